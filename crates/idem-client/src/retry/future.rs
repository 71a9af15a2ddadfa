//! [`ResponseFuture`] and the retry loop it runs.
//!
//! Calls of methods without a retry policy use a hand-written pass-through state (no
//! allocation). Calls that may retry run an `async` loop in a box: it must await the
//! request body, the inner service's readiness for each retry, backoff sleeps and
//! per-attempt timers, and a retrying call allocates its replay buffer anyway, so one more
//! allocation buys a loop that reads like A6's prose instead of a six-state machine.

use std::future::{Future, poll_fn};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::request::Parts;
use http::{HeaderName, HeaderValue};
use idem_core::config::RetryPolicy;
use idem_core::deadline::{ExhaustedMarker, earliest, encode_grpc_timeout};
use idem_core::headers::{DOWNSTREAM_EXHAUSTED, GRPC_TIMEOUT, PREVIOUS_RPC_ATTEMPTS};
use pin_project_lite::pin_project;
use tokio::time::Instant;
use tonic::Code;
use tower_service::Service;
use tracing::Instrument;

use super::backoff;
use super::body::{self, Buffered, Lease, Overflow};
use super::layer::{Effective, Shared};
use super::outcome::{CallOutcome, CallReport};
use super::pushback::{Pushback, pushback, retry_info_delay};
use crate::BoxError;

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// What the layer answers: the inner service's response with its body as a
/// [`tonic::body::Body`] (no extra box when it already is one, as with a `Channel`).
pub(crate) type Resp = http::Response<tonic::body::Body>;

pin_project! {
    /// The response future of [`Retry`](super::Retry).
    pub struct ResponseFuture<F, E> {
        #[pin]
        kind: Kind<F, E>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<F, E> {
        Passthrough {
            #[pin]
            fut: F,
            shared: Arc<Shared>,
            path: CallPath,
            span: tracing::Span,
        },
        Retrying {
            fut: BoxFuture<Result<Resp, E>>,
        },
        Ready {
            response: Option<Resp>,
        },
    }
}

impl<F, E> std::fmt::Debug for ResponseFuture<F, E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self.kind {
            Kind::Passthrough { .. } => "Passthrough",
            Kind::Retrying { .. } => "Retrying",
            Kind::Ready { .. } => "Ready",
        };
        f.debug_struct("ResponseFuture")
            .field("kind", &kind)
            .finish()
    }
}

impl<F, E> ResponseFuture<F, E> {
    pub(crate) fn passthrough(
        fut: F,
        shared: Arc<Shared>,
        path: CallPath,
        span: tracing::Span,
    ) -> Self {
        ResponseFuture {
            kind: Kind::Passthrough {
                fut,
                shared,
                path,
                span,
            },
        }
    }

    pub(crate) fn ready(response: Resp) -> Self {
        ResponseFuture {
            kind: Kind::Ready {
                response: Some(response),
            },
        }
    }

    pub(crate) fn retrying<S, B, RB>(
        svc: S,
        parts: Parts,
        body: B,
        call: Call,
        span: tracing::Span,
    ) -> Self
    where
        S: Service<
                http::Request<tonic::body::Body>,
                Response = http::Response<RB>,
                Future = F,
                Error = E,
            > + Send
            + 'static,
        F: Send + 'static,
        E: Into<BoxError> + Send + 'static,
        B: http_body::Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
        RB: http_body::Body<Data = Bytes> + Send + 'static,
        RB::Error: Into<BoxError>,
    {
        ResponseFuture {
            kind: Kind::Retrying {
                fut: Box::pin(run(svc, parts, body, call).instrument(span)),
            },
        }
    }
}

impl<F, RB, E> Future for ResponseFuture<F, E>
where
    F: Future<Output = Result<http::Response<RB>, E>>,
    RB: http_body::Body<Data = Bytes> + Send + 'static,
    RB::Error: Into<BoxError>,
{
    type Output = Result<Resp, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().kind.project() {
            KindProj::Passthrough {
                fut,
                shared,
                path,
                span,
            } => {
                let _enter = span.enter();
                let result = std::task::ready!(fut.poll(cx));
                let throttle = shared.throttle();
                let (result, code) = match result {
                    Ok(resp) => {
                        let resp = resp.map(tonic::body::Body::new);
                        let code = early_code(&resp);
                        if matches!(code, None | Some(Code::Ok))
                            && let Some(t) = &throttle
                        {
                            t.record_success();
                        }
                        (Ok(resp), code)
                    }
                    Err(e) => (Err(e), None),
                };
                let report = CallReport {
                    outcome: CallOutcome::NoRetryPolicy,
                    attempts: 1,
                    last_code: code,
                };
                Poll::Ready(conclude(shared, path.as_str(), result, report, None))
            }
            KindProj::Retrying { fut } => fut.as_mut().poll(cx),
            KindProj::Ready { response } => match response.take() {
                Some(r) => Poll::Ready(Ok(r)),
                None => Poll::Pending,
            },
        }
    }
}

