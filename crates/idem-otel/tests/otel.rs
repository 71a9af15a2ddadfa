//! idem's metrics end to end: a real tonic client and server on 127.0.0.1, the layers'
//! observers recorded through OpenTelemetry into the SDK's in-memory exporter, checked by
//! name, unit, labels and value for scripted scenarios; the Prometheus endpoint over real
//! HTTP; label cardinality under 10,000 distinct keys.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use idem_client::retry::RetryLayer;
use idem_core::config::ServiceConfig;
use idem_otel::{ClientMetrics, ServerMetrics};
use idem_server::idempotency::IdempotencyLayer;
use idem_store::faulty::{FaultyStore, StoreFault as Fault};
use idem_store::instrumented::StoreOp as Op;
use idem_store::{Store, memory::MemoryStore};
use idem_test_support::net;
use idem_test_support::shop::Order;
use idem_test_support::shop::orders_client::OrdersClient;
use opentelemetry::metrics::{Meter, MeterProvider as _};
use opentelemetry_sdk::metrics::data::{AggregatedMetrics, MetricData, ResourceMetrics};
use opentelemetry_sdk::metrics::{InMemoryMetricExporter, PeriodicReader, SdkMeterProvider};
use tokio::task::JoinHandle;
use tonic::transport::Channel;
use tonic::{Code, Response, Status};

mod support;
use support::{config, keyed, order, serve};

const METHOD: &str = "shop.v1.Orders/CreateOrder";

/// An OpenTelemetry pipeline into the SDK's in-memory exporter.
struct Otel {
    provider: SdkMeterProvider,
    exporter: InMemoryMetricExporter,
}

/// One data point: its attributes and value.
#[derive(Debug, Clone)]
struct Point {
    attrs: Vec<(String, String)>,
    value: Value,
}

#[derive(Debug, Clone, PartialEq)]
enum Value {
    Sum(f64),
    Gauge(f64),
    Histogram { count: u64, sum: f64 },
}

impl Otel {
    fn new() -> Self {
        let exporter = InMemoryMetricExporter::default();
        let reader = PeriodicReader::builder(exporter.clone())
            .with_interval(Duration::from_secs(3600))
            .build();
        Otel {
            provider: SdkMeterProvider::builder().with_reader(reader).build(),
            exporter,
        }
    }

    fn meter(&self) -> Meter {
        self.provider.meter("idem-test")
    }

    fn collect(&self) -> ResourceMetrics {
        self.exporter.reset();
        self.provider.force_flush().expect("flush");
        let mut all = self.exporter.get_finished_metrics().expect("metrics");
        all.pop().expect("one export")
    }

    /// Every point of `name`, and its unit (`None`: no such metric).
    fn points(&self, name: &str) -> Option<(String, Vec<Point>)> {
        let rm = self.collect();
        for scope in rm.scope_metrics() {
            for m in scope.metrics() {
                if m.name() == name {
                    return Some((m.unit().to_owned(), points(m.data())));
                }
            }
        }
        None
    }

    /// The value of the one point of `name` whose attributes include `attrs`.
    fn value(&self, name: &str, attrs: &[(&str, &str)]) -> Option<Value> {
        let (_, points) = self.points(name)?;
        let matching: Vec<_> = points
            .into_iter()
            .filter(|p| {
                attrs
                    .iter()
                    .all(|(k, v)| p.attrs.iter().any(|(pk, pv)| pk == k && pv == v))
            })
            .collect();
        assert!(matching.len() <= 1, "{name} {attrs:?}: {matching:#?}");
        matching.into_iter().next().map(|p| p.value)
    }

    fn unit(&self, name: &str) -> String {
        self.points(name)
            .unwrap_or_else(|| panic!("no metric {name}"))
            .0
    }

    fn labels(&self, name: &str) -> Vec<Vec<String>> {
        let (_, points) = self
            .points(name)
            .unwrap_or_else(|| panic!("no metric {name}"));
        points
            .into_iter()
            .map(|p| p.attrs.into_iter().map(|(k, _)| k).collect())
            .collect()
    }

    /// The value of the one sum point of `name` whose attributes include `attrs`.
    fn sum(&self, name: &str, attrs: &[(&str, &str)]) -> f64 {
        match self.value(name, attrs) {
            Some(Value::Sum(v)) => v,
            other => panic!("{name} {attrs:?}: {other:?}"),
        }
    }

    /// The value of the one gauge point of `name` whose attributes include `attrs`.
    fn gauge(&self, name: &str, attrs: &[(&str, &str)]) -> f64 {
        match self.value(name, attrs) {
            Some(Value::Gauge(v)) => v,
            other => panic!("{name} {attrs:?}: {other:?}"),
        }
    }

    /// The count of the one histogram point of `name` whose attributes include `attrs`.
    fn count(&self, name: &str, attrs: &[(&str, &str)]) -> u64 {
        match self.value(name, attrs) {
            Some(Value::Histogram { count, .. }) => count,
            other => panic!("{name} {attrs:?}: {other:?}"),
        }
    }

