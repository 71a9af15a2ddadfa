//! The demo with real crashes: each server instance is a separate OS process, killed with
//! SIGKILL every N intents and started again on the same port, while the workload runs.
//!
//! Orders survive the crash of the process that created it: with the memory and Redis
//! stores they are appended to a ledger file (one `write` per order); with the
//! PostgreSQL store they are rows of a table, written in the same transaction as the
//! record's completion ([`crate::pg_orders`]). They are counted at the end. What a crash
//! costs depends on where the records live: a process's memory store dies with it;
//! Redis keeps them, but a process killed after the handler ran and before the outcome
//! was recorded leaves the record in flight until its lease ends, and the retry then
//! runs the handler again; PostgreSQL commits the order and the record together.
//!
//! An instance process is started through a [`Launch`]: the demo binary with
//! [`SERVE_FLAG`] and the arguments of [`ServeArgs::to_args`], or a test binary running
//! one test that calls [`serve_from_env`]. A [`PausePoint`] makes an instance stop
//! inside its first `CreateOrder` and say so on standard output, so a test can kill it
//! exactly there.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use idem_client::retry::{Retry, RetryLayer};
use idem_core::config::ServiceConfig;
use idem_postgres::PostgresStore;
use idem_server::idempotency::tenant::SingleTenant;
use idem_server::inbound::InboundLayer;
use idem_store::memory::MemoryStore;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::io::{AsyncBufReadExt, BufReader, Lines};
use tokio::process::{Child, ChildStdout, Command};
use tonic::transport::{Channel, Server};
use tonic::{Request, Response};
use tower::ServiceBuilder;

use crate::demo::{Faults, Ledger, Options, OrdersImpl, RunReport};
use crate::demo_metrics::{DemoMetrics, InstanceMetrics, merge, scrape};
use crate::net::free_port;
use crate::pg_orders::{self, PgOrders};
use crate::shop::orders_client::OrdersClient;
use crate::shop::orders_server::{Orders, OrdersServer};

type Error = Box<dyn std::error::Error + Send + Sync>;

/// The first argument that makes the demo binary serve one instance.
pub const SERVE_FLAG: &str = "--serve-instance";

/// The environment variable that carries a test binary's instance arguments (see
/// [`serve_from_env`]).
pub const SERVE_ENV: &str = "IDEM_SERVE_INSTANCE";

/// Where the instances keep their idempotency records.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreKind {
    /// Each process its own memory store (lost when the process dies).
    Memory,
    /// Redis at this URL, shared by every process (a Redis Cluster when it is a
    /// comma-separated list of seed nodes, see `redis::connect_store`).
    Redis(String),
    /// PostgreSQL at this URL, shared by every process; orders are rows of the same
    /// database, written in the transaction that completes the record.
    Postgres(String),
}

impl StoreKind {
    /// `memory`, `redis` or `postgres`.
    pub fn name(&self) -> &'static str {
        match self {
            StoreKind::Memory => "memory",
            StoreKind::Redis(_) => "redis",
            StoreKind::Postgres(_) => "postgres",
        }
    }

    fn url(&self) -> &str {
        match self {
            StoreKind::Memory => "",
            StoreKind::Redis(u) | StoreKind::Postgres(u) => u,
        }
    }
}

/// Where an instance stops (forever, until it is killed) in its first `CreateOrder`,
/// after printing `paused <name>`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PausePoint {
    /// Before the order is written.
    BeforeWrite,
    /// The order is written in the transaction, not committed (PostgreSQL only).
    InTransaction,
    /// The order (and, with PostgreSQL, the reply) is committed; nothing answered yet.
    AfterCommit,
    /// The downstream call of a chained instance answered; nothing answered upstream.
    AfterDownstream,
}

impl PausePoint {
    /// The name used on the command line and in the `paused` line.
    pub fn name(self) -> &'static str {
        match self {
            PausePoint::BeforeWrite => "before-write",
            PausePoint::InTransaction => "in-transaction",
            PausePoint::AfterCommit => "after-commit",
            PausePoint::AfterDownstream => "after-downstream",
        }
    }

    fn parse(s: &str) -> Option<PausePoint> {
        [
            PausePoint::BeforeWrite,
            PausePoint::InTransaction,
            PausePoint::AfterCommit,
            PausePoint::AfterDownstream,
        ]
        .into_iter()
        .find(|p| p.name() == s)
    }
}

