//! Tests of the server idempotency layer: a real tonic `Orders` server (the shared
//! `shop_fake::Shop`) on 127.0.0.1 behind an auth layer (tenant from a test header into
//! a request extension) and `IdempotencyLayer`, driven by the generated client.
//!
//! Tests that move time (leases, deadlines) drive the layer in-process around the real
//! generated `OrdersServer` (hand-built gRPC requests) on tokio's paused clock.

use idem_store::faulty::{FaultyStore, INTERNAL_DETAIL, StoreFault as Fault};
use idem_store::instrumented::StoreOp as Op;
use idem_test_support::net;
use idem_test_support::shop;
use idem_test_support::shop_fake::{Shop, create};

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http_body_util::{BodyExt, Full};
use idem_core::config::{
    IdemSettings, IdempotencyPolicy, InFlightPolicy, MethodConfig, ServiceConfig,
};
use idem_core::headers::reason;
use idem_server::idempotency::{
    IdempotencyLayer, IdempotencyStats, StatsSnapshot, scope_for, tenant::FromExtension,
};
use idem_store::{RecordState, Store, memory::MemoryStore};
use prost::Message;
use shop::orders_client::OrdersClient;
use shop::orders_server::OrdersServer;
use shop::{CreateOrderRequest, GetOrderRequest, ListOrdersRequest, Order};
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tonic::body::Body;
use tonic::codec::CompressionEncoding;
use tonic::metadata::MetadataMap;
use tonic::transport::{Channel, Server};
use tonic::{Code, Request, Response, Status};
use tonic_types::StatusExt;
use tower::{Service, ServiceExt};

const CREATE: &str = "/shop.v1.Orders/CreateOrder";
const LIST: &str = "/shop.v1.Orders/ListOrders";
const KEY: &str = "order-key-0001";

// ---------------------------------------------------------------- the server

/// Set by the test auth layer from the `x-test-tenant` header.
#[derive(Clone)]
struct Tenant(String);

impl AsRef<str> for Tenant {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

fn policy() -> IdempotencyPolicy {
    IdempotencyPolicy {
        // The tests' server accepts gzip requests (some send them).
        accept_compressed: idem_core::config::CompressionSet::EMPTY
            .with(idem_core::config::Compression::Gzip),
        ..IdempotencyPolicy::default()
    }
}

/// CreateOrder and ListOrders with `create`, GetOrder with `get` (unprotected if `None`).
fn config(create: IdempotencyPolicy, get: Option<IdempotencyPolicy>) -> ServiceConfig {
    let mut entries = vec![
        MethodConfig::empty()
            .with_name("shop.v1.Orders", "CreateOrder")
            .with_name("shop.v1.Orders", "ListOrders")
            .with_idempotency(create),
    ];
    if let Some(get) = get {
        entries.push(
            MethodConfig::empty()
                .with_name("shop.v1.Orders", "GetOrder")
                .with_idempotency(get),
        );
    }
    ServiceConfig::from_parts(entries, None, IdemSettings::default()).expect("valid config")
}

fn auth(mut req: http::Request<Body>) -> http::Request<Body> {
    let tenant = req
        .headers()
        .get("x-test-tenant")
        .and_then(|v| v.to_str().ok())
        .map(|t| Tenant(t.to_owned()));
    if let Some(t) = tenant {
        req.extensions_mut().insert(t);
    }
    req
}

struct Running {
    addr: SocketAddr,
    shop: Shop,
    /// The layer's counters.
    stats: IdempotencyStats,
}

impl Running {
    fn client(&self) -> OrdersClient<Channel> {
        OrdersClient::new(net::channel(self.addr))
    }
}

async fn serve<St: Store>(layer: IdempotencyLayer<St>) -> Running {
    serve_probed(layer, Arc::new(Notify::new())).await
}

/// Serves `Orders` behind a drop probe (outermost), the auth layer, and `layer`, the
/// way the docs say: `Server::builder().layer(auth).layer(idempotency)`.
async fn serve_probed<St: Store>(layer: IdempotencyLayer<St>, dropped: Arc<Notify>) -> Running {
    let shop = Shop::new();
    let stats = layer.stats();
    let (addr, incoming) = net::bind().await;
    let auth_fn: fn(http::Request<Body>) -> http::Request<Body> = auth;
    let router = Server::builder()
        .max_concurrent_streams(Some(4096))
        .layer(DropProbe(dropped))
        .layer(tower::util::MapRequestLayer::new(auth_fn))
        .layer(layer)
        .add_service(OrdersServer::new(shop.clone()).accept_compressed(CompressionEncoding::Gzip));
    tokio::spawn(async move { router.serve_with_incoming(incoming).await.expect("server") });
    Running { addr, shop, stats }
}

/// [`serve`] with the default policy on `CreateOrder` and `ListOrders`, over `store`.
async fn serve_on<St: Store>(store: St) -> Running {
    serve(layer(store, &config(policy(), None))).await
}

fn layer<St: Store>(store: St, cfg: &ServiceConfig) -> IdempotencyLayer<St> {
    IdempotencyLayer::new(store, cfg).tenant(FromExtension::<Tenant>::new())
}

/// `msg` with an idempotency key and no tenant.
fn key_only<T>(msg: T, key: &str) -> Request<T> {
    let mut r = Request::new(msg);
    r.metadata_mut()
        .insert("x-idempotency-key", key.parse().unwrap());
    r
}

fn keyed<T>(msg: T, key: &str, tenant: &str) -> Request<T> {
    let mut r = key_only(msg, key);
    r.metadata_mut()
        .insert("x-test-tenant", tenant.parse().unwrap());
    r
}

/// `CreateOrder` for the "ok" item under [`KEY`], as `tenant`: the call most tests
/// send, and send again.
async fn create_ok(
    client: &mut OrdersClient<Channel>,
    tenant: &str,
) -> Result<Response<Order>, Status> {
    client.create_order(keyed(create("ok"), KEY, tenant)).await
}

/// `GetOrder` for order "x": the call to a method other than `CreateOrder`.
fn get_order_x() -> GetOrderRequest {
    GetOrderRequest {
        order_id: "x".into(),
    }
}

fn error_reason(s: &Status) -> Option<(String, String)> {
    s.get_details_error_info().map(|i| (i.domain, i.reason))
}

fn assert_idem_error(s: &Status, code: Code, why: &str) {
    assert_eq!(s.code(), code, "{s:?}");
    assert_eq!(
        error_reason(s),
        Some(("idem".to_owned(), why.to_owned())),
        "{s:?}"
    );
}

/// Metadata without what hyper adds per response (`date`) and the replay marker.
fn comparable(md: &MetadataMap) -> Vec<(String, Vec<u8>)> {
    let mut v: Vec<_> = md
        .clone()
        .into_headers()
        .iter()
        .filter(|(n, _)| *n != "date" && *n != "x-idempotency-replayed")
        .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec()))
        .collect();
    v.sort();
    v
}

fn replayed(md: &MetadataMap) -> bool {
    md.get("x-idempotency-replayed")
        .is_some_and(|v| v == "true")
}

/// Bounded "eventually": checks `cond` until it holds (never a condition of success by
/// itself: the assertion after it is).
async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    for _ in 0..2000 {
        if cond() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("timed out waiting for {what}");
}

// ---------------------------------------------------------------- replay

#[tokio::test]
async fn same_key_twice_runs_once_and_replays_headers_body_and_trailers() {
    let store = MemoryStore::default();
    let srv = serve_on(store.clone()).await;
    let mut client = srv.client();

    let first = create_ok(&mut client, "t1").await.unwrap();
    let second = create_ok(&mut client, "t1").await.unwrap();
    assert_eq!(srv.shop.runs(), 1, "handler ran once");
    assert_eq!(first.get_ref(), second.get_ref());
    assert_eq!(first.get_ref().order_id, "order-1");
    assert_eq!(comparable(first.metadata()), comparable(second.metadata()));
    assert!(!replayed(first.metadata()));
    assert!(replayed(second.metadata()));
    assert_eq!(second.metadata().get("x-run").unwrap(), "1");

    // Server streaming: every message and the trailers come back.
    let collect = |mut s: tonic::Streaming<Order>| async move {
        let mut items = Vec::new();
        while let Some(o) = s.message().await.unwrap() {
            items.push(o);
        }
        let trailers = s.trailers().await.unwrap().unwrap_or_default();
        (items, trailers)
    };
    let list = || {
        keyed(
            ListOrdersRequest {
                customer_id: "c-1".into(),
            },
            KEY,
            "t1",
        )
    };
    let a = client.list_orders(list()).await.unwrap();
    let (a_md, a) = (a.metadata().clone(), collect(a.into_inner()).await);
    let b = client.list_orders(list()).await.unwrap();
    let (b_md, b) = (b.metadata().clone(), collect(b.into_inner()).await);
    assert_eq!(srv.shop.runs(), 2, "one run per method");
    assert_eq!(a.0.len(), 3);
    assert_eq!(a.0, b.0, "every message replayed");
    assert_eq!(comparable(&a.1), comparable(&b.1), "trailers replayed");
    assert_eq!(comparable(&a_md), comparable(&b_md));
    assert!(replayed(&b_md));

    let s = srv.stats.snapshot();
    assert_eq!((s.executed, s.replayed, s.stored), (2, 2, 2), "{s:?}");
}

