//! The protected-call path where cancellation, streamed responses, panics, store faults
//! and the admission bounds meet: each test here is a defect an adversarial review found
//! (and that is fixed), kept so it stays fixed. The layer is called directly as a tower
//! `Service`, on a paused clock; a store whose writes the test holds (`Gated`) stands in
//! for a networked store's round trip.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use http::HeaderMap;
use http_body::Frame;
use http_body_util::{BodyExt, Full};
use idem_core::config::{
    IdemSettings, IdempotencyPolicy, InFlightPolicy, MethodConfig, ServiceConfig, TenantSource,
};
use idem_server::idempotency::{IdempotencyLayer, scope_for};
use idem_store::faulty::{FaultyStore, StoreFault as Fault};
use idem_store::instrumented::StoreOp as Op;
use idem_store::memory::MemoryStore;
use idem_store::{
    Claim, ClaimRequest, CompleteRequest, DeleteMode, Deletion, Fence, RecordInfo, RecordState,
    Scope, Store, StoreError,
};
use idem_test_support::shop::orders_server::OrdersServer;
use idem_test_support::shop_fake::{Shop, create};
use prost::Message;
use tokio::sync::{Notify, Semaphore, mpsc};
use tokio::time::Instant;
use tonic::body::Body;
use tonic::{Code, Status};
use tower::util::BoxCloneService;
use tower::{Layer, ServiceExt};

type BoxError = std::io::Error;

const CREATE: &str = "/shop.v1.Orders/CreateOrder";
const KEY: &str = "adversarial-key-0001";
const TENANT: &str = "t";

fn config(policy: IdempotencyPolicy, settings: IdemSettings) -> ServiceConfig {
    let settings = IdemSettings {
        tenant: TenantSource::Single(TENANT.into()),
        ..settings
    };
    ServiceConfig::from_parts(
        vec![
            MethodConfig::empty()
                .with_name("shop.v1.Orders", "CreateOrder")
                .with_idempotency(policy),
        ],
        None,
        settings,
    )
    .unwrap()
}

fn grpc_frame(msg: &[u8]) -> Bytes {
    let mut b = BytesMut::new();
    b.put_u8(0);
    b.put_u32(msg.len() as u32);
    b.put_slice(msg);
    b.freeze()
}

