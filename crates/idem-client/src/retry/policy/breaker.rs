//! The circuit breaker (`idem.client.circuitBreaker`), tied to retries: while the
//! target keeps failing, calls fail at once and nothing is retried.
//!
//! [`Machine`] is the state machine, pure and clock-injected (property-tested against a
//! small model below); [`CircuitBreaker`] shares one per layer, reads the clock and logs
//! each transition once: `WARN` when it opens, `INFO` when it closes.
//!
//! The breaker judges the target, so it counts **attempts**, each a call to the target
//! (a call retried twice is three), as each one ends: retries hide the target's failure
//! rate from the calls' results (at 60 % of attempts failing, only 22 % of calls with 3
//! attempts fail), and a burst of failing calls sends three attempts each before enough
//! of them have ended.
//!
//! - **Closed**: calls go out as configured. Each attempt counts over the sliding
//!   `window`, as a failure when its status is in `failureStatusCodes` (a committed
//!   response never is; a hedge cancelled because another won does not count). Once at
//!   least `minCalls` attempts ended in the window and `failureRatio` of them failed, it
//!   opens. Before that, once **half** of `failureRatio` of them failed, calls still go
//!   out but are no longer retried or hedged (as gRFC A6's throttle stops retries at half
//!   its tokens): retries cannot rescue calls from a target failing that often, they
//!   only add load (and, until the window's older successes age out, delay the
//!   opening).
//! - **Open** for `openFor`: no attempt is sent; the call fails at once with UNAVAILABLE,
//!   `ErrorInfo` reason `CIRCUIT_OPEN` and a `RetryInfo` delay (the time left open). It
//!   uses no attempt, no throttle token and no budget. A call already retrying when the
//!   breaker opens sends no more retries or hedges.
//! - **Half-Open** after that: `halfOpenProbes` calls go out, one attempt each, never
//!   retried or hedged; others are refused as while Open (with a retry delay of a tenth
//!   of `openFor`: the probes answer soon). The probes are judged by the same ratio: once
//!   `failureRatio` of `halfOpenProbes` failed it opens again, for `openFor × 2ⁿ` after
//!   *n* reopenings in a row (at most 8 × `openFor`), ± 20 % jitter; once that can no
//!   longer happen it closes (and forgets the window). With 3 probes and 0.5: two
//!   successes close it, two failures reopen it, so one failure a healthy target's
//!   background rate gives does not keep it open.
//!
//! A probe whose caller drops it before it ends gives its place back, and so does a call
//! that sent nothing (its deadline passed first, say): it says nothing about the target.

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use idem_core::config::CircuitBreakerSettings;
use idem_core::headers::{ERROR_DOMAIN, reason};
use tokio::time::Instant;

use crate::retry::outcome::{AttemptEnd, CallOutcome};
use crate::retry::policy;
use crate::retry::policy::backoff::jittered;
use crate::retry::policy::window::RollingCounts;

const ATTEMPTS: usize = 0;
const FAILURES: usize = 1;
/// Reopenings in a row beyond which `openFor` stops growing (× 2³ = 8).
const MAX_DOUBLINGS: u32 = 3;

