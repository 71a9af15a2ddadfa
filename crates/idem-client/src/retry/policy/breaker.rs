//! The circuit breaker (`idem.client.circuitBreaker`), tied to retries: while the
//! target keeps failing, calls fail at once and nothing is retried.
//!
//! [`Machine`] is the state machine, pure and clock-injected (property-tested against a
//! small model below); [`CircuitBreaker`] shares one per layer, reads the clock and logs
//! each transition once: `WARN` when it opens, `INFO` when it closes.
//!
//! - **Closed**: calls go out as configured. Each call that ends counts over the
//!   sliding `window`, as a failure when its status is in `failureStatusCodes` (a
//!   committed response never is). Once at least `minCalls` ended in the window and
//!   `failureRatio` of them failed, it opens.
//! - **Open** for `openFor`: no attempt is sent; the call fails at once with UNAVAILABLE,
//!   `ErrorInfo` reason `CIRCUIT_OPEN` and a `RetryInfo` delay (the time left open). It
//!   uses no attempt, no throttle token and no budget. A call already retrying when the
//!   breaker opens sends no more retries or hedges.
//! - **Half-Open** after that: `halfOpenProbes` calls go out, one attempt each, never
//!   retried or hedged; others are refused as while Open (with a retry delay of a tenth
//!   of `openFor`: the probes answer soon). All probes succeed: it
//!   closes (and forgets the window). One fails: it opens again, for `openFor × 2ⁿ`
//!   after *n* reopenings in a row (at most 8 × `openFor`), ± 20 % jitter.
//!
//! A probe whose caller drops it before it ends gives its place back.

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use idem_core::config::CircuitBreakerSettings;
use idem_core::headers::{ERROR_DOMAIN, reason};
use tokio::time::Instant;

use crate::retry::policy::backoff::jittered;
use crate::retry::policy::window::RollingCounts;

const CALLS: usize = 0;
const FAILURES: usize = 1;
/// Reopenings in a row beyond which `openFor` stops growing (× 2³ = 8).
const MAX_DOUBLINGS: u32 = 3;

/// Where a breaker is.
///
/// - **Closed**: calls go out as configured; ended calls count over `window`; at
///   `failureRatio` of at least `minCalls`, it opens.
/// - **Open** for `openFor` (× 2 per reopening in a row, up to 8 ×, ± 20 %): calls fail
///   at once (UNAVAILABLE, `CIRCUIT_OPEN`, a retry delay), nothing is sent.
/// - **Half-Open**: `halfOpenProbes` calls go out once each; all succeed: Closed; one
///   fails: Open again.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BreakerState {
    /// Calls go out as configured.
    Closed,
    /// Calls fail at once.
    Open,
    /// A few probes go out, one attempt each.
    HalfOpen,
}

impl BreakerState {
    /// Every state, in gauge order (`Closed` 0, `Open` 1, `HalfOpen` 2).
    pub const ALL: [BreakerState; 3] = [
        BreakerState::Closed,
        BreakerState::Open,
        BreakerState::HalfOpen,
    ];

    /// Stable snake-case name (`half_open`), for logs and metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            BreakerState::Closed => "closed",
            BreakerState::Open => "open",
            BreakerState::HalfOpen => "half_open",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

impl fmt::Display for BreakerState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What the breaker says to a call about to start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Admission {
    /// Closed: the call goes out as configured.
    Call,
    /// Half-Open: the call goes out as a probe of this round: one attempt.
    Probe(u64),
    /// Open (or every probe out): the call fails now; a retry after this may be let in.
    Refuse(Duration),
}

/// A change of state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Transition {
    pub(crate) from: BreakerState,
    pub(crate) to: BreakerState,
    /// How long it stays open (a transition to Open).
    pub(crate) open_for: Option<Duration>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Closed,
    Open { until: Instant },
    HalfOpen { sent: u32, passed: u32 },
}

/// The breaker's state machine, with the time (and the jitter) passed in.
#[derive(Debug, Clone)]
pub(crate) struct Machine {
    settings: CircuitBreakerSettings,
    counts: RollingCounts<2>,
    phase: Phase,
    /// Openings since it last closed: the exponent of the open time.
    reopenings: u32,
    /// Half-open rounds so far: a probe counts only in its own round.
    round: u64,
}

impl Machine {
    pub(crate) fn new(settings: CircuitBreakerSettings, now: Instant) -> Self {
        Machine {
            settings,
            counts: RollingCounts::new(settings.window, now),
            phase: Phase::Closed,
            reopenings: 0,
            round: 0,
        }
    }

    /// The state as of the last event (an Open breaker whose time is up stays Open until
    /// a call comes).
    pub(crate) fn state(&self) -> BreakerState {
        match self.phase {
            Phase::Closed => BreakerState::Closed,
            Phase::Open { .. } => BreakerState::Open,
            Phase::HalfOpen { .. } => BreakerState::HalfOpen,
        }
    }

    /// Whether calls may retry and hedge: only while Closed.
    pub(crate) fn retries_allowed(&self) -> bool {
        self.phase == Phase::Closed
    }

