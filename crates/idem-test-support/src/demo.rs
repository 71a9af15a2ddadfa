//! The demo's moving parts, shared by the `demo` example and the chaos tests: the `shop.v1.Orders` service
//! with a ledger of orders per intent, a seeded fault injector, server instances, and
//! one run of the workload.
#![allow(missing_docs)]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use idem_client::{retry::RetryLayer, with_key};
use idem_core::{config::ServiceConfig, key::IdempotencyKey};
use idem_server::idempotency::tenant::SingleTenant;
use idem_server::{idempotency::IdempotencyLayer, inbound::InboundLayer};
use idem_store::memory::MemoryStore;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tonic::transport::{Channel, Endpoint, Server};
use tonic::{Request, Response, Status};
use tower::{Layer, Service, ServiceBuilder};

use crate::shop;
use shop::orders_client::OrdersClient;
use shop::orders_server::OrdersServer;
use shop::{CreateOrderRequest, Order};

pub const DEFAULT_CONFIG: &str = r#"{
  "methodConfig": [
    {
      "name": [{"service": "shop.v1.Orders", "method": "CreateOrder"}],
      "timeout": "5s",
      "retryPolicy": {
        "maxAttempts": 5,
        "initialBackoff": "0.005s",
        "maxBackoff": "0.05s",
        "backoffMultiplier": 2,
        "retryableStatusCodes": ["UNAVAILABLE"]
      },
      "idempotency": {"leaseTtl": "10s", "recordTtl": "3600s"}
    }
  ],
  "idem": {"tenant": {"single": "demo"}}
}"#;

#[derive(Debug, Clone)]
pub struct Options {
    pub intents: usize,
    pub concurrency: usize,
    pub unavailable: f64,
    pub drop: f64,
    pub latency: Duration,
    pub seed: u64,
    pub app_retries: u32,
    pub instances: usize,
    pub redis: Option<String>,
    pub config: Option<String>,
    /// Kill instance 0 and start it again once this many intents are done.
    pub restart_after: Option<usize>,
    /// Print progress to stderr.
    pub progress: bool,
    /// Write the Prometheus exposition of both layers of the run with idem here
    /// (in-process runs).
    pub metrics_out: Option<std::path::PathBuf>,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            intents: 3000,
            concurrency: 64,
            unavailable: 0.10,
            drop: 0.10,
            latency: Duration::ZERO,
            seed: 7,
            app_retries: 5,
            instances: 1,
            redis: None,
            config: None,
            restart_after: None,
            progress: true,
            metrics_out: None,
        }
    }
}

// ---------------------------------------------------------------------------------------
// The service: a ledger of orders per intent (the intent id travels in `note`).

/// Where the service writes its orders: a map in this process, or a file that server
/// processes append to (one `write` per order, `O_APPEND`), so orders survive a SIGKILL
/// of the process that created them.
#[derive(Default)]
pub struct Ledger {
    orders_by_intent: Mutex<HashMap<String, u32>>,
    file: Option<Mutex<std::fs::File>>,
    next_id: AtomicU64,
}

impl Ledger {
    /// A ledger that appends each order's intent as a line of `path`.
    pub fn append_to(path: &std::path::Path) -> std::io::Result<Ledger> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)?;
        Ok(Ledger {
            file: Some(Mutex::new(file)),
            ..Ledger::default()
        })
    }

    fn create(&self, intent: &str) -> u64 {
        if let Some(file) = &self.file {
            use std::io::Write;
            let line = format!("{intent}\n");
            file.lock()
                .expect("ledger lock")
                .write_all(line.as_bytes())
                .expect("append to the ledger file");
        } else {
            *self
                .orders_by_intent
                .lock()
                .expect("ledger lock")
                .entry(intent.to_owned())
                .or_default() += 1;
        }
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Orders per intent.
    pub fn by_intent(&self) -> HashMap<String, u32> {
        self.orders_by_intent.lock().expect("ledger lock").clone()
    }

    /// Orders per intent in a ledger file written by [`Ledger::append_to`].
    pub fn read_file(path: &std::path::Path) -> std::io::Result<HashMap<String, u32>> {
        let mut by_intent = HashMap::new();
        for line in std::fs::read_to_string(path)?.lines() {
            *by_intent.entry(line.to_owned()).or_default() += 1;
        }
        Ok(by_intent)
    }
}

