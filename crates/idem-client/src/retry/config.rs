//! The runtime configuration model: what the builder and the service config say, merged
//! once into [`Settings`], and the [`LayerShared`] state every clone of a layer reads.
//!
//! [`Settings::new`] is the only place settings are merged: [`RetryLayerBuilder::build`]
//! and [`RetryLayer::reload`] both go through [`LayerShared::new`] / [`LayerShared::reload`], which
//! call it, so a setting cannot be honoured at build time and dropped on reload.
//!
//! [`RetryLayerBuilder::build`]: crate::retry::RetryLayerBuilder::build
//! [`RetryLayer::reload`]: crate::retry::RetryLayer::reload

use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use arc_swap::ArcSwap;
use http::HeaderName;
use idem_core::config::{
    ClientSettings, HedgingPolicy, IdemSettings, MethodConfig, MethodName, RetryPolicy,
    ServiceConfig,
};
use idem_core::deadline::InboundScope;
use idem_core::descriptor::Descriptors;

use crate::metrics::SharedObserver;
use crate::retry::outcome::{CallReport, OutcomeHook, RetryStats};
use crate::retry::policy::backoff::Jitter;
use crate::retry::policy::breaker::CircuitBreaker;
use crate::retry::policy::budget::RetryBudget;
use crate::retry::policy::gate::Guards;
use crate::retry::policy::throttle::RetryThrottle;
use crate::retry::request::budget::ReplayBudget;

/// The default of [`RetryLayerBuilder::max_retry_delay`](crate::retry::RetryLayerBuilder::max_retry_delay).
pub(crate) const DEFAULT_MAX_RETRY_DELAY: Duration = Duration::from_secs(30);

/// The default of
/// [`RetryLayerBuilder::wait_for_ready_limit`](crate::retry::RetryLayerBuilder::wait_for_ready_limit).
pub(crate) const DEFAULT_WAIT_FOR_READY_LIMIT: Duration = Duration::from_secs(30);

/// Where per-method policies come from.
#[derive(Debug)]
pub(crate) enum PolicySource {
    /// A service config: `lookup_path` per call.
    Config(Box<ServiceConfig>),
    /// One method config for every method (the builder without a config).
    Fixed(Box<MethodConfig>),
}

/// What applies to one call.
#[derive(Debug, Clone)]
pub(crate) struct CallPolicy {
    pub(crate) retry: Option<RetryPolicy>,
    /// `hedgingPolicy` (never with `retry`: the config refuses both on one entry).
    pub(crate) hedging: Option<HedgingPolicy>,
    pub(crate) timeout: Option<Duration>,
    pub(crate) add_key: bool,
    /// `waitForReady`: a channel that cannot connect is waited for.
    pub(crate) wait_for_ready: bool,
    pub(crate) limits: MessageLimits,
    /// The call's circuit breaker: its method config entry's own (`circuitBreaker`),
    /// else the layer's.
    pub(crate) breaker: Option<CircuitBreaker>,
}

/// `maxRequestMessageBytes` and `maxResponseMessageBytes` of one call.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct MessageLimits {
    pub(crate) request: Option<u64>,
    pub(crate) response: Option<u64>,
}

impl CallPolicy {
    /// The policy of a method config entry (`None`: no entry matched).
    fn of(entry: Option<&MethodConfig>, add_key: bool) -> Self {
        CallPolicy {
            retry: entry.and_then(|mc| mc.retry_policy().cloned()),
            hedging: entry.and_then(|mc| mc.hedging_policy().cloned()),
            timeout: entry.and_then(MethodConfig::timeout),
            add_key: add_key || entry.is_some_and(|mc| mc.idempotency().is_some()),
            wait_for_ready: entry.and_then(MethodConfig::wait_for_ready) == Some(true),
            limits: MessageLimits {
                request: entry.and_then(MethodConfig::max_request_message_bytes),
                response: entry.and_then(MethodConfig::max_response_message_bytes),
            },
            breaker: None,
        }
    }
}

