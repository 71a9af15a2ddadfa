//! One truth for the metrics: the README's metric table and this crate's docs table name
//! exactly the instruments [`ClientMetrics`] and [`ServerMetrics`] register, with their
//! units and types, and the outcome values they list are the ones the layers report.
//!
//! The instruments are read where they are made: a meter whose instrument provider writes
//! down every instrument built on it (name, kind, unit), then hands out a no-op one.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

use idem_client::retry::{CallOutcome, RetryLayer};
use idem_otel::{ClientMetrics, ServerMetrics};
use idem_server::idempotency::IdempotencyLayer;
use idem_store::memory::MemoryStore;
use opentelemetry::metrics::{
    AsyncInstrumentBuilder, Counter, Gauge, Histogram, HistogramBuilder, InstrumentBuilder,
    InstrumentProvider, Meter, ObservableCounter, ObservableGauge,
};

mod support;

const README: &str = include_str!("../../../README.md");
const CRATE_DOCS: &str = include_str!("../src/lib.rs");
const SERVER_METRICS_DOCS: &str = include_str!("../../idem-server/src/metrics.rs");

/// Every instrument built on it: name → (type as the tables write it, unit).
#[derive(Default)]
struct Recorder(Mutex<BTreeMap<String, (String, String)>>);

/// Hands out the API's no-op instruments (the trait's default methods).
struct Noop;
impl InstrumentProvider for Noop {}

impl Recorder {
    fn note(&self, name: &str, kind: &str, unit: Option<&str>) {
        let unit = unit.unwrap_or("").to_owned();
        let old = self
            .0
            .lock()
            .unwrap()
            .insert(name.to_string(), (kind.to_owned(), unit));
        assert!(old.is_none(), "{name} registered twice");
    }
}

impl InstrumentProvider for Recorder {
    fn u64_counter(&self, b: InstrumentBuilder<'_, Counter<u64>>) -> Counter<u64> {
        self.note(&b.name, "counter", b.unit.as_deref());
        Noop.u64_counter(b)
    }
    fn f64_counter(&self, b: InstrumentBuilder<'_, Counter<f64>>) -> Counter<f64> {
        self.note(&b.name, "counter", b.unit.as_deref());
        Noop.f64_counter(b)
    }
    fn u64_observable_counter(
        &self,
        b: AsyncInstrumentBuilder<'_, ObservableCounter<u64>, u64>,
    ) -> ObservableCounter<u64> {
        self.note(&b.name, "counter", b.unit.as_deref());
        Noop.u64_observable_counter(b)
    }
    fn u64_gauge(&self, b: InstrumentBuilder<'_, Gauge<u64>>) -> Gauge<u64> {
        self.note(&b.name, "gauge", b.unit.as_deref());
        Noop.u64_gauge(b)
    }
    fn f64_gauge(&self, b: InstrumentBuilder<'_, Gauge<f64>>) -> Gauge<f64> {
        self.note(&b.name, "gauge", b.unit.as_deref());
        Noop.f64_gauge(b)
    }
    fn u64_observable_gauge(
        &self,
        b: AsyncInstrumentBuilder<'_, ObservableGauge<u64>, u64>,
    ) -> ObservableGauge<u64> {
        self.note(&b.name, "gauge", b.unit.as_deref());
        Noop.u64_observable_gauge(b)
    }
    fn f64_observable_gauge(
        &self,
        b: AsyncInstrumentBuilder<'_, ObservableGauge<f64>, f64>,
    ) -> ObservableGauge<f64> {
        self.note(&b.name, "gauge", b.unit.as_deref());
        Noop.f64_observable_gauge(b)
    }
    fn f64_histogram(&self, b: HistogramBuilder<'_, Histogram<f64>>) -> Histogram<f64> {
        self.note(&b.name, "histogram", b.unit.as_deref());
        Noop.f64_histogram(b)
    }
    fn u64_histogram(&self, b: HistogramBuilder<'_, Histogram<u64>>) -> Histogram<u64> {
        self.note(&b.name, "histogram", b.unit.as_deref());
        Noop.u64_histogram(b)
    }
}

/// What every public constructor and `watch*` method of both sides registers.
fn registered() -> BTreeMap<String, (String, String)> {
    let recorder = Arc::new(Recorder::default());
    let meter = Meter::new(recorder.clone());
    let config = support::config(true);
    let client = ClientMetrics::new(&meter, "dns:///orders:50051", &config);
    let retry = RetryLayer::builder()
        .service_config(config.clone())
        .observer(client.clone())
        .build()
        .expect("a retry layer");
    client.watch(&retry);
    let server = ServerMetrics::new(&meter, &config);
    let store = MemoryStore::new(config.settings().memory_store.clone());
    server.watch_memory_store(&store);
    let layer = IdempotencyLayer::new(server.instrument_store(store, "memory"), &config)
        .observer(server.clone());
    server.watch(&layer);
    recorder.0.lock().unwrap().clone()
}

