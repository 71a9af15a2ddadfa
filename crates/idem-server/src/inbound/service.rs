use std::task::{Context, Poll};

use http::{Request, Response};
use idem_core::deadline::{ExhaustedMarker, InboundScope, parse_grpc_timeout};
use idem_core::headers::{GRPC_TIMEOUT, PREVIOUS_RPC_ATTEMPTS};
use tokio::time::Instant;
use tower_service::Service;

use super::{InboundLayer, ResponseBody, ResponseFuture};

/// Runs the inner service inside the inbound call's scope. See the [module docs](super).
#[derive(Debug, Clone)]
pub struct Inbound<S> {
    pub(super) inner: S,
    pub(super) pushback_on_exhausted: bool,
}

impl<S> Inbound<S> {
    /// Wraps `inner` with the defaults of [`InboundLayer::new`].
    pub fn new(inner: S) -> Self {
        Inbound {
            inner,
            pushback_on_exhausted: true,
        }
    }

    /// A layer that wraps services in `Inbound`.
    pub fn layer() -> InboundLayer {
        InboundLayer::new()
    }

    idem_core::define_inner_service_accessors!(inner);
}

/// The scope of the call whose request headers these are. Malformed values
/// count as absent.
pub(crate) fn scope_of(headers: &http::HeaderMap) -> InboundScope {
    let deadline = headers
        .get(GRPC_TIMEOUT)
        .and_then(|v| parse_grpc_timeout(v.as_bytes()))
        .and_then(|t| Instant::now().checked_add(t));
    let previous = headers
        .get(PREVIOUS_RPC_ATTEMPTS)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u32>().ok())
        .unwrap_or(0);
    InboundScope::new(deadline, previous)
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for Inbound<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
{
    type Response = Response<ResponseBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqBody>) -> Self::Future {
        let marker = ExhaustedMarker::random();
        let scope = scope_of(req.headers()).with_marker(marker);
        // The inner `call` may start work synchronously: give it the scope too.
        let inner = scope.sync_run(|| self.inner.call(req));
        ResponseFuture::new(inner, scope, self.pushback_on_exhausted)
    }
}
