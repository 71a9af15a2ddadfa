//! Hedging around a slow instance: `cargo bench --bench hedging`.
//!
//! Three `Orders` instances behind `IdempotencyLayer` share one `MemoryStore`; a tonic
//! `Channel::balance_list` spreads calls over them. One instance stalls 200 ms on one
//! request in 20 (5 %). Each scenario sends the same calls (16 at a time), first without
//! a policy, then hedged (`maxAttempts` 3, `hedgingDelay` 10 ms), in the same run, and
//! reports latency percentiles, handler executions per intent (each call is one intent
//! with its own key: it must be 1.00) and the extra requests hedging sent per call.
//!
//! Two places for the stall:
//! - **instance**: before the idempotency layer (the request queues on a busy instance,
//!   a GC pause, a noisy neighbour): a hedge reaches another instance, which claims the
//!   key and runs the handler; the stalled request then finds the outcome and replays it.
//! - **handler**: inside the handler, after the key is claimed: the hedges wait for that
//!   same execution, so hedging cannot help (and should not: it would run twice).
//! - **nowhere**: no stall, the reference for the p50: with 16 callers that no stall holds
//!   up, a call competes with more of them for the cores. "callers in a fast call" (the
//!   mean number of callers in a call under 5 ms, by Little's law) shows that load.
//!
//! Then what losing hedges cost a server while they wait: an idem server on a runtime
//! with **one** worker thread serves unrelated (unprotected) `GetOrder` calls, 16 at a
//! time, alone and while 64 hedged `CreateOrder` calls wait at a gate in their handler
//! (64 runs and 128 hedges waiting for them), in alternating phases; the table gives the
//! median throughput of each kind of phase, its ratio to the phases alone, and the tasks
//! alive on the server's runtime.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use idem_client::retry::{Retry, RetryLayer};
use idem_core::config::ServiceConfig;
use idem_server::idempotency::{IdempotencyLayer, tenant::SingleTenant};
use idem_store::memory::MemoryStore;
use idem_test_support::net;
use idem_test_support::one_worker::OneWorker;
use idem_test_support::shop::orders_client::OrdersClient;
use idem_test_support::shop::orders_server::OrdersServer;
use idem_test_support::shop::{self, CreateOrderRequest, Order};
use idem_test_support::shop_fake;
use tonic::Response;
use tonic::body::Body;
use tonic::transport::{Channel, Endpoint, Server};
use tower::Service;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

const CALLS: usize = 4_000;
const CONCURRENCY: usize = 16;
const STALL: Duration = Duration::from_millis(200);
/// One request in `EVERY` to the slow instance stalls.
const EVERY: u64 = 20;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Stall {
    Instance,
    Handler,
    /// No instance stalls: what hedging costs a call that needs no hedge.
    Never,
}

/// Counts one request in `EVERY` of an instance.
#[derive(Clone)]
struct Slow(Option<Arc<AtomicU64>>);

impl Slow {
    fn now(&self) -> bool {
        self.0
            .as_ref()
            .is_some_and(|n| n.fetch_add(1, Ordering::Relaxed) % EVERY == EVERY - 1)
    }
}

#[derive(Clone)]
struct Shop {
    runs: Arc<AtomicU64>,
    slow: Slow,
}

idem_test_support::create_only_orders! {
    Shop, why = "";
    create_order(&self, _) {
        self.runs.fetch_add(1, Ordering::Relaxed);
        if self.slow.now() {
            tokio::time::sleep(STALL).await;
        }
        Ok(Response::new(Order {
            order_id: "o-1".into(),
            ..Default::default()
        }))
    }
}

/// Stalls a request before the layers below see it.
#[derive(Clone)]
struct StallLayer(Slow);

#[derive(Clone)]
struct Stalled<S> {
    inner: S,
    slow: Slow,
}

