//! Layer tests of the retry budget and the circuit breaker (paused clock, a counting
//! `service_fn` below the layer).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::Duration;

use bytes::Bytes;
use idem_core::config::ServiceConfig;
use idem_core::headers::reason;
use tonic::body::Body;
use tonic_types::StatusExt;
use tower::{Layer, Service, ServiceExt};

use super::*;
use crate::BoxError;

type Inner = tower::util::BoxCloneService<http::Request<Body>, http::Response<Body>, BoxError>;

/// A target that counts what reaches it and answers UNAVAILABLE while down.
#[derive(Clone, Default)]
struct Target {
    sent: Arc<AtomicU32>,
    down: Arc<AtomicBool>,
}

impl Target {
    fn down() -> Self {
        let t = Target::default();
        t.down.store(true, Ordering::SeqCst);
        t
    }
    fn sent(&self) -> u32 {
        self.sent.load(Ordering::SeqCst)
    }
    fn service(&self) -> Inner {
        let t = self.clone();
        Inner::new(tower::service_fn(move |_req: http::Request<Body>| {
            let t = t.clone();
            async move {
                t.sent.fetch_add(1, Ordering::SeqCst);
                Ok(match t.down.load(Ordering::SeqCst) {
                    true => tonic::Status::unavailable("down").into_http(),
                    false => http::Response::new(Body::empty()),
                })
            }
        }))
    }
}

const RETRIED: &str = "/a.B/Retried";
const HEDGED: &str = "/a.B/Hedged";

fn guarded(client: &str, throttling: &str) -> RetryLayer {
    let json = format!(
        r#"{{"methodConfig": [
            {{"name": [{{"service": "a.B", "method": "Retried"}}],
              "retryPolicy": {{"maxAttempts": 3, "initialBackoff": "0.01s", "maxBackoff": "0.01s",
                "backoffMultiplier": 1, "retryableStatusCodes": ["UNAVAILABLE"]}}}},
            {{"name": [{{"service": "a.B", "method": "Hedged"}}],
              "hedgingPolicy": {{"maxAttempts": 3, "hedgingDelay": "0.05s",
                "nonFatalStatusCodes": ["UNAVAILABLE"]}}}}
          ]{throttling},
          "idem": {{"client": {client}}}}}"#
    );
    let config = ServiceConfig::from_json(&json).unwrap();
    RetryLayer::builder()
        .service_config(config)
        .jitter(crate::retry::policy::backoff::FixedJitter(0.5))
        .build()
        .unwrap()
}

const BREAKER: &str = r#"{"circuitBreaker": {"failureRatio": 0.5, "minCalls": 2, "openFor": "1s",
    "halfOpenProbes": 1}}"#;
const THROTTLE: &str = r#", "retryThrottling": {"maxTokens": 100, "tokenRatio": 1}"#;

fn request(path: &str) -> http::Request<Body> {
    http::Request::builder()
        .uri(format!("http://test{path}"))
        .body(Body::new(http_body_util::Full::new(Bytes::from_static(
            b"\0\0\0\0\x02hi",
        ))))
        .unwrap()
}

async fn call(layer: &RetryLayer, target: &Target, path: &str) -> http::Response<Body> {
    let mut svc = layer.layer(target.service());
    ServiceExt::<http::Request<Body>>::ready(&mut svc)
        .await
        .unwrap()
        .call(request(path))
        .await
        .unwrap()
}

fn report(resp: &http::Response<Body>) -> CallReport {
    *resp.extensions().get::<CallReport>().expect("report")
}

fn summary(resp: &http::Response<Body>) -> (CallOutcome, u32) {
    let r = report(resp);
    (r.outcome, r.attempts)
}

/// A call's two failed attempts open the breaker (minCalls 2, ratio 0.5: each attempt
/// counts), and its third is not sent.
async fn open(layer: &RetryLayer, target: &Target) {
    let resp = call(layer, target, RETRIED).await;
    assert_eq!(summary(&resp), (CallOutcome::CircuitOpen, 2));
    assert_eq!(layer.circuit_breaker().unwrap().state(), BreakerState::Open);
}

