//! A6 (2024) exponential backoff with ±20 % jitter, computed without overflow.
//!
//! Retry `n` (1-based: the wait before the second attempt is `n = 1`) waits
//! `min(initialBackoff · backoffMultiplier^(n-1), maxBackoff) × U(0.8, 1.2)`. Every step
//! saturates: a huge multiplier, exponent or `maxBackoff` yields [`Duration::MAX`] at worst,
//! never a panic.

use std::fmt;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use idem_core::config::RetryPolicy;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Lower jitter factor (A6: `U(0.8, 1.2)`).
pub const JITTER_LOW: f64 = 0.8;
/// Upper jitter factor (A6: `U(0.8, 1.2)`).
pub const JITTER_HIGH: f64 = 1.2;

/// A source of uniform random numbers for backoff jitter. Injectable so tests are
/// deterministic; the default uses the thread-local RNG.
pub trait Jitter: Send + Sync + fmt::Debug + 'static {
    /// A number in `[0, 1)`. Values outside (or NaN) are clamped into the range.
    fn unit(&self) -> f64;
}

/// [`Jitter`] from `rand`'s thread-local generator. The default.
#[derive(Debug, Default, Clone, Copy)]
pub struct ThreadRngJitter;

impl Jitter for ThreadRngJitter {
    fn unit(&self) -> f64 {
        rand::rng().random::<f64>()
    }
}

/// [`Jitter`] from a seeded [`StdRng`]: the same seed gives the same waits.
#[derive(Debug)]
pub struct SeededJitter(Mutex<StdRng>);

impl SeededJitter {
    /// A generator seeded with `seed`.
    pub fn new(seed: u64) -> Self {
        SeededJitter(Mutex::new(StdRng::seed_from_u64(seed)))
    }
}

impl Jitter for SeededJitter {
    fn unit(&self) -> f64 {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .random::<f64>()
    }
}

/// [`Jitter`] that always returns the same value (tests: `0.0` is the lower bound,
/// `0.5` the midpoint, values near `1.0` the upper bound).
#[derive(Debug, Clone, Copy)]
pub struct FixedJitter(pub f64);

impl Jitter for FixedJitter {
    fn unit(&self) -> f64 {
        self.0
    }
}

fn secs_to_duration(secs: f64) -> Duration {
    if secs.is_nan() || secs <= 0.0 {
        return Duration::ZERO;
    }
    Duration::try_from_secs_f64(secs).unwrap_or(Duration::MAX)
}

/// The backoff before jitter for retry `n` (1-based):
/// `min(initial · multiplier^(n-1), max)`, saturating.
pub fn base_backoff(initial: Duration, multiplier: f64, max: Duration, n: u32) -> Duration {
    let exp = i32::try_from(n.saturating_sub(1)).unwrap_or(i32::MAX);
    let factor = if multiplier.is_finite() && multiplier > 0.0 {
        multiplier.powi(exp)
    } else {
        1.0
    };
    let raw = initial.as_secs_f64() * factor;
    let max_s = max.as_secs_f64();
    // NaN only from 0 · inf, which cannot happen for validated policies; treat as max.
    let capped = if raw.is_nan() { max_s } else { raw.min(max_s) };
    secs_to_duration(capped)
}

/// Applies the A6 jitter to `base`: `base × (0.8 + 0.4·u)` with `u` in `[0, 1)`.
pub fn jittered(base: Duration, u: f64) -> Duration {
    let u = if u.is_nan() { 0.5 } else { u.clamp(0.0, 1.0) };
    let factor = JITTER_LOW + (JITTER_HIGH - JITTER_LOW) * u;
    secs_to_duration(base.as_secs_f64() * factor)
}

/// The jittered wait before retry `n` (1-based) under `policy`.
pub fn backoff(policy: &RetryPolicy, n: u32, jitter: &dyn Jitter) -> Duration {
    let base = base_backoff(
        policy.initial_backoff(),
        policy.backoff_multiplier(),
        policy.max_backoff(),
        n,
    );
    jittered(base, jitter.unit())
}