/// The rows of the metric table that follows `header` in `text` (with `prefix` cut from
/// each line, `//! ` for crate docs): name → (type, unit, labels, meaning). A row naming
/// `a.b.x`, `.y`, `.z` with units `u1`, `u2`, `u3` (`,` or `/` between) is three rows.
fn table(text: &str, prefix: &str) -> BTreeMap<String, (String, String, String, String)> {
    let mut rows = BTreeMap::new();
    let lines = text
        .lines()
        .map(|l| l.strip_prefix(prefix.trim_end()).unwrap_or(l).trim())
        .skip_while(|l| !l.starts_with("| name | type | unit |"))
        .skip(2)
        .take_while(|l| l.starts_with('|'));
    for line in lines {
        let cells: Vec<&str> = line.trim_matches('|').split('|').map(str::trim).collect();
        assert_eq!(cells.len(), 5, "{line}");
        let split = |cell: &str| -> Vec<String> {
            cell.split([',', '/'])
                .map(|s| s.trim().trim_matches('`').to_owned())
                .filter(|s| !s.is_empty())
                .collect()
        };
        let names = split(cells[0]);
        let units = split(cells[2]);
        let base = names[0]
            .rsplit_once('.')
            .expect("a dotted name")
            .0
            .to_owned();
        for (i, name) in names.iter().enumerate() {
            let name = match name.strip_prefix('.') {
                Some(leaf) => format!("{base}.{leaf}"),
                None => name.clone(),
            };
            let unit = units.get(i).or(units.first()).expect("a unit").clone();
            let row = (
                cells[1].to_owned(),
                unit,
                cells[3].to_owned(),
                cells[4].to_owned(),
            );
            assert!(rows.insert(name.clone(), row).is_none(), "{name} twice");
        }
    }
    assert!(!rows.is_empty(), "no metric table");
    rows
}

/// The backticked words of `text`.
fn backticked(text: &str) -> BTreeSet<String> {
    text.split('`')
        .skip(1)
        .step_by(2)
        .map(str::to_owned)
        .collect()
}

fn check_table(which: &str, rows: &BTreeMap<String, (String, String, String, String)>) {
    let registered = registered();
    let documented: BTreeSet<&String> = rows.keys().collect();
    let made: BTreeSet<&String> = registered.keys().collect();
    assert_eq!(documented, made, "{which}: documented vs registered names");
    for (name, (kind, unit)) in &registered {
        let (doc_kind, doc_unit, _, _) = &rows[name];
        assert_eq!(doc_kind, kind, "{which}: type of {name}");
        assert_eq!(doc_unit, unit, "{which}: unit of {name}");
    }
}

#[test]
fn the_readme_table_is_what_the_instruments_register() {
    check_table("README", &table(README, ""));
}

#[test]
fn the_crate_docs_table_is_what_the_instruments_register() {
    check_table("idem-otel docs", &table(CRATE_DOCS, "//! "));
}

#[test]
fn the_tables_list_every_client_outcome_committed_first() {
    let all: BTreeSet<String> = CallOutcome::ALL
        .iter()
        .map(|o| o.as_str().to_owned())
        .collect();
    for (which, rows) in [
        ("README", table(README, "")),
        ("idem-otel docs", table(CRATE_DOCS, "//! ")),
    ] {
        let meaning = &rows["idem.client.call.outcome"].3;
        let listed: BTreeSet<String> = backticked(meaning)
            .into_iter()
            .filter(|w| w.chars().all(|c| c.is_ascii_lowercase() || c == '_'))
            .collect();
        assert_eq!(listed, all, "{which}: idem.client.call.outcome values");
        // The normal end of a successful tonic call is `committed`; `ok` is Trailers-Only.
        assert!(
            meaning.find("`committed`") < meaning.find("`ok`"),
            "{which}: {meaning}"
        );
    }
}

#[test]
fn the_tables_list_the_server_outcomes_the_layer_documents() {
    // idem-server's metrics docs list the outcomes it reports (`# Outcomes`), passthrough
    // in the paragraph after.
    let section = SERVER_METRICS_DOCS
        .split("//! # Outcomes")
        .nth(1)
        .and_then(|s| s.split("//! Records").next())
        .expect("idem-server's # Outcomes section")
        .replace("//!", " ");
    let words = backticked(&section);
    let outcomes: BTreeSet<String> = words
        .iter()
        .filter(|w| w.chars().all(|c| c.is_ascii_lowercase() || c == '_'))
        // The config object the paragraph names, not an outcome.
        .filter(|w| *w != "idempotency")
        .cloned()
        .collect();
    assert!(outcomes.contains("passthrough"), "{outcomes:?}");
    assert!(words.contains("TENANT_SOURCE_MISSING"), "{words:?}");
    for (which, rows) in [
        ("README", table(README, "")),
        ("idem-otel docs", table(CRATE_DOCS, "//! ")),
    ] {
        let meaning = &rows["idem.server.call.outcome"].3;
        // Comma-separated, each outcome first in its item (backticked or not).
        let listed: BTreeSet<String> = meaning
            .replace(": ", ", ")
            .split(", ")
            .map(|w| w.trim_start_matches('`'))
            .map(|w| w.split(['`', ' ', '(']).next().unwrap_or("").to_owned())
            .filter(|w| outcomes.contains(w))
            .collect();
        assert_eq!(listed, outcomes, "{which}: idem.server.call.outcome values");
    }
}
