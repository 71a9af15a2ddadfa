//! The demo with real crashes: each server instance is a separate OS process, killed with
//! SIGKILL every N intents and started again on the same port, while the workload runs.
//!
//! Orders are appended to a ledger file by the server processes (one `write` per order),
//! so an order survives the crash of the process that created it and is counted from the
//! file at the end. What a crash costs depends on where the records live: a process's
//! memory store dies with it; Redis keeps them, but a process killed after the handler
//! ran and before the outcome was recorded leaves the record in flight until its lease
//! ends, and the retry then runs the handler again.
//!
//! The demo binary serves an instance when started with [`SERVE_FLAG`] and the
//! arguments of [`ServeArgs::to_args`]; [`run_with_crashes`] starts it that way.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use idem_client::RetryLayer;
use idem_core::ServiceConfig;
use idem_server::idempotency::tenant::SingleTenant;
use idem_server::{IdempotencyLayer, InboundLayer};
use idem_store::MemoryStore;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tonic::transport::Server;
use tower::ServiceBuilder;

use crate::demo::{Faults, Ledger, Options, OrdersImpl, RunReport, strip_idempotency};
use crate::shop::orders_client::OrdersClient;
use crate::shop::orders_server::OrdersServer;

type Error = Box<dyn std::error::Error + Send + Sync>;

/// The first argument that makes the demo binary serve one instance.
pub const SERVE_FLAG: &str = "--serve-instance";

/// Where the instances keep their idempotency records.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreKind {
    /// Each process its own memory store (lost when the process dies).
    Memory,
    /// Redis at this URL, shared by every process.
    Redis(String),
}

impl StoreKind {
    /// `memory` or `redis`.
    pub fn name(&self) -> &'static str {
        match self {
            StoreKind::Memory => "memory",
            StoreKind::Redis(_) => "redis",
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
    /// The ledger file orders are appended to.
    pub ledger: PathBuf,
    /// Seed of the fault injector.
    pub seed: u64,
    /// Probability of UNAVAILABLE before the handler.
    pub unavailable: f64,
    /// Probability of losing the response after the handler ran.
    pub drop: f64,
    /// Latency added before the handler, in milliseconds.
    pub latency_ms: u64,
}

impl ServeArgs {
    /// The command line that [`ServeArgs::parse`] reads back (after [`SERVE_FLAG`]).
    pub fn to_args(&self) -> Vec<String> {
        let redis = match &self.store {
            StoreKind::Memory => String::new(),
            StoreKind::Redis(url) => url.clone(),
        };
        [
            self.instance.to_string(),
            self.port.to_string(),
            self.with_idem.to_string(),
            self.store.name().to_owned(),
            redis,
            self.config.display().to_string(),
            self.ledger.display().to_string(),
            self.seed.to_string(),
            self.unavailable.to_string(),
            self.drop.to_string(),
            self.latency_ms.to_string(),
        ]
        .into()
    }

