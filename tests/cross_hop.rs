//! Across hops (docs/semantics.md, section 4): a chain of real tonic servers A → B → C → D on
//! 127.0.0.1, each with idem's server layers (`InboundLayer`, `IdempotencyLayer`) and a
//! `RetryLayer` client (maxAttempts 3) to the next hop.
//!
//! - Retry at one layer only: D always answers UNAVAILABLE. With the guard, D sees 3
//!   attempts per call into A; with it switched off, 3 × 3 × 3 = 27.
//! - Deadlines: the time left at A is what D is given, minus what was spent on the way;
//!   a handler making two sequential calls gives the second less than the first.
//! - The pushback marker never leaks onto errors that did not come from an exhausted
//!   downstream call.

use idem_test_support::net;
use idem_test_support::shop;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem::client::retry::{Retry, RetryLayer};
use idem::core::config::ServiceConfig;
use idem::core::deadline::parse_grpc_timeout;
use idem::server::{idempotency::IdempotencyLayer, inbound::InboundLayer};
use idem::store::memory::MemoryStore;
use idem_test_support::shop_fake::create_only;
use shop::orders_client::OrdersClient;
use shop::orders_server::{Orders, OrdersServer};
use shop::{CreateOrderRequest, Order};
use tokio::time::Instant;
use tonic::transport::{Channel, Server};
use tonic::{Code, Request, Response, Status};
use tower::ServiceBuilder;

const HOP_CONFIG: &str = r#"{
  "methodConfig": [{
    "name": [{"service": "shop.v1.Orders"}],
    "retryPolicy": {
      "maxAttempts": 3, "initialBackoff": "0.001s", "maxBackoff": "0.002s",
      "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]
    },
    "idempotency": {}
  }],
  "idem": {"tenant": {"single": "hops"}}
}"#;

fn config() -> ServiceConfig {
    ServiceConfig::from_json(HOP_CONFIG).expect("valid")
}

type Next = OrdersClient<Retry<Channel>>;

/// What the bottom hop (D) does.
#[derive(Clone, Copy)]
enum Bottom {
    /// UNAVAILABLE, always.
    Unavailable,
    /// INVALID_ARGUMENT (not retryable): passed up, never exhausted.
    InvalidArgument,
    /// OK after `delay`.
    OkAfter(Duration),
}

/// What a middle hop does with its request.
#[derive(Clone, Copy)]
enum Middle {
    /// Forwards once and passes the downstream result up unchanged (`?`).
    Forward,
    /// Works for a while, then forwards as `Forward`.
    ForwardAfter(Duration),
    /// Forwards twice in sequence (two downstream calls), passing errors up.
    ForwardTwice,
    /// Forwards once, but answers a fresh UNAVAILABLE of its own on any error.
    OwnError,
}

#[derive(Default)]
struct Seen {
    /// Calls that reached this hop's handler.
    calls: usize,
    /// `grpc-timeout` of each call, and when it arrived.
    timeouts: Vec<(Option<Duration>, Instant)>,
}

struct Hop {
    next: Option<(Next, Middle)>,
    bottom: Bottom,
    seen: Arc<Mutex<Seen>>,
}

impl Hop {
    fn server(self) -> OrdersServer<impl Orders> {
        let hop = Arc::new(self);
        create_only(move |request| hop.clone().create(request))
    }

    async fn create(
        self: Arc<Self>,
        request: Request<CreateOrderRequest>,
    ) -> Result<Response<Order>, Status> {
        let timeout = request
            .metadata()
            .get("grpc-timeout")
            .and_then(|v| parse_grpc_timeout(v.as_bytes()));
        {
            let mut seen = self.seen.lock().unwrap();
            seen.calls += 1;
            seen.timeouts.push((timeout, Instant::now()));
        }
        let msg = request.into_inner();
        match &self.next {
            Some((next, mode)) => {
                let mut next = next.clone();
                match mode {
                    Middle::Forward => Ok(next.create_order(msg).await?),
                    Middle::ForwardAfter(d) => {
                        tokio::time::sleep(*d).await;
                        Ok(next.create_order(msg).await?)
                    }
                    Middle::ForwardTwice => {
                        next.create_order(msg.clone()).await?;
                        Ok(next.create_order(msg).await?)
                    }
                    Middle::OwnError => next
                        .create_order(msg)
                        .await
                        .map_err(|_| Status::unavailable("my own error")),
                }
            }
            None => match self.bottom {
                Bottom::Unavailable => Err(Status::unavailable("D is down")),
                Bottom::InvalidArgument => Err(Status::invalid_argument("D refuses")),
                Bottom::OkAfter(d) => {
                    tokio::time::sleep(d).await;
                    Ok(Response::new(Order {
                        order_id: "o-1".into(),
                        ..Order::default()
                    }))
                }
            },
        }
    }
}

