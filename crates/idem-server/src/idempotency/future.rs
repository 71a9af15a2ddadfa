//! [`ResponseFuture`] of [`Idempotency`](super::Idempotency).

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http::Response;
use pin_project_lite::pin_project;
use tonic::Code;
use tonic::body::Body;

use super::BoxError;
use crate::metrics::{self, CallTrace};

/// The boxed future of a protected call (it awaits the store).
pub(crate) type Protected<E> =
    Pin<Box<dyn Future<Output = Result<Response<Body>, E>> + Send + 'static>>;

pin_project! {
    /// Response future of [`Idempotency`](super::Idempotency): the inner future as is for
    /// unprotected calls, a ready response for calls refused before the store, a boxed
    /// future for protected calls.
    pub struct ResponseFuture<F, E> {
        #[pin]
        kind: Kind<F, E>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<F, E> {
        Passthrough { #[pin] future: F, trace: Option<Arc<CallTrace>> },
        Ready { response: Option<Response<Body>> },
        Protected { future: Protected<E> },
        Done,
    }
}

impl<F, E> ResponseFuture<F, E> {
    /// The inner future, its response watched for the observer when `trace` is set.
    pub(crate) fn passthrough(future: F, trace: Option<Arc<CallTrace>>) -> Self {
        ResponseFuture {
            kind: Kind::Passthrough { future, trace },
        }
    }
    pub(crate) fn ready(response: Response<Body>) -> Self {
        ResponseFuture {
            kind: Kind::Ready {
                response: Some(response),
            },
        }
    }
    pub(crate) fn protected(future: Protected<E>) -> Self {
        ResponseFuture {
            kind: Kind::Protected { future },
        }
    }
}

impl<F, E> fmt::Debug for ResponseFuture<F, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match self.kind {
            Kind::Passthrough { .. } => "Passthrough",
            Kind::Ready { .. } => "Ready",
            Kind::Protected { .. } => "Protected",
            Kind::Done => "Done",
        };
        f.debug_struct("ResponseFuture")
            .field("kind", &kind)
            .finish()
    }
}

impl<F, B, E> Future for ResponseFuture<F, E>
where
    F: Future<Output = Result<Response<B>, E>>,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    type Output = Result<Response<Body>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut kind = self.project().kind;
        let output = match kind.as_mut().project() {
            KindProj::Passthrough { future, trace } => {
                let output = ready!(future.poll(cx)).map(|r| r.map(Body::new));
                match (trace.take(), output) {
                    (None, output) => output,
                    (Some(t), Ok(resp)) => Ok(metrics::watch(resp, t)),
                    (Some(t), Err(e)) => {
                        t.ended(Code::Unknown);
                        Err(e)
                    }
                }
            }
            KindProj::Ready { response } => Ok(response.take().expect("a response until Done")),
            KindProj::Protected { future } => ready!(future.as_mut().poll(cx)),
            KindProj::Done => panic!("ResponseFuture polled after completion"),
        };
        kind.set(Kind::Done);
        Poll::Ready(output)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::convert::Infallible;
    use std::future::Ready;

    #[test]
    #[should_panic(expected = "polled after completion")]
    fn polling_after_completion_panics() {
        let mut f = Box::pin(ResponseFuture::<
            Ready<Result<Response<Body>, Infallible>>,
            Infallible,
        >::passthrough(
            std::future::ready(Ok(Response::new(Body::empty()))), None
        ));
        let mut cx = Context::from_waker(std::task::Waker::noop());
        assert!(f.as_mut().poll(&mut cx).is_ready());
        let _ = f.as_mut().poll(&mut cx);
    }
}
