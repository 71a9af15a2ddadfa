//! One run with instance processes killed with SIGKILL every N intents and started
//! again on the same port, while the workload runs.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use idem_core::config::ServiceConfig;
use idem_test_support::net::free_port;
use idem_test_support::shop::orders_client::OrdersClient;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tower::ServiceBuilder;

use super::args::{ServeArgs, StoreKind};
use super::process::{Instance, Launch};
use crate::fleet::{client_channel, label, retry_layer};
use crate::metrics::{DemoMetrics, merge, scrape};
use crate::netfaults::Rig;
use crate::orders::Ledger;
#[cfg(feature = "postgres")]
use crate::pg_orders;
use crate::workload::{tally, workload};
use crate::{BoxError, Options, RunReport};

/// The files one run's instances share: the config they read and the ledger they append
/// to, in a directory of their own.
pub(crate) struct RunFiles {
    pub(crate) dir: PathBuf,
    pub(crate) config: PathBuf,
    pub(crate) ledger: PathBuf,
}

impl RunFiles {
    pub(crate) fn new(with_idem: bool, config_text: &str) -> Result<Self, BoxError> {
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
/// `metrics`); with `--net-faults`, each reaches its store through its own proxy of
/// `rig` (a Redis Cluster excepted: its nodes tell the client where they are, so a private
/// one is reached through `o.store_proxies`, one per node, which the caller drives).
pub(crate) async fn start_instances(
    o: &Options,
    with_idem: bool,
    metrics: bool,
    store: &StoreKind,
    files: &RunFiles,
    launch: &Launch,
    rig: &mut Rig,
) -> Result<Vec<Instance>, BoxError> {
    let mut instances = Vec::new();
    for i in 0..o.instances {
        let store = match store {
            StoreKind::Redis(url) if o.net_faults.is_some() && !url.contains(',') => {
                StoreKind::Redis(rig.front_url(format!("instance-{i} -> redis"), url).await?)
            }
            StoreKind::Postgres(url) if o.net_faults.is_some() => StoreKind::Postgres(
                rig.front_url(format!("instance-{i} -> postgres"), url)
                    .await?,
            ),
            other => other.clone(),
        };
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
                store,
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
        if let Some(port) = i.args().metrics_port {
            match scrape(port).await {
                Ok(text) => last.push(text),
                Err(e) => eprintln!("metrics of instance {} lost: {e}", i.args().instance),
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
) -> Result<RunReport, BoxError> {
    let label = label(with_idem);
    let files = RunFiles::new(with_idem, config_text)?;
    let orders_db: Option<crate::store::PgPool> = match store {
        #[cfg(not(feature = "postgres"))]
        StoreKind::Postgres(_) => {
            return Err(crate::store::missing_feature("postgres", "postgres"));
        }
        #[cfg(feature = "postgres")]
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
    let mut rig = Rig::default();
    let instances = start_instances(
        o,
        with_idem,
        metrics.is_some(),
        store,
        &files,
        launch,
        &mut rig,
    )
    .await?;
    let mut addrs: Vec<SocketAddr> = Vec::new();
    for i in &instances {
        let addr = SocketAddr::from(([127, 0, 0, 1], i.args().port));
        addrs.push(match o.net_faults {
            Some(_) => {
                let name = format!("client -> instance-{}", i.args().instance);
                rig.front(name, addr).await?
            }
            None => addr,
        });
    }
    if o.net_faults.is_some() {
        rig.adopt(&o.store_proxies);
    }
    let driver = o
        .net_faults
        .as_ref()
        .map(|spec| rig.drive(spec, o.progress));
    let retry = retry_layer(config, with_idem, metrics.as_ref());
    let stats = retry.stats();
    let client = OrdersClient::new(
        ServiceBuilder::new()
            .layer(retry)
            .service(client_channel(&addrs, Duration::from_millis(500))),
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
        launch.clone(),
    ));
    let w = workload(o, with_idem, label, &client, done).await?;
    let net_faults = driver.map(|d| d.stop());
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
    let orders = match &orders_db {
        #[cfg(feature = "postgres")]
        Some(pool) => pg_orders::orders(pool).await?,
        #[cfg(not(feature = "postgres"))]
        Some(never) => match *never {},
        None => Ledger::read_orders(&files.ledger)?,
    };
    let _ = std::fs::remove_dir_all(&files.dir);
    let mut report = tally(o, label, &orders, w);
    report.net_faults = net_faults;
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
) -> Result<(Vec<Instance>, Vec<String>), BoxError> {
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
        if let Some(port) = instance.args().metrics_port {
            match scrape(port).await {
                Ok(text) => dead.push(text),
                Err(e) => eprintln!("metrics of instance {victim} lost: {e}"),
            }
        }
        instance.kill().await?;
        crashes.fetch_add(1, Ordering::Relaxed);
        let args = instance.args().clone();
        instances[victim] = Instance::start(&launch, args).await?;
        victim = (victim + 1) % instances.len();
        next += every as u64;
    }
    Ok((instances, dead))
}
