//! Validated domain types. The parser produces them; the layers consume them.

use std::collections::HashMap;
use std::fmt;
use std::time::Duration;

use crate::code::{Code, CodeSet};
use idem_store::memory::MemoryStoreSettings;

/// One finding about a config document: where (a JSON path such as
/// `methodConfig[0].retryPolicy.maxAttempts`) and what rule it breaks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Diagnostic {
    /// JSON path of the offending value (`$` for the document itself).
    pub path: String,
    /// The rule, in lower case: `must be an integer > 1`.
    pub message: String,
}

impl fmt::Display for Diagnostic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.path, self.message)
    }
}

/// Why a config document was refused.
///
/// `Debug` prints the same sentences as `Display`, one error per line, so a `main` that
/// returns `Result<_, Box<dyn Error>>` and meets a bad config prints something a person
/// can act on rather than a struct dump.
#[derive(Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read the service config {path}: {message}")]
    Read {
        /// The path as given.
        path: String,
        /// The operating system's reason.
        message: String,
    },
    /// The text is not JSON (or not a JSON object at the top).
    #[error("invalid JSON at line {line}, column {column}: {message}")]
    Json {
        /// 1-based line of the parser's error.
        line: usize,
        /// 1-based column of the parser's error.
        column: usize,
        /// The parser's message.
        message: String,
    },
    /// The JSON breaks one or more rules; every error is listed.
    #[error("{} error(s) in service config: {}", .errors.len(), join(.errors))]
    Invalid {
        /// Every error found, in document order.
        errors: Vec<Diagnostic>,
        /// Warnings found along the way.
        warnings: Vec<Diagnostic>,
    },
}

impl fmt::Debug for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConfigError::Json { .. } | ConfigError::Read { .. } => fmt::Display::fmt(self, f),
            ConfigError::Invalid { errors, .. } => {
                write!(f, "{} error(s) in service config:", errors.len())?;
                for e in errors {
                    write!(f, "\n  {e}")?;
                }
                Ok(())
            }
        }
    }
}

fn join(d: &[Diagnostic]) -> String {
    d.iter()
        .map(|d| d.to_string())
        .collect::<Vec<_>>()
        .join("; ")
}

/// A valid config and the warnings its validation raised.
#[derive(Debug, Clone)]
pub struct Parsed {
    /// The validated config.
    pub config: ServiceConfig,
    /// Clamps, risky settings and unknown fields, each with its JSON path.
    pub warnings: Vec<Diagnostic>,
}

/// `{service, method}` of a `methodConfig[].name[]` entry. `""`, `null` and absent are
/// the same and are stored as `None`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct MethodName {
    /// Fully-qualified service name (`shop.v1.Orders`), or `None` for the default entry.
    pub service: Option<String>,
    /// Method name (`CreateOrder`), or `None` for every method of the service.
    pub method: Option<String>,
}

impl fmt::Display for MethodName {
    /// `shop.v1.Orders/CreateOrder`, `shop.v1.Orders/*`, or `*` for the default.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (&self.service, &self.method) {
            (None, _) => f.write_str("*"),
            (Some(s), None) => write!(f, "{s}/*"),
            (Some(s), Some(m)) => write!(f, "{s}/{m}"),
        }
    }
}

/// A validated `retryPolicy` (gRFC A6).
#[derive(Debug, Clone, PartialEq)]
pub struct RetryPolicy {
    pub(crate) max_attempts: u32,
    pub(crate) initial_backoff: Duration,
    pub(crate) max_backoff: Duration,
    pub(crate) backoff_multiplier: f64,
    pub(crate) retryable_status_codes: CodeSet,
    pub(crate) per_attempt_recv_timeout: Option<Duration>,
}

/// Why [`RetryPolicy::new`] refused its arguments.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid retry policy: {0}")]
pub struct InvalidRetryPolicy(pub(crate) String);

/// Most attempts A6 allows; larger values are clamped to it.
pub const MAX_ATTEMPTS_LIMIT: u32 = 5;

