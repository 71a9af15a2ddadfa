//! Several tonic server instances sharing one Redis through `idem_redis::RedisStore`.
//!
//! Each test starts its own `redis-server` (see `idem_test_support::redis`: without the
//! binary the tests print "SKIPPED" and pass, except when `CI` is set, where they fail)
//! and three `Orders` servers on three 127.0.0.1 ports, each with its own
//! `IdempotencyLayer` and its own `RedisStore` connection, like three processes.
//!
//! - one key, 500 concurrent calls spread over the instances → one execution, 500
//!   identical responses;
//! - Redis killed mid-run → protected calls get UNAVAILABLE (`STORE_UNAVAILABLE`) and no
//!   handler runs; restarted on the same port → calls succeed again;
//! - a claimant that crashes (claims, never completes) → after its lease another
//!   instance takes over with a higher fence; the stale fence's completion is refused;
//! - round trips per fresh call and per replay, from `INFO commandstats`;
//! - store-level details: key layout, corrupt records, start-up warnings, `SCRIPT FLUSH`;
//! - a throughput report and a wait-latency comparison of the two wait strategies
//!   (printed, not asserted).
//!
//! These tests use real time (they talk to another process); every wait is bounded.

use idem_test_support::net;
use idem_test_support::shop;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use idem_core::config::ServiceConfig;
use idem_core::headers::reason;
use idem_redis::{RedisStore, WaitStrategy};
use idem_server::idempotency::{IdempotencyLayer, IdempotencyStats, scope_for};
use idem_store::{
    Claim, ClaimRequest, ClaimantId, CompleteRequest, RecordState, Store, StoreError, StoredOutcome,
};
use idem_test_support::redis::RedisServer;
use idem_test_support::shop_fake::keyed_create;
use idem_test_support::store::{acquire, complete_not_retained, req};
use shop::orders_client::OrdersClient;
use shop::orders_server::OrdersServer;
use shop::{CreateOrderRequest, Order};
use tokio::sync::oneshot;
use tonic::transport::Channel;
use tonic::{Code, Request, Response, Status};

const TENANT: &str = "redis-e2e";
const CREATE: &str = "/shop.v1.Orders/CreateOrder";
/// Bound on every "eventually" loop and on each call's deadline.
const PATIENCE: Duration = Duration::from_secs(20);

/// The service config every instance reads, with the Redis URL in `idem.redis`.
fn config_json(redis_url: &str) -> String {
    format!(
        r#"{{
  "methodConfig": [{{
    "name": [{{"service": "shop.v1.Orders", "method": "CreateOrder"}}],
    "idempotency": {{}}
  }}],
  "idem": {{
    "tenant": {{"single": "{TENANT}"}},
    "redis": {{"url": "{redis_url}", "keyPrefix": "e2e:", "commandTimeout": "0.5s", "connectTimeout": "1s"}}
  }}
}}"#
    )
}

/// The `Orders` service: counts its executions, optionally takes its time.
#[derive(Clone)]
struct Shop {
    name: String,
    runs: Arc<AtomicUsize>,
    delay: Duration,
}

idem_test_support::create_only_orders! {
    Shop, why = "not in these tests";
    create_order(&self, req) {
        let n = self.runs.fetch_add(1, Ordering::SeqCst) + 1;
        if !self.delay.is_zero() {
            tokio::time::sleep(self.delay).await;
        }
        let r = req.into_inner();
        Ok(Response::new(Order {
            order_id: format!("order-{n}-{}", rand::random::<u64>()),
            customer_id: r.customer_id,
            sku: r.sku,
            quantity: r.quantity,
            created_by: self.name.clone(),
        }))
    }
}

/// One server instance: its own store connection, layer and port.
struct Instance {
    addr: SocketAddr,
    store: RedisStore,
    stats: IdempotencyStats,
    _stop: oneshot::Sender<()>,
}

