//! The in-memory store: the embedded default for a server that runs as one process.
//!
//! # Design
//! - **Sharded**: records live in [`SHARDS`] `HashMap`s, each behind its own
//!   `std::sync::Mutex`, chosen by the scope digest. No lock is held across an `.await`
//!   and no call takes two shard locks at once, so there is no global lock on the hot
//!   path and no lock ordering to get wrong.
//! - **Fences** come from one store-wide counter, so they grow for every scope across
//!   release, takeover, expiry and eviction: a fence can never be handed out twice, even
//!   after the record that held it was evicted.
//! - **Bounds**: `max_entries` records and `max_bytes` bytes (stored responses plus
//!   [`RECORD_OVERHEAD_BYTES`] per record) from [`MemoryStoreSettings`]. When a new record
//!   or a response does not fit, the store first drops expired records, then evicts
//!   completed and released records least-recently-used first (down to 1/64 below the
//!   bound, so a full store does not scan on every call), counts the evictions and logs a
//!   warning. In-flight records are never evicted. If a new claim still does not fit the
//!   claim fails with [`StoreError::Full`]; if a response still does not fit, the record
//!   is completed as [`StoredOutcome::NotRetained`] (the handler already ran; a
//!   duplicate gets a clear error rather than a second run).
//! - **Expiry**: completed records expire after the TTL given to `complete`; released
//!   records keep a tombstone for [`MemoryStoreSettings::tombstone_ttl`] (default 24 h,
//!   the default record TTL); an in-flight record whose lease ended is taken over by the
//!   next claim, and is dropped when its lease has been over for the tombstone TTL. A
//!   background task sweeps expired records every `sweep_interval`; it holds only a
//!   `Weak` reference and stops when the last clone of the store is dropped.
//! - **Waiting**: a waiter parks on a `tokio::sync::Notify` that belongs to the in-flight
//!   record (allocated only when someone waits) and is woken directly by complete,
//!   release, takeover or removal; it also wakes when the lease ends.
//! - **Clock**: `tokio::time::Instant`, so tests run on a paused clock.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

#[cfg(test)]
use crate::TenantId;
use crate::{
    Claim, ClaimRequest, ClaimantId, Fence, Fingerprint, RecordState, Scope, Store, StoreError,
    StoredOutcome,
};

/// Bounds and timings of a [`MemoryStore`] (`idem.memoryStore` in the service config).
///
/// # Defaults
/// `maxEntries` 100000, `maxBytes` 268435456 (256 MiB), `sweepInterval` `"1s"`,
/// `tombstoneTtl` `"86400s"` (24 h).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemoryStoreSettings {
    /// Most records kept.
    pub max_entries: usize,
    /// Most bytes of stored responses (plus per-record overhead) kept.
    pub max_bytes: usize,
    /// How often expired records are swept.
    pub sweep_interval: Duration,
    /// How long a released record, or an in-flight record whose lease ended, is kept
    /// as a tombstone.
    pub tombstone_ttl: Duration,
}

impl Default for MemoryStoreSettings {
    fn default() -> Self {
        MemoryStoreSettings {
            max_entries: 100_000,
            max_bytes: 256 * 1024 * 1024,
            sweep_interval: Duration::from_secs(1),
            tombstone_ttl: Duration::from_secs(24 * 3600),
        }
    }
}

/// Number of shards.
pub const SHARDS: usize = 64;

/// Bytes charged against `max_bytes` for each record on top of its stored response.
///
/// Measured (test `memory_per_record`, 100 000 records of 16-byte responses): a map slot
/// is 145 bytes (scope 32 + entry 112 + 1 control byte) and the tables run about 76 %
/// full, so 190 bytes per record amortized; the resident set grew by 223 bytes per
/// record including the 16-byte response and its allocation header.
pub const RECORD_OVERHEAD_BYTES: usize = 192;

/// The scope is already a uniform digest: hash it by taking 8 of its bytes.
#[derive(Default)]
struct ScopeHasher(u64);

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

