//! The layers bench's machine-readable results and the markdown table made from them.
//!
//! - `IDEM_BENCH_JSON=FILE cargo bench --bench layers -- …` writes `{"rows": [...]}`:
//!   one row per A/B pair, `{"id", "conc", "ratio", "cpu_us_baseline", "cpu_us_layer",
//!   "cpu_us_delta", "cpu_ratio"}` (plus the row's name, its throughput and latency
//!   columns and its target, for the table), `{"id": "redis_round_trips", "fresh": n,
//!   "replay": n}` when the Redis section ran, and `{"id": "postgres_statements",
//!   "fresh": n, "replay": n}` when the PostgreSQL one did.
//! - `cargo bench --bench layers -- table FILE...` prints BENCHMARKS.md's table from one
//!   or more such files: each number is the median over the files (three runs: the
//!   middle one), with each run's CPU ratio beside it and the verdict of issue 34's
//!   targets on the median.
//!
//! The ids of the rows the targets name are stable (`STABLE`); every other row's id is
//! its name made into a slug, with `_c<conc>`.

use serde_json::{Value, json};

/// Row names (as the table prints them) and the stable id each gets, before `_c<conc>`.
const STABLE: &[(&str, &str)] = &[
    (
        "client: RetryLayer vs bare Channel + the same key header by hand",
        "client_machinery",
    ),
    ("client: RetryLayer vs bare Channel", "client_vs_bare"),
    (
        "client: RetryLayer, method without a retryPolicy, vs bare Channel + the same key header by hand",
        "client_no_policy",
    ),
    (
        "peer: RetryLayer vs tower::retry::Retry (buffered request, key by hand)",
        "client_vs_tower_retry",
    ),
    (
        "server: fresh keys, MemoryStore vs bare",
        "server_fresh_memory",
    ),
    ("server: fresh keys, floor layer vs bare", "server_floor"),
    (
        "server: fresh keys, MemoryStore vs floor layer",
        "server_fresh_vs_floor",
    ),
    (
        "server: replay (50 µs busy-spin handler) vs bare",
        "server_replay",
    ),
    (
        "server: fresh keys, RedisStore vs MemoryStore",
        "redis_fresh",
    ),
    ("server: replay, RedisStore vs MemoryStore", "redis_replay"),
    (
        "server: fresh keys, PostgresStore vs MemoryStore",
        "postgres_fresh",
    ),
    (
        "server: replay, PostgresStore vs MemoryStore",
        "postgres_replay",
    ),
];

/// Issue 34's targets (and one proposed), by id: what is compared, the bound, and the
/// text the table shows.
const TARGETS: &[(&str, Field, Bound, &str)] = &[
    (
        "client_machinery_c64",
        Field::Cpu,
        Bound::AtMost(1.03),
        "CPU ≤ 1.03×",
    ),
    (
        "client_vs_tower_retry_c64",
        Field::Cpu,
        Bound::AtMost(1.03),
        "CPU ≤ tower × 1.03",
    ),
    (
        "server_fresh_memory_c64",
        Field::Cpu,
        Bound::AtMost(1.05),
        "CPU ≤ 1.05×",
    ),
    // Not issue 34's: the restatement its session-16 note proposes (idem's own cost over
    // the least any buffering layer pays; see BENCHMARKS.md, "The floor").
    (
        "server_fresh_vs_floor_c64",
        Field::Cpu,
        Bound::AtMost(1.05),
        "proposed: CPU ≤ 1.05× the floor",
    ),
    (
        "server_replay_c1",
        Field::Throughput,
        Bound::AtLeast(1.0),
        "≥ 1.0× bare",
    ),
    (
        "server_replay_c64",
        Field::Throughput,
        Bound::AtLeast(1.0),
        "≥ 1.0× bare",
    ),
    (
        "redis_fresh_c64",
        Field::Cpu,
        Bound::AtMost(1.35),
        "CPU ≤ 1.35× memory",
    ),
];

#[derive(Clone, Copy)]
enum Field {
    Cpu,
    Throughput,
}

#[derive(Clone, Copy)]
enum Bound {
    AtMost(f64),
    AtLeast(f64),
}

