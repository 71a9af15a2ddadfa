//! The demo's flags: [`parse_args`] reads them into [`Args`].

use super::*;

pub(super) const USAGE: &str = "usage: demo [--intents N] [--concurrency N] [--unavailable P] [--drop P] \
[--latency-ms MS] [--seed N] [--app-retries N] [--instances N] [--store memory|redis|redis-cluster|postgres] \
[--redis URL] [--redis-cluster URL,URL...] [--postgres URL] [--config FILE] [--crash-every N] [--redeploy-after N] [--metrics-out FILE] [--rolling-restart N] [--outage-after N] [--outage-for SECONDS] \
[--net-faults]";

/// What the command line asked for beyond the workload's options.
pub(super) struct Args {
    pub(super) o: Options,
    /// `--store`, or `redis` when only `--redis URL` is given (`redis-cluster` for
    /// `--redis-cluster NODES`, whose comma-separated seed nodes are in `o.redis`).
    pub(super) store: Option<String>,
    /// `--crash-every N`: instances as processes, one killed every N intents.
    pub(super) crash_every: Option<usize>,
    /// `--postgres URL`.
    pub(super) postgres: Option<String>,
    /// `--rolling-restart N`: instances as processes, one restarted (SIGTERM, drain)
    /// every N intents.
    pub(super) rolling: Option<usize>,
    /// `--net-faults`: TCP fault proxies in front of the instances and the stores.
    pub(super) net_faults: bool,
}

