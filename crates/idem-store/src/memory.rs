//! The in-memory store: the embedded default for a server that runs as one process.
//!
//! # Design
//! - **Sharded**: records live in [`SHARDS`] `HashMap`s, each behind its own
//!   `std::sync::Mutex`, chosen by the scope digest. No lock is held across an `.await`
//!   and no call takes two shard locks at once, so there is no global lock on the hot
//!   path and no lock ordering to get wrong.
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
//! - **Clock**: `tokio::time::Instant`, so tests run on a paused clock.
//!
//! # Bounds
//! A new record (a claim of a scope that has none) must fit every bound below, or the
//! claim fails with [`StoreError::Full`] (retryable: the server layer answers
//! RESOURCE_EXHAUSTED with a retry delay); the refusal is counted per bound in
//! [`MemoryStoreStats`] and logged (the 1st, 2nd, 4th, 8th… refusal per bound).
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
//! that does not fit its tenant's or the store's bytes is recorded as
//! [`StoredOutcome::NotRetained`] (the handler already ran: a duplicate gets a clear
//! error, never a second run) and counted in `responses_dropped`.
//!
//! **Nothing is ever evicted.** Evicting a completed record before its TTL would let a
//! retry of its key run a second time, and evicting an in-flight one would let a
//! duplicate run while the first still runs. So a full store refuses new work instead
//! of forgetting outcomes; forgetting them is the record TTL's job. Replays, waits on
//! in-flight records and takeovers of expired leases add no record and are never
//! refused. Because each tenant may use only a share of the store (a quarter by
//! default), one tenant's load can neither remove another tenant's records nor use up
//! the whole store. A server with a single tenant should raise `maxEntriesPerTenant`
//! and `maxBytesPerTenant` to the store bounds.
//!
//! Size `maxEntries` for (protected calls per second × record TTL), per tenant too.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock, Weak};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use crate::{
    Claim, ClaimRequest, ClaimantId, Fence, Fingerprint, RecordState, Scope, Store, StoreError,
    StoredOutcome, TenantId,
};

/// Bounds and timings of a [`MemoryStore`] (`idem.memoryStore` in the service config).
///
/// # Defaults
/// `maxEntries` 100000, `maxBytes` 268435456 (256 MiB), `maxInFlightPerTenant`
/// `maxEntries / 16`, `maxEntriesPerTenant` `maxEntries / 4`, `maxBytesPerTenant`
/// `maxBytes / 4`, `sweepInterval` `"1s"`. A per-tenant bound above its store-wide
/// bound is cut to it. See the [module docs](self) for what happens at each bound.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemoryStoreSettings {
    /// Most records kept, all tenants together.
    pub max_entries: usize,
    /// Most bytes of stored responses (plus per-record overhead) kept, all tenants
    /// together.
    pub max_bytes: usize,
    /// Most in-flight records of one tenant; `None`: `max_entries / 16` (at least 1).
    pub max_in_flight_per_tenant: Option<usize>,
    /// Most records of one tenant; `None`: `max_entries / 4` (at least 1).
    pub max_entries_per_tenant: Option<usize>,
    /// Most bytes of one tenant; `None`: `max_bytes / 4`.
    pub max_bytes_per_tenant: Option<usize>,
    /// How often expired records are swept.
    pub sweep_interval: Duration,
}

impl Default for MemoryStoreSettings {
    fn default() -> Self {
        MemoryStoreSettings {
            max_entries: 100_000,
            max_bytes: 256 * 1024 * 1024,
            max_in_flight_per_tenant: None,
            max_entries_per_tenant: None,
            max_bytes_per_tenant: None,
            sweep_interval: Duration::from_secs(1),
        }
    }
}

impl MemoryStoreSettings {
    /// The in-flight records one tenant may hold, defaults applied.
    pub fn tenant_in_flight_bound(&self) -> usize {
        self.max_in_flight_per_tenant
            .unwrap_or((self.max_entries / 16).max(1))
            .min(self.tenant_entries_bound())
    }

    /// The records one tenant may hold, defaults applied.
    pub fn tenant_entries_bound(&self) -> usize {
        self.max_entries_per_tenant
            .unwrap_or((self.max_entries / 4).max(1))
            .min(self.max_entries)
    }

    /// The bytes one tenant may hold, defaults applied.
    pub fn tenant_bytes_bound(&self) -> usize {
        self.max_bytes_per_tenant
            .unwrap_or(self.max_bytes / 4)
            .min(self.max_bytes)
    }
}

/// Number of shards.
pub const SHARDS: usize = 64;

