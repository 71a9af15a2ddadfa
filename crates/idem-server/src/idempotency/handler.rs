//! The handler's run under a claimed record: polled inline by the caller's future, its
//! response collected for the record, the outcome recorded, then the response sent
//! whole. A streamed response (a second message) goes on in a task of its own, forwarded
//! to the caller as it is produced; a run whose caller goes away goes on in a task of
//! its own too (see [`ProtectedCall`](super::future::ProtectedCall)).

use std::future::Future;
use std::panic::AssertUnwindSafe;

use futures_util::FutureExt;
use http::{HeaderMap, Request, Response};
use http_body_util::BodyExt;
use idem_core::deadline::{InboundScope, scope_inbound_deadline};
use idem_core::derive::KeySource;
use idem_store::{Fence, RecordRef, Store};
use tokio::sync::oneshot;
use tonic::body::Body;
use tower_service::Service;

use super::admission::HandlerSlot;
use super::collect::{Collected, Plan, plan};
use super::context::{BufferedRequest, Call};
use super::forward::Forwarder;
use super::future::Running;
use super::lease::Lease;
use super::status;
use super::{HandlerBody, HandlerService};

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

/// Runs the handler for `call` under the record it claimed with `fence`, and answers.
///
/// The run is polled by the caller's own future, with no task, channel or box of its
/// own: a unary response is collected, its outcome recorded, and it leaves whole. The
/// run is marked [`Running`]: a caller that goes away meanwhile hands the whole call's
/// future to a task, which runs it to the end. A response with a second message is a
/// stream: it leaves at once, fed from a task that runs the rest. `permit` (one of the
/// layer's handler runs) is held until the outcome is recorded.
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
    let claimed = Claimed { lease, permit };
    // Counted until its outcome is recorded, wherever it runs: a drain waits for it.
    let run =
        crate::drain::protect_answering(run(call, inner, request, claimed, scheduled_renewals));
    // A panic outside the handler's own (in recording the outcome, say) ends the run
    // here: the caller gets INTERNAL and the record is left to its lease.
    let run = Running::new(AssertUnwindSafe(run).catch_unwind());
    run.map(|answer| {
        answer.unwrap_or_else(|_| {
            tracing::error!("an idempotent handler's run panicked outside the handler");
            Ok(status::handler_task_lost().into_http())
        })
    })
}

/// What [`produce`] left of the response when it returned.
enum Produced {
    /// The response ended (or failed, or panicked): it is collected whole.
    Whole,
    /// A second message arrived: the rest is a stream, read from `body` in the handler's
    /// scopes.
    Stream {
        body: Body,
        keys: Option<KeySource>,
        inbound: Option<InboundScope>,
    },
}

/// The handler's run: produce, record, answer.
///
/// The handler runs inside the inbound deadline scope and a [`KeySource`] seeded with
/// the record's scope, so client calls it makes derive their keys from this call's
/// (the same keys on every run of it: a run after a crash replays downstream).
async fn run<S, St, ResBody>(
    call: Call<St>,
    inner: S,
    request: BufferedRequest,
    claimed: Claimed<St>,
    scheduled_renewals: bool,
) -> Result<Response<Body>, S::Error>
where
    S: HandlerService<ResBody>,
    ResBody: HandlerBody,
    St: Store,
{
    if scheduled_renewals {
        tokio::task::yield_now().await;
    }
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
        forward: Forwarder::new(policy.response_stall_timeout, trace),
        collected: None,
    };
    // A panic anywhere (the service's `call`, its future, its response stream) ends the
    // response with INTERNAL and is recorded like any outcome, never left in flight.
    let produced = produce(inner, req, &mut out, max, lease.record());
    let produced = AssertUnwindSafe(produced).catch_unwind();
    match scope_inbound_deadline(inbound, keys.run(produced)).await {
        Ok(Ok(Produced::Whole)) => {}
        Ok(Ok(Produced::Stream {
            body,
            keys,
            inbound,
        })) => {
            let response = out.forward.open();
            let rest = stream(shared, policy, out, body, Claimed { lease, permit });
            let rest = scoped(keys, inbound, rest);
            drop(tokio::spawn(crate::drain::protect(rest)));
            return Ok(response);
        }
        Ok(Err(e)) => {
            // The service failed without a response: nothing is known to be done.
            // Boxed, as every release here: a rare path, kept out of the call's future.
            let (attempted, _) = oneshot::channel();
            Box::pin(lease.release(attempted)).await;
            return Err(e);
        }
        Err(_) => {
            tracing::error!("idempotent handler panicked");
            out.panicked(max);
        }
    }
    let Output { forward, collected } = out;
    let mut collected = collected.expect("a response head, or the panic's");
    let plan = record_plan(&shared, &policy, &lease, &mut collected);
    let trailers = collected.trailers.take();
    drop(collected);
    match plan {
        None => lease.completed_elsewhere(),
        Some(Plan::Release) => {
            // The answer waits until the release has landed.
            let (attempted, _) = oneshot::channel();
            Box::pin(lease.release(attempted)).await;
        }
        Some(Plan::Complete(outcome)) => {
            // The answer leaves after the first attempt; retries go on apart, holding
            // the run's permit until they end.
            if let Some(rest) = lease.complete(outcome, policy.record_ttl).await {
                drop(tokio::spawn(crate::drain::protect(async move {
                    rest.await;
                    drop(permit);
                })));
                return Ok(forward.whole(trailers));
            }
        }
    }
    drop(permit);
    Ok(forward.whole(trailers))
}