fn retrying_client(addr: SocketAddr, cfg: &ServiceConfig) -> Next {
    OrdersClient::new(
        ServiceBuilder::new()
            .layer(RetryLayer::from_config(cfg))
            .service(net::channel(addr)),
    )
}

/// Starts one hop with idem's server layers; returns its address and what it saw.
async fn start_hop(
    next: Option<(Next, Middle)>,
    bottom: Bottom,
    guard: bool,
) -> (SocketAddr, Arc<Mutex<Seen>>) {
    let cfg = config();
    let seen = Arc::new(Mutex::new(Seen::default()));
    let (addr, incoming) = net::bind().await;
    let hop = Hop {
        next,
        bottom,
        seen: seen.clone(),
    };
    tokio::spawn(
        Server::builder()
            .layer(InboundLayer::new().pushback_on_exhausted(guard))
            .layer(IdempotencyLayer::new(MemoryStore::default(), &cfg))
            .add_service(hop.server())
            .serve_with_incoming(incoming),
    );
    (addr, seen)
}

/// A → B → C → D with the given modes; returns A's address and every hop's record.
async fn chain(middle: Middle, bottom: Bottom, guard: bool) -> (SocketAddr, Vec<Arc<Mutex<Seen>>>) {
    let cfg = config();
    let (d, seen_d) = start_hop(None, bottom, guard).await;
    let (c, seen_c) = start_hop(Some((retrying_client(d, &cfg), middle)), bottom, guard).await;
    let (b, seen_b) = start_hop(Some((retrying_client(c, &cfg), middle)), bottom, guard).await;
    let (a, seen_a) = start_hop(Some((retrying_client(b, &cfg), middle)), bottom, guard).await;
    (a, vec![seen_a, seen_b, seen_c, seen_d])
}

fn message() -> CreateOrderRequest {
    CreateOrderRequest {
        customer_id: "c".into(),
        sku: "s".into(),
        quantity: 1,
        note: String::new(),
    }
}

/// A CreateOrder request with its own idempotency key (A's method is protected).
fn request() -> Request<CreateOrderRequest> {
    let mut req = Request::new(message());
    idem::client::with_key(&mut req, &idem::core::key::IdempotencyKey::generate());
    req
}

fn calls(seen: &Arc<Mutex<Seen>>) -> usize {
    seen.lock().unwrap().calls
}

/// The handler calls of each hop, in order.
fn counts(seen: &[Arc<Mutex<Seen>>]) -> Vec<usize> {
    seen.iter().map(calls).collect()
}

/// One call of `req` into `addr` from a plain client (no retries of its own).
async fn call_plain(
    addr: SocketAddr,
    req: Request<CreateOrderRequest>,
) -> Result<Response<Order>, Status> {
    OrdersClient::new(net::channel(addr))
        .create_order(req)
        .await
}

#[tokio::test]
async fn with_the_guard_d_sees_three_attempts_per_call_from_a() {
    let (a, seen) = chain(Middle::Forward, Bottom::Unavailable, true).await;
    // A plain client: one call into A.
    let err = call_plain(a, request()).await.unwrap_err();
    assert_eq!(err.code(), Code::Unavailable);
    assert_eq!(
        err.metadata()
            .get("grpc-retry-pushback-ms")
            .map(|v| v.to_str().unwrap()),
        Some("-1"),
        "A's caller is told not to retry"
    );
    assert_eq!(counts(&seen), vec![1, 1, 1, 3], "A, B, C, D handler calls");
    // Internal headers never leave the process.
    for name in [
        "x-idem-downstream-exhausted",
        "x-idem-retry-outcome",
        "x-idem-retry-attempts",
    ] {
        assert!(err.metadata().get(name).is_none(), "{name} leaked");
    }
}

