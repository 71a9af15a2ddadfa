//! Chaos through real sockets on Redis Cluster: every node behind its own TCP fault
//! proxy (`idem_demo::netfaults::ProxiedCluster`), each node announcing its proxy's port,
//! so the instances' cluster client reaches the nodes (and follows `MOVED`) only through
//! the proxies; replication follows the announced ports too, the cluster bus does not.
//! Asserted through the history checker: each intent created exactly one order, every OK
//! named it, no OK named another intent's order.
//!
//! - the demo's workload on three instances with every proxy (client to instance, and
//!   instances to each node) on a seeded schedule of partitions, latency spikes, resets,
//!   half-open peers and drips;
//! - a master partitioned from everyone (through its proxy, both ways, connections kept
//!   open) while its replica takes its slots over (`CLUSTER FAILOVER FORCE`; the bus
//!   still connects them), with replica confirmation (`replicaAcks: 1`), healed 1.5 s
//!   after the replica is master (shorter than the lease): the writes sent to the old
//!   master never run a handler twice and no intent is lost. Not tested here: the
//!   partition held past the lease. redis-rs alone keeps sending the old master's slots
//!   to it while it stops answering (a response timeout is retried on the same node, no
//!   slot refresh); the store now rebuilds its cluster connection after a timeout and
//!   follows the failover within seconds (`tests/cluster_follows_failover.rs`), but a
//!   run cut off past its lease is still taken over (a second run, as after a crash).
//!
//! What is asserted holds whatever the timing: a loaded machine changes which calls a
//! fault hits, not whether an intent runs twice. Every wait is bounded.

use std::time::{Duration, Instant};

use idem::core::config::ServiceConfig;
use idem::redis::RedisStore;
use idem_demo::netfaults::{Direction, NetFault, ProxiedCluster, ScheduleSpec};
use idem_demo::{DEFAULT_CONFIG, DemoStore, Options, RunReport, run};
use idem_test_support::redis::{ClusterNode, RedisCluster};

fn options(cluster: &ProxiedCluster, intents: usize, seed: u64) -> Options {
    Options {
        intents,
        concurrency: 32,
        unavailable: 0.05,
        drop: 0.05,
        seed,
        // Generous: a caller whose calls hit a cut-off node tries again, as many times
        // as a loaded machine may need.
        app_retries: 30,
        instances: 3,
        progress: false,
        redis: Some(cluster.seeds()),
        store_proxies: cluster.proxies().to_vec(),
        ..Options::default()
    }
}

fn assert_exactly_once(r: &RunReport) {
    let verdict = r.verdict.as_ref().expect("the history was checked");
    assert!(verdict.is_exactly_once(), "{verdict}\n{r:?}");
    assert_eq!(r.orders, r.intents as u64, "{r:?}");
}

/// Every master's proxy carried the store's traffic: the instances reached the nodes
/// through the proxies only (they know no other address).
fn assert_masters_proxied(cluster: &ProxiedCluster) {
    for m in cluster.cluster().masters() {
        let stats = cluster.proxy_of(m.port).stats();
        assert!(
            stats.upstream > 0 && stats.downstream > 0,
            "master {} was reached around its proxy: {stats:?}",
            m.port
        );
    }
}

/// Three instances on one Redis Cluster, each node behind a proxy on a seeded schedule
/// (partitions 0.1 to 2 s, shorter than the 10 s lease), the client's way to each
/// instance proxied too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_three_instances_through_network_faults_exactly_once() {
    let Some(cluster) = ProxiedCluster::start().await else {
        return;
    };
    let config = ServiceConfig::from_json(DEFAULT_CONFIG).unwrap();
    let spec = ScheduleSpec::new(41, Duration::from_millis(100)..Duration::from_secs(2));
    let o = Options {
        net_faults: Some(spec),
        ..options(&cluster, 300, 41)
    };
    let seeds = cluster.seeds();
    let store = RedisStore::cluster_builder(seeds.split(','))
        .connect()
        .await
        .expect("connect through the proxies");
    let r = tokio::time::timeout(
        Duration::from_secs(240),
        run(&o, true, &config, &DemoStore::Redis(store)),
    )
    .await
    .expect("the run finished in time")
    .expect("the run");
    assert_exactly_once(&r);
    let faults = r.net_faults.as_ref().expect("net faults ran");
    assert!(faults.total() > 0, "the proxies applied faults: {r:?}");
    assert_masters_proxied(&cluster);
    eprintln!("{}: {faults}; {}", r.label, r.verdict.as_ref().unwrap());
}

