//! [`RedisStoreBuilder`]: settings with documented defaults, validated at `connect`.

use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};

use crate::notify::Notifier;
use crate::scripts::Scripts;
use crate::store::{Inner, RedisStore, map_error};

/// Default key prefix.
pub const DEFAULT_KEY_PREFIX: &str = "idem:";
/// Default timeout of every command (matches `idem.redis.commandTimeout`).
pub const DEFAULT_COMMAND_TIMEOUT: Duration = Duration::from_millis(500);
/// Default timeout of a (re)connection (matches `idem.redis.connectTimeout`).
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// Default per-tenant quota of in-flight records, across every instance (matches
/// `idem.redis.maxInFlightPerTenant`).
pub const DEFAULT_MAX_IN_FLIGHT_PER_TENANT: usize = 1000;
/// Default first polling interval of [`wait`](idem_store::Store::wait).
pub const DEFAULT_POLL_MIN: Duration = Duration::from_millis(2);
/// Default longest polling interval of [`wait`](idem_store::Store::wait).
pub const DEFAULT_POLL_MAX: Duration = Duration::from_millis(50);

/// How [`wait`](idem_store::Store::wait) learns that an in-flight record changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WaitStrategy {
    /// Subscribe to the record's `:done` channel (one subscriber connection per store,
    /// opened on the first wait), woken by the complete/release scripts' `PUBLISH`;
    /// polling continues as a fallback, every [`NOTIFY_POLL_MIN`] doubling to
    /// [`NOTIFY_POLL_MAX`]. The
    /// default: see the crate docs, "Waiting", for the measurement.
    #[default]
    Notify,
    /// Poll the record only, with the [`wait_poll_interval`](RedisStoreBuilder::wait_poll_interval)
    /// backoff. No extra connection, no `SUBSCRIBE`.
    Poll,
}

/// First polling interval while a waiter is subscribed ([`WaitStrategy::Notify`]):
/// the notification is the main path, polling only covers a lost connection.
pub const NOTIFY_POLL_MIN: Duration = Duration::from_millis(50);
/// Longest polling interval while a waiter is subscribed ([`WaitStrategy::Notify`]).
pub const NOTIFY_POLL_MAX: Duration = Duration::from_millis(250);

/// Why [`RedisStoreBuilder::connect`] failed.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// The URL is not a Redis URL.
    #[error("invalid redis url: {0}")]
    InvalidUrl(String),
    /// A setting is out of range (the message names it and its rule).
    #[error("invalid redis store setting: {0}")]
    InvalidSetting(String),
    /// Redis did not answer (connection refused, timeout, authentication, script load).
    #[error("redis unavailable: {0}")]
    Unavailable(String),
}

/// Builds a [`RedisStore`].
///
/// # Defaults
/// | setting | default | config field (`idem.redis`) |
/// |---------|---------|-----------------------------|
/// | [`key_prefix`](Self::key_prefix) | `"idem:"` | `keyPrefix` |
/// | [`command_timeout`](Self::command_timeout) | 500 ms | `commandTimeout` |
/// | [`connect_timeout`](Self::connect_timeout) | 2 s | `connectTimeout` |
/// | [`max_in_flight_per_tenant`](Self::max_in_flight_per_tenant) | 1000 | `maxInFlightPerTenant` (`0`: none) |
/// | [`wait_strategy`](Self::wait_strategy) | [`WaitStrategy::Notify`] | — |
/// | [`wait_poll_interval`](Self::wait_poll_interval) | 2 ms doubling to 50 ms | — |
///
/// ```no_run
/// # async fn f() -> Result<(), idem_redis::ConnectError> {
/// use std::time::Duration;
/// let store = idem_redis::RedisStore::builder("redis://127.0.0.1:6379/0")
///     .key_prefix("shop:idem:")
///     .command_timeout(Duration::from_millis(300))
///     .connect()
///     .await?;
/// # let _ = store; Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct RedisStoreBuilder {
    url: String,
    key_prefix: String,
    command_timeout: Duration,
    connect_timeout: Duration,
    max_in_flight_per_tenant: Option<usize>,
    poll_min: Duration,
    poll_max: Duration,
    wait_strategy: WaitStrategy,
    check_server: bool,
}

