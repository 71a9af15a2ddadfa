//! [`PostgresStoreBuilder`]: settings with documented defaults, validated at `connect`.

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use idem_core::endpoint::redacted;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, Connection, PgConnection};

use crate::listen::Listener;
use crate::schema::{self, Queries, SchemaError};
use crate::store::{Backend, PostgresStore};

/// Default table prefix: tables `idem_records`, `idem_schema_version`, and so on.
pub const DEFAULT_TABLE_PREFIX: &str = "idem_";
/// Default timeout of every statement, on the client and on the server.
pub const DEFAULT_STATEMENT_TIMEOUT: Duration = Duration::from_millis(500);
/// Default timeout of connecting (and of creating or checking the schema at start).
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// Default size of the connection pool.
pub const DEFAULT_MAX_CONNECTIONS: u32 = 10;
/// Default time a released record, or an in-flight record whose lease ended, is kept.
pub const DEFAULT_TOMBSTONE_TTL: Duration = Duration::from_secs(24 * 3600);
/// Default bound of in-flight records per tenant, across every instance (the Redis
/// store's default too).
pub const DEFAULT_MAX_IN_FLIGHT_PER_TENANT: usize = 1000;
/// Default interval of the expired-record sweep.
pub const DEFAULT_SWEEP_INTERVAL: Duration = Duration::from_secs(60);
/// Default number of expired records one sweep deletes at most.
pub const DEFAULT_SWEEP_BATCH: u32 = 1000;
/// Default first polling interval of `wait` when it polls.
pub const DEFAULT_POLL_MIN: Duration = Duration::from_millis(5);
/// Default longest polling interval of `wait` when it polls.
pub const DEFAULT_POLL_MAX: Duration = Duration::from_millis(100);
/// While notifications arrive, a waiter still reads the record this often: a safety net
/// for a listener connection that hangs without failing.
pub const NOTIFY_SAFETY_POLL: Duration = Duration::from_secs(1);

/// How [`wait`](idem_store::Store::wait) learns that an in-flight record changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WaitStrategy {
    /// `LISTEN`/`NOTIFY` on one dedicated connection per store (opened by the first
    /// wait); polling only while that connection is down, and a read every
    /// [`NOTIFY_SAFETY_POLL`] otherwise. The default.
    #[default]
    Notify,
    /// Poll the record only, with the
    /// [`wait_poll_interval`](PostgresStoreBuilder::wait_poll_interval) backoff. For
    /// poolers that do not pass `LISTEN` through (PgBouncer in transaction mode).
    Poll,
}

/// Why [`PostgresStoreBuilder::connect`] failed.
///
/// The message names the endpoint (the URL with its user, password and query replaced:
/// [`idem_core::endpoint::redacted`]); `Debug` prints the same sentence, so `?` in
/// `main` reads it.
#[derive(thiserror::Error)]
pub enum ConnectError {
    /// The URL is not a PostgreSQL URL.
    #[error("invalid postgres url: {0}")]
    InvalidUrl(String),
    /// A setting is out of range (the message names it and its rule).
    #[error("invalid postgres store setting: {0}")]
    InvalidSetting(String),
    /// PostgreSQL did not answer (refused, timed out, authentication, permissions).
    #[error("postgres unavailable at {0}")]
    Unavailable(String),
    /// The schema exists in a version this crate does not read.
    #[error("postgres schema: {0}")]
    Schema(String),
}

impl std::fmt::Debug for ConnectError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
}

/// Builds a [`PostgresStore`].
///
/// # Defaults
/// | setting | default |
/// |---------|---------|
/// | [`table_prefix`](Self::table_prefix) | `"idem_"` |
/// | [`statement_timeout`](Self::statement_timeout) | 500 ms |
/// | [`connect_timeout`](Self::connect_timeout) | 2 s |
/// | [`max_connections`](Self::max_connections) | 10 |
/// | [`tombstone_ttl`](Self::tombstone_ttl) | 24 h |
/// | [`sweep_interval`](Self::sweep_interval) | 60 s, at most 1000 records a sweep |
/// | [`wait_strategy`](Self::wait_strategy) | [`WaitStrategy::Notify`] |
/// | [`wait_poll_interval`](Self::wait_poll_interval) | 5 ms doubling to 100 ms |
/// | [`max_in_flight_per_tenant`](Self::max_in_flight_per_tenant) | 1000 (`None`: no bound) |
/// | [`manage_schema`](Self::manage_schema) | `true`: create a missing schema, migrate an older one |
///
/// ```no_run
/// # async fn f() -> Result<(), idem_postgres::ConnectError> {
/// use std::time::Duration;
/// let store = idem_postgres::PostgresStore::builder("postgres://app@db/shop")
///     .table_prefix("orders_idem_")
///     .statement_timeout(Duration::from_millis(300))
///     .connect()
///     .await?;
/// # let _ = store; Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct PostgresStoreBuilder {
    url: String,
    table_prefix: String,
    statement_timeout: Duration,
    connect_timeout: Duration,
    max_connections: u32,
    tombstone_ttl: Duration,
    sweep_interval: Option<Duration>,
    sweep_batch: u32,
    wait_strategy: WaitStrategy,
    poll_min: Duration,
    poll_max: Duration,
    max_in_flight_per_tenant: Option<usize>,
    manage_schema: bool,
}

