//! The stores' settings: plain data read from the `idem` object (`memoryStore`, `redis`),
//! which the store crates take (`idem_store::memory::MemoryStore::new`,
//! `idem_redis::RedisStore::from_settings`).

use std::time::Duration;

use serde_json::Value;

use super::read::{MIN_TIMER, Obj, Validator, Zero};

/// Bounds and timings of the in-memory store (`idem_store::memory::MemoryStore`;
/// `idem.memoryStore` in the service config).
///
/// # Defaults
/// `maxEntries` 2000000 ([`DEFAULT_MAX_ENTRIES`]), `maxBytes` 268435456 (256 MiB),
/// `maxInFlightPerTenant` `maxEntries / 16`, `maxEntriesPerTenant` `maxEntries / 4`,
/// `maxBytesPerTenant` `maxBytes / 4`, `sweepInterval` `"1s"`, `minRetention` `"120s"`
/// ([`DEFAULT_MIN_RETENTION`]). With a single tenant (`idem.tenant` `single`) the
/// per-tenant bounds default to the store-wide ones instead
/// ([`for_single_tenant`](Self::for_single_tenant)). A per-tenant bound above its
/// store-wide bound is cut to it. The `idem_store::memory` module docs say what happens
/// at each bound.
///
/// # Capacity
/// The bound that applies first is bytes: a record is charged its response plus the
/// store's per-record overhead (`idem_store::memory::RECORD_OVERHEAD_BYTES`, 240), so a
/// record of a 200-byte response costs 440 bytes and 256 MiB hold 610 080 of them
/// (1 118 481 records of empty responses), well under the 2 000 000 records of
/// `maxEntries`. Records younger than `minRetention` cannot be evicted, so the store
/// sustains `capacity / minRetention` new protected calls per second before it refuses
/// any: 5 084 calls/s of 200-byte responses for one tenant (the whole store), 1 271
/// calls/s for each of several tenants (a quarter each) and 5 084 for all together.
/// Below that rate a full store keeps working by evicting completed records older than
/// `minRetention`. `idem check-config` prints these rates for a config.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemoryStoreSettings {
    /// Most records kept, all tenants together.
    pub max_entries: usize,
    /// Most bytes of stored responses (plus per-record overhead) kept, all tenants
    /// together.
    pub max_bytes: usize,
    /// Most in-flight records of one tenant; `None`: `max_entries / 16` (at least 1).
    pub max_in_flight_per_tenant: Option<usize>,
    /// Most records of one tenant; `None`: `max_entries / 4` (at least 1).
    pub max_entries_per_tenant: Option<usize>,
    /// Most bytes of one tenant; `None`: `max_bytes / 4`.
    ///
    /// For a single tenant, [`for_single_tenant`](Self::for_single_tenant) sets the three
    /// per-tenant bounds left `None` to the store's.
    pub max_bytes_per_tenant: Option<usize>,
    /// How often expired records are swept.
    pub sweep_interval: Duration,
    /// How long a completed record is kept for certain. At a bound, a new record may
    /// take the place of a completed record older than this (oldest first: the
    /// tenant's own, or at a store-wide bound one of a tenant above its fair share); see
    /// "Eviction" in the `idem_store::memory` module docs. Zero: any completed record may be evicted at a
    /// bound. At or above every method's record TTL: nothing is ever evicted (records
    /// expire first).
    pub min_retention: Duration,
}

impl Default for MemoryStoreSettings {
    fn default() -> Self {
        MemoryStoreSettings {
            max_entries: DEFAULT_MAX_ENTRIES,
            max_bytes: DEFAULT_MAX_BYTES,
            max_in_flight_per_tenant: None,
            max_entries_per_tenant: None,
            max_bytes_per_tenant: None,
            sweep_interval: Duration::from_secs(1),
            min_retention: DEFAULT_MIN_RETENTION,
        }
    }
}

/// Default of [`MemoryStoreSettings::max_bytes`]: 256 MiB, the bound that applies first.
pub const DEFAULT_MAX_BYTES: usize = 256 * 1024 * 1024;

/// Default of [`MemoryStoreSettings::max_entries`]: 2 000 000 records.
///
/// Above the records [`DEFAULT_MAX_BYTES`] can hold even of empty responses (1 118 481 at
/// 240 bytes of overhead each), so with the defaults the store is bounded by memory,
/// never by a count: small records are limited by bytes. The count still bounds the
/// record table of a store configured with more bytes.
pub const DEFAULT_MAX_ENTRIES: usize = 2_000_000;

