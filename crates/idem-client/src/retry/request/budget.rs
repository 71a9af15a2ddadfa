//! The replay budget: request bytes held for replay by every call of one layer (and its
//! clones), and each call's lease on it.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::retry::CallOutcome;

/// Bytes held for replay across all calls of one layer (and its clones).
#[derive(Debug)]
pub(crate) struct ReplayBudget {
    held: AtomicUsize,
    limit: AtomicUsize,
}

impl ReplayBudget {
    pub(crate) fn new(limit: usize) -> Self {
        ReplayBudget {
            held: AtomicUsize::new(0),
            limit: AtomicUsize::new(limit),
        }
    }
    pub(crate) fn set_limit(&self, limit: usize) {
        self.limit.store(limit, Ordering::Relaxed);
    }
    pub(crate) fn held(&self) -> usize {
        self.held.load(Ordering::Relaxed)
    }
    fn try_reserve(&self, n: usize) -> bool {
        let limit = self.limit.load(Ordering::Relaxed);
        self.held
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |h| {
                h.checked_add(n).filter(|t| *t <= limit)
            })
            .is_ok()
    }
    fn release(&self, n: usize) {
        let _ = self
            .held
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |h| {
                Some(h.saturating_sub(n))
            });
    }
}

/// Bytes of one call reserved in the budget; released when dropped (the call ended).
#[derive(Debug)]
pub(crate) struct BudgetLease {
    budget: Arc<ReplayBudget>,
    bytes: usize,
}

impl BudgetLease {
    pub(crate) fn new(budget: Arc<ReplayBudget>) -> Self {
        BudgetLease { budget, bytes: 0 }
    }
    pub(crate) fn reserve(&mut self, n: usize) -> bool {
        if self.budget.try_reserve(n) {
            self.bytes += n;
            true
        } else {
            false
        }
    }
    pub(crate) fn release_all(&mut self) {
        if self.bytes > 0 {
            self.budget.release(self.bytes);
            self.bytes = 0;
        }
    }
}

impl Drop for BudgetLease {
    fn drop(&mut self) {
        self.release_all();
    }
}

impl BudgetLease {
    /// gRFC A6's rule for a call that keeps `kept` bytes for replay and reads `len` more:
    /// they are kept (reserved here) while the call stays within `cap`
    /// (`maxReplayBytesPerCall`) and what the layer's `maxReplayBytesTotal` has left;
    /// otherwise the limit they would pass, and the call commits.
    pub(crate) fn keep(&mut self, kept: usize, len: usize, cap: usize) -> Result<(), Overflow> {
        if kept.saturating_add(len) > cap {
            return Err(Overflow::PerCall);
        }
        if !self.reserve(len) {
            return Err(Overflow::Budget);
        }
        Ok(())
    }
}

/// Why a call's request is not kept for replay (the call is committed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Overflow {
    /// It passed `maxReplayBytesPerCall`.
    PerCall,
    /// It passed what is left of `maxReplayBytesTotal`.
    Budget,
    /// Reading the caller's body failed.
    Error,
}

impl Overflow {
    /// The call's outcome when a retry (or hedge) would otherwise follow.
    pub(crate) fn outcome(self) -> CallOutcome {
        match self {
            Overflow::PerCall => CallOutcome::BodyTooLarge,
            Overflow::Budget => CallOutcome::ReplayBudgetExhausted,
            Overflow::Error => CallOutcome::BodyError,
        }
    }
}
