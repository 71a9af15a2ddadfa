//! The Redis store on a Redis Cluster (`RedisStore::cluster_builder`): the store
//! conformance suite with both wait strategies, the per-tenant bound, records and tenant
//! counts spread over every master (no CROSSSLOT), waits woken through sharded pub/sub,
//! scripts loaded again after a `SCRIPT FLUSH` on every node, and replica confirmation
//! (`WAIT`).
//!
//! One private cluster (3 masters, 3 replicas, `idem_test_support::redis::RedisCluster`)
//! serves every test of this binary; each test has its own key prefix. Without
//! `redis-server`/`redis-cli` the tests say so and pass, except under `CI`, where they
//! fail.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use idem_redis::{RedisStore, RedisStoreBuilder, WaitStrategy};
use idem_store::testing::completion;
use idem_store::{
    Claim, ClaimRequest, ClaimantId, Fence, Fingerprint, RecordState, Scope, Store, StoreError,
    StoredOutcome, TenantId,
};
use idem_test_support::redis::{RedisCluster, RedisReply as Resp};
use idem_test_support::store::complete_not_retained;
use tokio::time::Instant;

/// A key prefix no other test of this process uses.
fn prefix(what: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    format!("{what}{}:", N.fetch_add(1, Ordering::Relaxed))
}

/// A store on `cluster` under a key prefix of its own.
fn builder(cluster: &RedisCluster, what: &str) -> RedisStoreBuilder {
    RedisStore::cluster_builder(cluster.urls()).key_prefix(prefix(what))
}

async fn store_on(cluster: &RedisCluster, what: &str, strategy: WaitStrategy) -> RedisStore {
    builder(cluster, what)
        .wait_strategy(strategy)
        .connect()
        .await
        .expect("connect to the test cluster")
}

async fn store(strategy: WaitStrategy) -> Option<(RedisStore, ())> {
    let cluster = RedisCluster::shared()?;
    Some((store_on(cluster, "conformance", strategy).await, ()))
}

idem_store::store_conformance_tests! {
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    make_each = store(WaitStrategy::Notify) => notify, store(WaitStrategy::Poll) => polling;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenant_in_flight_bound() {
    let Some(cluster) = RedisCluster::shared() else {
        return;
    };
    let store = builder(cluster, "bound")
        .max_in_flight_per_tenant(Some(idem_store::testing::TENANT_IN_FLIGHT_BOUND))
        .connect()
        .await
        .expect("connect");
    idem_store::testing::tenant_in_flight_bound(&store).await;
}

/// The bound holds for claims sent at once through two stores (two instances) under
/// one key prefix.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenant_in_flight_bound_across_instances() {
    let Some(cluster) = RedisCluster::shared() else {
        return;
    };
    let shared = prefix("bound-across");
    let mut stores = Vec::new();
    for _ in 0..2 {
        let store = RedisStore::cluster_builder(cluster.urls())
            .key_prefix(shared.clone())
            .max_in_flight_per_tenant(Some(idem_store::testing::TENANT_IN_FLIGHT_BOUND))
            .connect()
            .await
            .expect("connect");
        stores.push(store);
    }
    idem_store::testing::tenant_in_flight_bound_across_instances(&stores).await;
}

/// The stored-bytes quota on a Cluster: the tenant's keys in another slot than its
/// records, so each step is a script of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenant_bytes_bound() {
    let Some(cluster) = RedisCluster::shared() else {
        return;
    };
    let store = builder(cluster, "bytes")
        .max_bytes_per_tenant(Some(idem_store::testing::TENANT_BYTES_BOUND))
        .connect()
        .await
        .expect("connect");
    idem_store::testing::tenant_bytes_bound(&store).await;
}

fn request<'a>(
    scope: &'a Scope,
    tenant: &'a TenantId,
    fp: &'a Fingerprint,
    lease: Duration,
) -> ClaimRequest<'a> {
    ClaimRequest {
        scope,
        tenant,
        fingerprint: fp,
        claimant: ClaimantId::random(),
        lease,
    }
}

