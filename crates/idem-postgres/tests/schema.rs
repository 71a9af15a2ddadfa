//! Schema 2: the migration from schema 1 (a database made by the version-1 SQL, with
//! rows written by the version-1 functions), the version check, the record times, and
//! the per-tenant in-flight bound under racing claims from several instances. Each test
//! starts its own server (`idem_test_support::postgres`).

use std::time::{Duration, SystemTime};

use bytes::Bytes;
use idem_postgres::{ConnectError, PostgresStore, SCHEMA_VERSION};
use idem_store::testing::completion;
use idem_store::{
    Claim, ClaimRequest, ClaimantId, RecordState, Scope, Store, StoreError, StoredOutcome, TenantId,
};
use idem_test_support::postgres::PostgresServer;
use idem_test_support::store::{FP, TENANT, acquire, req};
use sqlx::postgres::PgPool;
use sqlx::{Executor, Row};
use tonic_types::StatusExt;

const LONG: Duration = Duration::from_secs(60);

/// The schema SQL of version 1 as released: the crate keeps it unchanged and migrates
/// from it, so it is what a version-1 database holds.
const SCHEMA_V1: &str = include_str!("../src/schema.sql");

fn scope() -> Scope {
    Scope(rand::random())
}

fn response(b: &'static [u8]) -> StoredOutcome {
    StoredOutcome::Response(Bytes::from_static(b))
}

async fn version(admin: &PgPool) -> i32 {
    sqlx::query("SELECT version FROM idem_schema_version")
        .fetch_one(admin)
        .await
        .expect("the version row")
        .get(0)
}

/// A claim through the version-1 function (what a store of the previous release
/// sends); returns its tag and fence.
async fn claim_v1(admin: &PgPool, sc: &Scope, claimant: u128) -> (String, Option<i64>) {
    let row = sqlx::query("SELECT o_tag, o_fence FROM idem_claim($1, $2, $3, $4, $5, $6)")
        .bind(&sc.0[..])
        .bind(&TENANT.0[..])
        .bind(&FP.0[..])
        .bind(&claimant.to_be_bytes()[..])
        .bind(60_000_000i64)
        .bind(60_000_000i64)
        .fetch_one(admin)
        .await
        .expect("the version-1 claim");
    (row.get(0), row.get(1))
}

