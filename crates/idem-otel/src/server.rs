//! [`ServerMetrics`]: gRPC's server metrics (gRFC A66) for protected methods and idem's
//! own, from an [`IdempotencyLayer`]'s observer events, its counters and its store.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use idem_core::config::ServiceConfig;
use idem_server::idempotency::IdempotencyLayer;
use idem_server::metrics::{ProtectedCallEnded, ServerObserver};
use idem_store::instrumented::{InstrumentedStore, OpResult, StoreObserver, StoreOp};
use idem_store::{Store, memory::MemoryStore};
use opentelemetry::metrics::{AsyncInstrument, Histogram, Meter};
use opentelemetry::{KeyValue, Value};

use crate::labels::{
    self, BoundSeries, FirstFew, Learned, MethodCounters, MethodLabels, PerMethod, STATUS_COUNT,
    Striped, lock, status_index,
};
use crate::{observed_counter, observed_gauge, seconds_histogram};

/// Records an idempotency layer's protected calls as OpenTelemetry instruments (see the
/// [crate docs](crate) for the table). Cheap to clone.
///
/// ```
/// # fn f(meter: opentelemetry::metrics::Meter, config: idem_core::config::ServiceConfig) {
/// use idem_otel::ServerMetrics;
/// use idem_server::idempotency::IdempotencyLayer;
/// use idem_store::memory::MemoryStore;
///
/// let metrics = ServerMetrics::new(&meter, &config);
/// let store = MemoryStore::default();
/// metrics.watch_memory_store(&store); // entries, bytes, in flight
/// let layer = IdempotencyLayer::new(metrics.instrument_store(store, "memory"), &config)
///     .observer(metrics.clone());
/// metrics.watch(&layer); // handler runs, records, stale fences
/// # }
/// ```
#[derive(Clone)]
pub struct ServerMetrics(Arc<ServerInstruments>);

struct ServerInstruments {
    meter: Meter,
    counts: Arc<MethodCounters<ServerCounts>>,
    /// The series of every store made by [`ServerMetrics::instrument_store`].
    stores: StoreSeries,
    /// Handler runs detached by their caller's cancel, going on now.
    detached: Arc<AtomicU64>,
    /// `idem.tenant` values, when opted in.
    tenants: Option<Learned>,
    duration: Histogram<f64>,
    store_duration: Histogram<f64>,
}

/// The server's counters per method label (see [`MethodCounters`]).
#[derive(Default)]
struct ServerCounts {
    started: Striped<1>,
    /// Boxed: a [`Striped`] counter takes 512 bytes, and most of the slots stay empty.
    outcomes: FirstFew<OutcomeKey, Box<Striped<1>>>,
    /// `grpc.server.call.duration`, per `grpc.status`.
    duration: BoundSeries<f64, STATUS_COUNT>,
}

/// One `idem.server.call.outcome` series of a method: outcome, reason, tenant label.
#[derive(Clone, PartialEq, Eq, Hash)]
struct OutcomeKey(&'static str, Option<&'static str>, Option<Arc<str>>);

impl ServerCounts {
    /// Counts one call ending as `key` says.
    fn add_outcome(&self, key: OutcomeKey) {
        self.outcomes.with(
            &key,
            || (key.clone(), Box::default()),
            |_| true,
            |n| n.add(0),
        );
    }
}

impl std::fmt::Debug for ServerMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerMetrics").finish_non_exhaustive()
    }
}

impl ServerMetrics {
    /// Instruments on `meter`. Methods `config` names exactly (`service` and `method`)
    /// are labelled by name; others `"other"` (add more with [`method`](Self::method)):
    /// the layer runs before the router, so a caller could make up method names.
    pub fn new(meter: &Meter, config: &ServiceConfig) -> Self {
        let counts = Arc::new(MethodCounters::<ServerCounts>::new(
            MethodLabels::from_config(config, false),
        ));
        let stores = StoreSeries::default();
        type Observe = fn(&PerMethod<ServerCounts>, &dyn AsyncInstrument<u64>);
        let counters: [(&str, &str, Observe); 2] = [
            (
                "grpc.server.call.started",
                "Calls received, protected or passed through.",
                |m, o| {
                    let n = m.counts.started.get(0);
                    if n > 0 {
                        o.observe(n, std::slice::from_ref(&m.method));
                    }
                },
            ),
            (
                "idem.server.call.outcome",
                "Calls by what the idempotency layer did (idem.outcome, passthrough included; idem.reason for rejected; idem.tenant when opted in).",
                |m, o| {
                    m.counts
                        .outcomes
                        .each(|OutcomeKey(outcome, reason, tenant), n| {
                            let mut attrs =
                                vec![m.method.clone(), KeyValue::new("idem.outcome", *outcome)];
                            if let Some(r) = reason {
                                attrs.push(KeyValue::new("idem.reason", *r));
                            }
                            if let Some(t) = tenant {
                                attrs.push(KeyValue::new("idem.tenant", Value::from(t.clone())));
                            }
                            o.observe(n.get(0), &attrs);
                        })
                },
            ),
        ];
        for (name, description, observe) in counters {
            let (c, st) = (counts.clone(), stores.clone());
            observed_counter(meter, name, "{call}", description, move |o| {
                // The histograms are flushed in each counter's callback: a view may drop
                // either counter.
                flush(&c, &st);
                c.each(|m| observe(m, o));
            });
        }
        ServerMetrics(Arc::new(ServerInstruments {
            counts,
            stores,
            detached: Arc::default(),
            tenants: None,
            duration: seconds_histogram(
                meter,
                "grpc.server.call.duration",
                "Calls, from arrival to the end of the response.",
            ),
            store_duration: seconds_histogram(
                meter,
                "idem.store.operation.duration",
                "Store operations by operation, store kind and result.",
            ),
            meter: meter.clone(),
        }))
    }

