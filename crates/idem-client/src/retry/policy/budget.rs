//! The retry budget (`idem.client.retryBudget`): retries and hedges at most a ratio of
//! the calls over a sliding window, plus a minimum rate any client may use.
//!
//! # Why not tower's `TpsBudget`
//! Its shape is the same (Finagle's: deposits per call, withdrawals per retry, ten
//! slots over a window, a reserve of `min_per_sec × ttl`), but three things do not fit:
//! it keeps the ratio as a whole number of deposits per withdrawal,
//! `(1.0 / retry_percent) as isize`, so a ratio of 0.7 allows a retry for every call and
//! 0.3 allows 0.33; it `assert!`s (panics) on a window outside 1 to 60 s and truncates
//! its fractional seconds, where idem validates the config and never panics on it; and
//! it cannot be reconfigured on a reload while keeping what it counted. idem-client
//! would also have to depend on `tower` itself for it (today it needs only
//! `tower-service` and `tower-layer`). So this is the same idea, with the exact ratio.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use idem_core::config::RetryBudgetSettings;
use tokio::time::Instant;

use crate::retry::policy::window::RollingCounts;

const CALLS: usize = 0;
const RETRIES: usize = 1;

/// The budget's arithmetic, with the time passed in.
#[derive(Debug, Clone)]
pub(crate) struct Budget {
    settings: RetryBudgetSettings,
    counts: RollingCounts<2>,
    /// Retries are refused now: logged once per change.
    refusing: bool,
}

impl Budget {
    pub(crate) fn new(settings: RetryBudgetSettings, now: Instant) -> Self {
        Budget {
            settings,
            counts: RollingCounts::new(settings.window, now),
            refusing: false,
        }
    }

    /// A call was made.
    pub(crate) fn deposit(&mut self, now: Instant) {
        self.counts.add(now, CALLS, 1);
    }

    /// Whether one more retry fits: retries in the window, this one included, at most
    /// `ratio × calls + minRetriesPerSecond × window`. A retry that fits is counted.
    pub(crate) fn withdraw(&mut self, now: Instant) -> bool {
        let [calls, retries] = self.counts.sums(now);
        let s = &self.settings;
        let allowed = s.ratio.get() * calls as f64
            + f64::from(s.min_retries_per_second) * s.window.as_secs_f64();
        let fits = (retries + 1) as f64 <= allowed;
        if fits {
            self.counts.add(now, RETRIES, 1);
        }
        fits
    }
}

struct Shared {
    budget: Mutex<Budget>,
    refused: AtomicU64,
}

/// A shared retry budget: every clone of a [`RetryLayer`](crate::retry::RetryLayer)
/// uses the same one, and a config reload keeps what it counted.
///
/// Each call the layer sends deposits one; each retry, and each hedge after the first
/// request, withdraws one and goes out only if it fits: at most `ratio` retries per call
/// over the last `window`, plus `minRetriesPerSecond × window` that any client may make.
/// A retry the budget refuses ends the call with its last attempt's status, reported as
/// [`CallOutcome::BudgetExhausted`](crate::retry::CallOutcome::BudgetExhausted). With the
/// A6 throttle as well, both must allow a retry (the throttle counts the failure first).
///
/// The budget logs a `WARN` when it starts refusing and an `INFO` when a retry fits
/// again, not per call.
#[derive(Clone)]
pub struct RetryBudget(Arc<Shared>);

impl fmt::Debug for RetryBudget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RetryBudget")
            .field("settings", &self.settings())
            .field("refused", &self.refused())
            .finish()
    }
}

impl RetryBudget {
    /// An empty budget with these settings.
    pub fn new(settings: RetryBudgetSettings) -> Self {
        RetryBudget(Arc::new(Shared {
            budget: Mutex::new(Budget::new(settings, Instant::now())),
            refused: AtomicU64::new(0),
        }))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Budget> {
        self.0.budget.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Counts a call.
    pub fn deposit(&self) {
        self.lock().deposit(Instant::now());
    }

    /// Counts a retry if it fits; `false` (and one more refusal) if not.
    pub fn withdraw(&self) -> bool {
        let (fits, changed) = {
            let mut b = self.lock();
            let fits = b.withdraw(Instant::now());
            let changed = b.refusing == fits;
            b.refusing = !fits;
            (fits, changed)
        };
        if !fits {
            self.0.refused.fetch_add(1, Ordering::Relaxed);
        }
        if changed && !fits {
            tracing::warn!(
                "retry budget used up: retries stop until calls without retries refill it"
            );
        } else if changed {
            tracing::info!("retry budget has room again: retries resume");
        }
        fits
    }

    /// Retries and hedges refused so far.
    pub fn refused(&self) -> u64 {
        self.0.refused.load(Ordering::Relaxed)
    }

    /// The current settings.
    pub fn settings(&self) -> RetryBudgetSettings {
        self.lock().settings
    }

    /// Applies new settings; the counts are kept unless the window changes.
    pub fn reconfigure(&self, settings: RetryBudgetSettings) {
        let mut b = self.lock();
        if b.settings.window != settings.window {
            b.counts = RollingCounts::new(settings.window, Instant::now());
        }
        b.settings = settings;
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use idem_core::config::Ratio;

    fn settings(ratio: f64, min: u32, window_s: u64) -> RetryBudgetSettings {
        RetryBudgetSettings {
            ratio: Ratio::new(ratio).unwrap(),
            min_retries_per_second: min,
            window: Duration::from_secs(window_s),
        }
    }

    #[test]
    fn the_ratio_holds_over_the_window_and_is_exact() {
        let t0 = Instant::now();
        let mut b = Budget::new(settings(0.7, 0, 10), t0);
        for _ in 0..10 {
            b.deposit(t0);
        }
        let allowed = (0..20).filter(|_| b.withdraw(t0)).count();
        assert_eq!(allowed, 7, "0.7 of 10 calls, not one per call as TpsBudget");
        // Half a window later the calls still count; a window later they are gone.
        assert!(!b.withdraw(t0 + Duration::from_secs(5)));
        for _ in 0..10 {
            b.deposit(t0 + Duration::from_secs(10));
        }
        assert_eq!(
            (0..20)
                .filter(|_| b.withdraw(t0 + Duration::from_secs(10)))
                .count(),
            7,
            "the first calls and retries left the window together"
        );
    }

    #[test]
    fn the_minimum_lets_a_quiet_client_retry() {
        let t0 = Instant::now();
        let mut b = Budget::new(settings(0.1, 2, 1), t0);
        assert!(b.withdraw(t0) && b.withdraw(t0));
        assert!(!b.withdraw(t0), "2 per second over a 1 s window");
        assert!(b.withdraw(t0 + Duration::from_secs(1)));
    }

    #[tokio::test(start_paused = true)]
    async fn the_shared_budget_counts_refusals_and_keeps_counts_on_reload() {
        let budget = RetryBudget::new(settings(0.5, 0, 10));
        let clone = budget.clone();
        for _ in 0..4 {
            budget.deposit();
        }
        assert!(clone.withdraw() && clone.withdraw());
        assert!(!budget.withdraw());
        assert_eq!(budget.refused(), 1);
        budget.reconfigure(settings(1.0, 0, 10));
        assert!(
            budget.withdraw() && budget.withdraw(),
            "4 calls now allow 4"
        );
        assert!(!budget.withdraw());
        tokio::time::advance(Duration::from_secs(10)).await;
        assert!(!budget.withdraw(), "no calls in the window");
        assert_eq!(clone.refused(), 3);
    }
}
