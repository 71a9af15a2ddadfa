//! Counters of the idempotency layer.

use std::sync::Arc;

use idem_core::striped::Striped;

macro_rules! stats {
    ($($(#[$doc:meta])* $name:ident,)*) => {
        /// A counter of [`IdempotencyStats`]: its place in the [`Striped`] counters.
        #[allow(non_camel_case_types)]
        #[derive(Debug, Clone, Copy)]
        pub(crate) enum Counter { $($name,)* }

        const COUNT: usize = [$(Counter::$name),*].len();

        /// A point-in-time copy of [`IdempotencyStats`].
        #[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
        pub struct StatsSnapshot { $($(#[$doc])* pub $name: u64,)* }

        impl IdempotencyStats {
            /// Reads every counter.
            pub fn snapshot(&self) -> StatsSnapshot {
                StatsSnapshot { $($name: self.0.get(Counter::$name as usize),)* }
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
    /// allows (`maxHandlersInFlight`, the tenant's `maxHandlersPerTenant`, or
    /// `maxDetachedHandlers` runs whose caller went away).
    overloaded,
    /// Completions or releases sent again after the store refused them transiently.
    record_retries,
    /// Outcomes (completions or releases) the store did not take within
    /// `completionRetryTimeout`: their records were left to expire with their lease.
    unrecorded,
    /// Duplicates refused instead of waiting: as many waited as the layer
    /// (`maxWaiters`) or the tenant (`maxWaitersPerTenant`) allows.
    waiters_refused,
    /// Duplicates whose call in progress ended without an outcome while they waited:
    /// holding only the fingerprint, they answered with a retry delay instead of
    /// running.
    ended_while_waiting,
}

/// Counters of one layer (shared by its clones). Cheap to clone. Each worker thread
/// counts in a stripe of its own, so counting every call moves no cache line between
/// the cores.
#[derive(Clone, Default)]
pub struct IdempotencyStats(Arc<Striped<COUNT>>);

impl std::fmt::Debug for IdempotencyStats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("IdempotencyStats")
            .field(&self.snapshot())
            .finish()
    }
}

impl IdempotencyStats {
    /// Adds one to counter `c`.
    pub(crate) fn inc(&self, c: Counter) {
        self.0.add(c as usize);
    }
}
