//! The breaker's state machine against a small model (times from tokio's paused clock),
//! and the shared handle under it.

use std::time::Duration;

use idem_core::config::{CircuitBreakerSettings, Ratio};
use proptest::prelude::*;
use tokio::time::Instant;

use super::*;

fn settings(ratio: f64, min_calls: u32, probes: u32) -> CircuitBreakerSettings {
    CircuitBreakerSettings {
        failure_ratio: Ratio::new(ratio).unwrap(),
        min_calls,
        window: WINDOW,
        open_for: Duration::from_millis(100),
        half_open_probes: probes,
        ..CircuitBreakerSettings::default()
    }
}

/// The model's window: a second in ten slots, with steps of up to 300 ms, so attempts
/// leave it during a run.
const WINDOW: Duration = Duration::from_secs(1);

/// The breaker as the issue states it, written the obvious way: every attempt of the
/// window kept with its time.
#[derive(Debug)]
enum Model {
    Closed {
        attempts: Vec<(Instant, bool)>,
    },
    Open {
        until: Instant,
    },
    HalfOpen {
        round: u64,
        out: u32,
        passed: u32,
        failed: u32,
    },
}

impl Model {
    /// The attempts and failures of the window at `now`: those in its last ten tenths
    /// (counted from the machine's start, `t0`).
    fn sums(attempts: &[(Instant, bool)], t0: Instant, now: Instant) -> (u64, u64) {
        let slot = |t: Instant| (t - t0).as_nanos() / (WINDOW / 10).as_nanos();
        let kept = attempts.iter().filter(|(t, _)| slot(now) - slot(*t) < 10);
        kept.fold((0, 0), |(a, f), (_, failed)| {
            (a + 1, f + u64::from(*failed))
        })
    }
}

#[derive(Debug, Clone)]
enum Op {
    Advance(u64),
    Admit,
    /// An attempt of the oldest call still out ends, failed or not; `last`: the call
    /// ends with it (a probe always does).
    Attempt {
        failed: bool,
        last: bool,
        u: f64,
    },
    /// The oldest call still out is dropped by its caller.
    Drop,
}

fn ops() -> impl Strategy<Value = Vec<Op>> {
    let attempt = (any::<bool>(), any::<bool>(), 0.0f64..1.0)
        .prop_map(|(failed, last, u)| Op::Attempt { failed, last, u });
    proptest::collection::vec(
        prop_oneof![
            (0u64..300).prop_map(Op::Advance),
            Just(Op::Admit),
            Just(Op::Admit),
            attempt.clone(),
            attempt.clone(),
            attempt,
            Just(Op::Drop),
        ],
        1..300,
    )
}

