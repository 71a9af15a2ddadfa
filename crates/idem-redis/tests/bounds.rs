//! What cheap failing calls and one tenant's load leave behind in a real `redis-server`:
//! released records leave (next to) nothing, so a `maxmemory` budget with
//! `noeviction` survives a flood of rejected calls, one tenant at its in-flight quota
//! does not stop another, and tenants claiming in turn are each counted on their own
//! keys.

use std::time::Duration;

use idem_redis::RedisStore;
use idem_store::testing::completion;
use idem_store::{
    Claim, ClaimRequest, ClaimantId, Fingerprint, RecordState, Scope, Store, StoreError,
    StoredOutcome, TenantId,
};
use idem_test_support::redis::RedisServer;

const LEASE: Duration = Duration::from_secs(10);
const TTL: Duration = Duration::from_secs(24 * 3600);

fn used_memory(redis: &RedisServer) -> u64 {
    let info = redis.cmd(&["INFO", "memory"]).expect("INFO memory").text();
    info.lines()
        .find_map(|l| l.strip_prefix("used_memory:"))
        .and_then(|v| v.trim().parse().ok())
        .expect("used_memory in INFO memory")
}

fn claim<'a>(scope: &'a Scope, tenant: &'a TenantId, fp: &'a Fingerprint) -> ClaimRequest<'a> {
    ClaimRequest {
        scope,
        tenant,
        fingerprint: fp,
        claimant: ClaimantId::random(),
        lease: LEASE,
    }
}

/// 10 000 rejected calls (claim, then release) under `maxmemory 2mb` and `noeviction`:
/// memory stays where it was and a normal call still claims and completes afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_released_claims_leaves_maxmemory_room_for_real_calls() {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    redis.config_set("maxmemory-policy", "noeviction");
    redis.config_set("maxmemory", "2mb");
    let store = RedisStore::builder(redis.url())
        .key_prefix("flood:")
        .connect()
        .await
        .expect("connect");
    let tenant = TenantId([1; 16]);
    let fp = Fingerprint([3; 32]);
    let before = used_memory(&redis);
    let mut warmed = 0;
    let mut failures = 0usize;
    let mut first_failure = None;
    for i in 0..10_000 {
        if i == 1_000 {
            // Redis grows some structures of its own once (buffers, script state);
            // what matters is that 9 000 more calls add nothing.
            warmed = used_memory(&redis);
        }
        let scope = Scope(rand::random());
        match store.claim(claim(&scope, &tenant, &fp)).await {
            Ok(Claim::Acquired { fence, .. }) => {
                if let Err(e) = store.release(&scope, fence).await {
                    failures += 1;
                    first_failure.get_or_insert(e.to_string());
                }
            }
            Ok(other) => panic!("{other:?}"),
            Err(e) => {
                failures += 1;
                first_failure.get_or_insert(e.to_string());
            }
        }
    }
    let after = used_memory(&redis);
    let keys = redis.cmd(&["DBSIZE"]).expect("DBSIZE").text();
    println!(
        "flood of 10000 claim+release under maxmemory 2mb: used_memory {before} before, \
         {warmed} after 1000 calls, {after} after 10000; {keys} keys left; {failures} failed \
         calls (first: {first_failure:?})"
    );
    assert_eq!(failures, 0, "first failure: {first_failure:?}");
    assert_eq!(keys, "0", "released claims left keys behind");
    assert!(
        after < warmed + 32 * 1024,
        "released claims left memory behind: {warmed} -> {after}"
    );
    // A normal call still runs and is recorded.
    let scope = Scope(rand::random());
    let Claim::Acquired { fence, .. } = store.claim(claim(&scope, &tenant, &fp)).await.unwrap()
    else {
        panic!("not acquired")
    };
    store
        .complete(completion(
            &scope,
            fence,
            StoredOutcome::Response(bytes::Bytes::from_static(b"order 1")),
            TTL,
        ))
        .await
        .unwrap();
    assert_eq!(
        store.claim(claim(&scope, &tenant, &fp)).await.unwrap(),
        Claim::Completed(StoredOutcome::Response(bytes::Bytes::from_static(
            b"order 1"
        )))
    );
}

async fn store_with_quota(redis: &RedisServer, quota: usize) -> RedisStore {
    RedisStore::builder(redis.url())
        .key_prefix("quota:")
        .max_in_flight_per_tenant(Some(quota))
        .connect()
        .await
        .expect("connect")
}