    /// Waits (server metrics are recorded once the record is written, just after the
    /// response) until `name` with `attrs` has `want`.
    async fn expect(&self, name: &str, attrs: &[(&str, &str)], want: Value) {
        for _ in 0..200 {
            if self.value(name, attrs).as_ref() == Some(&want) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let (unit, points) = self.points(name).unwrap_or_default();
        panic!("{name} {attrs:?}: want {want:?}; have ({unit}) {points:#?}");
    }

    /// Waits until `n` calls with `attrs` have been counted in `idem.server.call.outcome`.
    async fn expect_outcomes(&self, attrs: &[(&str, &str)], n: f64) {
        self.expect("idem.server.call.outcome", attrs, Value::Sum(n))
            .await;
    }

    /// Waits until `n` outcomes have been stored.
    async fn expect_stored(&self, n: f64) {
        let stored = [("idem.record", "stored")];
        self.expect("idem.server.record.outcome", &stored, Value::Sum(n))
            .await;
    }
}

fn points(data: &AggregatedMetrics) -> Vec<Point> {
    fn attrs<'a>(kvs: impl Iterator<Item = &'a opentelemetry::KeyValue>) -> Vec<(String, String)> {
        let mut v: Vec<_> = kvs
            .map(|kv| (kv.key.to_string(), kv.value.to_string()))
            .collect();
        v.sort();
        v
    }
    // Each data point type has its own accessors: `each!` maps one kind's points.
    macro_rules! each {
        ($points:expr, |$p:ident| $value:expr) => {
            $points
                .map(|$p| Point {
                    attrs: attrs($p.attributes()),
                    value: $value,
                })
                .collect()
        };
    }
    macro_rules! of {
        ($d:expr) => {
            match $d {
                MetricData::Sum(s) => each!(s.data_points(), |p| Value::Sum(p.value() as f64)),
                MetricData::Gauge(g) => {
                    each!(g.data_points(), |p| Value::Gauge(p.value() as f64))
                }
                MetricData::Histogram(h) => each!(h.data_points(), |p| Value::Histogram {
                    count: p.count(),
                    sum: p.sum() as f64,
                }),
                MetricData::ExponentialHistogram(_) => Vec::new(),
            }
        };
    }
    match data {
        AggregatedMetrics::F64(d) => of!(d),
        AggregatedMetrics::U64(d) => of!(d),
        AggregatedMetrics::I64(d) => of!(d),
    }
}

/// A retrying client of `addr` under `cfg`, its metrics recorded into `otel`, and the
/// `grpc.target` they are labelled with.
fn client(
    otel: &Otel,
    cfg: &ServiceConfig,
    addr: SocketAddr,
) -> (OrdersClient<idem_client::retry::Retry<Channel>>, String) {
    let target = format!("dns:///{addr}");
    let metrics = ClientMetrics::new(&otel.meter(), target.clone(), cfg);
    let layer = RetryLayer::builder()
        .service_config(cfg.clone())
        .observer(metrics.clone())
        .seed(1)
        .build()
        .expect("layer");
    metrics.watch(&layer);
    let svc = tower::Layer::layer(&layer, net::channel(addr));
    (OrdersClient::new(svc), target)
}

/// A metered client of `addr` (see [`client`]) after one `CreateOrder` that succeeds
/// (`why` it should).
async fn ordered(
    otel: &Otel,
    cfg: &ServiceConfig,
    addr: SocketAddr,
    why: &str,
) -> (OrdersClient<idem_client::retry::Retry<Channel>>, String) {
    let (mut c, target) = client(otel, cfg, addr);
    c.create_order(order("a")).await.expect(why);
    (c, target)
}

fn server_layer<St: Store>(
    otel: &Otel,
    cfg: &ServiceConfig,
    store: St,
) -> IdempotencyLayer<idem_store::instrumented::InstrumentedStore<St>> {
    let metrics = ServerMetrics::new(&otel.meter(), cfg);
    let layer = IdempotencyLayer::new(metrics.instrument_store(store, "memory"), cfg)
        .observer(metrics.clone());
    metrics.watch(&layer);
    layer
}

