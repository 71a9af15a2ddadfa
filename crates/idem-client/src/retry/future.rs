//! [`ResponseFuture`]: the future of a [`Retry`](crate::retry::Retry) call.
//!
//! The layer sends one attempt itself, on the service it was handed ready, and the future
//! awaits it by hand: every call of a method without a retry policy (nor `waitForReady`),
//! without allocating, and the first attempt of a retrying call (sent by `Run::attempt`,
//! the one attempt function), whose state between attempts (`Run`) waits in a box so
//! that the future stays small. When a retry is due, the `async` attempt loop
//! (`Run::run`, in `engine/attempts.rs`) takes over in a box, on a clone of the service: it awaits the service's readiness for each retry, backoff sleeps and
//! per-attempt timers, and reads like A6's prose instead of a six-state machine. Hedged
//! calls, and those that need the loop for their first attempt (`waitForReady`, the
//! early-trailers peek), run in the box from the start.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::task::{Context, Poll};

use bytes::Bytes;
use pin_project_lite::pin_project;
use tokio::time::Instant;
use tower_service::Service;
use tracing::{Instrument, Span};

use crate::BoxError;
use crate::retry::Req;
use crate::retry::Resp;
use crate::retry::engine::attempts::{AfterAttempt, Run};
use crate::retry::engine::context::{Attempt, CallContext};
use crate::retry::engine::timed::{self, Cut, Timed};
use crate::retry::outcome::{CallOutcome, CallReport};

pub(crate) type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// Where retries get their service: see [`Retry`](crate::retry::Retry)'s `spare`.
pub(crate) type Spare<S> = OnceLock<Mutex<S>>;

pin_project! {
    /// The response future of [`Retry`](crate::retry::Retry) over the inner service `S`.
    ///
    /// # Panics
    /// When polled again after it returned `Ready`, like tower's futures.
    pub struct ResponseFuture<S>
    where
        S: Service<Req>,
    {
        #[pin]
        kind: Phase<S>,
    }
}

pin_project! {
    #[project = PhaseProj]
    enum Phase<S>
    where
        S: Service<Req>,
    {
        // A call without a retry policy: its one attempt.
        Passthrough {
            #[pin]
            attempt: Timed<S::Future>,
            cx: CallContext,
            started: Instant,
            span: Span,
        },
        // A retrying call's first attempt; `spare` is cloned for the retries. The call's
        // state is boxed: inline, it would make every call's future (and each future
        // holding it: tonic's, the caller's) about 1 KB larger, copied at every move.
        First {
            #[pin]
            attempt: Timed<S::Future>,
            run: Option<Box<Run>>,
            spare: Arc<Spare<S>>,
            started: Instant,
            span: Span,
        },
        // The loop, boxed.
        Looping {
            fut: BoxFuture<Result<Resp, S::Error>>,
        },
        Ready {
            response: Option<Resp>,
        },
        Done,
    }
}

impl<S: Service<Req>> std::fmt::Debug for ResponseFuture<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self.kind {
            Phase::Passthrough { .. } => "Passthrough",
            Phase::First { .. } => "First",
            Phase::Looping { .. } => "Looping",
            Phase::Ready { .. } => "Ready",
            Phase::Done => "Done",
        };
        f.debug_struct("ResponseFuture")
            .field("kind", &kind)
            .finish()
    }
}

impl<S: Service<Req>> ResponseFuture<S> {
    /// One attempt, passed through; cut at the deadline.
    pub(crate) fn passthrough(fut: S::Future, cx: CallContext, span: Span) -> Self {
        let cut = Cut::earliest(cx.deadline, None);
        ResponseFuture {
            kind: Phase::Passthrough {
                attempt: Timed::new(fut, cut),
                cx,
                started: Instant::now(),
                span,
            },
        }
    }

    /// A retrying call's first attempt, sent at `started`.
    pub(crate) fn first(
        attempt: Timed<S::Future>,
        run: Box<Run>,
        spare: Arc<Spare<S>>,
        started: Instant,
        span: Span,
    ) -> Self {
        ResponseFuture {
            kind: Phase::First {
                attempt,
                run: Some(run),
                spare,
                started,
                span,
            },
        }
    }

    /// A call the boxed loop (or hedging) drives.
    pub(crate) fn looping(fut: BoxFuture<Result<Resp, S::Error>>) -> Self {
        ResponseFuture {
            kind: Phase::Looping { fut },
        }
    }

    pub(crate) fn ready(response: Resp) -> Self {
        ResponseFuture {
            kind: Phase::Ready {
                response: Some(response),
            },
        }
    }
}

impl<S, RB> Future for ResponseFuture<S>
where
    S: Service<Req, Response = http::Response<RB>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Into<BoxError> + Send + 'static,
    RB: http_body::Body<Data = Bytes> + Send + 'static,
    RB::Error: Into<BoxError>,
{
    type Output = Result<Resp, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut kind = self.project().kind;
        loop {
            let next = match kind.as_mut().project() {
                PhaseProj::Passthrough {
                    attempt,
                    cx: call,
                    started,
                    span,
                } => {
                    let _enter = span.enter();
                    let attempt = timed::ended(std::task::ready!(attempt.poll(cx)), call.deadline);
                    Polled::Answer(pass_through(call, attempt, started.elapsed()))
                }
                PhaseProj::First {
                    attempt,
                    run,
                    spare,
                    started,
                    span,
                } => {
                    let _enter = span.enter();
                    let deadline = run.as_deref().and_then(Run::deadline);
                    let attempt = timed::ended(std::task::ready!(attempt.poll(cx)), deadline);
                    let mut run = run.take().expect("ResponseFuture polled after completion");
                    match run.settle(attempt, started.elapsed()) {
                        AfterAttempt::Answer(answer) => Polled::Answer(answer),
                        AfterAttempt::After(wait) => {
                            drop(_enter);
                            let svc = spare
                                .get()
                                .expect("the spare is made before the first attempt")
                                .lock()
                                .unwrap_or_else(PoisonError::into_inner)
                                .clone();
                            let span = std::mem::replace(span, Span::none());
                            Polled::Then(Phase::Looping {
                                fut: Box::pin((*run).run(svc, Some(wait)).instrument(span)),
                            })
                        }
                    }
                }
                PhaseProj::Looping { fut } => {
                    let output = std::task::ready!(fut.as_mut().poll(cx));
                    kind.set(Phase::Done);
                    return Poll::Ready(output);
                }
                PhaseProj::Ready { response } => {
                    let response = response
                        .take()
                        .expect("ResponseFuture polled after completion");
                    kind.set(Phase::Done);
                    return Poll::Ready(Ok(response));
                }
                PhaseProj::Done => panic!("ResponseFuture polled after completion"),
            };
            match next {
                Polled::Answer(response) => {
                    kind.set(Phase::Done);
                    return Poll::Ready(Ok(response));
                }
                Polled::Then(next) => kind.set(next),
            }
        }
    }
}

/// What a poll of one state leads to: the answer, or the next state.
enum Polled<K> {
    Answer(Resp),
    Then(K),
}

/// Answers a passed-through call: its one attempt, with a report.
fn pass_through(cx: &CallContext, attempt: Attempt, took: std::time::Duration) -> Resp {
    let end = attempt.observe().end;
    let mut report = CallReport::new(CallOutcome::without_policy(end));
    report.record(end, took);
    if let Some(t) = cx.settings.throttle().filter(|_| end.is_success()) {
        t.record_success();
    }
    cx.finish(attempt, report)
}
