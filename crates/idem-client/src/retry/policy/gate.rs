//! What may refuse a retry or a hedge besides A6's own rules: the A6 throttle, the
//! circuit breaker and the retry budget, asked in that order.
//!
//! The throttle counts every retryable failure (A6), so it is asked first; an open (or
//! half-open) breaker refuses without spending anything; the budget is spent last, only
//! for a retry that every other rule lets go out.

use crate::retry::outcome::CallOutcome;
use crate::retry::policy::breaker::CircuitBreaker;
use crate::retry::policy::budget::RetryBudget;
use crate::retry::policy::throttle::RetryThrottle;

/// Asked by [`decide`](super::decide) about a retry.
pub(crate) trait RetryGate {
    /// A retryable failure: the throttle counts it. `Err` with why no retry may follow.
    fn count_failure(&mut self) -> Result<(), CallOutcome>;
    /// Every other rule allows the retry: the budget spends on it, or refuses.
    fn spend(&mut self) -> Result<(), CallOutcome> {
        Ok(())
    }
}

/// A bare throttle answer (`true`: allowed), as the decision's tests give it.
impl<F: FnMut() -> bool> RetryGate for F {
    fn count_failure(&mut self) -> Result<(), CallOutcome> {
        self().then_some(()).ok_or(CallOutcome::Throttled)
    }
}

/// The guards of one call's layer generation.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Guards<'a> {
    pub(crate) throttle: Option<&'a RetryThrottle>,
    pub(crate) breaker: Option<&'a CircuitBreaker>,
    pub(crate) budget: Option<&'a RetryBudget>,
}

impl Guards<'_> {
    fn breaker_allows(&self) -> Result<(), CallOutcome> {
        match self.breaker.and_then(CircuitBreaker::retry_refused) {
            Some(outcome) => Err(outcome),
            None => Ok(()),
        }
    }

    /// Whether the hedge now due may go out (the throttle is only read: A6 counts the
    /// failures of hedges as they end, not the hedges).
    pub(crate) fn hedge(&self) -> Result<(), CallOutcome> {
        if !self.throttle.is_none_or(RetryThrottle::is_retry_allowed) {
            return Err(CallOutcome::Throttled);
        }
        self.breaker_allows()?;
        self.clone().spend()
    }
}

impl RetryGate for Guards<'_> {
    fn count_failure(&mut self) -> Result<(), CallOutcome> {
        if !self.throttle.is_none_or(RetryThrottle::record_failure) {
            return Err(CallOutcome::Throttled);
        }
        self.breaker_allows()
    }

    fn spend(&mut self) -> Result<(), CallOutcome> {
        match self.budget {
            Some(b) if !b.withdraw() => Err(CallOutcome::BudgetExhausted),
            _ => Ok(()),
        }
    }
}
