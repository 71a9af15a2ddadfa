//! What each idem layer costs against bare tonic, measured in one run.
//!
//! `cargo bench --bench layers` (release profile). Every scenario runs beside its
//! baseline in the same process, over real tonic servers and clients on 127.0.0.1 with the
//! `shop.v1.Orders` service, in rounds that alternate the order (A B, then B A, ...);
//! the table reports the median over rounds of each number and of each per-round ratio,
//! so drift on a shared machine hits both sides of a ratio alike.
//!
//! Arguments (after `--`): words that pick scenarios by substring of their section name
//! (`client`, `server`, `floor`, `replay`, `redis`, `cluster`, `postgres`, `dup`, `retry`, `metrics`,
//! `peer`);
//! none runs all.
//! `IDEM_BENCH_JSON=FILE` also writes the rows to FILE as JSON, and `table FILE...`
//! prints the markdown table of one or more such files (the median of each number over
//! them) instead of running anything: see `layers/report.rs`.
//! `profile-client-bare` / `profile-client-bare-key` / `profile-client-layer` /
//! `profile-client-metrics` / `profile-client-no-policy` / `profile-client-tower` /
//! `profile-server-bare` / `profile-server-metrics` /
//! `profile-server-fresh` / `profile-server-floor` / `profile-server-redis-fresh` / `profile-server-postgres-fresh` /
//! `profile-server-replay` run only one side (2,000
//! calls from tasks, one at a time unless `IDEM_PROFILE_CONCURRENCY` says more; no table), for `valgrind --tool=callgrind` instruction counts (BENCHMARKS.md).
//! Environment: `IDEM_BENCH_ROUNDS` (default 7), `IDEM_BENCH_SCALE` (calls per run
//! multiplier, default 1.0), `IDEM_BENCH_SUBSCRIBER=none` (installs a global tracing
//! subscriber that records nothing, as a service with logging set up has one; without
//! it, the workspace's `tracing/log` feature, which sqlx turns on, sends every span
//! enter and exit to the `log` fallback, on both sides of every row).
//!
//! See BENCHMARKS.md for the numbers from the project's machine and what they mean.

#[path = "layers/floor.rs"]
mod floor;
#[path = "layers/peer.rs"]
mod peer;
#[path = "layers/report.rs"]
mod report;

use idem_test_support::net;
use idem_test_support::shop;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use idem_client::retry::{Retry, RetryLayer};
use idem_core::config::ServiceConfig;
use idem_server::idempotency::IdempotencyLayer;
use idem_store::Store;
use idem_store::memory::{MemoryStore, MemoryStoreSettings};

// tonic's `MetadataMap` takes `&'static str` names: the names of `idem_core::headers`.
const IDEMPOTENCY_KEY: &str = "x-idempotency-key";
const IDEMPOTENCY_REPLAYED: &str = "x-idempotency-replayed";
const PREVIOUS_RPC_ATTEMPTS: &str = "grpc-previous-rpc-attempts";
use idem_test_support::shop_fake::create_only;
use shop::orders_client::OrdersClient;
use shop::{CreateOrderRequest, Order};
use tokio::sync::oneshot;
use tonic::metadata::MetadataValue;
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Channel, Server};
use tonic::{Code, Request, Response, Status};
use tower::ServiceBuilder;

// ------------------------------------------------------------------ the service

/// The handler: decodes the request, formats an order id, encodes the reply; plus a
/// busy-spin of `spin` (CPU work, holds a worker thread: the honest cost of work).
#[derive(Clone)]
struct Shop {
    spin: Duration,
    runs: Arc<AtomicUsize>,
}

fn busy_spin(d: Duration) {
    if d.is_zero() {
        return;
    }
    let start = Instant::now();
    while start.elapsed() < d {
        std::hint::spin_loop();
    }
}

impl Shop {
    fn create(&self, req: Request<CreateOrderRequest>) -> Result<Response<Order>, Status> {
        let n = self.runs.fetch_add(1, Ordering::Relaxed);
        // `sku: "flaky"`: the first attempt fails with UNAVAILABLE and a zero pushback
        // (the layer then retries at once, with no timer).
        if req.get_ref().sku == "flaky" && req.metadata().get(PREVIOUS_RPC_ATTEMPTS).is_none() {
            let mut status = Status::unavailable("first attempt fails");
            status
                .metadata_mut()
                .insert("grpc-retry-pushback-ms", MetadataValue::from_static("0"));
            return Err(status);
        }
        busy_spin(self.spin);
        let r = req.into_inner();
        Ok(Response::new(Order {
            order_id: format!("order-{n}"),
            customer_id: r.customer_id,
            sku: r.sku,
            quantity: r.quantity,
            created_by: "bench".into(),
        }))
    }
}

/// CreateOrder: retried on UNAVAILABLE (client) and protected (server); one tenant.
const CONFIG: &str = r#"{
  "methodConfig": [{
    "name": [{"service": "shop.v1.Orders", "method": "CreateOrder"}],
    "retryPolicy": {
      "maxAttempts": 3, "initialBackoff": "0.02s", "maxBackoff": "1s",
      "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]
    },
    "idempotency": {}
  }],
  "idem": {"tenant": {"single": "bench"}}
}"#;

fn config() -> ServiceConfig {
    ServiceConfig::from_json(CONFIG).expect("bench config parses")
}

/// A running server; stops when dropped.
struct Running {
    addr: SocketAddr,
    runs: Arc<AtomicUsize>,
    _stop: oneshot::Sender<()>,
}

impl Running {
    fn channel(&self) -> Channel {
        net::channel(self.addr)
    }
    fn client(&self) -> OrdersClient<Channel> {
        OrdersClient::new(self.channel())
    }
    fn runs(&self) -> usize {
        self.runs.load(Ordering::Relaxed)
    }
}

/// Serves `Orders` (with `spin` of work per call), behind `layer` if given.
async fn serve<St: Store>(spin: Duration, layer: Option<IdempotencyLayer<St>>) -> Running {
    let (shop, runs) = shop(spin);
    let (incoming, addr) = listen().await;
    let (stop, stopped) = oneshot::channel::<()>();
    let shutdown = async {
        let _ = stopped.await;
    };
    match layer {
        None => {
            let router = Server::builder().add_service(shop);
            tokio::spawn(router.serve_with_incoming_shutdown(incoming, shutdown));
        }
        Some(layer) => {
            let router = Server::builder().layer(layer).add_service(shop);
            tokio::spawn(router.serve_with_incoming_shutdown(incoming, shutdown));
        }
    }
    warmed_up(Running {
        addr,
        runs,
        _stop: stop,
    })
    .await
}

/// Serves `Orders` (with `spin` of work per call) behind the [`floor::FloorLayer`].
async fn serve_floor(spin: Duration) -> Running {
    let (shop, runs) = shop(spin);
    let (incoming, addr) = listen().await;
    let (stop, stopped) = oneshot::channel::<()>();
    let shutdown = async {
        let _ = stopped.await;
    };
    let router = Server::builder()
        .layer(floor::FloorLayer::default())
        .add_service(shop);
    tokio::spawn(router.serve_with_incoming_shutdown(incoming, shutdown));
    warmed_up(Running {
        addr,
        runs,
        _stop: stop,
    })
    .await
}

