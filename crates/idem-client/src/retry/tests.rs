//! Layer tests against a scripted `service_fn` (paused clock: exact times).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::HeaderMap;
use http_body_util::BodyExt;
use idem_core::code::{Code, CodeSet};
use idem_core::config::{IdemSettings, MethodConfig, RetryThrottling, ServiceConfig};
use idem_core::deadline::{InboundScope, parse_grpc_timeout, scope_inbound_deadline};
use tokio::time::Instant;
use tonic::body::Body;
use tower::{Layer, Service, ServiceExt};

use super::*;
use crate::BoxError;
use crate::retry::policy::backoff::FixedJitter;

// Helpers shared by the retry module's tests.
/// A valid retry policy that retries `UNAVAILABLE` only (the one the end-to-end tests
/// use too).
pub(crate) use idem_test_support::unavailable_policy;

/// The body's next frame, which must be its trailers.
pub(crate) async fn next_trailers<B>(body: &mut B) -> HeaderMap
where
    B: http_body::Body + Unpin,
    B::Error: std::fmt::Debug,
{
    body.frame()
        .await
        .unwrap()
        .unwrap()
        .into_trailers()
        .unwrap_or_else(|_| panic!("not trailers"))
}

/// The report of a call that ran out of time, whose status must be DEADLINE_EXCEEDED
/// with a report of [`CallOutcome::Deadline`].
#[track_caller]
pub(crate) fn deadline_report(status: &tonic::Status) -> CallReport {
    assert_eq!(status.code(), tonic::Code::DeadlineExceeded, "{status:?}");
    let r = CallReport::from_status(status).unwrap();
    assert_eq!(r.outcome, CallOutcome::Deadline);
    r
}

/// A scripted service below the layer.
type Inner = tower::util::BoxCloneService<http::Request<Body>, http::Response<Body>, BoxError>;

#[derive(Clone)]
enum Step {
    /// Trailers-Only with this status.
    Status(tonic::Status),
    /// Real headers (committed), OK.
    Ok,
    /// Never answers.
    Hang,
    /// A transport error before anything came back.
    Refused,
    /// What tonic's channel says when it cannot connect: nothing was sent.
    NotConnected,
    /// What tonic's channel does with `grpc-timeout`: an error when it runs out.
    TimeoutExpired,
    /// Real headers, one message, then nothing for ever.
    Stall,
}

#[derive(Debug, Clone)]
struct Seen {
    at: Instant,
    headers: HeaderMap,
    body: Bytes,
}

#[derive(Clone, Default)]
struct Script {
    steps: Arc<Mutex<VecDeque<Step>>>,
    seen: Arc<Mutex<Vec<Seen>>>,
}

impl Script {
    fn new(steps: impl IntoIterator<Item = Step>) -> Self {
        let s = Script::default();
        s.steps.lock().unwrap().extend(steps);
        s
    }
    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }
    fn gaps(&self) -> Vec<Duration> {
        let seen = self.seen();
        seen.windows(2).map(|w| w[1].at - w[0].at).collect()
    }
    /// The `grpc-timeout` of every request seen.
    fn timeouts(&self) -> Vec<Duration> {
        self.seen()
            .iter()
            .map(|s| parse_grpc_timeout(s.headers["grpc-timeout"].as_bytes()).unwrap())
            .collect()
    }
    fn service(&self) -> Inner {
        let script = self.clone();
        Inner::new(tower::service_fn(move |req: http::Request<Body>| {
            let script = script.clone();
            async move {
                let at = Instant::now();
                let (parts, body) = req.into_parts();
                let parts_headers = parts.headers.clone();
                let body = body
                    .collect()
                    .await
                    .map(|c| c.to_bytes())
                    .unwrap_or_default();
                script.seen.lock().unwrap().push(Seen {
                    at,
                    headers: parts_headers,
                    body,
                });
                let step = script.steps.lock().unwrap().pop_front().unwrap_or(Step::Ok);
                match step {
                    Step::Status(s) => Ok(s.into_http()),
                    Step::Ok => Ok(http::Response::new(Body::empty())),
                    Step::Hang => std::future::pending().await,
                    Step::Refused => Err::<_, BoxError>("connection refused".into()),
                    Step::NotConnected => Err(Box::new(tonic::ConnectError(
                        "tcp connect error: Connection refused".into(),
                    )) as BoxError),
                    Step::TimeoutExpired => {
                        let timeout = parts
                            .headers
                            .get("grpc-timeout")
                            .and_then(|v| parse_grpc_timeout(v.as_bytes()));
                        tokio::time::sleep(timeout.unwrap_or(Duration::MAX)).await;
                        Err("Timeout expired".into())
                    }
                    Step::Stall => Ok(http::Response::new(Body::new(StalledBody(true)))),
                }
            }
        }))
    }
}

fn unavailable() -> Step {
    Step::Status(tonic::Status::unavailable("try again"))
}

fn with_pushback(value: &'static str) -> Step {
    let mut s = tonic::Status::unavailable("busy");
    s.metadata_mut()
        .insert("grpc-retry-pushback-ms", value.parse().unwrap());
    Step::Status(s)
}

fn request(path: &str) -> http::Request<Body> {
    http::Request::builder()
        .uri(format!("http://test{path}"))
        .body(Body::new(http_body_util::Full::new(Bytes::from_static(
            b"\0\0\0\0\x02hi",
        ))))
        .unwrap()
}

const PATH: &str = "/shop.v1.Orders/CreateOrder";

fn with_header(path: &str, name: &'static str, value: &'static str) -> http::Request<Body> {
    let mut req = request(path);
    req.headers_mut().insert(name, value.parse().unwrap());
    req
}

async fn send<S>(svc: &mut S, req: http::Request<Body>) -> Result<http::Response<Body>, BoxError>
where
    S: Service<http::Request<Body>, Response = http::Response<Body>, Error = BoxError>,
{
    svc.ready().await?.call(req).await
}

/// Sends `req` through `layer` over `script`.
async fn run(
    layer: &RetryLayer,
    script: &Script,
    req: http::Request<Body>,
) -> http::Response<Body> {
    send(&mut layer.layer(script.service()), req).await.unwrap()
}

fn report(resp: &http::Response<Body>) -> CallReport {
    *resp.extensions().get::<CallReport>().expect("report")
}

fn ends(r: &CallReport) -> Vec<AttemptEnd> {
    r.history().map(|a| a.end).collect()
}

/// Asserts the `(outcome, attempts, last_code)` of a response's report.
#[track_caller]
fn assert_summary(
    resp: &http::Response<Body>,
    outcome: CallOutcome,
    attempts: u32,
    last_code: Option<Code>,
) {
    let r = report(resp);
    assert_eq!(
        (r.outcome, r.attempts, r.last_code),
        (outcome, attempts, last_code),
        "{r}"
    );
}

/// The status a Trailers-Only response carries.
fn status_of(resp: &http::Response<Body>) -> tonic::Status {
    tonic::Status::from_header_map(resp.headers()).unwrap()
}

#[track_caller]
fn assert_status(status: &tonic::Status, code: tonic::Code, message: &str) {
    assert_eq!((status.code(), status.message()), (code, message));
}