/// Builder values. The `Option`s win over the config's `idem` object on every reload;
/// the others have no config counterpart.
#[derive(Debug, Clone)]
pub(crate) struct Overrides {
    pub(crate) key_header: Option<HeaderName>,
    pub(crate) key_all_methods: Option<bool>,
    pub(crate) max_replay_bytes_per_call: Option<usize>,
    pub(crate) max_replay_bytes_total: Option<usize>,
    pub(crate) min_attempt_time: Option<Duration>,
    pub(crate) retry_exhausted_pushback: Option<bool>,
    pub(crate) no_retry_under_retried_inbound: Option<bool>,
    pub(crate) max_retry_delay: Duration,
    pub(crate) wait_for_ready_limit: Duration,
    pub(crate) peek_early_trailers: bool,
    /// The services' descriptors, applied to the config at build and on every reload.
    pub(crate) descriptors: Option<Arc<Descriptors>>,
    pub(crate) retry_budget: Option<idem_core::config::RetryBudgetSettings>,
    pub(crate) circuit_breaker: Option<idem_core::config::CircuitBreakerSettings>,
}

impl Default for Overrides {
    fn default() -> Self {
        Overrides {
            key_header: None,
            key_all_methods: None,
            max_replay_bytes_per_call: None,
            max_replay_bytes_total: None,
            min_attempt_time: None,
            retry_exhausted_pushback: None,
            no_retry_under_retried_inbound: None,
            max_retry_delay: DEFAULT_MAX_RETRY_DELAY,
            wait_for_ready_limit: DEFAULT_WAIT_FOR_READY_LIMIT,
            peek_early_trailers: false,
            descriptors: None,
            retry_budget: None,
            circuit_breaker: None,
        }
    }
}

impl Overrides {
    fn client(&self, c: &ClientSettings) -> ClientSettings {
        ClientSettings {
            key_all_methods: self.key_all_methods.unwrap_or(c.key_all_methods),
            max_replay_bytes_per_call: self
                .max_replay_bytes_per_call
                .unwrap_or(c.max_replay_bytes_per_call),
            max_replay_bytes_total: self
                .max_replay_bytes_total
                .unwrap_or(c.max_replay_bytes_total),
            min_attempt_time: self.min_attempt_time.unwrap_or(c.min_attempt_time),
            retry_exhausted_pushback: self
                .retry_exhausted_pushback
                .unwrap_or(c.retry_exhausted_pushback),
            no_retry_under_retried_inbound: self
                .no_retry_under_retried_inbound
                .unwrap_or(c.no_retry_under_retried_inbound),
            retry_budget: self.retry_budget.or(c.retry_budget),
            circuit_breaker: self.circuit_breaker.or(c.circuit_breaker),
        }
    }
}

/// One generation of settings, read whole by each call; replaced whole by a reload.
#[derive(Debug)]
pub(crate) struct Settings {
    source: PolicySource,
    key_header: HeaderName,
    client: ClientSettings,
    max_retry_delay: Duration,
    wait_for_ready_limit: Duration,
    peek_early_trailers: bool,
    /// The channel's retry throttle: carried over from the generation before unless the
    /// config drops it.
    throttle: Option<RetryThrottle>,
    /// The retry budget and the circuit breaker: carried over like the throttle.
    guards: GuardHandles,
}

/// The budget and the breaker of a generation of settings.
#[derive(Debug, Clone, Default)]
pub(crate) struct GuardHandles {
    pub(crate) budget: Option<RetryBudget>,
    pub(crate) breaker: Option<CircuitBreaker>,
    /// The breakers of the method config entries that have their own
    /// (`methodConfig[].circuitBreaker`), by the entry's first name (names are unique in
    /// a document): a reload keeps the state of an entry that keeps its first name.
    pub(crate) methods: Vec<(MethodName, CircuitBreaker)>,
}

