//! `idem records show|delete` against records written through a real server: an
//! `Orders` server behind the idempotency layer on 127.0.0.1, with a private
//! redis-server, Redis Cluster or PostgreSQL (see `idem_test_support`), and the
//! command run as a real process. The memory store's API is checked the same way.

use std::path::PathBuf;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use idem_core::config::ServiceConfig;
use idem_server::idempotency::IdempotencyLayer;
use idem_store::format;
use idem_store::memory::MemoryStore;
use idem_store::{DeleteMode, Deletion, RecordState, Scope, Store, StoredOutcome};
use idem_test_support::net;
use idem_test_support::shop::Order;
use idem_test_support::shop::orders_client::OrdersClient;
use idem_test_support::shop::orders_server::OrdersServer;
use idem_test_support::shop_fake::{Shop, keyed_create};
use prost::Message;
use serde_json::Value;

const TENANT: &str = "ops";
const METHOD: &str = "shop.v1.Orders/CreateOrder";
const PATIENCE: Duration = Duration::from_secs(20);

fn root() -> PathBuf {
    // The directory cargo gives the test when it runs it: a test binary reused from a
    // build in another checkout of the same tree carries that checkout's path.
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")), PathBuf::from)
        .join("../..")
}

/// Runs `idem records …` as a process (blocking: call from `spawn_blocking`).
fn idem(args: &[String]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_idem"))
        .arg("records")
        .args(args)
        .current_dir(root())
        .output()
        .expect("idem runs")
}

async fn run(args: Vec<String>) -> Output {
    tokio::task::spawn_blocking(move || idem(&args))
        .await
        .expect("idem joined")
}

fn code(o: &Output) -> i32 {
    o.status.code().expect("exited, not killed")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn config() -> ServiceConfig {
    ServiceConfig::from_json_with_warnings(&format!(
        r#"{{"methodConfig": [{{"name": [{{"service": "shop.v1.Orders"}}], "idempotency": {{}}}}],
            "idem": {{"tenant": {{"single": "{TENANT}"}}}}}}"#
    ))
    .expect("valid config")
    .config
}

/// An `Orders` server on 127.0.0.1 behind the layer with `store`.
async fn serve<St: Store + std::fmt::Debug>(
    store: St,
) -> (OrdersClient<tonic::transport::Channel>, Shop) {
    let shop = Shop::new();
    let (addr, incoming) = net::bind().await;
    let router = tonic::transport::Server::builder()
        .layer(IdempotencyLayer::new(store, &config()))
        .add_service(OrdersServer::new(shop.clone()));
    tokio::spawn(router.serve_with_incoming(incoming));
    (OrdersClient::new(net::channel(addr)), shop)
}

fn select(key: &str) -> Vec<String> {
    ["--tenant", TENANT, "--method", METHOD, "--key", key]
        .map(String::from)
        .to_vec()
}

/// `rest[0]` (show or delete), the store arguments, then the rest.
fn with(store: &[String], rest: &[&str]) -> Vec<String> {
    let mut v = vec![rest[0].to_string()];
    v.extend(store.iter().cloned());
    v.extend(rest[1..].iter().map(|s| s.to_string()));
    v
}

