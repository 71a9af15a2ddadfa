//! Server half of idem: a tower layer for tonic servers that runs each idempotency key
//! once and replays the stored response to duplicates.
//!
//! - [`idempotency`]: [`IdempotencyLayer`](idempotency::IdempotencyLayer) /
//!   [`Idempotency`](idempotency::Idempotency), the middleware.
//! - [`drain`]: [`Drain`](drain::Drain), a graceful drain for rolling deploys: GOAWAY
//!   through tonic's `serve_with_shutdown`, then `REFUSED_STREAM` for streams that still
//!   arrive ([`Drain::layer`](drain::Drain::layer)), protected runs finished and recorded
//!   before the process exits, bounded by a drain timeout.
//! - [`inbound`]: [`InboundLayer`](inbound::InboundLayer), which records the inbound deadline for every call and
//!   turns an exhausted downstream failure into `grpc-retry-pushback-ms: -1`.
//!
//! Records live in a store: the [`Store`](idem_store::Store) trait and the embedded
//! [`MemoryStore`](idem_store::memory::MemoryStore) are in `idem-store`; `idem-redis` shares
//! records between instances.

pub mod drain;
pub mod idempotency;
pub mod inbound;
pub mod metrics;
