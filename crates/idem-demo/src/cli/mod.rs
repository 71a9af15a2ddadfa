//! The demo: effectively-once `CreateOrder` under injected faults, with idem and without.
//!
//! ```text
//! cargo run --release -p idem-demo
//! cargo run --release -p idem-demo -- --intents 5000 --concurrency 128 --drop 0.2
//! cargo run --release -p idem-demo --features redis -- --redis redis://127.0.0.1:6379 --instances 3
//! cargo run --release -p idem-demo -- --config examples/service_config.json
//! cargo run --release -p idem-demo --features redis -- --store redis --instances 3 --crash-every 200
//! cargo run --release -p idem-demo -- --metrics-out metrics.prom
//! cargo run --release -p idem-demo --features postgres -- --store postgres --instances 3 --crash-every 200
//! cargo run --release -p idem-demo --features redis -- --store redis-cluster --instances 3
//! cargo run --release -p idem-demo --features redis -- --redis-cluster redis://10.0.0.1:7000,redis://10.0.0.2:7000
//! cargo run --release -p idem-demo --features redis -- --store redis --instances 3 --rolling-restart 400 --unavailable 0 --drop 0
//! cargo run --release -p idem-demo -- --outage-after 500 --outage-for 3 --config examples/outage/breaker.json
//! cargo run --release -p idem-demo --features redis -- --store redis --instances 3 --net-faults
//! cargo run --release -p idem-demo --features postgres -- --store postgres --instances 2 --net-faults --crash-every 400
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
//! With `--crash-every N` the instances are separate OS processes: every N intents one of
//! them is killed with SIGKILL at a random point of its work and started again on the
//! same port, and orders are counted from where the processes write them.
//! `--store memory|redis|redis-cluster|postgres` chooses where records live (`--redis
//! URL` implies `redis`, `--redis-cluster URL,URL…` (seed nodes) `redis-cluster`,
//! `--postgres URL` `postgres`; without a URL the demo starts a private `redis-server`,
//! a private Redis Cluster (3 masters, 3 replicas, on free loopback ports, created with
//! `redis-cli --cluster create`) or a PostgreSQL server). With `memory` and `redis`,
//! orders are lines of a ledger file; a cache store cannot make a crash after the side
//! effect harmless, and the table shows how many duplicates it lets through. With
//! `postgres`, each order is a row written in the same transaction as the completion of
//! its idempotency record, so a crash at any point leaves the order and its reply, or
//! neither: duplicates and lost intents must be 0.
//!
//! With `--rolling-restart N` (with `--instances K` ≥ 2 and a shared store) the instances
//! are processes restarted as a rolling update does: every N intents the next one gets
//! SIGTERM, drains, exits and starts again on the same port, one at a time. The row
//! without idem is plain tonic on both sides (no retry layer; `serve_with_shutdown` on
//! SIGTERM).
//!
//! Redis and Redis Cluster need the package's `redis` feature, PostgreSQL its `postgres`
//! feature: the in-memory default builds neither client.
//!
//! With `--outage-after N --outage-for SECONDS`, every instance answers UNAVAILABLE for
//! that long once N intents are done, then recovers; the output adds `outage: A attempts
//! for C calls (R×)` (attempts that reached a server, for the calls the application made
//! during the outage) and the time from recovery to the first success. The application
//! then waits between its retries (a refused call's `RetryInfo` delay, else 100 ms) and
//! keeps retrying until 30 s after the outage. `examples/outage/` has the four configs
//! of BENCHMARKS.md's outage rows (no guard, A6 throttling, retry budget, breaker).
//!
//! With `--net-faults` (any store, also with `--crash-every`) the faults are on real
//! sockets too: a TCP proxy sits between the client and each instance and between each
//! instance and its store (Redis, PostgreSQL; for a private Redis Cluster one proxy per
//! node, shared by the instances, whose port the node announces in `CLUSTER SLOTS` and
//! `MOVED`; a cluster given with `--redis-cluster` is proxied on the client's side only).
//! Each proxy runs its own seeded
//! schedule of partitions (one way or both, bytes dropped, connections kept open),
//! latency spikes, resets after N bytes, peers that stop reading and drips, each printed
//! as it is applied; the table's header counts them by kind. Partitions are shorter
//! than the lease, except on PostgreSQL with crashes, where they also outlast it. Every
//! intent's calls and OKs are checked by the history checker: each intent one order,
//! every OK naming it.
//!
//! An intent that still fails after the client layer's retries is retried by the
//! application (up to `--app-retries`, 20 with `--net-faults`; backing off 10 ms
//! doubling to 1 s), as a real caller would. The table counts orders
//! per intent in the server's ledger. With idem, duplicates and lost intents must be 0:
//! the process exits with status 1 otherwise.

