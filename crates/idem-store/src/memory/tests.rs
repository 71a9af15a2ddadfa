use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use super::entry::{Done, Name, lock};
use super::sweep::QUEUE_SLACK;
use super::*;
use crate::testing::completion;
use crate::{ClaimantId, Fingerprint};
use proptest::prelude::*;

fn scope(n: u8) -> Scope {
    // Spread over shards like real digests (first byte picks the shard).
    let mut s = [n; 32];
    s[0] = n.wrapping_mul(37);
    Scope(s)
}

fn fp(n: u8) -> Fingerprint {
    Fingerprint([n; 32])
}

const LEASE: Duration = Duration::from_secs(10);
const TTL: Duration = Duration::from_secs(100);

fn req(s: &Scope, f: &Fingerprint, c: u128) -> ClaimRequest<'static> {
    // Leak-free 'static refs for tests: copy into boxes that live for the test.
    let s: &'static Scope = Box::leak(Box::new(*s));
    let f: &'static Fingerprint = Box::leak(Box::new(*f));
    ClaimRequest {
        scope: s,
        tenant: &TenantId([0; 16]),
        fingerprint: f,
        claimant: ClaimantId(c),
        lease: LEASE,
    }
}

/// A store with these global bounds and no per-tenant bound below them.
fn store(max_entries: usize, max_bytes: usize) -> MemoryStore {
    MemoryStore::new(MemoryStoreSettings {
        max_entries,
        max_bytes,
        max_in_flight_per_tenant: Some(max_entries),
        max_entries_per_tenant: Some(max_entries),
        max_bytes_per_tenant: Some(max_bytes),
        sweep_interval: Duration::from_secs(1),
        min_retention: DEFAULT_MIN_RETENTION,
    })
}

fn resp(b: &'static [u8]) -> StoredOutcome {
    StoredOutcome::Response(Bytes::from_static(b))
}

use bytes::Bytes;

async fn acquire(st: &MemoryStore, s: u8) -> Fence {
    match st
        .claim(req(&scope(s), &fp(1), u128::from(s)))
        .await
        .unwrap()
    {
        Claim::Acquired { fence, .. } => fence,
        other => panic!("expected Acquired, got {other:?}"),
    }
}

async fn complete(st: &MemoryStore, s: u8, body: &'static [u8]) {
    let f = acquire(st, s).await;
    st.complete(completion(&scope(s), f, resp(body), TTL))
        .await
        .unwrap();
}

#[tokio::test(start_paused = true)]
async fn lifecycle_replay_mismatch_and_fences() {
    let st = store(100, 1 << 20);
    let (s, a, b) = (scope(1), fp(1), fp(2));
    let Claim::Acquired {
        fence: f1,
        takeover: false,
    } = st.claim(req(&s, &a, 7)).await.unwrap()
    else {
        panic!()
    };
    // The same claimant again (lost reply) gets the same fence; another waits.
    assert_eq!(
        st.claim(req(&s, &a, 7)).await.unwrap(),
        Claim::Acquired {
            fence: f1,
            takeover: false
        }
    );
    assert!(matches!(
        st.claim(req(&s, &a, 8)).await.unwrap(),
        Claim::InFlight { .. }
    ));
    assert_eq!(st.claim(req(&s, &b, 8)).await.unwrap(), Claim::Mismatch);
    // Release, then a new claim gets a higher fence; the old fence is refused.
    st.release(&s, f1).await.unwrap();
    assert_eq!(st.get(&s).await.unwrap(), None, "a release leaves nothing");
    assert_eq!(st.len(), 0);
    let Claim::Acquired { fence: f2, .. } = st.claim(req(&s, &a, 8)).await.unwrap() else {
        panic!()
    };
    assert!(f2 > f1);
    assert!(matches!(
        st.complete(completion(&s, f1, resp(b"x"), TTL)).await,
        Err(StoreError::Fenced { .. })
    ));
    assert!(matches!(
        st.renew(&s, f1, LEASE).await,
        Err(StoreError::Fenced { .. })
    ));
    st.complete(completion(&s, f2, resp(b"done"), TTL))
        .await
        .unwrap();
    assert_eq!(
        st.claim(req(&s, &a, 9)).await.unwrap(),
        Claim::Completed(resp(b"done"))
    );
    assert_eq!(st.claim(req(&s, &b, 9)).await.unwrap(), Claim::Mismatch);
    // Completed records refuse every fence.
    assert!(matches!(
        st.release(&s, f2).await,
        Err(StoreError::Fenced { .. })
    ));
    assert_eq!(st.len(), 1);
}

#[tokio::test(start_paused = true)]
async fn expired_lease_is_taken_over_with_a_higher_fence() {
    let st = store(100, 1 << 20);
    let s = scope(3);
    let f1 = acquire(&st, 3).await;
    tokio::time::advance(LEASE / 2).await;
    st.renew(&s, f1, LEASE).await.unwrap();
    tokio::time::advance(LEASE - Duration::from_millis(1)).await;
    assert!(matches!(
        st.claim(req(&s, &fp(1), 99)).await.unwrap(),
        Claim::InFlight { .. }
    ));
    tokio::time::advance(Duration::from_millis(1)).await;
    let Claim::Acquired {
        fence: f2,
        takeover: true,
    } = st.claim(req(&s, &fp(1), 99)).await.unwrap()
    else {
        panic!()
    };
    assert!(f2 > f1);
    assert!(matches!(
        st.complete(completion(&s, f1, resp(b"late"), TTL)).await,
        Err(StoreError::Fenced { presented, current: Some(c) }) if presented == f1 && c == f2
    ));
    st.complete(completion(&s, f2, resp(b"new"), TTL))
        .await
        .unwrap();
    assert!(
        matches!(st.get(&s).await.unwrap(), Some(RecordState::Completed { fence, .. }) if fence == f2)
    );
}

#[tokio::test(start_paused = true)]
async fn completed_records_expire_and_the_sweeper_drops_them() {
    let st = store(100, 1 << 20);
    complete(&st, 1, b"one").await;
    tokio::time::advance(TTL - Duration::from_secs(1)).await;
    assert!(st.get(&scope(1)).await.unwrap().is_some());
    tokio::time::advance(Duration::from_secs(1)).await;
    assert_eq!(st.get(&scope(1)).await.unwrap(), None, "expired at its TTL");
    // The sweeper (every 1 s) removes it without any call on that scope.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(st.len(), 0);
    assert_eq!(st.stats().expirations, 1);
    assert_eq!(st.stats().bytes, 0);
    // A new claim starts afresh.
    assert!(matches!(
        st.claim(req(&scope(1), &fp(2), 1)).await.unwrap(),
        Claim::Acquired { .. }
    ));
}

const A: TenantId = TenantId([0xa; 16]);
const B: TenantId = TenantId([0xb; 16]);

fn treq(t: &TenantId, s: &Scope, c: u128) -> ClaimRequest<'static> {
    ClaimRequest {
        tenant: Box::leak(Box::new(*t)),
        ..req(s, &fp(1), c)
    }
}

/// A scope number `n` of `t` (distinct per tenant, spread over shards).
fn tscope(t: &TenantId, n: u32) -> Scope {
    let mut s = [t.0[0]; 32];
    s[..4].copy_from_slice(&n.to_le_bytes());
    Scope(s)
}

async fn tacquire(st: &MemoryStore, t: &TenantId, n: u32) -> Result<Fence, StoreError> {
    match st.claim(treq(t, &tscope(t, n), u128::from(n))).await? {
        Claim::Acquired { fence, .. } => Ok(fence),
        other => panic!("expected Acquired, got {other:?}"),
    }
}

/// Claims record `n` of `t` and completes it with `outcome`, kept for `ttl`.
async fn tcomplete_with(
    st: &MemoryStore,
    t: &TenantId,
    n: u32,
    outcome: StoredOutcome,
    ttl: Duration,
) -> Result<(), StoreError> {
    let f = tacquire(st, t, n).await?;
    st.complete(completion(&tscope(t, n), f, outcome, ttl))
        .await
        .unwrap();
    Ok(())
}

/// What a claim of record `n` of `t` is refused with.
async fn refusal(st: &MemoryStore, t: &TenantId, n: u32) -> String {
    tacquire(st, t, n).await.unwrap_err().to_string()
}

/// `t` floods: records `ns`, one per [`MIN`], each completed (at a bound, by evicting one
/// of `t`'s own).
async fn flood(st: &MemoryStore, t: &TenantId, ns: std::ops::Range<u32>) {
    for n in ns {
        tokio::time::advance(MIN).await;
        tcomplete(st, t, n)
            .await
            .expect("the flooding tenant evicts its own");
    }
}