#[tokio::test(start_paused = true)]
async fn open_sends_nothing_and_uses_no_token_nor_hedge() {
    let target = Target::down();
    let layer = guarded(BREAKER, THROTTLE);
    open(&layer, &target).await;
    assert_eq!(target.sent(), 2);
    let tokens = layer.throttle().unwrap().milli_tokens();
    for path in [RETRIED, HEDGED] {
        let resp = call(&layer, &target, path).await;
        let status = tonic::Status::from_header_map(resp.headers()).unwrap();
        assert_eq!(status.code(), tonic::Code::Unavailable);
        let info = status.get_details_error_info().unwrap();
        assert_eq!(info.reason, reason::CIRCUIT_OPEN);
        let delay = status
            .get_details_retry_info()
            .unwrap()
            .retry_delay
            .unwrap();
        assert!(delay > Duration::ZERO && delay <= Duration::from_millis(1200));
        let r = CallReport::from_status(&status).unwrap();
        assert_eq!((r.outcome, r.attempts), (CallOutcome::CircuitOpen, 0));
        assert_eq!(summary(&resp), (CallOutcome::CircuitOpen, 0));
    }
    assert_eq!(target.sent(), 2, "nothing was sent while open");
    assert_eq!(layer.throttle().unwrap().milli_tokens(), tokens, "no token");
    assert_eq!(layer.circuit_breaker().unwrap().refused(), 2);
}

#[tokio::test(start_paused = true)]
async fn a_probe_is_never_retried_nor_hedged_and_closes_the_breaker() {
    let target = Target::down();
    let layer = guarded(BREAKER, "");
    open(&layer, &target).await;
    let breaker = layer.circuit_breaker().unwrap();
    // Past the open time (1 s, at most +20 %): the next call is a probe, sent once.
    tokio::time::advance(Duration::from_millis(1300)).await;
    let resp = call(&layer, &target, RETRIED).await;
    assert_eq!(summary(&resp), (CallOutcome::CircuitProbe, 1));
    assert_eq!(target.sent(), 3, "a failed probe is not retried");
    assert_eq!(breaker.state(), BreakerState::Open, "and opens it again");
    // Reopened for 2 s (±20 %); the target recovers; a hedged method's probe sends one.
    target.down.store(false, Ordering::SeqCst);
    tokio::time::advance(Duration::from_millis(2500)).await;
    let resp = call(&layer, &target, HEDGED).await;
    assert_eq!(report(&resp).last_code, None, "committed");
    assert_eq!(target.sent(), 4, "a probe sends no hedge");
    assert_eq!(breaker.state(), BreakerState::Closed);
    assert_eq!(breaker.transitions(BreakerState::Open), 2);
    assert_eq!(breaker.transitions(BreakerState::Closed), 1);
    // Closed again, the window forgotten: a hedged call to a failing target hedges
    // again, until its own two failed hedges open the breaker.
    target.down.store(true, Ordering::SeqCst);
    let resp = call(&layer, &target, HEDGED).await;
    assert_eq!(summary(&resp), (CallOutcome::CircuitOpen, 2));
    assert_eq!(target.sent(), 6);
}

#[tokio::test(start_paused = true)]
async fn a_call_under_way_when_the_breaker_opens_stops_retrying() {
    let target = Target::down();
    let layer = guarded(
        r#"{"circuitBreaker": {"failureRatio": 1, "minCalls": 2, "openFor": "1s"}}"#,
        "",
    );
    let other = Target::down();
    // The first call's first attempt fails (one attempt: under minCalls); before its
    // retry, another call fails and opens the breaker: the retry is not sent.
    let mut svc = layer.layer(target.service());
    let first = ServiceExt::<http::Request<Body>>::ready(&mut svc)
        .await
        .unwrap()
        .call(request(RETRIED));
    let first = tokio::spawn(first);
    tokio::task::yield_now().await;
    let resp = call(&layer, &other, "/a.B/Unconfigured").await;
    assert_eq!(summary(&resp), (CallOutcome::NoRetryPolicy, 1));
    let resp = first.await.unwrap().unwrap();
    assert_eq!(summary(&resp), (CallOutcome::CircuitOpen, 1));
    assert_eq!(target.sent(), 1);
}

