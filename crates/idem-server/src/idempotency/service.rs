//! [`Idempotency`] and the life of a protected call.

use std::collections::{HashMap, VecDeque};
use std::convert::Infallible;
use std::fmt;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use futures_util::FutureExt;
use http::{HeaderMap, HeaderValue, Request, Response};
use http_body::{Body as _, Frame};
use http_body_util::{BodyExt, Full};
use idem_core::IdempotencyKey;
use idem_core::config::{IdempotencyPolicy, InFlightPolicy};
use idem_core::deadline::{InboundScope, scope_inbound_deadline};
use idem_core::headers::{self, reason};
use idem_core::key::KEY_RULE;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tonic::body::Body;
use tonic::{Code, Status};
use tonic_types::{ErrorDetails, StatusExt};
use tower_service::Service;
use tracing::{Instrument, field};

use super::body::{ChannelBody, ReplayBody};
use super::codec::{StoredResponse, headers_len};
use super::digest::{scope_for, tenant_id};
use super::future::ResponseFuture;
use super::layer::{IdempotencyLayer, Shared};
use super::request;
use idem_store::{
    Claim, ClaimRequest, ClaimantId, Fence, Fingerprint, Scope, Store, StoreError, StoredOutcome,
    TenantId,
};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Response header a handler may set to override the method's code lists for this one
/// response: `store` (record and replay it) or `release` (nothing was committed; let a
/// retry run again). Works on OK responses and on errors (as `Status` metadata). The
/// layer removes it (from headers and trailers) before the response leaves.
pub const DECISION_HEADER: &str = "x-idempotency-decision";

/// A handler's verdict on its own response, overriding the method's
/// `cacheableStatusCodes` / `releaseStatusCodes`. Insert it as a response extension
/// (`tonic::Response::extensions_mut`), or send [`DECISION_HEADER`] (needed for errors,
/// which carry no extensions).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IdemDecision {
    /// Record this response and replay it to duplicates.
    Store,
    /// Nothing was committed: release the record so a retry runs again.
    Release,
}

/// The fence under which a protected handler runs, as a request extension. Pass it to
/// downstream writes that can check it (a write carrying a lower fence than one already
/// seen comes from a run whose lease was taken over).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RecordFence(pub Fence);

/// The idempotency middleware; see the [module docs](super).
pub struct Idempotency<S, St> {
    pub(crate) inner: S,
    pub(crate) shared: Arc<Shared<St>>,
}

impl<S: Clone, St> Clone for Idempotency<S, St> {
    fn clone(&self) -> Self {
        Idempotency {
            inner: self.inner.clone(),
            shared: self.shared.clone(),
        }
    }
}

impl<S: fmt::Debug, St: fmt::Debug> fmt::Debug for Idempotency<S, St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Idempotency")
            .field("inner", &self.inner)
            .field("store", &self.shared.store)
            .finish_non_exhaustive()
    }
}

impl<S, St: Store> Idempotency<S, St> {
    /// Wraps `inner` with the settings of `layer`.
    pub fn new(inner: S, layer: &IdempotencyLayer<St>) -> Self {
        Idempotency {
            inner,
            shared: layer.shared.clone(),
        }
    }