impl PostgresStoreBuilder {
    /// A builder for `url` (`postgres://user:password@host:port/database?…`, any form
    /// libpq accepts as a URL, including `host=/run/postgresql` for a socket) with the
    /// defaults above.
    pub fn new(url: impl Into<String>) -> Self {
        PostgresStoreBuilder {
            url: url.into(),
            table_prefix: DEFAULT_TABLE_PREFIX.to_owned(),
            statement_timeout: DEFAULT_STATEMENT_TIMEOUT,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            tombstone_ttl: DEFAULT_TOMBSTONE_TTL,
            sweep_interval: Some(DEFAULT_SWEEP_INTERVAL),
            sweep_batch: DEFAULT_SWEEP_BATCH,
            wait_strategy: WaitStrategy::default(),
            poll_min: DEFAULT_POLL_MIN,
            poll_max: DEFAULT_POLL_MAX,
            max_in_flight_per_tenant: Some(DEFAULT_MAX_IN_FLIGHT_PER_TENANT),
            manage_schema: true,
        }
    }

    /// Whether [`connect`](Self::connect) may create a missing schema or migrate an older
    /// one (default `true`, what a server wants). With `false` it only checks: a missing
    /// schema, or one older than this crate's, fails the connect with
    /// [`ConnectError::Schema`] and nothing in the database changes. Tools that only read
    /// or repair records (such as `idem records`) use `false`, so a mistyped URL or
    /// prefix cannot create tables and an operator's read cannot run a migration.
    pub fn manage_schema(mut self, manage: bool) -> Self {
        self.manage_schema = manage;
        self
    }