type Map = HashMap<Scope, Entry, BuildHasherDefault<ScopeHasher>>;

#[derive(Debug)]
enum State {
    InFlight {
        fence: Fence,
        fingerprint: Fingerprint,
        claimant: ClaimantId,
        lease_until: Instant,
        waiters: Option<Arc<Notify>>,
    },
    Completed {
        fence: Fence,
        fingerprint: Fingerprint,
        outcome: StoredOutcome,
    },
    Released {
        fence: Fence,
    },
}

#[derive(Debug)]
struct Entry {
    state: State,
    /// When the sweeper may drop the record.
    expires_at: Instant,
    /// Store-wide tick of the last use, for LRU eviction.
    last_used: u64,
}

impl Entry {
    fn bytes(&self) -> usize {
        RECORD_OVERHEAD_BYTES
            + match &self.state {
                State::Completed { outcome, .. } => outcome.len(),
                _ => 0,
            }
    }

    fn wake(&mut self) {
        if let State::InFlight {
            waiters: Some(n), ..
        } = &mut self.state
        {
            n.notify_waiters();
        }
    }
}

/// Counters of a [`MemoryStore`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemoryStoreStats {
    /// Records currently held (in flight, completed and tombstones).
    pub entries: usize,
    /// Bytes currently charged (responses + per-record overhead).
    pub bytes: usize,
    /// Completed/released records evicted (least recently used) to make room.
    pub evictions: u64,
    /// Records dropped because they expired.
    pub expirations: u64,
    /// Claims refused with [`StoreError::Full`].
    pub full_rejections: u64,
    /// Responses recorded as not retained because they did not fit.
    pub responses_dropped: u64,
}

struct Inner {
    shards: Box<[Mutex<Map>]>,
    settings: MemoryStoreSettings,
    next_fence: AtomicU64,
    tick: AtomicU64,
    entries: AtomicUsize,
    bytes: AtomicUsize,
    evictions: AtomicU64,
    expirations: AtomicU64,
    full_rejections: AtomicU64,
    responses_dropped: AtomicU64,
    evicting: Mutex<()>,
    sweeper_started: AtomicBool,
}

/// The embedded default [`Store`]: sharded, bounded, with TTL expiry. See the module docs.
///
/// ```
/// # use idem_store::{MemoryStore, MemoryStoreSettings};
/// let store = MemoryStore::new(MemoryStoreSettings { max_entries: 10_000, ..Default::default() });
/// assert!(store.is_empty());
/// ```
#[derive(Clone)]
pub struct MemoryStore {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryStore")
            .field("settings", &self.inner.settings)
            .field("stats", &self.stats())
            .finish()
    }
}

impl Default for MemoryStore {
    /// A store with [`MemoryStoreSettings::default`] (100 000 records, 256 MiB, sweep 1 s).
    fn default() -> Self {
        MemoryStore::new(MemoryStoreSettings::default())
    }
}

