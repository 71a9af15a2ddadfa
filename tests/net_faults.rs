//! Chaos through real sockets: the demo's workload with a TCP fault proxy between the
//! client and each instance and between each instance and its store (partitions one way
//! or both, latency spikes, resets after N bytes, peers that stop reading, drips, on a
//! seeded schedule), asserted through the history checker: each intent created exactly
//! one order, every OK named it, no OK named another intent's order.
//!
//! What is asserted holds whatever the timing of the faults: a loaded machine changes
//! which calls a fault hits, not whether an intent runs twice.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use idem::core::config::ServiceConfig;
use idem::core::key::IdempotencyKey;
use idem::postgres::PostgresStore;
use idem::redis::RedisStore;
use idem::server::idempotency::{IdempotencyLayer, tenant::SingleTenant};
use idem::server::inbound::InboundLayer;
use idem_demo::crash::{self, Launch, StoreKind};
use idem_demo::history::History;
use idem_demo::netfaults::{Direction, FaultProxy, NetFault, ScheduleSpec};
use idem_demo::pg_orders;
use idem_demo::{DEFAULT_CONFIG, DemoStore, Options, RunReport, run};
use idem_test_support::postgres::PostgresServer;
use idem_test_support::redis::RedisServer;
use idem_test_support::shop::orders_client::OrdersClient;
use idem_test_support::shop::orders_server::OrdersServer;
use idem_test_support::shop::{CreateOrderRequest, Order};
use tokio::sync::Notify;
use tonic::transport::Server;
use tonic::{Request, Response, Status};

/// Not a test of its own: the entry point of the instance processes of the crash runs
/// (this binary, running only this test, with the instance's arguments in its
/// environment). In a normal run it returns at once.
#[test]
fn instance_process() {
    crash::serve_from_env();
}

/// Faults every 50 to 400 ms on each proxy, partitions and half-open peers lasting
/// `partition`.
fn schedule(seed: u64, partition: std::ops::Range<Duration>) -> ScheduleSpec {
    ScheduleSpec {
        gap: Duration::from_millis(50)..Duration::from_millis(400),
        ..ScheduleSpec::new(seed, partition)
    }
}

fn options(instances: usize, seed: u64, spec: ScheduleSpec) -> Options {
    Options {
        intents: 600,
        concurrency: 32,
        unavailable: 0.05,
        drop: 0.05,
        seed,
        // Generous: a caller whose instance is cut off tries again, as many times as a
        // loaded machine may need.
        app_retries: 30,
        instances,
        progress: false,
        net_faults: Some(spec),
        ..Options::default()
    }
}

fn assert_exactly_once_through_faults(r: &RunReport) {
    let verdict = r.verdict.as_ref().expect("the history was checked");
    assert!(verdict.is_exactly_once(), "{verdict}\n{r:?}");
    assert_eq!(r.orders, r.intents as u64, "{r:?}");
    let faults = r.net_faults.as_ref().expect("net faults ran");
    assert!(faults.total() > 0, "the proxies applied faults: {r:?}");
    eprintln!("{}: {faults}; {verdict}", r.label);
}

/// Redis shared by three instances, each with its own proxied connection; partitions
/// shorter than the 10 s lease: an instance cut off from its store retries its
/// completion until the partition heals, so nothing runs twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_three_instances_through_network_faults_exactly_once() {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    let config = ServiceConfig::from_json(DEFAULT_CONFIG).unwrap();
    let spec = schedule(31, Duration::from_millis(100)..Duration::from_secs(2));
    let o = Options {
        redis: Some(redis.url()),
        ..options(3, 31, spec)
    };
    let store = DemoStore::Redis(RedisStore::connect(redis.url()).await.expect("connect"));
    let r = tokio::time::timeout(Duration::from_secs(240), run(&o, true, &config, &store))
        .await
        .expect("the run finished in time")
        .expect("the run");
    assert_exactly_once_through_faults(&r);
}

/// PostgreSQL shared by two instance processes, one killed with SIGKILL at 200 and 400 intents,
/// with partitions up to three times the 1 s lease: a run taken over while its instance
/// was cut off commits nothing (its transaction loses to the fence), so each intent
/// still has one order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_crashes_and_partitions_longer_than_the_lease_exactly_once() {
    let Some(pg) = PostgresServer::start_with(&[("max_connections", "200")]) else {
        return;
    };
    let text = DEFAULT_CONFIG.replace(r#""leaseTtl": "10s""#, r#""leaseTtl": "1s""#);
    let config = ServiceConfig::from_json(&text).unwrap();
    let spec = schedule(32, Duration::from_millis(100)..Duration::from_secs(3));
    let o = options(2, 32, spec);
    let launch = Launch::Test {
        exe: std::env::current_exe().expect("the test binary"),
        test: "instance_process".into(),
    };
    let store = StoreKind::Postgres(pg.url());
    let run = crash::run_with_crashes(&o, 200, true, &config, &text, &store, &launch);
    let r = tokio::time::timeout(Duration::from_secs(240), run)
        .await
        .expect("the run finished in time")
        .expect("the run");
    assert_eq!(r.crashes, 2, "{r:?}");
    assert_exactly_once_through_faults(&r);
}