    /// Prefix of every table, sequence, function and the notification channel (default
    /// `"idem_"`): lower-case ASCII letters, digits and `_`, not starting with a digit,
    /// at most 45 bytes. The names are unqualified: they live in the first schema of the
    /// connection's `search_path`.
    pub fn table_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.table_prefix = prefix.into();
        self
    }

    /// Timeout of every statement (default 500 ms): the client gives up after it (taking
    /// a pooled connection included), and the server cancels the statement after it
    /// (`statement_timeout` is set on every connection of the pool). Either way the
    /// operation fails with `StoreError::Unavailable`, which the layer turns into
    /// UNAVAILABLE (fail closed).
    pub fn statement_timeout(mut self, timeout: Duration) -> Self {
        self.statement_timeout = timeout;
        self
    }

    /// Timeout of connecting at start and of creating or checking the schema (default 2 s).
    /// Connections the pool opens later count against the statement timeout of the
    /// operation that needs them.
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// Most connections in the pool (default 10). The listener takes one more.
    pub fn max_connections(mut self, n: u32) -> Self {
        self.max_connections = n;
        self
    }

    /// How long an in-flight record whose lease ended is kept (default 24 h), and a record
    /// whose handler committed its writes but whose reply was not recorded. A released
    /// record is deleted at once. Fences do not depend on it: they come from one sequence.
    pub fn tombstone_ttl(mut self, ttl: Duration) -> Self {
        self.tombstone_ttl = ttl;
        self
    }

    /// How often expired records are deleted (default 60 s), and how many at most per
    /// sweep (default 1000; a full batch sweeps again after 50 ms). Expired records
    /// count as absent before they are swept.
    pub fn sweep_interval(mut self, interval: Duration, batch: u32) -> Self {
        self.sweep_interval = Some(interval);
        self.sweep_batch = batch;
        self
    }

    /// No background sweep: call [`PostgresStore::sweep_expired`] yourself (a cron job,
    /// one instance only, …).
    pub fn no_sweep(mut self) -> Self {
        self.sweep_interval = None;
        self
    }

    /// How waiters learn of completions (default [`WaitStrategy::Notify`]).
    pub fn wait_strategy(mut self, strategy: WaitStrategy) -> Self {
        self.wait_strategy = strategy;
        self
    }

    /// Polling of [`wait`](idem_store::Store::wait) when it polls: the first interval,
    /// doubled after each read up to `max` (defaults 5 ms and 100 ms).
    pub fn wait_poll_interval(mut self, min: Duration, max: Duration) -> Self {
        self.poll_min = min;
        self.poll_max = max;
        self
    }

    /// Most in-flight records one tenant may hold across every instance that shares the
    /// database (default 1000, as the Redis store's `maxInFlightPerTenant`; `None`: no
    /// bound, and no lock or count in the claim). A claim that would start a run past it
    /// is refused with `StoreError::Full` (RESOURCE_EXHAUSTED with a retry delay, never a
    /// second run); replays, in-flight duplicates and re-claims are answered at any
    /// count. A record counts while its lease is live. See the crate docs, "Per-tenant
    /// in-flight bound".
    pub fn max_in_flight_per_tenant(mut self, bound: Option<usize>) -> Self {
        self.max_in_flight_per_tenant = bound;
        self
    }

    fn validate(&self) -> Result<(), ConnectError> {
        let bad = |m: String| Err(ConnectError::InvalidSetting(m));
        if !schema::valid_prefix(&self.table_prefix) {
            return bad(format!(
                "tablePrefix: must be 1 to {} lower-case ASCII letters, digits or '_', \
                 not starting with a digit",
                schema::MAX_PREFIX_LEN
            ));
        }
        if self.statement_timeout < Duration::from_millis(1) {
            return bad("statementTimeout: must be at least 1ms".into());
        }
        if self.connect_timeout.is_zero() {
            return bad("connectTimeout: must be > 0".into());
        }
        if self.max_connections == 0 {
            return bad("maxConnections: must be > 0".into());
        }
        if self.tombstone_ttl < Duration::from_secs(1) {
            return bad("tombstoneTtl: must be at least 1s".into());
        }
        if self.sweep_interval.is_some_and(|i| i.is_zero()) || self.sweep_batch == 0 {
            return bad("sweep: interval and batch must be > 0".into());
        }
        if self.poll_min.is_zero() || self.poll_max < self.poll_min {
            return bad("wait poll interval: must have 0 < min <= max".into());
        }
        if self.max_in_flight_per_tenant == Some(0) {
            return bad("maxInFlightPerTenant: must be > 0 (None: no bound)".into());
        }
        Ok(())
    }

    /// Validates the settings, connects, creates the schema when it is missing (or checks
    /// its version), and starts the sweeper.
    ///
    /// # Errors
    /// [`ConnectError::InvalidUrl`] / [`ConnectError::InvalidSetting`] before any I/O,
    /// [`ConnectError::Unavailable`] when PostgreSQL does not answer within the connect
    /// timeout or refuses (authentication, missing privileges to create the schema),
    /// [`ConnectError::Schema`] when the schema has a version this crate cannot use.
    pub async fn connect(self) -> Result<PostgresStore, ConnectError> {
        self.validate()?;
        if !(self.url.starts_with("postgres://") || self.url.starts_with("postgresql://")) {
            return Err(ConnectError::InvalidUrl(format!(
                "{}: must start with postgres:// or postgresql://",
                redacted(&self.url)
            )));
        }
        let mut options = PgConnectOptions::from_str(&self.url)
            .map_err(|e| ConnectError::InvalidUrl(format!("{}: {e}", redacted(&self.url))))?
            .options([(
                "statement_timeout",
                self.statement_timeout.as_millis().to_string(),
            )])
            // Statement logging is the application's business, not the store's.
            .disable_statement_logging();
        if options.get_application_name().is_none() {
            options = options.application_name("idem-postgres");
        }
        let pool = PgPoolOptions::new()
            .max_connections(self.max_connections)
            .min_connections(0)
            .acquire_timeout(self.statement_timeout)
            // Every operation is one statement; a dead connection fails it (Unavailable)
            // and is closed when it goes back. Testing before each use would cost a
            // round trip per operation.
            .test_before_acquire(false)
            .connect_lazy_with(options.clone());
        let endpoint = redacted(&self.url);
        let unavailable = |e: String| ConnectError::Unavailable(format!("{endpoint}: {e}"));
        // The schema step runs on a connection of its own, bounded by the connect
        // timeout rather than the (shorter) statement timeout of the pool.
        let setup = async {
            let mut conn = PgConnection::connect_with(&options)
                .await
                .map_err(|e| unavailable(e.to_string()))?;
            let r = schema::ensure(
                &mut conn,
                &self.table_prefix,
                self.connect_timeout,
                self.manage_schema,
            )
            .await
            .map_err(|e| match e {
                SchemaError::Database(e) => unavailable(e.to_string()),
                SchemaError::Version(m) => ConnectError::Schema(m),
            });
            let _ = conn.close().await;
            r
        };
        match tokio::time::timeout(self.connect_timeout, setup).await {
            Ok(r) => r?,
            Err(_) => {
                return Err(unavailable(format!(
                    "no answer within {:?}",
                    self.connect_timeout
                )));
            }
        }
        let queries = Queries::new(&self.table_prefix);
        let listener = (self.wait_strategy == WaitStrategy::Notify).then(|| {
            Arc::new(Listener::new(
                options,
                queries.channel.clone(),
                self.connect_timeout,
            ))
        });
        let backend = Backend {
            pool,
            sql: queries,
            statement_timeout: self.statement_timeout,
            tombstone_ttl: self.tombstone_ttl,
            poll_min: self.poll_min,
            poll_max: self.poll_max,
            sweep_batch: self.sweep_batch,
            listener,
            max_in_flight_per_tenant: self.max_in_flight_per_tenant,
        };
        Ok(PostgresStore::start(backend, self.sweep_interval))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn bad_settings_are_refused_before_any_io() {
        let b = || PostgresStoreBuilder::new("postgres://127.0.0.1:1/x");
        for builder in [
            b().table_prefix(""),
            b().table_prefix("Idem_"),
            b().table_prefix("idem-"),
            b().table_prefix("9x"),
            b().statement_timeout(Duration::ZERO),
            b().connect_timeout(Duration::ZERO),
            b().max_connections(0),
            b().tombstone_ttl(Duration::from_millis(10)),
            b().sweep_interval(Duration::ZERO, 10),
            b().sweep_interval(Duration::from_secs(1), 0),
            b().wait_poll_interval(Duration::from_millis(5), Duration::from_millis(1)),
            b().max_in_flight_per_tenant(Some(0)),
        ] {
            let err = builder.connect().await.err();
            assert!(
                matches!(err, Some(ConnectError::InvalidSetting(_))),
                "{err:?}"
            );
        }
        let err = PostgresStoreBuilder::new("http://nope")
            .connect()
            .await
            .err();
        assert!(matches!(err, Some(ConnectError::InvalidUrl(_))), "{err:?}");
    }

    /// A connect error is a sentence that names the endpoint without its password (in
    /// the user info or the query), in `Debug` (what `?` in `main` prints) as in
    /// `Display`.
    #[tokio::test]
    async fn connect_errors_name_the_endpoint_never_the_password() {
        for (url, names) in [
            (
                "postgres://idem:s3cret@127.0.0.1:1/x",
                "postgres://***@127.0.0.1:1/x",
            ),
            (
                "postgres://127.0.0.1:1/x?user=idem&password=s3cret",
                "postgres://127.0.0.1:1/x?…",
            ),
            (
                "postgres://idem:s3cret@127.0.0.1:notaport/x",
                "postgres://***@127.0.0.1:notaport/x",
            ),
            (
                "mysql://idem:s3cret@127.0.0.1:1/x",
                "mysql://***@127.0.0.1:1/x",
            ),
        ] {
            let err = PostgresStoreBuilder::new(url)
                .connect_timeout(Duration::from_millis(300))
                .connect()
                .await
                .expect_err("nothing listens on port 1");
            let (debug, display) = (format!("{err:?}"), err.to_string());
            assert_eq!(debug, display);
            assert!(display.contains(names), "{url}: {display}");
            assert!(!display.contains("s3cret"), "{display}");
        }
    }

    #[tokio::test]
    async fn unreachable_postgres_is_unavailable_within_the_connect_timeout() {
        // Port 1 on loopback: nothing listens there.
        let started = std::time::Instant::now();
        let err = PostgresStoreBuilder::new("postgres://idem@127.0.0.1:1/x")
            .connect_timeout(Duration::from_millis(300))
            .connect()
            .await
            .err();
        assert!(matches!(err, Some(ConnectError::Unavailable(_))), "{err:?}");
        assert!(started.elapsed() < Duration::from_secs(5));
    }
}
