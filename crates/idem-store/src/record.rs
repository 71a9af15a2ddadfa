//! [`RecordRef`]: the record a protected handler runs under, handed to the handler so it
//! can complete that record itself, inside its own database transaction.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use crate::{Fence, Scope};

/// The record a protected handler runs under. `idem-server` puts it into the request
/// extensions of every protected call it runs (beside `RecordFence`); read it with
/// `request.extensions().get::<RecordRef>()`.
///
/// A store whose records live in the service's own database can complete the record in
/// the handler's transaction, so the handler's writes and the stored reply commit
/// together: `idem-postgres`'s `PostgresStore::begin_for` does that. A handler that does
/// not use it changes nothing: the layer records the outcome after the handler returns.
///
/// Clones share one "completed in the handler's transaction" mark (see
/// [`mark_completed`](Self::mark_completed)).
#[derive(Debug, Clone)]
pub struct RecordRef {
    scope: Scope,
    fence: Fence,
    record_ttl: Duration,
    lease_ttl: Duration,
    completed: Arc<AtomicBool>,
}

impl RecordRef {
    /// The record at `scope`, held with `fence`; a completion keeps it for `record_ttl`,
    /// and the lease the layer renews lasts `lease_ttl`.
    pub fn new(scope: Scope, fence: Fence, record_ttl: Duration, lease_ttl: Duration) -> Self {
        RecordRef {
            scope,
            fence,
            record_ttl,
            lease_ttl,
            completed: Arc::new(AtomicBool::new(false)),
        }
    }

    /// The record's scope.
    pub fn scope(&self) -> &Scope {
        &self.scope
    }

    /// The fence the handler runs under; a completion with it fails once another
    /// claimant has taken the record over.
    pub fn fence(&self) -> Fence {
        self.fence
    }

    /// How long a completed record is kept (the method's `recordTtl`).
    pub fn record_ttl(&self) -> Duration {
        self.record_ttl
    }

    /// The method's `leaseTtl`.
    pub fn lease_ttl(&self) -> Duration {
        self.lease_ttl
    }

    /// Says that the record has been completed under this fence, by a transaction that
    /// committed: the layer then does not record the outcome again (saving a round trip).
    /// Stores call this after their commit; calling it without one leaves the record in
    /// flight until its lease ends, and the next attempt then runs the handler again.
    pub fn mark_completed(&self) {
        self.completed.store(true, Ordering::Release);
    }

    /// Whether [`mark_completed`](Self::mark_completed) was called (on any clone).
    pub fn is_completed(&self) -> bool {
        self.completed.load(Ordering::Acquire)
    }
}
