//! The mechanism of a retrying call: read the body, send an attempt, ask
//! [`policy::decide`](super::policy::decide), wait, repeat; then answer the caller.
//!
//! Everything A6 decides lives in [`policy`](super::policy); this file does the I/O,
//! the clock, the counters and the tracing around it.

use std::future::{Future, poll_fn};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::HeaderValue;
use http::request::Parts;
use idem_core::config::RetryPolicy;
use idem_core::deadline::{ExhaustedMarker, earliest, encode_grpc_timeout};
use idem_core::headers::{DOWNSTREAM_EXHAUSTED, GRPC_TIMEOUT, PREVIOUS_RPC_ATTEMPTS};
use tokio::time::Instant;
use tonic::Code;
use tower_service::Service;

use super::body::{self, Buffered, Lease, Overflow};
use super::config::{Settings, Shared};
use super::deadline;
use super::outcome::{AttemptEnd, CallOutcome, CallReport};
use super::peek::{self, Resp, early_code};
use super::policy::{Attempted, CallState, Decision, Limits, decide};
use super::pushback::{Pushback, pushback, retry_info_delay};
use crate::BoxError;

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

/// What every call needs to answer its caller, with or without retries.
#[derive(Debug)]
pub(crate) struct CallContext {
    pub(crate) shared: Arc<Shared>,
    pub(crate) path: CallPath,
    pub(crate) deadline: Option<Instant>,
    /// The inbound call's marker, when this call is made while serving one.
    pub(crate) marker: Option<ExhaustedMarker>,
}

/// How one attempt ended, with what it left for the caller.
pub(crate) enum Attempt<E> {
    Response(Resp),
    Error(E),
    /// `perAttemptRecvTimeout` passed before response headers.
    RecvTimeout,
    /// The call's deadline passed before response headers.
    Deadline,
}

impl<E> Attempt<E> {
    /// The inner service's result, as of `now`: an error once the deadline has passed is
    /// the deadline's doing (tonic's channel timeout fires at the `grpc-timeout` the layer
    /// wrote), not a transport failure.
    pub(crate) fn of<RB>(result: Result<http::Response<RB>, E>, deadline: Option<Instant>) -> Self
    where
        RB: http_body::Body<Data = Bytes> + Send + 'static,
        RB::Error: Into<BoxError>,
    {
        match result {
            Ok(resp) => Attempt::Response(resp.map(tonic::body::Body::new)),
            Err(_) if deadline.is_some_and(|d| d <= Instant::now()) => Attempt::Deadline,
            Err(e) => Attempt::Error(e),
        }
    }

    /// What the decision needs to know about this attempt.
    pub(crate) fn observe(&self) -> Attempted {
        let (end, headers) = match self {
            Attempt::Response(r) => match early_code(r) {
                None => (AttemptEnd::Committed, None),
                Some(code) => (AttemptEnd::Status(code), Some(r.headers())),
            },
            Attempt::Error(_) => (AttemptEnd::TransportError, None),
            Attempt::RecvTimeout => (AttemptEnd::RecvTimeout, None),
            Attempt::Deadline => (AttemptEnd::Deadline, None),
        };
        Attempted {
            end,
            pushback: headers.map_or(Pushback::Absent, pushback),
            retry_info: headers.and_then(retry_info_delay),
        }
    }
}

impl CallContext {
    /// The caller's response: the attempt's own, or for a failure without one a
    /// Trailers-Only status (a transport error becomes the status tonic would make of it),
    /// so every failure carries the report. Records the report (counters, hook, span),
    /// attaches it, and bounds the body by the deadline.
    pub(crate) fn finish<E: Into<BoxError>>(
        &self,
        attempt: Attempt<E>,
        mut report: CallReport,
    ) -> Resp {
        let mut resp = match attempt {
            Attempt::Response(r) => r,
            Attempt::Error(e) => self.error_status(e.into(), report.outcome).into_http(),
            Attempt::RecvTimeout => {
                tonic::Status::cancelled("perAttemptRecvTimeout exceeded").into_http()
            }
            Attempt::Deadline => tonic::Status::deadline_exceeded("deadline exceeded").into_http(),
        };
        report.last_code = early_code(&resp);
        self.shared.report(self.path.as_str(), &report);
        // The `idem_retry` span is a `debug` span: skip the lookup when nothing listens.
        if tracing::level_enabled!(tracing::Level::DEBUG) {
            let span = tracing::Span::current();
            span.record("attempts", report.attempts);
            span.record("outcome", report.outcome.as_str());
        }
        if report.last_code.is_some_and(|c| c != Code::Ok) {
            report.write_headers(resp.headers_mut());
            // Retry at one layer only: the server layer swaps this marker for
            // `grpc-retry-pushback-ms: -1` upstream.
            if let Some(m) = self.marker.filter(|_| report.outcome.retries_gave_up()) {
                resp.headers_mut()
                    .insert(DOWNSTREAM_EXHAUSTED, m.to_header_value());
            }
        }
        resp.extensions_mut().insert(report);
        deadline::bound(resp, self.deadline, report)
    }
}

