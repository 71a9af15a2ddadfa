//! A protected call after routing: read the request, claim its record, then run the
//! handler, replay the stored response, refuse, or wait for the call in flight.

use std::collections::VecDeque;
use std::future::Future;
use std::panic::AssertUnwindSafe;

use bytes::Bytes;
use futures_util::FutureExt;
use http::{HeaderValue, Request, Response};
use idem_core::config::InFlightPolicy;
use idem_core::deadline::scope_inbound_deadline;
use idem_core::headers;
use idem_store::response::StoredResponse;
use idem_store::{Claim, ClaimRequest, ClaimantId, Fingerprint, Store, StoreError, StoredOutcome};
use tokio::sync::oneshot;
use tokio::time::{Duration, Instant};
use tonic::body::Body;
use tower_service::Service;

use super::admission::{Bound, HandlerSlot, WaiterSlot};
use super::body::ReplayBody;
use super::context::{BufferedRequest, Call};
use super::future::Phases;
use super::handler;
use super::request::{ReadRequest, read_request};
use super::stats::Counter;
use super::status;
use super::{HandlerBody, HandlerService};
use crate::metrics::BodyEnd;

/// What [`Call::decide`] came to: the caller's answer, or a claimed record whose
/// handler is to run.
#[expect(
    clippy::large_enum_variant,
    reason = "returned once per call and moved straight into the handler's run: a box \
              would cost every call an allocation"
)]
pub(crate) enum Decided<St, S, E> {
    Answer(Result<Response<Body>, E>),
    Run(Acquired<St, S>),
}

/// A call whose claim acquired its record, with all its handler's run needs.
pub(crate) struct Acquired<St, S> {
    call: Call<St>,
    inner: S,
    request: BufferedRequest,
    fence: idem_store::Fence,
    slot: HandlerSlot,
}

/// The handler's run of an [`Acquired`] call ([`handler::execute`]).
fn execute<S, St, ResBody>(
    acquired: Acquired<St, S>,
) -> impl Future<Output = Result<Response<Body>, S::Error>> + Send
where
    S: HandlerService<ResBody>,
    ResBody: HandlerBody,
    St: Store,
{
    let Acquired {
        call,
        inner,
        request,
        fence,
        slot,
    } = acquired;
    handler::execute(call, inner, request, fence, slot)
}

impl<St: Store> Call<St> {
    /// Reads the request, claims its record, and answers: the handler's run, a replay,
    /// a refusal, or (after waiting for the call in flight) a claim again.
    ///
    /// Two futures one after the other ([`Phases`]), not one `async fn` that awaits the
    /// run: an `async fn` keeps room for the run's future (about 3 KB) beside the
    /// temporary it is built in, and the call's boxed future came to 7.6 KB, copied
    /// into its box and held for every call in flight. As two phases it is the larger
    /// of the two.
    pub(crate) fn run<S, ResBody>(
        self,
        inner: S,
        parts: http::request::Parts,
        body: Body,
    ) -> impl Future<Output = Result<Response<Body>, S::Error>> + Send
    where
        S: HandlerService<ResBody>,
        ResBody: HandlerBody,
    {
        Phases::new(self.decide(inner, parts, body), execute::<S, St, ResBody>)
    }

