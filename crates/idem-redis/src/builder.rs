//! [`RedisStoreBuilder`]: settings with documented defaults, validated at `connect`.

use std::time::Duration;

use idem_core::endpoint::{redacted, redacted_list};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClientBuilder;

use crate::conn::Shared;
use crate::notify::{Notifier, Target};
use crate::replica::ReplicaAcks;
use crate::reply::map_error;
use crate::scripts::Scripts;
use crate::store::{Backend, RedisStore};

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

/// TCP settings of the cluster's node connections: keepalive probes and
/// `TCP_USER_TIMEOUT` (Linux), so a node cut off by the network loses its connection
/// (which redis-rs then repairs) within seconds, not after `tcp_retries2` (about 15 min).
/// A second line of defence behind the rebuild on timeouts: a peer that ACKs but does
/// not answer (a hung process, a proxy) keeps its connection alive. `TCP_NODELAY` stays
/// as redis-rs sets it by default.
fn cluster_tcp_settings(command_timeout: Duration) -> redis::io::tcp::TcpSettings {
    use redis::io::tcp::socket2::TcpKeepalive;
    let idle = (command_timeout * 2).max(Duration::from_secs(2));
    let keepalive = TcpKeepalive::new().with_time(idle);
    #[cfg(any(target_os = "android", target_os = "fuchsia", target_os = "linux"))]
    let keepalive = keepalive
        .with_interval(Duration::from_secs(1))
        .with_retries(3);
    let settings = redis::io::tcp::TcpSettings::default().set_keepalive(keepalive);
    #[cfg(any(target_os = "android", target_os = "fuchsia", target_os = "linux"))]
    let settings = settings.set_user_timeout(idle);
    settings
}

/// Where the store connects.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Endpoint {
    /// One Redis endpoint.
    Url(String),
    /// Redis Cluster seed nodes.
    Cluster(Vec<String>),
}

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
///
/// The message names the endpoint (the URL or the cluster's seed nodes, with any user
/// and password replaced by `***`: [`idem_core::endpoint::redacted`]); `Debug` prints
/// the same sentence, so `?` in `main` reads it.
#[derive(thiserror::Error)]
pub enum ConnectError {
    /// The URL is not a Redis URL.
    #[error("invalid redis url: {0}")]
    InvalidUrl(String),
    /// A setting is out of range (the message names it and its rule).
    #[error("invalid redis store setting: {0}")]
    InvalidSetting(String),
    /// Redis did not answer (connection refused, timeout, authentication, script load).
    #[error("redis unavailable at {0}")]
    Unavailable(String),
}

impl std::fmt::Debug for ConnectError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
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
/// | [`max_bytes_per_tenant`](Self::max_bytes_per_tenant) | none | `maxBytesPerTenant` (`0`: none) |
/// | [`replica_acks`](Self::replica_acks) | off | `replicaAcks`, `replicaAckTimeout` |
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
    endpoint: Endpoint,
    key_prefix: String,
    command_timeout: Duration,
    connect_timeout: Duration,
    max_in_flight_per_tenant: Option<usize>,
    max_bytes_per_tenant: Option<usize>,
    poll_min: Duration,
    poll_max: Duration,
    wait_strategy: WaitStrategy,
    check_server: bool,
    replica_acks: Option<ReplicaAcks>,
}

impl RedisStoreBuilder {
    /// A builder for `url` with the defaults above.
    pub fn new(url: impl Into<String>) -> Self {
        Self::with_endpoint(Endpoint::Url(url.into()))
    }

    /// A builder for a Redis Cluster (Redis 7.0 or newer) reached through `nodes`, seed
    /// node URLs such as `redis://10.0.0.1:7000` (one reachable node is enough: the
    /// client learns the others and the slot map from it), with the defaults above.
    ///
    /// Every command goes to the master of its key's slot (all keys of a record share
    /// one slot; the tenant's in-flight count is a step of its own on its own key);
    /// `MOVED` and `ASK` (resharding) and failovers are followed by the client, under
    /// the command timeout. Waiters subscribe with `SSUBSCRIBE` on the record's sharded
    /// channel. See the crate docs, "Redis Cluster".
    pub fn cluster<I, S>(nodes: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        Self::with_endpoint(Endpoint::Cluster(
            nodes.into_iter().map(Into::into).collect(),
        ))
    }