impl<S> tower::Layer<S> for StallLayer {
    type Service = Stalled<S>;
    fn layer(&self, inner: S) -> Stalled<S> {
        Stalled {
            inner,
            slow: self.0.clone(),
        }
    }
}

impl<S> Service<http::Request<Body>> for Stalled<S>
where
    S: Service<http::Request<Body>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Into<BoxError>,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let stall = self.slow.now();
        Box::pin(async move {
            if stall {
                tokio::time::sleep(STALL).await;
            }
            inner.call(req).await.map_err(Into::into)
        })
    }
}

fn config(hedged: bool) -> ServiceConfig {
    let policy = if hedged {
        r#""hedgingPolicy": {"maxAttempts": 3, "hedgingDelay": "0.01s", "nonFatalStatusCodes": ["UNAVAILABLE"]},"#
    } else {
        ""
    };
    ServiceConfig::from_json(&format!(
        r#"{{"methodConfig": [{{"name": [{{"service": "shop.v1.Orders"}}], {policy} "idempotency": {{}}}}]}}"#
    ))
    .unwrap()
}

/// Three instances (the last one slow), sharing a store; their handler runs counter.
async fn instances(stall: Stall) -> (Vec<std::net::SocketAddr>, Arc<AtomicU64>) {
    let store = MemoryStore::default();
    let runs = Arc::new(AtomicU64::new(0));
    let mut addrs = Vec::new();
    for i in 0..3 {
        let slow = |here| Slow((i == 2 && stall == here).then(|| Arc::new(AtomicU64::new(0))));
        let shop = Shop {
            runs: runs.clone(),
            slow: slow(Stall::Handler),
        };
        let idem =
            IdempotencyLayer::new(store.clone(), &config(false)).tenant(SingleTenant::new("t"));
        let (addr, incoming) = net::bind().await;
        let router = Server::builder()
            .layer(StallLayer(slow(Stall::Instance)))
            .layer(idem)
            .add_service(OrdersServer::new(shop));
        tokio::spawn(router.serve_with_incoming(incoming));
        addrs.push(addr);
    }
    (addrs, runs)
}

struct Row {
    latencies: Vec<Duration>,
    runs_per_intent: f64,
    extra_per_call: f64,
    /// Wall time of the run.
    elapsed: Duration,
    /// Calls that failed (every call should succeed).
    failed: usize,
}

/// A call under this is not held up by a stall (a hedge answers 10 ms in).
const FAST: Duration = Duration::from_millis(5);

impl Row {
    fn calls_per_s(&self) -> f64 {
        self.latencies.len() as f64 / self.elapsed.as_secs_f64()
    }
    /// How many of the 16 callers were in a fast call at a time, on average (Little's
    /// law over the calls under [`FAST`]): the load a fast call competes with for the
    /// two cores, which is what its latency (the p50) follows.
    fn callers_in_fast_calls(&self) -> f64 {
        let busy: Duration = self.latencies.iter().filter(|l| **l < FAST).sum();
        busy.as_secs_f64() / self.elapsed.as_secs_f64()
    }
}

