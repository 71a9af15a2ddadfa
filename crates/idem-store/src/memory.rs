//! The in-memory store: the embedded default for a server that runs as one process.
//!
//! # Design
//! - **Sharded**: records live in [`SHARDS`] `HashMap`s, each behind its own
//!   `std::sync::Mutex`, chosen by the scope digest. No lock is held across an `.await`
//!   and no call takes two shard locks at once, so there is no global lock on the hot
//!   path. The only nesting: a tenant's completion queue, then one shard (eviction).
//! - **Fences** come from one store-wide counter, so they grow for every scope across
//!   release, takeover and expiry: a fence is never handed out twice. That is why a
//!   release can simply remove the record: no tombstone is needed to keep fences growing.
//! - **Per-tenant accounting**: each tenant (by its [`TenantId`] digest) has three
//!   atomic counters (in-flight records, records, bytes), found through a small sharded
//!   map and referenced from each of its records, beside the store-wide counters. A
//!   claim checks them in O(1); nothing on the claim path scans the store.
//! - **Expiry**: a completed record expires after the TTL given to `complete`. An
//!   in-flight record whose lease ended is taken over by the next claim of its scope;
//!   if none comes, it is kept for one more lease (a stalled holder can still record
//!   its outcome while nobody took over) and then dropped. A background task sweeps
//!   expired records every `sweep_interval`; it holds only a `Weak` reference and stops
//!   when the last clone of the store is dropped. Until a sweep, an expired record still
//!   counts against the bounds (a claim of its own scope replaces it at once).
//! - **Waiting**: a waiter parks on a `tokio::sync::Notify` that belongs to the in-flight
//!   record (allocated only when someone waits) and is woken directly by complete,
//!   release, takeover or removal; it also wakes when the lease ends.
//! - **Compact records**: a record is keyed by the first 128 bits of its [`Scope`]
//!   digest, and keeps its times as 8-byte ticks of the store's clock:
//!   [`RECORD_OVERHEAD_BYTES`] per record. For SHA-256 scopes (as the server layer makes
//!   them) two records alive at once share those bits with odds of about n² / 2¹²⁹ for
//!   n records. Making two scopes share them on purpose takes about 2⁶⁴ digests of keys
//!   the attacker chooses for both (normally two of its own tenant's keys: it then
//!   replays its own record to itself); aiming at a given record without choosing its
//!   key takes a second preimage, about 2¹²⁸ / n digests. A `Scope` made by other means
//!   must be uniform in its first 16 bytes.
//! - **Clock**: `tokio::time::Instant`, so tests run on a paused clock.
//!
//! # Bounds
//! A new record (a claim of a scope that has none) must fit every bound below. If it
//! does not, the claim first [evicts](#eviction) completed records older than
//! `minRetention`; if none may go, it fails with [`StoreError::Full`] (retryable: the
//! server layer answers RESOURCE_EXHAUSTED with a retry delay); the refusal is counted
//! per bound in [`MemoryStoreStats`] and logged (the 1st, 2nd, 4th, 8th… refusal per
//! bound).
//!
//! | bound | setting | default |
//! |-------|---------|---------|
//! | a tenant's in-flight records | `maxInFlightPerTenant` | `maxEntries / 16` |
//! | a tenant's records | `maxEntriesPerTenant` | `maxEntries / 4` |
//! | a tenant's bytes | `maxBytesPerTenant` | `maxBytes / 4` |
//! | all records | `maxEntries` | 100 000 |
//! | all bytes | `maxBytes` | 256 MiB |
//!
//! Bytes are stored responses plus [`RECORD_OVERHEAD_BYTES`] per record. A response
//! that does not fit its tenant's or the store's bytes (after evicting as a claim
//! would) is recorded as [`StoredOutcome::NotRetained`] (the handler already ran: a
//! duplicate gets a clear error, never a second run) and counted in
//! `responses_dropped`.
//!
//! Replays, waits on in-flight records and takeovers of expired leases add no record
//! and are never refused. Because each tenant may use only a share of the store (a
//! quarter by default), one tenant's load cannot use up the whole store. A server with
//! a single tenant should raise `maxEntriesPerTenant` and `maxBytesPerTenant` to the
//! store bounds.
//!
//! # Eviction
//! The store is a cache of recent outcomes: a full store keeps working by forgetting its
//! oldest outcomes, but never young ones. Every completed record is kept for at least
//! `minRetention` (default 10 minutes, [`DEFAULT_MIN_RETENTION`]); after that, until
//! its record TTL, it may be evicted (oldest completion first) to make room for a new
//! record:
//!
//! - **At a tenant's own record or byte bound**: the tenant's own records only.
//! - **At a store-wide bound**: a tenant holding less than its fair share of the store
//!   (the bound divided by the tenants holding records) takes a record of a tenant
//!   holding more than its share, never taking it below its share (and never evicts its
//!   own: it is refused if no such record may go yet); a tenant holding its share or
//!   more evicts its own records only. So one tenant's flood never costs a tenant
//!   within its fair share a record; it costs the flooding tenant its own oldest ones.
//! - **Never**: an in-flight record (a duplicate would run while the first still
//!   runs), a record completed less than `minRetention` ago, or anything at a tenant's
//!   in-flight bound. Then the claim is refused with [`StoreError::Full`].
//!
//! The trade-off: within `minRetention` a retry is always a replay; between
//! `minRetention` and the record TTL it is a replay unless its tenant's share was full
//! and the record was evicted (then the retry runs again). Each eviction is counted
//! (`evicted_after_min_retention`) and logged (the 1st, 2nd, 4th, 8th…). To never
//! evict, size `maxEntries` (and `maxEntriesPerTenant`, `maxBytes`) for protected calls
//! per second × record TTL, or set `minRetention` to the record TTL.
//!
//! Cost: O(1) amortized, no scan. Each completion is queued, in completion order, in
//! its tenant's queue and in its shard's; an entry whose record is gone or completed
//! again is skipped when it comes up (the sweeper compacts queues that hold mostly such
//! entries). A tenant's eviction looks at the front of its own queue; a store-wide one
//! at the front of each shard's queue, dropping entries of tenants within their share.

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock, Weak};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