/// Claims and completes record `n` of `t` with a day's TTL.
async fn tcomplete(st: &MemoryStore, t: &TenantId, n: u32) -> Result<(), StoreError> {
    tcomplete_with(st, t, n, resp(b"r"), DAY).await
}

#[tokio::test(start_paused = true)]
async fn at_the_store_bound_new_claims_are_refused_and_nothing_is_evicted() {
    let st = store(3, 1 << 20);
    complete(&st, 1, b"a").await;
    complete(&st, 2, b"b").await;
    // Record 3 has a short TTL and expires.
    let f = acquire(&st, 3).await;
    st.complete(completion(&scope(3), f, resp(b"c"), Duration::from_secs(1)))
        .await
        .unwrap();
    let err = st.claim(req(&scope(4), &fp(1), 4)).await.unwrap_err();
    assert!(matches!(err, StoreError::Full(_)), "{err}");
    assert_eq!(err.to_string(), "store full: store at its record bound (3)");
    // Once record 3 expired and was swept, there is room again.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    complete(&st, 4, b"d").await;
    // At the bound again: refused, and the completed records are all still there.
    let err = st.claim(req(&scope(5), &fp(1), 5)).await.unwrap_err();
    assert!(matches!(err, StoreError::Full(_)), "{err}");
    for s in [1, 2, 4] {
        assert!(
            matches!(
                st.get(&scope(s)).await.unwrap(),
                Some(RecordState::Completed { .. })
            ),
            "{s}"
        );
    }
    // Replays are not new records: never refused.
    assert_eq!(
        st.claim(req(&scope(1), &fp(1), 9)).await.unwrap(),
        Claim::Completed(resp(b"a"))
    );
    let stats = st.stats();
    assert_eq!(stats.full_rejections, 2);
    assert_eq!(stats.rejected_store_entries, 2);
    assert_eq!(stats.expirations, 1);
    assert_eq!(st.len(), 3);
}

#[tokio::test(start_paused = true)]
async fn in_flight_records_are_never_evicted_and_release_frees_room() {
    let st = store(2, 1 << 20);
    let f1 = acquire(&st, 1).await;
    let _f2 = acquire(&st, 2).await;
    let err = st.claim(req(&scope(3), &fp(1), 3)).await.unwrap_err();
    assert!(matches!(err, StoreError::Full(_)), "{err}");
    assert_eq!(st.stats().full_rejections, 1);
    // Released (nothing was done): the record goes and its room with it.
    st.release(&scope(1), f1).await.unwrap();
    assert_eq!(st.len(), 1);
    assert!(matches!(
        st.claim(req(&scope(3), &fp(1), 3)).await.unwrap(),
        Claim::Acquired { .. }
    ));
    assert!(matches!(
        st.get(&scope(2)).await.unwrap(),
        Some(RecordState::InFlight { .. })
    ));
}

#[tokio::test(start_paused = true)]
async fn a_response_that_does_not_fit_is_not_retained_and_nothing_is_evicted() {
    let st = store(100, 3 * RECORD_OVERHEAD_BYTES + 10);
    complete(&st, 1, b"0123456789").await;
    assert_eq!(st.stats().bytes, RECORD_OVERHEAD_BYTES + 10);
    let f2 = acquire(&st, 2).await;
    let _f3 = acquire(&st, 3).await;
    // 16 bytes do not fit the 0 left: recorded as not retained, record 1 untouched.
    st.complete(completion(&scope(2), f2, resp(b"0123456789abcdef"), TTL))
        .await
        .unwrap();
    assert!(matches!(
        st.get(&scope(2)).await.unwrap(),
        Some(RecordState::Completed {
            outcome: StoredOutcome::NotRetained,
            ..
        })
    ));
    assert_eq!(
        st.claim(req(&scope(1), &fp(1), 7)).await.unwrap(),
        Claim::Completed(resp(b"0123456789"))
    );
    assert_eq!(st.stats().responses_dropped, 1);
    assert_eq!(st.stats().bytes, 3 * RECORD_OVERHEAD_BYTES + 10);
    // A fourth record does not fit the bytes either.
    let err = st.claim(req(&scope(4), &fp(1), 4)).await.unwrap_err();
    assert!(err.to_string().contains("store at its byte bound"), "{err}");
    assert_eq!(st.stats().rejected_store_bytes, 1);
}

/// Tenant A floods the store with rejected calls (claim, then release) and with
/// abandoned claims that never finish; tenant B's completed record is still replayed
/// and B can still claim.
#[tokio::test(start_paused = true)]
async fn one_tenants_rejected_and_abandoned_calls_cost_another_tenant_nothing() {
    let st = MemoryStore::new(MemoryStoreSettings {
        max_entries: 64,
        max_bytes: 1 << 20,
        max_in_flight_per_tenant: Some(16),
        max_entries_per_tenant: Some(32),
        max_bytes_per_tenant: None,
        sweep_interval: Duration::from_secs(1),
        min_retention: DEFAULT_MIN_RETENTION,
    });
    tcomplete_with(&st, &B, 1, resp(b"order of B"), TTL)
        .await
        .unwrap();
    // 10 000 rejected calls of A: each claims and releases.
    for n in 0..10_000 {
        let f = tacquire(&st, &A, n).await.unwrap();
        st.release(&tscope(&A, n), f).await.unwrap();
    }
    assert_eq!(st.tenant_usage(&A).map(|u| u.entries), Some(0));
    // Then A abandons slow calls until it is refused.
    let mut abandoned = 0;
    while tacquire(&st, &A, 20_000 + abandoned).await.is_ok() {
        abandoned += 1;
    }
    assert_eq!(abandoned, 16, "A stops at its in-flight bound");
    assert_eq!(st.stats().rejected_tenant_in_flight, 1);
    // B's completed record is still replayed, and B can claim.
    assert_eq!(
        st.claim(treq(&B, &tscope(&B, 1), 99)).await.unwrap(),
        Claim::Completed(resp(b"order of B"))
    );
    for n in 2..18 {
        tacquire(&st, &B, n).await.expect("B is not limited by A");
    }
    // A's abandoned claims are dropped one lease after their lease ended; then A can
    // claim again.
    tokio::time::sleep(2 * LEASE + Duration::from_secs(2)).await;
    assert_eq!(
        st.tenant_usage(&A),
        None,
        "A's usage is gone with its records"
    );
    tacquire(&st, &A, 30_000).await.expect("A can claim again");
}

#[tokio::test(start_paused = true)]
async fn a_tenant_at_its_record_or_byte_bound_is_refused_and_keeps_its_records() {
    let st = MemoryStore::new(MemoryStoreSettings {
        max_entries: 100,
        max_bytes: 1 << 20,
        max_in_flight_per_tenant: None,
        max_entries_per_tenant: Some(4),
        max_bytes_per_tenant: Some(4 * RECORD_OVERHEAD_BYTES + 100),
        sweep_interval: Duration::from_secs(1),
        min_retention: DEFAULT_MIN_RETENTION,
    });
    for n in 0..4 {
        tcomplete_with(&st, &A, n, resp(b"0123456789"), TTL)
            .await
            .unwrap();
    }
    assert_eq!(
        refusal(&st, &A, 4).await,
        "store full: tenant at its record bound (4)"
    );
    // Its own records are kept (no eviction), and other tenants are not affected.
    for n in 0..4 {
        assert_eq!(
            st.claim(treq(&A, &tscope(&A, n), 50)).await.unwrap(),
            Claim::Completed(resp(b"0123456789"))
        );
    }
    tacquire(&st, &B, 0).await.unwrap();
    // Bytes: B's big response does not fit its share: not retained; then B is at
    // its byte bound for new records as well.
    let big = StoredOutcome::Response(Bytes::from(vec![1u8; 3 * RECORD_OVERHEAD_BYTES]));
    tcomplete_with(&st, &B, 1, big, TTL).await.unwrap();
    assert_eq!(
        st.claim(treq(&B, &tscope(&B, 1), 51)).await.unwrap(),
        Claim::Completed(StoredOutcome::NotRetained)
    );
    let fits = StoredOutcome::Response(Bytes::from(vec![2u8; RECORD_OVERHEAD_BYTES + 100]));
    tcomplete_with(&st, &B, 2, fits, TTL).await.unwrap();
    assert_eq!(
        refusal(&st, &B, 3).await,
        format!(
            "store full: tenant at its byte bound ({})",
            4 * RECORD_OVERHEAD_BYTES + 100
        )
    );
    let stats = st.stats();
    assert_eq!(
        (
            stats.rejected_tenant_entries,
            stats.rejected_tenant_bytes,
            stats.responses_dropped
        ),
        (1, 1, 1)
    );
    assert_eq!(stats.tenants, 2);
}

