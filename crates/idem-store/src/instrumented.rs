//! [`InstrumentedStore`]: any [`Store`], timed per operation, for metrics.
//!
//! It forwards every call unchanged and tells a [`StoreObserver`] the operation, the
//! store's kind (a label the caller picks: `memory`, `redis`, `postgres`), how long it
//! took and how it ended. No store changes; stack it where the store is built:
//!
//! ```
//! use idem_store::instrumented::{InstrumentedStore, StoreObserver, StoreOp, OpResult};
//! use idem_store::memory::MemoryStore;
//! use std::time::Duration;
//!
//! struct Print;
//! impl StoreObserver for Print {
//!     fn operation(&self, kind: &'static str, op: StoreOp, took: Duration, result: OpResult) {
//!         println!("{kind} {} {} in {took:?}", op.as_str(), result.as_str());
//!     }
//! }
//! let store = InstrumentedStore::new(MemoryStore::default(), "memory", Print);
//! # let _ = store;
//! ```

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::{Store, StoreError};

/// A [`Store`] operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum StoreOp {
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
    /// [`Store::wait`] (its duration is mostly the wait itself).
    Wait,
}

impl StoreOp {
    /// Every operation, in declaration order (`op as usize` indexes it).
    #[cfg_attr(not(any(test, feature = "testing")), allow(dead_code))]
    pub(crate) const ALL: [StoreOp; 6] = [
        StoreOp::Claim,
        StoreOp::Renew,
        StoreOp::Complete,
        StoreOp::Release,
        StoreOp::Get,
        StoreOp::Wait,
    ];

    /// The operation's place in [`StoreOp::ALL`], for per-operation tables.
    #[cfg_attr(not(any(test, feature = "testing")), allow(dead_code))]
    pub(crate) fn index(self) -> usize {
        self as usize
    }

    /// Lower-case name (`claim`), for labels.
    pub fn as_str(self) -> &'static str {
        match self {
            StoreOp::Claim => "claim",
            StoreOp::Renew => "renew",
            StoreOp::Complete => "complete",
            StoreOp::Release => "release",
            StoreOp::Get => "get",
            StoreOp::Wait => "wait",
        }
    }
}

/// How a store operation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum OpResult {
    /// It answered (whatever the answer).
    Ok,
    /// [`StoreError::Unavailable`].
    Unavailable,
    /// [`StoreError::Fenced`].
    Fenced,
    /// [`StoreError::Corrupt`].
    Corrupt,
    /// [`StoreError::Full`].
    Full,
}

impl OpResult {
    fn of<T>(r: &Result<T, StoreError>) -> Self {
        match r {
            Ok(_) => OpResult::Ok,
            Err(StoreError::Unavailable(_)) => OpResult::Unavailable,
            Err(StoreError::Fenced { .. }) => OpResult::Fenced,
            Err(StoreError::Corrupt(_)) => OpResult::Corrupt,
            Err(StoreError::Full(_)) => OpResult::Full,
        }
    }

    /// Lower-case name (`ok`, `unavailable`, `fenced`, `corrupt`, `full`), for labels.
    pub fn as_str(self) -> &'static str {
        match self {
            OpResult::Ok => "ok",
            OpResult::Unavailable => "unavailable",
            OpResult::Fenced => "fenced",
            OpResult::Corrupt => "corrupt",
            OpResult::Full => "full",
        }
    }
}

/// Told about every operation of an [`InstrumentedStore`]. Keep it short; never block.
pub trait StoreObserver: Send + Sync + 'static {
    /// `op` on a store of `kind` ended as `result` after `took`.
    fn operation(&self, kind: &'static str, op: StoreOp, took: Duration, result: OpResult);
}

/// A [`Store`] that times each operation of `St` for a [`StoreObserver`]. Cheap to
/// clone; see the [module docs](self).
pub struct InstrumentedStore<St> {
    inner: St,
    kind: &'static str,
    observer: Arc<dyn StoreObserver>,
}

impl<St: Clone> Clone for InstrumentedStore<St> {
    fn clone(&self) -> Self {
        InstrumentedStore {
            inner: self.inner.clone(),
            kind: self.kind,
            observer: self.observer.clone(),
        }
    }
}

impl<St: fmt::Debug> fmt::Debug for InstrumentedStore<St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("InstrumentedStore")
            .field("inner", &self.inner)
            .field("kind", &self.kind)
            .finish_non_exhaustive()
    }
}

impl<St> InstrumentedStore<St> {
    /// Wraps `inner`, a store of `kind` (a label: keep it to a few fixed names).
    pub fn new(inner: St, kind: &'static str, observer: impl StoreObserver) -> Self {
        Self::with_shared(inner, kind, Arc::new(observer))
    }

    /// [`new`](Self::new) with an observer shared by several stores.
    pub fn with_shared(inner: St, kind: &'static str, observer: Arc<dyn StoreObserver>) -> Self {
        InstrumentedStore {
            inner,
            kind,
            observer,
        }
    }

