//! Counters of the idempotency layer.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

macro_rules! stats {
    ($($(#[$doc:meta])* $name:ident,)*) => {
        #[derive(Debug, Default)]
        pub(crate) struct Counters { $(pub(crate) $name: AtomicU64,)* }

        /// A point-in-time copy of [`IdempotencyStats`].
        #[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
        pub struct StatsSnapshot { $($(#[$doc])* pub $name: u64,)* }

        impl IdempotencyStats {
            /// Reads every counter.
            pub fn snapshot(&self) -> StatsSnapshot {
                StatsSnapshot { $($name: self.0.$name.load(Ordering::Relaxed),)* }
            }
        }
    };
}

stats! {
    /// Protected calls whose handler ran under a claimed record.
    executed,
    /// Duplicates answered from a stored response.
    replayed,
    /// Duplicates that found the key in flight and waited (counted once per call).
    waited,
    /// Claims that found the key in flight (counted per claim attempt).
    in_flight_hits,
    /// Duplicates refused because the key was used with a different request.
    mismatched,
    /// Duplicates answered ABORTED (in-flight policy ABORT).
    aborted,
    /// Duplicates of a completed call whose response was not retained.
    not_retained_hits,
    /// Calls refused before reaching the store (key, tenant, body size or encoding).
    rejected,
    /// Outcomes stored (complete).
    stored,
    /// Responses stored as "not retained" because they were over the size limit.
    not_retained,
    /// Records released so a retry runs again.
    released,
    /// Completions or releases the store refused because the fence was stale (another
    /// claimant took the record over after this one's lease ended).
    stale_fence,
    /// Lease renewals that failed.
    renew_failures,
    /// Store calls that failed (claim, complete, release, wait).
    store_errors,
    /// Handlers run without a record because the store failed and the method is fail-open.
    fail_open_runs,
    /// Duplicates that gave up waiting at their deadline.
    deadline_exceeded,
    /// Protected calls refused because the store (or the tenant's share) was full.
    store_full,
    /// Protected calls refused because the layer was running as many handlers as it
    /// allows (`maxHandlersInFlight`).
    overloaded,
    /// Completions or releases sent again after the store refused them transiently.
    record_retries,
    /// Outcomes (completions or releases) the store did not take within
    /// `completionRetryTimeout`: their records were left to expire with their lease.
    unrecorded,
}

/// Counters of one layer (shared by its clones). Cheap to clone.
#[derive(Debug, Clone, Default)]
pub struct IdempotencyStats(Arc<Counters>);

impl IdempotencyStats {
    /// Adds one to the counter `f` picks.
    pub(crate) fn inc(&self, f: impl FnOnce(&Counters) -> &AtomicU64) {
        f(&self.0).fetch_add(1, Ordering::Relaxed);
    }
}