#[tokio::test]
async fn two_retries_then_ok() {
    let otel = Otel::new();
    let cfg = config(false);
    let memory = MemoryStore::default();
    let metrics = ServerMetrics::new(&otel.meter(), &cfg);
    metrics.watch_memory_store(&memory);
    let layer = IdempotencyLayer::new(metrics.instrument_store(memory.clone(), "memory"), &cfg)
        .observer(metrics.clone());
    metrics.watch(&layer);
    let addr = serve(layer, 2).await;
    let (_c, target) = ordered(&otel, &cfg, addr, "ok after two retries").await;

    let m = [("grpc.method", METHOD), ("grpc.target", target.as_str())];
    assert_eq!(otel.unit("grpc.client.attempt.started"), "{attempt}");
    assert_eq!(otel.sum("grpc.client.attempt.started", &m), 3.0);
    assert_eq!(otel.unit("grpc.client.attempt.duration"), "s");
    let unavailable = [m[0], m[1], ("grpc.status", "UNAVAILABLE")];
    let ok = [m[0], m[1], ("grpc.status", "OK")];
    assert_eq!(otel.count("grpc.client.attempt.duration", &unavailable), 2);
    assert_eq!(otel.count("grpc.client.attempt.duration", &ok), 1);
    assert_eq!(otel.unit("grpc.client.call.duration"), "s");
    assert_eq!(otel.count("grpc.client.call.duration", &ok), 1);
    assert_eq!(
        otel.labels("grpc.client.call.duration"),
        [["grpc.method", "grpc.status", "grpc.target"]]
    );
    assert_eq!(otel.unit("grpc.client.call.retries"), "{retry}");
    assert_eq!(
        otel.value("grpc.client.call.retries", &m),
        Some(Value::Histogram { count: 1, sum: 2.0 })
    );
    let Some(Value::Histogram {
        count: 1,
        sum: delay,
    }) = otel.value("grpc.client.call.retry_delay", &m)
    else {
        panic!("one retry_delay");
    };
    assert!(
        (0.015..1.0).contains(&delay),
        "two waits of 10 ms ±20 %: {delay}"
    );
    let committed = [m[0], m[1], ("idem.outcome", "committed")];
    assert_eq!(otel.sum("idem.client.call.outcome", &committed), 1.0);
    assert_eq!(otel.unit("idem.client.call.rescued"), "{call}");
    assert_eq!(
        otel.sum("idem.client.call.rescued", &m),
        1.0,
        "rescued by a retry"
    );
    // The fault sits in front of the server layer: it saw one call, which ran.
    let sm = [("grpc.method", METHOD)];
    otel.expect("grpc.server.call.started", &sm, Value::Sum(1.0))
        .await;
    let executed = [sm[0], ("idem.outcome", "executed")];
    otel.expect_outcomes(&executed, 1.0).await;
    assert_eq!(
        otel.count("grpc.server.call.duration", &[sm[0], ("grpc.status", "OK")]),
        1
    );
    otel.expect_stored(1.0).await;
    assert_eq!(otel.sum("idem.server.stale_fences", &[]), 0.0);
    assert_eq!(otel.gauge("idem.server.handlers.in_flight", &[]), 0.0);
    assert_eq!(otel.gauge("idem.store.memory.entries", &[]), 1.0);
    assert_eq!(otel.unit("idem.store.memory.size"), "By");
    assert!(
        otel.gauge("idem.store.memory.size", &[]) > 0.0,
        "the stored response is charged"
    );
    assert_eq!(
        otel.gauge("idem.store.memory.in_flight", &[]),
        0.0,
        "the record was completed"
    );
    // How full each bound is: one record of a store of millions.
    assert_eq!(otel.unit("idem.store.memory.usage"), "1");
    for bound in idem_store::memory::MemoryBound::ALL {
        let usage = otel.gauge(
            "idem.store.memory.usage",
            &[("idem.store.bound", bound.as_str())],
        );
        assert!((0.0..0.01).contains(&usage), "{bound:?}: {usage}");
    }
    assert!(
        otel.gauge(
            "idem.store.memory.usage",
            &[("idem.store.bound", "store_entries")]
        ) > 0.0
    );
    let claim = [
        ("idem.store.kind", "memory"),
        ("idem.store.operation", "claim"),
        ("idem.store.result", "ok"),
    ];
    assert_eq!(otel.count("idem.store.operation.duration", &claim), 1);
    let complete = [claim[0], ("idem.store.operation", "complete"), claim[2]];
    assert_eq!(otel.count("idem.store.operation.duration", &complete), 1);
    // A series exists once it has a value: none, empty, for the other operations,
    // results or status codes.
    assert_eq!(otel.labels("idem.store.operation.duration").len(), 2);
    assert_eq!(otel.labels("grpc.server.call.duration").len(), 1);
}

#[tokio::test]
async fn throttled() {
    let otel = Otel::new();
    let cfg = config(true);
    let addr = serve(
        server_layer(&otel, &cfg, MemoryStore::default()),
        usize::MAX,
    )
    .await;
    let (mut c, target) = client(&otel, &cfg, addr);
    let s = c.create_order(order("a")).await.unwrap_err();
    assert_eq!(s.code(), Code::Unavailable);
    let m = [("grpc.method", METHOD), ("grpc.target", target.as_str())];
    // 2 tokens, one failure leaves 1 (not above half): no retry.
    assert_eq!(otel.sum("grpc.client.attempt.started", &m), 1.0);
    let throttled = [m[0], m[1], ("idem.outcome", "throttled")];
    assert_eq!(otel.sum("idem.client.call.outcome", &throttled), 1.0);
    let status = [m[0], m[1], ("grpc.status", "UNAVAILABLE")];
    assert_eq!(otel.count("grpc.client.call.duration", &status), 1);
    assert_eq!(
        otel.value("grpc.client.call.retries", &m),
        None,
        "0 retries is not recorded"
    );
    assert_eq!(otel.unit("idem.client.retry_throttle.tokens"), "{token}");
    assert_eq!(
        otel.gauge(
            "idem.client.retry_throttle.tokens",
            &[("grpc.target", target.as_str())]
        ),
        1.0
    );
}