/// The `Orders` service of every server, and its count of handler runs.
fn shop(
    spin: Duration,
) -> (
    shop::orders_server::OrdersServer<impl shop::orders_server::Orders>,
    Arc<AtomicUsize>,
) {
    let runs = Arc::new(AtomicUsize::new(0));
    let shop = Shop {
        spin,
        runs: runs.clone(),
    };
    (
        create_only(move |req| std::future::ready(shop.create(req))),
        runs,
    )
}

/// A listener on 127.0.0.1, with TCP_NODELAY on accepted sockets as `Server::serve(addr)`
/// sets by default (`serve_with_incoming` ignores the builder's `tcp_nodelay`).
async fn listen() -> (TcpIncoming, SocketAddr) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind 127.0.0.1:0");
    let addr = listener.local_addr().expect("local addr");
    let incoming = TcpIncoming::from(listener)
        .with_nodelay(Some(std::env::var_os("IDEM_BENCH_NAGLE").is_none()));
    (incoming, addr)
}

/// Connects and warms up once, so no run pays the handshake.
async fn warmed_up(running: Running) -> Running {
    let _ = running
        .client()
        .create_order(order(Some(&fresh_key())))
        .await
        .expect("warm-up call");
    running
}

fn memory_store() -> MemoryStore {
    MemoryStore::new(MemoryStoreSettings {
        max_entries: 10_000_000,
        max_bytes: 4 << 30,
        ..MemoryStoreSettings::default()
    })
}

fn order(key: Option<&str>) -> Request<CreateOrderRequest> {
    order_sku(key, "sku-42")
}

fn order_sku(key: Option<&str>, sku: &str) -> Request<CreateOrderRequest> {
    let mut req = Request::new(CreateOrderRequest {
        customer_id: "customer-0001".into(),
        sku: sku.into(),
        quantity: 3,
        note: String::new(),
    });
    if let Some(k) = key {
        req.metadata_mut()
            .insert(IDEMPOTENCY_KEY, k.parse().expect("ascii key"));
    }
    req
}

fn fresh_key() -> String {
    format!("{:032x}", rand::random::<u128>())
}

fn keys(n: usize) -> Arc<Vec<String>> {
    Arc::new((0..n).map(|_| fresh_key()).collect())
}

// ------------------------------------------------------------------ measuring

/// One run: wall time, the process's CPU time, and every call's latency (sorted).
struct Run {
    elapsed: Duration,
    /// User + system time of every thread of the process (client and server) over the
    /// run: what the calls cost, whatever else the machine was doing.
    cpu: Duration,
    latencies: Vec<Duration>,
}

/// The process's CPU time so far (`CLOCK_PROCESS_CPUTIME_ID`: every thread, user and
/// system).
fn process_cpu() -> Duration {
    cpu_time::ProcessTime::now().as_duration()
}

impl Run {
    /// CPU time per call, in µs.
    fn cpu_per_call(&self) -> f64 {
        us(self.cpu) / self.latencies.len() as f64
    }
    fn throughput(&self) -> f64 {
        self.latencies.len() as f64 / self.elapsed.as_secs_f64()
    }
    fn pct(&self, p: f64) -> Duration {
        let i = ((self.latencies.len() as f64 - 1.0) * p).round() as usize;
        self.latencies[i.min(self.latencies.len() - 1)]
    }
}

/// Makes `calls` calls, `concurrency` at a time (each worker loops), with `f(i)` the
/// i-th call.
async fn drive<F, Fut>(calls: usize, concurrency: usize, f: F) -> Run
where
    F: Fn(usize) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = ()> + Send,
{
    let f = Arc::new(f);
    let next = Arc::new(AtomicUsize::new(0));
    let start = Instant::now();
    let cpu_start = process_cpu();
    let workers: Vec<_> = (0..concurrency)
        .map(|_| {
            let (f, next) = (f.clone(), next.clone());
            tokio::spawn(async move {
                let mut lat = Vec::with_capacity(calls / concurrency + 1);
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= calls {
                        break;
                    }
                    let t = Instant::now();
                    f(i).await;
                    lat.push(t.elapsed());
                }
                lat
            })
        })
        .collect();
    let mut latencies = Vec::with_capacity(calls);
    for w in workers {
        latencies.extend(w.await.expect("worker"));
    }
    let elapsed = start.elapsed();
    let cpu = process_cpu().saturating_sub(cpu_start);
    latencies.sort_unstable();
    Run {
        elapsed,
        cpu,
        latencies,
    }
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    let n = xs.len();
    if n == 0 {
        return f64::NAN;
    }
    if n % 2 == 1 {
        xs[n / 2]
    } else {
        (xs[n / 2 - 1] + xs[n / 2]) / 2.0
    }
}