impl RetryPolicy {
    /// Builds a policy, checking the A6 rules: `max_attempts >= 2` (clamped to 5),
    /// backoffs > 0, multiplier > 0 and finite, codes non-empty.
    pub fn new(
        max_attempts: u32,
        initial_backoff: Duration,
        max_backoff: Duration,
        backoff_multiplier: f64,
        retryable_status_codes: CodeSet,
    ) -> Result<Self, InvalidRetryPolicy> {
        if max_attempts < 2 {
            return Err(InvalidRetryPolicy("maxAttempts must be > 1".into()));
        }
        if initial_backoff.is_zero() || max_backoff.is_zero() {
            return Err(InvalidRetryPolicy("backoffs must be > 0".into()));
        }
        if !(backoff_multiplier.is_finite() && backoff_multiplier > 0.0) {
            return Err(InvalidRetryPolicy("backoffMultiplier must be > 0".into()));
        }
        if retryable_status_codes.is_empty() {
            return Err(InvalidRetryPolicy(
                "retryableStatusCodes must not be empty".into(),
            ));
        }
        Ok(RetryPolicy {
            max_attempts: max_attempts.min(MAX_ATTEMPTS_LIMIT),
            initial_backoff,
            max_backoff,
            backoff_multiplier,
            retryable_status_codes,
            per_attempt_recv_timeout: None,
        })
    }

    /// This policy with a `perAttemptRecvTimeout`.
    pub fn with_per_attempt_recv_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.per_attempt_recv_timeout = timeout;
        self
    }
    /// Attempts including the first, already clamped to 2..=5.
    pub fn max_attempts(&self) -> u32 {
        self.max_attempts
    }
    /// Backoff before the first retry (before jitter).
    pub fn initial_backoff(&self) -> Duration {
        self.initial_backoff
    }
    /// Cap on the backoff (before jitter).
    pub fn max_backoff(&self) -> Duration {
        self.max_backoff
    }
    /// Growth of the backoff per retry.
    pub fn backoff_multiplier(&self) -> f64 {
        self.backoff_multiplier
    }
    /// Codes that are retried.
    pub fn retryable_status_codes(&self) -> CodeSet {
        self.retryable_status_codes
    }
    /// Optional per-attempt receive timeout.
    pub fn per_attempt_recv_timeout(&self) -> Option<Duration> {
        self.per_attempt_recv_timeout
    }
}

/// A validated `hedgingPolicy` (gRFC A6), executed by the client layer (`idem-client`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HedgingPolicy {
    /// Attempts including the first, clamped to 2..=5.
    pub max_attempts: u32,
    /// Delay between hedges (`hedgingDelay`, default 0).
    pub hedging_delay: Duration,
    /// Codes that do not stop the other hedges.
    pub non_fatal_status_codes: CodeSet,
}

/// A validated `retryThrottling` (gRFC A6), kept in milli-tokens as C-core and
/// grpc-java do so a ratio keeps exactly 3 decimals.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryThrottling {
    /// `maxTokens × 1000`; `maxTokens` is in (0, 1000].
    pub max_milli_tokens: u32,
    /// `tokenRatio × 1000`, truncated to 3 decimals; > 0.
    pub token_ratio_milli: u32,
}

/// What a duplicate does when it finds the key's first call still running.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum InFlightPolicy {
    /// Wait for the outcome (up to the caller's deadline), then replay it. The default.
    #[default]
    Wait,
    /// Answer ABORTED at once, with a retry delay.
    Abort,
}

/// A request compression idem can decode to fingerprint a request (`grpc-encoding`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Compression {
    /// `gzip` (RFC 1952), one member per message.
    Gzip,
    /// `deflate`: a zlib stream (RFC 1950), one per message, as gRPC implementations send it.
    Deflate,
}

impl Compression {
    /// Every compression idem decodes.
    pub const ALL: [Compression; 2] = [Compression::Gzip, Compression::Deflate];

    /// The `grpc-encoding` name.
    pub const fn name(self) -> &'static str {
        match self {
            Compression::Gzip => "gzip",
            Compression::Deflate => "deflate",
        }
    }

    /// The compression a `grpc-encoding` value names, if idem decodes it.
    pub fn from_name(name: &[u8]) -> Option<Self> {
        Self::ALL.into_iter().find(|c| c.name().as_bytes() == name)
    }
}

