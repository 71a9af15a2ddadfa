//! [`RefuseLayer`]: once the drain started, every new stream is reset with
//! `RST_STREAM(REFUSED_STREAM)` before the service sees it.
//!
//! How it reaches the wire: the service fails the request with [`StreamRefused`], whose
//! source is an [`h2::Error`] carrying `REFUSED_STREAM`. tonic's `RecoverError` (the
//! outermost layer of `Server`) turns a service error into a gRPC status only when the
//! error is a `Status`, an `h2::Error` itself, tower's `Overloaded`, or has a `Status` (or
//! a timeout, connect or hyper error) in its source chain; it passes any other error on.
//! hyper's HTTP/2 server answers a service error by resetting the stream with the h2
//! reason it finds in the error's source chain (`hyper::Error::h2_reason`, from tonic
//! 0.14 / hyper 1 / h2 0.4's sources). So the wrapper must not be an `h2::Error` (tonic
//! would answer a Trailers-Only UNAVAILABLE, which a client may not resend), only carry
//! one.

use std::error::Error;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use pin_project_lite::pin_project;
use tokio::sync::watch;

type BoxError = Box<dyn Error + Send + Sync>;

/// The error a request gets once the drain started: hyper resets its stream with
/// `REFUSED_STREAM` (its source), which tells the client that nothing of it was processed
/// (RFC 9113 §8.7), so the client may send it again on another connection.
#[derive(Debug)]
pub struct StreamRefused(h2::Error);

impl StreamRefused {
    pub(super) fn new() -> Self {
        StreamRefused(h2::Error::from(h2::Reason::REFUSED_STREAM))
    }
}

impl fmt::Display for StreamRefused {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("the server is draining: stream refused before any processing")
    }
}

impl Error for StreamRefused {
    fn source(&self) -> Option<&(dyn Error + 'static)> {
        Some(&self.0)
    }
}

/// A tower layer that refuses every new stream once its drain started
/// ([`Drain::layer`](super::Drain::layer)). Place it first on tonic's `Server`
/// (`Server::builder().layer(drain.layer())`), outside the idempotency layer, so a
/// refused request never reaches it. Cheap to clone.
#[derive(Debug, Clone)]
pub struct RefuseLayer {
    started: watch::Receiver<bool>,
}

impl RefuseLayer {
    pub(super) fn new(started: watch::Receiver<bool>) -> Self {
        RefuseLayer { started }
    }
}

impl<S> tower_layer::Layer<S> for RefuseLayer {
    type Service = Refuse<S>;

    fn layer(&self, inner: S) -> Refuse<S> {
        Refuse {
            inner,
            started: self.started.clone(),
        }
    }
}

/// The service of [`RefuseLayer`].
#[derive(Debug, Clone)]
pub struct Refuse<S> {
    inner: S,
    started: watch::Receiver<bool>,
}

impl<S, Req> tower_service::Service<Req> for Refuse<S>
where
    S: tower_service::Service<Req>,
    S::Error: Into<BoxError>,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = RefuseFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, req: Req) -> Self::Future {
        let inner = (!*self.started.borrow()).then(|| self.inner.call(req));
        RefuseFuture { inner }
    }
}

pin_project! {
    /// The response future of [`Refuse`].
    pub struct RefuseFuture<F> {
        // The service's response future; `None`: the stream is refused.
        #[pin]
        inner: Option<F>,
    }
}

impl<F, T, E> Future for RefuseFuture<F>
where
    F: Future<Output = Result<T, E>>,
    E: Into<BoxError>,
{
    type Output = Result<T, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().inner.as_pin_mut() {
            None => Poll::Ready(Err(StreamRefused::new().into())),
            Some(inner) => inner.poll(cx).map_err(Into::into),
        }
    }
}