/// At half the failure ratio calls still go out, once each, without a retry or a hedge;
/// at the ratio the breaker opens, even inside a call.
#[tokio::test(start_paused = true)]
async fn retries_and_hedges_stop_at_half_the_ratio_before_it_opens() {
    let target = Target::default();
    let layer = guarded(
        r#"{"circuitBreaker": {"failureRatio": 0.5, "minCalls": 4, "window": "10s"}}"#,
        "",
    );
    for _ in 0..4 {
        call(&layer, &target, RETRIED).await;
    }
    target.down.store(true, Ordering::SeqCst);
    let breaker = layer.circuit_breaker().unwrap();
    // 2 of 6 attempts failed (a third, over a quarter): the second retry is not sent.
    let resp = call(&layer, &target, RETRIED).await;
    assert_eq!(summary(&resp), (CallOutcome::CircuitNoRetry, 2));
    assert_eq!(breaker.state(), BreakerState::Closed);
    let status = tonic::Status::from_header_map(resp.headers()).unwrap();
    assert_eq!(status.message(), "down", "the last attempt's own status");
    // A hedged call: its first hedge fails (3 of 7), no second hedge goes out.
    let resp = call(&layer, &target, HEDGED).await;
    assert_eq!(summary(&resp), (CallOutcome::CircuitNoRetry, 1));
    assert_eq!(target.sent(), 4 + 2 + 1);
    // 4 of 8: it opens on this call's attempt, and then sends nothing.
    let resp = call(&layer, &target, RETRIED).await;
    assert_eq!(summary(&resp), (CallOutcome::CircuitOpen, 1));
    assert_eq!(breaker.state(), BreakerState::Open);
    let resp = call(&layer, &target, RETRIED).await;
    assert_eq!(summary(&resp), (CallOutcome::CircuitOpen, 0));
    assert_eq!(target.sent(), 8);
}

#[tokio::test(start_paused = true)]
async fn the_budget_allows_its_ratio_of_the_calls_in_its_window() {
    let target = Target::down();
    let layer = guarded(
        r#"{"retryBudget": {"ratio": 0.5, "minRetriesPerSecond": 0, "window": "1s"}}"#,
        "",
    );
    let mut seen = Vec::new();
    for _ in 0..4 {
        seen.push(summary(&call(&layer, &target, RETRIED).await));
    }
    use CallOutcome::{AttemptsExhausted as Exhausted, BudgetExhausted as Budget};
    // Call 1: 1 retry > 0.5 × 1. Call 2: 1 ≤ 0.5 × 2, then 2 > 1. Call 3: 2 > 1.5.
    // Call 4: 2 ≤ 2, then 3 > 2.
    assert_eq!(seen, [(Budget, 1), (Budget, 2), (Budget, 1), (Budget, 2)]);
    assert_eq!(target.sent(), 6);
    let budget = layer.retry_budget().unwrap();
    assert_eq!(budget.refused(), 4);
    // A window later, the calls and retries have left it: 1 retry > 0.5 × 1 again.
    tokio::time::advance(Duration::from_secs(1)).await;
    assert_eq!(summary(&call(&layer, &target, RETRIED).await), (Budget, 1));
    // A quiet client still retries with the minimum.
    let quiet = guarded(
        r#"{"retryBudget": {"ratio": 0.1, "minRetriesPerSecond": 1, "window": "2s"}}"#,
        "",
    );
    assert_eq!(
        summary(&call(&quiet, &target, RETRIED).await),
        (Exhausted, 3)
    );
    assert_eq!(summary(&call(&quiet, &target, RETRIED).await), (Budget, 1));
}