#[tokio::test]
async fn without_the_guard_d_sees_twenty_seven() {
    let (a, seen) = chain(Middle::Forward, Bottom::Unavailable, false).await;
    let err = call_plain(a, request()).await.unwrap_err();
    assert_eq!(err.code(), Code::Unavailable);
    assert!(err.metadata().get("grpc-retry-pushback-ms").is_none());
    assert_eq!(counts(&seen), vec![1, 3, 9, 27], "A, B, C, D handler calls");
}

#[tokio::test]
async fn a_retrying_client_at_the_top_does_not_retry_the_marked_failure() {
    let (a, seen) = chain(Middle::Forward, Bottom::Unavailable, true).await;
    let cfg = config();
    let mut top = retrying_client(a, &cfg);
    let err = top.create_order(request()).await.unwrap_err();
    assert_eq!(err.code(), Code::Unavailable);
    assert_eq!(
        counts(&seen),
        vec![1, 1, 1, 3],
        "the top client stopped after one attempt"
    );
}

#[tokio::test]
async fn errors_not_from_an_exhausted_downstream_call_carry_no_marker() {
    // D's own UNAVAILABLE to a plain caller: no pushback.
    let (d, _) = start_hop(None, Bottom::Unavailable, true).await;
    let err = call_plain(d, request()).await.unwrap_err();
    assert!(err.metadata().get("grpc-retry-pushback-ms").is_none());

    // A non-retryable code passed up unchanged through the chain: nothing was exhausted.
    let (a, seen) = chain(Middle::Forward, Bottom::InvalidArgument, true).await;
    let err = call_plain(a, request()).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.metadata().get("grpc-retry-pushback-ms").is_none());
    assert_eq!(counts(&seen), vec![1, 1, 1, 1]);

    // A handler that answers an error of its own after its downstream call was
    // exhausted: its error is not the exhausted one, so it is retried normally.
    let (a, seen) = chain(Middle::OwnError, Bottom::Unavailable, true).await;
    let err = call_plain(a, request()).await.unwrap_err();
    assert_eq!(err.message(), "my own error");
    assert!(err.metadata().get("grpc-retry-pushback-ms").is_none());
    assert!(err.metadata().get("x-idem-downstream-exhausted").is_none());
    assert_eq!(counts(&seen), vec![1, 3, 9, 27]);
}

#[tokio::test]
async fn the_inbound_deadline_flows_down_the_chain_minus_time_spent() {
    // Each middle hop works 20 ms before calling the next.
    let work = Duration::from_millis(20);
    let (a, seen) = chain(
        Middle::ForwardAfter(work),
        Bottom::OkAfter(Duration::ZERO),
        true,
    )
    .await;
    let mut req = request();
    req.set_timeout(Duration::from_secs(1));
    call_plain(a, req).await.expect("OK through the chain");

    let given: Vec<Duration> = seen
        .iter()
        .enumerate()
        .map(|(i, hop)| {
            hop.lock().unwrap().timeouts[0]
                .0
                .unwrap_or_else(|| panic!("hop {i} got no grpc-timeout"))
        })
        .collect();
    assert_eq!(given[0], Duration::from_secs(1));
    for i in 1..given.len() {
        // Hop i-1's deadline started when its inbound layer read the call, at or before
        // its handler saw it; the handler then worked 20 ms before calling on. So what
        // it passes on is at most what it was given minus that work (grpc-timeout
        // rounds up by < 1 ms). Each bound uses one hop's own clock: the loopback
        // transit between hops, which the next hop cannot see, does not enter.
        assert!(
            given[i] + work <= given[i - 1] + Duration::from_millis(1),
            "hop {i}: given {:?}, but hop {} was given {:?} and worked {work:?} first",
            given[i],
            i - 1,
            given[i - 1]
        );
    }
    // D (three hops of 20 ms work down) got at most 940 ms of the original second
    // (plus < 1 ms of rounding per hop).
    assert!(given[3] <= Duration::from_millis(943), "{:?}", given[3]);
}