    /// Reads the request and claims its record: the answer (a replay, a refusal, after
    /// waiting for the call in flight a claim again), or the acquired record for the
    /// handler's run.
    async fn decide<S, ResBody>(
        self,
        inner: S,
        parts: http::request::Parts,
        body: Body,
    ) -> Decided<St, S, S::Error>
    where
        S: HandlerService<ResBody>,
        ResBody: HandlerBody,
    {
        let hook = self.shared.hooks.get(parts.uri.path());
        let request = read_request(body, &parts.headers, &self.policy, hook).await;
        let ReadRequest { body, fingerprint } = match request {
            Ok(r) => r,
            Err(status) => return Decided::Answer(Ok(self.refuse("rejected", status))),
        };
        let (mut request, deadline) = BufferedRequest::new(parts, body);

        let claimant = ClaimantId::random();
        // Held while this call waits for the call in flight with its key; `Some` once it
        // has seen its record in flight (and dropped its body).
        let mut waiter: Option<WaiterSlot> = None;
        loop {
            let waited = waiter.is_some();
            // A handler run to be, if the claim is acquired (replays need none). A call
            // that waited has only its fingerprint left, and never runs.
            let admission = &self.shared.admission;
            let slot = (!waited).then(|| admission.run(self.tenant, self.single_tenant));
            let claim = match self.claim(&fingerprint, claimant).await {
                Ok(claim) => claim,
                Err(e) => {
                    // Boxed: a rare path whose future holds the service's own, which
                    // would otherwise enlarge every protected call's future.
                    return Decided::Answer(
                        Box::pin(self.store_failed(e, inner, request, slot)).await,
                    );
                }
            };
            match claim {
                Claim::Acquired { fence, takeover } => {
                    let slot = match slot {
                        Some(Ok(slot)) => slot,
                        Some(Err(bound)) => {
                            // Boxed: a rare path (it gives the record back).
                            let refused = Box::pin(self.overloaded_after_claim(fence, bound));
                            return Decided::Answer(Ok(refused.await));
                        }
                        None => {
                            let ended = Box::pin(self.ended_while_waiting(fence));
                            return Decided::Answer(Ok(ended.await));
                        }
                    };
                    self.shared.stats.inc(Counter::executed);
                    self.outcome("executed");
                    tracing::Span::current().record("fence", fence);
                    if takeover {
                        tracing::warn!(fence, "took over an in-flight record whose lease ended");
                    }
                    return Decided::Run(Acquired {
                        call: self,
                        inner,
                        request,
                        fence,
                        slot,
                    });
                }
                Claim::Completed(StoredOutcome::Response(bytes)) => {
                    return Decided::Answer(Ok(self.replay(bytes, waited)));
                }
                Claim::Completed(StoredOutcome::NotRetained) => {
                    self.shared.stats.inc(Counter::not_retained_hits);
                    let answer = self.answer("not_retained", status::response_not_retained());
                    return Decided::Answer(Ok(answer));
                }
                Claim::Mismatch => {
                    self.shared.stats.inc(Counter::mismatched);
                    return Decided::Answer(Ok(self.answer("mismatch", status::key_reused())));
                }
                Claim::InFlight { lease_remaining } => {
                    drop(slot);
                    if !waited && self.policy.in_flight == InFlightPolicy::Wait {
                        match admission.wait(self.tenant, self.single_tenant) {
                            Ok(w) => waiter = Some(w),
                            Err(bound) => return Decided::Answer(Ok(self.too_many_waiting(bound))),
                        }
                        // A waiter needs the fingerprint, not the body: it is dropped
                        // here (a 2 MiB request no longer costs 2 MiB per duplicate, nor
                        // pins the connection's read buffer it may be a slice of). So a
                        // waiter never runs: if the call it waits for ends without an
                        // outcome, it answers with a retry delay and its retry runs.
                        request.body = Bytes::new();
                    }
                    let first_wait = !waited;
                    // Boxed, as above: only duplicates wait.
                    let wait = Box::pin(self.in_flight(lease_remaining, deadline, first_wait));
                    if let Some(resp) = wait.await {
                        return Decided::Answer(Ok(resp));
                    }
                }
            }
        }
    }

    /// Claims the record. A claim that fails transiently is sent once more with the same
    /// claimant id: it may have been applied with only its reply lost (a timeout), and
    /// the store recognises the claimant instead of leaving the record held until its
    /// lease ends.
    async fn claim(
        &self,
        fingerprint: &Fingerprint,
        claimant: ClaimantId,
    ) -> Result<Claim, StoreError> {
        let request = ClaimRequest {
            scope: &self.scope,
            tenant: &self.tenant,
            fingerprint,
            claimant,
            lease: self.policy.lease_ttl,
        };
        let pending = PendingClaim::new(&self.shared.store, request);
        let claimed = match self.shared.store.claim(request).await {
            Err(StoreError::Unavailable(e)) => {
                self.shared.stats.inc(Counter::store_errors);
                tracing::debug!(error = %e, "claim failed; sending it again once");
                self.shared.store.claim(request).await
            }
            r => r,
        };
        pending.answered();
        claimed
    }

