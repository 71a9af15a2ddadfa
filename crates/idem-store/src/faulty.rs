//! [`FaultyStore`]: any [`Store`] with faults injected into the operations a test picks
//! (a store blip, a lost reply, a full store, a store bug), and every operation counted.
//! The test double beside [`InstrumentedStore`](crate::instrumented::InstrumentedStore),
//! with the same [`StoreOp`]s; enable the `testing` feature to use it.
//!
//! ```
//! use idem_store::faulty::{FaultyStore, StoreFault};
//! use idem_store::instrumented::StoreOp;
//! use idem_store::memory::MemoryStore;
//!
//! let store = FaultyStore::new(MemoryStore::default());
//! store.inject(StoreOp::Complete, StoreFault::Unavailable, 1); // the next completion fails once
//! store.inject(StoreOp::Renew, StoreFault::Unavailable, usize::MAX); // renewals always fail
//! ```

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crate::instrumented::{StoreOp, forward_store_ops};
use crate::{Store, StoreError};

/// What goes wrong in a store operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreFault {
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

/// The operations, for the per-operation tables of [`Injections`].
const OPS: usize = StoreOp::ALL.len();

/// What was injected per operation, and what it hit: shared by the clones of one
/// [`FaultyStore`].
#[derive(Default)]
struct Injections {
    /// Per operation: the fault and how many more calls it hits.
    counted: Mutex<[Option<(StoreFault, usize)>; OPS]>,
    /// Per operation: a fault that hits each call with a probability, drawn from `rng`.
    random: Mutex<[Option<(StoreFault, f64)>; OPS]>,
    rng: Mutex<Option<rand::rngs::StdRng>>,
    calls: [AtomicUsize; OPS],
    faulted: [AtomicUsize; OPS],
}

/// Forwards to `St`, with faults injected per [`StoreOp`]. Clones share the faults and
/// counters.
#[derive(Clone)]
pub struct FaultyStore<St> {
    inner: St,
    injections: Arc<Injections>,
}

impl<St> FaultyStore<St> {
    /// Forwards to `inner`, with no faults yet.
    pub fn new(inner: St) -> Self {
        FaultyStore {
            inner,
            injections: Arc::default(),
        }
    }

    /// The next `times` calls of `op` fail with `fault` (`usize::MAX`: every call),
    /// replacing what was injected for `op` before.
    pub fn inject(&self, op: StoreOp, fault: StoreFault, times: usize) -> &Self {
        self.injections.counted.lock().expect("not poisoned")[op.index()] = Some((fault, times));
        self
    }

    /// Each call of `op` fails with `fault` with `probability`, drawn from a generator
    /// seeded with `seed` (one generator for every operation of this double), on top of
    /// what [`FaultyStore::inject`] set.
    pub fn inject_randomly(
        &self,
        op: StoreOp,
        fault: StoreFault,
        probability: f64,
        seed: u64,
    ) -> &Self {
        use rand::SeedableRng;
        let injections = &self.injections;
        injections.random.lock().expect("not poisoned")[op.index()] = Some((fault, probability));
        injections
            .rng
            .lock()
            .expect("not poisoned")
            .get_or_insert_with(|| rand::rngs::StdRng::seed_from_u64(seed));
        self
    }

    /// Removes the faults of `op`.
    pub fn heal(&self, op: StoreOp) -> &Self {
        self.injections.counted.lock().expect("not poisoned")[op.index()] = None;
        self.injections.random.lock().expect("not poisoned")[op.index()] = None;
        self
    }

    /// Calls of `op` so far (faulted or not).
    pub fn calls(&self, op: StoreOp) -> usize {
        self.injections.calls[op.index()].load(Ordering::SeqCst)
    }

    /// Calls of `op` that a fault hit.
    pub fn faulted(&self, op: StoreOp) -> usize {
        self.injections.faulted[op.index()].load(Ordering::SeqCst)
    }

    /// The store faults are injected in front of.
    pub fn inner(&self) -> &St {
        &self.inner
    }

    /// Counts a call of `op` and takes the fault that hits it, if any.
    fn take(&self, op: StoreOp) -> Option<StoreFault> {
        let injections = &self.injections;
        injections.calls[op.index()].fetch_add(1, Ordering::SeqCst);
        let fault = self.draw(op).or_else(|| {
            let mut counted = injections.counted.lock().expect("not poisoned");
            let slot = &mut counted[op.index()];
            let (fault, left) = (*slot)?;
            *slot = match left {
                usize::MAX => Some((fault, left)),
                1 => None,
                n => Some((fault, n - 1)),
            };
            Some(fault)
        })?;
        injections.faulted[op.index()].fetch_add(1, Ordering::SeqCst);
        Some(fault)
    }

    /// The random fault of `op`, when one is injected and the draw hits.
    fn draw(&self, op: StoreOp) -> Option<StoreFault> {
        use rand::Rng;
        let (fault, p) = self.injections.random.lock().expect("not poisoned")[op.index()]?;
        let mut rng = self.injections.rng.lock().expect("not poisoned");
        rng.as_mut()
            .is_some_and(|rng| rng.random_bool(p))
            .then_some(fault)
    }

    /// Runs `op` (the inner store's `fut`) unless a fault hits it.
    async fn around<T>(
        &self,
        op: StoreOp,
        fut: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        match self.take(op) {
            None => fut.await,
            Some(StoreFault::Unavailable) => Err(StoreError::Unavailable(INTERNAL_DETAIL.into())),
            Some(StoreFault::Full) => Err(StoreError::Full(INTERNAL_DETAIL.into())),
            Some(StoreFault::Panic) => panic!("a store bug in {op:?} (faulty store double)"),
            Some(StoreFault::ReplyLost) => {
                let _ = fut.await;
                Err(StoreError::Unavailable(INTERNAL_DETAIL.into()))
            }
        }
    }
}

forward_store_ops!(FaultyStore, around);
