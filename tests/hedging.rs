//! End-to-end tests of hedging in the client layer (`idem-client`, A6 `hedgingPolicy`):
//! real tonic `Orders` servers on 127.0.0.1, one per instance, each following a script
//! (wait, then answer or fail) and recording what every request carried and whether
//! its handler ran to the end or was cancelled. A router below the layer sends hedge
//! *n* (its `grpc-previous-rpc-attempts`) to instance *n* mod the number of instances,
//! so which instance gets which hedge is fixed.
//!
//! Streaming requests (i) go to `stream.v1.Tally` instances the same way, whose handlers
//! record the numbers each hedge delivered and how they ended, with a tap before the
//! idempotency layer recording each request's bytes. (j) tests `waitForReady` against a
//! real port that opens later; (k) parks losing hedges on a one-worker idem server.
//!
//! Timing is asserted on tokio's paused clock: the servers run in the same runtime, and
//! loopback I/O takes no virtual time. (j) and (k) run on real time and assert no
//! durations beyond lower bounds (their waits are bounded by generous timeouts).

use idem_test_support::net;
use idem_test_support::one_worker::OneWorker;
use idem_test_support::shop;
use idem_test_support::shop_fake;
use idem_test_support::stream::tally_client::TallyClient;
use idem_test_support::stream::tally_server::{Tally, TallyServer};
use idem_test_support::stream::{Number, Total, number, padded};

use std::collections::VecDeque;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::BodyExt;
use idem_client::retry::{AttemptEnd, CallOutcome, CallReport, Retry, RetryLayer};
use idem_core::config::ServiceConfig;
use idem_core::deadline::parse_grpc_timeout;
use idem_server::idempotency::{IdempotencyLayer, tenant::SingleTenant};
use idem_store::memory::MemoryStore;
use shop::orders_client::OrdersClient;
use shop::orders_server::OrdersServer;
use shop::{CreateOrderRequest, Order};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tonic::body::Body;
use tonic::transport::{Channel, Server};
use tonic::{Code, Request, Response, Status};
use tower::layer::layer_fn;
use tower::{Service, ServiceExt};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

// ---------------------------------------------------------------- the instances

/// What an instance does with one request: wait, then answer.
#[derive(Clone)]
struct Step {
    wait: Duration,
    answer: Result<(), Status>,
}

fn ok_after(ms: u64) -> Step {
    Step {
        wait: Duration::from_millis(ms),
        answer: Ok(()),
    }
}

fn fail_after(ms: u64, status: Status) -> Step {
    Step {
        wait: Duration::from_millis(ms),
        answer: Err(status),
    }
}

fn unavailable(pushback: Option<&'static str>) -> Status {
    let mut s = Status::unavailable("busy");
    if let Some(v) = pushback {
        s.metadata_mut()
            .insert("grpc-retry-pushback-ms", v.parse().unwrap());
    }
    s
}

/// One request as an instance saw it.
#[derive(Debug, Clone)]
struct Seen {
    instance: usize,
    at: Instant,
    key: Option<String>,
    hedge: u32,
    timeout: Option<Duration>,
}

/// What every instance saw and did, in order.
#[derive(Clone, Default)]
struct Log {
    seen: Arc<Mutex<Vec<Seen>>>,
    /// Handlers that ran to the end, by instance.
    finished: Arc<Mutex<Vec<usize>>>,
    /// Handlers dropped before their end (the client cancelled the hedge), by instance.
    cancelled: Arc<Mutex<Vec<usize>>>,
}