/// An instance's pause: fires once, at its point.
#[derive(Debug, Default)]
pub struct Pause {
    at: Option<PausePoint>,
    fired: AtomicBool,
}

impl Pause {
    /// A pause at `at` (none: never).
    pub fn new(at: Option<PausePoint>) -> Self {
        Pause {
            at,
            fired: AtomicBool::new(false),
        }
    }

    /// At `point`: the first time, say so on standard output and never return.
    pub async fn at(&self, point: PausePoint) {
        if self.at == Some(point) && !self.fired.swap(true, Ordering::SeqCst) {
            {
                use std::io::Write;
                let mut out = std::io::stdout().lock();
                let _ = writeln!(out, "paused {}", point.name());
                let _ = out.flush();
            }
            std::future::pending::<()>().await;
        }
    }
}

/// What one instance process is told.
#[derive(Debug, Clone)]
pub struct ServeArgs {
    /// Instance number (names the orders it creates).
    pub instance: usize,
    /// Loopback port to serve on.
    pub port: u16,
    /// Whether the idempotency layer is on.
    pub with_idem: bool,
    /// Where the records live.
    pub store: StoreKind,
    /// The service-config file.
    pub config: PathBuf,
    /// The ledger file orders are appended to (memory and Redis stores).
    pub ledger: PathBuf,
    /// Seed of the fault injector.
    pub seed: u64,
    /// Probability of UNAVAILABLE before the handler.
    pub unavailable: f64,
    /// Probability of losing the response after the handler ran.
    pub drop: f64,
    /// Latency added before the handler, in milliseconds.
    pub latency_ms: u64,
    /// Where to stop in the first `CreateOrder`.
    pub pause_at: Option<PausePoint>,
    /// Serve as the first hop of a chain: each `CreateOrder` calls this port's
    /// `CreateOrder` (through a `RetryLayer` with the same config) and answers with its
    /// order, writing nothing itself.
    pub downstream: Option<u16>,
    /// Serve the idempotency layer's metrics (Prometheus text) on 127.0.0.1 at this port.
    pub metrics_port: Option<u16>,
}

impl ServeArgs {
    /// An instance with no faults, no pause and no downstream.
    pub fn new(
        instance: usize,
        port: u16,
        store: StoreKind,
        config: PathBuf,
        ledger: PathBuf,
    ) -> Self {
        ServeArgs {
            instance,
            port,
            with_idem: true,
            store,
            config,
            ledger,
            seed: 0,
            unavailable: 0.0,
            drop: 0.0,
            latency_ms: 0,
            pause_at: None,
            downstream: None,
            metrics_port: None,
        }
    }

    /// The command line that [`ServeArgs::parse`] reads back (after [`SERVE_FLAG`]):
    /// `name=value` pairs.
    pub fn to_args(&self) -> Vec<String> {
        let mut args = vec![
            format!("instance={}", self.instance),
            format!("port={}", self.port),
            format!("with_idem={}", self.with_idem),
            format!("store={}", self.store.name()),
            format!("url={}", self.store.url()),
            format!("config={}", self.config.display()),
            format!("ledger={}", self.ledger.display()),
            format!("seed={}", self.seed),
            format!("unavailable={}", self.unavailable),
            format!("drop={}", self.drop),
            format!("latency_ms={}", self.latency_ms),
        ];
        if let Some(p) = self.pause_at {
            args.push(format!("pause_at={}", p.name()));
        }
        if let Some(port) = self.downstream {
            args.push(format!("downstream={port}"));
        }
        if let Some(port) = self.metrics_port {
            args.push(format!("metrics_port={port}"));
        }
        args
    }

