//! The replay budget: request bytes held for replay by every call of one layer (and its
//! clones), and each call's lease on it.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::retry::CallOutcome;

/// Request bytes held across all calls of one layer (and its clones): kept for replay,
/// or read before a call committed and not yet sent by its committed attempt. Both count
/// against `maxReplayBytesTotal`.
#[derive(Debug)]
pub(crate) struct ReplayBudget {
    /// Every byte held: kept for replay, or waiting to be sent after a commit.
    held: AtomicUsize,
    /// Of `held`, the bytes committed attempts have not sent yet.
    unsent: AtomicUsize,
    limit: AtomicUsize,
}

impl ReplayBudget {
    pub(crate) fn new(limit: usize) -> Self {
        ReplayBudget {
            held: AtomicUsize::new(0),
            unsent: AtomicUsize::new(0),
            limit: AtomicUsize::new(limit),
        }
    }
    pub(crate) fn set_limit(&self, limit: usize) {
        self.limit.store(limit, Ordering::Relaxed);
    }
    /// Bytes kept for replay.
    pub(crate) fn held(&self) -> usize {
        let unsent = self.unsent.load(Ordering::Relaxed);
        self.held.load(Ordering::Relaxed).saturating_sub(unsent)
    }
    /// Every byte held: kept for replay, or not sent yet by a committed attempt.
    pub(crate) fn total(&self) -> usize {
        self.held.load(Ordering::Relaxed)
    }
    /// Bytes read before their call committed that its attempt has not sent yet.
    #[cfg(test)]
    pub(crate) fn unsent(&self) -> usize {
        self.unsent.load(Ordering::Relaxed)
    }
    fn try_reserve(&self, n: usize) -> bool {
        let limit = self.limit.load(Ordering::Relaxed);
        self.held
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |h| {
                h.checked_add(n).filter(|t| *t <= limit)
            })
            .is_ok()
    }
    fn release(counter: &AtomicUsize, n: usize) {
        let _ = counter.fetch_update(Ordering::AcqRel, Ordering::Acquire, |h| {
            Some(h.saturating_sub(n))
        });
    }
}

/// Bytes of one call reserved in the budget; released when dropped (the call ended).
#[derive(Debug)]
pub(crate) struct BudgetLease {
    budget: Arc<ReplayBudget>,
    /// Kept for replay.
    bytes: usize,
    /// Read before the call committed, not yet sent by the committed attempt.
    unsent: usize,
}

impl BudgetLease {
    pub(crate) fn new(budget: Arc<ReplayBudget>) -> Self {
        BudgetLease {
            budget,
            bytes: 0,
            unsent: 0,
        }
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
        let all = self.bytes + self.unsent;
        if all > 0 {
            ReplayBudget::release(&self.budget.held, all);
            ReplayBudget::release(&self.budget.unsent, self.unsent);
            self.bytes = 0;
            self.unsent = 0;
        }
    }

    /// The call committed: nothing is kept for replay any more, but the `unsent` bytes
    /// its attempt has still to send stay counted until [`sent`](Self::sent).
    pub(crate) fn commit(&mut self, unsent: usize) {
        let unsent = unsent.min(self.bytes + self.unsent);
        let free = (self.bytes + self.unsent) - unsent;
        ReplayBudget::release(&self.budget.held, free);
        if unsent >= self.unsent {
            self.budget
                .unsent
                .fetch_add(unsent - self.unsent, Ordering::AcqRel);
        } else {
            ReplayBudget::release(&self.budget.unsent, self.unsent - unsent);
        }
        self.bytes = 0;
        self.unsent = unsent;
    }

    /// Counts `n` more bytes the committed attempt has still to send, whatever the
    /// limit: the message that passed a limit before the first attempt existed, held
    /// behind the messages read before it until the attempt takes it. Counting it keeps
    /// the budget's figure exact; while it is over the limit, no call keeps more for
    /// replay.
    pub(crate) fn hold(&mut self, n: usize) {
        self.unsent += n;
        self.budget.held.fetch_add(n, Ordering::AcqRel);
        self.budget.unsent.fetch_add(n, Ordering::AcqRel);
    }

    /// The committed attempt sent `n` of its unsent bytes.
    pub(crate) fn sent(&mut self, n: usize) {
        let n = n.min(self.unsent);
        self.unsent -= n;
        ReplayBudget::release(&self.budget.held, n);
        ReplayBudget::release(&self.budget.unsent, n);
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