impl fmt::Display for Compression {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A set of [`Compression`]s (`acceptCompressed`); `Copy`, no allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub struct CompressionSet(u8);

impl CompressionSet {
    /// No compression: identity requests only.
    pub const EMPTY: CompressionSet = CompressionSet(0);

    /// This set and `c`.
    pub const fn with(self, c: Compression) -> Self {
        CompressionSet(self.0 | 1 << c as u8)
    }

    /// Whether `c` is in the set.
    pub const fn contains(self, c: Compression) -> bool {
        self.0 & (1 << c as u8) != 0
    }

    /// Whether the set is empty.
    pub const fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// The members, in [`Compression::ALL`] order.
    pub fn iter(self) -> impl Iterator<Item = Compression> {
        Compression::ALL
            .into_iter()
            .filter(move |c| self.contains(*c))
    }
}

impl FromIterator<Compression> for CompressionSet {
    fn from_iter<I: IntoIterator<Item = Compression>>(iter: I) -> Self {
        iter.into_iter().fold(Self::EMPTY, Self::with)
    }
}

/// idem's per-method `idempotency` object. Its presence marks the method as protected.
///
/// # Defaults
/// | field (JSON) | default |
/// |---|---|
/// | `keyRequired` | `true` |
/// | `recordTtl` | `"86400s"` (24 h) |
/// | `leaseTtl` | `"10s"` |
/// | `inFlight` | `"WAIT"` (`"ABORT"` is the other choice) |
/// | `abortRetryDelay` | `"1s"` |
/// | `cacheableStatusCodes` | OK, UNKNOWN, DEADLINE_EXCEEDED, INTERNAL, DATA_LOSS |
/// | `releaseStatusCodes` | the other twelve codes |
/// | `maxRequestBytes` | 4194304 (4 MiB, tonic's default message limit) |
/// | `maxResponseBytes` | 1048576 (1 MiB) |
/// | `maxRequestFrames` | 65536 |
/// | `acceptCompressed` | `[]` (identity only, as a tonic service without `accept_compressed`) |
/// | `failOpen` | `false` |
/// | `completionRetryTimeout` | `"60s"` |
/// | `responseStallTimeout` | `"30s"` |
///
/// # Rules between fields
/// `leaseTtl` is at least `"0.001s"` and `recordTtl` at least `leaseTtl` (errors); a
/// `completionRetryTimeout` shorter than `leaseTtl` is a warning.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdempotencyPolicy {
    /// A call without a key is refused (INVALID_ARGUMENT) when true; passed through
    /// unprotected when false.
    pub key_required: bool,
    /// How long a completed record is kept.
    pub record_ttl: Duration,
    /// Lease of an in-flight record; renewed while the handler runs.
    pub lease_ttl: Duration,
    /// What an in-flight duplicate does.
    pub in_flight: InFlightPolicy,
    /// Retry delay sent with ABORTED under [`InFlightPolicy::Abort`].
    pub abort_retry_delay: Duration,
    /// Outcomes stored and replayed to duplicates.
    pub cacheable_status_codes: CodeSet,
    /// Outcomes that release the record so a retry runs again. Always the complement of
    /// `cacheable_status_codes`.
    pub release_status_codes: CodeSet,
    /// Buffering limit for a protected request's body.
    pub max_request_bytes: usize,
    /// Responses larger than this are recorded as "completed, response not retained".
    pub max_response_bytes: usize,
    /// Most gRPC messages (frames) a protected request may hold; more is refused with
    /// RESOURCE_EXHAUSTED before any of them is decoded.
    pub max_request_frames: usize,
    /// Request compressions the service accepts for this method: mirror the service's
    /// `accept_compressed` here. A request in any other `grpc-encoding` is refused with
    /// UNIMPLEMENTED before its body is read, as tonic refuses it.
    pub accept_compressed: CompressionSet,
    /// When the store cannot answer, run the handler without a record (true) or answer
    /// UNAVAILABLE (false).
    pub fail_open: bool,
    /// How long a completion or release the store refuses transiently is retried (with
    /// backoff, the lease renewed meanwhile) before the record is left to its lease.
    /// Zero: one attempt.
    pub completion_retry_timeout: Duration,
    /// How long a caller may leave a streamed response unread (no message taken while
    /// the next one waits) before the layer stops sending it: the caller's stream ends
    /// there, the handler runs on to its end and its outcome is recorded, so a caller
    /// that never reads cannot hold a handler run (and its place under
    /// `maxHandlersInFlight`) for ever. Unary responses are never held this way.
    pub response_stall_timeout: Duration,
}

