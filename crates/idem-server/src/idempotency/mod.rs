//! The idempotency middleware: run each idempotency key once, replay the stored response
//! to duplicates.
//!
//! Stack it on a tonic server *after* authentication, so the tenant comes from an
//! authenticated source:
//!
//! ```no_run
//! use idem_core::config::ServiceConfig;
//! use idem_server::idempotency::{IdempotencyLayer, tenant::FromExtension};
//! use tonic::service::InterceptorLayer;
//! use tonic::transport::Server;
//! use tonic::{Request, Status};
//!
//! /// What authentication establishes; `FromExtension` reads it (`AsRef<str>`).
//! #[derive(Clone)]
//! struct Tenant(String);
//! impl AsRef<str> for Tenant {
//!     fn as_ref(&self) -> &str { &self.0 }
//! }
//!
//! /// The usual tonic interceptor, which also records who the caller is.
//! fn auth(mut req: Request<()>) -> Result<Request<()>, Status> {
//!     let token = req.metadata().get("authorization").and_then(|v| v.to_str().ok());
//!     let tenant = match token {
//!         Some("Bearer secret-of-acme") => Tenant("acme".into()),
//!         _ => return Err(Status::unauthenticated("invalid token")),
//!     };
//!     req.extensions_mut().insert(tenant);
//!     Ok(req)
//! }
//!
//! # async fn run(
//! #     orders: tonic::service::Routes, // e.g. `OrdersServer::new(orders)`
//! # ) -> Result<(), Box<dyn std::error::Error>> {
//! let config = ServiceConfig::from_file("service_config.json")?;
//! // Records in a `MemoryStore` with the config's `idem.memoryStore` bounds.
//! let idempotency = IdempotencyLayer::from_config(&config)
//!     .tenant(FromExtension::<Tenant>::new())
//!     .check()?; // `NoTenantSource` if no tenant source is set
//! let stats = idempotency.stats(); // counters to export
//! let reload = idempotency.clone(); // `reload.reload(&new_config)?` on SIGHUP
//! Server::builder()
//!     .layer(InterceptorLayer::new(auth)) // first: it sets the `Tenant` extension
//!     .layer(idempotency)
//!     .add_routes(orders)
//!     .serve("127.0.0.1:50051".parse()?)
//!     .await?;
//! # let _ = (stats, reload);
//! # Ok(())
//! # }
//! ```
//!
//! # Authentication and tenants
//! The layer reads the tenant when the call arrives, so authentication must run
//! **before** it: it is the first of `Server::builder().layer(..)` calls, or an outer
//! layer in a `ServiceBuilder`. Any of these works; each puts what it established into a
//! request extension that [`tenant::FromExtension<T>`] reads (`T: AsRef<str> + Send +
//! Sync + 'static`, and `Clone` for tonic's extensions):
//! - **a tonic interceptor as a layer**: `tonic::service::InterceptorLayer::new(auth)`
//!   with `auth: FnMut(Request<()>) -> Result<Request<()>, Status>` that calls
//!   `req.extensions_mut().insert(Tenant(..))` (above);
//! - **an async tower layer**, for checks that await (a token introspection, a
//!   database), e.g. `tower::filter::AsyncFilterLayer::new(|mut req:
//!   http::Request<Body>| async move { .. req.extensions_mut().insert(tenant); Ok(req) })`
//!   returning `Err(Status::unauthenticated(..))` to refuse (tonic answers a `Status`
//!   error with that status), or your own `Layer`/`Service` pair;
//! - a synchronous tower layer, e.g. `tower::util::MapRequestLayer`.
//!
//! **`OrdersServer::with_interceptor(svc, auth)` does not work here**: it wraps the
//! service *inside* the router, so it runs after this layer, which finds no tenant
//! and refuses with UNAUTHENTICATED (`TENANT_MISSING`, whose message says so). Move the
//! same function into `InterceptorLayer::new(auth)` before the layer.
//!
//! Without any tenant source (no `idem.tenant` in the config, no
//! [`IdempotencyLayer::tenant`]), [`IdempotencyLayer::check`] fails with
//! [`NoTenantSource`]; a layer used unchecked logs an ERROR when it wraps a service and
//! refuses every protected call with FAILED_PRECONDITION (`TENANT_SOURCE_MISSING`).
//!
//! # Stores
//! [`IdempotencyLayer::from_config`] keeps records in a [`MemoryStore`](idem_store::memory::MemoryStore)
//! bounded by the config's `idem.memoryStore`. [`IdempotencyLayer::new`] takes any
//! [`Store`](idem_store::Store) (e.g. `idem-redis`, built from `idem.redis`); given a
//! `MemoryStore` whose bounds differ from `idem.memoryStore`, it keeps the store as
//! given and logs a warning.
//!
//! # Reloading the config
//! [`IdempotencyLayer::reload`] swaps the config for every clone of the layer and every
//! service made from it: protected methods, their policies, the key header and the
//! config's tenant source (a resolver set in code stays). A call keeps the policy and
//! tenant it was routed with; records, counters and handler runs in progress are kept.
//! The store's settings and the handler and waiter bounds (`idem.maxHandlersInFlight`,
//! `maxHandlersPerTenant`, `maxDetachedHandlers`, `maxWaiters`, `maxWaitersPerTenant`)
//! are read once, at build (a reload that changes them logs a warning). A reload that would leave protected methods with
//! no tenant source is refused ([`NoTenantSource`]) and changes nothing.
//!
//! # Which calls are protected
//! A call is protected when its method's entry in the service config
//! ([`ServiceConfig::lookup_path`](idem_core::config::ServiceConfig::lookup_path)) has an
//! `idempotency` object ([`IdempotencyPolicy`](idem_core::config::IdempotencyPolicy)).
//! Every other call passes through untouched: no buffering, no allocation, whatever
//! headers it carries. A protected call without a key passes through unprotected when
//! the method sets `keyRequired: false`.
//!
//! **Bidirectional-streaming methods must not be protected**: their requests are not a
//! finite message list to fingerprint and their responses depend on the interleaving.
//! Unary, server-streaming (responses stored within the size limit) and
//! client-streaming (requests buffered within the size limit) methods can be.
//!
//! # A protected call
//! 1. **Key**: exactly one value of the key header (`idem.keyHeader`, default
//!    `x-idempotency-key`) following [`KEY_RULE`](idem_core::key::KEY_RULE); missing,
//!    malformed or repeated → INVALID_ARGUMENT (`KEY_MISSING` / `KEY_INVALID`).
//! 2. **Tenant** from the [`TenantResolver`](tenant::TenantResolver); none →
//!    UNAUTHENTICATED (`TENANT_MISSING`). A layer with no resolver at all refuses
//!    before the key is read: FAILED_PRECONDITION (`TENANT_SOURCE_MISSING`).
//! 3. **Scope** = [`scope_for`]`(tenant, method path, key)`.
//! 4. **Encoding**: a `grpc-encoding` other than identity must be listed in the method's
//!    `acceptCompressed` (mirror the service's `accept_compressed`), else UNIMPLEMENTED
//!    (`ENCODING_UNSUPPORTED`, with `grpc-accept-encoding`) before the body is read, as
//!    tonic refuses it.
//!    **Body** buffered up to `maxRequestBytes` (→ RESOURCE_EXHAUSTED,
//!    `REQUEST_TOO_LARGE`); the handler gets a body rebuilt from the buffer, which is
//!    freed once the service has read it.
//! 5. **Decodable**: with a protobuf content type (`application/grpc`, `+proto`), each
//!    message must be well-formed protobuf wire format (keys, wire types, varints,
//!    lengths, groups), checked without its schema; otherwise INVALID_ARGUMENT
//!    (`REQUEST_MALFORMED`) before any record exists, so the corrected request can use
//!    the same key.
//! 6. **Fingerprint** = SHA-256 over the request messages after gRPC de-framing and
//!    decompression, or over the bytes a
//!    [`fingerprint_with`](IdempotencyLayer::fingerprint_with) hook returns. Frames are
//!    counted first (over `maxRequestFrames` → RESOURCE_EXHAUSTED, `REQUEST_TOO_LARGE`,
//!    before any is decoded), then decoded with one reused decoder and hashed as they
//!    come, so the work is linear in the body however it is framed; decompressed
//!    messages over `maxRequestBytes` → RESOURCE_EXHAUSTED. Requests that may take more
//!    than about half a millisecond are read on tokio's blocking pool.
//! 7. **Claim** the record. A caller that goes away before the claim's answer is back
//!    leaves nothing held: the claim is sent again by the same claimant from a task of
//!    its own, and a record it finds acquired is given back. A refusal after the claim
//!    (step 10) gives the record back from a task too.
//!    - *acquired*: the handler runs in the caller's future, and in a task of its own
//!      once that future is dropped (a caller that goes away does not cancel it), inside the inbound deadline scope
//!      ([`scope_inbound_deadline`](idem_core::deadline::scope_inbound_deadline)) and a
//!      [`KeySource`](idem_core::derive::KeySource) seeded with the scope, so client
//!      calls it makes without a key get keys derived from this call ([`derived_key`]):
//!      a run after a crash sends the same keys downstream and is replayed there. Its
//!      request carries [`RecordFence`] and [`RecordRef`](idem_store::RecordRef)
//!      extensions; with the latter a handler can complete the record in its own
//!      database transaction (`idem-postgres`'s `RecordTx`), and the layer then does not
//!      record the outcome again. The lease is renewed every `leaseTtl / 3` by
//!      the layer's renewal task (one per layer, not the handler's task), so a handler
//!      that blocks its thread keeps its lease. The response is collected (headers,
//!      every DATA frame, trailers); a unary response (one message) leaves whole once
//!      the store has been asked to record the outcome, with no task, channel or box of
//!      its own, and a streamed one leaves as it is produced, from a task of its own,
//!      its last frame (with the trailers) held back until then: a caller that saw the
//!      end of its response and retries finds the record completed. By the `grpc-status` (or an [`IdemDecision`] /
//!      [`DECISION_HEADER`] override) the outcome is completed (`cacheableStatusCodes`)
//!      or released (`releaseStatusCodes`). A response over `maxResponseBytes` is
//!      completed as "not retained".
//!    - *completed*: replayed byte for byte (status, headers, DATA frames, trailers) plus
//!      `x-idempotency-replayed: true`. Not retained → FAILED_PRECONDITION
//!      (`RESPONSE_NOT_RETAINED`), never a second run.
//!    - *mismatch* → FAILED_PRECONDITION "idempotency key reused with a different
//!      request" (`KEY_REUSED`); the record is unchanged.
//!    - *in flight*: `WAIT` waits on the store ([`Store::wait`](idem_store::Store::wait))
//!      and claims again, until the caller's `grpc-timeout` deadline (then
//!      DEADLINE_EXCEEDED, reason `IN_PROGRESS`); `ABORT` answers ABORTED with
//!      `google.rpc.RetryInfo` (`abortRetryDelay`) and reason `IN_PROGRESS`.
//! 8. **Recording the outcome**: a completion or release the store refuses transiently
//!    is retried with backoff (20 ms doubling to 1 s), the lease still renewed, for up
//!    to `completionRetryTimeout`. The caller gets a completed call's response after
//!    the first attempt; a released call's response waits until the release lands (or
//!    is given up), so a corrected request sent with the same key right after an error
//!    such as INVALID_ARGUMENT runs instead of meeting the held key (`KEY_REUSED`).
//!    Past the timeout the record is left to its lease (counted as
//!    `unrecorded`, logged at WARN with the scope). A response the store has no room
//!    for is recorded as not retained.
//! 9. **Store errors** → UNAVAILABLE (`STORE_UNAVAILABLE`), unless the method is
//!    `failOpen`: then the handler runs without a record (logged, counted; a panic in
//!    its `call` or future answers INTERNAL, while its response stream is passed on as
//!    is, as without the layer, and a caller that goes away cancels it). A call that
//!    has seen its record in flight never runs on a store error, fail-open or not: it
//!    answers UNAVAILABLE (`STORE_UNAVAILABLE`) with `google.rpc.RetryInfo`
//!    (`abortRetryDelay`), and its retry replays the first run's outcome. A full store
//!    (or tenant share) → RESOURCE_EXHAUSTED (`STORE_FULL`) with a 1 s
//!    `google.rpc.RetryInfo`, fail-open or not: nothing runs. Messages say what to do;
//!    what the store said goes to the logs only.
//! 10. **Handler bounds**: at most `idem.maxHandlersInFlight` handler runs per layer
//!     (default 1024), of which one tenant holds at most `idem.maxHandlersPerTenant` (a
//!     quarter by default, all of them for a single tenant), counted from the claim
//!     until the outcome is recorded, including runs whose caller went away. While
//!     `idem.maxDetachedHandlers` runs whose caller went away go on (default 256), no
//!     new run starts. A call that would start one more is refused with
//!     RESOURCE_EXHAUSTED (`OVERLOADED`, 1 s `RetryInfo`, `ErrorInfo` metadata `bound`:
//!     `handlers`, `tenant_handlers` or `detached_handlers`) and its key left free;
//!     duplicates answered from the store are served at the bound. The bound also caps
//!     the request buffers those runs hold (`maxHandlersInFlight × maxRequestBytes` at
//!     worst). See [Handler bounds and tonic's limits](#handler-bounds-and-tonics-limits).
//! 11. **Waiters**: a duplicate that waits holds the request's fingerprint, not its
//!     body (dropped when the key is found in flight). At most `idem.maxWaiters` wait
//!     per layer (default 4096) and `idem.maxWaitersPerTenant` per tenant (a quarter by
//!     default); past them RESOURCE_EXHAUSTED (`TOO_MANY_WAITING`, 1 s `RetryInfo`,
//!     bound `waiters` or `tenant_waiters`). A waiter whose claim after the wait
//!     acquires the record (the call it waited for was released, or its lease ended)
//!     has no body to run: it gives the record back and answers UNAVAILABLE
//!     (`IN_PROGRESS_ENDED`) with a 100 ms `RetryInfo`; its retry carries the request
//!     and runs.
//!
//! # Handler bounds and tonic's limits
//! tonic's `Server::concurrency_limit_per_connection` and tower's
//! `ConcurrencyLimitLayer` count calls whose caller is still there: a caller that
//! cancels frees its place at once, while its idempotent handler goes on (to record
//! its outcome). Only this layer sees those runs, so its own bounds
//! (`maxHandlersInFlight`, `maxHandlersPerTenant`, `maxDetachedHandlers`) are what caps
//! them. Put a `ConcurrencyLimitLayer` (or `GlobalConcurrencyLimitLayer`, shared by the
//! connections) *outside* this layer, before it in `Server::builder().layer(..)`, to
//! bound calls still waiting for their answer, replays and waits included; one inside
//! it (around the service) would count only the handler's own call, not the run's
//! recording. Runs whose caller went away are never stopped: stopping a handler
//! half-way and running its retry would be a second run. So their count can pass
//! `maxDetachedHandlers` by the runs whose callers were waiting when it was reached.
//!
//! Every error the layer makes carries `google.rpc.ErrorInfo` with domain `idem` and a
//! reason from [`idem_core::headers::reason`].
//!
//! # Options and defaults
//! Per method (`methodConfig[].idempotency`, see
//! [`IdempotencyPolicy`](idem_core::config::IdempotencyPolicy)): `keyRequired` true,
//! `recordTtl` 24 h, `leaseTtl` 10 s, `inFlight` WAIT, `abortRetryDelay` 1 s,
//! `cacheableStatusCodes` OK, UNKNOWN, DEADLINE_EXCEEDED, INTERNAL, DATA_LOSS,
//! `releaseStatusCodes` the others, `maxRequestBytes` 4 MiB, `maxResponseBytes` 1 MiB,
//! `maxRequestFrames` 65536, `acceptCompressed` `[]` (identity only), `failOpen` false,
//! `completionRetryTimeout` 60 s. Process-wide (`idem`): `keyHeader`
//! `x-idempotency-key`, `tenant` unset ([`IdempotencyLayer::check`] fails and every
//! protected call is refused until a resolver is set), `maxHandlersInFlight` 1024,
//! `maxHandlersPerTenant` a quarter of it (all of it for a single tenant),
//! `maxDetachedHandlers` 256, `maxWaiters` 4096, `maxWaitersPerTenant` a quarter of it,
//! `memoryStore` (read by [`IdempotencyLayer::from_config`]). In code: [`IdempotencyLayer::tenant`] (no
//! default beyond the config's), [`IdempotencyLayer::fingerprint_with`] (none),
//! [`IdempotencyLayer::max_handlers_in_flight`] and
//! [`IdempotencyLayer::max_handlers_per_tenant`] (the config's).
//!
//! # Decisions
//! - A response's code is its `grpc-status` (trailers, else Trailers-Only headers);
//!   a response without one counts as UNKNOWN.
//! - A handler that panics, in its `call`, its future or its response stream, is
//!   answered INTERNAL (Trailers-Only before the response started, in the trailers
//!   after) and that outcome follows the code lists (INTERNAL is cacheable by default:
//!   side effects may have happened). The record is never left in flight.
//! - Calls the handler never saw do not spend their key: besides the layer's own check
//!   (step 5), tonic's refusals of a request it cannot decode (INTERNAL "Missing
//!   request message." or "failed to decode Protobuf message: …", Trailers-Only) release
//!   the record whatever the code lists say. Refusals by other layers between this one
//!   and the handler cannot be told apart from the handler's errors: they follow the
//!   code lists (their usual codes, UNAUTHENTICATED, RESOURCE_EXHAUSTED, UNAVAILABLE…,
//!   release by default).
//! - An inner service error (not a gRPC status) or a response body that fails mid-way
//!   releases the record: no complete response exists to replay.
//! - A handler's lease that could not be renewed does not stop the handler; its
//!   completion is refused if another claimant took over (counted as `stale_fence`).
//! - Replayed responses keep the stored `grpc-encoding`: the response is replayed
//!   exactly as first sent.
//! - A store error while *waiting* for an in-flight duplicate, or on the claim after the
//!   wait, answers UNAVAILABLE (with a retry delay) even on a fail-open method: another
//!   claimant may still be running the call, so running it again would be a second
//!   execution.
//! - The layer's own deadline check and tonic's server timeout (which also reads
//!   `grpc-timeout`) fire at the same moment; whichever answers first wins (tonic's is
//!   CANCELLED "Timeout expired").
//! - The key is validated before the tenant is resolved, so a bad key is reported even
//!   for an unauthenticated caller.
//!
//! # Observability
//! One `idempotency` span per protected call with the method, the first 16 hex digits of
//! the scope (never the raw key), the fence and the outcome (`executed`, `replayed`,
//! `waited`, `mismatch`, `aborted`, `not_retained`, `rejected`, `store_unavailable`,
//! `store_full`, `overloaded`, `fail_open`, `waited_deadline`, `too_many_waiting`,
//! `in_progress_ended`), ending with one `INFO`
//! event `idempotent call` (outcome, what became of the record, gRPC status, duration);
//! counters in [`IdempotencyStats`]; per-call events for metrics through
//! [`IdempotencyLayer::observer`] ([`crate::metrics`]; `idem-otel` records them through
//! OpenTelemetry).

