//! The A6 hedging decision, apart from the loop that sends hedges and races them.
//!
//! [`decide`] looks at how one hedge ended and at the call so far, and says whether the
//! call ends with that hedge's result (the others are cancelled) or goes on, and when
//! the next hedge goes out. [`after_send`] and [`may_send`] schedule and gate the next
//! hedge. Like [`policy`](crate::retry::policy), nothing here does I/O or reads a clock: the
//! loop in [`hedge`](crate::retry::engine::race) measures the time left and asks the throttle.
//!
//! A6's rules, as applied here:
//! - the first request goes out at once, each next hedge `hedgingDelay` after the
//!   previous one, up to `maxAttempts` in all;
//! - response headers (the call commits) or an OK status end the call: that hedge wins;
//! - a fatal status (not in `nonFatalStatusCodes`) ends the call with it;
//! - a non-fatal status sends the next hedge at once; with a server pushback of *n* ms,
//!   after *n* ms; a pushback that says stop (negative, unparseable, repeated) sends no
//!   more hedges;
//! - the throttle counts non-fatal failures and pushbacks that say stop; a hedge after the
//!   first goes out only while it allows retries;
//! - a request that is no longer kept whole (it passed a replay limit, or the caller's
//!   stream failed: the call committed to one hedge) sends no more hedges, and its
//!   hedge's failure is not counted by the throttle (as a retry of a body sent once);
//! - when no more hedges may go out and none is still running, the call ends with the
//!   last hedge's status;
//! - no hedge starts past the deadline (or with less than the minimum attempt time
//!   left).

use std::time::Duration;

use idem_core::config::HedgingPolicy;

use crate::retry::outcome::CallOutcome;
use crate::retry::policy::pushback::Pushback;
use crate::retry::policy::{AttemptBounds, Attempted, failure_code};

/// What a hedged call has done so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct HedgeState {
    /// Hedges sent, the first request included.
    pub(crate) sent: u32,
    /// Hedges still running, besides the one being decided on.
    pub(crate) running: u32,
    /// Set once no more hedges may go out: why, the outcome when the last one fails.
    pub(crate) frozen: Option<CallOutcome>,
}

/// The limits the next hedge must fit in.
#[derive(Debug, Clone, Copy)]
pub(crate) struct HedgeLimits<'a> {
    pub(crate) policy: &'a HedgingPolicy,
    pub(crate) bounds: AttemptBounds,
}

/// When the next hedge goes out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum NextHedge {
    /// This long from now (replacing any earlier plan).
    After(Duration),
    /// Never: no more hedges (the state is frozen, with the reason).
    Never,
}

/// The decision after a hedge ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum HedgeDecision {
    /// The call ends with this hedge's result; the others are cancelled.
    Done(CallOutcome),
    /// The other hedges go on; the next one goes out as said.
    Continue(NextHedge),
}

/// When the hedge after the one just sent goes out: `hedgingDelay` later, unless that
/// was the last one or the deadline comes first. The deadline only stops this timer: a
/// non-fatal status may still send the next hedge at once (A6: it "shortcuts" the delay).
pub(crate) fn after_send(state: &mut HedgeState, limits: &HedgeLimits<'_>) -> NextHedge {
    let delay = limits.policy.hedging_delay;
    match state.frozen {
        Some(_) => NextHedge::Never,
        None if state.sent >= limits.policy.max_attempts => {
            freeze(state, CallOutcome::AttemptsExhausted)
        }
        None if limits.bounds.too_late(delay) => NextHedge::Never,
        None => NextHedge::After(delay),
    }
}

/// Whether the hedge now due may go out: `None` to send it; otherwise what follows
/// (A6: a hedge after the first goes out only while the throttle allows retries; the
/// call then ends with the last hedge's status once none is running). `allowed` (the
/// throttle, the circuit breaker, the retry budget) is asked only when no earlier rule
/// froze the hedges, so a refused hedge spends no budget.
pub(crate) fn may_send(
    state: &mut HedgeState,
    allowed: impl FnOnce() -> Result<(), CallOutcome>,
) -> Option<HedgeDecision> {
    let refused = match state.frozen {
        Some(outcome) => outcome,
        None => match allowed() {
            Ok(()) => return None,
            Err(outcome) => outcome,
        },
    };
    let next = freeze(state, refused);
    Some(settle(state, next))
}