    /// A call is about to start at `now`.
    pub(crate) fn admit(&mut self, now: Instant) -> (Admission, Option<Transition>) {
        let mut change = None;
        if let Phase::Open { until } = self.phase {
            if now < until {
                return (Admission::Refuse(until - now), None);
            }
            self.phase = Phase::HalfOpen { sent: 0, passed: 0 };
            self.round += 1;
            change = Some(self.transition(BreakerState::Open, None));
        }
        let admission = match &mut self.phase {
            Phase::Closed => Admission::Call,
            Phase::HalfOpen { sent, .. } if *sent < self.settings.half_open_probes => {
                *sent += 1;
                Admission::Probe(self.round)
            }
            // Every probe is out: their results decide, within about a round trip.
            _ => Admission::Refuse(self.probes_out_delay()),
        };
        (admission, change)
    }

    /// A call admitted as `admitted` ended at `now`, failed or not; `u` in [0, 1) is the
    /// jitter of an open time it may start.
    pub(crate) fn record(
        &mut self,
        now: Instant,
        admitted: Admission,
        failed: bool,
        u: f64,
    ) -> Option<Transition> {
        match (self.phase, admitted) {
            (Phase::Closed, Admission::Call) => {
                self.counts.add(now, CALLS, 1);
                if failed {
                    self.counts.add(now, FAILURES, 1);
                }
                let [calls, failures] = self.counts.sums(now);
                let trips = calls >= u64::from(self.settings.min_calls)
                    && failures as f64 >= self.settings.failure_ratio.get() * calls as f64;
                (failed && trips).then(|| self.open(now, u, BreakerState::Closed))
            }
            (Phase::HalfOpen { sent, passed }, Admission::Probe(round)) if round == self.round => {
                if failed {
                    return Some(self.open(now, u, BreakerState::HalfOpen));
                }
                let passed = passed + 1;
                if passed < self.settings.half_open_probes {
                    self.phase = Phase::HalfOpen { sent, passed };
                    return None;
                }
                self.phase = Phase::Closed;
                self.reopenings = 0;
                self.counts.clear();
                Some(self.transition(BreakerState::HalfOpen, None))
            }
            // Calls admitted in another state, or probes of an earlier round.
            _ => None,
        }
    }

    /// A probe of `round` ended without a result (its caller dropped it): its place is
    /// free for another.
    pub(crate) fn abandon(&mut self, round: u64) {
        if let Phase::HalfOpen { sent, .. } = &mut self.phase
            && round == self.round
        {
            *sent = sent.saturating_sub(1);
        }
    }

    /// New settings; the state and the counts are kept (new counts for a new window).
    pub(crate) fn reconfigure(&mut self, settings: CircuitBreakerSettings, now: Instant) {
        if settings.window != self.settings.window {
            self.counts = RollingCounts::new(settings.window, now);
        }
        self.settings = settings;
    }

    pub(crate) fn settings(&self) -> CircuitBreakerSettings {
        self.settings
    }

    /// The retry delay given while every probe is out: a tenth of `openFor` (at least
    /// 10 ms), so callers come back soon after the probes' answer, not a whole open time
    /// later.
    pub(crate) fn probes_out_delay(&self) -> Duration {
        (self.settings.open_for / 10).max(Duration::from_millis(10))
    }

    /// The open time after `reopenings` openings in a row, before jitter.
    pub(crate) fn base_open_for(&self, reopenings: u32) -> Duration {
        self.settings.open_for * (1 << reopenings.min(MAX_DOUBLINGS))
    }

    fn open(&mut self, now: Instant, u: f64, from: BreakerState) -> Transition {
        let open_for = jittered(self.base_open_for(self.reopenings), u);
        self.reopenings = self.reopenings.saturating_add(1);
        self.phase = Phase::Open {
            until: now.checked_add(open_for).unwrap_or(now),
        };
        self.counts.clear();
        self.transition(from, Some(open_for))
    }

    fn transition(&self, from: BreakerState, open_for: Option<Duration>) -> Transition {
        Transition {
            from,
            to: self.state(),
            open_for,
        }
    }
}

struct Shared {
    machine: Mutex<Machine>,
    /// Transitions into each state, in [`BreakerState::ALL`] order.
    transitions: [AtomicU64; 3],
    refused: AtomicU64,
}

/// A shared circuit breaker: every clone of a [`RetryLayer`](crate::retry::RetryLayer)
/// uses the same one (give it to the builders of other channels to the same target with
/// [`RetryLayerBuilder::circuit_breaker`](crate::retry::RetryLayerBuilder::circuit_breaker)),
/// and a config reload keeps its state. See [`BreakerState`] for the states, and the
/// README's "Retry budget and circuit breaker" for the rules.
///
/// A call the open breaker refuses never reached a server: its idempotency key was
/// never used, so an application retry with the same key is safe.
#[derive(Clone)]
pub struct CircuitBreaker(Arc<Shared>);

impl fmt::Debug for CircuitBreaker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CircuitBreaker")
            .field("state", &self.state())
            .field("refused", &self.refused())
            .finish()
    }
}