/// Three instances sharing one Redis, and the handler-run counter they share.
struct Cluster {
    instances: Vec<Instance>,
    runs: Arc<AtomicUsize>,
    config: ServiceConfig,
    /// A client of each instance, in order.
    clients: Vec<OrdersClient<Channel>>,
}

async fn cluster(redis: &RedisServer, n: usize, delay: Duration) -> Cluster {
    let parsed =
        ServiceConfig::from_json_with_warnings(&config_json(&redis.url())).expect("valid config");
    let config = parsed.config;
    let runs = Arc::new(AtomicUsize::new(0));
    let mut instances = Vec::new();
    for i in 0..n {
        let settings = config.settings().redis.as_ref().expect("idem.redis");
        let store = RedisStore::from_settings(settings)
            .await
            .expect("connect to the test redis");
        let (addr, stats, stop) = serve(store.clone(), &config, i, runs.clone(), delay).await;
        instances.push(Instance {
            addr,
            store,
            stats,
            _stop: stop,
        });
    }
    let clients = instances
        .iter()
        .map(|i| OrdersClient::new(net::channel(i.addr)))
        .collect();
    Cluster {
        instances,
        runs,
        config,
        clients,
    }
}

/// Starts instance `i` with `store`: an `Orders` server behind an `IdempotencyLayer`.
async fn serve<St: Store + std::fmt::Debug>(
    store: St,
    config: &ServiceConfig,
    i: usize,
    runs: Arc<AtomicUsize>,
    delay: Duration,
) -> (SocketAddr, IdempotencyStats, oneshot::Sender<()>) {
    let layer = IdempotencyLayer::new(store, config);
    let stats = layer.stats();
    let shop = Shop {
        name: format!("instance-{i}"),
        runs,
        delay,
    };
    let (addr, incoming) = net::bind().await;
    let (stop, stopped) = oneshot::channel::<()>();
    let router = tonic::transport::Server::builder()
        .layer(layer)
        .add_service(OrdersServer::new(shop));
    tokio::spawn(async move {
        router
            .serve_with_incoming_shutdown(incoming, async {
                let _ = stopped.await;
            })
            .await
    });
    (addr, stats, stop)
}

impl Cluster {
    fn runs(&self) -> usize {
        self.runs.load(Ordering::SeqCst)
    }
}

fn order_request(key: &str, note: &str) -> Request<CreateOrderRequest> {
    keyed_create(key, note, PATIENCE)
}

/// Sends the call with `key` and `note` again through every client: each must replay
/// `order`.
async fn replayed_by_all(clients: &[OrdersClient<Channel>], key: &str, note: &str, order: &Order) {
    for client in clients {
        let again = client
            .clone()
            .create_order(order_request(key, note))
            .await
            .expect("replay");
        assert!(is_replay(&again));
        assert_eq!(&again.into_inner(), order);
    }
}

fn new_key() -> String {
    format!("k{:032x}", rand::random::<u128>())
}

fn is_replay<T>(r: &Response<T>) -> bool {
    idem_client::is_replayed(r)
}