impl GuardHandles {
    /// The handles for `client`'s settings: the builder's `pinned` ones stay; others
    /// carry over from `prev` (reconfigured, keeping their state), are made when the
    /// settings appear and dropped when they go.
    fn next(
        prev: &GuardHandles,
        pinned: &GuardHandles,
        client: &ClientSettings,
        source: &PolicySource,
    ) -> Self {
        fn carry<G: Clone, S: Copy>(
            prev: Option<&G>,
            settings: Option<S>,
            new: impl Fn(S) -> G,
            reconfigure: impl Fn(&G, S),
        ) -> Option<G> {
            let s = settings?;
            match prev {
                Some(g) => {
                    reconfigure(g, s);
                    Some(g.clone())
                }
                None => Some(new(s)),
            }
        }
        GuardHandles {
            budget: pinned.budget.clone().or_else(|| {
                carry(
                    prev.budget.as_ref(),
                    client.retry_budget,
                    RetryBudget::new,
                    RetryBudget::reconfigure,
                )
            }),
            breaker: pinned.breaker.clone().or_else(|| {
                carry(
                    prev.breaker.as_ref(),
                    client.circuit_breaker,
                    CircuitBreaker::new,
                    CircuitBreaker::reconfigure,
                )
            }),
            methods: source
                .entries()
                .iter()
                .filter_map(|mc| {
                    let name = entry_key(mc);
                    let before = prev.method_breaker(&name);
                    let b = carry(
                        before,
                        mc.circuit_breaker().copied(),
                        CircuitBreaker::new,
                        CircuitBreaker::reconfigure,
                    )?;
                    Some((name, b))
                })
                .collect(),
        }
    }

    /// The breaker of the entry named `name` first, if it has its own.
    fn method_breaker(&self, name: &MethodName) -> Option<&CircuitBreaker> {
        self.methods.iter().find(|(n, _)| n == name).map(|(_, b)| b)
    }

    /// The breaker of a call matched to `entry`: the entry's own, else the layer's.
    fn breaker_of(&self, entry: Option<&MethodConfig>) -> Option<CircuitBreaker> {
        match entry {
            Some(mc) if mc.circuit_breaker().is_some() => {
                self.method_breaker(&entry_key(mc)).cloned()
            }
            _ => self.breaker.clone(),
        }
    }
}

/// What names an entry's own breaker: its first name (every method, for an entry built
/// in code without names).
fn entry_key(mc: &MethodConfig) -> MethodName {
    mc.names().first().cloned().unwrap_or(MethodName {
        service: None,
        method: None,
    })
}

impl PolicySource {
    /// The method config entries.
    fn entries(&self) -> &[MethodConfig] {
        match self {
            PolicySource::Config(cfg) => cfg.method_configs(),
            PolicySource::Fixed(mc) => std::slice::from_ref(mc),
        }
    }
}

impl Settings {
    /// Merges the builder's `overrides` over the config's `idem` object: the one place
    /// this happens, for the first build and every reload.
    ///
    /// Without a service config every method gets a key unless the builder says
    /// otherwise: the builder's policy retries every method, and a key is what lets an
    /// idem server run a retried write once (a server without idem ignores the header).
    pub(crate) fn new(
        source: PolicySource,
        idem: &IdemSettings,
        overrides: &Overrides,
        throttle: Option<RetryThrottle>,
        guards: (&GuardHandles, &GuardHandles),
    ) -> Self {
        let mut client = overrides.client(&idem.client);
        if matches!(source, PolicySource::Fixed(_)) {
            client.key_all_methods = overrides.key_all_methods.unwrap_or(true);
        }
        let guards = GuardHandles::next(guards.0, guards.1, &client, &source);
        Settings {
            source,
            key_header: overrides
                .key_header
                .clone()
                .unwrap_or_else(|| idem.key_header.clone()),
            max_retry_delay: overrides.max_retry_delay,
            wait_for_ready_limit: overrides.wait_for_ready_limit,
            peek_early_trailers: overrides.peek_early_trailers,
            throttle,
            guards,
            client,
        }
    }

    /// The policy of the call to `path`, made while serving `inbound` (if any).
    pub(crate) fn resolve(&self, path: &str, inbound: Option<InboundScope>) -> CallPolicy {
        let key_all = self.client.key_all_methods;
        let entry = match &self.source {
            PolicySource::Config(cfg) => cfg.lookup_path(path),
            PolicySource::Fixed(mc) => Some(&**mc),
        };
        let mut policy = CallPolicy::of(entry, key_all);
        policy.breaker = self.guards.breaker_of(entry);
        if self.client.no_retry_under_retried_inbound
            && inbound.is_some_and(|s| s.previous_attempts > 0)
        {
            // The caller upstream retries already: one attempt here.
            policy.retry = None;
            policy.hedging = None;
        }
        policy
    }