/// A store whose writes are answered once `replicas` replicas have them (WAIT, at most
/// `timeout`).
async fn confirming(
    cluster: &RedisCluster,
    what: &str,
    replicas: usize,
    timeout: Duration,
) -> RedisStore {
    builder(cluster, what)
        .replica_acks(replicas, timeout)
        .connect()
        .await
        .expect("connect")
}

/// The lease of the tests' claims.
const LEASE: Duration = Duration::from_secs(5);

/// Claims with `req` and returns the fence; panics with `what` unless it acquired.
async fn acquired(store: &RedisStore, req: ClaimRequest<'_>, what: &str) -> Fence {
    match store.claim(req).await {
        Ok(Claim::Acquired { fence, .. }) => fence,
        other => panic!("{what}: {other:?}"),
    }
}

/// Keys matching `pattern` on the node on `port` (SCAN, every page).
fn keys_on(cluster: &RedisCluster, port: u16, pattern: &str) -> Vec<String> {
    let mut cursor = "0".to_owned();
    let mut keys = Vec::new();
    loop {
        let reply = cluster
            .cmd(port, &["SCAN", &cursor, "MATCH", pattern, "COUNT", "1000"])
            .expect("SCAN");
        let Resp::Array(Some(parts)) = reply else {
            panic!("SCAN reply {reply:?}")
        };
        cursor = parts[0].text();
        if let Resp::Array(Some(items)) = &parts[1] {
            keys.extend(items.iter().map(Resp::text));
        }
        if cursor == "0" {
            return keys;
        }
    }
}

/// 300 records of 3 tenants, each claimed (counted on its tenant's set), completed and
/// replayed: no CROSSSLOT anywhere, and the records landed on every master.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_and_tenant_counts_spread_over_every_master() {
    let Some(cluster) = RedisCluster::shared() else {
        return;
    };
    let store = store_on(cluster, "spread", WaitStrategy::Notify).await;
    let fp = Fingerprint([1; 32]);
    let tenants = [TenantId([1; 16]), TenantId([2; 16]), TenantId([3; 16])];
    for i in 0..300 {
        let scope = Scope(rand::random());
        let tenant = &tenants[i % 3];
        let fence = acquired(
            &store,
            request(&scope, tenant, &fp, LEASE),
            &format!("claim {i}"),
        )
        .await;
        let body = StoredOutcome::Response(format!("reply {i}").into_bytes().into());
        store
            .complete(completion(
                &scope,
                fence,
                body.clone(),
                Duration::from_secs(60),
            ))
            .await
            .expect("complete");
        assert_eq!(
            store
                .claim(request(&scope, tenant, &fp, LEASE))
                .await
                .expect("replay"),
            Claim::Completed(body)
        );
    }
    let pattern = format!("{}{{*", store.key_prefix());
    let masters = cluster.masters();
    assert_eq!(masters.len(), RedisCluster::MASTERS);
    let mut total = 0;
    for m in &masters {
        let n = keys_on(cluster, m.port, &pattern).len();
        assert!(
            n > 30,
            "master {} holds {n} of the 300 records: the hash tags spread them",
            m.port
        );
        total += n;
    }
    assert_eq!(
        total, 300,
        "one key per record, nothing else under the prefix"
    );
}