impl IdempotencyPolicy {
    /// Codes cached by default: OK and the errors that may follow side effects.
    pub const DEFAULT_CACHEABLE: CodeSet = CodeSet::of(Code::Ok)
        .with(Code::Unknown)
        .with(Code::DeadlineExceeded)
        .with(Code::Internal)
        .with(Code::DataLoss);
}

impl Default for IdempotencyPolicy {
    fn default() -> Self {
        IdempotencyPolicy {
            key_required: true,
            record_ttl: Duration::from_secs(24 * 3600),
            lease_ttl: Duration::from_secs(10),
            in_flight: InFlightPolicy::Wait,
            abort_retry_delay: Duration::from_secs(1),
            cacheable_status_codes: Self::DEFAULT_CACHEABLE,
            release_status_codes: Self::DEFAULT_CACHEABLE.complement(),
            max_request_bytes: 4 * 1024 * 1024,
            max_response_bytes: 1024 * 1024,
            max_request_frames: 65_536,
            accept_compressed: CompressionSet::EMPTY,
            fail_open: false,
            completion_retry_timeout: Duration::from_secs(60),
            response_stall_timeout: Duration::from_secs(30),
        }
    }
}

/// One validated `methodConfig[]` entry.
#[derive(Debug, Clone, PartialEq)]
pub struct MethodConfig {
    pub(crate) names: Vec<MethodName>,
    pub(crate) timeout: Option<Duration>,
    pub(crate) wait_for_ready: Option<bool>,
    pub(crate) max_request_message_bytes: Option<u64>,
    pub(crate) max_response_message_bytes: Option<u64>,
    pub(crate) retry_policy: Option<RetryPolicy>,
    pub(crate) hedging_policy: Option<HedgingPolicy>,
    pub(crate) idempotency: Option<IdempotencyPolicy>,
}

impl MethodConfig {
    /// An entry with no names and no policies (what applies when nothing matches).
    pub fn empty() -> Self {
        MethodConfig {
            names: Vec::new(),
            timeout: None,
            wait_for_ready: None,
            max_request_message_bytes: None,
            max_response_message_bytes: None,
            retry_policy: None,
            hedging_policy: None,
            idempotency: None,
        }
    }
    /// This entry with a retry policy (replacing any hedging policy).
    pub fn with_retry_policy(mut self, policy: RetryPolicy) -> Self {
        self.retry_policy = Some(policy);
        self.hedging_policy = None;
        self
    }
    /// This entry with one more name: `("shop.v1.Orders", "CreateOrder")` for one method,
    /// `("shop.v1.Orders", "")` for every method of a service, `("", "")` for the
    /// default entry (empty means absent, as in the JSON form).
    pub fn with_name(mut self, service: impl Into<String>, method: impl Into<String>) -> Self {
        let (service, method) = (service.into(), method.into());
        self.names.push(MethodName {
            service: (!service.is_empty()).then_some(service),
            method: (!method.is_empty()).then_some(method),
        });
        self
    }
    /// This entry with an idempotency policy (marks the method protected).
    pub fn with_idempotency(mut self, policy: IdempotencyPolicy) -> Self {
        self.idempotency = Some(policy);
        self
    }
    /// This entry without its idempotency policy (the method becomes unprotected).
    pub fn without_idempotency(mut self) -> Self {
        self.idempotency = None;
        self
    }
    /// This entry with a per-call timeout.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }
    /// This entry with `waitForReady`.
    pub fn with_wait_for_ready(mut self, wait: bool) -> Self {
        self.wait_for_ready = Some(wait);
        self
    }
    /// This entry with `maxRequestMessageBytes`.
    pub fn with_max_request_message_bytes(mut self, bytes: u32) -> Self {
        self.max_request_message_bytes = Some(u64::from(bytes));
        self
    }
    /// This entry with `maxResponseMessageBytes`.
    pub fn with_max_response_message_bytes(mut self, bytes: u32) -> Self {
        self.max_response_message_bytes = Some(u64::from(bytes));
        self
    }
    /// The names this entry applies to.
    pub fn names(&self) -> &[MethodName] {
        &self.names
    }
    /// `timeout`: the per-call deadline when the caller sets none.
    pub fn timeout(&self) -> Option<Duration> {
        self.timeout
    }
    /// `waitForReady`: a call that finds the channel unable to connect waits for it
    /// (until its deadline) instead of failing at once. The client layer applies it.
    pub fn wait_for_ready(&self) -> Option<bool> {
        self.wait_for_ready
    }
    /// `maxRequestMessageBytes`: a larger request message fails on the client with
    /// RESOURCE_EXHAUSTED before it is sent. The client layer applies it.
    pub fn max_request_message_bytes(&self) -> Option<u64> {
        self.max_request_message_bytes
    }
    /// `maxResponseMessageBytes`: a larger response message ends the call with
    /// RESOURCE_EXHAUSTED on the client. The client layer applies it.
    pub fn max_response_message_bytes(&self) -> Option<u64> {
        self.max_response_message_bytes
    }
    /// The retry policy, if any.
    pub fn retry_policy(&self) -> Option<&RetryPolicy> {
        self.retry_policy.as_ref()
    }
    /// The hedging policy, if any (never both).
    pub fn hedging_policy(&self) -> Option<&HedgingPolicy> {
        self.hedging_policy.as_ref()
    }
    /// idem's `idempotency` object; `Some` marks the method protected.
    pub fn idempotency(&self) -> Option<&IdempotencyPolicy> {
        self.idempotency.as_ref()
    }
}

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