/// A claim refused at a bound costs what a normal claim costs: no scan of the store.
/// (Before, each refused claim at a full store of 50 000 in-flight records scanned all
/// of them under a lock: 4.4 ms, ~60× a normal claim in a debug build.) Counted, not
/// timed: the eviction queue entries a refusal looks at, with the store full of
/// in-flight claims and then of completed records younger than `minRetention`.
#[tokio::test(start_paused = true)]
async fn a_refused_claim_costs_what_a_normal_claim_costs() {
    const N: u32 = 20_000;
    const ROUNDS: u32 = 500;
    let settings = |max_entries| MemoryStoreSettings {
        max_entries,
        max_bytes: usize::MAX,
        max_in_flight_per_tenant: Some(max_entries),
        max_entries_per_tenant: Some(max_entries),
        max_bytes_per_tenant: None,
        sweep_interval: Duration::from_secs(3600),
        min_retention: DEFAULT_MIN_RETENTION,
    };
    let long = |t: &TenantId, n: u32| ClaimRequest {
        lease: Duration::from_secs(3600),
        ..treq(t, &tscope(t, n), u128::from(n))
    };
    // Full of in-flight claims (none may be evicted).
    let st = MemoryStore::new(settings(N as usize));
    for n in 0..N {
        assert!(matches!(
            st.claim(long(&A, n)).await,
            Ok(Claim::Acquired { .. })
        ));
    }
    let before = steps(&st);
    for n in 0..ROUNDS {
        assert!(matches!(
            st.claim(long(&B, N + n)).await,
            Err(StoreError::Full(_))
        ));
    }
    let in_flight = steps(&st) - before;
    // Full of completed records, every one younger than minRetention: a refusal looks
    // at the front of each shard's queue at most, whatever the number of records.
    let st = MemoryStore::new(settings(N as usize));
    for n in 0..N {
        tcomplete(&st, &A, n).await.unwrap();
    }
    let before = steps(&st);
    for n in 0..ROUNDS {
        assert!(matches!(
            tacquire(&st, &B, N + n).await,
            Err(StoreError::Full(_))
        ));
        assert!(matches!(
            tacquire(&st, &A, N + n).await,
            Err(StoreError::Full(_))
        ));
    }
    let young = steps(&st) - before;
    println!(
        "queue entries looked at per refused claim, at a bound of {N} records: \
         {:.2} (in flight), {:.2} (completed, young)",
        in_flight as f64 / f64::from(ROUNDS),
        young as f64 / f64::from(2 * ROUNDS)
    );
    assert_eq!(in_flight, 0, "in-flight claims are in no eviction queue");
    assert!(
        young <= u64::from(2 * ROUNDS) * SHARDS as u64,
        "at most one queue front per shard per refusal: {young} for {} refusals",
        2 * ROUNDS
    );
}

#[test]
fn per_tenant_bounds_default_to_a_share_of_the_store() {
    let d = MemoryStoreSettings::default();
    assert_eq!(
        (
            d.tenant_in_flight_bound(),
            d.tenant_entries_bound(),
            d.tenant_bytes_bound()
        ),
        (125_000, 500_000, 64 * 1024 * 1024)
    );
    let tiny = MemoryStoreSettings {
        max_entries: 3,
        max_in_flight_per_tenant: Some(1000),
        ..MemoryStoreSettings::default()
    };
    // Never above the store bound, never zero.
    assert_eq!(
        (tiny.tenant_in_flight_bound(), tiny.tenant_entries_bound()),
        (1, 1)
    );
    let explicit = MemoryStoreSettings {
        max_entries_per_tenant: Some(10_000_000),
        max_bytes_per_tenant: Some(usize::MAX),
        ..MemoryStoreSettings::default()
    };
    assert_eq!(explicit.tenant_entries_bound(), 2_000_000);
    assert_eq!(explicit.tenant_bytes_bound(), 256 * 1024 * 1024);
    assert_eq!(explicit.tenant_in_flight_bound(), 125_000);
}

#[tokio::test(start_paused = true)]
async fn conformance_tenant_in_flight_bound() {
    let st = MemoryStore::new(MemoryStoreSettings {
        max_in_flight_per_tenant: Some(crate::testing::TENANT_IN_FLIGHT_BOUND),
        ..MemoryStoreSettings::default()
    });
    crate::testing::tenant_in_flight_bound(&st).await;
}

#[tokio::test(start_paused = true)]
async fn conformance_tenant_in_flight_bound_across_instances() {
    let st = MemoryStore::new(MemoryStoreSettings {
        max_in_flight_per_tenant: Some(crate::testing::TENANT_IN_FLIGHT_BOUND),
        ..MemoryStoreSettings::default()
    });
    crate::testing::tenant_in_flight_bound_across_instances(&[st.clone(), st]).await;
}

#[tokio::test(start_paused = true)]
async fn conformance_tenant_bytes_bound() {
    let st = MemoryStore::new(MemoryStoreSettings {
        max_bytes_per_tenant: Some(crate::testing::TENANT_BYTES_BOUND),
        ..MemoryStoreSettings::default()
    });
    crate::testing::tenant_bytes_bound(&st).await;
}

