//! The demo: effectively-once `CreateOrder` under injected faults, with idem and without.
//!
//! ```text
//! cargo run --release --example demo
//! cargo run --release --example demo -- --intents 5000 --concurrency 128 --drop 0.2
//! cargo run --release --example demo -- --redis redis://127.0.0.1:6379 --instances 3
//! cargo run --release --example demo -- --config examples/service_config.json
//! ```
//!
//! It starts `shop.v1.Orders` server instances on 127.0.0.1 behind a seeded fault
//! injector, then fires N CreateOrder intents at a chosen concurrency, twice:
//!
//! - **with idem**: client `RetryLayer` (one `x-idempotency-key` per intent, the same on
//!   every attempt and on every application-level retry) and server `IdempotencyLayer`;
//! - **without**: the same retry policy and application retries, no key, no server layer.
//!
//! Faults, applied in front of the server (outside the idempotency layer):
//! - `--unavailable P`: UNAVAILABLE before the handler runs (nothing happened);
//! - `--drop P`: the handler ran, then the response is lost on the way back (the client
//!   gets UNAVAILABLE, as from a proxy whose upstream connection reset, and cannot know
//!   the order exists);
//! - `--latency-ms MS`: added before the handler.
//!
//! An intent that still fails after the client layer's retries is retried by the
//! application (up to `--app-retries`), as a real caller would. The table counts orders
//! per intent in the server's ledger. With idem, duplicates and lost intents must be 0:
//! the process exits with status 1 otherwise.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use idem::client::{RetryLayer, with_key};
use idem::core::{IdempotencyKey, ServiceConfig};
use idem::server::idempotency::tenant::SingleTenant;
use idem::server::{IdempotencyLayer, InboundLayer, store::MemoryStore};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tonic::transport::{Channel, Endpoint, Server};
use tonic::{Request, Response, Status};
use tower::{Layer, Service, ServiceBuilder};

pub mod shop {
    #![allow(missing_docs, unreachable_pub)]
    tonic::include_proto!("shop.v1");
}
use shop::orders_client::OrdersClient;
use shop::orders_server::{Orders, OrdersServer};
use shop::{CreateOrderRequest, GetOrderRequest, ListOrdersRequest, Order};

const DEFAULT_CONFIG: &str = r#"{
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
struct Options {
    intents: usize,
    concurrency: usize,
    unavailable: f64,
    drop: f64,
    latency: Duration,
    seed: u64,
    app_retries: u32,
    instances: usize,
    redis: Option<String>,
    config: Option<String>,
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
        }
    }
}

const USAGE: &str = "usage: demo [--intents N] [--concurrency N] [--unavailable P] [--drop P] \
[--latency-ms MS] [--seed N] [--app-retries N] [--instances N] [--redis URL] [--config FILE]";

fn parse_args() -> Result<Options, String> {
    let mut o = Options::default();
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        if flag == "--help" || flag == "-h" {
            println!("{USAGE}");
            std::process::exit(0);
        }
        let value = args
            .next()
            .ok_or_else(|| format!("{flag} needs a value\n{USAGE}"))?;
        let bad = |e: &dyn std::fmt::Display| format!("{flag} {value}: {e}");
        match flag.as_str() {
            "--intents" => o.intents = value.parse().map_err(|e| bad(&e))?,
            "--concurrency" => o.concurrency = value.parse().map_err(|e| bad(&e))?,
            "--unavailable" => o.unavailable = value.parse().map_err(|e| bad(&e))?,
            "--drop" => o.drop = value.parse().map_err(|e| bad(&e))?,
            "--latency-ms" => {
                o.latency = Duration::from_millis(value.parse().map_err(|e| bad(&e))?)
            }
            "--seed" => o.seed = value.parse().map_err(|e| bad(&e))?,
            "--app-retries" => o.app_retries = value.parse().map_err(|e| bad(&e))?,
            "--instances" => o.instances = value.parse().map_err(|e| bad(&e))?,
            "--redis" => o.redis = Some(value),
            "--config" => o.config = Some(value),
            _ => return Err(format!("unknown option {flag}\n{USAGE}")),
        }
    }
    if !(0.0..=1.0).contains(&o.unavailable) || !(0.0..=1.0).contains(&o.drop) {
        return Err("--unavailable and --drop are probabilities in [0, 1]".into());
    }
    if o.intents == 0 || o.concurrency == 0 || o.instances == 0 {
        return Err("--intents, --concurrency and --instances must be > 0".into());
    }
    if o.instances > 1 && o.redis.is_none() {
        return Err("--instances > 1 needs --redis URL (in-memory stores are per instance)".into());
    }
    Ok(o)
}