#[tokio::test(start_paused = true)]
async fn budget_and_throttle_must_both_allow_a_retry() {
    let target = Target::down();
    // The throttle allows (100 tokens), the budget refuses: the failure was counted.
    let budget = r#"{"retryBudget": {"ratio": 0.5, "minRetriesPerSecond": 0}}"#;
    let l = guarded(budget, THROTTLE);
    let resp = call(&l, &target, RETRIED).await;
    assert_eq!(summary(&resp), (CallOutcome::BudgetExhausted, 1));
    assert_eq!(l.throttle().unwrap().milli_tokens(), 99_000);
    // The budget allows (ratio 1), the throttle refuses: the budget is not spent.
    let budget = r#"{"retryBudget": {"ratio": 1, "minRetriesPerSecond": 0}}"#;
    let l = guarded(
        budget,
        r#", "retryThrottling": {"maxTokens": 3, "tokenRatio": 1}"#,
    );
    let resp = call(&l, &target, RETRIED).await;
    // 3 → 2 tokens: retry (budget 1 of 1); 2 → 1: throttled.
    assert_eq!(summary(&resp), (CallOutcome::Throttled, 2));
    let resp = call(&l, &target, RETRIED).await;
    assert_eq!(summary(&resp), (CallOutcome::Throttled, 1));
    let b = l.retry_budget().unwrap();
    assert_eq!(b.refused(), 0, "never asked once the throttle refused");
    assert!(
        b.withdraw(),
        "the second call's deposit is still there to spend"
    );
    // Hedges spend the budget too: with ratio 0.5, one call's second hedge is refused.
    let l = guarded(
        r#"{"retryBudget": {"ratio": 0.5, "minRetriesPerSecond": 0}}"#,
        "",
    );
    let resp = call(&l, &target, HEDGED).await;
    assert_eq!(summary(&resp), (CallOutcome::BudgetExhausted, 1));
}

#[tokio::test(start_paused = true)]
async fn the_demo_outage_config_gives_a_breaker() {
    let text = include_str!("../../../../examples/outage/breaker.json");
    let layer = RetryLayer::builder()
        .service_config(ServiceConfig::from_json(text).unwrap())
        .build()
        .unwrap();
    assert!(layer.circuit_breaker().is_some());
    let target = Target::down();
    for _ in 0..40 {
        call(&layer, &target, "/shop.v1.Orders/CreateOrder").await;
    }
    assert_eq!(layer.circuit_breaker().unwrap().state(), BreakerState::Open);
}

/// `circuitBreaker` in a method config entry: its methods get their own breaker and
/// state; other methods keep the layer's. A reload keeps the entry's state.
#[tokio::test(start_paused = true)]
async fn a_method_config_entry_with_its_own_breaker_opens_alone() {
    let json = r#"{"methodConfig": [
        {"name": [{"service": "a.B", "method": "Retried"}],
         "retryPolicy": {"maxAttempts": 3, "initialBackoff": "0.01s", "maxBackoff": "0.01s",
           "backoffMultiplier": 1, "retryableStatusCodes": ["UNAVAILABLE"]},
         "circuitBreaker": {"failureRatio": 0.5, "minCalls": 1, "openFor": "1s"}},
        {"name": [{"service": "a.B", "method": "Other"}],
         "retryPolicy": {"maxAttempts": 3, "initialBackoff": "0.01s", "maxBackoff": "0.01s",
           "backoffMultiplier": 1, "retryableStatusCodes": ["UNAVAILABLE"]}}],
      "idem": {"client": {"circuitBreaker": {"minCalls": 100}}}}"#;
    let config = ServiceConfig::from_json(json).unwrap();
    let layer = RetryLayer::builder()
        .service_config(config.clone())
        .build()
        .unwrap();
    let target = Target::down();
    let resp = call(&layer, &target, RETRIED).await;
    assert_eq!(
        summary(&resp),
        (CallOutcome::CircuitOpen, 1),
        "its own: minCalls 1"
    );
    let resp = call(&layer, &target, RETRIED).await;
    assert_eq!(summary(&resp), (CallOutcome::CircuitOpen, 0));
    let resp = call(&layer, &target, "/a.B/Other").await;
    assert_eq!(
        summary(&resp),
        (CallOutcome::AttemptsExhausted, 3),
        "the layer's"
    );
    assert_eq!(
        layer.circuit_breaker().unwrap().state(),
        BreakerState::Closed
    );
    let methods = layer.method_circuit_breakers();
    assert_eq!(methods.len(), 1);
    assert_eq!(methods[0].0.method.as_deref(), Some("Retried"));
    assert_eq!(methods[0].1.state(), BreakerState::Open);
    layer.reload(&config);
    assert_eq!(
        layer.method_circuit_breakers()[0].1.state(),
        BreakerState::Open
    );
    let resp = call(&layer, &target, RETRIED).await;
    assert_eq!(
        summary(&resp),
        (CallOutcome::CircuitOpen, 0),
        "kept across the reload"
    );
    assert_eq!(target.sent(), 4);
}
