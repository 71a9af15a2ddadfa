//! Server half of idem: a tower layer for tonic servers that runs each idempotency key
//! once and replays the stored response to duplicates.
//!
//! - [`idempotency`]: [`IdempotencyLayer`] / [`Idempotency`], the middleware.
//! - [`inbound`]: [`InboundLayer`], which records the inbound deadline for every call and
//!   turns an exhausted downstream failure into `grpc-retry-pushback-ms: -1`.
//! - [`store`]: the [`Store`](store::Store) trait its records live in, and
//!   [`MemoryStore`], the embedded default.

pub mod idempotency;
pub mod inbound;
pub mod store;

pub use idempotency::{
    IdemDecision, Idempotency, IdempotencyLayer, IdempotencyStats, RecordFence, StatsSnapshot,
    scope_for, tenant,
};
pub use inbound::{Inbound, InboundLayer};
pub use store::MemoryStore;