    /// Reads the arguments written by [`ServeArgs::to_args`].
    pub fn parse(args: &[String]) -> Result<ServeArgs, String> {
        let mut a = ServeArgs::new(0, 0, StoreKind::Memory, PathBuf::new(), PathBuf::new());
        let (mut store, mut url) = (String::from("memory"), String::new());
        let mut port = None;
        for arg in args {
            let (k, v) = arg
                .split_once('=')
                .ok_or_else(|| format!("{SERVE_FLAG}: {arg}: expected name=value"))?;
            let bad = || format!("{SERVE_FLAG}: bad {k}: {v}");
            match k {
                "instance" => a.instance = v.parse().map_err(|_| bad())?,
                "port" => port = Some(v.parse().map_err(|_| bad())?),
                "with_idem" => a.with_idem = v.parse().map_err(|_| bad())?,
                "store" => store = v.to_owned(),
                "url" => url = v.to_owned(),
                "config" => a.config = v.into(),
                "ledger" => a.ledger = v.into(),
                "seed" => a.seed = v.parse().map_err(|_| bad())?,
                "unavailable" => a.unavailable = v.parse().map_err(|_| bad())?,
                "drop" => a.drop = v.parse().map_err(|_| bad())?,
                "latency_ms" => a.latency_ms = v.parse().map_err(|_| bad())?,
                "pause_at" => a.pause_at = Some(PausePoint::parse(v).ok_or_else(bad)?),
                "downstream" => a.downstream = Some(v.parse().map_err(|_| bad())?),
                "metrics_port" => a.metrics_port = Some(v.parse().map_err(|_| bad())?),
                _ => return Err(format!("{SERVE_FLAG}: unknown argument {k}")),
            }
        }
        a.port = port.ok_or_else(|| format!("{SERVE_FLAG}: port missing"))?;
        a.store = match store.as_str() {
            "memory" => StoreKind::Memory,
            "redis" => StoreKind::Redis(url),
            "postgres" => StoreKind::Postgres(url),
            _ => return Err(format!("{SERVE_FLAG}: bad store: {store}")),
        };
        Ok(a)
    }
}

/// In a test binary started by [`Launch::Test`]: serves the instance its environment
/// describes until the process is killed. Returns at once (doing nothing) when the
/// variable is not set, so the test that calls it passes in a normal run.
pub fn serve_from_env() {
    let Ok(text) = std::env::var(SERVE_ENV) else {
        return;
    };
    let args: Vec<String> = text.split('\n').map(str::to_owned).collect();
    let args = ServeArgs::parse(&args).expect("instance arguments");
    let runtime = tokio::runtime::Runtime::new().expect("a tokio runtime");
    if let Err(e) = runtime.block_on(serve(args)) {
        eprintln!("instance: {e}");
        std::process::exit(2);
    }
}

/// Connection pool size of an instance's PostgreSQL store: handlers hold one for their
/// transaction, so it bounds the handlers that can write at once.
const PG_POOL: u32 = 24;

/// Serves one instance until the process is killed; prints `ready` on standard output
/// once it listens.
pub async fn serve(args: ServeArgs) -> Result<(), Error> {
    let config = ServiceConfig::from_file(&args.config)?;
    let pause = Arc::new(Pause::new(args.pause_at));
    let name = format!("instance-{}", args.instance);
    if let Some(port) = args.downstream {
        let svc = Chained {
            next: OrdersClient::new(
                ServiceBuilder::new()
                    .layer(RetryLayer::from_config(&config))
                    .service(crate::net::channel(SocketAddr::from((
                        [127, 0, 0, 1],
                        port,
                    )))),
            ),
            pause,
        };
        return serve_service(&args, &config, svc, None).await;
    }
    if let StoreKind::Postgres(url) = &args.store {
        let store = PostgresStore::builder(url.clone())
            .max_connections(PG_POOL)
            .connect()
            .await?;
        let svc = PgOrders::new(
            store.pool().clone(),
            args.with_idem.then(|| store.clone()),
            name,
            pause,
        );
        return serve_service(&args, &config, svc, Some(store)).await;
    }
    let ledger = Arc::new(Ledger::append_to(&args.ledger)?);
    serve_service(&args, &config, OrdersImpl::new(ledger, name), None).await
}

