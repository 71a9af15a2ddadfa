//! The store conformance suite (`idem_store::testing`) on a real `redis-server`, with
//! both wait strategies (pub/sub notification and polling only). Each test starts its own
//! server on a free port (`idem_test_support::redis`); without a `redis-server` binary
//! the tests say so and pass, except under `CI`, where they fail.

use idem_redis::{RedisStore, WaitStrategy};
use idem_test_support::redis::RedisServer;

async fn store(strategy: WaitStrategy) -> Option<(RedisStore, RedisServer)> {
    let server = RedisServer::start()?;
    let store = RedisStore::builder(server.url())
        .key_prefix("conformance:")
        .wait_strategy(strategy)
        .connect()
        .await
        .expect("connect to the test redis");
    Some((store, server))
}

idem_store::store_conformance_tests! {
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    make_each = store(WaitStrategy::Notify) => notify, store(WaitStrategy::Poll) => polling;
}

/// The per-tenant in-flight quota (`max_in_flight_per_tenant`), with the bound the
/// suite's case expects.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenant_in_flight_bound() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    let store = RedisStore::builder(server.url())
        .key_prefix("conformance:")
        .max_in_flight_per_tenant(Some(idem_store::testing::TENANT_IN_FLIGHT_BOUND))
        .connect()
        .await
        .expect("connect to the test redis");
    idem_store::testing::tenant_in_flight_bound(&store).await;
}

/// The quota holds for claims sent at once through two stores (two instances) on one
/// Redis.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenant_in_flight_bound_across_instances() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    let mut stores = Vec::new();
    for _ in 0..2 {
        let store = RedisStore::builder(server.url())
            .key_prefix("conformance:")
            .max_in_flight_per_tenant(Some(idem_store::testing::TENANT_IN_FLIGHT_BOUND))
            .connect()
            .await
            .expect("connect to the test redis");
        stores.push(store);
    }
    idem_store::testing::tenant_in_flight_bound_across_instances(&stores).await;
}

/// The per-tenant stored-bytes quota (`max_bytes_per_tenant`), with the bound the
/// suite's case expects, checked in the claim and completion scripts themselves; with
/// the in-flight quota on as well (the default), so the two meet in one script.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenant_bytes_bound() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    let store = RedisStore::builder(server.url())
        .key_prefix("conformance:")
        .max_bytes_per_tenant(Some(idem_store::testing::TENANT_BYTES_BOUND))
        .connect()
        .await
        .expect("connect to the test redis");
    idem_store::testing::tenant_bytes_bound(&store).await;
}
