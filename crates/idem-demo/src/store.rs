//! Where the demo's server layer keeps its records.

#[cfg(feature = "redis")]
use idem_redis::{ConnectError, RedisStore};
use idem_store::faulty::FaultyStore;
use idem_store::memory::MemoryStore;

/// The store of an in-process run, shared by its instances.
#[derive(Clone)]
pub enum DemoStore {
    /// One in-memory store shared by the instances of this process.
    Memory(MemoryStore),
    /// Redis, shared by every instance (feature `redis`).
    #[cfg(feature = "redis")]
    Redis(RedisStore),
    /// An in-memory store behind a fault injector (store blips, lost replies).
    Faulty(FaultyStore<MemoryStore>),
}

/// A Redis store with the default settings: a Redis Cluster when `url` is a
/// comma-separated list of seed nodes (how the demo passes a cluster around), else one
/// endpoint.
#[cfg(feature = "redis")]
pub async fn connect_redis(url: &str) -> Result<RedisStore, ConnectError> {
    if url.contains(',') {
        let nodes = url.split(',').map(str::trim).filter(|n| !n.is_empty());
        RedisStore::cluster_builder(nodes).connect().await
    } else {
        RedisStore::connect(url.to_owned()).await
    }
}

/// The PostgreSQL store of an instance process: [`idem_postgres::PostgresStore`] with the
/// `postgres` feature; without it no value exists, so the PostgreSQL paths cannot run.
#[cfg(feature = "postgres")]
pub type PgStore = idem_postgres::PostgresStore;
/// The PostgreSQL store of an instance process: [`idem_postgres::PostgresStore`] with the
/// `postgres` feature; without it no value exists, so the PostgreSQL paths cannot run.
#[cfg(not(feature = "postgres"))]
pub type PgStore = std::convert::Infallible;

/// The connection pool of the orders table (`--store postgres`): a sqlx pool with the
/// `postgres` feature, no value without it.
#[cfg(feature = "postgres")]
pub type PgPool = sqlx::PgPool;
/// The connection pool of the orders table (`--store postgres`): a sqlx pool with the
/// `postgres` feature, no value without it.
#[cfg(not(feature = "postgres"))]
pub type PgPool = std::convert::Infallible;

/// The error of a run that asked for a backend this binary was built without, naming the
/// command that builds it (`feature`: `redis` or `postgres`).
pub fn missing_feature(store: &str, feature: &str) -> crate::BoxError {
    format!(
        "--store {store} needs the demo built with the `{feature}` feature: \
         cargo run --release -p idem-demo --features {feature} -- --store {store} …"
    )
    .into()
}