/// What to record: `None` when the handler's own transaction completed the record with
/// its reply. Settled (and the response encoded) before the trailers move to the caller's
/// side: no copy of them is kept.
fn record_plan<St>(
    shared: &super::layer::Shared<St>,
    policy: &idem_core::config::IdempotencyPolicy,
    lease: &Lease<St>,
    collected: &mut Collected,
) -> Option<Plan>
where
    St: Store,
{
    if lease.record().is_completed() {
        None
    } else {
        Some(plan(&shared.stats, policy, collected))
    }
}

/// `fut` inside the handler's scopes, as they were when the stream started.
async fn scoped<F: Future<Output = ()>>(
    keys: Option<KeySource>,
    inbound: Option<InboundScope>,
    fut: F,
) {
    match (keys, inbound) {
        (Some(k), Some(i)) => scope_inbound_deadline(i, k.run(fut)).await,
        (Some(k), None) => k.run(fut).await,
        (None, Some(i)) => scope_inbound_deadline(i, fut).await,
        (None, None) => fut.await,
    }
}

/// The rest of a streamed response, in a task of its own: forward and collect each
/// message, record, then deliver the end.
async fn stream<St: Store>(
    shared: std::sync::Arc<super::layer::Shared<St>>,
    policy: idem_core::config::IdempotencyPolicy,
    mut out: Output,
    body: Body,
    claimed: Claimed<St>,
) {
    let Claimed { lease, permit } = claimed;
    let max = policy.max_response_bytes;
    let read = AssertUnwindSafe(read_rest(body, &mut out)).catch_unwind();
    if read.await.is_err() {
        tracing::error!("idempotent handler panicked");
        out.panicked(max);
    }
    let Output { forward, collected } = out;
    let mut collected = collected.expect("a response head");
    let plan = record_plan(&shared, &policy, &lease, &mut collected);
    let trailers = collected.trailers.take();
    drop(collected);
    let _permit = permit;
    match plan {
        None => {
            lease.completed_elsewhere();
            forward.finish(trailers).await;
        }
        Some(Plan::Release) => {
            let (attempted, _) = oneshot::channel();
            lease.release(attempted).await;
            forward.finish(trailers).await;
        }
        Some(Plan::Complete(outcome)) => {
            // Hold the end of the response back until the store has been asked once.
            let rest = lease.complete(outcome, policy.record_ttl).await;
            let rest = async {
                if let Some(rest) = rest {
                    rest.await;
                }
            };
            tokio::join!(rest, forward.finish(trailers));
        }
    }
}

/// What the handler's run has produced so far. It lives outside the future that
/// polls the handler, so it survives a panic there.
struct Output {
    forward: Forwarder,
    collected: Option<Collected>,
}

impl Output {
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

    /// One more frame of the response: collected, and held back or forwarded. `Err`:
    /// the frame was the response's end (its trailers).
    fn frame(&mut self, frame: http_body::Frame<bytes::Bytes>) -> Result<(), ()> {
        let collected = self.collected.as_mut().expect("a response head");
        match frame.into_data() {
            Ok(data) => {
                collected.data(&data);
                self.forward.data(data);
                Ok(())
            }
            Err(frame) => match frame.into_trailers() {
                Ok(t) => {
                    collected.trailers(t);
                    Err(())
                }
                Err(_) => Ok(()),
            },
        }
    }

    /// The body failed mid-way: no complete response exists.
    fn failed(&mut self, status: tonic::Status) {
        tracing::warn!(error = %status, "idempotent handler's response body failed");
        if let Some(c) = self.collected.as_mut() {
            c.broken = true;
        }
        self.forward.fail(status);
    }
}

/// Calls the handler and reads its response until it ends or a second message arrives
/// (a stream: the rest is read by [`stream`]), collecting it (encoding it for the record
/// unless the handler's own transaction already completed the record: a completed record
/// stays completed, so nothing would read the bytes).
async fn produce<S, ResBody>(
    mut inner: S,
    req: Request<Body>,
    out: &mut Output,
    max: usize,
    record: &RecordRef,
) -> Result<Produced, S::Error>
where
    S: Service<Request<Body>, Response = Response<ResBody>>,
    ResBody: HandlerBody,
{
    let resp = inner.call(req).await?;
    let (mut head, mut body) = resp.map(Body::new).into_parts();
    out.collected = Some(Collected::new(&mut head, max, !record.is_completed()));
    out.forward.head = Some(head);
    while let Some(frame) = body.frame().await {
        let frame = match frame {
            Ok(f) => f,
            Err(status) => {
                out.failed(status);
                return Ok(Produced::Whole);
            }
        };
        if out.frame(frame).is_err() {
            return Ok(Produced::Whole);
        }
        if out.forward.is_stream() {
            return Ok(Produced::Stream {
                body,
                keys: KeySource::current(),
                inbound: idem_core::deadline::current_scope(),
            });
        }
    }
    Ok(Produced::Whole)
}

/// Reads the rest of a streamed response, forwarding and collecting it.
async fn read_rest(mut body: Body, out: &mut Output) {
    // The frames held back when the stream was found out.
    out.forward.flush().await;
    while let Some(frame) = body.frame().await {
        let frame = match frame {
            Ok(f) => f,
            Err(status) => {
                // Queued, not sent: the error is the response's end, which leaves once
                // the outcome (a release) has landed, so a retry right after it runs.
                out.failed(status);
                return;
            }
        };
        let end = out.frame(frame).is_err();
        out.forward.flush().await;
        if end {
            return;
        }
    }
}
