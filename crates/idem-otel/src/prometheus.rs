//! The Prometheus text exposition (format 0.0.4) of an OpenTelemetry `MeterProvider`,
//! and a minimal scrape endpoint.
//!
//! Names follow OpenTelemetry's Prometheus conversion: characters other than
//! `[a-zA-Z0-9_:]` become `_`, the unit is appended (`s` → `_seconds`, `By` →
//! `_bytes`; `{…}` annotations are dropped), counters end in `_total`. Attribute keys
//! are converted the same way (`grpc.method` → `grpc_method`).
//!
//! ```no_run
//! # async fn f() -> std::io::Result<()> {
//! let prometheus = idem_otel::prometheus::Prometheus::new();
//! let meter = prometheus.meter("idem");
//! // … build ClientMetrics / ServerMetrics on `meter` …
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:9464").await?;
//! idem_otel::prometheus::serve(listener, prometheus).await
//! # }
//! ```

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use opentelemetry::metrics::{Meter, MeterProvider as _};
use opentelemetry::{KeyValue, Value};
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::metrics::data::{
    AggregatedMetrics, Gauge, Histogram, Metric, MetricData, ResourceMetrics, Sum,
};
use opentelemetry_sdk::metrics::exporter::PushMetricExporter;
use opentelemetry_sdk::metrics::{
    MeterProviderBuilder, PeriodicReader, SdkMeterProvider, Temporality,
};
use tokio::net::TcpListener;

mod endpoint;
pub use endpoint::{DEFAULT_MAX_CONNECTIONS, DEFAULT_REQUEST_TIMEOUT, Endpoint};

/// A `MeterProvider` whose metrics can be rendered as Prometheus text at any moment.
/// Cheap to clone.
#[derive(Clone, Debug)]
pub struct Prometheus {
    provider: SdkMeterProvider,
    text: Arc<Mutex<String>>,
}

impl Default for Prometheus {
    fn default() -> Self {
        Self::new()
    }
}

impl Prometheus {
    /// A provider with only this exposition as its reader.
    pub fn new() -> Self {
        Self::with_provider(SdkMeterProvider::builder())
    }

    /// Adds the exposition to `builder`, which may carry other readers (an OTLP
    /// exporter…) and a resource.
    pub fn with_provider(builder: MeterProviderBuilder) -> Self {
        let text = Arc::new(Mutex::new(String::new()));
        let exporter = TextExporter { text: text.clone() };
        // Rendered on demand (`render` flushes); the periodic export only refreshes it.
        let reader = PeriodicReader::builder(exporter)
            .with_interval(Duration::from_secs(60))
            .build();
        Prometheus {
            provider: builder.with_reader(reader).build(),
            text,
        }
    }

    /// A meter of the provider.
    pub fn meter(&self, name: &'static str) -> Meter {
        self.provider.meter(name)
    }

    /// The provider.
    pub fn provider(&self) -> &SdkMeterProvider {
        &self.provider
    }

