//! The gRPC service config, parsed and validated.
//!
//! One JSON document in the service-config format (gRFC A2, A6,
//! `grpc/service_config/service_config.proto`) configures both of idem's layers. The
//! standard fields mean exactly what they mean to grpc-go, grpc-java and grpcio; idem's
//! own settings are extra objects those stacks ignore:
//!
//! - `methodConfig[].idempotency` ([`IdempotencyPolicy`]): its presence marks the
//!   method as *protected*.
//! - top-level `idem` ([`IdemSettings`]): process-wide settings.
//!
//! ```
//! use idem_core::ServiceConfig;
//! let parsed = ServiceConfig::from_json(r#"{
//!   "methodConfig": [{
//!     "name": [{"service": "shop.v1.Orders", "method": "CreateOrder"}],
//!     "timeout": "2s",
//!     "retryPolicy": {
//!       "maxAttempts": 4, "initialBackoff": "0.05s", "maxBackoff": "1s",
//!       "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]
//!     },
//!     "idempotency": {}
//!   }]
//! }"#).unwrap();
//! let method = parsed.config.lookup("shop.v1.Orders", "CreateOrder").unwrap();
//! assert_eq!(method.retry_policy().unwrap().max_attempts(), 4);
//! assert!(method.idempotency().is_some());
//! ```

mod duration;
mod json;
mod parse;
#[cfg(test)]
mod tests;
mod types;

pub use duration::{DurationError, MAX_DURATION_SECONDS, format_duration, parse_duration};
pub use types::*;
