//! Where two features of the retry layer meet: the call's deadline and the inner
//! service's readiness (retries, hedges), hedging and the metrics observer.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use idem_client::BoxError;
use idem_client::metrics::{CallEnded, CallObserver};
use idem_client::retry::backoff::FixedJitter;
use idem_client::retry::{CallOutcome, CallReport, RetryLayer};
use idem_core::config::ServiceConfig;
use tokio::time::{Instant, Sleep};
use tonic::body::Body;
use tower::{Layer, Service, ServiceExt};

const PATH: &str = "/shop.v1.Orders/CreateOrder";

/// The requests the inner service saw, with when each came.
type Seen = Arc<Mutex<Vec<(Instant, http::HeaderMap)>>>;

/// An inner service that answers every request Trailers-Only UNAVAILABLE at once and
/// is ready for its first request only: after it, `poll_ready` stays pending for `busy`,
/// as `tower::limit::RateLimit`, or a tonic `Channel` whose buffer is full, does.
#[derive(Clone)]
struct BusyAfterFirst {
    seen: Seen,
    busy: Duration,
    until: Option<Arc<Mutex<Pin<Box<Sleep>>>>>,
}

impl BusyAfterFirst {
    fn new(busy: Duration) -> Self {
        BusyAfterFirst {
            seen: Seen::default(),
            busy,
            until: None,
        }
    }
}

impl Service<http::Request<Body>> for BusyAfterFirst {
    type Response = http::Response<Body>;
    type Error = BoxError;
    type Future = std::future::Ready<Result<http::Response<Body>, BoxError>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        if self.seen.lock().unwrap().is_empty() {
            return Poll::Ready(Ok(()));
        }
        let busy = self.busy;
        let until = self
            .until
            .get_or_insert_with(|| Arc::new(Mutex::new(Box::pin(tokio::time::sleep(busy)))));
        until.lock().unwrap().as_mut().poll(cx).map(Ok)
    }

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        self.seen
            .lock()
            .unwrap()
            .push((Instant::now(), req.headers().clone()));
        std::future::ready(Ok(tonic::Status::unavailable("busy").into_http()))
    }
}

/// A unary request; `timeout` is its `grpc-timeout` (what tonic's `set_timeout` sends).
fn request(timeout: Option<&'static str>) -> http::Request<Body> {
    let mut req = http::Request::builder()
        .uri(format!("http://test{PATH}"))
        .body(Body::new(http_body_util::Full::new(Bytes::from_static(
            b"\0\0\0\0\x02hi",
        ))))
        .unwrap();
    if let Some(t) = timeout {
        req.headers_mut()
            .insert("grpc-timeout", http::HeaderValue::from_static(t));
    }
    req
}

/// Sends `req` through `svc`; the answer, and how long it took. A call still
/// unanswered after two minutes (of paused time) fails the test.
async fn send<S>(svc: &mut S, req: http::Request<Body>) -> (http::Response<Body>, Duration)
where
    S: Service<http::Request<Body>, Response = http::Response<Body>, Error = BoxError>,
{
    let start = Instant::now();
    let call = ServiceExt::<http::Request<Body>>::ready(svc)
        .await
        .unwrap()
        .call(req);
    let resp = tokio::time::timeout(Duration::from_secs(120), call)
        .await
        .expect("the call ends")
        .unwrap();
    (resp, start.elapsed())
}

/// The code and the report's outcome of a Trailers-Only answer.
fn failure(resp: &http::Response<Body>) -> (tonic::Code, CallOutcome) {
    let status = tonic::Status::from_header_map(resp.headers()).expect("a Trailers-Only status");
    let report = CallReport::from_status(&status).expect("a report");
    (status.code(), report.outcome)
}

fn hedging_config(delay: &str) -> ServiceConfig {
    ServiceConfig::from_json(&format!(
        r#"{{"methodConfig": [{{"name": [{{"service": "shop.v1.Orders"}}],
            "hedgingPolicy": {{"maxAttempts": 3, "hedgingDelay": "{delay}",
                              "nonFatalStatusCodes": ["UNAVAILABLE"]}}}}]}}"#
    ))
    .unwrap()
}

