//! `RecordTx` through a real tonic server: a handler that writes its order and stores
//! its reply in one transaction. The stored reply is byte for byte what the layer would
//! have recorded, the layer does not record it again, a stale run is fenced and rolled
//! back, and a fresh call costs one statement outside the handler's transaction.

mod support;

use support::{insert_and_commit, order};

use std::time::Duration;

use idem_postgres::{PostgresStore, TxError};
use idem_server::idempotency::scope_for;
use idem_store::{RecordRef, RecordState, Scope, Store, StoredOutcome};
use idem_test_support::postgres::PostgresServer;
use idem_test_support::shop;
use shop::orders_client::OrdersClient;
use shop::{CreateOrderRequest, GetOrderRequest, Order};
use sqlx::postgres::PgPool;
use sqlx::{Executor, Row};
use tonic::{Code, Request, Response, Status};

const CREATE: &str = "/shop.v1.Orders/CreateOrder";
/// The same reply, recorded by the layer (no transaction).
const GET: &str = "/shop.v1.Orders/GetOrder";

struct Shop {
    store: PostgresStore,
}

idem_test_support::create_only_orders! {
    Shop, why = "not in these tests";
    // Inserts the order and stores the reply in one transaction.
    create_order(&self, request) {
        let tx = self.store.begin_for(&request).await?;
        let note = &request.get_ref().note;
        insert_and_commit(tx, "INSERT INTO orders (note) VALUES ($1)", note).await
    }
    // The same reply without a transaction: the layer records it.
    get_order(&self, request) {
        Ok(Response::new(order(&request.into_inner().order_id)))
    }
}

struct Env {
    _server: PostgresServer,
    store: PostgresStore,
    app: PgPool,
    client: OrdersClient<tonic::transport::Channel>,
}

async fn start(settings: &[(&str, &str)]) -> Option<Env> {
    let server = PostgresServer::start_with(settings)?;
    let store = PostgresStore::connect(server.url()).await.expect("connect");
    let app = server.pool(2).await;
    app.execute("CREATE TABLE orders (note text NOT NULL)")
        .await
        .unwrap();
    let client = support::serve(
        &store,
        Shop {
            store: store.clone(),
        },
    )
    .await;
    Some(Env {
        _server: server,
        store,
        app,
        client,
    })
}

impl Env {
    /// Sends `CreateOrder` with `note` and `key`; panics on an error.
    async fn create_ok(&mut self, note: &str, key: &str) -> Response<Order> {
        self.client.create_order(create(note, key)).await.unwrap()
    }
}

fn keyed<T>(msg: T, key: &str) -> Request<T> {
    let mut r = Request::new(msg);
    r.metadata_mut()
        .insert("x-idempotency-key", key.parse().unwrap());
    r
}

fn create(note: &str, key: &str) -> Request<CreateOrderRequest> {
    keyed(
        CreateOrderRequest {
            note: note.into(),
            ..Default::default()
        },
        key,
    )
}

async fn orders(app: &PgPool, note: &str) -> i64 {
    sqlx::query("SELECT count(*) FROM orders WHERE note = $1")
        .bind(note)
        .fetch_one(app)
        .await
        .unwrap()
        .get(0)
}

