//! The PostgreSQL store's own behaviour, beyond the shared conformance suite: fences
//! across takeover, release and expiry; waiting through LISTEN/NOTIFY and without it;
//! timeouts, a database that goes away and comes back, malformed rows, the schema and
//! its privileges, and the statements each call costs. Each test starts its own server
//! (`idem_test_support::postgres`).

use std::time::Duration;

use bytes::Bytes;
use idem_postgres::{ConnectError, PostgresStore, PostgresStoreBuilder, WaitStrategy};
use idem_store::testing::completion;
use idem_store::{
    Claim, ClaimRequest, ClaimantId, Fingerprint, RecordState, Scope, Store, StoreError,
    StoredOutcome,
};
use idem_test_support::postgres::PostgresServer;
use idem_test_support::store::{FP, TENANT, acquire, req, take_over};
use sqlx::postgres::{PgListener, PgPool};
use sqlx::{Executor, Row};
use tokio::task::JoinHandle;
use tokio::time::Instant;

const LONG: Duration = Duration::from_secs(60);

fn scope() -> Scope {
    Scope(rand::random())
}

fn response(b: &'static [u8]) -> StoredOutcome {
    StoredOutcome::Response(Bytes::from_static(b))
}

/// A new scope and the fence of its claim, held for [`LONG`].
async fn acquired(s: &PostgresStore) -> (Scope, u64) {
    let sc = scope();
    let fence = acquire(s, &sc, LONG).await;
    (sc, fence)
}

/// Holds `sc`'s row (`FOR UPDATE`) until the returned transaction ends.
async fn lock_row(admin: &PgPool, sc: &Scope) -> sqlx::Transaction<'static, sqlx::Postgres> {
    let mut tx = admin.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM idem_records WHERE scope = $1 FOR UPDATE")
        .bind(&sc.0[..])
        .execute(&mut *tx)
        .await
        .unwrap();
    tx
}

/// Completes `sc`'s record under `fence` with the response `body`, kept for [`LONG`];
/// panics when the store refuses.
async fn complete(s: &PostgresStore, sc: &Scope, fence: u64, body: &'static [u8]) {
    try_complete(s, sc, fence, body).await.unwrap();
}

/// Completes `sc`'s record under `fence` with the response `body`, kept for [`LONG`].
async fn try_complete(
    s: &PostgresStore,
    sc: &Scope,
    fence: u64,
    body: &'static [u8],
) -> Result<(), StoreError> {
    s.complete(completion(sc, fence, response(body), LONG))
        .await
}

async fn start(
    f: impl FnOnce(PostgresStoreBuilder) -> PostgresStoreBuilder,
) -> Option<(PostgresStore, PostgresServer, PgPool)> {
    let server = PostgresServer::start()?;
    let store = f(PostgresStore::builder(server.url()))
        .connect()
        .await
        .expect("connect to the test postgres");
    let admin = server.pool(4).await;
    Some((store, server, admin))
}

/// Waits on a task of its own for `sc` to change, for up to [`LONG`].
fn spawn_wait(s: &PostgresStore, sc: Scope) -> JoinHandle<Result<(), StoreError>> {
    let s = s.clone();
    tokio::spawn(async move { s.wait(&sc, Instant::now() + LONG).await })
}

