//! [`Retry`]: the service the [`RetryLayer`] wraps around a channel.

use std::mem;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use idem_core::deadline::{
    current_scope, earliest, encode_grpc_timeout, inbound_deadline, parse_grpc_timeout,
};
use idem_core::headers::GRPC_TIMEOUT;
use idem_core::{IdempotencyKey, ServiceConfig};
use tokio::time::Instant;
use tower_service::Service;
use tracing::field::Empty;

use super::future::{self, Call, CallPath, ResponseFuture};
use super::layer::{RetryLayer, Shared};
use super::outcome::{CallOutcome, CallReport};
use crate::BoxError;

/// Retries the calls of an inner gRPC service (a tonic `Channel`) as gRFC A6 says; built
/// by [`RetryLayer`].
///
/// It accepts requests with any body of `Bytes` (tonic clients send
/// [`tonic::body::Body`]) and drives the inner service with [`tonic::body::Body`], so it
/// fits between a generated client and a `Channel`. Responses (their body as a
/// [`tonic::body::Body`]) and errors are the inner service's, untouched except for the
/// [`CallReport`] extension (and, on Trailers-Only
/// errors, the local [`OUTCOME_HEADER`](super::outcome::OUTCOME_HEADER) /
/// [`ATTEMPTS_HEADER`](super::outcome::ATTEMPTS_HEADER) headers), or a DEADLINE_EXCEEDED /
/// CANCELLED Trailers-Only response the layer makes up when the deadline or
/// `perAttemptRecvTimeout` cuts an attempt short.
#[derive(Debug, Clone)]
pub struct Retry<S> {
    inner: S,
    shared: Arc<Shared>,
}

impl<S> Retry<S> {
    /// Wraps `inner` with the settings (and shared throttle, budget, counters) of `layer`.
    pub fn new(inner: S, layer: &RetryLayer) -> Self {
        Self::from_shared(inner, layer.shared.clone())
    }

    pub(crate) fn from_shared(inner: S, shared: Arc<Shared>) -> Self {
        Retry { inner, shared }
    }

    /// A layer configured from `config` ([`RetryLayer::from_config`]).
    pub fn layer(config: &ServiceConfig) -> RetryLayer {
        RetryLayer::from_config(config)
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
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
    type Future = ResponseFuture<S::Future, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: http::Request<B>) -> Self::Future {
        let eff = self.shared.effective();
        // The path as a `PathAndQuery` clone: `Bytes` inside (static for generated
        // clients), so no copy per call.
        let path = CallPath::of(req.uri());
        let mut policy = eff.resolve(path.as_str());
        if eff.no_retry_under_retried_inbound
            && current_scope().is_some_and(|s| s.previous_attempts > 0)
        {
            // The caller upstream retries already: one attempt here.
            policy.retry = None;
        }
        self.shared.stats.call();

        let typed = req.extensions_mut().remove::<IdempotencyKey>();
        crate::key::place_key(
            req.headers_mut(),
            typed.as_ref(),
            &eff.key_header,
            policy.add_key,
        );

        // The clock is read only when a timeout is relative to now.
        let header_timeout = req
            .headers()
            .get(GRPC_TIMEOUT)
            .and_then(|v| parse_grpc_timeout(v.as_bytes()));
        let deadline = if header_timeout.is_none() && policy.timeout.is_none() {
            inbound_deadline()
        } else {
            let now = Instant::now();
            let from_header = header_timeout.and_then(|t| now.checked_add(t));
            let from_config = policy.timeout.and_then(|t| now.checked_add(t));
            earliest([from_header, inbound_deadline(), from_config])
        };

        let span = tracing::debug_span!(
            "idem_retry",
            method = %path,
            attempts = Empty,
            outcome = Empty,
        );

        match policy.retry {
            None => {
                if let Some(d) = deadline {
                    let now = Instant::now();
                    if d <= now {
                        let report = CallReport {
                            outcome: CallOutcome::Deadline,
                            attempts: 0,
                            last_code: Some(tonic::Code::DeadlineExceeded),
                        };
                        self.shared.report(path.as_str(), &report);
                        return ResponseFuture::ready(future::made_up(
                            report,
                            "deadline exceeded before the call started",
                        ));
                    }
                    req.headers_mut()
                        .insert(GRPC_TIMEOUT, encode_grpc_timeout(d - now));
                }
                self.shared.stats.attempt(true);
                let fut = self.inner.call(req.map(tonic::body::Body::new));
                ResponseFuture::passthrough(fut, self.shared.clone(), path, span)
            }
            Some(retry) => {
                // The ready service goes into the future; a clone stays for the next call.
                let clone = self.inner.clone();
                let svc = mem::replace(&mut self.inner, clone);
                let (parts, body) = req.into_parts();
                let marker = current_scope()
                    .and_then(|s| s.marker())
                    .filter(|_| eff.mark_exhausted);
                let call = Call {
                    shared: self.shared.clone(),
                    eff,
                    policy: retry,
                    deadline,
                    path,
                    marker,
                };
                ResponseFuture::retrying(svc, parts, body, call, span)
            }
        }
    }
}

#[cfg(test)]
mod key_tests {
    use super::*;

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
