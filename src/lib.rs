//! idem: effectively-once gRPC writes for tonic.
//!
//! - [`client`] (`idem-client`): a tower layer for tonic channels that retries by gRPC
//!   status code (gRFC A6) under the call's deadline, and sends a stable
//!   `x-idempotency-key` on every attempt.
//! - [`server`] (`idem-server`): a tower layer for tonic servers that runs each key once
//!   and replays the stored response to duplicates.
//! - [`redis`] (`idem-redis`): a Redis store so several server instances act as one.
//! - [`core`] (`idem-core`): the service config both layers read, keys, deadlines.

pub use idem_client as client;
pub use idem_core as core;
pub use idem_redis as redis;
pub use idem_server as server;

pub use idem_core::{ConfigError, ServiceConfig};
