//! idem's top-level `idem` object ([`IdemSettings`]): process-wide settings (the key
//! header, the tenant, the bound on handler runs, the client's settings) and the
//! stores' settings of [`stores`](super::stores); with their readers.

use std::time::Duration;

use serde_json::Value;

use super::guards::{CircuitBreakerSettings, RetryBudgetSettings};
use super::read::{Validator, Zero, kind};
use super::stores::{MemoryStoreSettings, RedisSettings};

/// Where the server layer takes the tenant from, when the config says (the builder can
/// also set a resolver in code, which wins).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum TenantSource {
    /// Not set in the config: the server builder must choose (extension, single, …).
    #[default]
    Unset,
    /// Every call belongs to this one tenant (`{"single": "acme"}`).
    Single(String),
    /// Trust a client-sent header (`{"header": "x-tenant-id"}`): an explicit opt-in, only
    /// safe behind a proxy that sets it.
    Header(http::HeaderName),
}

/// Client-side settings (`idem.client`).
///
/// # Defaults
/// `keyAllMethods` false, `maxReplayBytesPerCall` 262144 (256 KiB),
/// `maxReplayBytesTotal` 16777216 (16 MiB), `minAttemptTime` `"0s"`,
/// `retryExhaustedPushback` true, `noRetryUnderRetriedInbound` false, `retryBudget`
/// and `circuitBreaker` absent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientSettings {
    /// Add `x-idempotency-key` to every method, not just protected ones.
    pub key_all_methods: bool,
    /// A call whose request body is larger is sent once, without retries.
    pub max_replay_bytes_per_call: usize,
    /// Bodies buffered for replay across all calls of one channel, at most.
    pub max_replay_bytes_total: usize,
    /// A retry is not started when less than this would be left before the deadline.
    pub min_attempt_time: Duration,
    /// Mark failures from an exhausted downstream call with `grpc-retry-pushback-ms: -1`
    /// (retry at one layer only, `docs/semantics.md`, section 4).
    pub retry_exhausted_pushback: bool,
    /// Make no retries for outgoing calls made while serving an inbound call that is
    /// itself a retry (`grpc-previous-rpc-attempts` > 0): the caller upstream already
    /// retries, so retrying here too would multiply attempts.
    pub no_retry_under_retried_inbound: bool,
    /// `retryBudget`: retries and hedges at most a ratio of the calls over a window.
    pub retry_budget: Option<RetryBudgetSettings>,
    /// `circuitBreaker`: fail fast, with no retries, while the target keeps failing.
    pub circuit_breaker: Option<CircuitBreakerSettings>,
}

impl Default for ClientSettings {
    fn default() -> Self {
        ClientSettings {
            key_all_methods: false,
            max_replay_bytes_per_call: 256 * 1024,
            max_replay_bytes_total: 16 * 1024 * 1024,
            min_attempt_time: Duration::ZERO,
            retry_exhausted_pushback: true,
            no_retry_under_retried_inbound: false,
            retry_budget: None,
            circuit_breaker: None,
        }
    }
}

/// idem's top-level `idem` object: process-wide settings.
///
/// # Defaults
/// `keyHeader` `"x-idempotency-key"`, `tenant` unset, `maxHandlersInFlight` 1024,
/// `maxHandlersPerTenant` a quarter of `maxHandlersInFlight` (all of it for a single
/// tenant), `maxDetachedHandlers` 256, `maxWaiters` 4096, `maxWaitersPerTenant` a
/// quarter of `maxWaiters` (all of it for a single tenant), `memoryStore` see
/// [`MemoryStoreSettings`], `redis` absent, `client` see [`ClientSettings`], `strict`
/// false.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdemSettings {
    /// Header carrying the key.
    pub key_header: http::HeaderName,
    /// Where the tenant comes from.
    pub tenant: TenantSource,
    /// Protected handler runs one server layer lets be in progress at once, counting
    /// runs whose caller went away (they keep running to record their outcome). Past
    /// it, new protected calls are refused (RESOURCE_EXHAUSTED) before they run.
    pub max_handlers_in_flight: usize,
    /// `maxHandlersPerTenant`: the share of `max_handlers_in_flight` one tenant may hold,
    /// its runs whose caller went away included. `None`: a quarter of
    /// `max_handlers_in_flight` (at least 1), or all of it when the layer has a single
    /// tenant ([`effective_max_handlers_per_tenant`](Self::effective_max_handlers_per_tenant)).
    pub max_handlers_per_tenant: Option<usize>,
    /// `maxDetachedHandlers`: while this many handler runs whose caller went away are
    /// still running (they run on to record their outcome), new protected calls are
    /// refused (RESOURCE_EXHAUSTED, with a retry delay), so callers that cancel cannot
    /// make more handlers run at once than callers that wait.
    pub max_detached_handlers: usize,
    /// `maxWaiters`: duplicates one server layer lets wait at once for a call in
    /// progress with their key. Past it a duplicate is answered RESOURCE_EXHAUSTED with a
    /// retry delay instead of waiting.
    pub max_waiters: usize,
    /// `maxWaitersPerTenant`: the share of `max_waiters` one tenant may hold. `None`: a
    /// quarter of `max_waiters` (at least 1), or all of it for a single tenant.
    pub max_waiters_per_tenant: Option<usize>,
    /// Bounds of the in-memory store.
    pub memory_store: MemoryStoreSettings,
    /// Redis store settings, when configured.
    pub redis: Option<RedisSettings>,
    /// Client-side settings.
    pub client: ClientSettings,
    /// `strict`: every warning about the document is an error (default false).
    pub strict: bool,
}