/// `t` is within a minute of this machine's clock (the database's runs on the same
/// machine; the bound only catches a wrong unit or epoch).
fn near_now(t: Option<SystemTime>, what: &str) -> SystemTime {
    let t = t.unwrap_or_else(|| panic!("{what} is recorded"));
    let now = SystemTime::now();
    let off = now
        .duration_since(t)
        .or_else(|e| Ok::<_, ()>(e.duration()))
        .unwrap();
    assert!(off < LONG, "{what} {t:?} is {off:?} away from now");
    t
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_version_1_database_is_migrated_once_and_its_records_still_read() {
    let Some(server) = PostgresServer::start() else {
        return;
    };
    let admin = server.pool(4).await;
    admin
        .execute(SCHEMA_V1)
        .await
        .expect("the version-1 schema");
    assert_eq!(version(&admin).await, 1);
    // Records written by version 1: one completed, one in flight.
    let (done, running) = (scope(), scope());
    let (tag, fence) = claim_v1(&admin, &done, 1).await;
    assert_eq!(tag, "A");
    sqlx::query("SELECT o_ok FROM idem_complete($1, $2, 'r', $3, $4)")
        .bind(&done.0[..])
        .bind(fence)
        .bind(&b"v1 reply"[..])
        .bind(60_000_000i64)
        .fetch_one(&admin)
        .await
        .expect("the version-1 completion");
    assert_eq!(claim_v1(&admin, &running, 2).await.0, "A");

    // Instances starting together migrate it once.
    let connects: Vec<_> = (0..4)
        .map(|_| {
            let url = server.url();
            tokio::spawn(async move { PostgresStore::connect(url).await })
        })
        .collect();
    let mut stores = Vec::new();
    for c in connects {
        stores.push(c.await.unwrap().expect("connect and migrate"));
    }
    assert_eq!(version(&admin).await, SCHEMA_VERSION);
    assert_eq!(SCHEMA_VERSION, 2);
    let s = &stores[0];

    // The version-1 rows read as before, with their times unknown.
    assert_eq!(
        s.claim(req(&done, LONG)).await.unwrap(),
        Claim::Completed(response(b"v1 reply"))
    );
    let info = s.read_record(&done).await.unwrap().expect("the v1 record");
    assert!(
        matches!(info.state, RecordState::Completed { .. }),
        "{info:?}"
    );
    assert_eq!((info.created_at, info.completed_at), (None, None));
    assert!(matches!(
        s.claim(req(&running, LONG)).await.unwrap(),
        Claim::InFlight { .. }
    ));
    let info = s.read_record(&running).await.unwrap().expect("in flight");
    assert_eq!((info.created_at, info.completed_at), (None, None));

    // The version-1 function still serves an instance of the previous release (no
    // bound), and its rows now get a creation time.
    let old = scope();
    assert_eq!(claim_v1(&admin, &old, 3).await.0, "A");
    let info = s.read_record(&old).await.unwrap().expect("claimed by v1");
    near_now(info.created_at, "created_at");

    // The migration ran once: running it again (a version row set back by hand) is
    // harmless, and a third start finds the schema current.
    admin
        .execute("UPDATE idem_schema_version SET version = 1")
        .await
        .unwrap();
    PostgresStore::connect(server.url())
        .await
        .expect("migrates again");
    assert_eq!(version(&admin).await, SCHEMA_VERSION);
    assert_eq!(
        s.claim(req(&done, LONG)).await.unwrap(),
        Claim::Completed(response(b"v1 reply"))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_schema_newer_than_this_release_is_refused_with_a_clear_error() {
    let Some(server) = PostgresServer::start() else {
        return;
    };
    PostgresStore::connect(server.url()).await.expect("create");
    let admin = server.pool(2).await;
    admin
        .execute("UPDATE idem_schema_version SET version = 3")
        .await
        .unwrap();
    let err = PostgresStore::connect(server.url())
        .await
        .expect_err("a newer schema is refused");
    let ConnectError::Schema(m) = &err else {
        panic!("expected a schema error, got {err:?}")
    };
    assert!(
        m.contains("idem_schema_version is 3, newer than this idem-postgres knows (2)")
            && m.contains("upgrade idem-postgres"),
        "{m}"
    );
    // Nothing was changed.
    assert_eq!(version(&admin).await, 3);
}

/// A role that may use the tables but does not own them cannot migrate: a schema
/// error that says what the migration needs, and the database stays at version 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_migration_that_cannot_run_changes_nothing_and_says_why() {
    let Some(server) = PostgresServer::start() else {
        return;
    };
    let admin = server.pool(2).await;
    admin.execute(SCHEMA_V1).await.unwrap();
    admin
        .execute(
            "CREATE ROLE app LOGIN; \
             GRANT SELECT ON idem_schema_version TO app; \
             GRANT SELECT, INSERT, UPDATE, DELETE ON idem_records TO app; \
             GRANT USAGE ON SEQUENCE idem_fence TO app",
        )
        .await
        .unwrap();
    let url = format!("postgres://app@127.0.0.1:{}/postgres", server.port());
    let err = PostgresStore::connect(url)
        .await
        .expect_err("app does not own the tables");
    let ConnectError::Schema(m) = &err else {
        panic!("expected a schema error, got {err:?}")
    };
    assert!(
        m.contains("migrating idem_records from schema version 1 to 2 failed")
            && m.contains("owner"),
        "{m}"
    );
    assert_eq!(version(&admin).await, 1);
    let columns: i64 = sqlx::query(
        "SELECT count(*) FROM information_schema.columns \
         WHERE table_name = 'idem_records' AND column_name = 'created_at'",
    )
    .fetch_one(&admin)
    .await
    .unwrap()
    .get(0);
    assert_eq!(columns, 0, "the migration rolled back");

    // The documented way out: the owner runs the step, then the application starts.
    let step = idem_postgres::migration_sql("idem_", 2).expect("the step to 2");
    admin
        .execute(step.as_str())
        .await
        .expect("the owner migrates");
    assert_eq!(version(&admin).await, 2);
    let url = format!("postgres://app@127.0.0.1:{}/postgres", server.port());
    let s = PostgresStore::connect(url)
        .await
        .expect("app finds it current");
    let sc = scope();
    acquire(&s, &sc, LONG).await;
    assert!(
        s.read_record(&sc)
            .await
            .unwrap()
            .unwrap()
            .created_at
            .is_some()
    );
    for (prefix, to) in [("idem_", 1), ("idem_", 3), ("Bad-", 2)] {
        assert_eq!(
            idem_postgres::migration_sql(prefix, to),
            None,
            "{prefix} {to}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_carry_the_database_times_of_their_claim_and_completion() {
    let Some(server) = PostgresServer::start() else {
        return;
    };
    let s = PostgresStore::connect(server.url()).await.unwrap();
    let sc = scope();
    let fence = acquire(&s, &sc, LONG).await;
    let info = s.read_record(&sc).await.unwrap().unwrap();
    let created = near_now(info.created_at, "created_at");
    assert_eq!(info.completed_at, None, "in flight: not completed");
    s.complete(completion(&sc, fence, response(b"r"), LONG))
        .await
        .unwrap();
    let info = s.read_record(&sc).await.unwrap().unwrap();
    assert_eq!(
        info.created_at,
        Some(created),
        "completion keeps created_at"
    );
    let completed = near_now(info.completed_at, "completed_at");
    assert!(completed >= created, "{completed:?} before {created:?}");

    // A takeover keeps the run's creation time; a new run after a release gets its own.
    let short = scope();
    acquire(&s, &short, Duration::from_millis(100)).await;
    let first = s.read_record(&short).await.unwrap().unwrap().created_at;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let Claim::Acquired {
        fence,
        takeover: true,
    } = s.claim(req(&short, LONG)).await.unwrap()
    else {
        panic!("the lease ended: a takeover")
    };
    assert_eq!(
        s.read_record(&short).await.unwrap().unwrap().created_at,
        first
    );
    s.release(&short, fence).await.unwrap();
    acquire(&s, &short, LONG).await;
    let again = s.read_record(&short).await.unwrap().unwrap().created_at;
    assert!(again > first, "{again:?} after {first:?}");
}

fn of(tenant: &'static TenantId, sc: &'static Scope, lease: Duration) -> ClaimRequest<'static> {
    ClaimRequest {
        scope: sc,
        tenant,
        fingerprint: &FP,
        claimant: ClaimantId::random(),
        lease,
    }
}

fn leak<T>(x: T) -> &'static T {
    Box::leak(Box::new(x))
}

/// Rounds of 40 claims of one tenant, released at once through three instances (each
/// with its own pool of 10) with a bound of 8: each round acquires exactly 8. Without the
/// tenant lock in the claim, racing claims each count fewer than 8 and all insert.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_claims_on_three_instances_never_pass_the_bound() {
    const BOUND: usize = 8;
    const CLAIMS: usize = 40;
    let Some(server) = PostgresServer::start() else {
        return;
    };
    let mut stores = Vec::new();
    for _ in 0..3 {
        let s = PostgresStore::builder(server.url())
            .max_in_flight_per_tenant(Some(BOUND))
            // 30 connections in all: the test server allows 50.
            .max_connections(10)
            .statement_timeout(Duration::from_secs(10))
            .connect()
            .await
            .unwrap();
        stores.push(s);
    }
    for round in 0..5 {
        let tenant = leak(TenantId(rand::random()));
        let start = std::sync::Arc::new(tokio::sync::Barrier::new(CLAIMS));
        let tasks: Vec<_> = (0..CLAIMS)
            .map(|i| {
                let (s, start) = (stores[i % 3].clone(), start.clone());
                tokio::spawn(async move {
                    let sc = leak(scope());
                    start.wait().await;
                    s.claim(of(tenant, sc, LONG)).await
                })
            })
            .collect();
        let (mut acquired, mut full) = (0, 0);
        for t in tasks {
            match t.await.unwrap() {
                Ok(Claim::Acquired { .. }) => acquired += 1,
                Err(StoreError::Full(e)) => {
                    assert_eq!(e.to_string(), "tenant at its in-flight record bound (8)");
                    full += 1;
                }
                other => panic!("round {round}: {other:?}"),
            }
        }
        assert_eq!((acquired, full), (BOUND, CLAIMS - BOUND), "round {round}");
    }
}

/// A record counts while its lease is live: leases that ended make room, and taking one
/// over starts a run, so it is counted (and refused at the bound).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_live_leases_count_and_a_takeover_is_a_new_run() {
    let Some(server) = PostgresServer::start() else {
        return;
    };
    let s = PostgresStore::builder(server.url())
        .max_in_flight_per_tenant(Some(2))
        .connect()
        .await
        .unwrap();
    let admin = server.pool(2).await;
    let tenant = leak(TenantId(rand::random()));
    let (a, b) = (leak(scope()), leak(scope()));
    for sc in [a, b] {
        assert!(matches!(
            s.claim(of(tenant, sc, LONG)).await,
            Ok(Claim::Acquired { .. })
        ));
    }
    assert!(matches!(
        s.claim(of(tenant, leak(scope()), LONG)).await,
        Err(StoreError::Full(_))
    ));
    // Both leases end (their holder crashed), without waiting on a clock.
    sqlx::query(
        "UPDATE idem_records SET lease_until = clock_timestamp() - interval '1 second' \
         WHERE scope = $1 OR scope = $2",
    )
    .bind(&a.0[..])
    .bind(&b.0[..])
    .execute(&admin)
    .await
    .unwrap();
    assert!(matches!(
        s.claim(of(tenant, leak(scope()), LONG)).await,
        Ok(Claim::Acquired { .. })
    ));
    assert!(matches!(
        s.claim(of(tenant, a, LONG)).await,
        Ok(Claim::Acquired { takeover: true, .. })
    ));
    assert!(matches!(
        s.claim(of(tenant, b, LONG)).await,
        Err(StoreError::Full(_))
    ));
    assert!(matches!(
        s.claim(of(tenant, leak(scope()), LONG)).await,
        Err(StoreError::Full(_))
    ));
    // No bound: the same tenant claims on.
    let unbounded = PostgresStore::builder(server.url())
        .max_in_flight_per_tenant(None)
        .connect()
        .await
        .unwrap();
    assert!(matches!(
        unbounded.claim(of(tenant, b, LONG)).await,
        Ok(Claim::Acquired { takeover: true, .. })
    ));
}