async fn stored(store: &PostgresStore, method: &str, key: &str) -> RecordState {
    store
        .get(&scope_for("t", method, key))
        .await
        .unwrap()
        .expect("a record")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reply_committed_with_the_order_is_replayed_byte_for_byte() {
    let Some(mut env) = start(&[]).await else {
        return;
    };
    let first = env.create_ok("a", "key-a-0001").await;
    assert_eq!(first.get_ref(), &order("a"));
    let again = env.create_ok("a", "key-a-0001").await;
    assert_eq!(again.get_ref(), &order("a"));
    assert_eq!(
        again.metadata().get("x-idempotency-replayed").unwrap(),
        "true"
    );
    assert_eq!(orders(&env.app, "a").await, 1);

    // The layer's own recording of the same reply holds the same bytes.
    let get = keyed(
        GetOrderRequest {
            order_id: "a".into(),
        },
        "key-a-0002",
    );
    env.client.get_order(get).await.unwrap();
    let (
        RecordState::Completed { outcome: by_tx, .. },
        RecordState::Completed {
            outcome: by_layer, ..
        },
    ) = (
        stored(&env.store, CREATE, "key-a-0001").await,
        stored(&env.store, GET, "key-a-0002").await,
    )
    else {
        panic!("both completed");
    };
    assert!(matches!(by_tx, StoredOutcome::Response(_)));
    assert_eq!(by_tx, by_layer);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_fence_rolls_the_handlers_writes_back() {
    let Some(env) = start(&[]).await else {
        return;
    };
    // A run whose record was taken over: its fence matches no in-flight record.
    let mut request = Request::new(());
    let scope = Scope(rand::random());
    request.extensions_mut().insert(RecordRef::new(
        scope,
        7,
        Duration::from_secs(60),
        Duration::from_secs(10),
    ));
    let mut tx = env.store.begin_for(&request).await.unwrap();
    sqlx::query("INSERT INTO orders (note) VALUES ('stale')")
        .execute(&mut *tx)
        .await
        .unwrap();
    let err = tx.commit_reply(&order("stale")).await.unwrap_err();
    assert!(matches!(err, TxError::Fenced { presented: 7, .. }), "{err}");
    assert_eq!(Status::from(err).code(), Code::Aborted);
    assert_eq!(orders(&env.app, "stale").await, 0);
    let record = request.extensions().get::<RecordRef>().unwrap();
    assert!(!record.is_completed());

    // Not a protected call: no record to complete.
    let err = env.store.begin_for(&Request::new(())).await.unwrap_err();
    assert!(matches!(err, TxError::NoRecord));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_call_is_one_statement_outside_the_handlers_transaction() {
    let Some(mut env) = start(&[("shared_preload_libraries", "pg_stat_statements")]).await else {
        return;
    };
    env.app
        .execute("CREATE EXTENSION pg_stat_statements")
        .await
        .unwrap();
    // Warm the pool's connections and their prepared statements.
    for i in 0..4 {
        let key = format!("warm-key-{i:04}");
        env.create_ok("w", &key).await;
        env.create_ok("w", &key).await;
    }
    let statements = |app: PgPool| async move {
        let rows = sqlx::query(
            "SELECT query, calls FROM pg_stat_statements \
             WHERE query LIKE '%idem_%' AND query NOT LIKE '%pg_stat_statements%'",
        )
        .fetch_all(&app)
        .await
        .unwrap();
        rows.iter()
            .map(|r| (r.get::<String, _>(0), r.get::<i64, _>(1)))
            .collect::<Vec<_>>()
    };
    let reset = |app: PgPool| async move {
        app.execute("SELECT pg_stat_statements_reset()")
            .await
            .unwrap();
    };
    reset(env.app.clone()).await;
    env.create_ok("f", "fresh-key-01").await;
    // The layer records nothing after the handler: wait out anything in the background.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let fresh = statements(env.app.clone()).await;
    eprintln!("fresh: {fresh:?}");
    let calls = |list: &[(String, i64)], f: &str| {
        list.iter()
            .filter(|(q, _)| q.contains(f))
            .map(|(_, c)| c)
            .sum::<i64>()
    };
    assert_eq!(calls(&fresh, "idem_claim"), 1, "{fresh:?}");
    assert_eq!(
        calls(&fresh, "idem_complete"),
        1,
        "in the handler's transaction: {fresh:?}"
    );
    assert_eq!(fresh.iter().map(|(_, c)| c).sum::<i64>(), 2, "{fresh:?}");

    reset(env.app.clone()).await;
    let replay = env.create_ok("f", "fresh-key-01").await;
    assert_eq!(
        replay.metadata().get("x-idempotency-replayed").unwrap(),
        "true"
    );
    let replay = statements(env.app.clone()).await;
    assert_eq!(replay.iter().map(|(_, c)| c).sum::<i64>(), 1, "{replay:?}");
}
