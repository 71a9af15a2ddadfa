//! End-to-end tests of the client retry layer (`idem-client`, docs/semantics.md section
//! 2): a real tonic `Orders` server on 127.0.0.1 whose handler follows a script of faults
//! and records what every attempt carried; the generated client drives `RetryLayer` over
//! a `Channel`.
//!
//! Time-dependent tests run on tokio's paused clock: the server runs in the same runtime,
//! so the gaps it records between attempts are exactly the waits the layer chose (loopback
//! I/O takes no virtual time).

use idem_test_support::net;
use idem_test_support::shop;
use idem_test_support::unavailable_policy as policy;

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem_client::{
    IdempotencyKeyInterceptor,
    retry::{CallOutcome, CallReport, Retry, RetryLayer},
    with_key,
};
use idem_core::config::{
    IdemSettings, IdempotencyPolicy, MethodConfig, RetryPolicy, RetryThrottling,
};
use idem_core::deadline::parse_grpc_timeout;
use idem_core::{config::ServiceConfig, key::IdempotencyKey};
use shop::orders_client::OrdersClient;
use shop::orders_server::{Orders, OrdersServer};
use shop::{CreateOrderRequest, GetOrderRequest, ListOrdersRequest, Order};
use tokio::time::Instant;
use tokio_stream::Stream;
use tonic::metadata::MetadataMap;
use tonic::transport::{Channel, Server};
use tonic::{Request, Response, Status};
use tower::ServiceBuilder;

// ---------------------------------------------------------------- the scripted server

/// What the server does with one attempt.
#[derive(Clone)]
enum Fault {
    /// Answer normally (headers, message, OK trailers).
    Ok,
    /// Fail with this status (a unary error is sent Trailers-Only).
    Fail(Status),
}

/// What one attempt carried, as the handler saw it.
#[derive(Debug, Clone)]
struct Seen {
    at: Instant,
    method: &'static str,
    metadata: MetadataMap,
    note_len: usize,
}

impl Seen {
    fn header(&self, name: &str) -> Option<String> {
        self.metadata
            .get(name)
            .map(|v| v.to_str().unwrap_or("<non-ascii>").to_owned())
    }
    fn timeout(&self) -> Option<Duration> {
        self.metadata
            .get("grpc-timeout")
            .and_then(|v| parse_grpc_timeout(v.as_bytes()))
    }
}

#[derive(Clone, Default)]
struct Shop {
    faults: Arc<Mutex<VecDeque<Fault>>>,
    seen: Arc<Mutex<Vec<Seen>>>,
}

impl Shop {
    fn with(faults: impl IntoIterator<Item = Fault>) -> Self {
        let shop = Shop::default();
        shop.faults.lock().unwrap().extend(faults);
        shop
    }
    fn next(&self, method: &'static str, metadata: &MetadataMap, note_len: usize) -> Fault {
        self.seen.lock().unwrap().push(Seen {
            at: Instant::now(),
            method,
            metadata: metadata.clone(),
            note_len,
        });
        self.faults.lock().unwrap().pop_front().unwrap_or(Fault::Ok)
    }
    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }
    fn attempts(&self) -> usize {
        self.seen.lock().unwrap().len()
    }
    fn gaps(&self) -> Vec<Duration> {
        self.seen().windows(2).map(|w| w[1].at - w[0].at).collect()
    }
    /// The value of header `name` on each attempt, in order.
    fn headers(&self, name: &str) -> Vec<Option<String>> {
        self.seen().iter().map(|s| s.header(name)).collect()
    }
}

fn order(id: &str) -> Order {
    Order {
        order_id: id.into(),
        created_by: "test".into(),
        ..Default::default()
    }
}

#[tonic::async_trait]
impl Orders for Shop {
    async fn create_order(
        &self,
        request: Request<CreateOrderRequest>,
    ) -> Result<Response<Order>, Status> {
        match self.next(
            "CreateOrder",
            request.metadata(),
            request.get_ref().note.len(),
        ) {
            Fault::Ok => Ok(Response::new(order("o-1"))),
            Fault::Fail(s) => Err(s),
        }
    }