fn request(msg: &[u8], key: &str) -> http::Request<Body> {
    http::Request::builder()
        .method("POST")
        .uri(format!("http://localhost{CREATE}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .header("x-idempotency-key", key)
        .body(Body::new(Full::new(grpc_frame(msg))))
        .unwrap()
}

fn create_req(sku: &str, key: &str) -> http::Request<Body> {
    request(&create(sku).encode_to_vec(), key)
}

#[derive(Debug, PartialEq)]
struct Raw {
    status: http::StatusCode,
    headers: HeaderMap,
    frames: Vec<Bytes>,
    trailers: Option<HeaderMap>,
}

impl Raw {
    fn status(&self) -> Status {
        Status::from_header_map(self.trailers.as_ref().unwrap_or(&self.headers))
            .expect("a grpc-status")
    }
}

/// The response, its body read to the end (a body error ends it, kept as trailers).
async fn collect(resp: http::Response<Body>) -> Raw {
    let (head, mut body) = resp.into_parts();
    let mut frames = Vec::new();
    let mut trailers = None;
    while let Some(f) = body.frame().await {
        match f {
            Ok(f) => match f.into_data() {
                Ok(d) => frames.push(d),
                Err(f) => trailers = f.into_trailers().ok(),
            },
            Err(status) => {
                let mut h = HeaderMap::new();
                let _ = status.add_header(&mut h);
                trailers = Some(h);
                break;
            }
        }
    }
    Raw {
        status: head.status,
        headers: head.headers,
        frames,
        trailers,
    }
}

async fn settle() {
    for _ in 0..50 {
        tokio::task::yield_now().await;
    }
}

// ---------------------------------------------------------------- a scripted handler

/// What a scripted response body does next.
enum Step {
    Data(Bytes),
    Fail(Status),
}

/// A response body fed by the test.
struct ScriptBody(mpsc::UnboundedReceiver<Step>);

impl http_body::Body for ScriptBody {
    type Data = Bytes;
    type Error = Status;
    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        match self.0.poll_recv(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Ready(Some(Step::Data(b))) => Poll::Ready(Some(Ok(Frame::data(b)))),
            Poll::Ready(Some(Step::Fail(s))) => Poll::Ready(Some(Err(s))),
        }
    }
}

/// A handler whose runs each take the next scripted body (or, with none left, answer a
/// Trailers-Only OK), counting its runs.
#[derive(Clone, Default)]
struct Script {
    runs: Arc<AtomicUsize>,
    bodies: Arc<Mutex<VecDeque<mpsc::UnboundedReceiver<Step>>>>,
}

impl Script {
    fn body(&self) -> mpsc::UnboundedSender<Step> {
        let (tx, rx) = mpsc::unbounded_channel();
        self.bodies.lock().unwrap().push_back(rx);
        tx
    }
    fn runs(&self) -> usize {
        self.runs.load(Ordering::SeqCst)
    }
    fn service(&self) -> BoxCloneService<http::Request<Body>, http::Response<Body>, BoxError> {
        let this = self.clone();
        BoxCloneService::new(tower::service_fn(move |_req: http::Request<Body>| {
            let this = this.clone();
            async move {
                this.runs.fetch_add(1, Ordering::SeqCst);
                let rx = this.bodies.lock().unwrap().pop_front();
                let mut resp = match rx {
                    Some(rx) => http::Response::new(Body::new(ScriptBody(rx))),
                    None => {
                        let mut r = http::Response::new(Body::empty());
                        r.headers_mut().insert("grpc-status", "0".parse().unwrap());
                        r
                    }
                };
                resp.headers_mut()
                    .insert("content-type", "application/grpc".parse().unwrap());
                Ok::<_, BoxError>(resp)
            }
        }))
    }
}

// ---------------------------------------------------------------- a store whose writes can be held

struct Gate {
    hold: AtomicBool,
    entered: Notify,
    open: Semaphore,
}

impl Default for Gate {
    fn default() -> Self {
        Gate {
            hold: AtomicBool::new(false),
            entered: Notify::new(),
            open: Semaphore::new(0),
        }
    }
}

impl Gate {
    async fn pass(&self) {
        if self.hold.load(Ordering::SeqCst) {
            self.entered.notify_one();
            self.open.acquire().await.expect("open").forget();
        }
    }
}

/// A memory store whose `claim` answer, `complete` and `release` can be held until the
/// test lets them through (a networked store's round trip, made as long as the test
/// needs). A held claim has landed; only its answer waits.
#[derive(Clone, Default)]
struct Gated {
    inner: MemoryStore,
    claim: Arc<Gate>,
    complete: Arc<Gate>,
    release: Arc<Gate>,
}

impl Store for Gated {
    fn claim(
        &self,
        req: ClaimRequest<'_>,
    ) -> impl Future<Output = Result<Claim, StoreError>> + Send {
        let gate = self.claim.clone();
        let inner = self.inner.clone();
        let ClaimRequest {
            scope,
            tenant,
            fingerprint,
            claimant,
            lease,
        } = req;
        let (scope, tenant, fingerprint) = (*scope, *tenant, *fingerprint);
        async move {
            let claimed = inner
                .claim(ClaimRequest {
                    scope: &scope,
                    tenant: &tenant,
                    fingerprint: &fingerprint,
                    claimant,
                    lease,
                })
                .await;
            gate.pass().await;
            claimed
        }
    }
    async fn renew(&self, scope: &Scope, fence: Fence, lease: Duration) -> Result<(), StoreError> {
        self.inner.renew(scope, fence, lease).await
    }
    fn complete(
        &self,
        req: CompleteRequest<'_>,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        let gate = self.complete.clone();
        let inner = self.inner.clone();
        let CompleteRequest {
            scope,
            fence,
            outcome,
            ttl,
        } = req;
        let scope = *scope;
        async move {
            gate.pass().await;
            inner
                .complete(CompleteRequest {
                    scope: &scope,
                    fence,
                    outcome,
                    ttl,
                })
                .await
        }
    }
    fn release(
        &self,
        scope: &Scope,
        fence: Fence,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        let gate = self.release.clone();
        let inner = self.inner.clone();
        let scope = *scope;
        async move {
            gate.pass().await;
            inner.release(&scope, fence).await
        }
    }
    async fn get(&self, scope: &Scope) -> Result<Option<RecordState>, StoreError> {
        self.inner.get(scope).await
    }
    async fn wait(&self, scope: &Scope, until: Instant) -> Result<(), StoreError> {
        self.inner.wait(scope, until).await
    }
    async fn read_record(&self, scope: &Scope) -> Result<Option<RecordInfo>, StoreError> {
        self.inner.read_record(scope).await
    }
    async fn delete_record(&self, scope: &Scope, mode: DeleteMode) -> Result<Deletion, StoreError> {
        self.inner.delete_record(scope, mode).await
    }
}

fn scope(key: &str) -> Scope {
    scope_for(TENANT, CREATE, key)
}

async fn state(store: &MemoryStore, key: &str) -> Option<RecordState> {
    store.get(&scope(key)).await.unwrap()
}

fn is_in_flight(s: &Option<RecordState>) -> bool {
    matches!(s, Some(RecordState::InFlight { .. }))
}

// ---------------------------------------------------------------- tests

/// A streamed response whose body fails mid-way (after its second message) ends for its
/// caller, with the error, only once the record's release has landed, as a unary one
/// does: the caller's retry right after it runs, instead of meeting the key still held
/// (ABORTED / IN_PROGRESS, or with WAIT a wait and IN_PROGRESS_ENDED).
#[tokio::test(start_paused = true)]
async fn a_broken_stream_ends_for_its_caller_only_once_its_release_landed() {
    let store = Gated::default();
    let p = IdempotencyPolicy {
        in_flight: InFlightPolicy::Abort,
        ..IdempotencyPolicy::default()
    };
    let l = IdempotencyLayer::new(store.clone(), &config(p, IdemSettings::default()));
    let script = Script::default();
    let svc = l.layer(script.service());
    let body = script.body();
    body.send(Step::Data(grpc_frame(b"\x0a\x01a"))).unwrap();
    body.send(Step::Data(grpc_frame(b"\x0a\x01b"))).unwrap();
    let resp = svc.clone().oneshot(request(b"", KEY)).await.unwrap();
    let mut caller = tokio::spawn(collect(resp));
    settle().await;
    // The response body fails mid-way: nothing complete to replay, the record is released.
    store.release.hold.store(true, Ordering::SeqCst);
    body.send(Step::Fail(Status::data_loss("broken"))).unwrap();
    store.release.entered.notified().await;
    // The release is on its way to the store and has not landed.
    let early = tokio::time::timeout(Duration::from_secs(1), &mut caller).await;
    let retry = match &early {
        Ok(_) => Some(collect(svc.clone().oneshot(request(b"", KEY)).await.unwrap()).await),
        Err(_) => None,
    };
    assert!(
        early.is_err(),
        "the caller saw the end (the error) of its broken stream while its record still \
         held the key; its retry right after got {:?}",
        retry.map(|r| r.status())
    );
    store.release.open.add_permits(1);
    let got = caller.await.unwrap();
    assert_eq!(got.status().code(), Code::DataLoss);
    let retry = collect(svc.clone().oneshot(request(b"", KEY)).await.unwrap()).await;
    assert_eq!(retry.status().code(), Code::Ok, "the retry runs");
    assert_eq!(script.runs(), 2);
}

/// A release that lands but whose reply is lost (a store timeout after applying it) is
/// retried; the retry finds no record at all. That is the lost reply of a release that
/// landed, counted as `released`, not a takeover (`stale_fence`, with its WARN and the
/// observer's "stale_fence").
#[tokio::test(start_paused = true)]
async fn a_release_whose_reply_was_lost_counts_as_released_not_as_a_stale_fence() {
    let store = FaultyStore::new(MemoryStore::default());
    store.inject(Op::Release, Fault::ReplyLost, 1);
    let l = IdempotencyLayer::new(
        store.clone(),
        &config(IdempotencyPolicy::default(), IdemSettings::default()),
    );
    let stats = l.stats();
    let shop = Shop::new();
    let svc = l.layer(OrdersServer::new(shop.clone()));
    let a = collect(
        svc.clone()
            .oneshot(create_req("unavailable", KEY))
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(a.status().code(), Code::Unavailable);
    assert!(state(store.inner(), KEY).await.is_none(), "released");
    let s = stats.snapshot();
    assert_eq!(
        (s.released, s.stale_fence),
        (1, 0),
        "the release landed (only its reply was lost), and no claimant took over: {s:?}"
    );
}

/// A call refused OVERLOADED after its claim gives its record back. A caller that goes
/// away while that release is on its way to the store (a networked store's round trip)
/// does not cancel it: the key is left free, and its retry runs at once instead of
/// waiting out the lease (10 s) for IN_PROGRESS_ENDED. (`ended_while_waiting` gives its
/// record back the same way.)
#[tokio::test(start_paused = true)]
async fn a_caller_gone_while_an_overloaded_claim_is_given_back_leaves_the_key_free() {
    let store = Gated::default();
    let l = IdempotencyLayer::new(
        store.clone(),
        &config(IdempotencyPolicy::default(), IdemSettings::default()),
    )
    .max_handlers_in_flight(1);
    let shop = Shop::new();
    let svc = l.layer(OrdersServer::new(shop.clone()));
    let busy = {
        let svc = svc.clone();
        tokio::spawn(async move {
            collect(svc.oneshot(create_req("gate", "key-busy")).await.unwrap()).await
        })
    };
    shop.started().await;
    // No handler run is free: this call claims, then gives its record back and is refused.
    store.release.hold.store(true, Ordering::SeqCst);
    let refused = {
        let svc = svc.clone();
        tokio::spawn(
            async move { collect(svc.oneshot(create_req("ok", KEY)).await.unwrap()).await },
        )
    };
    store.release.entered.notified().await;
    // Its caller goes away while the record is being given back.
    refused.abort();
    let _ = refused.await;
    store.release.hold.store(false, Ordering::SeqCst);
    store.release.open.add_permits(1);
    settle().await;
    shop.open_gate(1);
    busy.await.unwrap();
    let s = state(&store.inner, KEY).await;
    assert!(
        !is_in_flight(&s),
        "the refused call's key is left in flight with no run behind it: {s:?}"
    );
    // Its retry runs at once rather than waiting out the lease.
    let t = Instant::now();
    let retry = collect(svc.clone().oneshot(create_req("ok", KEY)).await.unwrap()).await;
    assert_eq!(retry.status().code(), Code::Ok, "{:?}", retry.status());
    assert!(Instant::now() - t < Duration::from_secs(1));
}

/// On a fail-open method with the store down, the handler runs without a record; when it
/// panics, the caller is answered INTERNAL, as on a claimed run, and the panic does not
/// unwind out of the layer's response future.
#[tokio::test(start_paused = true)]
async fn a_fail_open_run_whose_handler_panics_answers_internal() {
    let store = FaultyStore::new(MemoryStore::default());
    store.inject(Op::Claim, Fault::Unavailable, usize::MAX);
    let p = IdempotencyPolicy {
        fail_open: true,
        ..IdempotencyPolicy::default()
    };
    let l = IdempotencyLayer::new(store.clone(), &config(p, IdemSettings::default()));
    let shop = Shop::new();
    let svc = l.layer(OrdersServer::new(shop.clone()));
    let fut = svc.clone().oneshot(create_req("panic", KEY));
    let answer = tokio::spawn(async move { collect(fut.await.unwrap()).await }).await;
    assert!(
        !answer.as_ref().is_err_and(|e| e.is_panic()),
        "the handler's panic escaped the layer's future (no INTERNAL answer): {answer:?}"
    );
    assert_eq!(answer.unwrap().status().code(), Code::Internal);
    assert_eq!(shop.runs(), 1);
    assert_eq!(l.handlers_in_flight(), 0);
}

/// A caller that goes away while its claim's answer is on its way back (a networked
/// store's round trip; the claim has landed) does not leave its key held with no run
/// behind it until the lease ends: the claim is sent again by the same claimant and the
/// record it holds given back, so the key's retry runs at once.
#[tokio::test(start_paused = true)]
async fn a_caller_gone_while_its_claim_is_answered_leaves_the_key_free() {
    let store = Gated::default();
    let l = IdempotencyLayer::new(
        store.clone(),
        &config(IdempotencyPolicy::default(), IdemSettings::default()),
    );
    let shop = Shop::new();
    let svc = l.layer(OrdersServer::new(shop.clone()));
    store.claim.hold.store(true, Ordering::SeqCst);
    let first = {
        let svc = svc.clone();
        tokio::spawn(
            async move { collect(svc.oneshot(create_req("ok", KEY)).await.unwrap()).await },
        )
    };
    store.claim.entered.notified().await;
    assert!(
        is_in_flight(&state(&store.inner, KEY).await),
        "the claim landed before its answer was held"
    );
    // Its caller goes away while the answer is held.
    first.abort();
    let _ = first.await;
    store.claim.hold.store(false, Ordering::SeqCst);
    store.claim.open.add_permits(1);
    settle().await;
    let s = state(&store.inner, KEY).await;
    assert!(
        !is_in_flight(&s),
        "the cancelled call's claim left its key in flight with no run behind it: {s:?}"
    );
    assert_eq!(shop.runs(), 0, "nothing ran for the cancelled call");
    let t = Instant::now();
    let retry = collect(svc.clone().oneshot(create_req("ok", KEY)).await.unwrap()).await;
    assert_eq!(retry.status().code(), Code::Ok, "{:?}", retry.status());
    assert!(
        Instant::now() - t < Duration::from_secs(1),
        "the retry waited"
    );
    assert_eq!(shop.runs(), 1);
}
