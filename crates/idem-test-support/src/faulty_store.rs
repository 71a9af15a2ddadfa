//! [`FaultyStore`]: a store double that forwards to a real store and injects faults
//! into the operations a test picks (a store blip, a lost reply, a full store, a
//! partition), and counts every operation. Depends on `idem-store` only.
//!
//! ```
//! use idem_store::memory::MemoryStore;
//! use idem_test_support::faulty_store::{Fault, FaultyStore, Op};
//!
//! let store = FaultyStore::new(MemoryStore::default());
//! store.inject(Op::Complete, Fault::Unavailable, 1); // the next completion fails once
//! store.inject(Op::Renew, Fault::Unavailable, usize::MAX); // renewals always fail
//! ```

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem_store::{
    Claim, ClaimRequest, CompleteRequest, Fence, RecordState, Scope, Store, StoreError,
};
use tokio::time::Instant;

/// A store operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// [`Store::claim`].
    Claim,
    /// [`Store::renew`].
    Renew,
    /// [`Store::complete`].
    Complete,
    /// [`Store::release`].
    Release,
    /// [`Store::get`].
    Get,
    /// [`Store::wait`].
    Wait,
}

const OPS: usize = 6;

impl Op {
    fn index(self) -> usize {
        self as usize
    }
}

/// What goes wrong.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// The store cannot answer; nothing is applied.
    Unavailable,
    /// The operation is applied, but its reply is lost: the caller sees
    /// [`StoreError::Unavailable`] (as when a command times out after the store ran it).
    ReplyLost,
    /// The store (or the tenant's share) is full; nothing is applied.
    Full,
    /// The store's code panics (a bug in a store implementation); nothing is applied.
    Panic,
}

/// Text of the errors the double makes: store internals a client must never see.
pub const INTERNAL_DETAIL: &str = "OOM command not allowed (faulty store double)";

#[derive(Default)]
struct State {
    /// Per operation: the fault and how many more calls it hits.
    faults: Mutex<[Option<(Fault, usize)>; OPS]>,
    /// Per operation: a fault that hits each call with a probability, drawn from `rng`.
    random: Mutex<[Option<(Fault, f64)>; OPS]>,
    rng: Mutex<Option<rand::rngs::StdRng>>,
    calls: [AtomicUsize; OPS],
    faulted: [AtomicUsize; OPS],
}

/// Forwards to `St`, with faults injected per [`Op`]. Clones share the faults and
/// counters.
#[derive(Clone)]
pub struct FaultyStore<St> {
    inner: St,
    state: Arc<State>,
}

impl<St> FaultyStore<St> {
    /// Forwards to `inner`, with no faults yet.
    pub fn new(inner: St) -> Self {
        FaultyStore {
            inner,
            state: Arc::default(),
        }
    }

    /// The next `times` calls of `op` fail with `fault` (`usize::MAX`: every call),
    /// replacing what was injected for `op` before.
    pub fn inject(&self, op: Op, fault: Fault, times: usize) -> &Self {
        self.state.faults.lock().expect("not poisoned")[op.index()] = Some((fault, times));
        self
    }

    /// Each call of `op` fails with `fault` with `probability`, drawn from a generator
    /// seeded with `seed` (one generator for every operation of this double), on top of
    /// what [`FaultyStore::inject`] set.
    pub fn inject_randomly(&self, op: Op, fault: Fault, probability: f64, seed: u64) -> &Self {
        use rand::SeedableRng;
        self.state.random.lock().expect("not poisoned")[op.index()] = Some((fault, probability));
        self.state
            .rng
            .lock()
            .expect("not poisoned")
            .get_or_insert_with(|| rand::rngs::StdRng::seed_from_u64(seed));
        self
    }

    /// Removes the faults of `op`.
    pub fn heal(&self, op: Op) -> &Self {
        self.state.faults.lock().expect("not poisoned")[op.index()] = None;
        self.state.random.lock().expect("not poisoned")[op.index()] = None;
        self
    }

    /// Calls of `op` so far (faulted or not).
    pub fn calls(&self, op: Op) -> usize {
        self.state.calls[op.index()].load(Ordering::SeqCst)
    }

    /// Calls of `op` that a fault hit.
    pub fn faulted(&self, op: Op) -> usize {
        self.state.faulted[op.index()].load(Ordering::SeqCst)
    }

    /// The store faults are injected in front of.
    pub fn inner(&self) -> &St {
        &self.inner
    }

    /// Counts a call of `op` and takes the fault that hits it, if any.
    fn take(&self, op: Op) -> Option<Fault> {
        self.state.calls[op.index()].fetch_add(1, Ordering::SeqCst);
        if let Some((fault, p)) = self.state.random.lock().expect("not poisoned")[op.index()] {
            use rand::Rng;
            let hit = self
                .state
                .rng
                .lock()
                .expect("not poisoned")
                .as_mut()
                .is_some_and(|rng| rng.random_bool(p));
            if hit {
                self.state.faulted[op.index()].fetch_add(1, Ordering::SeqCst);
                return Some(fault);
            }
        }
        let mut faults = self.state.faults.lock().expect("not poisoned");
        let slot = &mut faults[op.index()];
        let (fault, left) = (*slot)?;
        *slot = match left {
            usize::MAX => Some((fault, left)),
            1 => None,
            n => Some((fault, n - 1)),
        };
        self.state.faulted[op.index()].fetch_add(1, Ordering::SeqCst);
        Some(fault)
    }

    async fn run<T>(
        &self,
        op: Op,
        f: impl std::future::Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        match self.take(op) {
            None => f.await,
            Some(Fault::Unavailable) => Err(StoreError::Unavailable(INTERNAL_DETAIL.into())),
            Some(Fault::Full) => Err(StoreError::Full(INTERNAL_DETAIL.into())),
            Some(Fault::Panic) => panic!("a store bug in {op:?} (faulty store double)"),
            Some(Fault::ReplyLost) => {
                let _ = f.await;
                Err(StoreError::Unavailable(INTERNAL_DETAIL.into()))
            }
        }
    }
}

impl<St: Store> Store for FaultyStore<St> {
    async fn claim(&self, req: ClaimRequest<'_>) -> Result<Claim, StoreError> {
        self.run(Op::Claim, self.inner.claim(req)).await
    }

    async fn renew(&self, scope: &Scope, fence: Fence, lease: Duration) -> Result<(), StoreError> {
        self.run(Op::Renew, self.inner.renew(scope, fence, lease))
            .await
    }

    async fn complete(&self, req: CompleteRequest<'_>) -> Result<(), StoreError> {
        self.run(Op::Complete, self.inner.complete(req)).await
    }

    async fn release(&self, scope: &Scope, fence: Fence) -> Result<(), StoreError> {
        self.run(Op::Release, self.inner.release(scope, fence))
            .await
    }

    async fn get(&self, scope: &Scope) -> Result<Option<RecordState>, StoreError> {
        self.run(Op::Get, self.inner.get(scope)).await
    }

    async fn wait(&self, scope: &Scope, until: Instant) -> Result<(), StoreError> {
        self.run(Op::Wait, self.inner.wait(scope, until)).await
    }
}