/// Medians over rounds of one A/B comparison.
struct Pair {
    base_tp: f64,
    tp: f64,
    tp_ratio: f64,
    /// Lowest and highest per-round throughput ratio: how noisy the machine was.
    tp_range: (f64, f64),
    base_p50: f64,
    p50: f64,
    p50_ratio: f64,
    base_p99: f64,
    p99: f64,
    p99_ratio: f64,
    base_cpu: f64,
    cpu: f64,
    /// Median per-round ratio of CPU time per call (B/A): the layer's cost in CPU,
    /// less disturbed by other load than throughput.
    cpu_ratio: f64,
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// One side of a scenario: a `CreateOrder` per call on a clone of `$client`, with the
/// order key `$key` (`None`, or `Some(&fresh_key())` evaluated per call).
macro_rules! creates {
    ($client:expr, $key:expr, $what:literal) => {{
        let client = $client;
        move |_| {
            let mut c = client.clone();
            async move {
                c.create_order(order($key)).await.expect($what);
            }
        }
    }};
}

/// A caller of `client` that sends key `keys[i]` on call `i` (replays, when the keys ran
/// before), checking each answer with `check`.
macro_rules! keyed {
    ($client:expr, $keys:expr, $what:literal) => {
        keyed!($client, $keys, $what, |_| {})
    };
    ($client:expr, $keys:expr, $what:literal, $check:expr) => {{
        let (client, keys) = ($client, $keys);
        move |i: usize| {
            let mut c = client.clone();
            let k = keys[i].clone();
            async move {
                let r = c.create_order(order(Some(&k))).await.expect($what);
                ($check)(r);
            }
        }
    }};
}

/// Runs each of `keys` once on `server` (64 callers), so later calls replay them.
async fn run_once(server: &Running, keys: &Arc<Vec<String>>) {
    drive(
        keys.len(),
        64,
        keyed!(server.client(), keys.clone(), "first run"),
    )
    .await;
}

/// Runs `a` (baseline) and `b` in `rounds` alternating rounds: round `r` runs A then B
/// when `r` is even, B then A when odd.
async fn ab<FA, FAF, FB, FBF>(rounds: usize, calls: usize, concurrency: usize, a: FA, b: FB) -> Pair
where
    FA: Fn(usize) -> FAF + Clone + Send + Sync + 'static,
    FAF: Future<Output = ()> + Send,
    FB: Fn(usize) -> FBF + Clone + Send + Sync + 'static,
    FBF: Future<Output = ()> + Send,
{
    let (a, b) = (
        move || std::future::ready(a.clone()),
        move || std::future::ready(b.clone()),
    );
    ab_per_round(rounds, calls, concurrency, a, b).await
}

/// As [`ab`], each side's caller made anew for every round by `make_a` / `make_b`: for
/// sides on two servers, a new connection to each per round. Which worker thread a
/// connection's tasks settle on moves its throughput by several percent for the
/// connection's whole life (two identical servers measured 0.94x at 64 callers, each
/// over one connection for all rounds); with new connections, that luck falls anew in
/// each round and the median over rounds evens it out.
async fn ab_per_round<MA, MAF, FA, FAF, MB, MBF, FB, FBF>(
    rounds: usize,
    calls: usize,
    concurrency: usize,
    make_a: MA,
    make_b: MB,
) -> Pair
where
    MA: Fn() -> MAF,
    MAF: Future<Output = FA>,
    FA: Fn(usize) -> FAF + Send + Sync + 'static,
    FAF: Future<Output = ()> + Send,
    MB: Fn() -> MBF,
    MBF: Future<Output = FB>,
    FB: Fn(usize) -> FBF + Send + Sync + 'static,
    FBF: Future<Output = ()> + Send,
{
    let mut runs_a = Vec::new();
    let mut runs_b = Vec::new();
    for r in 0..rounds {
        let (a, b) = (make_a().await, make_b().await);
        if r % 2 == 0 {
            runs_a.push(drive(calls, concurrency, a).await);
            runs_b.push(drive(calls, concurrency, b).await);
        } else {
            runs_b.push(drive(calls, concurrency, b).await);
            runs_a.push(drive(calls, concurrency, a).await);
        }
    }
    let per = |f: &dyn Fn(&Run) -> f64, runs: &[Run]| median(runs.iter().map(f).collect());
    let ratio = |f: &dyn Fn(&Run) -> f64| {
        median(
            runs_a
                .iter()
                .zip(&runs_b)
                .map(|(a, b)| f(b) / f(a))
                .collect(),
        )
    };
    let tp = |r: &Run| r.throughput();
    let per_round: Vec<f64> = runs_a
        .iter()
        .zip(&runs_b)
        .map(|(a, b)| tp(b) / tp(a))
        .collect();
    let tp_range = (
        per_round.iter().copied().fold(f64::INFINITY, f64::min),
        per_round.iter().copied().fold(f64::NEG_INFINITY, f64::max),
    );
    let p50 = |r: &Run| us(r.pct(0.50));
    let p99 = |r: &Run| us(r.pct(0.99));
    let cpu = |r: &Run| r.cpu_per_call();
    Pair {
        base_tp: per(&tp, &runs_a),
        tp: per(&tp, &runs_b),
        tp_ratio: ratio(&tp),
        tp_range,
        base_p50: per(&p50, &runs_a),
        p50: per(&p50, &runs_b),
        p50_ratio: ratio(&p50),
        base_p99: per(&p99, &runs_a),
        p99: per(&p99, &runs_b),
        p99_ratio: ratio(&p99),
        base_cpu: per(&cpu, &runs_a),
        cpu: per(&cpu, &runs_b),
        cpu_ratio: ratio(&cpu),
    }
}

// ------------------------------------------------------------------ the table

#[derive(Default)]
struct Table {
    rows: Vec<String>,
    notes: Vec<String>,
    /// The rows for `IDEM_BENCH_JSON` (report.rs).
    json: Vec<serde_json::Value>,
}

impl Table {
    fn header() -> &'static str {
        "| scenario | conc. | baseline calls/s | layer calls/s | throughput ratio (range over rounds) | \
         baseline p50 µs | layer p50 µs | p50 ratio | baseline p99 µs | layer p99 µs | \
         p99 ratio | baseline CPU µs/call | layer CPU µs/call | CPU ratio | target |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"
    }

    fn pair(&mut self, name: &str, concurrency: usize, p: &Pair, target: &str) {
        let row = format!(
            "| {name} | {concurrency} | {:.0} | {:.0} | **{:.3}** ({:.2}–{:.2}) | {:.0} | {:.0} | {:.3} | \
             {:.0} | {:.0} | {:.3} | {:.1} | {:.1} | {:.3} | {target} |",
            p.base_tp,
            p.tp,
            p.tp_ratio,
            p.tp_range.0,
            p.tp_range.1,
            p.base_p50,
            p.p50,
            p.p50_ratio,
            p.base_p99,
            p.p99,
            p.p99_ratio,
            p.base_cpu,
            p.cpu,
            p.cpu_ratio,
        );
        println!("{row}");
        self.rows.push(row);
        let n = report::RowNumbers {
            base_tp: p.base_tp,
            tp: p.tp,
            tp_ratio: p.tp_ratio,
            tp_range: p.tp_range,
            base_p50: p.base_p50,
            p50: p.p50,
            p50_ratio: p.p50_ratio,
            base_p99: p.base_p99,
            p99: p.p99,
            p99_ratio: p.p99_ratio,
            base_cpu: p.base_cpu,
            cpu: p.cpu,
            cpu_ratio: p.cpu_ratio,
        };
        self.json.push(report::row(name, concurrency, &n, target));
    }

    fn note(&mut self, s: String) {
        println!("  {s}");
        self.notes.push(s);
    }
}

fn verdict(ok: bool) -> &'static str {
    if ok { "met" } else { "MISSED" }
}