    /// The header that carries the key.
    pub(crate) fn key_header(&self) -> &HeaderName {
        &self.key_header
    }
    /// Largest request body buffered for replay.
    pub(crate) fn max_replay_bytes_per_call(&self) -> usize {
        self.client.max_replay_bytes_per_call
    }
    /// A retry must start with at least this much time before the deadline.
    pub(crate) fn min_attempt_time(&self) -> Duration {
        self.client.min_attempt_time
    }
    /// Whether give-up failures under an inbound call get its marker.
    pub(crate) fn mark_exhausted(&self) -> bool {
        self.client.retry_exhausted_pushback
    }
    /// The longest wait a server may ask for.
    pub(crate) fn max_retry_delay(&self) -> Duration {
        self.max_retry_delay
    }
    /// How long a `waitForReady` call without a deadline waits for the channel.
    pub(crate) fn wait_for_ready_limit(&self) -> Duration {
        self.wait_for_ready_limit
    }
    /// Opt-in: retry "headers, then error trailers with no message".
    pub(crate) fn peek_early_trailers(&self) -> bool {
        self.peek_early_trailers
    }
    /// The retry throttle (`retryThrottling`, or the builder's).
    pub(crate) fn throttle(&self) -> Option<&RetryThrottle> {
        self.throttle.as_ref()
    }
    /// What may refuse a retry or a hedge: the throttle, the breaker, the budget.
    pub(crate) fn guards(&self) -> Guards<'_> {
        Guards {
            throttle: self.throttle.as_ref(),
            breaker: self.guards.breaker.as_ref(),
            budget: self.guards.budget.as_ref(),
        }
    }
    /// The retry budget and the circuit breaker.
    pub(crate) fn guard_handles(&self) -> &GuardHandles {
        &self.guards
    }
}

/// A value alone on its cache lines (128 bytes: x86 fetches lines in pairs), so that
/// reading it does not miss when a neighbour is written.
#[repr(align(128))]
struct Padded<T>(T);

/// State shared by a layer, its clones and every service they made.
pub(crate) struct LayerShared {
    /// Read once per call, without a lock: one count for all of a call's settings. On a
    /// cache line of its own, apart from this struct's reference count, which every
    /// clone of a service writes.
    settings: Padded<ArcSwap<Settings>>,
    /// One reload at a time: the throttle bucket goes from a generation to the next.
    reloading: Mutex<()>,
    /// The throttle was given by the user: config reloads do not replace it.
    throttle_pinned: bool,
    /// The budget and breaker given to the builder: config reloads do not replace them.
    guards_pinned: GuardHandles,
    overrides: Overrides,
    pub(crate) budget: Arc<ReplayBudget>,
    pub(crate) stats: RetryStats,
    pub(crate) jitter: Arc<dyn Jitter>,
    hook: Option<OutcomeHook>,
    pub(crate) observer: Option<SharedObserver>,
}

impl fmt::Debug for LayerShared {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LayerShared")
            .field("settings", &self.settings())
            .field("budget", &self.budget)
            .field("stats", &self.stats)
            .field("jitter", &self.jitter)
            .field("hook", &self.hook.as_ref().map(|_| "Fn"))
            .field("observer", &self.observer.is_some())
            .finish()
    }
}

/// What only the builder gives [`LayerShared::new`].
pub(crate) struct BuilderParts {
    pub(crate) source: PolicySource,
    pub(crate) idem: IdemSettings,
    pub(crate) overrides: Overrides,
    /// The bucket, and whether the user gave it (then reloads keep it).
    pub(crate) throttle: (Option<RetryThrottle>, bool),
    /// The budget and breaker the user gave (then reloads keep them).
    pub(crate) guards: GuardHandles,
    pub(crate) jitter: Arc<dyn Jitter>,
    pub(crate) hook: Option<OutcomeHook>,
    pub(crate) observer: Option<SharedObserver>,
}