proptest! {
    #[test]
    fn the_machine_follows_the_model(
        ratio in 0.05f64..=1.0,
        min_calls in 1u32..8,
        probes in 1u32..4,
        ops in ops(),
    ) {
        let s = settings(ratio, min_calls, probes);
        let t0 = Instant::now();
        let mut now = t0;
        let mut m = Machine::new(s, now);
        let mut model = Model::Closed { attempts: Vec::new() };
        let (mut round, mut reopenings) = (0u64, 0u32);
        let mut out: std::collections::VecDeque<Admission> = Default::default();
        for op in ops {
            match op {
                Op::Advance(ms) => now += Duration::from_millis(ms),
                Op::Admit => {
                    if let Model::Open { until } = model && now >= until {
                        round += 1;
                        model = Model::HalfOpen { round, out: 0, passed: 0, failed: 0 };
                    }
                    let expected = match &mut model {
                        Model::Closed { .. } => Admission::Call,
                        Model::Open { until } => Admission::Refuse(*until - now),
                        Model::HalfOpen { round, out, .. } if *out < probes => {
                            *out += 1;
                            Admission::Probe(*round)
                        }
                        Model::HalfOpen { .. } => Admission::Refuse(s.open_for / 10),
                    };
                    let (got, _) = m.admit(now);
                    prop_assert_eq!(got, expected);
                    if !matches!(got, Admission::Refuse(_)) {
                        out.push_back(got);
                    }
                }
                Op::Attempt { failed, last, u } => {
                    let Some(&admitted) = out.front() else { continue };
                    if last || matches!(admitted, Admission::Probe(_)) {
                        out.pop_front();
                    }
                    let opens = |reopenings: &mut u32| {
                        let base = s.open_for * (1 << (*reopenings).min(3));
                        *reopenings += 1;
                        Model::Open { until: now + jittered(base, u) }
                    };
                    let next = match (&mut model, admitted) {
                        (Model::Closed { attempts }, Admission::Call) => {
                            attempts.push((now, failed));
                            let (a, f) = Model::sums(attempts, t0, now);
                            let trips = a >= u64::from(min_calls) && f as f64 >= ratio * a as f64;
                            (failed && trips).then(|| opens(&mut reopenings))
                        }
                        (Model::HalfOpen { round: r, passed, failed: f, .. }, Admission::Probe(p))
                            if p == *r =>
                        {
                            *passed += u32::from(!failed);
                            *f += u32::from(failed);
                            // The probes' failure ratio reached, or out of reach.
                            let limit = ratio * f64::from(probes);
                            if f64::from(*f) >= limit {
                                Some(opens(&mut reopenings))
                            } else if f64::from(probes - *passed) < limit {
                                reopenings = 0;
                                Some(Model::Closed { attempts: Vec::new() })
                            } else {
                                None
                            }
                        }
                        _ => None,
                    };
                    let before = m.state();
                    let change = m.record(now, admitted, failed, u);
                    if let Some(next) = next {
                        model = next;
                        prop_assert!(change.is_some_and(|t| t.from == before));
                    } else {
                        prop_assert!(change.is_none());
                    }
                }
                Op::Drop => {
                    let Some(admitted) = out.pop_front() else { continue };
                    if let (Model::HalfOpen { round: r, out, .. }, Admission::Probe(p)) =
                        (&mut model, admitted)
                        && p == *r
                    {
                        *out -= 1;
                    }
                    if let Admission::Probe(p) = admitted {
                        m.abandon(p);
                    }
                }
            }
            let (state, retries) = match &model {
                Model::Closed { attempts } => {
                    // Retries stop at half the ratio, with the minimum volume.
                    let (a, f) = Model::sums(attempts, t0, now);
                    let off = a >= u64::from(min_calls) && f as f64 >= ratio / 2.0 * a as f64;
                    (BreakerState::Closed, !off)
                }
                Model::Open { .. } => (BreakerState::Open, false),
                Model::HalfOpen { .. } => (BreakerState::HalfOpen, false),
            };
            prop_assert_eq!(m.state(), state);
            prop_assert_eq!(m.retries_allowed(now), retries);
            prop_assert_eq!(m.retry_delay(now).is_none(), state == BreakerState::Closed);
        }
    }

    /// The open time grows ×2 per reopening in a row, up to 8 × openFor, ± 20 %.
    #[test]
    fn open_times_grow_within_bounds(failures in 1usize..8, u in 0.0f64..1.0) {
        let s = settings(1.0, 1, 1);
        let mut now = Instant::now();
        let mut m = Machine::new(s, now);
        let (a, _) = m.admit(now);
        let mut change = m.record(now, a, true, u);
        for k in 0..failures {
            let open_for = change.unwrap().open_for.unwrap();
            let base = s.open_for * (1 << k.min(3));
            prop_assert!(open_for >= base.mul_f64(0.8) && open_for <= base.mul_f64(1.2));
            now += open_for;
            let (probe, t) = m.admit(now);
            prop_assert_eq!(t.map(|t| t.to), Some(BreakerState::HalfOpen));
            change = m.record(now, probe, true, u);
        }
    }
}

