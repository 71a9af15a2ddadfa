//! The command connection: one reconnecting connection to a single Redis endpoint, or
//! a Redis Cluster connection that routes each command to the master of its key's slot.
//!
//! Both are `redis::aio::ConnectionLike`, so the store sends the same scripts through
//! either. What the cluster client adds: it learns the slot map (`CLUSTER SLOTS`),
//! follows `MOVED` (a slot that moved for good: it refreshes the map) and `ASK` (a slot
//! being migrated: `ASKING` then the command on the target), and reconnects to nodes it
//! lost, finding the promoted replica after a failover. Every call is still bounded by
//! the store's command timeout, so a cluster that is down answers UNAVAILABLE in time.

use redis::aio::{ConnectionLike, ConnectionManager};
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, Pipeline, RedisFuture, Value};

/// A cheap-to-clone handle on the store's command connection.
#[derive(Clone)]
pub(crate) enum Conn {
    /// One endpoint: a standalone Redis, a Sentinel-managed primary, a proxy.
    Single(ConnectionManager),
    /// Redis Cluster (`cluster-async`): one multiplexed connection per node.
    Cluster(ClusterConnection),
}

impl Conn {
    /// Whether this is a Redis Cluster connection.
    pub(crate) fn is_cluster(&self) -> bool {
        matches!(self, Conn::Cluster(_))
    }
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Conn::Single(c) => c.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Conn::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Conn::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Single(c) => c.get_db(),
            Conn::Cluster(c) => c.get_db(),
        }
    }
}
