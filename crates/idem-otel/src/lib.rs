//! OpenTelemetry metrics for idem's layers: gRPC's standard client and server metrics
//! (gRFC A66, A96 names, units and labels) and idem's own, through the OpenTelemetry
//! metrics API, so any OpenTelemetry exporter works; plus a Prometheus text exposition
//! ([`prometheus`]).
//!
//! The layers know no metrics library: they call observer traits
//! ([`idem_client::metrics::CallObserver`], [`idem_server::metrics::ServerObserver`],
//! [`idem_store::instrumented::StoreObserver`]), which [`ClientMetrics`] and
//! [`ServerMetrics`] implement (the store's, through
//! [`ServerMetrics::instrument_store`]). Histograms are recorded through series bound
//! to their attributes at their first value, so a recording skips the SDK's attribute
//! lookup. Without this crate (the facade's `otel` feature off) no
//! OpenTelemetry code is compiled.
//!
//! ```no_run
//! # fn f(config: idem_core::config::ServiceConfig) -> Result<(), Box<dyn std::error::Error>> {
//! let prometheus = idem_otel::prometheus::Prometheus::new(); // or your own MeterProvider
//! let meter = prometheus.meter("idem");
//! let metrics = idem_otel::ClientMetrics::new(&meter, "dns:///orders:443", &config);
//! let layer = idem_client::retry::RetryLayer::builder().service_config(config).observer(metrics.clone()).build()?;
//! metrics.watch(&layer);
//! # Ok(()) }
//! ```
//!
//! # Metrics
//! | name | type | unit | labels | meaning |
//! |---|---|---|---|---|
//! | `grpc.client.attempt.started` | counter | `{attempt}` | `grpc.method`, `grpc.target` | attempts sent, retries, hedges and transparent retries included (A66) |
//! | `grpc.client.attempt.duration` | histogram | `s` | `grpc.method`, `grpc.target`, `grpc.status` | each attempt to its status; a committed one to the end of its response (A66) |
//! | `grpc.client.call.duration` | histogram | `s` | `grpc.method`, `grpc.target`, `grpc.status` | each call as the application sees it (A66) |
//! | `grpc.client.call.retries` | histogram | `{retry}` | `grpc.method`, `grpc.target` | retries of calls that retried; 0 is not recorded (A96) |
//! | `grpc.client.call.hedges` | histogram | `{hedge}` | `grpc.method`, `grpc.target` | hedges per hedged call beyond the first request; 0 is not recorded (A96) |
//! | `grpc.client.call.transparent_retries` | histogram | `{transparent_retry}` | `grpc.method`, `grpc.target` | transparent retries (gRFC A6) of calls that had any; 0 is not recorded (A96); not in `grpc.client.call.retries` nor in `grpc.client.attempt.duration` |
//! | `grpc.client.call.retry_delay` | histogram | `s` | `grpc.method`, `grpc.target` | per call, time with no attempt in flight (A96) |
//! | `idem.client.call.outcome` | counter | `{call}` | `grpc.method`, `grpc.target`, `idem.outcome` | calls by why the layer stopped ([`CallOutcome`](idem_client::retry::CallOutcome) names): `committed` (the normal end of a successful call: response headers, then trailers), `ok` (a Trailers-Only OK), `no_retry_policy`, `non_retryable_code`, `attempts_exhausted`, `throttled`, `pushback_stop`, `deadline`, `body_too_large`, `replay_budget_exhausted`, `body_error`, `service_error`, `message_too_large`, `not_ready`, `budget_exhausted` (the retry budget refused the retry), `circuit_open` (the breaker was open: nothing sent), `circuit_probe` (a half-open probe failed; never retried), `circuit_no_retry` (the breaker, closed but at half its failure ratio, stopped the retry), `not_hedged` (no longer reported) |
//! | `idem.client.retry_throttle.tokens` | gauge | `{token}` | `grpc.target` | tokens left in the A6 throttle |
//! | `idem.client.call.rescued` | counter | `{call}` | `grpc.method`, `grpc.target` | calls that ended OK after a failed attempt (a retry, or a later hedge, rescued them) |
//! | `idem.client.circuit_breaker.state` | gauge | `1` | `grpc.target` (and `grpc.method`, the entry's first name, for a method config entry's own breaker) | the breaker's state: 0 closed, 1 open, 2 half-open |
//! | `idem.client.circuit_breaker.transitions` | counter | `{transition}` | `grpc.target`, `idem.breaker.state` (and `grpc.method` for an entry's own breaker) | transitions, by the state entered |
//! | `idem.client.retry_budget.refusals` | counter | `{retry}` | `grpc.target` | retries and hedges the retry budget refused |
//! | `grpc.server.call.started` | counter | `{call}` | `grpc.method` | calls received, protected or passed through (A66) |
//! | `grpc.server.call.duration` | histogram | `s` | `grpc.method`, `grpc.status` | calls, arrival to the end of the response (A66) |
//! | `idem.server.call.outcome` | counter | `{call}` | `grpc.method`, `idem.outcome`, `idem.reason` (rejected: the `ErrorInfo` reason; store_full: the bound that refused), `idem.tenant` (opt-in: [`ServerMetrics::tenant_label`]) | calls by what the layer did: executed, replayed, waited, mismatch, aborted, not_retained, rejected, store_unavailable, store_full, overloaded, fail_open, waited_deadline, cancelled, passthrough (a method without `idempotency`, or a keyless call where the key is optional) |
//! | `idem.server.handlers.in_flight` | gauge | `{run}` | | handler runs from claim to recorded outcome, detached ones included |
//! | `idem.server.handlers.detached` | gauge | `{run}` | | handler runs going on after their caller went away before the response began (their outcome is still recorded) |
//! | `idem.server.record.outcome` | counter | `{record}` | `idem.record` | records stored, released, unrecorded |
//! | `idem.server.stale_fences` | counter | `{record}` | | completions/releases refused: the record was taken over |
//! | `idem.store.operation.duration` | histogram | `s` | `idem.store.kind`, `idem.store.operation`, `idem.store.result` | each store operation |
//! | `idem.store.memory.entries` / `.in_flight` / `.size` | gauge | `{record}` / `{record}` / `By` | | what a `MemoryStore` holds |
//! | `idem.store.memory.usage` | gauge | `1` | `idem.store.bound` | how full each bound of a `MemoryStore` is, 0 to 1 (a tenant bound: its fullest tenant); at 1 new protected calls get `STORE_FULL` |
//! | `idem.store.memory.evictions` | counter | `{record}` | | completed records a `MemoryStore` dropped before their TTL to make room: a retry of their key runs again |
//! | `idem.store.memory.expirations` | counter | `{record}` | | records a `MemoryStore` dropped at the end of their TTL |
//!
//! # Labels
//! Bounded by construction: no key or scope is ever a label, and the tenant only when
//! asked for, bounded ([`ServerMetrics::tenant_label`]: the first N tenants seen, then
//! `"other"`). `grpc.method` is
//! the method's name (`shop.v1.Orders/CreateOrder`) when the service config names it (on
//! the client also by its service), else `"other"`. `grpc.status` is the code's name
//! (`UNAVAILABLE`). The outcome, reason, record and store labels take values from fixed
//! lists.
//!
//! # When values appear
//! `grpc.client.attempt.started` and `grpc.server.call.started` count as calls arrive;
//! the rest is recorded when a call ends: a committed client call at the end of its
//! response body (its status from the trailers), a protected server call once its
//! response ended and, when its handler ran, its outcome was recorded.
//!
//! Counters are kept per thread and summed at each collection. Histogram values are
//! handed to the SDK in batches of 64 per thread and series, and whatever is buffered
//! at each collection, before the SDK reads anything: from the callbacks of the
//! observable counters (`grpc.client.attempt.started` and `idem.client.call.outcome`;
//! `grpc.server.call.started` and `idem.server.call.outcome`). An export holds every
//! value recorded before its collection began, unless a view drops both of a side's
//! counters: then histogram values wait for their batch to fill. Per call, this keeps
//! the worker threads from writing to the same SDK data at every value.

