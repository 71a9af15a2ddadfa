//! A soak of the stores with their default settings (issue 31):
//! `cargo bench --bench soak [-- memory redis postgres]` (none: `memory`).
//!
//! Every call is a real `CreateOrder` over a tonic client and server on 127.0.0.1, with
//! a fresh key, through `IdempotencyLayer`; the handler answers a 200-byte response (as
//! stored: the padding is measured on the first call), the size the capacity docs use.
//!
//! - `memory`: first the machine's rate, unpaced, bare tonic against the layer on a
//!   default store (rounds alternated; ratio in the same run). Then the soak:
//!   `IDEM_SOAK_CALLS` (1,000,000) calls through `IdempotencyLayer::from_config` with
//!   the defaults (one tenant: the whole store, 256 MiB, `minRetention` 120 s), at the
//!   machine's rate but at most 95 % of the store's sustained rate (records it holds /
//!   `minRetention`; a schedule that never bursts more than 1 s of calls), so the store
//!   fills and then evicts. Reports refusals, evictions, peak records and bytes, bytes per
//!   record, peak RSS, and latency while filling against while evicting. Last, the newest
//!   1,000 keys are sent again: each must replay.
//! - `redis`: `IDEM_SOAK_REDIS_CALLS` (100,000) calls on a private redis-server with the
//!   default record TTL; bytes per record from Redis's own `INFO memory` (`used_memory`,
//!   what `maxmemory` counts), and the sustained rate one GiB holds at that TTL.
//! - `postgres`: 1,000 calls/s for `IDEM_SOAK_PG_SECS` (600) with `recordTtl` 60 s and
//!   the store's default sweep, on a private PostgreSQL with `pg_stat_statements`: rows,
//!   expired rows and table size every 30 s, and the sweep's cost as PostgreSQL counts it.
//!
//! Numbers: BENCHMARKS.md, "Soak with the default settings".

use idem_test_support::net;
use idem_test_support::shop;

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idem_core::config::ServiceConfig;
use idem_server::idempotency::IdempotencyLayer;
use idem_store::Store;
use idem_store::memory::RECORD_OVERHEAD_BYTES;
use shop::orders_client::OrdersClient;
use shop::{CreateOrderRequest, Order};
use tonic::transport::{Channel, Server};
use tonic::{Code, Request, Response, Status};

const CONCURRENCY: usize = 64;
/// The stored response size the capacity docs are written for.
const RESPONSE_BYTES: usize = 200;

fn config(extra: &str) -> ServiceConfig {
    ServiceConfig::from_json(&format!(
        r#"{{
          "methodConfig": [{{
            "name": [{{"service": "shop.v1.Orders", "method": "CreateOrder"}}],
            "idempotency": {{{extra}}}
          }}],
          "idem": {{"tenant": {{"single": "soak"}}}}
        }}"#
    ))
    .expect("soak config parses")
}

/// A server answering orders whose `created_by` is `pad` bytes; stops when dropped.
struct Running {
    addr: std::net::SocketAddr,
    runs: Arc<AtomicUsize>,
    _task: AbortOnDrop,
}

struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

async fn serve<St: Store>(layer: Option<IdempotencyLayer<St>>, pad: usize) -> Running {
    let runs = Arc::new(AtomicUsize::new(0));
    let counter = runs.clone();
    let filler = "x".repeat(pad);
    let svc = idem_test_support::shop_fake::create_only(move |req: Request<CreateOrderRequest>| {
        let n = counter.fetch_add(1, Ordering::Relaxed);
        let r = req.into_inner();
        std::future::ready(Ok::<_, Status>(Response::new(Order {
            order_id: format!("order-{n:012}"),
            customer_id: r.customer_id,
            sku: r.sku,
            quantity: r.quantity,
            created_by: filler.clone(),
        })))
    });
    let (addr, incoming) = net::bind().await;
    let task = match layer {
        Some(l) => tokio::spawn(async move {
            let _ = Server::builder()
                .layer(l)
                .add_service(svc)
                .serve_with_incoming(incoming)
                .await;
        }),
        None => tokio::spawn(async move {
            let _ = Server::builder()
                .add_service(svc)
                .serve_with_incoming(incoming)
                .await;
        }),
    };
    Running {
        addr,
        runs,
        _task: AbortOnDrop(task),
    }
}

fn key(run: u64, i: usize) -> String {
    format!("soak-{run:08x}-{i:016x}")
}