fn lock(m: &Mutex<Map>) -> MutexGuard<'_, Map> {
    // A panic while holding a shard lock leaves a consistent map (every mutation is a
    // single insert/remove/assignment), so a poisoned lock is still usable.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl MemoryStore {
    /// A store with these bounds. The sweeper starts on the current tokio runtime if
    /// there is one, else on the first call made from inside a runtime.
    pub fn new(settings: MemoryStoreSettings) -> Self {
        let shards = (0..SHARDS).map(|_| Mutex::new(Map::default())).collect();
        let store = MemoryStore {
            inner: Arc::new(Inner {
                shards,
                settings,
                next_fence: AtomicU64::new(1),
                tick: AtomicU64::new(0),
                entries: AtomicUsize::new(0),
                bytes: AtomicUsize::new(0),
                evictions: AtomicU64::new(0),
                expirations: AtomicU64::new(0),
                full_rejections: AtomicU64::new(0),
                responses_dropped: AtomicU64::new(0),
                evicting: Mutex::new(()),
                sweeper_started: AtomicBool::new(false),
            }),
        };
        store.ensure_sweeper();
        store
    }

    /// The store's bounds.
    pub fn settings(&self) -> &MemoryStoreSettings {
        &self.inner.settings
    }

    /// Records held (in flight, completed, tombstones).
    pub fn len(&self) -> usize {
        self.inner.entries.load(Ordering::Relaxed)
    }

    /// Whether the store holds no record.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Current counters.
    pub fn stats(&self) -> MemoryStoreStats {
        let i = &self.inner;
        MemoryStoreStats {
            entries: i.entries.load(Ordering::Relaxed),
            bytes: i.bytes.load(Ordering::Relaxed),
            evictions: i.evictions.load(Ordering::Relaxed),
            expirations: i.expirations.load(Ordering::Relaxed),
            full_rejections: i.full_rejections.load(Ordering::Relaxed),
            responses_dropped: i.responses_dropped.load(Ordering::Relaxed),
        }
    }

    /// Drops every expired record now (the sweeper does this every `sweep_interval`).
    pub fn sweep(&self) {
        self.inner.sweep(Instant::now());
    }

    fn ensure_sweeper(&self) {
        if self.inner.sweeper_started.load(Ordering::Relaxed) {
            return;
        }
        let Ok(handle) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if self.inner.sweeper_started.swap(true, Ordering::AcqRel) {
            return;
        }
        let weak: Weak<Inner> = Arc::downgrade(&self.inner);
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

impl Inner {
    fn tombstone_ttl(&self) -> Duration {
        self.settings.tombstone_ttl
    }

    fn shard(&self, scope: &Scope) -> &Mutex<Map> {
        &self.shards[usize::from(scope.0[0]) % SHARDS]
    }

    fn tick(&self) -> u64 {
        self.tick.fetch_add(1, Ordering::Relaxed)
    }

    fn fence(&self) -> Fence {
        self.next_fence.fetch_add(1, Ordering::Relaxed)
    }

    /// Accounts for a removed entry.
    fn forget(&self, e: &Entry) {
        self.entries.fetch_sub(1, Ordering::Relaxed);
        self.bytes.fetch_sub(e.bytes(), Ordering::Relaxed);
    }

    fn try_reserve(&self, entries: usize, bytes: usize) -> bool {
        let s = &self.settings;
        if entries > 0
            && self
                .entries
                .fetch_update(Ordering::AcqRel, Ordering::Relaxed, |n| {
                    (n + entries <= s.max_entries).then_some(n + entries)
                })
                .is_err()
        {
            return false;
        }
        if self
            .bytes
            .fetch_update(Ordering::AcqRel, Ordering::Relaxed, |n| {
                n.checked_add(bytes).filter(|t| *t <= s.max_bytes)
            })
            .is_err()
        {
            self.entries.fetch_sub(entries, Ordering::Relaxed);
            return false;
        }
        true
    }

    fn unreserve(&self, entries: usize, bytes: usize) {
        self.entries.fetch_sub(entries, Ordering::Relaxed);
        self.bytes.fetch_sub(bytes, Ordering::Relaxed);
    }

    /// Reserves room, making it if needed (expired first, then LRU).
    fn reserve(&self, entries: usize, bytes: usize, now: Instant) -> bool {
        if self.try_reserve(entries, bytes) {
            return true;
        }
        self.make_room(entries, bytes, now);
        self.try_reserve(entries, bytes)
    }

    fn is_expired(e: &Entry, now: Instant) -> bool {
        e.expires_at <= now
    }

    fn sweep(&self, now: Instant) {
        for shard in self.shards.iter() {
            let mut map = lock(shard);
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
        }
    }

    fn over(&self, entries: usize, bytes: usize, slack: bool) -> bool {
        let s = &self.settings;
        let (me, mb) = if slack {
            (
                s.max_entries - s.max_entries / 64,
                s.max_bytes - s.max_bytes / 64,
            )
        } else {
            (s.max_entries, s.max_bytes)
        };
        self.entries.load(Ordering::Relaxed) + entries > me
            || self.bytes.load(Ordering::Relaxed).saturating_add(bytes) > mb
    }

    fn make_room(&self, entries: usize, bytes: usize, now: Instant) {
        let _one_at_a_time = self.evicting.lock().unwrap_or_else(|p| p.into_inner());
        if !self.over(entries, bytes, false) {
            return;
        }
        self.sweep(now);
        if !self.over(entries, bytes, false) {
            return;
        }
        // Least recently used completed/released records, oldest first.
        let mut candidates: Vec<(u64, Scope)> = Vec::new();
        for shard in self.shards.iter() {
            let map = lock(shard);
            candidates.extend(
                map.iter()
                    .filter(|(_, e)| !matches!(e.state, State::InFlight { .. }))
                    .map(|(s, e)| (e.last_used, *s)),
            );
        }
        candidates.sort_unstable_by_key(|(t, _)| *t);
        let mut evicted = 0u64;
        for (tick, scope) in candidates {
            if !self.over(entries, bytes, true) {
                break;
            }
            let mut map = lock(self.shard(&scope));
            let still = map
                .get(&scope)
                .is_some_and(|e| e.last_used == tick && !matches!(e.state, State::InFlight { .. }));
            if still && let Some(e) = map.remove(&scope) {
                self.forget(&e);
                evicted += 1;
            }
        }
        if evicted > 0 {
            self.evictions.fetch_add(evicted, Ordering::Relaxed);
            tracing::warn!(
                evicted,
                entries = self.entries.load(Ordering::Relaxed),
                bytes = self.bytes.load(Ordering::Relaxed),
                max_entries = self.settings.max_entries,
                max_bytes = self.settings.max_bytes,
                "idempotency memory store at its bound: evicted least-recently-used completed records"
            );
        }
    }

    fn new_in_flight(&self, req: &ClaimRequest<'_>, now: Instant) -> Entry {
        let lease_until = now + req.lease;
        Entry {
            state: State::InFlight {
                fence: self.fence(),
                fingerprint: *req.fingerprint,
                claimant: req.claimant,
                lease_until,
                waiters: None,
            },
            expires_at: lease_until + self.tombstone_ttl(),
            last_used: self.tick(),
        }
    }

    /// Claim on an existing entry. `None` when the entry is expired (treat as absent).
    fn claim_existing(&self, e: &mut Entry, req: &ClaimRequest<'_>, now: Instant) -> Option<Claim> {
        if Self::is_expired(e, now) {
            return None;
        }
        match &mut e.state {
            State::Completed {
                fingerprint,
                outcome,
                ..
            } => {
                if fingerprint != req.fingerprint {
                    return Some(Claim::Mismatch);
                }
                let outcome = outcome.clone();
                e.last_used = self.tick();
                Some(Claim::Completed(outcome))
            }
            State::Released { .. } => {
                // Keep the slot (already accounted), take it with a new fence.
                let bytes_before = e.bytes();
                e.wake();
                *e = self.new_in_flight(req, now);
                self.bytes
                    .fetch_sub(bytes_before - e.bytes(), Ordering::Relaxed);
                Some(Claim::Acquired {
                    fence: fence_of(e),
                    takeover: false,
                })
            }
            State::InFlight {
                fence,
                fingerprint,
                claimant,
                lease_until,
                ..
            } => {
                if fingerprint != req.fingerprint {
                    return Some(Claim::Mismatch);
                }
                if *claimant == req.claimant && *lease_until > now {
                    let fence = *fence;
                    *lease_until = now + req.lease;
                    e.expires_at = now + req.lease + self.tombstone_ttl();
                    return Some(Claim::Acquired {
                        fence,
                        takeover: false,
                    });
                }
                if *lease_until > now {
                    return Some(Claim::InFlight {
                        lease_remaining: *lease_until - now,
                    });
                }
                e.wake();
                *e = self.new_in_flight(req, now);
                Some(Claim::Acquired {
                    fence: fence_of(e),
                    takeover: true,
                })
            }
        }
    }

    fn claim(&self, req: ClaimRequest<'_>) -> Result<Claim, StoreError> {
        let now = Instant::now();
        let shard = self.shard(req.scope);
        {
            let mut map = lock(shard);
            if let Some(e) = map.get_mut(req.scope) {
                if let Some(c) = self.claim_existing(e, &req, now) {
                    return Ok(c);
                }
                // Expired: replace it in place (its accounting slot is reused).
                let old = std::mem::replace(e, self.new_in_flight(&req, now));
                let mut old = old;
                old.wake();
                self.bytes
                    .fetch_sub(old.bytes() - e.bytes(), Ordering::Relaxed);
                self.expirations.fetch_add(1, Ordering::Relaxed);
                return Ok(Claim::Acquired {
                    fence: fence_of(e),
                    takeover: false,
                });
            }
        }
        // A new record: reserve room without holding a shard lock (making room locks
        // the shards one by one).
        if !self.reserve(1, RECORD_OVERHEAD_BYTES, now) {
            self.full_rejections.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                max_entries = self.settings.max_entries,
                max_bytes = self.settings.max_bytes,
                "idempotency memory store full: every record is in flight"
            );
            return Err(StoreError::Full(
                format!(
                    "{} records in flight, bound {}",
                    self.entries.load(Ordering::Relaxed),
                    self.settings.max_entries
                )
                .into(),
            ));
        }
        let mut map = lock(shard);
        if let Some(e) = map.get_mut(req.scope) {
            // Someone inserted it meanwhile.
            self.unreserve(1, RECORD_OVERHEAD_BYTES);
            if let Some(c) = self.claim_existing(e, &req, now) {
                return Ok(c);
            }
            let mut old = std::mem::replace(e, self.new_in_flight(&req, now));
            old.wake();
            self.bytes
                .fetch_sub(old.bytes() - e.bytes(), Ordering::Relaxed);
            return Ok(Claim::Acquired {
                fence: fence_of(e),
                takeover: false,
            });
        }
        let e = self.new_in_flight(&req, now);
        let fence = fence_of(&e);
        map.insert(*req.scope, e);
        Ok(Claim::Acquired {
            fence,
            takeover: false,
        })
    }

    /// Runs `f` on the in-flight entry held with `fence`, or reports the stale fence.
    fn with_in_flight<T>(
        &self,
        scope: &Scope,
        fence: Fence,
        f: impl FnOnce(&mut Entry, Instant) -> T,
    ) -> Result<T, StoreError> {
        let now = Instant::now();
        let mut map = lock(self.shard(scope));
        match map.get_mut(scope) {
            Some(e) if !Self::is_expired(e, now) => match e.state {
                State::InFlight { fence: f0, .. } if f0 == fence => Ok(f(e, now)),
                _ => Err(StoreError::Fenced {
                    presented: fence,
                    current: Some(fence_of(e)),
                }),
            },
            _ => Err(StoreError::Fenced {
                presented: fence,
                current: None,
            }),
        }
    }

    fn complete(
        &self,
        scope: &Scope,
        fence: Fence,
        outcome: StoredOutcome,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        let now = Instant::now();
        let extra = outcome.len();
        let (outcome, reserved) = if extra == 0 || self.reserve(0, extra, now) {
            (outcome, extra)
        } else {
            self.responses_dropped.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                bytes = extra,
                max_bytes = self.settings.max_bytes,
                "idempotency memory store full: response recorded as not retained"
            );
            (StoredOutcome::NotRetained, 0)
        };
        let res = self.with_in_flight(scope, fence, |e, now| {
            let State::InFlight { fingerprint, .. } = e.state else {
                return;
            };
            e.wake();
            e.state = State::Completed {
                fence,
                fingerprint,
                outcome,
            };
            e.expires_at = now + ttl;
            e.last_used = self.tick();
        });
        if res.is_err() {
            self.unreserve(0, reserved);
        }
        res
    }

    fn wait_target(&self, scope: &Scope) -> Option<(Arc<Notify>, Fence, Instant)> {
        let now = Instant::now();
        let mut map = lock(self.shard(scope));
        let e = map.get_mut(scope)?;
        if Self::is_expired(e, now) {
            return None;
        }
        match &mut e.state {
            State::InFlight {
                fence,
                lease_until,
                waiters,
                ..
            } if *lease_until > now => {
                let n = waiters
                    .get_or_insert_with(|| Arc::new(Notify::new()))
                    .clone();
                Some((n, *fence, *lease_until))
            }
            _ => None,
        }
    }

    fn still_in_flight(&self, scope: &Scope, fence: Fence) -> bool {
        let now = Instant::now();
        let map = lock(self.shard(scope));
        map.get(scope).is_some_and(|e| {
            matches!(e.state, State::InFlight { fence: f, lease_until, .. } if f == fence && lease_until > now)
        })
    }
}

