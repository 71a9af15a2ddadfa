//! [`RetryLayer`] and its builder.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use http::HeaderName;
use idem_core::code::{Code, CodeSet};
use idem_core::config::{
    CircuitBreakerSettings, ConfigError, IdemSettings, InvalidRetryPolicy, MethodConfig,
    MethodName, RetryBudgetSettings, RetryPolicy, RetryThrottling, ServiceConfig,
};
use idem_core::descriptor::Descriptors;

use crate::retry::config::{self, GuardHandles, LayerShared, Overrides, PolicySource};
use crate::retry::outcome::{CallReport, OutcomeHook, RetryStats};
use crate::retry::policy::backoff::{Jitter, SeededJitter, ThreadRngJitter};
use crate::retry::policy::breaker::CircuitBreaker;
use crate::retry::policy::budget::RetryBudget;
use crate::retry::policy::throttle::RetryThrottle;
use crate::retry::service::Retry;

/// A tower [`Layer`](tower_layer::Layer) that retries gRPC calls as gRFC A6 says. See the
/// [crate docs](crate) for the behaviour and an example.
///
/// Cheap to clone: clones share the settings, the throttle bucket, the replay budget and
/// the counters.
#[derive(Debug, Clone)]
pub struct RetryLayer {
    pub(crate) shared: Arc<LayerShared>,
}

impl<S> tower_layer::Layer<S> for RetryLayer {
    type Service = Retry<S>;

    fn layer(&self, inner: S) -> Retry<S> {
        Retry::from_shared(inner, self.shared.clone())
    }
}

impl RetryLayer {
    /// A layer whose per-method policies, timeouts, throttling and client settings come
    /// from `config` (the method's entry: exact `service/method`, else `service`, else
    /// the default entry). Methods without a `retryPolicy` are passed through (one
    /// attempt) but still get a key when protected.
    pub fn from_config(config: &ServiceConfig) -> Self {
        Self::builder()
            .service_config(config.clone())
            .build_unchecked()
    }

    /// A builder with the gRPC-style defaults (see [`RetryLayerBuilder`]).
    pub fn builder() -> RetryLayerBuilder {
        RetryLayerBuilder::default()
    }

    /// Replaces the service config for every clone of this layer and every service made
    /// from it; calls already running keep the policy they started with. The throttle
    /// bucket, the replay budget's bytes in use and the counters are kept. Throttle
    /// settings that change are applied to the existing bucket keeping its fill ratio; a
    /// config without `retryThrottling` turns throttling off (unless a bucket was given
    /// to the builder with [`RetryLayerBuilder::throttle`], which always stays).
    pub fn reload(&self, config: &ServiceConfig) {
        self.shared.reload(config);
    }

    /// The throttle bucket in use, if any: give it to another layer's builder
    /// ([`RetryLayerBuilder::throttle`]) to share it across channels to one target.
    pub fn throttle(&self) -> Option<RetryThrottle> {
        self.shared.throttle()
    }

    /// The retry budget in use (`idem.client.retryBudget`, or the builder's), if any.
    pub fn retry_budget(&self) -> Option<RetryBudget> {
        self.shared.guard_handles().budget
    }

    /// The circuit breaker in use (`idem.client.circuitBreaker`, or the builder's), if
    /// any: give it to another layer's builder
    /// ([`RetryLayerBuilder::circuit_breaker`]) to share it across channels to one target.
    pub fn circuit_breaker(&self) -> Option<CircuitBreaker> {
        self.shared.guard_handles().breaker
    }

    /// The breakers of the method config entries that have their own
    /// (`methodConfig[].circuitBreaker`), each with the entry's first name: those
    /// methods use it instead of [`circuit_breaker`](Self::circuit_breaker).
    pub fn method_circuit_breakers(&self) -> Vec<(MethodName, CircuitBreaker)> {
        self.shared.guard_handles().methods
    }

    /// The counters of this layer and its clones.
    pub fn stats(&self) -> RetryStats {
        self.shared.stats.clone()
    }

