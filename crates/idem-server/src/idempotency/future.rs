//! [`ResponseFuture`] of [`Idempotency`](super::Idempotency), and what becomes of a
//! protected call whose caller goes away while its handler runs ([`Running`]).

use std::cell::Cell;
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
use tracing::Instrument;

use super::BoxError;
use super::admission::Admission;
use crate::metrics::{self, CallTrace};

/// The boxed future of a protected call (it awaits the store).
pub(crate) type Protected<E> =
    Pin<Box<dyn Future<Output = Result<Response<Body>, E>> + Send + 'static>>;

thread_local! {
    /// Set by a [`Running`] future that returns `Pending`: the protected call being
    /// polled is suspended inside its handler's run. Read (and restored) around each
    /// poll of a protected call, so nested protected calls do not mix their marks.
    static SUSPENDED_IN_RUN: Cell<bool> = const { Cell::new(false) };
}

pin_project! {
    /// A protected call's run, from its claim to its answer: while it is suspended, a
    /// caller that goes away does not cancel it (see [`ProtectedCall`]).
    pub(crate) struct Running<F> {
        #[pin]
        run: F,
    }
}

impl<F> Running<F> {
    pub(crate) fn new(run: F) -> Self {
        Running { run }
    }
}

impl<F: Future> Future for Running<F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let polled = self.project().run.poll(cx);
        if polled.is_pending() {
            SUSPENDED_IN_RUN.set(true);
        }
        polled
    }
}

pin_project! {
    /// A protected call's two phases: `decide` (read the request, claim the record), then,
    /// for a claim acquired, the handler's run that `run` makes of what `decide` gave.
    /// The run's future is built in place once `decide` is over, so the call's future is
    /// the larger of the two, not their sum (see `Call::run`).
    pub(crate) struct Phases<D, M, R> {
        make_run: Option<M>,
        #[pin]
        phase: Phase<D, R>,
    }
}

pin_project! {
    #[project = PhaseProj]
    enum Phase<D, R> {
        Deciding { #[pin] decide: D },
        Running { #[pin] run: R },
        Done,
    }
}

impl<D, M, R> Phases<D, M, R> {
    pub(crate) fn new(decide: D, make_run: M) -> Self {
        Phases {
            make_run: Some(make_run),
            phase: Phase::Deciding { decide },
        }
    }
}

impl<D, M, R, St, S, E> Future for Phases<D, M, R>
where
    D: Future<Output = super::call::Decided<St, S, E>>,
    M: FnOnce(super::call::Acquired<St, S>) -> R,
    R: Future<Output = Result<Response<Body>, E>>,
{
    type Output = Result<Response<Body>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            match this.phase.as_mut().project() {
                PhaseProj::Deciding { decide } => match ready!(decide.poll(cx)) {
                    super::call::Decided::Answer(answer) => {
                        this.phase.set(Phase::Done);
                        return Poll::Ready(answer);
                    }
                    super::call::Decided::Run(acquired) => {
                        let make_run = this.make_run.take().expect("one run per call");
                        this.phase.set(Phase::Running {
                            run: make_run(acquired),
                        });
                    }
                },
                PhaseProj::Running { run } => {
                    let answer = ready!(run.poll(cx));
                    this.phase.set(Phase::Done);
                    return Poll::Ready(answer);
                }
                PhaseProj::Done => panic!("a protected call's future polled after it ended"),
            }
        }
    }
}

/// What a protected call's future needs to hand its run to a task of its own.
pub(crate) struct Detach {
    /// The layer's bounds: a run detached by a cancel counts against
    /// `maxDetachedHandlers` until its task ends.
    pub(crate) admission: Arc<Admission>,
    /// The call's trace: told of a run detached by a cancel (the call ends CANCELLED).
    pub(crate) trace: Option<Arc<CallTrace>>,
    /// The call's span: a detached run is instrumented with it.
    pub(crate) span: tracing::Span,
}

/// A protected call's boxed future, polled by the caller. Dropped while its run is
/// suspended (the caller went away), it moves, box and all, to a task of its own and
/// runs to the end there: the outcome is still recorded, and nothing runs twice.
pub(crate) struct ProtectedCall<E> {
    future: Option<Protected<E>>,
    detach: Detach,
    /// The future is suspended inside its run.
    running: bool,
    /// Spawns the future (a plain function: the bounds it needs are known where the
    /// call is made).
    spawn: fn(Protected<E>, Detach),
}

impl<E> Drop for ProtectedCall<E> {
    fn drop(&mut self) {
        if !self.running {
            return;
        }
        if let Some(future) = self.future.take() {
            let detach = Detach {
                admission: self.detach.admission.clone(),
                trace: self.detach.trace.take(),
                span: std::mem::replace(&mut self.detach.span, tracing::Span::none()),
            };
            (self.spawn)(future, detach);
        }
    }
}

/// Runs a protected call whose caller went away to its end, counted as detached.
pub(crate) fn spawn_detached<E: Send + 'static>(future: Protected<E>, d: Detach) {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        // Only a future dropped outside any runtime gets here: the run cannot go on,
        // and its record is left to its lease.
        tracing::error!(
            "an idempotent handler's run was dropped outside a tokio runtime; its record stays in flight until its lease ends"
        );
        return;
    };
    // The caller went away now: that is how its call ended, whatever the run answers.
    if let Some(t) = &d.trace {
        t.ended(Code::Cancelled);
    }
    let cancelled = d.trace.and_then(CallTrace::detached);
    let gone = d.admission.detached();
    let run = async move {
        let _ = future.await;
        drop((cancelled, gone));
    };
    drop(runtime.spawn(run.instrument(d.span)));
}

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
        Protected { call: ProtectedCall<E> },
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
    pub(crate) fn protected(future: Protected<E>, detach: Detach) -> Self
    where
        E: Send + 'static,
    {
        let call = ProtectedCall {
            future: Some(future),
            detach,
            running: false,
            spawn: spawn_detached::<E>,
        };
        ResponseFuture {
            kind: Kind::Protected { call },
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
            KindProj::Protected { call } => {
                let Some(future) = call.future.as_mut() else {
                    panic!("ResponseFuture polled after completion")
                };
                let outer = SUSPENDED_IN_RUN.replace(false);
                let polled = future.as_mut().poll(cx);
                call.running = SUSPENDED_IN_RUN.replace(outer);
                let output = ready!(polled);
                call.running = false;
                call.future = None;
                output
            }
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