impl RedisStoreBuilder {
    /// A builder for `url` with the defaults above.
    pub fn new(url: impl Into<String>) -> Self {
        RedisStoreBuilder {
            url: url.into(),
            key_prefix: DEFAULT_KEY_PREFIX.to_owned(),
            command_timeout: DEFAULT_COMMAND_TIMEOUT,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            max_in_flight_per_tenant: Some(DEFAULT_MAX_IN_FLIGHT_PER_TENANT),
            poll_min: DEFAULT_POLL_MIN,
            poll_max: DEFAULT_POLL_MAX,
            wait_strategy: WaitStrategy::default(),
            check_server: true,
        }
    }

    /// A builder from the `idem.redis` config object (URL, prefix, timeouts, quota);
    /// the other settings keep their defaults.
    pub fn from_settings(settings: &idem_core::config::RedisSettings) -> Self {
        RedisStoreBuilder::new(settings.url.clone())
            .key_prefix(settings.key_prefix.clone())
            .command_timeout(settings.command_timeout)
            .connect_timeout(settings.connect_timeout)
            .max_in_flight_per_tenant(settings.max_in_flight_per_tenant)
    }

    /// Prefix of every key (default `"idem:"`). Must not contain `{` or `}`: the braces
    /// after it are the Redis Cluster hash tag.
    pub fn key_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.key_prefix = prefix.into();
        self
    }

    /// Timeout of every command, script load included (default 500 ms). Past it the
    /// operation fails with `StoreError::Unavailable`, which the layer turns into
    /// UNAVAILABLE (fail closed).
    pub fn command_timeout(mut self, timeout: Duration) -> Self {
        self.command_timeout = timeout;
        self
    }

    /// Timeout of the first connection and of each reconnection attempt (default 2 s).
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// Most in-flight records one tenant may hold across every instance sharing the
    /// Redis (default 1000; `None`: no quota, and no second step per claim). A claim
    /// past it is refused with `StoreError::Full` (RESOURCE_EXHAUSTED with a retry
    /// delay). See the crate docs, "Per-tenant quota", for how it is counted.
    pub fn max_in_flight_per_tenant(mut self, quota: Option<usize>) -> Self {
        self.max_in_flight_per_tenant = quota;
        self
    }

    /// Polling of [`wait`](idem_store::Store::wait): the first interval, doubled
    /// after each read up to `max` (defaults 2 ms and 50 ms).
    pub fn wait_poll_interval(mut self, min: Duration, max: Duration) -> Self {
        self.poll_min = min;
        self.poll_max = max;
        self
    }

    /// How waiters learn of completions (default [`WaitStrategy::Notify`]).
    pub fn wait_strategy(mut self, strategy: WaitStrategy) -> Self {
        self.wait_strategy = strategy;
        self
    }

    /// Skips [`RedisStore::check_server`] at connect (it is on by default).
    pub fn skip_server_check(mut self) -> Self {
        self.check_server = false;
        self
    }

    fn validate(&self) -> Result<(), ConnectError> {
        let bad = |m: &str| Err(ConnectError::InvalidSetting(m.to_owned()));
        if self.key_prefix.contains(['{', '}']) {
            return bad("keyPrefix: must not contain '{' or '}'");
        }
        if self.key_prefix.chars().any(char::is_control) {
            return bad("keyPrefix: must not contain control characters");
        }
        if self.command_timeout.is_zero() {
            return bad("commandTimeout: must be > 0");
        }
        if self.connect_timeout.is_zero() {
            return bad("connectTimeout: must be > 0");
        }
        if self.max_in_flight_per_tenant == Some(0) {
            return bad("maxInFlightPerTenant: must be > 0 (no quota: None)");
        }
        if self.poll_min.is_zero() || self.poll_max < self.poll_min {
            return bad("wait poll interval: must have 0 < min <= max");
        }
        Ok(())
    }

    /// Connects, loads the scripts and (unless skipped) runs
    /// [`RedisStore::check_server`], which logs warnings about risky Redis settings.
    ///
    /// # Errors
    /// [`ConnectError::InvalidUrl`] / [`ConnectError::InvalidSetting`] for bad settings,
    /// [`ConnectError::Unavailable`] when Redis does not answer within the connect
    /// timeout. Once connected, the store reconnects on its own.
    pub async fn connect(self) -> Result<RedisStore, ConnectError> {
        self.validate()?;
        let client = redis::Client::open(self.url.as_str())
            .map_err(|e| ConnectError::InvalidUrl(e.to_string()))?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(self.connect_timeout))
            .set_response_timeout(Some(self.command_timeout))
            .set_number_of_retries(3)
            .set_min_delay(Duration::from_millis(50))
            .set_max_delay(Duration::from_secs(1));
        let notifier = (self.wait_strategy == WaitStrategy::Notify).then(|| {
            std::sync::Arc::new(Notifier::new(
                client.clone(),
                self.connect_timeout,
                self.command_timeout,
            ))
        });
        let conn = match tokio::time::timeout(
            self.connect_timeout,
            ConnectionManager::new_with_config(client, config),
        )
        .await
        {
            Ok(Ok(c)) => c,
            Ok(Err(e)) => return Err(ConnectError::Unavailable(map_error(e).to_string())),
            Err(_) => {
                return Err(ConnectError::Unavailable(format!(
                    "no connection within {:?}",
                    self.connect_timeout
                )));
            }
        };
        let store = RedisStore::from_inner(Inner {
            conn,
            prefix: self.key_prefix,
            command_timeout: self.command_timeout,
            max_in_flight_per_tenant: self.max_in_flight_per_tenant,
            held: crate::quota::Held::new(),
            poll_min: self.poll_min,
            poll_max: self.poll_max,
            notifier,
            scripts: Scripts::new(),
        });
        store
            .load_scripts()
            .await
            .map_err(|e| ConnectError::Unavailable(e.to_string()))?;
        if self.check_server {
            store
                .check_server()
                .await
                .map_err(|e| ConnectError::Unavailable(e.to_string()))?;
        }
        Ok(store)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn bad_settings_are_refused_before_any_io() {
        let b = || RedisStoreBuilder::new("redis://127.0.0.1:1/0");
        for builder in [
            b().key_prefix("a{b"),
            b().key_prefix("a}b"),
            b().key_prefix("a\nb"),
            b().command_timeout(Duration::ZERO),
            b().connect_timeout(Duration::ZERO),
            b().max_in_flight_per_tenant(Some(0)),
            b().wait_poll_interval(Duration::from_millis(5), Duration::from_millis(1)),
        ] {
            let err = builder.connect().await.err();
            assert!(
                matches!(err, Some(ConnectError::InvalidSetting(_))),
                "{err:?}"
            );
        }
        let err = RedisStoreBuilder::new("http://nope").connect().await.err();
        assert!(matches!(err, Some(ConnectError::InvalidUrl(_))), "{err:?}");
    }

    #[tokio::test]
    async fn unreachable_redis_is_unavailable_within_the_connect_timeout() {
        // Port 1 on loopback: nothing listens there.
        let started = std::time::Instant::now();
        let err = RedisStoreBuilder::new("redis://127.0.0.1:1/0")
            .connect_timeout(Duration::from_millis(300))
            .connect()
            .await
            .err();
        assert!(matches!(err, Some(ConnectError::Unavailable(_))), "{err:?}");
        assert!(started.elapsed() < Duration::from_secs(5));
    }

    #[test]
    fn from_settings_takes_url_prefix_and_timeouts() {
        let s = idem_core::config::RedisSettings {
            url: "redis://example:6380/2".into(),
            key_prefix: "p:".into(),
            command_timeout: Duration::from_millis(123),
            connect_timeout: Duration::from_millis(456),
            max_in_flight_per_tenant: Some(7),
        };
        let b = RedisStoreBuilder::from_settings(&s);
        assert_eq!(b.url, "redis://example:6380/2");
        assert_eq!(b.key_prefix, "p:");
        assert_eq!(b.command_timeout, Duration::from_millis(123));
        assert_eq!(b.connect_timeout, Duration::from_millis(456));
        assert_eq!(b.max_in_flight_per_tenant, Some(7));
    }
}