impl LayerShared {
    pub(crate) fn new(parts: BuilderParts) -> Self {
        let settings = Settings::new(
            parts.source,
            &parts.idem,
            &parts.overrides,
            parts.throttle.0,
            (&GuardHandles::default(), &parts.guards),
        );
        let total = parts
            .overrides
            .client(&parts.idem.client)
            .max_replay_bytes_total;
        LayerShared {
            settings: Padded(ArcSwap::from_pointee(settings)),
            reloading: Mutex::new(()),
            throttle_pinned: parts.throttle.1,
            guards_pinned: parts.guards,
            overrides: parts.overrides,
            budget: Arc::new(ReplayBudget::new(total)),
            stats: RetryStats::default(),
            jitter: parts.jitter,
            hook: parts.hook,
            observer: parts.observer,
        }
    }

    /// Swaps in `config` (see [`RetryLayer::reload`](crate::retry::RetryLayer::reload)).
    pub(crate) fn reload(&self, config: &ServiceConfig) {
        let applied;
        let config = match &self.overrides.descriptors {
            None => config,
            Some(d) => match config.with_descriptors(d) {
                Ok(parsed) => {
                    applied = parsed.config;
                    &applied
                }
                Err(e) => {
                    tracing::error!(
                        "retry layer: the reloaded service config does not match the \
                         descriptors, the current one stays: {e}"
                    );
                    return;
                }
            },
        };
        let idem = config.settings();
        let total = self.overrides.client(&idem.client).max_replay_bytes_total;
        self.budget.set_limit(total);
        // The next generation is built outside the lock every call reads.
        let _one = self
            .reloading
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let before = self.settings();
        let bucket = before.throttle.clone();
        let throttle = match (bucket, config.retry_throttling()) {
            (bucket, _) if self.throttle_pinned => bucket,
            (Some(bucket), Some(t)) => {
                bucket.reconfigure(t);
                Some(bucket)
            }
            (None, Some(t)) => Some(RetryThrottle::new(t)),
            (_, None) => None,
        };
        let source = PolicySource::Config(Box::new(config.clone()));
        let guards = (&before.guards, &self.guards_pinned);
        let next = Arc::new(Settings::new(
            source,
            idem,
            &self.overrides,
            throttle,
            guards,
        ));
        self.settings.0.store(next);
    }