impl CircuitBreaker {
    /// A closed breaker with these settings.
    pub fn new(settings: CircuitBreakerSettings) -> Self {
        CircuitBreaker(Arc::new(Shared {
            machine: Mutex::new(Machine::new(settings, Instant::now())),
            transitions: Default::default(),
            refused: AtomicU64::new(0),
        }))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Machine> {
        self.0
            .machine
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// The state now.
    pub fn state(&self) -> BreakerState {
        self.lock().state()
    }

    /// The settings in use.
    pub fn settings(&self) -> CircuitBreakerSettings {
        self.lock().settings()
    }

    /// Transitions into `state` so far.
    pub fn transitions(&self, state: BreakerState) -> u64 {
        self.0.transitions[state.index()].load(Ordering::Relaxed)
    }

    /// Calls refused so far (while Open, or Half-Open with every probe out).
    pub fn refused(&self) -> u64 {
        self.0.refused.load(Ordering::Relaxed)
    }

    /// Applies new settings, keeping the state.
    pub fn reconfigure(&self, settings: CircuitBreakerSettings) {
        self.lock().reconfigure(settings, Instant::now());
    }

    pub(crate) fn retries_allowed(&self) -> bool {
        self.lock().retries_allowed()
    }

    /// `None` while retries may go out; else the answer to a retry that must not:
    /// [`refusal`], with `openFor` as the delay.
    pub(crate) fn refuse_retry(&self, path: &str) -> Option<tonic::Status> {
        let m = self.lock();
        (!m.retries_allowed()).then(|| refusal(path, m.settings.open_for))
    }

    /// Admits a call starting now (`target` names the layer in the logs).
    pub(crate) fn admit(&self, target: &str) -> CallTicket {
        let (admission, change) = self.lock().admit(Instant::now());
        self.log(change, target);
        if let Admission::Refuse(_) = admission {
            self.0.refused.fetch_add(1, Ordering::Relaxed);
        }
        CallTicket {
            breaker: self.clone(),
            admission,
            settled: AtomicBool::new(false),
        }
    }

    fn log(&self, change: Option<Transition>, target: &str) {
        let Some(t) = change else { return };
        self.0.transitions[t.to.index()].fetch_add(1, Ordering::Relaxed);
        let from = t.from.as_str();
        match t.to {
            BreakerState::Open => tracing::warn!(
                target_service = target,
                from,
                open_for_ms = t.open_for.map_or(0, |d| d.as_millis() as u64),
                "circuit breaker opened: calls fail at once (UNAVAILABLE, CIRCUIT_OPEN) \
                 without retries until probes succeed"
            ),
            BreakerState::HalfOpen => tracing::info!(
                target_service = target,
                "circuit breaker half-open: probes go out, one attempt each"
            ),
            BreakerState::Closed => tracing::info!(
                target_service = target,
                "circuit breaker closed: the probes succeeded; calls and retries resume"
            ),
        }
    }
}

/// The answer to a call the open breaker refuses: UNAVAILABLE, `ErrorInfo` reason
/// `CIRCUIT_OPEN`, and the time left open as `RetryInfo`.
pub(crate) fn refusal(path: &str, wait: Duration) -> tonic::Status {
    use tonic_types::{ErrorDetails, StatusExt};
    let mut details = ErrorDetails::with_error_info(
        reason::CIRCUIT_OPEN,
        ERROR_DOMAIN,
        std::collections::HashMap::<String, String>::new(),
    );
    details.set_retry_info(Some(wait));
    let message = format!(
        "circuit breaker open: {path} was not sent (the target kept failing); nothing \
         reached a server, so retrying with the same key after {}ms is safe",
        wait.as_millis()
    );
    tonic::Status::with_error_details(tonic::Code::Unavailable, message, details)
}

/// A call's place in the breaker: what it was admitted as, and its result to record.
/// A probe dropped before its result gives its place back.
pub(crate) struct CallTicket {
    breaker: CircuitBreaker,
    admission: Admission,
    settled: AtomicBool,
}

impl fmt::Debug for CallTicket {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CallTicket")
            .field("admission", &self.admission)
            .finish()
    }
}

impl CallTicket {
    pub(crate) fn admission(&self) -> Admission {
        self.admission
    }

    pub(crate) fn is_probe(&self) -> bool {
        matches!(self.admission, Admission::Probe(_))
    }

    /// Records how the call ended: `code` is its status when it did not commit (a
    /// committed response is a success). Once; later calls do nothing.
    pub(crate) fn settle(&self, code: Option<tonic::Code>, u: f64, target: &str) {
        if self.settled.swap(true, Ordering::Relaxed) {
            return;
        }
        let change = {
            let mut m = self.breaker.lock();
            let failed = code.is_some_and(|c| m.settings.failure_status_codes.contains(c));
            m.record(Instant::now(), self.admission, failed, u)
        };
        self.breaker.log(change, target);
    }
}

impl Drop for CallTicket {
    fn drop(&mut self) {
        if let (false, Admission::Probe(round)) = (*self.settled.get_mut(), self.admission) {
            self.breaker.lock().abandon(round);
        }
    }
}

#[cfg(test)]
mod tests;