/// Where a breaker is.
///
/// - **Closed**: calls go out as configured; ended attempts count over `window`; at
///   `failureRatio` of at least `minCalls`, it opens (at half that, retries and hedges
///   stop).
/// - **Open** for `openFor` (× 2 per reopening in a row, up to 8 ×, ± 20 %): calls fail
///   at once (UNAVAILABLE, `CIRCUIT_OPEN`, a retry delay), nothing is sent.
/// - **Half-Open**: `halfOpenProbes` calls go out once each; `failureRatio` of them
///   fail: Open again; else Closed.
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
    Open {
        until: Instant,
    },
    /// Probes out or ended (`sent`), and the results so far.
    HalfOpen {
        sent: u32,
        passed: u32,
        failed: u32,
    },
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

    /// Whether calls may retry and hedge at `now`: only while Closed, and while fewer
    /// than half of `failureRatio` of the window's attempts failed (or fewer than
    /// `minCalls` ended).
    pub(crate) fn retries_allowed(&mut self, now: Instant) -> bool {
        self.phase == Phase::Closed && !self.over(now, self.settings.failure_ratio.get() / 2.0)
    }

    /// Whether at least `minCalls` attempts ended in the window and `ratio` of them failed.
    fn over(&mut self, now: Instant, ratio: f64) -> bool {
        let [attempts, failures] = self.counts.sums(now);
        attempts >= u64::from(self.settings.min_calls) && failures as f64 >= ratio * attempts as f64
    }

    /// How long a retry stopped at `now` should wait: the time left open (a tenth of
    /// `openFor` while half-open); `None` while Closed.
    pub(crate) fn retry_delay(&self, now: Instant) -> Option<Duration> {
        match self.phase {
            Phase::Closed => None,
            Phase::Open { until } => Some(until.saturating_duration_since(now)),
            Phase::HalfOpen { .. } => Some(self.probes_out_delay()),
        }
    }

    /// A call is about to start at `now`.
    pub(crate) fn admit(&mut self, now: Instant) -> (Admission, Option<Transition>) {
        let mut change = None;
        if let Phase::Open { until } = self.phase {
            if now < until {
                return (Admission::Refuse(until - now), None);
            }
            self.phase = Phase::HalfOpen {
                sent: 0,
                passed: 0,
                failed: 0,
            };
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

    /// An attempt of a call admitted as `admitted` ended at `now`, failed or not; `u` in
    /// [0, 1) is the jitter of an open time it may start. A probe has one attempt.
    pub(crate) fn record(
        &mut self,
        now: Instant,
        admitted: Admission,
        failed: bool,
        u: f64,
    ) -> Option<Transition> {
        match (self.phase, admitted) {
            (Phase::Closed, Admission::Call) => {
                self.counts.add(now, ATTEMPTS, 1);
                if !failed {
                    return None;
                }
                self.counts.add(now, FAILURES, 1);
                let ratio = self.settings.failure_ratio.get();
                self.over(now, ratio)
                    .then(|| self.open(now, u, BreakerState::Closed))
            }
            (
                Phase::HalfOpen {
                    sent,
                    passed,
                    failed: f,
                },
                Admission::Probe(round),
            ) if round == self.round => {
                let (passed, f) = if failed {
                    (passed, f + 1)
                } else {
                    (passed + 1, f)
                };
                // Opens at `failureRatio` of the probes; closes once the probes still
                // to end could not bring the failures there.
                let limit =
                    self.settings.failure_ratio.get() * f64::from(self.settings.half_open_probes);
                if f64::from(f) >= limit {
                    return Some(self.open(now, u, BreakerState::HalfOpen));
                }
                if f64::from(
                    self.settings.half_open_probes - passed.min(self.settings.half_open_probes),
                ) >= limit
                {
                    self.phase = Phase::HalfOpen {
                        sent,
                        passed,
                        failed: f,
                    };
                    return None;
                }
                self.phase = Phase::Closed;
                self.reopenings = 0;
                self.counts.clear();
                Some(self.transition(BreakerState::HalfOpen, None))
            }
            // Attempts of calls admitted in another state, or probes of an earlier round.
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

    /// `None` while a call may retry or hedge; else why not: [`CallOutcome::CircuitOpen`]
    /// (open or half-open) or [`CallOutcome::CircuitNoRetry`] (closed, failures at half
    /// the ratio).
    pub(crate) fn retry_refused(&self) -> Option<CallOutcome> {
        let mut m = self.lock();
        if m.retries_allowed(Instant::now()) {
            return None;
        }
        Some(match m.state() {
            BreakerState::Closed => CallOutcome::CircuitNoRetry,
            _ => CallOutcome::CircuitOpen,
        })
    }

    /// `None` while retries may go out; else the answer to a retry that must not, and
    /// its outcome: the retry was not sent (UNAVAILABLE; while open, `CIRCUIT_OPEN` with
    /// the time left open as the retry delay).
    pub(crate) fn refuse_retry(&self, path: &str) -> Option<(tonic::Status, CallOutcome)> {
        let now = Instant::now();
        let mut m = self.lock();
        if m.retries_allowed(now) {
            return None;
        }
        Some(match m.retry_delay(now) {
            Some(wait) => (refusal(path, wait, Sent::Before), CallOutcome::CircuitOpen),
            None => (
                tonic::Status::unavailable(format!(
                    "the retry of {path} was not sent: over half of the circuit breaker's \
                     failureRatio of the recent attempts failed, so retries are off until \
                     fewer fail"
                )),
                CallOutcome::CircuitNoRetry,
            ),
        })
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
            recorded: AtomicU32::new(0),
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

/// Whether the call sent attempts before the breaker refused it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Sent {
    /// Nothing: the refused call never reached a server.
    Nothing,
    /// Earlier attempts; the breaker stopped its retry.
    Before,
}

/// The answer to a call (or a retry) the open breaker refuses: UNAVAILABLE, `ErrorInfo`
/// reason `CIRCUIT_OPEN`, and the time left open as `RetryInfo`.
pub(crate) fn refusal(path: &str, wait: Duration, sent: Sent) -> tonic::Status {
    use tonic_types::{ErrorDetails, StatusExt};
    let mut details = ErrorDetails::with_error_info(
        reason::CIRCUIT_OPEN,
        ERROR_DOMAIN,
        std::collections::HashMap::<String, String>::new(),
    );
    details.set_retry_info(Some(wait));
    let message = match sent {
        Sent::Nothing => format!(
            "circuit breaker open: {path} was not sent (the target kept failing); nothing \
             reached a server, so retrying with the same key after {}ms is safe",
            wait.as_millis()
        ),
        Sent::Before => format!(
            "circuit breaker open: the retry of {path} was not sent (the target kept \
             failing); retrying with the same key after {}ms is safe",
            wait.as_millis()
        ),
    };
    tonic::Status::with_error_details(tonic::Code::Unavailable, message, details)
}

/// A call's place in the breaker: what it was admitted as; each attempt's result is
/// recorded as it ends. A probe dropped before its result gives its place back.
pub(crate) struct CallTicket {
    breaker: CircuitBreaker,
    admission: Admission,
    /// Attempts recorded so far.
    recorded: AtomicU32,
    /// The call ended: nothing more is recorded.
    settled: AtomicBool,
}

impl fmt::Debug for CallTicket {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CallTicket")
            .field("admission", &self.admission)
            .field("recorded", &self.recorded)
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

    /// The breaker that admitted the call (its method's own, or the layer's).
    pub(crate) fn breaker(&self) -> &CircuitBreaker {
        &self.breaker
    }

    /// An attempt of the call ended as `end`: counted now, so that failing retries open
    /// the breaker sooner (and a call under way sees it before its next retry). A hedge
    /// cancelled because another won says nothing about the target.
    pub(crate) fn attempt_ended(&self, end: AttemptEnd, u: f64, target: &str) {
        let code = match end {
            AttemptEnd::Cancelled => return,
            AttemptEnd::Deadline => Some(tonic::Code::DeadlineExceeded),
            end => policy::failure_code(end).ok(),
        };
        if self.settled.load(Ordering::Relaxed) {
            return;
        }
        self.recorded.fetch_add(1, Ordering::Relaxed);
        if self.is_probe() {
            // A probe has one attempt: its result is the call's.
            self.settled.store(true, Ordering::Relaxed);
        }
        self.record(code, u, target);
    }

    /// The call ended: `code` is its status when it did not commit (a committed
    /// response is a success), after `attempts` attempts. Its attempts were recorded as
    /// they ended; a call whose attempts were not (one sent past the attempt loop) counts
    /// as one attempt, and a call that sent nothing counts as nothing (a probe's place is
    /// freed). Once; later calls do nothing.
    pub(crate) fn settle(&self, code: Option<tonic::Code>, attempts: u32, u: f64, target: &str) {
        if self.settled.swap(true, Ordering::Relaxed) || self.recorded.load(Ordering::Relaxed) > 0 {
            return;
        }
        if attempts == 0 {
            if let Admission::Probe(round) = self.admission {
                self.breaker.lock().abandon(round);
            }
            return;
        }
        self.record(code, u, target);
    }

    fn record(&self, code: Option<tonic::Code>, u: f64, target: &str) {
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
