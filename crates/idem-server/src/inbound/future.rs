use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use http::Response;
use idem_core::deadline::InboundScope;
use pin_project_lite::pin_project;

use super::ResponseBody;
use super::body::rewrite_marker;

pin_project! {
    /// Response future of [`Inbound`](super::Inbound): polls the inner future inside the
    /// inbound scope, then swaps the exhausted-downstream tag for pushback.
    #[derive(Debug)]
    pub struct ResponseFuture<F> {
        #[pin]
        inner: F,
        scope: InboundScope,
        pushback_on_exhausted: bool,
    }
}

impl<F> ResponseFuture<F> {
    pub(super) fn new(inner: F, scope: InboundScope, pushback_on_exhausted: bool) -> Self {
        ResponseFuture {
            inner,
            scope,
            pushback_on_exhausted,
        }
    }
}

impl<F, B, E> Future for ResponseFuture<F>
where
    F: Future<Output = Result<Response<B>, E>>,
{
    type Output = Result<Response<ResponseBody<B>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let scope = *this.scope;
        let inner = this.inner;
        let mut res = ready!(scope.sync_run(|| inner.poll(cx)))?;
        let marker = scope.marker();
        let enabled = *this.pushback_on_exhausted;
        // Trailers-Only responses carry the status (and the tag) in the headers.
        rewrite_marker(res.headers_mut(), marker, enabled);
        Poll::Ready(Ok(res.map(|body| ResponseBody::new(body, scope, enabled))))
    }
}
