//! What the idempotency layer tells an observer and the logs about each protected call.
//!
//! Give a [`ServerObserver`] to
//! [`IdempotencyLayer::observer`](crate::idempotency::IdempotencyLayer::observer);
//! `idem-otel` turns its events into OpenTelemetry instruments. Whether or not one is set,
//! every protected call (a call to a method with an `idempotency` object that was not
//! passed through) ends with one `INFO` event `idempotent call` inside its `idempotency`
//! span, with the outcome, what became of the record, the gRPC status and the duration:
//!
//! ```text
//! INFO idempotency{method=/shop.v1.Orders/CreateOrder scope=5f0c… rpc.system="grpc" …}: idempotent call outcome="executed" record="stored" grpc.status="OK" duration_ms=1.2
//! ```
//!
//! The span records the same (`outcome`, `idem.record`, `rpc.grpc.status_code`), with
//! OpenTelemetry's RPC attribute names where they exist (`rpc.system`, `rpc.service`,
//! `rpc.method`). Neither carries the key: the scope's first 16 hex digits only.
//!
//! # When a call ends
//! When the last of these is done: its response body ended (or was dropped by the
//! caller: CANCELLED), and, for a call whose handler ran, its outcome was recorded (or
//! not, after `completionRetryTimeout`). The duration stops at the response's end.
//!
//! # Outcomes
//! `executed`, `replayed`, `waited` (replayed after waiting for the call in flight),
//! `mismatch`, `aborted`, `not_retained`, `rejected` (with the `ErrorInfo` reason:
//! `KEY_MISSING`, `KEY_INVALID`, `TENANT_MISSING`, `TENANT_SOURCE_MISSING`, `REQUEST_TOO_LARGE`,
//! `REQUEST_MALFORMED`, `ENCODING_UNSUPPORTED`), `store_unavailable`, `store_full` (with
//! the bound that refused, when the store names it), `overloaded`, `fail_open`,
//! `waited_deadline`, and `cancelled` for a caller that went away before any of them.
//!
//! The observer also hears of the calls the layer lets through untouched, with the
//! outcome `passthrough`: calls to methods without an `idempotency` object, and calls
//! without a key to a method whose key is optional (`keyRequired: false`). A call that
//! carried a key to a method the layer does not protect has the reason `KEY_IGNORED`
//! ([`KEY_IGNORED`]; the method is also logged once at WARN), unless the descriptors
//! say the method is safe to repeat. Those get no
//! span and no `INFO` event, and cost nothing when no observer is set.
//!
//! Records (`executed` only): `stored`, `released`, `stale_fence` (another claimant took
//! the record over), `unrecorded` (the store did not take it in time).
//!
//! # Cost
//! Nothing is allocated or wrapped for a call when no observer is set and `INFO` events
//! of this crate are off.

use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use futures_util::FutureExt;
use futures_util::future::Either;
use http::Response;
use idem_core::code::{OnEnd, grpc_status_code};
use idem_core::headers::reason;
use tokio::time::Instant;
use tonic::Code;
use tonic::body::Body;

/// The reason of a `passthrough` outcome whose call carried a key the layer ignored (the
/// method is not protected).
pub const KEY_IGNORED: &str = "KEY_IGNORED";

/// Told about every call an [`IdempotencyLayer`](crate::idempotency::IdempotencyLayer) sees: protected ones, and those it
/// passes through (outcome `passthrough`; see the [module docs](self)).
///
/// Called on the server's tasks: keep it short and never block.
pub trait ServerObserver: Send + Sync + 'static {
    /// A call (`/shop.v1.Orders/CreateOrder`) arrived.
    fn call_started(&self, method: &str) {
        let _ = method;
    }

    /// A protected call ended (see the [module docs](self) for when).
    fn call_ended(&self, call: &ProtectedCallEnded<'_>);

    /// The caller of a call to `method` went away while its handler was running, before
    /// its response began: the run goes on in a task of its own, so its outcome is still
    /// recorded.
    fn run_detached(&self, method: &str) {
        let _ = method;
    }

    /// A run [`run_detached`](Self::run_detached) reported has ended.
    fn detached_run_ended(&self, method: &str) {
        let _ = method;
    }
}

/// One protected call, as [`ServerObserver::call_ended`] sees it.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct ProtectedCallEnded<'a> {
    /// The method path.
    pub method: &'a str,
    /// What the layer did (see the [module docs](self) for the names).
    pub outcome: &'static str,
    /// For `rejected`: the `ErrorInfo` reason of the refusal. For `store_full`: the
    /// bound that refused, when the store names it (the memory store's
    /// [`MemoryBound`](idem_store::memory::MemoryBound) labels: `tenant_in_flight`,
    /// `tenant_entries`, `tenant_bytes`, `store_entries`, `store_bytes`). For
    /// `passthrough`: [`KEY_IGNORED`] when the call carried a key the layer ignored.
    pub reason: Option<&'static str>,
    /// For `executed`: what became of the record.
    pub record: Option<&'static str>,
    /// The caller's tenant, for protected calls that got as far as naming one. It comes
    /// from the caller: never use it as a metric label without bounding the values.
    pub tenant: Option<&'a str>,
    /// The status the caller got (CANCELLED when it went away first).
    pub status: Code,
    /// From the call's arrival to its response's end.
    pub duration: Duration,
}