/// `config(false)`'s method, with `guards` as `idem.client`.
fn guarded(guards: &str) -> ServiceConfig {
    ServiceConfig::from_json(&format!(
        r#"{{"methodConfig": [{{
              "name": [{{"service": "shop.v1.Orders", "method": "CreateOrder"}}],
              "retryPolicy": {{"maxAttempts": 5, "initialBackoff": "0.01s", "maxBackoff": "0.01s",
                              "backoffMultiplier": 1, "retryableStatusCodes": ["UNAVAILABLE"]}},
              "idempotency": {{}}
            }}],
            "idem": {{"tenant": {{"single": "t"}}, "client": {guards}}}}}"#
    ))
    .expect("guarded config")
}

#[tokio::test]
async fn the_breaker_and_the_budget_are_measured() {
    let otel = Otel::new();
    let cfg = guarded(
        r#"{"circuitBreaker": {"failureRatio": 1, "minCalls": 2, "openFor": "60s"},
            "retryBudget": {"ratio": 0.5, "minRetriesPerSecond": 0}}"#,
    );
    let addr = serve(
        server_layer(&otel, &cfg, MemoryStore::default()),
        usize::MAX,
    )
    .await;
    let (mut c, target) = client(&otel, &cfg, addr);
    let t = [("grpc.target", target.as_str())];
    assert_eq!(otel.gauge("idem.client.circuit_breaker.state", &t), 0.0);
    // The budget refuses the first call's retry (1 > 0.5 × 1); the second call's failed
    // attempt opens the breaker (2 of 2 attempts failed; it counts attempts) and stops
    // its retry; the third is refused without being sent.
    for _ in 0..3 {
        let s = c.create_order(order("a")).await.unwrap_err();
        assert_eq!(s.code(), Code::Unavailable);
    }
    let m = [("grpc.method", METHOD), t[0]];
    assert_eq!(otel.sum("grpc.client.attempt.started", &m), 2.0);
    let outcome = |o| [m[0], m[1], ("idem.outcome", o)];
    assert_eq!(
        otel.sum("idem.client.call.outcome", &outcome("budget_exhausted")),
        1.0
    );
    assert_eq!(
        otel.sum("idem.client.call.outcome", &outcome("circuit_open")),
        2.0
    );
    assert_eq!(otel.sum("idem.client.retry_budget.refusals", &t), 1.0);
    assert_eq!(otel.gauge("idem.client.circuit_breaker.state", &t), 1.0);
    let opened = [t[0], ("idem.breaker.state", "open")];
    assert_eq!(
        otel.sum("idem.client.circuit_breaker.transitions", &opened),
        1.0
    );
    assert_eq!(
        otel.value("idem.client.call.rescued", &m),
        None,
        "none rescued"
    );
}

#[tokio::test]
async fn replay_and_mismatch() {
    let otel = Otel::new();
    let cfg = config(false);
    let addr = serve(server_layer(&otel, &cfg, MemoryStore::default()), 0).await;
    let mut c = OrdersClient::new(net::channel(addr));
    c.create_order(keyed("a", "key-replay-01"))
        .await
        .expect("first run");
    let replayed = c
        .create_order(keyed("a", "key-replay-01"))
        .await
        .expect("replay");
    assert!(idem_client::is_replayed(&replayed));
    let s = c
        .create_order(keyed("b", "key-replay-01"))
        .await
        .unwrap_err();
    assert_eq!(s.code(), Code::FailedPrecondition);
    let s = c.create_order(order("a")).await.unwrap_err();
    assert_eq!(s.code(), Code::InvalidArgument);

    let m = ("grpc.method", METHOD);
    for (outcome, n) in [("executed", 1.0), ("replayed", 1.0), ("mismatch", 1.0)] {
        otel.expect_outcomes(&[m, ("idem.outcome", outcome)], n)
            .await;
    }
    let rejected = [
        m,
        ("idem.outcome", "rejected"),
        ("idem.reason", "KEY_MISSING"),
    ];
    otel.expect_outcomes(&rejected, 1.0).await;
    otel.expect("grpc.server.call.started", &[m], Value::Sum(4.0))
        .await;
    assert_eq!(
        otel.count("grpc.server.call.duration", &[m, ("grpc.status", "OK")]),
        2
    );
    let fp = [m, ("grpc.status", "FAILED_PRECONDITION")];
    assert_eq!(otel.count("grpc.server.call.duration", &fp), 1);
    otel.expect_stored(1.0).await;
}