fn env_num(name: &str, default: f64) -> f64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() {
    assert_eq!(
        IDEMPOTENCY_KEY,
        idem_core::headers::IDEMPOTENCY_KEY.as_str()
    );
    assert_eq!(
        IDEMPOTENCY_REPLAYED,
        idem_core::headers::IDEMPOTENCY_REPLAYED.as_str()
    );
    assert_eq!(
        PREVIOUS_RPC_ATTEMPTS,
        idem_core::headers::PREVIOUS_RPC_ATTEMPTS.as_str()
    );
    let filters: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    if filters.first().is_some_and(|f| f == "table") {
        print!("{}", report::table(&filters[1..]));
        return;
    }
    let json_file = std::env::var("IDEM_BENCH_JSON").ok();
    let wants = |section: &str| filters.is_empty() || filters.iter().any(|f| section.contains(f));
    let profile_only = filters
        .iter()
        .find_map(|f| f.strip_prefix("profile-"))
        .map(str::to_owned);
    let subscriber = std::env::var("IDEM_BENCH_SUBSCRIBER").ok();
    if subscriber.as_deref() == Some("none") {
        tracing::subscriber::set_global_default(tracing::subscriber::NoSubscriber::default())
            .expect("the first global subscriber");
    }
    let rounds = env_num("IDEM_BENCH_ROUNDS", 7.0).max(1.0) as usize;
    let scale = env_num("IDEM_BENCH_SCALE", 1.0).max(0.01);
    let n = |calls: usize| ((calls as f64 * scale) as usize).max(64);

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async move {
        println!(
            "idem layers benchmark: {rounds} rounds, scale {scale}, {} build, {} CPUs, \
             tracing subscriber: {}",
            if cfg!(debug_assertions) {
                "DEBUG"
            } else {
                "release"
            },
            std::thread::available_parallelism().map_or(0, |n| n.get()),
            subscriber.as_deref().unwrap_or("unset (log fallback)")
        );
        if let Some(which) = profile_only {
            profile(&which, n(2000)).await;
            return;
        }
        println!("{}", Table::header());
        let mut t = Table::default();
        if wants("client") {
            client(&mut t, rounds, n(3000), n(20000)).await;
        }
        if wants("client-no-policy") {
            client_no_policy(&mut t, rounds, n(3000), n(20000)).await;
        }
        if wants("peer") {
            peer(&mut t, rounds, n(3000), n(20000)).await;
        }
        if wants("server-fresh") {
            server_fresh(&mut t, rounds, n(3000), n(20000)).await;
        }
        if wants("server-floor") {
            server_floor(&mut t, rounds, n(3000), n(20000)).await;
        }
        if wants("server-replay") {
            server_replay(&mut t, rounds, n(3000), n(20000)).await;
        }
        if wants("redis") {
            redis(&mut t, rounds, n(2000), n(10000)).await;
        }
        if wants("postgres") {
            postgres(&mut t, rounds, n(2000), n(10000)).await;
        }
        if wants("redis-cluster") {
            redis_cluster(&mut t, rounds, n(2000), n(10000)).await;
        }
        if wants("duplicates") {
            duplicates(&mut t, rounds).await;
        }
        if wants("retry") {
            retry(&mut t, rounds, n(3000)).await;
        }
        if wants("metrics") {
            metrics(&mut t, rounds, n(3000), n(20000)).await;
        }
        println!("\nnotes:");
        for s in &t.notes {
            println!("- {s}");
        }
        if let Some(path) = json_file {
            report::write(&path, &t.json);
        }
    });
}

// ------------------------------------------------------------------ scenarios

/// Each layer with its OpenTelemetry metrics (idem-otel on an SDK provider with the
/// Prometheus reader) vs the same layer without: A is off, B is on.
async fn metrics(t: &mut Table, rounds: usize, calls1: usize, calls64: usize) {
    let prometheus = idem_otel::prometheus::Prometheus::new();
    let meter = prometheus.meter("bench");
    let cfg = config();
    let server = serve::<MemoryStore>(Duration::ZERO, None).await;
    let client_metrics = idem_otel::ClientMetrics::new(&meter, "bench", &cfg);
    let on_layer = RetryLayer::builder()
        .service_config(cfg.clone())
        .observer(client_metrics.clone())
        .build()
        .expect("layer");
    client_metrics.watch(&on_layer);
    // One channel under both, as in the client rows.
    let channel = server.channel();
    let off: OrdersClient<Retry<Channel>> = OrdersClient::new(
        ServiceBuilder::new()
            .layer(RetryLayer::from_config(&cfg))
            .service(channel.clone()),
    );
    let on: OrdersClient<Retry<Channel>> =
        OrdersClient::new(ServiceBuilder::new().layer(on_layer).service(channel));
    let server_metrics = idem_otel::ServerMetrics::new(&meter, &cfg);
    let plain = serve(
        Duration::ZERO,
        Some(IdempotencyLayer::new(memory_store(), &cfg)),
    )
    .await;
    // A second server like `plain`: the A/A row is what two identical servers differ
    // by, the floor under every row that compares two servers.
    let plain2 = serve(
        Duration::ZERO,
        Some(IdempotencyLayer::new(memory_store(), &cfg)),
    )
    .await;
    let store = server_metrics.instrument_store(memory_store(), "memory");
    let layer = IdempotencyLayer::new(store, &cfg).observer(server_metrics.clone());
    server_metrics.watch(&layer);
    let observed = serve(Duration::ZERO, Some(layer)).await;
    for (conc, calls) in [(1, calls1), (64, calls64)] {
        let (a, b) = (off.clone(), on.clone());
        let p = ab(
            rounds,
            calls,
            conc,
            creates!(a, None, "metrics off"),
            creates!(b, None, "metrics on"),
        )
        .await;
        let ok = p.tp_ratio >= 0.97;
        t.pair(
            "metrics: RetryLayer with OTel metrics vs without",
            conc,
            &p,
            &format!("tp ≥ 0.97: {}", verdict(ok)),
        );
        let p = fresh_keys(rounds, calls, conc, &plain, &plain2).await;
        t.pair(
            "calibration: IdempotencyLayer vs the same, second server (A/A)",
            conc,
            &p,
            "(reported)",
        );
        let p = fresh_keys(rounds, calls, conc, &plain, &observed).await;
        let ok = p.tp_ratio >= 0.97;
        t.pair(
            "metrics: IdempotencyLayer (fresh keys) with OTel metrics vs without",
            conc,
            &p,
            &format!("tp ≥ 0.97: {}", verdict(ok)),
        );
    }
    let series = prometheus
        .render()
        .lines()
        .filter(|l| !l.starts_with('#'))
        .count();
    t.note(format!(
        "metrics: {series} exposition lines after the run (bounded)"
    ));
}

/// RetryLayer (config with a retryPolicy and idempotency on CreateOrder: the buffered,
/// keyed path) over a `Channel` vs the bare `Channel`, same bare server.
async fn client(t: &mut Table, rounds: usize, calls1: usize, calls64: usize) {
    let server = serve::<MemoryStore>(Duration::ZERO, None).await;
    // One channel (one connection) under both: the layer is the only difference, not
    // which worker thread each connection's tasks landed on.
    let channel = server.channel();
    let bare = OrdersClient::new(channel.clone());
    let layered: OrdersClient<Retry<Channel>> = OrdersClient::new(
        ServiceBuilder::new()
            .layer(RetryLayer::from_config(&config()))
            .service(channel),
    );
    let _ = layered
        .clone()
        .create_order(order(None))
        .await
        .expect("warm-up");
    for (conc, calls) in [(1, calls1), (64, calls64)] {
        let (a, b) = (bare.clone(), layered.clone());
        let p = ab(
            rounds,
            calls,
            conc,
            creates!(a, None, "bare call"),
            creates!(b, None, "layered call"),
        )
        .await;
        let ok = p.tp_ratio >= 0.97 && p.p50_ratio <= 1.05;
        t.pair(
            "client: RetryLayer vs bare Channel",
            conc,
            &p,
            &format!("tp ≥ 0.97, p50 ≤ 1.05: {}", verdict(ok)),
        );
        // The same, with a baseline that sends the same key header by hand (a fresh
        // pre-made 32-hex key per call, marked sensitive as the layer does): what is
        // left is the retry machinery (buffering, the retry future, the report).
        let ks = keys(calls);
        let (a, b) = (bare.clone(), layered.clone());
        let p = ab(
            rounds,
            calls,
            conc,
            move |i| {
                let mut c = a.clone();
                let mut req = order(None);
                let mut v: MetadataValue<_> = ks[i].parse().expect("ascii key");
                v.set_sensitive(true);
                req.metadata_mut().insert(IDEMPOTENCY_KEY, v);
                async move {
                    c.create_order(req).await.expect("bare call with key");
                }
            },
            creates!(b, None, "layered call"),
        )
        .await;
        let ok = p.tp_ratio >= 0.97 && p.p50_ratio <= 1.05;
        t.pair(
            "client: RetryLayer vs bare Channel + the same key header by hand",
            conc,
            &p,
            &format!("(machinery alone) tp ≥ 0.97, p50 ≤ 1.05: {}", verdict(ok)),
        );
    }
}