    async fn get_order(
        &self,
        request: Request<GetOrderRequest>,
    ) -> Result<Response<Order>, Status> {
        match self.next("GetOrder", request.metadata(), 0) {
            Fault::Ok => Ok(Response::new(order(&request.get_ref().order_id))),
            Fault::Fail(s) => Err(s),
        }
    }

    type ListOrdersStream = Pin<Box<dyn Stream<Item = Result<Order, Status>> + Send>>;

    /// Sends real headers first, then the scripted status as the stream's first item:
    /// "headers then an error", which commits the call.
    async fn list_orders(
        &self,
        request: Request<ListOrdersRequest>,
    ) -> Result<Response<Self::ListOrdersStream>, Status> {
        let item = match self.next("ListOrders", request.metadata(), 0) {
            Fault::Ok => Ok(order("o-1")),
            Fault::Fail(s) => Err(s),
        };
        let stream = async_stream_once(item);
        Ok(Response::new(Box::pin(stream)))
    }
}

/// A stream that first yields to the runtime (so tonic has sent the response headers)
/// and then produces `item`.
fn async_stream_once(
    item: Result<Order, Status>,
) -> impl Stream<Item = Result<Order, Status>> + Send {
    futures_util::stream::once(async move {
        tokio::task::yield_now().await;
        item
    })
}

async fn serve(shop: Shop) -> std::net::SocketAddr {
    let (addr, incoming) = net::bind().await;
    tokio::spawn(
        Server::builder()
            .add_service(OrdersServer::new(shop))
            .serve_with_incoming(incoming),
    );
    addr
}

/// Serves `shop` on `addr` (a port closed a moment ago) after `delay`.
async fn serve_later(addr: std::net::SocketAddr, shop: Shop, delay: Duration) {
    tokio::time::sleep(delay).await;
    // SO_REUSEADDR: the port was closed a moment ago.
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket.set_reuseaddr(true).expect("reuseaddr");
    socket.bind(addr).expect("rebind the port");
    let listener = socket.listen(128).expect("listen");
    let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
    tokio::spawn(
        Server::builder()
            .add_service(OrdersServer::new(shop))
            .serve_with_incoming(incoming),
    );
}

// ---------------------------------------------------------------- client helpers

type Client = OrdersClient<Retry<Channel>>;

fn client(addr: std::net::SocketAddr, layer: RetryLayer) -> Client {
    let svc = ServiceBuilder::new()
        .layer(layer)
        .service(net::channel(addr));
    OrdersClient::new(svc)
}

/// `shop.v1.Orders` retries with `policy`; `CreateOrder` is protected (has `idempotency`).
fn config(policy: RetryPolicy, throttling: Option<RetryThrottling>) -> ServiceConfig {
    ServiceConfig::from_parts(
        vec![
            MethodConfig::empty()
                .with_name("shop.v1.Orders", "CreateOrder")
                .with_retry_policy(policy.clone())
                .with_idempotency(IdempotencyPolicy::default()),
            MethodConfig::empty()
                .with_name("shop.v1.Orders", "")
                .with_retry_policy(policy),
        ],
        throttling,
        IdemSettings::default(),
    )
    .unwrap()
}

fn layer(cfg: &ServiceConfig) -> RetryLayer {
    RetryLayer::builder()
        .service_config(cfg.clone())
        .seed(3)
        .build()
        .unwrap()
}

/// [`config`] with [`policy`] and no throttling.
fn retry_config(
    max_attempts: u32,
    initial: Duration,
    max: Duration,
    multiplier: f64,
) -> ServiceConfig {
    config(policy(max_attempts, initial, max, multiplier), None)
}

/// [`policy`] with the default backoff: 20 ms, doubling, at most 1 s.
fn default_policy(max_attempts: u32) -> RetryPolicy {
    policy(
        max_attempts,
        Duration::from_millis(20),
        Duration::from_secs(1),
        2.0,
    )
}

fn default_config() -> ServiceConfig {
    config(default_policy(3), None)
}

fn list() -> ListOrdersRequest {
    ListOrdersRequest {
        customer_id: "c-1".into(),
    }
}

fn get(order_id: &str) -> GetOrderRequest {
    GetOrderRequest {
        order_id: order_id.into(),
    }
}