/// Through a real tonic server: with a bound of 1, a second key of the tenant while the
/// first runs is RESOURCE_EXHAUSTED (`STORE_FULL`) with a retry delay and does not run;
/// once the first completes, the same retry runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_at_its_bound_gets_resource_exhausted_through_the_layer() {
    use idem_server::idempotency::{IdempotencyLayer, tenant::SingleTenant};
    use idem_test_support::shop::orders_client::OrdersClient;
    use idem_test_support::shop::orders_server::OrdersServer;
    use idem_test_support::shop_fake::{Shop, keyed_create};
    let Some(server) = PostgresServer::start() else {
        return;
    };
    let store = PostgresStore::builder(server.url())
        .max_in_flight_per_tenant(Some(1))
        .connect()
        .await
        .unwrap();
    let config = idem_core::config::ServiceConfig::from_json(
        r#"{"methodConfig": [{"name": [{"service": "shop.v1.Orders"}], "idempotency": {}}]}"#,
    )
    .unwrap();
    let shop = Shop::new();
    let (addr, incoming) = idem_test_support::net::bind().await;
    tokio::spawn(
        tonic::transport::Server::builder()
            .layer(IdempotencyLayer::new(store, &config).tenant(SingleTenant::new("t")))
            .add_service(OrdersServer::new(shop.clone()))
            .serve_with_incoming(incoming),
    );
    let client = OrdersClient::new(idem_test_support::net::channel(addr));
    let mut held = keyed_create("bound-first-0001", "", LONG);
    held.get_mut().sku = "gate".into();
    let mut c = client.clone();
    let first = tokio::spawn(async move { c.create_order(held).await });
    tokio::time::timeout(LONG, shop.started())
        .await
        .expect("the first call runs");

    let err = client
        .clone()
        .create_order(keyed_create("bound-second-0001", "", LONG))
        .await
        .expect_err("the tenant is at its bound");
    assert_eq!(err.code(), tonic::Code::ResourceExhausted, "{err:?}");
    let details = err.get_error_details();
    assert_eq!(
        details.error_info().map(|i| i.reason.as_str()),
        Some(idem_core::headers::reason::STORE_FULL),
        "{err:?}"
    );
    assert!(details.retry_info().is_some(), "a retry delay: {err:?}");
    assert_eq!(shop.runs(), 1, "the refused call did not run");

    shop.open_gate(1);
    first.await.unwrap().expect("the first call completes");
    client
        .clone()
        .create_order(keyed_create("bound-second-0001", "", LONG))
        .await
        .expect("room again: the retry runs");
    assert_eq!(shop.runs(), 2);
}