    /// The store inside.
    pub fn get_ref(&self) -> &St {
        &self.inner
    }

    /// Unwraps the store inside.
    pub fn into_inner(self) -> St {
        self.inner
    }

    async fn timed<T>(
        &self,
        op: StoreOp,
        fut: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        let start = Instant::now();
        let r = fut.await;
        self.observer
            .operation(self.kind, op, start.elapsed(), OpResult::of(&r));
        r
    }
}

/// Implements [`Store`] for the wrapper `$ty<St>` by passing each operation of its
/// `inner` store, with its [`StoreOp`], through the wrapper's method `$around` (`async
/// fn(&self, StoreOp, impl Future<Output = Result<T, StoreError>>) -> Result<T,
/// StoreError>`): one forwarding impl for every wrapper of a store. `Store` and
/// [`StoreOp`] must be in scope where it is used.
macro_rules! forward_store_ops {
    ($ty:ident, $around:ident) => {
        impl<St: Store> Store for $ty<St> {
            async fn claim(
                &self,
                req: $crate::ClaimRequest<'_>,
            ) -> Result<$crate::Claim, $crate::StoreError> {
                self.$around(StoreOp::Claim, self.inner.claim(req)).await
            }

            async fn renew(
                &self,
                scope: &$crate::Scope,
                fence: $crate::Fence,
                lease: std::time::Duration,
            ) -> Result<(), $crate::StoreError> {
                self.$around(StoreOp::Renew, self.inner.renew(scope, fence, lease))
                    .await
            }

            async fn complete(
                &self,
                req: $crate::CompleteRequest<'_>,
            ) -> Result<(), $crate::StoreError> {
                self.$around(StoreOp::Complete, self.inner.complete(req))
                    .await
            }

            async fn release(
                &self,
                scope: &$crate::Scope,
                fence: $crate::Fence,
            ) -> Result<(), $crate::StoreError> {
                self.$around(StoreOp::Release, self.inner.release(scope, fence))
                    .await
            }

            async fn get(
                &self,
                scope: &$crate::Scope,
            ) -> Result<Option<$crate::RecordState>, $crate::StoreError> {
                self.$around(StoreOp::Get, self.inner.get(scope)).await
            }

            /// Not observed: an operator's read, not a protected call's.
            async fn read_record(
                &self,
                scope: &$crate::Scope,
            ) -> Result<Option<$crate::RecordInfo>, $crate::StoreError> {
                self.inner.read_record(scope).await
            }

            /// Not observed: an operator's delete, not a protected call's.
            async fn delete_record(
                &self,
                scope: &$crate::Scope,
                mode: $crate::DeleteMode,
            ) -> Result<$crate::Deletion, $crate::StoreError> {
                self.inner.delete_record(scope, mode).await
            }

            async fn wait(
                &self,
                scope: &$crate::Scope,
                until: tokio::time::Instant,
            ) -> Result<(), $crate::StoreError> {
                self.$around(StoreOp::Wait, self.inner.wait(scope, until))
                    .await
            }
        }
    };
}
#[cfg(any(test, feature = "testing"))]
pub(crate) use forward_store_ops;

forward_store_ops!(InstrumentedStore, timed);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        Claim, ClaimRequest, ClaimantId, Fingerprint, Scope, TenantId, memory::MemoryStore,
    };
    use std::sync::Mutex;

    #[derive(Default)]
    struct Seen(Mutex<Vec<(&'static str, StoreOp, OpResult)>>);
    impl StoreObserver for Arc<Seen> {
        fn operation(&self, kind: &'static str, op: StoreOp, _: Duration, r: OpResult) {
            self.0.lock().unwrap().push((kind, op, r));
        }
    }

    #[tokio::test]
    async fn every_operation_is_timed_with_its_result() {
        let seen = Arc::new(Seen::default());
        let store = InstrumentedStore::new(MemoryStore::default(), "memory", seen.clone());
        let scope = Scope([1; 32]);
        let req = ClaimRequest {
            scope: &scope,
            tenant: &TenantId::default(),
            fingerprint: &Fingerprint([2; 32]),
            claimant: ClaimantId(3),
            lease: Duration::from_secs(10),
        };
        let Claim::Acquired { fence, .. } = store.claim(req).await.unwrap() else {
            panic!("a fresh scope is acquired");
        };
        store
            .renew(&scope, fence + 1, Duration::from_secs(1))
            .await
            .unwrap_err();
        store.release(&scope, fence).await.unwrap();
        store.get(&scope).await.unwrap();
        assert_eq!(
            *seen.0.lock().unwrap(),
            [
                ("memory", StoreOp::Claim, OpResult::Ok),
                ("memory", StoreOp::Renew, OpResult::Fenced),
                ("memory", StoreOp::Release, OpResult::Ok),
                ("memory", StoreOp::Get, OpResult::Ok),
            ]
        );
    }
}