/// Asserts a call that failed before any attempt was sent: its status (code, message),
/// and a report of `outcome` after no attempt, the status's code the last.
#[track_caller]
fn assert_unsent(resp: &http::Response<Body>, (code, message): (Code, &str), outcome: CallOutcome) {
    assert_status(&status_of(resp), code, message);
    assert_summary(resp, outcome, 0, Some(code));
}

fn builder() -> RetryLayerBuilder {
    RetryLayer::builder().jitter(FixedJitter(0.5))
}

#[tokio::test(start_paused = true)]
async fn backoff_waits_lie_in_a6_bounds_for_attempts_1_to_4() {
    let policy = unavailable_policy(5, Duration::from_millis(20), Duration::from_secs(1), 2.0);
    for seed in 0..20u64 {
        let script = Script::new([
            unavailable(),
            unavailable(),
            unavailable(),
            unavailable(),
            Step::Ok,
        ]);
        let layer = RetryLayer::builder()
            .max_attempts(5)
            .seed(seed)
            .build()
            .unwrap();
        let resp = run(&layer, &script, request(PATH)).await;
        assert_summary(&resp, CallOutcome::Committed, 5, None);
        let gaps = script.gaps();
        assert_eq!(gaps.len(), 4);
        for (i, gap) in gaps.iter().enumerate() {
            let (lo, hi) = backoff::backoff_bounds(&policy, i as u32 + 1);
            assert!(
                lo <= *gap && *gap <= hi,
                "seed {seed} retry {}: {gap:?} not in [{lo:?}, {hi:?}]",
                i + 1
            );
        }
    }
    // The bounds themselves: 16..24, 32..48, 64..96, 128..192 ms.
    let ms = |n| {
        let (lo, hi) = backoff::backoff_bounds(&policy, n);
        (lo.as_millis(), hi.as_millis())
    };
    assert_eq!(
        [ms(1), ms(2), ms(3), ms(4)],
        [(16, 24), (32, 48), (64, 96), (128, 192)]
    );
}

#[tokio::test(start_paused = true)]
async fn exponent_resets_after_a_pushback() {
    let script = Script::new([
        unavailable(),
        unavailable(),
        with_pushback("300"),
        unavailable(),
        Step::Ok,
    ]);
    let layer = builder().max_attempts(5).build().unwrap();
    let resp = run(&layer, &script, request(PATH)).await;
    assert_eq!(report(&resp).attempts, 5);
    // Midpoint jitter: 20, 40, then exactly the pushback, then back to 20.
    let ms: Vec<u128> = script.gaps().iter().map(Duration::as_millis).collect();
    assert_eq!(ms, [20, 40, 300, 20]);
}

#[tokio::test(start_paused = true)]
async fn retry_info_is_a_minimum_and_reading_it_never_panics() {
    use tonic_types::{ErrorDetails, StatusExt};
    let with_info = |ms| {
        Step::Status(tonic::Status::with_error_details(
            tonic::Code::Unavailable,
            "busy",
            ErrorDetails::with_retry_info(Some(Duration::from_millis(ms))),
        ))
    };
    let mut garbage = tonic::Status::unavailable("x");
    garbage.metadata_mut().insert_bin(
        "grpc-status-details-bin",
        tonic::metadata::MetadataValue::from_bytes(b"\xff\x00junk"),
    );
    let script = Script::new([
        with_info(500),
        with_info(1),
        Step::Status(garbage),
        Step::Ok,
    ]);
    let layer = builder().max_attempts(5).build().unwrap();
    run(&layer, &script, request(PATH)).await;
    let ms: Vec<u128> = script.gaps().iter().map(Duration::as_millis).collect();
    // 500 (RetryInfo above the 20 ms backoff), 40 (backoff above 1 ms), 80 (garbage ignored).
    assert_eq!(ms, [500, 40, 80]);
}

#[tokio::test(start_paused = true)]
async fn deadline_100ms_with_1s_backoff_makes_one_attempt_and_returns_at_once() {
    let script = Script::new([unavailable(), Step::Ok]);
    let layer = builder()
        .initial_backoff(Duration::from_secs(1))
        .max_backoff(Duration::from_secs(1))
        .build()
        .unwrap();
    let req = with_timeout(PATH, "100m");
    let start = Instant::now();
    let resp = run(&layer, &script, req).await;
    assert_eq!(
        start.elapsed(),
        Duration::ZERO,
        "must not sleep into the deadline"
    );
    assert_eq!(script.seen().len(), 1);
    let r = report(&resp);
    assert_eq!(
        (r.outcome, r.attempts, r.last_code),
        (CallOutcome::Deadline, 1, Some(Code::Unavailable))
    );
    // The caller sees the last attempt's status, not DEADLINE_EXCEEDED.
    assert_eq!(resp.headers()["grpc-status"], "14");
}

#[tokio::test(start_paused = true)]
async fn pushback_longer_than_the_time_left_ends_the_call_without_waiting() {
    let script = Script::new([with_pushback("300"), Step::Ok]);
    let layer = builder().build().unwrap();
    let req = with_timeout(PATH, "200m");
    let start = Instant::now();
    let resp = run(&layer, &script, req).await;
    assert_eq!(start.elapsed(), Duration::ZERO);
    assert_eq!(report(&resp).outcome, CallOutcome::Deadline);
    assert_eq!(script.seen().len(), 1);
}

#[tokio::test(start_paused = true)]
async fn min_attempt_time_stops_a_retry_that_would_start_too_late() {
    // 100 ms deadline, 20 ms backoff: 80 ms would be left, below a 90 ms minimum and
    // above a 70 ms one.
    for (min, outcome, attempts) in [
        (90, CallOutcome::Deadline, 1),
        (70, CallOutcome::Committed, 2),
    ] {
        let script = Script::new([unavailable(), Step::Ok]);
        let layer = builder()
            .min_attempt_time(Duration::from_millis(min))
            .build()
            .unwrap();
        let req = with_timeout(PATH, "100m");
        let resp = run(&layer, &script, req).await;
        assert_eq!(report(&resp).outcome, outcome, "minimum {min} ms");
        assert_eq!(script.seen().len(), attempts, "minimum {min} ms");
    }
}

#[tokio::test(start_paused = true)]
async fn grpc_timeout_is_rewritten_to_the_time_left_on_every_attempt() {
    let script = Script::new([unavailable(), unavailable(), Step::Ok]);
    let layer = builder()
        .initial_backoff(Duration::from_millis(100))
        .build()
        .unwrap();
    let req = with_timeout(PATH, "1S");
    run(&layer, &script, req).await;
    assert_eq!(
        script.timeouts(),
        [
            Duration::from_millis(1000),
            Duration::from_millis(900),
            Duration::from_millis(700)
        ]
    );
    let previous: Vec<Option<String>> = script
        .seen()
        .iter()
        .map(|s| {
            s.headers
                .get("grpc-previous-rpc-attempts")
                .map(|v| v.to_str().unwrap().to_owned())
        })
        .collect();
    assert_eq!(previous, [None, Some("1".to_owned()), Some("2".to_owned())]);
}

