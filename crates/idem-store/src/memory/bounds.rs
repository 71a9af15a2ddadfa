//! The bounds of the store: what a tenant and the whole store hold ([`Usage`]), the
//! limits with defaults applied, and the admission of a new record or of a response's
//! bytes, counted against them in O(1) (atomic counters, no lock).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use super::entry::{Entry, Queue};
use super::{MemoryStoreSettings, RECORD_OVERHEAD_BYTES, Table};
use crate::{Cause, StoreError, TenantId};

/// What a tenant (or the whole store) holds.
#[derive(Debug, Default)]
pub(super) struct Usage {
    pub(super) in_flight: AtomicUsize,
    pub(super) entries: AtomicUsize,
    pub(super) bytes: AtomicUsize,
    /// The tenant's completions, oldest first (unused for the store-wide usage).
    pub(super) done: Mutex<Queue>,
}

impl Usage {
    pub(super) fn done(&self) -> MutexGuard<'_, Queue> {
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

pub(super) fn sub(a: &AtomicUsize, n: usize) {
    a.fetch_sub(n, Ordering::AcqRel);
}

/// A bound of the [`MemoryStore`](super::MemoryStore): the one that refused a new record
/// (the source of its [`StoreError::Full`], see [`MemoryBound::refused`]), or whose usage
/// [`MemoryStore::usage_ratio`](super::MemoryStore::usage_ratio) reads.
///
/// It names the bound only: never a tenant, a count or another tenant's usage, so a
/// server may put [`as_str`](Self::as_str) in the refusal's `ErrorInfo` metadata and in
/// its outcome metric. (That the whole store is full says only that all tenants
/// together hold its bound.)
///
/// ```
/// # use idem_store::memory::MemoryBound;
/// # use idem_store::StoreError;
/// fn bound_label(e: &StoreError) -> &'static str {
///     MemoryBound::refused(e).map_or("unknown", MemoryBound::as_str)
/// }
/// # assert_eq!(bound_label(&StoreError::Full("x".into())), "unknown");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum MemoryBound {
    /// The tenant's in-flight records (`maxInFlightPerTenant`).
    TenantInFlight,
    /// The tenant's records (`maxEntriesPerTenant`).
    TenantEntries,
    /// The tenant's bytes (`maxBytesPerTenant`).
    TenantBytes,
    /// All records (`maxEntries`).
    StoreEntries,
    /// All bytes (`maxBytes`).
    StoreBytes,
}

impl MemoryBound {
    /// Every bound.
    pub const ALL: [MemoryBound; 5] = [
        MemoryBound::TenantInFlight,
        MemoryBound::TenantEntries,
        MemoryBound::TenantBytes,
        MemoryBound::StoreEntries,
        MemoryBound::StoreBytes,
    ];

    /// A stable label: `tenant_in_flight`, `tenant_entries`, `tenant_bytes`,
    /// `store_entries`, `store_bytes`.
    pub fn as_str(self) -> &'static str {
        match self {
            MemoryBound::TenantInFlight => "tenant_in_flight",
            MemoryBound::TenantEntries => "tenant_entries",
            MemoryBound::TenantBytes => "tenant_bytes",
            MemoryBound::StoreEntries => "store_entries",
            MemoryBound::StoreBytes => "store_bytes",
        }
    }

    /// Whether it bounds one tenant (else the whole store).
    pub fn is_tenant(self) -> bool {
        matches!(
            self,
            MemoryBound::TenantInFlight | MemoryBound::TenantEntries | MemoryBound::TenantBytes
        )
    }

    /// The bound that refused, when `e` is a memory store's [`StoreError::Full`].
    pub fn refused(e: &StoreError) -> Option<MemoryBound> {
        let StoreError::Full(cause) = e else {
            return None;
        };
        std::error::Error::source(cause)?
            .downcast_ref::<MemoryBound>()
            .copied()
    }

    pub(super) fn describe(self) -> &'static str {
        match self {
            MemoryBound::TenantInFlight => "tenant at its in-flight record bound",
            MemoryBound::TenantEntries => "tenant at its record bound",
            MemoryBound::TenantBytes => "tenant at its byte bound",
            MemoryBound::StoreEntries => "store at its record bound",
            MemoryBound::StoreBytes => "store at its byte bound",
        }
    }

    /// What it counts in `u`: in-flight records, records or bytes.
    fn used(self, u: &Usage) -> usize {
        let counter = match self {
            MemoryBound::TenantInFlight => &u.in_flight,
            MemoryBound::TenantEntries | MemoryBound::StoreEntries => &u.entries,
            MemoryBound::TenantBytes | MemoryBound::StoreBytes => &u.bytes,
        };
        counter.load(Ordering::Relaxed)
    }
}

impl std::fmt::Display for MemoryBound {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.describe())
    }
}

impl std::error::Error for MemoryBound {}

/// Usage at which a bound is near (80 %): a WARN is logged once.
fn near(limit: usize) -> usize {
    limit - limit / 5
}

/// Usage below which a bound that was near may warn again (70 %), as the sweeper sees it.
fn clear(limit: usize) -> usize {
    limit - limit / 10 * 3
}

/// The effective bounds, defaults applied.
#[derive(Debug, Clone, Copy)]
pub(super) struct Limits {
    tenant_in_flight: usize,
    tenant_entries: usize,
    pub(super) tenant_bytes: usize,
    entries: usize,
    bytes: usize,
}