/// A layer used without `check()` and without a tenant source refuses protected calls
/// with FAILED_PRECONDITION `TENANT_SOURCE_MISSING`, and the metric says that reason (it
/// said `OTHER`).
#[tokio::test]
async fn a_missing_tenant_source_is_its_own_reason() {
    let otel = Otel::new();
    let cfg = ServiceConfig::from_json(
        r#"{"methodConfig": [{"name": [{"service": "shop.v1.Orders", "method": "CreateOrder"}],
            "idempotency": {}}]}"#,
    )
    .expect("config");
    let addr = serve(server_layer(&otel, &cfg, MemoryStore::default()), 0).await;
    let mut c = OrdersClient::new(net::channel(addr));
    let s = c
        .create_order(keyed("a", "key-no-tenant-01"))
        .await
        .unwrap_err();
    assert_eq!(s.code(), Code::FailedPrecondition, "{s:?}");
    let rejected = [
        ("grpc.method", METHOD),
        ("idem.outcome", "rejected"),
        ("idem.reason", "TENANT_SOURCE_MISSING"),
    ];
    otel.expect_outcomes(&rejected, 1.0).await;
}

#[tokio::test]
async fn store_down() {
    let otel = Otel::new();
    let cfg = config(false);
    let faulty = FaultyStore::new(MemoryStore::default());
    faulty.inject(Op::Claim, Fault::Unavailable, usize::MAX);
    let addr = serve(server_layer(&otel, &cfg, faulty), 0).await;
    let mut c = OrdersClient::new(net::channel(addr));
    let s = c
        .create_order(keyed("a", "key-store-down"))
        .await
        .unwrap_err();
    assert_eq!(s.code(), Code::Unavailable);
    let m = ("grpc.method", METHOD);
    let down = [m, ("idem.outcome", "store_unavailable")];
    otel.expect_outcomes(&down, 1.0).await;
    assert_eq!(
        otel.count(
            "grpc.server.call.duration",
            &[m, ("grpc.status", "UNAVAILABLE")]
        ),
        1
    );
    // The claim is sent once more with the same claimant before giving up.
    let claim = [
        ("idem.store.operation", "claim"),
        ("idem.store.result", "unavailable"),
    ];
    assert_eq!(otel.count("idem.store.operation.duration", &claim), 2);
}