#[tokio::test(start_paused = true)]
async fn waiters_are_woken_by_completion_not_by_polling() {
    let st = store(100, 1 << 20);
    let s = scope(1);
    let f = acquire(&st, 1).await;
    let start = Instant::now();
    let st2 = st.clone();
    let waiter = tokio::spawn(async move {
        st2.wait(&scope(1), Instant::now() + Duration::from_secs(3600))
            .await
            .unwrap();
        Instant::now()
    });
    tokio::task::yield_now().await;
    tokio::time::advance(Duration::from_millis(250)).await;
    st.complete(completion(&s, f, resp(b"ok"), TTL))
        .await
        .unwrap();
    let woke = waiter.await.unwrap();
    assert_eq!(
        woke - start,
        Duration::from_millis(250),
        "woken at completion"
    );
    // Nothing to wait for: returns at once.
    let t = Instant::now();
    st.wait(&s, t + Duration::from_secs(5)).await.unwrap();
    st.wait(&scope(9), t + Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!(Instant::now(), t);
}

#[tokio::test(start_paused = true)]
async fn waiters_wake_at_lease_end_or_their_deadline() {
    let st = store(100, 1 << 20);
    let _f = acquire(&st, 1).await;
    let t = Instant::now();
    st.wait(&scope(1), t + Duration::from_secs(2))
        .await
        .unwrap();
    assert_eq!(Instant::now() - t, Duration::from_secs(2));
    st.wait(&scope(1), t + Duration::from_secs(3600))
        .await
        .unwrap();
    assert_eq!(Instant::now() - t, LEASE, "lease end");
}

#[tokio::test]
async fn sweeper_does_not_keep_the_store_alive() {
    let st = store(100, 1 << 20);
    complete(&st, 1, b"x").await;
    let weak = Arc::downgrade(&st.inner);
    drop(st);
    assert!(weak.upgrade().is_none());
}

/// Memory per record beyond the stored response, for 100 000 small records.
///
/// Method: struct sizes and hash-table capacity, not an allocator hook (the workspace
/// forbids `unsafe`, which a counting global allocator needs). The table (hashbrown)
/// holds `buckets × (size_of::<(Name, Entry)>() + 1 control byte)` with
/// `buckets = capacity × 8 / 7` (a power of two); the stored response adds its
/// `Bytes` allocation, which is "the response". Cross-checked against the resident-set
/// growth from `/proc/self/statm` when available (printed only: RSS is noisy).
#[tokio::test(start_paused = true)]
async fn memory_per_record() {
    const N: usize = 100_000;
    let rss = || -> Option<usize> {
        let s = std::fs::read_to_string("/proc/self/statm").ok()?;
        let pages: usize = s.split_whitespace().nth(1)?.parse().ok()?;
        Some(pages * 4096)
    };
    let before = rss();
    let st = store(N, usize::MAX);
    let response = 16usize;
    for i in 0..N as u32 {
        let mut s = [0u8; 32];
        s[..4].copy_from_slice(&i.to_be_bytes());
        s[4] = (i % 251) as u8;
        s[0] = (i % 256) as u8;
        s[1] = (i / 256 % 256) as u8;
        s[2] = (i / 65536) as u8;
        let sc = Scope(s);
        let r = ClaimRequest {
            scope: &sc,
            tenant: &TenantId([0; 16]),
            fingerprint: &fp(1),
            claimant: ClaimantId(1),
            lease: LEASE,
        };
        let Claim::Acquired { fence, .. } = st.claim(r).await.unwrap() else {
            panic!()
        };
        st.complete(completion(
            &sc,
            fence,
            StoredOutcome::Response(Bytes::from(vec![7u8; response])),
            TTL,
        ))
        .await
        .unwrap();
    }
    assert_eq!(st.len(), N);
    let slot = std::mem::size_of::<(Name, Entry)>() + 1;
    let table: usize = st
        .inner
        .shards
        .iter()
        .map(|m| {
            let cap = lock(m).capacity();
            let buckets = (cap * 8 / 7).next_power_of_two();
            buckets * slot
        })
        .sum();
    // Each completion is queued twice (its tenant's queue and its shard's).
    let done = std::mem::size_of::<Done>();
    let queues: usize = st
        .inner
        .shards
        .iter()
        .map(|m| lock(m).done.capacity() * done)
        .sum::<usize>()
        + st.inner.usage(&TenantId([0; 16])).done().capacity() * done;
    let per_record = (table + queues) as f64 / N as f64;
    let after = rss();
    println!(
        "memory per record beyond the response: {per_record:.1} bytes \
         (slot {slot} bytes = name 16 + entry {} + ctrl 1; table load {:.2}; \
         queues {:.1} bytes: 2 × {done}-byte entries); \
         RSS growth per record incl. the {response}-byte response and allocator overhead: {:?}",
        std::mem::size_of::<Entry>(),
        (slot * N) as f64 / table as f64,
        queues as f64 / N as f64,
        before.zip(after).map(|(b, a)| a.saturating_sub(b) / N)
    );
    // What the byte bounds charge covers what a record holds at this (typical) load.
    assert!(
        per_record <= RECORD_OVERHEAD_BYTES as f64,
        "{per_record} bytes per record, charged {RECORD_OVERHEAD_BYTES}"
    );
    assert!(
        slot - 1 + 2 * done <= RECORD_OVERHEAD_BYTES,
        "the charge covers the slot and the queue entries"
    );
}

// ---- Eviction after minRetention ----

const MIN: Duration = Duration::from_secs(60);
const DAY: Duration = Duration::from_secs(24 * 3600);

/// A store where a tenant may hold `per_tenant` records (all in flight, too),
/// `max_entries` in all, each kept at least `min_retention`.
fn evicting(max_entries: usize, per_tenant: usize, min_retention: Duration) -> MemoryStore {
    MemoryStore::new(MemoryStoreSettings {
        max_entries,
        max_bytes: 1 << 30,
        max_in_flight_per_tenant: Some(per_tenant),
        max_entries_per_tenant: Some(per_tenant),
        max_bytes_per_tenant: None,
        sweep_interval: Duration::from_secs(1),
        min_retention,
    })
}

/// Whether record `n` of `t` is still there, completed.
async fn kept(st: &MemoryStore, t: &TenantId, n: u32) -> bool {
    matches!(
        st.get(&tscope(t, n)).await.unwrap(),
        Some(RecordState::Completed { .. })
    )
}

fn steps(st: &MemoryStore) -> u64 {
    st.inner.queue_steps.load(Ordering::Relaxed)
}

#[tokio::test(start_paused = true)]
async fn at_its_record_bound_a_tenant_evicts_its_own_oldest_records_past_min_retention() {
    let st = evicting(100, 3, MIN);
    for n in 0..3 {
        tcomplete(&st, &A, n).await.unwrap();
        tokio::time::advance(Duration::from_secs(1)).await;
    }
    // All three are younger than minRetention: refused, nothing evicted.
    assert_eq!(
        refusal(&st, &A, 3).await,
        "store full: tenant at its record bound (3)"
    );
    // Record 0 is exactly minRetention old: it makes room, the two younger stay.
    tokio::time::advance(MIN - Duration::from_secs(3)).await;
    tacquire(&st, &A, 3)
        .await
        .expect("room made by evicting record 0");
    assert!(!kept(&st, &A, 0).await);
    assert!(kept(&st, &A, 1).await && kept(&st, &A, 2).await);
    assert_eq!(st.tenant_usage(&A).map(|u| u.entries), Some(3));
    // The trade-off: a retry of the evicted key runs again (once record 1 may go).
    assert!(matches!(
        tacquire(&st, &A, 0).await,
        Err(StoreError::Full(_))
    ));
    tokio::time::advance(Duration::from_secs(1)).await;
    assert_eq!(
        st.claim(treq(&A, &tscope(&A, 0), 77)).await.unwrap(),
        Claim::Acquired {
            fence: 5,
            takeover: false
        }
    );
    assert!(!kept(&st, &A, 1).await && kept(&st, &A, 2).await);
    let stats = st.stats();
    assert_eq!(
        (
            stats.evicted_after_min_retention,
            stats.evicted_for_other_tenants,
            stats.rejected_tenant_entries,
            stats.expirations
        ),
        (2, 0, 2, 0)
    );
}

#[tokio::test(start_paused = true)]
async fn records_younger_than_min_retention_are_never_evicted() {
    // At the store's record bound (one tenant may use it all).
    let st = evicting(3, 3, MIN);
    for n in 0..3 {
        tcomplete(&st, &A, n).await.unwrap();
    }
    tokio::time::advance(MIN - Duration::from_millis(1)).await;
    for n in 3..10 {
        assert_eq!(
            refusal(&st, &A, n).await,
            "store full: store at its record bound (3)"
        );
    }
    for n in 0..3 {
        assert_eq!(
            st.claim(treq(&A, &tscope(&A, n), 50)).await.unwrap(),
            Claim::Completed(resp(b"r")),
            "still replayed"
        );
    }
    assert_eq!(st.stats().evicted_after_min_retention, 0);
    tokio::time::advance(Duration::from_millis(1)).await;
    tacquire(&st, &A, 3).await.expect("now record 0 may go");
    assert_eq!(st.stats().evicted_after_min_retention, 1);

    // At a tenant's byte bound: the claim and then its response evict old records.
    let st = MemoryStore::new(MemoryStoreSettings {
        max_bytes_per_tenant: Some(3 * (RECORD_OVERHEAD_BYTES + 10)),
        min_retention: MIN,
        ..MemoryStoreSettings::default()
    });
    for n in 0..3 {
        tcomplete_with(&st, &B, n, resp(b"0123456789"), DAY)
            .await
            .unwrap();
    }
    assert_eq!(
        refusal(&st, &B, 3).await,
        format!(
            "store full: tenant at its byte bound ({})",
            3 * (RECORD_OVERHEAD_BYTES + 10)
        )
    );
    tokio::time::advance(MIN).await;
    let f = tacquire(&st, &B, 3).await.expect("record 0 makes room");
    // 10 bytes are free; 25 need record 1 to go as well: retained, not dropped.
    st.complete(completion(
        &tscope(&B, 3),
        f,
        resp(b"0123456789012345678901234"),
        DAY,
    ))
    .await
    .unwrap();
    assert_eq!(
        st.claim(treq(&B, &tscope(&B, 3), 50)).await.unwrap(),
        Claim::Completed(resp(b"0123456789012345678901234"))
    );
    assert!(!kept(&st, &B, 0).await && !kept(&st, &B, 1).await && kept(&st, &B, 2).await);
    let stats = st.stats();
    assert_eq!(
        (
            stats.evicted_after_min_retention,
            stats.responses_dropped,
            stats.rejected_tenant_bytes
        ),
        (2, 0, 1)
    );
}

#[tokio::test(start_paused = true)]
async fn zero_min_retention_evicts_any_completed_record_at_the_bound() {
    let st = evicting(100, 2, Duration::ZERO);
    tcomplete(&st, &A, 0).await.unwrap();
    tcomplete(&st, &A, 1).await.unwrap();
    // No time passes: the oldest completed record goes at once.
    tcomplete(&st, &A, 2).await.unwrap();
    assert!(!kept(&st, &A, 0).await);
    assert!(kept(&st, &A, 1).await && kept(&st, &A, 2).await);
    assert_eq!(st.stats().evicted_after_min_retention, 1);
}

#[tokio::test(start_paused = true)]
async fn in_flight_records_are_never_evicted_however_old() {
    let st = evicting(100, 3, Duration::ZERO);
    let long = |n: u32| ClaimRequest {
        lease: 10 * DAY,
        ..treq(&A, &tscope(&A, n), u128::from(n))
    };
    let mut fences = vec![];
    for n in 0..2 {
        let Claim::Acquired { fence, .. } = st.claim(long(n)).await.unwrap() else {
            panic!()
        };
        fences.push(fence);
    }
    tokio::time::advance(DAY).await;
    tcomplete(&st, &A, 2).await.unwrap();
    // The completed record (the youngest) goes, never the older in-flight ones.
    tacquire(&st, &A, 3).await.unwrap();
    assert!(!kept(&st, &A, 2).await);
    // Three in flight: nothing may go.
    let err = tacquire(&st, &A, 4).await.unwrap_err();
    assert!(matches!(err, StoreError::Full(_)), "{err}");
    for (n, fence) in (0..2).zip(fences) {
        st.complete(completion(&tscope(&A, n), fence, resp(b"late"), DAY))
            .await
            .expect("still held");
    }
    assert_eq!(st.stats().evicted_after_min_retention, 1);
}

/// At a tenant's bound and at the store's, a tenant holding its fair share or more
/// evicts only its own records: another tenant's flood costs it nothing.
#[tokio::test(start_paused = true)]
async fn one_tenants_flood_never_evicts_another_tenants_records() {
    // A tenant bound below the store's.
    let st = evicting(100, 2, MIN);
    tcomplete(&st, &B, 0).await.unwrap();
    tcomplete(&st, &B, 1).await.unwrap();
    flood(&st, &A, 0..1000).await;
    assert!(kept(&st, &B, 0).await && kept(&st, &B, 1).await);
    assert_eq!(st.stats().evicted_after_min_retention, 998);
    assert_eq!(st.stats().evicted_for_other_tenants, 0);

    // The store's bound, each tenant allowed all of it: B holds its fair share (2 of
    // 4, two tenants), A floods.
    let st = evicting(4, 4, MIN);
    tcomplete(&st, &B, 0).await.unwrap();
    tcomplete(&st, &B, 1).await.unwrap();
    tcomplete(&st, &A, 0).await.unwrap();
    tcomplete(&st, &A, 1).await.unwrap();
    flood(&st, &A, 2..1000).await;
    assert!(kept(&st, &B, 0).await && kept(&st, &B, 1).await);
    // Once both of A's records are young, A is refused, and B is still untouched.
    tcomplete(&st, &A, 1000).await.unwrap();
    assert_eq!(
        refusal(&st, &A, 1001).await,
        "store full: store at its record bound (4)"
    );
    assert!(kept(&st, &B, 0).await && kept(&st, &B, 1).await);
    assert_eq!(st.stats().evicted_for_other_tenants, 0);
}

/// At the store's bound a tenant below its fair share takes room from a tenant above
/// its share, down to that share and never a young record.
#[tokio::test(start_paused = true)]
async fn below_its_fair_share_a_tenant_takes_room_from_one_above_it() {
    let st = evicting(4, 4, MIN);
    for n in 0..4 {
        tcomplete(&st, &A, n).await.unwrap();
    }
    // A's records are young: B is refused.
    assert_eq!(
        refusal(&st, &B, 0).await,
        "store full: store at its record bound (4)"
    );
    tokio::time::advance(MIN).await;
    // Two tenants: a share is 2 records. B takes two of A's four.
    tacquire(&st, &B, 0).await.unwrap();
    tacquire(&st, &B, 1).await.unwrap();
    assert_eq!(st.tenant_usage(&A).map(|u| u.entries), Some(2));
    assert_eq!(st.stats().evicted_for_other_tenants, 2);
    // B holds its share: it may only evict its own (in flight): refused; A keeps 2.
    let err = tacquire(&st, &B, 2).await.unwrap_err();
    assert!(matches!(err, StoreError::Full(_)), "{err}");
    assert_eq!(st.tenant_usage(&A).map(|u| u.entries), Some(2));
    let stats = st.stats();
    assert_eq!(
        (
            stats.evicted_after_min_retention,
            stats.evicted_for_other_tenants,
            stats.rejected_store_entries
        ),
        (2, 2, 2)
    );
}

/// The only tenant, at the store's bound, evicts its own old records even while its
/// counters lag the store's (another thread's claim charged the store first): it must
/// not be sent to look for a tenant above its share, find none, and be refused.
#[tokio::test(start_paused = true)]
async fn the_only_tenant_at_the_store_bound_evicts_its_own_while_its_counters_lag() {
    let st = evicting(4, 4, MIN);
    for n in 0..4 {
        tcomplete(&st, &A, n).await.unwrap();
    }
    tokio::time::advance(MIN).await;
    // As between another claim's charge of the store and of the tenant: the store holds
    // 4 records, the tenant's counter 3.
    let a = st.inner.usage(&A);
    sub(&a.entries, 1);
    tacquire(&st, &A, 4)
        .await
        .expect("evicts one of its own instead of refusing");
    a.entries.fetch_add(1, Ordering::AcqRel);
    let stats = st.stats();
    assert_eq!(
        (stats.evicted_after_min_retention, stats.full_rejections),
        (1, 0)
    );
    assert_eq!(st.tenant_usage(&A).map(|u| u.entries), Some(4));
}

/// Making room looks at O(1) queue entries per claim, amortized: every completion is
/// queued once per queue and each entry is passed over at most once, stale or not.
#[tokio::test(start_paused = true)]
async fn eviction_is_o1_amortized() {
    const BOUND: u32 = 1000;
    let st = evicting(1 << 20, BOUND as usize, MIN);
    // Half of A's records expire early (stale queue entries once swept).
    for n in 0..BOUND {
        let ttl = if n % 2 == 0 { MIN / 2 } else { DAY };
        tcomplete_with(&st, &A, n, resp(b"r"), ttl).await.unwrap();
    }
    tokio::time::sleep(MIN + Duration::from_secs(2)).await;
    assert_eq!(st.stats().expirations, u64::from(BOUND / 2));
    // 20 000 claims at the bound, each completed.
    let before = steps(&st);
    let mut worst = 0;
    let claims = 20 * BOUND;
    for n in BOUND..BOUND + claims {
        let s0 = steps(&st);
        tokio::time::advance(Duration::from_millis(100)).await;
        match tcomplete(&st, &A, n).await {
            Ok(()) | Err(StoreError::Full(_)) => {}
            Err(e) => panic!("{e}"),
        }
        worst = worst.max(steps(&st) - s0);
    }
    let per_claim = (steps(&st) - before) as f64 / f64::from(claims);
    println!("queue entries looked at per claim: {per_claim:.2} on average, {worst} at most");
    assert!(per_claim <= 2.0, "{per_claim}");
    assert!(st.stats().evicted_after_min_retention > u64::from(BOUND));
    // The queues stay near the records they track (the sweeper compacts them).
    tokio::time::sleep(Duration::from_secs(2)).await;
    let live = st.tenant_usage(&A).unwrap().entries;
    assert!(st.inner.usage(&A).done().len() <= 2 * live + QUEUE_SLACK);
    let shard_queues: usize = st.inner.shards.iter().map(|s| lock(s).done.len()).sum();
    assert!(
        shard_queues <= 2 * live + SHARDS * QUEUE_SLACK,
        "{shard_queues}"
    );

    // A tenant below its share, refused at a full store, looks at most at the front of
    // every shard's queue.
    let st = evicting(BOUND as usize, BOUND as usize, MIN);
    for n in 0..BOUND {
        tcomplete(&st, &A, n).await.unwrap();
    }
    let s0 = steps(&st);
    assert!(matches!(
        tacquire(&st, &B, 0).await,
        Err(StoreError::Full(_))
    ));
    assert!(steps(&st) - s0 <= SHARDS as u64, "{}", steps(&st) - s0);
}

#[test]
fn min_retention_defaults_to_two_minutes() {
    assert_eq!(
        MemoryStoreSettings::default().min_retention,
        Duration::from_secs(120)
    );
}

#[test]
fn by_default_bytes_bind_before_entries() {
    let d = MemoryStoreSettings::default();
    let per_record = 200 + RECORD_OVERHEAD_BYTES;
    assert_eq!(
        d.max_bytes / per_record,
        610_080,
        "records of a 200-byte response"
    );
    assert!(d.max_bytes / RECORD_OVERHEAD_BYTES < d.max_entries);
    assert_eq!(
        d.max_bytes / per_record / d.min_retention.as_secs() as usize,
        5_084,
        "sustained calls/s of one tenant"
    );
}

/// Under sustained load below `capacity / minRetention`, a full store (default
/// `minRetention`, one tenant) evicts old completed records and refuses nothing; above
/// it, it refuses rather than evict a record younger than `minRetention`.
#[tokio::test(start_paused = true)]
async fn sustained_load_evicts_old_records_instead_of_refusing() {
    const CAPACITY: usize = 1_000;
    let settings = MemoryStoreSettings {
        max_bytes: CAPACITY * (200 + RECORD_OVERHEAD_BYTES),
        sweep_interval: Duration::from_secs(3600),
        ..MemoryStoreSettings::default()
    }
    .for_single_tenant();
    let retention = settings.min_retention.as_secs() as u32;
    let st = MemoryStore::new(settings);
    let body = || StoredOutcome::Response(Bytes::from(vec![0u8; 200]));
    // Half of what the bound sustains: 4 calls/s for 1000 records over 120 s.
    let rate = CAPACITY as u32 / retention / 2;
    let mut n = 0;
    for _ in 0..4 * retention {
        for _ in 0..rate {
            tcomplete_with(&st, &A, n, body(), DAY)
                .await
                .expect("never refused below the sustained rate");
            n += 1;
        }
        tokio::time::advance(Duration::from_secs(1)).await;
    }
    let stats = st.stats();
    assert_eq!(stats.full_rejections, 0, "{stats:?}");
    assert!(stats.evicted_after_min_retention > 0, "{stats:?}");
    assert!(stats.entries <= CAPACITY, "{stats:?}");
    let young = n - rate * (retention - 1)..n;
    // Far above the sustained rate (all at once): the old records make room, then new
    // calls are refused; no record younger than minRetention is evicted.
    let mut refused = 0;
    for _ in 0..CAPACITY {
        match tcomplete_with(&st, &A, n, body(), DAY).await {
            Ok(()) => {}
            Err(StoreError::Full(_)) => refused += 1,
            Err(e) => panic!("{e}"),
        }
        n += 1;
    }
    assert!(refused > 0);
    for k in young {
        assert!(kept(&st, &A, k).await, "record {k}");
    }
}

// ---- Property test against a simple model ----

/// Scopes 0..5: 0, 1 and 2 are tenant A's, 3 and 4 tenant B's.
const SCOPES: u8 = 5;
/// The model's store: 4 records in all, 2 per tenant (in flight or not), each kept at
/// least 20 s once completed.
const M_MAX: usize = 4;
const M_PER_TENANT: usize = 2;
const M_MIN_RETENTION: u64 = 20;

fn model_tenant(s: u8) -> usize {
    usize::from(s >= 3)
}

fn mreq(s: u8, f: u8, c: u8) -> ClaimRequest<'static> {
    let t = if model_tenant(s) == 0 { &A } else { &B };
    ClaimRequest {
        tenant: t,
        ..req(&scope(s), &fp(f), u128::from(c))
    }
}