pub struct OrdersImpl {
    ledger: Arc<Ledger>,
    instance: String,
}

impl OrdersImpl {
    /// The service of instance `instance`, writing to `ledger`.
    pub fn new(ledger: Arc<Ledger>, instance: String) -> Self {
        OrdersImpl { ledger, instance }
    }
}

crate::create_only_orders! {
    OrdersImpl, why = "the demo only creates orders";
    create_order(&self, request) {
        let r = request.into_inner();
        let id = self.ledger.create(&r.note);
        Ok(Response::new(Order {
            order_id: format!("ord-{id}"),
            customer_id: r.customer_id,
            sku: r.sku,
            quantity: r.quantity,
            created_by: self.instance.clone(),
        }))
    }
}

// ---------------------------------------------------------------------------------------
// The fault injector: a tower layer in front of everything else on the server.

#[derive(Clone)]
pub struct Faults {
    unavailable: f64,
    drop: f64,
    latency: Duration,
    rng: Arc<Mutex<StdRng>>,
    attempts: Arc<AtomicU64>,
}

impl Faults {
    /// Faults drawn from `o`'s probabilities with their own seeded generator.
    pub fn new(o: &Options, seed: u64) -> Self {
        Faults {
            unavailable: o.unavailable,
            drop: o.drop,
            latency: o.latency,
            rng: Arc::new(Mutex::new(StdRng::seed_from_u64(seed))),
            attempts: Arc::new(AtomicU64::new(0)),
        }
    }

    /// Calls that reached this injector.
    pub fn attempts(&self) -> u64 {
        self.attempts.load(Ordering::Relaxed)
    }
}

impl<S> Layer<S> for Faults {
    type Service = FaultService<S>;
    fn layer(&self, inner: S) -> Self::Service {
        FaultService {
            inner,
            faults: self.clone(),
        }
    }
}

#[derive(Clone)]
pub struct FaultService<S> {
    inner: S,
    faults: Faults,
}

pub enum Fault {
    None,
    Before,
    DropResponse,
}

type BoxFuture<T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send>>;

impl<S, B, RB> Service<http::Request<B>> for FaultService<S>
where
    S: Service<http::Request<B>, Response = http::Response<RB>> + Clone + Send + 'static,
    S::Future: Send,
    B: Send + 'static,
    RB: http_body::Body<Data = bytes::Bytes> + Send + 'static,
    RB::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = S::Error;
    type Future = BoxFuture<Result<Self::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let f = &self.faults;
        f.attempts.fetch_add(1, Ordering::Relaxed);
        let fault = {
            let mut rng = f.rng.lock().expect("rng lock");
            let x: f64 = rng.random();
            if x < f.unavailable {
                Fault::Before
            } else if x < f.unavailable + f.drop {
                Fault::DropResponse
            } else {
                Fault::None
            }
        };
        let latency = f.latency;
        Box::pin(async move {
            if let Fault::Before = fault {
                return Ok(Status::unavailable("injected: before the handler").into_http());
            }
            if !latency.is_zero() {
                tokio::time::sleep(latency).await;
            }
            let res = inner.call(req).await?;
            if let Fault::DropResponse = fault {
                // The handler ran (its response is complete: unary). Lose it on the way.
                drop(res);
                return Ok(Status::unavailable("injected: response lost").into_http());
            }
            Ok(res.map(tonic::body::Body::new))
        })
    }
}

// ---------------------------------------------------------------------------------------
// One run.

