//! What a caller sees when a protected handler's `RecordTx` fails, through a real tonic
//! server: one fixed message and an `ErrorInfo` reason (domain `idem`) per kind of
//! failure, a code that does not invite a retry of a deterministic failure, and none of
//! the details (constraint, table, SQL, fences): those go to the server's log.

mod support;

use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use idem_postgres::{PostgresStore, TxError};
use idem_store::{Claim, Fence, Store};
use idem_test_support::logs::Sink;
use idem_test_support::postgres::PostgresServer;
use idem_test_support::shop;
use idem_test_support::store::req;
use shop::orders_client::OrdersClient;
use shop::{CreateOrderRequest, Order};
use sqlx::Executor;
use tonic::{Code, Request, Response, Status};
use tonic_types::StatusExt;

/// Names a caller must never see: they are the schema's, not the API's.
const TABLE: &str = "secret_orders";
const PKEY: &str = "secret_orders_note_pkey";
const DEFERRED: &str = "secret_ledger_note_once";

/// The fences a taken-over run held and lost to, as the handler saw them.
type Fences = Arc<Mutex<Option<(Fence, Fence)>>>;

struct Shop {
    store: PostgresStore,
    fences: Fences,
}

impl Shop {
    /// What another instance does once this run's lease is gone: the record is claimed
    /// anew, under a higher fence. Returns (this run's fence, the new one).
    async fn take_over(&self, record: &idem_store::RecordRef) -> (Fence, Fence) {
        let (scope, mine) = (*record.scope(), record.fence());
        self.store.release(&scope, mine).await.unwrap();
        match self.store.claim(req(&scope, Duration::from_secs(60))).await {
            Ok(Claim::Acquired { fence, .. }) => (mine, fence),
            other => panic!("expected Acquired, got {other:?}"),
        }
    }
}

idem_test_support::create_only_orders! {
    Shop, why = "not in these tests";
    // The request's `sku` picks what goes wrong; `note` is the row written.
    create_order(&self, request) {
        let mut tx = self.store.begin_for(&request).await?;
        let CreateOrderRequest { note, sku, .. } = request.get_ref().clone();
        let insert = match sku.as_str() {
            "slow" => {
                tx.execute("SET LOCAL statement_timeout = '50ms'")
                    .await
                    .map_err(TxError::from)?;
                tx.execute("SELECT pg_sleep(5)").await.map_err(TxError::from)?;
                "INSERT INTO secret_orders (note) VALUES ($1)"
            }
            "taken-over" => {
                let fences = self.take_over(tx.record()).await;
                *self.fences.lock().unwrap() = Some(fences);
                "INSERT INTO secret_orders (note) VALUES ($1)"
            }
            "deferred" => "INSERT INTO secret_ledger (note) VALUES ($1)",
            _ => "INSERT INTO secret_orders (note) VALUES ($1)",
        };
        support::insert_and_commit(tx, insert, &note).await
    }
}

/// The server's log, for every test of this binary (a global subscriber, so the
/// handler's worker threads write to it too).
fn server_log() -> &'static Sink {
    static SINK: OnceLock<Sink> = OnceLock::new();
    SINK.get_or_init(|| {
        let sink = Sink::default();
        let writer = sink.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_ansi(false)
            .with_max_level(tracing::Level::WARN)
            .with_writer(move || writer.clone())
            .finish();
        tracing::subscriber::set_global_default(subscriber).expect("one global subscriber");
        sink
    })
}

struct Env {
    _server: PostgresServer,
    fences: Fences,
    client: OrdersClient<tonic::transport::Channel>,
}