#[tokio::test(start_paused = true)]
async fn config_timeout_and_inbound_deadline_take_the_earliest() {
    let policy = unavailable_policy(3, Duration::from_millis(10), Duration::from_millis(10), 1.0);
    let cfg = ServiceConfig::from_parts(
        vec![
            MethodConfig::empty()
                .with_name("shop.v1.Orders", "")
                .with_timeout(Duration::from_millis(500))
                .with_retry_policy(policy),
        ],
        None,
        IdemSettings::default(),
    )
    .unwrap();
    let script = Script::new([Step::Ok, Step::Ok, Step::Ok]);
    let layer = RetryLayer::from_config(&cfg);
    let mut svc = layer.layer(script.service());
    // Config timeout alone.
    send(&mut svc, request(PATH)).await.unwrap();
    // The caller's shorter grpc-timeout.
    let req = with_timeout(PATH, "200m");
    send(&mut svc, req).await.unwrap();
    // An inbound deadline (the cross-hop hook) shorter still.
    let scope = InboundScope::new(Some(Instant::now() + Duration::from_millis(50)), 0);
    scope_inbound_deadline(scope, send(&mut svc, request(PATH)))
        .await
        .unwrap();
    assert_eq!(
        script.timeouts(),
        [
            Duration::from_millis(500),
            Duration::from_millis(200),
            Duration::from_millis(50)
        ]
    );
}

#[tokio::test(start_paused = true)]
async fn a_hanging_attempt_is_cut_at_the_deadline() {
    let script = Script::new([Step::Hang]);
    let layer = builder().build().unwrap();
    let req = with_timeout(PATH, "100m");
    let start = Instant::now();
    let resp = run(&layer, &script, req).await;
    assert_eq!(start.elapsed(), Duration::from_millis(100));
    assert_eq!(resp.headers()["grpc-status"], "4");
    assert_eq!(report(&resp).outcome, CallOutcome::Deadline);
}

#[tokio::test(start_paused = true)]
async fn per_attempt_recv_timeout_cancels_and_retries() {
    let script = Script::new([Step::Hang, Step::Ok]);
    let layer = builder()
        .per_attempt_recv_timeout(Duration::from_millis(50))
        .build()
        .unwrap();
    let start = Instant::now();
    let resp = run(&layer, &script, request(PATH)).await;
    assert_summary(&resp, CallOutcome::Committed, 2, None);
    assert_eq!(start.elapsed(), Duration::from_millis(50 + 20));
    // Every attempt hangs: CANCELLED after maxAttempts.
    let script = Script::new([Step::Hang, Step::Hang, Step::Hang]);
    let resp = run(&layer, &script, request(PATH)).await;
    assert_eq!(resp.headers()["grpc-status"], "1");
    assert_eq!(report(&resp).outcome, CallOutcome::AttemptsExhausted);
}

#[tokio::test(start_paused = true)]
async fn transport_errors_are_retried_like_unavailable() {
    let script = Script::new([Step::Refused, Step::Refused, Step::Ok]);
    let layer = builder().build().unwrap();
    let resp = run(&layer, &script, request(PATH)).await;
    assert_eq!(report(&resp).attempts, 3);
    // Not retried when UNAVAILABLE is not retryable; the error comes back as the status
    // tonic would make of it, with a report.
    let script = Script::new([Step::Refused, Step::Ok]);
    let layer = builder()
        .retryable_status_codes(CodeSet::of(Code::Aborted))
        .build()
        .unwrap();
    let resp = run(&layer, &script, request(PATH)).await;
    let status = status_of(&resp);
    assert_eq!(status.message(), "connection refused");
    let r = CallReport::from_status(&status).unwrap();
    assert_eq!((r.outcome, r.attempts), (CallOutcome::NonRetryableCode, 1));
    assert_eq!(ends(&r), [AttemptEnd::TransportError]);
    assert_eq!(
        layer
            .stats()
            .snapshot()
            .outcome(CallOutcome::NonRetryableCode),
        1
    );
}

#[tokio::test(start_paused = true)]
async fn a_call_that_fails_on_every_attempt_with_transport_errors_has_a_report() {
    let script = Script::new([Step::Refused, Step::Refused, Step::Refused]);
    let layer = builder().build().unwrap();
    let resp = run(&layer, &script, request(PATH)).await;
    let status = status_of(&resp);
    let r = CallReport::from_status(&status).unwrap();
    assert_eq!(r, report(&resp));
    assert_eq!((r.outcome, r.attempts), (CallOutcome::AttemptsExhausted, 3));
    assert_eq!(
        r.to_string(),
        "gave up: attempts exhausted after 3 attempts: transport error in 0ns, then waited \
         20ms; transport error in 0ns, then waited 40ms; transport error in 0ns"
    );
}

#[tokio::test(start_paused = true)]
async fn every_attempt_sends_the_whole_body() {
    let script = Script::new([unavailable(), unavailable(), Step::Ok]);
    let layer = builder().build().unwrap();
    run(&layer, &script, request(PATH)).await;
    for s in script.seen() {
        assert_eq!(&s.body[..], b"\0\0\0\0\x02hi");
    }
    assert_eq!(layer.replay_bytes_held(), 0, "released when the call ends");
}

#[tokio::test(start_paused = true)]
async fn a_body_over_the_replay_budget_is_sent_once() {
    let script = Script::new([unavailable(), Step::Ok]);
    let layer = builder().max_replay_bytes_total(4).build().unwrap();
    let err = run(&layer, &script, request(PATH)).await;
    assert_eq!(report(&err).outcome, CallOutcome::ReplayBudgetExhausted);
    assert_eq!(script.seen().len(), 1);
    assert_eq!(&script.seen()[0].body[..], b"\0\0\0\0\x02hi");
}

#[tokio::test(start_paused = true)]
async fn no_policy_passes_through_once_and_unprotected_methods_get_no_key() {
    let cfg = ServiceConfig::from_parts(Vec::new(), None, IdemSettings::default()).unwrap();
    let script = Script::new([unavailable()]);
    let layer = RetryLayer::from_config(&cfg);
    let resp = run(&layer, &script, request(PATH)).await;
    assert_eq!(report(&resp).outcome, CallOutcome::NoRetryPolicy);
    assert_eq!(script.seen().len(), 1);
    assert!(!script.seen()[0].headers.contains_key("x-idempotency-key"));
}