/// 10,000 distinct keys (and 100 made-up method names) make a fixed number of series.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_keys_make_a_bounded_number_of_series() {
    let otel = Otel::new();
    let cfg = config(false);
    let addr = serve(server_layer(&otel, &cfg, MemoryStore::default()), 0).await;
    let (c, _) = client(&otel, &cfg, addr);
    let sem = Arc::new(tokio::sync::Semaphore::new(64));
    let mut tasks = Vec::new();
    for i in 0..10_000 {
        let permit = sem.clone().acquire_owned().await.unwrap();
        let mut c = c.clone();
        tasks.push(tokio::spawn(async move {
            let _permit = permit;
            c.create_order(keyed("a", &format!("key-{i:08}")))
                .await
                .expect("call");
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let series = |name: &str| otel.points(name).map_or(0, |(_, p)| p.len());
    otel.expect_outcomes(&[("idem.outcome", "executed")], 10_000.0)
        .await;
    assert_eq!(series("idem.server.call.outcome"), 1);
    // Every call's values reach the export: histogram values are handed to the SDK in
    // batches per thread, and a collection takes the part-filled ones too.
    assert_eq!(otel.count("grpc.server.call.duration", &[]), 10_000);
    assert_eq!(otel.count("grpc.client.call.duration", &[]), 10_000);
    assert_eq!(otel.count("grpc.client.attempt.duration", &[]), 10_000);
    for op in ["claim", "complete"] {
        let op = [("idem.store.operation", op)];
        assert_eq!(otel.count("idem.store.operation.duration", &op), 10_000);
    }
    assert_eq!(series("grpc.server.call.duration"), 1);
    assert_eq!(series("grpc.client.call.duration"), 1);
    assert_eq!(series("grpc.client.attempt.started"), 1);
    let total: usize = otel
        .collect()
        .scope_metrics()
        .flat_map(|s| s.metrics())
        .map(|m| points(m.data()).len())
        .sum();
    assert!(total < 40, "{total} series for 10,000 keys");
}

/// The Prometheus endpoint answers a real HTTP GET with the exposition.
#[tokio::test]
async fn prometheus_scrape_over_http() {
    let prometheus = idem_otel::prometheus::Prometheus::new();
    let cfg = config(false);
    let meter = prometheus.meter("idem");
    let metrics = ServerMetrics::new(&meter, &cfg);
    let layer = IdempotencyLayer::new(MemoryStore::default(), &cfg).observer(metrics.clone());
    metrics.watch(&layer);
    let addr = serve(layer, 0).await;
    let mut c = OrdersClient::new(net::channel(addr));
    c.create_order(keyed("a", "key-scrape-0001"))
        .await
        .expect("call");

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let metrics_addr = listener.local_addr().unwrap();
    tokio::spawn(idem_otel::prometheus::serve(listener, prometheus));
    let mut text = String::new();
    for _ in 0..100 {
        text = http_get(metrics_addr, "/metrics").await;
        if text.contains("idem_server_call_outcome_total{") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(text.starts_with("HTTP/1.1 200 OK\r\n"), "{text}");
    assert!(
        text.contains("content-type: text/plain; version=0.0.4"),
        "{text}"
    );
    assert!(
        text.contains("# TYPE grpc_server_call_duration_seconds histogram"),
        "{text}"
    );
    assert!(
        text.contains(r#"idem_server_call_outcome_total{grpc_method="shop.v1.Orders/CreateOrder",idem_outcome="executed"} 1"#),
        "{text}"
    );
    assert!(
        text.contains(
            r#"grpc_server_call_started_total{grpc_method="shop.v1.Orders/CreateOrder"} 1"#
        ),
        "{text}"
    );
    assert!(
        http_get(metrics_addr, "/other")
            .await
            .starts_with("HTTP/1.1 404")
    );
}

async fn http_get(addr: SocketAddr, path: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(format!("GET {path} HTTP/1.1\r\nhost: x\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    out
}

/// A hedged call whose first request fails with a non-fatal code: the next hedge goes out
/// at once and wins. A96 records one hedge and no retry.
#[tokio::test]
async fn a_hedged_call_records_its_hedges_not_retries() {
    let otel = Otel::new();
    let cfg = ServiceConfig::from_json(
        r#"{"methodConfig": [{
              "name": [{"service": "shop.v1.Orders", "method": "CreateOrder"}],
              "hedgingPolicy": {"maxAttempts": 3, "hedgingDelay": "1s",
                                "nonFatalStatusCodes": ["UNAVAILABLE"]},
              "idempotency": {}
            }],
            "idem": {"tenant": {"single": "t"}}}"#,
    )
    .expect("hedging config");
    let addr = serve(IdempotencyLayer::new(MemoryStore::default(), &cfg), 1).await;
    let (_c, target) = ordered(&otel, &cfg, addr, "the second hedge answers").await;
    let m = [("grpc.method", METHOD), ("grpc.target", target.as_str())];
    assert_eq!(otel.unit("grpc.client.call.hedges"), "{hedge}");
    assert_eq!(
        otel.value("grpc.client.call.hedges", &m),
        Some(Value::Histogram { count: 1, sum: 1.0 })
    );
    assert_eq!(otel.value("grpc.client.call.retries", &m), None);
}

/// Calls the layer lets through (a method without `idempotency`, a keyless call to a
/// method whose key is optional) are counted with the outcome `passthrough`.
#[tokio::test]
async fn passthrough_calls_are_counted() {
    let otel = Otel::new();
    let cfg = ServiceConfig::from_json(
        r#"{"methodConfig": [
              {"name": [{"service": "shop.v1.Orders", "method": "CreateOrder"}],
               "idempotency": {"keyRequired": false}},
              {"name": [{"service": "shop.v1.Orders", "method": "GetOrder"}], "timeout": "5s"}],
            "idem": {"tenant": {"single": "t"}}}"#,
    )
    .unwrap();
    let addr = serve(server_layer(&otel, &cfg, MemoryStore::default()), 0).await;
    let mut c = OrdersClient::new(net::channel(addr));
    c.create_order(order("a"))
        .await
        .expect("keyless call passes");
    c.create_order(order("a"))
        .await
        .expect("keyless call passes");
    let s = c
        .get_order(idem_test_support::shop::GetOrderRequest::default())
        .await
        .unwrap_err();
    assert_eq!(s.code(), Code::Unimplemented);
    c.create_order(keyed("a", "key-passthrough-1"))
        .await
        .expect("protected");

    let create = ("grpc.method", METHOD);
    let get = ("grpc.method", "shop.v1.Orders/GetOrder");
    let pass = ("idem.outcome", "passthrough");
    otel.expect_outcomes(&[create, pass], 2.0).await;
    otel.expect_outcomes(&[get, pass], 1.0).await;
    otel.expect_outcomes(&[create, ("idem.outcome", "executed")], 1.0)
        .await;
    otel.expect("grpc.server.call.started", &[create], Value::Sum(3.0))
        .await;
    otel.expect("grpc.server.call.started", &[get], Value::Sum(1.0))
        .await;
    let unimplemented = [get, ("grpc.status", "UNIMPLEMENTED")];
    assert_eq!(otel.count("grpc.server.call.duration", &unimplemented), 1);
    assert_eq!(
        otel.count(
            "grpc.server.call.duration",
            &[create, ("grpc.status", "OK")]
        ),
        3
    );
    // Passed-through calls carry no tenant, even when tenants are labelled.
    assert!(
        otel.labels("idem.server.call.outcome")
            .iter()
            .all(|l| !l.iter().any(|k| k == "idem.tenant"))
    );
}

/// `idem.tenant` is off by default; opted in, the first `most` tenants are labelled and
/// the rest are `other`.
#[tokio::test]
async fn the_tenant_label_is_opt_in_and_bounded() {
    let cfg = ServiceConfig::from_json(
        r#"{"methodConfig": [
              {"name": [{"service": "shop.v1.Orders", "method": "CreateOrder"}],
               "idempotency": {}}],
            "idem": {"tenant": {"header": "x-tenant"}}}"#,
    )
    .unwrap();
    for most in [None, Some(2)] {
        let otel = Otel::new();
        let mut metrics = ServerMetrics::new(&otel.meter(), &cfg);
        if let Some(most) = most {
            metrics = metrics.tenant_label(most);
        }
        let layer = IdempotencyLayer::new(MemoryStore::default(), &cfg).observer(metrics);
        let addr = serve(layer, 0).await;
        let mut c = OrdersClient::new(net::channel(addr));
        for (i, tenant) in ["acme", "globex", "acme", "initech", "umbrella"]
            .iter()
            .enumerate()
        {
            let mut req = keyed("a", &format!("key-tenant-{i:04}"));
            req.metadata_mut()
                .insert("x-tenant", tenant.parse().unwrap());
            c.create_order(req).await.expect("call");
        }
        let executed = ("idem.outcome", "executed");
        match most {
            None => {
                otel.expect_outcomes(&[executed], 5.0).await;
                let labels = otel.labels("idem.server.call.outcome");
                assert!(
                    labels.iter().all(|l| !l.iter().any(|k| k == "idem.tenant")),
                    "{labels:?}"
                );
            }
            Some(_) => {
                for (tenant, n) in [("acme", 2.0), ("globex", 1.0), ("other", 2.0)] {
                    otel.expect_outcomes(&[executed, ("idem.tenant", tenant)], n)
                        .await;
                }
                assert_eq!(otel.labels("idem.server.call.outcome").len(), 3);
            }
        }
    }
}