    /// Request bytes currently held for replay by calls of this layer.
    pub fn replay_bytes_held(&self) -> usize {
        self.shared.budget.held()
    }

    /// Request bytes currently held by calls of this layer, all counted against
    /// `maxReplayBytesTotal`: those kept for replay
    /// ([`replay_bytes_held`](Self::replay_bytes_held)), and those read from a caller
    /// that a committed attempt has not handed to the transport yet.
    pub fn request_bytes_held(&self) -> usize {
        self.shared.budget.total()
    }
}

/// Why [`RetryLayerBuilder::build`] failed. `Debug` prints the same sentence as
/// `Display`, so `?` in `main` reads it.
#[derive(Clone, PartialEq, Eq, thiserror::Error)]
pub enum BuildError {
    /// The builder's retry policy breaks an A6 rule.
    #[error(transparent)]
    Policy(#[from] InvalidRetryPolicy),
    /// The service config does not match the descriptors given to
    /// [`RetryLayerBuilder::descriptors`]: a name that matches no service or method, a
    /// misspelled field, a retry policy on an opted-out side-effecting method… (every
    /// mismatch, each with its JSON path).
    #[error("the service config does not match the descriptors: {0}")]
    Descriptors(ConfigError),
}

impl std::fmt::Debug for BuildError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
}

/// Builds a [`RetryLayer`].
///
/// # Defaults
/// Retry policy, used for every method when no service config is given:
///
/// | option | default |
/// |---|---|
/// | [`max_attempts`](Self::max_attempts) | 3 (A6 clamps to 2..=5) |
/// | [`initial_backoff`](Self::initial_backoff) | 20 ms |
/// | [`backoff_multiplier`](Self::backoff_multiplier) | 2.0 |
/// | [`max_backoff`](Self::max_backoff) | 1 s |
/// | jitter | ×U(0.8, 1.2) (A6), from [`jitter`](Self::jitter) / [`seed`](Self::seed); thread RNG by default |
/// | [`retryable_status_codes`](Self::retryable_status_codes) | `[UNAVAILABLE]` |
/// | [`per_attempt_recv_timeout`](Self::per_attempt_recv_timeout) | none |
/// | [`timeout`](Self::timeout) | none (the caller's `grpc-timeout` or inbound deadline only) |
/// | [`wait_for_ready`](Self::wait_for_ready) | false (fail fast when the channel cannot connect) |
/// | [`max_request_message_bytes`](Self::max_request_message_bytes) | none |
/// | [`max_response_message_bytes`](Self::max_response_message_bytes) | none |
///
/// Settings that apply with or without a config (with a config, an explicit call here
/// wins over the config's `idem.client` object):
///
/// | option | default |
/// |---|---|
/// | [`max_replay_bytes_per_call`](Self::max_replay_bytes_per_call) | 262144 (256 KiB) |
/// | [`max_replay_bytes_total`](Self::max_replay_bytes_total) | 16777216 (16 MiB) per layer |
/// | [`min_attempt_time`](Self::min_attempt_time) | 0 |
/// | [`key_all_methods`](Self::key_all_methods) | without a config: true (the builder's policy retries every method, so every call carries a key); with a config: `idem.client.keyAllMethods` (false: only methods with an `idempotency` object get a key) |
/// | [`key_header`](Self::key_header) | `x-idempotency-key` (with a config: `idem.keyHeader`) |
/// | [`throttle`](Self::throttle) / [`retry_throttling`](Self::retry_throttling) | none (with a config: its `retryThrottling`) |
/// | [`retry_budget`](Self::retry_budget) / [`retry_budget_settings`](Self::retry_budget_settings) | none (with a config: `idem.client.retryBudget`) |
/// | [`circuit_breaker`](Self::circuit_breaker) / [`circuit_breaker_settings`](Self::circuit_breaker_settings) | none (with a config: `idem.client.circuitBreaker`) |
/// | [`on_outcome`](Self::on_outcome) | none |
/// | [`observer`](Self::observer) | none |
/// | [`retry_headers_then_error`](Self::retry_headers_then_error) | false |
/// | [`max_retry_delay`](Self::max_retry_delay) | 30 s (a longer server-requested wait stops the retries) |
/// | [`wait_for_ready_limit`](Self::wait_for_ready_limit) | 30 s (how long a `waitForReady` call without a deadline waits) |
/// | [`retry_exhausted_pushback`](Self::retry_exhausted_pushback) | true (with a config: `idem.client.retryExhaustedPushback`) |
/// | [`no_retry_under_retried_inbound`](Self::no_retry_under_retried_inbound) | false (with a config: `idem.client.noRetryUnderRetriedInbound`) |
pub struct RetryLayerBuilder {
    config: Option<ServiceConfig>,
    max_attempts: u32,
    initial_backoff: Duration,
    max_backoff: Duration,
    backoff_multiplier: f64,
    codes: CodeSet,
    per_attempt_recv_timeout: Option<Duration>,
    timeout: Option<Duration>,
    wait_for_ready: bool,
    max_request_message_bytes: Option<u32>,
    max_response_message_bytes: Option<u32>,
    overrides: Overrides,
    throttle: Option<RetryThrottle>,
    throttling: Option<RetryThrottling>,
    guards: GuardHandles,
    jitter: Arc<dyn Jitter>,
    hook: Option<OutcomeHook>,
    observer: Option<crate::metrics::SharedObserver>,
}

