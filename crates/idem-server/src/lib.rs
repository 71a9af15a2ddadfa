//! Server half of idem: a tower layer for tonic servers that runs each idempotency key
//! once and replays the stored response to duplicates.
//!
//! - [`idempotency`]: [`IdempotencyLayer`] / [`Idempotency`], the middleware.
//! - [`store`]: the [`Store`](store::Store) trait its records live in, and
//!   [`MemoryStore`], the embedded default.

pub mod idempotency;
pub mod store;

pub use idempotency::{
    IdemDecision, Idempotency, IdempotencyLayer, IdempotencyStats, RecordFence, StatsSnapshot,
    scope_for, tenant,
};
pub use store::MemoryStore;