#[derive(Debug, Clone)]
enum Op {
    Claim { s: u8, f: u8, c: u8 },
    Renew { s: u8, fence: u64 },
    Complete { s: u8, fence: u64, long: bool },
    Release { s: u8, fence: u64 },
    Get { s: u8 },
    Advance { secs: u64 },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..SCOPES, 0..2u8, 0..2u8).prop_map(|(s, f, c)| Op::Claim { s, f, c }),
        1 => (0..SCOPES, 1..12u64).prop_map(|(s, fence)| Op::Renew { s, fence }),
        3 => (0..SCOPES, 1..12u64, any::<bool>()).prop_map(|(s, fence, long)| Op::Complete { s, fence, long }),
        1 => (0..SCOPES, 1..12u64).prop_map(|(s, fence)| Op::Release { s, fence }),
        1 => (0..SCOPES).prop_map(|s| Op::Get { s }),
        2 => prop_oneof![0..3u64, 0..25u64].prop_map(|secs| Op::Advance { secs }),
    ]
}

#[derive(Debug, Clone, PartialEq)]
enum M {
    InFlight {
        fence: u64,
        f: u8,
        c: u8,
        lease_until: u64,
    },
    Completed {
        fence: u64,
        f: u8,
        until: u64,
        /// When it completed, and in which order.
        at: u64,
        seq: u64,
    },
}

