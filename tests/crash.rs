//! Real crashes: server instances are processes of this test binary (see
//! `instance_process`), killed with SIGKILL at chosen points of a handler or every N
//! intents of a workload, and started again.
//!
//! With the PostgreSQL store and a handler that commits its order in the transaction
//! that completes its record, every intent creates exactly one order whatever the point
//! of the kill. A handler's downstream call made with a derived key is replayed, not
//! executed again, when the handler runs again after a crash. The same crash schedule on
//! the memory store lets duplicates through: the crashes are real.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use idem::core::config::ServiceConfig;
use idem::postgres::PostgresStore;
use idem::server::idempotency::{IdempotencyLayer, scope_for, tenant::SingleTenant};
use idem::store::{RecordState, Store, memory::MemoryStore};
use idem_demo::crash::{self, Instance, Launch, PausePoint, ServeArgs, StoreKind};
use idem_demo::pg_orders;
use idem_demo::{DEFAULT_CONFIG, Options, RunReport};
use idem_test_support::net;
use idem_test_support::net::free_port;
use idem_test_support::postgres::PostgresServer;
use idem_test_support::shop::orders_client::OrdersClient;
use idem_test_support::shop::orders_server::{Orders, OrdersServer};
use idem_test_support::shop::{CreateOrderRequest, Order};
use idem_test_support::shop_fake::{create_only, keyed_create};
use tonic::transport::Server;
use tonic::{Request, Response};

/// Not a test of its own: the entry point of the instance processes the tests start
/// (this binary, running only this test, with the instance's arguments in its
/// environment). In a normal run it returns at once.
#[test]
fn instance_process() {
    crash::serve_from_env();
}

fn launch() -> Launch {
    Launch::Test {
        exe: std::env::current_exe().expect("the test binary"),
        test: "instance_process".into(),
    }
}