/// Tenant A abandons claims (never completes them) until its quota refuses it; tenant
/// B still claims; the refused claim left no record; once A's leases end its quota
/// frees itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_at_its_in_flight_quota_does_not_stop_another() {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    let store = store_with_quota(&redis, 16).await;
    let (a, b) = (TenantId([0xa; 16]), TenantId([0xb; 16]));
    let fp = Fingerprint([5; 32]);
    let lease = Duration::from_millis(600);
    for _ in 0..16 {
        let scope = Scope(rand::random());
        let got = store
            .claim(ClaimRequest {
                lease,
                ..claim(&scope, &a, &fp)
            })
            .await
            .unwrap();
        assert!(matches!(got, Claim::Acquired { .. }), "{got:?}");
    }
    let refused_scope = Scope(rand::random());
    let refused = store
        .claim(ClaimRequest {
            lease,
            ..claim(&refused_scope, &a, &fp)
        })
        .await;
    match &refused {
        Err(StoreError::Full(c)) => {
            assert_eq!(c.to_string(), "tenant at its in-flight record quota (16)")
        }
        other => panic!("expected Full, got {other:?}"),
    }
    assert_eq!(
        store.get(&refused_scope).await.unwrap(),
        None,
        "a refused claim leaves no record"
    );
    // B is not affected, and completes normally.
    let scope = Scope(rand::random());
    let Claim::Acquired { fence, .. } = store.claim(claim(&scope, &b, &fp)).await.unwrap() else {
        panic!("B refused")
    };
    store
        .complete(completion(&scope, fence, StoredOutcome::NotRetained, TTL))
        .await
        .unwrap();
    // B's count went back to nothing with its completion (the set is gone).
    let b_key = store.tenant_key_for(&b);
    assert_eq!(redis.cmd(&["EXISTS", &b_key]).unwrap().text(), "0");
    let a_key = store.tenant_key_for(&a);
    assert_eq!(redis.cmd(&["ZCARD", &a_key]).unwrap().text(), "16");
    // A's abandoned leases end: its quota frees itself, without any complete/release.
    tokio::time::sleep(lease + Duration::from_millis(100)).await;
    let scope = Scope(rand::random());
    let got = store.claim(claim(&scope, &a, &fp)).await.unwrap();
    assert!(matches!(got, Claim::Acquired { .. }), "{got:?}");
    assert_eq!(redis.cmd(&["ZCARD", &a_key]).unwrap().text(), "1");
    // And the abandoned records themselves expire one lease after their lease.
    tokio::time::sleep(lease).await;
    let left = redis.cmd(&["KEYS", "quota:{*"]).unwrap();
    assert_eq!(left.text().split_whitespace().count(), 2, "{left:?}");
}

/// A released record is deleted; only if the server clock is behind its fence (the
/// clock stepped back) does a tombstone keep the fence, and only until the clock
/// passes it. Simulated by planting an in-flight record with a fence 3 s ahead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_keeps_a_tombstone_only_while_the_clock_is_behind_the_fence() {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    let store = store_with_quota(&redis, 16).await;
    let tenant = TenantId([1; 16]);
    let fp = Fingerprint([6; 32]);
    // The normal case: nothing left.
    let scope = Scope(rand::random());
    let Claim::Acquired { fence, .. } = store.claim(claim(&scope, &tenant, &fp)).await.unwrap()
    else {
        panic!()
    };
    store.release(&scope, fence).await.unwrap();
    assert_eq!(
        redis
            .cmd(&["EXISTS", &store.key_for(&scope)])
            .unwrap()
            .text(),
        "0"
    );

    let scope = Scope(rand::random());
    let key = store.key_for(&scope);
    let time = redis.cmd(&["TIME"]).unwrap().text();
    let mut t = time.split_whitespace().map(|x| x.parse::<u64>().unwrap());
    let now_us = t.next().unwrap() * 1_000_000 + t.next().unwrap();
    let ahead = now_us + 3_000_000;
    let lease_end = (now_us / 1000 + 60_000).to_string();
    redis
        .cmd_bytes(&[
            b"HSET",
            key.as_bytes(),
            b"s",
            b"i",
            b"f",
            ahead.to_string().as_bytes(),
            b"fp",
            &fp.0,
            b"c",
            b"00000000000000000000000000000001",
            b"l",
            lease_end.as_bytes(),
        ])
        .unwrap();
    store.release(&scope, ahead).await.unwrap();
    assert_eq!(
        store.get(&scope).await.unwrap(),
        Some(RecordState::Released { fence: ahead })
    );
    let pttl = redis.pttl(&key);
    assert!(pttl > 0 && pttl <= 3001, "{pttl}");
    // The next claim starts above the tombstone's fence, not at the (behind) clock.
    let Claim::Acquired { fence, takeover } =
        store.claim(claim(&scope, &tenant, &fp)).await.unwrap()
    else {
        panic!()
    };
    assert_eq!((fence, takeover), (ahead + 1, false));
    assert!(matches!(
        store
            .complete(completion(&scope, ahead, StoredOutcome::NotRetained, TTL))
            .await,
        Err(StoreError::Fenced { .. })
    ));
}