/// What a trace has learned of its call so far.
#[derive(Default)]
struct TraceNotes {
    /// The response body reports its own end ([`BodyEnd`]): [`watch`] wraps nothing.
    body_watched: bool,
    outcome: Option<&'static str>,
    reason: Option<&'static str>,
    record: Option<&'static str>,
    status: Option<Code>,
    ended: Option<Instant>,
}

/// One protected call being traced; it reports when the last reference goes.
pub(crate) struct CallTrace {
    observer: Option<Arc<dyn ServerObserver>>,
    method: Arc<str>,
    tenant: Option<String>,
    /// A call passed through: no event, only the observer.
    passthrough: bool,
    span: tracing::Span,
    started: Instant,
    state: Mutex<TraceNotes>,
}

impl CallTrace {
    /// A trace of a protected call to `method`, when someone listens.
    /// `method` makes the method's path only then.
    pub(crate) fn start(
        observer: Option<&Arc<dyn ServerObserver>>,
        method: impl FnOnce() -> Arc<str>,
        span: &tracing::Span,
    ) -> Option<Arc<CallTrace>> {
        if observer.is_none() && !tracing::enabled!(tracing::Level::INFO) {
            return None;
        }
        let method = method();
        if let Some(o) = observer {
            o.call_started(&method);
        }
        Some(Arc::new(CallTrace {
            observer: observer.cloned(),
            method,
            tenant: None,
            passthrough: false,
            span: span.clone(),
            started: Instant::now(),
            state: Mutex::default(),
        }))
    }

    /// A trace of a call passed through to `method`, when an observer listens; `reason`
    /// [`KEY_IGNORED`] when it carried a key the layer ignored.
    pub(crate) fn passthrough(
        observer: Option<&Arc<dyn ServerObserver>>,
        method: &str,
        reason: Option<&'static str>,
    ) -> Option<Arc<Self>> {
        let o = observer?;
        o.call_started(method);
        Some(Arc::new(CallTrace {
            observer: Some(o.clone()),
            method: Arc::from(method),
            tenant: None,
            passthrough: true,
            span: tracing::Span::none(),
            started: Instant::now(),
            state: Mutex::new(TraceNotes {
                outcome: Some("passthrough"),
                reason,
                ..TraceNotes::default()
            }),
        }))
    }

    /// The trace of a protected call, with the caller's tenant (kept for the observer).
    pub(crate) fn with_tenant(mut self: Arc<Self>, tenant: String) -> Arc<Self> {
        if self.observer.is_some()
            && let Some(t) = Arc::get_mut(&mut self)
        {
            t.tenant = Some(tenant);
        }
        self
    }

    /// The caller went away while the call's handler was running: reports the run as
    /// detached until the returned guard is dropped (when the run ends).
    pub(crate) fn detached(self: Arc<Self>) -> Option<DetachedRun> {
        let o = self.observer.as_ref()?;
        o.run_detached(&self.method);
        Some(DetachedRun(self))
    }

    fn update(&self, f: impl FnOnce(&mut TraceNotes)) {
        f(&mut self.state.lock().unwrap_or_else(PoisonError::into_inner));
    }

    /// What became of the record of the call's run.
    pub(crate) fn recorded(&self, record: &'static str) {
        self.update(|s| s.record = Some(record));
    }

    /// The call ended with `code` now (the first end counts).
    pub(crate) fn ended(&self, code: Code) {
        self.update(|s| {
            if s.status.is_none() {
                s.status = Some(code);
                s.ended = Some(Instant::now());
            }
        });
    }
}

/// A response body's hold on its call's trace: the body reports its end (the status in
/// its trailers, or UNKNOWN without them) with [`ended`](Self::ended), or CANCELLED by
/// being dropped first, as [`OnEnd`] does around a body it wraps.
#[derive(Debug)]
pub(crate) struct BodyEnd(Option<Arc<CallTrace>>);

impl BodyEnd {
    /// The end of the call traced by `trace` is its body's: [`watch`] wraps nothing.
    pub(crate) fn new(trace: Arc<CallTrace>) -> Self {
        trace.update(|s| s.body_watched = true);
        BodyEnd(Some(trace))
    }

    /// The body ended with `code`.
    pub(crate) fn ended(mut self, code: Code) {
        if let Some(t) = self.0.take() {
            t.ended(code);
        }
    }
}

impl Drop for BodyEnd {
    fn drop(&mut self) {
        if let Some(t) = self.0.take() {
            t.ended(Code::Cancelled);
        }
    }
}