fn order(key: &str) -> Request<CreateOrderRequest> {
    let mut req = Request::new(CreateOrderRequest {
        customer_id: "customer-0001".into(),
        sku: "sku-42".into(),
        quantity: 3,
        note: String::new(),
    });
    req.metadata_mut()
        .insert("x-idempotency-key", key.parse().expect("ascii key"));
    req
}

fn replayed(r: &Response<Order>) -> bool {
    r.metadata()
        .get("x-idempotency-replayed")
        .is_some_and(|v| v == "true")
}

/// What a run of calls saw.
#[derive(Default)]
struct Outcomes {
    ok: AtomicU64,
    store_full: AtomicU64,
    other: AtomicU64,
    /// The first refused call's index (`u64::MAX`: none).
    first_full: AtomicU64,
    /// Latency of call i in µs (0: not made).
    micros: Vec<AtomicU64>,
}

/// Makes `calls` calls with keys of `run`, `CONCURRENCY` at a time, at most `rate` a
/// second if given (call i starts no sooner than i / rate after the start; when behind
/// by more than a second, the schedule moves on instead of bursting).
async fn drive(
    addr: std::net::SocketAddr,
    run: u64,
    calls: usize,
    rate: Option<f64>,
) -> (Duration, Arc<Outcomes>) {
    drive_into(addr, run, Outcomes::new(calls), rate).await
}

impl Outcomes {
    fn new(calls: usize) -> Arc<Outcomes> {
        Arc::new(Outcomes {
            micros: (0..calls).map(|_| AtomicU64::new(0)).collect(),
            first_full: AtomicU64::new(u64::MAX),
            ..Outcomes::default()
        })
    }
}

