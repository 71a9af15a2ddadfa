//! Across hops: record the inbound call's deadline for the handler, and retry at one
//! layer only.
//!
//! [`InboundLayer`] goes on a tonic server (outermost, before authentication or
//! [`IdempotencyLayer`](crate::idempotency::IdempotencyLayer)). For every call, protected or not, it:
//!
//! 1. reads `grpc-timeout` and `grpc-previous-rpc-attempts` and runs the handler inside an
//!    [`InboundScope`](idem_core::deadline::InboundScope), so a `RetryLayer` client used
//!    by the handler gives each downstream call what is left of the inbound deadline, not
//!    the original budget. Handlers that spawn tasks carry the scope over with
//!    [`current_scope`](idem_core::deadline::current_scope) and
//!    [`InboundScope::run`](idem_core::deadline::InboundScope::run).
//! 2. gives the scope a random marker. When a client layer used by the handler ends a call
//!    because its retries were exhausted, throttled or stopped by pushback, it tags the
//!    failure with that marker; if the handler passes that failure up (`?` on the
//!    `Status`), this layer replaces the tag with `grpc-retry-pushback-ms: -1`, so A6
//!    clients upstream (idem, grpc-go, grpc-java, grpcio) do not retry it again. A chain of
//!    retrying hops then costs `maxAttempts` attempts at the bottom, not `maxAttempts^hops`.
//!    The tag never leaves the process: a tag that is not this call's marker is removed,
//!    and an error the handler made itself carries no tag.
//!
//! ```no_run
//! # async fn run(router: tonic::service::Routes) -> Result<(), Box<dyn std::error::Error>> {
//! use idem_server::inbound::InboundLayer;
//! tonic::transport::Server::builder()
//!     .layer(InboundLayer::new())
//!     .add_routes(router)
//!     .serve("127.0.0.1:50051".parse()?)
//!     .await?;
//! # Ok(()) }
//! ```
//!
//! # Defaults
//! The pushback marker is on ([`InboundLayer::pushback_on_exhausted`] switches it).

mod body;
mod future;
mod layer;
mod service;

pub use body::ResponseBody;
pub use future::ResponseFuture;
pub use layer::InboundLayer;
pub use service::Inbound;
pub(crate) use service::scope_of;