impl Log {
    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }
    fn finished(&self) -> Vec<usize> {
        self.finished.lock().unwrap().clone()
    }
    fn cancelled(&self) -> Vec<usize> {
        self.cancelled.lock().unwrap().clone()
    }
    /// Waits (virtual time) until `n` handlers were cancelled: the reset travels over
    /// loopback after the call ended.
    async fn await_cancelled(&self, n: usize) -> Vec<usize> {
        for _ in 0..100 {
            if self.cancelled().len() >= n {
                break;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        self.cancelled()
    }
}

/// Records a handler dropped before it finished.
struct Running {
    log: Log,
    instance: usize,
    done: bool,
}

impl Drop for Running {
    fn drop(&mut self) {
        let list = if self.done {
            &self.log.finished
        } else {
            &self.log.cancelled
        };
        list.lock().unwrap().push(self.instance);
    }
}

#[derive(Clone)]
struct Instance {
    id: usize,
    script: Arc<Mutex<VecDeque<Step>>>,
    log: Log,
}

idem_test_support::create_only_orders! {
    Instance, why = "not in these tests";
    create_order(&self, request) {
        let md = request.metadata();
        self.log.seen.lock().unwrap().push(Seen {
            instance: self.id,
            at: Instant::now(),
            key: md
                .get("x-idempotency-key")
                .map(|v| v.to_str().unwrap().to_owned()),
            hedge: hedge_of(md.as_ref()),
            timeout: md
                .get("grpc-timeout")
                .and_then(|v| parse_grpc_timeout(v.as_bytes())),
        });
        let step = self
            .script
            .lock()
            .unwrap()
            .pop_front()
            .unwrap_or(ok_after(0));
        let mut running = Running {
            log: self.log.clone(),
            instance: self.id,
            done: false,
        };
        tokio::time::sleep(step.wait).await;
        running.done = true;
        // The handlers of this instance that finished before this one.
        let runs = self
            .log
            .finished()
            .iter()
            .filter(|i| **i == self.id)
            .count();
        step.answer.map(|()| {
            Response::new(Order {
                order_id: format!("o-{}-{runs}", self.id),
                created_by: "test".into(),
                ..Default::default()
            })
        })
    }
}

/// Serves one instance per script; `idem`: behind an `IdempotencyLayer` on that store
/// (shared by every instance, as instances share Redis in production), with what the
/// layer answered recorded in `Answers`.
async fn instances(
    scripts: Vec<Vec<Step>>,
    idem: Option<(MemoryStore, Answers)>,
) -> (Vec<SocketAddr>, Log) {
    let log = Log::default();
    let mut addrs = Vec::new();
    for (id, script) in scripts.into_iter().enumerate() {
        let instance = Instance {
            id,
            script: Arc::new(Mutex::new(script.into())),
            log: log.clone(),
        };
        let (addr, incoming) = net::bind().await;
        let svc = OrdersServer::new(instance);
        match &idem {
            None => tokio::spawn(
                Server::builder()
                    .add_service(svc)
                    .serve_with_incoming(incoming),
            ),
            Some((store, answers)) => {
                let layer = IdempotencyLayer::new(store.clone(), &config(r#""maxAttempts": 2"#))
                    .tenant(SingleTenant::new("t"));
                let answers = answers.clone();
                let recorder = layer_fn(move |inner| Recorder {
                    inner,
                    answers: answers.clone(),
                });
                tokio::spawn(
                    Server::builder()
                        .layer(recorder)
                        .layer(layer)
                        .add_service(svc)
                        .serve_with_incoming(incoming),
                )
            }
        };
        addrs.push(addr);
    }
    (addrs, log)
}

// ---------------------------------------------------------------- the router

/// Sends hedge *n* to instance *n* mod the count; answers of the hedges in `late` reach
/// the layer that much later (a slow network path on the client's side).
#[derive(Clone)]
struct Router {
    channels: Vec<Channel>,
    late: Vec<(u32, Duration)>,
}

impl Service<http::Request<Body>> for Router {
    type Response = http::Response<Body>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        let hedge = hedge_of(req.headers());
        let channel = self.channels[hedge as usize % self.channels.len()].clone();
        let late = self.late.iter().find(|(h, _)| *h == hedge).map(|(_, d)| *d);
        Box::pin(async move {
            let resp = channel.oneshot(req).await?;
            if let Some(d) = late {
                tokio::time::sleep(d).await;
            }
            Ok(resp)
        })
    }
}

impl Router {
    /// To `addrs`, no answer late.
    fn to(addrs: &[SocketAddr]) -> Self {
        Router {
            channels: addrs.iter().map(|a| net::channel(*a)).collect(),
            late: vec![],
        }
    }
}

/// The hedge a request is: its `grpc-previous-rpc-attempts` (none on hedge 0).
fn hedge_of(headers: &http::HeaderMap) -> u32 {
    headers
        .get("grpc-previous-rpc-attempts")
        .map_or(0, |v| v.to_str().unwrap().parse().unwrap())
}

type Client = OrdersClient<Retry<Router>>;

/// `shop.v1.Orders/CreateOrder`, protected, hedged with `hedging` (the JSON fields of a
/// `hedgingPolicy`); `extra`: more top-level fields (`timeout` goes in the method).
fn config_with(hedging: &str, timeout: Option<&str>, throttling: Option<&str>) -> ServiceConfig {
    let timeout = timeout.map_or(String::new(), |t| format!(r#""timeout": "{t}","#));
    let throttling = throttling.map_or(String::new(), |t| format!(r#","retryThrottling": {t}"#));
    ServiceConfig::from_json(&format!(
        r#"{{"methodConfig": [{{
            "name": [{{"service": "shop.v1.Orders", "method": "CreateOrder"}}],
            {timeout}
            "hedgingPolicy": {{ {hedging} }},
            "idempotency": {{}}
        }}]{throttling}}}"#
    ))
    .unwrap()
}

fn config(hedging: &str) -> ServiceConfig {
    config_with(hedging, None, None)
}

/// The fields of a `hedgingPolicy`: `max` hedges, `delay` apart, UNAVAILABLE non-fatal.
fn policy(max: u32, delay: &str) -> String {
    format!(
        r#""maxAttempts": {max}, "hedgingDelay": "{delay}", "nonFatalStatusCodes": ["UNAVAILABLE"]"#
    )
}

fn retry_layer(cfg: &ServiceConfig) -> RetryLayer {
    RetryLayer::builder()
        .service_config(cfg.clone())
        .build()
        .unwrap()
}

fn client(addrs: &[SocketAddr], cfg: &ServiceConfig, late: Vec<(u32, Duration)>) -> Client {
    let router = Router {
        late,
        ..Router::to(addrs)
    };
    OrdersClient::new(Retry::new(router, &retry_layer(cfg)))
}

/// A client on `cfg`, and its layer (for its throttle and counters).
fn client_and_layer(addrs: &[SocketAddr], cfg: &ServiceConfig) -> (Client, RetryLayer) {
    let layer = retry_layer(cfg);
    (
        OrdersClient::new(Retry::new(Router::to(addrs), &layer)),
        layer,
    )
}

/// One instance per step, the step its first request's, and a client hedging
/// `CreateOrder` to them with [`policy`]`(max, delay)`.
async fn hedged(steps: impl IntoIterator<Item = Step>, max: u32, delay: &str) -> (Client, Log) {
    hedged_with(steps, &config(&policy(max, delay))).await
}

/// [`hedged`], the client on `cfg`.
async fn hedged_with(steps: impl IntoIterator<Item = Step>, cfg: &ServiceConfig) -> (Client, Log) {
    let scripts = steps.into_iter().map(|step| vec![step]).collect();
    let (addrs, log) = instances(scripts, None).await;
    (client(&addrs, cfg, vec![]), log)
}

fn create() -> CreateOrderRequest {
    CreateOrderRequest {
        customer_id: "c-1".into(),
        sku: "sku-1".into(),
        quantity: 1,
        note: String::new(),
    }
}

fn report_of(status: &Status) -> CallReport {
    CallReport::from_status(status).unwrap_or_else(|| panic!("no report on {status:?}"))
}

/// Asserts a call committed after `hedges` hedges, won by hedge `winner`; its report.
#[track_caller]
fn assert_won<T>(resp: &Response<T>, hedges: u32, winner: u32) -> CallReport {
    let report = CallReport::from_response(resp).unwrap();
    assert_eq!(
        (report.hedges(), report.winner()),
        (Some(hedges), Some(winner)),
        "{report}"
    );
    report
}

/// Asserts a call failed with `code`, its report saying `outcome` after `hedges` hedges;
/// its report.
#[track_caller]
fn assert_failed(status: &Status, code: Code, outcome: CallOutcome, hedges: u32) -> CallReport {
    assert_eq!(status.code(), code, "{status:?}");
    let report = report_of(status);
    assert_eq!(
        (report.outcome, report.hedges()),
        (outcome, Some(hedges)),
        "{report}"
    );
    report
}

fn ends(report: &CallReport) -> Vec<AttemptEnd> {
    report.history().map(|r| r.end).collect()
}

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// The gaps between the requests the instances saw, in the order they came.
fn gaps(seen: &[Seen]) -> Vec<Duration> {
    seen.windows(2).map(|w| w[1].at - w[0].at).collect()
}

// ---------------------------------------------------------------- (a) slow instance

#[tokio::test(start_paused = true)]
async fn a_slow_instance_is_hedged_around_with_the_same_key_on_both_hedges() {
    let (mut c, log) = hedged(vec![ok_after(1000), ok_after(0)], 2, "0.05s").await;
    let start = Instant::now();
    let resp = c.create_order(create()).await.unwrap();
    let took = start.elapsed();
    assert!(took >= ms(50) && took < ms(60), "{took:?}");
    assert_eq!(resp.get_ref().order_id, "o-1-0");
    let report = assert_won(&resp, 2, 1);
    assert_eq!(report.outcome, CallOutcome::Committed);
    assert_eq!(
        ends(&report),
        [AttemptEnd::Cancelled, AttemptEnd::Committed]
    );
    assert_eq!(report.history().next().unwrap().wait_after, Some(ms(50)));
    let seen = log.seen();
    assert_eq!(seen.len(), 2);
    assert_eq!((seen[0].instance, seen[0].hedge), (0, 0));
    assert_eq!((seen[1].instance, seen[1].hedge), (1, 1));
    assert!(seen[0].key.is_some());
    assert_eq!(seen[0].key, seen[1].key, "one key per call, on every hedge");
    assert_eq!(gaps(&seen), [ms(50)]);
    // The slow hedge was cancelled: its handler never finished.
    assert_eq!(log.await_cancelled(1).await, [0]);
    assert_eq!(log.finished(), [1]);
    assert!(
        report
            .to_string()
            .starts_with("committed after 2 hedges, won by hedge 1: cancelled in"),
        "{report}"
    );
}

// ---------------------------------------------------------------- (b) fatal code

#[tokio::test(start_paused = true)]
async fn a_fatal_code_ends_the_call_and_cancels_the_other_hedges() {
    let steps = [
        ok_after(10_000),
        fail_after(5, Status::invalid_argument("bad order")),
        ok_after(0),
    ];
    let (mut c, log) = hedged(steps, 3, "0.05s").await;
    let start = Instant::now();
    let err = c.create_order(create()).await.unwrap_err();
    assert_eq!(start.elapsed(), ms(55));
    let report = assert_failed(
        &err,
        Code::InvalidArgument,
        CallOutcome::NonRetryableCode,
        2,
    );
    assert_eq!(report.winner(), None);
    assert_eq!(
        ends(&report),
        [
            AttemptEnd::Cancelled,
            AttemptEnd::Status(Code::InvalidArgument)
        ]
    );
    assert_eq!(log.await_cancelled(1).await, [0]);
    // No third hedge, ever.
    tokio::time::sleep(ms(500)).await;
    assert_eq!(log.seen().len(), 2);
}

// ---------------------------------------------------------------- (c) non-fatal code

#[tokio::test(start_paused = true)]
async fn a_non_fatal_code_sends_the_next_hedge_at_once_and_the_one_after_a_delay_later() {
    let steps = [
        fail_after(10, unavailable(None)),
        ok_after(5_000),
        ok_after(20),
    ];
    let (mut c, log) = hedged(steps, 3, "1s").await;
    let start = Instant::now();
    let resp = c.create_order(create()).await.unwrap();
    // Hedge 1 right after hedge 0 failed (10 ms, not 1 s); hedge 2 one hedgingDelay later.
    assert_eq!(gaps(&log.seen()), [ms(10), ms(1000)]);
    assert_eq!(start.elapsed(), ms(1030));
    assert_eq!(resp.get_ref().order_id, "o-2-0");
    let report = assert_won(&resp, 3, 2);
    assert_eq!(
        ends(&report),
        [
            AttemptEnd::Status(Code::Unavailable),
            AttemptEnd::Cancelled,
            AttemptEnd::Committed
        ]
    );
    let waits: Vec<_> = report.history().map(|r| r.wait_after).collect();
    assert_eq!(waits, [Some(ms(10)), Some(ms(1000)), None]);
    assert_eq!(log.await_cancelled(1).await, [1]);
}

#[tokio::test(start_paused = true)]
async fn a_non_fatal_code_sends_the_next_hedge_at_once_even_when_the_delay_ends_past_the_deadline()
{
    // The 5 s hedgingDelay ends past the 1 s deadline: no hedge on the timer, but the
    // failure still sends the next one.
    let cfg = config_with(&policy(3, "5s"), Some("1s"), None);
    let (mut c, log) =
        hedged_with(vec![fail_after(10, unavailable(None)), ok_after(0)], &cfg).await;
    let start = Instant::now();
    let resp = c.create_order(create()).await.unwrap();
    assert_eq!(start.elapsed(), ms(10));
    assert_eq!(gaps(&log.seen()), [ms(10)]);
    assert_won(&resp, 2, 1);
}

// ---------------------------------------------------------------- (d) maxAttempts

#[tokio::test(start_paused = true)]
async fn max_attempts_bounds_the_hedges_when_every_one_fails() {
    let (mut c, log) = hedged(vec![fail_after(30, unavailable(None)); 4], 3, "0.01s").await;
    let err = c.create_order(create()).await.unwrap_err();
    let report = assert_failed(&err, Code::Unavailable, CallOutcome::AttemptsExhausted, 3);
    assert_eq!(report.winner(), None);
    assert_eq!(ends(&report), [AttemptEnd::Status(Code::Unavailable); 3]);
    tokio::time::sleep(ms(500)).await;
    assert_eq!(log.seen().len(), 3);
}

#[tokio::test(start_paused = true)]
async fn max_attempts_bounds_the_hedges_of_a_slow_call_and_the_first_answer_wins() {
    let (mut c, log) = hedged(vec![ok_after(1000); 4], 3, "0.01s").await;
    let resp = c.create_order(create()).await.unwrap();
    assert_won(&resp, 3, 0);
    assert_eq!(gaps(&log.seen()), [ms(10), ms(10)]);
    assert_eq!(log.await_cancelled(2).await.len(), 2);
    assert_eq!(log.seen().len(), 3);
}

#[tokio::test(start_paused = true)]
async fn a_zero_hedging_delay_sends_every_hedge_at_once() {
    let cfg = config(r#""maxAttempts": 4, "nonFatalStatusCodes": ["UNAVAILABLE"]"#);
    let (mut c, log) = hedged_with(vec![ok_after(100); 2], &cfg).await;
    c.create_order(create()).await.unwrap();
    assert_eq!(gaps(&log.seen()), [Duration::ZERO; 3]);
    let mut hedges: Vec<_> = log.seen().iter().map(|s| s.hedge).collect();
    hedges.sort();
    assert_eq!(
        hedges,
        [0, 1, 2, 3],
        "grpc-previous-rpc-attempts is the hedge's index"
    );
}

// ---------------------------------------------------------------- (e) pushback

#[tokio::test(start_paused = true)]
async fn a_positive_pushback_delays_the_next_hedge_by_exactly_that() {
    let (mut c, log) = hedged(
        vec![fail_after(10, unavailable(Some("300"))), ok_after(0)],
        2,
        "5s",
    )
    .await;
    let resp = c.create_order(create()).await.unwrap();
    assert_eq!(gaps(&log.seen()), [ms(310)]);
    assert_won(&resp, 2, 1);
}

#[tokio::test(start_paused = true)]
async fn after_a_pushback_the_hedge_after_next_comes_a_hedging_delay_later() {
    // A6: "Send next hedged request in n ms. Subsequent hedged requests will resume at
    // n + hedgingDelay."
    let steps = [
        fail_after(10, unavailable(Some("300"))),
        ok_after(1000),
        ok_after(0),
    ];
    let (mut c, log) = hedged(steps, 3, "0.1s").await;
    let start = Instant::now();
    let resp = c.create_order(create()).await.unwrap();
    assert_eq!(start.elapsed(), ms(410));
    assert_eq!(gaps(&log.seen()), [ms(310), ms(100)]);
    assert_won(&resp, 3, 2);
}

#[tokio::test(start_paused = true)]
async fn a_negative_pushback_stops_the_hedges_and_the_ones_out_go_on() {
    // Alone: the call ends with the hedge's status.
    let (mut c, log) = hedged(vec![fail_after(10, unavailable(Some("-1")))], 3, "0.05s").await;
    let err = c.create_order(create()).await.unwrap_err();
    assert_failed(&err, Code::Unavailable, CallOutcome::PushbackStop, 1);
    tokio::time::sleep(ms(500)).await;
    assert_eq!(log.seen().len(), 1);

    // With a hedge out: no third hedge; the first still answers.
    let steps = [
        ok_after(500),
        fail_after(10, unavailable(Some("-1"))),
        ok_after(0),
    ];
    let (mut c, log) = hedged(steps, 3, "0.05s").await;
    let start = Instant::now();
    let resp = c.create_order(create()).await.unwrap();
    assert_eq!(start.elapsed(), ms(500));
    assert_won(&resp, 2, 0);
    assert_eq!(log.seen().len(), 2);
}

// ---------------------------------------------------------------- (f) throttling

/// One instance (every hedge goes to it) whose first request fails UNAVAILABLE after
/// 10 ms and whose next ones answer after `oks` ms, and a client hedging `max` times
/// 20 ms apart under a throttle of 2 tokens with `token_ratio`.
async fn throttled(max: u32, token_ratio: &str, oks: &[u64]) -> (Client, RetryLayer, Log) {
    let mut script = vec![fail_after(10, unavailable(None))];
    script.extend(oks.iter().map(|ms| ok_after(*ms)));
    let (addrs, log) = instances(vec![script], None).await;
    let throttling = format!(r#"{{"maxTokens": 2, "tokenRatio": {token_ratio}}}"#);
    let cfg = config_with(&policy(max, "0.02s"), None, Some(&throttling));
    let (c, layer) = client_and_layer(&addrs, &cfg);
    (c, layer, log)
}

#[tokio::test(start_paused = true)]
async fn the_throttle_counts_failed_hedges_and_stops_the_next_ones() {
    // maxTokens 2: one failure leaves 1 token, at the half: no more hedges.
    let (mut c, _, log) = throttled(3, "0.1", &[100, 0]).await;
    let err = c.create_order(create()).await.unwrap_err();
    assert_failed(&err, Code::Unavailable, CallOutcome::Throttled, 1);

    // The next call: its first request always goes out, its hedges do not.
    let resp = c.create_order(create()).await.unwrap();
    assert_won(&resp, 1, 0);
    assert_eq!(log.seen().len(), 2);
}

#[tokio::test(start_paused = true)]
async fn the_throttle_refills_with_successes_and_hedging_resumes() {
    // tokenRatio 1: a failure leaves 1 token (the half: no hedges), a success brings it
    // back to 2 (over the half: hedges again).
    let (mut c, layer, log) = throttled(2, "1", &[100, 100, 0]).await;
    let tokens = || layer.throttle().unwrap().milli_tokens();
    let err = c.create_order(create()).await.unwrap_err();
    assert_eq!(report_of(&err).outcome, CallOutcome::Throttled);
    assert_eq!(tokens(), 1_000);
    // Throttled: the slow call gets no hedge, and its success refills the bucket.
    let resp = c.create_order(create()).await.unwrap();
    assert_eq!(CallReport::from_response(&resp).unwrap().hedges(), Some(1));
    assert_eq!(tokens(), 2_000);
    // Over the half again: the next slow call is hedged, and the hedge wins.
    let resp = c.create_order(create()).await.unwrap();
    assert_won(&resp, 2, 1);
    assert_eq!(log.seen().len(), 4);
}

// ---------------------------------------------------------------- (g) deadline

#[tokio::test(start_paused = true)]
async fn the_deadline_bounds_every_hedge() {
    let cfg = config_with(&policy(5, "0.03s"), Some("0.1s"), None);
    let (mut c, log) = hedged_with(vec![ok_after(1000); 5], &cfg).await;
    let start = Instant::now();
    let err = c.create_order(create()).await.unwrap_err();
    assert_eq!(start.elapsed(), ms(100));
    // Hedges at 0, 30, 60 and 90 ms; the fifth would start at 120 ms, past the deadline.
    let report = assert_failed(&err, Code::DeadlineExceeded, CallOutcome::Deadline, 4);
    let seen = log.seen();
    assert_eq!(gaps(&seen), [ms(30); 3]);
    let timeouts: Vec<_> = seen.iter().map(|s| s.timeout.unwrap()).collect();
    assert_eq!(timeouts, [ms(100), ms(70), ms(40), ms(10)]);
    assert!(
        ends(&report)
            .iter()
            .all(|e| matches!(e, AttemptEnd::Deadline | AttemptEnd::Cancelled)),
        "{report}"
    );
    tokio::time::sleep(ms(2000)).await;
    assert_eq!(log.seen().len(), 4);
    assert!(log.finished().is_empty(), "every hedge was cancelled");
}

// ---------------------------------------------------------------- (h) idem server

#[tokio::test(start_paused = true)]
async fn hedges_to_an_idem_server_run_the_handler_once_and_every_hedge_gets_its_response() {
    let answers = Answers::default();
    // The handler takes 300 ms; hedges go out every 50 ms, to both instances in turn.
    let (addrs, log) = instances(
        vec![vec![ok_after(300)], vec![ok_after(300)]],
        Some((MemoryStore::default(), answers.clone())),
    )
    .await;
    // Hedge 0's answer reaches the client 100 ms late, so a replay wins the race.
    let cfg = config(&policy(3, "0.05s"));
    let mut c = client(&addrs, &cfg, vec![(0, ms(100))]);
    let start = Instant::now();
    let resp = c.create_order(create()).await.unwrap();
    assert_eq!(start.elapsed(), ms(300));
    // One execution: the other hedges waited for it (WAIT) and got its response.
    assert_eq!(log.seen().len(), 1);
    assert_eq!(log.finished(), [0]);
    assert_eq!(resp.get_ref().order_id, "o-0-0");
    assert_eq!(
        resp.metadata()
            .get("x-idempotency-replayed")
            .map(|v| v.to_str().unwrap()),
        Some("true")
    );
    let report = CallReport::from_response(&resp).unwrap();
    assert_eq!(report.hedges(), Some(3));
    assert!(matches!(report.winner(), Some(1 | 2)), "{report}");
    // Server side: the first hedge got the execution's response, the others its replay,
    // byte for byte.
    let mut answered = answers.lock().unwrap().clone();
    answered.sort_by_key(|a| a.0);
    let shape: Vec<_> = answered
        .iter()
        .map(|(h, replayed, _)| (*h, *replayed))
        .collect();
    assert_eq!(shape, [(0, false), (1, true), (2, true)]);
    assert!(answered.iter().all(|a| a.2 == answered[0].2));
    let order = <Order as prost::Message>::decode(&answered[0].2[5..]).unwrap();
    assert_eq!(order.order_id, "o-0-0");
}

/// What the server layer answered each hedge: (instance's hedge, replayed, body).
type Answers = Arc<Mutex<Vec<(u32, bool, Bytes)>>>;

/// Records what the layer below answered each request, body included (read whole and
/// passed on).
#[derive(Clone)]
struct Recorder<S> {
    inner: S,
    answers: Answers,
}

impl<S> Service<http::Request<Body>> for Recorder<S>
where
    S: Service<http::Request<Body>, Response = http::Response<Body>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Into<BoxError>,
{
    type Response = http::Response<Body>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        let hedge = hedge_of(req.headers());
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let answers = self.answers.clone();
        Box::pin(async move {
            let resp = inner.call(req).await.map_err(Into::into)?;
            let (parts, body) = resp.into_parts();
            let collected = body.collect().await?;
            let trailers = collected.trailers().cloned();
            let bytes = collected.to_bytes();
            let replayed = parts.headers.contains_key("x-idempotency-replayed");
            answers
                .lock()
                .unwrap()
                .push((hedge, replayed, bytes.clone()));
            let mut frames = vec![Ok::<_, Status>(http_body::Frame::data(bytes))];
            frames.extend(trailers.map(|t| Ok(http_body::Frame::trailers(t))));
            let body = http_body_util::StreamBody::new(futures_util::stream::iter(frames));
            Ok(http::Response::from_parts(parts, Body::new(body)))
        })
    }
}

// ---------------------------------------------------------------- (i) streaming requests

/// What a `Tally` instance saw of one request: the hedge it was, the numbers it read,
/// and how its handler ended.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Summed {
    instance: usize,
    hedge: u32,
    values: Vec<i64>,
    /// `Some(true)`: answered; `Some(false)`: the request stream failed under it;
    /// `None`: dropped before either (the client cancelled the hedge).
    answered: Option<bool>,
}

/// What instance *n* saw as hedge *n* (the router's rule).
fn summed(n: usize, values: &[i64], answered: Option<bool>) -> Summed {
    Summed {
        instance: n,
        hedge: n as u32,
        values: values.to_vec(),
        answered,
    }
}

#[derive(Clone, Default)]
struct TallyLog(Arc<Mutex<Vec<Summed>>>);

impl TallyLog {
    fn get(&self) -> Vec<Summed> {
        let mut all = self.0.lock().unwrap().clone();
        all.sort_by_key(|s| s.hedge);
        all
    }
    /// Waits (virtual time) until `n` handlers ended, however: the resets travel over
    /// loopback after the call ended.
    async fn settled(&self, n: usize) -> Vec<Summed> {
        for _ in 0..1000 {
            if self.0.lock().unwrap().len() >= n {
                break;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        self.get()
    }
}

/// A `Tally` instance: `Sum` reads the whole stream, then answers after `wait`.
#[derive(Clone)]
struct TallyInstance {
    id: usize,
    wait: Duration,
    log: TallyLog,
    runs: Arc<std::sync::atomic::AtomicUsize>,
}

/// Writes what a handler saw when it ends, however it ends.
struct SumGuard {
    log: TallyLog,
    entry: Summed,
}

impl Drop for SumGuard {
    fn drop(&mut self) {
        self.log.0.lock().unwrap().push(self.entry.clone());
    }
}

impl TallyInstance {
    /// Counts a handler run; what it sees is written when the guard drops.
    fn started<T>(&self, request: &Request<T>) -> SumGuard {
        self.runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        SumGuard {
            log: self.log.clone(),
            entry: Summed {
                instance: self.id,
                hedge: hedge_of(request.metadata().as_ref()),
                values: Vec::new(),
                answered: None,
            },
        }
    }
}

#[tonic::async_trait]
impl Tally for TallyInstance {
    async fn sum(
        &self,
        request: Request<tonic::Streaming<Number>>,
    ) -> Result<Response<Total>, Status> {
        let mut guard = self.started(&request);
        let mut input = request.into_inner();
        loop {
            match input.message().await {
                Ok(Some(n)) => guard.entry.values.push(n.value),
                Ok(None) => break,
                Err(status) => {
                    guard.entry.answered = Some(false);
                    return Err(status);
                }
            }
        }
        tokio::time::sleep(self.wait).await;
        guard.entry.answered = Some(true);
        let values = &guard.entry.values;
        Ok(Response::new(Total {
            sum: values.iter().sum(),
            count: values.len() as i64,
        }))
    }

    type RunningStream = Pin<Box<dyn tokio_stream::Stream<Item = Result<Total, Status>> + Send>>;

    /// Waits `wait` before its response headers, then answers each number with the
    /// running total.
    async fn running(
        &self,
        request: Request<tonic::Streaming<Number>>,
    ) -> Result<Response<Self::RunningStream>, Status> {
        let mut guard = self.started(&request);
        tokio::time::sleep(self.wait).await;
        let mut input = request.into_inner();
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            let mut total = Total::default();
            let ended = loop {
                match input.message().await {
                    Ok(Some(n)) => {
                        guard.entry.values.push(n.value);
                        total.sum += n.value;
                        total.count += 1;
                        let _ = tx.send(Ok(total));
                    }
                    Ok(None) => break true,
                    Err(_) => break false,
                }
            };
            guard.entry.answered = Some(ended);
            drop(guard);
        });
        Ok(Response::new(Box::pin(UnboundedReceiverStream::new(rx))))
    }
}

/// The request bodies the instances read to their end: (hedge, bytes), in the order they
/// ended. Recorded before the idempotency layer, which reads every protected request whole.
type Requests = Arc<Mutex<Vec<(u32, Bytes)>>>;

/// A request body that records what passed through it once it ended.
struct TapBody {
    inner: Body,
    hedge: u32,
    seen: Vec<u8>,
    requests: Requests,
}

impl http_body::Body for TapBody {
    type Data = Bytes;
    type Error = Status;
    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, Status>>> {
        let frame = std::task::ready!(Pin::new(&mut self.inner).poll_frame(cx));
        match &frame {
            Some(Ok(f)) => {
                if let Some(d) = f.data_ref() {
                    self.seen.extend_from_slice(d);
                }
            }
            None => {
                let entry = (self.hedge, Bytes::from(std::mem::take(&mut self.seen)));
                self.requests.lock().unwrap().push(entry);
            }
            Some(Err(_)) => {}
        }
        Poll::Ready(frame)
    }
    fn is_end_stream(&self) -> bool {
        false
    }
}

#[derive(Clone)]
struct Tap<S> {
    inner: S,
    requests: Requests,
}

impl<S> Service<http::Request<Body>> for Tap<S>
where
    S: Service<http::Request<Body>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }
    fn call(&mut self, req: http::Request<Body>) -> S::Future {
        let hedge = hedge_of(req.headers());
        let requests = self.requests.clone();
        self.inner.call(req.map(|inner| {
            Body::new(TapBody {
                inner,
                hedge,
                seen: Vec::new(),
                requests,
            })
        }))
    }
}