/// Number of shards of the tenant map.
const TENANT_SHARDS: usize = 16;

/// Bytes charged against the byte bounds for each record on top of its stored response.
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
type Tenants = HashMap<TenantId, Arc<Usage>, BuildHasherDefault<ScopeHasher>>;

/// What a tenant (or the whole store) holds.
#[derive(Debug, Default)]
struct Usage {
    in_flight: AtomicUsize,
    entries: AtomicUsize,
    bytes: AtomicUsize,
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
        lease_until: Instant,
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
    expires_at: Instant,
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

    fn wake(&mut self) {
        if let State::InFlight {
            waiters: Some(n), ..
        } = &mut self.state
        {
            n.notify_waiters();
        }
    }
}

/// `now + d`, saturating far in the future instead of overflowing.
fn later(now: Instant, d: Duration) -> Instant {
    now.checked_add(d)
        .unwrap_or_else(|| now + Duration::from_secs(100 * 365 * 24 * 3600))
}

/// Expiry of an in-flight record: one more lease after the lease ends.
fn in_flight_expiry(now: Instant, lease: Duration) -> Instant {
    later(later(now, lease), lease)
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
    shards: Box<[Mutex<Map>]>,
    tenants: Box<[RwLock<Tenants>]>,
    settings: MemoryStoreSettings,
    limits: Limits,
    next_fence: AtomicU64,
    total: Usage,
    expirations: AtomicU64,
    rejections: [AtomicU64; Bound::ALL],
    responses_dropped: AtomicU64,
    sweeper_started: AtomicBool,
}