impl CallContext {
    /// The status of a transport error: tonic's classification, with what tonic leaves
    /// UNKNOWN (a connection reset, a refused stream) as UNAVAILABLE, as gRPC clients
    /// report a channel that failed before any response; a give-up under an inbound call
    /// says so, for the handler's logs upstream.
    fn error_status(&self, e: BoxError, outcome: CallOutcome) -> tonic::Status {
        let status = tonic::Status::from_error(e);
        let status = match status.code() {
            Code::Unknown => tonic::Status::unavailable(status.message()),
            _ => status,
        };
        if self.marker.is_some() && outcome.retries_gave_up() {
            let message = format!(
                "downstream call failed on every attempt: {}",
                status.message()
            );
            return tonic::Status::new(status.code(), message);
        }
        status
    }
}

/// What one retrying call needs.
pub(crate) struct Call {
    pub(crate) cx: CallContext,
    pub(crate) settings: Arc<Settings>,
    pub(crate) policy: RetryPolicy,
}

/// The request body each attempt sends.
enum AttemptBody {
    /// Buffered: every attempt gets a copy.
    Replay(body::Replay),
    /// Did not fit: sent once, and the call reports `outcome` if it would have retried.
    Once(Option<tonic::body::Body>, CallOutcome),
}

impl AttemptBody {
    fn of(buffered: Buffered<tonic::body::Body>) -> Self {
        match buffered {
            Buffered::Complete(replay) => AttemptBody::Replay(replay),
            Buffered::Partial(partial, why) => {
                let outcome = match why {
                    Overflow::PerCall => CallOutcome::BodyTooLarge,
                    Overflow::Budget => CallOutcome::ReplayBudgetExhausted,
                    Overflow::Error => CallOutcome::BodyError,
                };
                AttemptBody::Once(Some(tonic::body::Body::new(partial)), outcome)
            }
        }
    }

    fn next(&mut self) -> tonic::body::Body {
        match self {
            AttemptBody::Replay(replay) => tonic::body::Body::new(replay.body()),
            AttemptBody::Once(body, _) => body.take().unwrap_or_default(),
        }
    }

    fn sent_once(&self) -> Option<CallOutcome> {
        match self {
            AttemptBody::Replay(_) => None,
            AttemptBody::Once(_, outcome) => Some(*outcome),
        }
    }
}

impl Call {
    /// The request of attempt number `attempts` (1-based): `grpc-previous-rpc-attempts`
    /// on retries, `grpc-timeout` rewritten to the time left.
    fn request(
        &self,
        parts: &Parts,
        body: tonic::body::Body,
        attempts: u32,
    ) -> http::Request<tonic::body::Body> {
        let mut req = http::Request::from_parts(parts.clone(), body);
        let headers = req.headers_mut();
        if attempts > 1 {
            headers.insert(PREVIOUS_RPC_ATTEMPTS, HeaderValue::from(attempts - 1));
        } else {
            headers.remove(PREVIOUS_RPC_ATTEMPTS);
        }
        if let Some(d) = self.cx.deadline {
            let left = d.saturating_duration_since(Instant::now());
            headers.insert(GRPC_TIMEOUT, encode_grpc_timeout(left));
        }
        req
    }