/// What the `Tally` instances of a test share.
struct Tallies {
    addrs: Vec<SocketAddr>,
    log: TallyLog,
    requests: Requests,
    /// Handler runs, every instance.
    runs: Arc<std::sync::atomic::AtomicUsize>,
    /// The idempotency layer, when the instances run behind one.
    idem: Option<IdempotencyLayer<MemoryStore>>,
}

impl Tallies {
    fn runs(&self) -> usize {
        self.runs.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Two hedges ended, each having read the number 1 alone, and neither answered.
    async fn assert_two_hedges_read_only_1_and_none_answered(&self) {
        let log = self.log.settled(2).await;
        assert_eq!(log.len(), 2, "{log:?}");
        assert!(
            log.iter()
                .all(|s| s.values == [1] && s.answered != Some(true)),
            "{log:?}"
        );
    }
}

/// `stream.v1.Tally/Sum`, hedged with `hedging`, protected.
fn tally_config(hedging: &str) -> ServiceConfig {
    tally_method_config("Sum", r#""idempotency": {},"#, hedging)
}

/// `stream.v1.Tally/{method}`, hedged with `hedging`; `fields`: more fields of the
/// method, each followed by a comma.
fn tally_method_config(method: &str, fields: &str, hedging: &str) -> ServiceConfig {
    ServiceConfig::from_json(&format!(
        r#"{{"methodConfig": [{{
            "name": [{{"service": "stream.v1.Tally", "method": "{method}"}}],
            {fields}
            "hedgingPolicy": {{ {hedging} }}
        }}]}}"#
    ))
    .unwrap()
}