/// The obvious single-map implementation of the contract, times in whole seconds.
#[derive(Default)]
struct Model {
    now: u64,
    next: u64,
    seq: u64,
    recs: HashMap<u8, M>,
    evicted: u64,
}

/// An in-flight record is kept for one more lease after its lease ends.
const GRACE: u64 = 10;

impl Model {
    fn dead(&self, r: &M) -> bool {
        match r {
            M::InFlight { lease_until, .. } => *lease_until + GRACE <= self.now,
            M::Completed { until, .. } => *until <= self.now,
        }
    }

    /// What a sweep does.
    fn purge(&mut self) {
        let recs = std::mem::take(&mut self.recs);
        self.recs = recs.into_iter().filter(|(_, r)| !self.dead(r)).collect();
    }

    fn live(&mut self, s: u8) -> Option<&mut M> {
        if self.dead(self.recs.get(&s)?) {
            self.recs.remove(&s);
            return None;
        }
        self.recs.get_mut(&s)
    }

    /// (records, in flight) of tenant `t`, or of all when `None`.
    fn count(&self, t: Option<usize>) -> (usize, usize) {
        let of_t = self
            .recs
            .iter()
            .filter(|(s, _)| t.is_none_or(|t| model_tenant(**s) == t));
        let in_flight = of_t
            .clone()
            .filter(|(_, r)| matches!(r, M::InFlight { .. }))
            .count();
        (of_t.count(), in_flight)
    }

    /// Evicts `t`'s earliest completed record that completed `M_MIN_RETENTION` ago.
    fn evict_own(&mut self, t: usize) -> bool {
        let victim = self
            .recs
            .iter()
            .filter_map(|(s, r)| match r {
                M::Completed { at, seq, .. }
                    if model_tenant(*s) == t && at + M_MIN_RETENTION <= self.now =>
                {
                    Some((*seq, *s))
                }
                _ => None,
            })
            .min();
        victim.is_some_and(|(_, s)| {
            self.recs.remove(&s);
            self.evicted += 1;
            true
        })
    }

    /// Whether a new record of `s` fits, after evicting what may go.
    fn admit(&mut self, s: u8) -> bool {
        let t = model_tenant(s);
        loop {
            let (total, _) = self.count(None);
            let (mine, mine_in_flight) = self.count(Some(t));
            if total >= M_MAX {
                // With 2 tenants of at most 2 records, a full store means this tenant
                // holds its fair share: it evicts its own.
                let tenants = (0..2).filter(|t| self.count(Some(*t)).0 > 0).count();
                assert!(mine + 1 > M_MAX / tenants.max(1));
            } else if mine_in_flight >= M_PER_TENANT {
                return false;
            } else if mine < M_PER_TENANT {
                return true;
            }
            if !self.evict_own(t) {
                return false;
            }
        }
    }

    fn fresh(&mut self, s: u8, f: u8, c: u8) -> u64 {
        self.next += 1;
        let fence = self.next;
        self.recs.insert(
            s,
            M::InFlight {
                fence,
                f,
                c,
                lease_until: self.now + 10,
            },
        );
        fence
    }

    fn claim(&mut self, s: u8, f: u8, c: u8) -> Result<Claim, ()> {
        let now = self.now;
        Ok(match self.live(s).cloned() {
            None if !self.admit(s) => return Err(()),
            None => Claim::Acquired {
                fence: self.fresh(s, f, c),
                takeover: false,
            },
            Some(M::Completed { f: f0, .. }) if f0 != f => Claim::Mismatch,
            Some(M::Completed { .. }) => Claim::Completed(resp(b"r")),
            Some(M::InFlight { f: f0, .. }) if f0 != f => Claim::Mismatch,
            Some(M::InFlight {
                fence,
                c: c0,
                lease_until,
                ..
            }) if lease_until > now => {
                if c0 == c {
                    self.recs.insert(
                        s,
                        M::InFlight {
                            fence,
                            f,
                            c,
                            lease_until: now + 10,
                        },
                    );
                    Claim::Acquired {
                        fence,
                        takeover: false,
                    }
                } else {
                    Claim::InFlight {
                        lease_remaining: Duration::from_secs(lease_until - now),
                    }
                }
            }
            Some(M::InFlight { .. }) => Claim::Acquired {
                fence: self.fresh(s, f, c),
                takeover: true,
            },
        })
    }

    fn fenced(&mut self, s: u8, fence: u64) -> Option<(u8, u8)> {
        match self.live(s) {
            Some(M::InFlight {
                fence: f0, f, c, ..
            }) if *f0 == fence => Some((*f, *c)),
            _ => None,
        }
    }
}