/// Serves `svc` behind the fault injector, `InboundLayer` and (with idem) the
/// idempotency layer on the instance's store.
async fn serve_service<T: Orders>(
    args: &ServeArgs,
    config: &ServiceConfig,
    svc: T,
    postgres: Option<PostgresStore>,
) -> Result<(), Error> {
    let o = Options {
        unavailable: args.unavailable,
        drop: args.drop,
        latency: Duration::from_millis(args.latency_ms),
        ..Options::default()
    };
    let faults = Faults::new(&o, args.seed);
    let listener = bind_with_retries(SocketAddr::from(([127, 0, 0, 1], args.port))).await?;
    let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
    let svc = OrdersServer::new(svc);
    println!("ready");
    let mut router = Server::builder().layer(faults).layer(InboundLayer::new());
    if !args.with_idem {
        router
            .add_service(svc)
            .serve_with_incoming(incoming)
            .await?;
        return Ok(());
    }
    let metrics = InstanceMetrics::new(config);
    if let Some(port) = args.metrics_port {
        metrics.serve(port).await?;
    }
    let tenant = SingleTenant::new("demo");
    match (&args.store, postgres) {
        (_, Some(store)) => {
            let layer = metrics.server(store, "postgres", config).tenant(tenant);
            router
                .layer(layer)
                .add_service(svc)
                .serve_with_incoming(incoming)
                .await?;
        }
        (StoreKind::Redis(url), None) => {
            let store = crate::redis::connect_store(url).await?;
            let layer = metrics.server(store, "redis", config).tenant(tenant);
            router
                .layer(layer)
                .add_service(svc)
                .serve_with_incoming(incoming)
                .await?;
        }
        _ => {
            let store = MemoryStore::new(config.settings().memory_store.clone());
            let layer = metrics.server(store, "memory", config).tenant(tenant);
            router
                .layer(layer)
                .add_service(svc)
                .serve_with_incoming(incoming)
                .await?;
        }
    }
    Ok(())
}

/// The first hop of a chain: forwards `CreateOrder` downstream (its key derived from
/// this call's record), then answers with the downstream's order.
struct Chained {
    next: OrdersClient<Retry<Channel>>,
    pause: Arc<Pause>,
}

crate::create_only_orders! {
    Chained, why = "the demo only creates orders";
    create_order(&self, request) {
        let order = self
            .next
            .clone()
            .create_order(Request::new(request.into_inner()))
            .await?
            .into_inner();
        self.pause.at(PausePoint::AfterDownstream).await;
        Ok(Response::new(order))
    }
}