fn create(note_len: usize) -> Request<CreateOrderRequest> {
    Request::new(CreateOrderRequest {
        customer_id: "c-1".into(),
        sku: "sku-1".into(),
        quantity: 1,
        note: "n".repeat(note_len),
    })
}

fn unavailable() -> Fault {
    Fault::Fail(Status::unavailable("try again"))
}

fn pushback(values: &[&'static str]) -> Fault {
    let mut s = Status::unavailable("busy");
    for v in values {
        s.metadata_mut()
            .append("grpc-retry-pushback-ms", v.parse().unwrap());
    }
    Fault::Fail(s)
}

/// Asserts that the call behind `resp` committed after `attempts` attempts.
#[track_caller]
fn assert_committed<T>(resp: &Response<T>, attempts: u32) {
    let report = CallReport::from_response(resp).unwrap();
    assert_eq!(
        (report.outcome, report.attempts),
        (CallOutcome::Committed, attempts)
    );
}

fn report_of(status: &Status) -> CallReport {
    CallReport::from_status(status).unwrap_or_else(|| panic!("no report on {status:?}"))
}

// ---------------------------------------------------------------- attempts and codes

#[tokio::test(start_paused = true)]
async fn unavailable_twice_then_ok_takes_three_attempts() {
    let shop = Shop::with([unavailable(), unavailable(), Fault::Ok]);
    let mut c = client(serve(shop.clone()).await, layer(&default_config()));
    let resp = c.create_order(create(10)).await.unwrap();
    assert_eq!(resp.get_ref().order_id, "o-1");
    assert_committed(&resp, 3);
    let previous = shop.headers("grpc-previous-rpc-attempts");
    assert_eq!(previous, [None, Some("1".into()), Some("2".into())]);
}

#[tokio::test(start_paused = true)]
async fn max_attempts_2_gives_up_after_2_attempts_with_unavailable() {
    let shop = Shop::with([unavailable(), unavailable(), unavailable()]);
    let cfg = retry_config(2, Duration::from_millis(20), Duration::from_secs(1), 2.0);
    let mut c = client(serve(shop.clone()).await, layer(&cfg));
    let err = c.create_order(create(10)).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unavailable);
    assert_eq!(shop.attempts(), 2);
    let r = report_of(&err);
    assert_eq!((r.outcome, r.attempts), (CallOutcome::AttemptsExhausted, 2));
}

#[tokio::test(start_paused = true)]
async fn a_non_retryable_code_is_not_retried() {
    let shop = Shop::with([Fault::Fail(Status::invalid_argument("bad")), Fault::Ok]);
    let mut c = client(serve(shop.clone()).await, layer(&default_config()));
    let err = c.create_order(create(10)).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert_eq!(shop.attempts(), 1);
    assert_eq!(report_of(&err).outcome, CallOutcome::NonRetryableCode);
}

#[tokio::test(start_paused = true)]
async fn max_attempts_10_makes_at_most_5() {
    let shop = Shop::with((0..10).map(|_| unavailable()));
    let cfg = retry_config(
        10,
        Duration::from_millis(10),
        Duration::from_millis(10),
        1.0,
    );
    let mut c = client(serve(shop.clone()).await, layer(&cfg));
    let err = c.create_order(create(10)).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unavailable);
    assert_eq!(shop.attempts(), 5);
    assert_eq!(report_of(&err).attempts, 5);
}

#[tokio::test(start_paused = true)]
async fn headers_then_an_error_is_not_retried() {
    let shop = Shop::with([unavailable(), Fault::Ok]);
    let mut c = client(serve(shop.clone()).await, layer(&default_config()));
    let resp = c.list_orders(list()).await.unwrap();
    assert_committed(&resp, 1);
    let err = resp.into_inner().message().await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unavailable);
    assert_eq!(shop.attempts(), 1);
}

#[tokio::test(start_paused = true)]
async fn with_the_opt_in_headers_then_an_error_is_retried() {
    let shop = Shop::with([unavailable(), Fault::Ok]);
    let l = RetryLayer::builder()
        .service_config(default_config())
        .retry_headers_then_error(true)
        .build()
        .unwrap();
    let mut c = client(serve(shop.clone()).await, l);
    let resp = c.list_orders(list()).await.unwrap();
    assert_committed(&resp, 2);
    let mut stream = resp.into_inner();
    assert_eq!(stream.message().await.unwrap().unwrap().order_id, "o-1");
    assert!(stream.message().await.unwrap().is_none());
    assert_eq!(shop.attempts(), 2);
    // Unary calls are unaffected: Trailers-Only errors retried, answers intact.
    c.create_order(create(10)).await.unwrap();
}

