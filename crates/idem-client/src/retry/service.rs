//! [`Retry`]: the service the [`RetryLayer`] wraps around a channel.

use std::mem;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use bytes::Bytes;
use idem_core::config::ServiceConfig;
use idem_core::deadline::{
    current_scope, earliest, encode_grpc_timeout, inbound_deadline, parse_grpc_timeout,
};
use idem_core::headers::GRPC_TIMEOUT;
use tokio::time::Instant;
use tower_service::Service;
use tracing::Instrument;
use tracing::field::Empty;

use crate::BoxError;
use crate::key::place_request_key;
use crate::metrics::Started;
use crate::retry::config::LayerShared;
use crate::retry::engine::attempts::{CallPlan, Run};
use crate::retry::engine::context::{Attempt, CallContext, CallPath};
use crate::retry::engine::race;
use crate::retry::future::{ResponseFuture, Spare};
use crate::retry::layer::RetryLayer;
use crate::retry::outcome::{CallOutcome, CallReport};
use crate::retry::policy::breaker::{self, Admission, CallTicket};
use crate::retry::request::check::{CheckedBody, RequestCheck, RequestFault};

/// Retries the calls of an inner gRPC service (a tonic `Channel`) as gRFC A6 says; built
/// by [`RetryLayer`].
///
/// It accepts requests with any body of `Bytes` (tonic clients send
/// [`tonic::body::Body`]) and drives the inner service with [`tonic::body::Body`], so it
/// fits between a generated client and a `Channel`. Responses (their body as a
/// [`tonic::body::Body`]) are the inner service's, untouched except for the
/// [`CallReport`] extension (and, on Trailers-Only errors, the local report headers of
/// [`idem_core::headers`]). Every failure comes back as a Trailers-Only response that
/// carries the report: the inner service's errors as the status tonic would make of them
/// ([`tonic::Status::from_error`], with UNKNOWN made UNAVAILABLE: no response came back),
/// and a DEADLINE_EXCEEDED / CANCELLED status the layer
/// makes up when the deadline or `perAttemptRecvTimeout` cuts an attempt short. The
/// deadline also bounds the response body.
///
/// A call's first attempt goes out from `call`, on the service made ready by
/// `poll_ready`, as a bare channel sends its request there: dropping the response future
/// unpolled does not take it back. Retries go out on a clone of one spare service, which
/// every clone of this `Retry` shares, polled ready before each.
#[derive(Debug, Clone)]
pub struct Retry<S> {
    inner: S,
    shared: Arc<LayerShared>,
    /// A clone of `inner` that retries clone again (the first attempt goes out on
    /// `inner` itself): made at the first retrying call, and shared by the clones of
    /// this service, which clients often make per call.
    spare: Arc<Spare<S>>,
}

impl<S> Retry<S> {
    /// Wraps `inner` with the settings (and shared throttle, budget, counters) of `layer`.
    pub fn new(inner: S, layer: &RetryLayer) -> Self {
        Self::from_shared(inner, layer.shared.clone())
    }

    pub(crate) fn from_shared(inner: S, shared: Arc<LayerShared>) -> Self {
        Retry {
            inner,
            shared,
            spare: Arc::default(),
        }
    }