// ---------------------------------------------------------------------------------------
// The service: a ledger of orders per intent (the intent id travels in `note`).

#[derive(Default)]
struct Ledger {
    orders_by_intent: Mutex<HashMap<String, u32>>,
    next_id: AtomicU64,
}

impl Ledger {
    fn create(&self, intent: &str) -> u64 {
        *self
            .orders_by_intent
            .lock()
            .expect("ledger lock")
            .entry(intent.to_owned())
            .or_default() += 1;
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }
}

struct OrdersImpl {
    ledger: Arc<Ledger>,
    instance: String,
}

#[tonic::async_trait]
impl Orders for OrdersImpl {
    async fn create_order(
        &self,
        request: Request<CreateOrderRequest>,
    ) -> Result<Response<Order>, Status> {
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

    async fn get_order(&self, _: Request<GetOrderRequest>) -> Result<Response<Order>, Status> {
        Err(Status::unimplemented("the demo only creates orders"))
    }

    type ListOrdersStream = tokio_stream::Empty<Result<Order, Status>>;

    async fn list_orders(
        &self,
        _: Request<ListOrdersRequest>,
    ) -> Result<Response<Self::ListOrdersStream>, Status> {
        Ok(Response::new(tokio_stream::empty()))
    }
}

// ---------------------------------------------------------------------------------------
// The fault injector: a tower layer in front of everything else on the server.

#[derive(Clone)]
struct Faults {
    unavailable: f64,
    drop: f64,
    latency: Duration,
    rng: Arc<Mutex<StdRng>>,
    attempts: Arc<AtomicU64>,
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
struct FaultService<S> {
    inner: S,
    faults: Faults,
}

enum Fault {
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
struct RunReport {
    label: &'static str,
    intents: usize,
    attempts: u64,
    app_calls: u64,
    replays: u64,
    orders: u64,
    duplicates: u64,
    lost: u64,
    p50: Duration,
    p99: Duration,
    elapsed: Duration,
}

enum Store {
    Memory,
    #[allow(dead_code)]
    Redis(idem::redis::RedisStore),
}

async fn start_servers(
    o: &Options,
    with_idem: bool,
    config: &ServiceConfig,
    ledger: Arc<Ledger>,
    faults: Faults,
    store: &Store,
) -> Result<
    (
        Vec<SocketAddr>,
        Vec<tokio::sync::oneshot::Sender<()>>,
        Vec<idem::server::idempotency::IdempotencyStats>,
    ),
    Box<dyn std::error::Error>,
> {
    let mut addrs = Vec::new();
    let mut stops = Vec::new();
    let mut stats = Vec::new();
    let memory = MemoryStore::new(config.settings().memory_store.clone());
    for i in 0..o.instances {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        addrs.push(listener.local_addr()?);
        let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        stops.push(tx);
        let svc = OrdersServer::new(OrdersImpl {
            ledger: ledger.clone(),
            instance: format!("instance-{i}"),
        });
        let shutdown = async move {
            let _ = rx.await;
        };
        if with_idem {
            let handle = match store {
                Store::Memory => {
                    let layer = IdempotencyLayer::new(memory.clone(), config)
                        .tenant(SingleTenant::new("demo"));
                    stats.push(layer.stats());
                    tokio::spawn(
                        Server::builder()
                            .layer(faults.clone())
                            .layer(InboundLayer::new())
                            .layer(layer)
                            .add_service(svc)
                            .serve_with_incoming_shutdown(incoming, shutdown),
                    )
                }
                Store::Redis(redis) => {
                    let layer = IdempotencyLayer::new(redis.clone(), config)
                        .tenant(SingleTenant::new("demo"));
                    stats.push(layer.stats());
                    tokio::spawn(
                        Server::builder()
                            .layer(faults.clone())
                            .layer(InboundLayer::new())
                            .layer(layer)
                            .add_service(svc)
                            .serve_with_incoming_shutdown(incoming, shutdown),
                    )
                }
            };
            drop(handle);
        } else {
            tokio::spawn(
                Server::builder()
                    .layer(faults.clone())
                    .add_service(svc)
                    .serve_with_incoming_shutdown(incoming, shutdown),
            );
        }
    }
    Ok((addrs, stops, stats))
}

fn client_channel(addrs: &[SocketAddr]) -> Channel {
    let endpoints = addrs.iter().map(|a| {
        Endpoint::from_shared(format!("http://{a}"))
            .expect("valid endpoint")
            .connect_timeout(Duration::from_secs(2))
    });
    Channel::balance_list(endpoints)
}

async fn run(
    o: &Options,
    with_idem: bool,
    config: &ServiceConfig,
    store: &Store,
) -> Result<RunReport, Box<dyn std::error::Error>> {
    let label = if with_idem {
        "with idem"
    } else {
        "without idem"
    };
    let ledger = Arc::new(Ledger::default());
    let faults = Faults {
        unavailable: o.unavailable,
        drop: o.drop,
        latency: o.latency,
        rng: Arc::new(Mutex::new(StdRng::seed_from_u64(o.seed))),
        attempts: Arc::new(AtomicU64::new(0)),
    };
    let (addrs, stops, server_stats) =
        start_servers(o, with_idem, config, ledger.clone(), faults.clone(), store).await?;

    // Without idem: the same retry policy, but no method is protected, so no key.
    let retry = if with_idem {
        RetryLayer::from_config(config)
    } else {
        let unprotected = strip_idempotency(config);
        RetryLayer::from_config(&unprotected)
    };
    let svc = ServiceBuilder::new()
        .layer(retry)
        .service(client_channel(&addrs));
    let client = OrdersClient::new(svc);

    let started = Instant::now();
    let done = Arc::new(AtomicU64::new(0));
    let app_calls = Arc::new(AtomicU64::new(0));
    let sem = Arc::new(tokio::sync::Semaphore::new(o.concurrency));
    let progress = {
        let done = done.clone();
        let total = o.intents as u64;
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(500));
            loop {
                tick.tick().await;
                let d = done.load(Ordering::Relaxed);
                eprint!("\r  {label:<13} {d:>6}/{total} intents");
                if d >= total {
                    eprintln!();
                    break;
                }
            }
        })
    };

