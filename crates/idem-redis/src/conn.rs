//! The command connection: one reconnecting connection to a single Redis endpoint, or
//! a Redis Cluster connection that routes each command to the master of its key's slot.
//!
//! Both are `redis::aio::ConnectionLike`, so the store sends the same scripts through
//! either. What the cluster client adds: it learns the slot map (`CLUSTER SLOTS`),
//! follows `MOVED` (a slot that moved for good: it refreshes the map) and `ASK` (a slot
//! being migrated: `ASKING` then the command on the target), and reconnects to nodes it
//! lost, finding the promoted replica after a failover. Every call is still bounded by
//! the store's command timeout, so a cluster that is down answers UNAVAILABLE in time.
//!
//! What the cluster client does not do: follow a failover while the old master stops
//! answering but keeps its TCP connection open (a partition, a hung host). redis-rs
//! 1.8.1 retries a response timeout on the same node, with no reconnect and no slot
//! refresh, so the old master keeps its slots in the client's map until its connection
//! dies (minutes: `tcp_retries2`), long after the cluster promoted its replica. So
//! [`Shared::suspect`] (called on every command timeout) rebuilds the cluster
//! connection in the background, at most once per command timeout: a new connection
//! reads the slot map from a node that answers, and the next calls go by that map.

use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::Duration;

use redis::aio::{ConnectionLike, ConnectionManager};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, Pipeline, RedisFuture, Value};
use tokio::time::Instant;

/// A cheap-to-clone handle on the store's command connection, for one call.
#[derive(Clone)]
pub(crate) enum Conn {
    /// One endpoint: a standalone Redis, a Sentinel-managed primary, a proxy.
    Single(ConnectionManager),
    /// Redis Cluster (`cluster-async`): one multiplexed connection per node.
    Cluster(ClusterConnection),
}

/// The store's connection, shared by every clone of the store: one endpoint's, or the
/// current cluster connection, replaced when a timeout makes it suspect.
pub(crate) enum Shared {
    /// One endpoint (its `ConnectionManager` reconnects on its own).
    Single(ConnectionManager),
    /// Redis Cluster, rebuilt after timeouts.
    Cluster(Arc<Rebuilt>),
}

impl Shared {
    /// A cluster connection that [`suspect`](Self::suspect) rebuilds: a new one from
    /// `client` (at most every `min_interval`, each attempt bounded by `attempt_limit`).
    pub(crate) fn cluster(
        client: ClusterClient,
        conn: ClusterConnection,
        min_interval: Duration,
        attempt_limit: Duration,
    ) -> Self {
        Shared::Cluster(Arc::new(Rebuilt {
            client,
            current: RwLock::new(conn),
            state: Mutex::new(RebuildState::default()),
            min_interval,
            attempt_limit,
        }))
    }

    /// Whether this is a Redis Cluster connection.
    pub(crate) fn is_cluster(&self) -> bool {
        matches!(self, Shared::Cluster(_))
    }

    /// A handle for one call: on a cluster, the current connection.
    pub(crate) fn handle(&self) -> Conn {
        match self {
            Shared::Single(c) => Conn::Single(c.clone()),
            Shared::Cluster(r) => Conn::Cluster(r.current()),
        }
    }

    /// A command timed out: on a cluster, the node it went to may be gone while its
    /// connection stays open, so rebuild the connection (in the background, at most once
    /// per `min_interval`). Nothing on a single endpoint.
    pub(crate) fn suspect(&self) {
        if let Shared::Cluster(r) = self {
            Rebuilt::suspect(r);
        }
    }
}

/// A cluster connection and what it takes to replace it.
pub(crate) struct Rebuilt {
    client: ClusterClient,
    current: RwLock<ClusterConnection>,
    state: Mutex<RebuildState>,
    min_interval: Duration,
    attempt_limit: Duration,
}

#[derive(Default)]
struct RebuildState {
    /// A rebuild is under way.
    running: bool,
    /// When the last rebuild started or ended (whichever is later).
    last: Option<Instant>,
    /// Rebuilds that replaced the connection (for tests and logs).
    done: u64,
}

