//! The handler's run under a claimed record: polled by the caller's future, and moved to
//! a task of its own if that future goes away first (a caller that goes away does not
//! cancel it), its response forwarded to the caller as it is produced and
//! collected for the record, then its outcome recorded.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;

use futures_util::FutureExt;
use http::{HeaderMap, Request, Response};
use http_body_util::BodyExt;
use idem_core::deadline::scope_inbound_deadline;
use idem_core::derive::KeySource;
use idem_store::{Fence, RecordRef, Store};
use tokio::sync::oneshot;
use tonic::body::Body;
use tower_service::Service;
use tracing::Instrument;

use super::admission::{Admission, HandlerSlot};
use super::collect::{Collected, Plan, plan};
use super::context::{BufferedRequest, Call};
use super::forward::{Forwarder, Reply};
use super::lease::Lease;
use super::status;
use super::{HandlerBody, HandlerService};
use crate::metrics::CallTrace;

/// The fence under which a protected handler runs, as a request extension. Pass it to
/// downstream writes that can check it (a write carrying a lower fence than one already
/// seen comes from a run whose lease was taken over).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RecordFence(pub Fence);

/// What a handler's run holds until its outcome is recorded: the lease on the record its
/// call claimed, and one of the layer's handler runs (`maxHandlersInFlight`, and the
/// tenant's `maxHandlersPerTenant`).
struct Claimed<St> {
    lease: Lease<St>,
    permit: HandlerSlot,
}

/// Runs the handler for `call` under the record it claimed with `fence`, and answers
/// with the response as soon as it starts.
///
/// The run is polled by the caller's own future while the caller waits: a unary call
/// (whose response leaves whole, after the outcome is recorded) costs no task of its
/// own. Whatever is left of the run when the response leaves (the rest of a streamed
/// response) or when the caller's future is dropped (the caller went away) moves to a
/// task of its own and runs to the end there; see [`Detach`]. `permit` (one of the
/// layer's handler runs) is held until the outcome is recorded.
///
/// The run is boxed here, in a plain function: it holds the service's own future inline
/// and is large; made inside the returned future, that future would reserve room for
/// the whole run and be copied with it. A detached run moves into its task by pointer.
pub(crate) fn execute<S, St, ResBody>(
    call: Call<St>,
    inner: S,
    mut request: BufferedRequest,
    fence: Fence,
    permit: HandlerSlot,
) -> impl Future<Output = Result<Response<Body>, S::Error>> + Send
where
    S: HandlerService<ResBody>,
    ResBody: HandlerBody,
    St: Store,
{
    let lease = call.lease(fence);
    let scheduled_renewals = lease.scheduled_renewal_task();
    let extensions = &mut request.parts.extensions;
    extensions.insert(RecordFence(fence));
    extensions.insert(lease.record().clone());
    let (tx, mut rx) = oneshot::channel();
    let trace = call.trace.as_ref().filter(|t| t.observed()).cloned();
    let admission = call.shared.admission.clone();
    let mut run = Detach {
        trace,
        admission,
        answered: false,
        // Counted until its outcome is recorded, wherever it runs: a drain waits for it.
        run: Some(Box::pin(crate::drain::protect(run(
            call,
            inner,
            request,
            Claimed { lease, permit },
            tx,
        )))),
        span: tracing::Span::current(),
        runtime: tokio::runtime::Handle::try_current().ok(),
    };
    async move {
        if scheduled_renewals {
            tokio::task::yield_now().await;
        }
        let answer = std::future::poll_fn(|cx| {
            if let Some(r) = run.run.as_mut() {
                // A panic outside the handler's own (in recording the outcome, say) ends
                // the run here, as it would have ended its task: the caller gets
                // INTERNAL and the record is left to its lease.
                match std::panic::catch_unwind(AssertUnwindSafe(|| r.as_mut().poll(cx))) {
                    Ok(Poll::Pending) => {}
                    Ok(Poll::Ready(())) => run.run = None,
                    Err(_) => {
                        tracing::error!("an idempotent handler's run panicked outside the handler");
                        run.run = None;
                    }
                }
            }
            if run.run.is_none() {
                // The run is over: its answer is in the channel (or it ended without one,
                // which it cannot, but never hang the caller). Not `poll`: a receiver
                // polled with the task's cooperative budget spent says Pending even with
                // the answer there.
                return Poll::Ready(rx.try_recv().ok());
            }
            Pin::new(&mut rx).poll(cx).map(Result::ok)
        })
        .await;
        // What is left of the run now (the rest of a streamed response) is no cancel.
        run.answered = true;
        drop(run);
        answer.unwrap_or_else(|| Ok(status::handler_task_lost().into_http()))
    }
}

/// A handler's run, polled by the caller's future until the response leaves; dropped
/// before the run ends (the rest of a streamed response, or a caller that went away),
/// it hands the run to a task of its own, so the outcome is still recorded.
struct Detach {
    run: Option<Pin<Box<dyn Future<Output = ()> + Send>>>,
    /// The call's span: the caller's future polls the run inside it; a detached run
    /// is instrumented with it.
    span: tracing::Span,
    /// The runtime the call came in on, so a future dropped on another thread still
    /// detaches its run there.
    runtime: Option<tokio::runtime::Handle>,
    /// The call's trace, when an observer listens: told of a run detached by a cancel.
    trace: Option<Arc<CallTrace>>,
    /// The layer's bounds: a run detached by a cancel counts against
    /// `maxDetachedHandlers` until its task ends.
    admission: Arc<Admission>,
    /// The caller got its answer: what is left of the run is not a cancel's.
    answered: bool,
}

