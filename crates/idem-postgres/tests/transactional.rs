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

/// One test's world: the store, the service's own pool with an `orders` table, and a
/// fresh scope.
struct World {
    s: PostgresStore,
    app: PgPool,
    sc: Scope,
    _server: PostgresServer,
}

async fn start() -> Option<World> {
    let server = PostgresServer::start()?;
    let s = PostgresStore::builder(server.url())
        .connect()
        .await
        .expect("connect");
    let app = server.pool(4).await;
    app.execute("CREATE TABLE orders (id text PRIMARY KEY)")
        .await
        .unwrap();
    Some(World {
        s,
        app,
        sc: Scope(rand::random()),
        _server: server,
    })
}

impl World {
    /// The scope's first claim, with a lease of `lease`: its fence.
    async fn acquire(&self, lease: Duration) -> u64 {
        acquire(&self.s, &self.sc, lease).await
    }

    /// What a duplicate's claim finds.
    async fn claim(&self) -> Claim {
        self.s.claim(req(&self.sc, LONG)).await.unwrap()
    }

    async fn orders(&self) -> i64 {
        sqlx::query("SELECT count(*) FROM orders")
            .fetch_one(&self.app)
            .await
            .unwrap()
            .get(0)
    }

    /// The handler up to its own COMMIT: order `id` inserted and the record marked done
    /// under `fence` (its lease extended by `lease`), in one transaction not yet committed.
    async fn marked(
        &self,
        fence: u64,
        id: &str,
        lease: Duration,
    ) -> Result<Transaction<'static, Postgres>, StoreError> {
        let mut tx = self.app.begin().await.unwrap();
        sqlx::query("INSERT INTO orders VALUES ($1)")
            .bind(id)
            .execute(&mut *tx)
            .await
            .unwrap();
        self.s.commit_in(&mut tx, &self.sc, fence, lease).await?;
        Ok(tx)
    }

    /// The handler: insert order `id`, mark the record under `fence`, commit.
    async fn handler(&self, fence: u64, id: &str) -> Result<(), StoreError> {
        self.marked(fence, id, LONG).await?.commit().await.unwrap();
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_and_completion_commit_together() {
    let Some(w) = start().await else { return };
    let fence = w.acquire(LONG).await;
    w.handler(fence, "a").await.unwrap();
    // Committed, response not recorded yet: duplicates wait, as for any run in flight.
    assert!(matches!(w.claim().await, Claim::InFlight { .. }));
    assert!(matches!(
        w.s.get(&w.sc).await.unwrap(),
        Some(RecordState::InFlight { fence: f, .. }) if f == fence
    ));
    w.s.renew(&w.sc, fence, LONG).await.unwrap();
    w.s.complete(completion(
        &w.sc,
        fence,
        StoredOutcome::Response(Bytes::from_static(b"ok")),
        LONG,
    ))
    .await
    .unwrap();
    assert_eq!(
        w.claim().await,
        Claim::Completed(StoredOutcome::Response(Bytes::from_static(b"ok")))
    );
    assert_eq!(w.orders().await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_before_the_handlers_commit_leaves_nothing_done() {
    let Some(w) = start().await else { return };
    let fence = w.acquire(Duration::from_millis(200)).await;
    {
        let tx = w.marked(fence, "lost", LONG).await.unwrap();
        // The process dies here: the transaction never commits.
        drop(tx);
    }
    assert_eq!(w.orders().await, 0);
    // The record is in flight as before; once its lease ends, the next run takes over.
    tokio::time::sleep(Duration::from_millis(250)).await;
    let next = take_over(&w.s, &w.sc, LONG).await;
    w.handler(next, "again").await.unwrap();
    assert_eq!(w.orders().await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_after_the_handlers_commit_never_runs_it_again() {
    let Some(w) = start().await else { return };
    let fence = w.acquire(Duration::from_millis(200)).await;
    let tx = w
        .marked(fence, "kept", Duration::from_millis(300))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    // The process dies before `complete`. While the lease lasts, duplicates wait...
    assert!(matches!(w.claim().await, Claim::InFlight { .. }));
    // ...then learn it is done, without its response. Never a second run.
    let start = Instant::now();
    loop {
        match w.claim().await {
            Claim::InFlight { .. } if start.elapsed() < Duration::from_secs(5) => {
                tokio::time::sleep(Duration::from_millis(50)).await
            }
            Claim::Completed(StoredOutcome::NotRetained) => break,
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(w.orders().await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_fence_rolls_the_handlers_writes_back() {
    let Some(w) = start().await else { return };
    let old = w.acquire(Duration::from_millis(100)).await;
    tokio::time::sleep(Duration::from_millis(150)).await;
    let new = w.acquire(LONG).await;
    let r = w.handler(old, "stale").await;
    assert!(
        matches!(r, Err(StoreError::Fenced { presented, current: Some(c) }) if presented == old && c == new),
        "{r:?}"
    );
    // The handler's transaction was dropped uncommitted.
    assert_eq!(w.orders().await, 0);
    w.handler(new, "fresh").await.unwrap();
    assert_eq!(w.orders().await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_takeover_waits_for_the_handlers_transaction() {
    let Some(w) = start().await else { return };
    let fence = w.acquire(Duration::from_millis(300)).await;
    let tx = w.marked(fence, "slow", LONG).await.unwrap();
    // The old lease ends while the handler is still before its COMMIT: a claim now
    // blocks on the record's row instead of taking over...
    tokio::time::sleep(Duration::from_millis(350)).await;
    let claim = {
        let (s, sc) = (w.s.clone(), w.sc);
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
    assert_eq!(w.orders().await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn releasing_a_committed_run_records_it_as_done() {
    let Some(w) = start().await else { return };
    let fence = w.acquire(LONG).await;
    w.handler(fence, "r").await.unwrap();
    // The handler committed, then answered with a "nothing was done" code.
    w.s.release(&w.sc, fence).await.unwrap();
    assert_eq!(
        w.claim().await,
        Claim::Completed(StoredOutcome::NotRetained)
    );
}
