//! Interop with an independently written gRPC stack: Python's `grpcio` (gRPC C-core).
//!
//! The Python programs live in `tests/interop/` (`client.py`, `server.py`; stubs are
//! generated from `proto/shop/v1/orders.proto` at run time into a temporary directory)
//! and run from the venv that `scripts/setup-test-deps.sh` creates at `.venv`
//! (`tests/interop/requirements.txt` pins grpcio). They print JSON lines that these
//! tests parse.
//!
//! - grpcio client → tonic server with idem's `IdempotencyLayer` and `MemoryStore`:
//!   the same key twice runs the handler once and the second reply is a replay; the same
//!   key with another request is FAILED_PRECONDITION; grpcio's own service-config
//!   retries (maxAttempts 4 on UNAVAILABLE, from the very file the server reads) against a
//!   handler that fails twice with UNAVAILABLE run to exactly one order; a call without
//!   a key is INVALID_ARGUMENT, and idem's `ErrorInfo` reasons (KEY_MISSING, KEY_REUSED)
//!   reach grpcio intact; a gzip-compressed call and a plain call of the same request are
//!   one execution (the fingerprint is taken after decompression).
//! - idem's `RetryLayer` over a tonic channel → grpcio server that fails twice with
//!   UNAVAILABLE: three attempts, the same key on each, `grpc-previous-rpc-attempts`
//!   absent / 1 / 2; and a grpcio server's `grpc-retry-pushback-ms: -1` stops the
//!   retries after one attempt.
//! - Across hops (a chain with grpcio at the top): grpcio (4 attempts) → A → B →
//!   C → D, where A, B and C are tonic servers with idem's `InboundLayer` and
//!   `IdempotencyLayer` whose handler calls the next hop through a `RetryLayer` (3
//!   attempts), and D always answers UNAVAILABLE. With the pushback marker on, the
//!   exhausted failure reaches grpcio with `grpc-retry-pushback-ms: -1` and nobody above
//!   C retries: D sees 3 attempts. With it off, D sees 4 × 3 × 3 × 3 = 108. idem's local
//!   outcome headers never reach grpcio.
//!
//! Without the venv the tests print `skipped: …` and pass, except when `CI` is set: then
//! they fail, so CI never skips them silently. Every process wait is bounded
//! ([`PROCESS_TIMEOUT`]) and every child is killed when its handle drops. These tests use
//! real time: they talk to other processes, and the bounds are only there so a hang
//! fails instead of stalling the suite.

use idem_test_support::net;
use idem_test_support::shop;

use std::future::Future;
use std::io::Write as _;
use std::path::PathBuf;
use std::pin::Pin;
use std::process::Stdio;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use idem_client::retry::{CallOutcome, CallReport, Retry, RetryLayer};
use idem_core::config::TenantSource;
use idem_core::headers::{
    ERROR_DOMAIN, GRPC_STATUS_DETAILS, IDEMPOTENCY_KEY, IDEMPOTENCY_REPLAYED,
    PREVIOUS_RPC_ATTEMPTS, RETRY_ATTEMPTS, RETRY_OUTCOME, RETRY_PUSHBACK_MS, reason,
};
use idem_core::{config::ServiceConfig, key::IdempotencyKey};
use idem_server::{idempotency::IdempotencyLayer, inbound::InboundLayer};
use idem_store::memory::MemoryStore;
use idem_test_support::shop_fake::create_only;
use serde_json::Value;
use shop::orders_client::OrdersClient;
use shop::orders_server::{Orders, OrdersServer};
use shop::{CreateOrderRequest, Order};
use tokio::io::{AsyncBufReadExt, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};
use tokio::sync::oneshot;
use tokio::time::timeout;
use tokio_stream::wrappers::TcpListenerStream;
use tonic::codec::CompressionEncoding;
use tonic::transport::Channel;
use tonic::{Request, Response, Status};
use tonic_types::StatusExt;

/// Bound on every wait for a child process (start, a line of output, exit).
const PROCESS_TIMEOUT: Duration = Duration::from_secs(60);