/// 3 hedges 50 ms apart, non-fatal on every code a broken request stream can end a hedge
/// with: what ends those calls is not a fatal code.
const LENIENT_POLICY: &str = r#""maxAttempts": 3, "hedgingDelay": "0.05s", "nonFatalStatusCodes": ["UNAVAILABLE", "CANCELLED", "UNKNOWN", "INTERNAL"]"#;

/// One `Tally` instance per wait; `idem`: all behind one `IdempotencyLayer` on one store.
async fn tallies(waits: &[u64], idem: bool) -> Tallies {
    let log = TallyLog::default();
    let requests = Requests::default();
    let runs = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let layer = idem.then(|| {
        IdempotencyLayer::new(MemoryStore::default(), &tally_config(r#""maxAttempts": 2"#))
            .tenant(SingleTenant::new("t"))
    });
    let mut addrs = Vec::new();
    for (id, wait) in waits.iter().enumerate() {
        let instance = TallyInstance {
            id,
            wait: ms(*wait),
            log: log.clone(),
            runs: runs.clone(),
        };
        let (addr, incoming) = net::bind().await;
        let tapped = requests.clone();
        let tap = layer_fn(move |inner| Tap {
            inner,
            requests: tapped.clone(),
        });
        let router = Server::builder()
            .layer(tap)
            .layer(tower::util::option_layer(layer.clone()))
            .add_service(TallyServer::new(instance));
        tokio::spawn(router.serve_with_incoming(incoming));
        addrs.push(addr);
    }
    Tallies {
        addrs,
        log,
        requests,
        runs,
        idem: layer,
    }
}

type TallyHedged = TallyClient<Retry<Router>>;

fn tally_client(addrs: &[SocketAddr], layer: &RetryLayer) -> TallyHedged {
    TallyClient::new(Retry::new(Router::to(addrs), layer))
}

/// The caller's stream of numbers, fed by the test.
fn numbers() -> (
    mpsc::UnboundedSender<Number>,
    UnboundedReceiverStream<Number>,
) {
    let (tx, rx) = mpsc::unbounded_channel();
    (tx, UnboundedReceiverStream::new(rx))
}

type SumCall = tokio::task::JoinHandle<Result<Response<Total>, Status>>;

/// Starts a `Sum` call through `layer` to the instances, the caller having sent `first`:
/// the sender of the rest of its stream, and the call.
fn start_sum(
    t: &Tallies,
    layer: &RetryLayer,
    first: Vec<Number>,
) -> (mpsc::UnboundedSender<Number>, SumCall) {
    let mut client = tally_client(&t.addrs, layer);
    let (tx, stream) = numbers();
    for n in first {
        tx.send(n).unwrap();
    }
    let call = tokio::spawn(async move { client.sum(stream).await });
    (tx, call)
}

fn hedged_stream_layer(hedging: &str) -> RetryLayer {
    retry_layer(&tally_config(hedging))
}

#[tokio::test(start_paused = true)]
async fn a_client_stream_hedged_to_a_slow_and_a_fast_instance_gets_the_fast_answer() {
    // Instance 0 answers 1 s after the stream ends, instance 1 at once.
    let t = tallies(&[1000, 0], false).await;
    let layer = hedged_stream_layer(&policy(2, "0.05s"));
    let start = Instant::now();
    let (tx, call) = start_sum(&t, &layer, vec![number(1), number(2)]);
    // Hedge 1 goes out at 50 ms with 1 and 2; the caller sends 3 and ends at 100 ms.
    tokio::time::sleep(ms(100)).await;
    assert!(layer.replay_bytes_held() > 0, "kept for the hedges");
    tx.send(number(3)).unwrap();
    drop(tx);
    let resp = call.await.unwrap().unwrap();
    assert_eq!(start.elapsed(), ms(100));
    assert_eq!(resp.get_ref(), &Total { sum: 6, count: 3 });
    let report = assert_won(&resp, 2, 1);
    assert_eq!(
        ends(&report),
        [AttemptEnd::Cancelled, AttemptEnd::Committed]
    );
    assert_eq!(layer.replay_bytes_held(), 0);
    // Each hedge sent the whole stream, byte for byte the same; the slow one was
    // cancelled before it answered.
    let requests = t.requests.lock().unwrap().clone();
    assert_eq!(requests.len(), 2);
    assert_eq!(requests[0].1, requests[1].1);
    let log = t.log.settled(2).await;
    assert_eq!(
        log,
        [
            summed(0, &[1, 2, 3], None),
            summed(1, &[1, 2, 3], Some(true)),
        ]
    );
}

#[tokio::test(start_paused = true)]
async fn a_client_stream_hedged_to_an_idem_server_runs_once_and_every_hedge_sends_the_same_stream()
{
    // The handler takes 300 ms on either instance.
    let t = tallies(&[300, 300], true).await;
    let layer = hedged_stream_layer(&policy(2, "0.05s"));
    let start = Instant::now();
    let (tx, call) = start_sum(&t, &layer, vec![number(1), number(2)]);
    tokio::time::sleep(ms(100)).await;
    tx.send(number(3)).unwrap();
    drop(tx);
    let resp = call.await.unwrap().unwrap();
    // Both hedges reached the layer whole at 100 ms: one claimed the key and ran the
    // handler, the other waited for that run.
    assert_eq!(start.elapsed(), ms(400));
    assert_eq!(resp.get_ref(), &Total { sum: 6, count: 3 });
    let report = CallReport::from_response(&resp).unwrap();
    assert_eq!(report.hedges(), Some(2));
    assert_eq!(t.runs(), 1, "one execution");
    let requests = t.requests.lock().unwrap().clone();
    assert_eq!(
        requests.len(),
        2,
        "the layer read both hedges' streams whole"
    );
    assert_eq!(requests[0].1, requests[1].1, "the same bytes");
    let stats = t.idem.as_ref().unwrap().stats().snapshot();
    assert_eq!((stats.executed, stats.waited, stats.mismatched), (1, 1, 0));
    assert_eq!(t.log.settled(1).await.len(), 1);
}

#[tokio::test(start_paused = true)]
async fn past_the_replay_limit_a_hedged_stream_commits_to_one_hedge_and_sends_no_more() {
    let t = tallies(&[0, 0, 0], false).await;
    let layer = RetryLayer::builder()
        .service_config(tally_config(&policy(3, "0.05s")))
        .max_replay_bytes_per_call(1000)
        .build()
        .unwrap();
    let (tx, call) = start_sum(&t, &layer, vec![padded(1, 600)]);
    // Both hedges are out with the first message; the second passes the 1000-byte limit.
    tokio::time::sleep(ms(60)).await;
    assert!(layer.replay_bytes_held() >= 600);
    tx.send(padded(2, 600)).unwrap();
    tokio::time::sleep(ms(1)).await;
    assert_eq!(layer.replay_bytes_held(), 0, "nothing kept once committed");
    // No third hedge at 100 ms; the committed one goes on with the live stream.
    tokio::time::sleep(ms(100)).await;
    tx.send(number(3)).unwrap();
    drop(tx);
    let resp = call.await.unwrap().unwrap();
    assert_eq!(resp.get_ref().sum, 6);
    let report = CallReport::from_response(&resp).unwrap();
    assert_eq!(
        (report.outcome, report.hedges()),
        (CallOutcome::Committed, Some(2))
    );
    let winner = report.winner().unwrap();
    let mut history = ends(&report);
    history.remove(winner as usize);
    assert_eq!(history, [AttemptEnd::Cancelled]);
    let log = t.log.settled(2).await;
    assert_eq!(log.len(), 2, "no third hedge: {log:?}");
    for s in &log {
        if s.hedge == winner {
            assert_eq!(
                (s.values.as_slice(), s.answered),
                (&[1, 2, 3][..], Some(true))
            );
        } else {
            assert_eq!(
                s.values,
                [1],
                "cancelled before the message that did not fit"
            );
            assert_ne!(s.answered, Some(true));
        }
    }
    assert_eq!(layer.replay_bytes_held(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_caller_that_goes_away_mid_hedge_cancels_every_hedge_and_runs_nothing() {
    let t = tallies(&[0, 0], true).await;
    let layer = hedged_stream_layer(&policy(2, "0.05s"));
    let (tx, call) = start_sum(&t, &layer, vec![number(1)]);
    tokio::time::sleep(ms(60)).await;
    call.abort();
    assert!(call.await.unwrap_err().is_cancelled());
    assert_eq!(layer.replay_bytes_held(), 0);
    // Both streams were reset before they ended: the layer never had a whole request,
    // so nothing ran and nothing was stored.
    tokio::time::sleep(ms(100)).await;
    assert_eq!(t.runs(), 0);
    assert!(t.requests.lock().unwrap().is_empty());
    let stats = t.idem.as_ref().unwrap().stats().snapshot();
    assert_eq!((stats.executed, stats.stored), (0, 0));
    assert!(t.idem.as_ref().unwrap().store().is_empty());
    drop(tx);
}

#[tokio::test(start_paused = true)]
async fn a_caller_stream_that_fails_mid_hedge_fails_every_hedge_and_ends_the_call() {
    let t = tallies(&[0, 0, 0], false).await;
    let layer = hedged_stream_layer(LENIENT_POLICY);
    let router = Router::to(&t.addrs);
    let mut svc = Retry::new(router, &layer);
    // The caller's body as raw frames: one message, then an error at 60 ms.
    let (tx, rx) = mpsc::unbounded_channel::<Result<http_body::Frame<Bytes>, Status>>();
    let one = Bytes::from_static(b"\0\0\0\0\x02\x08\x01");
    tx.send(Ok(http_body::Frame::data(one))).unwrap();
    let body = http_body_util::StreamBody::new(UnboundedReceiverStream::new(rx));
    let req = http::Request::builder()
        .method("POST")
        .uri("http://test/stream.v1.Tally/Sum")
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(Body::new(body))
        .unwrap();
    let start = Instant::now();
    let call = tokio::spawn(async move {
        let ready = ServiceExt::<http::Request<Body>>::ready(&mut svc)
            .await
            .unwrap();
        ready.call(req).await
    });
    tokio::time::sleep(ms(60)).await;
    tx.send(Err(Status::internal("the caller broke"))).unwrap();
    let resp = tokio::time::timeout(ms(1000), call)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert!(start.elapsed() < ms(100), "{:?}", start.elapsed());
    let status = Status::from_header_map(resp.headers()).expect("a failure");
    let report = CallReport::from_status(&status).unwrap();
    assert_eq!(report.outcome, CallOutcome::BodyError, "{report}");
    assert_eq!(
        report.hedges(),
        Some(2),
        "no hedge after the caller's stream failed"
    );
    // Neither instance got a whole request: no handler answered.
    t.assert_two_hedges_read_only_1_and_none_answered().await;
    assert_eq!(layer.replay_bytes_held(), 0);
}

// ---------------------------------------------------------------- (j) waitForReady

/// `CreateOrder` hedged (3 hedges, UNAVAILABLE non-fatal, 20 s apart: past the 10 s
/// deadline, so only a failure sends the next one), with a throttle of 10 tokens;
/// `wait_for_ready` as given.
fn ready_config(wait_for_ready: bool) -> ServiceConfig {
    ServiceConfig::from_json(&format!(
        r#"{{"methodConfig": [{{
            "name": [{{"service": "shop.v1.Orders", "method": "CreateOrder"}}],
            "waitForReady": {wait_for_ready}, "timeout": "10s",
            "hedgingPolicy": {{"maxAttempts": 3, "hedgingDelay": "20s",
                               "nonFatalStatusCodes": ["UNAVAILABLE"]}},
            "idempotency": {{}}
        }}],
        "retryThrottling": {{"maxTokens": 10, "tokenRatio": 0.1}}}}"#
    ))
    .unwrap()
}

