//! The A6 retry decision, apart from the mechanism that sends attempts and sleeps.
//!
//! [`decide`] looks at how one attempt ended and at the call so far, and says whether
//! the call is done (and why) or retries after a wait. It does no I/O and reads no
//! clock: the attempt loop (`engine/attempts.rs`) measures the time left, asks the
//! throttle through a closure, and does what the decision says. That keeps every A6 rule in one
//! place, testable without a network (see the property tests below).
//!
//! The other pure decisions sit beside it: [`hedge`] (the hedging decision), [`backoff`],
//! [`pushback`] (what the server asked) and [`throttle`] (the token bucket).

pub mod backoff;
pub(crate) mod breaker;
pub(crate) mod budget;
pub(crate) mod gate;
pub(crate) mod hedge;
pub(crate) mod pushback;
pub(crate) mod throttle;
pub(crate) mod window;

use std::time::Duration;

use idem_core::config::RetryPolicy;
use tonic::Code;

use crate::retry::outcome::{AttemptEnd, CallOutcome};
use crate::retry::policy::backoff::Jitter;
use crate::retry::policy::gate::RetryGate;
use crate::retry::policy::pushback::Pushback;

/// What an attempt told the client, as far as the decision cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Attempted {
    pub(crate) end: AttemptEnd,
    /// `grpc-retry-pushback-ms`.
    pub(crate) pushback: Pushback,
    /// `google.rpc.RetryInfo.retry_delay`: a minimum wait.
    pub(crate) retry_info: Option<Duration>,
}

/// What the call has done so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct CallState {
    /// Attempts made, including the one just ended.
    pub(crate) attempts: u32,
    /// Retries since the start or the last valid pushback: the backoff exponent.
    pub(crate) exponent: u32,
}

/// What bounds the next attempt of a call, retried or hedged.
#[derive(Debug, Clone, Copy)]
pub(crate) struct AttemptBounds {
    /// Set when the request is not kept whole any more (it passed a replay limit, or the
    /// caller's body failed): the body is sent once, and this is the outcome when another
    /// attempt would otherwise be made.
    pub(crate) sent_once: Option<CallOutcome>,
    /// Time left before the call's deadline; `None` without a deadline.
    pub(crate) time_left: Option<Duration>,
    /// An attempt must start with at least this much time left.
    pub(crate) min_attempt_time: Duration,
    /// The longest wait a server may ask for (pushback or RetryInfo); longer stops.
    pub(crate) max_retry_delay: Duration,
}

impl AttemptBounds {
    /// Whether an attempt `wait` from now would start past the deadline, or with less
    /// than the minimum attempt time left.
    pub(crate) fn too_late(&self, wait: Duration) -> bool {
        self.time_left
            .is_some_and(|left| wait >= left || left - wait < self.min_attempt_time)
    }
}

/// The limits a retry must fit in.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RetryLimits<'a> {
    pub(crate) policy: &'a RetryPolicy,
    pub(crate) bounds: AttemptBounds,
    pub(crate) jitter: &'a dyn Jitter,
}

/// The decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Decision {
    /// Stop: the last attempt's result goes to the caller.
    Done(CallOutcome),
    /// Send another attempt after this wait.
    RetryAfter(Duration),
}

/// A6's first rule, for retries and hedges alike: response headers (a commit), an OK
/// status or the deadline end the call, with this outcome; any other end is a failure
/// with its code (nothing came back: UNAVAILABLE, as tonic reports a refused connection;
/// a receive timeout, or a hedge cancelled: CANCELLED).
pub(crate) fn failure_code(end: AttemptEnd) -> Result<Code, CallOutcome> {
    match end {
        AttemptEnd::Committed => Err(CallOutcome::Committed),
        AttemptEnd::Status(Code::Ok) => Err(CallOutcome::Ok),
        AttemptEnd::Deadline => Err(CallOutcome::Deadline),
        AttemptEnd::Status(code) => Ok(code),
        AttemptEnd::TransportError => Ok(Code::Unavailable),
        AttemptEnd::RecvTimeout | AttemptEnd::Cancelled => Ok(Code::Cancelled),
    }
}