    /// A layer configured from `config` ([`RetryLayer::from_config`]).
    pub fn layer(config: &ServiceConfig) -> RetryLayer {
        RetryLayer::from_config(config)
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, mutably. What is changed through it reaches retries too: this
    /// service's retries clone it again from now on (clones of this service made before
    /// keep their own inner service and spare).
    pub fn get_mut(&mut self) -> &mut S {
        self.spare = Arc::default();
        &mut self.inner
    }

    /// Unwraps the inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S, B, RB> Service<http::Request<B>> for Retry<S>
where
    S: Service<http::Request<tonic::body::Body>, Response = http::Response<RB>>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    S::Error: Into<BoxError> + Send + 'static,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
    RB: http_body::Body<Data = Bytes> + Send + 'static,
    RB::Error: Into<BoxError>,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = S::Error;
    type Future = ResponseFuture<S>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: http::Request<B>) -> Self::Future {
        let settings = self.shared.settings();
        // The path as a `PathAndQuery` clone: `Bytes` inside (static for generated
        // clients), so no copy per call.
        let path = CallPath::of(req.uri());
        let inbound = current_scope();
        let mut policy = settings.resolve(path.as_str(), inbound);
        self.shared.stats.call();
        let ticket = policy.breaker.take().map(|b| b.admit(path.as_str()));
        let admission = ticket.as_ref().map(CallTicket::admission);
        if let Some(Admission::Probe(_)) = admission {
            // A half-open breaker's probe: one attempt, never retried or hedged.
            policy.retry = None;
            policy.hedging = None;
        }
        if !matches!(admission, Some(Admission::Refuse(_)))
            && let Some(budget) = &settings.guard_handles().budget
        {
            budget.deposit();
        }
        place_request_key(&mut req, settings.key_header(), policy.add_key);
        let cx = CallContext {
            shared: self.shared.clone(),
            deadline: deadline(req.headers(), policy.timeout),
            marker: inbound
                .and_then(|s| s.marker())
                .filter(|_| settings.mark_exhausted()),
            path,
            limits: policy.limits,
            fault: policy
                .limits
                .request
                .map(|_| Arc::new(RequestFault::default())),
            started: Started::now(self.shared.observer.as_ref()),
            settings,
            ticket,
        };
        if let Some(Admission::Refuse(wait)) = admission {
            // Open: nothing is sent, and no attempt, token or budget is used.
            let status = breaker::refusal(cx.path.as_str(), wait, breaker::Sent::Nothing);
            let report = CallReport::new(CallOutcome::CircuitOpen);
            return ResponseFuture::ready(cx.finish(Attempt::Local(status), report));
        }
        let span = tracing::debug_span!(
            "idem_retry",
            method = %cx.path,
            rpc.system = "grpc",
            rpc.service = rpc_part(cx.path.as_str(), 0),
            rpc.method = rpc_part(cx.path.as_str(), 1),
            attempts = Empty,
            retry_delay_ms = Empty,
            outcome = Empty,
            rpc.grpc.status_code = Empty,
        );
        // A method without a retry policy is still sent again transparently (gRFC A6)
        // after a failure its server never saw, so its call keeps a copy of the request
        // until response headers, as a retrying call does. The one exception is a
        // request checked against `maxRequestMessageBytes`: it streams to the server
        // unbuffered, as before (a message over the limit fails the stream it is on).
        if policy.retry.is_none()
            && policy.hedging.is_none()
            && !policy.wait_for_ready
            && policy.limits.request.is_some()
        {
            return self.pass_through(req, cx, span);
        }
        let (parts, body) = req.into_parts();
        let call = CallPlan {
            cx,
            policy: policy.retry,
            hedging: policy.hedging,
            wait_for_ready: policy.wait_for_ready,
        };
        // A tonic client's body already is a `tonic::body::Body` (no new box; other
        // bodies are boxed once).
        let body = tonic::body::Body::new(body);
        if let Some(hedging) = call.hedging.clone() {
            let svc = self.take_ready();
            let fut = race::run(svc, parts, body, call, hedging).instrument(span);
            return ResponseFuture::looping(Box::pin(fut));
        }
        let _enter = span.enter();
        // What the caller has ready of the request is read now. A body that would wait
        // is polled again, with the waker of the task that sends it (the connection's),
        // as the first attempt goes out. The first attempt is sent here, as a bare
        // channel sends its request at `call`.
        let mut noop = Context::from_waker(Waker::noop());
        let mut run = match Run::start(parts, body, call, &mut noop) {
            Ok(run) => run,
            Err(answer) => return ResponseFuture::ready(answer),
        };
        if run.needs_loop() {
            let svc = self.take_ready();
            drop(_enter);
            return ResponseFuture::looping(Box::pin(run.run(svc, None).instrument(span)));
        }
        let (attempt, started) = match run.attempt(&mut self.inner) {
            Ok(sent) => sent,
            Err(answer) => return ResponseFuture::ready(answer),
        };
        self.spare.get_or_init(|| Mutex::new(self.inner.clone()));
        drop(_enter);
        let spare = self.spare.clone();
        ResponseFuture::first(attempt, Box::new(run), spare, started, span)
    }
}