#[tokio::test]
async fn compressed_and_plain_copies_of_a_request_match() {
    let srv = serve_on(MemoryStore::default()).await;
    let mut gz = srv.client().send_compressed(CompressionEncoding::Gzip);
    let mut plain = srv.client();
    let mut req = create("ok");
    req.note = "n".repeat(2000);
    let a = gz
        .create_order(keyed(req.clone(), KEY, "t1"))
        .await
        .unwrap();
    let b = plain.create_order(keyed(req, KEY, "t1")).await.unwrap();
    assert_eq!(a.get_ref(), b.get_ref());
    assert!(replayed(b.metadata()));
    assert_eq!(srv.shop.runs(), 1);
}

// ---------------------------------------------------------------- mismatch

#[tokio::test]
async fn same_key_different_request_is_refused_and_the_record_is_unchanged() {
    let store = MemoryStore::default();
    let srv = serve_on(store.clone()).await;
    let mut client = srv.client();
    create_ok(&mut client, "t1").await.unwrap();
    let scope = scope_for("t1", CREATE, KEY);
    let before = store.get(&scope).await.unwrap();
    assert!(matches!(before, Some(RecordState::Completed { .. })));

    let err = client
        .create_order(keyed(create("other"), KEY, "t1"))
        .await
        .unwrap_err();
    assert_idem_error(&err, Code::FailedPrecondition, reason::KEY_REUSED);
    assert!(
        err.message()
            .contains("key reused with a different request"),
        "{}",
        err.message()
    );
    assert_eq!(store.get(&scope).await.unwrap(), before, "record unchanged");
    assert_eq!(srv.shop.runs(), 1);
    // The original request still replays.
    let again = create_ok(&mut client, "t1").await.unwrap();
    assert!(replayed(again.metadata()));
}

// ---------------------------------------------------------------- concurrency

async fn thousand(
    in_flight: InFlightPolicy,
) -> (Running, Vec<Result<Response<Order>, Status>>, StatsSnapshot) {
    let p = IdempotencyPolicy {
        in_flight,
        ..policy()
    };
    let l = layer(MemoryStore::default(), &config(p, None));
    let srv = serve(l).await;
    let client = srv.client();
    let mut calls = Vec::new();
    for _ in 0..1000 {
        let mut c = client.clone();
        calls.push(tokio::spawn(async move {
            c.create_order(keyed(create("gate"), KEY, "t1")).await
        }));
    }
    // Hold the one execution until the 999 others have found it in flight.
    let stats = &srv.stats;
    match in_flight {
        InFlightPolicy::Wait => eventually("999 waiters", || stats.snapshot().waited >= 999).await,
        InFlightPolicy::Abort => eventually("999 aborts", || stats.snapshot().aborted >= 999).await,
    }
    srv.shop.open_gate(1);
    let mut out = Vec::new();
    for c in calls {
        out.push(c.await.unwrap());
    }
    let s = srv.stats.snapshot();
    (srv, out, s)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_concurrent_calls_with_one_key_run_once() {
    let (srv, results, s) = thousand(InFlightPolicy::Wait).await;
    assert_eq!(srv.shop.runs(), 1, "exactly one execution");
    let oks: Vec<_> = results
        .into_iter()
        .map(|r| r.expect("every call succeeds"))
        .collect();
    assert_eq!(oks.len(), 1000);
    let first = oks[0].get_ref().clone();
    assert!(
        oks.iter().all(|r| *r.get_ref() == first),
        "identical responses"
    );
    let canon = comparable(oks[0].metadata());
    assert!(oks.iter().all(|r| comparable(r.metadata()) == canon));
    assert_eq!(oks.iter().filter(|r| replayed(r.metadata())).count(), 999);
    assert_eq!((s.executed, s.replayed, s.waited), (1, 999, 999), "{s:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_abort_policy_the_others_are_aborted_with_a_retry_delay() {
    let (srv, results, s) = thousand(InFlightPolicy::Abort).await;
    assert_eq!(srv.shop.runs(), 1);
    let (oks, errs): (Vec<_>, Vec<_>) = results.into_iter().partition(Result::is_ok);
    assert_eq!(oks.len(), 1);
    assert_eq!(errs.len(), 999);
    for e in errs {
        let e = e.unwrap_err();
        assert_idem_error(&e, Code::Aborted, reason::IN_PROGRESS);
        let retry = e.get_details_retry_info().expect("RetryInfo");
        assert_eq!(retry.retry_delay, Some(Duration::from_secs(1)));
    }
    assert_eq!((s.executed, s.aborted), (1, 999), "{s:?}");
}

// ---------------------------------------------------------------- isolation

#[tokio::test]
async fn tenants_and_methods_isolate_keys() {
    let l = layer(MemoryStore::default(), &config(policy(), Some(policy())));
    let srv = serve(l).await;
    let mut client = srv.client();
    let a = create_ok(&mut client, "tenant-a").await.unwrap();
    let b = create_ok(&mut client, "tenant-b").await.unwrap();
    assert_eq!(srv.shop.runs(), 2, "two tenants, two executions");
    assert_ne!(a.get_ref().order_id, b.get_ref().order_id);
    assert!(!replayed(b.metadata()));
    let a2 = create_ok(&mut client, "tenant-a").await.unwrap();
    assert_eq!(a2.get_ref(), a.get_ref(), "tenant a sees its own response");
    let b2 = create_ok(&mut client, "tenant-b").await.unwrap();
    assert_eq!(b2.get_ref(), b.get_ref());
    // Same key on another method: another execution.
    let g = client
        .get_order(keyed(get_order_x(), KEY, "tenant-a"))
        .await
        .unwrap();
    assert!(!replayed(g.metadata()));
    assert_eq!(srv.shop.runs(), 3);
    // No tenant on a protected call.
    let err = client
        .create_order(key_only(create("ok"), KEY))
        .await
        .unwrap_err();
    assert_idem_error(&err, Code::Unauthenticated, reason::TENANT_MISSING);
    assert_eq!(srv.shop.runs(), 3);
}

#[tokio::test]
async fn unprotected_methods_pass_through_whatever_they_carry() {
    let store = MemoryStore::default();
    let srv = serve_on(store.clone()).await;
    let mut client = srv.client();
    for key in ["", "bad key", KEY] {
        client
            .get_order(key_only(get_order_x(), key))
            .await
            .unwrap();
    }
    assert_eq!(srv.shop.runs(), 3);
    assert!(store.is_empty());
    assert_eq!(srv.stats.snapshot(), StatsSnapshot::default());
    // keyRequired: false → a keyless call passes through unprotected.
    let p = IdempotencyPolicy {
        key_required: false,
        ..policy()
    };
    let l = layer(store.clone(), &config(p, None));
    let srv = serve(l).await;
    let mut client = srv.client();
    client
        .create_order(Request::new(create("ok")))
        .await
        .unwrap();
    client
        .create_order(Request::new(create("ok")))
        .await
        .unwrap();
    assert_eq!(srv.shop.runs(), 2);
    assert!(store.is_empty());
}

// ---------------------------------------------------------------- cancellation

/// Signals when a response future is dropped before it completed (the caller went away).
#[derive(Clone)]
struct DropProbe(Arc<Notify>);

impl<S> tower::Layer<S> for DropProbe {
    type Service = Probed<S>;
    fn layer(&self, inner: S) -> Probed<S> {
        Probed(inner, self.0.clone())
    }
}

#[derive(Clone)]
struct Probed<S>(S, Arc<Notify>);

struct Armed(Option<Arc<Notify>>);

impl Armed {
    fn disarm(&mut self) {
        self.0 = None;
    }
}

impl Drop for Armed {
    fn drop(&mut self) {
        if let Some(n) = self.0.take() {
            n.notify_one();
        }
    }
}

impl<S> Service<http::Request<Body>> for Probed<S>
where
    S: Service<http::Request<Body>>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, S::Error>> + Send>>;
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.0.poll_ready(cx)
    }
    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        let fut = self.0.call(req);
        let mut armed = Armed(Some(self.1.clone()));
        Box::pin(async move {
            let r = fut.await;
            armed.disarm();
            r
        })
    }
}

#[tokio::test]
async fn a_caller_that_disconnects_does_not_cancel_the_handler() {
    let store = MemoryStore::default();
    let l = layer(store.clone(), &config(policy(), None));
    let dropped = Arc::new(Notify::new());
    let srv = serve_probed(l, dropped.clone()).await;
    let mut client = srv.client();
    let call =
        tokio::spawn(async move { client.create_order(keyed(create("gate"), KEY, "t1")).await });
    srv.shop.started().await;
    call.abort();
    dropped.notified().await; // the server saw the caller go away
    assert_eq!(srv.shop.finished(), 0, "handler still running");
    srv.shop.open_gate(1);
    eventually("the outcome to be stored", || {
        srv.stats.snapshot().stored == 1
    })
    .await;
    assert_eq!(srv.shop.finished(), 1, "the handler ran to completion");
    assert!(matches!(
        store.get(&scope_for("t1", CREATE, KEY)).await.unwrap(),
        Some(RecordState::Completed { .. })
    ));
    let retry = srv
        .client()
        .create_order(keyed(create("gate"), KEY, "t1"))
        .await
        .unwrap();
    assert!(replayed(retry.metadata()));
    assert_eq!(retry.get_ref().order_id, "order-1");
    assert_eq!(srv.shop.runs(), 1, "no second run");
}

// ---------------------------------------------------------------- code lists