/// Redis store settings (`idem.redis`).
///
/// # Defaults
/// `keyPrefix` `"idem:"`, `commandTimeout` `"0.5s"`, `connectTimeout` `"2s"`,
/// `maxInFlightPerTenant` 1000 (`0`: no per-tenant bound), `replicaAcks` 0 (off),
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
}

/// Client-side settings (`idem.client`).
///
/// # Defaults
/// `keyAllMethods` false, `maxReplayBytesPerCall` 262144 (256 KiB),
/// `maxReplayBytesTotal` 16777216 (16 MiB), `minAttemptTime` `"0s"`,
/// `retryExhaustedPushback` true, `noRetryUnderRetriedInbound` false.
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
        }
    }
}

/// idem's top-level `idem` object: process-wide settings.
///
/// # Defaults
/// `keyHeader` `"x-idempotency-key"`, `tenant` unset, `maxHandlersInFlight` 1024,
/// `memoryStore` see [`MemoryStoreSettings`], `redis` absent, `client` see
/// [`ClientSettings`].
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
    /// Bounds of the in-memory store.
    pub memory_store: MemoryStoreSettings,
    /// Redis store settings, when configured.
    pub redis: Option<RedisSettings>,
    /// Client-side settings.
    pub client: ClientSettings,
}

impl Default for IdemSettings {
    fn default() -> Self {
        IdemSettings {
            key_header: crate::headers::IDEMPOTENCY_KEY,
            tenant: TenantSource::Unset,
            max_handlers_in_flight: 1024,
            memory_store: MemoryStoreSettings::default(),
            redis: None,
            client: ClientSettings::default(),
        }
    }
}

/// A validated service config: method configs with their name index, throttling, and
/// idem's settings. Cheap to share behind an `Arc`.
#[derive(Debug, Clone, Default)]
pub struct ServiceConfig {
    pub(crate) method_configs: Vec<MethodConfig>,
    /// Keyed by `service/method`.
    pub(crate) by_method: HashMap<String, usize>,
    pub(crate) by_service: HashMap<String, usize>,
    pub(crate) default_entry: Option<usize>,
    pub(crate) retry_throttling: Option<RetryThrottling>,
    pub(crate) settings: IdemSettings,
}

impl ServiceConfig {
    /// The config entry for `service`/`method`: exact `service/method`, else `service`,
    /// else the default entry (`{}`). The most specific entry wins whole.
    pub fn lookup(&self, service: &str, method: &str) -> Option<&MethodConfig> {
        self.lookup_split(&format!("{service}/{method}"), service)
    }