    let mut tasks = Vec::with_capacity(o.intents);
    for n in 0..o.intents {
        let permit = sem.clone().acquire_owned().await?;
        let mut client = client.clone();
        let done = done.clone();
        let app_calls = app_calls.clone();
        let app_retries = o.app_retries;
        tasks.push(tokio::spawn(async move {
            let _permit = permit;
            let intent = format!("intent-{n}");
            // One business intent, one key: created here, reused by every retry.
            let key = IdempotencyKey::generate();
            let t0 = Instant::now();
            let mut ok = false;
            for _ in 0..=app_retries {
                app_calls.fetch_add(1, Ordering::Relaxed);
                let mut req = Request::new(CreateOrderRequest {
                    customer_id: format!("customer-{}", n % 97),
                    sku: "sku-42".into(),
                    quantity: 1,
                    note: intent.clone(),
                });
                if with_idem {
                    with_key(&mut req, &key);
                }
                match client.create_order(req).await {
                    Ok(_) => {
                        ok = true;
                        break;
                    }
                    Err(s) if s.code() == tonic::Code::Unavailable => continue,
                    Err(_) => break,
                }
            }
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
    let elapsed = started.elapsed();
    for s in stops {
        let _ = s.send(());
    }

    latencies.sort();
    let pct = |p: f64| latencies[((latencies.len() as f64 - 1.0) * p).round() as usize];
    let by_intent = ledger.orders_by_intent.lock().expect("ledger lock").clone();
    let orders: u64 = by_intent.values().map(|&c| u64::from(c)).sum();
    let duplicates: u64 = by_intent
        .values()
        .map(|&c| u64::from(c.saturating_sub(1)))
        .sum();
    // Lost: the caller never got an OK, or got one for an order that does not exist.
    let lost = (0..o.intents)
        .filter(|n| !by_intent.contains_key(&format!("intent-{n}")))
        .count() as u64
        + failed.iter().filter(|i| by_intent.contains_key(*i)).count() as u64;
    let replays = server_stats.iter().map(|s| s.snapshot().replayed).sum();
    Ok(RunReport {
        label,
        intents: o.intents,
        attempts: faults.attempts.load(Ordering::Relaxed),
        app_calls: app_calls.load(Ordering::Relaxed),
        replays,
        orders,
        duplicates,
        lost,
        p50: pct(0.50),
        p99: pct(0.99),
        elapsed,
    })
}

/// The same config with every `idempotency` object removed: no protected methods.
fn strip_idempotency(config: &ServiceConfig) -> ServiceConfig {
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

fn print_table(o: &Options, reports: &[RunReport]) {
    println!();
    println!(
        "{} intents, concurrency {}, faults: {:.0}% UNAVAILABLE before the handler, {:.0}% responses lost after it, +{} ms; seed {}; {} instance(s), {} store",
        o.intents,
        o.concurrency,
        o.unavailable * 100.0,
        o.drop * 100.0,
        o.latency.as_millis(),
        o.seed,
        o.instances,
        if o.redis.is_some() {
            "Redis"
        } else {
            "in-memory"
        }
    );
    println!();
    println!(
        "| {:<12} | {:>7} | {:>8} | {:>7} | {:>11} | {:>7} | {:>7} | {:>10} | {:>6} | {:>8} | {:>8} | {:>6} |",
        "run",
        "intents",
        "attempts",
        "retries",
        "app retries",
        "replays",
        "orders",
        "duplicates",
        "lost",
        "p50",
        "p99",
        "time"
    );
    println!(
        "|--------------|---------|----------|---------|-------------|---------|---------|------------|--------|----------|----------|--------|"
    );
    for r in reports {
        println!(
            "| {:<12} | {:>7} | {:>8} | {:>7} | {:>11} | {:>7} | {:>7} | {:>10} | {:>6} | {:>8} | {:>8} | {:>6} |",
            r.label,
            r.intents,
            r.attempts,
            r.attempts.saturating_sub(r.intents as u64),
            r.app_calls.saturating_sub(r.intents as u64),
            r.replays,
            r.orders,
            r.duplicates,
            r.lost,
            format!("{:.1}ms", r.p50.as_secs_f64() * 1e3),
            format!("{:.1}ms", r.p99.as_secs_f64() * 1e3),
            format!("{:.1}s", r.elapsed.as_secs_f64()),
        );
    }
    println!();
    println!(
        "attempts: calls that reached a server; retries: attempts beyond one per intent (client layer and application);"
    );
    println!(
        "app retries: calls the application made again after the client layer gave up (same key with idem);"
    );
    println!(
        "replays: duplicates answered from the idempotency store; duplicates: orders beyond one per intent;"
    );
    println!(
        "lost: intents whose caller never got an OK, or got one for an order that does not exist."
    );
}

#[tokio::main]
async fn main() {
    let o = match parse_args() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(2);
        }
    };
    let text = match &o.config {
        Some(path) => match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) => {
                eprintln!("cannot read {path}: {e}");
                std::process::exit(2);
            }
        },
        None => DEFAULT_CONFIG.to_owned(),
    };
    let config = match ServiceConfig::from_json(&text) {
        Ok(parsed) => {
            for w in &parsed.warnings {
                eprintln!("config warning: {w}");
            }
            parsed.config
        }
        Err(e) => {
            eprintln!("invalid config: {e}");
            std::process::exit(2);
        }
    };
    let store = match &o.redis {
        None => Store::Memory,
        Some(url) => match idem::redis::RedisStore::connect(url.clone()).await {
            Ok(s) => Store::Redis(s),
            Err(e) => {
                eprintln!("cannot connect to Redis at {url}: {e}");
                std::process::exit(2);
            }
        },
    };
    eprintln!(
        "idem demo: {} CreateOrder intents, twice (with idem, then without)",
        o.intents
    );
    let mut reports = Vec::new();
    for with_idem in [true, false] {
        match run(&o, with_idem, &config, &store).await {
            Ok(r) => reports.push(r),
            Err(e) => {
                eprintln!("run failed: {e}");
                std::process::exit(2);
            }
        }
    }
    print_table(&o, &reports);
    let idem = &reports[0];
    if idem.duplicates > 0 || idem.lost > 0 {
        eprintln!(
            "FAIL: with idem there were {} duplicate orders and {} lost intents",
            idem.duplicates, idem.lost
        );
        std::process::exit(1);
    }
    println!(
        "OK: with idem every intent took effect exactly once; without it, {} duplicate orders.",
        reports[1].duplicates
    );
}
