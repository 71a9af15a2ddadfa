//! The breaker's state machine against a small model, and the shared handle under
//! tokio's paused clock.

use std::time::Duration;

use idem_core::config::{CircuitBreakerSettings, Ratio};
use proptest::prelude::*;
use tokio::time::Instant;

use super::*;

fn settings(ratio: f64, min_calls: u32, probes: u32) -> CircuitBreakerSettings {
    CircuitBreakerSettings {
        failure_ratio: Ratio::new(ratio).unwrap(),
        min_calls,
        // Longer than any test run: the model needs no window arithmetic (the window
        // itself is tested in `window.rs`).
        window: Duration::from_secs(100_000),
        open_for: Duration::from_millis(100),
        half_open_probes: probes,
        ..CircuitBreakerSettings::default()
    }
}

/// The breaker as the issue states it, written the obvious way.
#[derive(Debug)]
enum Model {
    Closed { calls: u64, failures: u64 },
    Open { until: Instant },
    HalfOpen { round: u64, out: u32, passed: u32 },
}

#[derive(Debug, Clone)]
enum Op {
    Advance(u64),
    Admit,
    /// The oldest call still out ends, failed or not.
    End(bool, f64),
    /// The oldest call still out is dropped by its caller.
    Drop,
}

fn ops() -> impl Strategy<Value = Vec<Op>> {
    proptest::collection::vec(
        prop_oneof![
            (0u64..200).prop_map(Op::Advance),
            Just(Op::Admit),
            Just(Op::Admit),
            (any::<bool>(), 0.0f64..1.0).prop_map(|(f, u)| Op::End(f, u)),
            (any::<bool>(), 0.0f64..1.0).prop_map(|(f, u)| Op::End(f, u)),
            Just(Op::Drop),
        ],
        1..200,
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
        let mut model = Model::Closed { calls: 0, failures: 0 };
        let (mut round, mut reopenings) = (0u64, 0u32);
        let mut out: std::collections::VecDeque<Admission> = Default::default();
        for op in ops {
            match op {
                Op::Advance(ms) => now += Duration::from_millis(ms),
                Op::Admit => {
                    if let Model::Open { until } = model && now >= until {
                        round += 1;
                        model = Model::HalfOpen { round, out: 0, passed: 0 };
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
                Op::End(failed, u) => {
                    let Some(admitted) = out.pop_front() else { continue };
                    let opens = |reopenings: &mut u32| {
                        let base = s.open_for * (1 << (*reopenings).min(3));
                        *reopenings += 1;
                        Model::Open { until: now + jittered(base, u) }
                    };
                    let next = match (&mut model, admitted) {
                        (Model::Closed { calls, failures }, Admission::Call) => {
                            *calls += 1;
                            *failures += u64::from(failed);
                            let trips = *calls >= u64::from(min_calls)
                                && *failures as f64 >= ratio * *calls as f64;
                            (failed && trips).then(|| opens(&mut reopenings))
                        }
                        (Model::HalfOpen { round: r, passed, .. }, Admission::Probe(p))
                            if p == *r =>
                        {
                            if failed {
                                Some(opens(&mut reopenings))
                            } else {
                                *passed += 1;
                                (*passed == probes).then(|| {
                                    reopenings = 0;
                                    Model::Closed { calls: 0, failures: 0 }
                                })
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
            let state = match model {
                Model::Closed { .. } => BreakerState::Closed,
                Model::Open { .. } => BreakerState::Open,
                Model::HalfOpen { .. } => BreakerState::HalfOpen,
            };
            prop_assert_eq!(m.state(), state);
            prop_assert_eq!(m.retries_allowed(), state == BreakerState::Closed);
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

#[tokio::test(start_paused = true)]
async fn probes_half_open_close_and_a_dropped_probe_frees_its_place() {
    let s = settings(1.0, 1, 2);
    let b = CircuitBreaker::new(s);
    let first = b.admit("t");
    first.settle(Some(tonic::Code::Unavailable), 0.5, "t");
    assert_eq!(b.state(), BreakerState::Open);
    assert!(!b.retries_allowed());
    assert!(matches!(b.admit("t").admission(), Admission::Refuse(_)));
    tokio::time::advance(s.open_for).await;
    let p1 = b.admit("t");
    let p2 = b.admit("t");
    assert!(p1.is_probe() && p2.is_probe());
    assert_eq!(b.state(), BreakerState::HalfOpen);
    assert!(!b.retries_allowed(), "no retries while half-open");
    assert!(matches!(b.admit("t").admission(), Admission::Refuse(_)));
    drop(p2);
    let p3 = b.admit("t");
    assert!(p3.is_probe(), "the dropped probe's place is free");
    p1.settle(None, 0.5, "t");
    p1.settle(Some(tonic::Code::Unavailable), 0.5, "t"); // settled once: ignored
    assert_eq!(b.state(), BreakerState::HalfOpen);
    p3.settle(Some(tonic::Code::Ok), 0.5, "t");
    assert_eq!(b.state(), BreakerState::Closed);
    assert_eq!(b.transitions(BreakerState::Open), 1);
    assert_eq!(b.transitions(BreakerState::HalfOpen), 1);
    assert_eq!(b.transitions(BreakerState::Closed), 1);
    assert_eq!(b.refused(), 2);
}
