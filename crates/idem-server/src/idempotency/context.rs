//! What a protected call carries from routing to its answer ([`Call`]), the request as
//! its handler gets it ([`BufferedRequest`]), and how the call answers its caller with a
//! status of the layer's own: counted, and noted in its span and trace.
//!
//! The service makes the `Call` when it routes a protected call; [`Call::run`] (in
//! [`call`](super::call)) reads the request, claims the record and answers, and a claim
//! acquired hands both to the handler's run ([`handler`](super::handler)).

use std::sync::Arc;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::Full;
use idem_core::config::IdempotencyPolicy;
use idem_core::deadline::InboundScope;
use idem_store::{Fence, RecordRef, Scope, Store, TenantId};
use tokio::time::Instant;
use tonic::Status;
use tonic::body::Body;

use super::layer::Shared;
use super::lease::Lease;
use super::stats::Counter;
use crate::metrics::CallTrace;

/// Per-call state of a protected call (the inner service travels apart from it, so
/// this is `Sync` whatever the service is).
pub(crate) struct Call<St> {
    pub(crate) shared: Arc<Shared<St>>,
    /// The policy the call was routed with (a reload meanwhile does not change it).
    pub(crate) policy: IdempotencyPolicy,
    pub(crate) scope: Scope,
    pub(crate) tenant: TenantId,
    /// The layer's tenant source is a single tenant (its share of the bounds is the
    /// whole).
    pub(crate) single_tenant: bool,
    /// The call's trace, when an observer listens.
    pub(crate) trace: Option<Arc<CallTrace>>,
}

/// A protected request once its body is buffered, as its handler gets it: the head, the
/// body, and the inbound deadline scope the handler runs in.
pub(crate) struct BufferedRequest {
    pub(crate) parts: http::request::Parts,
    pub(crate) body: Bytes,
    pub(crate) inbound: InboundScope,
}

impl BufferedRequest {
    /// The request of `parts` and its buffered `body`, with this call's own deadline (it
    /// bounds waiting). The deadline and the handler's scope are read as `InboundLayer`
    /// reads them; under an `InboundLayer` the scope (with its exhausted-downstream
    /// marker) is already set: it is kept, so clients in the handler can mark give-ups.
    pub(crate) fn new(parts: http::request::Parts, body: Bytes) -> (Self, Option<Instant>) {
        let own = crate::inbound::scope_of(&parts.headers);
        let inbound = idem_core::deadline::current_scope().unwrap_or(own);
        let request = BufferedRequest {
            parts,
            body,
            inbound,
        };
        (request, own.deadline)
    }

    /// The request to call the service with, and the scope to call it in. The buffer
    /// moves into the request: once the service has read it, it is freed.
    pub(crate) fn into_request(self) -> (Request<Body>, InboundScope) {
        let req = Request::from_parts(self.parts, Body::new(Full::new(self.body)));
        (req, self.inbound)
    }
}

impl<St: Store> Call<St> {
    /// Starts the lease on the record this call claimed with `fence`; the record's
    /// reference is the one its handler gets.
    pub(crate) fn lease(&self, fence: Fence) -> Lease<St> {
        let policy = &self.policy;
        let record = RecordRef::new(self.scope, fence, policy.record_ttl, policy.lease_ttl);
        let retry_for = policy.completion_retry_timeout;
        Lease::start(&self.shared, record, retry_for, self.trace.clone())
    }

    /// A call refused before it reached the store (counted as rejected).
    pub(crate) fn refuse(&self, name: &'static str, status: Status) -> Response<Body> {
        self.shared.stats.inc(Counter::rejected);
        tracing::info!(code = ?status.code(), "{}", status.message());
        self.answer(name, status)
    }

    /// Answers with `status`, the call's outcome being `name`.
    pub(crate) fn answer(&self, name: &'static str, status: Status) -> Response<Body> {
        self.outcome(name);
        status.into_http()
    }

    /// Notes what the call came to, in its span and its trace.
    pub(crate) fn outcome(&self, name: &'static str) {
        crate::metrics::outcome_of(self.trace.as_deref(), name);
    }

    /// Notes the reason of the call's outcome for its observer (the bound that refused a
    /// `store_full`).
    pub(crate) fn trace_reason(&self, reason: Option<&'static str>) {
        crate::metrics::reason_of_outcome(self.trace.as_deref(), reason);
    }

    /// The scope's first 16 hex digits, for the logs (never the key).
    pub(crate) fn short_scope(&self) -> String {
        self.scope.short_hex()
    }
}