pub use idem_core::config::{DEFAULT_MIN_RETENTION, MemoryStoreSettings};

use crate::{
    Claim, ClaimRequest, ClaimantId, CompleteRequest, Fence, Fingerprint, RecordState, Scope,
    Store, StoreError, StoredOutcome, TenantId,
};

/// Number of shards.
pub const SHARDS: usize = 64;

/// Most records one claim or completion evicts to make room.
const MAX_EVICTIONS_PER_CALL: usize = 16;

/// Number of shards of the tenant map.
const TENANT_SHARDS: usize = 16;

/// Bytes charged against the byte bounds for each record on top of its stored response.
///
/// Measured (test `memory_per_record`, 100 000 records of 16-byte responses): a map slot
/// is 113 bytes (the scope's first 16 bytes + entry 96 + 1 control byte) and the tables
/// run about 76 % full, so 149 bytes per record amortized; the two completion queues add
/// 2 × 32 bytes, 84 amortized (a `VecDeque` grows by doubling): 232 in all. The resident
/// set grew by 254 bytes per record including the 16-byte response and its allocation
/// header.
pub const RECORD_OVERHEAD_BYTES: usize = 240;

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

/// How this store names a record: the first 16 bytes of its [`Scope`], half the bytes
/// of the full digest in the map and in both completion queues. What that costs in
/// collisions: the module docs ("Compact records").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Name([u8; 16]);

impl Name {
    fn of(scope: &Scope) -> Self {
        let mut n = [0u8; 16];
        n.copy_from_slice(&scope.0[..16]);
        Name(n)
    }
}

type Map = HashMap<Name, Entry, BuildHasherDefault<ScopeHasher>>;
type Tenants = HashMap<TenantId, Arc<Usage>, BuildHasherDefault<ScopeHasher>>;

/// A completion, queued in completion order for eviction.
///
/// Queued once in its tenant's queue and once in its shard's; an entry whose record is
/// gone or was completed again (another fence) is stale and skipped when it comes up.
#[derive(Debug, Clone, Copy)]
struct Done {
    scope: Name,
    /// The fence of the run that completed: identifies this completion of the scope.
    fence: Fence,
    /// When it completed.
    at: Tick,
}

type Queue = VecDeque<Done>;

/// A queue with more stale entries than this (beyond twice its live ones) is compacted
/// by the sweeper.
const QUEUE_SLACK: usize = 64;

