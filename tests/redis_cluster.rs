//! Three tonic server instances sharing a Redis Cluster through
//! `RedisStore::cluster_builder`: each instance its own `IdempotencyLayer` and its own
//! cluster connection, like three processes; the clusters are private (3 masters, 3
//! replicas, `idem_test_support::redis::RedisCluster`).
//!
//! - 500 keys spread over every slot range, each called at once on all three instances
//!   → one execution per key, identical responses;
//! - a master SIGKILLed mid-run while cut off from its replica, restarted once the
//!   replica is promoted, as a supervisor would: calls on its slots fail closed (UNAVAILABLE)
//!   during the failover, then recover. Without replica confirmation the promoted
//!   replica has lost writes and retries run handlers a second time; with it
//!   (`replicaAcks: 1`) no handler runs twice. The failover window and the double
//!   executions are printed (`--nocapture`);
//! - slots migrated between masters mid-run (`redis-cli --cluster reshard`, `ASK` and
//!   `MOVED` on the way) → no handler runs twice.
//!
//! Real time throughout (other processes are involved); every wait is bounded.

use idem_test_support::net;
use idem_test_support::shop;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idem_core::config::ServiceConfig;
use idem_redis::RedisStore;
use idem_server::idempotency::{IdempotencyLayer, scope_for};
use idem_test_support::redis::RedisCluster;
use idem_test_support::shop_fake::keyed_create;
use rand::{Rng, SeedableRng};
use shop::orders_client::OrdersClient;
use shop::orders_server::OrdersServer;
use shop::{CreateOrderRequest, Order};
use tokio::sync::oneshot;
use tonic::transport::Channel;
use tonic::{Code, Request, Response};

const TENANT: &str = "cluster-e2e";
const CREATE: &str = "/shop.v1.Orders/CreateOrder";

fn config() -> ServiceConfig {
    ServiceConfig::from_json(&format!(
        r#"{{
  "methodConfig": [{{
    "name": [{{"service": "shop.v1.Orders", "method": "CreateOrder"}}],
    "idempotency": {{"leaseTtl": "10s"}}
  }}],
  "idem": {{"tenant": {{"single": "{TENANT}"}}}}
}}"#
    ))
    .expect("valid config")
}

/// Handler runs per key (the request's note carries the key).
type Runs = Arc<Mutex<HashMap<String, u32>>>;

#[derive(Clone)]
struct Shop {
    runs: Runs,
    delay: Duration,
}

idem_test_support::create_only_orders! {
    Shop, why = "not in these tests";
    create_order(&self, req) {
        let r = req.into_inner();
        let n = {
            let mut runs = self.runs.lock().unwrap_or_else(|p| p.into_inner());
            let n = runs.entry(r.note.clone()).or_default();
            *n += 1;
            *n
        };
        if !self.delay.is_zero() {
            tokio::time::sleep(self.delay).await;
        }
        Ok(Response::new(Order {
            order_id: format!("{}-run{n}-{}", r.note, rand::random::<u32>()),
            customer_id: r.customer_id,
            sku: r.sku,
            quantity: r.quantity,
            created_by: String::new(),
        }))
    }
}

/// Three instances on one cluster, each with its own store connection.
struct Instances {
    clients: Vec<OrdersClient<Channel>>,
    store: RedisStore,
    runs: Runs,
    _stops: Vec<oneshot::Sender<()>>,
}

impl Instances {
    async fn start(
        cluster: &RedisCluster,
        prefix: &str,
        replica_acks: bool,
        delay: Duration,
    ) -> Instances {
        let config = config();
        let runs = Runs::default();
        let mut clients = Vec::new();
        let mut stops = Vec::new();
        let mut first = None;
        for _ in 0..3 {
            let mut b = RedisStore::cluster_builder(cluster.urls())
                .key_prefix(prefix)
                .command_timeout(Duration::from_millis(500))
                .connect_timeout(Duration::from_secs(1));
            if replica_acks {
                b = b.replica_acks(1, Duration::from_millis(100));
            }
            let store = b.connect().await.expect("connect to the test cluster");
            first.get_or_insert_with(|| store.clone());
            let (addr, stop) = serve(store, &config, runs.clone(), delay).await;
            clients.push(OrdersClient::new(net::channel(addr)));
            stops.push(stop);
        }
        Instances {
            clients,
            store: first.expect("three stores"),
            runs,
            _stops: stops,
        }
    }

