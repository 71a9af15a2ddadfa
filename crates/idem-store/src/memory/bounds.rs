//! The bounds of the store: what a tenant and the whole store hold ([`Usage`]), the
//! limits with defaults applied, and the admission of a new record or of a response's
//! bytes, counted against them in O(1) (atomic counters, no lock).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use super::entry::{Entry, Queue};
use super::{MemoryStoreSettings, RECORD_OVERHEAD_BYTES, Table};
use crate::{StoreError, TenantId};

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

/// A bound a claim or a response can hit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Bound {
    TenantInFlight,
    TenantEntries,
    TenantBytes,
    StoreEntries,
    StoreBytes,
}

impl Bound {
    pub(super) const ALL: usize = 5;

    pub(super) fn describe(self) -> &'static str {
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

    pub(super) fn value(&self, b: Bound) -> usize {
        match b {
            Bound::TenantInFlight => self.tenant_in_flight,
            Bound::TenantEntries => self.tenant_entries,
            Bound::TenantBytes => self.tenant_bytes,
            Bound::StoreEntries => self.entries,
            Bound::StoreBytes => self.bytes,
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
    pub(super) fn admit(&self, t: &Usage) -> Result<(), Bound> {
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
    pub(super) fn admit_bytes(&self, t: &Usage, n: usize) -> Result<(), Bound> {
        if !add_within(&t.bytes, n, self.limits.tenant_bytes) {
            return Err(Bound::TenantBytes);
        }
        if !add_within(&self.total.bytes, n, self.limits.bytes) {
            sub(&t.bytes, n);
            return Err(Bound::StoreBytes);
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

    pub(super) fn refuse(&self, bound: Bound) -> StoreError {
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
}
