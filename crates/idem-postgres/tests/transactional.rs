//! Transactional completion (`PostgresStore::commit_in`): a handler's own writes and its
//! record's "done" mark commit together, guarded by the fence. A crash is simulated at
//! each point (before the handler's commit, between its commit and `complete`), and
//! the handler's table and the record must agree every time.

use std::time::Duration;

use bytes::Bytes;
use idem_postgres::PostgresStore;
use idem_store::testing::completion;
use idem_store::{Claim, RecordState, Scope, Store, StoreError, StoredOutcome};
use idem_test_support::postgres::PostgresServer;
use idem_test_support::store::{acquire, req, take_over};
use sqlx::postgres::PgPool;
use sqlx::{Executor, Postgres, Row, Transaction};
use tokio::time::Instant;

const LONG: Duration = Duration::from_secs(60);

/// The store, the server, and the service's own pool with an `orders` table.
async fn start() -> Option<(PostgresStore, PostgresServer, PgPool)> {
    let server = PostgresServer::start()?;
    let store = PostgresStore::builder(server.url())
        .connect()
        .await
        .expect("connect");
    let app = server.pool(4).await;
    app.execute("CREATE TABLE orders (id text PRIMARY KEY)")
        .await
        .unwrap();
    Some((store, server, app))
}

async fn orders(app: &PgPool) -> i64 {
    sqlx::query("SELECT count(*) FROM orders")
        .fetch_one(app)
        .await
        .unwrap()
        .get(0)
}

/// The handler's transaction after its own write: order `id` inserted, not committed.
async fn insert_order(app: &PgPool, id: &str) -> Transaction<'static, Postgres> {
    let mut tx = app.begin().await.unwrap();
    sqlx::query("INSERT INTO orders VALUES ($1)")
        .bind(id)
        .execute(&mut *tx)
        .await
        .unwrap();
    tx
}

/// The handler: insert an order, mark the record, commit.
async fn handler(
    s: &PostgresStore,
    app: &PgPool,
    scope: &Scope,
    fence: u64,
    id: &str,
) -> Result<(), StoreError> {
    let mut tx = insert_order(app, id).await;
    s.commit_in(&mut tx, scope, fence, LONG).await?;
    tx.commit().await.unwrap();
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_and_completion_commit_together() {
    let Some((s, _server, app)) = start().await else {
        return;
    };
    let sc = Scope(rand::random());
    let fence = acquire(&s, &sc, LONG).await;
    handler(&s, &app, &sc, fence, "a").await.unwrap();
    // Committed, response not recorded yet: duplicates wait, as for any run in flight.
    assert!(matches!(
        s.claim(req(&sc, LONG)).await.unwrap(),
        Claim::InFlight { .. }
    ));
    assert!(matches!(
        s.get(&sc).await.unwrap(),
        Some(RecordState::InFlight { fence: f, .. }) if f == fence
    ));
    s.renew(&sc, fence, LONG).await.unwrap();
    s.complete(completion(
        &sc,
        fence,
        StoredOutcome::Response(Bytes::from_static(b"ok")),
        LONG,
    ))
    .await
    .unwrap();
    assert_eq!(
        s.claim(req(&sc, LONG)).await.unwrap(),
        Claim::Completed(StoredOutcome::Response(Bytes::from_static(b"ok")))
    );
    assert_eq!(orders(&app).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_before_the_handlers_commit_leaves_nothing_done() {
    let Some((s, _server, app)) = start().await else {
        return;
    };
    let sc = Scope(rand::random());
    let fence = acquire(&s, &sc, Duration::from_millis(200)).await;
    {
        let mut tx = insert_order(&app, "lost").await;
        s.commit_in(&mut tx, &sc, fence, LONG).await.unwrap();
        // The process dies here: the transaction never commits.
        drop(tx);
    }
    assert_eq!(orders(&app).await, 0);
    // The record is in flight as before; once its lease ends, the next run takes over.
    tokio::time::sleep(Duration::from_millis(250)).await;
    let next = take_over(&s, &sc, LONG).await;
    handler(&s, &app, &sc, next, "again").await.unwrap();
    assert_eq!(orders(&app).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_after_the_handlers_commit_never_runs_it_again() {
    let Some((s, _server, app)) = start().await else {
        return;
    };
    let sc = Scope(rand::random());
    let fence = acquire(&s, &sc, Duration::from_millis(200)).await;
    let mut tx = insert_order(&app, "kept").await;
    s.commit_in(&mut tx, &sc, fence, Duration::from_millis(300))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    // The process dies before `complete`. While the lease lasts, duplicates wait...
    assert!(matches!(
        s.claim(req(&sc, LONG)).await.unwrap(),
        Claim::InFlight { .. }
    ));
    // ...then learn it is done, without its response. Never a second run.
    let start = Instant::now();
    loop {
        match s.claim(req(&sc, LONG)).await.unwrap() {
            Claim::InFlight { .. } if start.elapsed() < Duration::from_secs(5) => {
                tokio::time::sleep(Duration::from_millis(50)).await
            }
            Claim::Completed(StoredOutcome::NotRetained) => break,
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(orders(&app).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_fence_rolls_the_handlers_writes_back() {
    let Some((s, _server, app)) = start().await else {
        return;
    };
    let sc = Scope(rand::random());
    let old = acquire(&s, &sc, Duration::from_millis(100)).await;
    tokio::time::sleep(Duration::from_millis(150)).await;
    let new = acquire(&s, &sc, LONG).await;
    let r = handler(&s, &app, &sc, old, "stale").await;
    assert!(
        matches!(r, Err(StoreError::Fenced { presented, current: Some(c) }) if presented == old && c == new),
        "{r:?}"
    );
    // The handler's transaction was dropped uncommitted.
    assert_eq!(orders(&app).await, 0);
    handler(&s, &app, &sc, new, "fresh").await.unwrap();
    assert_eq!(orders(&app).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_takeover_waits_for_the_handlers_transaction() {
    let Some((s, _server, app)) = start().await else {
        return;
    };
    let sc = Scope(rand::random());
    let fence = acquire(&s, &sc, Duration::from_millis(300)).await;
    let mut tx = insert_order(&app, "slow").await;
    s.commit_in(&mut tx, &sc, fence, LONG).await.unwrap();
    // The old lease ends while the handler is still before its COMMIT: a claim now
    // blocks on the record's row instead of taking over...
    tokio::time::sleep(Duration::from_millis(350)).await;
    let claim = {
        let s = s.clone();
        tokio::spawn(async move { s.claim(req(&sc, LONG)).await })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!claim.is_finished());
    tx.commit().await.unwrap();
    // ...and then finds the writes committed with the lease extended: it waits.
    assert!(matches!(
        claim.await.unwrap().unwrap(),
        Claim::InFlight { .. }
    ));
    assert_eq!(orders(&app).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn releasing_a_committed_run_records_it_as_done() {
    let Some((s, _server, app)) = start().await else {
        return;
    };
    let sc = Scope(rand::random());
    let fence = acquire(&s, &sc, LONG).await;
    handler(&s, &app, &sc, fence, "r").await.unwrap();
    // The handler committed, then answered with a "nothing was done" code.
    s.release(&sc, fence).await.unwrap();
    assert_eq!(
        s.claim(req(&sc, LONG)).await.unwrap(),
        Claim::Completed(StoredOutcome::NotRetained)
    );
}
