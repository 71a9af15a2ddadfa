//! idem-client (docs being written)

mod key;
pub mod retry;

pub use key::{IdempotencyKeyInterceptor, RequestKeyExt, with_key};
pub use retry::{
    BuildError, CallOutcome, CallReport, Retry, RetryLayer, RetryLayerBuilder, RetryStats,
    RetryStatsSnapshot, RetryThrottle,
};

/// The boxed error type of request bodies.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