/// A waiter on one store is woken by a completion through another, through the sharded
/// channel on the record's master: its fallback polling is set to 10 s, so only the
/// notification can wake it within the bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waits_are_woken_by_sharded_pubsub_on_the_records_master() {
    let Some(cluster) = RedisCluster::shared() else {
        return;
    };
    let p = prefix("spubsub");
    let connect = |poll: Duration| {
        RedisStore::cluster_builder(cluster.urls())
            .key_prefix(p.clone())
            .wait_poll_interval(poll, poll)
            .connect()
    };
    let holder = connect(Duration::from_millis(2)).await.expect("connect");
    let waiter = connect(Duration::from_secs(10)).await.expect("connect");
    for round in 0..5 {
        let scope = Scope(rand::random());
        let tenant = TenantId([9; 16]);
        let fp = Fingerprint([2; 32]);
        let fence = acquired(
            &holder,
            request(&scope, &tenant, &fp, Duration::from_secs(30)),
            "claim",
        )
        .await;
        let started = Instant::now();
        let wait = tokio::spawn({
            let waiter = waiter.clone();
            async move {
                waiter
                    .wait(&scope, Instant::now() + Duration::from_secs(20))
                    .await
            }
        });
        // The subscription shows on the master of the record's slot.
        let channel = format!("{}:done", holder.key_for(&scope));
        let master = cluster.master_of_slot(cluster.slot_of(&channel));
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        loop {
            let n = match cluster.cmd(master.port, &["PUBSUB", "SHARDNUMSUB", &channel]) {
                Ok(Resp::Array(Some(v))) if v.len() == 2 => v[1].text(),
                other => panic!("PUBSUB SHARDNUMSUB: {other:?}"),
            };
            if n == "1" {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "round {round}: no SSUBSCRIBE on the record's master {}",
                master.port
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        complete_not_retained(&holder, &scope, fence, "complete").await;
        tokio::time::timeout(Duration::from_secs(5), wait)
            .await
            .expect("woken by the notification, not the 10 s poll")
            .expect("task")
            .expect("wait");
        assert!(started.elapsed() < Duration::from_secs(5));
    }
}

/// `SCRIPT FLUSH` on every node: the next calls load their scripts again (`NOSCRIPT`,
/// then `SCRIPT LOAD` on every node) and succeed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scripts_are_loaded_again_after_a_flush_on_every_node() {
    let Some(cluster) = RedisCluster::shared() else {
        return;
    };
    let store = store_on(cluster, "flush", WaitStrategy::Notify).await;
    for port in cluster.ports() {
        cluster.cmd(port, &["SCRIPT", "FLUSH"]).expect("flush");
    }
    let fp = Fingerprint([3; 32]);
    for _ in 0..20 {
        let scope = Scope(rand::random());
        let fence = acquired(
            &store,
            request(&scope, &TenantId([4; 16]), &fp, LEASE),
            "claim after SCRIPT FLUSH",
        )
        .await;
        complete_not_retained(&store, &scope, fence, "complete after SCRIPT FLUSH").await;
    }
}

/// The record's state field as the replica of its master sees it (`READONLY`, `HGET`).
fn state_on_replica(cluster: &RedisCluster, key: &str) -> Option<String> {
    let master = cluster.master_of_slot(cluster.slot_of(key));
    let replica = cluster
        .topology()
        .into_iter()
        .find(|n| n.master_id.as_deref() == Some(master.id.as_str()))
        .expect("the master has a replica");
    cluster
        .cmds(replica.port, &[&["READONLY"], &["HGET", key, "s"]])
        .expect("read on the replica")
        .bulk("HGET on the replica")
}

/// With `replica_acks(1, …)` a claim and a completion are answered only once the
/// master's replica has them: read on the replica right after each, 100 times.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn confirmed_claims_and_completions_are_on_the_replica_when_answered() {
    let Some(cluster) = RedisCluster::shared() else {
        return;
    };
    let store = confirming(cluster, "acks", 1, Duration::from_millis(200)).await;
    let fp = Fingerprint([5; 32]);
    for i in 0..100 {
        let scope = Scope(rand::random());
        let key = store.key_for(&scope);
        let fence = acquired(
            &store,
            request(&scope, &TenantId([5; 16]), &fp, LEASE),
            &format!("claim {i}"),
        )
        .await;
        assert_eq!(
            state_on_replica(cluster, &key).as_deref(),
            Some("i"),
            "claim {i} on the replica when answered"
        );
        complete_not_retained(&store, &scope, fence, "complete").await;
        assert_eq!(
            state_on_replica(cluster, &key).as_deref(),
            Some("c"),
            "completion {i} on the replica when answered"
        );
        // A completion retried after a lost reply is confirmed too, and reported as
        // landed (fenced with its own fence).
        assert!(matches!(
            store.complete(completion(&scope, fence, StoredOutcome::NotRetained, Duration::from_secs(60))).await,
            Err(StoreError::Fenced { presented, current: Some(c) }) if presented == c
        ));
    }
}

