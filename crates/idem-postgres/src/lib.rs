//! A PostgreSQL-backed idempotency [`Store`](idem_store::Store) for `idem-server`.
//!
//! (crate docs below)

mod builder;
mod error;
mod listen;
mod schema;
mod store;
mod sweep;

pub use builder::{
    ConnectError, DEFAULT_CONNECT_TIMEOUT, DEFAULT_MAX_CONNECTIONS, DEFAULT_POLL_MAX,
    DEFAULT_POLL_MIN, DEFAULT_STATEMENT_TIMEOUT, DEFAULT_SWEEP_BATCH, DEFAULT_SWEEP_INTERVAL,
    DEFAULT_TABLE_PREFIX, DEFAULT_TOMBSTONE_TTL, NOTIFY_SAFETY_POLL, PostgresStoreBuilder,
    WaitStrategy,
};
pub use schema::SCHEMA_VERSION;
pub use store::PostgresStore;

/// The schema SQL for `prefix` (every name of the default schema with `idem_` replaced),
/// for operators who create the schema by hand. `None` when `prefix` is not a valid table
/// prefix (see [`PostgresStoreBuilder::table_prefix`]).
pub fn schema_sql(prefix: &str) -> Option<String> {
    schema::valid_prefix(prefix).then(|| schema::render(schema::SCHEMA_SQL, prefix))
}
