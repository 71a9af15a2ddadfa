//! Chaos: the demo's workload, seeded and bounded, through the fault injector.
//!
//! Every intent must take effect exactly once with idem: on the in-memory store, on an
//! in-memory store that blips (claims, completions and releases failing now and then),
//! on Redis shared by three instances, on a Redis Cluster (3 masters, 3 replicas)
//! shared by three instances, with and without replica confirmation, and when an
//! instance is redeployed mid-run. The run without idem must show duplicates (the faults are real).

use idem_demo as harness;

use std::time::Duration;

use harness::{DEFAULT_CONFIG, DemoStore, Options, RunReport, run};
use idem::core::config::ServiceConfig;
use idem::redis::RedisStore;
use idem::store::memory::MemoryStore;

fn config() -> ServiceConfig {
    ServiceConfig::from_json(DEFAULT_CONFIG).expect("the demo's config is valid")
}

fn options(instances: usize, seed: u64) -> Options {
    Options {
        intents: 2000,
        concurrency: 64,
        unavailable: 0.10,
        drop: 0.10,
        latency: Duration::ZERO,
        seed,
        app_retries: 8,
        instances,
        progress: false,
        ..Options::default()
    }
}

fn assert_exactly_once(r: &RunReport) {
    assert_eq!(r.duplicates, 0, "duplicate orders: {r:?}");
    assert_eq!(
        r.ok_without_order, 0,
        "OK answered for a missing order: {r:?}"
    );
    assert_eq!(r.failed, 0, "intents that never got an OK: {r:?}");
    assert_eq!(r.orders, r.intents as u64, "orders != intents: {r:?}");
    assert!(
        r.replays > 0,
        "faults dropped responses, so some calls must replay: {r:?}"
    );
}

async fn with_and_without(o: &Options, store: &DemoStore) -> (RunReport, RunReport) {
    let cfg = config();
    let with = tokio::time::timeout(Duration::from_secs(120), run(o, true, &cfg, store))
        .await
        .expect("run with idem finished in time")
        .expect("run with idem");
    let without = tokio::time::timeout(Duration::from_secs(120), run(o, false, &cfg, store))
        .await
        .expect("run without idem finished in time")
        .expect("run without idem");
    (with, without)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_store_2000_intents_exactly_once() {
    let store = DemoStore::Memory(MemoryStore::default());
    let (with, without) = with_and_without(&options(1, 11), &store).await;
    assert_exactly_once(&with);
    assert!(
        without.duplicates > 50,
        "10% lost responses must duplicate orders without idem: {without:?}"
    );
}

/// The store blips under the workload: claims, completions and releases fail now and
/// then (some applied with their reply lost), and the layer must still record every
/// outcome it produced: completions and releases are retried while the lease is held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_blips_on_claim_complete_and_release_2000_intents_exactly_once() {
    use idem::store::faulty::{FaultyStore, StoreFault as Fault};
    use idem::store::instrumented::StoreOp as Op;
    let faulty = FaultyStore::new(MemoryStore::default());
    faulty
        .inject_randomly(Op::Claim, Fault::Unavailable, 0.03, 21)
        .inject_randomly(Op::Complete, Fault::Unavailable, 0.05, 21)
        .inject_randomly(Op::Release, Fault::ReplyLost, 0.05, 21);
    let store = DemoStore::Faulty(faulty.clone());
    let o = options(1, 14);
    let with = tokio::time::timeout(Duration::from_secs(120), run(&o, true, &config(), &store))
        .await
        .expect("run finished in time")
        .expect("run");
    assert!(
        faulty.faulted(Op::Complete) > 10,
        "completions were hit: {}",
        faulty.faulted(Op::Complete)
    );
    assert!(faulty.faulted(Op::Claim) > 10, "claims were hit");
    assert_eq!(with.duplicates, 0, "duplicate orders: {with:?}");
    assert_eq!(with.ok_without_order, 0, "{with:?}");
    assert_eq!(with.failed, 0, "intents that never got an OK: {with:?}");
    assert_eq!(with.orders, with.intents as u64, "{with:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_three_instances_2000_intents_exactly_once() {
    let Some(redis) = idem_test_support::redis::RedisServer::start() else {
        return;
    };
    let store = DemoStore::Redis(RedisStore::connect(redis.url()).await.expect("connect"));
    let (with, without) = with_and_without(&options(3, 12), &store).await;
    assert_exactly_once(&with);
    assert!(without.duplicates > 50, "{without:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_three_instances_2000_intents_exactly_once() {
    let Some(cluster) = idem_test_support::redis::RedisCluster::start() else {
        return;
    };
    let store = RedisStore::cluster_builder(cluster.urls())
        .key_prefix("chaos:")
        .connect()
        .await
        .expect("connect");
    let (with, without) = with_and_without(&options(3, 15), &store_of(store)).await;
    assert_exactly_once(&with);
    assert!(without.duplicates > 50, "{without:?}");
    // Replica confirmation on (WAIT 1 replica), an instance redeployed mid-run.
    let store = RedisStore::cluster_builder(cluster.urls())
        .key_prefix("chaos-acks:")
        .replica_acks(1, Duration::from_millis(100))
        .connect()
        .await
        .expect("connect");
    let o = Options {
        restart_after: Some(700),
        ..options(3, 16)
    };
    let r = tokio::time::timeout(
        Duration::from_secs(120),
        run(&o, true, &config(), &store_of(store)),
    )
    .await
    .expect("run finished in time")
    .expect("run");
    assert!(r.restarted, "{r:?}");
    assert_exactly_once(&r);
}

fn store_of(s: RedisStore) -> DemoStore {
    DemoStore::Redis(s)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_instance_restarted_mid_run_still_exactly_once() {
    let Some(redis) = idem_test_support::redis::RedisServer::start() else {
        return;
    };
    let store = DemoStore::Redis(RedisStore::connect(redis.url()).await.expect("connect"));
    let o = Options {
        restart_after: Some(700),
        ..options(3, 13)
    };
    let r = tokio::time::timeout(Duration::from_secs(120), run(&o, true, &config(), &store))
        .await
        .expect("run finished in time")
        .expect("run");
    assert!(r.restarted, "instance 0 was killed and restarted: {r:?}");
    // Every intent that got an OK has exactly one order; none has two.
    assert_eq!(r.duplicates, 0, "{r:?}");
    assert_eq!(r.ok_without_order, 0, "{r:?}");
    // Application retries with the same key ride over the restart.
    assert_eq!(r.failed, 0, "{r:?}");
    assert_eq!(r.orders, r.intents as u64, "{r:?}");
}