    fn with_endpoint(endpoint: Endpoint) -> Self {
        RedisStoreBuilder {
            endpoint,
            key_prefix: DEFAULT_KEY_PREFIX.to_owned(),
            command_timeout: DEFAULT_COMMAND_TIMEOUT,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            max_in_flight_per_tenant: Some(DEFAULT_MAX_IN_FLIGHT_PER_TENANT),
            max_bytes_per_tenant: None,
            poll_min: DEFAULT_POLL_MIN,
            poll_max: DEFAULT_POLL_MAX,
            wait_strategy: WaitStrategy::default(),
            check_server: true,
            replica_acks: None,
        }
    }

    /// A builder from the `idem.redis` config object (URL, prefix, timeouts, quota);
    /// the other settings keep their defaults.
    /// With `clusterNodes`, a cluster builder ([`cluster`](Self::cluster)).
    pub fn from_settings(settings: &idem_core::config::RedisSettings) -> Self {
        let builder = if settings.cluster_nodes.is_empty() {
            RedisStoreBuilder::new(settings.url.clone())
        } else {
            RedisStoreBuilder::cluster(settings.cluster_nodes.iter().cloned())
        };
        let builder = builder
            .key_prefix(settings.key_prefix.clone())
            .command_timeout(settings.command_timeout)
            .connect_timeout(settings.connect_timeout)
            .max_in_flight_per_tenant(settings.max_in_flight_per_tenant)
            .max_bytes_per_tenant(settings.max_bytes_per_tenant);
        match settings.replica_acks {
            0 => builder,
            n => builder.replica_acks(n, settings.replica_ack_timeout),
        }
    }