/// One service config for every stack in these tests: grpcio's client reads the standard
/// parts (its retry policy) and ignores idem's objects; idem's `RetryLayer` reads the
/// retry policy and `idempotency` (which makes it add a key); idem's server layer reads
/// `idempotency` and `idem`.
const SERVICE_CONFIG: &str = r#"{
  "methodConfig": [{
    "name": [{"service": "shop.v1.Orders", "method": "CreateOrder"}],
    "timeout": "10s",
    "retryPolicy": {
      "maxAttempts": 4,
      "initialBackoff": "0.05s",
      "maxBackoff": "0.2s",
      "backoffMultiplier": 2,
      "retryableStatusCodes": ["UNAVAILABLE"]
    },
    "idempotency": {"acceptCompressed": ["gzip"]}
  }],
  "idem": {"tenant": {"single": "interop"}}
}"#;

/// [`SERVICE_CONFIG`] as idem reads it: the same document grpcio gets.
fn service_config() -> ServiceConfig {
    let parsed =
        ServiceConfig::from_json_with_warnings(SERVICE_CONFIG).expect("SERVICE_CONFIG is valid");
    assert!(parsed.warnings.is_empty(), "{:?}", parsed.warnings);
    let config = parsed.config;
    let method = config
        .lookup("shop.v1.Orders", "CreateOrder")
        .expect("CreateOrder has an entry");
    assert!(method.idempotency().is_some(), "CreateOrder is protected");
    assert_eq!(method.retry_policy().map(|p| p.max_attempts()), Some(4));
    assert_eq!(
        config.settings().tenant,
        TenantSource::Single("interop".into())
    );
    config
}

// ---------------------------------------------------------------------------------------
// Python side
// ---------------------------------------------------------------------------------------

/// The venv's interpreter and the directory of the Python programs.
struct Python {
    exe: PathBuf,
    dir: PathBuf,
}