fn kind(r: &Result<(), StoreError>) -> bool {
    match r {
        Ok(()) => true,
        Err(StoreError::Fenced { .. }) => false,
        Err(e) => panic!("unexpected {e}"),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2048, ..ProptestConfig::default() })]
    #[test]
    fn behaves_like_the_model(ops in proptest::collection::vec(op(), 1..80)) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_time().start_paused(true).build().unwrap();
        rt.block_on(async {
            let st = MemoryStore::new(MemoryStoreSettings {
                max_entries: M_MAX,
                max_bytes: 1 << 20,
                max_in_flight_per_tenant: Some(M_PER_TENANT),
                max_entries_per_tenant: Some(M_PER_TENANT),
                max_bytes_per_tenant: None,
                sweep_interval: Duration::from_secs(1),
                min_retention: Duration::from_secs(M_MIN_RETENTION),
            });
            let mut m = Model::default();
            for op in ops {
                match op {
                    Op::Claim { s, f, c } => {
                        let got = match st.claim(mreq(s, f, c)).await {
                            Ok(c) => Ok(c),
                            Err(StoreError::Full(_)) => Err(()),
                            Err(e) => panic!("unexpected {e}"),
                        };
                        let want = m.claim(s, f, c);
                        assert_eq!(got, want, "{op:?}");
                    }
                    Op::Renew { s, fence } => {
                        let ok = kind(&st.renew(&scope(s), fence, LEASE).await);
                        let want = m.fenced(s, fence).map(|(f, c)| {
                            m.recs.insert(s, M::InFlight { fence, f, c, lease_until: m.now + 10 });
                        });
                        assert_eq!(ok, want.is_some(), "{op:?}");
                    }
                    Op::Complete { s, fence, long } => {
                        let ttl = if long { 100 } else { 5 };
                        let ok = kind(&st.complete(completion(&scope(s), fence, resp(b"r"), Duration::from_secs(ttl))).await);
                        let want = m.fenced(s, fence).map(|(f, _)| {
                            m.seq += 1;
                            let (until, at, seq) = (m.now + ttl, m.now, m.seq);
                            m.recs.insert(s, M::Completed { fence, f, until, at, seq });
                        });
                        assert_eq!(ok, want.is_some(), "{op:?}");
                    }
                    Op::Release { s, fence } => {
                        let ok = kind(&st.release(&scope(s), fence).await);
                        let want = m.fenced(s, fence).map(|_| {
                            m.recs.remove(&s);
                        });
                        assert_eq!(ok, want.is_some(), "{op:?}");
                    }
                    Op::Get { s } => {
                        let got = st.get(&scope(s)).await.unwrap().map(|r| match r {
                            RecordState::InFlight { fence, .. } => ("in_flight", fence),
                            RecordState::Completed { fence, .. } => ("completed", fence),
                            RecordState::Released { fence } => ("released", fence),
                        });
                        let want = m.live(s).map(|r| match r {
                            M::InFlight { fence, .. } => ("in_flight", *fence),
                            M::Completed { fence, .. } => ("completed", *fence),
                        });
                        assert_eq!(got, want, "{op:?}");
                    }
                    Op::Advance { secs } => {
                        tokio::time::advance(Duration::from_secs(secs)).await;
                        m.now += secs;
                        // Expired records count against the bounds until swept: sweep
                        // now, as the model does.
                        st.sweep();
                        m.purge();
                    }
                }
                // Same records, per tenant and in all, and the same evictions.
                assert_eq!(st.len(), m.count(None).0, "accounting after {op:?}");
                for (t, id) in [(0, A), (1, B)] {
                    let (n, in_flight) = m.count(Some(t));
                    let u = st.tenant_usage(&id).unwrap_or_default();
                    assert_eq!((u.entries, u.in_flight), (n, in_flight), "tenant {t} after {op:?}");
                }
                assert_eq!(st.stats().evicted_after_min_retention, m.evicted, "{op:?}");
            }
        });
    }
}

// ---- Property test of the eviction invariants, three tenants sharing the store ----

#[derive(Debug, Clone)]
enum LoadOp {
    Claim { t: u8, n: u8 },
    Complete { t: u8, n: u8, long: bool },
    Advance { secs: u64 },
}

fn load_op() -> impl Strategy<Value = LoadOp> {
    prop_oneof![
        4 => (0..3u8, 0..8u8).prop_map(|(t, n)| LoadOp::Claim { t, n }),
        3 => (0..3u8, 0..8u8, any::<bool>()).prop_map(|(t, n, long)| LoadOp::Complete { t, n, long }),
        2 => prop_oneof![0..3u64, 0..25u64].prop_map(|secs| LoadOp::Advance { secs }),
    ]
}

/// A record the load holds: its fence, and once completed, when and until when.
type Held = (Fence, Option<(Instant, Instant)>);

proptest! {
    #![proptest_config(ProptestConfig { cases: 1024, ..ProptestConfig::default() })]
    /// Whatever the load: a record completed less than minRetention ago, or in flight,
    /// is never evicted; a record of another tenant is evicted only while its tenant
    /// holds more than its fair share, for a tenant below its share, and never below it.
    #[test]
    fn eviction_keeps_its_invariants(ops in proptest::collection::vec(load_op(), 1..120)) {
        const MAX: usize = 6;
        const MIN_S: u64 = 20;
        let rt = tokio::runtime::Builder::new_current_thread().enable_time().start_paused(true).build().unwrap();
        rt.block_on(async {
            let st = evicting(MAX, MAX, Duration::from_secs(MIN_S));
            let tenants = [A, B, TenantId([0xc; 16])];
            let mut held: HashMap<(u8, u8), Held> = HashMap::new();
            for op in ops {
                let usage = |t: u8| st.tenant_usage(&tenants[usize::from(t)]).unwrap_or_default().entries;
                let before: Vec<usize> = (0..3).map(usage).collect();
                let mut claimant = None;
                match op {
                    LoadOp::Claim { t, n } => {
                        let tid = &tenants[usize::from(t)];
                        claimant = Some(t);
                        let r = ClaimRequest { lease: DAY, ..treq(tid, &tscope(tid, u32::from(n)), 1) };
                        match st.claim(r).await {
                            Ok(Claim::Acquired { fence, .. }) => {
                                held.insert((t, n), (fence, None));
                            }
                            Ok(_) | Err(StoreError::Full(_)) => {}
                            Err(e) => panic!("{e}"),
                        }
                    }
                    LoadOp::Complete { t, n, long } => {
                        if let Some((fence, done @ None)) = held.get_mut(&(t, n)) {
                            let tid = &tenants[usize::from(t)];
                            let ttl = if long { DAY } else { Duration::from_secs(30) };
                            st.complete(completion(&tscope(tid, u32::from(n)), *fence, resp(b"r"), ttl)).await.unwrap();
                            *done = Some((Instant::now(), Instant::now() + ttl));
                        }
                    }
                    LoadOp::Advance { secs } => {
                        tokio::time::advance(Duration::from_secs(secs)).await;
                        st.sweep();
                    }
                }
                let now = Instant::now();
                let fair = MAX / st.stats().tenants.max(1);
                let mut lost = [false; 3];
                for (&(t, n), &(_, done)) in &held {
                    let tid = &tenants[usize::from(t)];
                    if st.get(&tscope(tid, u32::from(n))).await.unwrap().is_some() {
                        continue;
                    }
                    let Some((at, until)) = done else {
                        panic!("in-flight record {t}/{n} evicted after {op:?}")
                    };
                    if until <= now {
                        continue; // expired
                    }
                    assert!(now - at >= Duration::from_secs(MIN_S), "young record {t}/{n} evicted after {op:?}");
                    let by = claimant.unwrap_or_else(|| panic!("{t}/{n} gone after {op:?}"));
                    if by != t {
                        lost[usize::from(t)] = true;
                        assert!(before[usize::from(by)] < fair, "claimant {by} at its share took {t}/{n}");
                    }
                }
                for t in 0..3u8 {
                    if lost[usize::from(t)] {
                        assert!(usage(t) >= fair, "tenant {t} taken below its share ({fair})");
                    }
                }
                held.retain(|&(t, n), _| {
                    let tid = &tenants[usize::from(t)];
                    st.inner.get(&Name::of(&tscope(tid, u32::from(n)))).is_some()
                });
            }
        });
    }
}

// ---- The store's clock ----

/// A store made after a paused runtime was built (outside it, as `MemoryStore::new`
/// allows) reads that runtime's clock, which stands behind the real one the store was
/// made on: leases and TTLs still end exactly when they should.
#[test]
fn a_store_made_after_a_paused_runtime_keeps_leases_and_ttls_exact() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap();
    // Real time moves on; the runtime's paused clock does not.
    std::thread::sleep(Duration::from_millis(10));
    let st = store(10, 1 << 20);
    rt.block_on(async {
        let claimed = Instant::now();
        acquire(&st, 1).await;
        let Some(RecordState::InFlight { lease_until, .. }) = st.get(&scope(1)).await.unwrap()
        else {
            panic!("in flight")
        };
        assert_eq!(lease_until, claimed + LEASE);
        tokio::time::advance(LEASE).await;
        assert!(matches!(
            st.claim(req(&scope(1), &fp(1), 99)).await.unwrap(),
            Claim::Acquired { takeover: true, .. }
        ));

        complete(&st, 2, b"x").await;
        tokio::time::advance(TTL).await;
        assert!(
            st.get(&scope(2)).await.unwrap().is_none(),
            "gone at its TTL"
        );
    });
}

