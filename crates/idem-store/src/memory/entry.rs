//! A record as the store keeps it: its compact name, its entry (in flight or completed),
//! its times in ticks of the store's clock, and the shard that holds it.

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use super::RECORD_OVERHEAD_BYTES;
use super::Table;
use super::bounds::Usage;
use crate::{Claim, ClaimRequest, ClaimantId, Fence, Fingerprint, Scope, StoredOutcome, TenantId};

/// The scope is already a uniform digest: hash it by taking 8 of its bytes.
#[derive(Default)]
pub(super) struct ScopeHasher(u64);

impl Hasher for ScopeHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut b = [0u8; 8];
            b[..chunk.len()].copy_from_slice(chunk);
            self.0 = self.0.rotate_left(5) ^ u64::from_le_bytes(b);
        }
    }
}

/// How this store names a record: the first 16 bytes of its [`Scope`], half the bytes
/// of the full digest in the map and in both completion queues. What that costs in
/// collisions: the module docs ("Compact records").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct Name(pub(super) [u8; 16]);

impl Name {
    pub(super) fn of(scope: &Scope) -> Self {
        let mut n = [0u8; 16];
        n.copy_from_slice(&scope.0[..16]);
        Name(n)
    }
}

pub(super) type Map = HashMap<Name, Entry, BuildHasherDefault<ScopeHasher>>;

pub(super) type Tenants = HashMap<TenantId, Arc<Usage>, BuildHasherDefault<ScopeHasher>>;

/// A completion, queued in completion order for eviction.
///
/// Queued once in its tenant's queue and once in its shard's; an entry whose record is
/// gone or was completed again (another fence) is stale and skipped when it comes up.
#[derive(Debug, Clone, Copy)]
pub(super) struct Done {
    pub(super) scope: Name,
    /// The fence of the run that completed: identifies this completion of the scope.
    pub(super) fence: Fence,
    /// When it completed.
    pub(super) at: Tick,
}

pub(super) type Queue = VecDeque<Done>;

/// One shard: its records and its completions in completion order (for evictions at
/// the store-wide bounds).
#[derive(Default)]
pub(super) struct Shard {
    pub(super) map: Map,
    pub(super) done: Queue,
}

impl std::ops::Deref for Shard {
    type Target = Map;
    fn deref(&self) -> &Map {
        &self.map
    }
}

impl std::ops::DerefMut for Shard {
    fn deref_mut(&mut self) -> &mut Map {
        &mut self.map
    }
}

pub(super) fn lock(m: &Mutex<Shard>) -> MutexGuard<'_, Shard> {
    // A panic while holding a shard lock leaves a consistent map (every mutation is a
    // single insert/remove/assignment), so a poisoned lock is still usable.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Where a record is in its life: in flight (a claimant holds its lease) or completed.
#[derive(Debug)]
pub(super) enum EntryState {
    InFlight {
        fence: Fence,
        fingerprint: Fingerprint,
        claimant: ClaimantId,
        lease_until: Tick,
        waiters: Option<Arc<Notify>>,
        /// When the run was claimed (a takeover keeps it).
        created: Secs,
    },
    Completed {
        fence: Fence,
        fingerprint: Fingerprint,
        outcome: StoredOutcome,
        /// When the run was claimed.
        created: Secs,
    },
}

/// A record: its state, when the sweeper may drop it, and the tenant it is charged to.
#[derive(Debug)]
pub(super) struct Entry {
    pub(super) state: EntryState,
    /// When the sweeper may drop the record.
    pub(super) expires_at: Tick,
    /// The usage of the tenant the record is charged to.
    pub(super) tenant: Arc<Usage>,
}

impl Entry {
    pub(super) fn bytes(&self) -> usize {
        RECORD_OVERHEAD_BYTES
            + match &self.state {
                EntryState::Completed { outcome, .. } => outcome.len(),
                EntryState::InFlight { .. } => 0,
            }
    }

    pub(super) fn is_in_flight(&self) -> bool {
        matches!(self.state, EntryState::InFlight { .. })
    }

    /// When the record's run was claimed.
    pub(super) fn created(&self) -> Secs {
        match self.state {
            EntryState::InFlight { created, .. } | EntryState::Completed { created, .. } => created,
        }
    }

    pub(super) fn fence(&self) -> Fence {
        match self.state {
            EntryState::InFlight { fence, .. } | EntryState::Completed { fence, .. } => fence,
        }
    }

    /// Whether this is the completion `d` queued.
    pub(super) fn is_completion(&self, d: &Done) -> bool {
        matches!(self.state, EntryState::Completed { fence, .. } if fence == d.fence)
    }

