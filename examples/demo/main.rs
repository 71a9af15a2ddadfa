//! The demo: effectively-once `CreateOrder` under injected faults, with idem and without.
//!
//! ```text
//! cargo run --release --example demo
//! cargo run --release --example demo -- --intents 5000 --concurrency 128 --drop 0.2
//! cargo run --release --example demo -- --redis redis://127.0.0.1:6379 --instances 3
//! cargo run --release --example demo -- --config examples/service_config.json
//! ```
//!
//! It starts `shop.v1.Orders` server instances on 127.0.0.1 behind a seeded fault
//! injector, then fires N CreateOrder intents at a chosen concurrency, twice:
//!
//! - **with idem**: client `RetryLayer` (one `x-idempotency-key` per intent, the same on
//!   every attempt and on every application-level retry) and server `IdempotencyLayer`;
//! - **without**: the same retry policy and application retries, no key, no server layer.
//!
//! Faults, applied in front of the server (outside the idempotency layer):
//! - `--unavailable P`: UNAVAILABLE before the handler runs (nothing happened);
//! - `--drop P`: the handler ran, then the response is lost on the way back (the client
//!   gets UNAVAILABLE, as from a proxy whose upstream connection reset, and cannot know
//!   the order exists);
//! - `--latency-ms MS`: added before the handler.
//!
//! An intent that still fails after the client layer's retries is retried by the
//! application (up to `--app-retries`), as a real caller would. The table counts orders
//! per intent in the server's ledger. With idem, duplicates and lost intents must be 0:
//! the process exits with status 1 otherwise.

use idem_test_support::demo as harness;

use harness::{DEFAULT_CONFIG, Options, RunReport, Store, run};
use std::time::Duration;

use idem::core::ServiceConfig;
use idem::store::MemoryStore;

const USAGE: &str = "usage: demo [--intents N] [--concurrency N] [--unavailable P] [--drop P] \
[--latency-ms MS] [--seed N] [--app-retries N] [--instances N] [--redis URL] [--config FILE] [--restart-after N]";

fn parse_args() -> Result<Options, String> {
    let mut o = Options::default();
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        if flag == "--help" || flag == "-h" {
            println!("{USAGE}");
            std::process::exit(0);
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
            "--app-retries" => o.app_retries = value.parse().map_err(|e| bad(&e))?,
            "--instances" => o.instances = value.parse().map_err(|e| bad(&e))?,
            "--redis" => o.redis = Some(value),
            "--config" => o.config = Some(value),
            "--restart-after" => o.restart_after = Some(value.parse().map_err(|e| bad(&e))?),
            _ => return Err(format!("unknown option {flag}\n{USAGE}")),
        }
    }
    if !(0.0..=1.0).contains(&o.unavailable) || !(0.0..=1.0).contains(&o.drop) {
        return Err("--unavailable and --drop are probabilities in [0, 1]".into());
    }
    if o.intents == 0 || o.concurrency == 0 || o.instances == 0 {
        return Err("--intents, --concurrency and --instances must be > 0".into());
    }
    if o.instances > 1 && o.redis.is_none() {
        return Err("--instances > 1 needs --redis URL (in-memory stores are per instance)".into());
    }
    Ok(o)
}

fn print_table(o: &Options, reports: &[RunReport]) {
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
        if o.redis.is_some() {
            "Redis"
        } else {
            "in-memory"
        }
    );
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
}

#[tokio::main]
async fn main() {
    let o = match parse_args() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(2);
        }
    };
    let text = match &o.config {
        Some(path) => match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) => {
                eprintln!("cannot read {path}: {e}");
                std::process::exit(2);
            }
        },
        None => DEFAULT_CONFIG.to_owned(),
    };
    let config = match ServiceConfig::from_json_with_warnings(&text) {
        Ok(parsed) => {
            for w in &parsed.warnings {
                eprintln!("config warning: {w}");
            }
            parsed.config
        }
        Err(e) => {
            eprintln!("invalid config: {e}");
            std::process::exit(2);
        }
    };
    let store = match &o.redis {
        None => Store::Memory(MemoryStore::new(config.settings().memory_store.clone())),
        Some(url) => match idem::redis::RedisStore::connect(url.clone()).await {
            Ok(s) => Store::Redis(s),
            Err(e) => {
                eprintln!("cannot connect to Redis at {url}: {e}");
                std::process::exit(2);
            }
        },
    };
    eprintln!(
        "idem demo: {} CreateOrder intents, twice (with idem, then without)",
        o.intents
    );
    let mut reports = Vec::new();
    for with_idem in [true, false] {
        match run(&o, with_idem, &config, &store).await {
            Ok(r) => reports.push(r),
            Err(e) => {
                eprintln!("run failed: {e}");
                std::process::exit(2);
            }
        }
    }
    print_table(&o, &reports);
    let idem = &reports[0];
    if idem.duplicates > 0 || idem.lost > 0 {
        eprintln!(
            "FAIL: with idem there were {} duplicate orders and {} lost intents",
            idem.duplicates, idem.lost
        );
        std::process::exit(1);
    }
    println!(
        "OK: with idem every intent took effect exactly once; without it, {} duplicate orders.",
        reports[1].duplicates
    );
}
