//! idem: effectively-once gRPC writes for tonic.
//!
//! - [`client`] (`idem-client`, feature `client`): a tower layer for tonic channels that
//!   retries by gRPC status code (gRFC A6) under the call's deadline, and sends a stable
//!   `x-idempotency-key` on every attempt.
//! - [`server`] (`idem-server`, feature `server`): a tower layer for tonic servers that
//!   runs each key once and replays the stored response to duplicates.
//! - [`store`] (`idem-store`, with `server`): the store contract and the embedded
//!   [`MemoryStore`](store::memory::MemoryStore).
//! - `redis` (`idem-redis`, feature `redis`): a Redis store so several server instances
//!   act as one.
//! - `postgres` (`idem-postgres`, feature `postgres`): a PostgreSQL store, in which a
//!   handler can commit its own writes and its record's completion in one transaction,
//!   so a crash at any point leaves the write and its reply, or neither.
//! - [`core`] (`idem-core`, always): the service config both layers read, keys,
//!   deadlines, status codes.
//!
//! On crates.io the package is `idem-grpc` (`idem` was taken); its library is `idem`, so
//! `cargo add idem-grpc` and `use idem::…`.
//!
//! # Features
//! | feature | default | brings |
//! |---|---|---|
//! | `client` | yes | [`client`] |
//! | `server` | yes | [`server`], [`store`] |
//! | `redis` | no | `redis` (implies `server`) |
//! | `otel` | no | `otel`: OpenTelemetry metrics for both layers, a Prometheus exposition (implies `client`, `server`) |
//! | `postgres` | no | `postgres` (implies `server`) |
//!
//! A client-only build (`default-features = false, features = ["client"]`) compiles no
//! server layer, no store backend, no SHA-256 and no compression code.

// docs.rs (`--cfg docsrs`, nightly): each re-export says which feature brings it.
#![cfg_attr(docsrs, feature(doc_cfg))]

#[cfg(feature = "client")]
#[cfg_attr(docsrs, doc(cfg(feature = "client")))]
pub use idem_client as client;
pub use idem_core as core;
#[cfg(feature = "otel")]
#[cfg_attr(docsrs, doc(cfg(feature = "otel")))]
pub use idem_otel as otel;
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub use idem_postgres as postgres;
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub use idem_redis as redis;
#[cfg(feature = "server")]
#[cfg_attr(docsrs, doc(cfg(feature = "server")))]
pub use idem_server as server;
#[cfg(feature = "server")]
#[cfg_attr(docsrs, doc(cfg(feature = "server")))]
pub use idem_store as store;

/// What idem commits to: the semantics both layers and every store follow
/// (`docs/semantics.md` in the repository).
#[doc = include_str!("../docs/semantics.md")]
pub mod semantics {}

/// The README's Rust snippets, compiled as doctests so they cannot rot.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeSnippets;
