//! What one instance process is told, on its command line or in its environment, and
//! where it may pause.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};

/// The first argument that makes the demo binary serve one instance.
pub const SERVE_FLAG: &str = "--serve-instance";

/// The environment variable that carries a test binary's instance arguments (see
/// [`serve_from_env`](super::serve_from_env)).
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