    /// Labels `method` (`pkg.Service/Method`) by its name too.
    pub fn method(self, method: &str) -> Self {
        self.0.counts.add_method(method);
        self
    }

    /// Labels `idem.server.call.outcome` with `idem.tenant`, the caller's tenant, for the
    /// first `most` distinct tenants the layer sees; later ones are `"other"`. Off by
    /// default: tenants come from callers, so each one is a new series. Calls without a
    /// tenant (passed through, or refused before one was read) carry none.
    ///
    /// ```
    /// # fn f(meter: opentelemetry::metrics::Meter, config: idem_core::config::ServiceConfig) {
    /// let metrics = idem_otel::ServerMetrics::new(&meter, &config).tenant_label(100);
    /// # }
    /// ```
    pub fn tenant_label(mut self, most: usize) -> Self {
        match Arc::get_mut(&mut self.0) {
            Some(inner) => inner.tenants = Some(Learned::new(most)),
            None => {
                tracing::warn!("ServerMetrics::tenant_label called after the metrics were shared")
            }
        }
        self
    }

    /// `store`, timed per operation into `idem.store.operation.duration` with
    /// `idem.store.kind = kind` (keep it to a fixed name: `memory`, `redis`, `postgres`).
    pub fn instrument_store<St: Store>(
        &self,
        store: St,
        kind: &'static str,
    ) -> InstrumentedStore<St> {
        let series = Arc::new(BoundSeries::default());
        lock(&self.0.stores).push(Arc::downgrade(&series));
        let timings = StoreTimings {
            histogram: self.0.store_duration.clone(),
            series,
        };
        InstrumentedStore::new(store, kind, timings)
    }

    /// Reports `layer`'s handler runs in flight (detached ones apart too) and record
    /// results at each collection.
    pub fn watch<St: Store>(&self, layer: &IdempotencyLayer<St>) {
        let meter = &self.0.meter;
        // Told by the observer events, so counted for every layer this observes.
        let detached = self.0.detached.clone();
        observed_gauge(
            meter,
            "idem.server.handlers.detached",
            "{run}",
            "Handler runs going on after their caller went away before the response began (their outcome is still recorded).",
            move || detached.load(Ordering::Relaxed),
        );
        let l = layer.clone();
        observed_gauge(
            meter,
            "idem.server.handlers.in_flight",
            "{run}",
            "Handler runs from claim until their outcome is recorded, runs whose caller went away included.",
            move || l.handlers_in_flight() as u64,
        );
        let stats = layer.stats();
        observed_counter(
            meter,
            "idem.server.record.outcome",
            "{record}",
            "What became of executed calls' records (idem.record: stored, released, unrecorded).",
            move |c| {
                let s = stats.snapshot();
                for (name, v) in [
                    ("stored", s.stored),
                    ("released", s.released),
                    ("unrecorded", s.unrecorded),
                ] {
                    c.observe(v, &[KeyValue::new("idem.record", name)]);
                }
            },
        );
        let stats = layer.stats();
        observed_counter(
            meter,
            "idem.server.stale_fences",
            "{record}",
            "Completions or releases refused because another claimant took the record over.",
            move |c| c.observe(stats.snapshot().stale_fence, &[]),
        );
    }