fn fence_of(e: &Entry) -> Fence {
    match e.state {
        State::InFlight { fence, .. }
        | State::Completed { fence, .. }
        | State::Released { fence } => fence,
    }
}

impl Store for MemoryStore {
    async fn claim(&self, req: ClaimRequest<'_>) -> Result<Claim, StoreError> {
        self.ensure_sweeper();
        self.inner.claim(req)
    }

    async fn renew(&self, scope: &Scope, fence: Fence, lease: Duration) -> Result<(), StoreError> {
        let tomb = self.inner.tombstone_ttl();
        self.inner.with_in_flight(scope, fence, |e, now| {
            if let State::InFlight { lease_until, .. } = &mut e.state {
                *lease_until = now + lease;
                e.expires_at = now + lease + tomb;
            }
        })
    }

    async fn complete(
        &self,
        scope: &Scope,
        fence: Fence,
        outcome: StoredOutcome,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        self.inner.complete(scope, fence, outcome, ttl)
    }

    async fn release(&self, scope: &Scope, fence: Fence) -> Result<(), StoreError> {
        let tomb = self.inner.tombstone_ttl();
        let tick = self.inner.tick();
        self.inner.with_in_flight(scope, fence, |e, now| {
            e.wake();
            e.state = State::Released { fence };
            e.expires_at = now + tomb;
            e.last_used = tick;
        })
    }