/// Default of [`MemoryStoreSettings::min_retention`]: 2 minutes.
///
/// A record must answer every retry of its key, and those come within the client's
/// retry window, which deadlines bound: gRPC's retries and hedges (at most 5 attempts)
/// and idem's `RetryLayer` all stop at the call's deadline, typically seconds and at
/// most a minute or so for a write; an application that retries the whole call after a
/// deadline with the same key does so within a deadline or two more. Two minutes cover a
/// one-minute deadline and a retry after it, or a 30-second deadline retried three
/// times with backoff. Within that window a record is never evicted, so a retry is
/// always a replay.
///
/// It is not longer because records younger than it cannot make room: a store whose
/// bound is full of them refuses every new call. At 2 minutes the default 256 MiB hold
/// 5 084 new calls per second of 200-byte responses (one tenant), against 1 016 at the
/// former 10 minutes; under sustained load the store evicts completed records older
/// than 2 minutes instead of refusing. Past the window a record is still kept until its
/// record TTL while there is room. A service whose clients retry later (a queue
/// redelivering after a long visibility timeout, a client restarted after minutes)
/// should raise it and size the store for it (`idem check-config` prints the rate).
pub const DEFAULT_MIN_RETENTION: Duration = Duration::from_secs(120);

impl MemoryStoreSettings {
    /// The in-flight records one tenant may hold, defaults applied.
    pub fn tenant_in_flight_bound(&self) -> usize {
        self.max_in_flight_per_tenant
            .unwrap_or((self.max_entries / 16).max(1))
            .min(self.tenant_entries_bound())
    }

    /// The records one tenant may hold, defaults applied.
    pub fn tenant_entries_bound(&self) -> usize {
        self.max_entries_per_tenant
            .unwrap_or((self.max_entries / 4).max(1))
            .min(self.max_entries)
    }

    /// The bytes one tenant may hold, defaults applied.
    pub fn tenant_bytes_bound(&self) -> usize {
        self.max_bytes_per_tenant
            .unwrap_or(self.max_bytes / 4)
            .min(self.max_bytes)
    }

    /// These settings for a store that serves one tenant: each per-tenant bound left
    /// unset becomes the store-wide bound (records and bytes: `maxEntries` and
    /// `maxBytes`; in-flight records: `maxEntries`), so the one tenant may use the whole
    /// store. A per-tenant bound given explicitly stays as given.
    ///
    /// The config applies it when `idem.tenant` is `single`; a server given a single
    /// tenant in code applies it to the settings it builds its store with.
    ///
    /// ```
    /// # use idem_core::config::MemoryStoreSettings;
    /// let s = MemoryStoreSettings::default().for_single_tenant();
    /// assert_eq!(s.tenant_entries_bound(), s.max_entries);
    /// assert_eq!(s.tenant_bytes_bound(), s.max_bytes);
    /// assert_eq!(s.tenant_in_flight_bound(), s.max_entries);
    /// ```
    #[must_use]
    pub fn for_single_tenant(mut self) -> Self {
        self.max_in_flight_per_tenant
            .get_or_insert(self.max_entries);
        self.max_entries_per_tenant.get_or_insert(self.max_entries);
        self.max_bytes_per_tenant.get_or_insert(self.max_bytes);
        self
    }
}

/// Redis store settings (`idem.redis`).
///
/// # Defaults
/// `keyPrefix` `"idem:"`, `commandTimeout` `"0.5s"`, `connectTimeout` `"2s"`,
/// `maxInFlightPerTenant` 1000 (`0`: no per-tenant bound), `maxBytesPerTenant` none
/// (`0`: none), `replicaAcks` 0 (off),
/// `replicaAckTimeout` `"0.1s"`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedisSettings {
    /// `redis://host:port/db`: one endpoint. Empty when `clusterNodes` is given (exactly
    /// one of the two is).
    pub url: String,
    /// `clusterNodes`: seed nodes of a Redis Cluster (`redis://host:port`); empty for a
    /// single endpoint.
    pub cluster_nodes: Vec<String>,
    /// `replicaAcks`: replicas that must confirm each claim and completion (Redis
    /// `WAIT`) before the store answers; 0: no confirmation.
    pub replica_acks: usize,
    /// `replicaAckTimeout`: how long `WAIT` waits for them (less than
    /// `commandTimeout`).
    pub replica_ack_timeout: Duration,
    /// Prefix of every key idem writes.
    pub key_prefix: String,
    /// Timeout of every command; past it the call gets UNAVAILABLE.
    pub command_timeout: Duration,
    /// Timeout of a (re)connection.
    pub connect_timeout: Duration,
    /// Most in-flight records one tenant may hold across every instance (`None`: no
    /// bound). A claim past it is refused with RESOURCE_EXHAUSTED and a retry delay.
    pub max_in_flight_per_tenant: Option<usize>,
    /// `maxBytesPerTenant`: most bytes of stored records (responses plus a per-record
    /// overhead, as the memory store's) one tenant may hold across every instance
    /// (`None`, the default: no bound). A new record past it is refused with
    /// RESOURCE_EXHAUSTED; a response past it is recorded as not retained.
    pub max_bytes_per_tenant: Option<usize>,
}