    /// Returns a layer wrapping services with these settings (a clone of `layer`).
    pub fn layer(layer: &IdempotencyLayer<St>) -> IdempotencyLayer<St> {
        layer.clone()
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Unwraps the inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

/// What `call` decided before any I/O.
enum Route {
    Passthrough,
    Reject(Status),
    Protect { key: IdempotencyKey, tenant: String },
}

pub(super) fn idem_status(code: Code, message: impl Into<String>, why: &str) -> Status {
    Status::with_error_details(
        code,
        message,
        ErrorDetails::with_error_info(why, headers::ERROR_DOMAIN, HashMap::<String, String>::new()),
    )
}

fn route(
    shared: &Shared<impl Store>,
    policy: &IdempotencyPolicy,
    parts: &http::request::Parts,
) -> Route {
    let header = &shared.config.settings().key_header;
    let mut values = parts.headers.get_all(header).iter();
    let key = match (values.next(), values.next()) {
        (None, _) if !policy.key_required => return Route::Passthrough,
        (None, _) => {
            return Route::Reject(idem_status(
                Code::InvalidArgument,
                format!("missing idempotency key ({header}): {KEY_RULE}"),
                reason::KEY_MISSING,
            ));
        }
        (Some(_), Some(_)) => {
            return Route::Reject(idem_status(
                Code::InvalidArgument,
                format!("idempotency key ({header}) sent more than once: {KEY_RULE}"),
                reason::KEY_INVALID,
            ));
        }
        (Some(v), None) => match IdempotencyKey::parse(v.as_bytes()) {
            Ok(k) => k,
            Err(e) => {
                return Route::Reject(idem_status(
                    Code::InvalidArgument,
                    e.to_string(),
                    reason::KEY_INVALID,
                ));
            }
        },
    };
    match shared.tenant.tenant(parts) {
        Some(tenant) => Route::Protect { key, tenant },
        None => Route::Reject(idem_status(
            Code::Unauthenticated,
            "no tenant for an idempotent call: authenticate first",
            reason::TENANT_MISSING,
        )),
    }
}

impl<S, St, ResBody> Service<Request<Body>> for Idempotency<S, St>
where
    S: Service<Request<Body>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ResBody: http_body::Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
    St: Store,
{
    type Response = Response<Body>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        let Some(policy) = self
            .shared
            .config
            .lookup_path(req.uri().path())
            .and_then(|m| m.idempotency())
        else {
            return ResponseFuture::passthrough(self.inner.call(req));
        };
        let (parts, body) = req.into_parts();
        match route(&self.shared, policy, &parts) {
            Route::Passthrough => {
                ResponseFuture::passthrough(self.inner.call(Request::from_parts(parts, body)))
            }
            Route::Reject(status) => {
                self.shared.stats.inc(|c| &c.rejected);
                tracing::info!(method = parts.uri.path(), outcome = "rejected", code = ?status.code(), "{}", status.message());
                ResponseFuture::ready(status.into_http())
            }
            Route::Protect { key, tenant } => {
                let policy = policy.clone();
                let clone = self.inner.clone();
                let inner = std::mem::replace(&mut self.inner, clone);
                let path = parts.uri.path().to_owned();
                let scope = scope_for(&tenant, &path, key.as_str());
                let tenant = tenant_id(&tenant);
                let span = tracing::info_span!(
                    "idempotency",
                    method = %path,
                    scope = %&scope.to_hex()[..16],
                    outcome = field::Empty,
                    fence = field::Empty,
                );
                let call = Call {
                    inner,
                    shared: self.shared.clone(),
                    policy,
                    path,
                    scope,
                    tenant,
                };
                ResponseFuture::protected(Box::pin(call.run(parts, body).instrument(span)))
            }
        }
    }
}

/// Per-call state of a protected call.
struct Call<S, St> {
    inner: S,
    shared: Arc<Shared<St>>,
    policy: IdempotencyPolicy,
    path: String,
    scope: Scope,
    tenant: TenantId,
}

fn outcome(name: &'static str) {
    tracing::Span::current().record("outcome", name);
}

fn store_unavailable(e: &StoreError) -> Status {
    idem_status(
        Code::Unavailable,
        format!("idempotency store unavailable: {e}"),
        reason::STORE_UNAVAILABLE,
    )
}

impl<S, St, ResBody> Call<S, St>
where
    S: Service<Request<Body>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ResBody: http_body::Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
    St: Store,
{
    fn reject(&self, status: Status) -> Result<Response<Body>, S::Error> {
        self.shared.stats.inc(|c| &c.rejected);
        outcome("rejected");
        tracing::info!(code = ?status.code(), "{}", status.message());
        Ok(status.into_http())
    }

    async fn run(
        self,
        parts: http::request::Parts,
        body: Body,
    ) -> Result<Response<Body>, S::Error> {
        let stats = &self.shared.stats;
        // Refuse an encoding the method does not accept before reading the body.
        let compression = match request::compression(&parts.headers, &self.policy) {
            Ok(c) => c,
            Err(status) => return self.reject(status),
        };
        // Buffer the body, up to the limit.
        let max = self.policy.max_request_bytes;
        let mut buf = BytesMut::new();
        let mut body = body;
        while let Some(frame) = body.frame().await {
            let frame = match frame {
                Ok(f) => f,
                Err(status) => return Ok(status.into_http()),
            };
            if let Ok(data) = frame.into_data() {
                if buf.len() + data.len() > max {
                    return self.reject(idem_status(
                        Code::ResourceExhausted,
                        format!("request body over the idempotency buffer limit of {max} bytes"),
                        reason::REQUEST_TOO_LARGE,
                    ));
                }
                buf.extend_from_slice(&data);
            }
        }
        let buffered = buf.freeze();
        let hook = self.shared.hooks.get(&self.path).cloned();
        let fingerprint =
            match request::fingerprint(buffered.clone(), compression, &self.policy, hook).await {
                Ok(f) => f,
                Err(status) => return self.reject(status),
            };

        // This call's own deadline (bounds waiting) and scope, read as `InboundLayer`
        // reads them. Under an `InboundLayer` the scope (with its exhausted-downstream
        // marker) is already set: keep it, so clients in the handler can mark give-ups.
        let own = crate::inbound::scope_of(&parts.headers);
        let deadline = own.deadline;
        let inbound = idem_core::deadline::current_scope().unwrap_or(own);

        let claimant = ClaimantId::random();
        let mut waited = false;
        let mut resent = false;
        loop {
            let claim = self
                .shared
                .store
                .claim(ClaimRequest {
                    scope: &self.scope,
                    tenant: &self.tenant,
                    fingerprint: &fingerprint,
                    claimant,
                    lease: self.policy.lease_ttl,
                })
                .await;
            match claim {
                Err(StoreError::Unavailable(e)) if !resent => {
                    // The claim may have been applied and only its reply lost (a timeout):
                    // send it again once, with the same claimant id, which the store
                    // recognises, instead of leaving the record held until its lease ends.
                    resent = true;
                    stats.inc(|c| &c.store_errors);
                    tracing::debug!(error = %e, "claim failed; sending it again once");
                    continue;
                }
                Err(e) => {
                    stats.inc(|c| &c.store_errors);
                    if self.policy.fail_open {
                        stats.inc(|c| &c.fail_open_runs);
                        outcome("fail_open");
                        tracing::warn!(error = %e, "idempotency store failed; method is fail-open: running without a record");
                        let req = Request::from_parts(parts, Body::new(Full::new(buffered)));
                        let mut inner = self.inner;
                        return scope_inbound_deadline(inbound, inner.call(req))
                            .await
                            .map(|r| r.map(Body::new));
                    }
                    outcome("store_unavailable");
                    tracing::warn!(error = %e, "idempotency store failed: refusing the call");
                    return Ok(store_unavailable(&e).into_http());
                }
                Ok(Claim::Acquired { fence, takeover }) => {
                    stats.inc(|c| &c.executed);
                    outcome("executed");
                    tracing::Span::current().record("fence", fence);
                    if takeover {
                        tracing::warn!(fence, "took over an in-flight record whose lease ended");
                    }
                    return self
                        .execute(parts, buffered, fingerprint, fence, inbound)
                        .await;
                }
                Ok(Claim::Completed(StoredOutcome::Response(bytes))) => {
                    return Ok(self.replay(bytes, waited));
                }
                Ok(Claim::Completed(StoredOutcome::NotRetained)) => {
                    stats.inc(|c| &c.not_retained_hits);
                    outcome("not_retained");
                    return Ok(idem_status(
                        Code::FailedPrecondition,
                        "this key's call already completed, but its response was over the size limit and was not retained; it will not run again",
                        reason::RESPONSE_NOT_RETAINED,
                    )
                    .into_http());
                }
                Ok(Claim::Mismatch) => {
                    stats.inc(|c| &c.mismatched);
                    outcome("mismatch");
                    return Ok(idem_status(
                        Code::FailedPrecondition,
                        "idempotency key reused with a different request",
                        reason::KEY_REUSED,
                    )
                    .into_http());
                }
                Ok(Claim::InFlight { lease_remaining }) => {
                    stats.inc(|c| &c.in_flight_hits);
                    if self.policy.in_flight == InFlightPolicy::Abort {
                        stats.inc(|c| &c.aborted);
                        outcome("aborted");
                        let mut details =
                            ErrorDetails::with_retry_info(Some(self.policy.abort_retry_delay));
                        details.set_error_info(
                            reason::IN_PROGRESS,
                            headers::ERROR_DOMAIN,
                            HashMap::<String, String>::new(),
                        );
                        return Ok(Status::with_error_details(
                            Code::Aborted,
                            "a call with this idempotency key is in progress",
                            details,
                        )
                        .into_http());
                    }
                    if !waited {
                        waited = true;
                        stats.inc(|c| &c.waited);
                    }
                    let now = Instant::now();
                    if deadline.is_some_and(|d| d <= now) {
                        return Ok(self.deadline_exceeded());
                    }
                    // Wake at the lease's end at the latest, to take an abandoned record over.
                    let lease_end = now + lease_remaining;
                    let until = deadline.map_or(lease_end, |d| d.min(lease_end));
                    if let Err(e) = self.shared.store.wait(&self.scope, until).await {
                        stats.inc(|c| &c.store_errors);
                        outcome("store_unavailable");
                        tracing::warn!(error = %e, "idempotency store failed while waiting");
                        return Ok(store_unavailable(&e).into_http());
                    }
                    if deadline.is_some_and(|d| d <= Instant::now()) {
                        return Ok(self.deadline_exceeded());
                    }
                }
            }
        }
    }

    fn deadline_exceeded(&self) -> Response<Body> {
        self.shared.stats.inc(|c| &c.deadline_exceeded);
        outcome("waited_deadline");
        idem_status(
            Code::DeadlineExceeded,
            "deadline reached while a call with this idempotency key was in progress",
            reason::IN_PROGRESS,
        )
        .into_http()
    }

    fn replay(&self, bytes: Bytes, waited: bool) -> Response<Body> {
        let stored = match StoredResponse::decode(bytes) {
            Ok(s) => s,
            Err(e) => {
                self.shared.stats.inc(|c| &c.store_errors);
                outcome("store_unavailable");
                tracing::error!(error = %e, "stored response does not decode");
                return store_unavailable(&StoreError::Corrupt(e.to_string().into())).into_http();
            }
        };
        self.shared.stats.inc(|c| &c.replayed);
        outcome(if waited { "waited" } else { "replayed" });
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
        let body = ReplayBody {
            frames: VecDeque::from(frames),
            trailers,
        };
        let body = if body.is_end_stream() {
            Body::empty()
        } else {
            Body::new(body)
        };
        let mut resp = Response::new(body);
        *resp.status_mut() = status;
        *resp.headers_mut() = headers;
        resp
    }

    /// Runs the handler in its own task, so a caller that goes away does not cancel it;
    /// the task renews the lease, forwards the response, and records the outcome.
    async fn execute(
        self,
        mut parts: http::request::Parts,
        buffered: Bytes,
        _fingerprint: Fingerprint,
        fence: Fence,
        inbound: InboundScope,
    ) -> Result<Response<Body>, S::Error> {
        parts.extensions.insert(RecordFence(fence));
        let req = Request::from_parts(parts, Body::new(Full::new(buffered)));
        let (tx, rx) = oneshot::channel();
        let span = tracing::Span::current();
        tokio::spawn(run_handler(self, req, fence, inbound, tx).instrument(span));
        match rx.await {
            Ok(r) => r,
            Err(_) => Ok(Status::internal(
                "the idempotent handler's task ended without a response",
            )
            .into_http()),
        }
    }
}

fn take_decision(h: &mut HeaderMap) -> Option<IdemDecision> {
    let mut d = None;
    for v in h.get_all(DECISION_HEADER) {
        d = match v.as_bytes() {
            b"store" => Some(IdemDecision::Store),
            b"release" => Some(IdemDecision::Release),
            _ => d,
        };
    }
    h.remove(DECISION_HEADER);
    d
}

fn grpc_code(h: &HeaderMap) -> Option<Code> {
    let v = h.get("grpc-status")?.to_str().ok()?.parse::<i32>().ok()?;
    Some(Code::from_i32(v))
}

async fn renew_forever<St: Store>(
    store: St,
    scope: Scope,
    fence: Fence,
    lease: Duration,
    stats: super::IdempotencyStats,
) -> Infallible {
    let period = (lease / 3).max(Duration::from_millis(1));
    loop {
        tokio::time::sleep(period).await;
        if let Err(e) = store.renew(&scope, fence, lease).await {
            stats.inc(|c| &c.renew_failures);
            tracing::warn!(error = %e, fence, "could not renew the idempotency lease");
        }
    }
}

type Reply<E> = oneshot::Sender<Result<Response<Body>, E>>;

/// What the handler produced, collected while it was forwarded.
struct Collected {
    stored: StoredResponse,
    over_limit: bool,
    decision: Option<IdemDecision>,
    /// Set when the body failed mid-way: the outcome is unknown, release.
    body_error: bool,
}

async fn run_handler<S, St, ResBody>(
    call: Call<S, St>,
    req: Request<Body>,
    fence: Fence,
    inbound: InboundScope,
    reply: Reply<S::Error>,
) where
    S: Service<Request<Body>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ResBody: http_body::Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
    St: Store,
{
    let Call {
        mut inner,
        shared,
        policy,
        scope,
        ..
    } = call;
    let stats = shared.stats.clone();
    let max = policy.max_response_bytes;
    let mut reply = Some(reply);
    let mut forward: Option<mpsc::Sender<Result<Frame<Bytes>, Status>>> = None;
    // The newest data frame is held back until the next frame arrives, so the last one
    // leaves with the trailers (and a unary response leaves whole, head included) after
    // the outcome is recorded: one write, not a trailing small one that Nagle's algorithm
    // would hold for the peer's delayed ACK on sockets without TCP_NODELAY.
    let mut pending: Option<Bytes> = None;

    let work = scope_inbound_deadline(inbound, async {
        let resp = match AssertUnwindSafe(inner.call(req)).catch_unwind().await {
            Ok(Ok(r)) => r.map(Body::new),
            Ok(Err(e)) => return Err(e),
            Err(_) => {
                tracing::error!("idempotent handler panicked");
                Status::internal("handler panicked").into_http()
            }
        };
        let (mut head, mut body) = resp.into_parts();
        let mut decision = head.extensions.remove::<IdemDecision>();
        decision = take_decision(&mut head.headers).or(decision);
        let mut stored = StoredResponse {
            status: head.status,
            headers: head.headers.clone(),
            frames: Vec::new(),
            trailers: None,
        };
        let mut size = 11 + headers_len(&stored.headers);
        let mut over_limit = size > max;
        let mut head = Some(head);
        let mut body_error = false;
        let reply = &mut reply;
        let forward = &mut forward;
        let pending = &mut pending;
        loop {
            let frame = match body.frame().await {
                None => break,
                Some(Ok(f)) => f,
                Some(Err(status)) => {
                    body_error = true;
                    tracing::warn!(error = %status, "idempotent handler's response body failed");
                    if let Some(tx) = forward.as_ref() {
                        if let Some(prev) = pending.take() {
                            let _ = tx.send(Ok(Frame::data(prev))).await;
                        }
                        let _ = tx.send(Err(status)).await;
                    }
                    break;
                }
            };
            let frame = match frame.into_data() {
                Ok(data) => {
                    size += 4 + data.len();
                    if !over_limit && size > max {
                        over_limit = true;
                        stored.frames = Vec::new();
                    }
                    if !over_limit {
                        stored.frames.push(data.clone());
                    }
                    match pending.replace(data) {
                        Some(prev) => Frame::data(prev),
                        None => continue,
                    }
                }
                Err(frame) => match frame.into_trailers() {
                    Ok(mut t) => {
                        decision = take_decision(&mut t).or(decision);
                        size += headers_len(&t);
                        over_limit |= size > max;
                        // Held back until the outcome is recorded (below).
                        stored.trailers = Some(t);
                        break;
                    }
                    Err(_) => continue,
                },
            };
            // First data frame: the caller gets the head and a body fed from here.
            if let Some(h) = head.take() {
                let (tx, rx) = mpsc::channel(16);
                *forward = Some(tx);
                if let Some(r) = reply.take() {
                    let _ = r.send(Ok(Response::from_parts(h, Body::new(ChannelBody { rx }))));
                }
            }
            if let Some(tx) = forward.as_ref()
                && tx.send(Ok(frame)).await.is_err()
            {
                // The caller went away: keep running, keep recording.
                *forward = None;
            }
        }
        Ok((
            Collected {
                stored,
                over_limit,
                decision,
                body_error,
            },
            head,
        ))
    });

    let result = {
        let renew = renew_forever(
            shared.store.clone(),
            scope,
            fence,
            policy.lease_ttl,
            stats.clone(),
        );
        tokio::pin!(work);
        tokio::pin!(renew);
        tokio::select! {
            r = &mut work => r,
            never = &mut renew => match never {},
        }
    };

    let (collected, head) = match result {
        Ok(c) => c,
        Err(e) => {
            // The service failed without a response: nothing is known to be done.
            release(&shared, &scope, fence).await;
            if let Some(r) = reply.take() {
                let _ = r.send(Err(e));
            }
            return;
        }
    };
    let Collected {
        stored,
        over_limit,
        decision,
        body_error,
    } = collected;
    let code = stored
        .trailers
        .as_ref()
        .and_then(grpc_code)
        .or_else(|| grpc_code(&stored.headers))
        .unwrap_or(Code::Unknown);
    let keep = !body_error
        && match decision {
            Some(IdemDecision::Store) => true,
            Some(IdemDecision::Release) => false,
            None => policy.cacheable_status_codes.contains(code),
        };
    if keep {
        let outcome = if over_limit {
            stats.inc(|c| &c.not_retained);
            tracing::warn!(
                max,
                "response over the size limit: recorded as not retained"
            );
            StoredOutcome::NotRetained
        } else {
            StoredOutcome::Response(stored.encode())
        };
        match shared
            .store
            .complete(&scope, fence, outcome, policy.record_ttl)
            .await
        {
            Ok(()) => stats.inc(|c| &c.stored),
            Err(StoreError::Fenced { presented, current }) => {
                stats.inc(|c| &c.stale_fence);
                tracing::warn!(
                    presented,
                    ?current,
                    "completion refused: the lease was taken over"
                );
            }
            Err(e) => {
                stats.inc(|c| &c.store_errors);
                tracing::warn!(error = %e, "could not record the outcome");
            }
        }
    } else {
        release(&shared, &scope, fence).await;
    }

    // Deliver what is still held back: the head (Trailers-Only or bodyless response)
    // and the trailers.
    if let Some(mut h) = head {
        // No frame was forwarded yet: at most one data frame arrived, held in `pending`.
        let body = if pending.is_none() && stored.trailers.is_none() {
            Body::empty()
        } else {
            Body::new(ReplayBody {
                frames: pending.into_iter().collect::<VecDeque<_>>(),
                trailers: stored.trailers,
            })
        };
        h.headers = stored.headers;
        if let Some(r) = reply.take() {
            let _ = r.send(Ok(Response::from_parts(h, body)));
        }
    } else if let Some(tx) = forward.take() {
        if let Some(last) = pending {
            let _ = tx.send(Ok(Frame::data(last))).await;
        }
        if let Some(t) = stored.trailers {
            let _ = tx.send(Ok(Frame::trailers(t))).await;
        }
    }
}

async fn release<St: Store>(shared: &Shared<St>, scope: &Scope, fence: Fence) {
    match shared.store.release(scope, fence).await {
        Ok(()) => shared.stats.inc(|c| &c.released),
        Err(StoreError::Fenced { presented, current }) => {
            shared.stats.inc(|c| &c.stale_fence);
            tracing::warn!(
                presented,
                ?current,
                "release refused: the lease was taken over"
            );
        }
        Err(e) => {
            shared.stats.inc(|c| &c.store_errors);
            tracing::warn!(error = %e, "could not release the record");
        }
    }
}