impl Default for IdemSettings {
    fn default() -> Self {
        IdemSettings {
            key_header: crate::headers::IDEMPOTENCY_KEY,
            tenant: TenantSource::Unset,
            max_handlers_in_flight: 1024,
            max_handlers_per_tenant: None,
            max_detached_handlers: DEFAULT_MAX_DETACHED_HANDLERS,
            max_waiters: DEFAULT_MAX_WAITERS,
            max_waiters_per_tenant: None,
            memory_store: MemoryStoreSettings::default(),
            redis: None,
            client: ClientSettings::default(),
            strict: false,
        }
    }
}

/// Default of [`IdemSettings::max_detached_handlers`].
pub const DEFAULT_MAX_DETACHED_HANDLERS: usize = 256;
/// Default of [`IdemSettings::max_waiters`].
pub const DEFAULT_MAX_WAITERS: usize = 4096;

impl IdemSettings {
    /// The handler runs one tenant may hold: `max_handlers_per_tenant`, or its default
    /// (a quarter of `max_handlers_in_flight`, all of it when `single_tenant`), never
    /// above `max_handlers_in_flight`.
    pub fn effective_max_handlers_per_tenant(&self, single_tenant: bool) -> usize {
        share(
            self.max_handlers_per_tenant,
            self.max_handlers_in_flight,
            single_tenant,
        )
    }

    /// The duplicates of one tenant that may wait at once: `max_waiters_per_tenant`, or
    /// its default (a quarter of `max_waiters`, all of it when `single_tenant`), never
    /// above `max_waiters`.
    pub fn effective_max_waiters_per_tenant(&self, single_tenant: bool) -> usize {
        share(self.max_waiters_per_tenant, self.max_waiters, single_tenant)
    }
}

fn share(set: Option<usize>, whole: usize, single_tenant: bool) -> usize {
    match set {
        Some(n) => n.min(whole),
        None if single_tenant => whole,
        None => (whole / 4).max(1),
    }
}

pub(super) const IDEM_FIELDS: &[&str] = &[
    "keyHeader",
    "tenant",
    "maxHandlersInFlight",
    "maxHandlersPerTenant",
    "maxDetachedHandlers",
    "maxWaiters",
    "maxWaitersPerTenant",
    "memoryStore",
    "redis",
    "client",
    "strict",
];
pub(super) const TENANT_FIELDS: &[&str] = &["single", "header"];
pub(super) const CLIENT_FIELDS: &[&str] = &[
    "keyAllMethods",
    "maxReplayBytesPerCall",
    "maxReplayBytesTotal",
    "minAttemptTime",
    "retryExhaustedPushback",
    "noRetryUnderRetriedInbound",
    "retryBudget",
    "circuitBreaker",
];

impl Validator {
    pub(super) fn idem_settings(&mut self, v: &Value, path: String) -> Option<IdemSettings> {
        let o = self.object(v, path, IDEM_FIELDS)?;
        let errors_before = self.errors.len();
        let mut s = IdemSettings::default();
        if let Some(v) = o.get("keyHeader")
            && let Some(x) = self.header_name(v, o.path("keyHeader"))
        {
            s.key_header = x;
        }
        if let Some(v) = o.get("tenant")
            && let Some(x) = self.tenant(v, o.path("tenant"), &s.key_header)
        {
            s.tenant = x;
        }
        if let Some(x) = self.size_field(&o, "maxHandlersInFlight") {
            s.max_handlers_in_flight = x;
        }
        if let Some(x) = self.size_field(&o, "maxHandlersPerTenant") {
            s.max_handlers_per_tenant = Some(x);
            if x > s.max_handlers_in_flight {
                self.warn(
                    o.path("maxHandlersPerTenant"),
                    "is above maxHandlersInFlight: a tenant gets at most maxHandlersInFlight",
                );
            }
        }
        if let Some(x) = self.size_field(&o, "maxDetachedHandlers") {
            s.max_detached_handlers = x;
        }
        if let Some(x) = self.size_field(&o, "maxWaiters") {
            s.max_waiters = x;
        }
        if let Some(x) = self.size_field(&o, "maxWaitersPerTenant") {
            s.max_waiters_per_tenant = Some(x);
            if x > s.max_waiters {
                self.warn(
                    o.path("maxWaitersPerTenant"),
                    "is above maxWaiters: a tenant gets at most maxWaiters",
                );
            }
        }
        if let Some(v) = o.get("memoryStore")
            && let Some(x) = self.memory_store(v, o.path("memoryStore"))
        {
            s.memory_store = x;
        }
        if let Some(v) = o.get("redis") {
            s.redis = self.redis(v, o.path("redis"));
        }
        if let Some(v) = o.get("client")
            && let Some(x) = self.client(v, o.path("client"))
        {
            s.client = x;
        }
        if let Some(b) = self.boolean(&o, "strict") {
            s.strict = b;
        }
        // One tenant: its share is the whole store.
        if matches!(s.tenant, TenantSource::Single(_)) {
            s.memory_store = s.memory_store.for_single_tenant();
        }
        (self.errors.len() == errors_before).then_some(s)
    }

