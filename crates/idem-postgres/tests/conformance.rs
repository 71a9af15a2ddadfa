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