/// A call's method path, kept without copying: a `PathAndQuery` is `Bytes` inside
/// (static for generated tonic clients), so cloning it out of the request is free.
#[derive(Debug, Clone)]
pub(crate) struct CallPath(Option<http::uri::PathAndQuery>);

impl CallPath {
    pub(crate) fn of(uri: &http::Uri) -> Self {
        CallPath(uri.path_and_query().cloned())
    }
    pub(crate) fn as_str(&self) -> &str {
        self.0.as_ref().map_or("", http::uri::PathAndQuery::path)
    }
}

impl std::fmt::Display for CallPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What one retrying call needs.
pub(crate) struct Call {
    pub(crate) shared: Arc<Shared>,
    pub(crate) eff: Arc<Effective>,
    pub(crate) policy: RetryPolicy,
    pub(crate) deadline: Option<Instant>,
    pub(crate) path: CallPath,
    /// The inbound call's marker, when this call is made while serving one.
    pub(crate) marker: Option<ExhaustedMarker>,
}

/// The status of an attempt that ended before the call committed: a Trailers-Only
/// response (`grpc-status` among the headers; an unparseable value is UNKNOWN), or a
/// non-200 HTTP response without `grpc-status` (a proxy's 503…), mapped as gRPC's
/// `http-grpc-status-mapping.md` says. `None` for a 200 response with real headers: the
/// call is committed.
pub(crate) fn early_code<RB>(resp: &http::Response<RB>) -> Option<Code> {
    if let Some(v) = resp.headers().get("grpc-status") {
        let code = std::str::from_utf8(v.as_bytes())
            .ok()
            .and_then(|s| s.parse::<i32>().ok())
            .map(Code::from_i32)
            .unwrap_or(Code::Unknown);
        return Some(code);
    }
    match resp.status().as_u16() {
        200 => None,
        400 => Some(Code::Internal),
        401 => Some(Code::Unauthenticated),
        403 => Some(Code::PermissionDenied),
        404 => Some(Code::Unimplemented),
        429 | 502 | 503 | 504 => Some(Code::Unavailable),
        _ => Some(Code::Unknown),
    }
}

/// A Trailers-Only response the layer makes up (deadline, receive timeout).
pub(crate) fn made_up(report: CallReport, message: &'static str) -> Resp {
    let code = report.last_code.unwrap_or(Code::Unknown);
    let mut resp: Resp = tonic::Status::new(code, message).into_http();
    resp.extensions_mut().insert(report);
    report.write_headers(resp.headers_mut());
    resp
}

/// Records `report` (counters, hook, span) and attaches it to the response. A give-up
/// failure made while serving an inbound call also gets that call's marker, so the server
/// layer answers upstream with `grpc-retry-pushback-ms: -1` (retry at one layer only).
fn conclude<E>(
    shared: &Shared,
    path: &str,
    result: Result<Resp, E>,
    report: CallReport,
    marker: Option<ExhaustedMarker>,
) -> Result<Resp, E> {
    shared.report(path, &report);
    // The `idem_retry` span is a `debug` span: skip the lookup when nothing listens.
    if tracing::level_enabled!(tracing::Level::DEBUG) {
        let span = tracing::Span::current();
        span.record("attempts", report.attempts);
        span.record("outcome", report.outcome.as_str());
    }
    result.map(|mut resp| {
        if matches!(report.last_code, Some(c) if c != Code::Ok) {
            report.write_headers(resp.headers_mut());
            if let Some(m) = marker.filter(|_| report.outcome.retries_gave_up()) {
                resp.headers_mut()
                    .insert(DOWNSTREAM_EXHAUSTED, m.to_header_value());
            }
        }
        resp.extensions_mut().insert(report);
        resp
    })
}

/// How one attempt ended.
enum Attempt<E> {
    Response(Resp),
    Error(E),
    /// `perAttemptRecvTimeout` passed before response headers.
    RecvTimeout,
    /// The call's deadline passed before response headers.
    Deadline,
}