/// The demo's config with a 1 s lease, so a record left in flight by a killed process is
/// taken over within the retry's deadline.
fn config_text() -> String {
    DEFAULT_CONFIG.replace(r#""leaseTtl": "10s""#, r#""leaseTtl": "1s""#)
}

/// A directory with the config file, removed on drop.
struct Dir(PathBuf);

impl Dir {
    fn new(name: &str) -> Dir {
        static N: AtomicU64 = AtomicU64::new(0);
        let dir = std::env::temp_dir().join(format!(
            "idem-crash-{name}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("config.json"), config_text()).unwrap();
        Dir(dir)
    }

    fn args(&self, store: StoreKind, port: u16) -> ServeArgs {
        ServeArgs::new(
            0,
            port,
            store,
            self.0.join("config.json"),
            self.0.join("ledger"),
        )
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn create(intent: &str, key: &str) -> Request<CreateOrderRequest> {
    keyed_create(key, intent, Duration::from_secs(10))
}

fn client(port: u16) -> OrdersClient<tonic::transport::Channel> {
    OrdersClient::new(net::channel(([127, 0, 0, 1], port).into()))
}

/// The retry of a call whose run died with its process. Sent while the dead run's lease
/// lasts, it waits; when the lease ends its claim takes the record over, but a waiting
/// duplicate keeps only the fingerprint, not the request (issue 30 item 3), so it does
/// not run: it answers UNAVAILABLE (`IN_PROGRESS_ENDED`) with a short retry delay, and
/// the next retry (an idem client's own) runs. Sent after the lease, it runs at once.
async fn retry_past_a_dead_run(port: u16, intent: &str, key: &str) -> Response<Order> {
    use tonic_types::StatusExt;
    match client(port).create_order(create(intent, key)).await {
        Err(s)
            if s.code() == tonic::Code::Unavailable
                && s.get_details_error_info().is_some_and(|i| {
                    i.reason == idem::core::headers::reason::IN_PROGRESS_ENDED
                }) =>
        {
            client(port)
                .create_order(create(intent, key))
                .await
                .unwrap()
        }
        other => other.unwrap(),
    }
}

/// One order, killed at `point` in its handler, retried on a restarted instance: the
/// retry's answer and the orders table.
async fn kill_at(point: PausePoint) {
    let Some(pg) = PostgresServer::start() else {
        return;
    };
    let dir = Dir::new(point.name());
    let store = PostgresStore::connect(pg.url()).await.unwrap();
    let pool = store.pool();
    pg_orders::reset_table(pool).await.unwrap();
    let port = free_port();
    let args = dir.args(StoreKind::Postgres(pg.url()), port);
    let mut first = Instance::start(
        &launch(),
        ServeArgs {
            pause_at: Some(point),
            ..args.clone()
        },
    )
    .await
    .unwrap();

    let key = "intent-key-0001";
    let call = tokio::spawn(async move { client(port).create_order(create("i1", key)).await });
    first
        .wait_for(&format!("paused {}", point.name()), Duration::from_secs(10))
        .await
        .unwrap();
    if point == PausePoint::InTransaction {
        // Let the lease (1 s) be renewed past its first end while the handler waits,
        // then kill in the middle of the renewals.
        tokio::time::sleep(Duration::from_millis(1300)).await;
        let record = store
            .get(&scope_for("demo", "/shop.v1.Orders/CreateOrder", key))
            .await
            .unwrap();
        assert!(
            matches!(record, Some(RecordState::InFlight { lease_until, .. })
                if lease_until > tokio::time::Instant::now()),
            "renewed past the first lease: {record:?}"
        );
    }
    first.kill().await.unwrap();
    let lost = call.await.unwrap();
    assert!(lost.is_err(), "the caller saw the crash: {lost:?}");

    let _second = Instance::start(&launch(), args).await.unwrap();
    let retry = retry_past_a_dead_run(port, "i1", key).await;
    let replayed = idem::client::is_replayed(&retry);
    // After the commit the reply is in the record: replayed. Before it, nothing was
    // done: the retry takes the record over and runs the handler.
    assert_eq!(replayed, point == PausePoint::AfterCommit, "{point:?}");
    let again = client(port).create_order(create("i1", key)).await.unwrap();
    assert!(idem::client::is_replayed(&again));
    assert_eq!(again.get_ref(), retry.get_ref());
    let orders = pg_orders::orders_by_intent(pool).await.unwrap();
    assert_eq!(orders.get("i1"), Some(&1), "{point:?}: {orders:?}");
    assert_eq!(orders.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_before_the_write_then_one_order() {
    kill_at(PausePoint::BeforeWrite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_in_the_transaction_during_lease_renewals_then_one_order() {
    kill_at(PausePoint::InTransaction).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_after_the_commit_before_the_reply_then_one_order_replayed() {
    kill_at(PausePoint::AfterCommit).await;
}

/// The second hop: counts the orders it creates.
#[derive(Default)]
struct Counting {
    created: AtomicU64,
}

/// B's handler: an order numbered by B's count.
fn hop(b: Arc<Counting>) -> OrdersServer<impl Orders> {
    create_only(move |request: Request<CreateOrderRequest>| {
        let n = b.created.fetch_add(1, Ordering::SeqCst);
        std::future::ready(Ok(Response::new(Order {
            order_id: format!("b-{n}"),
            customer_id: request.into_inner().customer_id,
            ..Order::default()
        })))
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hop_killed_after_its_downstream_call_replays_it_when_run_again() {
    let dir = Dir::new("chain");
    let config = ServiceConfig::from_json(&config_text()).unwrap();
    // B, in this process: its own memory store, counting what it executes.
    let b = Arc::new(Counting::default());
    let layer =
        IdempotencyLayer::new(MemoryStore::default(), &config).tenant(SingleTenant::new("demo"));
    let b_stats = layer.stats();
    let (b_addr, incoming) = net::bind().await;
    tokio::spawn(
        Server::builder()
            .layer(layer)
            .add_service(hop(b.clone()))
            .serve_with_incoming(incoming),
    );
    // A, a process on a memory store (which dies with it), calling B.
    let port = free_port();
    let args = ServeArgs {
        downstream: Some(b_addr.port()),
        ..dir.args(StoreKind::Memory, port)
    };
    let mut a = Instance::start(
        &launch(),
        ServeArgs {
            pause_at: Some(PausePoint::AfterDownstream),
            ..args.clone()
        },
    )
    .await
    .unwrap();
    let key = "chain-key-0001";
    let call = tokio::spawn(async move { client(port).create_order(create("c1", key)).await });
    a.wait_for("paused after-downstream", Duration::from_secs(10))
        .await
        .unwrap();
    assert_eq!(b.created.load(Ordering::SeqCst), 1);
    a.kill().await.unwrap();
    assert!(call.await.unwrap().is_err());

    // A runs the handler again (its record died with it) and calls B with the same
    // derived key: B replays.
    let _a = Instance::start(&launch(), args).await.unwrap();
    let order = client(port)
        .create_order(create("c1", key))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        order.order_id, "b-0",
        "the first run's order, replayed by B"
    );
    assert_eq!(b.created.load(Ordering::SeqCst), 1, "B executed once");
    let s = b_stats.snapshot();
    assert_eq!((s.executed, s.replayed), (1, 1), "{s:?}");
}

fn chaos_options() -> Options {
    Options {
        intents: 2000,
        concurrency: 64,
        unavailable: 0.05,
        drop: 0.05,
        seed: 11,
        app_retries: 10,
        instances: 1,
        progress: false,
        ..Options::default()
    }
}

/// Every 200 intents an instance is killed with SIGKILL at a random point of its work.
const CRASH_EVERY: usize = 200;

async fn crash_run(store: StoreKind) -> RunReport {
    let text = config_text();
    let config = ServiceConfig::from_json(&text).unwrap();
    let o = chaos_options();
    let launch = launch();
    let run = crash::run_with_crashes(&o, CRASH_EVERY, true, &config, &text, &store, &launch);
    let report = tokio::time::timeout(Duration::from_secs(120), run)
        .await
        .expect("the run finished in time")
        .expect("the run");
    eprintln!("{}: {report:?}", store.name());
    assert_eq!(report.crashes, 9, "{report:?}");
    report
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_2000_intents_through_sigkills_exactly_once() {
    let Some(pg) = PostgresServer::start_with(&[("max_connections", "200")]) else {
        return;
    };
    let r = crash_run(StoreKind::Postgres(pg.url())).await;
    assert_eq!(r.duplicates, 0, "{r:?}");
    assert_eq!(r.lost, 0, "{r:?}");
    assert_eq!(r.orders, r.intents as u64, "{r:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_store_same_crashes_lets_duplicates_through() {
    let r = crash_run(StoreKind::Memory).await;
    assert!(
        r.duplicates > 0,
        "a store that dies with the process cannot stop re-runs: {r:?}"
    );
}

/// `--metrics-out` under `--crash-every`: the client side from the demo's process, the
/// server side summed over every instance process's lifetime (each scraped just before
/// its SIGKILL, the live ones at the end). With the last lifetime alone, a third of the
/// executions would show.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_out_sums_the_instances_scraped_before_each_sigkill() {
    let text = config_text();
    let config = ServiceConfig::from_json(&text).unwrap();
    let dir = Dir::new("metrics-out");
    let path = dir.0.join("metrics.prom");
    let o = Options {
        intents: 600,
        concurrency: 16,
        instances: 1,
        seed: 5,
        progress: false,
        metrics_out: Some(path.clone()),
        ..Options::default()
    };
    let launch = launch();
    let run = crash::run_with_crashes(&o, 200, true, &config, &text, &StoreKind::Memory, &launch);
    let report = tokio::time::timeout(Duration::from_secs(60), run)
        .await
        .expect("the run finished in time")
        .expect("the run");
    assert_eq!(report.crashes, 2, "{report:?}");
    let out = std::fs::read_to_string(&path).expect("the file was written");
    assert!(
        out.starts_with("# idem demo:") && out.contains("summed over 3 instance-process lifetimes"),
        "{}",
        out.lines().next().unwrap_or("")
    );
    let mut types = std::collections::HashSet::new();
    for line in out.lines().filter(|l| l.starts_with("# TYPE ")) {
        assert!(types.insert(line), "{line} twice");
    }
    let sample = |series: &str| -> f64 {
        out.lines()
            .filter_map(|l| l.rsplit_once(' '))
            .find(|(s, _)| *s == series)
            .map(|(_, v)| v.parse().expect("a number"))
            .unwrap_or(0.0)
    };
    let method = r#"grpc_method="shop.v1.Orders/CreateOrder""#;
    let attempts = sample(&format!(
        r#"grpc_client_attempt_started_total{{{method},grpc_target="demo"}}"#
    ));
    assert_eq!(attempts as u64, report.attempts, "the client side is exact");
    let executed = sample(&format!(
        r#"idem_server_call_outcome_total{{{method},idem_outcome="executed"}}"#
    ));
    let started = sample(&format!(r#"grpc_server_call_started_total{{{method}}}"#));
    // Every counted execution wrote its order; only calls that ended between a scrape
    // and its kill are missing.
    assert!(executed <= report.orders as f64, "{executed} > {report:?}");
    assert!(
        executed >= 0.8 * report.orders as f64,
        "{executed} executions counted for {} orders",
        report.orders
    );
    assert!(started >= executed && started <= attempts, "{started}");
}
