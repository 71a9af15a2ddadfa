//! A private Redis Cluster reached only through fault proxies: one [`FaultProxy`] in
//! front of each node, shared by every client, with each node announcing its proxy's
//! port (`cluster-announce-port`), so the cluster client's view of the topology
//! (`CLUSTER SLOTS`, `MOVED`, `ASK`) names the proxies and never a node itself. Replicas
//! replicate from the port their master announces, so replication goes through the
//! proxies too (a partitioned master is cut off from its replica's data stream, as on a
//! real network). The cluster bus is not proxied: gossip, failure detection and
//! failover votes go on as they would while clients are cut off.
//!
//! ```no_run
//! # async fn demo() {
//! use idem_demo::netfaults::{Direction, NetFault, ProxiedCluster};
//!
//! let Some(cluster) = ProxiedCluster::start().await else {
//!     return; // no redis-server or redis-cli (outside CI)
//! };
//! // Seed the cluster client with the proxies (`redis://127.0.0.1:P1,…`): it never
//! // learns another address.
//! let seeds = cluster.seeds();
//! // Cut a master off from every client (and its replica's data stream).
//! let master = cluster.cluster().masters().remove(0);
//! cluster
//!     .proxy_of(master.port)
//!     .set(Some(NetFault::Partition(Direction::Both)));
//! # drop(seeds);
//! # }
//! ```

use std::net::SocketAddr;
use std::sync::Arc;

use idem_test_support::redis::RedisCluster;
use tokio::net::TcpListener;

use super::proxy::FaultProxy;

/// A private [`RedisCluster`] behind one proxy per node. Dropping it stops the nodes and
/// the proxies.
pub struct ProxiedCluster {
    // Dropped first: no proxy forwards to a node that is gone.
    proxies: Vec<(String, Arc<FaultProxy>)>,
    /// Each proxy's node, by its own port (same order as `proxies`).
    nodes: Vec<u16>,
    cluster: RedisCluster,
}

impl std::fmt::Debug for ProxiedCluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProxiedCluster")
            .field("proxies", &self.proxies)
            .finish_non_exhaustive()
    }
}

impl ProxiedCluster {
    /// Reserves a proxy port per node, starts the cluster announcing them
    /// ([`RedisCluster::start_announcing`], on a blocking thread), then starts the
    /// proxies, named `instances -> redis node N`. `None` (outside CI) when
    /// `redis-server` or `redis-cli` is missing.
    ///
    /// # Panics
    /// When the cluster or a proxy cannot start.
    pub async fn start() -> Option<ProxiedCluster> {
        let mut listeners = Vec::new();
        for _ in 0..2 * RedisCluster::MASTERS {
            let l = TcpListener::bind("127.0.0.1:0")
                .await
                .expect("bind a proxy port");
            listeners.push(l);
        }
        let announce: Vec<u16> = listeners
            .iter()
            .map(|l| l.local_addr().expect("proxy address").port())
            .collect();
        let runtime = tokio::runtime::Handle::current();
        let (cluster, proxies) = tokio::task::spawn_blocking(move || {
            let mut proxies = Vec::new();
            // The nodes' replicas replicate through the proxies too, so they forward
            // before the nodes announce them.
            let forward = |nodes: &[u16]| {
                let _runtime = runtime.enter();
                for (i, (listener, &port)) in listeners.into_iter().zip(nodes).enumerate() {
                    let upstream = SocketAddr::from(([127, 0, 0, 1], port));
                    let proxy = FaultProxy::listen(listener, upstream).expect("start a node proxy");
                    proxies.push((format!("instances -> redis node {i}"), Arc::new(proxy)));
                }
            };
            let cluster = RedisCluster::start_announcing(&announce, forward);
            cluster.map(|c| (c, proxies))
        })
        .await
        .expect("the cluster start panicked")?;
        let nodes = cluster.ports();
        Some(ProxiedCluster {
            proxies,
            nodes,
            cluster,
        })
    }

    /// The seed nodes, comma-separated (as `--redis-cluster` takes them): the proxies.
    pub fn seeds(&self) -> String {
        self.cluster.urls().join(",")
    }

    /// Every proxy with its name, to drive them
    /// ([`Options::store_proxies`](crate::Options::store_proxies)).
    pub fn proxies(&self) -> &[(String, Arc<FaultProxy>)] {
        &self.proxies
    }

    /// The proxy in front of the node listening on `port` (a [`RedisCluster`] port, as
    /// [`RedisCluster::ports`] and `ClusterNode::port` give them).
    ///
    /// # Panics
    /// When no node listens on `port`.
    pub fn proxy_of(&self, port: u16) -> &Arc<FaultProxy> {
        let i = self
            .nodes
            .iter()
            .position(|&p| p == port)
            .unwrap_or_else(|| panic!("no cluster node on port {port}"));
        &self.proxies[i].1
    }

    /// The cluster (its nodes' own ports, for the test's own commands).
    pub fn cluster(&self) -> &RedisCluster {
        &self.cluster
    }
}