/// Decides what follows an attempt, in A6's order: success or commit ends the call; a
/// code outside `retryableStatusCodes` ends it (a receive timeout is retried whatever the
/// codes say, as C-core); a body sent once ends it; the throttle counts the failure and
/// may refuse; a pushback may stop; `maxAttempts` ends it; the wait (the backoff, or
/// exactly the pushback, and at least RetryInfo) must not exceed the maximum retry delay
/// when the server asked for it, nor reach the deadline.
///
/// `gate` counts a retryable failure and says whether a retry is still allowed (the A6
/// throttle, the circuit breaker); it is asked at most once, only for failures that A6
/// counts. Its budget is spent last, only for a retry every other rule allows.
/// `state.exponent` advances only when the decision is to retry.
pub(crate) fn decide(
    state: &mut CallState,
    attempted: &Attempted,
    limits: &RetryLimits<'_>,
    mut gate: impl RetryGate,
) -> Decision {
    let code = match failure_code(attempted.end) {
        Ok(code) => code,
        Err(outcome) => return Decision::Done(outcome),
    };
    let timed_out = attempted.end == AttemptEnd::RecvTimeout;
    if !timed_out && !limits.policy.retryable_status_codes().contains(code) {
        return Decision::Done(CallOutcome::NonRetryableCode);
    }
    if let Some(outcome) = limits.bounds.sent_once {
        return Decision::Done(outcome);
    }
    if let Err(outcome) = gate.count_failure() {
        return Decision::Done(outcome);
    }
    if attempted.pushback == Pushback::Stop {
        return Decision::Done(CallOutcome::PushbackStop);
    }
    if state.attempts >= limits.policy.max_attempts() {
        return Decision::Done(CallOutcome::AttemptsExhausted);
    }
    let (wait, exponent) = wait(state.exponent, attempted, limits);
    let Some(wait) = wait else {
        return Decision::Done(CallOutcome::PushbackStop);
    };
    if limits.bounds.too_late(wait) {
        return Decision::Done(CallOutcome::Deadline);
    }
    if let Err(outcome) = gate.spend() {
        return Decision::Done(outcome);
    }
    state.exponent = exponent;
    Decision::RetryAfter(wait)
}

/// The wait before the next attempt and the exponent after it: exactly a valid pushback
/// (resetting the exponent), else the jittered backoff; at least RetryInfo. `None` when
/// the server asks for more than the maximum retry delay.
fn wait(exponent: u32, attempted: &Attempted, limits: &RetryLimits<'_>) -> (Option<Duration>, u32) {
    let (base, exponent, asked) = match attempted.pushback {
        Pushback::Wait(d) => (d, 0, Some(d)),
        _ => {
            let n = exponent.saturating_add(1);
            (backoff::backoff(limits.policy, n, limits.jitter), n, None)
        }
    };
    let asked = asked.max(attempted.retry_info);
    if asked.is_some_and(|d| d > limits.bounds.max_retry_delay) {
        return (None, exponent);
    }
    let wait = attempted.retry_info.map_or(base, |min| base.max(min));
    (Some(wait), exponent)
}

/// `waitForReady`'s wait before sending again to a channel that could not connect:
/// 100 ms, growing ×1.6 per wait up to 2 s (the shape of gRPC's connection backoff, kept
/// short because the channel reconnects on each send), ±20 % jitter.
const READY_INITIAL: Duration = Duration::from_millis(100);
const READY_MULTIPLIER: f64 = 1.6;
const READY_MAX: Duration = Duration::from_secs(2);

/// The wait before sending again to a channel that could not connect, after `waits`
/// such waits, with `left` until the call stops waiting (its deadline, or the layer's
/// limit without one). The last wait is cut to end there, so a channel that connects at
/// the last moment still gets the call; `None` once nothing is left.
pub(crate) fn ready_wait(waits: u32, left: Duration, jitter: &dyn Jitter) -> Option<Duration> {
    if left.is_zero() {
        return None;
    }
    let n = waits.saturating_add(1);
    let base = backoff::base_backoff(READY_INITIAL, READY_MULTIPLIER, READY_MAX, n);
    Some(backoff::jittered(base, jitter.unit()).min(left))
}