    /// Collects every instrument now and returns the exposition. Blocks while the
    /// provider collects (observable callbacks run): from async code, call it on a
    /// blocking thread, as [`serve`] does.
    pub fn render(&self) -> String {
        if let Err(e) = self.provider.force_flush() {
            tracing::warn!(error = %e, "metrics collection failed");
        }
        self.text
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

/// Keeps the text of the last export.
struct TextExporter {
    text: Arc<Mutex<String>>,
}

impl PushMetricExporter for TextExporter {
    async fn export(&self, metrics: &ResourceMetrics) -> OTelSdkResult {
        let text = encode(metrics);
        *self.text.lock().unwrap_or_else(PoisonError::into_inner) = text;
        Ok(())
    }
    fn force_flush(&self) -> OTelSdkResult {
        Ok(())
    }
    fn shutdown_with_timeout(&self, _: Duration) -> OTelSdkResult {
        Ok(())
    }
    fn temporality(&self) -> Temporality {
        Temporality::Cumulative
    }
}

/// One metric family: its `# TYPE`, `# HELP` and, per data point, its labels and
/// sample lines (a histogram's in their order: buckets, `_sum`, `_count`).
struct Family {
    kind: &'static str,
    help: String,
    samples: Vec<(String, Vec<String>)>,
}

/// The Prometheus text exposition of `metrics`, families sorted by name and data points
/// by labels within each.
pub fn encode(metrics: &ResourceMetrics) -> String {
    let mut families: BTreeMap<String, Family> = BTreeMap::new();
    for scope in metrics.scope_metrics() {
        for metric in scope.metrics() {
            add(&mut families, metric);
        }
    }
    let mut out = String::new();
    for (name, f) in &mut families {
        f.samples.sort();
        if !f.help.is_empty() {
            let _ = writeln!(out, "# HELP {name} {}", escape_help(&f.help));
        }
        let _ = writeln!(out, "# TYPE {name} {}", f.kind);
        for s in f.samples.iter().flat_map(|(_, lines)| lines) {
            out.push_str(s);
            out.push('\n');
        }
    }
    out
}

fn add(families: &mut BTreeMap<String, Family>, metric: &Metric) {
    match metric.data() {
        AggregatedMetrics::F64(d) => add_data(families, metric, d),
        AggregatedMetrics::U64(d) => add_data(families, metric, d),
        AggregatedMetrics::I64(d) => add_data(families, metric, d),
    }
}

fn add_data<T: Number>(
    families: &mut BTreeMap<String, Family>,
    metric: &Metric,
    data: &MetricData<T>,
) {
    let base = prom_name(metric.name(), metric.unit());
    match data {
        MetricData::Sum(sum) if sum.is_monotonic() => {
            let name = format!("{}_total", base.trim_end_matches("_total"));
            sums(family(families, metric, &name, "counter"), &name, sum);
        }
        MetricData::Sum(sum) => sums(family(families, metric, &base, "gauge"), &base, sum),
        MetricData::Gauge(g) => gauges(family(families, metric, &base, "gauge"), &base, g),
        MetricData::Histogram(h) => {
            histograms(family(families, metric, &base, "histogram"), &base, h)
        }
        MetricData::ExponentialHistogram(_) => {
            tracing::debug!(
                metric = metric.name(),
                "exponential histograms are not exposed"
            );
        }
    }
}

/// The numbers the SDK aggregates, written as Prometheus writes them.
trait Number: Copy {
    fn text(self) -> String;
}
impl Number for f64 {
    fn text(self) -> String {
        float(self)
    }
}
impl Number for u64 {
    fn text(self) -> String {
        self.to_string()
    }
}
impl Number for i64 {
    fn text(self) -> String {
        self.to_string()
    }
}

fn float(v: f64) -> String {
    if v.is_infinite() {
        if v > 0.0 {
            "+Inf".into()
        } else {
            "-Inf".into()
        }
    } else if v.is_nan() {
        "NaN".into()
    } else {
        format!("{v}")
    }
}

/// The family `name` of `kind` in `families`, made (with `metric`'s description) if new.
fn family<'f>(
    families: &'f mut BTreeMap<String, Family>,
    metric: &Metric,
    name: &str,
    kind: &'static str,
) -> &'f mut Family {
    families.entry(name.to_owned()).or_insert_with(|| Family {
        kind,
        help: metric.description().to_owned(),
        samples: Vec::new(),
    })
}

fn sums<T: Number>(f: &mut Family, name: &str, sum: &Sum<T>) {
    samples(
        f,
        name,
        sum.data_points().map(|p| (p.attributes(), p.value())),
    );
}

fn gauges<T: Number>(f: &mut Family, name: &str, g: &Gauge<T>) {
    samples(
        f,
        name,
        g.data_points().map(|p| (p.attributes(), p.value())),
    );
}

/// One sample line per point (its attributes and value): a sum's or a gauge's.
fn samples<'a, T: Number, A: Iterator<Item = &'a KeyValue>>(
    f: &mut Family,
    name: &str,
    points: impl Iterator<Item = (A, T)>,
) {
    for (attributes, value) in points {
        let l = labels(attributes, None);
        let line = format!("{name}{l} {}", value.text());
        f.samples.push((l, vec![line]));
    }
}

fn histograms<T: Number>(f: &mut Family, name: &str, h: &Histogram<T>) {
    for p in h.data_points() {
        let mut lines = Vec::new();
        let mut cumulative = 0;
        for (bound, count) in p.bounds().zip(p.bucket_counts()) {
            cumulative += count;
            let le = labels(p.attributes(), Some(&float(bound)));
            lines.push(format!("{name}_bucket{le} {cumulative}"));
        }
        let inf = labels(p.attributes(), Some("+Inf"));
        lines.push(format!("{name}_bucket{inf} {}", p.count()));
        let plain = labels(p.attributes(), None);
        lines.push(format!("{name}_sum{plain} {}", p.sum().text()));
        lines.push(format!("{name}_count{plain} {}", p.count()));
        f.samples.push((plain, lines));
    }
}