/// A retry whose inner service stays busy (not ready) past the call's deadline ends at
/// the deadline with DEADLINE_EXCEEDED and a report, and sends nothing more: the
/// deadline bounds the wait for readiness as it bounds the backoff and the attempt.
#[tokio::test(start_paused = true)]
async fn a_retry_waiting_for_a_busy_service_ends_at_the_deadline() {
    let inner = BusyAfterFirst::new(Duration::from_secs(30));
    let seen = inner.seen.clone();
    let layer = RetryLayer::builder()
        .max_attempts(3)
        .jitter(FixedJitter(0.5))
        .build()
        .unwrap();
    let (resp, took) = send(&mut layer.layer(inner), request(Some("1S"))).await;
    let sent = seen.lock().unwrap().len();
    assert_eq!(
        (failure(&resp), took, sent),
        (
            (tonic::Code::DeadlineExceeded, CallOutcome::Deadline),
            Duration::from_secs(1),
            1
        ),
        "(code, outcome), answered after, requests sent"
    );
}

/// A hedged call whose next hedge waits for a busy inner service ends at the deadline
/// with DEADLINE_EXCEEDED and a report, and sends no hedge past the deadline ("the
/// call's deadline bounds every hedge: none starts past it").
#[tokio::test(start_paused = true)]
async fn a_hedge_waiting_for_a_busy_service_ends_at_the_deadline() {
    let inner = BusyAfterFirst::new(Duration::from_secs(30));
    let seen = inner.seen.clone();
    let layer = RetryLayer::builder()
        .service_config(hedging_config("0.05s"))
        .build()
        .unwrap();
    let (resp, took) = send(&mut layer.layer(inner), request(Some("1S"))).await;
    let sent = seen.lock().unwrap().len();
    assert_eq!(
        (failure(&resp), took, sent),
        (
            (tonic::Code::DeadlineExceeded, CallOutcome::Deadline),
            Duration::from_secs(1),
            1
        ),
        "(code, outcome), answered after, requests sent"
    );
}

/// Counts `attempt_started`.
#[derive(Default, Clone)]
struct Counting(Arc<AtomicUsize>);

impl CallObserver for Counting {
    fn attempt_started(&self, _method: &str) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
    fn call_ended(&self, _call: &CallEnded<'_>) {}
}

/// The observer hears of every hedge as it is sent (`attempt_started`), as it hears of
/// every attempt of a retried call: idem-otel's `grpc.client.attempt.started` counts
/// "attempts sent, retries, hedges and transparent retries included (A66)".
#[tokio::test(start_paused = true)]
async fn the_observer_hears_of_every_hedge() {
    let counting = Counting::default();
    let layer = RetryLayer::builder()
        .service_config(hedging_config("1s"))
        .observer(counting.clone())
        .build()
        .unwrap();
    let seen = Seen::default();
    let calls = seen.clone();
    // The first hedge fails (non-fatal): the second goes out at once and commits.
    let inner = tower::service_fn(move |req: http::Request<Body>| {
        let first = {
            let mut calls = calls.lock().unwrap();
            calls.push((Instant::now(), req.headers().clone()));
            calls.len() == 1
        };
        std::future::ready(Ok::<_, BoxError>(match first {
            true => tonic::Status::unavailable("busy").into_http(),
            false => http::Response::new(Body::empty()),
        }))
    });
    let (resp, _) = send(&mut layer.layer(inner), request(None)).await;
    let report = *resp.extensions().get::<CallReport>().unwrap();
    assert_eq!(
        (report.outcome, report.hedges()),
        (CallOutcome::Committed, Some(2))
    );
    assert_eq!(seen.lock().unwrap().len(), 2, "hedges sent");
    assert_eq!(
        counting.0.load(Ordering::SeqCst),
        2,
        "attempts the observer heard of"
    );
}
