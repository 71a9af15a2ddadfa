//! The sweep: expired records dropped every `sweep_interval` by a background task that
//! holds only a `Weak` reference (it stops with the last clone of the store), queues with
//! mostly stale entries compacted, and tenants that hold nothing forgotten.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Duration;

use tokio::time::Instant;

use super::bounds::Usage;
use super::entry::{Shard, lock};
use super::{MemoryStore, Table};

/// A queue with more stale entries than this (beyond twice its live ones) is compacted
/// by the sweeper.
pub(super) const QUEUE_SLACK: usize = 64;

impl MemoryStore {
    pub(super) fn ensure_sweeper(&self) {
        if self.inner.sweeper_started.load(Ordering::Relaxed) {
            return;
        }
        let Ok(handle) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if self.inner.sweeper_started.swap(true, Ordering::AcqRel) {
            return;
        }
        let weak: Weak<Table> = Arc::downgrade(&self.inner);
        let period = self
            .inner
            .settings
            .sweep_interval
            .max(Duration::from_millis(1));
        handle.spawn(async move {
            loop {
                tokio::time::sleep(period).await;
                let Some(inner) = weak.upgrade() else { break };
                inner.sweep(Instant::now());
            }
        });
    }
}

impl Table {
    pub(super) fn sweep(&self, now: Instant) {
        let now = self.tick(now);
        for shard in self.shards.iter() {
            let mut guard = lock(shard);
            let Shard { map, done } = &mut *guard;
            map.retain(|_, e| {
                if Self::is_expired(e, now) {
                    e.wake();
                    self.forget(e);
                    self.expirations.fetch_add(1, Ordering::Relaxed);
                    false
                } else {
                    true
                }
            });
            if done.len() > 2 * map.len() + QUEUE_SLACK {
                done.retain(|d| map.get(&d.scope).is_some_and(|e| e.is_completion(d)));
            }
        }
        // Tenant queues with many stale entries (records that expired) are compacted.
        // The usages are collected first: a queue is never locked under a tenant-map lock.
        let usages: Vec<Arc<Usage>> = self
            .tenants
            .iter()
            .flat_map(|t| {
                let map = t.read().unwrap_or_else(|p| p.into_inner());
                map.values().cloned().collect::<Vec<_>>()
            })
            .collect();
        for u in &usages {
            let mut queue = u.done();
            if queue.len() > 2 * u.entries.load(Ordering::Relaxed) + QUEUE_SLACK {
                queue.retain(|d| {
                    lock(self.shard(&d.scope))
                        .get(&d.scope)
                        .is_some_and(|e| e.is_completion(d))
                });
            }
        }
        self.rearm(&usages);
        drop(usages);
        // Tenants whose usage nobody references (no record, no claim under way) go.
        for shard in self.tenants.iter() {
            let mut map = shard.write().unwrap_or_else(|p| p.into_inner());
            map.retain(|_, u| {
                let keep = Arc::strong_count(u) > 1;
                if !keep {
                    self.tenant_count.fetch_sub(1, Ordering::Relaxed);
                }
                keep
            });
        }
    }
}