#[tokio::test(start_paused = true)]
async fn reload_swaps_policies_and_keeps_the_throttle_bucket() {
    let policy =
        |n| unavailable_policy(n, Duration::from_millis(10), Duration::from_millis(10), 1.0);
    let throttling = RetryThrottling {
        max_milli_tokens: 20_000,
        token_ratio_milli: 500,
    };
    let cfg = |n| {
        ServiceConfig::from_parts(
            vec![
                MethodConfig::empty()
                    .with_name("shop.v1.Orders", "")
                    .with_retry_policy(policy(n)),
            ],
            Some(throttling),
            IdemSettings::default(),
        )
        .unwrap()
    };
    let script = Script::new([unavailable(), unavailable()]);
    let layer = RetryLayer::from_config(&cfg(2));
    run(&layer, &script, request(PATH)).await;
    let bucket = layer.throttle().unwrap();
    assert_eq!(bucket.milli_tokens(), 18_000);
    layer.reload(&cfg(4));
    assert_eq!(
        layer.throttle().unwrap().milli_tokens(),
        18_000,
        "bucket survives the reload"
    );
    let script = Script::new([unavailable(), unavailable(), unavailable(), unavailable()]);
    let resp = run(&layer, &script, request(PATH)).await;
    assert_eq!(report(&resp).attempts, 4, "new policy applies");
    assert_eq!(bucket.milli_tokens(), 14_000, "same bucket, shared");
}

#[tokio::test(start_paused = true)]
async fn a_throttle_handle_is_shared_across_layers() {
    let bucket = RetryThrottle::new(RetryThrottling {
        max_milli_tokens: 3_000,
        token_ratio_milli: 1_000,
    });
    let a = builder().throttle(bucket.clone()).build().unwrap();
    let b = builder().throttle(bucket.clone()).build().unwrap();
    let script = Script::new([unavailable(), unavailable()]);
    let resp = run(&a, &script, request(PATH)).await;
    // 3 → 2 tokens (> 1.5): retried; second failure 2 → 1: throttled.
    assert_eq!(report(&resp).outcome, CallOutcome::Throttled);
    let script = Script::new([unavailable(), Step::Ok]);
    let resp = run(&b, &script, request(PATH)).await;
    assert_summary(&resp, CallOutcome::Throttled, 1, Some(Code::Unavailable));
}

#[tokio::test(start_paused = true)]
async fn outcome_hook_and_stats_see_every_call() {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let sink = seen.clone();
    let layer = builder()
        .on_outcome(move |path, r| {
            sink.lock()
                .unwrap()
                .push((path.to_owned(), r.outcome, r.attempts))
        })
        .build()
        .unwrap();
    let script = Script::new([
        unavailable(),
        unavailable(),
        unavailable(),
        Step::Status(tonic::Status::internal("x")),
    ]);
    let mut svc = layer.layer(script.service());
    let resp = send(&mut svc, request(PATH)).await.unwrap();
    assert!(
        resp.headers()
            .contains_key(idem_core::headers::RETRY_OUTCOME)
    );
    let status = status_of(&resp);
    let r = CallReport::from_status(&status).unwrap();
    assert_eq!((r.outcome, r.attempts), (CallOutcome::AttemptsExhausted, 3));
    assert!(r.outcome.retries_gave_up());
    send(&mut svc, request(PATH)).await.unwrap();
    assert_eq!(
        *seen.lock().unwrap(),
        [
            (PATH.to_owned(), CallOutcome::AttemptsExhausted, 3),
            (PATH.to_owned(), CallOutcome::NonRetryableCode, 1)
        ]
    );
    let stats = layer.stats().snapshot();
    assert_eq!((stats.calls, stats.attempts, stats.retries), (2, 4, 2));
    assert_eq!(stats.outcome(CallOutcome::AttemptsExhausted), 1);
}

#[tokio::test(start_paused = true)]
async fn give_up_failures_carry_the_inbound_marker() {
    use idem_core::deadline::ExhaustedMarker;
    use idem_core::headers::DOWNSTREAM_EXHAUSTED;
    let marker = ExhaustedMarker::random();
    let scope = InboundScope::new(None, 0).with_marker(marker);
    let layer = builder().build().unwrap();
    // Exhausted: marked.
    let script = Script::new([unavailable(), unavailable(), unavailable()]);
    let resp = scope.run(run(&layer, &script, request(PATH))).await;
    assert!(marker.matches(&resp.headers()[DOWNSTREAM_EXHAUSTED]));
    // A non-retryable failure is the handler's to judge: not marked.
    let script = Script::new([Step::Status(tonic::Status::internal("x"))]);
    let resp = scope.run(run(&layer, &script, request(PATH))).await;
    assert!(!resp.headers().contains_key(DOWNSTREAM_EXHAUSTED));
    // Outside an inbound call: not marked.
    let script = Script::new([unavailable(), unavailable(), unavailable()]);
    let resp = run(&layer, &script, request(PATH)).await;
    assert!(!resp.headers().contains_key(DOWNSTREAM_EXHAUSTED));
}

#[tokio::test(start_paused = true)]
async fn a_proxy_503_without_grpc_status_is_retried_like_unavailable() {
    let calls = Arc::new(Mutex::new(0u32));
    let counter = calls.clone();
    let svc = tower::service_fn(move |_req: http::Request<Body>| {
        let counter = counter.clone();
        async move {
            let mut n = counter.lock().unwrap();
            *n += 1;
            let status = if *n == 1 { 503 } else { 200 };
            Ok::<_, BoxError>(
                http::Response::builder()
                    .status(status)
                    .body(Body::empty())
                    .unwrap(),
            )
        }
    });
    let layer = builder().build().unwrap();
    let resp = send(&mut layer.layer(svc), request(PATH)).await.unwrap();
    assert_summary(&resp, CallOutcome::Committed, 2, None);
    assert_eq!(*calls.lock().unwrap(), 2);
}