    /// Keys whose handler ran more than once, with their run counts.
    fn doubles(&self) -> Vec<(String, u32)> {
        let runs = self.runs.lock().unwrap_or_else(|p| p.into_inner());
        runs.iter()
            .filter(|(_, n)| **n > 1)
            .map(|(k, n)| (k.clone(), *n))
            .collect()
    }

    fn runs_of(&self, key: &str) -> u32 {
        let runs = self.runs.lock().unwrap_or_else(|p| p.into_inner());
        runs.get(key).copied().unwrap_or(0)
    }

    /// The record key of an idempotency key, as the store names it.
    fn record_key(&self, key: &str) -> String {
        self.store.key_for(&scope_for(TENANT, CREATE, key))
    }
}

async fn serve(
    store: RedisStore,
    config: &ServiceConfig,
    runs: Runs,
    delay: Duration,
) -> (SocketAddr, oneshot::Sender<()>) {
    let layer = IdempotencyLayer::new(store, config);
    let (addr, incoming) = net::bind().await;
    let (stop, stopped) = oneshot::channel::<()>();
    let router = tonic::transport::Server::builder()
        .layer(layer)
        .add_service(OrdersServer::new(Shop { runs, delay }));
    tokio::spawn(async move {
        router
            .serve_with_incoming_shutdown(incoming, async {
                let _ = stopped.await;
            })
            .await
    });
    (addr, stop)
}

fn order_request(key: &str, deadline: Duration) -> Request<CreateOrderRequest> {
    keyed_create(key, key, deadline)
}