#[tokio::test]
async fn a_second_sequential_call_gets_less_time_than_the_first() {
    let cfg = config();
    let (d, seen_d) = start_hop(None, Bottom::OkAfter(Duration::from_millis(30)), true).await;
    let (a, _) = start_hop(
        Some((retrying_client(d, &cfg), Middle::ForwardTwice)),
        Bottom::Unavailable,
        true,
    )
    .await;
    let mut req = request();
    req.set_timeout(Duration::from_secs(1));
    call_plain(a, req).await.expect("OK");
    let seen = seen_d.lock().unwrap();
    assert_eq!(seen.timeouts.len(), 2);
    let first = seen.timeouts[0].0.expect("first call has a deadline");
    let second = seen.timeouts[1].0.expect("second call has a deadline");
    assert!(first < Duration::from_secs(1), "{first:?}");
    // D spent 30 ms on the first call: the second is given at least that much less.
    assert!(
        second + Duration::from_millis(30) <= first,
        "first {first:?}, second {second:?}"
    );
}

#[tokio::test]
async fn deadline_propagation_works_without_idempotency() {
    // InboundLayer alone (no IdempotencyLayer), and a client with no `idempotency` entry.
    let cfg = ServiceConfig::from_json(
        r#"{"methodConfig": [{"name": [{"service": "shop.v1.Orders"}],
            "retryPolicy": {"maxAttempts": 2, "initialBackoff": "0.001s", "maxBackoff": "0.001s",
                            "backoffMultiplier": 1, "retryableStatusCodes": ["UNAVAILABLE"]}}]}"#,
    )
    .expect("valid");
    let seen_d = Arc::new(Mutex::new(Seen::default()));
    let (d, incoming) = net::bind().await;
    tokio::spawn(
        Server::builder()
            .add_service(
                Hop {
                    next: None,
                    bottom: Bottom::OkAfter(Duration::ZERO),
                    seen: seen_d.clone(),
                }
                .server(),
            )
            .serve_with_incoming(incoming),
    );
    let (a, incoming) = net::bind().await;
    tokio::spawn(
        Server::builder()
            .layer(InboundLayer::new())
            .add_service(
                Hop {
                    next: Some((retrying_client(d, &cfg), Middle::Forward)),
                    bottom: Bottom::Unavailable,
                    seen: Arc::new(Mutex::new(Seen::default())),
                }
                .server(),
            )
            .serve_with_incoming(incoming),
    );
    let mut req = request();
    req.set_timeout(Duration::from_millis(500));
    call_plain(a, req).await.expect("OK");
    let t = seen_d.lock().unwrap().timeouts[0]
        .0
        .expect("D got a deadline");
    assert!(t < Duration::from_millis(500), "{t:?}");
}

#[tokio::test]
async fn optional_no_retries_under_an_inbound_retry() {
    let cfg = config();
    let (d, seen_d) = start_hop(None, Bottom::Unavailable, true).await;
    let layer = RetryLayer::builder()
        .service_config(cfg.clone())
        .no_retry_under_retried_inbound(true)
        .build()
        .expect("valid layer");
    let next = OrdersClient::new(ServiceBuilder::new().layer(layer).service(net::channel(d)));
    let (a, _) = start_hop(Some((next, Middle::Forward)), Bottom::Unavailable, true).await;
    let mut top = OrdersClient::new(net::channel(a));

    // A first attempt into A: A's client retries as usual.
    top.create_order(request()).await.unwrap_err();
    assert_eq!(calls(&seen_d), 3);

    // An inbound retry (grpc-previous-rpc-attempts: 1): A's client makes one attempt.
    let mut retry = request();
    retry
        .metadata_mut()
        .insert("grpc-previous-rpc-attempts", "1".parse().unwrap());
    top.create_order(retry).await.unwrap_err();
    assert_eq!(calls(&seen_d), 4);
}

#[tokio::test]
async fn an_unreachable_downstream_is_marked_too() {
    let cfg = config();
    // A port nothing listens on: every attempt fails to connect (a transport error, not a
    // response).
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let (a, seen_a) = start_hop(
        Some((retrying_client(dead, &cfg), Middle::Forward)),
        Bottom::Unavailable,
        true,
    )
    .await;
    let mut top = retrying_client(a, &cfg);
    let err = top.create_order(request()).await.unwrap_err();
    assert_eq!(err.code(), Code::Unavailable);
    assert!(
        err.message()
            .contains("downstream call failed on every attempt"),
        "{err:?}"
    );
    assert_eq!(
        calls(&seen_a),
        1,
        "the top client did not retry the marked failure"
    );
}
