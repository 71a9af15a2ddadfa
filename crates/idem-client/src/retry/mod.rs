//! The A6 retry middleware: [`RetryLayer`] / [`Retry`] / [`future::ResponseFuture`].
//!
//! See the [crate docs](crate) for what it does and where it differs from grpc-go.

pub mod backoff;
mod body;
mod call;
mod config;
mod context;
mod deadline;
pub mod future;
mod hedge;
mod hedge_body;
mod hedge_policy;
mod layer;
mod limit;
mod outcome;
mod peek;
mod policy;
mod pushback;
mod replay;
mod service;
mod throttle;
mod timed;
mod transport;

pub(crate) use context::CallPath;
pub use layer::{BuildError, RetryLayer, RetryLayerBuilder};
pub use outcome::{
    AttemptEnd, AttemptRecord, CallOutcome, CallReport, OutcomeHook, RetryStats, RetryStatsSnapshot,
};
pub(crate) use peek::Resp;
pub use service::Retry;
pub use throttle::RetryThrottle;

#[cfg(test)]
mod strategies;
#[cfg(test)]
mod test_util;
#[cfg(test)]
mod tests;