    /// Reports `store`'s records, bytes and in-flight records, and the records it evicted
    /// or expired, at each collection.
    pub fn watch_memory_store(&self, store: &MemoryStore) {
        type ReadGauge = fn(&idem_store::memory::MemoryStoreStats) -> usize;
        let gauges: [(&str, &str, &str, ReadGauge); 3] = [
            (
                "idem.store.memory.entries",
                "{record}",
                "Records held, in flight and completed.",
                |s| s.entries,
            ),
            (
                "idem.store.memory.in_flight",
                "{record}",
                "Records in flight.",
                |s| s.in_flight,
            ),
            (
                "idem.store.memory.size",
                "By",
                "Bytes charged: responses and per-record overhead.",
                |s| s.bytes,
            ),
        ];
        let meter = &self.0.meter;
        for (name, unit, description, read) in gauges {
            let store = store.clone();
            let read = move || read(&store.stats()) as u64;
            observed_gauge(meter, name, unit, description, read);
        }
        type ReadCounter = fn(&idem_store::memory::MemoryStoreStats) -> u64;
        let counters: [(&str, &str, ReadCounter); 2] = [
            (
                "idem.store.memory.evictions",
                "Completed records dropped before their TTL (after minRetention) to make room for a new one: a retry of their key runs again.",
                |s| s.evicted_after_min_retention,
            ),
            (
                "idem.store.memory.expirations",
                "Records dropped at the end of their TTL.",
                |s| s.expirations,
            ),
        ];
        for (name, description, read) in counters {
            let store = store.clone();
            let observe = move |c: &dyn AsyncInstrument<u64>| c.observe(read(&store.stats()), &[]);
            observed_counter(meter, name, "{record}", description, observe);
        }
        // How full each bound is (a tenant bound: its fullest tenant), 0 to 1: the store
        // refuses new calls at 1, so alert well before (the store itself warns at 0.8).
        let store = store.clone();
        meter
            .f64_observable_gauge("idem.store.memory.usage")
            .with_unit("1")
            .with_description(
                "How full each bound of the memory store is, 0 to 1 (tenant bounds: the fullest tenant's); at 1 new protected calls are refused (STORE_FULL).",
            )
            .with_callback(move |g| {
                for bound in idem_store::memory::MemoryBound::ALL {
                    g.observe(
                        store.usage_ratio(bound),
                        &[KeyValue::new("idem.store.bound", bound.as_str())],
                    );
                }
            })
            .build();
    }
}

impl ServerObserver for ServerMetrics {
    fn call_started(&self, method: &str) {
        self.0.counts.with(method, |m| m.counts.started.add(0));
    }

    fn call_ended(&self, call: &ProtectedCallEnded<'_>) {
        self.0.counts.with(call.method, |m| self.0.record(m, call));
    }

    fn run_detached(&self, _method: &str) {
        self.0.detached.fetch_add(1, Ordering::Relaxed);
    }

    fn detached_run_ended(&self, _method: &str) {
        self.0.detached.fetch_sub(1, Ordering::Relaxed);
    }
}

impl ServerInstruments {
    /// Records `call` on its method's `counts`.
    fn record(&self, counts: &PerMethod<ServerCounts>, call: &ProtectedCallEnded<'_>) {
        let m = self;
        let code = call.status;
        counts
            .counts
            .duration
            .record(status_index(code), call.duration.as_secs_f64(), || {
                m.duration
                    .bind(&[counts.method.clone(), labels::status(code)])
            });
        let tenant = m
            .tenants
            .as_ref()
            .zip(call.tenant)
            .map(|(labels, t)| labels.of(t));
        counts
            .counts
            .add_outcome(OutcomeKey(call.outcome, call.reason, tenant));
    }
}

/// `idem.store.operation.duration` of one store (one kind): a series per operation and
/// result.
struct StoreTimings {
    histogram: Histogram<f64>,
    series: Arc<StoreBound>,
}

/// The series of one store's `idem.store.operation.duration`.
type StoreBound = BoundSeries<f64, { STORE_OPS * STORE_RESULTS }>;

/// The series of the stores a [`ServerMetrics`] times (dropped stores are forgotten at
/// the next collection).
type StoreSeries = Arc<Mutex<Vec<Weak<StoreBound>>>>;

/// Hands the histogram values buffered since the last collection to the SDK (see
/// [`BoundSeries`]).
fn flush(counts: &MethodCounters<ServerCounts>, stores: &StoreSeries) {
    counts.each(|m| m.counts.duration.flush());
    lock(stores).retain(|s| match s.upgrade() {
        Some(series) => {
            series.flush();
            true
        }
        None => false,
    });
}

const STORE_OPS: usize = 6;
const STORE_RESULTS: usize = 5;

impl StoreTimings {
    /// The series of `op` ending as `result`; `usize::MAX` for one this build lacks.
    fn index(op: StoreOp, result: OpResult) -> usize {
        let op = match op {
            StoreOp::Claim => 0,
            StoreOp::Renew => 1,
            StoreOp::Complete => 2,
            StoreOp::Release => 3,
            StoreOp::Get => 4,
            StoreOp::Wait => 5,
            _ => return usize::MAX,
        };
        let result = match result {
            OpResult::Ok => 0,
            OpResult::Unavailable => 1,
            OpResult::Fenced => 2,
            OpResult::Corrupt => 3,
            OpResult::Full => 4,
            _ => return usize::MAX,
        };
        op * STORE_RESULTS + result
    }
}

impl StoreObserver for StoreTimings {
    fn operation(&self, kind: &'static str, op: StoreOp, took: Duration, result: OpResult) {
        self.series
            .record(Self::index(op, result), took.as_secs_f64(), || {
                self.histogram.bind(&[
                    KeyValue::new("idem.store.kind", kind),
                    KeyValue::new("idem.store.operation", op.as_str()),
                    KeyValue::new("idem.store.result", result.as_str()),
                ])
            });
    }
}