/// A 200 response with real headers whose body is `data` frames, then `trailers`.
fn headers_then(
    data: &[&'static [u8]],
    trailers: &[(&'static str, &'static str)],
) -> http::Response<Body> {
    struct Frames(VecDeque<http_body::Frame<Bytes>>);
    impl http_body::Body for Frames {
        type Data = Bytes;
        type Error = std::convert::Infallible;
        fn poll_frame(
            mut self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
            std::task::Poll::Ready(self.0.pop_front().map(Ok))
        }
    }
    let mut frames: VecDeque<_> = data
        .iter()
        .map(|d| http_body::Frame::data(Bytes::from_static(d)))
        .collect();
    let mut t = HeaderMap::new();
    for (k, v) in trailers {
        t.append(*k, v.parse().unwrap());
    }
    frames.push_back(http_body::Frame::trailers(t));
    http::Response::builder()
        .header("content-type", "application/grpc")
        .body(Body::new(Frames(frames)))
        .unwrap()
}

fn scripted_responses(responses: Vec<http::Response<Body>>) -> (Arc<Mutex<u32>>, Inner) {
    let queue = Arc::new(Mutex::new(VecDeque::from(responses)));
    let calls = Arc::new(Mutex::new(0u32));
    let counter = calls.clone();
    let svc = tower::service_fn(move |_req: http::Request<Body>| {
        let queue = queue.clone();
        let counter = counter.clone();
        async move {
            *counter.lock().unwrap() += 1;
            let next = queue.lock().unwrap().pop_front();
            Ok::<_, BoxError>(next.unwrap_or_else(|| http::Response::new(Body::empty())))
        }
    });
    (calls, Inner::new(svc))
}

#[tokio::test(start_paused = true)]
async fn headers_then_error_is_retried_only_with_the_opt_in() {
    let failing = || {
        headers_then(
            &[],
            &[
                ("grpc-status", "14"),
                ("grpc-message", "down"),
                ("grpc-retry-pushback-ms", "70"),
            ],
        )
    };
    // Default: committed, passed through with its trailers intact.
    let (calls, svc) = scripted_responses(vec![failing()]);
    let layer = builder().build().unwrap();
    let resp = send(&mut layer.layer(svc), request(PATH)).await.unwrap();
    assert_eq!(report(&resp).outcome, CallOutcome::Committed);
    assert_eq!(*calls.lock().unwrap(), 1);
    let trailers = resp
        .into_body()
        .collect()
        .await
        .unwrap()
        .trailers()
        .cloned()
        .unwrap();
    assert_eq!(trailers["grpc-status"], "14");

    // Opt-in: reshaped as Trailers-Only, retried (after the pushback it carried).
    let (calls, svc) = scripted_responses(vec![
        failing(),
        headers_then(&[b"\0\0\0\0\0"], &[("grpc-status", "0")]),
    ]);
    let layer = builder().retry_headers_then_error(true).build().unwrap();
    let start = Instant::now();
    let resp = send(&mut layer.layer(svc), request(PATH)).await.unwrap();
    assert_eq!(start.elapsed(), Duration::from_millis(70));
    assert_summary(&resp, CallOutcome::Committed, 2, None);
    assert_eq!(*calls.lock().unwrap(), 2);
    // The peeked message is put back in front of the rest.
    let collected = resp.into_body().collect().await.unwrap();
    assert_eq!(collected.trailers().unwrap()["grpc-status"], "0");
    assert_eq!(&collected.to_bytes()[..], b"\0\0\0\0\0");

    // Opt-in, every attempt fails that way: the caller gets a Trailers-Only error.
    let (_, svc) = scripted_responses(vec![failing(), failing(), failing()]);
    let resp = send(&mut layer.layer(svc), request(PATH)).await.unwrap();
    let status = status_of(&resp);
    assert_status(&status, tonic::Code::Unavailable, "down");
    assert_eq!(
        CallReport::from_status(&status).unwrap().outcome,
        CallOutcome::AttemptsExhausted
    );
}

#[tokio::test(start_paused = true)]
async fn a_message_then_an_error_is_never_retried() {
    let (calls, svc) = scripted_responses(vec![headers_then(
        &[b"\0\0\0\0\0"],
        &[("grpc-status", "14")],
    )]);
    let layer = builder().retry_headers_then_error(true).build().unwrap();
    let resp = send(&mut layer.layer(svc), request(PATH)).await.unwrap();
    assert_eq!(report(&resp).outcome, CallOutcome::Committed);
    assert_eq!(*calls.lock().unwrap(), 1);
    let collected = resp.into_body().collect().await.unwrap();
    assert_eq!(collected.trailers().unwrap()["grpc-status"], "14");
    assert_eq!(&collected.to_bytes()[..], b"\0\0\0\0\0");
}

/// Real headers at once; `after` them, one empty message (or, with `error`, these
/// error trailers and no message) then OK trailers.
pub(crate) fn late_first_frame(
    after: Duration,
    error: Option<&'static str>,
) -> http::Response<Body> {
    struct Late {
        sleep: std::pin::Pin<Box<tokio::time::Sleep>>,
        frames: VecDeque<http_body::Frame<Bytes>>,
    }
    impl http_body::Body for Late {
        type Data = Bytes;
        type Error = tonic::Status;
        fn poll_frame(
            mut self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
            std::task::ready!(self.sleep.as_mut().poll(cx));
            std::task::Poll::Ready(self.frames.pop_front().map(Ok))
        }
    }
    let trailers = |code: &'static str| {
        let mut t = HeaderMap::new();
        t.insert("grpc-status", code.parse().unwrap());
        http_body::Frame::trailers(t)
    };
    let frames = match error {
        Some(code) => VecDeque::from([trailers(code)]),
        None => VecDeque::from([
            http_body::Frame::data(Bytes::from_static(b"\0\0\0\0\0")),
            trailers("0"),
        ]),
    };
    let sleep = Box::pin(tokio::time::sleep(after));
    http::Response::builder()
        .header("content-type", "application/grpc")
        .body(Body::new(Late { sleep, frames }))
        .unwrap()
}

/// Issue 30, item 8: with the opt-in peek and `perAttemptRecvTimeout`, response headers
/// that came at once and a first message that comes later: the headers committed the
/// call, so the receive timeout ends the peek (the response goes on) and never retries
/// it. It was retried (3 handler runs), and the caller got CANCELLED with a report of
/// "no response headers".
#[tokio::test(start_paused = true)]
async fn a_receive_timeout_after_the_headers_never_retries_a_peeked_call() {
    let (calls, svc) = scripted_responses(
        (0..3)
            .map(|_| late_first_frame(Duration::from_secs(1), None))
            .collect(),
    );
    let layer = builder()
        .retry_headers_then_error(true)
        .per_attempt_recv_timeout(Duration::from_millis(200))
        .build()
        .unwrap();
    let start = Instant::now();
    let resp = send(&mut layer.layer(svc), request(PATH)).await.unwrap();
    // The peek gave up at the receive timeout; the headers go on, committed.
    assert_eq!(start.elapsed(), Duration::from_millis(200));
    assert_summary(&resp, CallOutcome::Committed, 1, None);
    // The report says when the headers came.
    let first = *report(&resp).history().next().unwrap();
    assert_eq!(
        (first.end, first.took),
        (AttemptEnd::Committed, Duration::ZERO)
    );
    let collected = resp.into_body().collect().await.unwrap();
    assert_eq!(start.elapsed(), Duration::from_secs(1));
    assert_eq!(collected.trailers().unwrap()["grpc-status"], "0");
    assert_eq!(&collected.to_bytes()[..], b"\0\0\0\0\0");
    assert_eq!(*calls.lock().unwrap(), 1);
    assert_eq!(layer.stats().snapshot().retries, 0);
}

#[tokio::test(start_paused = true)]
async fn keys_are_sensitive_and_the_same_on_every_attempt() {
    // Generated key.
    let script = Script::new([unavailable(), Step::Ok]);
    let layer = builder().key_all_methods(true).build().unwrap();
    let resp = run(&layer, &script, request(PATH)).await;
    assert_eq!(report(&resp).attempts, 2);
    let seen = script.seen();
    let keys: Vec<_> = seen
        .iter()
        .map(|s| s.headers["x-idempotency-key"].clone())
        .collect();
    assert_eq!(keys[0], keys[1]);
    assert_eq!(keys[0].len(), 32);
    assert!(keys.iter().all(http::HeaderValue::is_sensitive));

    // A caller's key is kept, and marked sensitive too.
    let script = Script::new([unavailable(), Step::Ok]);
    let req = with_header(PATH, "x-idempotency-key", "caller-key-7");
    run(&layer, &script, req).await;
    for s in script.seen() {
        let v = &s.headers["x-idempotency-key"];
        assert_eq!(v, "caller-key-7");
        assert!(v.is_sensitive());
    }
}