mod args;
mod print;

use args::{Args, parse_args};
use print::{print_rolling, print_table};

use crate::crash::{self, SERVE_FLAG, ServeArgs, StoreKind};
use crate::netfaults::{ProxiedCluster, ScheduleSpec};
#[cfg(feature = "redis")]
use crate::store::connect_redis;
use crate::{DEFAULT_CONFIG, DemoStore, Options, RunReport, run};
#[cfg(feature = "postgres")]
use idem_test_support::postgres::PostgresServer;
use idem_test_support::redis::{RedisCluster, RedisServer};
use std::time::Duration;

use idem::core::config::ServiceConfig;
use idem::store::memory::MemoryStore;

/// What keeps a private PostgreSQL server alive (none without the `postgres` feature).
#[cfg(feature = "postgres")]
type PrivatePostgres = PostgresServer;
/// What keeps a private PostgreSQL server alive (none without the `postgres` feature).
#[cfg(not(feature = "postgres"))]
struct PrivatePostgres;

/// The demo's command line: parses the flags above, runs, prints the table, and exits
/// non-zero unless the run with idem was exactly-once. What both `cargo run -p idem-demo`
/// and the root package's `cargo run --example demo` call.
pub fn main() {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let runtime = tokio::runtime::Runtime::new().expect("a tokio runtime");
    if argv.first().map(String::as_str) == Some(SERVE_FLAG) {
        // One server instance of a `--crash-every` run, started by the demo itself.
        let code = match ServeArgs::parse(&argv[1..]) {
            Ok(args) => match runtime.block_on(crash::serve(args)) {
                Ok(()) => 0,
                Err(e) => {
                    eprintln!("demo instance: {e}");
                    2
                }
            },
            Err(e) => {
                eprintln!("{e}");
                2
            }
        };
        std::process::exit(code);
    }
    runtime.block_on(demo());
}