    /// The store could not claim: refuse (full, or fail closed), or run without a
    /// record on a fail-open method. A call that waited (`slot` `None`) has seen its
    /// record in flight: another claimant may still be running it, so it is refused
    /// (retryable) fail-open or not; running it here would be a second run of the key.
    async fn store_failed<S, ResBody>(
        self,
        e: StoreError,
        mut inner: S,
        request: BufferedRequest,
        slot: Option<Result<HandlerSlot, Bound>>,
    ) -> Result<Response<Body>, S::Error>
    where
        S: Service<Request<Body>, Response = Response<ResBody>>,
        ResBody: HandlerBody,
    {
        let stats = &self.shared.stats;
        if let StoreError::Full(cause) = &e {
            stats.inc(Counter::store_full);
            let bound = idem_store::memory::MemoryBound::refused(&e).map(|b| b.as_str());
            tracing::warn!(error = %cause, bound = bound.unwrap_or("unnamed"), scope = %self.short_scope(), "idempotency store full: refusing the call");
            self.trace_reason(bound);
            return Ok(self.answer("store_full", status::store_full(bound)));
        }
        stats.inc(Counter::store_errors);
        let Some(slot) = slot else {
            tracing::warn!(error = %e, scope = %self.short_scope(), "idempotency store failed after waiting for the call in flight: refusing the call");
            return Ok(self.store_unavailable_in_flight());
        };
        if !self.policy.fail_open {
            tracing::warn!(error = %e, scope = %self.short_scope(), "idempotency store failed: refusing the call");
            return Ok(self.answer("store_unavailable", status::store_unavailable()));
        }
        let slot = match slot {
            Ok(slot) => slot,
            Err(bound) => return Ok(self.overloaded(bound)),
        };
        stats.inc(Counter::fail_open_runs);
        self.outcome("fail_open");
        tracing::warn!(error = %e, scope = %self.short_scope(), "idempotency store failed; method is fail-open: running without a record");
        let (req, inbound) = request.into_request();
        // A panic in the service (its `call` or its future) answers INTERNAL, as on a
        // claimed run, instead of unwinding out of the layer.
        let run =
            AssertUnwindSafe(async move { scope_inbound_deadline(inbound, inner.call(req)).await });
        let resp = run.catch_unwind().await;
        drop(slot);
        match resp {
            Ok(resp) => resp.map(|r| r.map(Body::new)),
            Err(_) => {
                tracing::error!("idempotent handler panicked (fail-open run, no record)");
                Ok(status::handler_panicked().into_http())
            }
        }
    }

    /// Another claimant holds the record: abort, or wait for a change (up to the
    /// caller's deadline, and at most to the lease's end, to take an abandoned record
    /// over). `None`: claim again.
    async fn in_flight(
        &self,
        lease_remaining: Duration,
        deadline: Option<Instant>,
        first_wait: bool,
    ) -> Option<Response<Body>> {
        let stats = &self.shared.stats;
        stats.inc(Counter::in_flight_hits);
        if self.policy.in_flight == InFlightPolicy::Abort {
            stats.inc(Counter::aborted);
            let status = status::in_progress_aborted(self.policy.abort_retry_delay);
            return Some(self.answer("aborted", status));
        }
        if first_wait {
            stats.inc(Counter::waited);
        }
        let now = Instant::now();
        if deadline.is_some_and(|d| d <= now) {
            return Some(self.deadline_exceeded());
        }
        let lease_end = now + lease_remaining;
        let until = deadline.map_or(lease_end, |d| d.min(lease_end));
        if let Err(e) = self.shared.store.wait(&self.scope, until).await {
            stats.inc(Counter::store_errors);
            tracing::warn!(error = %e, scope = %self.short_scope(), "idempotency store failed while waiting");
            return Some(self.store_unavailable_in_flight());
        }
        if deadline.is_some_and(|d| d <= Instant::now()) {
            return Some(self.deadline_exceeded());
        }
        None
    }

    fn replay(&self, bytes: Bytes, waited: bool) -> Response<Body> {
        let stored = match StoredResponse::decode(bytes) {
            Ok(s) => s,
            Err(e) => {
                self.shared.stats.inc(Counter::store_errors);
                tracing::error!(error = %e, scope = %self.short_scope(), "stored response does not decode");
                return self.answer("store_unavailable", status::stored_response_unreadable());
            }
        };
        self.shared.stats.inc(Counter::replayed);
        self.outcome(if waited { "waited" } else { "replayed" });
        let StoredResponse {
            status,
            mut headers,
            frames,
            trailers,
        } = stored;
        headers.insert(
            headers::IDEMPOTENCY_REPLAYED,
            HeaderValue::from_static("true"),
        );
        let body = if frames.is_empty() && trailers.is_none() {
            Body::empty()
        } else {
            let end = self.trace.clone().map(BodyEnd::new);
            Body::new(ReplayBody::new(VecDeque::from(frames), None, trailers, end))
        };
        let mut resp = Response::new(body);
        *resp.status_mut() = status;
        *resp.headers_mut() = headers;
        resp
    }

    /// The store failed after this call saw its record in flight: UNAVAILABLE with a
    /// retry delay (`abortRetryDelay`, the delay for a call in progress), never a run.
    fn store_unavailable_in_flight(&self) -> Response<Body> {
        let status = status::store_unavailable_retry_after(self.policy.abort_retry_delay);
        self.answer("store_unavailable", status)
    }