pub(super) const MEMORY_FIELDS: &[&str] = &[
    "maxEntries",
    "maxBytes",
    "maxInFlightPerTenant",
    "maxEntriesPerTenant",
    "maxBytesPerTenant",
    "sweepInterval",
    "minRetention",
    "tombstoneTtl",
];
pub(super) const REDIS_FIELDS: &[&str] = &[
    "url",
    "keyPrefix",
    "commandTimeout",
    "connectTimeout",
    "maxInFlightPerTenant",
    "maxBytesPerTenant",
    "clusterNodes",
    "replicaAcks",
    "replicaAckTimeout",
];
/// Default of `idem.redis.maxInFlightPerTenant`.
const REDIS_MAX_IN_FLIGHT_PER_TENANT: usize = 1000;

/// The most records a memory store may be configured for (2^32): far beyond what fits
/// in any machine's memory at the per-record overhead.
const MAX_MEMORY_ENTRIES: u64 = 1 << 32;

/// The most bytes a memory store may be configured for: the user address space of a
/// 64-bit process (2^48, x86-64 and aarch64 with 4-level page tables), or all of it on
/// smaller targets.
fn max_memory_bytes() -> usize {
    usize::try_from(1u64 << 48).unwrap_or(isize::MAX.unsigned_abs())
}

impl Validator {
    pub(super) fn memory_store(&mut self, v: &Value, path: String) -> Option<MemoryStoreSettings> {
        let o = self.object(v, path, MEMORY_FIELDS)?;
        let mut m = MemoryStoreSettings::default();
        let errors_before = self.errors.len();
        if let Some(x) = self.size_field(&o, "maxEntries") {
            if u64::try_from(x).is_ok_and(|x| x > MAX_MEMORY_ENTRIES) {
                self.error(
                    o.path("maxEntries"),
                    format!(
                        "must be at most {MAX_MEMORY_ENTRIES}: a bound no process can reach \
                         bounds nothing"
                    ),
                );
            }
            m.max_entries = x;
        }
        if let Some(x) = self.size_field(&o, "maxBytes") {
            let max = max_memory_bytes();
            if x > max {
                self.error(
                    o.path("maxBytes"),
                    format!(
                        "must be at most {max} (the address space of this machine's \
                         processes): a bound no process can reach bounds nothing"
                    ),
                );
            }
            m.max_bytes = x;
        }
        m.max_in_flight_per_tenant = self.size_field(&o, "maxInFlightPerTenant");
        m.max_entries_per_tenant = self.size_field(&o, "maxEntriesPerTenant");
        m.max_bytes_per_tenant = self.size_field(&o, "maxBytesPerTenant");
        if let Some(d) = self.duration_field(&o, "sweepInterval", Zero::Refused) {
            if d < MIN_TIMER {
                self.error(
                    o.path("sweepInterval"),
                    "must be at least 0.001s: tokio's timers tick in milliseconds",
                );
            }
            m.sweep_interval = d;
        }
        // Zero: any completed record may be evicted at a bound.
        if let Some(d) = self.duration_field(&o, "minRetention", Zero::Allowed) {
            m.min_retention = d;
        }
        if o.get("tombstoneTtl").is_some() {
            self.warn(
                o.path("tombstoneTtl"),
                "no longer used: a released record is removed, and an in-flight record \
                 whose lease ended is dropped one lease later",
            );
        }
        for (key, value, store) in [
            (
                "maxEntriesPerTenant",
                m.max_entries_per_tenant,
                m.max_entries,
            ),
            (
                "maxInFlightPerTenant",
                m.max_in_flight_per_tenant,
                m.max_entries,
            ),
            ("maxBytesPerTenant", m.max_bytes_per_tenant, m.max_bytes),
        ] {
            if value.is_some_and(|v| v > store) {
                self.warn(
                    o.path(key),
                    format!(
                        "is above the store-wide bound ({store}); the store-wide bound applies"
                    ),
                );
            }
        }
        (self.errors.len() == errors_before).then_some(m)
    }