#[derive(Debug, Default, Clone)]
pub struct RunReport {
    pub label: &'static str,
    pub intents: usize,
    pub attempts: u64,
    pub app_calls: u64,
    pub replays: u64,
    pub orders: u64,
    pub duplicates: u64,
    /// Intents whose caller never got an OK (after every application retry).
    pub failed: u64,
    /// Intents whose caller got an OK but whose order does not exist.
    pub ok_without_order: u64,
    /// Whether instance 0 was killed and restarted during the run.
    pub restarted: bool,
    /// `failed + ok_without_order`.
    pub lost: u64,
    /// Server processes killed with SIGKILL during the run.
    pub crashes: u64,
    pub p50: Duration,
    pub p99: Duration,
    pub elapsed: Duration,
}

/// Where the server layer keeps its records.
#[derive(Clone)]
pub enum Store {
    /// One in-memory store shared by the instances of this process.
    Memory(MemoryStore),
    /// Redis, shared by every instance.
    Redis(idem_redis::RedisStore),
    /// An in-memory store behind a fault injector (store blips, lost replies).
    Faulty(crate::faulty_store::FaultyStore<MemoryStore>),
}

/// One server instance: its address and the task serving it.
struct Instance {
    addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

/// What every instance of one run shares.
#[derive(Clone)]
struct Fleet {
    with_idem: bool,
    config: ServiceConfig,
    ledger: Arc<Ledger>,
    faults: Faults,
    store: Store,
    stats: Arc<Mutex<Vec<idem_server::idempotency::IdempotencyStats>>>,
    metrics: Option<crate::demo_metrics::DemoMetrics>,
}

impl Fleet {
    /// Calls the instances' layers answered from a stored record.
    fn replays(&self) -> u64 {
        let stats = self.stats.lock().expect("stats lock");
        stats.iter().map(|s| s.snapshot().replayed).sum()
    }

    /// Serves `svc` behind the fault injector, `InboundLayer` and `IdempotencyLayer`.
    fn serve_with_idem<St: idem_store::Store>(
        &self,
        store: St,
        faults: Faults,
        svc: OrdersServer<OrdersImpl>,
        incoming: tokio_stream::wrappers::TcpListenerStream,
        kind: &'static str,
    ) -> tokio::task::JoinHandle<()> {
        if let Some(m) = &self.metrics {
            let layer = m.server(store, kind, &self.config);
            return self.serve_layer(layer, faults, svc, incoming);
        }
        self.serve_layer(
            IdempotencyLayer::new(store, &self.config),
            faults,
            svc,
            incoming,
        )
    }

    fn serve_layer<St: idem_store::Store>(
        &self,
        layer: IdempotencyLayer<St>,
        faults: Faults,
        svc: OrdersServer<OrdersImpl>,
        incoming: tokio_stream::wrappers::TcpListenerStream,
    ) -> tokio::task::JoinHandle<()> {
        let layer = layer.tenant(SingleTenant::new("demo"));
        self.stats.lock().expect("stats lock").push(layer.stats());
        tokio::spawn(async move {
            let _ = Server::builder()
                .layer(faults)
                .layer(InboundLayer::new())
                .layer(layer)
                .add_service(svc)
                .serve_with_incoming(incoming)
                .await;
        })
    }

