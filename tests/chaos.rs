//! Chaos: the demo's workload, seeded and bounded, through the fault injector.
//!
//! Every intent must take effect exactly once with idem: on the in-memory store, on
//! Redis shared by three instances, and when an instance is killed and restarted
//! mid-run. The run without idem must show duplicates (the faults are real).

use idem_test_support::demo as harness;

use std::time::Duration;

use harness::{DEFAULT_CONFIG, Options, RunReport, Store, run};
use idem::core::ServiceConfig;
use idem::redis::RedisStore;
use idem::store::MemoryStore;

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

async fn with_and_without(o: &Options, store: &Store) -> (RunReport, RunReport) {
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
    let store = Store::Memory(MemoryStore::default());
    let (with, without) = with_and_without(&options(1, 11), &store).await;
    assert_exactly_once(&with);
    assert!(
        without.duplicates > 50,
        "10% lost responses must duplicate orders without idem: {without:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_three_instances_2000_intents_exactly_once() {
    let Some(redis) = idem_test_support::redis::RedisServer::start() else {
        return;
    };
    let store = Store::Redis(RedisStore::connect(redis.url()).await.expect("connect"));
    let (with, without) = with_and_without(&options(3, 12), &store).await;
    assert_exactly_once(&with);
    assert!(without.duplicates > 50, "{without:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_instance_restarted_mid_run_still_exactly_once() {
    let Some(redis) = idem_test_support::redis::RedisServer::start() else {
        return;
    };
    let store = Store::Redis(RedisStore::connect(redis.url()).await.expect("connect"));
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
