//! What the demo prints: the result table and the lines under it.

use super::*;

/// The result table: one row per run, then the lines of the run's extras (crashes,
/// network faults, outage).
pub(super) fn print_table(
    o: &Options,
    store: &str,
    crash_every: Option<usize>,
    reports: &[RunReport],
) {
    println!();
    println!(
        "{} intents, concurrency {}, faults: {:.0}% UNAVAILABLE before the handler, {:.0}% responses lost after it, +{} ms; seed {}; {} instance(s), {} store",
        o.intents,
        o.concurrency,
        o.unavailable * 100.0,
        o.drop * 100.0,
        o.latency.as_millis(),
        o.seed,
        o.instances,
        store,
    );
    if let Some(every) = crash_every {
        println!(
            "crashes: each instance is a separate process; one is killed with SIGKILL every {every} intents and started again ({} kills per run)",
            reports.first().map_or(0, |r| r.crashes)
        );
    }
    if let Some(spec) = &o.net_faults {
        let store_side = if o.store_proxies.is_empty() {
            "between each instance and its store"
        } else {
            "in front of each Redis Cluster node (shared by the instances, announced by the node)"
        };
        println!(
            "net faults: a TCP proxy between the client and each instance and {store_side}; \
             partitions and half-open peers {}-{} ms, seed {}",
            spec.partition.start.as_millis(),
            spec.partition.end.as_millis(),
            spec.seed
        );
        for r in reports {
            if let Some(counts) = &r.net_faults {
                println!("{}: {counts}", r.label);
            }
        }
    }
    println!();
    println!(
        "| {:<12} | {:>7} | {:>8} | {:>7} | {:>11} | {:>7} | {:>7} | {:>10} | {:>6} | {:>8} | {:>8} | {:>6} |",
        "run",
        "intents",
        "attempts",
        "retries",
        "app retries",
        "replays",
        "orders",
        "duplicates",
        "lost",
        "p50",
        "p99",
        "time"
    );
    println!(
        "|--------------|---------|----------|---------|-------------|---------|---------|------------|--------|----------|----------|--------|"
    );
    for r in reports {
        println!(
            "| {:<12} | {:>7} | {:>8} | {:>7} | {:>11} | {:>7} | {:>7} | {:>10} | {:>6} | {:>8} | {:>8} | {:>6} |",
            r.label,
            r.intents,
            r.attempts,
            r.attempts.saturating_sub(r.intents as u64),
            r.app_calls.saturating_sub(r.intents as u64),
            r.replays,
            r.orders,
            r.duplicates,
            r.lost,
            format!("{:.1}ms", r.p50.as_secs_f64() * 1e3),
            format!("{:.1}ms", r.p99.as_secs_f64() * 1e3),
            format!("{:.1}s", r.elapsed.as_secs_f64()),
        );
    }
    println!();
    println!(
        "attempts: calls that reached a server; retries: attempts beyond one per intent (client layer and application);"
    );
    println!(
        "app retries: calls the application made again after the client layer gave up (same key with idem);"
    );
    println!(
        "replays: duplicates answered from the idempotency store; duplicates: orders beyond one per intent;"
    );
    println!(
        "lost: intents whose caller never got an OK, or got one for an order that does not exist."
    );
    for r in reports {
        if let Some(outage) = &r.outage {
            // Attempts that reached a server, for the calls the application made while
            // every instance was down; then the time from recovery to the first OK.
            println!("{outage} ({})", r.label);
        }
    }
}

/// The rolling-restart lines under the table: restarts, and calls that failed to the
/// application (each one an application retry, or an intent given up).
pub(super) fn print_rolling(every: usize, reports: &[RunReport]) {
    println!(
        "rolling restart: each instance is a separate process; every {every} intents the next one gets SIGTERM, drains, exits and starts again on its port"
    );
    for r in reports {
        let failed_calls = r.app_calls - (r.intents as u64 - r.failed);
        println!(
            "  {:<12}: {} restarts, {} call(s) failed to the application ({} app retries, {} intents given up); {} transparent retries",
            r.label,
            r.restarts,
            failed_calls,
            r.app_calls.saturating_sub(r.intents as u64),
            r.failed,
            r.transparent
        );
    }
}
