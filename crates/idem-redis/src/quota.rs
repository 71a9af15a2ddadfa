//! The per-tenant in-flight quota: which claims this process holds, so their count can
//! be taken back when they complete or are released.
//!
//! The count itself lives in Redis, one sorted set per tenant (see the crate docs,
//! "Per-tenant quota"); this is only the process-local note of which tenant each held
//! claim was counted against, since `renew`, `complete` and `release` name the record
//! but not its tenant. A claim lost from this note (a restart, a note dropped by
//! pruning) still leaves the count on its own when its lease ends.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use idem_store::{Fence, Scope, TenantId};
use tokio::time::Instant;

const SHARDS: usize = 16;

/// The member naming one claim in its tenant's set: the scope, then the fence
/// (big-endian), so a stale holder's entry is never mistaken for its successor's.
pub(crate) fn member(scope: &Scope, fence: Fence) -> [u8; 40] {
    let mut m = [0u8; 40];
    m[..32].copy_from_slice(&scope.0);
    m[32..].copy_from_slice(&fence.to_be_bytes());
    m
}

#[derive(Debug)]
struct Note {
    tenant: TenantId,
    /// After this the claim's lease has surely ended and the count has let it go.
    until: Instant,
}

#[derive(Debug, Default)]
struct Shard {
    notes: HashMap<(Scope, Fence), Note>,
    /// Size after the last prune; the next prune runs at twice that.
    pruned_at: usize,
}

/// Claims this process holds and counted, by (scope, fence).
#[derive(Debug)]
pub(crate) struct Held {
    shards: Box<[Mutex<Shard>]>,
}

impl Held {
    pub(crate) fn new() -> Self {
        Held {
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
        }
    }

    fn shard(&self, scope: &Scope) -> std::sync::MutexGuard<'_, Shard> {
        self.shards[usize::from(scope.0[0]) % SHARDS]
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// Notes a counted claim held for `lease`. Notes whose lease ended long ago (a
    /// claim never completed nor released) are pruned, amortized O(1).
    pub(crate) fn insert(&self, scope: &Scope, fence: Fence, tenant: TenantId, lease: Duration) {
        let now = Instant::now();
        let mut s = self.shard(scope);
        if s.notes.len() >= (2 * s.pruned_at).max(64) {
            s.notes.retain(|_, n| n.until > now);
            s.pruned_at = s.notes.len();
        }
        s.notes.insert(
            (*scope, fence),
            Note {
                tenant,
                until: expiry(now, lease),
            },
        );
    }

    /// The tenant a held claim was counted against, its note kept for `lease` more.
    pub(crate) fn renewed(&self, scope: &Scope, fence: Fence, lease: Duration) -> Option<TenantId> {
        let mut s = self.shard(scope);
        let n = s.notes.get_mut(&(*scope, fence))?;
        n.until = expiry(Instant::now(), lease);
        Some(n.tenant)
    }

    /// The tenant a held claim was counted against.
    pub(crate) fn get(&self, scope: &Scope, fence: Fence) -> Option<TenantId> {
        self.shard(scope)
            .notes
            .get(&(*scope, fence))
            .map(|n| n.tenant)
    }

    /// Forgets a claim that completed or was released (or is no longer ours).
    pub(crate) fn remove(&self, scope: &Scope, fence: Fence) {
        self.shard(scope).notes.remove(&(*scope, fence));
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.lock().unwrap_or_else(|p| p.into_inner()).notes.len())
            .sum()
    }
}

/// The claim's lease and one more (the record's own lifetime).
fn expiry(now: Instant, lease: Duration) -> Instant {
    now.checked_add(lease.saturating_mul(2))
        .unwrap_or_else(|| now + Duration::from_secs(10 * 365 * 24 * 3600))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn notes_of_abandoned_claims_are_pruned() {
        let held = Held::new();
        let lease = Duration::from_secs(1);
        for i in 0..1000u32 {
            let mut s = [0u8; 32];
            s[..4].copy_from_slice(&i.to_le_bytes());
            held.insert(&Scope(s), 1, TenantId([1; 16]), lease);
        }
        tokio::time::advance(3 * lease).await;
        for i in 0..1000u32 {
            let mut s = [9u8; 32];
            s[..4].copy_from_slice(&i.to_le_bytes());
            held.insert(&Scope(s), 1, TenantId([1; 16]), lease);
        }
        assert!(held.len() < 1500, "{}", held.len());
        let sc = Scope([7; 32]);
        held.insert(&sc, 1, TenantId([1; 16]), lease);
        assert_eq!(held.get(&sc, 1), Some(TenantId([1; 16])));
        assert_eq!(held.get(&sc, 2), None);
        held.remove(&sc, 1);
        assert_eq!(held.get(&sc, 1), None);
    }

    #[test]
    fn members_differ_by_fence() {
        let sc = Scope([3; 32]);
        assert_ne!(member(&sc, 1), member(&sc, 2));
        assert_eq!(&member(&sc, 1)[..32], &sc.0);
    }
}
