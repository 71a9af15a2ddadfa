//! The contract between idem's server layer and the places it keeps its records: the
//! [`Store`] trait, its record types and errors, the embedded [`MemoryStore`], and (with
//! the `testing` feature) a conformance suite every backend runs.
//!
//! Backends are crates of their own (`idem-redis`, or yours) that depend on this crate
//! only, not on the server layer.
//!
//! A record lives per [`Scope`] (digest of tenant + method + key). Its life:
//!
//! ```text
//!   (none) --claim--> InFlight{fence, lease} --complete--> Completed{response} --ttl--> (none)
//!     ^                  |  ^        |
//!     |           renew--+  |        |
//!     +-----release---------+--------+   (nothing was done: the record goes; the next
//!                           |             claim runs again with a higher fence)
//!                 lease expired: the next claim takes over with a higher fence
//! ```
//!
//! # Contract every store keeps
//! - Each method is atomic with respect to every other call on the same scope, across
//!   every process that shares the store.
//! - Fences only grow for a scope, across release, takeover and expiry. `renew`,
//!   `complete` and `release` succeed only for the current fence of an in-flight record;
//!   otherwise they return [`StoreError::Fenced`] and change nothing.
//! - A release leaves nothing that blocks or delays the next claim of the scope, with
//!   any fingerprint. (A store may keep a small [`RecordState::Released`] tombstone for a
//!   while if it needs one to keep fences growing; it never blocks a claim.)
//! - A claim that would add a record may be refused with [`StoreError::Full`] when the
//!   store or the tenant's share of it is at a bound. A store never makes room by
//!   dropping an in-flight record. It may drop a completed record before its TTL (a
//!   retry of its key then runs again) only as its documented eviction policy allows:
//!   the [`MemoryStore`] evicts records completed more than `minRetention` ago, of the
//!   claiming tenant or of a tenant above its fair share, never one of a tenant within
//!   its share for another tenant. Replays, waits and a claimant's own re-claim are
//!   never refused for being full.
//! - A claim sent again by the same claimant (same [`ClaimantId`], e.g. after a lost
//!   reply) while it still holds the lease gets the same fence back.
//! - A completed record answers claims with the same fingerprint with
//!   [`Claim::Completed`], and with a different fingerprint with [`Claim::Mismatch`]; so
//!   does an in-flight one ([`Claim::InFlight`] / [`Claim::Mismatch`]).
//! - [`StoreError::Unavailable`] means "the store could not answer": the layer fails
//!   closed (UNAVAILABLE) unless the method opts in to fail-open. It never means "no
//!   record".
//!
//! [`MemoryStore`]: memory::MemoryStore

// docs.rs (`--cfg docsrs`, nightly): feature-gated items say which feature they need.
#![cfg_attr(docsrs, feature(doc_cfg))]

use std::fmt;
use std::future::Future;
use std::time::Duration;

use bytes::Bytes;
use tokio::time::Instant;

#[cfg(any(test, feature = "testing"))]
#[cfg_attr(docsrs, doc(cfg(feature = "testing")))]
pub mod faulty;
pub mod format;
pub mod instrumented;
pub mod memory;
mod record;
pub mod records;
pub mod response;
#[cfg(any(test, feature = "testing"))]
#[cfg_attr(docsrs, doc(cfg(feature = "testing")))]
pub mod testing;
pub mod wait;

pub use record::RecordRef;
pub use records::{DeleteMode, Deletion, FORCE_DELETE_RISK, RecordInfo};

/// A generation number of a record; grows on every claim of a scope.
pub type Fence = u64;

/// The 32-byte digest naming a record: SHA-256 of the length-prefixed
/// (tenant, method path, key). Raw client input never reaches a store.
///
/// A store may name a record by a prefix of the digest ([`memory::MemoryStore`] keys
/// by the first 16 bytes), so a scope made by other means than the server layer's must
/// be as uniform as a digest in every byte: two scopes equal in their first 16 bytes
/// are one record there.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Scope(pub [u8; 32]);

impl Scope {
    /// The scope of a protected call, exactly as the server layer computes it: SHA-256
    /// over the version tag `idem-scope-v1`, then the tenant, the method path
    /// (`/package.Service/Method`, as in the request's URI) and the idempotency key, each
    /// as a big-endian `u64` length and its bytes. No separator inside a value can make
    /// two triples collide.
    ///
    /// ```
    /// # use idem_store::Scope;
    /// assert_ne!(
    ///     Scope::for_call("ab", "/s/m", "keykeykey"),
    ///     Scope::for_call("a", "b/s/m", "keykeykey"),
    /// );
    /// ```
    pub fn for_call(tenant: &str, method_path: &str, key: &str) -> Scope {
        use sha2::{Digest, Sha256};
        let mut h = Sha256::new();
        h.update(b"idem-scope-v1");
        for part in [tenant, method_path, key] {
            h.update((part.len() as u64).to_be_bytes());
            h.update(part.as_bytes());
        }
        Scope(h.finalize().into())
    }