async fn bind_with_retries(addr: SocketAddr) -> Result<tokio::net::TcpListener, Error> {
    let mut tries = 0;
    loop {
        match tokio::net::TcpListener::bind(addr).await {
            Ok(l) => return Ok(l),
            Err(_) if tries < 300 => {
                tries += 1;
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            Err(e) => return Err(format!("cannot bind {addr}: {e}").into()),
        }
    }
}

/// How an instance process is started.
#[derive(Debug, Clone)]
pub enum Launch {
    /// `exe --serve-instance ARGS…` (the demo binary).
    Binary(PathBuf),
    /// `exe TEST --exact --nocapture` with the arguments in [`SERVE_ENV`]: a test binary
    /// whose test `TEST` calls [`serve_from_env`].
    Test {
        /// The test binary (`std::env::current_exe()` in a test).
        exe: PathBuf,
        /// The test that serves.
        test: String,
    },
}

impl Launch {
    fn command(&self, args: &ServeArgs) -> Command {
        match self {
            Launch::Binary(exe) => {
                let mut c = Command::new(exe);
                c.arg(SERVE_FLAG).args(args.to_args());
                c
            }
            Launch::Test { exe, test } => {
                let mut c = Command::new(exe);
                c.args([test.as_str(), "--exact", "--nocapture", "--test-threads=1"])
                    .env(SERVE_ENV, args.to_args().join("\n"));
                c
            }
        }
    }
}

/// A running instance process.
pub struct Instance {
    args: ServeArgs,
    child: Child,
    stdout: Lines<BufReader<ChildStdout>>,
}

impl Instance {
    /// Starts the process and waits (up to 30 s) for its `ready` line.
    pub async fn start(launch: &Launch, args: ServeArgs) -> Result<Instance, Error> {
        let mut child = launch
            .command(&args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()?;
        let stdout = child.stdout.take().ok_or("instance stdout")?;
        let mut instance = Instance {
            args,
            child,
            stdout: BufReader::new(stdout).lines(),
        };
        instance.wait_for("ready", Duration::from_secs(30)).await?;
        Ok(instance)
    }

    /// Waits for a line ending with `line` on the process's standard output (others are
    /// skipped). Ending with: a test binary's harness writes `test NAME ... ` first,
    /// without a newline.
    pub async fn wait_for(&mut self, line: &str, timeout: Duration) -> Result<(), Error> {
        let read = async {
            while let Some(l) = self.stdout.next_line().await? {
                if l.ends_with(line) {
                    return Ok(());
                }
            }
            Err::<(), Error>("the instance's output ended".into())
        };
        match tokio::time::timeout(timeout, read).await {
            Ok(r) => r.map_err(|e| {
                format!("instance {}: waiting for {line:?}: {e}", self.args.instance).into()
            }),
            Err(_) => Err(format!(
                "instance {}: no {line:?} within {timeout:?}",
                self.args.instance
            )
            .into()),
        }
    }

    /// The arguments it was started with.
    pub fn args(&self) -> &ServeArgs {
        &self.args
    }

    /// SIGKILL, then wait for the process to be gone.
    pub async fn kill(&mut self) -> Result<(), Error> {
        self.child.start_kill()?;
        self.child.wait().await?;
        Ok(())
    }
}

/// The files one run's instances share: the config they read and the ledger they append
/// to, in a directory of their own.
struct RunFiles {
    dir: PathBuf,
    config: PathBuf,
    ledger: PathBuf,
}

impl RunFiles {
    fn new(with_idem: bool, config_text: &str) -> Result<Self, Error> {
        static RUNS: AtomicU64 = AtomicU64::new(0);
        let dir = std::env::temp_dir().join(format!(
            "idem-demo-{}-{}-{}",
            std::process::id(),
            RUNS.fetch_add(1, Ordering::Relaxed),
            if with_idem { "idem" } else { "plain" }
        ));
        std::fs::create_dir_all(&dir)?;
        let config = dir.join("service_config.json");
        std::fs::write(&config, config_text)?;
        let ledger = dir.join("ledger");
        let _ = std::fs::remove_file(&ledger);
        std::fs::write(&ledger, "")?;
        Ok(RunFiles {
            dir,
            config,
            ledger,
        })
    }
}

/// Starts `o.instances` processes, each on a free port (and a metrics port when
/// `metrics`).
async fn start_instances(
    o: &Options,
    with_idem: bool,
    metrics: bool,
    store: &StoreKind,
    files: &RunFiles,
    launch: &Launch,
) -> Result<Vec<Instance>, Error> {
    let mut instances = Vec::new();
    for i in 0..o.instances {
        let args = ServeArgs {
            with_idem,
            metrics_port: metrics.then(free_port),
            seed: o.seed.wrapping_add(i as u64),
            unavailable: o.unavailable,
            drop: o.drop,
            latency_ms: o.latency.as_millis() as u64,
            ..ServeArgs::new(
                i,
                free_port(),
                store.clone(),
                files.config.clone(),
                files.ledger.clone(),
            )
        };
        instances.push(Instance::start(launch, args).await?);
    }
    Ok(instances)
}

/// The metrics of the instances still running, scraped once their last calls' metrics
/// have landed (a lost scrape is reported, not fatal).
async fn scrape_survivors(instances: &[Instance]) -> Vec<String> {
    // Server metrics of a call are recorded just after its response: let them land.
    tokio::time::sleep(Duration::from_millis(50)).await;
    let mut last = Vec::new();
    for i in instances {
        if let Some(port) = i.args.metrics_port {
            match scrape(port).await {
                Ok(text) => last.push(text),
                Err(e) => eprintln!("metrics of instance {} lost: {e}", i.args.instance),
            }
        }
    }
    last
}

/// One run with instance processes that are killed with SIGKILL each time `crash_every`
/// more intents are done (the victim taken in turn, killed after a random pause of up to
/// 3 ms so it dies at a random point of its work), and started again on the same port.
pub async fn run_with_crashes(
    o: &Options,
    crash_every: usize,
    with_idem: bool,
    config: &ServiceConfig,
    config_text: &str,
    store: &StoreKind,
    launch: &Launch,
) -> Result<RunReport, Error> {
    let label = if with_idem {
        "with idem"
    } else {
        "without idem"
    };
    let files = RunFiles::new(with_idem, config_text)?;
    let orders_db = match store {
        StoreKind::Postgres(url) => {
            let pool = sqlx::postgres::PgPoolOptions::new()
                .max_connections(1)
                .connect(url)
                .await?;
            pg_orders::reset_table(&pool).await?;
            Some(pool)
        }
        _ => None,
    };

    // `--metrics-out`, for the run with idem: the client side here, each instance's
    // server side scraped before its SIGKILL and at the end.
    let metrics = o
        .metrics_out
        .as_ref()
        .filter(|_| with_idem)
        .map(|_| DemoMetrics::new(config));
    let instances = start_instances(o, with_idem, metrics.is_some(), store, &files, launch).await?;
    let addrs: Vec<SocketAddr> = instances
        .iter()
        .map(|i| SocketAddr::from(([127, 0, 0, 1], i.args.port)))
        .collect();
    let retry = crate::demo::retry_layer(config, with_idem, metrics.as_ref());
    let stats = retry.stats();
    let client = OrdersClient::new(ServiceBuilder::new().layer(retry).service(
        crate::demo::client_channel(&addrs, Duration::from_millis(500)),
    ));

    let done = Arc::new(AtomicU64::new(0));
    let crashes = Arc::new(AtomicU64::new(0));
    let killer = tokio::spawn(crash_loop(
        instances,
        done.clone(),
        crashes.clone(),
        crash_every,
        o.intents,
        o.seed,
        launch.clone(),
    ));
    let w = crate::demo::workload(o, with_idem, label, &client, done).await?;
    let (mut instances, dead) = killer.await??;
    let last = match metrics {
        Some(_) => scrape_survivors(&instances).await,
        None => Vec::new(),
    };
    for i in &mut instances {
        i.kill().await?;
    }
    if let (Some(m), Some(path)) = (&metrics, &o.metrics_out) {
        let servers = merge(&dead, &last);
        let (m, path, n) = (m.clone(), path.clone(), dead.len() + last.len());
        tokio::task::spawn_blocking(move || m.write_with_servers(&path, &servers, n)).await??;
    }
    let by_intent = match &orders_db {
        Some(pool) => pg_orders::orders_by_intent(pool).await?,
        None => Ledger::read_file(&files.ledger)?,
    };
    let _ = std::fs::remove_dir_all(&files.dir);
    let mut report = crate::demo::tally(o, label, &by_intent, w);
    report.attempts = stats.snapshot().attempts;
    report.crashes = crashes.load(Ordering::Relaxed);
    Ok(report)
}

async fn crash_loop(
    mut instances: Vec<Instance>,
    done: Arc<AtomicU64>,
    crashes: Arc<AtomicU64>,
    every: usize,
    total: usize,
    seed: u64,
    launch: Launch,
) -> Result<(Vec<Instance>, Vec<String>), Error> {
    let mut rng = StdRng::seed_from_u64(seed ^ 0xc0ffee);
    // The expositions of killed instances, each scraped just before its SIGKILL.
    let mut dead = Vec::new();
    let mut next = every as u64;
    let mut victim = 0;
    while next < total as u64 {
        while done.load(Ordering::Relaxed) < next {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        tokio::time::sleep(Duration::from_micros(rng.random_range(0..3000))).await;
        let instance = &mut instances[victim];
        if let Some(port) = instance.args.metrics_port {
            match scrape(port).await {
                Ok(text) => dead.push(text),
                Err(e) => eprintln!("metrics of instance {victim} lost: {e}"),
            }
        }
        instance.kill().await?;
        crashes.fetch_add(1, Ordering::Relaxed);
        let args = instance.args.clone();
        instances[victim] = Instance::start(&launch, args).await?;
        victim = (victim + 1) % instances.len();
        next += every as u64;
    }
    Ok((instances, dead))
}