impl Drop for Detach {
    fn drop(&mut self) {
        let Some(run) = self.run.take() else { return };
        let cancelled = match self.trace.take() {
            Some(trace) if !self.answered => trace.detached(),
            _ => None,
        };
        let gone = (!self.answered).then(|| self.admission.detached());
        match self.runtime.take() {
            Some(rt) => {
                let run = async move {
                    run.await;
                    drop((cancelled, gone));
                };
                drop(rt.spawn(run.instrument(self.span.clone())));
            }
            // Only a future made outside any runtime gets here: the run cannot go on,
            // and its record is left to its lease.
            None => tracing::error!(
                "an idempotent handler's run was dropped outside a tokio runtime; its record stays in flight until its lease ends"
            ),
        }
    }
}

/// The handler's run: produce (forwarding as it goes), record, deliver the rest.
///
/// The handler runs inside the inbound deadline scope and a [`KeySource`] seeded with
/// the record's scope, so client calls it makes derive their keys from this call's
/// (the same keys on every run of it: a run after a crash replays downstream).
/// The claim's permit is held until the outcome is recorded (not until the caller has
/// read the rest of the response).
async fn run<S, St, ResBody>(
    call: Call<St>,
    inner: S,
    request: BufferedRequest,
    claimed: Claimed<St>,
    reply: Reply<S::Error>,
) where
    S: HandlerService<ResBody>,
    ResBody: HandlerBody,
    St: Store,
{
    let Call {
        shared,
        policy,
        scope,
        trace,
        ..
    } = call;
    let Claimed { lease, permit } = claimed;
    let (req, inbound) = request.into_request();
    let keys = KeySource::new(scope.0, super::derived_key);
    let max = policy.max_response_bytes;
    let mut out = Output {
        forward: Forwarder::new(reply, policy.response_stall_timeout, trace),
        collected: None,
    };
    // A panic anywhere (the service's `call`, its future, its response stream) ends the
    // response with INTERNAL and is recorded like any outcome, never left in flight.
    let produced = produce(inner, req, &mut out, max, lease.record());
    let produced = AssertUnwindSafe(produced).catch_unwind();
    match scope_inbound_deadline(inbound, keys.run(produced)).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => {
            // The service failed without a response: nothing is known to be done.
            let (attempted, _) = oneshot::channel();
            lease.release(attempted).await;
            out.forward.fail_service(e);
            return;
        }
        Err(_) => {
            tracing::error!("idempotent handler panicked");
            out.panicked(max);
        }
    }
    let Output { forward, collected } = out;
    let mut collected = collected.expect("a response head, or the panic's");
    // What to record is settled (and the response encoded) before the trailers move to
    // the caller's side: no copy of them is kept.
    let plan = if lease.record().is_completed() {
        // The handler's own transaction completed the record with its reply.
        None
    } else {
        Some(plan(&shared.stats, &policy, &mut collected))
    };
    let trailers = collected.trailers.take();
    drop(collected);
    let (attempted, on_attempted) = oneshot::channel();
    let deliver = async move {
        // Hold the end of the response back until the store has been asked once.
        let _ = on_attempted.await;
        forward.finish(trailers).await;
    };
    let record = async {
        let _permit = permit;
        match plan {
            None => lease.completed_elsewhere(attempted),
            Some(Plan::Release) => lease.release(attempted).await,
            Some(Plan::Complete(outcome)) => {
                lease.complete(outcome, policy.record_ttl, attempted).await;
            }
        }
    };
    tokio::join!(record, deliver);
}

/// What the handler's run has produced so far. It lives outside the future that
/// polls the handler, so it survives a panic there.
struct Output<E> {
    forward: Forwarder<E>,
    collected: Option<Collected>,
}

impl<E> Output<E> {
    /// Ends the response with INTERNAL: Trailers-Only before the head, trailers after.
    fn panicked(&mut self, max: usize) {
        match &mut self.collected {
            Some(c) => {
                let mut trailers = HeaderMap::new();
                let _ = status::handler_panicked().add_header(&mut trailers);
                c.trailers(trailers);
            }
            None => {
                let (mut head, ()) = status::handler_panicked().into_http::<()>().into_parts();
                self.collected = Some(Collected::new(&mut head, max, true));
                self.forward.head = Some(head);
            }
        }
    }
}

/// Calls the handler and reads its response to the end, forwarding and collecting it
/// (encoding it for the record unless the handler's own transaction already completed
/// the record: a completed record stays completed, so nothing would read the bytes).
async fn produce<S, ResBody>(
    mut inner: S,
    req: Request<Body>,
    out: &mut Output<S::Error>,
    max: usize,
    record: &RecordRef,
) -> Result<(), S::Error>
where
    S: Service<Request<Body>, Response = Response<ResBody>>,
    ResBody: HandlerBody,
{
    let resp = inner.call(req).await?;
    let (mut head, mut body) = resp.map(Body::new).into_parts();
    let Output { forward, collected } = out;
    let collected = collected.insert(Collected::new(&mut head, max, !record.is_completed()));
    forward.head = Some(head);
    while let Some(frame) = body.frame().await {
        let frame = match frame {
            Ok(f) => f,
            Err(status) => {
                tracing::warn!(error = %status, "idempotent handler's response body failed");
                collected.broken = true;
                forward.fail(status).await;
                return Ok(());
            }
        };
        match frame.into_data() {
            Ok(data) => {
                collected.data(&data);
                forward.data(data).await;
            }
            Err(frame) => {
                if let Ok(t) = frame.into_trailers() {
                    collected.trailers(t);
                    return Ok(());
                }
            }
        }
    }
    Ok(())
}
