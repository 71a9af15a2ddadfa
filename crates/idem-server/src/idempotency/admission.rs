//! What one layer lets protected calls hold at once: handler runs (all of them, each
//! tenant's share, and those whose caller went away) and waiting duplicates (all of
//! them, and each tenant's share).
//!
//! A handler run is admitted before its claim is sent ([`Admission::run`]); a call
//! refused here still claims, so a duplicate is answered from the store, and a claim it
//! acquires without a run is given back (see `call.rs`). A run holds its
//! [`HandlerSlot`] until its outcome is recorded, also after its caller went away:
//! the run goes on in a task of its own and is counted as *detached* until that task
//! ends ([`Admission::detached`]). While `maxDetachedHandlers` such runs are going, new
//! runs are refused: callers that cancel cannot make more handlers run at once than
//! callers that wait (tonic's own limits, `concurrency_limit_per_connection` and
//! `ConcurrencyLimitLayer`, count only calls whose caller is still there). A run never
//! stops because its caller went away, whatever the count: stopping a handler half-way
//! and letting the retry run it again would be a second run. So the count can pass the
//! bound by the runs whose callers were still waiting when it was reached, never by
//! more than `maxHandlersInFlight`.
//!
//! A duplicate that finds its key in flight holds a [`WaiterSlot`] while it waits.
//!
//! # Costs
//! Two atomic updates and one lock of a tenant shard (16 shards) per admission, and the
//! same on release; a tenant's entry exists only while it holds a run or a waiter.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use idem_core::config::IdemSettings;
use idem_store::TenantId;

const SHARDS: usize = 16;

/// A tenant's holdings by its id. The id is already a uniform digest: it is hashed by
/// taking 8 of its bytes, not SipHash's rounds (two per call).
type Tenants = HashMap<TenantId, Held, BuildHasherDefault<IdHasher>>;

/// Hashes a [`TenantId`] (16 digest bytes) by folding them into 8.
#[derive(Default)]
struct IdHasher(u64);

impl Hasher for IdHasher {
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

/// The bound that refused an admission, as the `bound` of the refusal's `ErrorInfo`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Bound {
    /// `idem.maxHandlersInFlight`.
    Handlers,
    /// `idem.maxHandlersPerTenant`.
    TenantHandlers,
    /// `idem.maxDetachedHandlers`.
    DetachedHandlers,
    /// `idem.maxWaiters`.
    Waiters,
    /// `idem.maxWaitersPerTenant`.
    TenantWaiters,
}

impl Bound {
    /// The label in the refusal's `ErrorInfo` metadata and in the logs.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Bound::Handlers => "handlers",
            Bound::TenantHandlers => "tenant_handlers",
            Bound::DetachedHandlers => "detached_handlers",
            Bound::Waiters => "waiters",
            Bound::TenantWaiters => "tenant_waiters",
        }
    }

    /// The config field that sets it.
    pub(crate) fn field(self) -> &'static str {
        match self {
            Bound::Handlers => "idem.maxHandlersInFlight",
            Bound::TenantHandlers => "idem.maxHandlersPerTenant",
            Bound::DetachedHandlers => "idem.maxDetachedHandlers",
            Bound::Waiters => "idem.maxWaiters",
            Bound::TenantWaiters => "idem.maxWaitersPerTenant",
        }
    }
}

/// The bounds, read from the config once, at build.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Limits {
    pub(crate) handlers: usize,
    /// A tenant's share of `handlers`: with several tenants, with a single one.
    tenant_handlers: [usize; 2],
    pub(crate) detached: usize,
    waiters: usize,
    tenant_waiters: [usize; 2],
}

impl Limits {
    pub(crate) fn new(s: &IdemSettings) -> Self {
        Limits {
            handlers: s.max_handlers_in_flight,
            tenant_handlers: [false, true]
                .map(|single| s.effective_max_handlers_per_tenant(single)),
            detached: s.max_detached_handlers,
            waiters: s.max_waiters,
            tenant_waiters: [false, true].map(|single| s.effective_max_waiters_per_tenant(single)),
        }
    }

    /// The bound `bound` names, for a layer with a single tenant or several.
    pub(crate) fn of(&self, bound: Bound, single_tenant: bool) -> usize {
        let i = usize::from(single_tenant);
        match bound {
            Bound::Handlers => self.handlers,
            Bound::TenantHandlers => self.tenant_handlers[i],
            Bound::DetachedHandlers => self.detached,
            Bound::Waiters => self.waiters,
            Bound::TenantWaiters => self.tenant_waiters[i],
        }
    }
}