    /// [`lookup`](Self::lookup) by HTTP/2 path (`/shop.v1.Orders/CreateOrder`); does not
    /// allocate. `None` also when the path is not of that form.
    pub fn lookup_path(&self, path: &str) -> Option<&MethodConfig> {
        let (service, _) = split_path(path)?;
        self.lookup_split(&path[1..], service)
    }

    fn lookup_split(&self, service_method: &str, service: &str) -> Option<&MethodConfig> {
        self.by_method
            .get(service_method)
            .or_else(|| self.by_service.get(service))
            .copied()
            .or(self.default_entry)
            .map(|i| &self.method_configs[i])
    }

    /// Every entry, in document order.
    pub fn method_configs(&self) -> &[MethodConfig] {
        &self.method_configs
    }
    /// `retryThrottling`, if configured.
    pub fn retry_throttling(&self) -> Option<RetryThrottling> {
        self.retry_throttling
    }
    /// idem's top-level settings.
    pub fn settings(&self) -> &IdemSettings {
        &self.settings
    }

    /// Builds a config in code: entries are indexed by their names as the parser would.
    /// Fails when a name appears twice.
    pub fn from_parts(
        method_configs: Vec<MethodConfig>,
        retry_throttling: Option<RetryThrottling>,
        settings: IdemSettings,
    ) -> Result<Self, ConfigError> {
        let mut cfg = ServiceConfig {
            method_configs: Vec::new(),
            by_method: HashMap::new(),
            by_service: HashMap::new(),
            default_entry: None,
            retry_throttling,
            settings,
        };
        let mut errors = Vec::new();
        for (i, mc) in method_configs.into_iter().enumerate() {
            for (j, name) in mc.names.iter().enumerate() {
                let dup = match (&name.service, &name.method) {
                    (None, _) => cfg.default_entry.replace(i).is_some(),
                    (Some(s), None) => cfg.by_service.insert(s.clone(), i).is_some(),
                    (Some(s), Some(m)) => cfg.by_method.insert(format!("{s}/{m}"), i).is_some(),
                };
                if dup {
                    errors.push(Diagnostic {
                        path: format!("methodConfig[{i}].name[{j}]"),
                        message: format!("duplicate name {name}"),
                    });
                }
            }
            cfg.method_configs.push(mc);
        }
        if errors.is_empty() {
            Ok(cfg)
        } else {
            Err(ConfigError::Invalid {
                errors,
                warnings: Vec::new(),
            })
        }
    }

    /// Parses and validates a service-config JSON document.
    ///
    /// # Errors
    /// [`ConfigError::Json`] with the parser's line and column when the text is not JSON;
    /// [`ConfigError::Invalid`] listing every broken rule, each as `json.path: rule`.
    pub fn from_json(text: &str) -> Result<ServiceConfig, ConfigError> {
        super::parse::parse(text).map(|parsed| parsed.config)
    }

    /// Parses and validates a service-config JSON document, and returns the warnings
    /// (clamps, risky settings, unknown fields) with the config.
    ///
    /// # Errors
    /// As [`ServiceConfig::from_json`].
    pub fn from_json_with_warnings(text: &str) -> Result<Parsed, ConfigError> {
        super::parse::parse(text)
    }

    /// Reads, parses and validates the service-config file at `path`.
    ///
    /// # Errors
    /// [`ConfigError::Read`] naming the path when the file cannot be read; otherwise as
    /// [`ServiceConfig::from_json`].
    pub fn from_file(path: impl AsRef<std::path::Path>) -> Result<ServiceConfig, ConfigError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError::Read {
            path: path.display().to_string(),
            message: e.to_string(),
        })?;
        ServiceConfig::from_json(&text)
    }
}

/// Splits `/package.Service/Method` into `("package.Service", "Method")`.
pub fn split_path(path: &str) -> Option<(&str, &str)> {
    let rest = path.strip_prefix('/')?;
    let (service, method) = rest.split_once('/')?;
    if service.is_empty() || method.is_empty() || method.contains('/') {
        return None;
    }
    Some((service, method))
}
