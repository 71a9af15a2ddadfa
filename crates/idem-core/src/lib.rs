//! The parts of idem that the client and server layers share.
//!
//! - [`config`]: the gRPC service-config document (gRFC A2 / A6 and
//!   `grpc/service_config/service_config.proto`) parsed and validated into domain types,
//!   with idem's own `idempotency` (per method) and `idem` (process-wide) objects.
//! - [`code`]: status-code names and [`CodeSet`](code::CodeSet).
//! - [`key`]: the `x-idempotency-key` value: validation and generation.
//! - [`deadline`]: `grpc-timeout` parsing and encoding, and the inbound deadline that a
//!   server records so outgoing calls inherit what is left of it.
//! - [`derive`](mod@derive): keys derived for the downstream calls of a protected handler from its
//!   inbound record, so a run after a crash sends the same keys downstream.
//! - [`headers`]: the metadata names idem reads and writes, and the `ErrorInfo` reasons
//!   its layers put on the errors they make.
//! - [`striped`]: counters that every worker thread adds to without sharing a cache line.

pub mod code;
pub mod config;
pub mod deadline;
pub mod derive;
pub mod descriptor;
pub mod endpoint;
pub mod headers;
pub mod key;
mod macros;
pub mod striped;
