//! The A6 retry middleware: [`RetryLayer`] / [`Retry`] / [`future::ResponseFuture`].
//!
//! See the [crate docs](crate) for what it does and where it differs from grpc-go.

pub mod backoff;
mod body;
pub mod future;
mod layer;
pub mod outcome;
mod pushback;
mod service;
mod throttle;

pub use layer::{BuildError, RetryLayer, RetryLayerBuilder};
pub use outcome::{CallOutcome, CallReport, OutcomeHook, RetryStats, RetryStatsSnapshot};
pub use service::Retry;
pub use throttle::RetryThrottle;

#[cfg(test)]
mod tests;