#[tokio::test]
async fn cache_and_release_lists_and_handler_overrides() {
    let srv = serve_on(MemoryStore::default()).await;
    let mut client = srv.client();
    // (sku, key, code of both calls, runs after two calls)
    let cases: [(&str, &str, Option<Code>, usize); 5] = [
        ("unavailable", "key-unavailable", Some(Code::Unavailable), 2),
        ("internal", "key-internal-1", Some(Code::Internal), 1),
        (
            "unavailable-store",
            "key-unavail-store",
            Some(Code::Unavailable),
            1,
        ),
        (
            "internal-release",
            "key-internal-rel",
            Some(Code::Internal),
            2,
        ),
        ("ok-release", "key-ok-release-1", None, 2),
    ];
    for (sku, key, code, runs) in cases {
        let before = srv.shop.runs();
        let mut seen = Vec::new();
        for _ in 0..2 {
            let r = client.create_order(keyed(create(sku), key, "t1")).await;
            match (&r, code) {
                (Err(s), Some(c)) => {
                    assert_eq!(s.code(), c, "{sku}");
                    assert_eq!(
                        error_reason(s),
                        None,
                        "{sku}: a handler error, not the layer's"
                    );
                    assert!(
                        s.metadata().get("x-idempotency-decision").is_none(),
                        "stripped"
                    );
                    seen.push(replayed(s.metadata()));
                }
                (Ok(resp), None) => {
                    assert!(resp.metadata().get("x-idempotency-decision").is_none());
                    seen.push(replayed(resp.metadata()));
                }
                _ => panic!("{sku}: unexpected {r:?}"),
            }
        }
        assert_eq!(srv.shop.runs() - before, runs, "{sku}");
        assert_eq!(
            seen,
            [false, runs == 1],
            "{sku}: second replayed iff stored"
        );
    }
}

// ---------------------------------------------------------------- bad keys

#[tokio::test]
async fn bad_keys_are_refused_before_anything_runs_or_is_stored() {
    let store = MemoryStore::default();
    let srv = serve_on(store.clone()).await;
    // Raw header values, injected below the generated client's metadata checks.
    let table: Vec<(&str, Vec<&[u8]>, &str)> = vec![
        ("missing", vec![], reason::KEY_MISSING),
        ("empty", vec![b""], reason::KEY_INVALID),
        ("7 chars", vec![b"abcdefg"], reason::KEY_INVALID),
        ("65 chars", vec![&[b'a'; 65]], reason::KEY_INVALID),
        ("a,b", vec![b"a,b"], reason::KEY_INVALID),
        ("comma", vec![b"abcd,efgh"], reason::KEY_INVALID),
        (
            "two values",
            vec![b"abcdefgh1", b"abcdefgh2"],
            reason::KEY_INVALID,
        ),
        (
            "two equal values",
            vec![b"abcdefgh1", b"abcdefgh1"],
            reason::KEY_INVALID,
        ),
        ("spaces", vec![b"abcd efgh"], reason::KEY_INVALID),
        (
            "non-ASCII",
            vec!["abcdéfgh".as_bytes()],
            reason::KEY_INVALID,
        ),
        (
            "control byte (tab)",
            vec![b"abcd\tefgh"],
            reason::KEY_INVALID,
        ),
    ];
    for (name, values, why) in table {
        let values: Vec<http::HeaderValue> = values
            .iter()
            .map(|v| http::HeaderValue::from_bytes(v).unwrap())
            .collect();
        let channel = tower::ServiceBuilder::new()
            .map_request(move |mut req: http::Request<Body>| {
                for v in &values {
                    req.headers_mut().append("x-idempotency-key", v.clone());
                }
                req.headers_mut()
                    .insert("x-test-tenant", http::HeaderValue::from_static("t1"));
                req
            })
            .service(net::channel(srv.addr));
        let mut client = OrdersClient::new(channel);
        let err = client.create_order(create("ok")).await.unwrap_err();
        assert_idem_error(&err, Code::InvalidArgument, why);
        assert!(
            err.message()
                .contains("8 to 64 characters from [A-Za-z0-9_-]"),
            "{name}: {}",
            err.message()
        );
    }
    assert_eq!(srv.shop.runs(), 0, "handler not run");
    assert!(store.is_empty(), "nothing stored");
    assert_eq!(srv.stats.snapshot().rejected, 11);
}

// ---------------------------------------------------------------- store failure

/// A memory store whose next `times` calls of `op` fail with `fault`.
fn faulty(op: Op, fault: Fault, times: usize) -> FaultyStore<MemoryStore> {
    let store = FaultyStore::new(MemoryStore::default());
    store.inject(op, fault, times);
    store
}

/// A store that cannot answer anything.
fn failing_store() -> FaultyStore<MemoryStore> {
    let store = FaultyStore::new(MemoryStore::default());
    for op in [
        Op::Claim,
        Op::Renew,
        Op::Complete,
        Op::Release,
        Op::Get,
        Op::Wait,
    ] {
        store.inject(op, Fault::Unavailable, usize::MAX);
    }
    store
}

#[tokio::test]
async fn a_failing_store_fails_closed_unless_the_method_is_fail_open() {
    let store = failing_store();
    let cfg = config(
        policy(),
        Some(IdempotencyPolicy {
            fail_open: true,
            ..policy()
        }),
    );
    let l = layer(store.clone(), &cfg);
    let srv = serve(l).await;
    let mut client = srv.client();
    let err = create_ok(&mut client, "t1").await.unwrap_err();
    assert_idem_error(&err, Code::Unavailable, reason::STORE_UNAVAILABLE);
    assert!(
        !err.message().contains(INTERNAL_DETAIL),
        "the store's own words stay in the logs: {}",
        err.message()
    );
    assert_eq!(srv.shop.runs(), 0);
    for _ in 0..2 {
        let r = client
            .get_order(keyed(get_order_x(), KEY, "t1"))
            .await
            .unwrap();
        assert!(!replayed(r.metadata()));
    }
    assert_eq!(
        srv.shop.runs(),
        2,
        "fail-open runs without a record, every time"
    );
    let s = srv.stats.snapshot();
    // Each call sends its claim twice (once more in case only the reply was lost).
    assert_eq!(
        (s.store_errors, s.fail_open_runs, s.executed),
        (6, 2, 0),
        "{s:?}"
    );
    assert_eq!(store.calls(Op::Claim), 6);
    assert_eq!(
        store.calls(Op::Complete) + store.calls(Op::Release) + store.calls(Op::Wait),
        0,
        "only claims were attempted"
    );
}

#[tokio::test]
async fn a_claim_whose_reply_was_lost_is_sent_again_and_recognised() {
    let memory = MemoryStore::default();
    let store = FaultyStore::new(memory.clone());
    store.inject(Op::Claim, Fault::ReplyLost, 1);
    let srv = serve_on(store.clone()).await;
    let mut client = srv.client();
    // Without the resend, the record would stay in flight (held by the lost claim) until
    // its lease ends, and this call would wait for it.
    let r = create_ok(&mut client, "t1")
        .await
        .expect("the resent claim is recognised as the same claimant");
    assert!(!replayed(r.metadata()));
    assert_eq!(srv.shop.runs(), 1);
    assert_eq!(store.calls(Op::Claim), 2, "one claim, sent twice");
    match memory.get(&scope_for("t1", CREATE, KEY)).await.unwrap() {
        Some(RecordState::Completed { fence, .. }) => assert!(fence >= 1),
        other => panic!("expected a completed record, got {other:?}"),
    }
}

// ---------------------------------------------------------------- limits

#[tokio::test]
async fn size_limits() {
    let p = IdempotencyPolicy {
        max_request_bytes: 1024,
        max_response_bytes: 16,
        ..policy()
    };
    let store = MemoryStore::default();
    let l = layer(store.clone(), &config(p, None));
    let srv = serve(l).await;
    let mut client = srv.client();
    let mut big = create("ok");
    big.note = "n".repeat(2000);
    let err = client
        .create_order(keyed(big, KEY, "t1"))
        .await
        .unwrap_err();
    assert_idem_error(&err, Code::ResourceExhausted, reason::REQUEST_TOO_LARGE);
    assert_eq!(srv.shop.runs(), 0);
    assert!(store.is_empty());
    // A response over 16 bytes: delivered, recorded as not retained, never run again.
    let first = create_ok(&mut client, "t1").await.unwrap();
    assert_eq!(first.get_ref().order_id, "order-1");
    let err = create_ok(&mut client, "t1").await.unwrap_err();
    assert_idem_error(
        &err,
        Code::FailedPrecondition,
        reason::RESPONSE_NOT_RETAINED,
    );
    assert_eq!(srv.shop.runs(), 1);
}

// ---------------------------------------------------------------- in-process, paused clock

fn grpc_frame(msg: &impl Message) -> Bytes {
    let body = msg.encode_to_vec();
    let mut b = BytesMut::new();
    b.put_u8(0);
    b.put_u32(body.len() as u32);
    b.put_slice(&body);
    b.freeze()
}

fn raw_request(
    path: &str,
    msg: &impl Message,
    key: &str,
    timeout: Option<&str>,
) -> http::Request<Body> {
    raw_body_request(path, grpc_frame(msg), key, timeout)
}