    pub(super) fn redis(&mut self, v: &Value, path: String) -> Option<RedisSettings> {
        let o = self.object(v, path, REDIS_FIELDS)?;
        let errors_before = self.errors.len();
        let (url, cluster_nodes) = self.redis_endpoint(&o);
        let key_prefix = self
            .string_field(&o, "keyPrefix")
            .unwrap_or("idem:")
            .to_owned();
        let command_timeout = self
            .duration_field(&o, "commandTimeout", Zero::Refused)
            .unwrap_or(Duration::from_millis(500));
        let connect_timeout = self
            .duration_field(&o, "connectTimeout", Zero::Refused)
            .unwrap_or(Duration::from_secs(2));
        let max = u64::try_from(usize::MAX).unwrap_or(u64::MAX);
        let max_in_flight_per_tenant = match self.integer_field(
            &o,
            "maxInFlightPerTenant",
            0,
            max,
            "must be an integer >= 0 (0: no per-tenant bound)",
        ) {
            None => Some(REDIS_MAX_IN_FLIGHT_PER_TENANT),
            Some(0) => None,
            Some(n) => usize::try_from(n).ok(),
        };
        let max_bytes_per_tenant = match self.integer_field(
            &o,
            "maxBytesPerTenant",
            0,
            max,
            "must be an integer >= 0 (0: no per-tenant bound)",
        ) {
            None | Some(0) => None,
            Some(n) => usize::try_from(n).ok(),
        };
        let replica_acks = self
            .integer_field(
                &o,
                "replicaAcks",
                0,
                1000,
                "must be an integer in 0..=1000 (0: no confirmation)",
            )
            .and_then(|n| usize::try_from(n).ok())
            .unwrap_or(0);
        let replica_ack_timeout = self
            .duration_field(&o, "replicaAckTimeout", Zero::Refused)
            .unwrap_or(Duration::from_millis(100));
        if replica_acks > 0 && replica_ack_timeout >= command_timeout {
            self.error(
                o.path("replicaAckTimeout"),
                "must be shorter than commandTimeout (WAIT runs within a command)",
            );
        }
        if self.errors.len() > errors_before {
            return None;
        }
        Some(RedisSettings {
            url: url?,
            cluster_nodes: cluster_nodes.unwrap_or_default(),
            key_prefix,
            command_timeout,
            connect_timeout,
            max_in_flight_per_tenant,
            max_bytes_per_tenant,
            replica_acks,
            replica_ack_timeout,
        })
    }

    /// `url` (one endpoint) or `clusterNodes` (a cluster's seeds), exactly one of them;
    /// with `clusterNodes` the URL is empty.
    fn redis_endpoint(&mut self, o: &Obj<'_>) -> (Option<String>, Option<Vec<String>>) {
        const URL_RULE: &str = "must be a redis://, rediss://, redis+unix:// or unix:// URL";
        const NODE_RULE: &str = "must be a redis:// or rediss:// URL";
        let is_url = |s: &str, schemes: &[&str]| {
            schemes
                .iter()
                .any(|scheme| s.len() > scheme.len() && s.starts_with(scheme))
        };
        let cluster_nodes = match o.get("clusterNodes") {
            None => None,
            Some(Value::Array(items)) if !items.is_empty() => {
                let mut nodes = Vec::with_capacity(items.len());
                for (k, item) in items.iter().enumerate() {
                    match item {
                        Value::String(s) if is_url(s, &["redis://", "rediss://"]) => {
                            nodes.push(s.clone());
                        }
                        _ => self.error(format!("{}[{k}]", o.path("clusterNodes")), NODE_RULE),
                    }
                }
                Some(nodes)
            }
            Some(_) => {
                self.error(
                    o.path("clusterNodes"),
                    "must be a non-empty array of redis:// URLs (Redis Cluster seed nodes)",
                );
                None
            }
        };
        let url = match (o.get("url"), o.get("clusterNodes")) {
            (Some(_), Some(_)) => {
                self.error(
                    o.path("url"),
                    "must not be given with clusterNodes (one endpoint, or a cluster)",
                );
                None
            }
            (None, Some(_)) => Some(String::new()),
            (Some(Value::String(s)), None)
                if is_url(s, &["redis://", "rediss://", "redis+unix://", "unix://"]) =>
            {
                Some(s.clone())
            }
            (Some(_), None) => {
                self.error(o.path("url"), URL_RULE);
                None
            }
            (None, None) => {
                self.error(
                    o.path("url"),
                    format!("is required (or clusterNodes) and {URL_RULE}"),
                );
                None
            }
        };
        (url, cluster_nodes)
    }
}

#[cfg(test)]
mod tests;