/// The venv's Python with grpcio, or `None` (after saying so) when it is missing outside
/// CI. In CI (`CI` set) a missing venv fails the test.
async fn python() -> Option<Python> {
    // The directory cargo gives the test when it runs it (a test binary reused from a
    // build in another checkout carries that checkout's path).
    let root = std::env::var_os("CARGO_MANIFEST_DIR")
        .map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")), PathBuf::from);
    let exe = root.join(".venv/bin/python");
    let dir = root.join("tests/interop");
    let usable = exe.is_file() && {
        let check = Command::new(&exe)
            .args(["-c", "import grpc, grpc_tools"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .status();
        matches!(timeout(PROCESS_TIMEOUT, check).await, Ok(Ok(status)) if status.success())
    };
    if usable {
        return Some(Python { exe, dir });
    }
    let why = format!(
        "{} with grpcio and grpcio-tools is missing: run scripts/setup-test-deps.sh",
        exe.display()
    );
    let in_ci = std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "false" && v != "0");
    if in_ci {
        panic!("grpcio interop tests cannot run in CI: {why}");
    }
    // Straight to the process's stderr: libtest captures `eprintln!` of passing tests, and
    // a skip must be seen.
    let _ = writeln!(std::io::stderr(), "skipped: {why}");
    None
}

impl Python {
    fn command(&self, program: &str) -> Command {
        let mut cmd = Command::new(&self.exe);
        cmd.arg(self.dir.join(program))
            .current_dir(&self.dir)
            // Keep the source tree free of __pycache__.
            .env("PYTHONDONTWRITEBYTECODE", "1")
            .env("PYTHONUNBUFFERED", "1")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        cmd
    }

    /// Runs `client.py` with `args` to completion and returns one JSON value per call.
    async fn client(&self, args: &[&str]) -> Vec<Value> {
        let child = self
            .command("client.py")
            .args(args)
            .stdin(Stdio::null())
            .spawn()
            .expect("spawn client.py");
        // On timeout the future, and with it the child, is dropped: kill_on_drop ends it.
        let out = timeout(PROCESS_TIMEOUT, child.wait_with_output())
            .await
            .unwrap_or_else(|_| {
                panic!("client.py {args:?} still running after {PROCESS_TIMEOUT:?}")
            })
            .expect("wait for client.py");
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success(),
            "client.py {args:?} failed: {}\nstdout:\n{stdout}\nstderr:\n{stderr}",
            out.status
        );
        stdout
            .lines()
            .map(|line| {
                serde_json::from_str(line)
                    .unwrap_or_else(|e| panic!("client.py printed non-JSON {line:?}: {e}"))
            })
            .collect()
    }

    /// Runs client.py against `addr` in `mode` with `key` and `more` arguments.
    async fn calls(&self, addr: &str, mode: &str, key: &str, more: &[&str]) -> Vec<Value> {
        let mut args = vec!["--addr", addr, "--mode", mode, "--key", key];
        args.extend(more);
        self.client(&args).await
    }

    /// Starts `server.py` and waits until it listens.
    async fn server(&self, args: &[&str]) -> PyServer {
        let mut child = self
            .command("server.py")
            .args(args)
            // server.py exits when its stdin closes: a second guard besides kill_on_drop.
            .stdin(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn server.py");
        let stdin = child.stdin.take().expect("server.py stdin");
        let stdout = child.stdout.take().expect("server.py stdout");
        let mut server = PyServer {
            _stdin: stdin,
            lines: BufReader::new(stdout).lines(),
            port: 0,
            child,
        };
        let first = server.next_event().await;
        assert_eq!(first["event"], "listening", "server.py: {first}");
        server.port = first["port"]
            .as_u64()
            .and_then(|p| u16::try_from(p).ok())
            .unwrap_or_else(|| panic!("server.py announced no port: {first}"));
        server
    }
}

/// A running `server.py`; killed when dropped.
struct PyServer {
    _stdin: ChildStdin,
    lines: Lines<BufReader<ChildStdout>>,
    port: u16,
    child: Child,
}

impl PyServer {
    fn addr(&self) -> std::net::SocketAddr {
        std::net::SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    /// The next JSON line server.py printed.
    async fn next_event(&mut self) -> Value {
        let line = timeout(PROCESS_TIMEOUT, self.lines.next_line())
            .await
            .unwrap_or_else(|_| panic!("server.py printed nothing for {PROCESS_TIMEOUT:?}"))
            .expect("read server.py stdout");
        let Some(line) = line else {
            let status = self.child.try_wait();
            panic!("server.py closed its stdout (exit: {status:?})");
        };
        serde_json::from_str(&line)
            .unwrap_or_else(|e| panic!("server.py printed non-JSON {line:?}: {e}"))
    }
}

/// The values of `key` in one of client.py's metadata maps (`initial` or `trailing`).
fn meta<'a>(call: &'a Value, which: &str, key: impl AsRef<str>) -> Vec<&'a str> {
    call[which][key.as_ref()]
        .as_array()
        .map(|values| values.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default()
}

/// The `google.rpc.ErrorInfo` (domain, reason) of a failed call, decoded from the
/// `grpc-status-details-bin` trailer that grpcio handed client.py.
fn error_info(call: &Value) -> Option<(String, String)> {
    let hex = *meta(call, "trailing", GRPC_STATUS_DETAILS).first()?;
    let bytes = (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(hex.get(i..i + 2)?, 16).ok())
        .collect::<Option<Vec<u8>>>()?;
    let code = tonic::Code::from(call["code_value"].as_i64()? as i32);
    let status = Status::with_details(code, "", bytes.into());
    let info = status.get_details_error_info()?;
    Some((info.domain, info.reason))
}

/// The status code of every call.
fn codes(calls: &[Value]) -> Vec<&str> {
    calls
        .iter()
        .map(|c| c["code"].as_str().unwrap_or("?"))
        .collect()
}

/// Whether a reply says it was replayed, in its headers or (Trailers-Only) trailers.
fn replayed(call: &Value) -> bool {
    let mut values = meta(call, "initial", IDEMPOTENCY_REPLAYED);
    values.extend(meta(call, "trailing", IDEMPOTENCY_REPLAYED));
    values == ["true"]
}

// ---------------------------------------------------------------------------------------
// Rust side: a shop whose handler records what it saw
// ---------------------------------------------------------------------------------------

/// What the handler saw of one execution.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Seen {
    key: Option<String>,
    previous_rpc_attempts: Option<String>,
    encoding: Option<String>,
}