/// One shard: its records and its completions in completion order (for evictions at
/// the store-wide bounds).
#[derive(Default)]
struct Shard {
    map: Map,
    done: Queue,
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

/// What a tenant (or the whole store) holds.
#[derive(Debug, Default)]
struct Usage {
    in_flight: AtomicUsize,
    entries: AtomicUsize,
    bytes: AtomicUsize,
    /// The tenant's completions, oldest first (unused for the store-wide usage).
    done: Mutex<Queue>,
}

impl Usage {
    fn done(&self) -> MutexGuard<'_, Queue> {
        // Every mutation is a single push or pop: a poisoned queue is still consistent.
        self.done.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Adds `n` to `a` unless the sum would pass `max`.
fn add_within(a: &AtomicUsize, n: usize, max: usize) -> bool {
    a.fetch_update(Ordering::AcqRel, Ordering::Relaxed, |v| {
        v.checked_add(n).filter(|t| *t <= max)
    })
    .is_ok()
}

fn sub(a: &AtomicUsize, n: usize) {
    a.fetch_sub(n, Ordering::AcqRel);
}

/// A bound a claim or a response can hit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Bound {
    TenantInFlight,
    TenantEntries,
    TenantBytes,
    StoreEntries,
    StoreBytes,
}

impl Bound {
    const ALL: usize = 5;

    fn describe(self) -> &'static str {
        match self {
            Bound::TenantInFlight => "tenant at its in-flight record bound",
            Bound::TenantEntries => "tenant at its record bound",
            Bound::TenantBytes => "tenant at its byte bound",
            Bound::StoreEntries => "store at its record bound",
            Bound::StoreBytes => "store at its byte bound",
        }
    }
}

/// The effective bounds, defaults applied.
#[derive(Debug, Clone, Copy)]
struct Limits {
    tenant_in_flight: usize,
    tenant_entries: usize,
    tenant_bytes: usize,
    entries: usize,
    bytes: usize,
}

impl Limits {
    fn of(s: &MemoryStoreSettings) -> Self {
        Limits {
            tenant_in_flight: s.tenant_in_flight_bound(),
            tenant_entries: s.tenant_entries_bound(),
            tenant_bytes: s.tenant_bytes_bound(),
            entries: s.max_entries,
            bytes: s.max_bytes,
        }
    }

    fn value(&self, b: Bound) -> usize {
        match b {
            Bound::TenantInFlight => self.tenant_in_flight,
            Bound::TenantEntries => self.tenant_entries,
            Bound::TenantBytes => self.tenant_bytes,
            Bound::StoreEntries => self.entries,
            Bound::StoreBytes => self.bytes,
        }
    }
}

#[derive(Debug)]
enum State {
    InFlight {
        fence: Fence,
        fingerprint: Fingerprint,
        claimant: ClaimantId,
        lease_until: Tick,
        waiters: Option<Arc<Notify>>,
    },
    Completed {
        fence: Fence,
        fingerprint: Fingerprint,
        outcome: StoredOutcome,
    },
}

#[derive(Debug)]
struct Entry {
    state: State,
    /// When the sweeper may drop the record.
    expires_at: Tick,
    /// The usage of the tenant the record is charged to.
    tenant: Arc<Usage>,
}

impl Entry {
    fn bytes(&self) -> usize {
        RECORD_OVERHEAD_BYTES
            + match &self.state {
                State::Completed { outcome, .. } => outcome.len(),
                State::InFlight { .. } => 0,
            }
    }

    fn is_in_flight(&self) -> bool {
        matches!(self.state, State::InFlight { .. })
    }

    fn fence(&self) -> Fence {
        match self.state {
            State::InFlight { fence, .. } | State::Completed { fence, .. } => fence,
        }
    }