impl fmt::Debug for RetryLayerBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RetryLayerBuilder")
            .field("config", &self.config.is_some())
            .field("max_attempts", &self.max_attempts)
            .field("initial_backoff", &self.initial_backoff)
            .field("max_backoff", &self.max_backoff)
            .field("backoff_multiplier", &self.backoff_multiplier)
            .field("codes", &self.codes)
            .finish_non_exhaustive()
    }
}

impl Default for RetryLayerBuilder {
    fn default() -> Self {
        RetryLayerBuilder {
            config: None,
            max_attempts: 3,
            initial_backoff: Duration::from_millis(20),
            max_backoff: Duration::from_secs(1),
            backoff_multiplier: 2.0,
            codes: CodeSet::of(Code::Unavailable),
            per_attempt_recv_timeout: None,
            timeout: None,
            wait_for_ready: false,
            max_request_message_bytes: None,
            max_response_message_bytes: None,
            overrides: Overrides::default(),
            throttle: None,
            throttling: None,
            guards: GuardHandles::default(),
            jitter: Arc::new(ThreadRngJitter),
            hook: None,
            observer: None,
        }
    }
}

/// Builder methods that set one field each: `name(arg: Type) => field = value;`, with
/// their docs.
macro_rules! setters {
    ($($(#[$doc:meta])* $name:ident($arg:ident: $ty:ty) => $($field:ident).+ = $value:expr;)+) => {
        $(
            $(#[$doc])*
            pub fn $name(mut self, $arg: $ty) -> Self {
                self.$($field).+ = $value;
                self
            }
        )+
    };
}

impl RetryLayerBuilder {
    setters! {
        /// Take per-method policies, timeouts, throttling and client settings from a service
        /// config. The builder's per-method options (the retry policy, `timeout`,
        /// `wait_for_ready`, the message limits) are then ignored: the config's method
        /// entries say them.
        service_config(config: ServiceConfig) => config = Some(config);
        /// Attempts including the first (default 3; clamped to 5; must be ≥ 2).
        max_attempts(n: u32) => max_attempts = n;
        /// Backoff before the first retry (default 20 ms).
        initial_backoff(d: Duration) => initial_backoff = d;
        /// Cap on the backoff before jitter (default 1 s).
        max_backoff(d: Duration) => max_backoff = d;
        /// Growth of the backoff per retry (default 2.0).
        backoff_multiplier(m: f64) => backoff_multiplier = m;
        /// Codes that are retried (default `[UNAVAILABLE]`).
        retryable_status_codes(codes: CodeSet) => codes = codes;
        /// Cancel an attempt that has no response headers after this long and retry it
        /// (default none). With a config, its `perAttemptRecvTimeout` is used instead.
        per_attempt_recv_timeout(d: Duration) => per_attempt_recv_timeout = Some(d);
        /// Per-call deadline when the caller sets none (default none; with a config, the
        /// method's `timeout`).
        timeout(d: Duration) => timeout = Some(d);
        /// Wait for a channel that cannot connect instead of failing at once, as gRPC's
        /// `waitForReady` (default false; with a config, the method's `waitForReady`). A call
        /// whose attempt fails to connect (nothing was sent) sends the same attempt again
        /// after a short backoff (100 ms growing ×1.6 to 2 s, ±20 %), until its deadline, or
        /// for [`wait_for_ready_limit`](Self::wait_for_ready_limit) without one. These waits
        /// use no attempt of `maxAttempts` and no throttle token.
        wait_for_ready(yes: bool) => wait_for_ready = yes;
        /// Fail a call whose request message is larger than this with RESOURCE_EXHAUSTED,
        /// on the client (default none; with a config, the method's
        /// `maxRequestMessageBytes`). The length is read from each message's gRPC frame
        /// header (the compressed length for a compressed message).
        max_request_message_bytes(bytes: u32) => max_request_message_bytes = Some(bytes);
        /// End a call whose response carries a message larger than this with
        /// RESOURCE_EXHAUSTED (default none; with a config, the method's
        /// `maxResponseMessageBytes`). Checked on each message's gRPC frame header as the
        /// response streams; the messages before it are delivered.
        max_response_message_bytes(bytes: u32) => max_response_message_bytes = Some(bytes);
        /// How long a `waitForReady` call that has no deadline waits for a channel that
        /// cannot connect before it fails with UNAVAILABLE and
        /// [`CallOutcome::NotReady`](crate::retry::CallOutcome::NotReady) (default 30 s; counted
        /// from each attempt the channel could not send, so at most `maxAttempts` times per
        /// call). A call with a deadline waits until its deadline.
        wait_for_ready_limit(d: Duration) => overrides.wait_for_ready_limit = d;
        /// Request bytes one call keeps for replay (default 256 KiB). A call that sends more
        /// before it commits is committed there: it goes on, but is not retried.
        max_replay_bytes_per_call(n: usize) => overrides.max_replay_bytes_per_call = Some(n);
        /// Request bytes kept for replay by all calls of this layer together (default 16 MiB);
        /// a call that would pass it is committed, as over the per-call limit.
        max_replay_bytes_total(n: usize) => overrides.max_replay_bytes_total = Some(n);
        /// Do not start a retry that would have less than this before the deadline (default 0).
        min_attempt_time(d: Duration) => overrides.min_attempt_time = Some(d);
        /// Add a key to every method, not only protected ones (default: true without a
        /// service config, whose one policy retries every method; with a config, its
        /// `idem.client.keyAllMethods`, false by default, so only methods with an
        /// `idempotency` object get one). Set false to send no key without a config: an
        /// idem server then answers calls to its protected methods with `KEY_MISSING`.
        key_all_methods(yes: bool) => overrides.key_all_methods = Some(yes);
        /// Tag a failure this layer gives up on (retries exhausted, throttled, pushback stop)
        /// while serving an inbound call, so the server's `InboundLayer` sends it upstream with
        /// `grpc-retry-pushback-ms: -1` (default true): retry at one layer only.
        retry_exhausted_pushback(yes: bool) => overrides.retry_exhausted_pushback = Some(yes);
        /// Make no retries for calls made while serving an inbound call that is itself a retry
        /// (`grpc-previous-rpc-attempts` > 0), since the caller upstream retries already
        /// (default false).
        no_retry_under_retried_inbound(yes: bool) => overrides.no_retry_under_retried_inbound = Some(yes);
        /// Header carrying the key (default `x-idempotency-key`, or the config's
        /// `idem.keyHeader`).
        key_header(name: HeaderName) => overrides.key_header = Some(name);
        /// Use this throttle bucket (shared with other layers, e.g. other channels to the same
        /// target). It stays across reloads and wins over the config's `retryThrottling`.
        throttle(bucket: RetryThrottle) => throttle = Some(bucket);
        /// Throttle with a new bucket of these settings (when no config gives one).
        retry_throttling(t: RetryThrottling) => throttling = Some(t);
        /// Use this retry budget (shared with other layers). It stays across reloads and
        /// wins over the config's `idem.client.retryBudget`.
        retry_budget(budget: RetryBudget) => guards.budget = Some(budget);
        /// A new retry budget of these settings; wins over the config's
        /// `idem.client.retryBudget` on every reload.
        retry_budget_settings(s: RetryBudgetSettings) => overrides.retry_budget = Some(s);
        /// Use this circuit breaker (shared with other layers, e.g. other channels to the
        /// same target). It stays across reloads and wins over the config's
        /// `idem.client.circuitBreaker`.
        circuit_breaker(breaker: CircuitBreaker) => guards.breaker = Some(breaker);
        /// A new circuit breaker of these settings; wins over the config's
        /// `idem.client.circuitBreaker` on every reload.
        circuit_breaker_settings(s: CircuitBreakerSettings) => overrides.circuit_breaker = Some(s);
        /// Random source for the backoff jitter (default: thread RNG).
        jitter(jitter: impl Jitter) => jitter = Arc::new(jitter);
        /// Opt-in (default false): also retry an attempt whose response has real headers and
        /// then, before any message, error trailers, for servers that never answer
        /// Trailers-Only. The layer then reads the first body frame of every response before
        /// handing it on (under the deadline and `perAttemptRecvTimeout`): response headers
        /// reach the caller with the first message instead of before it. A response whose
        /// first frame is a message is committed as usual. The headers still commit the
        /// call: when the deadline or `perAttemptRecvTimeout` passes before the first
        /// frame, the response goes on as it came (never retried, nor hedged again), and
        /// while a hedge's first frame is awaited no other hedge goes out.
        retry_headers_then_error(yes: bool) => overrides.peek_early_trailers = yes;
        /// The longest wait before a retry that a server may ask for, with
        /// `grpc-retry-pushback-ms` or `google.rpc.RetryInfo` (default 30 s). A server that
        /// asks for more (a call with no deadline could otherwise be parked for hours) gets
        /// no retry: the call ends at once with the attempt's status and
        /// [`CallOutcome::PushbackStop`](crate::retry::CallOutcome::PushbackStop). Retrying *sooner*
        /// than the server asked would defeat the pushback, so the wait is never shortened.
        /// The policy's own backoff is bounded by its `maxBackoff` instead.
        max_retry_delay(d: Duration) => overrides.max_retry_delay = d;
        /// Tells `observer` about every attempt and call, for metrics
        /// ([`metrics`](crate::metrics); default none: no clock reads, no wrapping).
        /// `idem-otel` has one that records gRPC's standard client metrics.
        observer(observer: impl crate::metrics::CallObserver) => observer = Some(Arc::new(observer));
    }

    /// Makes the services' descriptors the source of truth for which methods are keyed,
    /// retried and hedged, at build and on every [`RetryLayer::reload`]: every
    /// configured name must match a real service or method ([`build`](Self::build)
    /// fails otherwise), side-effecting methods (no `idempotency_level`) are protected,
    /// so every call to them that carries a retry or a hedge carries a key, and
    /// `NO_SIDE_EFFECTS` / `IDEMPOTENT` methods are retried without one. The config's own
    /// settings still apply (see
    /// [`ServiceConfig::with_descriptors`](idem_core::config::ServiceConfig::with_descriptors)).
    /// Without a [`service_config`](Self::service_config), the builder's retry policy is
    /// the config's default entry.
    ///
    /// Resolved once, when the layer is built: a call costs what it did.
    pub fn descriptors(mut self, descriptors: impl Into<Arc<Descriptors>>) -> Self {
        self.overrides.descriptors = Some(descriptors.into());
        self
    }

    /// Seeded jitter: the same seed gives the same backoff waits.
    pub fn seed(self, seed: u64) -> Self {
        self.jitter(SeededJitter::new(seed))
    }
    /// Called with `(method path, report)` when each call ends.
    pub fn on_outcome(mut self, hook: impl Fn(&str, &CallReport) + Send + Sync + 'static) -> Self {
        self.hook = Some(Arc::new(hook));
        self
    }

    /// Builds the layer.
    ///
    /// # Errors
    /// [`BuildError::Policy`] when no config is given and the retry options break an A6
    /// rule (`max_attempts < 2`, zero backoffs, multiplier ≤ 0 or not finite, no codes);
    /// [`BuildError::Descriptors`] when the config does not match the
    /// [`descriptors`](Self::descriptors).
    pub fn build(mut self) -> Result<RetryLayer, BuildError> {
        let retry = RetryPolicy::new(
            self.max_attempts,
            self.initial_backoff,
            self.max_backoff,
            self.backoff_multiplier,
            self.codes,
        )?;
        let retry = retry.with_per_attempt_recv_timeout(self.per_attempt_recv_timeout);
        let mut method = MethodConfig::empty()
            .with_retry_policy(retry)
            .with_wait_for_ready(self.wait_for_ready);
        if let Some(t) = self.timeout {
            method = method.with_timeout(t);
        }
        if let Some(n) = self.max_request_message_bytes {
            method = method.with_max_request_message_bytes(n);
        }
        if let Some(n) = self.max_response_message_bytes {
            method = method.with_max_response_message_bytes(n);
        }
        if let Some(d) = self.overrides.descriptors.clone() {
            let config = match self.config.take() {
                Some(config) => config,
                // The builder's policy is the default entry, for the descriptors to refine.
                None => ServiceConfig::from_parts(
                    vec![method.clone().with_name("", "")],
                    None,
                    IdemSettings::default(),
                )
                .map_err(BuildError::Descriptors)?,
            };
            let parsed = config
                .with_descriptors(&d)
                .map_err(BuildError::Descriptors)?;
            for w in &parsed.warnings {
                tracing::warn!(path = %w.path, "service config: {}", w.message);
            }
            self.config = Some(parsed.config);
        }
        Ok(self.finish(Some(method)))
    }

    fn build_unchecked(self) -> RetryLayer {
        self.finish(None)
    }

    fn finish(self, method: Option<MethodConfig>) -> RetryLayer {
        let throttle = match self.throttle {
            Some(pinned) => (Some(pinned), true),
            None => {
                let settings = self
                    .config
                    .as_ref()
                    .and_then(ServiceConfig::retry_throttling);
                (settings.or(self.throttling).map(RetryThrottle::new), false)
            }
        };
        let idem = self
            .config
            .as_ref()
            .map(|c| c.settings().clone())
            .unwrap_or_default();
        let source = match (self.config, method) {
            (Some(cfg), _) => PolicySource::Config(Box::new(cfg)),
            (None, Some(method)) => PolicySource::Fixed(Box::new(method)),
            (None, None) => PolicySource::Config(Box::default()),
        };
        RetryLayer {
            shared: Arc::new(LayerShared::new(config::BuilderParts {
                source,
                idem,
                overrides: self.overrides,
                throttle,
                guards: self.guards,
                jitter: self.jitter,
                hook: self.hook,
                observer: self.observer,
            })),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What `fn main() -> Result<(), Box<dyn Error>>` prints on `?`: the sentence.
    #[test]
    fn a_build_error_debugs_as_its_sentence() {
        let e = RetryLayer::builder()
            .max_attempts(1)
            .build()
            .expect_err("one attempt is not a retry policy");
        assert_eq!(format!("{e:?}"), e.to_string());
        assert!(e.to_string().starts_with("invalid retry policy: "), "{e}");
    }
}
