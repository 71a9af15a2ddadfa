//! Eviction at a bound (see "Eviction" in the [module docs](super)): the oldest
//! completed records older than `minRetention`, a tenant's own or, at a store-wide bound,
//! one of a tenant above its fair share.
//!
//! Lock order: a tenant's queue, then one shard. A shard lock is never held while
//! taking a tenant's queue (complete queues the tenant's entry after unlocking).

use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::bounds::{MemoryBound, Usage};
use super::entry::{Done, Entry, Tick, lock};
use super::{SHARDS, Table};

/// Most records one claim or completion evicts to make room.
pub(super) const MAX_EVICTIONS_PER_CALL: usize = 16;

impl Table {
    /// Whether a record completed at tick `at` may be evicted at tick `now`.
    fn old_enough(&self, at: u64, now: u64) -> bool {
        at.saturating_add(self.min_retention) <= now
    }

    /// `bound`'s measure of `u`: its records or its bytes.
    fn measure(u: &Usage, bound: MemoryBound) -> usize {
        match bound {
            MemoryBound::StoreEntries
            | MemoryBound::TenantEntries
            | MemoryBound::TenantInFlight => u.entries.load(Ordering::Acquire),
            MemoryBound::StoreBytes | MemoryBound::TenantBytes => u.bytes.load(Ordering::Acquire),
        }
    }

    /// A tenant's fair share of a store-wide bound: the bound divided among the tenants
    /// that hold records or claims.
    fn fair_share(&self, bound: MemoryBound) -> usize {
        self.limits.value(bound) / self.tenant_count.load(Ordering::Relaxed).max(1)
    }

    /// Evicts one completed record so that `t` can add `need` (one record, or `need`
    /// bytes) under `bound`; false when no record may go. At its own bound a tenant
    /// evicts its own records; at a store-wide bound a tenant below its fair share
    /// evicts a record of a tenant above its share, and any other tenant its own.
    pub(super) fn make_room(
        &self,
        t: &Arc<Usage>,
        bound: MemoryBound,
        need: usize,
        now: Tick,
    ) -> bool {
        match bound {
            MemoryBound::TenantInFlight => false,
            MemoryBound::TenantEntries | MemoryBound::TenantBytes => self.evict_own(t, bound, now),
            MemoryBound::StoreEntries | MemoryBound::StoreBytes => {
                let need = if bound == MemoryBound::StoreEntries {
                    1
                } else {
                    need
                };
                // The only tenant holding records is at the store's bound whatever its
                // counters say: a claim or completion under way on another thread has
                // charged the store before the tenant (or uncharged the tenant first), so
                // for a moment it may look below its share. It has no one to take room
                // from but itself (a single-tenant store at its sustained rate was
                // refusing ~60 calls in a million this way: benches/soak.rs).
                let alone = self.tenant_count.load(Ordering::Relaxed) <= 1;
                if !alone && Self::measure(t, bound).saturating_add(need) <= self.fair_share(bound)
                {
                    self.evict_over_share(t, bound, now)
                } else {
                    self.evict_own(t, bound, now)
                }
            }
        }
    }

    /// Evicts `t`'s oldest completed record if it completed `min_retention` ago or more.
    fn evict_own(&self, t: &Usage, bound: MemoryBound, tick: Tick) -> bool {
        let mut queue = t.done();
        while let Some(d) = queue.front().copied() {
            self.queue_steps.fetch_add(1, Ordering::Relaxed);
            if !self.old_enough(d.at, tick) {
                return false;
            }
            queue.pop_front();
            let mut shard = lock(self.shard(&d.scope));
            if shard.get(&d.scope).is_some_and(|e| e.is_completion(&d))
                && let Some(e) = shard.remove(&d.scope)
            {
                drop(shard);
                self.evicted(&e, bound, false, tick);
                return true;
            }
            // Stale: the record was released, expired or evicted already.
        }
        false
    }

    /// Evicts the oldest evictable record, shard by shard, of a tenant holding more than
    /// its fair share of `bound` (keeping at least its share), or an expired record.
    fn evict_over_share(&self, claimant: &Arc<Usage>, bound: MemoryBound, tick: Tick) -> bool {
        let fair = self.fair_share(bound);
        let start = self.cursor.fetch_add(1, Ordering::Relaxed);
        for i in 0..SHARDS {
            let mut guard = lock(&self.shards[(start + i) % SHARDS]);
            let shard = &mut *guard;
            while let Some(d) = shard.done.front().copied() {
                self.queue_steps.fetch_add(1, Ordering::Relaxed);
                if !self.old_enough(d.at, tick) {
                    break;
                }
                shard.done.pop_front();
                let Some(e) = shard.map.get(&d.scope).filter(|e| e.is_completion(&d)) else {
                    continue;
                };
                let over = !Arc::ptr_eq(&e.tenant, claimant) && {
                    let cost = if bound == MemoryBound::StoreEntries {
                        1
                    } else {
                        e.bytes()
                    };
                    Self::measure(&e.tenant, bound) >= fair.saturating_add(cost)
                };
                if (over || Self::is_expired(e, tick))
                    && let Some(e) = shard.map.remove(&d.scope)
                {
                    drop(guard);
                    self.evicted(&e, bound, true, tick);
                    return true;
                }
                // Its tenant holds no more than its share: from now on only its own
                // tenant may evict this record (it stays in that tenant's queue).
            }
        }
        false
    }

    /// Uncharges an evicted record, counts it and logs (the 1st, 2nd, 4th, 8th…).
    fn evicted(&self, e: &Entry, bound: MemoryBound, for_other: bool, now: Tick) {
        self.forget(e);
        if Self::is_expired(e, now) {
            self.expirations.fetch_add(1, Ordering::Relaxed);
            return;
        }
        if for_other {
            self.evictions_for_others.fetch_add(1, Ordering::Relaxed);
        }
        let n = self.evictions.fetch_add(1, Ordering::Relaxed) + 1;
        if n.is_power_of_two() {
            tracing::warn!(
                evictions = n,
                limit = self.limits.value(bound),
                min_retention = ?self.settings.min_retention,
                "idempotency memory store: {}; evicting completed records younger than \
                 their record TTL (but older than minRetention) to make room: a retry of an \
                 evicted key runs again. To keep every record for its TTL, size maxEntries \
                 (and maxEntriesPerTenant, maxBytes) for protected calls per second × recordTtl",
                bound.describe()
            );
        }
    }

    /// Queues a completion for eviction in its tenant's queue (the shard's was done
    /// under the shard lock).
    pub(super) fn queue_for_tenant(&self, t: &Usage, d: Done) {
        t.done().push_back(d);
    }
}