    /// Lower-case hex, for logs and key names.
    pub fn to_hex(&self) -> String {
        hex32(&self.0)
    }

    /// The first 16 hex digits: how logs name a scope.
    pub fn short_hex(&self) -> String {
        hex(&self.0[..8])
    }
}

impl fmt::Debug for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Scope({})", self.short_hex())
    }
}

/// A digest naming the tenant a record belongs to, so a store can bound each tenant's
/// share (in-flight records, bytes) without seeing the tenant's name.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct TenantId(pub [u8; 16]);

impl TenantId {
    /// Lower-case hex, for logs and key names.
    pub fn to_hex(&self) -> String {
        hex(&self.0)
    }
}

impl fmt::Debug for TenantId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "TenantId({})", &self.to_hex()[..8])
    }
}

/// The 32-byte digest of a request's message bytes.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint(pub [u8; 32]);

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({})", &hex32(&self.0)[..16])
    }
}

fn hex32(b: &[u8; 32]) -> String {
    hex(b)
}

/// Lower-case hex: a table, not `fmt` (about 30× fewer instructions; keys and spans
/// name scopes on every call).
fn hex(b: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(2 * b.len());
    for &x in b {
        s.push(char::from(DIGITS[usize::from(x >> 4)]));
        s.push(char::from(DIGITS[usize::from(x & 0xf)]));
    }
    s
}

/// Identifies one claimant (one protected call being served), so a claim that is sent
/// again after a lost reply is recognised. Random per call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ClaimantId(pub u128);

impl ClaimantId {
    /// A fresh random id.
    pub fn random() -> Self {
        ClaimantId(rand_u128())
    }
}

fn rand_u128() -> u128 {
    rand::random()
}

/// What [`Store::claim`] asks.
#[derive(Debug, Clone, Copy)]
pub struct ClaimRequest<'a> {
    /// The record.
    pub scope: &'a Scope,
    /// The tenant the record is charged to (for per-tenant bounds).
    pub tenant: &'a TenantId,
    /// The request's fingerprint.
    pub fingerprint: &'a Fingerprint,
    /// Who asks.
    pub claimant: ClaimantId,
    /// Lease to take on success.
    pub lease: Duration,
}

/// What [`Store::complete`] asks.
#[derive(Debug, Clone)]
pub struct CompleteRequest<'a> {
    /// The record.
    pub scope: &'a Scope,
    /// The fence the caller's lease was taken with.
    pub fence: Fence,
    /// What a later claim with the same fingerprint replays.
    pub outcome: StoredOutcome,
    /// How long the completed record is kept.
    pub ttl: Duration,
}

/// What [`Store::claim`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// The caller now holds the record's lease with this fence and must run the handler,
    /// then `complete` or `release`. `takeover` is true when it replaced an expired lease.
    Acquired {
        /// The fence to present on renew/complete/release.
        fence: Fence,
        /// Whether an expired in-flight record was taken over.
        takeover: bool,
    },
    /// Completed with the same fingerprint: replay this.
    Completed(StoredOutcome),
    /// Another claimant holds a live lease (same fingerprint).
    InFlight {
        /// Time left on that lease.
        lease_remaining: Duration,
    },
    /// The record (in flight or completed) has a different fingerprint.
    Mismatch,
}

/// The outcome stored by [`Store::complete`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoredOutcome {
    /// The encoded response (opaque to the store; the layer encodes and decodes it, in
    /// the format of [`response::StoredResponse`]).
    Response(Bytes),
    /// The call completed but its response was over the size limit and was not kept.
    NotRetained,
}

impl StoredOutcome {
    /// Bytes this outcome holds.
    pub fn len(&self) -> usize {
        match self {
            StoredOutcome::Response(b) => b.len(),
            StoredOutcome::NotRetained => 0,
        }
    }
    /// Whether it holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A record as [`Store::get`] reports it (for tests, tools and observability).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RecordState {
    /// A claimant holds the lease.
    InFlight {
        /// Current fence.
        fence: Fence,
        /// Fingerprint of the request being run.
        fingerprint: Fingerprint,
        /// When the lease ends (in this process's clock).
        lease_until: Instant,
    },
    /// Completed, kept until its TTL ends.
    Completed {
        /// Fence of the claimant that completed it.
        fence: Fence,
        /// Fingerprint of the request that ran.
        fingerprint: Fingerprint,
        /// What is replayed.
        outcome: StoredOutcome,
    },
    /// Released: nothing was done; any claim takes it with a higher fence. Only a store
    /// that keeps a tombstone to carry the fence reports it (the memory store never
    /// does; it removes a released record).
    Released {
        /// Last fence.
        fence: Fence,
    },
}