/// The id of row `name` at `conc` callers.
pub(crate) fn id_of(name: &str, conc: usize) -> String {
    let base = STABLE
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, id)| (*id).to_owned())
        .unwrap_or_else(|| slug(name));
    format!("{base}_c{conc}")
}

fn slug(name: &str) -> String {
    let mut s = String::new();
    for c in name.chars() {
        if c.is_ascii_alphanumeric() {
            s.push(c.to_ascii_lowercase());
        } else if !s.ends_with('_') && !s.is_empty() {
            s.push('_');
        }
    }
    s.trim_end_matches('_').to_owned()
}

/// The measured numbers of one row, as the JSON file holds them.
pub(crate) struct RowNumbers {
    pub(crate) base_tp: f64,
    pub(crate) tp: f64,
    pub(crate) tp_ratio: f64,
    pub(crate) tp_range: (f64, f64),
    pub(crate) base_p50: f64,
    pub(crate) p50: f64,
    pub(crate) p50_ratio: f64,
    pub(crate) base_p99: f64,
    pub(crate) p99: f64,
    pub(crate) p99_ratio: f64,
    pub(crate) base_cpu: f64,
    pub(crate) cpu: f64,
    pub(crate) cpu_ratio: f64,
}

/// One A/B row.
pub(crate) fn row(name: &str, conc: usize, n: &RowNumbers, target: &str) -> Value {
    json!({
        "id": id_of(name, conc),
        "conc": conc,
        "ratio": round(n.tp_ratio, 4),
        "cpu_us_baseline": round(n.base_cpu, 2),
        "cpu_us_layer": round(n.cpu, 2),
        "cpu_us_delta": round(n.cpu - n.base_cpu, 2),
        "cpu_ratio": round(n.cpu_ratio, 4),
        "name": name,
        "ratio_min": round(n.tp_range.0, 4),
        "ratio_max": round(n.tp_range.1, 4),
        "calls_per_s_baseline": round(n.base_tp, 0),
        "calls_per_s_layer": round(n.tp, 0),
        "p50_us_baseline": round(n.base_p50, 1),
        "p50_us_layer": round(n.p50, 1),
        "p50_ratio": round(n.p50_ratio, 4),
        "p99_us_baseline": round(n.base_p99, 1),
        "p99_us_layer": round(n.p99, 1),
        "p99_ratio": round(n.p99_ratio, 4),
        "target": target,
    })
}

/// The Redis round trips per call, from `INFO commandstats`.
pub(crate) fn round_trips(fresh: f64, replay: f64) -> Value {
    json!({"id": "redis_round_trips", "fresh": round(fresh, 2), "replay": round(replay, 2)})
}

fn round(x: f64, digits: i32) -> f64 {
    let k = 10f64.powi(digits);
    (x * k).round() / k
}

/// The PostgreSQL statements per call, from `pg_stat_statements`.
pub(crate) fn statements(fresh: f64, replay: f64) -> Value {
    json!({"id": "postgres_statements", "fresh": round(fresh, 2), "replay": round(replay, 2)})
}

/// Writes `{"rows": rows}` to `path`.
pub(crate) fn write(path: &str, rows: &[Value]) {
    let doc = json!({ "rows": rows });
    let text = serde_json::to_string_pretty(&doc).expect("rows serialize");
    std::fs::write(path, text + "\n").unwrap_or_else(|e| panic!("write {path}: {e}"));
    println!("wrote {} rows to {path}", rows.len());
}