#[derive(Debug, Default)]
struct Journal {
    executions: Vec<Seen>,
    orders: Vec<Order>,
}

/// `shop.v1.Orders` that fails its first `fail_first` executions with UNAVAILABLE (as a
/// handler that found a dependency down would) and then creates orders.
#[derive(Debug, Clone, Default)]
struct Shop {
    fail_first: usize,
    journal: Arc<Mutex<Journal>>,
}

impl Journal {
    /// One field of every execution, in order.
    fn each<'a>(&'a self, field: impl Fn(&'a Seen) -> &'a Option<String>) -> Vec<Option<&'a str>> {
        self.executions
            .iter()
            .map(|s| field(s).as_deref())
            .collect()
    }
}

impl Shop {
    fn failing_first(fail_first: usize) -> Self {
        Shop {
            fail_first,
            ..Shop::default()
        }
    }

    fn journal(&self) -> MutexGuard<'_, Journal> {
        self.journal.lock().expect("journal lock")
    }
}

fn header(req: &Request<CreateOrderRequest>, name: impl AsRef<str>) -> Option<String> {
    req.metadata()
        .get(name.as_ref())
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
}

impl Shop {
    /// Records the attempt; fails the first `fail_first`, then creates the order.
    fn create(&self, req: Request<CreateOrderRequest>) -> Result<Response<Order>, Status> {
        let seen = Seen {
            key: header(&req, IDEMPOTENCY_KEY),
            previous_rpc_attempts: header(&req, PREVIOUS_RPC_ATTEMPTS),
            encoding: header(&req, "grpc-encoding"),
        };
        let mut journal = self.journal();
        journal.executions.push(seen);
        let n = journal.executions.len();
        if n <= self.fail_first {
            return Err(Status::unavailable(format!(
                "injected failure {n} of {}",
                self.fail_first
            )));
        }
        let r = req.into_inner();
        let order = Order {
            order_id: format!("ord-{}", journal.orders.len() + 1),
            customer_id: r.customer_id,
            sku: r.sku,
            quantity: r.quantity,
            created_by: "tonic".into(),
        };
        journal.orders.push(order.clone());
        Ok(Response::new(order))
    }

    fn server(&self) -> OrdersServer<impl Orders> {
        let shop = self.clone();
        create_only(move |req| std::future::ready(shop.create(req)))
    }
}

/// A tonic server on 127.0.0.1:0; stops when dropped.
struct RustServer {
    addr: std::net::SocketAddr,
    _stop: oneshot::Sender<()>,
}

/// Resolves when the [`RustServer`] handle is dropped.
type Stop = Pin<Box<dyn Future<Output = ()> + Send>>;

/// Binds 127.0.0.1:0 and spawns the server that `serve` makes from the listener and the
/// stop signal.
async fn spawn_server<F>(serve: impl FnOnce(TcpListenerStream, Stop) -> F) -> RustServer
where
    F: Future<Output = Result<(), tonic::transport::Error>> + Send + 'static,
{
    let (addr, incoming) = net::bind().await;
    let (stop, stopped) = oneshot::channel::<()>();
    let server = serve(
        incoming,
        Box::pin(async {
            let _ = stopped.await;
        }),
    );
    tokio::spawn(async move { server.await.expect("tonic server") });
    RustServer { addr, _stop: stop }
}

