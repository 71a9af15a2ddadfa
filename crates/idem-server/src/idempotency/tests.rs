//! Layer tests against `service_fn` inner services (end-to-end tests with a real tonic
//! server live in the crate's `tests/server.rs`).

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use idem_core::config::{
    IdemSettings, IdempotencyPolicy, MethodConfig, ServiceConfig, TenantSource,
};
use tonic::body::Body;
use tower::{ServiceExt, service_fn};
use tower_layer::Layer;

use super::IdempotencyLayer;
use idem_store::faulty::{FaultyStore, StoreFault as Fault};
use idem_store::instrumented::StoreOp as Op;
use idem_store::memory::MemoryStore;
use idem_store::{RecordState, Store};

/// A body that never yields: buffering it would never finish.
struct Pending;

impl http_body::Body for Pending {
    type Data = Bytes;
    type Error = tonic::Status;
    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, tonic::Status>>> {
        std::task::Poll::Pending
    }
}

fn config() -> ServiceConfig {
    let settings = IdemSettings {
        tenant: TenantSource::Single("t".into()),
        ..Default::default()
    };
    ServiceConfig::from_parts(
        vec![
            MethodConfig::empty()
                .with_name("shop.v1.Orders", "CreateOrder")
                .with_idempotency(IdempotencyPolicy {
                    key_required: false,
                    ..Default::default()
                }),
        ],
        None,
        settings,
    )
    .unwrap()
}

#[tokio::test(start_paused = true)]
async fn unprotected_calls_reach_the_inner_service_untouched() {
    let seen = Arc::new(AtomicUsize::new(0));
    let s2 = seen.clone();
    let inner = service_fn(move |req: Request<Body>| {
        let s2 = s2.clone();
        async move {
            // The original request, with its extension; its body was never read.
            assert_eq!(req.extensions().get::<&'static str>(), Some(&"marker"));
            s2.fetch_add(1, Ordering::SeqCst);
            Ok::<_, Infallible>(Response::new(Body::empty()))
        }
    });
    let store = MemoryStore::default();
    let svc = IdempotencyLayer::new(store.clone(), &config()).layer(inner);
    // Not protected (with a malformed key); protected with an optional key, absent.
    for (path, key) in [
        ("/shop.v1.Orders/GetOrder", Some("bad key")),
        ("/shop.v1.Orders/CreateOrder", None),
    ] {
        let mut req = Request::builder().uri(format!("http://x{path}"));
        if let Some(k) = key {
            req = req.header("x-idempotency-key", k);
        }
        let mut req = req.body(Body::new(Pending)).unwrap();
        req.extensions_mut().insert("marker");
        tokio::time::timeout(Duration::from_secs(1), svc.clone().oneshot(req))
            .await
            .expect("passed through without buffering the body")
            .unwrap();
    }
    assert_eq!(seen.load(Ordering::SeqCst), 2);
    assert!(store.is_empty());
}

#[tokio::test(start_paused = true)]
async fn a_protected_call_buffers_its_body() {
    let inner =
        service_fn(|_: Request<Body>| async { Ok::<_, Infallible>(Response::new(Body::empty())) });
    let svc = IdempotencyLayer::new(MemoryStore::default(), &config()).layer(inner);
    let req = Request::builder()
        .uri("http://x/shop.v1.Orders/CreateOrder")
        .header("x-idempotency-key", "abcdefgh")
        .body(Body::new(Pending))
        .unwrap();
    // The body never ends, so the protected call never reaches the handler.
    assert!(
        tokio::time::timeout(Duration::from_secs(1), svc.oneshot(req))
            .await
            .is_err()
    );
}

/// A handler that answers OK (Trailers-Only) after `before`.
fn answers_ok<F: std::future::Future<Output = ()> + Send + 'static>(
    before: impl Fn() -> F + Clone + Send + Sync + 'static,
) -> tower::util::BoxCloneService<Request<Body>, Response<Body>, Infallible> {
    tower::util::BoxCloneService::new(service_fn(move |_: Request<Body>| {
        let before = before.clone();
        async move {
            before().await;
            let mut resp = Response::new(Body::empty());
            resp.headers_mut()
                .insert("grpc-status", "0".parse().unwrap());
            Ok::<_, Infallible>(resp)
        }
    }))
}

/// A protected CreateOrder with an empty message.
fn create_order() -> Request<Body> {
    Request::builder()
        .uri("http://x/shop.v1.Orders/CreateOrder")
        .header("x-idempotency-key", "abcdefgh")
        .body(Body::new(http_body_util::Full::new(Bytes::from_static(
            b"\0\0\0\0\0",
        ))))
        .unwrap()
}

