//! What a demo run is asked for and what it reports.

use std::time::Duration;

use idem_core::config::ServiceConfig;

/// The demo's service config: `CreateOrder` retried on UNAVAILABLE (5 attempts) and
/// protected by the idempotency layer, one tenant `demo`.
pub const DEFAULT_CONFIG: &str = r#"{
  "methodConfig": [
    {
      "name": [{"service": "shop.v1.Orders", "method": "CreateOrder"}],
      "timeout": "5s",
      "retryPolicy": {
        "maxAttempts": 5,
        "initialBackoff": "0.005s",
        "maxBackoff": "0.05s",
        "backoffMultiplier": 2,
        "retryableStatusCodes": ["UNAVAILABLE"]
      },
      "idempotency": {"leaseTtl": "10s", "recordTtl": "3600s"}
    }
  ],
  "idem": {"tenant": {"single": "demo"}}
}"#;

/// The workload and the faults of a run (the demo's command line).
#[derive(Debug, Clone)]
pub struct Options {
    /// `CreateOrder` intents, each with its own key.
    pub intents: usize,
    /// Intents in flight at once.
    pub concurrency: usize,
    /// Probability of UNAVAILABLE before the handler runs.
    pub unavailable: f64,
    /// Probability of losing the response after the handler ran.
    pub drop: f64,
    /// Latency added before the handler.
    pub latency: Duration,
    /// Seed of the fault injector.
    pub seed: u64,
    /// Application retries of an intent after the client layer gave up.
    pub app_retries: u32,
    /// Server instances.
    pub instances: usize,
    /// A Redis URL (comma-separated seed nodes: a cluster), for the example.
    pub redis: Option<String>,
    /// A service-config file instead of [`DEFAULT_CONFIG`], for the example.
    pub config: Option<String>,
    /// Kill instance 0 and start it again once this many intents are done.
    pub restart_after: Option<usize>,
    /// Print progress to stderr.
    pub progress: bool,
    /// Write the Prometheus exposition of both layers of the run with idem here
    /// (in-process runs).
    pub metrics_out: Option<std::path::PathBuf>,
    /// Once this many intents are done, every instance answers UNAVAILABLE for
    /// `outage_for` (in-process runs). The application then waits between its retries
    /// (the `RetryInfo` delay, else 100 ms) and keeps retrying until 30 s after it.
    pub outage_after: Option<usize>,
    /// How long the outage lasts.
    pub outage_for: Duration,
    /// `--net-faults`: a TCP fault proxy between the client and each instance and
    /// between each instance and its store, on this seeded schedule.
    pub net_faults: Option<crate::netfaults::ScheduleSpec>,
    /// Proxies every instance shares on its way to the store (one per Redis Cluster node,
    /// [`crate::netfaults::ProxiedCluster::proxies`]), driven on the `net_faults`
    /// schedule with the run's own; none by default.
    pub store_proxies: Vec<(String, std::sync::Arc<crate::netfaults::FaultProxy>)>,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            intents: 3000,
            concurrency: 64,
            unavailable: 0.10,
            drop: 0.10,
            latency: Duration::ZERO,
            seed: 7,
            app_retries: 5,
            instances: 1,
            redis: None,
            config: None,
            restart_after: None,
            progress: true,
            metrics_out: None,
            outage_after: None,
            outage_for: Duration::from_secs(3),
            net_faults: None,
            store_proxies: Vec::new(),
        }
    }
}

/// What one run did.
#[derive(Debug, Default, Clone)]
pub struct RunReport {
    /// `with idem` or `without idem`.
    pub label: &'static str,
    /// Intents fired.
    pub intents: usize,
    /// Calls that reached a server.
    pub attempts: u64,
    /// Calls the application made (first calls and application retries).
    pub app_calls: u64,
    /// Calls answered from a stored record.
    pub replays: u64,
    /// Orders created.
    pub orders: u64,
    /// Orders beyond one per intent.
    pub duplicates: u64,
    /// Intents whose caller never got an OK (after every application retry).
    pub failed: u64,
    /// Intents whose caller got an OK but whose order does not exist.
    pub ok_without_order: u64,
    /// OKs that named an order not of their intent (another intent's, or none).
    pub wrong_orders: u64,
    /// Whether instance 0 was killed and restarted during the run.
    pub restarted: bool,
    /// `failed + ok_without_order`.
    pub lost: u64,
    /// Server processes killed with SIGKILL during the run.
    pub crashes: u64,
    /// Server processes restarted (SIGTERM, drain, exit, start) during a rolling restart.
    pub restarts: u64,
    /// Attempts the client layer sent again transparently (gRFC A6), inside `attempts`.
    pub transparent: u64,
    /// Median latency of an intent (with its application retries).
    pub p50: Duration,
    /// 99th percentile latency of an intent.
    pub p99: Duration,
    /// Wall time of the workload.
    pub elapsed: Duration,
    /// What the outage did (`--outage-after`).
    pub outage: Option<crate::outage::OutageReport>,
    /// The network faults applied during the run (`--net-faults`).
    pub net_faults: Option<crate::netfaults::FaultCounts>,
    /// The history checker's verdict on the run.
    pub verdict: Option<crate::history::Verdict>,
}

/// The same config with every `idempotency` object removed: no protected methods.
pub fn strip_idempotency(config: &ServiceConfig) -> ServiceConfig {
    let entries = config
        .method_configs()
        .iter()
        .map(|m| m.clone().without_idempotency())
        .collect();
    ServiceConfig::from_parts(
        entries,
        config.retry_throttling(),
        config.settings().clone(),
    )
    .expect("names were valid already")
}
