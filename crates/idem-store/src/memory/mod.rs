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
//! - **Operators** read and delete one record with [`MemoryStore::record`] and
//!   [`MemoryStore::delete`] (also `Store::read_record` / `delete_record`). No network
//!   endpoint is added for them: records hold responses, which may be personal data;
//!   expose them only behind the service's own admin authentication.
//!
//! # Bounds
//! A new record (a claim of a scope that has none) must fit every bound below. If it
//! does not, the claim first [evicts](#eviction) completed records older than
//! `minRetention`; if none may go, it fails with [`StoreError::Full`] (retryable: the
//! server layer answers RESOURCE_EXHAUSTED with a retry delay); the refusal is counted
//! per bound in [`MemoryStoreStats`] and logged (the 1st, 2nd, 4th, 8th… refusal per
//! bound). The error names the bound that refused as a [`MemoryBound`]
//! ([`MemoryBound::refused`]), for the server's `ErrorInfo` and outcome metric.
//!
//! Before the cliff: when a tenant or the store passes 80 % of a bound the store logs a
//! WARN, once (again only after the sweeper saw it back under 70 %), and
//! [`MemoryStore::usage_ratio`] gives each bound's usage for a gauge.
//!
//! | bound | setting | default |
//! |-------|---------|---------|
//! | a tenant's in-flight records | `maxInFlightPerTenant` | `maxEntries / 16` |
//! | a tenant's records | `maxEntriesPerTenant` | `maxEntries / 4` |
//! | a tenant's bytes | `maxBytesPerTenant` | `maxBytes / 4` |
//! | all records | `maxEntries` | 2 000 000 ([`DEFAULT_MAX_ENTRIES`]) |
//! | all bytes | `maxBytes` | 256 MiB ([`DEFAULT_MAX_BYTES`]) |
//!
//! With a single tenant the three tenant bounds default to the store's (see below).
//!
//! Bytes are stored responses plus [`RECORD_OVERHEAD_BYTES`] per record. A response
//! that does not fit its tenant's or the store's bytes (after evicting as a claim
//! would) is recorded as [`StoredOutcome::NotRetained`] (the handler already ran: a
//! duplicate gets a clear error, never a second run) and counted in
//! `responses_dropped`.
//!
//! Replays, waits on in-flight records and takeovers of expired leases add no record
//! and are never refused. Because each tenant may use only a share of the store (a
//! quarter by default), one tenant's load cannot use up the whole store. With a single
//! tenant (`idem.tenant` `single`) the shares default to the whole store
//! ([`MemoryStoreSettings::for_single_tenant`]).
//!
//! # Default capacity
//! With the defaults, bytes bind first: a record of a 200-byte response is charged 440
//! bytes (with [`RECORD_OVERHEAD_BYTES`]), so 256 MiB hold **610 080 such records**
//! (the 2 000 000 of `maxEntries` are reached only by records of no response at all,
//! and not even then: 1 118 481 fit). As records younger than `minRetention` cannot
//! make room, that is **5 084 new protected calls per second** sustained for one
//! tenant (the whole store), or 1 271 per tenant when several share it (a quarter
//! each). Below that rate a full store evicts completed records older than two
//! minutes and never refuses; above it, new calls are refused (RESOURCE_EXHAUSTED)
//! until records age. `idem check-config` prints the rate of each bound of a config.
//!
//! # Eviction
//! The store is a cache of recent outcomes: a full store keeps working by forgetting its
//! oldest outcomes, but never young ones. Every completed record is kept for at least
//! `minRetention` (default 2 minutes, [`DEFAULT_MIN_RETENTION`]: the client's retry
//! window, which deadlines bound); after that, until
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

mod admin;
mod bounds;
mod entry;
mod evict;
mod sweep;

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

pub use idem_core::config::{
    DEFAULT_MAX_BYTES, DEFAULT_MAX_ENTRIES, DEFAULT_MIN_RETENTION, MemoryStoreSettings,
};

use crate::{
    Claim, ClaimRequest, CompleteRequest, DeleteMode, Deletion, Fence, RecordInfo, RecordState,
    Scope, Store, StoreError, StoredOutcome, TenantId,
};
pub use bounds::MemoryBound;

use bounds::{Limits, Usage, sub};
use entry::{
    Done, Entry, EntryState, Name, Shard, Tenants, Tick, after, epoch, in_flight_expiry, lock,
    nanos,
};
use evict::MAX_EVICTIONS_PER_CALL;

/// Number of shards.
pub const SHARDS: usize = 64;

/// A locked shard.
type Locked<'a> = MutexGuard<'a, Shard>;

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