pub(super) fn parse_args() -> Result<Args, String> {
    let mut o = Options::default();
    let mut store = None;
    let mut crash_every = None;
    let mut postgres = None;
    let mut cluster_nodes = false;
    let mut rolling = None;
    let mut net_faults = false;
    let mut app_retries_given = false;
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        if flag == "--help" || flag == "-h" {
            println!("{USAGE}");
            std::process::exit(0);
        }
        // A switch, without a value.
        if flag == "--net-faults" {
            net_faults = true;
            continue;
        }
        let value = args
            .next()
            .ok_or_else(|| format!("{flag} needs a value\n{USAGE}"))?;
        let bad = |e: &dyn std::fmt::Display| format!("{flag} {value}: {e}");
        match flag.as_str() {
            "--intents" => o.intents = value.parse().map_err(|e| bad(&e))?,
            "--concurrency" => o.concurrency = value.parse().map_err(|e| bad(&e))?,
            "--unavailable" => o.unavailable = value.parse().map_err(|e| bad(&e))?,
            "--drop" => o.drop = value.parse().map_err(|e| bad(&e))?,
            "--latency-ms" => {
                o.latency = Duration::from_millis(value.parse().map_err(|e| bad(&e))?)
            }
            "--seed" => o.seed = value.parse().map_err(|e| bad(&e))?,
            "--app-retries" => {
                o.app_retries = value.parse().map_err(|e| bad(&e))?;
                app_retries_given = true;
            }
            "--instances" => o.instances = value.parse().map_err(|e| bad(&e))?,
            "--redis" => o.redis = Some(value),
            "--redis-cluster" => {
                // A trailing comma keeps a single seed node a cluster (`connect_redis`).
                o.redis = Some(if value.contains(',') {
                    value
                } else {
                    format!("{value},")
                });
                cluster_nodes = true;
            }
            "--config" => o.config = Some(value),
            // The Prometheus exposition of both layers of the run with idem (with
            // --crash-every: the instances' server side, scraped before each SIGKILL).
            "--metrics-out" => o.metrics_out = Some(value.into()),
            "--postgres" => postgres = Some(value),
            "--store"
                if ["memory", "redis", "redis-cluster", "postgres"].contains(&value.as_str()) =>
            {
                store = Some(value)
            }
            "--store" => {
                return Err(format!(
                    "--store {value}: must be memory, redis, redis-cluster or postgres"
                ));
            }
            "--crash-every" => crash_every = Some(value.parse().map_err(|e| bad(&e))?),
            // `--restart-after` is the old name of `--redeploy-after`.
            "--redeploy-after" | "--restart-after" => {
                o.restart_after = Some(value.parse().map_err(|e| bad(&e))?)
            }
            "--rolling-restart" => rolling = Some(value.parse().map_err(|e| bad(&e))?),
            // Every instance answers UNAVAILABLE for --outage-for seconds (default 3)
            // once N intents are done, then recovers.
            "--outage-after" => o.outage_after = Some(value.parse().map_err(|e| bad(&e))?),
            "--outage-for" => {
                let secs: f64 = value.parse().map_err(|e| bad(&e))?;
                o.outage_for = Duration::try_from_secs_f64(secs)
                    .ok()
                    .filter(|d| !d.is_zero())
                    .ok_or_else(|| bad(&"must be a number of seconds > 0"))?;
            }
            _ => return Err(format!("unknown option {flag}\n{USAGE}")),
        }
    }
    if !(0.0..=1.0).contains(&o.unavailable) || !(0.0..=1.0).contains(&o.drop) {
        return Err("--unavailable and --drop are probabilities in [0, 1]".into());
    }
    if o.intents == 0 || o.concurrency == 0 || o.instances == 0 {
        return Err("--intents, --concurrency and --instances must be > 0".into());
    }
    let redis_kind = if cluster_nodes {
        "redis-cluster"
    } else {
        "redis"
    };
    if o.redis.is_some() && store.as_deref().is_some_and(|s| s != redis_kind) {
        return Err(
            "--redis URL goes with --store redis, --redis-cluster NODES with --store redis-cluster"
                .into(),
        );
    }
    if postgres.is_some() && store.as_deref().is_some_and(|s| s != "postgres") {
        return Err("--postgres URL goes with --store postgres".into());
    }
    if o.redis.is_some() {
        store = Some(redis_kind.into());
    }
    if postgres.is_some() {
        store = Some("postgres".into());
    }
    if let Some(e) = store.as_deref().and_then(missing_backend) {
        return Err(e);
    }
    if store.as_deref() == Some("postgres") && crash_every.is_none() {
        return Err(
            "--store postgres runs the instances as processes: give --crash-every N too".into(),
        );
    }
    let memory = store.as_deref().unwrap_or("memory") == "memory";
    if o.instances > 1 && memory {
        return Err(
            "--instances > 1 needs --store redis, redis-cluster or postgres (in-memory stores are per instance)"
                .into(),
        );
    }
    // A caller cut off by a partition keeps trying for longer (its backoff reaches 1 s).
    if net_faults && !app_retries_given {
        o.app_retries = 20;
    }
    if crash_every == Some(0) {
        return Err("--crash-every must be > 0".into());
    }
    if crash_every.is_some() && o.outage_after.is_some() {
        return Err("--outage-after runs in process: not with --crash-every".into());
    }
    if crash_every.is_some() && o.restart_after.is_some() {
        return Err("--crash-every and --redeploy-after do not go together".into());
    }
    if let Some(every) = rolling {
        if every == 0 || o.instances < 2 {
            return Err("--rolling-restart N needs N > 0 and --instances K with K >= 2".into());
        }
        if store.as_deref() != Some("redis") || crash_every.is_some() || o.restart_after.is_some() {
            return Err(
                "--rolling-restart goes with --store redis, without --crash-every or --redeploy-after"
                    .into(),
            );
        }
    }
    Ok(Args {
        o,
        store,
        crash_every,
        postgres,
        rolling,
        net_faults,
    })
}

/// The error for a `--store` whose backend this binary was built without (features
/// `redis`, `postgres` of idem-demo), naming the command that builds it.
pub(super) fn missing_backend(store: &str) -> Option<String> {
    let feature = match store {
        "redis" | "redis-cluster" if !cfg!(feature = "redis") => "redis",
        "postgres" if !cfg!(feature = "postgres") => "postgres",
        _ => return None,
    };
    Some(crate::store::missing_feature(store, feature).to_string())
}