// ---------------------------------------------------------------- backoff and pushback

/// End to end, the waits come from what a real tonic server sends (pushback in its
/// metadata, RetryInfo in its status details) and the deadline travels as a shrinking
/// `grpc-timeout`. The exact waits (A6 bounds, the exponent reset after a pushback,
/// RetryInfo as a minimum, a pushback past the deadline, the `grpc-timeout` rewrite) are
/// the unit tests' in `idem_client::retry`.
#[tokio::test(start_paused = true)]
async fn waits_follow_a_real_servers_pushback_and_retry_info_under_a_shrinking_deadline() {
    use tonic_types::{ErrorDetails, StatusExt};
    let info = Fault::Fail(Status::with_error_details(
        tonic::Code::Unavailable,
        "busy",
        ErrorDetails::with_retry_info(Some(Duration::from_millis(500))),
    ));
    let shop = Shop::with([unavailable(), pushback(&["300"]), info, Fault::Ok]);
    let cfg = retry_config(4, Duration::from_millis(20), Duration::from_secs(1), 2.0);
    let mut c = client(serve(shop.clone()).await, layer(&cfg));
    let mut req = create(10);
    req.set_timeout(Duration::from_secs(5));
    c.create_order(req).await.unwrap();
    assert_eq!(shop.attempts(), 4);
    let gaps = shop.gaps();
    assert!(gaps[0] < Duration::from_millis(300), "a backoff: {gaps:?}");
    assert!(
        gaps[1] >= Duration::from_millis(300),
        "the pushback: {gaps:?}"
    );
    assert!(gaps[2] >= Duration::from_millis(500), "RetryInfo: {gaps:?}");
    let timeouts: Vec<Duration> = shop.seen().iter().map(|s| s.timeout().unwrap()).collect();
    assert!(timeouts[0] <= Duration::from_secs(5), "{timeouts:?}");
    assert!(
        timeouts.windows(2).all(|w| w[1] < w[0]),
        "the deadline shrinks: {timeouts:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn negative_garbage_or_repeated_pushback_stops() {
    for values in [&["-1"][..], &["xxx"], &["100", "10"]] {
        let shop = Shop::with([pushback(values), Fault::Ok]);
        let mut c = client(serve(shop.clone()).await, layer(&default_config()));
        let err = c.create_order(create(10)).await.unwrap_err();
        assert_eq!(err.code(), tonic::Code::Unavailable, "{values:?}");
        assert_eq!(shop.attempts(), 1, "{values:?}");
        assert_eq!(
            report_of(&err).outcome,
            CallOutcome::PushbackStop,
            "{values:?}"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn pushback_0_retries_at_once() {
    // A 1 s backoff would show: the retry must come with no wait at all.
    let cfg = retry_config(3, Duration::from_secs(1), Duration::from_secs(1), 2.0);
    let shop = Shop::with([pushback(&["0"]), Fault::Ok]);
    let mut c = client(serve(shop.clone()).await, layer(&cfg));
    c.create_order(create(10)).await.unwrap();
    assert_eq!(shop.gaps(), [Duration::ZERO]);
}

// ---------------------------------------------------------------- throttling

/// grpc-go `test/retry_test.go` `TestRetryThrottling`: maxTokens 10, tokenRatio 0.5,
/// maxAttempts 4; the server answers OK on attempts 0, 3, 6, 10–14, 16, 18 and UNAVAILABLE
/// otherwise. Each call's code and the server's attempt index after it must match.
#[tokio::test(start_paused = true)]
async fn grpc_go_retry_throttling_sequence() {
    let ok_at = [0, 3, 6, 10, 11, 12, 13, 14, 16, 18];
    let shop = Shop::with((0..19).map(|i| {
        if ok_at.contains(&i) {
            Fault::Ok
        } else {
            unavailable()
        }
    }));
    let cfg = config(
        policy(4, Duration::from_millis(10), Duration::from_millis(10), 1.0),
        Some(RetryThrottling {
            max_milli_tokens: 10_000,
            token_ratio_milli: 500,
        }),
    );
    let l = layer(&cfg);
    let mut c = client(serve(shop.clone()).await, l.clone());
    use tonic::Code::{Ok as OK, Unavailable as UNAV};
    let expected = [
        (OK, 0, 10_000),
        (OK, 3, 8_500),
        (OK, 6, 7_000),
        (UNAV, 8, 5_000), // first failure retried, second throttled
        (UNAV, 9, 4_000),
        (OK, 10, 4_500),
        (OK, 11, 5_000),
        (OK, 12, 5_500),
        (OK, 13, 6_000),
        (OK, 14, 6_500),
        (OK, 16, 6_000),
        (UNAV, 17, 5_000),
    ];
    for (n, (code, last_index, tokens)) in expected.into_iter().enumerate() {
        let got = match c.get_order(get("x")).await {
            Ok(_) => OK,
            Err(s) => s.code(),
        };
        assert_eq!(got, code, "call {n}");
        assert_eq!(
            shop.attempts() - 1,
            last_index,
            "call {n}: server attempt index"
        );
        assert_eq!(
            l.throttle().unwrap().milli_tokens(),
            tokens,
            "call {n}: tokens"
        );
    }
}

// ---------------------------------------------------------------- deadline

#[tokio::test(start_paused = true)]
async fn a_100ms_deadline_with_1s_backoff_makes_one_attempt_and_returns_well_under_1s() {
    let cfg = retry_config(3, Duration::from_secs(1), Duration::from_secs(1), 2.0);
    let shop = Shop::with([unavailable(), Fault::Ok]);
    let mut c = client(serve(shop.clone()).await, layer(&cfg));
    let mut req = create(10);
    req.set_timeout(Duration::from_millis(100));
    let start = Instant::now();
    let err = c.create_order(req).await.unwrap_err();
    let elapsed = start.elapsed();
    assert!(elapsed < Duration::from_millis(100), "took {elapsed:?}");
    assert_eq!(
        err.code(),
        tonic::Code::Unavailable,
        "the last attempt's status"
    );
    assert_eq!(shop.attempts(), 1);
    assert_eq!(report_of(&err).outcome, CallOutcome::Deadline);
}

// ---------------------------------------------------------------- keys

#[tokio::test(start_paused = true)]
async fn a_generated_key_is_identical_on_every_attempt() {
    let shop = Shop::with([unavailable(), unavailable(), Fault::Ok]);
    let mut c = client(serve(shop.clone()).await, layer(&default_config()));
    c.create_order(create(10)).await.unwrap();
    let keys = shop.headers("x-idempotency-key");
    assert_eq!(keys.len(), 3);
    let first = keys[0].clone().expect("a key on a protected method");
    assert!(IdempotencyKey::parse(first.as_bytes()).is_ok());
    assert_eq!(first.len(), 32, "128 random bits");
    assert!(
        keys.iter().all(|k| k.as_deref() == Some(first.as_str())),
        "{keys:?}"
    );
    // The next call gets a new key.
    c.create_order(create(10)).await.unwrap();
    assert_ne!(shop.seen()[3].header("x-idempotency-key").unwrap(), first);
}

#[tokio::test(start_paused = true)]
async fn the_callers_key_is_kept() {
    let shop = Shop::with([unavailable(), Fault::Ok]);
    let mut c = client(serve(shop.clone()).await, layer(&default_config()));
    let mut req = create(10);
    with_key(&mut req, &"order-2024-0001".parse().unwrap());
    c.create_order(req).await.unwrap();
    let keys = shop.headers("x-idempotency-key");
    assert_eq!(
        keys,
        [
            Some("order-2024-0001".into()),
            Some("order-2024-0001".into())
        ]
    );
}

#[tokio::test(start_paused = true)]
async fn unprotected_methods_get_no_key_unless_the_option_says_so() {
    let shop = Shop::with([unavailable(), Fault::Ok]);
    let addr = serve(shop.clone()).await;
    let mut c = client(addr, layer(&default_config()));
    c.get_order(get("o-9")).await.unwrap();
    assert_eq!(shop.attempts(), 2, "retried, but");
    assert!(
        shop.seen()
            .iter()
            .all(|s| s.method == "GetOrder" && s.header("x-idempotency-key").is_none())
    );
    let all = RetryLayer::builder()
        .service_config(default_config())
        .key_all_methods(true)
        .build()
        .unwrap();
    let mut c = client(addr, all);
    c.get_order(get("o-9")).await.unwrap();
    assert!(shop.seen()[2].header("x-idempotency-key").is_some());
}

#[tokio::test(start_paused = true)]
async fn the_interceptor_key_is_stable_across_retries_below_it() {
    let shop = Shop::with([unavailable(), unavailable(), Fault::Ok]);
    let addr = serve(shop.clone()).await;
    // No idempotency in this config: the key comes only from the interceptor.
    let cfg = ServiceConfig::from_parts(
        vec![
            MethodConfig::empty()
                .with_name("shop.v1.Orders", "")
                .with_retry_policy(default_policy(3)),
        ],
        None,
        IdemSettings::default(),
    )
    .unwrap();
    let svc = ServiceBuilder::new()
        .layer(layer(&cfg))
        .service(net::channel(addr));
    let mut c = OrdersClient::with_interceptor(svc, IdempotencyKeyInterceptor::all_methods());
    c.get_order(get("o-1")).await.unwrap();
    let keys = shop.headers("x-idempotency-key");
    assert_eq!(keys.len(), 3);
    assert!(
        keys[0].is_some() && keys.iter().all(|k| *k == keys[0]),
        "{keys:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn the_interceptor_for_a_config_keys_only_protected_methods() {
    let shop = Shop::default();
    let addr = serve(shop.clone()).await;
    let cfg = default_config();
    // A layer that adds no keys itself, so every key seen comes from the interceptor.
    let no_keys = ServiceConfig::from_parts(Vec::new(), None, IdemSettings::default()).unwrap();
    let svc = ServiceBuilder::new()
        .layer(layer(&no_keys))
        .service(net::channel(addr));
    let mut c = OrdersClient::with_interceptor(svc, IdempotencyKeyInterceptor::for_config(&cfg));
    c.create_order(create(10)).await.unwrap();
    c.get_order(get("o-1")).await.unwrap();
    let seen = shop.seen();
    assert_eq!(seen[0].method, "CreateOrder");
    assert!(seen[0].header("x-idempotency-key").is_some());
    assert_eq!(seen[1].method, "GetOrder");
    assert!(seen[1].header("x-idempotency-key").is_none());
}

// ---------------------------------------------------------------- body and transport

#[tokio::test(start_paused = true)]
async fn a_body_over_the_cap_is_sent_once_and_whole() {
    let shop = Shop::with([unavailable(), Fault::Ok]);
    let l = RetryLayer::builder()
        .service_config(default_config())
        .max_replay_bytes_per_call(1024)
        .build()
        .unwrap();
    let mut c = client(serve(shop.clone()).await, l.clone());
    let err = c.create_order(create(4096)).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unavailable);
    assert_eq!(shop.attempts(), 1);
    assert_eq!(
        shop.seen()[0].note_len,
        4096,
        "nothing read for buffering is lost"
    );
    assert_eq!(report_of(&err).outcome, CallOutcome::BodyTooLarge);
    // A small body on the same layer is retried.
    c.create_order(create(100)).await.unwrap();
    assert_eq!(shop.attempts(), 2);
    assert_eq!(l.replay_bytes_held(), 0);
}

#[tokio::test]
async fn a_refused_connection_is_retried() {
    // A port nothing listens on: bind, note it, close it.
    let addr = {
        let (addr, _incoming) = net::bind().await;
        addr
    };
    let l = layer(&default_config());
    let mut c = client(addr, l.clone());
    let err = c.create_order(create(10)).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unavailable, "{err:?}");
    let stats = l.stats().snapshot();
    assert_eq!((stats.calls, stats.attempts, stats.retries), (1, 3, 2));
    assert_eq!(stats.outcome(CallOutcome::AttemptsExhausted), 1);

    // Retries reach a server that comes up on that port during the backoff.
    let l = RetryLayer::builder()
        .service_config(retry_config(
            5,
            Duration::from_millis(200),
            Duration::from_millis(200),
            1.0,
        ))
        .build()
        .unwrap();
    let mut c = client(addr, l.clone());
    let shop = Shop::default();
    let server = serve_later(addr, shop.clone(), Duration::from_millis(50));
    let (resp, ()) = tokio::join!(c.create_order(create(10)), server);
    let resp = resp.unwrap();
    let report = CallReport::from_response(&resp).unwrap();
    assert!(report.attempts >= 2, "{report:?}");
    assert_eq!(
        shop.attempts(),
        1,
        "only the attempt that reached the server is seen"
    );
}

#[tokio::test]
async fn wait_for_ready_waits_for_a_server_that_comes_up_without_using_attempts() {
    // A port nothing listens on yet.
    let addr = {
        let (addr, _incoming) = net::bind().await;
        addr
    };
    let cfg = ServiceConfig::from_parts(
        vec![
            MethodConfig::empty()
                .with_name("shop.v1.Orders", "CreateOrder")
                .with_retry_policy(default_policy(2))
                .with_wait_for_ready(true)
                .with_timeout(Duration::from_secs(10))
                .with_idempotency(IdempotencyPolicy::default()),
        ],
        None,
        IdemSettings::default(),
    )
    .unwrap();
    let l = layer(&cfg);
    let mut c = client(addr, l.clone());
    let shop = Shop::default();
    let server = serve_later(addr, shop.clone(), Duration::from_millis(300));
    let start = std::time::Instant::now();
    let (resp, ()) = tokio::join!(c.create_order(create(10)), server);
    let resp = resp.unwrap();
    assert!(start.elapsed() >= Duration::from_millis(300));
    let report = CallReport::from_response(&resp).unwrap();
    assert_eq!(
        (report.outcome, report.attempts),
        (CallOutcome::Committed, 1),
        "waiting for the channel uses no attempt"
    );
    assert_eq!(shop.attempts(), 1);
    let stats = l.stats().snapshot();
    assert_eq!((stats.attempts, stats.retries), (1, 0));
}

#[tokio::test(start_paused = true)]
async fn message_limits_from_the_config_apply_both_ways() {
    let cfg = ServiceConfig::from_json(
        r#"{"methodConfig": [
          {"name": [{"service": "shop.v1.Orders", "method": "CreateOrder"}],
           "maxRequestMessageBytes": 100,
           "retryPolicy": {"maxAttempts": 3, "initialBackoff": "0.02s", "maxBackoff": "1s",
                           "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]}},
          {"name": [{"service": "shop.v1.Orders", "method": "GetOrder"}],
           "maxResponseMessageBytes": 8}
        ]}"#,
    )
    .unwrap();
    let shop = Shop::default();
    let mut c = client(serve(shop.clone()).await, layer(&cfg));
    // A request message over its limit never leaves the client.
    let err = c.create_order(create(200)).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::ResourceExhausted, "{err:?}");
    assert!(
        err.message().contains("maxRequestMessageBytes (100)"),
        "{err:?}"
    );
    let r = report_of(&err);
    assert_eq!((r.outcome, r.attempts), (CallOutcome::MessageTooLarge, 0));
    assert_eq!(shop.attempts(), 0);
    c.create_order(create(10)).await.unwrap();
    assert_eq!(shop.attempts(), 1);
    // A response message over its limit ends the call (here without a retry policy).
    let err = c.get_order(get("o-9")).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::ResourceExhausted, "{err:?}");
    assert!(
        err.message().contains("maxResponseMessageBytes (8)"),
        "{err:?}"
    );
    assert_eq!(report_of(&err).outcome, CallOutcome::MessageTooLarge);
}

#[tokio::test(start_paused = true)]
async fn a_builder_without_a_config_keys_every_method() {
    let shop = Shop::with([unavailable(), Fault::Ok]);
    let l = RetryLayer::builder().seed(3).build().unwrap();
    let mut c = client(serve(shop.clone()).await, l);
    c.get_order(get("o-9")).await.unwrap();
    let keys = shop.headers("x-idempotency-key");
    assert_eq!(keys.len(), 2);
    assert!(
        keys[0].is_some(),
        "an idem server would answer KEY_MISSING without it"
    );
    assert_eq!(keys[0], keys[1]);
}