/// Decides what follows a hedge that ended, in A6's order: success or commit ends the
/// call (this hedge wins); the deadline ends it; a fatal code ends it; a request no longer
/// kept whole sends no more hedges; a non-fatal code counts against the throttle and sends the next hedge now (or after the server's
/// pushback), unless the throttle, a pushback, `maxAttempts` or the deadline says no
/// more; with no more hedges and none running, the call ends with this one.
///
/// `throttle` counts a failure and says whether retries are still allowed; it is called
/// at most once, only for non-fatal codes and pushbacks that say stop (A6), and not for a
/// request sent once.
pub(crate) fn decide(
    state: &mut HedgeState,
    attempted: &Attempted,
    limits: &HedgeLimits<'_>,
    throttle: impl FnOnce() -> bool,
) -> HedgeDecision {
    let code = match failure_code(attempted.end) {
        Ok(code) => code,
        Err(outcome) => return HedgeDecision::Done(outcome),
    };
    let fatal = !limits.policy.non_fatal_status_codes.contains(code);
    let stop = attempted.pushback == Pushback::Stop;
    if fatal {
        if stop {
            throttle();
        }
        return HedgeDecision::Done(CallOutcome::NonRetryableCode);
    }
    if let Some(outcome) = limits.bounds.sent_once {
        let next = freeze(state, outcome);
        return settle(state, next);
    }
    let next = if !throttle() {
        freeze(state, CallOutcome::Throttled)
    } else if stop {
        freeze(state, CallOutcome::PushbackStop)
    } else {
        let asked = match attempted.pushback {
            Pushback::Wait(d) => Some(d),
            _ => None,
        };
        let wait = asked.max(attempted.retry_info);
        match wait {
            Some(w) if w > limits.bounds.max_retry_delay => {
                freeze(state, CallOutcome::PushbackStop)
            }
            _ => schedule(state, wait.unwrap_or(Duration::ZERO), limits),
        }
    };
    settle(state, next)
}

/// The next hedge `wait` from now, if one may still go out.
fn schedule(state: &mut HedgeState, wait: Duration, limits: &HedgeLimits<'_>) -> NextHedge {
    if state.frozen.is_some() {
        return NextHedge::Never;
    }
    if state.sent >= limits.policy.max_attempts {
        return freeze(state, CallOutcome::AttemptsExhausted);
    }
    if limits.bounds.too_late(wait) {
        return freeze(state, CallOutcome::Deadline);
    }
    NextHedge::After(wait)
}

/// No more hedges; the first reason given is kept.
fn freeze(state: &mut HedgeState, why: CallOutcome) -> NextHedge {
    state.frozen.get_or_insert(why);
    NextHedge::Never
}