/// The A6 bounds of the wait before retry `n`: `(0.8·b, 1.2·b)` with `b` the base backoff.
pub fn backoff_bounds(policy: &RetryPolicy, n: u32) -> (Duration, Duration) {
    let base = base_backoff(
        policy.initial_backoff(),
        policy.backoff_multiplier(),
        policy.max_backoff(),
        n,
    );
    (jittered(base, 0.0), jittered(base, 1.0))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::retry::tests::unavailable_policy;
    use idem_core::code::{Code, CodeSet};
    use proptest::prelude::*;

    fn policy(initial_ms: u64, mult: f64, max_ms: u64) -> RetryPolicy {
        unavailable_policy(
            5,
            Duration::from_millis(initial_ms),
            Duration::from_millis(max_ms),
            mult,
        )
    }

    #[test]
    fn grows_then_caps() {
        let p = policy(20, 2.0, 1000);
        let b = |n| base_backoff(p.initial_backoff(), 2.0, p.max_backoff(), n);
        assert_eq!(b(1), Duration::from_millis(20));
        assert_eq!(b(2), Duration::from_millis(40));
        assert_eq!(b(3), Duration::from_millis(80));
        assert_eq!(b(10), Duration::from_millis(1000));
        assert_eq!(b(u32::MAX), Duration::from_millis(1000));
        assert_eq!(
            backoff_bounds(&p, 1),
            (Duration::from_millis(16), Duration::from_millis(24))
        );
    }

    #[test]
    fn seeded_jitter_repeats() {
        let p = policy(20, 2.0, 1000);
        let a = SeededJitter::new(7);
        let b = SeededJitter::new(7);
        for n in 1..6 {
            assert_eq!(backoff(&p, n, &a), backoff(&p, n, &b));
        }
    }

    #[test]
    fn odd_jitter_values_are_clamped() {
        let base = Duration::from_millis(100);
        assert_eq!(jittered(base, f64::NAN), base);
        assert_eq!(jittered(base, -3.0), Duration::from_millis(80));
        assert_eq!(jittered(base, 9.0), Duration::from_millis(120));
        assert_eq!(jittered(Duration::MAX, 1.0), Duration::MAX);
    }

    proptest! {
        #[test]
        fn never_panics_and_stays_in_bounds(
            initial_ns in 1u64..=u64::MAX,
            max_ns in 1u64..=u64::MAX,
            max_secs in prop_oneof![Just(0u64), 0u64..=u64::MAX],
            mult in prop_oneof![0.000_001f64..1e6, Just(f64::MAX), Just(f64::MIN_POSITIVE), 1.0f64..2.0],
            n in prop_oneof![1u32..10, Just(u32::MAX), 0u32..=u32::MAX],
            u in 0.0f64..1.0,
        ) {
            let initial = Duration::from_nanos(initial_ns);
            let max = Duration::new(max_secs, 0).saturating_add(Duration::from_nanos(max_ns));
            let p = RetryPolicy::new(3, initial, max, mult, CodeSet::of(Code::Unavailable)).unwrap();
            let base = base_backoff(initial, mult, max, n);
            // Never above the cap (allowing for f64 rounding of huge values).
            prop_assert!(base.as_secs_f64() <= max.as_secs_f64() * (1.0 + 1e-9));
            let wait = backoff(&p, n, &FixedJitter(u));
            let (lo, hi) = backoff_bounds(&p, n);
            prop_assert!(lo <= wait && wait <= hi, "{lo:?} <= {wait:?} <= {hi:?}");
            prop_assert!(lo.as_secs_f64() >= base.as_secs_f64() * 0.8 * (1.0 - 1e-9));
            prop_assert!(hi.as_secs_f64() <= base.as_secs_f64() * 1.2 * (1.0 + 1e-9) || hi == Duration::MAX);
        }
    }
}