#[cfg(test)]
mod strategies;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::retry::policy::backoff::FixedJitter;
    use crate::retry::policy::strategies::{durations, ends, pushbacks};
    use crate::retry::tests::unavailable_policy;
    use idem_core::code::{ALL_CODES, CodeSet};
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn decisions_keep_every_a6_rule(
            end in ends(false),
            pushback in pushbacks(),
            retry_info in proptest::option::of(durations()),
            attempts in 1u32..8,
            exponent in prop_oneof![0u32..6, Just(u32::MAX)],
            max_attempts in 2u32..8,
            initial_ms in 1u64..2_000,
            max_ms in 1u64..100_000,
            multiplier in prop_oneof![0.1f64..10.0, Just(f64::MAX)],
            codes in 0u32..(1 << 17),
            sent_once in proptest::option::of(Just(CallOutcome::BodyTooLarge)),
            time_left in proptest::option::of(durations()),
            min_attempt_time in durations(),
            max_retry_delay in durations(),
            u in 0.0f64..1.0,
            allowed in any::<bool>(),
        ) {
            let codes: CodeSet = ALL_CODES.iter().copied().filter(|c| codes & (1 << *c as u32) != 0).collect();
            let codes = if codes.is_empty() { CodeSet::of(Code::Unavailable) } else { codes };
            let policy = RetryPolicy::new(
                max_attempts,
                Duration::from_millis(initial_ms),
                Duration::from_millis(max_ms),
                multiplier,
                codes,
            ).unwrap();
            let jitter = FixedJitter(u);
            let bounds = AttemptBounds { sent_once, time_left, min_attempt_time, max_retry_delay };
            let limits = RetryLimits { policy: &policy, bounds, jitter: &jitter };
            let attempted = Attempted { end, pushback, retry_info };
            let mut state = CallState { attempts, exponent };
            let mut asked = 0;
            let decision = decide(&mut state, &attempted, &limits, || { asked += 1; allowed });
            prop_assert!(asked <= 1);
            let Decision::RetryAfter(wait) = decision else {
                prop_assert_eq!(state.exponent, exponent, "no retry, no new exponent");
                return Ok(());
            };
            // Only failures with a retryable code (or a receive timeout) are retried.
            let code = match end {
                AttemptEnd::Status(c) => c,
                AttemptEnd::TransportError => Code::Unavailable,
                AttemptEnd::RecvTimeout => Code::Cancelled,
                other => return Err(TestCaseError::fail(format!("retried {other:?}"))),
            };
            prop_assert!(code != Code::Ok);
            prop_assert!(end == AttemptEnd::RecvTimeout || codes.contains(code));
            prop_assert!(allowed && sent_once.is_none() && pushback != Pushback::Stop);
            prop_assert!(attempts < policy.max_attempts(), "attempts never exceed maxAttempts");
            // Never past the deadline, with the minimum attempt time left.
            if let Some(left) = time_left {
                prop_assert!(wait < left && left - wait >= min_attempt_time);
            }
            // Exactly the pushback, or a backoff within A6 bounds; at least RetryInfo.
            let base = match pushback {
                Pushback::Wait(d) => {
                    prop_assert!(d <= max_retry_delay);
                    prop_assert_eq!(state.exponent, 0);
                    d
                }
                _ => {
                    let n = exponent.saturating_add(1);
                    let (lo, hi) = backoff::backoff_bounds(&policy, n);
                    let b = backoff::backoff(&policy, n, &jitter);
                    prop_assert!(lo <= b && b <= hi);
                    prop_assert_eq!(state.exponent, n);
                    b
                }
            };
            match retry_info {
                Some(min) => {
                    prop_assert!(min <= max_retry_delay);
                    prop_assert_eq!(wait, base.max(min));
                }
                None => prop_assert_eq!(wait, base),
            }
        }
    }

    proptest! {
        #[test]
        fn ready_waits_are_short_positive_and_never_past_the_end(
            waits in prop_oneof![0u32..20, Just(u32::MAX)],
            left in durations(),
            u in 0.0f64..1.0,
        ) {
            match ready_wait(waits, left, &FixedJitter(u)) {
                None => prop_assert!(left.is_zero()),
                Some(wait) => {
                    prop_assert!(!wait.is_zero() && wait <= left);
                    prop_assert!(wait <= READY_MAX.mul_f64(1.2));
                    prop_assert!(wait >= READY_INITIAL.mul_f64(0.8).min(left));
                }
            }
        }
    }

    fn limits<'a>(policy: &'a RetryPolicy, jitter: &'a FixedJitter) -> RetryLimits<'a> {
        RetryLimits {
            policy,
            bounds: AttemptBounds {
                sent_once: None,
                time_left: None,
                min_attempt_time: Duration::ZERO,
                max_retry_delay: Duration::from_secs(30),
            },
            jitter,
        }
    }

    #[test]
    fn a_server_wait_over_the_cap_stops_instead_of_parking_the_call() {
        let policy = unavailable_policy(3, Duration::from_millis(20), Duration::from_secs(1), 2.0);
        let jitter = FixedJitter(0.5);
        let l = limits(&policy, &jitter);
        let unavailable = AttemptEnd::Status(Code::Unavailable);
        let decide_one = |pushback, retry_info| {
            let attempted = Attempted {
                end: unavailable,
                pushback,
                retry_info,
            };
            decide(
                &mut CallState {
                    attempts: 1,
                    exponent: 0,
                },
                &attempted,
                &l,
                || true,
            )
        };
        let day = Duration::from_secs(25 * 3600);
        let decade = Duration::from_secs(10 * 365 * 24 * 3600);
        assert_eq!(
            decide_one(Pushback::Wait(day), None),
            Decision::Done(CallOutcome::PushbackStop)
        );
        assert_eq!(
            decide_one(Pushback::Absent, Some(decade)),
            Decision::Done(CallOutcome::PushbackStop)
        );
        assert_eq!(
            decide_one(Pushback::Wait(Duration::from_secs(30)), None),
            Decision::RetryAfter(Duration::from_secs(30))
        );
        assert_eq!(
            decide_one(Pushback::Absent, None),
            Decision::RetryAfter(Duration::from_millis(20))
        );
    }
}