/// [`drive`] recording into `out` (made before, so its memory is not the store's).
async fn drive_into(
    addr: std::net::SocketAddr,
    run: u64,
    out: Arc<Outcomes>,
    rate: Option<f64>,
) -> (Duration, Arc<Outcomes>) {
    let calls = out.micros.len();
    let next = Arc::new(AtomicUsize::new(0));
    let origin = Arc::new(Mutex::new(tokio::time::Instant::now()));
    let channel: Channel = net::channel(addr);
    let start = Instant::now();
    let workers: Vec<_> = (0..CONCURRENCY)
        .map(|_| {
            let (out, next, origin) = (out.clone(), next.clone(), origin.clone());
            let mut client = OrdersClient::new(channel.clone());
            tokio::spawn(async move {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= calls {
                        return;
                    }
                    if let Some(rate) = rate {
                        let due = {
                            let now = tokio::time::Instant::now();
                            let mut o = origin.lock().expect("origin");
                            let due = *o + Duration::from_secs_f64(i as f64 / rate);
                            if now > due + Duration::from_secs(1) {
                                *o += now - due - Duration::from_secs(1);
                            }
                            *o + Duration::from_secs_f64(i as f64 / rate)
                        };
                        tokio::time::sleep_until(due).await;
                    }
                    let t = Instant::now();
                    let r = client.create_order(order(&key(run, i))).await;
                    out.micros[i].store(t.elapsed().as_micros().max(1) as u64, Ordering::Relaxed);
                    match r {
                        Ok(_) => &out.ok,
                        Err(s) if s.code() == Code::ResourceExhausted => {
                            out.first_full.fetch_min(i as u64, Ordering::Relaxed);
                            &out.store_full
                        }
                        Err(_) => &out.other,
                    }
                    .fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    for w in workers {
        w.await.expect("worker");
    }
    (start.elapsed(), out)
}

fn percentile(mut xs: Vec<u64>, p: f64) -> f64 {
    xs.retain(|&x| x > 0);
    if xs.is_empty() {
        return f64::NAN;
    }
    xs.sort_unstable();
    xs[((xs.len() - 1) as f64 * p).round() as usize] as f64 / 1000.0
}

fn cpu() -> Duration {
    cpu_time::ProcessTime::now().as_duration()
}

/// The resident set now (kB → bytes), from /proc/self/status.
fn rss() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    s.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

fn env_num(name: &str, default: f64) -> f64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The `created_by` padding that makes the stored response `RESPONSE_BYTES` (as the
/// store charges it), found by a few calls.
async fn calibrate() -> usize {
    let mut pad = 0;
    for attempt in 0..4 {
        let layer = IdempotencyLayer::from_config(&config(""));
        let store = layer.store().clone();
        let s = serve(Some(layer), pad).await;
        let mut c = OrdersClient::new(net::channel(s.addr));
        c.create_order(order(&format!("calibrate-{attempt:04}")))
            .await
            .expect("calibration call");
        let stored = store.stats().bytes - RECORD_OVERHEAD_BYTES;
        if stored == RESPONSE_BYTES {
            println!("stored response: {stored} bytes (created_by padded by {pad})");
            return pad;
        }
        pad = (pad + RESPONSE_BYTES).saturating_sub(stored);
    }
    println!("stored response: about {RESPONSE_BYTES} bytes (created_by padded by {pad})");
    pad
}

fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let picked = |s: &str| args.is_empty() && s == "memory" || args.iter().any(|a| a == s);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let pad = calibrate().await;
        if picked("memory") {
            memory(pad).await;
        }
        if picked("redis") {
            redis(pad).await;
        }
        if picked("postgres") {
            postgres(pad).await;
        }
    });
}

// ------------------------------------------------------------------ memory

async fn memory(pad: usize) {
    // The machine's rate: bare tonic against the layer on a default store, alternated.
    let n = env_num("IDEM_SOAK_RATE_CALLS", 50_000.0) as usize;
    let (mut bare, mut idem) = (Vec::new(), Vec::new());
    for round in 0..4u64 {
        let with_layer = round % 2 == 1;
        let layer = with_layer.then(|| IdempotencyLayer::from_config(&config("")));
        let s = serve(layer, pad).await;
        let c0 = cpu();
        let (took, out) = drive(s.addr, 1000 + round, n, None).await;
        let per_call = (cpu() - c0).as_secs_f64() * 1e6 / n as f64;
        assert_eq!(
            out.ok.load(Ordering::Relaxed),
            n as u64,
            "every call answered"
        );
        let tp = n as f64 / took.as_secs_f64();
        if with_layer { &mut idem } else { &mut bare }.push((tp, per_call));
    }
    let mean =
        |v: &[(f64, f64)], f: fn(&(f64, f64)) -> f64| v.iter().map(f).sum::<f64>() / v.len() as f64;
    let (bare_tp, idem_tp) = (mean(&bare, |x| x.0), mean(&idem, |x| x.0));
    println!(
        "machine rate ({n} fresh calls x2 each, {CONCURRENCY} at a time): bare {bare_tp:.0}/s \
         ({:.1} µs CPU/call), layer on the default memory store {idem_tp:.0}/s ({:.1} µs \
         CPU/call): throughput ratio {:.3}, CPU ratio {:.2}",
        mean(&bare, |x| x.1),
        mean(&idem, |x| x.1),
        idem_tp / bare_tp,
        mean(&idem, |x| x.1) / mean(&bare, |x| x.1),
    );

    // The soak.
    let calls = env_num("IDEM_SOAK_CALLS", 1_000_000.0) as usize;
    let config = config("");
    let layer = IdempotencyLayer::from_config(&config);
    let store = layer.store().clone();
    let settings = store.settings().clone();
    let record = (RESPONSE_BYTES + RECORD_OVERHEAD_BYTES) as f64;
    let holds = (settings.max_bytes as f64 / record).min(settings.max_entries as f64);
    let sustained = holds / settings.min_retention.as_secs_f64();
    let rate = env_num("IDEM_SOAK_RATE", (0.95 * sustained).min(idem_tp));
    println!(
        "soak: {calls} calls, defaults (maxBytes {}, maxEntries {}, minRetention {:?}, one \
         tenant): the store holds {holds:.0} records of {RESPONSE_BYTES}-byte responses, \
         sustains {sustained:.0}/s; paced at {rate:.0}/s",
        settings.max_bytes, settings.max_entries, settings.min_retention
    );
    let s = serve(Some(layer), pad).await;
    let out = Outcomes::new(calls);
    let rss0 = rss();
    let peaks = Arc::new(Mutex::new((0usize, 0usize, rss0)));
    let sampler = {
        let (store, peaks) = (store.clone(), peaks.clone());
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(250)).await;
                let st = store.stats();
                let mut p = peaks.lock().expect("peaks");
                *p = (p.0.max(st.entries), p.1.max(st.bytes), p.2.max(rss()));
            }
        })
    };
    let c0 = cpu();
    let (took, out) = drive_into(s.addr, 1, out, Some(rate)).await;
    let cpu_per_call = (cpu() - c0).as_secs_f64() * 1e6 / calls as f64;
    sampler.abort();
    let st = store.stats();
    let (peak_entries, peak_bytes, peak_rss) = *peaks.lock().expect("peaks");
    let micros: Vec<u64> = out
        .micros
        .iter()
        .map(|m| m.load(Ordering::Relaxed))
        .collect();
    let fill = (holds as usize).min(calls);
    let (filling, evicting) = micros.split_at(fill);
    println!(
        "soak: {calls} calls in {:.1}s = {:.0}/s ({cpu_per_call:.1} µs CPU/call, client and \
         server); ok {}, refused STORE_FULL {} (the first at call {}), other errors {}; \
         store: refusals {} (store bytes {}, tenant bytes {}, store entries {}, tenant \
         entries {}, tenant in flight {}), evicted after minRetention {}, expirations {}, \
         responses not retained {}",
        took.as_secs_f64(),
        calls as f64 / took.as_secs_f64(),
        out.ok.load(Ordering::Relaxed),
        out.store_full.load(Ordering::Relaxed),
        out.first_full.load(Ordering::Relaxed),
        out.other.load(Ordering::Relaxed),
        st.full_rejections,
        st.rejected_store_bytes,
        st.rejected_tenant_bytes,
        st.rejected_store_entries,
        st.rejected_tenant_entries,
        st.rejected_tenant_in_flight,
        st.evicted_after_min_retention,
        st.expirations,
        st.responses_dropped,
    );
    println!(
        "soak: peak records {peak_entries}, peak bytes charged {peak_bytes} ({:.0} per \
         record; at the end {} records, {} bytes); RSS {:.0} MB at the start, peak {:.0} MB: \
         {:.0} bytes per peak record",
        peak_bytes as f64 / peak_entries.max(1) as f64,
        st.entries,
        st.bytes,
        rss0 as f64 / 1e6,
        peak_rss as f64 / 1e6,
        (peak_rss - rss0) as f64 / peak_entries.max(1) as f64,
    );
    let (f50, f99) = (
        percentile(filling.to_vec(), 0.5),
        percentile(filling.to_vec(), 0.99),
    );
    let (e50, e99) = (
        percentile(evicting.to_vec(), 0.5),
        percentile(evicting.to_vec(), 0.99),
    );
    println!(
        "soak latency: filling (calls 0..{fill}) p50 {f50:.2} ms p99 {f99:.2} ms; evicting \
         (the rest) p50 {e50:.2} ms p99 {e99:.2} ms: ratio p50 {:.2}, p99 {:.2}",
        e50 / f50,
        e99 / f99
    );
    // The newest records are within minRetention: each retry replays.
    let runs = s.runs.load(Ordering::Relaxed);
    let mut c = OrdersClient::new(net::channel(s.addr));
    let mut replays = 0;
    for i in calls.saturating_sub(1000)..calls {
        let r = c.create_order(order(&key(1, i))).await.expect("retry");
        replays += usize::from(replayed(&r));
    }
    println!(
        "soak: the newest 1000 keys sent again: {replays} replayed, {} handler runs",
        s.runs.load(Ordering::Relaxed) - runs
    );
}