/// A caller of `client` that sends the pre-made key `keys[i]` on call `i`, set by hand
/// (marked sensitive, as the layer does): the baseline of the machinery rows.
fn key_by_hand<S>(
    client: OrdersClient<S>,
    keys: Arc<Vec<String>>,
) -> impl Fn(usize) -> CallFut + Clone
where
    S: tonic::client::GrpcService<tonic::body::Body> + Clone + Send + Sync + 'static,
    S::Future: Send,
    S::ResponseBody: http_body::Body<Data = bytes::Bytes> + Send + 'static,
    <S::ResponseBody as http_body::Body>::Error:
        Into<Box<dyn std::error::Error + Send + Sync>> + Send,
    S::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    move |i| {
        let mut c = client.clone();
        let mut req = order(None);
        let mut v: MetadataValue<_> = keys[i].parse().expect("ascii key");
        v.set_sensitive(true);
        req.metadata_mut().insert(IDEMPOTENCY_KEY, v);
        Box::pin(async move {
            c.create_order(req)
                .await
                .expect("call with the key by hand");
        })
    }
}

type CallFut = std::pin::Pin<Box<dyn Future<Output = ()> + Send>>;

/// Issue 32's request copy: RetryLayer on a method without a `retryPolicy` (keyed, so
/// only transparent retries can resend it, for which the layer keeps the request until
/// response headers) vs a bare channel sending the same key by hand, one channel.
async fn client_no_policy(t: &mut Table, rounds: usize, calls1: usize, calls64: usize) {
    const NO_POLICY: &str = r#"{
      "methodConfig": [{
        "name": [{"service": "shop.v1.Orders", "method": "CreateOrder"}],
        "idempotency": {}
      }]
    }"#;
    let cfg = ServiceConfig::from_json(NO_POLICY).expect("no-policy config parses");
    let server = serve::<MemoryStore>(Duration::ZERO, None).await;
    let channel = server.channel();
    let bare = OrdersClient::new(channel.clone());
    let layered: OrdersClient<Retry<Channel>> = OrdersClient::new(
        ServiceBuilder::new()
            .layer(RetryLayer::from_config(&cfg))
            .service(channel),
    );
    let r = layered
        .clone()
        .create_order(order(None))
        .await
        .expect("warm-up");
    let report = idem_client::retry::CallReport::from_response(&r).expect("report");
    assert_eq!(report.outcome.as_str(), "no_retry_policy", "{report:?}");
    for (conc, calls) in [(1, calls1), (64, calls64)] {
        let ks = keys(calls);
        let p = ab(
            rounds,
            calls,
            conc,
            key_by_hand(bare.clone(), ks),
            creates!(layered.clone(), None, "layered call"),
        )
        .await;
        t.pair(
            "client: RetryLayer, method without a retryPolicy, vs bare Channel + the same key header by hand",
            conc,
            &p,
            "(issue 32's request copy)",
        );
    }
}

/// The peer row: idem's RetryLayer (the bench's config: a retryPolicy, a generated key)
/// vs `tower::retry::Retry` with the same policy over a buffered request and the key
/// set by hand (`layers/peer.rs`), one channel under both.
async fn peer(t: &mut Table, rounds: usize, calls1: usize, calls64: usize) {
    let server = serve::<MemoryStore>(Duration::ZERO, None).await;
    let channel = server.channel();
    let tower_retry = OrdersClient::new(peer::Buffered::new(channel.clone()));
    let layered: OrdersClient<Retry<Channel>> = OrdersClient::new(
        ServiceBuilder::new()
            .layer(RetryLayer::from_config(&config()))
            .service(channel),
    );
    let _ = layered
        .clone()
        .create_order(order(None))
        .await
        .expect("warm-up");
    // The policies are equivalent: a call that always fails UNAVAILABLE (without
    // `grpc-previous-rpc-attempts`, the bench's flaky order fails every attempt) makes 3
    // attempts through tower's, as through idem's.
    let before = server.runs();
    let e = tower_retry
        .clone()
        .create_order(order_sku(None, "flaky"))
        .await
        .expect_err("every attempt fails");
    assert_eq!(e.code(), Code::Unavailable);
    assert_eq!(server.runs() - before, 3, "tower's policy makes 3 attempts");
    for (conc, calls) in [(1, calls1), (64, calls64)] {
        let ks = keys(calls);
        let p = ab(
            rounds,
            calls,
            conc,
            key_by_hand(tower_retry.clone(), ks),
            creates!(layered.clone(), None, "layered call"),
        )
        .await;
        let target = match conc {
            64 => format!("CPU ≤ tower × 1.03: {}", verdict(p.cpu_ratio <= 1.03)),
            _ => "(latency view)".into(),
        };
        t.pair(
            "peer: RetryLayer vs tower::retry::Retry (buffered request, key by hand)",
            conc,
            &p,
            &target,
        );
    }
}

/// Fresh keys through IdempotencyLayer + MemoryStore vs a bare server; both get the same
/// request with a key header (the bare server ignores it).
async fn server_fresh(t: &mut Table, rounds: usize, calls1: usize, calls64: usize) {
    // The target row: a handler that does nothing, so idem's own cost is all there is.
    // Then the same with 50 µs of work per call (reported): the share of a handler that
    // does something.
    for spin in [Duration::ZERO, Duration::from_micros(50)] {
        let bare = serve::<MemoryStore>(spin, None).await;
        let idem = serve(spin, layer_of(memory_store())).await;
        for (conc, calls) in [(1, calls1), (64, calls64)] {
            let before = idem.runs();
            let p = fresh_keys(rounds, calls, conc, &bare, &idem).await;
            assert_eq!(
                idem.runs() - before,
                rounds * calls,
                "every fresh key ran once"
            );
            let (name, target) = match (spin.is_zero(), conc) {
                (true, 64) => (
                    "server: fresh keys, MemoryStore vs bare",
                    format!("tp ≥ 0.95: {}", verdict(p.tp_ratio >= 0.95)),
                ),
                (true, _) => (
                    "server: fresh keys, MemoryStore vs bare",
                    "(latency view)".into(),
                ),
                (false, _) => (
                    "server: fresh keys (50 µs busy-spin handler), MemoryStore vs bare",
                    "(reported)".into(),
                ),
            };
            t.pair(name, conc, &p, &target);
        }
    }
}

