//! What a tonic user writes without idem: `tower::retry::Retry` with a status-code
//! policy over a buffered unary request (issue 34's peer row).
//!
//! - The policy retries UNAVAILABLE (a Trailers-Only `grpc-status: 14`, or a transport
//!   error) up to 3 attempts in all, with exponential backoff from 20 ms (as the bench's
//!   `retryPolicy`).
//! - `tower::retry` must clone the request for each attempt, so the body is buffered
//!   first: [`Buffered`] collects the caller's body into `Bytes` (an `async` step, boxed,
//!   as a tonic user's own service would be) and the policy clones the head and the
//!   `Bytes` (a refcount) per attempt.
//! - The idempotency key is added by hand by the caller, as in the machinery row.
//!
//! It keeps no deadline, no report and no throttle: idem's layer does all three.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use tonic::body::Body;
use tonic::transport::Channel;
use tower::Service;
use tower::retry::{Policy, Retry};
use tower::util::MapRequest;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The inner service: the channel, fed a buffered body.
type Inner = MapRequest<Channel, fn(http::Request<Bytes>) -> http::Request<Body>>;

fn to_body(req: http::Request<Bytes>) -> http::Request<Body> {
    req.map(|b| Body::new(Full::new(b)))
}

/// UNAVAILABLE, 3 attempts in all, exponential backoff (20 ms, ×2).
#[derive(Clone, Debug)]
pub(crate) struct Unavailable {
    retries_left: u32,
    backoff: Duration,
}

impl Default for Unavailable {
    fn default() -> Self {
        Unavailable {
            retries_left: 2,
            backoff: Duration::from_millis(20),
        }
    }
}

impl<E> Policy<http::Request<Bytes>, http::Response<Body>, E> for Unavailable {
    type Future = tokio::time::Sleep;

    fn retry(
        &mut self,
        _req: &mut http::Request<Bytes>,
        result: &mut Result<http::Response<Body>, E>,
    ) -> Option<Self::Future> {
        let unavailable = match result {
            Ok(resp) => resp
                .headers()
                .get("grpc-status")
                .is_some_and(|v| v.as_bytes() == b"14"),
            Err(_) => true,
        };
        if !unavailable || self.retries_left == 0 {
            return None;
        }
        self.retries_left -= 1;
        let wait = self.backoff;
        self.backoff *= 2;
        Some(tokio::time::sleep(wait))
    }

    fn clone_request(&mut self, req: &http::Request<Bytes>) -> Option<http::Request<Bytes>> {
        let mut clone = http::Request::new(req.body().clone());
        *clone.method_mut() = req.method().clone();
        *clone.uri_mut() = req.uri().clone();
        *clone.version_mut() = req.version();
        *clone.headers_mut() = req.headers().clone();
        Some(clone)
    }
}

/// Buffers the caller's body, then sends it through `tower::retry::Retry`.
#[derive(Clone)]
pub(crate) struct Buffered {
    inner: Retry<Unavailable, Inner>,
}

impl Buffered {
    pub(crate) fn new(channel: Channel) -> Self {
        let inner: Inner = MapRequest::new(channel, to_body as fn(_) -> _);
        Buffered {
            inner: Retry::new(Unavailable::default(), inner),
        }
    }
}

impl Service<http::Request<Body>> for Buffered {
    type Response = http::Response<Body>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<http::Response<Body>, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        // The ready service goes with the call; a clone stays (tower's advice).
        let clone = self.inner.clone();
        let mut ready = std::mem::replace(&mut self.inner, clone);
        Box::pin(async move {
            let (parts, body) = req.into_parts();
            let bytes = body.collect().await?.to_bytes();
            ready
                .call(http::Request::from_parts(parts, bytes))
                .await
                .map_err(Into::into)
        })
    }
}