#[test]
fn closed_opens_at_the_ratio_only_with_the_minimum_volume() {
    let s = settings(0.5, 4, 2);
    let now = Instant::now();
    let mut m = Machine::new(s, now);
    for failed in [true, true, true] {
        let (a, _) = m.admit(now);
        assert_eq!(m.record(now, a, failed, 0.5), None, "under minCalls");
    }
    let (a, _) = m.admit(now);
    let t = m.record(now, a, false, 0.5);
    assert_eq!(t, None, "a success never opens it");
    let (a, _) = m.admit(now);
    let t = m.record(now, a, true, 0.5).unwrap();
    assert_eq!((t.from, t.to), (BreakerState::Closed, BreakerState::Open));
    assert_eq!(t.open_for, Some(s.open_for));
    let (refused, _) = m.admit(now + Duration::from_millis(40));
    assert_eq!(refused, Admission::Refuse(Duration::from_millis(60)));
}

/// Retries hide a target's failures from its calls' results: here every call fails
/// twice, then succeeds on its third attempt. No call fails, but two attempts in three
/// do, and the breaker (counting attempts) opens.
#[test]
fn failing_attempts_open_it_although_every_call_succeeds() {
    let s = settings(0.5, 6, 1);
    let now = Instant::now();
    let mut m = Machine::new(s, now);
    let (a, _) = m.admit(now);
    assert_eq!(m.record(now, a, true, 0.5), None);
    assert_eq!(m.record(now, a, true, 0.5), None);
    assert_eq!(
        m.record(now, a, false, 0.5),
        None,
        "the first call succeeded"
    );
    let (a, _) = m.admit(now);
    assert_eq!(m.record(now, a, true, 0.5), None);
    assert_eq!(m.record(now, a, true, 0.5), None);
    assert_eq!(
        m.record(now, a, false, 0.5),
        None,
        "6 attempts, 4 failed, last OK"
    );
    let (a, _) = m.admit(now);
    let t = m.record(now, a, true, 0.5).unwrap();
    assert_eq!(t.to, BreakerState::Open, "5 of 7 attempts failed");
}

/// At half the failure ratio the breaker stops retries but still lets calls out; at
/// the ratio it opens. Successes bring retries back.
#[test]
fn retries_stop_at_half_the_ratio_before_it_opens() {
    let s = settings(0.5, 4, 1);
    let now = Instant::now();
    let mut m = Machine::new(s, now);
    let (a, _) = m.admit(now);
    for _ in 0..3 {
        m.record(now, a, false, 0.5);
    }
    assert_eq!(m.record(now, a, true, 0.5), None);
    assert!(
        !m.retries_allowed(now),
        "1 of 4 failed: a quarter, half of 0.5"
    );
    assert_eq!(m.state(), BreakerState::Closed);
    assert_eq!(m.admit(now).0, Admission::Call, "calls still go out");
    m.record(now, a, false, 0.5);
    assert!(m.retries_allowed(now), "1 of 5");
    // The window passes: the counts leave it, and so does the volume.
    let later = now + WINDOW;
    m.record(later, a, true, 0.5);
    assert!(
        m.retries_allowed(later),
        "1 attempt in the window, under minCalls"
    );
    assert_eq!(m.state(), BreakerState::Closed);
}

/// The probes are judged by the failure ratio: with 3 probes and 0.5, one failure of
/// three closes it, two reopen it.
#[test]
fn probes_close_it_under_the_ratio_and_reopen_it_at_it() {
    let s = settings(0.5, 1, 3);
    let mut now = Instant::now();
    let mut m = Machine::new(s, now);
    let (a, _) = m.admit(now);
    assert!(m.record(now, a, true, 0.5).is_some());
    for (results, to) in [
        ([true, false, false], BreakerState::Closed),
        ([false, true, true], BreakerState::Open),
    ] {
        now += Duration::from_secs(1);
        if m.state() == BreakerState::Closed {
            let (a, _) = m.admit(now);
            assert!(m.record(now, a, true, 0.5).is_some(), "opens again");
            now += Duration::from_secs(1);
        }
        let probes: Vec<_> = (0..3).map(|_| m.admit(now).0).collect();
        assert!(probes.iter().all(|p| matches!(p, Admission::Probe(_))));
        let mut last = None;
        for (p, failed) in probes.iter().zip(results) {
            if let Some(t) = m.record(now, *p, failed, 0.5) {
                last = Some(t.to);
            }
        }
        assert_eq!(last, Some(to), "{results:?}");
    }
}