/// `method` labels a method the config does not name, on both sides.
#[tokio::test]
async fn a_method_added_by_name_gets_its_own_label() {
    let otel = Otel::new();
    let cfg = config(false);
    let get = "shop.v1.Orders/GetOrder";
    let server = ServerMetrics::new(&otel.meter(), &cfg).method(get);
    let layer = IdempotencyLayer::new(MemoryStore::default(), &cfg).observer(server);
    let addr = serve(layer, 0).await;
    let metrics = ClientMetrics::new(&otel.meter(), "t", &cfg).method(get);
    let layer = RetryLayer::builder()
        .service_config(cfg.clone())
        .observer(metrics)
        .build()
        .unwrap();
    let mut c = OrdersClient::new(tower::Layer::layer(&layer, net::channel(addr)));
    let s = c
        .get_order(idem_test_support::shop::GetOrderRequest::default())
        .await
        .unwrap_err();
    assert_eq!(s.code(), Code::Unimplemented);
    let m = ("grpc.method", get);
    otel.expect("grpc.client.attempt.started", &[m], Value::Sum(1.0))
        .await;
    otel.expect("grpc.server.call.started", &[m], Value::Sum(1.0))
        .await;
}

/// A memory store's evictions (a completed record dropped before its TTL to make room)
/// and expirations (dropped at its TTL) are counted.
#[tokio::test(start_paused = true)]
async fn memory_store_evictions_and_expirations() {
    use idem_store::memory::MemoryStoreSettings;
    use idem_store::{CompleteRequest, Scope, StoredOutcome};
    use idem_test_support::store::acquire;

    let otel = Otel::new();
    // The tenant may hold 2 records; any completed one may go to make room.
    let memory = MemoryStore::new(MemoryStoreSettings {
        max_entries_per_tenant: Some(2),
        min_retention: Duration::ZERO,
        ..MemoryStoreSettings::default()
    });
    ServerMetrics::new(&otel.meter(), &config(false)).watch_memory_store(&memory);
    let lease = Duration::from_secs(10);
    let complete = |scope, ttl| {
        let memory = memory.clone();
        async move {
            let fence = acquire(&memory, scope, lease).await;
            let outcome = StoredOutcome::Response(bytes::Bytes::from_static(b"done"));
            let req = CompleteRequest {
                scope,
                fence,
                outcome,
                ttl,
            };
            memory.complete(req).await.expect("complete");
        }
    };
    let scopes: Vec<Scope> = (1..=3).map(|i| Scope([i; 32])).collect();
    complete(&scopes[0], Duration::from_secs(3600)).await;
    complete(&scopes[1], Duration::from_secs(1)).await;
    assert_eq!(otel.sum("idem.store.memory.evictions", &[]), 0.0);
    // The tenant's share is full: its third record takes the oldest one's room.
    complete(&scopes[2], Duration::from_secs(3600)).await;
    assert_eq!(otel.sum("idem.store.memory.evictions", &[]), 1.0);
    assert_eq!(otel.sum("idem.store.memory.expirations", &[]), 0.0);
    tokio::time::advance(Duration::from_secs(2)).await;
    // A new claim of the expired key finds it gone (the sweeper would find it too).
    acquire(&memory, &scopes[1], lease).await;
    assert_eq!(otel.sum("idem.store.memory.expirations", &[]), 1.0);
    assert_eq!(otel.unit("idem.store.memory.evictions"), "{record}");
    assert_eq!(otel.sum("idem.store.memory.evictions", &[]), 1.0);
}