/// Sends `request` through a tonic unary client over `svc`, as a generated client would
/// (the message is `()`: an empty protobuf).
async fn tonic_unary<S>(
    svc: S,
    request: tonic::Request<()>,
) -> Result<tonic::Response<()>, tonic::Status>
where
    S: tonic::client::GrpcService<Body>,
    S::Error: Into<BoxError>,
    S::ResponseBody: http_body::Body<Data = Bytes> + Send + 'static,
    <S::ResponseBody as http_body::Body>::Error: Into<BoxError> + Send,
{
    let mut grpc = tonic::client::Grpc::new(svc);
    grpc.ready()
        .await
        .map_err(|e| tonic::Status::unknown(e.into().to_string()))?;
    let path = http::uri::PathAndQuery::from_static(PATH);
    grpc.unary(request, path, tonic_prost::ProstCodec::<(), ()>::default())
        .await
}

#[tokio::test(start_paused = true)]
async fn a_callers_key_goes_under_the_configured_header_on_every_attempt() {
    use crate::RequestKeyExt;
    let cfg = ServiceConfig::from_json(
        r#"{
          "methodConfig": [{
            "name": [{"service": "shop.v1.Orders"}],
            "retryPolicy": {"maxAttempts": 3, "initialBackoff": "0.01s", "maxBackoff": "0.01s",
                            "backoffMultiplier": 1, "retryableStatusCodes": ["UNAVAILABLE"]},
            "idempotency": {}
          }],
          "idem": {"keyHeader": "idempotency-key"}
        }"#,
    )
    .unwrap();
    let layer = RetryLayer::from_config(&cfg);
    let key: idem_core::key::IdempotencyKey = "intent-0001-abcdef".parse().unwrap();
    let script = Script::new([unavailable(), Step::Ok, unavailable(), Step::Ok]);
    for _ in 0..2 {
        let req = tonic::Request::new(()).with_idempotency_key(&key);
        // The scripted OK has no trailers: tonic calls it an error; only the headers sent
        // matter here.
        let _ = tonic_unary(layer.layer(script.service()), req).await;
    }
    let seen = script.seen();
    assert_eq!(seen.len(), 4, "two calls, two attempts each");
    for s in &seen {
        assert_eq!(s.headers["idempotency-key"], "intent-0001-abcdef");
        assert!(s.headers["idempotency-key"].is_sensitive());
        assert!(!s.headers.contains_key("x-idempotency-key"));
    }

    // A key written by hand under the default name is moved, not replaced.
    let script = Script::new([unavailable(), Step::Ok]);
    let req = with_header(PATH, "x-idempotency-key", "by-hand-key-42");
    run(&layer, &script, req).await;
    for s in script.seen() {
        assert_eq!(s.headers["idempotency-key"], "by-hand-key-42");
        assert!(!s.headers.contains_key("x-idempotency-key"));
    }
}

/// Real headers, one message, then nothing for ever (a stalled server stream).
struct StalledBody(bool);

impl http_body::Body for StalledBody {
    type Data = Bytes;
    type Error = tonic::Status;
    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, tonic::Status>>> {
        if std::mem::take(&mut self.0) {
            let message = Bytes::from_static(b"\0\0\0\0\0");
            return std::task::Poll::Ready(Some(Ok(http_body::Frame::data(message))));
        }
        std::task::Poll::Pending
    }
}

fn with_timeout(path: &str, grpc_timeout: &'static str) -> http::Request<Body> {
    with_header(path, "grpc-timeout", grpc_timeout)
}

fn no_policy() -> RetryLayer {
    let cfg = ServiceConfig::from_parts(Vec::new(), None, IdemSettings::default()).unwrap();
    RetryLayer::from_config(&cfg)
}

#[tokio::test(start_paused = true)]
async fn a_server_cannot_park_a_call_without_a_deadline() {
    use tonic_types::{ErrorDetails, StatusExt};
    // 25 hours of pushback, then ten years of RetryInfo: both over the 30 s default.
    let decade = Duration::from_secs(10 * 365 * 24 * 3600);
    let info = tonic::Status::with_error_details(
        tonic::Code::Unavailable,
        "come back later",
        ErrorDetails::with_retry_info(Some(decade)),
    );
    for step in [with_pushback("90000000"), Step::Status(info)] {
        let script = Script::new([step, Step::Ok]);
        let layer = builder().build().unwrap();
        let start = Instant::now();
        let resp = run(&layer, &script, request(PATH)).await;
        assert_eq!(start.elapsed(), Duration::ZERO);
        assert_summary(&resp, CallOutcome::PushbackStop, 1, Some(Code::Unavailable));
    }
    // Within a raised cap, the server's wait is honoured exactly.
    let script = Script::new([with_pushback("90000"), Step::Ok]);
    let layer = builder()
        .max_retry_delay(Duration::from_secs(120))
        .build()
        .unwrap();
    let resp = run(&layer, &script, request(PATH)).await;
    assert_eq!(report(&resp).outcome, CallOutcome::Committed);
    assert_eq!(script.gaps(), [Duration::from_secs(90)]);
}

#[tokio::test(start_paused = true)]
async fn the_deadline_bounds_a_stalled_response_body() {
    for layer in [builder().build().unwrap(), no_policy()] {
        let script = Script::new([Step::Stall]);
        let start = Instant::now();
        let resp = run(&layer, &script, with_timeout(PATH, "1S")).await;
        let mut body = resp.into_body();
        assert!(body.frame().await.unwrap().unwrap().is_data());
        let trailers = next_trailers(&mut body).await;
        assert_eq!(start.elapsed(), Duration::from_secs(1));
        let status = tonic::Status::from_header_map(&trailers).unwrap();
        assert_eq!(deadline_report(&status).attempts, 1);
        assert!(body.frame().await.is_none());
    }
}

#[tokio::test(start_paused = true)]
async fn a_channel_timeout_at_the_deadline_is_deadline_exceeded_with_a_report() {
    for layer in [builder().build().unwrap(), no_policy()] {
        let script = Script::new([Step::TimeoutExpired]);
        let start = Instant::now();
        let resp = run(&layer, &script, with_timeout(PATH, "100m")).await;
        assert_eq!(start.elapsed(), Duration::from_millis(100));
        let status = status_of(&resp);
        let r = deadline_report(&status);
        assert_eq!(ends(&r), [AttemptEnd::Deadline]);
    }
}

#[tokio::test(start_paused = true)]
async fn a_tonic_deadline_comes_back_as_deadline_exceeded() {
    // `Request::set_timeout` becomes `grpc-timeout`; the script hangs past it.
    let layer = builder().build().unwrap();
    let script = Script::new([Step::Hang]);
    let mut req = tonic::Request::new(());
    req.set_timeout(Duration::from_secs(1));
    let status = tonic_unary(layer.layer(script.service()), req)
        .await
        .unwrap_err();
    assert_eq!(deadline_report(&status).attempts, 1);
}

