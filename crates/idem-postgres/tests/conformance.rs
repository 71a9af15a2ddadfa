//! The store conformance suite (`idem_store::testing`) on a real PostgreSQL, with both
//! wait strategies (LISTEN/NOTIFY and polling only). Each test starts its own server on a
//! free port (`idem_test_support::postgres`); without PostgreSQL installed the tests say
//! so and pass, except under `CI`, where they fail.

use idem_postgres::{PostgresStore, WaitStrategy};
use idem_test_support::postgres::PostgresServer;

async fn store(strategy: WaitStrategy) -> Option<(PostgresStore, PostgresServer)> {
    let server = PostgresServer::start()?;
    let store = PostgresStore::builder(server.url())
        .table_prefix("conformance_")
        .wait_strategy(strategy)
        .connect()
        .await
        .expect("connect to the test postgres");
    Some((store, server))
}

idem_store::store_conformance_tests! {
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    make_each = store(WaitStrategy::Notify) => notify, store(WaitStrategy::Poll) => polling;
}

/// A store with the per-tenant in-flight bound the suite's tenant cases expect.
async fn bounded(server: &PostgresServer) -> PostgresStore {
    PostgresStore::builder(server.url())
        .table_prefix("conformance_")
        .max_in_flight_per_tenant(Some(idem_store::testing::TENANT_IN_FLIGHT_BOUND))
        .connect()
        .await
        .expect("connect to the test postgres")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenant_in_flight_bound() {
    let Some(server) = PostgresServer::start() else {
        return;
    };
    idem_store::testing::tenant_in_flight_bound(&bounded(&server).await).await;
}

/// Three stores (three instances, each with its own pool) on one database.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenant_in_flight_bound_across_instances() {
    let Some(server) = PostgresServer::start() else {
        return;
    };
    let mut stores = Vec::new();
    for _ in 0..3 {
        stores.push(bounded(&server).await);
    }
    idem_store::testing::tenant_in_flight_bound_across_instances(&stores).await;
}