    pub(crate) fn settings(&self) -> Arc<Settings> {
        self.settings.0.load_full()
    }
    pub(crate) fn throttle(&self) -> Option<RetryThrottle> {
        self.settings().throttle.clone()
    }
    /// The retry budget and the circuit breaker in use.
    pub(crate) fn guard_handles(&self) -> GuardHandles {
        self.settings().guards.clone()
    }
    /// Counts a finished call and tells the hook.
    pub(crate) fn report(&self, path: &str, report: &CallReport) {
        self.stats.finished(report.outcome);
        if let Some(hook) = &self.hook {
            hook(path, report);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::retry::RetryLayer;

    /// Client settings where every field differs from the defaults and from `other`.
    fn client_settings(n: usize) -> ClientSettings {
        let d = ClientSettings::default();
        ClientSettings {
            key_all_methods: !d.key_all_methods,
            max_replay_bytes_per_call: d.max_replay_bytes_per_call + n,
            max_replay_bytes_total: d.max_replay_bytes_total + n,
            min_attempt_time: d.min_attempt_time + Duration::from_millis(n as u64),
            retry_exhausted_pushback: !d.retry_exhausted_pushback,
            no_retry_under_retried_inbound: !d.no_retry_under_retried_inbound,
            ..d
        }
    }

    fn config(n: usize) -> ServiceConfig {
        let idem = IdemSettings {
            key_header: HeaderName::from_bytes(format!("x-key-{n}").as_bytes()).unwrap(),
            client: client_settings(n),
            ..IdemSettings::default()
        };
        ServiceConfig::from_parts(Vec::new(), None, idem).unwrap()
    }

    #[test]
    fn every_builder_override_survives_reload() {
        let d = ClientSettings::default();
        let layer = RetryLayer::builder()
            .service_config(config(1))
            .key_header(HeaderName::from_static("x-from-builder"))
            .key_all_methods(d.key_all_methods)
            .max_replay_bytes_per_call(7)
            .max_replay_bytes_total(11)
            .min_attempt_time(Duration::from_millis(13))
            .retry_exhausted_pushback(d.retry_exhausted_pushback)
            .no_retry_under_retried_inbound(d.no_retry_under_retried_inbound)
            .max_retry_delay(Duration::from_secs(17))
            .wait_for_ready_limit(Duration::from_secs(19))
            .retry_headers_then_error(true)
            .build()
            .unwrap();
        let expected = ClientSettings {
            max_replay_bytes_per_call: 7,
            max_replay_bytes_total: 11,
            min_attempt_time: Duration::from_millis(13),
            ..d
        };
        for reload in [None, Some(config(2)), Some(config(3))] {
            if let Some(cfg) = &reload {
                layer.reload(cfg);
            }
            let s = layer.shared.settings();
            assert_eq!(s.client, expected, "after reload {reload:?}");
            assert_eq!(s.key_header, "x-from-builder");
            assert_eq!(s.max_retry_delay, Duration::from_secs(17));
            assert_eq!(s.wait_for_ready_limit, Duration::from_secs(19));
            assert!(s.peek_early_trailers);
        }
    }

    #[test]
    fn without_a_config_every_method_gets_a_key_unless_the_builder_says_not() {
        let resolve = |layer: RetryLayer| layer.shared.settings().resolve("/a.B/C", None);
        let keyed = resolve(RetryLayer::builder().build().unwrap());
        assert!(keyed.add_key && keyed.retry.is_some());
        let unkeyed = resolve(
            RetryLayer::builder()
                .key_all_methods(false)
                .build()
                .unwrap(),
        );
        assert!(!unkeyed.add_key);
        // With a config, only protected methods (or `keyAllMethods`), as before.
        let layer = RetryLayer::from_config(&ServiceConfig::default());
        assert!(!resolve(layer.clone()).add_key);
        // A reload from the builder's fixed policy to a config follows the config.
        let layer = RetryLayer::builder().build().unwrap();
        layer.reload(&ServiceConfig::default());
        assert!(!resolve(layer).add_key);
    }

    #[test]
    fn per_method_settings_come_from_the_method_entry_or_the_builder() {
        let cfg = ServiceConfig::from_json(
            r#"{"methodConfig": [{"name": [{"service": "a.B"}], "waitForReady": true,
                "maxRequestMessageBytes": 10, "maxResponseMessageBytes": 20}]}"#,
        )
        .unwrap();
        let p = RetryLayer::from_config(&cfg)
            .shared
            .settings()
            .resolve("/a.B/C", None);
        assert!(p.wait_for_ready && p.retry.is_none());
        assert_eq!(
            p.limits,
            MessageLimits {
                request: Some(10),
                response: Some(20)
            }
        );
        let other = RetryLayer::from_config(&cfg)
            .shared
            .settings()
            .resolve("/x.Y/Z", None);
        assert!(!other.wait_for_ready);
        assert_eq!(other.limits, MessageLimits::default());
        let layer = RetryLayer::builder()
            .wait_for_ready(true)
            .max_request_message_bytes(1)
            .max_response_message_bytes(2)
            .build()
            .unwrap();
        let p = layer.shared.settings().resolve("/x.Y/Z", None);
        assert!(p.wait_for_ready && p.retry.is_some());
        assert_eq!(
            p.limits,
            MessageLimits {
                request: Some(1),
                response: Some(2)
            }
        );
    }

    #[test]
    fn without_overrides_a_reload_takes_the_new_config_whole() {
        let layer = RetryLayer::from_config(&config(1));
        assert_eq!(layer.shared.settings().client, client_settings(1));
        layer.reload(&config(2));
        let s = layer.shared.settings();
        assert_eq!(s.client, client_settings(2));
        assert_eq!(s.key_header, "x-key-2");
    }
}