    /// Serves instance `i` on `listener` until the task is aborted.
    fn spawn(&self, i: usize, listener: tokio::net::TcpListener) -> Instance {
        let addr = listener
            .local_addr()
            .expect("bound listener has an address");
        let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
        let svc = OrdersServer::new(OrdersImpl {
            ledger: self.ledger.clone(),
            instance: format!("instance-{i}"),
        });
        let faults = self.faults.clone();
        let task = if !self.with_idem {
            tokio::spawn(async move {
                let _ = Server::builder()
                    .layer(faults)
                    .add_service(svc)
                    .serve_with_incoming(incoming)
                    .await;
            })
        } else {
            match &self.store {
                Store::Memory(s) => {
                    self.serve_with_idem(s.clone(), faults, svc, incoming, "memory")
                }
                Store::Redis(s) => self.serve_with_idem(s.clone(), faults, svc, incoming, "redis"),
                Store::Faulty(s) => {
                    self.serve_with_idem(s.clone(), faults, svc, incoming, "memory")
                }
            }
        };
        Instance { addr, task }
    }
}

/// One channel balanced over the instances at `addrs`.
pub(crate) fn client_channel(addrs: &[SocketAddr], connect_timeout: Duration) -> Channel {
    let endpoints = addrs.iter().map(|a| {
        Endpoint::from_shared(format!("http://{a}"))
            .expect("valid endpoint")
            .connect_timeout(connect_timeout)
    });
    Channel::balance_list(endpoints)
}

/// The demo client's retry layer, observed by `metrics` when given. Without idem it
/// keeps the same retry policy, but no method is protected, so no key is sent.
pub(crate) fn retry_layer(
    config: &ServiceConfig,
    with_idem: bool,
    metrics: Option<&crate::demo_metrics::DemoMetrics>,
) -> RetryLayer {
    let retry = if with_idem {
        let builder = RetryLayer::builder().service_config(config.clone());
        let builder = match metrics {
            Some(m) => m.client(builder),
            None => builder,
        };
        builder.build().expect("a config needs no validation")
    } else {
        RetryLayer::from_config(&strip_idempotency(config))
    };
    if let Some(m) = metrics {
        m.watch_client(&retry);
    }
    retry
}

/// Once `after` intents are done, kills `first` (its serving task aborted, its
/// connections dropped) and starts it again on the same port, so the client's balancer
/// reconnects to it.
async fn restart_after(
    after: usize,
    first: Instance,
    fleet: Fleet,
    done: Arc<AtomicU64>,
) -> Instance {
    while done.load(Ordering::Relaxed) < after as u64 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    first.task.abort();
    let _ = first.task.await;
    let mut tries = 0;
    let listener = loop {
        match tokio::net::TcpListener::bind(first.addr).await {
            Ok(l) => break l,
            Err(_) if tries < 200 => {
                tries += 1;
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            Err(e) => panic!("cannot rebind {}: {e}", first.addr),
        }
    };
    fleet.spawn(0, listener)
}

/// Runs the workload once (with idem or without) and counts what happened.
///
/// With `o.restart_after = Some(n)`, instance 0 is killed (its serving task aborted, its
/// connections dropped) once `n` intents are done, and started again on the same port.
pub async fn run(
    o: &Options,
    with_idem: bool,
    config: &ServiceConfig,
    store: &Store,
) -> Result<RunReport, Box<dyn std::error::Error + Send + Sync>> {
    let label = if with_idem {
        "with idem"
    } else {
        "without idem"
    };
    let fleet = Fleet {
        with_idem,
        config: config.clone(),
        ledger: Arc::new(Ledger::default()),
        faults: Faults::new(o, o.seed),
        store: store.clone(),
        stats: Arc::new(Mutex::new(Vec::new())),
        metrics: o
            .metrics_out
            .as_ref()
            .filter(|_| with_idem)
            .map(|_| crate::demo_metrics::DemoMetrics::new(config)),
    };
    let mut instances = Vec::new();
    for i in 0..o.instances {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        instances.push(fleet.spawn(i, listener));
    }
    let addrs: Vec<SocketAddr> = instances.iter().map(|i| i.addr).collect();

    let client = OrdersClient::new(
        ServiceBuilder::new()
            .layer(retry_layer(config, with_idem, fleet.metrics.as_ref()))
            .service(client_channel(&addrs, Duration::from_secs(2))),
    );

    let done = Arc::new(AtomicU64::new(0));
    let restarter = o.restart_after.map(|after| {
        let first = instances.remove(0);
        tokio::spawn(restart_after(after, first, fleet.clone(), done.clone()))
    });

    let w = workload(o, with_idem, label, &client, done).await?;
    let mut restarted = false;
    if let Some(r) = restarter {
        instances.push(r.await?);
        restarted = true;
    }
    for i in &instances {
        i.task.abort();
    }
    let mut report = tally(o, label, &fleet.ledger.by_intent(), w);
    report.attempts = fleet.faults.attempts();
    report.replays = fleet.replays();
    report.restarted = restarted;
    if let (Some(m), Some(path)) = (&fleet.metrics, &o.metrics_out) {
        // Server metrics of a call are recorded just after its response: let them land.
        tokio::time::sleep(Duration::from_millis(50)).await;
        let m = m.clone();
        let path = path.clone();
        tokio::task::spawn_blocking(move || m.write(&path)).await??;
    }
    Ok(report)
}

/// What the callers saw in one run.
pub struct Workload {
    latencies: Vec<Duration>,
    /// Calls answered with `x-idempotency-replayed: true`.
    replays: Arc<AtomicU64>,
    failed: Vec<String>,
    app_calls: u64,
    elapsed: Duration,
}

/// Fires `o.intents` CreateOrder intents through `client` at `o.concurrency`, each with
/// its own key (with idem) reused by every application retry; `done` counts finished
/// intents as they finish.
pub async fn workload<S>(
    o: &Options,
    with_idem: bool,
    label: &'static str,
    client: &OrdersClient<S>,
    done: Arc<AtomicU64>,
) -> Result<Workload, Box<dyn std::error::Error + Send + Sync>>
where
    S: tonic::client::GrpcService<tonic::body::Body> + Clone + Send + 'static,
    S::Future: Send,
    S::ResponseBody: http_body::Body<Data = bytes::Bytes> + Send + 'static,
    <S::ResponseBody as http_body::Body>::Error:
        Into<Box<dyn std::error::Error + Send + Sync>> + Send,
    S::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let started = Instant::now();
    let app_calls = Arc::new(AtomicU64::new(0));
    let replays = Arc::new(AtomicU64::new(0));
    let sem = Arc::new(tokio::sync::Semaphore::new(o.concurrency));
    let progress = show_progress(o, label, done.clone());
    let mut tasks = Vec::with_capacity(o.intents);
    for n in 0..o.intents {
        let permit = sem.clone().acquire_owned().await?;
        let client = client.clone();
        let done = done.clone();
        let app_calls = app_calls.clone();
        let replays = replays.clone();
        let app_retries = o.app_retries;
        tasks.push(tokio::spawn(async move {
            let _permit = permit;
            let intent = format!("intent-{n}");
            let t0 = Instant::now();
            let calls = (&*app_calls, &*replays);
            let ok = one_intent(client, n, &intent, with_idem, app_retries, calls).await;
            done.fetch_add(1, Ordering::Relaxed);
            (intent, ok, t0.elapsed())
        }));
    }
    let mut latencies = Vec::with_capacity(o.intents);
    let mut failed = Vec::new();
    for t in tasks {
        let (intent, ok, latency) = t.await?;
        latencies.push(latency);
        if !ok {
            failed.push(intent);
        }
    }
    let _ = progress.await;
    latencies.sort();
    Ok(Workload {
        latencies,
        replays,
        failed,
        app_calls: app_calls.load(Ordering::Relaxed),
        elapsed: started.elapsed(),
    })
}

/// One business intent: one key, created here and reused by every application retry.
/// Retries codes that say "nothing was decided" or "not yet": UNAVAILABLE, CANCELLED (not
/// by this caller), DEADLINE_EXCEEDED, ABORTED, RESOURCE_EXHAUSTED.
async fn one_intent<S>(
    mut client: OrdersClient<S>,
    n: usize,
    intent: &str,
    with_idem: bool,
    app_retries: u32,
    (app_calls, replays): (&AtomicU64, &AtomicU64),
) -> bool
where
    S: tonic::client::GrpcService<tonic::body::Body>,
    S::ResponseBody: http_body::Body<Data = bytes::Bytes> + Send + 'static,
    <S::ResponseBody as http_body::Body>::Error:
        Into<Box<dyn std::error::Error + Send + Sync>> + Send,
    S::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let key = IdempotencyKey::generate();
    for _ in 0..=app_retries {
        app_calls.fetch_add(1, Ordering::Relaxed);
        let mut req = Request::new(CreateOrderRequest {
            customer_id: format!("customer-{}", n % 97),
            sku: "sku-42".into(),
            quantity: 1,
            note: intent.to_owned(),
        });
        if with_idem {
            with_key(&mut req, &key);
        }
        match client.create_order(req).await {
            Ok(response) => {
                if idem_client::is_replayed(&response) {
                    replays.fetch_add(1, Ordering::Relaxed);
                }
                return true;
            }
            Err(s)
                if matches!(
                    s.code(),
                    tonic::Code::Unavailable
                        // A connection that died mid-call (a killed server) can end
                        // the call CANCELLED although the caller cancelled nothing.
                        | tonic::Code::Cancelled
                        | tonic::Code::DeadlineExceeded
                        | tonic::Code::Aborted
                        | tonic::Code::ResourceExhausted
                ) =>
            {
                continue;
            }
            Err(s) => {
                if std::env::var_os("IDEM_DEMO_DEBUG").is_some() {
                    eprintln!("intent {intent} failed: {s:?}");
                }
                return false;
            }
        }
    }
    false
}