/// What made a store call fail: a message for logs, and the underlying error if any.
///
/// Built from a message (`"timed out".into()`) or with [`Cause::new`] to keep the error
/// that caused it as its [`source`](std::error::Error::source).
#[derive(Debug)]
pub struct Cause {
    message: String,
    source: Option<Box<dyn std::error::Error + Send + Sync>>,
}

impl Cause {
    /// A cause with a message and the error behind it.
    pub fn new(
        message: impl Into<String>,
        source: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    ) -> Self {
        Cause {
            message: message.into(),
            source: Some(source.into()),
        }
    }

    /// The message.
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl fmt::Display for Cause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Cause {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source.as_deref().map(|e| e as _)
    }
}

impl From<String> for Cause {
    fn from(message: String) -> Self {
        Cause {
            message,
            source: None,
        }
    }
}

impl From<&str> for Cause {
    fn from(message: &str) -> Self {
        Cause::from(message.to_owned())
    }
}

/// Why a store call failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The store could not answer (connection, timeout, overload). Fail closed.
    #[error("store unavailable: {0}")]
    Unavailable(#[source] Cause),
    /// The fence presented is not the current fence of an in-flight record.
    #[error("stale fence {presented} (current: {current:?})")]
    Fenced {
        /// The fence the caller presented.
        presented: Fence,
        /// The record's current fence, if there is a record.
        current: Option<Fence>,
    },
    /// The store returned something it should not have (corrupt record, bad reply).
    #[error("store returned a malformed reply: {0}")]
    Corrupt(#[source] Cause),
    /// The store (or the tenant's share of it) is at its bound and cannot take a new
    /// record now. Retryable: the layer answers RESOURCE_EXHAUSTED with a retry delay.
    /// The message names the bound, never the tenant or the key.
    #[error("store full: {0}")]
    Full(#[source] Cause),
}

/// A place to keep idempotency records. See the module docs for the contract.
///
/// Implementations are cheap to clone (an `Arc` inside) and shared by every clone of the
/// layer.
pub trait Store: Clone + Send + Sync + 'static {
    /// Claims the record, or reports what holds it.
    fn claim(
        &self,
        req: ClaimRequest<'_>,
    ) -> impl Future<Output = Result<Claim, StoreError>> + Send;

    /// Extends the lease of an in-flight record held with `fence`.
    fn renew(
        &self,
        scope: &Scope,
        fence: Fence,
        lease: Duration,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Stores the outcome of the run held with the request's fence; the record lives for
    /// its `ttl`.
    fn complete(
        &self,
        req: CompleteRequest<'_>,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Gives the record up (nothing was done) so the next claim runs again.
    fn release(
        &self,
        scope: &Scope,
        fence: Fence,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// The record's current state, if any.
    fn get(
        &self,
        scope: &Scope,
    ) -> impl Future<Output = Result<Option<RecordState>, StoreError>> + Send;

    /// Returns once the in-flight record at `scope` may have changed (completed,
    /// released, lease expired, gone), or at `until`, whichever is first. The caller then
    /// claims again. Returning early is allowed; returning late is not.
    fn wait(
        &self,
        scope: &Scope,
        until: Instant,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// The record at `scope` as an operator sees it (see [`records`]): its state and
    /// stored outcome, and the times the store keeps. `None`: no record (or it expired).
    /// Changes nothing.
    fn read_record(
        &self,
        scope: &Scope,
    ) -> impl Future<Output = Result<Option<RecordInfo>, StoreError>> + Send;

    /// Deletes the record at `scope`, atomically with respect to every other call on
    /// it, and reports what it held. An in-flight record is deleted only with
    /// [`DeleteMode::Force`]; otherwise it is left as it is and reported as
    /// [`Deletion::RefusedInFlight`]. Fences keep growing across a delete, as across a
    /// release: the next claim runs the handler again with a higher fence, and a holder
    /// of a deleted in-flight record is fenced.
    fn delete_record(
        &self,
        scope: &Scope,
        mode: DeleteMode,
    ) -> impl Future<Output = Result<Deletion, StoreError>> + Send;
}