/// `{a="x",b="y"}` (sorted by key), with `le` last when given; empty without labels.
fn labels<'a>(attrs: impl Iterator<Item = &'a KeyValue>, le: Option<&str>) -> String {
    let mut pairs: Vec<(String, String)> = attrs
        .map(|kv| {
            (
                sanitize(kv.key.as_str()),
                escape_value(&value_text(&kv.value)),
            )
        })
        .collect();
    pairs.sort();
    if let Some(le) = le {
        pairs.push(("le".into(), le.into()));
    }
    if pairs.is_empty() {
        return String::new();
    }
    let inner: Vec<String> = pairs.iter().map(|(k, v)| format!("{k}=\"{v}\"")).collect();
    format!("{{{}}}", inner.join(","))
}

fn value_text(v: &Value) -> String {
    v.as_str().into_owned()
}

/// OpenTelemetry's metric name to Prometheus's: sanitized, with the unit's suffix.
pub fn prom_name(name: &str, unit: &str) -> String {
    let mut n = sanitize(name);
    let suffix = match unit {
        "s" => Some("seconds"),
        "ms" => Some("milliseconds"),
        "By" => Some("bytes"),
        u if u.is_empty() || u.starts_with('{') || u == "1" => None,
        u => Some(u),
    };
    if let Some(s) = suffix {
        let s = sanitize(s);
        if !n.ends_with(&format!("_{s}")) {
            n.push('_');
            n.push_str(&s);
        }
    }
    n
}

fn sanitize(s: &str) -> String {
    let mut out: String = s
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' || c == ':' {
                c
            } else {
                '_'
            }
        })
        .collect();
    if out.starts_with(|c: char| c.is_ascii_digit()) {
        out.insert(0, '_');
    }
    out
}

fn escape_value(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fn escape_help(s: &str) -> String {
    s.replace('\\', "\\\\").replace('\n', "\\n")
}

/// Answers `GET /metrics` (any other path: 404) on `listener` with the exposition of
/// `prometheus`, one short request per connection (`Connection: close`), as Prometheus
/// scrapes; with [`Endpoint`]'s default bounds (at most [`DEFAULT_MAX_CONNECTIONS`]
/// connections, each closed after [`DEFAULT_REQUEST_TIMEOUT`]). Runs until the future
/// is dropped: an accept error (`EMFILE`…) is logged and retried after a backoff, never
/// returned.
pub async fn serve(listener: TcpListener, prometheus: Prometheus) -> std::io::Result<()> {
    Endpoint::new(prometheus).serve(listener).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_the_otel_to_prometheus_conversion() {
        assert_eq!(
            prom_name("grpc.client.call.duration", "s"),
            "grpc_client_call_duration_seconds"
        );
        assert_eq!(
            prom_name("grpc.client.attempt.started", "{attempt}"),
            "grpc_client_attempt_started"
        );
        assert_eq!(
            prom_name("idem.store.memory.size", "By"),
            "idem_store_memory_size_bytes"
        );
    }

    #[test]
    fn renders_counters_gauges_and_histograms() {
        let p = Prometheus::new();
        let m = p.meter("t");
        let c = m
            .u64_counter("a.calls")
            .with_unit("{call}")
            .with_description("Calls.")
            .build();
        c.add(2, &[KeyValue::new("grpc.method", "x/\"y\"")]);
        let h = m
            .f64_histogram("a.d")
            .with_unit("s")
            .with_boundaries(vec![0.1, 1.0])
            .build();
        h.record(0.5, &[]);
        let text = p.render();
        for line in [
            "# TYPE a_calls_total counter\n",
            "a_calls_total{grpc_method=\"x/\\\"y\\\"\"} 2\n",
            "a_d_seconds_bucket{le=\"0.1\"} 0\n",
            "a_d_seconds_bucket{le=\"1\"} 1\n",
            "a_d_seconds_bucket{le=\"+Inf\"} 1\n",
            "a_d_seconds_bucket{le=\"+Inf\"} 1\na_d_seconds_sum 0.5\na_d_seconds_count 1\n",
        ] {
            assert!(text.contains(line), "{line:?} not in {text}");
        }
    }

    /// Through the public `serve` on a real socket: a connection that never sends a
    /// request is closed at the default request timeout instead of being held for ever.
    #[tokio::test(start_paused = true)]
    async fn serve_closes_a_connection_that_sends_nothing() {
        use tokio::io::AsyncReadExt;
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(serve(listener, Prometheus::new()));
        let mut idle = tokio::net::TcpStream::connect(addr).await.unwrap();
        let began = tokio::time::Instant::now();
        let mut out = Vec::new();
        let read =
            tokio::time::timeout(DEFAULT_REQUEST_TIMEOUT * 2, idle.read_to_end(&mut out)).await;
        assert!(read.is_ok(), "still open after twice the request timeout");
        assert!(out.is_empty());
        assert_eq!(began.elapsed(), DEFAULT_REQUEST_TIMEOUT);
    }
}