/// The embedded default [`Store`]: sharded, bounded per tenant and in total, with TTL
/// expiry. See the module docs.
///
/// ```
/// # use idem_store::{MemoryStore, MemoryStoreSettings};
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
        let tenants = (0..TENANT_SHARDS)
            .map(|_| RwLock::new(Tenants::default()))
            .collect();
        let store = MemoryStore {
            inner: Arc::new(Inner {
                shards,
                tenants,
                limits: Limits::of(&settings),
                settings,
                next_fence: AtomicU64::new(1),
                total: Usage::default(),
                expirations: AtomicU64::new(0),
                rejections: Default::default(),
                responses_dropped: AtomicU64::new(0),
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
            tenants: i
                .tenants
                .iter()
                .map(|t| t.read().unwrap_or_else(|p| p.into_inner()).len())
                .sum(),
            expirations: i.expirations.load(Ordering::Relaxed),
            full_rejections: i.rejections.iter().map(|a| a.load(Ordering::Relaxed)).sum(),
            rejected_tenant_in_flight: r(Bound::TenantInFlight),
            rejected_tenant_entries: r(Bound::TenantEntries),
            rejected_tenant_bytes: r(Bound::TenantBytes),
            rejected_store_entries: r(Bound::StoreEntries),
            rejected_store_bytes: r(Bound::StoreBytes),
            responses_dropped: i.responses_dropped.load(Ordering::Relaxed),
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
    fn shard(&self, scope: &Scope) -> &Mutex<Map> {
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
            .or_default()
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

    /// Charges `n` response bytes to `t` and the store, if they fit both.
    fn admit_bytes(&self, t: &Usage, n: usize) -> bool {
        if !add_within(&t.bytes, n, self.limits.tenant_bytes) {
            return false;
        }
        if !add_within(&self.total.bytes, n, self.limits.bytes) {
            sub(&t.bytes, n);
            return false;
        }
        true
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
                "idempotency memory store: {}; new claims are refused until records complete, \
                 are released or expire",
                bound.describe()
            );
        }
        StoreError::Full(format!("{} ({limit})", bound.describe()).into())
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
        // Tenants whose usage nobody references (no record, no claim under way) go.
        for shard in self.tenants.iter() {
            let mut map = shard.write().unwrap_or_else(|p| p.into_inner());
            map.retain(|_, u| Arc::strong_count(u) > 1);
        }
    }

    fn new_in_flight(&self, req: &ClaimRequest<'_>, now: Instant, tenant: Arc<Usage>) -> Entry {
        Entry {
            state: State::InFlight {
                fence: self.fence(),
                fingerprint: *req.fingerprint,
                claimant: req.claimant,
                lease_until: later(now, req.lease),
                waiters: None,
            },
            expires_at: in_flight_expiry(now, req.lease),
            tenant,
        }
    }

    /// Claim on an entry that has not expired: replay, mismatch, wait, re-claim or
    /// takeover. Adds no record, so no bound applies.
    fn claim_existing(&self, e: &mut Entry, req: &ClaimRequest<'_>, now: Instant) -> Claim {
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
            } if *lease_until > now => {
                if *claimant != req.claimant {
                    return Claim::InFlight {
                        lease_remaining: *lease_until - now,
                    };
                }
                // The same claimant again (a lost reply): same fence, lease extended.
                *lease_until = (*lease_until).max(later(now, req.lease));
                e.expires_at = e.expires_at.max(in_flight_expiry(now, req.lease));
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
                *e = self.new_in_flight(req, now, tenant);
                Claim::Acquired {
                    fence: e.fence(),
                    takeover: true,
                }
            }
        }
    }

    fn claim(&self, req: ClaimRequest<'_>) -> Result<Claim, StoreError> {
        let now = Instant::now();
        let mut map = lock(self.shard(req.scope));
        if let Some(e) = map.get_mut(req.scope) {
            if !Self::is_expired(e, now) {
                return Ok(self.claim_existing(e, &req, now));
            }
            if let Some(mut old) = map.remove(req.scope) {
                old.wake();
                self.forget(&old);
                self.expirations.fetch_add(1, Ordering::Relaxed);
            }
        }
        let tenant = self.usage(req.tenant);
        if let Err(bound) = self.admit(&tenant) {
            return Err(self.refuse(bound));
        }
        let e = self.new_in_flight(&req, now, tenant);
        let fence = e.fence();
        map.insert(*req.scope, e);
        Ok(Claim::Acquired {
            fence,
            takeover: false,
        })
    }

    /// Locks the shard of `scope` and checks that it holds an in-flight record with
    /// `fence`. A lease that ended does not matter (the fence stays current until
    /// someone takes over); an expired record counts as gone.
    fn fenced(&self, scope: &Scope, fence: Fence) -> Result<MutexGuard<'_, Map>, StoreError> {
        let now = Instant::now();
        let map = lock(self.shard(scope));
        match map.get(scope).filter(|e| !Self::is_expired(e, now)) {
            Some(e) if e.is_in_flight() && e.fence() == fence => Ok(map),
            other => Err(StoreError::Fenced {
                presented: fence,
                current: other.map(Entry::fence),
            }),
        }
    }

    fn renew(&self, scope: &Scope, fence: Fence, lease: Duration) -> Result<(), StoreError> {
        let now = Instant::now();
        let mut map = self.fenced(scope, fence)?;
        if let Some(e) = map.get_mut(scope)
            && let State::InFlight { lease_until, .. } = &mut e.state
        {
            *lease_until = later(now, lease);
            e.expires_at = in_flight_expiry(now, lease);
        }
        Ok(())
    }

    fn complete(
        &self,
        scope: &Scope,
        fence: Fence,
        outcome: StoredOutcome,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        let now = Instant::now();
        let mut map = self.fenced(scope, fence)?;
        let Some(e) = map.get_mut(scope) else {
            unreachable!("checked by fenced")
        };
        let State::InFlight { fingerprint, .. } = e.state else {
            unreachable!("checked by fenced")
        };
        let outcome = if outcome.is_empty() || self.admit_bytes(&e.tenant, outcome.len()) {
            outcome
        } else {
            self.responses_dropped.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                bytes = outcome.len(),
                "idempotency memory store: response does not fit its tenant's or the store's \
                 byte bound; recorded as not retained"
            );
            StoredOutcome::NotRetained
        };
        e.wake();
        e.state = State::Completed {
            fence,
            fingerprint,
            outcome,
        };
        e.expires_at = later(now, ttl);
        sub(&e.tenant.in_flight, 1);
        sub(&self.total.in_flight, 1);
        Ok(())
    }

    /// Removes the record: the global fence counter keeps the next claim's fence higher.
    fn release(&self, scope: &Scope, fence: Fence) -> Result<(), StoreError> {
        let mut map = self.fenced(scope, fence)?;
        if let Some(mut e) = map.remove(scope) {
            e.wake();
            self.forget(&e);
        }
        Ok(())
    }

    fn get(&self, scope: &Scope) -> Option<RecordState> {
        let now = Instant::now();
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
        })
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

impl Store for MemoryStore {
    async fn claim(&self, req: ClaimRequest<'_>) -> Result<Claim, StoreError> {
        self.ensure_sweeper();
        self.inner.claim(req)
    }

    async fn renew(&self, scope: &Scope, fence: Fence, lease: Duration) -> Result<(), StoreError> {
        self.inner.renew(scope, fence, lease)
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
        self.inner.release(scope, fence)
    }

    async fn get(&self, scope: &Scope) -> Result<Option<RecordState>, StoreError> {
        Ok(self.inner.get(scope))
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