/// A request with `body` as it is (gRPC framing included).
fn raw_body_request(
    path: &str,
    body: Bytes,
    key: &str,
    timeout: Option<&str>,
) -> http::Request<Body> {
    let mut b = http::Request::builder()
        .method("POST")
        .uri(format!("http://localhost{path}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .header("x-idempotency-key", key);
    if let Some(t) = timeout {
        b = b.header("grpc-timeout", t);
    }
    b.extension(Tenant("t1".into()))
        .body(Body::new(Full::new(body)))
        .unwrap()
}

#[derive(Debug, PartialEq)]
struct Raw {
    status: http::StatusCode,
    headers: http::HeaderMap,
    frames: Vec<Bytes>,
    trailers: Option<http::HeaderMap>,
}

async fn collect(resp: http::Response<Body>) -> Raw {
    let (head, mut body) = resp.into_parts();
    let mut frames = Vec::new();
    let mut trailers = None;
    while let Some(f) = body.frame().await {
        let f = f.unwrap();
        match f.into_data() {
            Ok(d) => frames.push(d),
            Err(f) => trailers = f.into_trailers().ok(),
        }
    }
    Raw {
        status: head.status,
        headers: head.headers,
        frames,
        trailers,
    }
}

fn decode_orders(frames: &[Bytes]) -> Vec<Order> {
    let mut all = BytesMut::new();
    for f in frames {
        all.extend_from_slice(f);
    }
    let mut b = all.freeze();
    let mut out = Vec::new();
    while b.has_remaining() {
        b.advance(1);
        let len = b.get_u32() as usize;
        out.push(Order::decode(b.split_to(len)).unwrap());
    }
    out
}

type InProcess<St> = idem_server::idempotency::Idempotency<OrdersServer<Shop>, St>;

/// A fresh `Shop`, and `l` around it in-process.
fn in_process<St: Store>(l: &IdempotencyLayer<St>) -> (Shop, InProcess<St>) {
    let shop = Shop::new();
    (
        shop.clone(),
        tower::Layer::layer(l, OrdersServer::new(shop)),
    )
}

async fn call<St: Store>(svc: &InProcess<St>, req: http::Request<Body>) -> Raw {
    collect(svc.clone().oneshot(req).await.unwrap()).await
}

/// [`call`] in a task of its own: a call to hold open, or to abandon.
fn spawn_call<St: Store>(svc: &InProcess<St>, req: http::Request<Body>) -> JoinHandle<Raw> {
    let svc = svc.clone();
    tokio::spawn(async move { call(&svc, req).await })
}

/// `CreateOrder` for item `sku` under `key`, no deadline.
fn raw_create(sku: &str, key: &str) -> http::Request<Body> {
    raw_request(CREATE, &create(sku), key, None)
}

impl Raw {
    /// Marked as a replay (`x-idempotency-replayed: true`).
    fn replayed(&self) -> bool {
        self.headers
            .get("x-idempotency-replayed")
            .is_some_and(|v| v == "true")
    }
}

#[tokio::test(start_paused = true)]
async fn replay_is_byte_for_byte_including_trailers_only_errors() {
    let l = layer(MemoryStore::default(), &config(policy(), None));
    let (shop, svc) = in_process(&l);
    // OK, unary.
    let a = call(&svc, raw_create("ok", KEY)).await;
    let mut b = call(&svc, raw_create("ok", KEY)).await;
    assert_eq!(b.headers.remove("x-idempotency-replayed").unwrap(), "true");
    assert_eq!(a, b);
    assert!(a.trailers.is_some());
    assert_eq!(decode_orders(&a.frames).len(), 1);
    // Server streaming: three messages.
    let list = ListOrdersRequest {
        customer_id: "c".into(),
    };
    let a = call(&svc, raw_request(LIST, &list, KEY, None)).await;
    let mut b = call(&svc, raw_request(LIST, &list, KEY, None)).await;
    b.headers.remove("x-idempotency-replayed").unwrap();
    assert_eq!(a, b);
    assert_eq!(decode_orders(&a.frames).len(), 3);
    // A Trailers-Only error (INTERNAL is stored).
    let a = call(&svc, raw_create("internal", "key-internal-2")).await;
    let mut b = call(&svc, raw_create("internal", "key-internal-2")).await;
    b.headers.remove("x-idempotency-replayed").unwrap();
    assert_eq!(a, b);
    assert!(a.frames.is_empty() && a.trailers.is_none(), "Trailers-Only");
    assert_eq!(a.headers.get("grpc-status").unwrap(), "13");
    assert_eq!(shop.runs(), 3);
}

#[tokio::test(start_paused = true)]
async fn a_handler_that_outlives_its_lease_loses_to_a_takeover() {
    let memory = MemoryStore::default();
    // Renewals fail, as when the store is partitioned from this instance for a while.
    let store = FaultyStore::new(memory.clone());
    store.inject(Op::Renew, Fault::Unavailable, usize::MAX);
    let l = layer(store, &config(policy(), None));
    let stats = l.stats();
    let (shop, svc) = in_process(&l);
    let scope = scope_for("t1", CREATE, KEY);

    let first = spawn_call(&svc, raw_create("gate", KEY));
    shop.started().await;
    // The lease (10 s) runs out while the first handler is stuck.
    tokio::time::advance(Duration::from_secs(11)).await;
    let second = spawn_call(&svc, raw_create("gate", KEY));
    shop.started().await;
    let fences = shop.fences();
    assert_eq!(fences.len(), 2);
    assert!(
        fences[1] > fences[0],
        "takeover with a higher fence: {fences:?}"
    );
    assert!(
        matches!(memory.get(&scope).await.unwrap(), Some(RecordState::InFlight { fence, .. }) if fence == fences[1])
    );

    // The first handler finishes late: its completion is refused.
    shop.open_gate(1);
    let a = first.await.unwrap();
    assert_eq!(
        decode_orders(&a.frames)[0].order_id,
        "order-1",
        "its caller still gets its answer"
    );
    assert_eq!(stats.snapshot().stale_fence, 1);
    assert!(matches!(
        memory.get(&scope).await.unwrap(),
        Some(RecordState::InFlight { .. })
    ));
    shop.open_gate(1);
    let b = second.await.unwrap();
    assert_eq!(decode_orders(&b.frames)[0].order_id, "order-2");
    assert!(
        matches!(memory.get(&scope).await.unwrap(), Some(RecordState::Completed { fence, .. }) if fence == fences[1])
    );
    // Duplicates now get the takeover's outcome.
    let c = call(&svc, raw_create("gate", KEY)).await;
    assert!(c.replayed());
    assert_eq!(decode_orders(&c.frames)[0].order_id, "order-2");
    let s = stats.snapshot();
    assert_eq!((s.executed, s.stored, s.stale_fence), (2, 1, 1), "{s:?}");
    assert!(s.renew_failures > 0);
}

#[tokio::test(start_paused = true)]
async fn waiting_is_bounded_by_the_callers_deadline_and_the_handler_sees_its_own() {
    let l = layer(MemoryStore::default(), &config(policy(), None));
    let (shop, svc) = in_process(&l);
    let first = spawn_call(&svc, raw_request(CREATE, &create("gate"), KEY, Some("30S")));
    shop.started().await;
    let t = Instant::now();
    let dup = call(&svc, raw_request(CREATE, &create("gate"), KEY, Some("2S"))).await;
    assert_eq!(
        Instant::now() - t,
        Duration::from_secs(2),
        "waited until its deadline"
    );
    assert_eq!(
        dup.headers.get("grpc-status").unwrap(),
        "4",
        "DEADLINE_EXCEEDED"
    );
    let st = Status::from_header_map(&dup.headers).unwrap();
    assert_eq!(
        error_reason(&st),
        Some(("idem".into(), reason::IN_PROGRESS.into()))
    );
    // A duplicate without a deadline waits for the outcome (across lease renewals).
    let waiting = spawn_call(&svc, raw_create("gate", KEY));
    tokio::time::sleep(Duration::from_secs(25)).await;
    assert!(!waiting.is_finished());
    shop.open_gate(1);
    let a = first.await.unwrap();
    let w = waiting.await.unwrap();
    assert_eq!(w.frames, a.frames);
    assert!(w.replayed());
    assert_eq!(shop.runs(), 1);
    assert_eq!(shop.saw_deadline(), [true], "inbound deadline recorded");
    assert_eq!(l.stats().snapshot().deadline_exceeded, 1);
}

#[tokio::test(start_paused = true)]
async fn a_fingerprint_hook_decides_what_a_different_request_is() {
    // Ignore the `note` field: decode, clear it, re-encode.
    let l = layer(MemoryStore::default(), &config(policy(), None)).fingerprint_with(
        CREATE,
        |msgs: &[Bytes]| {
            let mut out = Vec::new();
            for m in msgs {
                let mut r = CreateOrderRequest::decode(m.clone()).unwrap_or_default();
                r.note.clear();
                out.extend(r.encode_to_vec());
            }
            out
        },
    );
    let (shop, svc) = in_process(&l);
    let mut a = create("ok");
    a.note = "first".into();
    let mut b = create("ok");
    b.note = "second".into();
    call(&svc, raw_request(CREATE, &a, KEY, None)).await;
    let r = call(&svc, raw_request(CREATE, &b, KEY, None)).await;
    assert!(r.replayed());
    let c = call(&svc, raw_create("other", KEY)).await;
    assert_eq!(
        c.headers.get("grpc-status").unwrap(),
        "9",
        "FAILED_PRECONDITION"
    );
    assert_eq!(shop.runs(), 1);
}

/// `CreateOrderRequest` plus a `map<string, string> labels = 15` field, held as its wire
/// form: repeated entries, in the order they are encoded (the order prost takes from a
/// `HashMap`'s iteration, which differs between two maps holding the same entries).
#[derive(Clone, PartialEq, Message)]
struct LabelledCreate {
    #[prost(string, tag = "2")]
    sku: String,
    #[prost(message, repeated, tag = "15")]
    labels: Vec<Label>,
}

#[derive(Clone, PartialEq, Message)]
struct Label {
    #[prost(string, tag = "1")]
    key: String,
    #[prost(string, tag = "2")]
    value: String,
}

/// The same message decoded with its map as a map (what the application sees).
#[derive(Clone, PartialEq, Message)]
struct LabelledCreateMap {
    #[prost(string, tag = "2")]
    sku: String,
    #[prost(btree_map = "string, string", tag = "15")]
    labels: std::collections::BTreeMap<String, String>,
}

fn labelled(order: &[(&str, &str)]) -> LabelledCreate {
    LabelledCreate {
        sku: "ok".into(),
        labels: order
            .iter()
            .map(|(k, v)| Label {
                key: (*k).into(),
                value: (*v).into(),
            })
            .collect(),
    }
}

#[tokio::test(start_paused = true)]
async fn map_entries_in_another_order_are_a_different_request() {
    // docs/semantics.md, "Fingerprints are over bytes": the layer digests bytes, so a
    // request rebuilt with its map entries in another order is another request.
    let l = layer(MemoryStore::default(), &config(policy(), None));
    let (shop, svc) = in_process(&l);
    let a = labelled(&[("region", "eu"), ("channel", "web")]);
    let b = labelled(&[("channel", "web"), ("region", "eu")]);
    let as_map =
        |m: &LabelledCreate| LabelledCreateMap::decode(m.encode_to_vec().as_slice()).unwrap();
    assert_eq!(
        as_map(&a),
        as_map(&b),
        "the same message to the application"
    );
    assert_ne!(a.encode_to_vec(), b.encode_to_vec(), "not the same bytes");

    let first = call(&svc, raw_request(CREATE, &a, KEY, None)).await;
    assert_eq!(
        first.trailers.as_ref().unwrap().get("grpc-status").unwrap(),
        "0"
    );
    let again = call(&svc, raw_request(CREATE, &a, KEY, None)).await;
    assert!(again.replayed(), "the same bytes replay");
    let rebuilt = call(&svc, raw_request(CREATE, &b, KEY, None)).await;
    assert_eq!(
        rebuilt.headers.get("grpc-status").unwrap(),
        "9",
        "FAILED_PRECONDITION (KEY_REUSED)"
    );
    assert_eq!(shop.runs(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_fingerprint_hook_can_make_map_order_irrelevant() {
    // The documented remedy when the bytes cannot be kept: a canonical form. Decoding
    // into a BTreeMap and encoding again sorts the entries.
    let l = layer(MemoryStore::default(), &config(policy(), None)).fingerprint_with(
        CREATE,
        |msgs: &[Bytes]| {
            let mut out = Vec::new();
            for m in msgs {
                let canonical = LabelledCreateMap::decode(m.clone()).unwrap_or_default();
                out.extend(canonical.encode_to_vec());
            }
            out
        },
    );
    let (shop, svc) = in_process(&l);
    let a = labelled(&[("region", "eu"), ("channel", "web")]);
    let b = labelled(&[("channel", "web"), ("region", "eu")]);
    call(&svc, raw_request(CREATE, &a, KEY, None)).await;
    let rebuilt = call(&svc, raw_request(CREATE, &b, KEY, None)).await;
    assert!(rebuilt.replayed());
    assert_eq!(shop.runs(), 1);
}

#[tokio::test(start_paused = true)]
async fn unsupported_request_encodings_are_refused_clearly() {
    let l = layer(MemoryStore::default(), &config(policy(), None));
    let (shop, svc) = in_process(&l);
    let mut req = raw_create("ok", KEY);
    req.headers_mut()
        .insert("grpc-encoding", http::HeaderValue::from_static("zstd"));
    // A compressed frame (flag 1) the layer cannot decode.
    let mut body = BytesMut::new();
    body.put_u8(1);
    body.put_u32(3);
    body.put_slice(b"zzz");
    *req.body_mut() = Body::new(Full::new(body.freeze()));
    let r = call(&svc, req).await;
    let st = Status::from_header_map(&r.headers).unwrap();
    assert_idem_error(&st, Code::Unimplemented, reason::ENCODING_UNSUPPORTED);
    assert_eq!(shop.runs(), 0);
}

/// Whether `store` holds a record of `tenant`'s `CreateOrder` under [`KEY`].
async fn has_record(store: &MemoryStore, tenant: &str) -> bool {
    store
        .get(&scope_for(tenant, CREATE, KEY))
        .await
        .unwrap()
        .is_some()
}

#[tokio::test]
async fn the_configs_tenant_source_applies_when_the_builder_sets_none() {
    use idem_core::config::TenantSource;
    let entries = || {
        vec![
            MethodConfig::empty()
                .with_name("shop.v1.Orders", "CreateOrder")
                .with_idempotency(policy()),
        ]
    };
    let with = |tenant| {
        let settings = IdemSettings {
            tenant,
            ..IdemSettings::default()
        };
        ServiceConfig::from_parts(entries(), None, settings).unwrap()
    };
    // Unset: the layer fails its check, and (unchecked) protected calls fail closed as
    // a misconfigured server, not as an unauthenticated caller.
    let store = MemoryStore::default();
    let unset = IdempotencyLayer::new(store.clone(), &with(TenantSource::Unset));
    assert!(unset.clone().check().is_err());
    let srv = serve(unset).await;
    let err = srv
        .client()
        .create_order(keyed(create("ok"), KEY, "t1"))
        .await
        .unwrap_err();
    assert_idem_error(
        &err,
        Code::FailedPrecondition,
        reason::TENANT_SOURCE_MISSING,
    );
    assert_eq!(srv.shop.runs(), 0);
    // Single tenant.
    let srv = serve(IdempotencyLayer::new(
        store.clone(),
        &with(TenantSource::Single("acme".into())),
    ))
    .await;
    srv.client()
        .create_order(key_only(create("ok"), KEY))
        .await
        .unwrap();
    assert!(has_record(&store, "acme").await);
    // Header (explicit opt-in): the client's header is the tenant.
    let header = TenantSource::Header(http::HeaderName::from_static("x-test-tenant"));
    let srv = serve(IdempotencyLayer::new(store.clone(), &with(header))).await;
    srv.client()
        .create_order(keyed(create("ok"), KEY, "from-header"))
        .await
        .unwrap();
    assert!(has_record(&store, "from-header").await);
    let err = srv
        .client()
        .create_order(key_only(create("ok"), KEY))
        .await
        .unwrap_err();
    assert_idem_error(&err, Code::Unauthenticated, reason::TENANT_MISSING);
}

// ---------------------------------------------------------------- store blips, panics, blocked threads

fn status_of(r: &Raw) -> Status {
    Status::from_header_map(r.trailers.as_ref().unwrap_or(&r.headers)).expect("a grpc-status")
}

#[tokio::test(start_paused = true)]
async fn a_completion_the_store_refuses_once_is_retried_and_the_waiting_duplicate_replays_it() {
    let store = faulty(Op::Complete, Fault::Unavailable, 1);
    let l = layer(store.clone(), &config(policy(), None));
    let (shop, svc) = in_process(&l);
    let first = spawn_call(&svc, raw_create("gate", KEY));
    shop.started().await;
    let dup = spawn_call(&svc, raw_create("gate", KEY));
    let stats = l.stats();
    eventually("the duplicate to wait", || stats.snapshot().waited == 1).await;
    shop.open_gate(1);
    let a = first.await.unwrap();
    let b = dup.await.unwrap();
    assert_eq!(shop.runs(), 1, "one execution");
    assert!(b.replayed());
    assert_eq!(a.frames, b.frames);
    assert_eq!(store.faulted(Op::Complete), 1);
    assert_eq!(store.calls(Op::Complete), 2, "sent again after the blip");
    let s = stats.snapshot();
    assert_eq!(
        (s.stored, s.record_retries, s.unrecorded),
        (1, 1, 0),
        "{s:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_release_the_store_refuses_once_is_retried_so_the_retry_runs_at_once() {
    let store = faulty(Op::Release, Fault::Unavailable, 1);
    let l = layer(store.clone(), &config(policy(), None));
    let (shop, svc) = in_process(&l);
    let a = call(&svc, raw_create("unavailable", KEY)).await;
    assert_eq!(status_of(&a).code(), Code::Unavailable);
    let t = Instant::now();
    let b = call(&svc, raw_create("unavailable", KEY)).await;
    assert!(
        Instant::now() - t < Duration::from_secs(1),
        "the retry did not wait for the lease to end"
    );
    assert_eq!(status_of(&b).code(), Code::Unavailable);
    assert_eq!(shop.runs(), 2, "released, so the retry ran");
    assert_eq!(store.calls(Op::Release), 3, "first release sent twice");
    assert_eq!(l.stats().snapshot().released, 2);
}

#[tokio::test(start_paused = true)]
async fn a_completion_that_never_lands_gives_up_after_its_timeout_and_says_so() {
    let store = faulty(Op::Complete, Fault::Unavailable, usize::MAX);
    let p = IdempotencyPolicy {
        completion_retry_timeout: Duration::from_secs(5),
        ..policy()
    };
    let l = layer(store.clone(), &config(p, None));
    let stats = l.stats();
    let (_, svc) = in_process(&l);
    let t = Instant::now();
    let a = call(&svc, raw_create("ok", KEY)).await;
    assert_eq!(
        decode_orders(&a.frames).len(),
        1,
        "the caller is not kept waiting"
    );
    assert!(Instant::now() - t < Duration::from_secs(1));
    eventually("the give-up", || stats.snapshot().unrecorded == 1).await;
    let waited = Instant::now() - t;
    // It gives up when the next wait (up to 1 s, +20 % jitter) would cross the 5 s
    // timeout: between 3.8 s and 5 s after the first attempt, whatever the jitter drew.
    assert!(
        waited >= Duration::from_millis(3800) && waited <= Duration::from_millis(5010),
        "{waited:?}"
    );
    assert!(store.calls(Op::Complete) > 3, "retried with backoff");
    assert!(matches!(
        store
            .inner()
            .get(&scope_for("t1", CREATE, KEY))
            .await
            .unwrap(),
        Some(RecordState::InFlight { .. })
    ));
}

#[tokio::test(start_paused = true)]
async fn a_panic_in_a_response_stream_is_recorded_as_internal_never_left_in_flight() {
    let store = MemoryStore::default();
    let l = layer(store.clone(), &config(policy(), None));
    let (shop, svc) = in_process(&l);
    let list = ListOrdersRequest {
        customer_id: "panic-mid-stream".into(),
    };
    let a = call(&svc, raw_request(LIST, &list, KEY, None)).await;
    assert_eq!(status_of(&a).code(), Code::Internal);
    assert!(
        a.trailers.is_some(),
        "the response had started: INTERNAL in its trailers"
    );
    assert!(matches!(
        store.get(&scope_for("t1", LIST, KEY)).await.unwrap(),
        Some(RecordState::Completed { .. })
    ));
    let mut b = call(&svc, raw_request(LIST, &list, KEY, None)).await;
    assert_eq!(b.headers.remove("x-idempotency-replayed").unwrap(), "true");
    assert_eq!(a, b, "replayed as it was sent");
    // A unary handler that panics: the same.
    let c = call(&svc, raw_create("panic", KEY)).await;
    assert_eq!(status_of(&c).code(), Code::Internal);
    let d = call(&svc, raw_create("panic", KEY)).await;
    assert!(d.replayed());
    assert_eq!(shop.runs(), 2, "one run per method");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_that_blocks_its_thread_past_the_lease_keeps_it() {
    let lease = Duration::from_millis(600);
    let p = IdempotencyPolicy {
        lease_ttl: lease,
        ..policy()
    };
    let l = layer(MemoryStore::default(), &config(p, None));
    let (shop, svc) = in_process(&l);
    let sku = format!("block-{}", 3 * lease.as_millis());
    let first = spawn_call(&svc, raw_create(&sku, KEY));
    shop.started().await;
    // The first handler now blocks its worker thread for three leases.
    let dup = call(&svc, raw_create(&sku, KEY)).await;
    let a = first.await.unwrap();
    assert_eq!(shop.runs(), 1, "the duplicate did not run it again");
    assert!(dup.replayed());
    assert_eq!(dup.frames, a.frames);
}

#[tokio::test(start_paused = true)]
async fn a_request_the_service_cannot_decode_does_not_spend_its_key() {
    let store = MemoryStore::default();
    let l = layer(store.clone(), &config(policy(), None));
    let (shop, svc) = in_process(&l);
    let frame = |msg: &[u8]| {
        let mut b = BytesMut::new();
        b.put_u8(0);
        b.put_u32(msg.len() as u32);
        b.put_slice(msg);
        b.freeze()
    };
    // (key, body, the code the caller gets)
    let cases = [
        // Not protobuf at all: refused by the layer before any record exists.
        (
            "key-not-protobuf",
            frame(b"\xff\xff\xff"),
            Code::InvalidArgument,
        ),
        // No message: tonic refuses it before the handler runs.
        ("key-no-message-1", Bytes::new(), Code::Internal),
        // Well-formed protobuf, but field 1 (a string) as a varint: tonic cannot
        // decode it as the method's type.
        ("key-wrong-type-1", frame(b"\x08\x01"), Code::Internal),
    ];
    for (key, body, code) in cases {
        let r = call(&svc, raw_body_request(CREATE, body, key, None)).await;
        let st = status_of(&r);
        assert_eq!(st.code(), code, "{key}: {st:?}");
        if code == Code::InvalidArgument {
            assert_idem_error(&st, code, reason::REQUEST_MALFORMED);
        }
        assert!(
            !matches!(
                store.get(&scope_for("t1", CREATE, key)).await.unwrap(),
                Some(RecordState::Completed { .. } | RecordState::InFlight { .. })
            ),
            "{key}: the key is free"
        );
        // The corrected request, with the same key, runs.
        let before = shop.runs();
        let ok = call(&svc, raw_create("ok", key)).await;
        assert_eq!(status_of(&ok).code(), Code::Ok, "{key}");
        assert!(ok.headers.get("x-idempotency-replayed").is_none());
        assert_eq!(shop.runs(), before + 1, "{key}");
    }
    assert_eq!(
        shop.runs(),
        3,
        "the handler ran only for the corrected requests"
    );
}

#[tokio::test]
async fn a_full_store_is_resource_exhausted_with_a_retry_delay_and_no_run() {
    let store = faulty(Op::Claim, Fault::Full, usize::MAX);
    let fail_open = IdempotencyPolicy {
        fail_open: true,
        ..policy()
    };
    let l = layer(store.clone(), &config(policy(), Some(fail_open)));
    let srv = serve(l).await;
    let mut client = srv.client();
    let get = get_order_x();
    let errs = [
        create_ok(&mut client, "t1").await.unwrap_err(),
        // Even on a fail-open method: a full store answered, and running anyway could
        // run a key twice.
        client.get_order(keyed(get, KEY, "t1")).await.unwrap_err(),
    ];
    for err in errs {
        assert_idem_error(&err, Code::ResourceExhausted, reason::STORE_FULL);
        let retry = err.get_details_retry_info().expect("RetryInfo");
        assert!(retry.retry_delay.is_some_and(|d| d > Duration::ZERO));
        assert!(
            !err.message().contains(INTERNAL_DETAIL),
            "{}",
            err.message()
        );
    }
    assert_eq!(srv.shop.runs(), 0);
    assert_eq!(store.calls(Op::Claim), 2, "no resend: the store answered");
    assert_eq!(srv.stats.snapshot().store_full, 2);
}

/// An outcome and its reason, as the observer hears them.
type Heard = (&'static str, Option<&'static str>);

/// Records what the observer hears of each protected call.
#[derive(Clone, Default)]
struct Outcomes(Arc<std::sync::Mutex<Vec<Heard>>>);

impl idem_server::metrics::ServerObserver for Outcomes {
    fn call_ended(&self, call: &idem_server::metrics::ProtectedCallEnded<'_>) {
        self.0.lock().unwrap().push((call.outcome, call.reason));
    }
}

#[tokio::test(start_paused = true)]
async fn a_full_memory_store_names_the_bound_that_refused() {
    // A tenant's share of one record, kept (minRetention) when the second key arrives.
    let store = MemoryStore::new(idem_store::memory::MemoryStoreSettings {
        max_entries_per_tenant: Some(1),
        ..Default::default()
    });
    let outcomes = Outcomes::default();
    let l = layer(store, &config(policy(), None)).observer(outcomes.clone());
    let (shop, svc) = in_process(&l);
    let first = call(&svc, raw_create("ok", KEY)).await;
    assert_eq!(status_of(&first).code(), Code::Ok);
    let refused = call(&svc, raw_create("ok", "order-key-0002")).await;
    let err = status_of(&refused);
    assert_idem_error(&err, Code::ResourceExhausted, reason::STORE_FULL);
    let info = err.get_details_error_info().unwrap();
    assert_eq!(
        info.metadata.get("bound").map(String::as_str),
        Some("tenant_entries"),
        "{info:?}"
    );
    assert_eq!(
        info.metadata.len(),
        1,
        "the bound's name only, no usage: {info:?}"
    );
    assert!(
        !err.message().contains('1'),
        "no size or usage in the message: {err:?}"
    );
    assert_eq!(shop.runs(), 1);
    assert_eq!(
        outcomes.0.lock().unwrap().last(),
        Some(&("store_full", Some("tenant_entries")))
    );
}

#[tokio::test(start_paused = true)]
async fn a_response_the_store_has_no_room_for_is_recorded_as_not_retained() {
    let store = faulty(Op::Complete, Fault::Full, 1);
    let l = layer(store.clone(), &config(policy(), None));
    let (shop, svc) = in_process(&l);
    let a = call(&svc, raw_create("ok", KEY)).await;
    assert_eq!(decode_orders(&a.frames).len(), 1);
    let b = call(&svc, raw_create("ok", KEY)).await;
    assert_idem_error(
        &status_of(&b),
        Code::FailedPrecondition,
        reason::RESPONSE_NOT_RETAINED,
    );
    assert_eq!(shop.runs(), 1, "never a second run");
}

#[tokio::test(start_paused = true)]
async fn handler_runs_are_bounded_and_cancelled_calls_count_until_their_handlers_end() {
    // One tenant may take the whole bound here (its share is tested apart).
    let l = layer(MemoryStore::default(), &config(policy(), None))
        .max_handlers_in_flight(2)
        .max_handlers_per_tenant(2);
    let stats = l.stats();
    let (shop, svc) = in_process(&l);
    let a = spawn_call(&svc, raw_create("gate", "key-bounded-a"));
    let b = spawn_call(&svc, raw_create("gate", "key-bounded-b"));
    eventually("two handlers running", || shop.runs() == 2).await;
    let refused = |r: &Raw| {
        let st = status_of(r);
        assert_idem_error(&st, Code::ResourceExhausted, reason::OVERLOADED);
        assert!(st.get_details_retry_info().is_some(), "RetryInfo");
    };
    refused(&call(&svc, raw_create("gate", "key-bounded-c")).await);
    // Their callers go away; the handlers keep running, and keep counting.
    a.abort();
    b.abort();
    let _ = (a.await, b.await);
    refused(&call(&svc, raw_create("gate", "key-bounded-d")).await);
    assert_eq!(shop.runs(), 2, "refused calls never ran");
    shop.open_gate(2);
    eventually("both outcomes recorded", || stats.snapshot().stored == 2).await;
    // The refused key was left free: it runs now.
    shop.open_gate(1);
    let c = call(&svc, raw_create("gate", "key-bounded-c")).await;
    assert_eq!(status_of(&c).code(), Code::Ok);
    assert_eq!(shop.runs(), 3);
    assert_eq!(stats.snapshot().overloaded, 2);
}

#[tokio::test(start_paused = true)]
async fn a_caller_that_never_reads_its_stream_holds_no_handler_run_past_the_stall_timeout() {
    let stall = Duration::from_secs(5);
    let cfg = config(
        IdempotencyPolicy {
            response_stall_timeout: stall,
            ..policy()
        },
        None,
    );
    let l = layer(MemoryStore::default(), &cfg).max_handlers_in_flight(1);
    let stats = l.stats();
    let (shop, svc) = in_process(&l);
    // 200 messages: far more than the layer queues for a caller that takes none.
    let many = ListOrdersRequest {
        customer_id: "count-200".into(),
    };
    let key = "key-never-read";
    let resp = svc
        .clone()
        .oneshot(raw_request(LIST, &many, key, None))
        .await
        .unwrap();
    // The caller holds its stream and reads nothing: the run waits for room, and still
    // counts against the bound.
    let other = |key: &'static str| call(&svc, raw_create("ok", key));
    assert_idem_error(
        &status_of(&other("key-while-stalled").await),
        Code::ResourceExhausted,
        reason::OVERLOADED,
    );
    // Past the stall timeout its stream is ended; the handler's outcome is recorded and
    // its place under the bound freed.
    tokio::time::sleep(stall + Duration::from_secs(1)).await;
    eventually("the stalled run's outcome recorded", || {
        stats.snapshot().stored == 1
    })
    .await;
    assert_eq!(status_of(&other("key-after-stall").await).code(), Code::Ok);
    // The stalled caller gets what was queued for it, then an end without a status.
    let cut = collect(resp).await;
    assert!(cut.trailers.is_none(), "no grpc-status: the stream was cut");
    let got = decode_orders(&cut.frames).len();
    assert!(
        got < 200,
        "{got} of 200 messages reached the stalled caller"
    );
    // Its retry replays the whole response, without a second run.
    let mut again = call(&svc, raw_request(LIST, &many, key, None)).await;
    assert_eq!(
        again.headers.remove("x-idempotency-replayed").unwrap(),
        "true"
    );
    assert_eq!(decode_orders(&again.frames).len(), 200);
    assert_eq!(status_of(&again).code(), Code::Ok);
    assert_eq!(
        shop.runs(),
        2,
        "one run for the stalled key, one for the other"
    );
}

// ---------------------------------------------------------------- a wait never becomes a second run

#[tokio::test(start_paused = true)]
async fn a_duplicate_that_waited_answers_unavailable_on_a_store_error_even_when_fail_open() {
    let store = FaultyStore::new(MemoryStore::default());
    let fail_open = IdempotencyPolicy {
        fail_open: true,
        ..policy()
    };
    let l = layer(store.clone(), &config(fail_open, None));
    let stats = l.stats();
    let (shop, svc) = in_process(&l);
    let first = spawn_call(&svc, raw_create("gate", KEY));
    shop.started().await;
    let dup = spawn_call(&svc, raw_create("gate", KEY));
    eventually("the duplicate to wait", || stats.snapshot().waited == 1).await;
    // The duplicate's claim after its wait fails (and so does its resend).
    store.inject(Op::Claim, Fault::Unavailable, 2);
    // Room for a second run, so that one would end (and be counted) rather than hang.
    shop.open_gate(2);
    let a = first.await.unwrap();
    let b = dup.await.unwrap();
    assert_eq!(store.faulted(Op::Claim), 2, "the re-claim met the fault");
    assert_eq!(shop.runs(), 1, "the duplicate never ran the handler");
    let st = status_of(&b);
    assert_idem_error(&st, Code::Unavailable, reason::STORE_UNAVAILABLE);
    let retry = st.get_details_retry_info().expect("RetryInfo");
    assert!(
        retry.retry_delay.is_some_and(|d| d > Duration::ZERO),
        "{retry:?}"
    );
    assert_eq!(stats.snapshot().fail_open_runs, 0);
    // Its retry replays the first run's outcome.
    let c = call(&svc, raw_create("gate", KEY)).await;
    assert!(c.replayed());
    assert_eq!(c.frames, a.frames);
    assert_eq!(decode_orders(&c.frames)[0].order_id, "order-1");
    assert_eq!(shop.runs(), 1);
}

// ---------------------------------------------------------------- handler slots and waiters are bounded per tenant

/// CreateOrder and ListOrders protected with `policy()`, under `settings`.
fn config_with(settings: IdemSettings) -> ServiceConfig {
    let entries = vec![
        MethodConfig::empty()
            .with_name("shop.v1.Orders", "CreateOrder")
            .with_name("shop.v1.Orders", "ListOrders")
            .with_idempotency(policy()),
    ];
    ServiceConfig::from_parts(entries, None, settings).expect("valid config")
}

/// `req` as a call of `tenant`.
fn of_tenant(mut req: http::Request<Body>, tenant: &str) -> http::Request<Body> {
    req.extensions_mut().insert(Tenant(tenant.into()));
    req
}

/// The `bound` of a refusal's `ErrorInfo`, after checking its code, reason and RetryInfo.
fn refused_by(r: &Raw, code: Code, why: &str) -> String {
    let st = status_of(r);
    assert_idem_error(&st, code, why);
    assert!(st.get_details_retry_info().is_some(), "RetryInfo: {st:?}");
    let info = st.get_details_error_info().expect("ErrorInfo");
    info.metadata.get("bound").cloned().expect("a bound")
}

#[tokio::test(start_paused = true)]
async fn one_tenant_cannot_take_another_tenants_handler_slots() {
    // 16 handler runs; each tenant's share is a quarter (4) by default.
    let settings = IdemSettings {
        max_handlers_in_flight: 16,
        ..IdemSettings::default()
    };
    let l = layer(MemoryStore::default(), &config_with(settings));
    let (shop, svc) = in_process(&l);
    // Tenant "greedy" starts 16 runs and its callers go away: 4 run (and go on,
    // detached), the other 12 are refused by the tenant's share.
    let mut greedy = Vec::new();
    for i in 0..16 {
        let req = of_tenant(raw_create("gate", &format!("key-greedy-{i}")), "greedy");
        greedy.push(spawn_call(&svc, req));
    }
    eventually("greedy's share running", || shop.runs() == 4).await;
    let mut refused = 0;
    for task in greedy.iter_mut() {
        tokio::task::yield_now().await;
        if task.is_finished() {
            let r = task.await.unwrap();
            assert_eq!(
                refused_by(&r, Code::ResourceExhausted, reason::OVERLOADED),
                "tenant_handlers"
            );
            assert!(
                status_of(&r)
                    .message()
                    .contains("idem.maxHandlersPerTenant")
            );
            refused += 1;
        }
    }
    assert_eq!(refused, 12);
    for task in &greedy {
        task.abort();
    }
    eventually("greedy's runs detached", || l.handlers_detached() == 4).await;
    // Another tenant still gets its 4.
    let other: Vec<_> = (0..4)
        .map(|i| {
            spawn_call(
                &svc,
                of_tenant(raw_create("gate", &format!("key-other-{i}")), "other"),
            )
        })
        .collect();
    eventually("the other tenant running", || shop.runs() == 8).await;
    assert_eq!(l.handlers_in_flight(), 8);
    shop.open_gate(8);
    for t in other {
        assert_eq!(status_of(&t.await.unwrap()).code(), Code::Ok);
    }
    // A detached run gives its handler slot back as its future ends and its detached
    // count just after, when its task ends: the two gauges are read one by one.
    eventually("every run ended", || {
        l.handlers_in_flight() == 0 && l.handlers_detached() == 0
    })
    .await;
    assert_eq!(shop.runs(), 8, "refused calls never ran");
}

/// Where the caller going away meets a tenant's share: the runs of a tenant whose callers
/// went away (handed, with the handler slot their claim took, to tasks of their own)
/// keep that tenant's share until they end. Meanwhile a new call of the tenant is
/// refused and runs nothing; once they end, their outcomes are recorded (their keys
/// replay) and the tenant runs new calls again.
#[tokio::test(start_paused = true)]
async fn detached_runs_keep_their_tenants_share_until_they_end() {
    let settings = IdemSettings {
        max_handlers_in_flight: 16,
        ..IdemSettings::default()
    };
    let l = layer(MemoryStore::default(), &config_with(settings));
    let (shop, svc) = in_process(&l);
    let held: Vec<_> = (0..4)
        .map(|i| {
            let req = of_tenant(raw_create("gate", &format!("key-held-{i}")), "greedy");
            spawn_call(&svc, req)
        })
        .collect();
    eventually("the tenant's share running", || shop.runs() == 4).await;
    for task in &held {
        task.abort();
    }
    eventually("the runs detached", || l.handlers_detached() == 4).await;
    assert_eq!(l.handlers_in_flight(), 4);

    let more = call(&svc, of_tenant(raw_create("gate", "key-more"), "greedy")).await;
    assert_eq!(
        refused_by(&more, Code::ResourceExhausted, reason::OVERLOADED),
        "tenant_handlers"
    );
    assert_eq!(shop.runs(), 4, "the refused call ran");

    shop.open_gate(4);
    eventually("the detached runs ended", || {
        l.handlers_detached() == 0 && l.handlers_in_flight() == 0
    })
    .await;
    for i in 0..4 {
        let again = call(
            &svc,
            of_tenant(raw_create("gate", &format!("key-held-{i}")), "greedy"),
        )
        .await;
        assert_eq!(status_of(&again).code(), Code::Ok);
        assert!(again.replayed(), "key-held-{i} ran again");
    }
    let next = spawn_call(&svc, of_tenant(raw_create("gate", "key-more"), "greedy"));
    eventually("the tenant's next call running", || shop.runs() == 5).await;
    shop.open_gate(1);
    let next = next.await.unwrap();
    assert_eq!(status_of(&next).code(), Code::Ok);
    assert!(!next.replayed());
    assert_eq!(shop.runs(), 5);
}

#[tokio::test(start_paused = true)]
async fn callers_that_cancel_cannot_run_more_handlers_than_max_detached_handlers() {
    let settings = IdemSettings {
        max_detached_handlers: 3,
        ..IdemSettings::default()
    };
    let l = layer(MemoryStore::default(), &config_with(settings)).max_handlers_per_tenant(64);
    let stats = l.stats();
    let (shop, svc) = in_process(&l);
    // One caller after another starts a call and goes away, as through a connection
    // limit of 1: each run goes on, detached.
    for i in 0..3 {
        let t = spawn_call(&svc, raw_create("gate", &format!("key-gone-{i}")));
        eventually("the run to start", || shop.runs() == i + 1).await;
        t.abort();
        let _ = t.await;
        eventually("the run detached", || l.handlers_detached() == i + 1).await;
    }
    // The next caller is refused, retryably, and names the bound; nothing more runs.
    for i in 0..5 {
        let r = call(&svc, raw_create("gate", &format!("key-more-{i}"))).await;
        assert_eq!(
            refused_by(&r, Code::ResourceExhausted, reason::OVERLOADED),
            "detached_handlers"
        );
        assert!(status_of(&r).message().contains("idem.maxDetachedHandlers"));
    }
    assert_eq!(shop.runs(), 3);
    assert_eq!(l.handlers_in_flight(), 3);
    // A duplicate of a detached run is served at the bound: it waits, then replays.
    let dup = spawn_call(&svc, raw_create("gate", "key-gone-0"));
    eventually("the duplicate to wait", || stats.snapshot().waited == 1).await;
    shop.open_gate(3);
    assert!(dup.await.unwrap().replayed());
    eventually("the detached runs ended", || l.handlers_detached() == 0).await;
    // The refused keys were left free: they run now.
    shop.open_gate(1);
    let again = call(&svc, raw_create("gate", "key-more-0")).await;
    assert_eq!(status_of(&again).code(), Code::Ok);
    assert_eq!(shop.runs(), 4, "one run per key, never two");
}

#[tokio::test(start_paused = true)]
async fn waiting_duplicates_are_bounded_per_tenant_and_per_layer() {
    let settings = IdemSettings {
        max_waiters: 3,
        max_waiters_per_tenant: Some(2),
        ..IdemSettings::default()
    };
    let l = layer(MemoryStore::default(), &config_with(settings));
    let stats = l.stats();
    let (shop, svc) = in_process(&l);
    let a = spawn_call(&svc, raw_create("gate", "key-waiters-a"));
    let b = spawn_call(&svc, of_tenant(raw_create("gate", "key-waiters-b"), "t2"));
    eventually("both running", || shop.runs() == 2).await;
    // Tenant t1: two wait, the third is refused by the tenant's share.
    let waiting: Vec<_> = (0..2)
        .map(|_| spawn_call(&svc, raw_create("gate", "key-waiters-a")))
        .collect();
    eventually("two waiting", || l.waiters() == 2).await;
    let r = call(&svc, raw_create("gate", "key-waiters-a")).await;
    assert_eq!(
        refused_by(&r, Code::ResourceExhausted, reason::TOO_MANY_WAITING),
        "tenant_waiters"
    );
    assert!(status_of(&r).message().contains("idem.maxWaitersPerTenant"));
    // Tenant t2: one waits, the next meets the layer's bound.
    let w2 = spawn_call(&svc, of_tenant(raw_create("gate", "key-waiters-b"), "t2"));
    eventually("three waiting", || l.waiters() == 3).await;
    let r = call(&svc, of_tenant(raw_create("gate", "key-waiters-b"), "t2")).await;
    assert_eq!(
        refused_by(&r, Code::ResourceExhausted, reason::TOO_MANY_WAITING),
        "waiters"
    );
    shop.open_gate(2);
    let (a, b) = (a.await.unwrap(), b.await.unwrap());
    for w in waiting {
        assert_eq!(w.await.unwrap().frames, a.frames);
    }
    assert_eq!(w2.await.unwrap().frames, b.frames);
    assert_eq!(l.waiters(), 0);
    assert_eq!(shop.runs(), 2);
    assert_eq!(stats.snapshot().waiters_refused, 2);
}

#[tokio::test(start_paused = true)]
async fn a_waiter_whose_call_is_released_answers_retryably_and_its_retry_runs() {
    let store = MemoryStore::default();
    let l = layer(store.clone(), &config(policy(), None));
    let stats = l.stats();
    let (shop, svc) = in_process(&l);
    let first = spawn_call(&svc, raw_create("gate-unavailable", KEY));
    shop.started().await;
    let dup = spawn_call(&svc, raw_create("gate-unavailable", KEY));
    eventually("the duplicate to wait", || stats.snapshot().waited == 1).await;
    shop.open_gate(1);
    assert_eq!(status_of(&first.await.unwrap()).code(), Code::Unavailable);
    // The first run was released; the duplicate kept only the fingerprint, so it does
    // not run in its place: it answers UNAVAILABLE with a short retry delay.
    let st = status_of(&dup.await.unwrap());
    assert_idem_error(&st, Code::Unavailable, reason::IN_PROGRESS_ENDED);
    let delay = st.get_details_retry_info().and_then(|r| r.retry_delay);
    assert!(
        delay.is_some_and(|d| d < Duration::from_secs(1)),
        "{delay:?}"
    );
    assert_eq!(shop.runs(), 1);
    assert_eq!(stats.snapshot().ended_while_waiting, 1);
    // It gave the record back: its retry (with the request) runs at once.
    assert!(
        store
            .get(&scope_for("t1", CREATE, KEY))
            .await
            .unwrap()
            .is_none()
    );
    shop.open_gate(1);
    let retry = call(&svc, raw_create("gate-unavailable", KEY)).await;
    assert_eq!(status_of(&retry).code(), Code::Unavailable);
    assert_eq!(shop.runs(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_calls_behind_a_connection_limit_run_at_most_256_handlers_at_once() {
    // The case: a server with tonic's `concurrency_limit_per_connection(2)`; one
    // caller sends 300 calls, each cancelled once its handler runs. tonic frees the
    // connection's slot at each cancel; idem's `maxDetachedHandlers` (default 256) is
    // what bounds the runs that go on.
    let l = layer(MemoryStore::default(), &config(policy(), None)).max_handlers_per_tenant(1024);
    let shop = Shop::new();
    let (addr, incoming) = net::bind().await;
    let auth_fn: fn(http::Request<Body>) -> http::Request<Body> = auth;
    let router = Server::builder()
        .concurrency_limit_per_connection(2)
        .layer(tower::util::MapRequestLayer::new(auth_fn))
        .layer(l.clone())
        .add_service(OrdersServer::new(shop.clone()));
    tokio::spawn(async move { router.serve_with_incoming(incoming).await.expect("server") });
    let client = OrdersClient::new(net::channel(addr));
    let mut refused = 0;
    for i in 0..300 {
        let mut c = client.clone();
        let runs = shop.runs();
        let task = tokio::spawn(async move {
            c.create_order(keyed(create("gate"), &format!("key-cancel-{i:04}"), "t1"))
                .await
        });
        eventually("the call to run or be refused", || {
            shop.runs() > runs || task.is_finished()
        })
        .await;
        if shop.runs() > runs {
            task.abort();
            let _ = task.await;
            let detached = shop.runs();
            eventually("the run detached", || l.handlers_detached() == detached).await;
        } else {
            let err = task.await.unwrap().unwrap_err();
            assert_idem_error(&err, Code::ResourceExhausted, reason::OVERLOADED);
            refused += 1;
        }
    }
    assert_eq!(shop.runs(), 256, "at most maxDetachedHandlers runs at once");
    assert_eq!(refused, 44);
    assert_eq!(l.handlers_in_flight(), 256);
    shop.open_gate(256);
    // The handler slot is given back as the run's future ends, the detached count
    // when its task ends just after (CI once read 2 still detached in between).
    eventually("the detached runs ended", || {
        l.handlers_in_flight() == 0 && l.handlers_detached() == 0
    })
    .await;
    assert_eq!(shop.runs(), 256, "no run after the gate opened");
}