/// `shop` behind idem's server layer with a `MemoryStore`, configured by [`SERVICE_CONFIG`].
async fn serve_idem(shop: Shop) -> RustServer {
    let config = service_config();
    let store = MemoryStore::new(config.settings().memory_store.clone());
    spawn_server(|incoming, stop| {
        tonic::transport::Server::builder()
            .layer(IdempotencyLayer::new(store, &config))
            .add_service(shop.server().accept_compressed(CompressionEncoding::Gzip))
            .serve_with_incoming_shutdown(incoming, stop)
    })
    .await
}

/// A [`Shop`] failing its first `fail_first` executions, served by [`serve_idem`]; the
/// server (stops when dropped) and its address for client.py.
async fn idem_shop(fail_first: usize) -> (Shop, RustServer, String) {
    let shop = Shop::failing_first(fail_first);
    let server = serve_idem(shop.clone()).await;
    let addr = server.addr.to_string();
    (shop, server, addr)
}

/// `SERVICE_CONFIG` written to a file for client.py; removed when dropped.
struct ConfigFile(PathBuf);

impl ConfigFile {
    fn write(name: &str) -> Self {
        let path =
            std::env::temp_dir().join(format!("idem-interop-{}-{name}.json", std::process::id()));
        std::fs::write(&path, SERVICE_CONFIG).expect("write service config");
        ConfigFile(path)
    }

    fn path(&self) -> &str {
        self.0.to_str().expect("utf-8 temp path")
    }
}

impl Drop for ConfigFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