/// The store's record table, shared by every clone of a [`MemoryStore`]: the shards of
/// records, the tenants' usage, the bounds with defaults applied, and the counters.
struct Table {
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
    rejections: [AtomicU64; MemoryBound::ALL.len()],
    /// Whether each bound was seen at 80 % (warned once; the sweeper re-arms it).
    near_warned: [AtomicBool; MemoryBound::ALL.len()],
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
    inner: Arc<Table>,
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

impl MemoryStore {
    /// A store with these bounds. The sweeper starts on the current tokio runtime if
    /// there is one, else on the first call made from inside a runtime.
    pub fn new(settings: MemoryStoreSettings) -> Self {
        let shards = (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect();
        let tenants = (0..TENANT_SHARDS)
            .map(|_| RwLock::new(Tenants::default()))
            .collect();
        let store = MemoryStore {
            inner: Arc::new(Table {
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
                near_warned: Default::default(),
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
        let r = |b: MemoryBound| i.rejections[b as usize].load(Ordering::Relaxed);
        MemoryStoreStats {
            entries: i.total.entries.load(Ordering::Relaxed),
            in_flight: i.total.in_flight.load(Ordering::Relaxed),
            bytes: i.total.bytes.load(Ordering::Relaxed),
            tenants: i.tenant_count.load(Ordering::Relaxed),
            expirations: i.expirations.load(Ordering::Relaxed),
            full_rejections: i.rejections.iter().map(|a| a.load(Ordering::Relaxed)).sum(),
            rejected_tenant_in_flight: r(MemoryBound::TenantInFlight),
            rejected_tenant_entries: r(MemoryBound::TenantEntries),
            rejected_tenant_bytes: r(MemoryBound::TenantBytes),
            rejected_store_entries: r(MemoryBound::StoreEntries),
            rejected_store_bytes: r(MemoryBound::StoreBytes),
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

    /// How full `bound` is: usage over the bound, 0.0 to 1.0 (for a tenant bound, the
    /// fullest tenant's). A gauge reads it; the store logs a WARN when a bound passes
    /// 0.8. Tenant bounds look at every tenant (O(tenants)); store bounds are O(1).
    pub fn usage_ratio(&self, bound: MemoryBound) -> f64 {
        self.inner.usage_ratio(bound)
    }

    /// Drops every expired record now (the sweeper does this every `sweep_interval`).
    pub fn sweep(&self) {
        self.inner.sweep(Instant::now());
    }
}

impl Table {
    fn shard(&self, scope: &Name) -> &Mutex<Shard> {
        &self.shards[usize::from(scope.0[0]) % SHARDS]
    }

    fn tenant_shard(&self, tenant: &TenantId) -> &RwLock<Tenants> {
        &self.tenants[usize::from(tenant.0[0]) % TENANT_SHARDS]
    }

    fn fence(&self) -> Fence {
        self.next_fence.fetch_add(1, Ordering::Relaxed)
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
                    self.watch(&tenant);
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
    /// someone takes over); an expired record (at `now`) counts as gone.
    fn fenced(&self, scope: &Name, fence: Fence, now: Tick) -> Result<Locked<'_>, StoreError> {
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
        let mut map = self.fenced(scope, fence, now)?;
        if let Some(e) = map.get_mut(scope)
            && let EntryState::InFlight { lease_until, .. } = &mut e.state
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
        // One clock read, unless making room took a while.
        let mut now = self.tick(Instant::now());
        let (mut map, outcome) = loop {
            let map = self.fenced(scope, fence, now)?;
            let Some(e) = map.get(scope) else {
                unreachable!("checked by fenced")
            };
            let bound = match n {
                0 => break (map, outcome),
                _ => match self.admit_bytes(&e.tenant, n) {
                    Ok(()) => {
                        self.watch(&e.tenant);
                        break (map, outcome);
                    }
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
                break (self.fenced(scope, fence, now)?, StoredOutcome::NotRetained);
            }
            evictions += 1;
            now = self.tick(Instant::now());
        };
        let Shard { map: records, done } = &mut *map;
        let Some(e) = records.get_mut(scope) else {
            unreachable!("checked by fenced")
        };
        let EntryState::InFlight { fingerprint, .. } = e.state else {
            unreachable!("checked by fenced")
        };
        e.wake();
        e.state = EntryState::Completed {
            fence,
            fingerprint,
            outcome,
            created: e.created(),
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
        let mut map = self.fenced(scope, fence, self.tick(Instant::now()))?;
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
        Some(self.record_state(e))
    }

    /// What `get` and the admin read report of an entry.
    pub(super) fn record_state(&self, e: &Entry) -> RecordState {
        match &e.state {
            EntryState::InFlight {
                fence,
                fingerprint,
                lease_until,
                ..
            } => RecordState::InFlight {
                fence: *fence,
                fingerprint: *fingerprint,
                lease_until: self.instant(*lease_until),
            },
            EntryState::Completed {
                fence,
                fingerprint,
                outcome,
                ..
            } => RecordState::Completed {
                fence: *fence,
                fingerprint: *fingerprint,
                outcome: outcome.clone(),
            },
        }
    }

    fn wait_target(&self, scope: &Name) -> Option<(Arc<Notify>, Fence, Instant)> {
        let now = self.tick(Instant::now());
        let mut map = lock(self.shard(scope));
        let e = map.get_mut(scope)?;
        if Self::is_expired(e, now) {
            return None;
        }
        match &mut e.state {
            EntryState::InFlight {
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
            matches!(e.state, EntryState::InFlight { fence: f, lease_until, .. } if f == fence && lease_until > now)
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

    async fn read_record(&self, scope: &Scope) -> Result<Option<RecordInfo>, StoreError> {
        Ok(self.record(scope))
    }

    async fn delete_record(&self, scope: &Scope, mode: DeleteMode) -> Result<Deletion, StoreError> {
        Ok(self.delete(scope, mode))
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