async fn run(stall: Stall, hedged: bool) -> Row {
    let (addrs, runs) = instances(stall).await;
    let endpoints = addrs
        .iter()
        .map(|a| Endpoint::from_shared(format!("http://{a}")).unwrap());
    let channel = Channel::balance_list(endpoints);
    let layer = RetryLayer::from_config(&config(hedged));
    let client = OrdersClient::new(
        tower::ServiceBuilder::new()
            .layer(layer.clone())
            .service(channel),
    );
    // Warm the connections.
    for _ in 0..30 {
        client.clone().create_order(request()).await.unwrap();
    }
    let (runs0, stats0) = (runs.load(Ordering::Relaxed), layer.stats().snapshot());
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..CONCURRENCY {
        let mut c = client.clone();
        tasks.push(tokio::spawn(async move {
            let mut lat = Vec::with_capacity(CALLS / CONCURRENCY);
            let mut failed = Vec::new();
            for _ in 0..CALLS / CONCURRENCY {
                let start = Instant::now();
                if let Err(status) = c.create_order(request()).await {
                    failed.push(status);
                }
                lat.push(start.elapsed());
            }
            (lat, failed)
        }));
    }
    let mut latencies = Vec::with_capacity(CALLS);
    let mut failed = Vec::new();
    for t in tasks {
        let (lat, f) = t.await.unwrap();
        latencies.extend(lat);
        failed.extend(f);
    }
    // A failed call is counted and its first status shown, not hidden (nor a panic that
    // hides the other rows).
    if let Some(first) = failed.first() {
        eprintln!(
            "{stall:?}, hedged {hedged}: {} of {CALLS} calls failed; the first: {first:?}",
            failed.len()
        );
    }
    let elapsed = started.elapsed();
    // Stalled requests that lost their race still finish on the server: let them.
    tokio::time::sleep(STALL * 2).await;
    let stats = layer.stats().snapshot();
    let calls = (stats.calls - stats0.calls) as f64;
    latencies.sort();
    Row {
        latencies,
        runs_per_intent: (runs.load(Ordering::Relaxed) - runs0) as f64 / calls,
        extra_per_call: ((stats.attempts - stats0.attempts) as f64 - calls) / calls,
        elapsed,
        failed: failed.len(),
    }
}

fn request() -> CreateOrderRequest {
    CreateOrderRequest {
        customer_id: "c-1".into(),
        sku: "sku-1".into(),
        quantity: 1,
        note: String::new(),
    }
}

fn pct(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i]
}

fn ms(d: Duration) -> String {
    format!("{:.1}", d.as_secs_f64() * 1000.0)
}

// ---------------------------------------------------------------- parked losing hedges

/// Unrelated calls per phase, hedged calls parked at the gate, phases with them parked.
const UNRELATED: usize = 10_000;
const PARKED: usize = 64;
const ROUNDS: usize = 4;

/// Sorts `rates` and returns the median.
fn median(rates: &mut [f64]) -> f64 {
    rates.sort_by(f64::total_cmp);
    let n = rates.len();
    if n % 2 == 1 {
        rates[n / 2]
    } else {
        (rates[n / 2 - 1] + rates[n / 2]) / 2.0
    }
}

/// `CreateOrder` protected (hedged when `hedged`); `GetOrder` neither.
fn create_only(hedged: bool) -> ServiceConfig {
    let policy = if hedged {
        r#""hedgingPolicy": {"maxAttempts": 3, "hedgingDelay": "0.005s", "nonFatalStatusCodes": ["UNAVAILABLE"]},"#
    } else {
        ""
    };
    ServiceConfig::from_json(&format!(
        r#"{{"methodConfig": [{{"name": [{{"service": "shop.v1.Orders", "method": "CreateOrder"}}], {policy} "idempotency": {{}}}}]}}"#
    ))
    .unwrap()
}