/// The [`floor::FloorLayer`] (the least work a layer with idem's promise does per fresh
/// call, written plainly) vs bare, and idem's layer on the memory store vs that floor:
/// how much of the server's fresh-call cost any buffering layer pays on tonic's types,
/// and how much is idem's own.
async fn server_floor(t: &mut Table, rounds: usize, calls1: usize, calls64: usize) {
    let bare = serve::<MemoryStore>(Duration::ZERO, None).await;
    let floor = serve_floor(Duration::ZERO).await;
    let idem = serve(Duration::ZERO, layer_of(memory_store())).await;
    for (conc, calls) in [(1, calls1), (64, calls64)] {
        let before = (floor.runs(), idem.runs());
        let p = fresh_keys(rounds, calls, conc, &bare, &floor).await;
        t.pair(
            "server: fresh keys, floor layer vs bare",
            conc,
            &p,
            "(reported)",
        );
        let p = fresh_keys(rounds, calls, conc, &floor, &idem).await;
        t.pair(
            "server: fresh keys, MemoryStore vs floor layer",
            conc,
            &p,
            "(reported)",
        );
        assert_eq!(
            (floor.runs() - before.0, idem.runs() - before.1),
            (2 * rounds * calls, rounds * calls),
            "every fresh key ran once"
        );
    }
}

/// Replays of completed keys vs a bare server, handler busy-spinning 50 µs on both.
async fn server_replay(t: &mut Table, rounds: usize, calls1: usize, calls64: usize) {
    let spin = Duration::from_micros(50);
    let bare = serve::<MemoryStore>(spin, None).await;
    let idem = serve(spin, Some(IdempotencyLayer::new(memory_store(), &config()))).await;
    for (conc, calls) in [(1, calls1), (64, calls64)] {
        // Complete every key once; the measured runs replay them.
        let ks = keys(calls);
        run_once(&idem, &ks).await;
        let before = idem.runs();
        let p = replays(rounds, calls, conc, (&bare, &idem), ks, |r| {
            assert!(r.metadata().get(IDEMPOTENCY_REPLAYED).is_some())
        })
        .await;
        assert_eq!(idem.runs(), before, "replays never run the handler");
        t.pair(
            "server: replay (50 µs busy-spin handler) vs bare",
            conc,
            &p,
            &format!("tp ≥ 1.0: {}", verdict(p.tp_ratio >= 1.0)),
        );
    }
}

/// RedisStore vs MemoryStore (same layer config), fresh keys and replays; and Redis
/// round trips per call from `INFO commandstats`.
async fn redis(t: &mut Table, rounds: usize, calls1: usize, calls64: usize) {
    let Some(redis) = idem_test_support::redis::RedisServer::start() else {
        t.note("redis: SKIPPED (no redis-server found)".into());
        return;
    };
    let mem = serve(Duration::ZERO, layer_of(memory_store())).await;
    let red = serve(Duration::ZERO, layer_of(redis_store(&redis.url()).await)).await;

    // Round trips: sequential calls, commands counted by Redis.
    const RT: usize = 200;
    let ks = keys(RT);
    let mut c = red.client();
    redis.reset_stats();
    for k in ks.iter() {
        c.create_order(order(Some(k))).await.expect("fresh");
    }
    let fresh_rt = redis.round_trips() as f64 / RT as f64;
    let fresh_cmds = redis.command_calls();
    redis.reset_stats();
    for k in ks.iter() {
        c.create_order(order(Some(k))).await.expect("replay");
    }
    let replay_rt = redis.round_trips() as f64 / RT as f64;
    let replay_cmds = redis.command_calls();
    t.note(format!(
        "redis round trips per call ({RT} sequential calls, INFO commandstats): fresh {fresh_rt:.2} \
         (claim with the tenant's quotas in its script, complete: target ≤ 2: {}), \
         replay {replay_rt:.2} (target 1: {}); commands fresh {fresh_cmds:?}, \
         replay {replay_cmds:?}",
        verdict(fresh_rt <= 2.0),
        verdict(replay_rt <= 1.0),
    ));
    t.json.push(report::round_trips(fresh_rt, replay_rt));

    store_pairs(
        t,
        "RedisStore vs MemoryStore",
        rounds,
        (calls1, calls64),
        &mem,
        &red,
    )
    .await;
}

/// PostgreSQL (a private server on this machine: `fsync = off`, `pg_stat_statements`
/// loaded; the store with its defaults, a pool of 10, no sweep while measuring) vs the
/// memory store: statements per fresh call and per replay, counted by PostgreSQL, then
/// fresh keys and replays as the Redis rows. The server's own CPU is not the process's:
/// the CPU ratio is what the layer's process spends, as for Redis.
async fn postgres(t: &mut Table, rounds: usize, calls1: usize, calls64: usize) {
    use sqlx::{Executor, Row};
    let Some(pg) = idem_test_support::postgres::PostgresServer::start_with(&[(
        "shared_preload_libraries",
        "pg_stat_statements",
    )]) else {
        t.note("postgres: SKIPPED (no PostgreSQL server binaries found)".into());
        return;
    };
    let admin = pg.pool(2).await;
    admin
        .execute("CREATE EXTENSION pg_stat_statements")
        .await
        .expect("pg_stat_statements");
    let mem = serve(Duration::ZERO, layer_of(memory_store())).await;
    let pgs = serve(Duration::ZERO, layer_of(postgres_store(&pg.url()).await)).await;

    // Statements: sequential calls, counted by PostgreSQL (the bench's own queries to
    // pg_stat_statements left out).
    const ST: usize = 200;
    let reset = || async {
        admin
            .execute("SELECT pg_stat_statements_reset()")
            .await
            .expect("reset pg_stat_statements");
    };
    let count = || async {
        let rows = sqlx::query(
            "SELECT calls FROM pg_stat_statements WHERE query NOT LIKE '%pg_stat_statements%'",
        )
        .fetch_all(&admin)
        .await
        .expect("read pg_stat_statements");
        rows.iter().map(|r| r.get::<i64, _>(0)).sum::<i64>() as f64 / ST as f64
    };
    let ks = keys(ST);
    let mut c = pgs.client();
    reset().await;
    for k in ks.iter() {
        c.create_order(order(Some(k))).await.expect("fresh");
    }
    let fresh = count().await;
    reset().await;
    for k in ks.iter() {
        c.create_order(order(Some(k))).await.expect("replay");
    }
    let replay = count().await;
    t.note(format!(
        "postgres statements per call ({ST} sequential calls, pg_stat_statements): fresh \
         {fresh:.2} (claim, complete), replay {replay:.2} (claim)"
    ));
    t.json.push(report::statements(fresh, replay));

    store_pairs(
        t,
        "PostgresStore vs MemoryStore",
        rounds,
        (calls1, calls64),
        &mem,
        &pgs,
    )
    .await;
}