#[tokio::test]
#[should_panic(expected = "polled after completion")]
async fn a_finished_response_future_panics_when_polled_again() {
    let inner = tower::service_fn(|_req: http::Request<Body>| async {
        Ok::<_, BoxError>(http::Response::new(Body::empty()))
    });
    let mut svc = no_policy().layer(inner);
    let ready = ServiceExt::<http::Request<Body>>::ready(&mut svc)
        .await
        .unwrap();
    let mut fut = std::pin::pin!(ready.call(request(PATH)));
    let _ = (&mut fut).await;
    let _ = std::future::poll_fn(|cx| {
        std::task::Poll::Ready(std::future::Future::poll(fut.as_mut(), cx))
    })
    .await;
}

// ---------------------------------------------------------------- waitForReady

fn throttled_builder() -> RetryLayerBuilder {
    builder().retry_throttling(RetryThrottling {
        max_milli_tokens: 10_000,
        token_ratio_milli: 100,
    })
}

#[tokio::test(start_paused = true)]
async fn wait_for_ready_sends_again_without_using_attempts_or_tokens() {
    let script = Script::new([
        Step::NotConnected,
        Step::NotConnected,
        Step::NotConnected,
        unavailable(),
        Step::Ok,
    ]);
    let layer = throttled_builder()
        .max_attempts(2)
        .wait_for_ready(true)
        .build()
        .unwrap();
    let resp = run(&layer, &script, request(PATH)).await;
    assert_summary(&resp, CallOutcome::Committed, 2, None);
    let r = report(&resp);
    assert_eq!(
        ends(&r),
        [AttemptEnd::Status(Code::Unavailable), AttemptEnd::Committed]
    );
    // The waits: 100, 160, 256 ms (jitter at its midpoint), then the policy's 20 ms.
    let ms = |n| Duration::from_millis(n);
    assert_eq!(script.gaps(), [ms(100), ms(160), ms(256), ms(20)]);
    let seen = script.seen();
    assert!(seen.iter().all(|s| &s.body[..] == b"\0\0\0\0\x02hi"));
    let previous: Vec<_> = seen
        .iter()
        .map(|s| s.headers.get("grpc-previous-rpc-attempts").cloned())
        .collect();
    assert_eq!(previous[..4], [None, None, None, None]);
    assert_eq!(previous[4].as_ref().unwrap(), "1");
    // One token for the one UNAVAILABLE, a tenth back for the success.
    assert_eq!(layer.throttle().unwrap().milli_tokens(), 9_100);
    let stats = layer.stats().snapshot();
    assert_eq!((stats.attempts, stats.retries), (2, 1));
}

#[tokio::test(start_paused = true)]
async fn without_wait_for_ready_a_connect_failure_is_an_attempt() {
    let script = Script::new([Step::NotConnected, Step::NotConnected, Step::Ok]);
    let layer = builder().max_attempts(2).build().unwrap();
    let resp = run(&layer, &script, request(PATH)).await;
    assert_summary(
        &resp,
        CallOutcome::AttemptsExhausted,
        2,
        Some(Code::Unavailable),
    );
}

#[tokio::test(start_paused = true)]
async fn wait_for_ready_waits_until_the_deadline_and_ends_with_deadline_exceeded() {
    let script = Script::new(std::iter::repeat_n(Step::NotConnected, 100));
    let layer = builder().wait_for_ready(true).build().unwrap();
    let start = Instant::now();
    let resp = run(&layer, &script, with_timeout(PATH, "1S")).await;
    assert_eq!(start.elapsed(), Duration::from_secs(1));
    let why = "deadline exceeded while waiting for the channel to become ready";
    assert_unsent(&resp, (Code::DeadlineExceeded, why), CallOutcome::Deadline);
}

#[tokio::test(start_paused = true)]
async fn wait_for_ready_without_a_deadline_gives_up_after_its_limit() {
    let script = Script::new(std::iter::repeat_n(Step::NotConnected, 100));
    let layer = builder()
        .wait_for_ready(true)
        .wait_for_ready_limit(Duration::from_secs(5))
        .build()
        .unwrap();
    let start = Instant::now();
    let resp = run(&layer, &script, request(PATH)).await;
    assert_eq!(start.elapsed(), Duration::from_secs(5));
    let status = status_of(&resp);
    assert_status(
        &status,
        tonic::Code::Unavailable,
        "the channel did not become ready within 5s (waitForReady): tcp connect error: \
         Connection refused",
    );
    let r = CallReport::from_status(&status).unwrap();
    assert_eq!((r.outcome, r.attempts), (CallOutcome::NotReady, 0));
    assert!(r.outcome.retries_gave_up());
}

#[tokio::test(start_paused = true)]
async fn wait_for_ready_applies_to_methods_without_a_retry_policy() {
    let cfg = ServiceConfig::from_json(
        r#"{"methodConfig": [{"name": [{"service": "shop.v1.Orders"}], "waitForReady": true}]}"#,
    )
    .unwrap();
    let script = Script::new([Step::NotConnected, Step::NotConnected, unavailable()]);
    let layer = RetryLayer::from_config(&cfg);
    let resp = run(&layer, &script, request(PATH)).await;
    // Sent once it connected; its UNAVAILABLE is not retried (no retry policy).
    assert_summary(
        &resp,
        CallOutcome::NoRetryPolicy,
        1,
        Some(Code::Unavailable),
    );
    assert_eq!(script.seen().len(), 3);
}

// ---------------------------------------------------------------- message limits

#[tokio::test(start_paused = true)]
async fn a_request_message_over_the_limit_fails_before_anything_is_sent() {
    let script = Script::new([Step::Ok]);
    let layer = builder().max_request_message_bytes(1).build().unwrap();
    let resp = run(&layer, &script, request(PATH)).await;
    let why = "request message of 2 bytes is over maxRequestMessageBytes (1)";
    assert_unsent(
        &resp,
        (Code::ResourceExhausted, why),
        CallOutcome::MessageTooLarge,
    );
    assert!(script.seen().is_empty());
    // At the limit it goes.
    let layer = builder().max_request_message_bytes(2).build().unwrap();
    let resp = run(&layer, &script, request(PATH)).await;
    assert_eq!(report(&resp).outcome, CallOutcome::Committed);
}

#[tokio::test(start_paused = true)]
async fn without_a_retry_policy_the_request_limit_is_checked_as_the_body_streams() {
    let cfg = ServiceConfig::from_json(
        r#"{"methodConfig": [{"name": [{"service": "shop.v1.Orders"}], "maxRequestMessageBytes": 1}]}"#,
    )
    .unwrap();
    let script = Script::new([Step::Ok]);
    let layer = RetryLayer::from_config(&cfg);
    let resp = run(&layer, &script, request(PATH)).await;
    let status = status_of(&resp);
    assert_eq!(status.code(), tonic::Code::ResourceExhausted);
    assert_eq!(report(&resp).outcome, CallOutcome::MessageTooLarge);
    // The server saw the stream fail, not the message.
    assert!(script.seen()[0].body.is_empty());
}