use bytes::Bytes;
use http::{Request, Response};
use tonic::body::Body;
use tower_service::Service;

// Reading order: `service.rs` routes each call (with what `layer.rs` shares between the
// layer's clones); `context.rs` is a protected call's context; `call.rs` reads its
// request (`request.rs`, `fingerprint.rs`, `inflate.rs`), claims its record and answers;
// `handler.rs` runs the handler under the record's lease (`lease.rs`, `renewal.rs`),
// forwarding its response (`forward.rs`) and collecting it for the record
// (`collect.rs`, `decision.rs`); `body.rs` replays; `status.rs` holds the layer's answers.
mod admission;
mod body;
mod call;
mod collect;
mod context;
mod decision;
mod digest;
mod error;
mod fingerprint;
mod forward;
mod future;
mod handler;
mod ignored;
mod inflate;
mod layer;
mod lease;
mod renewal;
mod request;
mod service;
mod stats;
mod status;
pub mod tenant;
#[cfg(test)]
mod tests;

pub use decision::{DECISION_HEADER, IdemDecision};
pub use digest::{derived_key, scope_for, tenant_id};
pub use error::{CheckError, NoTenantSource};
pub use future::ResponseFuture;
pub use handler::RecordFence;
pub use layer::{FingerprintHook, IdempotencyLayer};
pub use service::Idempotency;
pub use stats::{IdempotencyStats, StatsSnapshot};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// What a protected call needs of the wrapped service, in one name: its futures and
/// errors cross the handler's task.
pub(crate) trait HandlerService<B>:
    Service<Request<Body>, Response = Response<B>, Future: Send + 'static, Error: Send + 'static>
    + Send
    + 'static
{
}

impl<S, B> HandlerService<B> for S
where
    S: Service<Request<Body>, Response = Response<B>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
{
}

/// What a protected call needs of the wrapped service's response body.
pub(crate) trait HandlerBody:
    http_body::Body<Data = Bytes, Error: Into<BoxError>> + Send + 'static
{
}

impl<B> HandlerBody for B where
    B: http_body::Body<Data = Bytes, Error: Into<BoxError>> + Send + 'static
{
}