    async fn get(&self, scope: &Scope) -> Result<Option<RecordState>, StoreError> {
        let now = Instant::now();
        let map = lock(self.inner.shard(scope));
        Ok(map
            .get(scope)
            .filter(|e| !Inner::is_expired(e, now))
            .map(|e| match &e.state {
                State::InFlight {
                    fence,
                    fingerprint,
                    lease_until,
                    ..
                } => RecordState::InFlight {
                    fence: *fence,
                    fingerprint: *fingerprint,
                    lease_until: *lease_until,
                },
                State::Completed {
                    fence,
                    fingerprint,
                    outcome,
                } => RecordState::Completed {
                    fence: *fence,
                    fingerprint: *fingerprint,
                    outcome: outcome.clone(),
                },
                State::Released { fence } => RecordState::Released { fence: *fence },
            }))
    }

    async fn wait(&self, scope: &Scope, until: Instant) -> Result<(), StoreError> {
        let Some((notify, fence, lease_until)) = self.inner.wait_target(scope) else {
            return Ok(());
        };
        // Register before re-checking, so a change between the two is not missed
        // (`notify_waiters` wakes every `Notified` created before it).
        let notified = notify.notified();
        if !self.inner.still_in_flight(scope, fence) {
            return Ok(());
        }
        let _ = tokio::time::timeout_at(until.min(lease_until), notified).await;
        Ok(())
    }
}

#[cfg(test)]
mod tests;