/// Asking for more replicas than the cluster has: every fresh claim fails closed
/// (`Unavailable`, after the WAIT timeout) and is released again, so nothing is left in
/// flight and nothing would have run; the same store's reads still work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unconfirmed_claims_fail_closed_and_leave_nothing_behind() {
    let Some(cluster) = RedisCluster::shared() else {
        return;
    };
    let store = confirming(cluster, "noacks", 2, Duration::from_millis(50)).await;
    let fp = Fingerprint([6; 32]);
    for i in 0..10 {
        let scope = Scope(rand::random());
        let r = store
            .claim(request(&scope, &TenantId([6; 16]), &fp, LEASE))
            .await;
        match r {
            Err(StoreError::Unavailable(cause)) => assert!(
                cause.message().contains("1 of 2 replicas"),
                "{}",
                cause.message()
            ),
            other => panic!("claim {i}: expected Unavailable, got {other:?}"),
        }
        assert_eq!(
            store.get(&scope).await.expect("get"),
            None,
            "claim {i} released"
        );
    }
    // Nothing of this prefix is left on any master (records nor tenant counts: the
    // count is never taken for a claim refused before it).
    let pattern = format!("{}*", store.key_prefix());
    for m in cluster.masters() {
        assert_eq!(keys_on(cluster, m.port, &pattern), Vec::<String>::new());
    }
    // A record completed by a store without confirmation still replays through this one.
    let plain = RedisStore::cluster_builder(cluster.urls())
        .key_prefix(store.key_prefix())
        .connect()
        .await
        .expect("connect");
    let scope = Scope(rand::random());
    let tenant = TenantId([6; 16]);
    let fence = acquired(&plain, request(&scope, &tenant, &fp, LEASE), "claim").await;
    complete_not_retained(&plain, &scope, fence, "complete").await;
    assert_eq!(
        store
            .claim(request(&scope, &tenant, &fp, LEASE))
            .await
            .expect("replay needs no confirmation"),
        Claim::Completed(StoredOutcome::NotRetained)
    );
    assert!(matches!(
        store.get(&scope).await,
        Ok(Some(RecordState::Completed { .. }))
    ));
}

/// The `idem.redis` object with `clusterNodes` builds a cluster store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn config_with_cluster_nodes_connects_to_the_cluster() {
    let Some(cluster) = RedisCluster::shared() else {
        return;
    };
    let nodes = serde_json_array(&cluster.urls()[..2]);
    let json = format!(
        r#"{{"idem": {{"redis": {{"clusterNodes": {nodes}, "keyPrefix": "{}", "replicaAcks": 1, "replicaAckTimeout": "0.2s"}}}}}}"#,
        prefix("config")
    );
    let config = idem_core::config::ServiceConfig::from_json(&json).expect("valid config");
    let store = RedisStore::from_settings(config.settings().redis.as_ref().expect("idem.redis"))
        .await
        .expect("connect from the config");
    assert!(store.is_cluster());
    let scope = Scope(rand::random());
    let fp = Fingerprint([8; 32]);
    assert!(matches!(
        store
            .claim(request(&scope, &TenantId([8; 16]), &fp, LEASE))
            .await,
        Ok(Claim::Acquired { .. })
    ));
    assert_eq!(
        state_on_replica(cluster, &store.key_for(&scope)).as_deref(),
        Some("i")
    );
}

fn serde_json_array(items: &[String]) -> String {
    let quoted: Vec<String> = items.iter().map(|s| format!("\"{s}\"")).collect();
    format!("[{}]", quoted.join(", "))
}

/// A cluster node given as a single endpoint (`url`) is refused at connect, naming the
/// setting to use instead; and cluster seeds that are not a cluster are refused too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_and_single_endpoint_mix_ups_are_refused_at_connect() {
    let Some(cluster) = RedisCluster::shared() else {
        return;
    };
    let err = RedisStore::connect(format!("{}/0", cluster.urls()[0]))
        .await
        .err();
    assert!(
        matches!(&err, Some(idem_redis::ConnectError::InvalidSetting(m)) if m.contains("clusterNodes")),
        "{err:?}"
    );
    let Some(single) = idem_test_support::redis::RedisServer::start() else {
        return;
    };
    let err = RedisStore::cluster_builder([single.url()])
        .connect_timeout(Duration::from_secs(1))
        .connect()
        .await
        .err();
    assert!(
        matches!(&err, Some(idem_redis::ConnectError::Unavailable(m)) if m.to_lowercase().contains("cluster")),
        "{err:?}"
    );
}
