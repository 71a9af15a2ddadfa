//! One conformance suite for every `Store`: the same generic functions run on the
//! in-memory store (paused tokio clock) and on the Redis store (a real `redis-server`
//! started by `redis_support`, real time with short leases and bounded polling), the
//! latter with both wait strategies (pub/sub notification and polling only).
//!
//! Redis half: without a `redis-server` binary these tests print "SKIPPED" and pass,
//! except when `CI` is set, where they panic (see `tests/redis_support/mod.rs`).

#[path = "redis_support/mod.rs"]
mod redis_support;

use std::future::Future;
use std::time::Duration;

use bytes::Bytes;
use idem_server::store::{
    Claim, ClaimRequest, ClaimantId, Fingerprint, RecordState, Scope, Store, StoreError,
    StoredOutcome,
};
use tokio::time::Instant;

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
        fingerprint: fp,
        claimant: who,
        lease,
    }
}

async fn acquire<S: Store>(s: &S, scope: &Scope, fp: &Fingerprint, lease: Duration) -> u64 {
    match s.claim(req(scope, fp, ClaimantId::random(), lease)).await {
        Ok(Claim::Acquired { fence, .. }) => fence,
        other => panic!("expected Acquired, got {other:?}"),
    }
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

mod suite {
    use super::*;

    pub(crate) async fn claim_complete_replay<S: Store>(s: &S) {
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
        s.complete(&sc, fence, StoredOutcome::Response(body.clone()), LONG)
            .await
            .unwrap();
        for _ in 0..2 {
            let again = s
                .claim(req(&sc, &f, ClaimantId::random(), LONG))
                .await
                .unwrap();
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
        s.complete(&sc2, f2, StoredOutcome::NotRetained, LONG)
            .await
            .unwrap();
        assert_eq!(
            s.claim(req(&sc2, &f, ClaimantId::random(), LONG))
                .await
                .unwrap(),
            Claim::Completed(StoredOutcome::NotRetained)
        );
        let sc3 = scope();
        let f3 = acquire(s, &sc3, &f, LONG).await;
        s.complete(&sc3, f3, StoredOutcome::Response(Bytes::new()), LONG)
            .await
            .unwrap();
        assert_eq!(
            s.claim(req(&sc3, &f, ClaimantId::random(), LONG))
                .await
                .unwrap(),
            Claim::Completed(StoredOutcome::Response(Bytes::new()))
        );
        assert_eq!(s.get(&scope()).await.unwrap(), None);
    }

    pub(crate) async fn mismatch_in_flight_and_completed<S: Store>(s: &S) {
        let sc = scope();
        let fence = acquire(s, &sc, &fp(1), LONG).await;
        assert_eq!(
            s.claim(req(&sc, &fp(2), ClaimantId::random(), LONG))
                .await
                .unwrap(),
            Claim::Mismatch
        );
        s.complete(
            &sc,
            fence,
            StoredOutcome::Response(Bytes::from_static(b"x")),
            LONG,
        )
        .await
        .unwrap();
        assert_eq!(
            s.claim(req(&sc, &fp(2), ClaimantId::random(), LONG))
                .await
                .unwrap(),
            Claim::Mismatch
        );
    }

    pub(crate) async fn in_flight_duplicate_and_same_claimant<S: Store>(s: &S) {
        let sc = scope();
        let f = fp(3);
        let me = ClaimantId::random();
        let Claim::Acquired { fence, .. } = s.claim(req(&sc, &f, me, LONG)).await.unwrap() else {
            panic!("not acquired")
        };
        match s
            .claim(req(&sc, &f, ClaimantId::random(), LONG))
            .await
            .unwrap()
        {
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

    pub(crate) async fn stale_fences_are_refused<S: Store>(s: &S) {
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
            s.complete(
                &sc,
                stale,
                StoredOutcome::Response(Bytes::from_static(b"no")),
                LONG,
            )
            .await,
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
        s.complete(
            &sc,
            fence,
            StoredOutcome::Response(Bytes::from_static(b"ok")),
            LONG,
        )
        .await
        .unwrap();
        for r in [
            s.renew(&sc, fence, LONG).await,
            s.release(&sc, fence).await,
            s.complete(&sc, fence, StoredOutcome::NotRetained, LONG)
                .await,
        ] {
            assert!(
                matches!(r, Err(StoreError::Fenced { current: Some(c), .. }) if c == fence),
                "{r:?}"
            );
        }
        assert_eq!(
            s.claim(req(&sc, &f, ClaimantId::random(), LONG))
                .await
                .unwrap(),
            Claim::Completed(StoredOutcome::Response(Bytes::from_static(b"ok")))
        );
    }

    pub(crate) async fn release_then_any_claim_with_a_higher_fence<S: Store>(s: &S) {
        let sc = scope();
        let f1 = acquire(s, &sc, &fp(5), LONG).await;
        s.release(&sc, f1).await.unwrap();
        assert_eq!(
            s.get(&sc).await.unwrap(),
            Some(RecordState::Released { fence: f1 })
        );
        // A tombstone accepts any fingerprint.
        let f2 = acquire(s, &sc, &fp(6), LONG).await;
        assert!(f2 > f1, "{f2} > {f1}");
        assert!(matches!(
            s.release(&sc, f1).await,
            Err(StoreError::Fenced { .. })
        ));
        s.release(&sc, f2).await.unwrap();
        let f3 = acquire(s, &sc, &fp(5), LONG).await;
        assert!(f3 > f2, "{f3} > {f2}");
        s.complete(
            &sc,
            f3,
            StoredOutcome::Response(Bytes::from_static(b"3")),
            LONG,
        )
        .await
        .unwrap();
        assert!(matches!(
            s.complete(&sc, f2, StoredOutcome::NotRetained, LONG).await,
            Err(StoreError::Fenced { .. })
        ));
    }

    pub(crate) async fn lease_expiry_and_takeover<S: Store>(s: &S) {
        let sc = scope();
        let f = fp(7);
        let old = acquire(s, &sc, &f, LEASE).await;
        // Until the lease ends, others see it in flight; then one takes over.
        let (new, takeover) = eventually("takeover after the lease", || async {
            match s
                .claim(req(&sc, &f, ClaimantId::random(), LEASE * 10))
                .await
                .unwrap()
            {
                Claim::InFlight { .. } => None,
                Claim::Acquired { fence, takeover } => Some((fence, takeover)),
                other => panic!("{other:?}"),
            }
        })
        .await;
        assert!(takeover);
        assert!(new > old, "{new} > {old}");
        // The crashed claimant's late writes are refused.
        let r = s
            .complete(
                &sc,
                old,
                StoredOutcome::Response(Bytes::from_static(b"stale")),
                LONG,
            )
            .await;
        assert!(
            matches!(r, Err(StoreError::Fenced { presented, current: Some(c) }) if presented == old && c == new),
            "{r:?}"
        );
        assert!(matches!(
            s.renew(&sc, old, LONG).await,
            Err(StoreError::Fenced { .. })
        ));
        s.complete(
            &sc,
            new,
            StoredOutcome::Response(Bytes::from_static(b"fresh")),
            LONG,
        )
        .await
        .unwrap();
        assert_eq!(
            s.claim(req(&sc, &f, ClaimantId::random(), LONG))
                .await
                .unwrap(),
            Claim::Completed(StoredOutcome::Response(Bytes::from_static(b"fresh")))
        );
    }

    pub(crate) async fn renew_keeps_the_lease<S: Store>(s: &S) {
        let sc = scope();
        let f = fp(8);
        let fence = acquire(s, &sc, &f, LEASE).await;
        s.renew(&sc, fence, LONG).await.unwrap();
        // Well past the first lease, the record is still held.
        tokio::time::sleep(LEASE * 3).await;
        assert!(matches!(
            s.claim(req(&sc, &f, ClaimantId::random(), LEASE))
                .await
                .unwrap(),
            Claim::InFlight { .. }
        ));
        s.complete(&sc, fence, StoredOutcome::NotRetained, LONG)
            .await
            .unwrap();
    }

    pub(crate) async fn completed_records_expire_after_their_ttl<S: Store>(s: &S) {
        let sc = scope();
        let f = fp(9);
        let fence = acquire(s, &sc, &f, LONG).await;
        s.complete(
            &sc,
            fence,
            StoredOutcome::Response(Bytes::from_static(b"t")),
            LEASE,
        )
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

    pub(crate) async fn wait_returns_when_the_record_changes<S: Store>(s: &S) {
        // No record: returns at once.
        s.wait(&scope(), Instant::now() + LONG).await.unwrap();

        // Completed by another claimant while we wait.
        let sc = scope();
        let f = fp(11);
        let fence = acquire(s, &sc, &f, LONG).await;
        let waiter = {
            let s = s.clone();
            tokio::spawn(async move { s.wait(&sc, Instant::now() + LONG).await })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        s.complete(
            &sc,
            fence,
            StoredOutcome::Response(Bytes::from_static(b"w")),
            LONG,
        )
        .await
        .unwrap();
        tokio::time::timeout(PATIENCE, waiter)
            .await
            .expect("wait returned after completion")
            .unwrap()
            .unwrap();

        // Released.
        let sc = scope();
        let fence = acquire(s, &sc, &f, LONG).await;
        let waiter = {
            let s = s.clone();
            tokio::spawn(async move { s.wait(&sc, Instant::now() + LONG).await })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        s.release(&sc, fence).await.unwrap();
        tokio::time::timeout(PATIENCE, waiter)
            .await
            .expect("wait returned after release")
            .unwrap()
            .unwrap();

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
}

/// Instantiates every suite function as a test for one store.
macro_rules! conformance {
    ($name:ident, flavor = $($flavor:tt)*) => {
        mod $name {
            use super::*;
            conformance!(@tests $($flavor)*;
                claim_complete_replay,
                mismatch_in_flight_and_completed,
                in_flight_duplicate_and_same_claimant,
                stale_fences_are_refused,
                release_then_any_claim_with_a_higher_fence,
                lease_expiry_and_takeover,
                renew_keeps_the_lease,
                completed_records_expire_after_their_ttl,
                wait_returns_when_the_record_changes,
            );
        }
    };
    (@tests memory; $($t:ident,)*) => {$(
        #[tokio::test(start_paused = true)]
        async fn $t() {
            let store = idem_server::store::MemoryStore::new(Default::default());
            suite::$t(&store).await;
        }
    )*};
    (@tests redis $strategy:ident; $($t:ident,)*) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $t() {
            let Some(server) = redis_support::RedisServer::start() else { return };
            let store = idem_redis::RedisStore::builder(server.url())
                .key_prefix("conformance:")
                .wait_strategy(idem_redis::WaitStrategy::$strategy)
                .connect()
                .await
                .expect("connect to the test redis");
            suite::$t(&store).await;
            drop(server);
        }
    )*};
}

conformance!(memory, flavor = memory);
conformance!(redis, flavor = redis Notify);
conformance!(redis_polling, flavor = redis Poll);