/// The whole operator's path on one store: a call, `show` (hex and `--proto` JSON,
/// by key and by the logs' scope prefix), `delete`, and the same key runs again; an
/// unknown key; a forced delete of an in-flight record.
async fn operate<St: Store + std::fmt::Debug>(store: St, store_args: Vec<String>, by_prefix: bool) {
    let (mut client, shop) = serve(store).await;
    let key = format!("rec-{:016x}", rand_u64());
    let got: Order = client
        .create_order(keyed_create(&key, "first", PATIENCE))
        .await
        .expect("the call succeeds")
        .into_inner();
    assert_eq!(shop.runs(), 1);

    // Hex, JSON.
    let o = run(with(&store_args, &["show", "--json"])
        .into_iter()
        .chain(select(&key))
        .collect())
    .await;
    assert_eq!(code(&o), 0, "show: {}", text(&o.stderr));
    let v: Value = serde_json::from_slice(&o.stdout).expect("one JSON object");
    assert_eq!(v["state"], "completed");
    assert_eq!(
        v["scope"],
        Scope::for_call(TENANT, &format!("/{METHOD}"), &key).to_hex()
    );
    assert_eq!(v["response"]["grpc_status"], 0);
    // When the run was claimed and completed, as the store's clock recorded them
    // (RFC 3339 UTC, so they compare as text).
    let (created, completed) = (v["created_at"].as_str(), v["completed_at"].as_str());
    assert!(
        created.zip(completed).is_some_and(|(c, d)| c <= d),
        "times: {v}"
    );
    let hex: String = got
        .encode_to_vec()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert_eq!(v["response"]["messages"][0]["hex"], hex.as_str());

    // With the proto: the message as JSON, as the caller got it.
    let mut args = with(
        &store_args,
        &[
            "show",
            "--json",
            "--proto",
            "proto/shop/v1/orders.proto",
            "-I",
            "proto",
        ],
    );
    args.extend(select(&key));
    let o = run(args).await;
    assert_eq!(code(&o), 0, "show --proto: {}", text(&o.stderr));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    let m = &v["response"]["messages"][0];
    assert_eq!(m["orderId"], got.order_id.as_str(), "{v}");
    assert_eq!(m["sku"], got.sku.as_str());

    // Text output, found by the 16 hex digits the logs print.
    if by_prefix {
        let short = Scope::for_call(TENANT, &format!("/{METHOD}"), &key).short_hex();
        let o = run(with(&store_args, &["show", "--scope", &short])).await;
        assert_eq!(code(&o), 0, "show --scope: {}", text(&o.stderr));
        let out = text(&o.stdout);
        assert!(
            out.contains("state: completed")
                && out.contains("grpc_status: 0")
                && out.contains(&format!("created_at: {}\n", created.unwrap_or("?")))
                && out.contains(&format!("completed_at: {}\n", completed.unwrap_or("?"))),
            "{out}"
        );
    }

    // Unknown key: 1.
    let o = run(with(&store_args, &["show"])
        .into_iter()
        .chain(select("no-such-key-0001"))
        .collect())
    .await;
    assert_eq!(code(&o), 1, "{}", text(&o.stderr));

    // Delete; the same key runs the handler again.
    let o = run(with(&store_args, &["delete"])
        .into_iter()
        .chain(select(&key))
        .collect())
    .await;
    assert_eq!(code(&o), 0, "delete: {}", text(&o.stderr));
    assert!(
        text(&o.stdout).starts_with("deleted\n"),
        "{}",
        text(&o.stdout)
    );
    let o = run(with(&store_args, &["delete"])
        .into_iter()
        .chain(select(&key))
        .collect())
    .await;
    assert_eq!(code(&o), 1, "a second delete finds nothing");
    client
        .create_order(keyed_create(&key, "first", PATIENCE))
        .await
        .expect("the call runs again");
    assert_eq!(
        shop.runs(),
        2,
        "the deleted record's key ran the handler again"
    );

    // In flight: refused without --force (and left alone), deleted with it.
    let key = format!("gate-{:016x}", rand_u64());
    let mut req = keyed_create(&key, "", PATIENCE);
    req.get_mut().sku = "gate".into();
    let mut c = client.clone();
    let call = tokio::spawn(async move { c.create_order(req).await });
    tokio::time::timeout(PATIENCE, shop.started())
        .await
        .expect("the handler started");
    let o = run(with(&store_args, &["delete"])
        .into_iter()
        .chain(select(&key))
        .collect())
    .await;
    assert_eq!(code(&o), 2, "an in-flight delete without --force");
    assert!(text(&o.stderr).contains("in flight"), "{}", text(&o.stderr));
    let o = run(with(&store_args, &["show"])
        .into_iter()
        .chain(select(&key))
        .collect())
    .await;
    assert!(
        text(&o.stdout).contains("state: in_flight"),
        "{}",
        text(&o.stdout)
    );
    let o = run(with(&store_args, &["delete", "--force"])
        .into_iter()
        .chain(select(&key))
        .collect())
    .await;
    assert_eq!(code(&o), 0, "forced: {}", text(&o.stderr));
    assert!(
        text(&o.stderr).contains("warning: deleted an in-flight record"),
        "{}",
        text(&o.stderr)
    );
    let o = run(with(&store_args, &["show"])
        .into_iter()
        .chain(select(&key))
        .collect())
    .await;
    assert_eq!(code(&o), 1, "the record is gone");
    shop.open_gate(1);
    let _ = tokio::time::timeout(PATIENCE, call).await;
}

