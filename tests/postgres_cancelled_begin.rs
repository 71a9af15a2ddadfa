//! A `begin_for` cut short (by its time limit, or by a caller that went away) while the
//! database's answer to `BEGIN` is still on its way leaves no pooled connection inside a
//! transaction.
//!
//! sqlx 0.8.6 counts a transaction only once `BEGIN` is answered, so a `pool.begin()`
//! dropped in that window hands its connection back to the pool in a transaction
//! nothing ends (sqlx issue #4393). The store's own statements later run on that
//! connection inside it, uncommitted, and once one fails every statement there gets
//! `25P02`. The store reaches the database through the demo's fault proxy, whose
//! latency holds `BEGIN` and its answer back and so opens that window on purpose.

use std::time::Duration;

use idem::postgres::{PostgresStore, TxError};
use idem::store::{RecordRef, Scope};
use idem_demo::netfaults::{FaultProxy, NetFault};
use idem_test_support::postgres::PostgresServer;
use sqlx::postgres::PgPool;

/// Sessions of the test database left inside a transaction and idle.
async fn idle_in_transaction(direct: &PgPool) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity \
         WHERE datname = current_database() AND pid <> pg_backend_pid() \
         AND state LIKE 'idle in transaction%'",
    )
    .fetch_one(direct)
    .await
    .unwrap()
}

/// Waits (up to 10 s) until the pool's one connection is back in the pool: the
/// `BEGIN` held by the proxy answered and whatever followed it done.
async fn back_in_pool(store: &PostgresStore) {
    let until = tokio::time::Instant::now() + Duration::from_secs(10);
    while store.pool().num_idle() < 1 {
        assert!(
            tokio::time::Instant::now() < until,
            "the connection stays out"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn protected_request() -> tonic::Request<()> {
    let mut request = tonic::Request::new(());
    request.extensions_mut().insert(RecordRef::new(
        Scope(rand::random()),
        1,
        Duration::from_secs(60),
        Duration::from_secs(10),
    ));
    request
}

struct Env {
    _server: PostgresServer,
    direct: PgPool,
    store: PostgresStore,
    proxy: FaultProxy,
}

/// A store with one pooled connection, through the proxy, and a direct pool to watch.
async fn start() -> Option<Env> {
    let server = PostgresServer::start()?;
    let direct = server.pool(1).await;
    let proxy = FaultProxy::start(([127, 0, 0, 1], server.port()).into())
        .await
        .expect("start the proxy");
    let url = server.url().replace(
        &format!(":{}/", server.port()),
        &format!(":{}/", proxy.addr().port()),
    );
    assert_ne!(url, server.url(), "the store goes through the proxy");
    let store = PostgresStore::builder(url)
        .max_connections(1)
        .statement_timeout(Duration::from_millis(200))
        .no_sweep()
        .connect()
        .await
        .expect("connect through the proxy");
    // The pool's connection is open and back in the pool (its release ping answered)
    // before the latency starts.
    sqlx::query("SELECT 1").execute(store.pool()).await.unwrap();
    back_in_pool(&store).await;
    Some(Env {
        _server: server,
        direct,
        store,
        proxy,
    })
}

impl Env {
    /// The pool's one connection still works outside a transaction: a failed
    /// statement does not leave the next one answering `25P02`.
    async fn assert_connection_clean(&self) {
        back_in_pool(&self.store).await;
        assert_eq!(
            idle_in_transaction(&self.direct).await,
            0,
            "a session left in a transaction"
        );
        let failed = sqlx::query("SELECT 1/0").execute(self.store.pool()).await;
        assert!(
            matches!(&failed, Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("22012")),
            "{failed:?}"
        );
        sqlx::query("SELECT 1")
            .execute(self.store.pool())
            .await
            .expect("the pooled connection is not inside an aborted transaction");
        // And a begin_for now gets a transaction of its own that commits.
        let request = protected_request();
        let tx = self.store.begin_for(&request).await.unwrap();
        tx.rollback().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn begin_for_past_its_time_limit_leaves_no_connection_in_a_transaction() {
    let Some(env) = start().await else {
        return;
    };
    env.proxy
        .set(Some(NetFault::Latency(Duration::from_millis(800))));
    let request = protected_request();
    let err = env.store.begin_for(&request).await.unwrap_err();
    assert!(
        matches!(err, TxError::Database(sqlx::Error::PoolTimedOut)),
        "{err}"
    );
    env.proxy.heal();
    env.assert_connection_clean().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn begin_for_dropped_by_its_caller_leaves_no_connection_in_a_transaction() {
    let Some(env) = start().await else {
        return;
    };
    env.proxy
        .set(Some(NetFault::Latency(Duration::from_millis(800))));
    let store = env.store.clone();
    // A handler whose caller went away: its future is dropped mid-`BEGIN`.
    let handler = tokio::spawn(async move {
        let request = protected_request();
        let _tx = store.begin_for(&request).await;
        std::future::pending::<()>().await;
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    handler.abort();
    assert!(handler.await.unwrap_err().is_cancelled());
    env.proxy.heal();
    env.assert_connection_clean().await;
}