fn new_key(i: usize) -> String {
    format!("k{i:05}x{:024x}", rand::random::<u128>() >> 32)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_hundred_keys_over_every_slot_each_called_on_three_instances_run_once() {
    let Some(cluster) = RedisCluster::shared() else {
        return;
    };
    let inst = Instances::start(cluster, "spread:", false, Duration::from_millis(20)).await;
    let keys: Vec<String> = (0..500).map(new_key).collect();
    let mut calls = Vec::new();
    for key in &keys {
        for client in &inst.clients {
            let mut client = client.clone();
            let req = order_request(key, Duration::from_secs(30));
            let key = key.clone();
            calls.push(tokio::spawn(async move {
                (key, client.create_order(req).await)
            }));
        }
    }
    let mut answers: HashMap<String, Vec<Order>> = HashMap::new();
    for call in calls {
        let (key, r) = call.await.expect("task");
        let order = r
            .unwrap_or_else(|s| panic!("call for {key}: {s:?}"))
            .into_inner();
        answers.entry(key).or_default().push(order);
    }
    for key in &keys {
        assert_eq!(inst.runs_of(key), 1, "{key}: exactly one execution");
        let a = &answers[key];
        assert!(
            a.len() == 3 && a.iter().all(|o| *o == a[0]),
            "{key}: three identical answers"
        );
    }
    // The records live on every master.
    let mut per_master: HashMap<u16, usize> = HashMap::new();
    for key in &keys {
        let slot = cluster.slot_of(&inst.record_key(key));
        *per_master
            .entry(cluster.master_of_slot(slot).port)
            .or_default() += 1;
    }
    assert_eq!(per_master.len(), RedisCluster::MASTERS, "{per_master:?}");
    assert!(per_master.values().all(|n| *n > 100), "{per_master:?}");
}

/// What a load run saw.
#[derive(Debug, Default)]
struct Load {
    intents: usize,
    ok: usize,
    /// Failed attempts by code, and when (since the load began).
    failures: Vec<(Duration, Code)>,
    /// Intents whose OK the client "lost" and asked again for later.
    asked_again: usize,
    elapsed: Duration,
}

impl Load {
    fn unavailable(&self) -> usize {
        self.failures
            .iter()
            .filter(|(_, c)| *c == Code::Unavailable)
            .count()
    }
    /// From `from` (since the load began) to the last UNAVAILABLE (a duplicate that
    /// waited out its deadline for an in-flight record is not the store failing).
    fn failing_window_after(&self, from: Duration) -> Duration {
        self.failures
            .iter()
            .filter(|(_, c)| *c == Code::Unavailable)
            .map(|(t, _)| *t)
            .filter(|t| *t >= from)
            .max()
            .map_or(Duration::ZERO, |t| t - from)
    }
}

/// `intents` keys at `concurrency`; each intent retries failures every 25 ms (same key)
/// until it gets an OK, and for `drop` of them the client acts as if that OK was lost:
/// it asks again 1.5 to 3 s later, in a task of its own (a replay, unless the record was
/// lost meanwhile). `done` counts the intents that got their first OK.
async fn load(
    inst: &Instances,
    intents: usize,
    concurrency: usize,
    drop: f64,
    seed: u64,
    done: Arc<std::sync::atomic::AtomicUsize>,
) -> Load {
    let started = Instant::now();
    let report = Arc::new(Mutex::new(Load {
        intents,
        ..Load::default()
    }));
    let later = Arc::new(Mutex::new(Vec::new()));
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut workers = Vec::new();
    for w in 0..concurrency {
        let clients = inst.clients.clone();
        let report = report.clone();
        let later = later.clone();
        let next = next.clone();
        let done = done.clone();
        workers.push(tokio::spawn(async move {
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed + w as u64);
            loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if i >= intents {
                    return;
                }
                let key = new_key(i);
                until_ok(&clients, i, &key, &report, started).await;
                done.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if rng.random_bool(drop) {
                    report.lock().unwrap().asked_again += 1;
                    let wait = Duration::from_millis(rng.random_range(1500..3000));
                    let (clients, report) = (clients.clone(), report.clone());
                    later.lock().unwrap().push(tokio::spawn(async move {
                        tokio::time::sleep(wait).await;
                        until_ok(&clients, i + 1, &key, &report, started).await;
                    }));
                }
                report.lock().unwrap().ok += 1;
            }
        }));
    }
    for w in workers {
        w.await.expect("load worker");
    }
    let later = std::mem::take(&mut *later.lock().unwrap());
    for t in later {
        t.await.expect("asked again");
    }
    let mut r = std::mem::take(&mut *report.lock().unwrap());
    r.elapsed = started.elapsed();
    r
}

/// Calls until an OK (40 s at most), each failure noted and followed by 25 ms.
async fn until_ok(
    clients: &[OrdersClient<Channel>],
    first: usize,
    key: &str,
    report: &Mutex<Load>,
    started: Instant,
) {
    let give_up = Instant::now() + Duration::from_secs(40);
    for attempt in 0.. {
        assert!(Instant::now() < give_up, "intent {key} never got an OK");
        let mut client = clients[(first + attempt) % clients.len()].clone();
        match client
            .create_order(order_request(key, Duration::from_secs(5)))
            .await
        {
            Ok(_) => return,
            Err(s) => {
                report
                    .lock()
                    .unwrap()
                    .failures
                    .push((started.elapsed(), s.code()));
                tokio::time::sleep(Duration::from_millis(25)).await;
            }
        }
    }
}

/// What one failover run measured.
#[derive(Debug)]
struct Failover {
    load: Load,
    /// From the SIGKILL to the replica's promotion (as `CLUSTER NODES` shows it).
    promoted_after: Duration,
    /// From the SIGKILL to the last UNAVAILABLE.
    window: Duration,
    /// Failed attempts before the SIGKILL (the cut replica, with confirmation).
    failed_before_kill: usize,
    doubles: Vec<(String, u32)>,
}

