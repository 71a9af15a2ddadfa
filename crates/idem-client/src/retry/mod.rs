//! The A6 retry middleware: [`RetryLayer`] / [`Retry`] / [`future::ResponseFuture`].
//!
//! See the [crate docs](crate) for what it does and where it differs from grpc-go.
//!
//! # Where to start reading
//! - `layer.rs` builds the [`RetryLayer`] and `config.rs` its settings; `service.rs`
//!   ([`Retry`]) takes each call, sends the first attempt and hands the rest to
//!   `future.rs` ([`future::ResponseFuture`]).
//! - `policy/`: the pure decisions, no I/O and no clock: the retry decision
//!   (`policy/mod.rs`), the hedging decision (`policy/hedge.rs`), the backoff, the
//!   server's pushback, the throttle bucket, the retry budget and the circuit breaker
//!   (`policy/gate.rs` asks them in order).
//! - `engine/`: the mechanism around them: what a call carries and how it answers
//!   (`context.rs`), the attempt loop (`attempts.rs`), the hedge race (`race.rs`) and the
//!   per-attempt timers (`timed.rs`).
//! - `request/`: the copy of the request every attempt and hedge sends.
//! - `response/`: reading an attempt's response (`peek.rs`), its transport errors, and
//!   the deadline and size limits that bound the body the caller gets.
//! - `outcome.rs`: the [`CallReport`] every call ends with.

mod config;
mod engine;
pub mod future;
mod layer;
mod outcome;
mod policy;
mod request;
mod response;
mod service;

pub(crate) use engine::context::CallPath;
pub use layer::{BuildError, RetryLayer, RetryLayerBuilder};
pub use outcome::{
    AttemptEnd, AttemptRecord, CallOutcome, CallReport, OutcomeHook, RetryStats, RetryStatsSnapshot,
};
pub use policy::backoff;
pub use policy::breaker::{BreakerState, CircuitBreaker};
pub use policy::budget::RetryBudget;
pub use policy::throttle::RetryThrottle;
pub use service::Retry;

/// The inner request: what the layer sends its inner service.
pub(crate) type Req = http::Request<tonic::body::Body>;

/// What the layer answers: a response whose body is a [`tonic::body::Body`].
pub(crate) type Resp = http::Response<tonic::body::Body>;

#[cfg(test)]
mod guard_tests;
#[cfg(test)]
mod tests;