/// One tenant's holdings.
#[derive(Debug, Default, Clone, Copy)]
struct Held {
    handlers: usize,
    waiters: usize,
}

/// The layer's counts against [`Limits`].
#[derive(Debug)]
pub(crate) struct Admission {
    pub(crate) limits: Limits,
    handlers: AtomicUsize,
    detached: AtomicUsize,
    waiters: AtomicUsize,
    tenants: Box<[Mutex<Tenants>]>,
}

impl Admission {
    pub(crate) fn new(limits: Limits) -> Arc<Self> {
        Arc::new(Admission {
            limits,
            handlers: AtomicUsize::new(0),
            detached: AtomicUsize::new(0),
            waiters: AtomicUsize::new(0),
            tenants: (0..SHARDS).map(|_| Mutex::default()).collect(),
        })
    }

    fn shard(&self, tenant: &TenantId) -> MutexGuard<'_, Tenants> {
        self.tenants[usize::from(tenant.0[0]) % SHARDS]
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// One more handler run for `tenant`, or the bound that refuses it.
    pub(crate) fn run(
        self: &Arc<Self>,
        tenant: TenantId,
        single_tenant: bool,
    ) -> Result<HandlerSlot, Bound> {
        if self.detached.load(Ordering::Acquire) >= self.limits.detached {
            return Err(Bound::DetachedHandlers);
        }
        take(&self.handlers, self.limits.handlers).ok_or(Bound::Handlers)?;
        let share = self.limits.of(Bound::TenantHandlers, single_tenant);
        let mut shard = self.shard(&tenant);
        let held = shard.entry(tenant).or_default();
        if held.handlers >= share {
            let held = *held;
            forget_if_empty(&mut shard, tenant, held);
            drop(shard);
            self.handlers.fetch_sub(1, Ordering::AcqRel);
            return Err(Bound::TenantHandlers);
        }
        held.handlers += 1;
        Ok(HandlerSlot {
            admission: self.clone(),
            tenant,
        })
    }

    /// One more waiting duplicate for `tenant`, or the bound that refuses it.
    pub(crate) fn wait(
        self: &Arc<Self>,
        tenant: TenantId,
        single_tenant: bool,
    ) -> Result<WaiterSlot, Bound> {
        take(&self.waiters, self.limits.waiters).ok_or(Bound::Waiters)?;
        let share = self.limits.of(Bound::TenantWaiters, single_tenant);
        let mut shard = self.shard(&tenant);
        let held = shard.entry(tenant).or_default();
        if held.waiters >= share {
            let held = *held;
            forget_if_empty(&mut shard, tenant, held);
            drop(shard);
            self.waiters.fetch_sub(1, Ordering::AcqRel);
            return Err(Bound::TenantWaiters);
        }
        held.waiters += 1;
        Ok(WaiterSlot {
            admission: self.clone(),
            tenant,
        })
    }

    /// A run whose caller went away: counted as detached until the guard is dropped
    /// (when the run's task ends).
    pub(crate) fn detached(self: &Arc<Self>) -> DetachedRun {
        self.detached.fetch_add(1, Ordering::AcqRel);
        DetachedRun(self.clone())
    }

    /// Handler runs in progress (detached ones included).
    pub(crate) fn handlers_in_flight(&self) -> usize {
        self.handlers.load(Ordering::Acquire)
    }

    /// Handler runs in progress whose caller went away.
    pub(crate) fn detached_in_flight(&self) -> usize {
        self.detached.load(Ordering::Acquire)
    }

    /// Duplicates waiting now.
    pub(crate) fn waiting(&self) -> usize {
        self.waiters.load(Ordering::Acquire)
    }

    fn put_back(&self, tenant: TenantId, f: impl FnOnce(&mut Held)) {
        let mut shard = self.shard(&tenant);
        if let Some(held) = shard.get_mut(&tenant) {
            f(held);
            let held = *held;
            forget_if_empty(&mut shard, tenant, held);
        }
    }
}

/// Adds one to `count` unless it is at `max`.
fn take(count: &AtomicUsize, max: usize) -> Option<usize> {
    count
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
            (n < max).then_some(n + 1)
        })
        .ok()
}

