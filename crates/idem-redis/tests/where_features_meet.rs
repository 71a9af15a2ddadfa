//! Where the Redis store's features meet: a fence near the limit of Lua numbers and a
//! takeover, the tenant quota's bookkeeping under `maxmemory` with `noeviction`, and
//! the per-tenant in-flight quota and a claimant's re-claim after a late renewal.

use std::time::Duration;

use idem_redis::RedisStore;
use idem_store::testing::completion;
use idem_store::{
    Claim, ClaimRequest, ClaimantId, Fingerprint, RecordState, Scope, Store, StoreError,
    StoredOutcome, TenantId,
};
use idem_test_support::redis::RedisServer;
use tokio::time::Instant;

const TTL: Duration = Duration::from_secs(3600);

fn req<'a>(
    scope: &'a Scope,
    tenant: &'a TenantId,
    fp: &'a Fingerprint,
    claimant: ClaimantId,
    lease: Duration,
) -> ClaimRequest<'a> {
    ClaimRequest {
        scope,
        tenant,
        fingerprint: fp,
        claimant,
        lease,
    }
}

async fn store(redis: &RedisServer, quota: Option<usize>) -> RedisStore {
    RedisStore::builder(redis.url())
        .key_prefix("meet:")
        .max_in_flight_per_tenant(quota)
        .connect()
        .await
        .expect("connect")
}

fn resp(b: &'static [u8]) -> StoredOutcome {
    StoredOutcome::Response(bytes::Bytes::from_static(b))
}

/// Fences only grow: an in-flight record whose fence is 2^53 (a huge number written to
/// the key by something else, or one handed out by a server whose clock is past the
/// year 2255), taken over after its lease ended, gets a strictly higher fence (or a
/// clear `Corrupt`), and the stale holder's completion is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_takeover_of_a_record_with_a_huge_fence_gets_a_higher_fence() {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    let store = store(&redis, None).await;
    let tenant = TenantId([1; 16]);
    let fp = Fingerprint([2; 32]);
    let scope = Scope(rand::random());
    let key = store.key_for(&scope);
    let old: u64 = 1 << 53;
    redis
        .cmd_bytes(&[
            b"HSET",
            key.as_bytes(),
            b"s",
            b"i",
            b"f",
            old.to_string().as_bytes(),
            b"fp",
            &fp.0,
            b"c",
            b"00000000000000000000000000000001",
            b"l",
            b"1",
        ])
        .unwrap();
    redis.cmd(&["PEXPIRE", &key, "60000"]).unwrap();
    match store
        .claim(req(&scope, &tenant, &fp, ClaimantId::random(), TTL))
        .await
    {
        Ok(Claim::Acquired { fence, takeover }) => {
            assert!(takeover);
            let stale = store
                .complete(completion(&scope, old, resp(b"stale"), TTL))
                .await;
            assert!(
                fence > old,
                "takeover fence {fence} not above the taken-over fence {old}; \
                 the stale holder's completion: {stale:?}"
            );
            assert!(matches!(stale, Err(StoreError::Fenced { .. })), "{stale:?}");
        }
        Err(StoreError::Corrupt(_)) => {}
        other => panic!("{other:?}"),
    }
}

/// A Redis at `maxmemory` with `noeviction` refuses writes, and the store reports a
/// fresh claim there as `Unavailable` (fail closed, nothing written): also with the
/// per-tenant in-flight quota on (the default), whose bookkeeping runs in the claim
/// script before the record is written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_redis_refuses_fresh_claims_with_the_default_tenant_quota() {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    let store = RedisStore::builder(redis.url())
        .key_prefix("meetoom:")
        .connect()
        .await
        .expect("connect");
    let tenant = TenantId([1; 16]);
    let fp = Fingerprint([2; 32]);
    redis.config_set("maxmemory-policy", "noeviction");
    let used = redis.cmd(&["INFO", "memory"]).unwrap().text();
    let used: u64 = used
        .lines()
        .find_map(|l| l.strip_prefix("used_memory:"))
        .and_then(|v| v.trim().parse().ok())
        .expect("used_memory");
    redis.config_set("maxmemory", &(used / 2).to_string());
    // Redis itself refuses writes now.
    let plain = redis
        .cmd(&["HSET", "meetoom:probe", "a", "b"])
        .unwrap()
        .text();
    assert!(plain.starts_with("OOM"), "{plain}");
    let keys_before = redis.cmd(&["DBSIZE"]).unwrap().text();
    let mut acquired = 0;
    for _ in 0..100 {
        let scope = Scope(rand::random());
        match store
            .claim(req(&scope, &tenant, &fp, ClaimantId::random(), TTL))
            .await
        {
            Err(StoreError::Unavailable(_)) => {}
            Ok(Claim::Acquired { .. }) => acquired += 1,
            other => panic!("{other:?}"),
        }
    }
    let keys_after = redis.cmd(&["DBSIZE"]).unwrap().text();
    redis.config_set("maxmemory", "0");
    assert_eq!(
        acquired, 0,
        "fresh claims acquired (records written) past maxmemory with noeviction; keys \
         {keys_before} -> {keys_after}"
    );
}

async fn acquired(store: &RedisStore, r: ClaimRequest<'_>) -> u64 {
    match store.claim(r).await {
        Ok(Claim::Acquired { fence, .. }) => fence,
        other => panic!("expected Acquired, got {other:?}"),
    }
}

/// Polls (bounded) until the record's lease has ended on the server.
async fn until_lease_ended(store: &RedisStore, scope: &Scope) {
    let start = Instant::now();
    loop {
        match store.read_record(scope).await.unwrap() {
            Some(info) => match info.state {
                RecordState::InFlight { lease_until, .. } if lease_until > Instant::now() => {}
                _ => return,
            },
            None => return,
        }
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "lease never ended"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A claimant's own re-claim (same claimant, lease live) is never refused for being
/// full, also when its lease was renewed after it had run out (the renewal succeeds
/// while nobody took over) and another claim of the tenant filled the quota meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claimants_re_claim_after_a_late_renewal_is_not_refused_as_full() {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    let store = store(&redis, Some(1)).await;
    let tenant = TenantId([8; 16]);
    let fp = Fingerprint([2; 32]);
    let me = ClaimantId::random();
    let s1 = Scope(rand::random());
    let f = acquired(
        &store,
        req(&s1, &tenant, &fp, me, Duration::from_millis(50)),
    )
    .await;
    until_lease_ended(&store, &s1).await;
    // Another call of the tenant: admitted (the ended lease no longer counts).
    let s2 = Scope(rand::random());
    acquired(&store, req(&s2, &tenant, &fp, ClaimantId::random(), TTL)).await;
    // The late renewal succeeds: nobody took s1 over.
    store.renew(&s1, f, TTL).await.unwrap();
    // The claimant's own re-claim (a lost reply) gets its fence back.
    let r = store
        .claim(req(&s1, &tenant, &fp, me, Duration::from_millis(50)))
        .await;
    assert!(
        matches!(r, Ok(Claim::Acquired { fence, takeover: false }) if fence == f),
        "the claimant's own re-claim of a live lease: {r:?}"
    );
}