async fn start() -> Option<Env> {
    server_log();
    let server = PostgresServer::start()?;
    let store = PostgresStore::connect(server.url()).await.expect("connect");
    let app = server.pool(1).await;
    app.execute(
        "CREATE TABLE secret_orders (note varchar(24) CONSTRAINT secret_orders_note_pkey PRIMARY KEY);
         CREATE TABLE secret_ledger (note text CONSTRAINT secret_ledger_note_once UNIQUE
             DEFERRABLE INITIALLY DEFERRED);",
    )
    .await
    .unwrap();
    let fences = Fences::default();
    let shop = Shop {
        store: store.clone(),
        fences: fences.clone(),
    };
    let client = support::serve(&store, shop).await;
    Some(Env {
        _server: server,
        fences,
        client,
    })
}

impl Env {
    /// Sends `CreateOrder` writing `note`, going wrong as `sku` says, with `key`.
    async fn create(&mut self, note: &str, sku: &str, key: &str) -> Result<Order, Status> {
        let mut r = Request::new(CreateOrderRequest {
            note: note.into(),
            sku: sku.into(),
            ..Default::default()
        });
        r.metadata_mut()
            .insert("x-idempotency-key", key.parse().unwrap());
        self.client.create_order(r).await.map(Response::into_inner)
    }

    /// [`create`](Self::create), which must fail: its error.
    async fn fail(&mut self, note: &str, sku: &str, key: &str) -> Status {
        let r = self.create(note, sku, key).await;
        r.expect_err("the call fails")
    }

    /// Writes `note` (as `sku` says) under the key `{tag}-01`, then again under
    /// `{tag}-02`, and returns the second call's error.
    async fn write_twice(&mut self, note: &str, sku: &str, tag: &str) -> Status {
        self.create(note, sku, &format!("{tag}-01")).await.unwrap();
        self.fail(note, sku, &format!("{tag}-02")).await
    }
}

/// What a caller reads for every constraint violation.
const CONSTRAINT_VIOLATED: &str = "the call's writes conflict with data already stored; \
    nothing was committed; the same request fails the same way until that data changes";

/// Asserts the caller got `code` with exactly `message` and the idem reason `reason`,
/// and that nothing of `secrets` (nor any long number, such as a fence) is anywhere in
/// what it got: message, details, metadata.
fn assert_fixed_answer(status: &Status, code: Code, reason: &str, message: &str, secrets: &[&str]) {
    assert_eq!(status.code(), code, "{status:?}");
    assert_eq!(status.message(), message, "{status:?}");
    let info = status.get_details_error_info().expect("an ErrorInfo");
    assert_eq!(info.domain, "idem");
    assert_eq!(info.reason, reason);
    assert!(info.metadata.is_empty(), "{:?}", info.metadata);
    let mut told = vec![
        status.message().to_owned(),
        String::from_utf8_lossy(status.details()).into_owned(),
    ];
    for kv in status.metadata().iter() {
        if let tonic::metadata::KeyAndValueRef::Ascii(k, v) = kv {
            told.push(format!("{k}: {}", v.to_str().unwrap_or_default()));
        }
    }
    for text in &told {
        for secret in secrets {
            assert!(
                !text.to_lowercase().contains(&secret.to_lowercase()),
                "{secret:?} reached the caller in {text:?}"
            );
        }
        let longest_number = text
            .split(|c: char| !c.is_ascii_digit())
            .map(str::len)
            .max()
            .unwrap_or(0);
        assert!(
            longest_number < 6,
            "a number reached the caller in {text:?}"
        );
    }
}

/// What no caller may read, whatever went wrong.
const ALWAYS_SECRET: [&str; 7] = [
    TABLE,
    "INSERT",
    "database error",
    "error returned from database",
    "fence",
    "postgres",
    "sqlstate",
];

fn secrets<'a>(more: &[&'a str]) -> Vec<&'a str> {
    ALWAYS_SECRET
        .iter()
        .copied()
        .chain(more.iter().copied())
        .collect()
}