    /// A header name idem may read: lower-case, valid, not reserved by HTTP/2 or gRPC.
    fn header_name(&mut self, v: &Value, path: String) -> Option<http::HeaderName> {
        let Value::String(s) = v else {
            self.error(
                path,
                format!("must be a header name string, not {}", kind(v)),
            );
            return None;
        };
        let Ok(name) = http::HeaderName::from_bytes(s.as_bytes()) else {
            self.error(
                path,
                "must be a valid header name (letters, digits, '-', '_', '.')",
            );
            return None;
        };
        if name.as_str() != s {
            self.error(
                path,
                format!("must be lower case: write \"{}\"", name.as_str()),
            );
            return None;
        }
        const RESERVED: &[&str] = &[
            "content-type",
            "te",
            "host",
            "connection",
            "keep-alive",
            "proxy-connection",
            "transfer-encoding",
            "upgrade",
            "user-agent",
            "content-length",
        ];
        if s.starts_with("grpc-") {
            self.error(path, "must not start with \"grpc-\" (reserved by gRPC)");
            None
        } else if s.ends_with("-bin") {
            self.error(path, "must not end in \"-bin\" (binary metadata)");
            None
        } else if RESERVED.contains(&s.as_str()) {
            self.error(path, "is reserved by HTTP/2 or gRPC");
            None
        } else {
            Some(name)
        }
    }

    fn tenant(
        &mut self,
        v: &Value,
        path: String,
        key_header: &http::HeaderName,
    ) -> Option<TenantSource> {
        let o = self.object(v, path, TENANT_FIELDS)?;
        match (o.get("single"), o.get("header")) {
            (Some(single), None) => match single {
                Value::String(s) if !s.is_empty() => Some(TenantSource::Single(s.clone())),
                other => {
                    self.error(
                        o.path("single"),
                        format!("must be a non-empty string, not {}", kind(other)),
                    );
                    None
                }
            },
            (None, Some(header)) => {
                let h = self.header_name(header, o.path("header"))?;
                if h == *key_header {
                    self.error(o.path("header"), "must differ from keyHeader");
                    return None;
                }
                self.warn(
                    o.path("header"),
                    "trusts a client-sent header: only safe behind a proxy that sets or strips it",
                );
                Some(TenantSource::Header(h))
            }
            _ => {
                self.error(
                    o.path.clone(),
                    "must have exactly one of \"single\" or \"header\"",
                );
                None
            }
        }
    }

    fn client(&mut self, v: &Value, path: String) -> Option<ClientSettings> {
        let o = self.object(v, path, CLIENT_FIELDS)?;
        let errors_before = self.errors.len();
        let mut c = ClientSettings::default();
        if let Some(b) = self.boolean(&o, "keyAllMethods") {
            c.key_all_methods = b;
        }
        if let Some(x) = self.size_field(&o, "maxReplayBytesPerCall") {
            c.max_replay_bytes_per_call = x;
        }
        if let Some(x) = self.size_field(&o, "maxReplayBytesTotal") {
            c.max_replay_bytes_total = x;
        }
        if let Some(d) = self.duration_field(&o, "minAttemptTime", Zero::Allowed) {
            c.min_attempt_time = d;
        }
        if let Some(b) = self.boolean(&o, "retryExhaustedPushback") {
            c.retry_exhausted_pushback = b;
        }
        if let Some(b) = self.boolean(&o, "noRetryUnderRetriedInbound") {
            c.no_retry_under_retried_inbound = b;
        }
        if let Some(v) = o.get("retryBudget") {
            c.retry_budget = self.retry_budget(v, o.path("retryBudget"));
        }
        if let Some(v) = o.get("circuitBreaker") {
            c.circuit_breaker = self.circuit_breaker(v, o.path("circuitBreaker"));
        }
        if c.max_replay_bytes_total < c.max_replay_bytes_per_call {
            self.warn(
                o.path("maxReplayBytesTotal"),
                "is less than maxReplayBytesPerCall: calls between the two are never retried",
            );
        }
        (self.errors.len() == errors_before).then_some(c)
    }
}

#[cfg(test)]
mod tests;