async fn eventually<F, Fut>(what: &str, limit: Duration, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = Instant::now();
    while !f().await {
        assert!(start.elapsed() < limit, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_fence_cannot_complete_after_takeover_release_or_expiry() {
    let Some((s, _server, _admin)) = start(|b| b.no_sweep()).await else {
        return;
    };
    // Takeover: the old claimant, paused past its lease, is refused everything.
    let sc = scope();
    let old = acquire(&s, &sc, Duration::from_millis(100)).await;
    tokio::time::sleep(Duration::from_millis(150)).await;
    let new = take_over(&s, &sc, LONG).await;
    assert!(new > old);
    for r in [
        try_complete(&s, &sc, old, b"stale").await,
        s.renew(&sc, old, LONG).await,
        s.release(&sc, old).await,
    ] {
        assert!(
            matches!(r, Err(StoreError::Fenced { presented, current: Some(c) }) if presented == old && c == new),
            "{r:?}"
        );
    }
    s.complete(completion(
        &sc,
        new,
        response(b"fresh"),
        Duration::from_millis(200),
    ))
    .await
    .unwrap();

    // Expiry, then the sweep deletes the row: the next fence is still higher, because
    // fences come from one sequence rather than from the row.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(s.get(&sc).await.unwrap(), None);
    assert!(s.sweep_expired().await.unwrap() >= 1);
    let after = acquire(&s, &sc, LONG).await;
    assert!(after > new, "{after} > {new}");
    // The new run's claimant completes; the taken-over one still cannot.
    assert!(matches!(
        try_complete(&s, &sc, new, b"late").await,
        Err(StoreError::Fenced { .. })
    ));
    complete(&s, &sc, after, b"third").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fences_start_at_the_database_clock_and_survive_a_new_schema() {
    let Some((s, server, admin)) = start(|b| b.table_prefix("clock_")).await else {
        return;
    };
    let first = acquire(&s, &scope(), LONG).await;
    let now_us = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_micros() as u64;
    // Started at the clock in µs when the schema was made (same machine clock here).
    assert!(
        first > now_us - 600_000_000 && first <= now_us,
        "{first} ~ {now_us}"
    );
    // Drop everything and start again: the new sequence starts above the old fences.
    drop(s);
    admin
        .execute(
            "DROP TABLE clock_records, clock_schema_version; DROP SEQUENCE clock_fence; \
             DROP FUNCTION clock_claim(bytea, bytea, bytea, bytea, bigint, bigint), \
             clock_claim(bytea, bytea, bytea, bytea, bigint, bigint, bigint), \
             clock_tenant_full, clock_renew, clock_complete, clock_release, clock_watch, \
             clock_commit",
        )
        .await
        .unwrap();
    let s = PostgresStore::builder(server.url())
        .table_prefix("clock_")
        .connect()
        .await
        .unwrap();
    let again = acquire(&s, &scope(), LONG).await;
    assert!(again > first, "{again} > {first}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_claims_of_a_new_record_acquire_it_once() {
    let Some((s, _server, _admin)) = start(|b| b.max_connections(8)).await else {
        return;
    };
    for _ in 0..5 {
        let sc = scope();
        let tasks: Vec<_> = (0..8)
            .map(|_| {
                let s = s.clone();
                tokio::spawn(async move { s.claim(req(&sc, LONG)).await.unwrap() })
            })
            .collect();
        let mut acquired = 0;
        for t in tasks {
            match t.await.unwrap() {
                Claim::Acquired { .. } => acquired += 1,
                Claim::InFlight { .. } => {}
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(acquired, 1);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_is_woken_by_notify_not_by_polling() {
    let Some((s, _server, _admin)) = start(|b| b).await else {
        return;
    };
    // Warm the listener up, so the measured wait is notified rather than polled.
    s.wait(&scope(), Instant::now() + Duration::from_millis(10))
        .await
        .unwrap();
    let sc = scope();
    acquire(&s, &sc, LONG).await; // warms the listener: the first wait opens it
    let w = spawn_wait(&s, sc);
    eventually("listener up", Duration::from_secs(5), || async {
        s.is_listening()
    })
    .await;
    // Let the waiter mark the record and park (its next safety read is a second away).
    tokio::time::sleep(Duration::from_millis(300)).await;
    let fence = match s.get(&sc).await.unwrap() {
        Some(RecordState::InFlight { fence, .. }) => fence,
        other => panic!("{other:?}"),
    };
    let done = Instant::now();
    complete(&s, &sc, fence, b"n").await;
    tokio::time::timeout(Duration::from_secs(5), w)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    // Its next safety read was about 700 ms after the completion.
    let late = done.elapsed();
    assert!(late < Duration::from_millis(500), "woken {late:?} after");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_watched_records_notify() {
    let Some((s, _server, admin)) = start(|b| b).await else {
        return;
    };
    let mut listener = PgListener::connect_with(&admin).await.unwrap();
    listener.listen("idem_done").await.unwrap();
    // Nobody waits: completing sends nothing (NOTIFY serialises commits, so it is
    // spent only where someone listens).
    let quiet = scope();
    let f = acquire(&s, &quiet, LONG).await;
    complete(&s, &quiet, f, b"q").await;
    // Somebody waits: its completion is announced with the scope.
    let loud = scope();
    let f = acquire(&s, &loud, LONG).await;
    let w = spawn_wait(&s, loud);
    eventually(
        "record marked as watched",
        Duration::from_secs(5),
        || async {
            sqlx::query("SELECT watched FROM idem_records WHERE scope = $1")
                .bind(&loud.0[..])
                .fetch_one(&admin)
                .await
                .unwrap()
                .get::<bool, _>(0)
        },
    )
    .await;
    complete(&s, &loud, f, b"l").await;
    let n = tokio::time::timeout(Duration::from_secs(5), listener.recv())
        .await
        .expect("a notification")
        .unwrap();
    assert_eq!(n.payload(), loud.to_hex());
    w.await.unwrap().unwrap();
    assert!(
        tokio::time::timeout(Duration::from_millis(200), listener.recv())
            .await
            .is_err(),
        "no other notification"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_return_when_the_listener_connection_is_lost() {
    let Some((s, _server, admin)) = start(|b| b).await else {
        return;
    };
    let (sc, fence) = acquired(&s).await;
    let w = spawn_wait(&s, sc);
    eventually("listener up", Duration::from_secs(5), || async {
        s.is_listening()
    })
    .await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    // Kill the listener's backend; complete while it is (or was just) gone, so its
    // notification is lost. The waiter must still see the completion, by polling.
    let killed: i64 = sqlx::query(
        "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE query LIKE 'LISTEN %' AND pid <> pg_backend_pid()) t",
    )
    .fetch_one(&admin)
    .await
    .unwrap()
    .get(0);
    assert_eq!(killed, 1);
    complete(&s, &sc, fence, b"x").await;
    tokio::time::timeout(Duration::from_secs(3), w)
        .await
        .expect("the waiter returned")
        .unwrap()
        .unwrap();
    // The listener comes back, and waiting is notified again.
    eventually("listener back", Duration::from_secs(10), || async {
        s.is_listening()
    })
    .await;
    let (sc, fence) = acquired(&s).await;
    let w = spawn_wait(&s, sc);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let done = Instant::now();
    s.release(&sc, fence).await.unwrap();
    tokio::time::timeout(Duration::from_secs(5), w)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert!(
        done.elapsed() < Duration::from_millis(500),
        "{:?}",
        done.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_returns_at_until_even_when_postgres_hangs() {
    let Some((s, _server, admin)) = start(|b| b.statement_timeout(Duration::from_secs(5))).await
    else {
        return;
    };
    let (sc, _) = acquired(&s).await;
    // Hold the row: the waiter's read blocks on it.
    let tx = lock_row(&admin, &sc).await;
    let t0 = Instant::now();
    s.wait(&sc, t0 + Duration::from_millis(300)).await.unwrap();
    let took = t0.elapsed();
    assert!(
        took >= Duration::from_millis(290) && took < Duration::from_millis(2000),
        "{took:?}"
    );
    tx.rollback().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_statement_blocked_past_its_timeout_is_unavailable() {
    let Some((s, _server, admin)) =
        start(|b| b.statement_timeout(Duration::from_millis(200))).await
    else {
        return;
    };
    let (sc, fence) = acquired(&s).await;
    let tx = lock_row(&admin, &sc).await;
    for _ in 0..3 {
        let t0 = Instant::now();
        let r = try_complete(&s, &sc, fence, b"r").await;
        assert!(matches!(r, Err(StoreError::Unavailable(_))), "{r:?}");
        assert!(
            t0.elapsed() < Duration::from_millis(1500),
            "{:?}",
            t0.elapsed()
        );
    }
    // The server cancelled the statements too: nothing of ours is left waiting.
    eventually(
        "no store statement waits",
        Duration::from_secs(5),
        || async {
            let n: i64 = sqlx::query(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'idem-postgres' \
             AND wait_event_type = 'Lock'",
            )
            .fetch_one(&admin)
            .await
            .unwrap()
            .get(0);
            n == 0
        },
    )
    .await;
    tx.rollback().await.unwrap();
    // Nothing was completed meanwhile; now it is.
    assert!(matches!(
        s.get(&sc).await.unwrap(),
        Some(RecordState::InFlight { .. })
    ));
    complete(&s, &sc, fence, b"r").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_that_goes_away_is_unavailable_then_recovers() {
    let Some((s, mut server, admin)) =
        start(|b| b.statement_timeout(Duration::from_millis(300))).await
    else {
        return;
    };
    drop(admin);
    let (sc, fence) = acquired(&s).await;
    server.stop();
    for _ in 0..3 {
        let t0 = Instant::now();
        let r = try_complete(&s, &sc, fence, b"d").await;
        assert!(matches!(r, Err(StoreError::Unavailable(_))), "{r:?}");
        let r = s.claim(req(&scope(), LONG)).await;
        assert!(matches!(r, Err(StoreError::Unavailable(_))), "{r:?}");
        assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
    }
    server.start_again();
    // The pool drops its dead connections as they fail, then connects anew.
    let start = Instant::now();
    loop {
        match try_complete(&s, &sc, fence, b"d").await {
            Ok(()) => break,
            Err(StoreError::Unavailable(_)) if start.elapsed() < Duration::from_secs(10) => {
                tokio::time::sleep(Duration::from_millis(50)).await
            }
            other => panic!("{other:?}"),
        }
    }
    // The record written before the crash is still there (the data directory stayed).
    assert_eq!(
        s.claim(req(&sc, LONG)).await.unwrap(),
        Claim::Completed(response(b"d"))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_rows_are_corrupt_not_panics() {
    let Some((s, _server, admin)) = start(|b| b).await else {
        return;
    };
    let fp = &FP.0[..];
    // Each: an UPDATE that breaks a valid completed record in one way.
    let breakages: &[(&str, &str)] = &[
        (
            "unknown state",
            "UPDATE idem_records SET state = 'z' WHERE scope = $1",
        ),
        (
            "short fingerprint",
            "UPDATE idem_records SET fingerprint = '\\x0102' WHERE scope = $1",
        ),
        (
            "negative fence",
            "UPDATE idem_records SET fence = -4 WHERE scope = $1",
        ),
        (
            "unknown outcome kind",
            "UPDATE idem_records SET outcome_kind = 'q' WHERE scope = $1",
        ),
        (
            "response without bytes",
            "UPDATE idem_records SET outcome = NULL WHERE scope = $1",
        ),
        (
            "in flight without a lease",
            "UPDATE idem_records SET state = 'i', lease_until = NULL WHERE scope = $1",
        ),
    ];
    for (what, sql) in breakages {
        let (sc, f) = acquired(&s).await;
        complete(&s, &sc, f, b"ok").await;
        sqlx::query(sql)
            .bind(&sc.0[..])
            .execute(&admin)
            .await
            .unwrap();
        let c = s
            .claim(ClaimRequest {
                scope: &sc,
                tenant: &TENANT,
                fingerprint: &Fingerprint(fp.try_into().unwrap()),
                claimant: ClaimantId::random(),
                lease: LONG,
            })
            .await;
        assert!(
            matches!(c, Err(StoreError::Corrupt(_))),
            "{what}: claim {c:?}"
        );
        let g = s.get(&sc).await;
        if *what != "in flight without a lease" {
            assert!(
                matches!(g, Err(StoreError::Corrupt(_))),
                "{what}: get {g:?}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sweep_deletes_expired_rows_in_bounded_batches() {
    let Some((s, _server, admin)) = start(|b| b.sweep_interval(Duration::from_secs(3600), 2)).await
    else {
        return;
    };
    for _ in 0..5 {
        let (sc, f) = acquired(&s).await;
        s.complete(completion(&sc, f, response(b"t"), Duration::from_millis(1)))
            .await
            .unwrap();
    }
    let live = scope();
    let f = acquire(&s, &live, LONG).await;
    complete(&s, &live, f, b"kept").await;
    tokio::time::sleep(Duration::from_millis(20)).await;
    let mut swept = Vec::new();
    for _ in 0..4 {
        swept.push(s.sweep_expired().await.unwrap());
    }
    assert_eq!(swept, [2, 2, 1, 0]);
    let rows: i64 = sqlx::query("SELECT count(*) FROM idem_records")
        .fetch_one(&admin)
        .await
        .unwrap()
        .get(0);
    assert_eq!(rows, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_background_sweep_stops_with_the_store() {
    let Some((s, _server, admin)) =
        start(|b| b.sweep_interval(Duration::from_millis(100), 100)).await
    else {
        return;
    };
    let (sc, f) = acquired(&s).await;
    s.complete(completion(&sc, f, response(b"t"), Duration::from_millis(1)))
        .await
        .unwrap();
    let count = || async {
        sqlx::query("SELECT count(*) FROM idem_records")
            .fetch_one(&admin)
            .await
            .unwrap()
            .get::<i64, _>(0)
    };
    eventually("swept", Duration::from_secs(5), || async {
        count().await == 0
    })
    .await;
    let pool = s.pool().clone();
    drop(s);
    // The sweeper held only a weak reference; the pool is unused from now on.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(pool.size(), pool.num_idle() as u32);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_schema_is_created_once_and_its_version_checked() {
    let Some(server) = PostgresServer::start() else {
        return;
    };
    // Instances starting together create the schema once.
    let connects: Vec<_> = (0..4)
        .map(|_| {
            let url = server.url();
            tokio::spawn(async move { PostgresStore::connect(url).await })
        })
        .collect();
    for c in connects {
        c.await.unwrap().expect("connect");
    }
    let admin = server.pool(4).await;
    let version: i32 = sqlx::query("SELECT version FROM idem_schema_version")
        .fetch_one(&admin)
        .await
        .unwrap()
        .get(0);
    assert_eq!(version, idem_postgres::SCHEMA_VERSION);
    // A schema from a newer idem-postgres is refused, not used.
    admin
        .execute("UPDATE idem_schema_version SET version = 99")
        .await
        .unwrap();
    let err = PostgresStore::connect(server.url()).await.err();
    assert!(matches!(err, Some(ConnectError::Schema(_))), "{err:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_role_without_create_privilege_uses_an_existing_schema() {
    let Some((_owner, server, admin)) = start(|b| b).await else {
        return;
    };
    // The privileges the crate docs list for the application's role.
    admin
        .execute(
            "CREATE ROLE app LOGIN; \
             REVOKE CREATE ON SCHEMA public FROM PUBLIC; \
             GRANT SELECT ON idem_schema_version TO app; \
             GRANT SELECT, INSERT, UPDATE, DELETE ON idem_records TO app; \
             GRANT USAGE ON SEQUENCE idem_fence TO app",
        )
        .await
        .unwrap();
    let url = format!("postgres://app@127.0.0.1:{}/postgres", server.port());
    let s = PostgresStore::connect(url).await.expect("connect as app");
    let (sc, f) = acquired(&s).await;
    complete(&s, &sc, f, b"app").await;
    assert_eq!(
        s.claim(req(&sc, LONG)).await.unwrap(),
        Claim::Completed(response(b"app"))
    );
    // Without the schema, the same role cannot create it: a clear start-up error.
    let err = PostgresStore::builder(format!(
        "postgres://app@127.0.0.1:{}/postgres",
        server.port()
    ))
    .table_prefix("other_")
    .connect()
    .await
    .err();
    assert!(matches!(err, Some(ConnectError::Unavailable(_))), "{err:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_call_is_two_statements_and_a_replay_one() {
    let Some(server) =
        PostgresServer::start_with(&[("shared_preload_libraries", "pg_stat_statements")])
    else {
        return;
    };
    let admin = server.pool(4).await;
    admin
        .execute("CREATE EXTENSION pg_stat_statements")
        .await
        .unwrap();
    let s = PostgresStore::builder(server.url())
        .wait_strategy(WaitStrategy::Poll)
        .no_sweep()
        .connect()
        .await
        .unwrap();
    // Counts the store's statements (everything but the test's own).
    let statements = || async {
        let rows = sqlx::query(
            "SELECT query, calls FROM pg_stat_statements \
             WHERE query NOT LIKE '%pg_stat_statements%' ORDER BY query",
        )
        .fetch_all(&admin)
        .await
        .unwrap();
        let list: Vec<(String, i64)> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
        (list.iter().map(|(_, c)| c).sum::<i64>(), list)
    };
    let reset = || async {
        admin
            .execute("SELECT pg_stat_statements_reset()")
            .await
            .unwrap();
    };
    // Warm: the pool's connection and its prepared statements exist.
    let warm = scope();
    let f = acquire(&s, &warm, LONG).await;
    complete(&s, &warm, f, b"w").await;

    reset().await;
    let (sc, f) = acquired(&s).await;
    complete(&s, &sc, f, b"fresh").await;
    let (fresh, list) = statements().await;
    eprintln!("fresh call: {fresh} statements: {list:?}");
    assert_eq!(fresh, 2, "{list:?}");

    reset().await;
    assert_eq!(
        s.claim(req(&sc, LONG)).await.unwrap(),
        Claim::Completed(response(b"fresh"))
    );
    let (replay, list) = statements().await;
    eprintln!("replay: {replay} statements: {list:?}");
    assert_eq!(replay, 1, "{list:?}");
}

/// A flood of rejected calls (claim, then release: nothing was done) leaves no row, and
/// the next claim of a released scope still gets a higher fence.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn released_claims_leave_no_rows() {
    let Some((s, _server, admin)) = start(|b| b).await else {
        return;
    };
    let again = scope();
    let first = acquire(&s, &again, LONG).await;
    s.release(&again, first).await.expect("release");
    for _ in 0..500 {
        let (sc, fence) = acquired(&s).await;
        s.release(&sc, fence).await.expect("release");
    }
    let rows: i64 = sqlx::query("SELECT count(*) FROM idem_records")
        .fetch_one(&admin)
        .await
        .expect("count")
        .get(0);
    assert_eq!(rows, 0, "released records must not stay behind");
    assert!(acquire(&s, &again, LONG).await > first);
}