/// Asserts the server's log has a line with every one of `parts`.
fn assert_logged(parts: &[&str]) {
    let log = server_log().text();
    let found = log
        .lines()
        .any(|line| parts.iter().all(|p| line.contains(p)));
    assert!(found, "no log line with all of {parts:?} in:\n{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_unique_violation_is_failed_precondition_with_a_fixed_message() {
    let Some(mut env) = start().await else { return };
    let err = env.write_twice("unique-1", "", "key-unique").await;
    assert_fixed_answer(
        &err,
        Code::FailedPrecondition,
        "CONSTRAINT_VIOLATED",
        CONSTRAINT_VIOLATED,
        &secrets(&[PKEY, "duplicate", "unique", "23505"]),
    );
    assert_logged(&["23505", PKEY, TABLE]);
    // Not recorded: nothing was committed, and the same request fails the same way.
    let again = env.fail("unique-1", "", "key-unique-02").await;
    assert_eq!(again.code(), Code::FailedPrecondition);
    assert!(again.metadata().get("x-idempotency-replayed").is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_constraint_checked_at_commit_is_failed_precondition_not_an_unknown_commit() {
    let Some(mut env) = start().await else { return };
    // The deferred constraint fails at COMMIT: the database answered, nothing committed.
    let err = env
        .write_twice("deferred-1", "deferred", "key-deferred")
        .await;
    assert_fixed_answer(
        &err,
        Code::FailedPrecondition,
        "CONSTRAINT_VIOLATED",
        CONSTRAINT_VIOLATED,
        &secrets(&[DEFERRED, "secret_ledger", "duplicate", "commit's outcome"]),
    );
    assert_logged(&["23505", DEFERRED]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_value_the_column_cannot_hold_is_invalid_argument() {
    let Some(mut env) = start().await else { return };
    let long = "a note longer than its column";
    let err = env.fail(long, "", "key-value-00001").await;
    assert_fixed_answer(
        &err,
        Code::InvalidArgument,
        "VALUE_REJECTED",
        "the database rejected a value in the call's writes; nothing was committed; \
         fix the request before sending it again",
        &secrets(&["varchar", "character varying", "too long", "22001", long]),
    );
    assert_logged(&["22001", "too long"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_statement_timeout_is_unavailable_with_a_fixed_message() {
    let Some(mut env) = start().await else { return };
    let err = env.fail("slow-1", "slow", "key-slow-000001").await;
    assert_fixed_answer(
        &err,
        Code::Unavailable,
        "STORE_UNAVAILABLE",
        "the database could not complete the call's transaction; nothing was committed; \
         retry the call with the same key",
        &secrets(&["canceling", "statement timeout", "pg_sleep", "57014"]),
    );
    assert_logged(&["57014", "statement timeout"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_taken_over_run_is_aborted_without_its_fences() {
    let Some(mut env) = start().await else { return };
    let err = env.fail("taken-1", "taken-over", "key-taken-00001").await;
    let (mine, theirs) = env.fences.lock().unwrap().expect("the handler ran");
    let (mine, theirs) = (mine.to_string(), theirs.to_string());
    assert_fixed_answer(
        &err,
        Code::Aborted,
        "LEASE_LOST",
        "another run of this call took it over while this one ran; this run's writes \
         were rolled back; retry the call with the same key for that run's outcome",
        &secrets(&[&mine, &theirs, "stale"]),
    );
    let fence = format!("fence={mine}");
    let current = format!("current_fence={theirs}");
    assert_logged(&["LEASE_LOST", &fence, &current]);
}

/// The answers are fixed: two violations of different constraints, on different tables
/// and at different steps (a statement, the `COMMIT`), read alike, byte for byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_do_not_depend_on_the_details() {
    let Some(mut env) = start().await else { return };
    let mut answers = Vec::new();
    for (note, sku, tag) in [
        ("same-a", "", "key-same-a"),
        ("same-b", "deferred", "key-same-b"),
    ] {
        let err = env.write_twice(note, sku, tag).await;
        answers.push((err.code(), err.message().to_owned(), err.details().to_vec()));
    }
    assert_eq!(answers[0], answers[1]);
}
