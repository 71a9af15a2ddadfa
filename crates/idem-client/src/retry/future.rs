//! [`ResponseFuture`]: the future of a [`Retry`](super::Retry) call.
//!
//! Calls of methods without a retry policy (nor `waitForReady`) use a hand-written
//! pass-through state (no allocation beyond a deadline timer). Calls that may send more
//! than once run the `async` loop of the call module (`call::run`) in a box: it must
//! await the inner service's readiness for each retry, backoff sleeps and per-attempt
//! timers, and such a call allocates its replay buffer anyway, so one more allocation
//! buys a loop that reads like A6's prose instead of a six-state machine.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::request::Parts;
use pin_project_lite::pin_project;
use tokio::time::{Instant, Sleep};
use tower_service::Service;
use tracing::Instrument;

use super::call::{self, Call};
use super::context::{Attempt, CallContext};
use super::hedge;
use super::outcome::{CallOutcome, CallReport};
use super::peek::Resp;
use crate::BoxError;

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

pin_project! {
    /// The response future of [`Retry`](super::Retry).
    ///
    /// # Panics
    /// When polled again after it returned `Ready`, like tower's futures.
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
            // The call's deadline, over the response headers.
            #[pin]
            timer: Option<Sleep>,
            cx: CallContext,
            started: Instant,
            span: tracing::Span,
        },
        Retrying {
            fut: BoxFuture<Result<Resp, E>>,
        },
        Ready {
            response: Option<Resp>,
        },
        Done,
    }
}

impl<F, E> std::fmt::Debug for ResponseFuture<F, E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self.kind {
            Kind::Passthrough { .. } => "Passthrough",
            Kind::Retrying { .. } => "Retrying",
            Kind::Ready { .. } => "Ready",
            Kind::Done => "Done",
        };
        f.debug_struct("ResponseFuture")
            .field("kind", &kind)
            .finish()
    }
}

impl<F, E> ResponseFuture<F, E> {
    /// One attempt, passed through; cut at the deadline.
    pub(crate) fn passthrough(fut: F, cx: CallContext, span: tracing::Span) -> Self {
        ResponseFuture {
            kind: Kind::Passthrough {
                fut,
                timer: cx.deadline.map(tokio::time::sleep_until),
                cx,
                started: Instant::now(),
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
        // Dispatch: a method with a hedging policy races hedges instead of retrying.
        let fut: BoxFuture<_> = match call.hedging.clone() {
            Some(policy) => Box::pin(hedge::run(svc, parts, body, call, policy).instrument(span)),
            None => Box::pin(call::run(svc, parts, body, call).instrument(span)),
        };
        ResponseFuture {
            kind: Kind::Retrying { fut },
        }
    }
}

impl<F, RB, E> Future for ResponseFuture<F, E>
where
    F: Future<Output = Result<http::Response<RB>, E>>,
    RB: http_body::Body<Data = Bytes> + Send + 'static,
    RB::Error: Into<BoxError>,
    E: Into<BoxError>,
{
    type Output = Result<Resp, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut kind = self.project().kind;
        let output = match kind.as_mut().project() {
            KindProj::Passthrough {
                fut,
                timer,
                cx: call,
                started,
                span,
            } => {
                let _enter = span.enter();
                let attempt = match fut.poll(cx) {
                    Poll::Ready(result) => Attempt::of(result, call.deadline),
                    Poll::Pending => match timer.as_pin_mut().map(|t| t.poll(cx)) {
                        Some(Poll::Ready(())) => Attempt::Deadline,
                        _ => return Poll::Pending,
                    },
                };
                Ok(pass_through(call, attempt, started.elapsed()))
            }
            KindProj::Retrying { fut } => std::task::ready!(fut.as_mut().poll(cx)),
            KindProj::Ready { response } => Ok(response
                .take()
                .expect("ResponseFuture polled after completion")),
            KindProj::Done => panic!("ResponseFuture polled after completion"),
        };
        kind.set(Kind::Done);
        Poll::Ready(output)
    }
}

/// Answers a passed-through call: its one attempt, with a report.
fn pass_through(cx: &CallContext, attempt: Attempt, took: std::time::Duration) -> Resp {
    let end = attempt.observe().end;
    let mut report = CallReport::new(CallOutcome::without_policy(end));
    report.record(end, took);
    if let Some(t) = cx.shared.throttle().filter(|_| end.is_success()) {
        t.record_success();
    }
    cx.finish(attempt, report)
}