fn forget_if_empty(shard: &mut Tenants, tenant: TenantId, held: Held) {
    if held.handlers == 0 && held.waiters == 0 {
        shard.remove(&tenant);
    }
}

/// One handler run under the layer's bounds, given back when dropped.
#[derive(Debug)]
pub(crate) struct HandlerSlot {
    admission: Arc<Admission>,
    tenant: TenantId,
}

impl Drop for HandlerSlot {
    fn drop(&mut self) {
        let a = &self.admission;
        a.put_back(self.tenant, |h| h.handlers = h.handlers.saturating_sub(1));
        a.handlers.fetch_sub(1, Ordering::AcqRel);
    }
}

/// One waiting duplicate under the layer's bounds, given back when dropped.
#[derive(Debug)]
pub(crate) struct WaiterSlot {
    admission: Arc<Admission>,
    tenant: TenantId,
}

impl Drop for WaiterSlot {
    fn drop(&mut self) {
        let a = &self.admission;
        a.put_back(self.tenant, |h| h.waiters = h.waiters.saturating_sub(1));
        a.waiters.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A run whose caller went away, counted while it goes on.
#[derive(Debug)]
pub(crate) struct DetachedRun(Arc<Admission>);

impl Drop for DetachedRun {
    fn drop(&mut self) {
        self.0.detached.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(f: impl FnOnce(&mut IdemSettings)) -> Limits {
        let mut s = IdemSettings::default();
        f(&mut s);
        Limits::new(&s)
    }

    #[test]
    fn a_tenant_takes_its_share_and_another_still_runs() {
        let a = Admission::new(settings(|s| {
            s.max_handlers_in_flight = 4;
            s.max_handlers_per_tenant = Some(2);
        }));
        let (t1, t2, t3) = (TenantId([1; 16]), TenantId([2; 16]), TenantId([3; 16]));
        let held: Vec<_> = (0..2).map(|_| a.run(t1, false).unwrap()).collect();
        assert_eq!(a.run(t1, false).unwrap_err(), Bound::TenantHandlers);
        let other: Vec<_> = (0..2).map(|_| a.run(t2, false).unwrap()).collect();
        assert_eq!(a.run(t3, false).unwrap_err(), Bound::Handlers);
        assert_eq!(a.handlers_in_flight(), 4);
        drop(held);
        assert!(a.run(t1, false).is_ok());
        drop(other);
        assert_eq!(a.handlers_in_flight(), 0);
        assert!(a.tenants.iter().all(|s| s.lock().unwrap().is_empty()));
    }

    #[test]
    fn detached_runs_refuse_new_runs_at_their_bound() {
        let a = Admission::new(settings(|s| s.max_detached_handlers = 2));
        let t = TenantId([1; 16]);
        let gone: Vec<_> = (0..2)
            .map(|_| (a.run(t, true).unwrap(), a.detached()))
            .collect();
        assert_eq!(a.run(t, true).unwrap_err(), Bound::DetachedHandlers);
        assert_eq!(a.detached_in_flight(), 2);
        drop(gone);
        assert!(a.run(t, true).is_ok());
    }

    #[test]
    fn waiters_are_bounded_per_tenant_and_per_layer() {
        let a = Admission::new(settings(|s| {
            s.max_waiters = 3;
            s.max_waiters_per_tenant = Some(2);
        }));
        let (t1, t2) = (TenantId([1; 16]), TenantId([2; 16]));
        let w: Vec<_> = (0..2).map(|_| a.wait(t1, false).unwrap()).collect();
        assert_eq!(a.wait(t1, false).unwrap_err(), Bound::TenantWaiters);
        let w2 = a.wait(t2, false).unwrap();
        assert_eq!(a.wait(t2, false).unwrap_err(), Bound::Waiters);
        assert_eq!(a.waiting(), 3);
        drop((w, w2));
        assert_eq!(a.waiting(), 0);
    }

    #[test]
    fn a_single_tenant_gets_the_whole_bound_unless_its_share_is_set() {
        let l = settings(|_| {});
        assert_eq!(l.of(Bound::TenantHandlers, true), 1024);
        assert_eq!(l.of(Bound::TenantHandlers, false), 256);
        assert_eq!(l.of(Bound::TenantWaiters, true), 4096);
    }
}
