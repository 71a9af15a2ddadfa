//! One run with a rolling restart of instance processes, as a rolling update does: every
//! N intents the next instance gets SIGTERM, drains, exits and starts again on the same
//! port, one at a time, while the workload runs.
//!
//! With idem the client is the `RetryLayer` (transparent retries, the policy with the
//! intent's key) and each instance drains ([`idem_server::drain`]). Without idem both
//! sides are plain tonic: a client on the balanced channel, and a server that stops with
//! `serve_with_shutdown` on SIGTERM, which is what a tonic service does today.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use idem_core::config::ServiceConfig;
use idem_test_support::shop::orders_client::OrdersClient;
use tower::ServiceBuilder;

use super::args::StoreKind;
use super::process::{Instance, Launch};
use super::run::{RunFiles, start_instances};
use crate::fleet::{client_channel, label, retry_layer};
use crate::netfaults::Rig;
use crate::orders::Ledger;
use crate::workload::{Workload, tally, workload};
use crate::{BoxError, Options, RunReport};

/// How long an instance may take from SIGTERM to its exit (its drain timeout is 10 s).
const EXIT_TIMEOUT: Duration = Duration::from_secs(15);

/// One run with instance processes restarted in turn each time `every` more intents are
/// done. The store must be shared (Redis): a restarted instance's records are the
/// fleet's.
pub async fn run_rolling(
    o: &Options,
    every: usize,
    with_idem: bool,
    config: &ServiceConfig,
    config_text: &str,
    store: &StoreKind,
    launch: &Launch,
) -> Result<RunReport, BoxError> {
    let label = label(with_idem);
    let files = RunFiles::new(with_idem, config_text)?;
    // No fault proxies here (`--rolling-restart` goes without `--net-faults`).
    let mut rig = Rig::default();
    let instances = start_instances(o, with_idem, false, store, &files, launch, &mut rig).await?;
    let addrs: Vec<SocketAddr> = instances
        .iter()
        .map(|i| SocketAddr::from(([127, 0, 0, 1], i.args().port)))
        .collect();
    let channel = client_channel(&addrs, Duration::from_millis(500));
    let done = Arc::new(AtomicU64::new(0));
    let restarts = Arc::new(AtomicU64::new(0));
    let roller = tokio::spawn(roll(
        instances,
        done.clone(),
        restarts.clone(),
        every,
        o.intents,
        launch.clone(),
    ));
    let (w, (attempts, transparent)) = if with_idem {
        let retry = retry_layer(config, true, None);
        let stats = retry.stats();
        let client = OrdersClient::new(ServiceBuilder::new().layer(retry).service(channel));
        let w: Workload = workload(o, true, label, &client, done).await?;
        let s = stats.snapshot();
        (w, (s.attempts, s.transparent))
    } else {
        let client = OrdersClient::new(channel);
        let w = workload(o, false, label, &client, done).await?;
        (w, (0, 0))
    };
    let mut instances = roller.await??;
    for i in &mut instances {
        i.kill().await?;
    }
    let orders = Ledger::read_orders(&files.ledger)?;
    let _ = std::fs::remove_dir_all(&files.dir);
    let mut report = tally(o, label, &orders, w);
    report.attempts = attempts;
    report.transparent = transparent;
    report.restarts = restarts.load(Ordering::Relaxed);
    Ok(report)
}

/// Each time `every` more intents are done: SIGTERM to the next instance, wait for its
/// exit, start it again on its port (and wait for its `ready`).
async fn roll(
    mut instances: Vec<Instance>,
    done: Arc<AtomicU64>,
    restarts: Arc<AtomicU64>,
    every: usize,
    total: usize,
    launch: Launch,
) -> Result<Vec<Instance>, BoxError> {
    let mut next = every as u64;
    let mut victim = 0;
    while next < total as u64 {
        while done.load(Ordering::Relaxed) < next {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        let instance = &mut instances[victim];
        instance.terminate(EXIT_TIMEOUT).await?;
        let args = instance.args().clone();
        instances[victim] = Instance::start(&launch, args).await?;
        restarts.fetch_add(1, Ordering::Relaxed);
        victim = (victim + 1) % instances.len();
        next += every as u64;
    }
    Ok(instances)
}
