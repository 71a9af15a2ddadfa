//! The conformance suite every [`Store`] must pass, for idem's own backends and yours.
//!
//! Each public `async fn` checks one part of the contract in the [crate docs](crate)
//! against a fresh store; [`store_conformance_tests!`](crate::store_conformance_tests)
//! turns all of them into `#[test]`s for one backend:
//!
//! ```text
//! // In your backend's tests (enable the `testing` feature in dev-dependencies):
//! idem_store::store_conformance_tests! {
//!     #[tokio::test(start_paused = true)]
//!     make = async { Some((idem_store::memory::MemoryStore::default(), ())) };
//! }
//! ```
//!
//! `make` is an async expression returning `Option<(store, guard)>`: the guard (a test
//! server, say) lives until the test ends; `None` skips the test (say why on stderr, and
//! never return `None` in CI).
//!
//! Timing: leases are 300 ms, so the suite runs on a paused tokio clock or in real time
//! against a networked store alike; every "eventually" loop is bounded by 10 s.

use std::future::Future;
use std::time::Duration;

use bytes::Bytes;
use tokio::time::Instant;

use crate::{
    Claim, ClaimRequest, ClaimantId, CompleteRequest, Fence, Fingerprint, RecordState, Scope,
    Store, StoreError, StoredOutcome, TenantId,
};

mod records;
mod tenant_bytes;
mod tenants;
pub use records::*;
pub use tenant_bytes::*;
pub use tenants::*;

/// The tenant every suite record is charged to.
const TENANT: TenantId = TenantId([7; 16]);

/// Short enough for real-time Redis tests, long enough that a claim and its checks fit.
const LEASE: Duration = Duration::from_millis(300);
const LONG: Duration = Duration::from_secs(60);
/// Bound of every "eventually" loop: generous, never a condition of success.
const PATIENCE: Duration = Duration::from_secs(10);

fn scope() -> Scope {
    Scope(rand::random())
}

fn fp(b: u8) -> Fingerprint {
    Fingerprint([b; 32])
}

fn req<'a>(
    scope: &'a Scope,
    fp: &'a Fingerprint,
    who: ClaimantId,
    lease: Duration,
) -> ClaimRequest<'a> {
    ClaimRequest {
        scope,
        tenant: &TENANT,
        fingerprint: fp,
        claimant: who,
        lease,
    }
}

/// The request that completes the record at `scope`, held with `fence`, with `outcome`,
/// kept for `ttl`: for tests that complete many records.
pub fn completion(
    scope: &Scope,
    fence: Fence,
    outcome: StoredOutcome,
    ttl: Duration,
) -> CompleteRequest<'_> {
    CompleteRequest {
        scope,
        fence,
        outcome,
        ttl,
    }
}

async fn acquire<S: Store>(s: &S, scope: &Scope, fp: &Fingerprint, lease: Duration) -> u64 {
    match s.claim(req(scope, fp, ClaimantId::random(), lease)).await {
        Ok(Claim::Acquired { fence, .. }) => fence,
        other => panic!("expected Acquired, got {other:?}"),
    }
}

/// A stored response of `body`.
fn resp(body: &'static [u8]) -> StoredOutcome {
    StoredOutcome::Response(Bytes::from_static(body))
}

/// What a claim by a new claimant gets.
async fn claim_new<S: Store>(s: &S, sc: &Scope, fp: &Fingerprint, lease: Duration) -> Claim {
    s.claim(req(sc, fp, ClaimantId::random(), lease))
        .await
        .unwrap()
}