    pub(super) fn wake(&mut self) {
        if let EntryState::InFlight {
            waiters: Some(n), ..
        } = &mut self.state
        {
            n.notify_waiters();
        }
    }
}

/// `d` in nanoseconds, saturated.
pub(super) fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// `now + d`, saturating far in the future instead of overflowing.
pub(super) fn later(now: Instant, d: Duration) -> Instant {
    now.checked_add(d)
        .unwrap_or_else(|| now + Duration::from_secs(100 * 365 * 24 * 3600))
}

/// The store's epoch: a day before it was made where the clock allows, so that a `now`
/// read on tokio's paused clock (a runtime built before the store, whose time stands
/// still) comes after it, and every tick stays as exact as the `Instant`s it stands for.
pub(super) fn epoch() -> Instant {
    let now = Instant::now();
    [86_400, 3_600, 60, 1]
        .into_iter()
        .find_map(|s| now.checked_sub(Duration::from_secs(s)))
        .unwrap_or(now)
}

/// A point in the store's time: nanoseconds since its epoch. A record keeps its times
/// in 8 bytes each where an `Instant` takes 16; it saturates 584 years on.
pub(super) type Tick = u64;

/// A point in the store's time to the second: whole seconds since its epoch, in the 4
/// bytes the entry has free beside its state's tag (so records stay their size); it
/// saturates 136 years on.
pub(super) type Secs = u32;

/// Tick `t` to the second (rounded down).
pub(super) fn secs(t: Tick) -> Secs {
    Secs::try_from(t / 1_000_000_000).unwrap_or(Secs::MAX)
}

/// `now + d`, saturated.
pub(super) fn after(now: Tick, d: Duration) -> Tick {
    now.saturating_add(nanos(d))
}

/// Expiry of an in-flight record: one more lease after the lease ends.
pub(super) fn in_flight_expiry(now: Tick, lease: Duration) -> Tick {
    after(after(now, lease), lease)
}

impl Table {
    /// `now` in ticks.
    pub(super) fn tick(&self, now: Instant) -> Tick {
        nanos(now.saturating_duration_since(self.epoch))
    }

    /// The instant of tick `t`.
    pub(super) fn instant(&self, t: Tick) -> Instant {
        later(self.epoch, Duration::from_nanos(t))
    }

    pub(super) fn is_expired(e: &Entry, now: Tick) -> bool {
        e.expires_at <= now
    }

    pub(super) fn new_in_flight(
        &self,
        req: &ClaimRequest<'_>,
        now: Tick,
        tenant: Arc<Usage>,
    ) -> Entry {
        Entry {
            state: EntryState::InFlight {
                fence: self.fence(),
                fingerprint: *req.fingerprint,
                claimant: req.claimant,
                lease_until: after(now, req.lease),
                waiters: None,
                created: secs(now),
            },
            expires_at: in_flight_expiry(now, req.lease),
            tenant,
        }
    }

    /// Claim on an entry that has not expired: replay, mismatch, wait, re-claim or
    /// takeover. Adds no record, so no bound applies.
    pub(super) fn claim_existing(
        &self,
        e: &mut Entry,
        req: &ClaimRequest<'_>,
        tick: Tick,
    ) -> Claim {
        match &mut e.state {
            EntryState::Completed {
                fingerprint,
                outcome,
                ..
            } => {
                if fingerprint == req.fingerprint {
                    Claim::Completed(outcome.clone())
                } else {
                    Claim::Mismatch
                }
            }
            EntryState::InFlight { fingerprint, .. } if fingerprint != req.fingerprint => {
                Claim::Mismatch
            }
            EntryState::InFlight {
                fence,
                claimant,
                lease_until,
                ..
            } if *lease_until > tick => {
                if *claimant != req.claimant {
                    return Claim::InFlight {
                        lease_remaining: Duration::from_nanos(*lease_until - tick),
                    };
                }
                // The same claimant again (a lost reply): same fence, lease extended.
                *lease_until = (*lease_until).max(after(tick, req.lease));
                e.expires_at = e.expires_at.max(in_flight_expiry(tick, req.lease));
                Claim::Acquired {
                    fence: *fence,
                    takeover: false,
                }
            }
            EntryState::InFlight { .. } => {
                // The lease ended: take over in place (same tenant, still one in-flight
                // record).
                e.wake();
                let (tenant, was) = (e.tenant.clone(), e.created());
                *e = self.new_in_flight(req, tick, tenant);
                if let EntryState::InFlight { created, .. } = &mut e.state {
                    *created = was;
                }
                Claim::Acquired {
                    fence: e.fence(),
                    takeover: true,
                }
            }
        }
    }
}
