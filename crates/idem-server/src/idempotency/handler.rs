//! The handler's run under a claimed record: polled by the caller's future, and moved to
//! a task of its own if that future goes away first (a caller that goes away does not
//! cancel it), its response forwarded to the caller as it is produced and
//! collected for the record, then its outcome recorded.

use std::collections::VecDeque;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;

use bytes::Bytes;
use futures_util::FutureExt;
use http::{HeaderMap, Request, Response};
use http_body::Frame;
use http_body_util::{BodyExt, StreamBody};
use idem_core::config::IdempotencyPolicy;
use idem_core::deadline::scope_inbound_deadline;
use idem_core::derive::KeySource;
use idem_store::response::{EncodedSize, ResponseEncoder};
use idem_store::{Fence, RecordRef, Store, StoredOutcome};
use tokio::sync::{OwnedSemaphorePermit, mpsc, oneshot};
use tokio::time::Duration;
use tonic::body::Body;
use tonic::{Code, Status};
use tower_service::Service;
use tracing::Instrument;

use super::body::ReplayBody;
use super::context::{BufferedRequest, Call};
use super::decision::{self, IdemDecision, Origin};
use super::lease::Lease;
use super::stats::Counter;
use super::status;
use super::{HandlerBody, HandlerService};
use crate::metrics::{BodyEnd, CallTrace};

/// The fence under which a protected handler runs, as a request extension. Pass it to
/// downstream writes that can check it (a write carrying a lower fence than one already
/// seen comes from a run whose lease was taken over).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RecordFence(pub Fence);

type Reply<E> = oneshot::Sender<Result<Response<Body>, E>>;