fn rand_u64() -> u64 {
    use std::hash::{BuildHasher, RandomState};
    RandomState::new().hash_one(Instant::now())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_records_are_shown_and_deleted() {
    let Some(redis) = idem_test_support::redis::RedisServer::start() else {
        return;
    };
    let store = idem_redis::RedisStore::builder(redis.url())
        .connect()
        .await
        .expect("connect");
    operate(store, vec!["--redis".into(), redis.url()], true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_records_are_shown_and_deleted() {
    let Some(cluster) = idem_test_support::redis::RedisCluster::shared() else {
        return;
    };
    let store = idem_redis::RedisStore::cluster_builder(cluster.urls())
        .key_prefix("records:")
        .connect()
        .await
        .expect("connect");
    let args = vec![
        "--redis-cluster".into(),
        cluster.urls().join(","),
        "--key-prefix".into(),
        "records:".into(),
    ];
    operate(store, args, true).await;
}

/// `--scope` with the logs' 16 hex digits on a Redis Cluster: one record on each master
/// (so whichever node a one-node `SCAN` would walk, two are elsewhere, and at least one
/// is on neither the first seed's node nor slot 0's master), each found, shown and then
/// deleted by its prefix; afterwards the prefix finds nothing (exit 1).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_scope_prefixes_find_records_on_every_master() {
    let Some(cluster) = idem_test_support::redis::RedisCluster::shared() else {
        return;
    };
    let prefix = "prefixes:";
    let store = idem_redis::RedisStore::cluster_builder(cluster.urls())
        .key_prefix(prefix)
        .connect()
        .await
        .expect("connect");
    let (mut client, shop) = serve(store).await;
    let args = vec![
        "--redis-cluster".to_owned(),
        cluster.urls().join(","),
        "--key-prefix".to_owned(),
        prefix.to_owned(),
    ];
    let mut masters: Vec<u16> = cluster.masters().iter().map(|m| m.port).collect();
    assert_eq!(masters.len(), 3, "the fixture has three masters");
    let first_seed = cluster.ports()[0];
    let slot0 = cluster.master_of_slot(0).port;
    // A key per master, the one on neither the first seed nor slot 0's master first.
    masters.sort_by_key(|p| *p == first_seed || *p == slot0);
    let mut keys = Vec::new();
    for master in &masters {
        let key = loop {
            let key = format!("pfx-{:016x}", rand_u64());
            let scope = Scope::for_call(TENANT, &format!("/{METHOD}"), &key);
            let slot = cluster.slot_of(&format!("{prefix}{{{}}}", scope.to_hex()));
            if cluster.master_of_slot(slot).port == *master {
                break key;
            }
        };
        client
            .create_order(keyed_create(&key, "first", PATIENCE))
            .await
            .expect("the call succeeds");
        keys.push(key);
    }
    assert_eq!(shop.runs(), 3);
    for key in &keys {
        let short = Scope::for_call(TENANT, &format!("/{METHOD}"), key).short_hex();
        let o = run(with(&args, &["show", "--scope", &short])).await;
        assert_eq!(code(&o), 0, "show --scope {short}: {}", text(&o.stderr));
        assert!(
            text(&o.stdout).contains("state: completed"),
            "{}",
            text(&o.stdout)
        );
        let o = run(with(&args, &["delete", "--scope", &short])).await;
        assert_eq!(code(&o), 0, "delete --scope {short}: {}", text(&o.stderr));
        let o = run(with(&args, &["show", "--scope", &short])).await;
        assert_eq!(code(&o), 1, "deleted: {}", text(&o.stderr));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_records_are_shown_and_deleted() {
    let Some(pg) = idem_test_support::postgres::PostgresServer::start() else {
        return;
    };
    let store = idem_postgres::PostgresStore::connect(pg.url())
        .await
        .expect("connect");
    operate(store, vec!["--postgres".into(), pg.url()], true).await;
}

/// The memory store through its API: the record of a real call, its decoded response,
/// a delete, and the same key runs again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_records_are_read_and_deleted_through_the_api() {
    let store = MemoryStore::default();
    let (mut client, shop) = serve(store.clone()).await;
    let got = client
        .create_order(keyed_create("mem-key-0001", "", PATIENCE))
        .await
        .unwrap()
        .into_inner();
    let scope = Scope::for_call(TENANT, &format!("/{METHOD}"), "mem-key-0001");
    let info = store.record(&scope).expect("the record");
    let RecordState::Completed {
        outcome: StoredOutcome::Response(bytes),
        ..
    } = &info.state
    else {
        panic!("completed with a response: {info:?}");
    };
    assert!(info.completed_at.is_some() && info.expires_in.is_some());
    assert!(
        info.created_at
            .is_some_and(|c| Some(c) <= info.completed_at)
    );
    let r = format::read(bytes.clone()).unwrap();
    let m = format::grpc_messages(&r.frames).unwrap();
    assert_eq!(Order::decode(m[0].bytes.clone()).unwrap(), got);
    assert!(matches!(
        store.delete(&scope, DeleteMode::UnlessInFlight),
        Deletion::Deleted(_)
    ));
    assert!(store.record(&scope).is_none());
    client
        .create_order(keyed_create("mem-key-0001", "", PATIENCE))
        .await
        .unwrap();
    assert_eq!(shop.runs(), 2);
}

/// Bad input and an unreachable store: exit 2 with a message, never a panic.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_and_unreachable_stores_exit_2() {
    let port = net::free_port();
    let url = format!("redis://user:hunter2@127.0.0.1:{port}");
    let start = Instant::now();
    let o = run(with(&["--redis".into(), url.clone()], &["show"])
        .into_iter()
        .chain(select("k-0001"))
        .collect())
    .await;
    assert_eq!(code(&o), 2);
    let err = text(&o.stderr);
    assert!(
        err.contains("cannot reach the store") && !err.contains("hunter2"),
        "{err}"
    );
    // Within the 2 s connect timeout; a generous bound for a loaded machine.
    assert!(start.elapsed() < PATIENCE, "took {:?}", start.elapsed());

    let pg = format!("postgres://me:s3cret@127.0.0.1:{port}/db");
    let o = run(with(
        &["--postgres".into(), pg],
        &["show", "--scope", &"ab".repeat(32)],
    ))
    .await;
    assert_eq!(code(&o), 2);
    assert!(!text(&o.stderr).contains("s3cret"), "{}", text(&o.stderr));

    for (args, says) in [
        (
            vec!["show", "--redis", "redis://x", "--scope", "12xz34"],
            "not a hex digit",
        ),
        (
            vec!["show", "--redis", "redis://x", "--scope", "abc"],
            "digits",
        ),
        (
            vec![
                "show",
                "--redis",
                "redis://x",
                "--tenant",
                "t",
                "--method",
                "NoSlash",
                "--key",
                "k",
            ],
            "one '/'",
        ),
        (
            vec!["show", "--redis", "redis://x", "--tenant", "t"],
            "--tenant",
        ),
        (
            vec!["show", "--tenant", "t", "--method", "a.B/C", "--key", "k"],
            "give a store",
        ),
        (vec!["frobnicate"], "unknown records command"),
    ] {
        let o = run(args.iter().map(|s| s.to_string()).collect()).await;
        assert_eq!(code(&o), 2, "{args:?}");
        assert!(
            text(&o.stderr).contains(says),
            "{args:?}: {}",
            text(&o.stderr)
        );
        assert!(!text(&o.stderr).contains("panicked"));
    }

    let dir = std::env::temp_dir().join(format!("idem-records-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("bad.proto");
    std::fs::write(&bad, "syntax = \"proto3\"; message { broken").unwrap();
    let o = run(vec![
        "show".into(),
        "--redis".into(),
        format!("redis://127.0.0.1:{port}"),
        "--tenant".into(),
        "t".into(),
        "--method".into(),
        "a.B/C".into(),
        "--key".into(),
        "k".into(),
        "--proto".into(),
        bad.to_string_lossy().into_owned(),
    ])
    .await;
    assert_eq!(code(&o), 2);
    assert!(text(&o.stderr).contains("--proto"), "{}", text(&o.stderr));
    let _ = std::fs::remove_dir_all(&dir);
}

/// A record in a format this version does not read: exit 2 naming it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_of_an_unknown_format_version_exits_2() {
    let Some(redis) = idem_test_support::redis::RedisServer::start() else {
        return;
    };
    let store = idem_redis::RedisStore::builder(redis.url())
        .connect()
        .await
        .unwrap();
    let scope = Scope::for_call(TENANT, &format!("/{METHOD}"), "future-key-01");
    let fence = idem_test_support::store::acquire(&store, &scope, PATIENCE).await;
    store
        .complete(idem_store::CompleteRequest {
            scope: &scope,
            fence,
            outcome: StoredOutcome::Response(bytes_of(b"IDR9 from the future")),
            ttl: PATIENCE,
        })
        .await
        .unwrap();
    let o = run(with(&["--redis".into(), redis.url()], &["show"])
        .into_iter()
        .chain(select("future-key-01"))
        .collect())
    .await;
    assert_eq!(code(&o), 2);
    assert!(text(&o.stderr).contains("IDR9"), "{}", text(&o.stderr));
}

fn bytes_of(b: &'static [u8]) -> bytes::Bytes {
    bytes::Bytes::from_static(b)
}