    /// Whether this is the completion `d` queued.
    fn is_completion(&self, d: &Done) -> bool {
        matches!(self.state, State::Completed { fence, .. } if fence == d.fence)
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

/// `d` in nanoseconds, saturated.
fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// `now + d`, saturating far in the future instead of overflowing.
fn later(now: Instant, d: Duration) -> Instant {
    now.checked_add(d)
        .unwrap_or_else(|| now + Duration::from_secs(100 * 365 * 24 * 3600))
}

/// The store's epoch: a day before it was made where the clock allows, so that a `now`
/// read on tokio's paused clock (a runtime built before the store, whose time stands
/// still) comes after it, and every tick stays as exact as the `Instant`s it stands for.
fn epoch() -> Instant {
    let now = Instant::now();
    [86_400, 3_600, 60, 1]
        .into_iter()
        .find_map(|s| now.checked_sub(Duration::from_secs(s)))
        .unwrap_or(now)
}

/// A point in the store's time: nanoseconds since its epoch. A record keeps its times
/// in 8 bytes each where an `Instant` takes 16; it saturates 584 years on.
type Tick = u64;

/// `now + d`, saturated.
fn after(now: Tick, d: Duration) -> Tick {
    now.saturating_add(nanos(d))
}

/// Expiry of an in-flight record: one more lease after the lease ends.
fn in_flight_expiry(now: Tick, lease: Duration) -> Tick {
    after(after(now, lease), lease)
}

/// Counters of a [`MemoryStore`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemoryStoreStats {
    /// Records currently held (in flight and completed, expired ones until swept).
    pub entries: usize,
    /// Records currently in flight.
    pub in_flight: usize,
    /// Bytes currently charged (responses + per-record overhead).
    pub bytes: usize,
    /// Tenants that currently hold records.
    pub tenants: usize,
    /// Records dropped because they expired.
    pub expirations: u64,
    /// Claims refused with [`StoreError::Full`], all bounds together.
    pub full_rejections: u64,
    /// Claims refused because their tenant held its most in-flight records.
    pub rejected_tenant_in_flight: u64,
    /// Claims refused because their tenant held its most records.
    pub rejected_tenant_entries: u64,
    /// Claims refused because their tenant held its most bytes.
    pub rejected_tenant_bytes: u64,
    /// Claims refused because the store held its most records.
    pub rejected_store_entries: u64,
    /// Claims refused because the store held its most bytes.
    pub rejected_store_bytes: u64,
    /// Responses recorded as not retained because they did not fit.
    pub responses_dropped: u64,
    /// Completed records evicted before their TTL (but after `minRetention`) to make
    /// room for a new record: a retry of one of their keys runs again.
    pub evicted_after_min_retention: u64,
    /// Of those, records evicted at a store-wide bound for another tenant's new record
    /// (their tenant held more than its fair share of the store).
    pub evicted_for_other_tenants: u64,
}

/// What one tenant holds in a [`MemoryStore`] ([`MemoryStore::tenant_usage`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TenantUsage {
    /// Its in-flight records.
    pub in_flight: usize,
    /// Its records (in flight and completed).
    pub entries: usize,
    /// Its bytes (responses + per-record overhead).
    pub bytes: usize,
}

struct Inner {
    shards: Box<[Mutex<Shard>]>,
    tenants: Box<[RwLock<Tenants>]>,
    /// Entries of `tenants`.
    tenant_count: AtomicUsize,
    settings: MemoryStoreSettings,
    limits: Limits,
    /// Origin of [`Done::at`].
    epoch: Instant,
    /// `min_retention` in nanoseconds (saturated).
    min_retention: u64,
    next_fence: AtomicU64,
    total: Usage,
    expirations: AtomicU64,
    rejections: [AtomicU64; Bound::ALL],
    responses_dropped: AtomicU64,
    evictions: AtomicU64,
    evictions_for_others: AtomicU64,
    /// Queue entries looked at while making room (to check that eviction is O(1)
    /// amortized).
    queue_steps: AtomicU64,
    /// The shard where the next search for another tenant's record starts.
    cursor: AtomicUsize,
    sweeper_started: AtomicBool,
}

/// The embedded default [`Store`]: sharded, bounded per tenant and in total, with TTL
/// expiry. See the module docs.
///
/// ```
/// # use idem_store::memory::{MemoryStore, MemoryStoreSettings};
/// let store = MemoryStore::new(MemoryStoreSettings {
///     max_entries: 10_000,
///     max_in_flight_per_tenant: Some(100),
///     ..Default::default()
/// });
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
    /// A store with [`MemoryStoreSettings::default`].
    fn default() -> Self {
        MemoryStore::new(MemoryStoreSettings::default())
    }
}