/// What a handler's run holds until its outcome is recorded: the lease on the record its
/// call claimed, and one of the layer's handler runs (`maxHandlersInFlight`).
struct Claimed<St> {
    lease: Lease<St>,
    permit: OwnedSemaphorePermit,
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
    permit: OwnedSemaphorePermit,
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
    let mut run = Detach {
        trace,
        answered: false,
        run: Some(Box::pin(run(
            call,
            inner,
            request,
            Claimed { lease, permit },
            tx,
        ))),
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
        match self.runtime.take() {
            Some(rt) => {
                let run = async move {
                    run.await;
                    drop(cancelled);
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

/// What becomes of the record: released, or completed with this outcome.
enum Plan {
    Release,
    Complete(StoredOutcome),
}

/// Whether the record is completed (with the response encoded, or as not retained) or
/// released, by what the handler produced.
fn plan(
    stats: &super::IdempotencyStats,
    policy: &IdempotencyPolicy,
    collected: &mut Collected,
) -> Plan {
    let origin = collected.origin();
    let code = collected.code();
    let cacheable = policy.cacheable_status_codes;
    if !decision::keep(origin, code, collected.decision, cacheable) {
        if origin == Origin::BeforeHandler {
            tracing::info!("the service refused the request before its handler ran: released");
        }
        return Plan::Release;
    }
    match collected.encode() {
        Some(bytes) => Plan::Complete(StoredOutcome::Response(bytes)),
        None => {
            stats.inc(Counter::not_retained);
            let max = policy.max_response_bytes;
            tracing::warn!(
                max,
                "response over the size limit: recorded as not retained"
            );
            Plan::Complete(StoredOutcome::NotRetained)
        }
    }
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

/// The response as it will be stored, encoded as it arrives within the size limit.
struct Collected {
    /// The record's bytes so far; `None` once over the limit, or when nothing is to be
    /// recorded (the handler's own transaction completed the record).
    encoded: Option<ResponseEncoder>,
    /// The response's trailers, until they move to the caller's side.
    trailers: Option<HeaderMap>,
    /// The head's `grpc-status` (a Trailers-Only response's code).
    head_code: Option<Code>,
    /// The head is tonic's own refusal of a request it could not decode.
    decode_refusal: bool,
    frames: usize,
    size: EncodedSize,
    max: usize,
    decision: Option<IdemDecision>,
    /// The body failed mid-way: no complete response exists.
    broken: bool,
}

impl Collected {
    /// Starts from the response head, taking the handler's decision out of it; `encode`
    /// says whether the response is to be recorded.
    fn new(head: &mut http::response::Parts, max: usize, encode: bool) -> Self {
        let from_extension = head.extensions.remove::<IdemDecision>();
        let decision = decision::take_decision(&mut head.headers).or(from_extension);
        let size = EncodedSize::of_head(&head.headers);
        let head_code = decision::grpc_status(&head.headers);
        Collected {
            encoded: (encode && size.bytes() <= max)
                .then(|| ResponseEncoder::new(head.status, &head.headers)),
            trailers: None,
            head_code,
            decode_refusal: head_code == Some(Code::Internal)
                && decision::is_decode_refusal(&head.headers),
            frames: 0,
            size,
            max,
            decision,
            broken: false,
        }
    }

    fn data(&mut self, data: &Bytes) {
        self.frames += 1;
        self.size.add_frame(data);
        self.drop_over_limit();
        if let Some(e) = &mut self.encoded {
            e.frame(data);
        }
    }

    fn trailers(&mut self, mut t: HeaderMap) {
        self.decision = decision::take_decision(&mut t).or(self.decision);
        self.size.add_trailers(&t);
        self.drop_over_limit();
        self.trailers = Some(t);
    }

    /// A response over the size limit is not kept: its record says so instead.
    fn drop_over_limit(&mut self) {
        if self.size.bytes() > self.max {
            self.encoded = None;
        }
    }

    /// The record's bytes: the response as collected, with its trailers; `None` when it
    /// is over the size limit.
    fn encode(&mut self) -> Option<Bytes> {
        let encoded = self.encoded.take()?;
        Some(encoded.finish(self.trailers.as_ref()))
    }

    /// The response's code: its trailers' `grpc-status`, else the Trailers-Only
    /// head's; a response without one counts as UNKNOWN.
    fn code(&self) -> Code {
        let from_trailers = self.trailers.as_ref().and_then(decision::grpc_status);
        from_trailers.or(self.head_code).unwrap_or(Code::Unknown)
    }

    fn origin(&self) -> Origin {
        let within_limit = self.size.bytes() <= self.max;
        let trailers_only = self.frames == 0 && within_limit && self.trailers.is_none();
        if self.broken {
            Origin::Broken
        } else if trailers_only && self.decode_refusal {
            Origin::BeforeHandler
        } else {
            Origin::Handler
        }
    }
}

/// Sends the response to the caller as it is produced. The newest data frame is held
/// back until the next one arrives, so the last one leaves with the trailers (and a
/// unary response leaves whole, head included) after the outcome is recorded: a caller
/// that saw the end of its response and retries finds the record completed, and the
/// end goes out in one write, not a trailing small one that Nagle's algorithm would
/// hold for the peer's delayed ACK.
struct Forwarder<E> {
    reply: Option<Reply<E>>,
    /// The head, until the first frame is forwarded.
    head: Option<http::response::Parts>,
    tx: Option<mpsc::Sender<Result<Frame<Bytes>, Status>>>,
    pending: Option<Bytes>,
    /// How long a frame may wait for the caller to make room (`responseStallTimeout`).
    stall: Duration,
    /// The call's trace, for a response delivered whole: its body reports its end.
    trace: Option<Arc<CallTrace>>,
}

impl<E> Forwarder<E> {
    fn new(reply: Reply<E>, stall: Duration, trace: Option<Arc<CallTrace>>) -> Self {
        Forwarder {
            reply: Some(reply),
            head: None,
            tx: None,
            pending: None,
            stall,
            trace,
        }
    }

    async fn data(&mut self, data: Bytes) {
        if let Some(prev) = self.pending.replace(data) {
            self.open();
            self.send(Ok(Frame::data(prev))).await;
        }
    }

    /// The body failed mid-way: the caller gets what came before, then the error.
    async fn fail(&mut self, status: Status) {
        self.open();
        if let Some(prev) = self.pending.take() {
            self.send(Ok(Frame::data(prev))).await;
        }
        self.send(Err(status)).await;
    }

    fn fail_service(mut self, e: E) {
        if let Some(r) = self.reply.take() {
            let _ = r.send(Err(e));
        }
    }

    /// Sends the head with a body fed from here, once. The run goes on (and records
    /// the outcome) when that body is dropped because the caller went away.
    fn open(&mut self) {
        if let Some(head) = self.head.take() {
            let (tx, mut rx) = mpsc::channel(16);
            self.tx = Some(tx);
            let frames = futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx));
            let body = Body::new(StreamBody::new(frames));
            self.respond(Response::from_parts(head, body));
        }
    }

    fn respond(&mut self, resp: Response<Body>) {
        if let Some(r) = self.reply.take() {
            let _ = r.send(Ok(resp));
        }
    }

    /// Sends one frame to the caller, waiting at most `stall` for room. A caller that
    /// went away, or that has read nothing for that long, is sent nothing more: its
    /// stream ends (without trailers, which its client reports as an error), and the run
    /// goes on to record its outcome.
    async fn send(&mut self, item: Result<Frame<Bytes>, Status>) {
        let Some(tx) = &self.tx else { return };
        // Room now (the usual case): no timer.
        let item = match tx.try_send(item) {
            Ok(()) => return,
            Err(mpsc::error::TrySendError::Closed(_)) => {
                self.tx = None;
                return;
            }
            Err(mpsc::error::TrySendError::Full(item)) => item,
        };
        match tokio::time::timeout(self.stall, tx.send(item)).await {
            Ok(Ok(())) => {}
            Ok(Err(_)) => self.tx = None,
            Err(_) => {
                tracing::warn!(
                    stall_ms = u64::try_from(self.stall.as_millis()).unwrap_or(u64::MAX),
                    "the caller has read nothing of its streamed response for responseStallTimeout: its stream is ended; the handler's outcome is still recorded"
                );
                self.tx = None;
            }
        }
    }

    /// Delivers what was held back, once the outcome is recorded: the head too when no
    /// frame was forwarded (a Trailers-Only or single-message response).
    async fn finish(mut self, trailers: Option<HeaderMap>) {
        if let Some(head) = self.head.take() {
            let body = if self.pending.is_none() && trailers.is_none() {
                Body::empty()
            } else {
                let end = self.trace.take().map(BodyEnd::new);
                Body::new(ReplayBody::new(
                    VecDeque::new(),
                    self.pending.take(),
                    trailers,
                    end,
                ))
            };
            self.respond(Response::from_parts(head, body));
            return;
        }
        if let Some(last) = self.pending.take() {
            self.send(Ok(Frame::data(last))).await;
        }
        if let Some(t) = trailers {
            self.send(Ok(Frame::trailers(t))).await;
        }
    }
}