/// The demo's orders on PostgreSQL, each committed with its record; instance A's
/// handler says when its order is written (uncommitted) and waits to be let go.
struct GatedOrders {
    store: PostgresStore,
    name: &'static str,
    gate: Option<(Arc<Notify>, Arc<Notify>)>,
}

idem_test_support::create_only_orders! {
    GatedOrders, why = "the test only creates orders";
    create_order(&self, request) {
        let mut tx = self.store.begin_for(&request).await?;
        let r = request.into_inner();
        let id = pg_orders::insert_order(&mut tx, &r.note, self.name).await?;
        if let Some((written, go)) = &self.gate {
            written.notify_one();
            go.notified().await;
        }
        let reply = Order {
            order_id: format!("ord-{id}"),
            created_by: self.name.into(),
            ..Default::default()
        };
        tx.commit_reply(&reply).await?;
        Ok(Response::new(reply))
    }
}

/// Serves `svc` behind the idempotency layer on `store` (1 s lease).
async fn serve_pg(store: PostgresStore, svc: GatedOrders) -> SocketAddr {
    let text = DEFAULT_CONFIG.replace(r#""leaseTtl": "10s""#, r#""leaseTtl": "1s""#);
    let config = ServiceConfig::from_json(&text).unwrap();
    let layer = IdempotencyLayer::new(store, &config).tenant(SingleTenant::new("demo"));
    let (addr, incoming) = idem_test_support::net::bind().await;
    tokio::spawn(
        Server::builder()
            .layer(InboundLayer::new())
            .layer(layer)
            .add_service(OrdersServer::new(svc))
            .serve_with_incoming(incoming),
    );
    addr
}

async fn create(addr: SocketAddr, key: &IdempotencyKey) -> Result<Order, Status> {
    let mut client = OrdersClient::new(idem_test_support::net::channel(addr));
    let mut req = Request::new(CreateOrderRequest {
        note: "intent-0".into(),
        quantity: 1,
        ..Default::default()
    });
    idem::client::with_key(&mut req, key);
    client.create_order(req).await.map(Response::into_inner)
}

/// Instance A is cut off from PostgreSQL (both ways, connections kept open) while its
/// handler holds an uncommitted order, for longer than the lease. Instance B takes the
/// record over and commits the order. When the partition heals, A's commit loses to the
/// fence: one order, and every OK names it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_instance_cut_off_longer_than_the_lease_loses_to_the_fence() {
    let Some(pg) = PostgresServer::start() else {
        return;
    };
    let pool = pg.pool(2).await;
    pg_orders::reset_table(&pool).await.unwrap();
    let proxy = FaultProxy::start(SocketAddr::from(([127, 0, 0, 1], pg.port())))
        .await
        .unwrap();
    let via = format!("postgres://idem@{}/postgres", proxy.addr());
    let (written, go) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let a_store = PostgresStore::connect(via).await.unwrap();
    let a = serve_pg(
        a_store.clone(),
        GatedOrders {
            store: a_store,
            name: "a",
            gate: Some((written.clone(), go.clone())),
        },
    )
    .await;
    let b_store = PostgresStore::connect(pg.url()).await.unwrap();
    let b = serve_pg(
        b_store.clone(),
        GatedOrders {
            store: b_store,
            name: "b",
            gate: None,
        },
    )
    .await;
    let key = IdempotencyKey::generate();
    let history = Arc::new(History::default());
    history.attempt("intent-0");
    let first = tokio::spawn({
        let key = key.clone();
        async move { create(a, &key).await }
    });
    written.notified().await;
    proxy.set(Some(NetFault::Partition(Direction::Both)));
    // B's retries wait for the record in flight, then take it over once A's lease
    // (not renewed: A's store is cut off) has run out.
    let mut tries = 0;
    let order = loop {
        history.attempt("intent-0");
        match create(b, &key).await {
            Ok(order) => break order,
            Err(s) if tries < 300 => {
                tries += 1;
                eprintln!("B: {s:?}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(s) => panic!("B never took the record over: {s:?}"),
        }
    };
    history.ok("intent-0", &order.order_id);
    assert_eq!(order.created_by, "b", "{order:?}");
    proxy.heal();
    go.notify_one();
    match first.await.unwrap() {
        Ok(order) => history.ok("intent-0", &order.order_id),
        Err(s) => eprintln!("A, taken over: {s:?}"),
    }
    let orders = pg_orders::orders(&pool).await.unwrap();
    let verdict = history.check(["intent-0"], orders.iter().map(|(i, o)| (i, o)));
    assert!(verdict.is_exactly_once(), "{verdict}");
}

/// Orders kept in this process (a cache store cannot commit them with the record);
/// the handler says when it has written its order and waits to be let go.
#[derive(Clone, Default)]
struct GatedLedger {
    orders: Arc<std::sync::Mutex<Vec<(String, String)>>>,
    gate: Option<(Arc<Notify>, Arc<Notify>)>,
}

idem_test_support::create_only_orders! {
    GatedLedger, why = "the test only creates orders";
    create_order(&self, request) {
        let r = request.into_inner();
        let id = {
            let mut orders = self.orders.lock().unwrap();
            let id = format!("ord-{}", orders.len());
            orders.push((r.note.clone(), id.clone()));
            id
        };
        if let Some((written, go)) = &self.gate {
            written.notify_one();
            go.notified().await;
        }
        Ok(Response::new(Order { order_id: id, ..Default::default() }))
    }
}

/// Serves `ledger` behind the idempotency layer on Redis at `url` (10 s lease).
async fn serve_redis(url: String, ledger: GatedLedger) -> SocketAddr {
    let config = ServiceConfig::from_json(DEFAULT_CONFIG).unwrap();
    let store = RedisStore::connect(url).await.expect("connect");
    let layer = IdempotencyLayer::new(store, &config).tenant(SingleTenant::new("demo"));
    let (addr, incoming) = idem_test_support::net::bind().await;
    tokio::spawn(
        Server::builder()
            .layer(InboundLayer::new())
            .layer(layer)
            .add_service(OrdersServer::new(ledger))
            .serve_with_incoming(incoming),
    );
    addr
}

/// Calls until an OK (the store's connections reconnect after a partition), recording
/// each call and OK in `history`.
async fn create_until_ok(addr: SocketAddr, key: &IdempotencyKey, history: &History) -> Order {
    for _ in 0..300 {
        history.attempt("intent-0");
        match create(addr, key).await {
            Ok(order) => {
                history.ok("intent-0", &order.order_id);
                return order;
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
    panic!("no OK after 300 calls");
}

/// Redis stops answering (partitioned both ways, connections kept open): a call is
/// UNAVAILABLE after the command timeout and its handler never runs; once the store
/// answers again, the same key runs once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_that_stops_answering_runs_nothing_then_runs_once() {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    let proxy = FaultProxy::start(SocketAddr::from(([127, 0, 0, 1], redis.port())))
        .await
        .unwrap();
    let ledger = GatedLedger::default();
    let addr = serve_redis(format!("redis://{}", proxy.addr()), ledger.clone()).await;
    let key = IdempotencyKey::generate();
    proxy.set(Some(NetFault::Partition(Direction::Both)));
    let history = History::default();
    history.attempt("intent-0");
    let s = create(addr, &key).await.expect_err("no store, no run");
    assert_eq!(s.code(), tonic::Code::Unavailable, "{s:?}");
    assert!(
        ledger.orders.lock().unwrap().is_empty(),
        "the handler never ran"
    );
    proxy.heal();
    create_until_ok(addr, &key, &history).await;
    let orders = ledger.orders.lock().unwrap().clone();
    let verdict = history.check(["intent-0"], orders.iter().map(|(i, o)| (i, o)));
    assert!(verdict.is_exactly_once(), "{verdict}");
}

/// An instance cut off from Redis after its handler wrote its order, for less than the
/// lease: the completion is retried until the partition heals, and every retry of the
/// key replays that order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_instance_cut_off_shorter_than_the_lease_runs_once() {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    let proxy = FaultProxy::start(SocketAddr::from(([127, 0, 0, 1], redis.port())))
        .await
        .unwrap();
    let (written, go) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let ledger = GatedLedger {
        gate: Some((written.clone(), go.clone())),
        ..GatedLedger::default()
    };
    let addr = serve_redis(format!("redis://{}", proxy.addr()), ledger.clone()).await;
    let key = IdempotencyKey::generate();
    let history = Arc::new(History::default());
    history.attempt("intent-0");
    let first = tokio::spawn({
        let key = key.clone();
        async move { create(addr, &key).await }
    });
    written.notified().await;
    proxy.set(Some(NetFault::Partition(Direction::Both)));
    let before = proxy.stats().dropped;
    go.notify_one();
    // The completion was sent into the partition (and lost) before it heals.
    while proxy.stats().dropped == before {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    proxy.heal();
    if let Ok(order) = first.await.unwrap() {
        history.ok("intent-0", &order.order_id);
    }
    let order = create_until_ok(addr, &key, &history).await;
    assert_eq!(order.order_id, "ord-0");
    let orders = ledger.orders.lock().unwrap().clone();
    let verdict = history.check(["intent-0"], orders.iter().map(|(i, o)| (i, o)));
    assert!(verdict.is_exactly_once(), "{verdict}");
}