/// An abandoned in-flight record (no renew, no complete) lives one lease past its
/// lease, not a day.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abandoned_claim_expires_one_lease_after_its_lease() {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    let store = store_with_quota(&redis, 16).await;
    let scope = Scope(rand::random());
    let fp = Fingerprint([7; 32]);
    let tenant = TenantId([2; 16]);
    let req = ClaimRequest {
        lease: Duration::from_secs(10),
        ..claim(&scope, &tenant, &fp)
    };
    assert!(matches!(
        store.claim(req).await.unwrap(),
        Claim::Acquired { .. }
    ));
    let pttl = redis.pttl(&store.key_for(&scope));
    assert!((19_000..=20_000).contains(&pttl), "{pttl}");
    let pttl = redis.pttl(&store.tenant_key_for(&tenant));
    assert!((10_000..=11_000).contains(&pttl), "{pttl}");
}

/// The stored-bytes charge on one endpoint, read from Redis itself: a claim charges the
/// record overhead, a completion its response too, a release takes its charge back,
/// the in-flight count is back to 0; once the records' TTLs end, the tenant's keys
/// expire on their own (nothing is left to leak).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stored_bytes_are_charged_taken_back_and_expire_with_their_records() {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    let store = RedisStore::builder(redis.url())
        .key_prefix("bytes:")
        .max_bytes_per_tenant(Some(1 << 20))
        .connect()
        .await
        .expect("connect");
    let tenant = TenantId([0xc; 16]);
    let fp = Fingerprint([6; 32]);
    let base = store.tenant_key_for(&tenant);
    let (sizes, charges) = (format!("{base}:sizes"), format!("{base}:bytes"));
    let sum = || match redis.cmd(&["HGET", &sizes, "n"]).expect("HGET").bulk("n") {
        Some(n) => n.parse::<usize>().expect("a number"),
        None => 0,
    };
    let in_flight = || redis.cmd(&["ZCARD", &base]).expect("ZCARD").text();
    let overhead = idem_redis::RECORD_OVERHEAD_BYTES;
    // A short lease, so the in-flight charges' keys expire within seconds too.
    let short = |scope| ClaimRequest {
        lease: Duration::from_secs(2),
        ..claim(scope, &tenant, &fp)
    };

    let kept = Scope(rand::random());
    let Claim::Acquired { fence, .. } = store.claim(short(&kept)).await.unwrap() else {
        panic!("not acquired")
    };
    assert_eq!(sum(), overhead);
    assert_eq!(in_flight(), "1");
    let body = bytes::Bytes::from(vec![1u8; 1000]);
    store
        .complete(completion(
            &kept,
            fence,
            StoredOutcome::Response(body.clone()),
            Duration::from_millis(300),
        ))
        .await
        .unwrap();
    assert_eq!(sum(), overhead + 1000);
    assert_eq!(in_flight(), "0");

    let released = Scope(rand::random());
    let Claim::Acquired { fence, .. } = store.claim(short(&released)).await.unwrap() else {
        panic!("not acquired")
    };
    assert_eq!(sum(), 2 * overhead + 1000);
    store.release(&released, fence).await.unwrap();
    assert_eq!(sum(), overhead + 1000);
    assert_eq!(in_flight(), "0");

    // The record expires after 300 ms; the keys a second after the latest charge or
    // lease in them (the claims' 2 × 2 s).
    let start = std::time::Instant::now();
    loop {
        let left = redis
            .cmd(&["EXISTS", &sizes, &charges, &base])
            .expect("EXISTS")
            .text();
        if left == "0" {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "the tenant's keys outlived their records: {left} left"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Three tenants claiming in turn, from 8 tasks at once, so that most claims name
/// another tenant than the one before (the store keeps the key names of the tenant named
/// last): every claim is counted on its own tenant's keys, none on another's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_claiming_in_turn_are_each_counted_on_their_own_keys() {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    let store = store_with_quota(&redis, 1000).await;
    let tenants = [TenantId([1; 16]), TenantId([2; 16]), TenantId([3; 16])];
    let claims_of = [30usize, 20, 10];
    // Round-robin over the tenants that still have claims to make: 1 2 3 1 2 3 … 1 2 1.
    let mut left = claims_of;
    let mut order = Vec::new();
    while left.iter().any(|n| *n > 0) {
        for (t, n) in left.iter_mut().enumerate() {
            if *n > 0 {
                *n -= 1;
                order.push(t);
            }
        }
    }
    let order = std::sync::Arc::new(order);
    let tasks: Vec<_> = (0..8)
        .map(|task| {
            let (store, order) = (store.clone(), order.clone());
            tokio::spawn(async move {
                let fp = Fingerprint([5; 32]);
                for &t in order.iter().skip(task).step_by(8) {
                    let scope = Scope(rand::random());
                    let got = store
                        .claim(claim(&scope, &tenants[t], &fp))
                        .await
                        .expect("claim");
                    assert!(matches!(got, Claim::Acquired { .. }), "{got:?}");
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.expect("claiming task");
    }
    for (i, (tenant, n)) in tenants.iter().zip(claims_of).enumerate() {
        let key = store.tenant_key_for(tenant);
        let counted = redis.cmd(&["ZCARD", &key]).expect("ZCARD").text();
        assert_eq!(counted.trim(), n.to_string(), "tenant {i}: {key}");
    }
}