fn lock(m: &Mutex<Shard>) -> MutexGuard<'_, Shard> {
    // A panic while holding a shard lock leaves a consistent map (every mutation is a
    // single insert/remove/assignment), so a poisoned lock is still usable.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl MemoryStore {
    /// A store with these bounds. The sweeper starts on the current tokio runtime if
    /// there is one, else on the first call made from inside a runtime.
    pub fn new(settings: MemoryStoreSettings) -> Self {
        let shards = (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect();
        let tenants = (0..TENANT_SHARDS)
            .map(|_| RwLock::new(Tenants::default()))
            .collect();
        let store = MemoryStore {
            inner: Arc::new(Inner {
                shards,
                tenants,
                tenant_count: AtomicUsize::new(0),
                limits: Limits::of(&settings),
                epoch: epoch(),
                min_retention: nanos(settings.min_retention),
                settings,
                next_fence: AtomicU64::new(1),
                total: Usage::default(),
                expirations: AtomicU64::new(0),
                rejections: Default::default(),
                responses_dropped: AtomicU64::new(0),
                evictions: AtomicU64::new(0),
                evictions_for_others: AtomicU64::new(0),
                queue_steps: AtomicU64::new(0),
                cursor: AtomicUsize::new(0),
                sweeper_started: AtomicBool::new(false),
            }),
        };
        store.ensure_sweeper();
        store
    }

    /// The store's settings.
    pub fn settings(&self) -> &MemoryStoreSettings {
        &self.inner.settings
    }

    /// Records held (in flight and completed).
    pub fn len(&self) -> usize {
        self.inner.total.entries.load(Ordering::Relaxed)
    }

    /// Whether the store holds no record.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Current counters.
    pub fn stats(&self) -> MemoryStoreStats {
        let i = &self.inner;
        let r = |b: Bound| i.rejections[b as usize].load(Ordering::Relaxed);
        MemoryStoreStats {
            entries: i.total.entries.load(Ordering::Relaxed),
            in_flight: i.total.in_flight.load(Ordering::Relaxed),
            bytes: i.total.bytes.load(Ordering::Relaxed),
            tenants: i.tenant_count.load(Ordering::Relaxed),
            expirations: i.expirations.load(Ordering::Relaxed),
            full_rejections: i.rejections.iter().map(|a| a.load(Ordering::Relaxed)).sum(),
            rejected_tenant_in_flight: r(Bound::TenantInFlight),
            rejected_tenant_entries: r(Bound::TenantEntries),
            rejected_tenant_bytes: r(Bound::TenantBytes),
            rejected_store_entries: r(Bound::StoreEntries),
            rejected_store_bytes: r(Bound::StoreBytes),
            responses_dropped: i.responses_dropped.load(Ordering::Relaxed),
            evicted_after_min_retention: i.evictions.load(Ordering::Relaxed),
            evicted_for_other_tenants: i.evictions_for_others.load(Ordering::Relaxed),
        }
    }

    /// What `tenant` holds now, or `None` when it holds nothing the store knows of.
    pub fn tenant_usage(&self, tenant: &TenantId) -> Option<TenantUsage> {
        let map = self.inner.tenant_shard(tenant).read();
        let map = map.unwrap_or_else(|p| p.into_inner());
        map.get(tenant).map(|u| TenantUsage {
            in_flight: u.in_flight.load(Ordering::Relaxed),
            entries: u.entries.load(Ordering::Relaxed),
            bytes: u.bytes.load(Ordering::Relaxed),
        })
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
    fn shard(&self, scope: &Name) -> &Mutex<Shard> {
        &self.shards[usize::from(scope.0[0]) % SHARDS]
    }

    fn tenant_shard(&self, tenant: &TenantId) -> &RwLock<Tenants> {
        &self.tenants[usize::from(tenant.0[0]) % TENANT_SHARDS]
    }

    /// The usage counters of `tenant`, created on its first record.
    fn usage(&self, tenant: &TenantId) -> Arc<Usage> {
        let shard = self.tenant_shard(tenant);
        if let Some(u) = shard.read().unwrap_or_else(|p| p.into_inner()).get(tenant) {
            return u.clone();
        }
        shard
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .entry(*tenant)
            .or_insert_with(|| {
                self.tenant_count.fetch_add(1, Ordering::Relaxed);
                Arc::default()
            })
            .clone()
    }

    fn fence(&self) -> Fence {
        self.next_fence.fetch_add(1, Ordering::Relaxed)
    }

    /// Charges one new in-flight record to the store and `t`, or names the bound it
    /// does not fit (store-wide bounds first). Atomic counters only: O(1), no lock.
    fn admit(&self, t: &Usage) -> Result<(), Bound> {
        let l = &self.limits;
        let o = RECORD_OVERHEAD_BYTES;
        let steps: [(&AtomicUsize, usize, usize, Bound); 5] = [
            (&self.total.entries, 1, l.entries, Bound::StoreEntries),
            (&self.total.bytes, o, l.bytes, Bound::StoreBytes),
            (&t.in_flight, 1, l.tenant_in_flight, Bound::TenantInFlight),
            (&t.entries, 1, l.tenant_entries, Bound::TenantEntries),
            (&t.bytes, o, l.tenant_bytes, Bound::TenantBytes),
        ];
        for (i, (counter, n, max, bound)) in steps.iter().enumerate() {
            if !add_within(counter, *n, *max) {
                for (counter, n, ..) in &steps[..i] {
                    sub(counter, *n);
                }
                return Err(*bound);
            }
        }
        self.total.in_flight.fetch_add(1, Ordering::AcqRel);
        Ok(())
    }

    /// Charges `n` response bytes to `t` and the store, or names the bound they do not
    /// fit.
    fn admit_bytes(&self, t: &Usage, n: usize) -> Result<(), Bound> {
        if !add_within(&t.bytes, n, self.limits.tenant_bytes) {
            return Err(Bound::TenantBytes);
        }
        if !add_within(&self.total.bytes, n, self.limits.bytes) {
            sub(&t.bytes, n);
            return Err(Bound::StoreBytes);
        }
        Ok(())
    }

    // ---- eviction (see the module docs) --------------------------------------------------
    //
    // Lock order: a tenant's queue, then one shard. A shard lock is never held while
    // taking a tenant's queue (complete queues the tenant's entry after unlocking).

    /// `now` in ticks.
    fn tick(&self, now: Instant) -> Tick {
        nanos(now.saturating_duration_since(self.epoch))
    }

    /// The instant of tick `t`.
    fn instant(&self, t: Tick) -> Instant {
        later(self.epoch, Duration::from_nanos(t))
    }

    /// Whether a record completed at tick `at` may be evicted at tick `now`.
    fn old_enough(&self, at: u64, now: u64) -> bool {
        at.saturating_add(self.min_retention) <= now
    }

    /// `bound`'s measure of `u`: its records or its bytes.
    fn measure(u: &Usage, bound: Bound) -> usize {
        match bound {
            Bound::StoreEntries | Bound::TenantEntries | Bound::TenantInFlight => {
                u.entries.load(Ordering::Acquire)
            }
            Bound::StoreBytes | Bound::TenantBytes => u.bytes.load(Ordering::Acquire),
        }
    }

    /// A tenant's fair share of a store-wide bound: the bound divided among the tenants
    /// that hold records or claims.
    fn fair_share(&self, bound: Bound) -> usize {
        self.limits.value(bound) / self.tenant_count.load(Ordering::Relaxed).max(1)
    }

    /// Evicts one completed record so that `t` can add `need` (one record, or `need`
    /// bytes) under `bound`; false when no record may go. At its own bound a tenant
    /// evicts its own records; at a store-wide bound a tenant below its fair share
    /// evicts a record of a tenant above its share, and any other tenant its own.
    fn make_room(&self, t: &Arc<Usage>, bound: Bound, need: usize, now: Tick) -> bool {
        match bound {
            Bound::TenantInFlight => false,
            Bound::TenantEntries | Bound::TenantBytes => self.evict_own(t, bound, now),
            Bound::StoreEntries | Bound::StoreBytes => {
                let need = if bound == Bound::StoreEntries {
                    1
                } else {
                    need
                };
                if Self::measure(t, bound).saturating_add(need) <= self.fair_share(bound) {
                    self.evict_over_share(t, bound, now)
                } else {
                    self.evict_own(t, bound, now)
                }
            }
        }
    }

    /// Evicts `t`'s oldest completed record if it completed `min_retention` ago or more.
    fn evict_own(&self, t: &Usage, bound: Bound, tick: Tick) -> bool {
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
    fn evict_over_share(&self, claimant: &Arc<Usage>, bound: Bound, tick: Tick) -> bool {
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
                    let cost = if bound == Bound::StoreEntries {
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
    fn evicted(&self, e: &Entry, bound: Bound, for_other: bool, now: Tick) {
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
    fn queue_for_tenant(&self, t: &Usage, d: Done) {
        t.done().push_back(d);
    }

    /// Uncharges a removed entry.
    fn forget(&self, e: &Entry) {
        let bytes = e.bytes();
        for u in [&*e.tenant, &self.total] {
            sub(&u.entries, 1);
            sub(&u.bytes, bytes);
            if e.is_in_flight() {
                sub(&u.in_flight, 1);
            }
        }
    }

    fn refuse(&self, bound: Bound) -> StoreError {
        let n = self.rejections[bound as usize].fetch_add(1, Ordering::Relaxed) + 1;
        let limit = self.limits.value(bound);
        if n.is_power_of_two() {
            tracing::warn!(
                refusals = n,
                limit,
                "idempotency memory store: {}; new claims are refused until records complete \
                 (and are older than minRetention), are released or expire",
                bound.describe()
            );
        }
        StoreError::Full(format!("{} ({limit})", bound.describe()).into())
    }

    fn is_expired(e: &Entry, now: Tick) -> bool {
        e.expires_at <= now
    }

    fn sweep(&self, now: Instant) {
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

    fn new_in_flight(&self, req: &ClaimRequest<'_>, now: Tick, tenant: Arc<Usage>) -> Entry {
        Entry {
            state: State::InFlight {
                fence: self.fence(),
                fingerprint: *req.fingerprint,
                claimant: req.claimant,
                lease_until: after(now, req.lease),
                waiters: None,
            },
            expires_at: in_flight_expiry(now, req.lease),
            tenant,
        }
    }

    /// Claim on an entry that has not expired: replay, mismatch, wait, re-claim or
    /// takeover. Adds no record, so no bound applies.
    fn claim_existing(&self, e: &mut Entry, req: &ClaimRequest<'_>, tick: Tick) -> Claim {
        match &mut e.state {
            State::Completed {
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
            State::InFlight { fingerprint, .. } if fingerprint != req.fingerprint => {
                Claim::Mismatch
            }
            State::InFlight {
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
            State::InFlight { .. } => {
                // The lease ended: take over in place (same tenant, still one in-flight
                // record).
                e.wake();
                let tenant = e.tenant.clone();
                *e = self.new_in_flight(req, tick, tenant);
                Claim::Acquired {
                    fence: e.fence(),
                    takeover: true,
                }
            }
        }
    }

    fn claim(&self, req: ClaimRequest<'_>) -> Result<Claim, StoreError> {
        let scope = &Name::of(req.scope);
        let mut evictions = 0;
        loop {
            let now = self.tick(Instant::now());
            let mut map = lock(self.shard(scope));
            if let Some(e) = map.get_mut(scope) {
                if !Self::is_expired(e, now) {
                    return Ok(self.claim_existing(e, &req, now));
                }
                if let Some(mut old) = map.remove(scope) {
                    old.wake();
                    self.forget(&old);
                    self.expirations.fetch_add(1, Ordering::Relaxed);
                }
            }
            let tenant = self.usage(req.tenant);
            match self.admit(&tenant) {
                Ok(()) => {
                    let e = self.new_in_flight(&req, now, tenant);
                    let fence = e.fence();
                    map.insert(*scope, e);
                    return Ok(Claim::Acquired {
                        fence,
                        takeover: false,
                    });
                }
                Err(bound) => {
                    // Evict without holding this shard (eviction locks other shards),
                    // then look at the scope again: it may have changed meanwhile.
                    drop(map);
                    if evictions < MAX_EVICTIONS_PER_CALL
                        && self.make_room(&tenant, bound, RECORD_OVERHEAD_BYTES, now)
                    {
                        evictions += 1;
                        continue;
                    }
                    return Err(self.refuse(bound));
                }
            }
        }
    }

    /// Locks the shard of `scope` and checks that it holds an in-flight record with
    /// `fence`. A lease that ended does not matter (the fence stays current until
    /// someone takes over); an expired record counts as gone.
    fn fenced(&self, scope: &Name, fence: Fence) -> Result<MutexGuard<'_, Shard>, StoreError> {
        let now = self.tick(Instant::now());
        let map = lock(self.shard(scope));
        match map.get(scope).filter(|e| !Self::is_expired(e, now)) {
            Some(e) if e.is_in_flight() && e.fence() == fence => Ok(map),
            other => Err(StoreError::Fenced {
                presented: fence,
                current: other.map(Entry::fence),
            }),
        }
    }

    fn renew(&self, scope: &Name, fence: Fence, lease: Duration) -> Result<(), StoreError> {
        let now = self.tick(Instant::now());
        let mut map = self.fenced(scope, fence)?;
        if let Some(e) = map.get_mut(scope)
            && let State::InFlight { lease_until, .. } = &mut e.state
        {
            *lease_until = after(now, lease);
            e.expires_at = in_flight_expiry(now, lease);
        }
        Ok(())
    }

    fn complete(&self, req: CompleteRequest<'_>) -> Result<(), StoreError> {
        let CompleteRequest {
            scope,
            fence,
            outcome,
            ttl,
        } = req;
        let scope = &Name::of(scope);
        let n = outcome.len();
        // A response that could never fit evicts nothing.
        let may_evict = n + RECORD_OVERHEAD_BYTES <= self.limits.tenant_bytes;
        let mut evictions = 0;
        let (mut map, outcome) = loop {
            let map = self.fenced(scope, fence)?;
            let Some(e) = map.get(scope) else {
                unreachable!("checked by fenced")
            };
            let bound = match n {
                0 => break (map, outcome),
                _ => match self.admit_bytes(&e.tenant, n) {
                    Ok(()) => break (map, outcome),
                    Err(bound) => bound,
                },
            };
            let tenant = e.tenant.clone();
            drop(map);
            if !(may_evict
                && evictions < MAX_EVICTIONS_PER_CALL
                && self.make_room(&tenant, bound, n, self.tick(Instant::now())))
            {
                self.responses_dropped.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    bytes = n,
                    "idempotency memory store: response does not fit its tenant's or the \
                     store's byte bound; recorded as not retained"
                );
                break (self.fenced(scope, fence)?, StoredOutcome::NotRetained);
            }
            evictions += 1;
        };
        let now = self.tick(Instant::now());
        let Shard { map: records, done } = &mut *map;
        let Some(e) = records.get_mut(scope) else {
            unreachable!("checked by fenced")
        };
        let State::InFlight { fingerprint, .. } = e.state else {
            unreachable!("checked by fenced")
        };
        e.wake();
        e.state = State::Completed {
            fence,
            fingerprint,
            outcome,
        };
        e.expires_at = after(now, ttl);
        sub(&e.tenant.in_flight, 1);
        sub(&self.total.in_flight, 1);
        let d = Done {
            scope: *scope,
            fence,
            at: now,
        };
        done.push_back(d);
        let tenant = e.tenant.clone();
        drop(map);
        self.queue_for_tenant(&tenant, d);
        Ok(())
    }

    /// Removes the record: the global fence counter keeps the next claim's fence higher.
    fn release(&self, scope: &Name, fence: Fence) -> Result<(), StoreError> {
        let mut map = self.fenced(scope, fence)?;
        if let Some(mut e) = map.remove(scope) {
            e.wake();
            self.forget(&e);
        }
        Ok(())
    }

    fn get(&self, scope: &Name) -> Option<RecordState> {
        let now = self.tick(Instant::now());
        let map = lock(self.shard(scope));
        let e = map.get(scope).filter(|e| !Self::is_expired(e, now))?;
        Some(match &e.state {
            State::InFlight {
                fence,
                fingerprint,
                lease_until,
                ..
            } => RecordState::InFlight {
                fence: *fence,
                fingerprint: *fingerprint,
                lease_until: self.instant(*lease_until),
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
        })
    }

    fn wait_target(&self, scope: &Name) -> Option<(Arc<Notify>, Fence, Instant)> {
        let now = self.tick(Instant::now());
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
                Some((n, *fence, self.instant(*lease_until)))
            }
            _ => None,
        }
    }

    fn still_in_flight(&self, scope: &Name, fence: Fence) -> bool {
        let now = self.tick(Instant::now());
        let map = lock(self.shard(scope));
        map.get(scope).is_some_and(|e| {
            matches!(e.state, State::InFlight { fence: f, lease_until, .. } if f == fence && lease_until > now)
        })
    }
}

impl Store for MemoryStore {
    async fn claim(&self, req: ClaimRequest<'_>) -> Result<Claim, StoreError> {
        self.ensure_sweeper();
        self.inner.claim(req)
    }

    async fn renew(&self, scope: &Scope, fence: Fence, lease: Duration) -> Result<(), StoreError> {
        self.inner.renew(&Name::of(scope), fence, lease)
    }

    async fn complete(&self, req: CompleteRequest<'_>) -> Result<(), StoreError> {
        self.inner.complete(req)
    }

    async fn release(&self, scope: &Scope, fence: Fence) -> Result<(), StoreError> {
        self.inner.release(&Name::of(scope), fence)
    }

    async fn get(&self, scope: &Scope) -> Result<Option<RecordState>, StoreError> {
        Ok(self.inner.get(&Name::of(scope)))
    }

    async fn wait(&self, scope: &Scope, until: Instant) -> Result<(), StoreError> {
        let scope = &Name::of(scope);
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