#[tokio::test(start_paused = true)]
async fn probes_half_open_close_and_a_dropped_probe_frees_its_place() {
    let s = settings(0.5, 1, 2);
    let b = CircuitBreaker::new(s);
    let first = b.admit("t");
    first.settle(Some(tonic::Code::Unavailable), 1, 0.5, "t");
    assert_eq!(b.state(), BreakerState::Open);
    assert_eq!(b.retry_refused(), Some(CallOutcome::CircuitOpen));
    assert!(matches!(b.admit("t").admission(), Admission::Refuse(_)));
    tokio::time::advance(s.open_for).await;
    let p1 = b.admit("t");
    let p2 = b.admit("t");
    assert!(p1.is_probe() && p2.is_probe());
    assert_eq!(b.state(), BreakerState::HalfOpen);
    assert_eq!(
        b.retry_refused(),
        Some(CallOutcome::CircuitOpen),
        "no retries while half-open"
    );
    assert!(matches!(b.admit("t").admission(), Admission::Refuse(_)));
    drop(p2);
    let p3 = b.admit("t");
    assert!(p3.is_probe(), "the dropped probe's place is free");
    let p4 = b.admit("t");
    assert!(!p4.is_probe());
    p3.settle(Some(tonic::Code::DeadlineExceeded), 0, 0.5, "t");
    let p5 = b.admit("t");
    assert!(
        p5.is_probe(),
        "a probe that sent nothing frees its place too"
    );
    p1.attempt_ended(AttemptEnd::Committed, 0.5, "t");
    p1.settle(Some(tonic::Code::Unavailable), 1, 0.5, "t"); // recorded already: ignored
    assert_eq!(b.state(), BreakerState::HalfOpen);
    p5.settle(Some(tonic::Code::Ok), 1, 0.5, "t");
    assert_eq!(b.state(), BreakerState::Closed);
    assert_eq!(b.retry_refused(), None);
    assert_eq!(b.transitions(BreakerState::Open), 1);
    assert_eq!(b.transitions(BreakerState::HalfOpen), 1);
    assert_eq!(b.transitions(BreakerState::Closed), 1);
    assert_eq!(b.refused(), 3);
}

/// A call's attempts count as they end, a cancelled hedge not at all, and the call's end
/// adds nothing more.
#[tokio::test(start_paused = true)]
async fn attempts_count_as_they_end() {
    let b = CircuitBreaker::new(settings(0.5, 3, 1));
    let call = b.admit("t");
    call.attempt_ended(AttemptEnd::Status(tonic::Code::Unavailable), 0.5, "t");
    call.attempt_ended(AttemptEnd::Cancelled, 0.5, "t");
    call.attempt_ended(AttemptEnd::TransportError, 0.5, "t");
    assert_eq!(
        b.state(),
        BreakerState::Closed,
        "2 attempts, under minCalls"
    );
    call.settle(Some(tonic::Code::Unavailable), 3, 0.5, "t");
    assert_eq!(
        b.state(),
        BreakerState::Closed,
        "the end is not another attempt"
    );
    let other = b.admit("t");
    other.attempt_ended(AttemptEnd::Deadline, 0.5, "t");
    assert_eq!(b.state(), BreakerState::Open, "3 attempts failed");
    assert!(b.refuse_retry("/a.B/C").is_some_and(|(s, o)| {
        s.code() == tonic::Code::Unavailable && o == CallOutcome::CircuitOpen
    }));
}
