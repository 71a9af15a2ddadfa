//! Reading and deleting one record by scope: the operator's view of the memory store
//! ([`MemoryStore::record`], [`MemoryStore::delete`]).
//!
//! These are Rust calls only. The store opens no endpoint for them, on purpose: a
//! record holds the response its handler returned, which may be personal data, so
//! whoever reads records reads responses. A service that wants them reachable puts them
//! behind its own admin authentication.

use std::time::{Duration, SystemTime};

use tokio::time::Instant;

use super::entry::{Entry, Name, Tick, lock};
use super::{MemoryStore, Table};
use crate::{DeleteMode, Deletion, RecordInfo, Scope};

impl MemoryStore {
    /// The record at `scope` (see [`records`](crate::records)): state, fence,
    /// fingerprint, lease or stored outcome, time left until it expires, when its run was
    /// claimed (to the second, rounded down; a takeover keeps it) and when it was
    /// completed (from the completion queue), on this process's clock. `None`: no
    /// record, or it expired. Changes nothing.
    ///
    /// Records are named by the first 16 bytes of their scope (see the module docs,
    /// "Compact records"): give the full scope, as `Scope::for_call` computes it.
    pub fn record(&self, scope: &Scope) -> Option<RecordInfo> {
        self.inner.record(&Name::of(scope))
    }

    /// Deletes the record at `scope` and reports what it held; an in-flight record only
    /// with [`DeleteMode::Force`] (see [`FORCE_DELETE_RISK`](crate::FORCE_DELETE_RISK)).
    /// Waiters on a deleted in-flight record wake and claim again; its holder's renew,
    /// complete and release are then refused as stale (fences come from one store-wide
    /// counter, so the next claim's is higher).
    pub fn delete(&self, scope: &Scope, mode: DeleteMode) -> Deletion {
        self.inner.delete(&Name::of(scope), mode)
    }
}

impl Table {
    fn record(&self, scope: &Name) -> Option<RecordInfo> {
        let now = Instant::now();
        let tick = self.tick(now);
        let map = lock(self.shard(scope));
        let e = map.get(scope).filter(|e| !Self::is_expired(e, tick))?;
        // The shard's completion queue holds this record's completion (newest last).
        let completed = map
            .done
            .iter()
            .rev()
            .find(|d| d.scope == *scope && e.is_completion(d))
            .map(|d| d.at);
        Some(self.info(e, now, tick, completed))
    }

    fn delete(&self, scope: &Name, mode: DeleteMode) -> Deletion {
        let now = Instant::now();
        let tick = self.tick(now);
        let mut map = lock(self.shard(scope));
        let Some(e) = map.get(scope).filter(|e| !Self::is_expired(e, tick)) else {
            return Deletion::NotFound;
        };
        let info = self.info(e, now, tick, None);
        if e.is_in_flight() && mode == DeleteMode::UnlessInFlight {
            return Deletion::RefusedInFlight(info);
        }
        if let Some(mut e) = map.remove(scope) {
            // Its completion-queue entries are skipped as stale when they come up.
            e.wake();
            self.forget(&e);
        }
        Deletion::Deleted(info)
    }

    fn info(&self, e: &Entry, now: Instant, tick: Tick, completed: Option<Tick>) -> RecordInfo {
        let state = self.record_state(e);
        let wall = |t: Tick| {
            let ago = now.saturating_duration_since(self.instant(t));
            SystemTime::now().checked_sub(ago)
        };
        RecordInfo {
            state,
            expires_in: Some(Duration::from_nanos(e.expires_at.saturating_sub(tick))),
            created_at: wall(u64::from(e.created()) * 1_000_000_000),
            completed_at: completed.and_then(wall),
        }
    }
}