impl<S: Clone> Retry<S> {
    /// The ready inner service, for a future that drives it; a clone stays for the next
    /// call.
    fn take_ready(&mut self) -> S {
        let clone = self.inner.clone();
        mem::replace(&mut self.inner, clone)
    }
}

impl<S> Retry<S> {
    /// Sends a call without a retry policy once, with `grpc-timeout` set to the time left
    /// and its request messages checked against `maxRequestMessageBytes` as they stream.
    fn pass_through<B, RB>(
        &mut self,
        mut req: http::Request<B>,
        cx: CallContext,
        span: tracing::Span,
    ) -> ResponseFuture<S>
    where
        S: Service<http::Request<tonic::body::Body>, Response = http::Response<RB>>,
        S::Error: Into<BoxError>,
        B: http_body::Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        if let Some(d) = cx.deadline {
            let now = Instant::now();
            if d <= now {
                let report = CallReport::new(CallOutcome::Deadline);
                return ResponseFuture::ready(cx.finish(Attempt::Deadline, report));
            }
            req.headers_mut()
                .insert(GRPC_TIMEOUT, encode_grpc_timeout(d - now));
        }
        self.shared.stats.attempt(true);
        cx.attempt_started();
        let check = cx.limits.request.zip(cx.fault.clone());
        let req = req.map(|body| {
            let body = tonic::body::Body::new(body);
            match check {
                Some((limit, fault)) => {
                    tonic::body::Body::new(CheckedBody::new(body, RequestCheck::new(limit, fault)))
                }
                None => body,
            }
        });
        let fut = self.inner.call(req);
        ResponseFuture::passthrough(fut, cx, span)
    }
}

/// OpenTelemetry's `rpc.service` (`i = 0`) or `rpc.method` (`i = 1`) of a path. Recorded
/// as a string field (quoted by `tracing`'s fmt output, a string attribute in OTel). A
/// lazy `Display` wrapper would save about 300 instructions a call but print the values
/// unquoted, which the log format promises (`idem-otel`'s `tests/logs.rs`).
fn rpc_part(path: &str, i: usize) -> &str {
    path.trim_start_matches('/').split('/').nth(i).unwrap_or("")
}

/// The call's deadline: the earliest of the request's `grpc-timeout` (tonic's
/// `Request::set_timeout`), the inbound call's deadline and the config `timeout`. The
/// clock is read only when a timeout is relative to now.
fn deadline(headers: &http::HeaderMap, config_timeout: Option<Duration>) -> Option<Instant> {
    let header_timeout = headers
        .get(GRPC_TIMEOUT)
        .and_then(|v| parse_grpc_timeout(v.as_bytes()));
    if header_timeout.is_none() && config_timeout.is_none() {
        return inbound_deadline();
    }
    let now = Instant::now();
    let from_header = header_timeout.and_then(|t| now.checked_add(t));
    let from_config = config_timeout.and_then(|t| now.checked_add(t));
    earliest([from_header, inbound_deadline(), from_config])
}

#[cfg(test)]
mod key_tests {
    use idem_core::key::IdempotencyKey;

    #[test]
    fn generated_keys_are_valid_distinct_sensitive_hex() {
        let (ka, kb) = (crate::key::fresh_value(), crate::key::fresh_value());
        assert_ne!(ka, kb);
        assert!(ka.is_sensitive());
        assert_eq!(ka.len(), 32);
        assert!(
            ka.as_bytes()
                .iter()
                .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase())
        );
        assert!(IdempotencyKey::parse(ka.as_bytes()).is_ok());
    }
}