    /// Awaits one attempt's response headers (and, with `peek`, its first body frame),
    /// cut short by the deadline or the receive timeout.
    async fn send<F, RB, E>(&self, fut: F, peek: bool) -> Attempt<E>
    where
        F: Future<Output = Result<http::Response<RB>, E>>,
        RB: http_body::Body<Data = Bytes> + Send + 'static,
        RB::Error: Into<BoxError>,
    {
        let deadline = self.cx.deadline;
        let recv_timeout = self
            .policy
            .per_attempt_recv_timeout()
            .and_then(|t| Instant::now().checked_add(t));
        let response = async {
            match Attempt::of(fut.await, deadline) {
                Attempt::Response(r) if peek && early_code(&r).is_none() => {
                    Attempt::Response(peek::peek_early_trailers(r).await)
                }
                other => other,
            }
        };
        match earliest([deadline, recv_timeout]) {
            None => response.await,
            Some(at) => match tokio::time::timeout_at(at, response).await {
                Ok(attempt) => attempt,
                Err(_) if deadline == Some(at) => Attempt::Deadline,
                Err(_) => Attempt::RecvTimeout,
            },
        }
    }

    /// Before attempt `attempts + 1`: a passed deadline, or an inner service that fails
    /// to become ready for a retry, ends the call.
    async fn before_attempt<S, Req>(
        &self,
        svc: &mut S,
        attempts: u32,
    ) -> Option<(Attempt<S::Error>, CallOutcome)>
    where
        S: Service<Req>,
    {
        if self.cx.deadline.is_some_and(|d| d <= Instant::now()) {
            return Some((Attempt::Deadline, CallOutcome::Deadline));
        }
        if attempts > 0
            && let Err(e) = poll_fn(|cx| svc.poll_ready(cx)).await
        {
            return Some((Attempt::Error(e), CallOutcome::ServiceError));
        }
        None
    }

    fn limits<'a>(&'a self, body: &AttemptBody) -> Limits<'a> {
        Limits {
            policy: &self.policy,
            sent_once: body.sent_once(),
            time_left: self
                .cx
                .deadline
                .map(|d| d.saturating_duration_since(Instant::now())),
            min_attempt_time: self.settings.min_attempt_time(),
            max_retry_delay: self.settings.max_retry_delay(),
            jitter: self.cx.shared.jitter.as_ref(),
        }
    }
}

/// The retry loop: attempt, decide, wait.
pub(crate) async fn run<S, B, RB>(
    mut svc: S,
    parts: Parts,
    body: B,
    call: Call,
) -> Result<Resp, S::Error>
where
    S: Service<http::Request<tonic::body::Body>, Response = http::Response<RB>>,
    S::Error: Into<BoxError>,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
    RB: http_body::Body<Data = Bytes> + Send + 'static,
    RB::Error: Into<BoxError>,
{
    let mut lease = Lease::new(call.cx.shared.budget.clone());
    // A tonic client's body already is a `tonic::body::Body` (no new box; other bodies are
    // boxed once), which is `Unpin`: `buffer` reads it in place.
    let cap = call.settings.max_replay_bytes_per_call();
    let buffered = body::buffer(tonic::body::Body::new(body), cap, &mut lease).await;
    let mut body = AttemptBody::of(buffered);
    let peek = call.settings.peek_early_trailers() && body.sent_once().is_none();
    let throttle = call.cx.shared.throttle();
    let mut state = CallState::default();
    let mut report = CallReport::new(CallOutcome::Committed);
    loop {
        if let Some((attempt, outcome)) = call.before_attempt(&mut svc, state.attempts).await {
            report.outcome = outcome;
            return Ok(call.cx.finish(attempt, report));
        }
        state.attempts += 1;
        call.cx.shared.stats.attempt(state.attempts == 1);
        let started = Instant::now();
        let req = call.request(&parts, body.next(), state.attempts);
        let attempt = call.send(svc.call(req), peek).await;
        let attempted = attempt.observe();
        report.record(attempted.end, started.elapsed());
        let count_failure = || throttle.as_ref().is_none_or(|t| t.record_failure());
        match decide(&mut state, &attempted, &call.limits(&body), count_failure) {
            Decision::Done(outcome) => {
                if let Some(t) = throttle.as_ref().filter(|_| outcome.is_success()) {
                    t.record_success();
                }
                report.outcome = outcome;
                return Ok(call.cx.finish(attempt, report));
            }
            Decision::RetryAfter(wait) => {
                report.waited(wait);
                tracing::debug!(
                    attempt = state.attempts,
                    end = %attempted.end,
                    wait_ms = u64::try_from(wait.as_millis()).unwrap_or(u64::MAX),
                    "retrying"
                );
                drop(attempt);
                sleep(wait).await;
            }
        }
    }
}

async fn sleep(wait: Duration) {
    if !wait.is_zero() {
        tokio::time::sleep(wait).await;
    }
}