#[tokio::test(start_paused = true)]
async fn a_response_message_over_the_limit_ends_the_body_after_the_ones_before_it() {
    for layer in [
        builder().max_response_message_bytes(3).build().unwrap(),
        RetryLayer::from_config(
            &ServiceConfig::from_json(
                r#"{"methodConfig": [{"name": [{}], "maxResponseMessageBytes": 3}]}"#,
            )
            .unwrap(),
        ),
    ] {
        // Two small messages and the start of a large one's header in one chunk, the rest
        // in the next: the small ones arrive, then RESOURCE_EXHAUSTED, and nothing of the
        // large one but the header bytes that came before its length was known (tonic,
        // like any gRPC client, takes the status from the trailers).
        let (_, svc) = scripted_responses(vec![headers_then(
            &[b"\0\0\0\0\x01a\0\0\0\0\x03abc\0\0\0", b"\0\x04abcd"],
            &[("grpc-status", "0")],
        )]);
        let resp = send(&mut layer.layer(svc), request(PATH)).await.unwrap();
        let collected = resp.into_body().collect().await.unwrap();
        let trailers = collected.trailers().cloned().unwrap();
        assert_eq!(
            &collected.to_bytes()[..],
            b"\0\0\0\0\x01a\0\0\0\0\x03abc\0\0\0"
        );
        let status = tonic::Status::from_header_map(&trailers).unwrap();
        assert_status(
            &status,
            tonic::Code::ResourceExhausted,
            "response message of 4 bytes is over maxResponseMessageBytes (3)",
        );
        let r = CallReport::from_status(&status).unwrap();
        assert_eq!((r.outcome, r.attempts), (CallOutcome::MessageTooLarge, 1));
    }
}

#[tokio::test(start_paused = true)]
async fn a_throttled_call_says_why() {
    let bucket = RetryThrottle::new(RetryThrottling {
        max_milli_tokens: 2_000,
        token_ratio_milli: 1_000,
    });
    let layer = builder().throttle(bucket).build().unwrap();
    let script = Script::new([unavailable()]);
    let resp = run(&layer, &script, request(PATH)).await;
    assert_eq!(
        report(&resp).to_string(),
        "gave up: retries throttled after 1 attempt: UNAVAILABLE in 0ns (retry throttle: the \
         token bucket is at or below half; failures elsewhere on this channel spend tokens)"
    );
}

/// A service that counts its clones; clone number `panic_at` (counted from 1), if any,
/// panics.
struct Counted {
    inner: Inner,
    clones: Arc<std::sync::atomic::AtomicUsize>,
    panic_at: Option<usize>,
}

impl Clone for Counted {
    fn clone(&self) -> Self {
        let n = self
            .clones
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            + 1;
        assert_ne!(Some(n), self.panic_at, "this clone panics");
        Counted {
            inner: self.inner.clone(),
            clones: self.clones.clone(),
            panic_at: self.panic_at,
        }
    }
}

impl Service<http::Request<Body>> for Counted {
    type Response = http::Response<Body>;
    type Error = BoxError;
    type Future = <Inner as Service<http::Request<Body>>>::Future;
    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx)
    }
    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        self.inner.call(req)
    }
}

#[tokio::test(start_paused = true)]
async fn first_attempts_go_out_on_the_ready_service_and_retries_on_one_shared_clone() {
    let script = Script::new([]);
    let clones = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = || clones.load(std::sync::atomic::Ordering::Relaxed);
    let layer = builder().max_attempts(3).build().unwrap();
    let svc = layer.layer(Counted {
        inner: script.service(),
        clones: clones.clone(),
        panic_at: None,
    });
    // A client per call, as tonic users clone theirs: the layer adds one clone (the
    // spare, shared by every clone of the service), not one per call.
    for _ in 0..10 {
        let resp = send(&mut svc.clone(), request(PATH)).await.unwrap();
        assert_summary(&resp, CallOutcome::Committed, 1, None);
    }
    assert_eq!(counted(), 10 + 1);
    // A retry goes out on a clone of the spare, polled ready first.
    script.steps.lock().unwrap().push_back(unavailable());
    let resp = send(&mut svc.clone(), request(PATH)).await.unwrap();
    assert_summary(&resp, CallOutcome::Committed, 2, None);
    assert_eq!(counted(), 10 + 1 + 1 + 1);
    assert_eq!(script.seen().len(), 12);
}

/// A service replaced through `get_mut` takes the retries too, not only first attempts:
/// the spare cloned from the old one is dropped with it.
#[tokio::test(start_paused = true)]
async fn retries_go_to_the_inner_service_that_get_mut_put_in() {
    let old = Script::new([unavailable()]);
    let layer = builder().max_attempts(3).build().unwrap();
    let mut svc = layer.layer(old.service());
    let resp = send(&mut svc, request(PATH)).await.unwrap();
    assert_summary(&resp, CallOutcome::Committed, 2, None);
    assert_eq!(old.seen().len(), 2);

    let new = Script::new([unavailable()]);
    *svc.get_mut() = new.service();
    let resp = send(&mut svc, request(PATH)).await.unwrap();
    assert_summary(&resp, CallOutcome::Committed, 2, None);
    assert_eq!(new.seen().len(), 2, "first attempt and retry");
    assert_eq!(old.seen().len(), 2, "nothing more to the old service");
}

#[tokio::test(start_paused = true)]
async fn the_report_reuses_the_request_extensions_map_without_its_entries() {
    #[derive(Clone, Debug, PartialEq)]
    struct FromTheRequest(u8);
    let script = Script::new([unavailable()]);
    let layer = builder().max_attempts(3).build().unwrap();
    let mut req = request(PATH);
    req.extensions_mut().insert(FromTheRequest(7));
    let resp = run(&layer, &script, req).await;
    assert_summary(&resp, CallOutcome::Committed, 2, None);
    assert_eq!(resp.extensions().get::<FromTheRequest>(), None);
    assert_eq!(resp.extensions().len(), 1, "the report alone");
}

#[tokio::test(start_paused = true)]
async fn a_retry_whose_service_clone_panics_fails_that_call_only() {
    // Clone 1 is the test's copy of the layer's service, clone 2 the spare (made at the
    // first retrying call), clone 3 the first retry's copy of the spare: that one
    // panics, under the spare's lock.
    let script = Script::new([unavailable(), unavailable()]);
    let layer = builder().max_attempts(3).build().unwrap();
    let mut svc = layer.layer(Counted {
        inner: script.service(),
        clones: Arc::default(),
        panic_at: Some(3),
    });
    let mut first = svc.clone();
    let call = tokio::spawn(async move { send(&mut first, request(PATH)).await });
    let panicked = call.await.expect_err("the retry's clone panicked");
    assert!(panicked.is_panic());
    // The spare's lock was poisoned by the panic: the next retry still gets its clone.
    let resp = send(&mut svc, request(PATH)).await.unwrap();
    assert_summary(&resp, CallOutcome::Committed, 2, None);
    assert_eq!(script.seen().len(), 3);
}

/// The future lives inline in tonic's and the caller's futures and is copied with them
/// at every move: the retrying call's state (about 870 bytes) is boxed, not held in it.
#[test]
fn the_response_future_over_a_channel_stays_small() {
    let size =
        std::mem::size_of::<crate::retry::future::ResponseFuture<tonic::transport::Channel>>();
    assert!(size <= 512, "ResponseFuture<Channel> is {size} bytes");
}