mod client;
mod labels;
pub mod prometheus;
mod server;

pub use client::ClientMetrics;
pub use labels::OTHER;
pub use server::ServerMetrics;

/// Bucket boundaries of the duration histograms, in seconds: gRFC A66's.
pub const LATENCY_BUCKETS: [f64; 41] = [
    0.0, 0.00001, 0.00005, 0.0001, 0.0003, 0.0006, 0.0008, 0.001, 0.002, 0.003, 0.004, 0.005,
    0.006, 0.008, 0.01, 0.013, 0.016, 0.02, 0.025, 0.03, 0.04, 0.05, 0.065, 0.08, 0.1, 0.13, 0.16,
    0.2, 0.25, 0.3, 0.4, 0.5, 0.65, 0.8, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0,
];

/// Bucket boundaries of `grpc.client.call.retries`: gRFC A96's.
pub const RETRY_BUCKETS: [f64; 5] = [1.0, 2.0, 3.0, 4.0, 5.0];

/// An observable `u64` counter on `meter`, read by `observe` at each collection.
pub(crate) fn observed_counter(
    meter: &opentelemetry::metrics::Meter,
    name: &'static str,
    unit: &'static str,
    description: &'static str,
    observe: impl Fn(&dyn opentelemetry::metrics::AsyncInstrument<u64>) + Send + Sync + 'static,
) {
    meter
        .u64_observable_counter(name)
        .with_unit(unit)
        .with_description(description)
        .with_callback(observe)
        .build();
}

/// An observable `u64` gauge on `meter`, without attributes: `read` at each collection.
pub(crate) fn observed_gauge(
    meter: &opentelemetry::metrics::Meter,
    name: &'static str,
    unit: &'static str,
    description: &'static str,
    read: impl Fn() -> u64 + Send + Sync + 'static,
) {
    meter
        .u64_observable_gauge(name)
        .with_unit(unit)
        .with_description(description)
        .with_callback(move |g| g.observe(read(), &[]))
        .build();
}

/// A histogram of seconds, with [`LATENCY_BUCKETS`].
pub(crate) fn seconds_histogram(
    meter: &opentelemetry::metrics::Meter,
    name: &'static str,
    description: &'static str,
) -> opentelemetry::metrics::Histogram<f64> {
    meter
        .f64_histogram(name)
        .with_unit("s")
        .with_description(description)
        .with_boundaries(LATENCY_BUCKETS.to_vec())
        .build()
}

/// A histogram of requests per call (retries, hedges), with [`RETRY_BUCKETS`].
pub(crate) fn per_call_histogram(
    meter: &opentelemetry::metrics::Meter,
    name: &'static str,
    unit: &'static str,
    description: &'static str,
) -> opentelemetry::metrics::Histogram<u64> {
    meter
        .u64_histogram(name)
        .with_unit(unit)
        .with_description(description)
        .with_boundaries(RETRY_BUCKETS.to_vec())
        .build()
}
