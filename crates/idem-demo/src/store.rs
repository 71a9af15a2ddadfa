//! Where the demo's server layer keeps its records.

use idem_redis::{ConnectError, RedisStore};
use idem_store::faulty::FaultyStore;
use idem_store::memory::MemoryStore;

/// The store of an in-process run, shared by its instances.
#[derive(Clone)]
pub enum DemoStore {
    /// One in-memory store shared by the instances of this process.
    Memory(MemoryStore),
    /// Redis, shared by every instance.
    Redis(RedisStore),
    /// An in-memory store behind a fault injector (store blips, lost replies).
    Faulty(FaultyStore<MemoryStore>),
}

/// A Redis store with the default settings: a Redis Cluster when `url` is a
/// comma-separated list of seed nodes (how the demo passes a cluster around), else one
/// endpoint.
pub async fn connect_redis(url: &str) -> Result<RedisStore, ConnectError> {
    if url.contains(',') {
        let nodes = url.split(',').map(str::trim).filter(|n| !n.is_empty());
        RedisStore::cluster_builder(nodes).connect().await
    } else {
        RedisStore::connect(url.to_owned()).await
    }
}