    fn deadline_exceeded(&self) -> Response<Body> {
        self.shared.stats.inc(Counter::deadline_exceeded);
        self.answer("waited_deadline", status::in_progress_past_deadline())
    }

    /// Claimed, but no handler run is free under `bound`: give the record back and
    /// refuse.
    async fn overloaded_after_claim(
        &self,
        fence: idem_store::Fence,
        bound: Bound,
    ) -> Response<Body> {
        self.give_back(fence).await;
        self.overloaded(bound)
    }

    /// Gives back the record this call claimed with `fence` and will not run, and waits
    /// until the release has landed (or been given up). The release runs in a task of
    /// its own: a caller that goes away meanwhile does not cancel it, which would leave
    /// the key held, with no run behind it, until its lease ends.
    async fn give_back(&self, fence: idem_store::Fence) {
        let (landed, released) = oneshot::channel();
        let release = self.lease(fence).release(landed);
        drop(tokio::spawn(crate::drain::protect(release)));
        let _ = released.await;
    }

    fn overloaded(&self, bound: Bound) -> Response<Body> {
        self.shared.stats.inc(Counter::overloaded);
        let limit = self.shared.admission.limits.of(bound, self.single_tenant);
        tracing::warn!(limit, bound = bound.as_str(), scope = %self.short_scope(), "too many idempotent handlers running: refusing the call");
        self.trace_reason(Some(bound.as_str()));
        self.answer("overloaded", status::overloaded(bound, limit))
    }

    /// The key is in flight and no room is left to wait under `bound`: refuse, with a
    /// retry delay.
    fn too_many_waiting(&self, bound: Bound) -> Response<Body> {
        self.shared.stats.inc(Counter::waiters_refused);
        let limit = self.shared.admission.limits.of(bound, self.single_tenant);
        tracing::warn!(limit, bound = bound.as_str(), scope = %self.short_scope(), "too many duplicates waiting: refusing the call");
        self.trace_reason(Some(bound.as_str()));
        self.answer("too_many_waiting", status::too_many_waiting(bound, limit))
    }

    /// This call waited, and its claim after the wait acquired the record: the call it
    /// waited for ended without an outcome (released, or its lease ended). Having kept
    /// only the fingerprint, it cannot run: give the record back and answer UNAVAILABLE
    /// with a short retry delay; the retry carries the request and runs.
    async fn ended_while_waiting(&self, fence: idem_store::Fence) -> Response<Body> {
        self.give_back(fence).await;
        self.shared.stats.inc(Counter::ended_while_waiting);
        self.answer("in_progress_ended", status::in_progress_ended())
    }
}

/// A claim on its way to the store. Dropped before its answer (the caller went away
/// meanwhile), it may have landed with nobody left to run it: the key would stay held,
/// with no run and no renewal, until its lease ended. So a task sends the claim again
/// with the same claimant (the store answers a claimant's own re-claim with the fence
/// it holds) and gives back a record that it finds acquired. Borrowed until then: a
/// claim that is answered (every call's) copies nothing.
struct PendingClaim<'a, St: Store> {
    store: &'a St,
    /// `None` once the claim was answered.
    request: Option<ClaimRequest<'a>>,
}

impl<'a, St: Store> PendingClaim<'a, St> {
    fn new(store: &'a St, request: ClaimRequest<'a>) -> Self {
        PendingClaim {
            store,
            request: Some(request),
        }
    }

    /// The claim was answered: its caller has what it needs.
    fn answered(mut self) {
        self.request = None;
    }
}

impl<St: Store> Drop for PendingClaim<'_, St> {
    fn drop(&mut self) {
        let Some(r) = self.request.take() else { return };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let store = self.store.clone();
        let (scope, tenant, fingerprint) = (*r.scope, *r.tenant, *r.fingerprint);
        let (claimant, lease) = (r.claimant, r.lease);
        let give_back = async move {
            let request = ClaimRequest {
                scope: &scope,
                tenant: &tenant,
                fingerprint: &fingerprint,
                claimant,
                lease,
            };
            // Acquired: by the claim that was cut off (same fence), or by this one if
            // that never reached the store. Anything else is not this claimant's.
            if let Ok(Claim::Acquired { fence, .. }) = store.claim(request).await
                && let Err(e) = store.release(&scope, fence).await
            {
                tracing::debug!(error = %e, fence, "a cancelled call's claim could not be given back; its record is left to its lease");
            }
        };
        drop(runtime.spawn(crate::drain::protect(give_back)));
    }
}