/// A connection built with `manage_schema(false)` (what `idem records` uses) changes
/// nothing: on an empty database it creates no table, on a version-1 database it runs
/// no migration; each time the connect fails with a schema error that says why. On a
/// current schema it connects.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_that_does_not_manage_the_schema_creates_and_migrates_nothing() {
    let Some(server) = PostgresServer::start() else {
        return;
    };
    let admin = server.pool(2).await;
    let check_only = || PostgresStore::builder(server.url()).manage_schema(false);

    let err = check_only().connect().await.expect_err("no schema yet");
    let ConnectError::Schema(m) = &err else {
        panic!("expected a schema error, got {err:?}")
    };
    assert!(
        m.contains("no idempotency schema") && m.contains("prefix"),
        "{m}"
    );
    let created: bool = sqlx::query("SELECT to_regclass('idem_schema_version') IS NOT NULL")
        .fetch_one(&admin)
        .await
        .unwrap()
        .get(0);
    assert!(!created, "a check-only connect created the schema");

    admin
        .execute(SCHEMA_V1)
        .await
        .expect("the version-1 schema");
    let err = check_only().connect().await.expect_err("an old schema");
    let ConnectError::Schema(m) = &err else {
        panic!("expected a schema error, got {err:?}")
    };
    assert!(
        m.contains("is 1, older") && m.contains("does not migrate"),
        "{m}"
    );
    assert_eq!(version(&admin).await, 1, "a check-only connect migrated");

    PostgresStore::connect(server.url()).await.expect("migrate");
    check_only()
        .connect()
        .await
        .expect("a current schema connects");
}