/// Redis Cluster (3 masters, 3 replicas, all on this machine) vs one Redis vs memory,
/// fresh keys and replays; then replica confirmation (`replica_acks(1, 100 ms)`: WAIT
/// for one replica on every claim and completion) vs the same cluster without it.
async fn redis_cluster(t: &mut Table, rounds: usize, calls1: usize, calls64: usize) {
    let (Some(single), Some(cluster)) = (
        idem_test_support::redis::RedisServer::start(),
        idem_test_support::redis::RedisCluster::start(),
    ) else {
        t.note("redis-cluster: SKIPPED (no redis-server or redis-cli found)".into());
        return;
    };
    let single_store = redis_store(&single.url()).await;
    let cluster_store = |prefix: &'static str, acks: bool| {
        let mut b = idem_redis::RedisStore::cluster_builder(cluster.urls()).key_prefix(prefix);
        if acks {
            b = b.replica_acks(1, Duration::from_millis(100));
        }
        b.connect()
    };
    let layer = |s| Some(IdempotencyLayer::new(s, &config()));
    let mem = serve(Duration::ZERO, layer_of(memory_store())).await;
    let one = serve(Duration::ZERO, layer(single_store)).await;
    let plain = serve(
        Duration::ZERO,
        layer(cluster_store("plain:", false).await.expect("cluster")),
    )
    .await;
    let acked = serve(
        Duration::ZERO,
        layer(cluster_store("acked:", true).await.expect("cluster")),
    )
    .await;
    for (conc, calls) in [(1, calls1), (64, calls64)] {
        for (name, a, b) in [
            ("Redis Cluster vs MemoryStore", &mem, &plain),
            ("Redis Cluster vs one Redis", &one, &plain),
            ("cluster + replicaAcks 1 vs cluster", &plain, &acked),
        ] {
            store_pair(t, name, rounds, calls, conc, a, b).await;
        }
    }
}

fn layer_of<St: idem_store::Store>(s: St) -> Option<IdempotencyLayer<St>> {
    Some(IdempotencyLayer::new(s, &config()))
}

/// The Redis store the bench measures, on the server at `url`.
async fn redis_store(url: &str) -> idem_redis::RedisStore {
    idem_redis::RedisStore::connect(url)
        .await
        .expect("connect to the bench redis")
}

/// The PostgreSQL store the bench measures (its defaults, a pool of 10, no sweep while
/// measuring), on the server at `url`.
async fn postgres_store(url: &str) -> idem_postgres::PostgresStore {
    idem_postgres::PostgresStore::builder(url)
        .no_sweep()
        .connect()
        .await
        .expect("connect to the bench PostgreSQL")
}

/// Fresh keys on server `b` against server `a` (baseline), `rounds` alternating rounds.
async fn fresh_keys(rounds: usize, calls: usize, conc: usize, a: &Running, b: &Running) -> Pair {
    let (a, b) = (a.addr, b.addr);
    ab_per_round(
        rounds,
        calls,
        conc,
        move || async move { creates!(connect(a).await, Some(&fresh_key()), "baseline") },
        move || async move { creates!(connect(b).await, Some(&fresh_key()), "layer") },
    )
    .await
}

/// Replays of `keys` (run before on both servers) on `servers.1` against `servers.0`,
/// over new connections each round; `check` looks at each of `servers.1`'s answers.
async fn replays(
    rounds: usize,
    calls: usize,
    conc: usize,
    servers: (&Running, &Running),
    keys: Arc<Vec<String>>,
    check: fn(tonic::Response<Order>),
) -> Pair {
    let (a, b, ka) = (servers.0.addr, servers.1.addr, keys.clone());
    ab_per_round(
        rounds,
        calls,
        conc,
        move || {
            let ks = ka.clone();
            async move { keyed!(connect(a).await, ks, "baseline replay") }
        },
        move || {
            let ks = keys.clone();
            async move { keyed!(connect(b).await, ks, "replay", check) }
        },
    )
    .await
}

/// A new connection to the server at `addr`, made now (not at the first call, whose
/// time would count).
async fn connect(addr: SocketAddr) -> OrdersClient<Channel> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .expect("endpoint")
        .connect()
        .await
        .expect("connect to the bench server");
    OrdersClient::new(channel)
}

/// Fresh keys, then replays of keys run once before, on server `b` against server `a`.
async fn store_pair(
    t: &mut Table,
    name: &str,
    rounds: usize,
    calls: usize,
    conc: usize,
    a: &Running,
    b: &Running,
) {
    let p = fresh_keys(rounds, calls, conc, a, b).await;
    t.pair(
        &format!("server: fresh keys, {name}"),
        conc,
        &p,
        "(reported)",
    );
    let ks = keys(calls);
    run_once(a, &ks).await;
    run_once(b, &ks).await;
    let p = replays(rounds, calls, conc, (a, b), ks, |_| {}).await;
    t.pair(&format!("server: replay, {name}"), conc, &p, "(reported)");
}

/// [`store_pair`] at 1 caller and at 64.
async fn store_pairs(
    t: &mut Table,
    name: &str,
    rounds: usize,
    (calls1, calls64): (usize, usize),
    a: &Running,
    b: &Running,
) {
    for (conc, calls) in [(1, calls1), (64, calls64)] {
        store_pair(t, name, rounds, calls, conc, a, b).await;
    }
}

/// 1,000 concurrent calls with one key (MemoryStore, WAIT policy): time until all have
/// their response, vs one plain call to a bare server, and vs 1,000 concurrent plain
/// calls to the bare server.
async fn duplicates(t: &mut Table, rounds: usize) {
    const N: usize = 1000;
    let bare = serve::<MemoryStore>(Duration::ZERO, None).await;
    let idem = serve(
        Duration::ZERO,
        Some(IdempotencyLayer::new(memory_store(), &config())),
    )
    .await;
    let (mut one, mut burst, mut dups) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..rounds {
        // One plain call (median of 50, so one number is not one outlier).
        let r = drive(50, 1, {
            let c = bare.client();
            creates!(c, None, "plain")
        })
        .await;
        one.push(us(r.pct(0.5)));
        // 1000 concurrent plain calls, distinct, to the bare server.
        let c = bare.client();
        let r = drive(N, N, creates!(c, None, "plain burst")).await;
        burst.push(us(r.elapsed));
        // 1000 concurrent duplicates of one fresh key.
        let key = Arc::new(fresh_key());
        let before = idem.runs();
        let c = idem.client();
        let r = drive(N, N, move |_| {
            let mut c = c.clone();
            let k = key.clone();
            async move {
                let r = c.create_order(order(Some(&k))).await;
                match r {
                    Ok(_) => {}
                    Err(s) => panic!("duplicate failed: {s:?}"),
                }
            }
        })
        .await;
        assert_eq!(idem.runs() - before, 1, "one key runs once");
        dups.push(us(r.elapsed));
    }
    let (one, burst, dups) = (median(one), median(burst), median(dups));
    let row = format!(
        "| 1,000 concurrent duplicates of one key (MemoryStore) | 1000 | — | — | — | \
         one plain call p50 {one:.0} | all 1,000 answered {dups:.0} | **{:.1}× one call** | \
         1,000 plain calls (bare) {burst:.0} | — | **{:.2}× 1,000 plain** | — | — | — | (reported) |",
        dups / one,
        dups / burst
    );
    println!("{row}");
    t.rows.push(row);
}