impl Limits {
    pub(super) fn of(s: &MemoryStoreSettings) -> Self {
        Limits {
            tenant_in_flight: s.tenant_in_flight_bound(),
            tenant_entries: s.tenant_entries_bound(),
            tenant_bytes: s.tenant_bytes_bound(),
            entries: s.max_entries,
            bytes: s.max_bytes,
        }
    }

    pub(super) fn value(&self, b: MemoryBound) -> usize {
        match b {
            MemoryBound::TenantInFlight => self.tenant_in_flight,
            MemoryBound::TenantEntries => self.tenant_entries,
            MemoryBound::TenantBytes => self.tenant_bytes,
            MemoryBound::StoreEntries => self.entries,
            MemoryBound::StoreBytes => self.bytes,
        }
    }
}

impl Table {
    /// The usage counters of `tenant`, created on its first record.
    pub(super) fn usage(&self, tenant: &TenantId) -> Arc<Usage> {
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

    /// Charges one new in-flight record to the store and `t`, or names the bound it
    /// does not fit (store-wide bounds first). Atomic counters only: O(1), no lock.
    pub(super) fn admit(&self, t: &Usage) -> Result<(), MemoryBound> {
        let l = &self.limits;
        let o = RECORD_OVERHEAD_BYTES;
        let steps: [(&AtomicUsize, usize, usize, MemoryBound); 5] = [
            (&self.total.entries, 1, l.entries, MemoryBound::StoreEntries),
            (&self.total.bytes, o, l.bytes, MemoryBound::StoreBytes),
            (
                &t.in_flight,
                1,
                l.tenant_in_flight,
                MemoryBound::TenantInFlight,
            ),
            (&t.entries, 1, l.tenant_entries, MemoryBound::TenantEntries),
            (&t.bytes, o, l.tenant_bytes, MemoryBound::TenantBytes),
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
    pub(super) fn admit_bytes(&self, t: &Usage, n: usize) -> Result<(), MemoryBound> {
        if !add_within(&t.bytes, n, self.limits.tenant_bytes) {
            return Err(MemoryBound::TenantBytes);
        }
        if !add_within(&self.total.bytes, n, self.limits.bytes) {
            sub(&t.bytes, n);
            return Err(MemoryBound::StoreBytes);
        }
        Ok(())
    }

    /// Uncharges a removed entry.
    pub(super) fn forget(&self, e: &Entry) {
        let bytes = e.bytes();
        for u in [&*e.tenant, &self.total] {
            sub(&u.entries, 1);
            sub(&u.bytes, bytes);
            if e.is_in_flight() {
                sub(&u.in_flight, 1);
            }
        }
    }

    /// What `bound` counts now: the store's usage, or for a tenant bound `t`'s.
    fn used(&self, t: &Usage, bound: MemoryBound) -> usize {
        bound.used(if bound.is_tenant() { t } else { &self.total })
    }

    /// Logs a WARN the first time `t` (for a tenant bound) or the store passes 80 % of a
    /// bound; once more only after the sweeper saw every tenant below 70 % of it. A few
    /// atomic loads, after each admitted record or response.
    pub(super) fn watch(&self, t: &Usage) {
        for bound in MemoryBound::ALL {
            let limit = self.limits.value(bound);
            let used = self.used(t, bound);
            let warned = &self.near_warned[bound as usize];
            if used >= near(limit)
                && !warned.load(Ordering::Relaxed)
                && !warned.swap(true, Ordering::AcqRel)
            {
                tracing::warn!(
                    bound = bound.as_str(),
                    used,
                    limit,
                    min_retention = ?self.settings.min_retention,
                    "idempotency memory store: {} is at 80 % or more; at the bound, new \
                     calls are refused (RESOURCE_EXHAUSTED) unless completed records older \
                     than minRetention can be evicted: raise the bound or lower minRetention",
                    if bound.is_tenant() { "a tenant's share" } else { "the store" }
                );
            }
        }
    }

    /// The highest usage of `bound` over its limit: the store's, or the highest tenant's.
    pub(super) fn usage_ratio(&self, bound: MemoryBound) -> f64 {
        let used = if bound.is_tenant() {
            self.tenants
                .iter()
                .flat_map(|shard| {
                    let map = shard.read().unwrap_or_else(|p| p.into_inner());
                    map.values().map(|u| bound.used(u)).max()
                })
                .max()
                .unwrap_or(0)
        } else {
            bound.used(&self.total)
        };
        used as f64 / self.limits.value(bound).max(1) as f64
    }

    /// Lets a bound warn again once its usage (every tenant's, for a tenant bound) is back
    /// below 70 %; the sweeper calls it with every tenant's usage.
    pub(super) fn rearm(&self, tenants: &[Arc<Usage>]) {
        for bound in MemoryBound::ALL {
            let warned = &self.near_warned[bound as usize];
            if !warned.load(Ordering::Relaxed) {
                continue;
            }
            let used = if bound.is_tenant() {
                tenants.iter().map(|u| bound.used(u)).max().unwrap_or(0)
            } else {
                bound.used(&self.total)
            };
            if used < clear(self.limits.value(bound)) {
                warned.store(false, Ordering::Relaxed);
            }
        }
    }

    pub(super) fn refuse(&self, bound: MemoryBound) -> StoreError {
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
        StoreError::Full(Cause::new(format!("{} ({limit})", bound.describe()), bound))
    }
}