// ---------------------------------------------------------------------------------------
// Tests
// ---------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpcio_same_key_twice_runs_once_and_replays() {
    let Some(py) = python().await else { return };
    let (shop, _server, addr) = idem_shop(0).await;
    let key = "grpcio-twice-0001";

    let calls = py.calls(&addr, "twice", key, &["--quantity", "3"]).await;

    assert_eq!(codes(&calls), ["OK", "OK"], "{calls:?}");
    assert!(
        !replayed(&calls[0]),
        "the first call ran, it is no replay: {}",
        calls[0]
    );
    assert!(
        replayed(&calls[1]),
        "second reply lacks {IDEMPOTENCY_REPLAYED}: true: {}",
        calls[1]
    );
    assert_eq!(
        calls[0]["order"], calls[1]["order"],
        "the replay is the first reply"
    );
    assert_eq!(calls[1]["order"]["quantity"], 3);
    let journal = shop.journal();
    assert_eq!(journal.orders.len(), 1, "one order for one key");
    assert_eq!(
        journal.executions,
        [Seen {
            key: Some(key.into()),
            previous_rpc_attempts: None,
            encoding: None,
        }],
        "the handler ran once"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpcio_gzip_then_plain_same_request_is_a_replay() {
    let Some(py) = python().await else { return };
    let (shop, _server, addr) = idem_shop(0).await;
    // Compressible, and large enough that grpcio really compresses it.
    let note = "interop ".repeat(512);

    let calls = py
        .calls(
            &addr,
            "twice",
            "grpcio-gzip-0001",
            &["--compression", "first", "--note", &note],
        )
        .await;

    assert_eq!(
        codes(&calls),
        ["OK", "OK"],
        "the gzip call, then the plain call with the same request: {calls:?}"
    );
    assert!(
        replayed(&calls[1]),
        "the fingerprint is taken after decompression, so the plain call is a replay: {}",
        calls[1]
    );
    assert_eq!(calls[0]["order"], calls[1]["order"]);
    let journal = shop.journal();
    assert_eq!(journal.orders.len(), 1);
    let encodings = journal.each(|s| &s.encoding);
    assert_eq!(encodings, [Some("gzip")], "only the gzip call ran");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpcio_same_key_other_request_is_failed_precondition() {
    let Some(py) = python().await else { return };
    let (shop, _server, addr) = idem_shop(0).await;

    let calls = py.calls(&addr, "different", "grpcio-reuse-0001", &[]).await;

    assert_eq!(
        codes(&calls),
        ["OK", "FAILED_PRECONDITION"],
        "the first call, then the reused key: {calls:?}"
    );
    assert!(calls[1]["order"].is_null());
    assert_eq!(
        error_info(&calls[1]),
        Some((ERROR_DOMAIN.into(), reason::KEY_REUSED.into())),
        "grpcio receives idem's ErrorInfo intact: {}",
        calls[1]
    );
    assert_eq!(
        shop.journal().executions.len(),
        1,
        "the second request never ran"
    );
    assert_eq!(shop.journal().orders.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpcio_service_config_retries_run_once() {
    let Some(py) = python().await else { return };
    // The handler answers UNAVAILABLE twice; idem releases the record on UNAVAILABLE, so
    // grpcio's third attempt runs it again and succeeds.
    let (shop, _server, addr) = idem_shop(2).await;
    let config = ConfigFile::write("retries");
    let key = "grpcio-retry-0001";

    let calls = py
        .calls(&addr, "retry", key, &["--service-config", config.path()])
        .await;

    assert_eq!(calls.len(), 1, "{calls:?}");
    assert_eq!(
        calls[0]["code"], "OK",
        "grpcio retried to success: {}",
        calls[0]
    );
    assert!(!replayed(&calls[0]), "{}", calls[0]);
    {
        let journal = shop.journal();
        let keys = journal.each(|s| &s.key);
        assert_eq!(
            keys,
            [Some(key); 3],
            "grpcio sent three attempts, each with the key"
        );
        let previous = journal.each(|s| &s.previous_rpc_attempts);
        assert_eq!(
            previous,
            [None, Some("1"), Some("2")],
            "grpcio's attempt numbering"
        );
        assert_eq!(journal.orders.len(), 1, "exactly one successful execution");
    }

    // The application retrying the whole intent later (same key) gets the stored reply.
    let again = py
        .calls(&addr, "twice", key, &["--service-config", config.path()])
        .await;
    assert_eq!(again.len(), 2, "{again:?}");
    for call in &again {
        assert_eq!(call["code"], "OK", "{call}");
        assert!(
            replayed(call),
            "a later call with the key is a replay: {call}"
        );
        assert_eq!(call["order"], calls[0]["order"]);
    }
    assert_eq!(shop.journal().executions.len(), 3, "replays run nothing");
    assert_eq!(shop.journal().orders.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idem_client_retries_grpcio_server_with_one_key() {
    let Some(py) = python().await else { return };
    let mut server = py.server(&["--fail-first", "2"]).await;
    let layer = RetryLayer::from_config(&service_config());
    let channel = tower::ServiceBuilder::new()
        .layer(layer.clone())
        .service(net::channel(server.addr()));
    let mut client = OrdersClient::new(channel);

    let request = CreateOrderRequest {
        customer_id: "c-7".into(),
        sku: "sku-7".into(),
        quantity: 7,
        note: String::new(),
    };
    let reply = timeout(PROCESS_TIMEOUT, client.create_order(request))
        .await
        .expect("the call ends within the bound")
        .expect("OK once grpcio stops failing");

    let order = reply.get_ref();
    assert_eq!(
        (order.created_by.as_str(), order.quantity),
        ("grpcio", 7),
        "{order:?}"
    );
    let report = CallReport::from_response(&reply).expect("the retry layer reports the call");
    assert_eq!(report.attempts, 3, "{report:?}");
    let stats = layer.stats().snapshot();
    assert_eq!(
        (stats.calls, stats.attempts, stats.retries),
        (1, 3, 2),
        "{stats:?}"
    );

    let mut attempts = Vec::new();
    for _ in 0..3 {
        let event = server.next_event().await;
        assert_eq!(event["event"], "attempt", "{event}");
        attempts.push(event);
    }
    let outcomes: Vec<_> = attempts.iter().map(|a| a["outcome"].as_str()).collect();
    assert_eq!(
        outcomes,
        [Some("UNAVAILABLE"), Some("UNAVAILABLE"), Some("OK")]
    );
    let key = attempts[0]["key"]
        .as_str()
        .unwrap_or_else(|| panic!("the first attempt carried one key: {}", attempts[0]));
    IdempotencyKey::parse(key.as_bytes()).expect("the generated key follows the key rule");
    for attempt in &attempts {
        assert_eq!(
            attempt["key"], key,
            "every attempt carries the same key: {attempt}"
        );
    }
    let previous: Vec<_> = attempts
        .iter()
        .map(|a| a["previous_rpc_attempts"].as_str())
        .collect();
    assert!(
        previous == [None, Some("1"), Some("2")] || previous == [Some("0"), Some("1"), Some("2")],
        "{PREVIOUS_RPC_ATTEMPTS} per attempt: {previous:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpcio_without_key_is_invalid_argument() {
    let Some(py) = python().await else { return };
    let (shop, _server, addr) = idem_shop(0).await;

    let calls = py.client(&["--addr", &addr, "--mode", "twice"]).await;

    assert_eq!(calls.len(), 2, "{calls:?}");
    for call in &calls {
        assert_eq!(call["code"], "INVALID_ARGUMENT", "{call}");
        assert_eq!(
            error_info(call),
            Some((ERROR_DOMAIN.into(), reason::KEY_MISSING.into())),
            "{call}"
        );
    }
    assert!(
        shop.journal().executions.is_empty(),
        "the handler never ran"
    );
}

/// `shop.v1.Orders` that passes every CreateOrder to a downstream `Orders` through idem's
/// `RetryLayer`, and returns the downstream failure upstream with `?`.
#[derive(Debug, Clone)]
struct Relay {
    downstream: OrdersClient<Retry<Channel>>,
    executions: Arc<AtomicUsize>,
}

impl Relay {
    fn server(&self) -> OrdersServer<impl Orders> {
        let relay = self.clone();
        create_only(move |req: Request<CreateOrderRequest>| {
            let relay = relay.clone();
            async move {
                relay.executions.fetch_add(1, Ordering::SeqCst);
                let mut downstream = relay.downstream.clone();
                let order = downstream.create_order(req.into_inner()).await?;
                Ok(Response::new(order.into_inner()))
            }
        })
    }
}

/// The retry policy of the relays' `RetryLayer`s (3 attempts, millisecond backoffs) and
/// the `idempotency` object that makes them send keys.
const HOP_CONFIG: &str = r#"{
  "methodConfig": [{
    "name": [{"service": "shop.v1.Orders"}],
    "retryPolicy": {
      "maxAttempts": 3,
      "initialBackoff": "0.001s",
      "maxBackoff": "0.005s",
      "backoffMultiplier": 2,
      "retryableStatusCodes": ["UNAVAILABLE"]
    },
    "idempotency": {}
  }]
}"#;

/// What one run through the chain did.
#[derive(Debug)]
struct ChainRun {
    /// grpcio's view of the call (client.py's JSON line).
    call: Value,
    /// Handler executions at A, B and C.
    relay_runs: [usize; 3],
    /// Attempts that reached D.
    bottom_attempts: usize,
}

/// grpcio (retry policy: 4 attempts on UNAVAILABLE, from [`SERVICE_CONFIG`]) → A → B → C
/// → D. A, B and C are tonic servers with idem's `InboundLayer` and `IdempotencyLayer`
/// whose handler passes the call down through a `RetryLayer` (3 attempts); D always
/// answers UNAVAILABLE.
async fn grpcio_over_chain(py: &Python, pushback_on_exhausted: bool) -> ChainRun {
    let bottom = Shop::failing_first(usize::MAX);
    let d = spawn_server(|incoming, stop| {
        tonic::transport::Server::builder()
            .add_service(bottom.server())
            .serve_with_incoming_shutdown(incoming, stop)
    })
    .await;
    let hop_config = ServiceConfig::from_json(HOP_CONFIG).expect("HOP_CONFIG is valid");
    let config = service_config();

    // Built from the bottom up: C, then B, then A.
    let mut next = d;
    let mut servers = Vec::new();
    let mut relays = Vec::new();
    for _ in 0..3 {
        let relay = Relay {
            downstream: OrdersClient::new(
                tower::ServiceBuilder::new()
                    .layer(RetryLayer::from_config(&hop_config))
                    .service(net::channel(next.addr)),
            ),
            executions: Arc::default(),
        };
        let store = MemoryStore::new(config.settings().memory_store.clone());
        let server = spawn_server(|incoming, stop| {
            tonic::transport::Server::builder()
                .layer(InboundLayer::new().pushback_on_exhausted(pushback_on_exhausted))
                .layer(IdempotencyLayer::new(store, &config))
                .add_service(relay.server())
                .serve_with_incoming_shutdown(incoming, stop)
        })
        .await;
        servers.push(std::mem::replace(&mut next, server));
        relays.push(relay);
    }
    let a = next;

    let file = ConfigFile::write(if pushback_on_exhausted {
        "chain-on"
    } else {
        "chain-off"
    });
    let addr = a.addr.to_string();
    let calls = py
        .calls(
            &addr,
            "retry",
            "grpcio-chain-0001",
            &["--service-config", file.path()],
        )
        .await;
    assert_eq!(calls.len(), 1, "{calls:?}");
    let runs = |hop: &Relay| hop.executions.load(Ordering::SeqCst);
    ChainRun {
        call: calls[0].clone(),
        relay_runs: [runs(&relays[2]), runs(&relays[1]), runs(&relays[0])],
        bottom_attempts: bottom.journal().executions.len(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpcio_does_not_retry_an_exhausted_downstream_failure() {
    let Some(py) = python().await else { return };

    // Marker on: grpcio honours grpc-retry-pushback-ms: -1 and does not retry, nor do A
    // or B. Marker off: every layer retries what the one below already retried.
    let cases = [
        (
            true,
            &["-1"][..],
            [1, 1, 1],
            3,
            "retries happen at one layer only",
        ),
        (
            false,
            &[][..],
            [4, 12, 36],
            108,
            "4, 4 × 3, 4 × 3 × 3 runs; 4 × 3 × 3 × 3 at D",
        ),
    ];
    for (marker, pushback, relay_runs, bottom_attempts, why) in cases {
        let run = grpcio_over_chain(&py, marker).await;
        let call = &run.call;
        let case = format!("marker {marker}: {why}: {run:?}");
        assert_eq!(call["code"], "UNAVAILABLE", "{case}");
        assert_eq!(
            meta(call, "trailing", RETRY_PUSHBACK_MS),
            pushback,
            "{case}"
        );
        assert_eq!(run.relay_runs, relay_runs, "runs at A, B, C: {case}");
        assert_eq!(
            run.bottom_attempts, bottom_attempts,
            "attempts at D: {case}"
        );
        for local in [RETRY_OUTCOME, RETRY_ATTEMPTS] {
            assert!(
                meta(call, "trailing", &local).is_empty(),
                "{local} leaked: {case}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idem_client_honours_grpcio_server_pushback_stop() {
    let Some(py) = python().await else { return };
    let mut server = py
        .server(&["--fail-first", "2", "--pushback-ms", "-1"])
        .await;
    let layer = RetryLayer::from_config(&service_config());
    let channel = tower::ServiceBuilder::new()
        .layer(layer.clone())
        .service(net::channel(server.addr()));
    let mut client = OrdersClient::new(channel);

    let status = timeout(
        PROCESS_TIMEOUT,
        client.create_order(CreateOrderRequest::default()),
    )
    .await
    .expect("the call ends within the bound")
    .expect_err("UNAVAILABLE, not retried");

    assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
    let report = CallReport::from_status(&status).expect("the retry layer reports the call");
    assert_eq!(
        (report.outcome, report.attempts),
        (CallOutcome::PushbackStop, 1),
        "grpc-retry-pushback-ms: -1 from grpcio stops the retries"
    );
    assert_eq!(layer.stats().snapshot().attempts, 1);
    let event = server.next_event().await;
    assert_eq!(
        (event["event"].as_str(), event["n"].as_u64()),
        (Some("attempt"), Some(1)),
        "{event}"
    );
}