/// `GetOrder` calls, 16 at a time: calls per second.
async fn unrelated(client: &OrdersClient<Channel>) -> f64 {
    let start = Instant::now();
    let tasks: Vec<_> = (0..CONCURRENCY)
        .map(|_| {
            let mut c = client.clone();
            tokio::spawn(async move {
                for _ in 0..UNRELATED / CONCURRENCY {
                    let req = shop::GetOrderRequest {
                        order_id: "o".into(),
                    };
                    c.get_order(req).await.unwrap();
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    UNRELATED as f64 / start.elapsed().as_secs_f64()
}

async fn until(mut f: impl FnMut() -> bool) {
    while !f() {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

async fn parked_hedges() {
    let server = OneWorker::start(&create_only(false)).await;
    let (addr, shop, layer) = (server.addr, &server.shop, &server.layer);
    let tasks = || server.alive_tasks();
    let plain = OrdersClient::new(net::channel(addr));
    let retry = RetryLayer::from_config(&create_only(true));
    let hedged = OrdersClient::new(Retry::new(net::channel(addr), &retry));
    // Warm both connections.
    for _ in 0..100 {
        plain
            .clone()
            .get_order(shop::GetOrderRequest::default())
            .await
            .unwrap();
    }
    hedged
        .clone()
        .create_order(shop_fake::create("warm"))
        .await
        .unwrap();
    until(|| server.in_progress() == 0).await;

    // Warm the server's path for unrelated calls, then alternate: alone, with the
    // hedged calls parked, alone again (each hedged call's gate opened and its answer
    // awaited in between).
    unrelated(&plain).await;
    let (mut alone, mut parked) = (Vec::new(), Vec::new());
    let (mut alone_tasks, mut parked_tasks) = (0, 0);
    for round in 0..=ROUNDS {
        alone.push(unrelated(&plain).await);
        alone_tasks = alone_tasks.max(tasks());
        if round == ROUNDS {
            break;
        }
        let calls: Vec<_> = (0..PARKED)
            .map(|_| {
                let mut c = hedged.clone();
                tokio::spawn(async move { c.create_order(shop_fake::create("gate")).await })
            })
            .collect();
        until(|| {
            server.in_progress() == 3 * PARKED as i64
                && layer.stats().snapshot().waited == 2 * PARKED as u64 * (round as u64 + 1)
        })
        .await;
        parked_tasks = parked_tasks.max(tasks());
        parked.push(unrelated(&plain).await);
        shop.open_gate(PARKED);
        for c in calls {
            c.await.unwrap().unwrap();
        }
        until(|| server.in_progress() == 0 && layer.handlers_in_flight() == 0).await;
    }
    let base = median(&mut alone);
    println!(
        "\n{UNRELATED} unrelated GetOrder calls per phase, {CONCURRENCY} at a time, on an idem server with 1 worker thread; {} phases alone, {ROUNDS} with hedged calls parked, alternating\n",
        ROUNDS + 1
    );
    println!(
        "| parked on the server | unrelated calls / s (median) | min – max | ratio to alone | server tasks alive |"
    );
    println!("|---|---|---|---|---|");
    for (what, rates, tasks) in [
        ("nothing", &mut alone, alone_tasks),
        (
            "64 runs at a gate, 128 losing hedges waiting",
            &mut parked,
            parked_tasks,
        ),
    ] {
        let m = median(rates);
        println!(
            "| {what} | {m:.0} | {:.0} – {:.0} | {:.2} | {tasks} |",
            rates[0],
            rates[rates.len() - 1],
            m / base
        );
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    println!(
        "{CALLS} calls, {CONCURRENCY} at a time; 3 instances, one stalls {} ms on 1 request in {EVERY}\n",
        STALL.as_millis()
    );
    println!(
        "| stall in | policy | p50 ms | p99 ms | p99.9 ms | handler runs / intent | extra requests / call | calls/s | callers in a fast call (mean of 16) | failed calls |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for stall in [Stall::Instance, Stall::Handler, Stall::Never] {
        for hedged in [false, true] {
            let row = run(stall, hedged).await;
            let l = &row.latencies;
            println!(
                "| {} | {} | {} | {} | {} | {:.2} | {:.3} | {:.0} | {:.1} | {} |",
                match stall {
                    Stall::Instance => "instance (before the key is claimed)",
                    Stall::Handler => "handler (after the key is claimed)",
                    Stall::Never => "nowhere (no instance stalls)",
                },
                if hedged { "hedging 3 × 10 ms" } else { "none" },
                ms(pct(l, 0.50)),
                ms(pct(l, 0.99)),
                ms(pct(l, 0.999)),
                row.runs_per_intent,
                row.extra_per_call,
                row.calls_per_s(),
                row.callers_in_fast_calls(),
                row.failed,
            );
        }
    }
    parked_hedges().await;
}