/// With no more hedges to come and none running, the call ends.
fn settle(state: &HedgeState, next: NextHedge) -> HedgeDecision {
    match (next, state.frozen) {
        (NextHedge::Never, Some(why)) if state.running == 0 => HedgeDecision::Done(why),
        _ => HedgeDecision::Continue(next),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::retry::AttemptEnd;
    use crate::retry::policy::strategies::{durations, ends, pushbacks};
    use idem_core::code::{ALL_CODES, CodeSet};
    use proptest::prelude::*;
    use tonic::Code;

    fn frozen() -> impl Strategy<Value = Option<CallOutcome>> {
        prop_oneof![
            Just(None),
            Just(Some(CallOutcome::Throttled)),
            Just(Some(CallOutcome::PushbackStop)),
            Just(Some(CallOutcome::AttemptsExhausted)),
            Just(Some(CallOutcome::Deadline)),
            Just(Some(CallOutcome::BodyTooLarge)),
        ]
    }

    fn sent_once() -> impl Strategy<Value = Option<CallOutcome>> {
        prop_oneof![
            Just(None),
            Just(Some(CallOutcome::BodyTooLarge)),
            Just(Some(CallOutcome::ReplayBudgetExhausted)),
            Just(Some(CallOutcome::BodyError)),
        ]
    }

    /// The outcomes a call may end with once its hedges ran out.
    const GAVE_UP: [CallOutcome; 7] = [
        CallOutcome::Throttled,
        CallOutcome::PushbackStop,
        CallOutcome::AttemptsExhausted,
        CallOutcome::Deadline,
        CallOutcome::BodyTooLarge,
        CallOutcome::ReplayBudgetExhausted,
        CallOutcome::BodyError,
    ];

    proptest! {
        #[test]
        fn decisions_keep_every_a6_hedging_rule(
            end in ends(true),
            pushback in pushbacks(),
            retry_info in proptest::option::of(durations()),
            max_attempts in 2u32..=5,
            sent in 1u32..=5,
            running in 0u32..5,
            frozen in frozen(),
            delay in durations(),
            codes in 0u32..(1 << 17),
            time_left in proptest::option::of(durations()),
            min_attempt_time in durations(),
            max_retry_delay in durations(),
            allowed in any::<bool>(),
            sent_once in sent_once(),
        ) {
            let sent = sent.min(max_attempts);
            let non_fatal: CodeSet = ALL_CODES.iter().copied().filter(|c| codes & (1 << *c as u32) != 0).collect();
            let policy = HedgingPolicy { max_attempts, hedging_delay: delay, non_fatal_status_codes: non_fatal };
            let bounds = AttemptBounds { sent_once, time_left, min_attempt_time, max_retry_delay };
            let limits = HedgeLimits { policy: &policy, bounds };
            let attempted = Attempted { end, pushback, retry_info };
            let mut state = HedgeState { sent, running, frozen };
            let mut asked = 0;
            let decision = decide(&mut state, &attempted, &limits, || { asked += 1; allowed });
            prop_assert!(asked <= 1);
            prop_assert_eq!(state.sent, sent, "deciding sends nothing");
            if frozen.is_some() {
                prop_assert_eq!(state.frozen, frozen, "a frozen call stays frozen, for its first reason");
            }
            let code = match end {
                AttemptEnd::Committed => {
                    prop_assert_eq!(decision, HedgeDecision::Done(CallOutcome::Committed));
                    prop_assert_eq!(asked, 0);
                    return Ok(());
                }
                AttemptEnd::Status(Code::Ok) => {
                    prop_assert_eq!(decision, HedgeDecision::Done(CallOutcome::Ok));
                    return Ok(());
                }
                AttemptEnd::Deadline => {
                    prop_assert_eq!(decision, HedgeDecision::Done(CallOutcome::Deadline));
                    return Ok(());
                }
                AttemptEnd::Status(c) => c,
                AttemptEnd::TransportError => Code::Unavailable,
                AttemptEnd::RecvTimeout | AttemptEnd::Cancelled => Code::Cancelled,
            };
            let fatal = !non_fatal.contains(code);
            // The throttle counts non-fatal failures and pushbacks that say stop, only, and
            // never the failure of a request sent once.
            prop_assert_eq!(
                asked == 1,
                (fatal && pushback == Pushback::Stop) || (!fatal && sent_once.is_none())
            );
            if fatal {
                prop_assert_eq!(decision, HedgeDecision::Done(CallOutcome::NonRetryableCode));
                return Ok(());
            }
            if let Some(why) = sent_once {
                // No hedge can follow a request no longer kept whole.
                prop_assert!(!matches!(decision, HedgeDecision::Continue(NextHedge::After(_))));
                prop_assert_eq!(state.frozen, Some(frozen.unwrap_or(why)));
            }
            match decision {
                HedgeDecision::Done(outcome) => {
                    prop_assert_eq!(running, 0, "never ends while another hedge runs");
                    prop_assert!(GAVE_UP.contains(&outcome));
                    prop_assert_eq!(state.frozen, Some(outcome));
                }
                HedgeDecision::Continue(NextHedge::Never) => {
                    prop_assert!(running > 0);
                    prop_assert!(state.frozen.is_some());
                }
                HedgeDecision::Continue(NextHedge::After(wait)) => {
                    prop_assert!(frozen.is_none() && state.frozen.is_none());
                    prop_assert!(allowed && pushback != Pushback::Stop);
                    prop_assert!(sent < max_attempts, "never more than maxAttempts hedges");
                    if let Some(left) = time_left {
                        prop_assert!(wait < left && left - wait >= min_attempt_time);
                    }
                    // At once, or exactly the pushback; at least RetryInfo; never over the cap.
                    let base = match pushback {
                        Pushback::Wait(d) => d,
                        _ => Duration::ZERO,
                    };
                    prop_assert_eq!(wait, base.max(retry_info.unwrap_or(Duration::ZERO)));
                    prop_assert!(wait <= max_retry_delay || wait.is_zero());
                }
            }
            // Whatever came before: a throttle that refuses or a pushback that says stop
            // sends no more hedges.
            if !allowed || pushback == Pushback::Stop {
                prop_assert!(state.frozen.is_some());
            }
        }

        #[test]
        fn hedges_go_out_every_hedging_delay_up_to_max_attempts(
            max_attempts in 2u32..=5,
            sent in 1u32..=5,
            delay in durations(),
            time_left in proptest::option::of(durations()),
            min_attempt_time in durations(),
        ) {
            let sent = sent.min(max_attempts);
            let policy = HedgingPolicy { max_attempts, hedging_delay: delay, non_fatal_status_codes: CodeSet::of(Code::Unavailable) };
            let bounds = AttemptBounds { sent_once: None, time_left, min_attempt_time, max_retry_delay: Duration::MAX };
            let limits = HedgeLimits { policy: &policy, bounds };
            let mut state = HedgeState { sent, running: sent, frozen: None };
            let late = time_left.is_some_and(|left| delay >= left || left - delay < min_attempt_time);
            match after_send(&mut state, &limits) {
                NextHedge::After(wait) => {
                    prop_assert_eq!(wait, delay);
                    prop_assert!(sent < max_attempts);
                    prop_assert!(!late);
                }
                NextHedge::Never if sent >= max_attempts => {
                    prop_assert_eq!(state.frozen, Some(CallOutcome::AttemptsExhausted));
                }
                NextHedge::Never => {
                    // The deadline stops the timer, not the hedges a failure sends at once.
                    prop_assert!(late);
                    prop_assert_eq!(state.frozen, None);
                }
            }
        }
    }

    #[test]
    fn the_throttle_gates_every_hedge_after_the_first() {
        let mut state = HedgeState {
            sent: 1,
            running: 1,
            frozen: None,
        };
        assert_eq!(may_send(&mut state, || Ok(())), None);
        assert_eq!(
            may_send(&mut state, || Err(CallOutcome::Throttled)),
            Some(HedgeDecision::Continue(NextHedge::Never))
        );
        assert_eq!(state.frozen, Some(CallOutcome::Throttled));
        // Frozen stays frozen, even when the bucket refills.
        state.running = 0;
        assert_eq!(
            may_send(&mut state, || panic!("frozen: not asked")),
            Some(HedgeDecision::Done(CallOutcome::Throttled))
        );
    }
}