/// One load over a fresh prefix. When 500 of the 1,500 intents are done, the master of
/// slot 0 is cut off from its replica (`cut_replication`: its acknowledged writes stop
/// reaching it); 300 intents later (or after 3 s) the master is SIGKILLed, so the replica it fails over to lacks its last writes. Once
/// the replica is promoted, the killed node is started again (it rejoins as the new
/// master's replica, as under a supervisor; started before the promotion, an empty
/// master would take its slots back and wipe its replica, since these nodes keep no
/// data on disk). Waits for the cluster to be healthy again before returning.
async fn failover_run(cluster: &mut RedisCluster, replica_acks: bool, seed: u64) -> Failover {
    let prefix = format!("failover-{replica_acks}:");
    let inst = Instances::start(cluster, &prefix, replica_acks, Duration::ZERO).await;
    let (victim, replica) = tokio::task::block_in_place(|| {
        // A loaded host may have failed a master over since the last check: the
        // victim and its replica are read from a settled cluster.
        cluster.wait_healthy(Duration::from_secs(30));
        let victim = cluster.master_of_slot(0);
        let replica = cluster.replica_of(&victim.id);
        (victim, replica)
    });
    let done = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let run = load(&inst, 1500, 32, 0.25, seed, done.clone());
    let reached = |n: usize, limit: Duration| {
        let done = done.clone();
        async move {
            let until = Instant::now() + limit;
            while done.load(std::sync::atomic::Ordering::Relaxed) < n && Instant::now() < until {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    };
    let chaos = async {
        reached(500, Duration::from_secs(30)).await;
        let c: &RedisCluster = cluster;
        tokio::task::block_in_place(|| c.cut_replication(victim.port, replica.port));
        reached(800, Duration::from_secs(3)).await;
        let killed_at = Instant::now();
        cluster.kill(victim.port);
        let limit = killed_at + Duration::from_secs(20);
        while cluster.master_of_slot(0).port != replica.port {
            assert!(Instant::now() < limit, "no failover within 20 s");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let promoted_after = killed_at.elapsed();
        tokio::task::block_in_place(|| cluster.restart(victim.port));
        (killed_at, promoted_after)
    };
    let started = Instant::now();
    let (load, (killed_at, promoted_after)) = tokio::join!(run, chaos);
    let window = load.failing_window_after(killed_at - started);
    let failed_before_kill = load
        .failures
        .iter()
        .filter(|(t, _)| *t < killed_at - started)
        .count();
    let c: &RedisCluster = cluster;
    tokio::task::block_in_place(|| c.wait_healthy(Duration::from_secs(30)));
    Failover {
        doubles: inst.doubles(),
        promoted_after,
        window,
        failed_before_kill,
        load,
    }
}

/// Failover without and with replica confirmation, on one cluster (healthy again
/// between the runs). Printed: the failover window and the double executions of each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn master_killed_mid_run_fails_closed_then_recovers_and_replica_acks_prevent_double_runs() {
    let Some(mut cluster) = RedisCluster::start() else {
        return;
    };
    let without = failover_run(&mut cluster, false, 1).await;
    let with = failover_run(&mut cluster, true, 2).await;
    for (name, r) in [("without replica acks", &without), ("replicaAcks 1", &with)] {
        println!(
            "failover, {name}: {} intents, {} OK, {} asked again later, {} failed attempts \
             ({} UNAVAILABLE, {} before the SIGKILL), replica promoted {:?} after the SIGKILL, \
             UNAVAILABLE until {:?} after the SIGKILL, run {:?}, double executions {} {:?}",
            r.load.intents,
            r.load.ok,
            r.load.asked_again,
            r.load.failures.len(),
            r.load.unavailable(),
            r.failed_before_kill,
            r.promoted_after,
            r.window,
            r.load.elapsed,
            r.doubles.len(),
            &r.doubles[..r.doubles.len().min(5)],
        );
    }
    for r in [&without, &with] {
        // Every intent got its OK once the cluster recovered.
        assert_eq!(r.load.ok, r.load.intents, "{r:?}");
        // The failover was felt, and only as UNAVAILABLE (fail closed).
        assert!(r.load.unavailable() > 0, "{r:?}");
        // Fail closed: UNAVAILABLE, or a duplicate's deadline while it waited for a
        // record whose outcome could not be written yet (tonic answers CANCELLED).
        assert!(
            r.load.failures.iter().all(|(_, c)| matches!(
                c,
                Code::Unavailable | Code::Cancelled | Code::DeadlineExceeded
            )),
            "{r:?}"
        );
        assert!(r.window < Duration::from_secs(20), "{r:?}");
    }
    assert_eq!(
        with.doubles,
        vec![],
        "with replicaAcks 1 no handler ran twice"
    );
    assert!(
        !without.doubles.is_empty(),
        "the cut-off replica lacked acknowledged writes: without confirmation some \
         retries run again (or this test no longer cuts the replica off)"
    );
}

/// 1000 slots move from one master to another and 1000 back while calls run: clients
/// follow `ASK` (keys of a slot being migrated) and `MOVED`; no handler runs twice and
/// every intent gets its OK.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slots_migrated_mid_run_no_double_execution() {
    let Some(cluster) = RedisCluster::start() else {
        return;
    };
    // Without, then with replica confirmation (EVALSHA + WAIT pipelines redirected too).
    for acks in [false, true] {
        reshard_run(&cluster, acks).await;
    }
}

async fn reshard_run(cluster: &RedisCluster, acks: bool) {
    let inst = Instances::start(cluster, &format!("reshard-{acks}:"), acks, Duration::ZERO).await;
    // Each master is named by the highest slot it serves: redis-cli moves a source's
    // lowest slots, so that slot stays with it (or with the replica that took over
    // from it, should a loaded host miss the node timeout).
    let tops: Vec<u16> = cluster
        .masters()
        .iter()
        .filter_map(|n| n.slots.iter().map(|(_, y)| *y).max())
        .collect();
    let (a, b) = (tops[0], tops[1]);
    let slots_of = |slot: u16| -> usize {
        cluster
            .master_of_slot(slot)
            .slots
            .iter()
            .map(|(x, y)| usize::from(y - x) + 1)
            .sum()
    };
    let before = (slots_of(a), slots_of(b));
    let started = Instant::now();
    let run = load(&inst, 3000, 32, 0.25, 3, Arc::default());
    let reshard = async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let t0 = started.elapsed();
        let keys_there = tokio::task::block_in_place(|| cluster.reshard(a, b, 1000));
        let moved = (slots_of(a), slots_of(b));
        let keys_back = tokio::task::block_in_place(|| cluster.reshard(b, a, 1000));
        (t0, started.elapsed(), moved, keys_there + keys_back)
    };
    let (load, (t0, t1, moved, keys_moved)) = tokio::join!(run, reshard);
    println!(
        "resharding (replica acks: {acks}): 2 x 1000 slots moved from {t0:?} to {t1:?} of a \
         {:?} run, {keys_moved} keys migrated; {} intents, {} OK, {} asked again later, \
         {} failed attempts ({} UNAVAILABLE), double executions {}",
        load.elapsed,
        load.intents,
        load.ok,
        load.asked_again,
        load.failures.len(),
        load.unavailable(),
        inst.doubles().len()
    );
    assert_eq!(moved, (before.0 - 1000, before.1 + 1000), "the slots moved");
    assert_eq!((slots_of(a), slots_of(b)), before, "and moved back");
    assert!(t1 < load.elapsed, "the resharding ended while calls ran");
    assert!(
        keys_moved > 50,
        "records (and tenant counts) were migrated under the calls: {keys_moved}"
    );
    assert_eq!(load.ok, load.intents, "{load:?}");
    assert_eq!(inst.doubles(), vec![], "no handler ran twice");
}