/// Polls `f` every 20 ms until it returns `Some`, for at most `PATIENCE`.
async fn eventually<T, F, Fut>(what: &str, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let start = Instant::now();
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(start.elapsed() < PATIENCE, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Conformance: claim complete replay.
pub async fn claim_complete_replay<S: Store>(s: &S) {
    let sc = scope();
    let f = fp(1);
    let first = ClaimantId::random();
    let fence = match s.claim(req(&sc, &f, first, LONG)).await.unwrap() {
        Claim::Acquired { fence, takeover } => {
            assert!(!takeover);
            fence
        }
        other => panic!("{other:?}"),
    };
    assert!(matches!(
        s.get(&sc).await.unwrap(),
        Some(RecordState::InFlight { fence: f0, fingerprint, .. }) if f0 == fence && fingerprint == f
    ));
    // Binary-safe: NUL, 0xff, CR LF.
    let body = Bytes::from_static(b"\x00\xff\r\nresponse\x00");
    s.complete(completion(
        &sc,
        fence,
        StoredOutcome::Response(body.clone()),
        LONG,
    ))
    .await
    .unwrap();
    for _ in 0..2 {
        let again = claim_new(s, &sc, &f, LONG).await;
        assert_eq!(
            again,
            Claim::Completed(StoredOutcome::Response(body.clone()))
        );
    }
    // The first claimant asking again also gets the outcome, not a new run.
    let again = s.claim(req(&sc, &f, first, LONG)).await.unwrap();
    assert_eq!(
        again,
        Claim::Completed(StoredOutcome::Response(body.clone()))
    );
    assert_eq!(
        s.get(&sc).await.unwrap(),
        Some(RecordState::Completed {
            fence,
            fingerprint: f,
            outcome: StoredOutcome::Response(body)
        })
    );

    // Empty responses and "not retained" are distinct outcomes.
    let sc2 = scope();
    let f2 = acquire(s, &sc2, &f, LONG).await;
    s.complete(completion(&sc2, f2, StoredOutcome::NotRetained, LONG))
        .await
        .unwrap();
    assert_eq!(
        claim_new(s, &sc2, &f, LONG).await,
        Claim::Completed(StoredOutcome::NotRetained)
    );
    let sc3 = scope();
    let f3 = acquire(s, &sc3, &f, LONG).await;
    s.complete(completion(
        &sc3,
        f3,
        StoredOutcome::Response(Bytes::new()),
        LONG,
    ))
    .await
    .unwrap();
    assert_eq!(
        claim_new(s, &sc3, &f, LONG).await,
        Claim::Completed(StoredOutcome::Response(Bytes::new()))
    );
    assert_eq!(s.get(&scope()).await.unwrap(), None);
}

/// Conformance: mismatch in flight and completed.
pub async fn mismatch_in_flight_and_completed<S: Store>(s: &S) {
    let sc = scope();
    let fence = acquire(s, &sc, &fp(1), LONG).await;
    assert_eq!(claim_new(s, &sc, &fp(2), LONG).await, Claim::Mismatch);
    s.complete(completion(&sc, fence, resp(b"x"), LONG))
        .await
        .unwrap();
    assert_eq!(claim_new(s, &sc, &fp(2), LONG).await, Claim::Mismatch);
}

/// Conformance: in flight duplicate and same claimant.
pub async fn in_flight_duplicate_and_same_claimant<S: Store>(s: &S) {
    let sc = scope();
    let f = fp(3);
    let me = ClaimantId::random();
    let Claim::Acquired { fence, .. } = s.claim(req(&sc, &f, me, LONG)).await.unwrap() else {
        panic!("not acquired")
    };
    match claim_new(s, &sc, &f, LONG).await {
        Claim::InFlight { lease_remaining } => {
            assert!(
                lease_remaining > Duration::ZERO && lease_remaining <= LONG,
                "{lease_remaining:?}"
            )
        }
        other => panic!("{other:?}"),
    }
    // A claim re-sent after a lost reply: same claimant, same fence, no takeover.
    assert_eq!(
        s.claim(req(&sc, &f, me, LONG)).await.unwrap(),
        Claim::Acquired {
            fence,
            takeover: false
        }
    );
}

/// Conformance: stale fences are refused.
pub async fn stale_fences_are_refused<S: Store>(s: &S) {
    let sc = scope();
    let f = fp(4);
    let fence = acquire(s, &sc, &f, LONG).await;
    let stale = fence + 1;
    let check = |r: Result<(), StoreError>, cur: Option<u64>| match r {
        Err(StoreError::Fenced { presented, current }) => {
            assert_eq!(presented, stale);
            assert_eq!(current, cur);
        }
        other => panic!("expected Fenced, got {other:?}"),
    };
    check(s.renew(&sc, stale, LONG).await, Some(fence));
    check(
        s.complete(completion(&sc, stale, resp(b"no"), LONG)).await,
        Some(fence),
    );
    check(s.release(&sc, stale).await, Some(fence));
    // Nothing changed.
    assert!(matches!(
        s.get(&sc).await.unwrap(),
        Some(RecordState::InFlight { fence: f0, .. }) if f0 == fence
    ));
    // No record at all.
    let none = scope();
    check(s.renew(&none, stale, LONG).await, None);
    check(s.release(&none, stale).await, None);
    // A completed record is not in flight: even its own fence is refused now.
    s.renew(&sc, fence, LONG).await.unwrap();
    s.complete(completion(&sc, fence, resp(b"ok"), LONG))
        .await
        .unwrap();
    for r in [
        s.renew(&sc, fence, LONG).await,
        s.release(&sc, fence).await,
        s.complete(completion(&sc, fence, StoredOutcome::NotRetained, LONG))
            .await,
    ] {
        assert!(
            matches!(r, Err(StoreError::Fenced { current: Some(c), .. }) if c == fence),
            "{r:?}"
        );
    }
    assert_eq!(
        claim_new(s, &sc, &f, LONG).await,
        Claim::Completed(resp(b"ok"))
    );
}

/// Conformance: release then any claim with a higher fence.
pub async fn release_then_any_claim_with_a_higher_fence<S: Store>(s: &S) {
    let sc = scope();
    let f1 = acquire(s, &sc, &fp(5), LONG).await;
    s.release(&sc, f1).await.unwrap();
    // No record, or a tombstone that carries the fence.
    match s.get(&sc).await.unwrap() {
        None => {}
        Some(RecordState::Released { fence }) if fence == f1 => {}
        other => panic!("a release left {other:?}"),
    }
    // The next claim, with any fingerprint, runs again.
    let f2 = acquire(s, &sc, &fp(6), LONG).await;
    assert!(f2 > f1, "{f2} > {f1}");
    assert!(matches!(
        s.release(&sc, f1).await,
        Err(StoreError::Fenced { .. })
    ));
    s.release(&sc, f2).await.unwrap();
    let f3 = acquire(s, &sc, &fp(5), LONG).await;
    assert!(f3 > f2, "{f3} > {f2}");
    s.complete(completion(&sc, f3, resp(b"3"), LONG))
        .await
        .unwrap();
    assert!(matches!(
        s.complete(completion(&sc, f2, StoredOutcome::NotRetained, LONG))
            .await,
        Err(StoreError::Fenced { .. })
    ));
}

/// Conformance: a release leaves nothing that blocks a new claim (no wait, no
/// mismatch, no takeover), and the old fence stays refused.
pub async fn release_leaves_nothing_that_blocks_a_new_claim<S: Store>(s: &S) {
    let sc = scope();
    let f1 = acquire(s, &sc, &fp(12), LONG).await;
    s.release(&sc, f1).await.unwrap();
    // Another claimant, another fingerprint: acquired at once, not a takeover.
    match claim_new(s, &sc, &fp(13), LONG).await {
        Claim::Acquired { fence, takeover } => {
            assert!(!takeover, "a released record is not taken over");
            assert!(fence > f1, "{fence} > {f1}");
        }
        other => panic!("expected Acquired, got {other:?}"),
    }
    // A waiter on a released record returns at once.
    let sc2 = scope();
    let f2 = acquire(s, &sc2, &fp(12), LONG).await;
    s.release(&sc2, f2).await.unwrap();
    tokio::time::timeout(Duration::from_secs(5), s.wait(&sc2, Instant::now() + LONG))
        .await
        .expect("wait on a released record returns at once")
        .unwrap();
}

/// Conformance: after a release, the released fence can neither renew, complete nor
/// release, before and after the next claim.
pub async fn a_released_fence_cannot_renew_or_complete<S: Store>(s: &S) {
    let sc = scope();
    let f = fp(14);
    let old = acquire(s, &sc, &f, LONG).await;
    s.release(&sc, old).await.unwrap();
    let fenced = |r: Result<(), StoreError>| {
        assert!(
            matches!(r, Err(StoreError::Fenced { presented, .. }) if presented == old),
            "{r:?}"
        )
    };
    fenced(s.renew(&sc, old, LONG).await);
    fenced(s.complete(completion(&sc, old, resp(b"late"), LONG)).await);
    fenced(s.release(&sc, old).await);
    // Nothing was written by those: the next claim still runs.
    let new = acquire(s, &sc, &f, LONG).await;
    assert!(new > old, "{new} > {old}");
    fenced(s.renew(&sc, old, LONG).await);
    fenced(s.complete(completion(&sc, old, resp(b"late"), LONG)).await);
    fenced(s.release(&sc, old).await);
    assert!(matches!(
        s.get(&sc).await.unwrap(),
        Some(RecordState::InFlight { fence, .. }) if fence == new
    ));
}

/// Conformance: a claimant whose lease was taken over stays fenced after the taker
/// releases and a third claimant runs: fences still grow across takeover + release.
pub async fn takeover_then_release_keeps_the_stale_holder_fenced<S: Store>(s: &S) {
    let sc = scope();
    let f = fp(15);
    let stale = acquire(s, &sc, &f, LEASE).await;
    let taker = eventually("takeover after the lease", || async {
        match claim_new(s, &sc, &f, LONG).await {
            Claim::InFlight { .. } => None,
            Claim::Acquired { fence, takeover } => {
                assert!(takeover);
                Some(fence)
            }
            other => panic!("{other:?}"),
        }
    })
    .await;
    s.release(&sc, taker).await.unwrap();
    let third = acquire(s, &sc, &f, LONG).await;
    assert!(
        third > taker && taker > stale,
        "{third} > {taker} > {stale}"
    );
    for old in [stale, taker] {
        let r = s.complete(completion(&sc, old, resp(b"x"), LONG)).await;
        assert!(
            matches!(r, Err(StoreError::Fenced { current: Some(c), .. }) if c == third),
            "{r:?}"
        );
    }
    s.complete(completion(&sc, third, resp(b"3"), LONG))
        .await
        .unwrap();
}

const FP16: Fingerprint = Fingerprint([16; 32]);

/// Conformance: lease expiry and takeover.
pub async fn lease_expiry_and_takeover<S: Store>(s: &S) {
    let sc = scope();
    let f = fp(7);
    let old = acquire(s, &sc, &f, LEASE).await;
    // Until the lease ends, others see it in flight; then one takes over.
    let (new, takeover) = eventually("takeover after the lease", || async {
        match claim_new(s, &sc, &f, LEASE * 10).await {
            Claim::InFlight { .. } => None,
            Claim::Acquired { fence, takeover } => Some((fence, takeover)),
            other => panic!("{other:?}"),
        }
    })
    .await;
    assert!(takeover);
    assert!(new > old, "{new} > {old}");
    // The crashed claimant's late writes are refused.
    let r = s.complete(completion(&sc, old, resp(b"stale"), LONG)).await;
    assert!(
        matches!(r, Err(StoreError::Fenced { presented, current: Some(c) }) if presented == old && c == new),
        "{r:?}"
    );
    assert!(matches!(
        s.renew(&sc, old, LONG).await,
        Err(StoreError::Fenced { .. })
    ));
    s.complete(completion(&sc, new, resp(b"fresh"), LONG))
        .await
        .unwrap();
    assert_eq!(
        claim_new(s, &sc, &f, LONG).await,
        Claim::Completed(resp(b"fresh"))
    );
}

/// Conformance: renew keeps the lease.
pub async fn renew_keeps_the_lease<S: Store>(s: &S) {
    let sc = scope();
    let f = fp(8);
    let fence = acquire(s, &sc, &f, LEASE).await;
    s.renew(&sc, fence, LONG).await.unwrap();
    // Well past the first lease, the record is still held.
    tokio::time::sleep(LEASE * 3).await;
    assert!(matches!(
        claim_new(s, &sc, &f, LEASE).await,
        Claim::InFlight { .. }
    ));
    s.complete(completion(&sc, fence, StoredOutcome::NotRetained, LONG))
        .await
        .unwrap();
}

/// Conformance: completed records expire after their ttl.
pub async fn completed_records_expire_after_their_ttl<S: Store>(s: &S) {
    let sc = scope();
    let f = fp(9);
    let fence = acquire(s, &sc, &f, LONG).await;
    s.complete(completion(&sc, fence, resp(b"t"), LEASE))
        .await
        .unwrap();
    eventually("record gone after its ttl", || async {
        s.get(&sc).await.unwrap().is_none().then_some(())
    })
    .await;
    // Gone means a new run (the key may be reused with another request, too), and
    // its fence is still above every fence the expired record handed out.
    let next = acquire(s, &sc, &fp(10), LONG).await;
    assert!(next > fence, "{next} > {fence}");
}

/// Waits on `sc` while, 50 ms in, `change` runs: the wait returns after it (`what`).
async fn wait_across<S: Store>(s: &S, sc: Scope, what: &str, change: impl Future<Output = ()>) {
    let waiter = {
        let s = s.clone();
        tokio::spawn(async move { s.wait(&sc, Instant::now() + LONG).await })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    change.await;
    tokio::time::timeout(PATIENCE, waiter)
        .await
        .unwrap_or_else(|e| panic!("wait returned after {what}: {e}"))
        .unwrap()
        .unwrap();
}

/// Conformance: wait returns when the record changes.
pub async fn wait_returns_when_the_record_changes<S: Store>(s: &S) {
    // No record: returns at once.
    s.wait(&scope(), Instant::now() + LONG).await.unwrap();

    // Completed by another claimant while we wait.
    let sc = scope();
    let f = fp(11);
    let fence = acquire(s, &sc, &f, LONG).await;
    let complete = async {
        s.complete(completion(&sc, fence, resp(b"w"), LONG))
            .await
            .unwrap()
    };
    wait_across(s, sc, "completion", complete).await;

    // Released.
    let sc = scope();
    let fence = acquire(s, &sc, &f, LONG).await;
    let release = async { s.release(&sc, fence).await.unwrap() };
    wait_across(s, sc, "release", release).await;

    // Lease ended (crash): returns, and the next claim takes over.
    let sc = scope();
    acquire(s, &sc, &f, LEASE).await;
    tokio::time::timeout(PATIENCE, s.wait(&sc, Instant::now() + LONG))
        .await
        .expect("wait returned after the lease")
        .unwrap();

    // Nothing happens: returns by `until`, not later.
    let sc = scope();
    acquire(s, &sc, &f, LONG).await;
    let until = Instant::now() + Duration::from_millis(200);
    tokio::time::timeout(PATIENCE, s.wait(&sc, until))
        .await
        .expect("wait returned at until")
        .unwrap();
}

/// Instantiates every function of [`testing`](crate::testing) as a test for one store.
///
/// See the [module docs](crate::testing) for the form. With
/// `make_each = make_a => mod_a, make_b => mod_b;` the suite runs once per store, each
/// in a module of its own (a backend's wait strategies, say); the modules `use super::*`.
#[macro_export]
macro_rules! store_conformance_tests {
    ($(#[$attr:meta])* make_each = $($make:expr => $module:ident),+ $(,)?;) => {
        $crate::store_conformance_tests!(@each [$(#[$attr])*]; $($make => $module,)+);
    };
    (@each [$($attr:tt)*];) => {};
    (@each [$($attr:tt)*]; $make:expr => $module:ident, $($rest:tt)*) => {
        mod $module {
            use super::*;
            $crate::store_conformance_tests! { $($attr)* make = $make; }
        }
        $crate::store_conformance_tests!(@each [$($attr)*]; $($rest)*);
    };
    ($(#[$attr:meta])* make = $make:expr;) => {
        $crate::store_conformance_tests!(@cases [$(#[$attr])*] [$make];
            claim_complete_replay,
            mismatch_in_flight_and_completed,
            in_flight_duplicate_and_same_claimant,
            stale_fences_are_refused,
            release_then_any_claim_with_a_higher_fence,
            release_leaves_nothing_that_blocks_a_new_claim,
            a_released_fence_cannot_renew_or_complete,
            takeover_then_release_keeps_the_stale_holder_fenced,
            lease_expiry_and_takeover,
            renew_keeps_the_lease,
            completed_records_expire_after_their_ttl,
            wait_returns_when_the_record_changes,
            read_and_delete_a_completed_record,
            delete_refuses_in_flight_unless_forced,
            no_record_reads_none_and_deletes_nothing,
        );
    };
    (@cases [$($attr:tt)*] [$make:expr];) => {};
    (@cases [$($attr:tt)*] [$make:expr]; $case:ident, $($rest:ident,)*) => {
        $($attr)*
        async fn $case() {
            let Some((store, _guard)) = $make.await else { return };
            $crate::testing::$case(&store).await;
        }
        $crate::store_conformance_tests!(@cases [$($attr)*] [$make]; $($rest,)*);
    };
}

#[cfg(test)]
mod memory_store {
    crate::store_conformance_tests! {
        #[tokio::test(start_paused = true)]
        make = async { Some((crate::memory::MemoryStore::default(), ())) };
    }
}