/// Leases, TTLs and retention of `Duration::MAX` saturate instead of overflowing: no
/// panic anywhere, and the record behaves as one that never ends.
#[tokio::test(start_paused = true)]
async fn durations_at_their_maximum_saturate() {
    let st = MemoryStore::new(MemoryStoreSettings {
        min_retention: Duration::MAX,
        sweep_interval: Duration::MAX,
        ..MemoryStoreSettings::default()
    });
    let s = scope(3);
    let mut first = req(&s, &fp(1), 1);
    first.lease = Duration::MAX;
    let Claim::Acquired { fence, .. } = st.claim(first).await.unwrap() else {
        panic!("acquired")
    };
    let mut second = req(&s, &fp(1), 2);
    second.lease = Duration::MAX;
    let Claim::InFlight { lease_remaining } = st.claim(second).await.unwrap() else {
        panic!("in flight")
    };
    assert!(lease_remaining > Duration::from_secs(100 * 365 * 24 * 3600));
    // What the server layer does with it: wait until the lease ends or its deadline.
    let lease_end = Instant::now() + lease_remaining;
    let t = Instant::now();
    st.wait(&s, lease_end.min(t + Duration::from_secs(1)))
        .await
        .unwrap();
    assert_eq!(Instant::now() - t, Duration::from_secs(1));
    st.renew(&s, fence, Duration::MAX).await.unwrap();
    st.complete(completion(&s, fence, resp(b"ok"), Duration::MAX))
        .await
        .unwrap();
    tokio::time::advance(Duration::from_secs(10 * 365 * 24 * 3600)).await;
    st.sweep();
    assert!(matches!(
        st.get(&s).await.unwrap(),
        Some(RecordState::Completed { .. })
    ));
}

// ---- Which bound refused; warnings before the bound ----

#[tokio::test(start_paused = true)]
async fn a_full_store_names_the_bound_that_refused() {
    let o = RECORD_OVERHEAD_BYTES;
    let settings = |max_entries, max_bytes, in_flight, entries, bytes| MemoryStoreSettings {
        max_entries,
        max_bytes,
        max_in_flight_per_tenant: in_flight,
        max_entries_per_tenant: entries,
        max_bytes_per_tenant: bytes,
        sweep_interval: Duration::from_secs(3600),
        min_retention: DEFAULT_MIN_RETENTION,
    };
    let cases = [
        (
            settings(3, 1 << 20, Some(3), Some(3), None),
            false,
            MemoryBound::StoreEntries,
        ),
        (
            settings(100, 3 * o, Some(100), Some(100), Some(3 * o)),
            false,
            MemoryBound::StoreBytes,
        ),
        (
            settings(100, 1 << 20, Some(3), None, None),
            false,
            MemoryBound::TenantInFlight,
        ),
        (
            settings(100, 1 << 20, None, Some(3), None),
            true,
            MemoryBound::TenantEntries,
        ),
        (
            settings(160, 1 << 20, None, None, Some(3 * o)),
            false,
            MemoryBound::TenantBytes,
        ),
    ];
    for (settings, complete_them, bound) in cases {
        let st = MemoryStore::new(settings);
        for n in 0..3 {
            if complete_them {
                tcomplete_with(&st, &A, n, StoredOutcome::NotRetained, DAY)
                    .await
                    .unwrap();
            } else {
                tacquire(&st, &A, n).await.unwrap();
            }
        }
        let e = tacquire(&st, &A, 3).await.unwrap_err();
        assert_eq!(MemoryBound::refused(&e), Some(bound), "{e}");
        assert_eq!(bound.is_tenant(), bound.as_str().starts_with("tenant_"));
        // The message names the bound and its configured size, no usage.
        assert!(
            e.to_string().starts_with(&format!("store full: {bound} (")),
            "{e}"
        );
    }
    assert_eq!(
        MemoryBound::ALL.map(MemoryBound::as_str),
        [
            "tenant_in_flight",
            "tenant_entries",
            "tenant_bytes",
            "store_entries",
            "store_bytes"
        ]
    );
    // Not a memory store's refusal (another store, another error): no bound.
    assert_eq!(MemoryBound::refused(&StoreError::Full("x".into())), None);
    assert_eq!(
        MemoryBound::refused(&StoreError::Unavailable("x".into())),
        None
    );
}

/// The WARN events logged on this thread, each as `bound`.
#[derive(Clone, Default)]
struct Warnings(Arc<Mutex<Vec<String>>>);

impl Warnings {
    fn of(&self, bound: MemoryBound) -> usize {
        let label = format!("\"{}\"", bound.as_str());
        let seen = self.0.lock().unwrap();
        seen.iter().filter(|b| **b == label).count()
    }
}

/// The `bound` field of an event.
struct BoundField(Option<String>);

impl tracing::field::Visit for BoundField {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        if field.name() == "bound" {
            self.0 = Some(format!("{value:?}"));
        }
    }
}

impl tracing::Subscriber for Warnings {
    fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, event: &tracing::Event<'_>) {
        let mut bound = BoundField(None);
        event.record(&mut bound);
        if *event.metadata().level() == tracing::Level::WARN
            && let Some(b) = bound.0
            && event.metadata().fields().field("used").is_some()
        {
            self.0.lock().unwrap().push(b);
        }
    }
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}

#[tokio::test(start_paused = true)]
async fn past_80_percent_of_a_bound_the_store_warns_once_and_the_ratio_says_it() {
    let warnings = Warnings::default();
    let _guard = tracing::subscriber::set_default(warnings.clone());
    let st = MemoryStore::new(
        MemoryStoreSettings {
            max_entries: 10,
            sweep_interval: Duration::from_secs(3600),
            ..MemoryStoreSettings::default()
        }
        .for_single_tenant(),
    );
    let mut fences = Vec::new();
    for n in 0..7 {
        fences.push(tacquire(&st, &A, n).await.unwrap());
    }
    assert_eq!(st.usage_ratio(MemoryBound::StoreEntries), 0.7);
    assert_eq!(warnings.of(MemoryBound::StoreEntries), 0);
    for n in 7..10 {
        fences.push(tacquire(&st, &A, n).await.unwrap());
    }
    // Passed 80 % at the 8th record: one WARN per bound it passed, not one per claim.
    for bound in [
        MemoryBound::StoreEntries,
        MemoryBound::TenantEntries,
        MemoryBound::TenantInFlight,
    ] {
        assert_eq!(warnings.of(bound), 1, "{bound}");
        assert_eq!(st.usage_ratio(bound), 1.0, "{bound}");
    }
    assert_eq!(warnings.of(MemoryBound::StoreBytes), 0);
    assert!(st.usage_ratio(MemoryBound::StoreBytes) < 0.001);
    // Back below 70 % (seen by the sweeper), then past 80 % again: a second WARN.
    for (n, fence) in (0..4).zip(&fences) {
        st.release(&tscope(&A, n), *fence).await.unwrap();
    }
    st.sweep();
    assert_eq!(st.usage_ratio(MemoryBound::TenantEntries), 0.6);
    for n in 10..12 {
        tacquire(&st, &A, n).await.unwrap();
    }
    assert_eq!(warnings.of(MemoryBound::StoreEntries), 2);
    assert_eq!(warnings.of(MemoryBound::TenantEntries), 2);
}

/// The admin read reports when the run was claimed (to the second; a takeover keeps
/// it) and when it completed, on this process's clock; an entry stays 96 bytes.
#[tokio::test(start_paused = true)]
async fn the_admin_read_reports_when_the_run_was_claimed_and_completed() {
    let st = store(100, 1 << 20);
    let f = acquire(&st, 1).await;
    let read = |n| st.record(&scope(n)).expect("the record");
    assert!(read(1).created_at.is_some());
    assert_eq!(read(1).completed_at, None);
    tokio::time::advance(Duration::from_secs(5)).await;
    st.complete(completion(&scope(1), f, resp(b"r"), TTL))
        .await
        .unwrap();
    let info = read(1);
    let (c, d) = (info.created_at.unwrap(), info.completed_at.unwrap());
    let took = d.duration_since(c).expect("created before completed");
    assert!(
        took >= Duration::from_secs(4) && took <= Duration::from_secs(7),
        "{took:?} for 5 s"
    );
    // A takeover keeps the run's creation time, 15 s back (a new one would be now).
    // Times of one read only: the paused tokio clock moves, the system clock does not.
    acquire(&st, 2).await;
    tokio::time::advance(LEASE + Duration::from_secs(5)).await;
    assert!(matches!(
        st.claim(req(&scope(2), &fp(1), 99)).await.unwrap(),
        Claim::Acquired { takeover: true, .. }
    ));
    let age = std::time::SystemTime::now()
        .duration_since(read(2).created_at.unwrap())
        .expect("created in the past");
    assert!(age >= Duration::from_secs(13), "created {age:?} ago");
    assert!(std::mem::size_of::<super::entry::Entry>() <= 96);
}