/// A port nothing listens on (yet).
async fn closed_port() -> SocketAddr {
    let (addr, _incoming) = net::bind().await;
    addr
}

/// Serves one instance on `addr` after `after` (real time): the port was closed a moment
/// ago, hence SO_REUSEADDR.
async fn serve_later(addr: SocketAddr, after: Duration, log: Log) {
    tokio::time::sleep(after).await;
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket.set_reuseaddr(true).expect("reuseaddr");
    socket.bind(addr).expect("rebind the port");
    let listener = socket.listen(128).expect("listen");
    let instance = Instance {
        id: 0,
        script: Arc::default(),
        log,
    };
    tokio::spawn(
        Server::builder()
            .add_service(OrdersServer::new(instance))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
}

// Real time: the port opens while the client waits, and connecting takes real time.
#[tokio::test]
async fn wait_for_ready_hedges_wait_for_a_server_that_comes_up_and_use_no_hedge_or_token() {
    let addr = closed_port().await;
    let (mut c, layer) = client_and_layer(&[addr], &ready_config(true));
    let log = Log::default();
    let start = std::time::Instant::now();
    let (resp, ()) = tokio::join!(
        c.create_order(create()),
        serve_later(addr, ms(300), log.clone())
    );
    let resp = resp.unwrap();
    assert!(start.elapsed() >= ms(300));
    let report = CallReport::from_response(&resp).unwrap();
    assert_eq!(report.outcome, CallOutcome::Committed);
    assert_eq!(
        (report.hedges(), report.winner()),
        (Some(1), Some(0)),
        "waiting for the channel sends no hedge: {report}"
    );
    let seen = log.seen();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].hedge, 0);
    // The connect failures took no token (the success gives back what is over the cap).
    assert_eq!(layer.throttle().unwrap().milli_tokens(), 10_000);
    let stats = layer.stats().snapshot();
    assert_eq!((stats.attempts, stats.retries), (1, 0));
}