/// A call whose first attempt fails with UNAVAILABLE (zero pushback, so zero backoff)
/// through RetryLayer, vs one plain successful call, vs the same two attempts made by
/// hand without the layer.
async fn retry(t: &mut Table, rounds: usize, calls: usize) {
    let server = serve::<MemoryStore>(Duration::ZERO, None).await;
    let bare = server.client();
    let layer = RetryLayer::builder()
        .max_attempts(2)
        .initial_backoff(Duration::from_millis(1))
        .seed(1)
        // The by-hand baseline sends no key: compare like with like.
        .key_all_methods(false)
        .build()
        .expect("retry layer");
    let layered = OrdersClient::new(ServiceBuilder::new().layer(layer).service(server.channel()));
    let by_hand = |c: OrdersClient<Channel>| {
        move |_: usize| {
            let mut c = c.clone();
            async move {
                let e = c
                    .create_order(order_sku(None, "flaky"))
                    .await
                    .expect_err("first attempt fails");
                assert_eq!(e.code(), Code::Unavailable);
                let mut req = order_sku(None, "flaky");
                req.metadata_mut()
                    .insert(PREVIOUS_RPC_ATTEMPTS, MetadataValue::from_static("1"));
                c.create_order(req).await.expect("second attempt");
            }
        }
    };
    let retried = {
        let b = layered.clone();
        move |_: usize| {
            let mut c = b.clone();
            async move {
                let r = c
                    .create_order(order_sku(None, "flaky"))
                    .await
                    .expect("retried call");
                let report = idem_client::retry::CallReport::from_response(&r).expect("report");
                assert_eq!(report.attempts, 2);
            }
        }
    };
    let a = bare.clone();
    let p = ab(
        rounds,
        calls,
        1,
        creates!(a, None, "plain"),
        retried.clone(),
    )
    .await;
    t.pair(
        "retry: 1 UNAVAILABLE + 1 OK via RetryLayer vs one plain call",
        1,
        &p,
        "(reported)",
    );
    let p = ab(rounds, calls, 1, by_hand(bare.clone()), retried).await;
    t.pair(
        "retry: via RetryLayer vs the same 2 attempts by hand",
        1,
        &p,
        "(machinery cost)",
    );
}

/// One side of a scenario, sequentially, for instruction-counting profilers.
async fn profile(which: &str, calls: usize) {
    let idem_layer = || Some(IdempotencyLayer::new(memory_store(), &config()));
    let mut redis_guard = None;
    let mut pg_guard = None;
    let (server, layered) = match which {
        "client-bare" | "client-bare-key" | "client-layer" | "client-metrics"
        | "client-no-policy" | "client-tower" | "server-bare" => {
            (serve::<MemoryStore>(Duration::ZERO, None).await, false)
        }
        "server-fresh" | "server-replay" => (serve(Duration::ZERO, idem_layer()).await, true),
        "server-floor" => (serve_floor(Duration::ZERO).await, true),
        "server-redis-fresh" => {
            // Stopped when the profile ends, with its guard.
            let redis = redis_guard.insert(
                idem_test_support::redis::RedisServer::start()
                    .expect("server-redis-fresh needs redis-server (scripts/setup-test-deps.sh)"),
            );
            let store = redis_store(&redis.url()).await;
            (serve(Duration::ZERO, layer_of(store)).await, true)
        }
        "server-postgres-fresh" => {
            // Stopped when the profile ends, with its guard.
            let pg = pg_guard.insert(
                idem_test_support::postgres::PostgresServer::start()
                    .expect("server-postgres-fresh needs PostgreSQL (scripts/setup-test-deps.sh)"),
            );
            let store = postgres_store(&pg.url()).await;
            (serve(Duration::ZERO, layer_of(store)).await, true)
        }
        "server-metrics" => {
            // The provider lives as long as the process: the meter records into it.
            let prometheus = Box::leak(Box::new(idem_otel::prometheus::Prometheus::new()));
            let m = idem_otel::ServerMetrics::new(&prometheus.meter("bench"), &config());
            let store = m.instrument_store(memory_store(), "memory");
            let layer = IdempotencyLayer::new(store, &config()).observer(m.clone());
            (serve(Duration::ZERO, Some(layer)).await, true)
        }
        other => panic!("unknown profile {other:?}"),
    };
    let ks = keys(calls);
    if which == "server-replay" {
        let mut c = server.client();
        for k in ks.iter() {
            c.create_order(order(Some(k))).await.expect("first run");
        }
    }
    let with_key = layered || which == "server-bare";
    // `IDEM_PROFILE_CONCURRENCY=64`: that many callers at once over one channel, as in
    // the conc. 64 rows (the scheduling and contention a sequential run lacks). Callers
    // are tasks, as in the rows.
    let conc = env_num("IDEM_PROFILE_CONCURRENCY", 1.0).max(1.0) as usize;
    let start = Instant::now();
    if which == "client-tower" {
        // tower::retry over the buffered request, the key by hand (the peer row's A).
        let client = OrdersClient::new(peer::Buffered::new(server.channel()));
        drive(calls, conc, key_by_hand(client, ks)).await;
    } else if which == "client-no-policy" {
        let cfg = ServiceConfig::from_json(
            r#"{"methodConfig": [{"name": [{"service": "shop.v1.Orders"}], "idempotency": {}}]}"#,
        )
        .expect("config");
        let client = OrdersClient::new(
            ServiceBuilder::new()
                .layer(RetryLayer::from_config(&cfg))
                .service(server.channel()),
        );
        drive(calls, conc, creates!(client, None, "call")).await;
    } else if which == "client-layer" || which == "client-metrics" {
        let mut layer = RetryLayer::builder().service_config(config());
        // Kept alive to the end: the meter records into its provider.
        let prometheus = idem_otel::prometheus::Prometheus::new();
        if which == "client-metrics" {
            let meter = prometheus.meter("bench");
            layer = layer.observer(idem_otel::ClientMetrics::new(&meter, "bench", &config()));
        }
        let client = OrdersClient::new(
            ServiceBuilder::new()
                .layer(layer.build().expect("layer"))
                .service(server.channel()),
        );
        drive(calls, conc, creates!(client, None, "call")).await;
    } else if which == "client-bare-key" {
        // The key header the layer would add, sent by hand (sensitive, as the layer does).
        let client = server.client();
        drive(calls, conc, move |i| {
            let mut c = client.clone();
            let mut req = order(None);
            let mut v: MetadataValue<_> = ks[i].parse().expect("ascii key");
            v.set_sensitive(true);
            req.metadata_mut().insert(IDEMPOTENCY_KEY, v);
            async move {
                c.create_order(req).await.expect("call");
            }
        })
        .await;
    } else {
        let client = server.client();
        drive(calls, conc, move |i| {
            let (mut c, ks) = (client.clone(), ks.clone());
            async move {
                let key = with_key.then_some(ks[i].as_str());
                c.create_order(order(key)).await.expect("call");
            }
        })
        .await;
    }
    println!("{which}: {calls} calls in {:?}", start.elapsed());
}