/// Awaits one attempt's response headers (and, with `peek`, its first body frame), cut
/// short by the deadline or the receive timeout.
async fn attempt<F, RB, E>(
    fut: F,
    deadline: Option<Instant>,
    recv_timeout: Option<Instant>,
    peek: bool,
) -> Attempt<E>
where
    F: Future<Output = Result<http::Response<RB>, E>>,
    RB: http_body::Body<Data = Bytes> + Send + 'static,
    RB::Error: Into<BoxError>,
{
    let response = async {
        let resp = fut.await?.map(tonic::body::Body::new);
        if peek && early_code(&resp).is_none() {
            Ok(body::peek_early_trailers(resp).await)
        } else {
            Ok(resp)
        }
    };
    let result = match earliest([deadline, recv_timeout]) {
        None => response.await,
        Some(at) => match tokio::time::timeout_at(at, response).await {
            Ok(r) => r,
            Err(_) if deadline == Some(at) => return Attempt::Deadline,
            Err(_) => return Attempt::RecvTimeout,
        },
    };
    match result {
        Ok(r) => Attempt::Response(r),
        Err(e) => Attempt::Error(e),
    }
}

fn request(
    parts: &Parts,
    body: tonic::body::Body,
    attempts: u32,
    deadline: Option<Instant>,
) -> http::Request<tonic::body::Body> {
    let mut req = http::Request::from_parts(parts.clone(), body);
    let headers = req.headers_mut();
    const PREVIOUS: HeaderName = HeaderName::from_static(PREVIOUS_RPC_ATTEMPTS);
    let previous = PREVIOUS;
    if attempts > 1 {
        headers.insert(previous, HeaderValue::from(attempts - 1));
    } else {
        headers.remove(previous);
    }
    if let Some(d) = deadline {
        let left = d.saturating_duration_since(Instant::now());
        headers.insert(GRPC_TIMEOUT, encode_grpc_timeout(left));
    }
    req
}

/// The request body each attempt sends.
enum Source {
    /// Buffered: every attempt gets a copy.
    Replay(body::Replay),
    /// Did not fit: sent once, and the call reports `outcome` if it would have retried.
    Once(Option<tonic::body::Body>, CallOutcome),
}