/// Polls `ready` (a blocking look at the nodes) every 50 ms until it holds; panics
/// naming `what` after `limit`.
async fn wait_for(what: &str, limit: Duration, ready: impl Fn() -> bool) {
    let started = Instant::now();
    while !tokio::task::block_in_place(&ready) {
        assert!(started.elapsed() < limit, "{what} within {limit:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The cluster as each node sees it, and what each proxy did: said when a run hangs.
fn state(cluster: &ProxiedCluster) -> String {
    let nodes = cluster.cluster();
    let mut out = String::new();
    for port in nodes.ports() {
        let ask = |args: &[&str]| nodes.cmd(port, args).map_or_else(|e| e, |r| r.text());
        out += &format!(
            "\n--- node {port} (proxy {:?}):\n{}\n{}",
            cluster.proxy_of(port).stats(),
            ask(&["CLUSTER", "NODES"]),
            ask(&["INFO", "replication"]),
        );
    }
    out
}

fn is_master(cluster: &RedisCluster, node: &ClusterNode) -> bool {
    cluster
        .masters()
        .iter()
        .any(|m| m.id == node.id && !m.slots.is_empty())
}

/// A master is partitioned from every client and from its replica's data stream (its
/// proxy drops both ways, connections kept open) while the run's calls are reaching it;
/// its replica then takes its slots over (`CLUSTER FAILOVER FORCE`: the partition keeps
/// it from catching up, and the bus, not proxied, carries the votes); once the replica
/// is master the partition heals: the old master rejoins as its replica, and the
/// connections that lost bytes to the partition are reset. With replica confirmation,
/// what the old master acknowledged its replica had: no handler runs twice, no intent
/// is lost. The partition lasts a few seconds, shorter than the lease (see below).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_master_partitioned_during_a_failover_exactly_once() {
    let Some(cluster) = ProxiedCluster::start().await else {
        return;
    };
    let config = ServiceConfig::from_json(DEFAULT_CONFIG).unwrap();
    let o = options(&cluster, 1500, 42);
    let seeds = cluster.seeds();
    let store = RedisStore::cluster_builder(seeds.split(','))
        .replica_acks(1, Duration::from_millis(100))
        .connect()
        .await
        .expect("connect through the proxies");
    let nodes = cluster.cluster();
    let victim = nodes.masters().remove(0);
    let replica = nodes.replica_of(&victim.id);
    let proxy = cluster.proxy_of(victim.port).clone();
    let workload = {
        let (o, config) = (o.clone(), config.clone());
        tokio::spawn(async move { run(&o, true, &config, &DemoStore::Redis(store)).await })
    };
    // The run's calls are reaching the victim: partition it mid-stream.
    let reached = proxy.stats().upstream + 20_000;
    wait_for(
        "the run reached the victim",
        Duration::from_secs(60),
        || proxy.stats().upstream > reached,
    )
    .await;
    proxy.set(Some(NetFault::Partition(Direction::Both)));
    // Writes (and replication) were sent into the partition and lost.
    let dropped = proxy.stats().dropped;
    wait_for(
        "bytes dropped by the partition",
        Duration::from_secs(30),
        || proxy.stats().dropped > dropped,
    )
    .await;
    tokio::task::block_in_place(|| {
        let reply = nodes.cmd(replica.port, &["CLUSTER", "FAILOVER", "FORCE"]);
        assert!(
            matches!(&reply, Ok(r) if r.text() == "OK"),
            "CLUSTER FAILOVER FORCE on {}: {reply:?}",
            replica.port
        );
    });
    wait_for(
        "the replica took the slots over",
        Duration::from_secs(30),
        || is_master(nodes, &replica) && !is_master(nodes, &victim),
    )
    .await;
    // Held a while after the failover (three command timeouts), so calls stuck on the old
    // master time out and are retried by their callers, but far shorter than the 10 s
    // lease: a run whose writes are cut off longer than its lease is taken over (as
    // after a crash), whichever way the client follows the failover (the store's
    // rebuild after a timeout, `tests/cluster_follows_failover.rs`, or the heal
    // resetting its connection).
    tokio::time::sleep(Duration::from_millis(1500)).await;
    proxy.heal();
    let Ok(r) = tokio::time::timeout(Duration::from_secs(240), workload).await else {
        panic!(
            "the run did not finish in time; {}",
            tokio::task::block_in_place(|| state(&cluster))
        );
    };
    let r = r.expect("the run task").expect("the run");
    assert_exactly_once(&r);
    assert!(
        proxy.stats().dropped > dropped,
        "the partition dropped the victim's traffic"
    );
    assert_masters_proxied(&cluster);
    eprintln!(
        "failover of {} to {} behind a partition ({} bytes dropped): {}; {} attempts, {} app calls, p99 {:?}, {:?}",
        victim.port,
        replica.port,
        proxy.stats().dropped,
        r.verdict.as_ref().unwrap(),
        r.attempts,
        r.app_calls,
        r.p99,
        r.elapsed,
    );
}