#[tokio::test]
async fn without_wait_for_ready_hedges_to_a_closed_port_fail_fast() {
    let addr = closed_port().await;
    let (mut c, layer) = client_and_layer(&[addr], &ready_config(false));
    let err = c.create_order(create()).await.unwrap_err();
    // Each connect failure is a failed hedge (UNAVAILABLE, non-fatal): the next goes out
    // at once (a hedgingDelay later would be past the deadline), and each takes a token.
    assert_failed(&err, Code::Unavailable, CallOutcome::AttemptsExhausted, 3);
    assert_eq!(layer.throttle().unwrap().milli_tokens(), 7_000);
}

// ---------------------------------------------------------------- (k) losing hedges

/// Waits (real time, at most 10 s) until `f` holds; panics with `what` otherwise.
async fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    let start = std::time::Instant::now();
    while !f() {
        assert!(start.elapsed() < Duration::from_secs(10), "never: {what}");
        tokio::time::sleep(ms(2)).await;
    }
}

fn get(id: &str) -> shop::GetOrderRequest {
    shop::GetOrderRequest {
        order_id: id.into(),
    }
}

// Real time: the server runs on a multi-threaded runtime of its own (one worker), which
// tokio's paused clock cannot drive; no assertion depends on how long anything takes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn losing_hedges_parked_on_an_idem_server_hold_no_worker_and_leave_nothing_behind() {
    const CALLS: usize = 64;
    // An idem server (`CreateOrder` protected, WAIT) on a runtime with one worker thread.
    let server = OneWorker::start(&config(r#""maxAttempts": 2"#)).await;
    let layer = retry_layer(&config(&policy(3, "0.005s")));
    let client = OrdersClient::new(Retry::new(net::channel(server.addr), &layer));
    // Warm up: the connection, and a protected call through the store.
    client.clone().get_order(get("warm")).await.unwrap();
    client
        .clone()
        .create_order(shop_fake::create("warm"))
        .await
        .unwrap();
    eventually("the warm-up settles", || server.in_progress() == 0).await;
    tokio::time::sleep(ms(20)).await;
    let baseline = server.alive_tasks();

    // 64 hedged calls whose handler waits at a gate: each runs once, and its two other
    // hedges wait (WAIT) for that run on the server.
    let calls: Vec<_> = (0..CALLS)
        .map(|_| {
            let mut c = client.clone();
            tokio::spawn(async move { c.create_order(shop_fake::create("gate")).await })
        })
        .collect();
    let waiting = 2 * CALLS as u64;
    eventually("every call runs once and its two other hedges wait", || {
        server.in_progress() == 3 * CALLS as i64
            && server.layer.stats().snapshot().waited == waiting
    })
    .await;
    assert_eq!(server.layer.handlers_in_flight(), CALLS);
    let parked = server.alive_tasks();
    // Each waiting hedge is (at least) a task while it waits: what must go away.
    assert!(parked >= baseline + waiting as usize, "{parked} tasks");

    // The one worker still serves unrelated calls while 128 hedges wait.
    for i in 0..100 {
        let served = tokio::time::timeout(
            Duration::from_secs(5),
            client.clone().get_order(get(&format!("o-{i}"))),
        )
        .await
        .expect("an unrelated call is served while losing hedges wait");
        served.unwrap();
    }
    assert_eq!(
        server.shop.finished(),
        2 + 100,
        "no gated run ended meanwhile"
    );

    // The callers of half the calls go away: their waiting hedges (64) are dropped at
    // once, with their request tasks; their runs go on, as a run outlives its caller.
    for c in &calls[..CALLS / 2] {
        c.abort();
    }
    eventually("the abandoned calls' waiting hedges are gone", || {
        server.in_progress() == (3 * CALLS - 2 * (CALLS / 2)) as i64
    })
    .await;
    eventually("their request tasks are gone", || {
        server.alive_tasks() <= parked - 2 * (CALLS / 2)
    })
    .await;
    assert_eq!(server.layer.handlers_in_flight(), CALLS);

    // The gate opens: every run ends; each remaining call takes its first answer and
    // cancels its other hedges.
    server.shop.open_gate(CALLS);
    for c in calls.into_iter().skip(CALLS / 2) {
        let resp = c.await.unwrap().unwrap();
        let report = CallReport::from_response(&resp).unwrap();
        assert_eq!(report.hedges(), Some(3), "{report}");
    }
    // Nothing is left behind: no call in progress, no handler, no task over the
    // baseline; one run per call, the abandoned ones included.
    eventually("no protected call in progress", || {
        server.in_progress() == 0
    })
    .await;
    eventually("no handler in flight", || {
        server.layer.handlers_in_flight() == 0
    })
    .await;
    eventually("tasks back to the baseline", || {
        server.alive_tasks() <= baseline
    })
    .await;
    let stats = server.layer.stats().snapshot();
    assert_eq!(stats.executed, 1 + CALLS as u64);
    assert_eq!(stats.waited, waiting);
    assert_eq!(server.shop.runs(), 2 + 100 + CALLS);
}

#[tokio::test(start_paused = true)]
async fn a_bidi_call_hedged_goes_on_with_the_hedge_whose_headers_came_first() {
    // Instance 0 sends its headers after 1 s, instance 1 at once.
    let t = tallies(&[1000, 0], false).await;
    let layer = retry_layer(&tally_method_config("Running", "", &policy(2, "0.05s")));
    let mut client = tally_client(&t.addrs, &layer);
    let (tx, stream) = numbers();
    tx.send(number(1)).unwrap();
    let start = Instant::now();
    let resp = client.running(stream).await.unwrap();
    assert_eq!(start.elapsed(), ms(50), "hedge 1's headers");
    assert_won(&resp, 2, 1);
    assert_eq!(layer.replay_bytes_held(), 0, "headers commit the call");
    // Request, response, request, response on the winner.
    let mut answers = resp.into_inner();
    assert_eq!(
        answers.message().await.unwrap(),
        Some(Total { sum: 1, count: 1 })
    );
    tx.send(number(2)).unwrap();
    assert_eq!(
        answers.message().await.unwrap(),
        Some(Total { sum: 3, count: 2 })
    );
    tx.send(number(3)).unwrap();
    assert_eq!(
        answers.message().await.unwrap(),
        Some(Total { sum: 6, count: 3 })
    );
    drop(tx);
    assert_eq!(answers.message().await.unwrap(), None);
    let log = t.log.settled(2).await;
    assert_eq!(
        log,
        [summed(0, &[], None), summed(1, &[1, 2, 3], Some(true)),]
    );
}

#[tokio::test(start_paused = true)]
async fn a_request_message_over_its_limit_mid_hedge_ends_the_call_and_every_hedge() {
    let t = tallies(&[0, 0, 0], false).await;
    let layer = retry_layer(&tally_method_config(
        "Sum",
        r#""maxRequestMessageBytes": 100,"#,
        LENIENT_POLICY,
    ));
    let start = Instant::now();
    let (tx, call) = start_sum(&t, &layer, vec![number(1)]);
    tokio::time::sleep(ms(60)).await;
    // Both hedges are out; this message is over maxRequestMessageBytes.
    tx.send(padded(2, 200)).unwrap();
    let status = call.await.unwrap().unwrap_err();
    assert_eq!(start.elapsed(), ms(60));
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert!(
        status.message().contains("maxRequestMessageBytes (100)"),
        "{status:?}"
    );
    assert_failed(
        &status,
        Code::ResourceExhausted,
        CallOutcome::MessageTooLarge,
        2,
    );
    // No instance got the message, none answered, and no third hedge went out.
    tokio::time::sleep(ms(200)).await;
    t.assert_two_hedges_read_only_1_and_none_answered().await;
    assert_eq!(layer.replay_bytes_held(), 0);
    drop(tx);
}