/// The markdown table of the rows in `files` (each a `{"rows": [...]}` of one run):
/// every number the median over the runs, in the first file's row order.
pub(crate) fn table(files: &[String]) -> String {
    let runs: Vec<Vec<Value>> = files
        .iter()
        .map(|f| {
            let text = std::fs::read_to_string(f).unwrap_or_else(|e| panic!("read {f}: {e}"));
            let doc: Value =
                serde_json::from_str(&text).unwrap_or_else(|e| panic!("{f} is not JSON: {e}"));
            doc["rows"]
                .as_array()
                .unwrap_or_else(|| panic!("{f}: no \"rows\" array"))
                .clone()
        })
        .collect();
    let Some(first) = runs.first() else {
        return "no files given: `-- table FILE...`\n".into();
    };
    let runs_of = |id: &str| -> Vec<&Value> {
        runs.iter()
            .filter_map(|rows| rows.iter().find(|r| r["id"] == id))
            .collect()
    };
    let med = |rows: &[&Value], key: &str| -> f64 {
        median(rows.iter().filter_map(|r| r[key].as_f64()).collect())
    };
    let mut out = format!(
        "Median of {} run(s){}.\n\n",
        runs.len(),
        if runs.len() > 1 {
            "; \"CPU ratio, each run\" in file order"
        } else {
            ""
        }
    );
    out.push_str(
        "| id | scenario | conc. | baseline calls/s | layer calls/s | throughput ratio (range over rounds) | \
         baseline p50 µs | layer p50 µs | baseline p99 µs | layer p99 µs | \
         baseline CPU µs/call | layer CPU µs/call | CPU Δ µs | CPU ratio | CPU ratio, each run | target |\n\
         |---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|\n",
    );
    let mut notes = Vec::new();
    for r in first {
        let id = r["id"].as_str().unwrap_or("");
        let rows = runs_of(id);
        if r.get("conc").is_none() {
            if id == "postgres_statements" {
                notes.push(format!(
                    "- PostgreSQL statements per call (pg_stat_statements): fresh **{:.2}**, \
                     replay **{:.2}**",
                    med(&rows, "fresh"),
                    med(&rows, "replay"),
                ));
            }
            if id == "redis_round_trips" {
                notes.push(format!(
                    "- Redis round trips per call (INFO commandstats): fresh **{:.2}**, replay **{:.2}** \
                     (targets 2 and 1: {})",
                    med(&rows, "fresh"),
                    med(&rows, "replay"),
                    verdict(med(&rows, "fresh") <= 2.0 && med(&rows, "replay") <= 1.0),
                ));
            }
            continue;
        }
        let each: Vec<String> = rows
            .iter()
            .filter_map(|r| r["cpu_ratio"].as_f64())
            .map(|x| format!("{x:.3}"))
            .collect();
        let (tp, cpu) = (med(&rows, "ratio"), med(&rows, "cpu_ratio"));
        let target = match TARGETS.iter().find(|t| t.0 == id) {
            Some((_, field, bound, text)) => {
                let x = match field {
                    Field::Cpu => cpu,
                    Field::Throughput => tp,
                };
                let ok = match bound {
                    Bound::AtMost(b) => x <= *b,
                    Bound::AtLeast(b) => x >= *b,
                };
                format!("{text}: {}", verdict(ok))
            }
            None => r["target"].as_str().unwrap_or("").to_owned(),
        };
        out.push_str(&format!(
            "| `{id}` | {} | {} | {:.0} | {:.0} | **{tp:.3}** ({:.2}–{:.2}) | {:.0} | {:.0} | {:.0} | {:.0} | \
             {:.1} | {:.1} | {:+.1} | **{cpu:.3}** | {} | {target} |\n",
            r["name"].as_str().unwrap_or(""),
            r["conc"],
            med(&rows, "calls_per_s_baseline"),
            med(&rows, "calls_per_s_layer"),
            med(&rows, "ratio_min"),
            med(&rows, "ratio_max"),
            med(&rows, "p50_us_baseline"),
            med(&rows, "p50_us_layer"),
            med(&rows, "p99_us_baseline"),
            med(&rows, "p99_us_layer"),
            med(&rows, "cpu_us_baseline"),
            med(&rows, "cpu_us_layer"),
            med(&rows, "cpu_us_delta"),
            each.join(", "),
        ));
    }
    if !notes.is_empty() {
        out.push('\n');
        out.push_str(&notes.join("\n"));
        out.push('\n');
    }
    out
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    match xs.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => xs[n / 2],
        n => (xs[n / 2 - 1] + xs[n / 2]) / 2.0,
    }
}

fn verdict(ok: bool) -> &'static str {
    if ok { "met" } else { "MISSED" }
}
