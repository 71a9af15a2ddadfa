//! The Redis Cluster store follows a failover while the old master stops answering (its
//! connections stay open, no replies: a partition, a hung host).
//!
//! redis-rs 1.8.1 retries a response timeout on the same node, with no reconnect and no
//! slot refresh, so without help the old master keeps its slots in the client's map
//! until its TCP connection dies (here: when the partition heals; on a real network
//! after `tcp_retries2`, about 15 min). Every call on those slots is UNAVAILABLE all that
//! time, a run in flight there cannot renew its lease, and past the lease another
//! instance takes it over: a double execution was seen. The store rebuilds its cluster
//! connection after a command timeout (reading the slot map again from a node that
//! answers), so calls succeed again soon after the promotion, while the old master is
//! still partitioned.
//!
//! No timing is asserted tightly: the bound is many command timeouts, and "succeeds
//! again" is a run of consecutive successful calls on fresh keys (a third of which land
//! on the failed-over slots), plus the promoted master running the scripts.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use idem::core::config::ServiceConfig;
use idem::core::key::IdempotencyKey;
use idem::redis::RedisStore;
use idem::server::idempotency::{IdempotencyLayer, tenant::SingleTenant};
use idem::server::inbound::InboundLayer;
use idem_demo::DEFAULT_CONFIG;
use idem_demo::netfaults::{Direction, NetFault, ProxiedCluster};
use idem_test_support::redis::RedisCluster;
use idem_test_support::shop::orders_client::OrdersClient;
use idem_test_support::shop::orders_server::OrdersServer;
use idem_test_support::shop::{CreateOrderRequest, Order};
use tonic::transport::Server;
use tonic::{Request, Response};

/// The store's command timeout (the default, spelled out: the bounds below count in it).
const COMMAND_TIMEOUT: Duration = Duration::from_millis(500);
/// Consecutive successful fresh calls that show the failed-over slots work: with a third
/// of the keys on them, a broken map passes this by chance with odds (2/3)^40 < 1e-7.
const IN_A_ROW: usize = 40;
/// How long after the promotion the calls may take to succeed again: 120 command
/// timeouts (a rebuild takes about one command timeout plus a connect timeout; the rest
/// is room for a loaded 2-core machine). Without the rebuild they never do while the
/// partition holds.
const RECOVERY_BOUND: Duration = Duration::from_secs(60);

#[derive(Clone, Default)]
struct Orders;

idem_test_support::create_only_orders! {
    Orders, why = "the test only creates orders";
    create_order(&self, _request) {
        Ok(Response::new(Order { order_id: "ord".into(), ..Default::default() }))
    }
}

async fn call(addr: SocketAddr) -> Result<Response<Order>, tonic::Status> {
    let mut client = OrdersClient::new(idem_test_support::net::channel(addr));
    let mut req = Request::new(CreateOrderRequest {
        note: "n".into(),
        quantity: 1,
        ..Default::default()
    });
    idem::client::with_key(&mut req, &IdempotencyKey::generate());
    client.create_order(req).await
}

/// `EVALSHA` calls a node has run (the idem scripts).
fn script_calls(nodes: &RedisCluster, port: u16) -> u64 {
    let info = nodes
        .cmd(port, &["INFO", "commandstats"])
        .expect("INFO commandstats")
        .text();
    info.lines()
        .find_map(|l| l.strip_prefix("cmdstat_evalsha:"))
        .and_then(|s| s.split(',').find_map(|kv| kv.strip_prefix("calls=")))
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_store_follows_a_failover_while_the_old_master_stops_answering() {
    let Some(cluster) = ProxiedCluster::start().await else {
        return;
    };
    let store = RedisStore::cluster_builder(cluster.seeds().split(','))
        .command_timeout(COMMAND_TIMEOUT)
        .connect()
        .await
        .unwrap();
    let config = ServiceConfig::from_json(DEFAULT_CONFIG).unwrap();
    let layer = IdempotencyLayer::new(store, &config).tenant(SingleTenant::new("demo"));
    let (addr, incoming) = idem_test_support::net::bind().await;
    tokio::spawn(
        Server::builder()
            .layer(InboundLayer::new())
            .layer(layer)
            .add_service(OrdersServer::new(Orders))
            .serve_with_incoming(incoming),
    );
    let nodes = cluster.cluster();
    let victim = nodes.masters().remove(0);
    let replica = nodes.replica_of(&victim.id);
    // Warm up: the connection to every master is open and in the client's map.
    for _ in 0..30 {
        call(addr).await.unwrap();
    }

    // The victim stops answering both ways; its connections stay open (the proxy keeps
    // them). Its replica takes over without it.
    let proxy = cluster.proxy_of(victim.port).clone();
    proxy.set(Some(NetFault::Partition(Direction::Both)));
    let before = tokio::task::block_in_place(|| {
        let before = script_calls(nodes, replica.port);
        nodes
            .cmd(replica.port, &["CLUSTER", "FAILOVER", "FORCE"])
            .unwrap();
        let started = Instant::now();
        while !nodes
            .masters()
            .iter()
            .any(|m| m.id == replica.id && !m.slots.is_empty())
        {
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "the replica was not promoted"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        before
    });
    let promoted = Instant::now();

    // Fresh keys over every slot until IN_A_ROW succeed in a row, the partition held.
    let mut in_a_row = 0;
    let mut failures = 0;
    let mut last_failure = None;
    while in_a_row < IN_A_ROW && promoted.elapsed() < RECOVERY_BOUND {
        match call(addr).await {
            Ok(_) => in_a_row += 1,
            Err(s) => {
                in_a_row = 0;
                failures += 1;
                last_failure = Some((promoted.elapsed(), s.code(), s.message().to_owned()));
            }
        }
    }
    let recovered = in_a_row >= IN_A_ROW;
    let after = tokio::task::block_in_place(|| script_calls(nodes, replica.port));
    proxy.heal();
    eprintln!(
        "after the promotion: {failures} failed calls, the last {last_failure:?}; \
         {in_a_row} in a row at {:?}; the promoted master ran {} scripts",
        promoted.elapsed(),
        after - before
    );
    assert!(
        recovered,
        "calls on the failed-over slots still fail {RECOVERY_BOUND:?} after the promotion \
         (the old master partitioned): {failures} failures, the last {last_failure:?}"
    );
    assert!(
        after > before,
        "the promoted master ran no script: the calls never reached the failed-over slots"
    );
}