// ------------------------------------------------------------------ redis

fn info_field(info: &str, name: &str) -> u64 {
    info.lines()
        .find_map(|l| l.strip_prefix(&format!("{name}:")))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

async fn redis(pad: usize) {
    let Some(server) = idem_test_support::redis::RedisServer::start() else {
        println!("redis: SKIPPED (no redis-server)");
        return;
    };
    let info = || match server.cmd(&["INFO", "memory"]) {
        Ok(idem_test_support::redis::RedisReply::Bulk(Some(b))) => {
            String::from_utf8_lossy(&b).into_owned()
        }
        other => panic!("INFO memory: {other:?}"),
    };
    let store = idem_redis::RedisStore::connect(server.url())
        .await
        .expect("connect to the soak redis");
    let config = config("");
    let ttl = config.method_configs()[0]
        .idempotency()
        .expect("protected")
        .record_ttl;
    let s = serve(Some(IdempotencyLayer::new(store, &config)), pad).await;
    let calls = env_num("IDEM_SOAK_REDIS_CALLS", 100_000.0) as usize;
    let before = info_field(&info(), "used_memory");
    let (took, out) = drive(s.addr, 2, calls, None).await;
    let after = info();
    let keys = match server.cmd(&["DBSIZE"]) {
        Ok(idem_test_support::redis::RedisReply::Int(n)) => n,
        other => panic!("DBSIZE: {other:?}"),
    };
    let per_record = (info_field(&after, "used_memory") - before) as f64 / calls as f64;
    let per_gib = (1u64 << 30) as f64 / per_record;
    println!(
        "redis: {calls} calls in {:.1}s ({:.0}/s), ok {}, errors {}; {keys} keys; \
         used_memory +{} bytes = {per_record:.0} bytes per record of a {RESPONSE_BYTES}-byte \
         response (used_memory_rss {}, mem_fragmentation_ratio {}); one GiB of maxmemory \
         holds {per_gib:.0} records: {:.1} calls/s sustained at recordTtl {:?}, {:.0}/s at 1h, \
         {:.0}/s at 10 min",
        took.as_secs_f64(),
        calls as f64 / took.as_secs_f64(),
        out.ok.load(Ordering::Relaxed),
        out.store_full.load(Ordering::Relaxed) + out.other.load(Ordering::Relaxed),
        info_field(&after, "used_memory") - before,
        info_field(&after, "used_memory_rss"),
        after
            .lines()
            .find_map(|l| l.strip_prefix("mem_fragmentation_ratio:"))
            .unwrap_or("?")
            .trim(),
        per_gib / ttl.as_secs_f64(),
        ttl,
        per_gib / 3600.0,
        per_gib / 600.0,
    );
}

// ------------------------------------------------------------------ postgres

async fn postgres(pad: usize) {
    let Some(server) = idem_test_support::postgres::PostgresServer::start_with(&[(
        "shared_preload_libraries",
        "pg_stat_statements",
    )]) else {
        println!("postgres: SKIPPED (no PostgreSQL)");
        return;
    };
    let pool = server.pool(2).await;
    sqlx::query("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        .execute(&pool)
        .await
        .expect("pg_stat_statements");
    let store = idem_postgres::PostgresStore::connect(server.url())
        .await
        .expect("connect to the soak postgres");
    let config = config(r#""recordTtl": "60s""#);
    let s = serve(Some(IdempotencyLayer::new(store, &config)), pad).await;
    let secs = env_num("IDEM_SOAK_PG_SECS", 600.0);
    let rate = env_num("IDEM_SOAK_PG_RATE", 1000.0);
    let calls = (secs * rate) as usize;
    println!(
        "postgres: {calls} calls at {rate:.0}/s, recordTtl 60s, default sweep (every 60s, 1000 a batch)"
    );
    let sampler = {
        let pool = pool.clone();
        tokio::spawn(async move {
            let start = Instant::now();
            loop {
                tokio::time::sleep(Duration::from_secs(30)).await;
                let (rows, expired, size): (i64, i64, i64) = sqlx::query_as(
                    "SELECT count(*), count(*) FILTER (WHERE expires_at <= clock_timestamp()), \
                     pg_total_relation_size('idem_records') FROM idem_records",
                )
                .fetch_one(&pool)
                .await
                .expect("table stats");
                println!(
                    "postgres t={:>4.0}s: rows {rows}, expired {expired}, table+indexes {:.1} MB",
                    start.elapsed().as_secs_f64(),
                    size as f64 / 1e6
                );
            }
        })
    };
    let (took, out) = drive(s.addr, 3, calls, Some(rate)).await;
    sampler.abort();
    let sweep: Option<(i64, f64, i64, f64)> = sqlx::query_as(
        "SELECT calls, total_exec_time, rows, max_exec_time FROM pg_stat_statements \
         WHERE query LIKE 'DELETE FROM idem_records%'",
    )
    .fetch_optional(&pool)
    .await
    .expect("pg_stat_statements");
    let (n, ms, rows, max) = sweep.unwrap_or_default();
    println!(
        "postgres: {calls} calls in {:.1}s ({:.0}/s), ok {}, errors {}; sweep: {n} DELETEs, \
         {rows} rows, {ms:.0} ms in all ({:.2} ms a DELETE, max {max:.1} ms; {:.1} µs a row)",
        took.as_secs_f64(),
        calls as f64 / took.as_secs_f64(),
        out.ok.load(Ordering::Relaxed),
        out.store_full.load(Ordering::Relaxed) + out.other.load(Ordering::Relaxed),
        ms / n.max(1) as f64,
        ms * 1000.0 / rows.max(1) as f64,
    );
}