fn grpc_status(resp: &Response<Body>) -> Option<&[u8]> {
    resp.headers().get("grpc-status").map(|v| v.as_bytes())
}

#[tokio::test(start_paused = true)]
async fn a_store_that_panics_on_complete_answers_internal_and_leaves_the_record() {
    let store = FaultyStore::new(MemoryStore::default());
    store.inject(Op::Complete, Fault::Panic, 1);
    let svc = IdempotencyLayer::new(store.clone(), &config()).layer(answers_ok(|| async {}));
    let resp = svc
        .oneshot(create_order())
        .await
        .expect("an answer, not a panic");
    assert_eq!(grpc_status(&resp), Some(&b"13"[..]), "INTERNAL: {resp:?}");
    let scope = super::scope_for("t", "/shop.v1.Orders/CreateOrder", "abcdefgh");
    assert!(matches!(
        store.get(&scope).await.unwrap(),
        Some(RecordState::InFlight { .. })
    ));
}

/// Spends the task's cooperative budget down to its last unit (as a handler that did a
/// lot of I/O in one poll would).
async fn spend_the_budget_but_one() {
    use tokio::task::coop::{has_budget_remaining, poll_proceed};
    std::future::poll_fn(|cx| {
        let mut last = None;
        while has_budget_remaining() {
            let std::task::Poll::Ready(unit) = poll_proceed(cx) else {
                break;
            };
            if let Some(prev) = last.replace(unit) {
                prev.made_progress();
            }
        }
        // Dropped without progress: the last unit comes back.
        drop(last);
        std::task::Poll::Ready(())
    })
    .await;
}

#[tokio::test]
async fn a_run_that_ends_with_the_tasks_budget_spent_still_answers() {
    let svc = IdempotencyLayer::new(MemoryStore::default(), &config())
        .layer(answers_ok(spend_the_budget_but_one));
    let resp = svc.oneshot(create_order()).await.unwrap();
    assert_eq!(
        grpc_status(&resp),
        Some(&b"0"[..]),
        "the handler's OK, not a lost run: {resp:?}"
    );
}

/// A protected CreateOrder whose message is `msg`.
fn create_order_with(msg: &[u8]) -> Request<Body> {
    let mut framed = vec![0];
    framed.extend_from_slice(&u32::try_from(msg.len()).unwrap().to_be_bytes());
    framed.extend_from_slice(msg);
    Request::builder()
        .uri("http://x/shop.v1.Orders/CreateOrder")
        .header("x-idempotency-key", "abcdefgh")
        .body(Body::new(http_body_util::Full::new(Bytes::from(framed))))
        .unwrap()
}

/// A handler that answers INVALID_ARGUMENT (Trailers-Only) to the message `bad` and OK
/// to any other, counting its runs.
fn refuses(
    bad: &'static [u8],
    runs: Arc<AtomicUsize>,
) -> tower::util::BoxCloneService<Request<Body>, Response<Body>, Infallible> {
    use http_body_util::BodyExt;
    tower::util::BoxCloneService::new(service_fn(move |req: Request<Body>| {
        let runs = runs.clone();
        async move {
            let body = req.into_body().collect().await.unwrap().to_bytes();
            runs.fetch_add(1, Ordering::SeqCst);
            let code = if body[5..] == *bad { "3" } else { "0" };
            let mut resp = Response::new(Body::empty());
            resp.headers_mut()
                .insert("grpc-status", code.parse().unwrap());
            Ok::<_, Infallible>(resp)
        }
    }))
}

#[tokio::test(start_paused = true)]
async fn a_corrected_request_sent_right_after_a_refusal_runs_even_if_the_release_failed_once() {
    let store = FaultyStore::new(MemoryStore::default());
    store.inject(Op::Release, Fault::Unavailable, 1);
    let runs = Arc::new(AtomicUsize::new(0));
    let bad = b"\x0a\x03bad";
    let svc = IdempotencyLayer::new(store.clone(), &config()).layer(refuses(bad, runs.clone()));
    let refused = svc.clone().oneshot(create_order_with(bad)).await.unwrap();
    assert_eq!(grpc_status(&refused), Some(&b"3"[..]), "{refused:?}");
    // Told to fix its request, the caller sends the corrected one with the same key at
    // once: the record was released before that answer left.
    let fixed = svc
        .clone()
        .oneshot(create_order_with(b"\x0a\x02ok"))
        .await
        .unwrap();
    assert_eq!(
        grpc_status(&fixed),
        Some(&b"0"[..]),
        "the corrected request ran, not KEY_REUSED: {fixed:?}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    assert_eq!(store.faulted(Op::Release), 1);
    assert_eq!(
        store.calls(Op::Release),
        2,
        "the failed release was sent again"
    );
}