    /// Reads the arguments written by [`ServeArgs::to_args`].
    pub fn parse(args: &[String]) -> Result<ServeArgs, String> {
        let [
            instance,
            port,
            with_idem,
            store,
            redis,
            config,
            ledger,
            seed,
            unavailable,
            drop,
            latency,
        ] = args
        else {
            return Err(format!(
                "{SERVE_FLAG} takes 11 arguments, got {}",
                args.len()
            ));
        };
        let bad = |what: &str| format!("{SERVE_FLAG}: bad {what}");
        Ok(ServeArgs {
            instance: instance.parse().map_err(|_| bad("instance"))?,
            port: port.parse().map_err(|_| bad("port"))?,
            with_idem: with_idem.parse().map_err(|_| bad("with_idem"))?,
            store: match store.as_str() {
                "memory" => StoreKind::Memory,
                "redis" => StoreKind::Redis(redis.clone()),
                _ => return Err(bad("store")),
            },
            config: config.into(),
            ledger: ledger.into(),
            seed: seed.parse().map_err(|_| bad("seed"))?,
            unavailable: unavailable.parse().map_err(|_| bad("unavailable"))?,
            drop: drop.parse().map_err(|_| bad("drop"))?,
            latency_ms: latency.parse().map_err(|_| bad("latency"))?,
        })
    }
}

/// Serves one instance until the process is killed; prints `ready` on standard output
/// once it listens.
pub async fn serve(args: ServeArgs) -> Result<(), Error> {
    let config = ServiceConfig::from_file(&args.config)?;
    let ledger = Arc::new(Ledger::append_to(&args.ledger)?);
    let o = Options {
        unavailable: args.unavailable,
        drop: args.drop,
        latency: Duration::from_millis(args.latency_ms),
        ..Options::default()
    };
    let faults = Faults::new(&o, args.seed);
    let listener = bind_with_retries(SocketAddr::from(([127, 0, 0, 1], args.port))).await?;
    let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
    let svc = OrdersServer::new(OrdersImpl::new(
        ledger,
        format!("instance-{}", args.instance),
    ));
    println!("ready");
    let mut router = Server::builder().layer(faults).layer(InboundLayer::new());
    if !args.with_idem {
        router
            .add_service(svc)
            .serve_with_incoming(incoming)
            .await?;
        return Ok(());
    }
    let tenant = SingleTenant::new("demo");
    match &args.store {
        StoreKind::Memory => {
            let store = MemoryStore::new(config.settings().memory_store.clone());
            let layer = IdempotencyLayer::new(store, &config).tenant(tenant);
            router
                .layer(layer)
                .add_service(svc)
                .serve_with_incoming(incoming)
                .await?;
        }
        StoreKind::Redis(url) => {
            let store = idem_redis::RedisStore::connect(url.clone()).await?;
            let layer = IdempotencyLayer::new(store, &config).tenant(tenant);
            router
                .layer(layer)
                .add_service(svc)
                .serve_with_incoming(incoming)
                .await?;
        }
    }
    Ok(())
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

/// A running instance process.
struct Instance {
    args: ServeArgs,
    child: Child,
}

impl Instance {
    async fn start(exe: &Path, args: ServeArgs) -> Result<Instance, Error> {
        let mut child = Command::new(exe)
            .arg(SERVE_FLAG)
            .args(args.to_args())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()?;
        let stdout = child.stdout.take().ok_or("instance stdout")?;
        let mut lines = BufReader::new(stdout).lines();
        match tokio::time::timeout(Duration::from_secs(30), lines.next_line()).await {
            Ok(Ok(Some(line))) if line == "ready" => Ok(Instance { args, child }),
            other => Err(format!("instance {} did not start: {other:?}", args.instance).into()),
        }
    }

    /// SIGKILL, then wait for the process to be gone.
    async fn kill(&mut self) -> Result<(), Error> {
        self.child.start_kill()?;
        self.child.wait().await?;
        Ok(())
    }
}

fn free_port() -> Result<u16, Error> {
    let l = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(l.local_addr()?.port())
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
    exe: &Path,
) -> Result<RunReport, Error> {
    let label = if with_idem {
        "with idem"
    } else {
        "without idem"
    };
    let dir = std::env::temp_dir().join(format!(
        "idem-demo-{}-{}",
        std::process::id(),
        if with_idem { "idem" } else { "plain" }
    ));
    std::fs::create_dir_all(&dir)?;
    let config_path = dir.join("service_config.json");
    std::fs::write(&config_path, config_text)?;
    let ledger = dir.join("ledger");
    let _ = std::fs::remove_file(&ledger);
    std::fs::write(&ledger, "")?;

    let mut instances = Vec::new();
    for i in 0..o.instances {
        let args = ServeArgs {
            instance: i,
            port: free_port()?,
            with_idem,
            store: store.clone(),
            config: config_path.clone(),
            ledger: ledger.clone(),
            seed: o.seed.wrapping_add(i as u64),
            unavailable: o.unavailable,
            drop: o.drop,
            latency_ms: o.latency.as_millis() as u64,
        };
        instances.push(Instance::start(exe, args).await?);
    }
    let endpoints = instances.iter().map(|i| {
        tonic::transport::Endpoint::from_shared(format!("http://127.0.0.1:{}", i.args.port))
            .expect("valid endpoint")
            .connect_timeout(Duration::from_millis(500))
    });
    let retry = if with_idem {
        RetryLayer::from_config(config)
    } else {
        RetryLayer::from_config(&strip_idempotency(config))
    };
    let stats = retry.stats();
    let client = OrdersClient::new(
        ServiceBuilder::new()
            .layer(retry)
            .service(tonic::transport::Channel::balance_list(endpoints)),
    );

    let done = Arc::new(AtomicU64::new(0));
    let crashes = Arc::new(AtomicU64::new(0));
    let killer = tokio::spawn(crash_loop(
        instances,
        done.clone(),
        crashes.clone(),
        crash_every,
        o.intents,
        o.seed,
        exe.to_owned(),
    ));
    let w = crate::demo::workload(o, with_idem, label, &client, done).await?;
    let mut instances = killer.await??;
    for i in &mut instances {
        i.kill().await?;
    }
    let by_intent = Ledger::read_file(&ledger)?;
    let _ = std::fs::remove_dir_all(&dir);
    let mut report = crate::demo::tally(o, label, &by_intent, w);
    let snapshot = stats.snapshot();
    report.attempts = snapshot.attempts;
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
    exe: PathBuf,
) -> Result<Vec<Instance>, Error> {
    let mut rng = StdRng::seed_from_u64(seed ^ 0xc0ffee);
    let mut next = every as u64;
    let mut victim = 0;
    while next < total as u64 {
        while done.load(Ordering::Relaxed) < next {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        tokio::time::sleep(Duration::from_micros(rng.random_range(0..3000))).await;
        let instance = &mut instances[victim];
        instance.kill().await?;
        crashes.fetch_add(1, Ordering::Relaxed);
        let args = instance.args.clone();
        instances[victim] = Instance::start(&exe, args).await?;
        victim = (victim + 1) % instances.len();
        next += every as u64;
    }
    Ok(instances)
}