impl Rebuilt {
    fn current(&self) -> ClusterConnection {
        self.current
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, RebuildState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Rebuilds that replaced the connection so far.
    #[cfg(test)]
    pub(crate) fn rebuilds(&self) -> u64 {
        self.lock().done
    }

    fn suspect(this: &Arc<Self>) {
        // Outside a runtime (cannot happen from a command future, but never panic)
        // there is nothing to run the rebuild on: keep the connection.
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        {
            let now = Instant::now();
            let mut s = this.lock();
            if s.running || s.last.is_some_and(|t| now < t + this.min_interval) {
                return;
            }
            s.running = true;
            s.last = Some(now);
        }
        let guard = Running(this.clone());
        runtime.spawn(async move {
            let this = &guard.0;
            match tokio::time::timeout(this.attempt_limit, this.client.get_async_connection())
                .await
            {
                Ok(Ok(conn)) => {
                    *this.current.write().unwrap_or_else(PoisonError::into_inner) = conn;
                    this.lock().done += 1;
                    tracing::info!(
                        "redis cluster connection rebuilt after a command timeout (slot map read again)"
                    );
                }
                Ok(Err(e)) => tracing::warn!(
                    error = %e,
                    "redis cluster connection not rebuilt after a command timeout; keeping the old one"
                ),
                Err(_) => tracing::warn!(
                    limit = ?this.attempt_limit,
                    "redis cluster connection not rebuilt in time after a command timeout; keeping the old one"
                ),
            }
        });
    }
}

/// Ends a rebuild, also when its task is dropped (runtime shut down) or panics.
struct Running(Arc<Rebuilt>);

impl Drop for Running {
    fn drop(&mut self) {
        let mut s = self.0.lock();
        s.running = false;
        s.last = Some(Instant::now());
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

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use idem_store::StoreError;
    use idem_test_support::redis::RedisCluster;
    use redis::Value;

    use crate::RedisStore;
    use crate::conn::{Rebuilt, Shared};

    /// A master that stops answering (`CLIENT PAUSE`, its connections open): the
    /// commands that time out on it start one rebuild between them, not one each, and
    /// the rebuilt connection serves the key again once the node answers.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn timeouts_rebuild_the_cluster_connection_once() {
        let Some(cluster) = tokio::task::block_in_place(RedisCluster::start) else {
            return;
        };
        // A connect timeout longer than the pause: the rebuild's connection to the
        // paused node waits the pause out instead of failing.
        let store = RedisStore::cluster_builder(cluster.urls())
            .connect_timeout(Duration::from_secs(10))
            .connect()
            .await
            .unwrap();
        let Shared::Cluster(rebuilt) = &store.backend.conn else {
            panic!("a cluster store");
        };
        let key = "rebuild-test";
        let get = |store: RedisStore| async move {
            let mut c = store.connection();
            store
                .bounded(store.command_timeout(), async move {
                    redis::cmd("GET")
                        .arg(key)
                        .query_async::<Value>(&mut c)
                        .await
                })
                .await
        };
        // Warm up (a loaded machine may time a first call out: that rebuild is let end).
        let idle = |rebuilt: Arc<Rebuilt>| async move {
            let mut waited = Duration::ZERO;
            while rebuilt.lock().running {
                assert!(waited < Duration::from_secs(60), "a rebuild never ended");
                tokio::time::sleep(Duration::from_millis(50)).await;
                waited += Duration::from_millis(50);
            }
            // Past the spacing of rebuilds, so the next timeout may start one.
            tokio::time::sleep(rebuilt.min_interval).await;
            rebuilt.rebuilds()
        };
        let mut tries = 0;
        while get(store.clone()).await.is_err() {
            tries += 1;
            assert!(tries < 50, "the cluster does not answer");
        }
        let before = idle(rebuilt.clone()).await;
        let master = cluster.master_of_slot(cluster.slot_of(key));
        tokio::task::block_in_place(|| {
            cluster
                .cmd(master.port, &["CLIENT", "PAUSE", "2000", "ALL"])
                .unwrap()
        });
        let calls: Vec<_> = (0..10).map(|_| tokio::spawn(get(store.clone()))).collect();
        let mut timed_out = 0;
        for c in calls {
            if matches!(c.await.unwrap(), Err(StoreError::Unavailable(_))) {
                timed_out += 1;
            }
        }
        assert!(timed_out > 0, "no call timed out on the paused master");
        // The rebuild ends once the pause does (a few seconds; generous bound).
        assert_eq!(
            idle(rebuilt.clone()).await,
            before + 1,
            "one rebuild for ten timeouts at once"
        );
        let mut tries = 0;
        while get(store.clone()).await.is_err() {
            tries += 1;
            assert!(tries < 50, "the rebuilt connection does not serve the key");
        }
    }
}