    /// Confirms every claim and completion on `replicas` replicas with Redis `WAIT`,
    /// waiting at most `timeout` (off by default). Without it, a failover can lose the
    /// last writes acknowledged by the master (replication is asynchronous): a claim or
    /// a completion lost that way lets a retry run the handler again. With it, the store
    /// answers only once that many replicas have the write; a claim not confirmed in
    /// time is released and refused (`StoreError::Unavailable`, UNAVAILABLE: nothing
    /// ran), a completion not confirmed is retried by the layer like any store failure
    /// (for `completionRetryTimeout`, the lease renewed meanwhile).
    ///
    /// Lease renewals are not confirmed: a renewal lost in a failover leaves the lease
    /// of the renewal before it (at least two thirds of a lease), and the next renewal
    /// lands on the new master; confirming them would let leases run out whenever a
    /// shard has fewer live replicas than asked for, which is exactly after a failover.
    ///
    /// Costs: a replay nothing; a fresh call one round trip more (the claim's
    /// confirmation) and two replication delays. Writes to a shard with fewer than
    /// `replicas` live replicas fail closed (UNAVAILABLE) until one is back: run
    /// `replicas + 1` replicas per master to ride out the loss of one. It narrows the
    /// window, it is not consensus: Redis may still promote a replica that missed a
    /// write, e.g. when the confirming replica fails with its master. `timeout` must be
    /// shorter than the command timeout.
    pub fn replica_acks(mut self, replicas: usize, timeout: Duration) -> Self {
        self.replica_acks = Some(ReplicaAcks { replicas, timeout });
        self
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

    /// Most bytes of stored records one tenant may hold across every instance sharing
    /// the Redis: its responses plus [`RECORD_OVERHEAD_BYTES`](crate::RECORD_OVERHEAD_BYTES)
    /// per record, as the memory store's `maxBytesPerTenant` (default `None`: no quota).
    /// A new record that does not fit is refused with `StoreError::Full`
    /// (RESOURCE_EXHAUSTED with a retry delay); a response that does not fit is recorded
    /// as not retained (a duplicate gets a clear error, never a second run). Charges end
    /// with their record (release, TTL). On a single endpoint it costs no round trip
    /// (checked in the claim and completion scripts); on a Redis Cluster the completion's
    /// tenant step runs before the record's, one round trip more. See the crate docs,
    /// "Per-tenant quota".
    ///
    /// No default, unlike the memory store (a quarter of its `maxBytes`): Redis's own
    /// bound is `maxmemory`, which idem does not know, and a guessed quota would refuse a
    /// busy tenant's calls on a Redis with room to spare.
    pub fn max_bytes_per_tenant(mut self, quota: Option<usize>) -> Self {
        self.max_bytes_per_tenant = quota;
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
        if self.max_bytes_per_tenant == Some(0) {
            return bad("maxBytesPerTenant: must be > 0 (no quota: None)");
        }
        if self.poll_min.is_zero() || self.poll_max < self.poll_min {
            return bad("wait poll interval: must have 0 < min <= max");
        }
        if let Some(a) = self.replica_acks {
            if a.replicas == 0 {
                return bad("replicaAcks: must be > 0 (no confirmation: leave it off)");
            }
            if a.timeout.is_zero() || a.timeout >= self.command_timeout {
                return bad("replicaAckTimeout: must be > 0 and < commandTimeout");
            }
        }
        if let Endpoint::Cluster(nodes) = &self.endpoint
            && nodes.is_empty()
        {
            return bad("clusterNodes: must name at least one node");
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
        let endpoint = self.endpoint_name();
        let at = |e: String| ConnectError::Unavailable(format!("{endpoint}: {e}"));
        let (conn, notify_target) = match &self.endpoint {
            Endpoint::Url(url) => self.connect_single(url).await?,
            Endpoint::Cluster(nodes) => self.connect_cluster(nodes).await?,
        };
        let notifier = (self.wait_strategy == WaitStrategy::Notify).then(|| {
            std::sync::Arc::new(Notifier::new(
                notify_target,
                self.connect_timeout,
                self.command_timeout,
            ))
        });
        let sharded = conn.is_cluster();
        let store = RedisStore::from_backend(Backend {
            conn,
            prefix: self.key_prefix,
            command_timeout: self.command_timeout,
            max_in_flight_per_tenant: self.max_in_flight_per_tenant,
            max_bytes_per_tenant: self.max_bytes_per_tenant,
            quota_args: [
                quota_arg(self.max_in_flight_per_tenant),
                quota_arg(self.max_bytes_per_tenant),
                crate::RECORD_OVERHEAD_BYTES.to_string(),
            ],
            held: crate::quota::Held::new(),
            last_tenant: arc_swap::ArcSwapOption::empty(),
            poll_min: self.poll_min,
            poll_max: self.poll_max,
            notifier,
            scripts: Scripts::new(sharded),
            replica_acks: self.replica_acks,
        });
        if !sharded && store.is_cluster_node().await {
            return Err(ConnectError::InvalidSetting(
                "url: the server is a Redis Cluster node; a single-endpoint store would \
                 reach only its slots (every other record: MOVED, UNAVAILABLE): give the \
                 cluster's nodes instead (clusterNodes, RedisStoreBuilder::cluster)"
                    .into(),
            ));
        }
        store.load_scripts().await.map_err(|e| at(e.to_string()))?;
        if self.check_server {
            store.check_server().await.map_err(|e| at(e.to_string()))?;
        }
        Ok(store)
    }

    async fn connect_single(&self, url: &str) -> Result<(Shared, Target), ConnectError> {
        let client = redis::Client::open(url)
            .map_err(|e| ConnectError::InvalidUrl(format!("{}: {e}", redacted(url))))?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(self.connect_timeout))
            .set_response_timeout(Some(self.command_timeout))
            .set_number_of_retries(3)
            .set_min_delay(Duration::from_millis(50))
            .set_max_delay(Duration::from_secs(1));
        let conn = tokio::time::timeout(
            self.connect_timeout,
            ConnectionManager::new_with_config(client.clone(), config),
        )
        .await;
        Ok((
            Shared::Single(self.connected(conn)?),
            Target::Single(client),
        ))
    }

    async fn connect_cluster(&self, nodes: &[String]) -> Result<(Shared, Target), ConnectError> {
        for n in nodes {
            redis::Client::open(n.as_str())
                .map_err(|e| ConnectError::InvalidUrl(format!("{}: {e}", redacted(n))))?;
        }
        // Few retries inside the client (a redirect or two, a reconnection): the layer
        // retries what fails, and a request the client retries after the caller's
        // timeout would land late.
        let client = ClusterClientBuilder::new(nodes.to_vec())
            .connection_timeout(self.connect_timeout)
            .response_timeout(self.command_timeout)
            .retries(3)
            .min_retry_wait(10)
            .max_retry_wait(200)
            .tcp_settings(cluster_tcp_settings(self.command_timeout))
            .build()
            .map_err(|e| ConnectError::InvalidUrl(format!("{}: {e}", redacted_list(nodes))))?;
        let conn = tokio::time::timeout(self.connect_timeout, client.get_async_connection()).await;
        let conn = self.connected(conn)?;
        // A rebuild connects to the seeds and then to every node of the new map, each
        // within the connect timeout: a seed that does not answer costs one of them.
        let attempt_limit = self.connect_timeout * 2 + self.command_timeout;
        Ok((
            Shared::cluster(client, conn, self.command_timeout, attempt_limit),
            Target::Cluster(nodes.to_vec()),
        ))
    }

    fn connected<C>(
        &self,
        attempt: Result<redis::RedisResult<C>, tokio::time::error::Elapsed>,
    ) -> Result<C, ConnectError> {
        let endpoint = self.endpoint_name();
        match attempt {
            Ok(Ok(c)) => Ok(c),
            Ok(Err(e)) => Err(ConnectError::Unavailable(format!(
                "{endpoint}: {}",
                map_error(e)
            ))),
            Err(_) => Err(ConnectError::Unavailable(format!(
                "{endpoint}: no connection within {:?}",
                self.connect_timeout
            ))),
        }
    }

    /// The endpoint for messages: the URL or the seed nodes, credentials taken out.
    fn endpoint_name(&self) -> String {
        match &self.endpoint {
            Endpoint::Url(url) => redacted(url),
            Endpoint::Cluster(nodes) => format!("cluster {}", redacted_list(nodes)),
        }
    }
}

/// A quota as a script argument: the number, or `""` (off).
fn quota_arg(q: Option<usize>) -> String {
    q.map(|q| q.to_string()).unwrap_or_default()
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
            b().max_bytes_per_tenant(Some(0)),
            b().wait_poll_interval(Duration::from_millis(5), Duration::from_millis(1)),
            b().replica_acks(0, Duration::from_millis(10)),
            b().replica_acks(1, Duration::ZERO),
            // WAIT must end before the command timeout (500 ms by default) cuts it off.
            b().replica_acks(1, Duration::from_millis(500)),
            RedisStoreBuilder::cluster(Vec::<String>::new()),
        ] {
            let err = builder.connect().await.err();
            assert!(
                matches!(err, Some(ConnectError::InvalidSetting(_))),
                "{err:?}"
            );
        }
        let err = RedisStoreBuilder::new("http://nope").connect().await.err();
        assert!(matches!(err, Some(ConnectError::InvalidUrl(_))), "{err:?}");
        let err = RedisStoreBuilder::cluster(["redis://127.0.0.1:1", "http://nope"])
            .connect()
            .await
            .err();
        assert!(matches!(err, Some(ConnectError::InvalidUrl(_))), "{err:?}");
    }

    /// Connecting with `builder` (to nothing) fails as unavailable, well within 5 s
    /// with a 300 ms connect timeout.
    async fn unavailable_within_the_connect_timeout(builder: RedisStoreBuilder) {
        let started = std::time::Instant::now();
        let err = builder
            .connect_timeout(Duration::from_millis(300))
            .connect()
            .await
            .err();
        assert!(matches!(err, Some(ConnectError::Unavailable(_))), "{err:?}");
        assert!(started.elapsed() < Duration::from_secs(5));
    }

    #[tokio::test]
    async fn unreachable_redis_is_unavailable_within_the_connect_timeout() {
        // Port 1 on loopback: nothing listens there.
        unavailable_within_the_connect_timeout(RedisStoreBuilder::new("redis://127.0.0.1:1/0"))
            .await;
    }

    #[tokio::test]
    async fn unreachable_cluster_seeds_are_unavailable_within_the_connect_timeout() {
        unavailable_within_the_connect_timeout(RedisStoreBuilder::cluster([
            "redis://127.0.0.1:1",
            "redis://127.0.0.1:2",
        ]))
        .await;
    }

    /// A connect error is a sentence that names the endpoint without its password, in
    /// `Debug` (what `?` in `main` prints) as in `Display`.
    #[tokio::test]
    async fn connect_errors_name_the_endpoint_never_the_password() {
        let single = RedisStoreBuilder::new("redis://app:s3cret@127.0.0.1:1/0");
        let cluster = RedisStoreBuilder::cluster([
            "redis://:s3cret@127.0.0.1:1",
            "redis://:s3cret@127.0.0.1:2",
        ]);
        let bad_url = RedisStoreBuilder::new("redis://app:s3cret@127.0.0.1:notaport/0");
        for (builder, names) in [
            (single, "redis://***@127.0.0.1:1/0"),
            (
                cluster,
                "cluster redis://***@127.0.0.1:1,redis://***@127.0.0.1:2",
            ),
            (bad_url, "redis://***@127.0.0.1:notaport/0"),
        ] {
            let err = builder
                .connect_timeout(Duration::from_millis(300))
                .connect()
                .await
                .expect_err("nothing listens on ports 1 and 2");
            let (debug, display) = (format!("{err:?}"), err.to_string());
            assert_eq!(debug, display);
            assert!(display.contains(names), "{display}");
            assert!(!display.contains("s3cret"), "{display}");
        }
    }

    #[test]
    fn from_settings_takes_url_prefix_and_timeouts() {
        let s = idem_core::config::RedisSettings {
            url: "redis://example:6380/2".into(),
            key_prefix: "p:".into(),
            command_timeout: Duration::from_millis(123),
            connect_timeout: Duration::from_millis(456),
            max_in_flight_per_tenant: Some(7),
            max_bytes_per_tenant: Some(9000),
            cluster_nodes: vec![],
            replica_acks: 0,
            replica_ack_timeout: Duration::from_millis(100),
        };
        let b = RedisStoreBuilder::from_settings(&s);
        assert_eq!(b.endpoint, Endpoint::Url("redis://example:6380/2".into()));
        assert_eq!(b.replica_acks, None);
        assert_eq!(b.key_prefix, "p:");
        assert_eq!(b.command_timeout, Duration::from_millis(123));
        assert_eq!(b.connect_timeout, Duration::from_millis(456));
        assert_eq!(b.max_in_flight_per_tenant, Some(7));
        assert_eq!(b.max_bytes_per_tenant, Some(9000));
        let cluster = idem_core::config::RedisSettings {
            url: String::new(),
            cluster_nodes: vec!["redis://a:7000".into(), "redis://b:7001".into()],
            replica_acks: 1,
            replica_ack_timeout: Duration::from_millis(50),
            ..s
        };
        let b = RedisStoreBuilder::from_settings(&cluster);
        assert_eq!(
            b.endpoint,
            Endpoint::Cluster(vec!["redis://a:7000".into(), "redis://b:7001".into()])
        );
        assert_eq!(
            b.replica_acks,
            Some(ReplicaAcks {
                replicas: 1,
                timeout: Duration::from_millis(50)
            })
        );
    }
}