async fn demo() {
    let Args {
        mut o,
        store: store_choice,
        crash_every,
        postgres,
        rolling,
        net_faults,
    } = match parse_args() {
        Ok(a) => a,
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
        // Under crashes, a record left in flight by a killed process blocks its key for a
        // lease: a short one lets the retry take it over within the call's deadline.
        None if crash_every.is_some() => {
            DEFAULT_CONFIG.replace(r#""leaseTtl": "10s""#, r#""leaseTtl": "1s""#)
        }
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
    if net_faults {
        o.net_faults = Some(net_fault_schedule(
            &o,
            &config,
            store_choice.as_deref(),
            crash_every,
        ));
    }
    let redis_wanted = store_choice.as_deref() == Some("redis");
    let cluster_wanted = store_choice.as_deref() == Some("redis-cluster");
    // A private redis-server when --store redis comes without a URL, a private cluster
    // for --store redis-cluster; a cluster's seed nodes travel as one comma-separated
    // string (`crate::store::connect_redis`).
    let mut private_redis = None;
    let mut private_cluster = None;
    let mut proxied_cluster = None;
    let redis_url = match (&o.redis, redis_wanted) {
        (Some(url), _) => Some(url.clone()),
        // `--net-faults`: every node behind its own proxy, announcing the proxy's port,
        // so the instances reach the nodes only through the proxies.
        (None, false) if cluster_wanted && net_faults => {
            let (cluster, nodes) = private(
                ProxiedCluster::start().await,
                ProxiedCluster::seeds,
                "--store redis-cluster needs redis-server and redis-cli: install them \
                 (Debian/Ubuntu: apt-get install redis-server)",
            );
            eprintln!(
                "private Redis Cluster (3 masters, 3 replicas), each node behind a fault proxy: {nodes}"
            );
            o.store_proxies = cluster.proxies().to_vec();
            proxied_cluster = Some(cluster);
            Some(nodes)
        }
        (None, false) if cluster_wanted => {
            let (cluster, nodes) = private(
                RedisCluster::start(),
                |c| c.urls().join(","),
                "--store redis-cluster needs redis-server and redis-cli: pass --redis-cluster NODES, \
                 or install them (Debian/Ubuntu: apt-get install redis-server)",
            );
            eprintln!("private Redis Cluster (3 masters, 3 replicas): {nodes}");
            private_cluster = Some(cluster);
            Some(nodes)
        }
        (None, true) => {
            let (server, url) = private(
                RedisServer::start(),
                RedisServer::url,
                "--store redis needs a redis-server: pass --redis URL, or install one (Debian/Ubuntu: apt-get install redis-server)",
            );
            private_redis = Some(server);
            // `--net-faults` gives each instance its own proxied connection to it.
            o.redis = Some(url.clone());
            Some(url)
        }
        (None, false) => None,
    };
    if proxied_cluster.is_some() {
        // Its seeds are the proxies (`fleet::proxied_stores` leaves a cluster's alone).
        o.redis.clone_from(&redis_url);
    }
    // A private PostgreSQL server when --store postgres comes without a URL.
    #[cfg_attr(not(feature = "postgres"), allow(unused_mut))]
    let mut private_postgres: Option<PrivatePostgres> = None;
    let postgres_url = match (postgres, store_choice.as_deref() == Some("postgres")) {
        (Some(url), _) => Some(url),
        #[cfg(feature = "postgres")]
        (None, true) => {
            let (server, url) = private(
                PostgresServer::start_with(&[("max_connections", "300")]),
                PostgresServer::url,
                "--store postgres needs PostgreSQL: pass --postgres URL, or install its server \
                 (Debian/Ubuntu: apt-get install postgresql; the demo runs its own private \
                 server from /usr/lib/postgresql/*/bin, or from $PG_BIN)",
            );
            private_postgres = Some(server);
            Some(url)
        }
        (None, _) => None,
    };
    let store_label = if postgres_url.is_some() {
        "PostgreSQL"
    } else if cluster_wanted {
        "Redis Cluster"
    } else if redis_url.is_some() {
        "Redis"
    } else {
        "in-memory"
    };
    eprintln!(
        "idem demo: {} CreateOrder intents, twice (with idem, then without)",
        o.intents
    );
    let reports = match (crash_every, rolling) {
        (None, Some(every)) => {
            let kind = StoreKind::Redis(redis_url.clone().unwrap_or_default());
            rolling_runs(&o, every, &config, &text, &kind).await
        }
        (Some(every), _) => {
            let kind = match (&redis_url, &postgres_url) {
                (_, Some(url)) => StoreKind::Postgres(url.clone()),
                (Some(url), None) => StoreKind::Redis(url.clone()),
                (None, None) => StoreKind::Memory,
            };
            crash_runs(&o, every, &config, &text, &kind).await
        }
        (None, None) => in_process_runs(&o, &config, redis_url.as_deref()).await,
    };
    drop(private_redis);
    drop(private_cluster);
    // Its nodes stop; `o.store_proxies` keeps the idle proxies for the table's header.
    drop(proxied_cluster);
    #[cfg_attr(not(feature = "postgres"), allow(clippy::drop_non_drop))]
    drop(private_postgres);
    print_table(&o, store_label, crash_every, &reports);
    let idem = &reports[0];
    if let Some(every) = rolling {
        print_rolling(every, &reports);
        exit_unless_exactly_once(idem, "with idem", " through the rolling restarts");
        if idem.app_calls > idem.intents as u64 {
            eprintln!(
                "FAIL: with idem {} call(s) failed to the application",
                idem.app_calls - idem.intents as u64
            );
            std::process::exit(1);
        }
        return;
    }
    if crash_every.is_some() && postgres_url.is_some() {
        exit_unless_exactly_once(idem, "with idem on PostgreSQL", " under crashes");
        println!(
            "OK: with idem on PostgreSQL every intent took effect exactly once through {} SIGKILLs: \
             each order commits in the transaction that completes its record (without idem: {} duplicates).",
            idem.crashes, reports[1].duplicates
        );
        return;
    }
    if crash_every.is_some() {
        // A cache of outcomes (memory, Redis) cannot undo a crash that falls between the
        // side effect and the record: say how often it happened, do not fail on it.
        println!(
            "With crashes, the {store_label} store let {} duplicate order(s) through with idem ({} without); \
             a crash between the handler's side effect and the recorded outcome re-runs the handler.",
            idem.duplicates, reports[1].duplicates
        );
        if idem.lost > 0 {
            eprintln!("FAIL: with idem {} intents were lost", idem.lost);
            std::process::exit(1);
        }
        return;
    }
    exit_unless_exactly_once(idem, "with idem", "");
    println!(
        "OK: with idem every intent took effect exactly once; without it, {} duplicate orders.",
        reports[1].duplicates
    );
}

/// A private server the demo `started` and its URL; when it could not start, exits with
/// status 2 after saying `missing`.
fn private<T>(started: Option<T>, url: impl FnOnce(&T) -> String, missing: &str) -> (T, String) {
    let Some(server) = started else {
        eprintln!("{missing}");
        std::process::exit(2);
    };
    let url = url(&server);
    (server, url)
}

/// Exits with status 1 (after saying so) when the run `with` let a duplicate order
/// through or lost an intent; `when` ends the message.
fn exit_unless_exactly_once(idem: &RunReport, with: &str, when: &str) {
    if idem.duplicates > 0 || idem.lost > 0 || idem.wrong_orders > 0 {
        eprintln!(
            "FAIL: {with} there were {} duplicate orders, {} lost intents and {} OKs naming another order{when}",
            idem.duplicates, idem.lost, idem.wrong_orders
        );
        if let Some(v) = &idem.verdict {
            eprintln!("{v}");
        }
        std::process::exit(1);
    }
}

/// `--net-faults`: partitions shorter than the lease (at most half of it, 3 s at most),
/// except on PostgreSQL with crashes, where they also run longer than the lease (up to
/// three leases, 3 s at least), so a run taken over while cut off must lose to the fence.
fn net_fault_schedule(
    o: &Options,
    config: &ServiceConfig,
    store: Option<&str>,
    crash_every: Option<usize>,
) -> ScheduleSpec {
    let lease = config
        .method_configs()
        .iter()
        .filter_map(|m| m.idempotency())
        .map(|p| p.lease_ttl)
        .min()
        .unwrap_or(Duration::from_secs(10));
    let longest = if store == Some("postgres") && crash_every.is_some() {
        (lease * 3).max(Duration::from_secs(3))
    } else {
        (lease / 2).min(Duration::from_secs(3))
    };
    ScheduleSpec::new(o.seed, Duration::from_millis(100)..longest)
}

/// Both runs with every instance in this process.
async fn in_process_runs(
    o: &Options,
    config: &ServiceConfig,
    redis: Option<&str>,
) -> Vec<RunReport> {
    let store = match redis {
        None => {
            // Every instance serves the one tenant "demo" (`SingleTenant` in code).
            let settings = config.settings().memory_store.clone().for_single_tenant();
            DemoStore::Memory(MemoryStore::new(settings))
        }
        #[cfg(not(feature = "redis"))]
        Some(_) => {
            // parse_args refused it already.
            eprintln!("{}", crate::store::missing_feature("redis", "redis"));
            std::process::exit(2);
        }
        #[cfg(feature = "redis")]
        Some(url) => match connect_redis(url).await {
            Ok(s) => DemoStore::Redis(s),
            Err(e) => {
                eprintln!("cannot connect to Redis at {url}: {e}");
                std::process::exit(2);
            }
        },
    };
    let mut reports = Vec::new();
    for with_idem in [true, false] {
        match run(o, with_idem, config, &store).await {
            Ok(r) => reports.push(r),
            Err(e) => {
                eprintln!("run failed: {e}");
                std::process::exit(2);
            }
        }
    }
    reports
}

/// Both runs with a rolling restart every `every` intents.
async fn rolling_runs(
    o: &Options,
    every: usize,
    config: &ServiceConfig,
    text: &str,
    store: &StoreKind,
) -> Vec<RunReport> {
    let launch = own_launch();
    let mut reports = Vec::new();
    for with_idem in [true, false] {
        let run = crash::run_rolling(o, every, with_idem, config, text, store, &launch);
        reports.push(or_exit(run.await));
    }
    reports
}

/// Both runs with instance processes killed every `every` intents.
async fn crash_runs(
    o: &Options,
    every: usize,
    config: &ServiceConfig,
    text: &str,
    store: &StoreKind,
) -> Vec<RunReport> {
    let launch = own_launch();
    let mut reports = Vec::new();
    for with_idem in [true, false] {
        let run = crash::run_with_crashes(o, every, with_idem, config, text, store, &launch);
        reports.push(or_exit(run.await));
    }
    reports
}

/// How instance processes are started: the demo's own executable (exits 2 when it
/// cannot be found).
fn own_launch() -> crash::Launch {
    match std::env::current_exe() {
        Ok(exe) => crash::Launch::Binary(exe),
        Err(e) => {
            eprintln!("cannot find the demo's own executable to start instances: {e}");
            std::process::exit(2);
        }
    }
}

/// A run's report, or exit 2 saying why the run failed.
fn or_exit(run: Result<RunReport, crate::BoxError>) -> RunReport {
    run.unwrap_or_else(|e| {
        eprintln!("run failed: {e}");
        std::process::exit(2);
    })
}