impl std::fmt::Debug for CallTrace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CallTrace")
            .field("method", &self.method)
            .finish_non_exhaustive()
    }
}

/// A handler run going on after its caller went away; reports its end when dropped.
pub(crate) struct DetachedRun(Arc<CallTrace>);

impl Drop for DetachedRun {
    fn drop(&mut self) {
        if let Some(o) = &self.0.observer {
            o.detached_run_ended(&self.0.method);
        }
    }
}

impl Drop for CallTrace {
    fn drop(&mut self) {
        let s = std::mem::take(self.state.get_mut().unwrap_or_else(PoisonError::into_inner));
        let status = s.status.unwrap_or(Code::Cancelled);
        let outcome = s.outcome.unwrap_or("cancelled");
        let end = s.ended.unwrap_or_else(Instant::now);
        let duration = end.saturating_duration_since(self.started);
        if self.passthrough {
            if let Some(o) = &self.observer {
                o.call_ended(&ProtectedCallEnded {
                    method: &self.method,
                    outcome,
                    reason: s.reason,
                    record: None,
                    tenant: None,
                    status,
                    duration,
                });
            }
            return;
        }
        self.span.record("rpc.grpc.status_code", status as i32);
        if let Some(r) = s.record {
            self.span.record("idem.record", r);
        }
        self.span.in_scope(|| {
            tracing::info!(
                outcome,
                record = s.record,
                reason = s.reason,
                grpc.status = idem_core::code::code_name(status),
                duration_ms = duration.as_secs_f64() * 1e3,
                "idempotent call"
            );
        });
        if let Some(o) = &self.observer {
            o.call_ended(&ProtectedCallEnded {
                method: &self.method,
                outcome,
                reason: s.reason,
                record: s.record,
                tenant: self.tenant.as_deref(),
                status,
                duration,
            });
        }
    }
}

/// Runs a protected call's future, then watches its response to the end.
///
/// Combinators, not an `async fn`: an `async fn` keeps its `fut` argument and the future
/// it awaits in separate slots, doubling the size of every protected call's future
/// (2.5 KB more to copy into its box).
pub(crate) fn traced<F, E>(trace: Option<Arc<CallTrace>>, fut: F) -> impl Future<Output = F::Output>
where
    F: Future<Output = Result<Response<Body>, E>>,
{
    let Some(trace) = trace else {
        return Either::Left(fut);
    };
    Either::Right(fut.map(move |resp| {
        if resp.is_err() {
            trace.ended(Code::Unknown);
        }
        resp.map(|r| watch(r, trace))
    }))
}

/// Watches a response to its end: its Trailers-Only status now, else its trailers
/// (unless its body reports them itself: [`BodyEnd`]).
pub(crate) fn watch(resp: Response<Body>, trace: Arc<CallTrace>) -> Response<Body> {
    let state = trace.state.lock().unwrap_or_else(PoisonError::into_inner);
    let (rejected, watched) = (state.outcome == Some("rejected"), state.body_watched);
    drop(state);
    if watched {
        // Its body reports the end itself.
        return resp;
    }
    if let Some(code) = grpc_status_code(resp.headers()) {
        if rejected {
            let why = reason_of(resp.headers());
            trace.update(|s| s.reason = why);
        }
        trace.ended(code);
        return resp;
    }
    resp.map(|inner| Body::new(OnEnd::new(inner, move |code| trace.ended(code))))
}

/// The `ErrorInfo` reason of a refusal the layer made, as one of its known names.
fn reason_of(headers: &http::HeaderMap) -> Option<&'static str> {
    use tonic_types::StatusExt;
    let status = tonic::Status::from_header_map(headers)?;
    let info = status.get_details_error_info()?;
    const KNOWN: [&str; 7] = [
        reason::KEY_MISSING,
        reason::KEY_INVALID,
        reason::TENANT_MISSING,
        reason::TENANT_SOURCE_MISSING,
        reason::REQUEST_TOO_LARGE,
        reason::REQUEST_MALFORMED,
        reason::ENCODING_UNSUPPORTED,
    ];
    Some(
        KNOWN
            .into_iter()
            .find(|k| *k == info.reason)
            .unwrap_or("OTHER"),
    )
}

/// Notes `reason` as the reason of the outcome of a call traced by `trace` (the bound
/// that refused a `store_full`).
pub(crate) fn reason_of_outcome(trace: Option<&CallTrace>, reason: Option<&'static str>) {
    if let Some(t) = trace {
        t.update(|s| s.reason = reason);
    }
}

/// Notes `name` as the outcome of a call traced by `trace`, in its span too.
pub(crate) fn outcome_of(trace: Option<&CallTrace>, name: &'static str) {
    tracing::Span::current().record("outcome", name);
    if let Some(t) = trace {
        t.update(|s| s.outcome = Some(name));
    }
}