/// What the last attempt left, for the caller.
enum Last<E> {
    Response(Resp, Option<Code>),
    Error(E),
    MadeUp(Code, &'static str),
}

async fn run<S, B, RB>(mut svc: S, parts: Parts, body: B, call: Call) -> Result<Resp, S::Error>
where
    S: Service<http::Request<tonic::body::Body>, Response = http::Response<RB>>,
    S::Error: Into<BoxError>,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
    RB: http_body::Body<Data = Bytes> + Send + 'static,
    RB::Error: Into<BoxError>,
{
    let mut lease = Lease::new(call.shared.budget.clone());
    // A tonic client's body already is a `tonic::body::Body` (no new box; other bodies are
    // boxed once), which is `Unpin`: `buffer` reads it in place.
    let body = tonic::body::Body::new(body);
    let mut source = match body::buffer(body, call.eff.max_replay_bytes_per_call, &mut lease).await
    {
        Buffered::Complete(replay) => Source::Replay(replay),
        Buffered::Partial(partial, why) => {
            let outcome = match why {
                Overflow::PerCall => CallOutcome::BodyTooLarge,
                Overflow::Budget => CallOutcome::ReplayBudgetExhausted,
                Overflow::Error => CallOutcome::BodyError,
            };
            Source::Once(Some(tonic::body::Body::new(partial)), outcome)
        }
    };
    let throttle = call.shared.throttle();
    let policy = &call.policy;
    let mut attempts = 0u32;
    // Retries since the start or the last valid pushback: the backoff exponent.
    let mut exponent = 0u32;

    let finish = |last: Last<S::Error>, outcome: CallOutcome, attempts: u32| {
        let (result, code) = match last {
            Last::Response(r, code) => (Ok(r), code),
            // Giving up on transport errors while serving an inbound call: answer with an
            // UNAVAILABLE response instead of the error, so it can carry the marker (an
            // error never reaches the server side as a response it could tag).
            Last::Error(e) if call.marker.is_some() && outcome.retries_gave_up() => {
                let e: BoxError = e.into();
                let status = tonic::Status::unavailable(format!(
                    "downstream call failed on every attempt: {e}"
                ));
                (Ok(status.into_http()), Some(Code::Unavailable))
            }
            Last::Error(e) => (Err(e), None),
            Last::MadeUp(code, message) => (
                Ok(tonic::Status::new(code, message).into_http()),
                Some(code),
            ),
        };
        let report = CallReport {
            outcome,
            attempts,
            last_code: code,
        };
        conclude(
            &call.shared,
            call.path.as_str(),
            result,
            report,
            call.marker,
        )
    };

    loop {
        if call.deadline.is_some_and(|d| d <= Instant::now()) {
            return finish(
                Last::MadeUp(
                    Code::DeadlineExceeded,
                    "deadline exceeded before the attempt started",
                ),
                CallOutcome::Deadline,
                attempts,
            );
        }
        if attempts > 0
            && let Err(e) = poll_fn(|cx| svc.poll_ready(cx)).await
        {
            return finish(Last::Error(e), CallOutcome::ServiceError, attempts);
        }
        let body = match &mut source {
            Source::Replay(replay) => tonic::body::Body::new(replay.body()),
            Source::Once(body, _) => body.take().unwrap_or_default(),
        };
        attempts += 1;
        call.shared.stats.attempt(attempts == 1);
        let recv_timeout = policy
            .per_attempt_recv_timeout()
            .and_then(|t| Instant::now().checked_add(t));
        let req = request(&parts, body, attempts, call.deadline);
        let peek = call.shared.peek_early_trailers && matches!(source, Source::Replay(_));
        let result = attempt(svc.call(req), call.deadline, recv_timeout, peek).await;

        // Classify: done, or a failure that may be retried (with its code).
        let (last, code, timed_out) = match result {
            Attempt::Response(resp) => match early_code(&resp) {
                None => {
                    if let Some(t) = &throttle {
                        t.record_success();
                    }
                    return finish(Last::Response(resp, None), CallOutcome::Committed, attempts);
                }
                Some(Code::Ok) => {
                    if let Some(t) = &throttle {
                        t.record_success();
                    }
                    return finish(
                        Last::Response(resp, Some(Code::Ok)),
                        CallOutcome::Ok,
                        attempts,
                    );
                }
                Some(code) => (Last::Response(resp, Some(code)), code, false),
            },
            // A transport error: nothing came back, like UNAVAILABLE (tonic reports it so).
            Attempt::Error(e) => (Last::Error(e), Code::Unavailable, false),
            Attempt::RecvTimeout => (
                Last::MadeUp(Code::Cancelled, "perAttemptRecvTimeout exceeded"),
                Code::Cancelled,
                true,
            ),
            Attempt::Deadline => {
                return finish(
                    Last::MadeUp(Code::DeadlineExceeded, "deadline exceeded"),
                    CallOutcome::Deadline,
                    attempts,
                );
            }
        };

        // As C-core: a receive timeout is retried whatever the codes say.
        if !timed_out && !policy.retryable_status_codes().contains(code) {
            return finish(last, CallOutcome::NonRetryableCode, attempts);
        }
        if let Source::Once(_, outcome) = source {
            return finish(last, outcome, attempts);
        }
        if let Some(t) = &throttle
            && !t.record_failure()
        {
            return finish(last, CallOutcome::Throttled, attempts);
        }
        let (push, info) = match &last {
            Last::Response(resp, _) => (pushback(resp.headers()), retry_info_delay(resp.headers())),
            _ => (Pushback::Absent, None),
        };
        if push == Pushback::Stop {
            return finish(last, CallOutcome::PushbackStop, attempts);
        }
        if attempts >= policy.max_attempts() {
            return finish(last, CallOutcome::AttemptsExhausted, attempts);
        }
        let mut wait = match push {
            Pushback::Wait(d) => {
                exponent = 0;
                d
            }
            _ => {
                exponent = exponent.saturating_add(1);
                backoff::backoff(policy, exponent, call.shared.jitter.as_ref())
            }
        };
        if let Some(min) = info {
            wait = wait.max(min);
        }
        if let Some(d) = call.deadline {
            let now = Instant::now();
            let too_late = match now.checked_add(wait) {
                None => true,
                Some(resume) => resume >= d || d - resume < call.eff.min_attempt_time,
            };
            if too_late {
                return finish(last, CallOutcome::Deadline, attempts);
            }
        }
        tracing::debug!(
            attempt = attempts,
            code = ?code,
            wait_ms = u64::try_from(wait.as_millis()).unwrap_or(u64::MAX),
            "retrying"
        );
        drop(last);
        sleep(wait).await;
    }
}

async fn sleep(wait: Duration) {
    if !wait.is_zero() {
        tokio::time::sleep(wait).await;
    }
}