fn idem_reason(s: &Status) -> Option<String> {
    idem_client::idem_reason(s)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_key_500_concurrent_calls_over_three_instances_run_once() {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    // The handler takes a while, so most duplicates arrive while it is in flight.
    let c = cluster(&redis, 3, Duration::from_millis(300)).await;
    let key = new_key();
    let mut calls = Vec::new();
    for i in 0..500 {
        let mut client = c.clients[i % c.clients.len()].clone();
        let req = order_request(&key, "same request");
        calls.push(tokio::spawn(async move { client.create_order(req).await }));
    }
    let mut orders = Vec::new();
    let mut replays = 0;
    for call in calls {
        let resp = call.await.expect("task").expect("every call succeeds");
        replays += usize::from(is_replay(&resp));
        orders.push(resp.into_inner());
    }
    assert_eq!(c.runs(), 1, "exactly one handler execution");
    assert_eq!(orders.len(), 500);
    assert!(
        orders.iter().all(|o| *o == orders[0]),
        "500 identical responses"
    );
    assert_eq!(replays, 499, "all but the executing call are replays");
    // Every instance served some of them, and the others waited across instances.
    for inst in &c.instances {
        let s = inst.stats.snapshot();
        println!("{:?}: {s:?}", inst.addr);
    }
    // One record, completed; nobody took over or released it.
    let scope = scope_for(TENANT, CREATE, &key);
    assert!(matches!(
        c.instances[0].store.get(&scope).await.expect("get"),
        Some(RecordState::Completed { .. })
    ));
    let stored: u64 = c.instances.iter().map(|i| i.stats.snapshot().stored).sum();
    let released: u64 = c
        .instances
        .iter()
        .map(|i| i.stats.snapshot().released)
        .sum();
    assert_eq!((stored, released), (1, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_down_fails_closed_and_recovers_after_restart() {
    let Some(mut redis) = RedisServer::start() else {
        return;
    };
    let c = cluster(&redis, 3, Duration::from_millis(5)).await;

    // Load running while Redis is killed: every call ends OK or UNAVAILABLE.
    let stop_load = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut load = Vec::new();
    for (i, client) in c.clients.iter().enumerate() {
        let mut client = client.clone();
        let stop = stop_load.clone();
        load.push(tokio::spawn(async move {
            let (mut ok, mut unavailable) = (0usize, 0usize);
            while !stop.load(Ordering::SeqCst) {
                match client
                    .create_order(order_request(&new_key(), &format!("load {i}")))
                    .await
                {
                    Ok(_) => ok += 1,
                    Err(s) if s.code() == Code::Unavailable => unavailable += 1,
                    Err(s) => panic!("unexpected status during the outage: {s:?}"),
                }
            }
            (ok, unavailable)
        }));
    }
    // Let the load get going, then kill Redis under it.
    let start = Instant::now();
    while c.runs() < 30 {
        assert!(start.elapsed() < PATIENCE, "load did not start");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    redis.stop();
    // Long enough for the calls in flight to get their answer (their completion waits up
    // to one command timeout, 500 ms, before the caller is answered and the completion
    // is retried behind it) and for new calls to meet the dead store.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    stop_load.store(true, Ordering::SeqCst);
    let (mut ok, mut unavailable) = (0, 0);
    for l in load {
        let (o, u) = l.await.expect("load task");
        ok += o;
        unavailable += u;
    }
    println!(
        "mid-run: {ok} ok, {unavailable} unavailable, {} handler runs",
        c.runs()
    );
    assert!(
        ok > 0 && unavailable > 0,
        "{ok} ok, {unavailable} unavailable"
    );
    // No handler ran without a claim: at most one run per successful claim, and every OK
    // answer came from a run (fresh keys, so no replays).
    assert!(c.runs() >= ok, "{} runs < {ok} ok", c.runs());

    // Redis is down: protected calls fail closed and no handler runs.
    let runs_before = c.runs();
    for (i, client) in c.clients.iter().enumerate() {
        for _ in 0..5 {
            let err = client
                .clone()
                .create_order(order_request(&new_key(), &format!("down {i}")))
                .await
                .expect_err("redis is down");
            assert_eq!(err.code(), Code::Unavailable, "{err:?}");
            assert_eq!(
                idem_reason(&err).as_deref(),
                Some(reason::STORE_UNAVAILABLE),
                "{err:?}"
            );
        }
    }
    assert_eq!(c.runs(), runs_before, "no handler ran while redis was down");

    // Same port again: every instance reconnects on its own (the first calls may still
    // fail closed while a connection is re-established).
    redis.restart();
    for (i, client) in c.clients.iter().enumerate() {
        let start = Instant::now();
        loop {
            match client
                .clone()
                .create_order(order_request(&new_key(), &format!("after {i}")))
                .await
            {
                Ok(_) => break,
                Err(s) if s.code() == Code::Unavailable && start.elapsed() < PATIENCE => {
                    tokio::time::sleep(Duration::from_millis(50)).await
                }
                Err(s) => panic!("instance {i} did not recover: {s:?}"),
            }
        }
    }
    // And idempotency works across instances again.
    let key = new_key();
    let first = c.clients[0]
        .clone()
        .create_order(order_request(&key, "after restart"))
        .await
        .expect("fresh call after restart")
        .into_inner();
    let runs = c.runs();
    replayed_by_all(&c.clients, &key, "after restart", &first).await;
    assert_eq!(c.runs(), runs);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn crashed_claimant_is_taken_over_with_a_higher_fence() {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    let c = cluster(&redis, 3, Duration::ZERO).await;
    let store = &c.instances[0].store;

    // Learn the request's fingerprint from a completed record of another key.
    let probe = new_key();
    c.clients[0]
        .clone()
        .create_order(order_request(&probe, "crash"))
        .await
        .expect("probe call");
    let fingerprint = match store.get(&scope_for(TENANT, CREATE, &probe)).await.unwrap() {
        Some(RecordState::Completed { fingerprint, .. }) => fingerprint,
        other => panic!("{other:?}"),
    };

    // "Instance 0" claims the key and dies: no renew, no complete, no release.
    let key = new_key();
    let scope = scope_for(TENANT, CREATE, &key);
    let lease = Duration::from_millis(400);
    let crashed = match store
        .claim(ClaimRequest {
            scope: &scope,
            tenant: &idem_store::TenantId::default(),
            fingerprint: &fingerprint,
            claimant: ClaimantId::random(),
            lease,
        })
        .await
        .unwrap()
    {
        Claim::Acquired { fence, .. } => fence,
        other => panic!("{other:?}"),
    };
    let runs = c.runs();
    let claimed_at = Instant::now();

    // The retry lands on instance 1: it waits out the lease and takes the record over,
    // but a waiting duplicate keeps only the fingerprint (issue 30 item 3): it gives the
    // record back and answers UNAVAILABLE (IN_PROGRESS_ENDED) with a short retry delay.
    let waited = c.clients[1]
        .clone()
        .create_order(order_request(&key, "crash"))
        .await
        .expect_err("a waiter does not run");
    assert_eq!(waited.code(), Code::Unavailable, "{waited:?}");
    let info = tonic_types::StatusExt::get_details_error_info(&waited).expect("ErrorInfo");
    assert_eq!(info.reason, reason::IN_PROGRESS_ENDED);
    assert!(
        claimed_at.elapsed() >= lease - Duration::from_millis(50),
        "answered before the lease ended"
    );
    assert_eq!(c.runs(), runs, "the waiter did not run");
    // Its retry (with the request) runs, under a higher fence.
    let resp = c.clients[1]
        .clone()
        .create_order(order_request(&key, "crash"))
        .await
        .expect("run after the takeover");
    assert!(!is_replay(&resp));
    assert_eq!(c.runs(), runs + 1);
    let order = resp.into_inner();
    assert_eq!(order.created_by, "instance-1");
    let current = match store.get(&scope).await.unwrap() {
        Some(RecordState::Completed { fence, .. }) => fence,
        other => panic!("{other:?}"),
    };
    assert!(current > crashed, "{current} > {crashed}");

    // The crashed claimant wakes up and tries to finish: refused.
    let late = store
        .complete(CompleteRequest {
            scope: &scope,
            fence: crashed,
            outcome: StoredOutcome::Response(bytes::Bytes::from_static(b"stale")),
            ttl: Duration::from_secs(60),
        })
        .await;
    assert!(
        matches!(late, Err(StoreError::Fenced { presented, current: Some(cur) }) if presented == crashed && cur == current),
        "{late:?}"
    );
    // Duplicates everywhere replay the taken-over run.
    replayed_by_all(&c.clients, &key, "crash", &order).await;
    assert_eq!(c.runs(), runs + 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn round_trips_per_fresh_call_and_per_replay() {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    let c = cluster(&redis, 3, Duration::ZERO).await;
    const N: usize = 60;
    let keys: Vec<String> = (0..N).map(|_| new_key()).collect();

    redis.reset_stats();
    for (i, key) in keys.iter().enumerate() {
        c.clients[i % 3]
            .clone()
            .create_order(order_request(key, "rt"))
            .await
            .expect("fresh call");
    }
    let fresh = redis.command_calls();
    // Commands the clients sent: the scripts (`EVALSHA`). On one endpoint the per-tenant
    // quota is checked and counted inside the claim and complete scripts, so a fresh
    // call is two round trips: claim, complete. (`INFO commandstats` also counts the
    // commands scripts call, such as the count's `ZADD`/`ZREM`; those are left out.)
    let sent =
        |calls: &std::collections::HashMap<String, u64>| calls.get("evalsha").copied().unwrap_or(0);
    let fresh_total = sent(&fresh);
    assert_eq!(c.runs(), N);

    redis.reset_stats();
    for (i, key) in keys.iter().enumerate() {
        let r = c.clients[(i + 1) % 3]
            .clone()
            .create_order(order_request(key, "rt"))
            .await
            .expect("replay");
        assert!(is_replay(&r));
    }
    let replay = redis.command_calls();
    let replay_total = sent(&replay);
    assert_eq!(c.runs(), N);

    let per = |x: u64| x as f64 / N as f64;
    println!(
        "round trips: fresh call {:.2} commands ({:?}), replay {:.2} ({:?})",
        per(fresh_total),
        fresh,
        per(replay_total),
        replay
    );
    assert_eq!(
        fresh.get("evalsha").copied(),
        Some(2 * N as u64),
        "fresh: claim (with the tenant's quota) + complete: {fresh:?}"
    );
    assert_eq!(
        fresh.get("zadd").copied(),
        Some(N as u64),
        "fresh: each claim counted in its tenant's set, inside the script: {fresh:?}"
    );
    assert_eq!(
        fresh.get("zrem").copied(),
        Some(N as u64),
        "fresh: each completion taken out of the count, inside the script: {fresh:?}"
    );
    assert_eq!(replay.get("evalsha").copied(), Some(N as u64), "{replay:?}");
    assert_eq!(replay_total, N as u64, "replay: one claim: {replay:?}");
}

/// Throughput of fresh and replayed calls through three instances sharing one Redis,
/// next to a baseline measured in the same run: the same three servers, each with its
/// own `MemoryStore` (replays sent to the instance that ran the call). Printed, not
/// asserted (wall-clock numbers).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn throughput_of_fresh_and_replayed_calls() {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    const CALLS: usize = 3000;
    const CONCURRENCY: usize = 64;

    async fn run(
        clients: &[OrdersClient<Channel>],
        keys: Arc<Vec<String>>,
        shift: usize,
    ) -> (Duration, usize) {
        let next = Arc::new(AtomicUsize::new(0));
        let replays = Arc::new(AtomicUsize::new(0));
        let start = Instant::now();
        let mut workers = Vec::new();
        for _ in 0..CONCURRENCY {
            let clients = clients.to_vec();
            let (next, keys, replays) = (next.clone(), keys.clone(), replays.clone());
            workers.push(tokio::spawn(async move {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(key) = keys.get(i) else { break };
                    // Key i goes to instance (i + shift) mod 3.
                    let r = clients[(i + shift) % clients.len()]
                        .clone()
                        .create_order(order_request(key, "tp"))
                        .await
                        .expect("call");
                    replays.fetch_add(usize::from(is_replay(&r)), Ordering::Relaxed);
                }
            }));
        }
        for w in workers {
            w.await.expect("worker");
        }
        (start.elapsed(), replays.load(Ordering::Relaxed))
    }
    let rate = |d: Duration| CALLS as f64 / d.as_secs_f64();
    let new_keys = || -> Arc<Vec<String>> { Arc::new((0..CALLS).map(|_| new_key()).collect()) };

    // Baseline: in-memory stores, one per instance.
    let (memory_fresh, memory_replay) = {
        let config = ServiceConfig::from_json(&config_json(&redis.url())).expect("valid config");
        let runs = Arc::new(AtomicUsize::new(0));
        let mut clients = Vec::new();
        let mut stops = Vec::new();
        for i in 0..3 {
            let store = idem_store::memory::MemoryStore::new(Default::default());
            let (addr, _, stop) = serve(store, &config, i, runs.clone(), Duration::ZERO).await;
            clients.push(OrdersClient::new(net::channel(addr)));
            stops.push(stop);
        }
        let keys = new_keys();
        let (fresh, fresh_replays) = run(&clients, keys.clone(), 0).await;
        let (replay, replays) = run(&clients, keys, 0).await;
        assert_eq!((fresh_replays, replays), (0, CALLS));
        assert_eq!(runs.load(Ordering::SeqCst), CALLS);
        (rate(fresh), rate(replay))
    };

    let c = cluster(&redis, 3, Duration::ZERO).await;
    let keys = new_keys();
    let (fresh, fresh_replays) = run(&c.clients, keys.clone(), 0).await;
    // Replays on another instance than the one that ran the call.
    let (replay, replays) = run(&c.clients, keys, 1).await;
    assert_eq!(fresh_replays, 0);
    assert_eq!(replays, CALLS);
    assert_eq!(c.runs(), CALLS);
    let (fresh, replay) = (rate(fresh), rate(replay));
    println!(
        "throughput ({CALLS} calls, {CONCURRENCY} concurrent, 3 instances, {} build): \
         redis fresh {fresh:.0} calls/s, replay {replay:.0} calls/s; \
         memory baseline fresh {memory_fresh:.0}, replay {memory_replay:.0}; \
         redis/memory fresh {:.2}, replay {:.2}",
        if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        },
        fresh / memory_fresh,
        replay / memory_replay,
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_are_one_hash_per_record_named_by_the_scope_digest() {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    let c = cluster(&redis, 1, Duration::ZERO).await;
    let key = "raw-client-key-123";
    c.clients[0]
        .clone()
        .create_order(order_request(key, "layout"))
        .await
        .expect("call");
    let keys = redis.cmd(&["KEYS", "*"]).expect("KEYS").text();
    let scope = scope_for(TENANT, CREATE, key);
    assert_eq!(
        keys,
        format!("e2e:{{{}}}", scope.to_hex()),
        "one key per record"
    );
    assert!(!keys.contains(key), "raw client input never in a key name");
    assert_eq!(c.instances[0].store.key_for(&scope), keys);
    assert_eq!(redis.cmd(&["TYPE", &keys]).unwrap().text(), "hash");
    let ttl = redis.pttl(&keys);
    let record_ttl = c
        .config
        .lookup("shop.v1.Orders", "CreateOrder")
        .and_then(|m| m.idempotency())
        .map(|p| p.record_ttl)
        .unwrap();
    assert!(ttl > 0 && ttl as u128 <= record_ttl.as_millis(), "{ttl}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_records_are_corrupt_not_panics() {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    let store = RedisStore::connect(redis.url()).await.expect("connect");
    let fp = idem_store::Fingerprint([7; 32]);
    let claim = |scope| ClaimRequest {
        scope,
        tenant: &idem_store::TenantId([0; 16]),
        fingerprint: &fp,
        claimant: ClaimantId::random(),
        lease: Duration::from_secs(5),
    };
    let plant = |scope: &idem_store::Scope, fields: &[&[u8]]| {
        let key = store.key_for(scope);
        let mut args: Vec<&[u8]> = vec![b"HSET", key.as_bytes()];
        args.extend_from_slice(fields);
        redis.cmd_bytes(&args).expect("HSET");
    };
    // Not a hash at all.
    let s1 = idem_store::Scope([1; 32]);
    redis
        .cmd(&["SET", &store.key_for(&s1), "garbage"])
        .expect("SET");
    // A hash with an unknown state, one without a fence, one with a bad outcome kind,
    // one in flight without a lease.
    let s2 = idem_store::Scope([2; 32]);
    plant(&s2, &[b"s", b"x", b"f", b"1"]);
    let s3 = idem_store::Scope([3; 32]);
    plant(&s3, &[b"s", b"c"]);
    let s4 = idem_store::Scope([4; 32]);
    plant(
        &s4,
        &[
            b"s", b"c", b"f", b"2", b"fp", &[7; 32], b"k", b"?", b"o", b"",
        ],
    );
    let s5 = idem_store::Scope([5; 32]);
    plant(&s5, &[b"s", b"i", b"f", b"2", b"fp", &[7; 32], b"c", b"00"]);
    for s in [&s1, &s2, &s3, &s4, &s5] {
        let r = store.claim(claim(s)).await;
        assert!(matches!(r, Err(StoreError::Corrupt(_))), "{s:?}: {r:?}");
    }
    for s in [&s1, &s3] {
        let r = store.get(s).await;
        assert!(matches!(r, Err(StoreError::Corrupt(_))), "{s:?}: {r:?}");
        let r = store.renew(s, 1, Duration::from_secs(1)).await;
        assert!(matches!(r, Err(StoreError::Corrupt(_))), "{s:?}: {r:?}");
    }
    // A fingerprint of the wrong length in a completed record.
    let s6 = idem_store::Scope([6; 32]);
    plant(
        &s6,
        &[
            b"s", b"c", b"f", b"2", b"fp", b"short", b"k", b"r", b"o", b"",
        ],
    );
    assert!(matches!(store.get(&s6).await, Err(StoreError::Corrupt(_))));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scripts_are_reloaded_after_a_script_flush() {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    let store = RedisStore::connect(redis.url()).await.expect("connect");
    let scope = idem_store::Scope(rand::random());
    redis.cmd(&["SCRIPT", "FLUSH"]).expect("SCRIPT FLUSH");
    let r = store.claim(req(&scope, Duration::from_secs(5))).await;
    assert!(matches!(r, Ok(Claim::Acquired { .. })), "{r:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn start_up_check_reports_risky_settings() {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    // The harness runs Redis without persistence; make it evict, too.
    redis.config_set("maxmemory-policy", "allkeys-lru");
    let store = RedisStore::connect(redis.url()).await.expect("connect");
    let report = store.check_server().await.expect("check");
    assert_eq!(report.maxmemory_policy.as_deref(), Some("allkeys-lru"));
    assert!(report.may_evict_records());
    assert!(report.persistence_off());
    assert_eq!(report.warnings.len(), 2, "{:?}", report.warnings);

    redis.config_set("maxmemory-policy", "noeviction");
    redis.config_set("appendonly", "yes");
    let report = store.check_server().await.expect("check");
    assert!(!report.may_evict_records());
    assert!(!report.persistence_off());
    assert!(report.warnings.is_empty(), "{:?}", report.warnings);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commands_time_out_as_unavailable() {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    let store = RedisStore::builder(redis.url())
        .command_timeout(Duration::from_millis(200))
        .connect()
        .await
        .expect("connect");
    // Make the server busy: a client pause blocks every command for 2 s.
    redis
        .cmd(&["CLIENT", "PAUSE", "2000", "ALL"])
        .expect("CLIENT PAUSE");
    let scope = idem_store::Scope(rand::random());
    let r = store.get(&scope).await;
    assert!(matches!(r, Err(StoreError::Unavailable(_))), "{r:?}");
    redis.cmd(&["CLIENT", "UNPAUSE"]).expect("CLIENT UNPAUSE");
    let start = Instant::now();
    loop {
        match store.get(&scope).await {
            Ok(None) => break,
            r if start.elapsed() > PATIENCE => panic!("{r:?}"),
            _ => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
}

/// `store.wait` for `scope` (for up to [`PATIENCE`]) in a task of its own, which ends
/// with the instant the wait returned.
fn spawn_wait(store: &RedisStore, scope: idem_store::Scope) -> tokio::task::JoinHandle<Instant> {
    let store = store.clone();
    tokio::spawn(async move {
        store
            .wait(&scope, tokio::time::Instant::now() + PATIENCE)
            .await
            .expect("wait");
        Instant::now()
    })
}

/// How late a waiter on another instance learns of a completion, with each
/// [`WaitStrategy`]: printed for the docs' choice, not asserted (wall-clock numbers).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn wait_latency_notify_versus_poll() {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    const ROUNDS: usize = 40;
    for strategy in [WaitStrategy::Poll, WaitStrategy::Notify] {
        let connect = || {
            // No per-tenant quota: this measures waiting, not the count's round trip.
            RedisStore::builder(redis.url())
                .wait_strategy(strategy)
                .max_in_flight_per_tenant(None)
                .connect()
        };
        let (a, b) = (connect().await.expect("a"), connect().await.expect("b"));
        let mut late = Vec::new();
        redis.reset_stats();
        for _ in 0..ROUNDS {
            let scope = idem_store::Scope(rand::random());
            let fence = acquire(&a, &scope, Duration::from_secs(10)).await;
            let waiter = spawn_wait(&b, scope);
            // Complete after 0-300 ms, so the waiter is at a random point of its backoff.
            let pause = Duration::from_millis(rand::random_range(0..300));
            tokio::time::sleep(pause).await;
            a.complete(CompleteRequest {
                scope: &scope,
                fence,
                outcome: StoredOutcome::Response(bytes::Bytes::from_static(b"done")),
                ttl: Duration::from_secs(60),
            })
            .await
            .expect("complete");
            let completed = Instant::now();
            let returned = tokio::time::timeout(PATIENCE, waiter)
                .await
                .expect("wait returned")
                .expect("waiter task");
            late.push(returned.saturating_duration_since(completed));
            // What the waiter's caller does next: claim again, and get the outcome.
            let again = b.claim(req(&scope, Duration::from_secs(10))).await.unwrap();
            assert!(matches!(again, Claim::Completed(_)), "{again:?}");
        }
        let commands = redis.round_trips();
        late.sort();
        let mean = late.iter().sum::<Duration>() / ROUNDS as u32;
        println!(
            "wait {strategy:?}: completion seen {mean:?} late on average (p50 {:?}, p90 {:?}, \
             max {:?}); {:.1} redis commands per waited call (claim + complete + re-claim + \
             wait's reads/subscriptions)",
            late[ROUNDS / 2],
            late[ROUNDS * 9 / 10],
            late[ROUNDS - 1],
            commands as f64 / ROUNDS as f64
        );
    }
}

/// The notification connection is lost while a waiter waits: it falls back to polling
/// and still sees the completion; the next wait subscribes on a fresh connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_survive_a_lost_notification_connection() {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    let a = RedisStore::connect(redis.url()).await.expect("a");
    let b = RedisStore::connect(redis.url()).await.expect("b");
    for round in 0..2 {
        let scope = idem_store::Scope(rand::random());
        let fence = acquire(&a, &scope, Duration::from_secs(30)).await;
        let waiter = spawn_wait(&b, scope);
        // Wait until the waiter is subscribed, then cut every pub/sub connection.
        let start = Instant::now();
        while redis
            .cmd(&["PUBSUB", "NUMSUB", &format!("{}:done", b.key_for(&scope))])
            .expect("PUBSUB NUMSUB")
            .text()
            .ends_with(" 0")
        {
            assert!(
                start.elapsed() < PATIENCE,
                "round {round}: never subscribed"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        if round == 0 {
            let killed = redis
                .cmd(&["CLIENT", "KILL", "TYPE", "pubsub"])
                .expect("CLIENT KILL");
            assert_eq!(killed, idem_test_support::redis::RedisReply::Int(1));
        }
        complete_not_retained(&a, &scope, fence, "complete").await;
        tokio::time::timeout(PATIENCE, waiter)
            .await
            .expect("the waiter saw the completion")
            .expect("waiter task");
    }
}