fn show_progress(
    o: &Options,
    label: &'static str,
    done: Arc<AtomicU64>,
) -> tokio::task::JoinHandle<()> {
    let total = o.intents as u64;
    let show = o.progress;
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_millis(500));
        loop {
            tick.tick().await;
            let d = done.load(Ordering::Relaxed);
            if show {
                eprint!("\r  {label:<13} {d:>6}/{total} intents");
            }
            if d >= total {
                if show {
                    eprintln!();
                }
                break;
            }
        }
    })
}

/// Counts orders, duplicates and lost intents of a run from the ledger's orders per
/// intent and what the callers saw.
pub fn tally(
    o: &Options,
    label: &'static str,
    by_intent: &HashMap<String, u32>,
    w: Workload,
) -> RunReport {
    let pct = |p: f64| w.latencies[((w.latencies.len() as f64 - 1.0) * p).round() as usize];
    let orders: u64 = by_intent.values().map(|&c| u64::from(c)).sum();
    let duplicates: u64 = by_intent
        .values()
        .map(|&c| u64::from(c.saturating_sub(1)))
        .sum();
    let ok_without_order = (0..o.intents)
        .map(|n| format!("intent-{n}"))
        .filter(|i| !w.failed.contains(i) && !by_intent.contains_key(i))
        .count() as u64;
    RunReport {
        label,
        intents: o.intents,
        attempts: 0,
        app_calls: w.app_calls,
        replays: w.replays.load(Ordering::Relaxed),
        orders,
        duplicates,
        failed: w.failed.len() as u64,
        ok_without_order,
        restarted: false,
        lost: w.failed.len() as u64 + ok_without_order,
        p50: pct(0.50),
        p99: pct(0.99),
        elapsed: w.elapsed,
        crashes: 0,
    }
}

/// The same config with every `idempotency` object removed: no protected methods.
pub fn strip_idempotency(config: &ServiceConfig) -> ServiceConfig {
    let entries = config
        .method_configs()
        .iter()
        .map(|m| m.clone().without_idempotency())
        .collect();
    ServiceConfig::from_parts(
        entries,
        config.retry_throttling(),
        config.settings().clone(),
    )
    .expect("names were valid already")
}