/// Past 80 % of a bound the usage gauge says so (the store also logs its WARN), and the
/// refusal at the bound is counted as `store_full` with the bound as its reason.
#[tokio::test]
async fn the_usage_gauge_passes_80_percent_and_the_refusal_names_the_bound() {
    use idem_store::memory::MemoryStoreSettings;

    let otel = Otel::new();
    let cfg = config(false);
    // One tenant, the whole store: 10 records.
    let settings = MemoryStoreSettings {
        max_entries: 10,
        ..MemoryStoreSettings::default()
    };
    let memory = MemoryStore::new(settings.for_single_tenant());
    ServerMetrics::new(&otel.meter(), &cfg).watch_memory_store(&memory);
    let addr = serve(server_layer(&otel, &cfg, memory.clone()), 0).await;
    let mut c = OrdersClient::new(net::channel(addr));
    let usage = |bound: &str| otel.gauge("idem.store.memory.usage", &[("idem.store.bound", bound)]);
    for i in 0..8 {
        c.create_order(keyed("ok", &format!("usage-key-{i:04}")))
            .await
            .expect("room");
    }
    otel.expect_stored(8.0).await;
    assert_eq!(usage("store_entries"), 0.8);
    assert_eq!(
        usage("tenant_entries"),
        0.8,
        "the one tenant may fill the store"
    );
    assert_eq!(usage("tenant_in_flight"), 0.0);
    for i in 8..10 {
        c.create_order(keyed("ok", &format!("usage-key-{i:04}")))
            .await
            .expect("room");
    }
    otel.expect_stored(10.0).await;
    assert_eq!(usage("store_entries"), 1.0);
    let refused = c
        .create_order(keyed("ok", "usage-key-0010"))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::ResourceExhausted);
    let full = [
        ("grpc.method", METHOD),
        ("idem.outcome", "store_full"),
        ("idem.reason", "store_entries"),
    ];
    otel.expect_outcomes(&full, 1.0).await;
}

/// A handler whose caller went away goes on in a task of its own: the detached gauge
/// counts it until its run ends, and its outcome is still recorded.
#[tokio::test]
async fn a_cancelled_call_shows_as_a_detached_run_until_it_ends() {
    let otel = Otel::new();
    let (call, release) = held_call(&otel, false, "key-detached-0001").await;
    assert_eq!(
        otel.gauge("idem.server.handlers.detached", &[]),
        0.0,
        "the caller is still there"
    );
    call.abort();
    otel.expect("idem.server.handlers.detached", &[], Value::Gauge(1.0))
        .await;
    assert_eq!(otel.unit("idem.server.handlers.detached"), "{run}");
    release.notify_one();
    otel.expect("idem.server.handlers.detached", &[], Value::Gauge(0.0))
        .await;
    otel.expect_stored(1.0).await;
}

/// A detached run whose handler panics still ends its place in the gauge, its outcome
/// (INTERNAL) is recorded, and the call, whose caller went away, reads CANCELLED.
#[tokio::test]
async fn a_detached_run_that_panics_leaves_the_gauge_and_the_call_reads_cancelled() {
    let otel = Otel::new();
    let (call, release) = held_call(&otel, true, "key-detached-0002").await;
    call.abort();
    otel.expect("idem.server.handlers.detached", &[], Value::Gauge(1.0))
        .await;
    release.notify_one();
    otel.expect("idem.server.handlers.detached", &[], Value::Gauge(0.0))
        .await;
    otel.expect_stored(1.0).await;
    let cancelled = [("grpc.status", "CANCELLED")];
    assert_eq!(
        otel.count("grpc.server.call.duration", &cancelled),
        1,
        "the call's duration, as CANCELLED"
    );
}

/// A call with `key` to a [`held_handler`], in a task of its own, once its handler has
/// started; and the handler's `release`.
async fn held_call(
    otel: &Otel,
    panics: bool,
    key: &'static str,
) -> (
    JoinHandle<Result<Response<Order>, Status>>,
    Arc<tokio::sync::Notify>,
) {
    let (addr, started, release) = held_handler(otel, panics).await;
    let mut c = OrdersClient::new(net::channel(addr));
    let call = tokio::spawn(async move { c.create_order(keyed("a", key)).await });
    started.notified().await;
    (call, release)
}

/// A server whose handler says it `started`, then waits for `release` (and then
/// panics, if `panics`).
async fn held_handler(
    otel: &Otel,
    panics: bool,
) -> (
    SocketAddr,
    Arc<tokio::sync::Notify>,
    Arc<tokio::sync::Notify>,
) {
    use tokio::sync::Notify;

    let layer = server_layer(otel, &config(false), MemoryStore::default());
    let (started, release) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let (s, r) = (started.clone(), release.clone());
    let handler = idem_test_support::shop_fake::create_only(move |_req| {
        let (s, r) = (s.clone(), r.clone());
        async move {
            s.notify_one();
            r.notified().await;
            assert!(!panics, "the handler panics after its caller went away");
            Ok(Response::new(Order::default()))
        }
    });
    let (addr, incoming) = net::bind().await;
    tokio::spawn(
        tonic::transport::Server::builder()
            .layer(layer)
            .add_service(handler)
            .serve_with_incoming(incoming),
    );
    (addr, started, release)
}
