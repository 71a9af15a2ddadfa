//! [`ClientMetrics`]: gRPC's client metrics (gRFC A66, A96) and idem's, from a
//! [`RetryLayer`]'s observer events.

use std::sync::Arc;

use idem_client::metrics::{CallEnded, CallObserver};
use idem_client::{AttemptEnd, RetryLayer};
use idem_core::ServiceConfig;
use opentelemetry::metrics::{Counter, Histogram, Meter};
use opentelemetry::{KeyValue, Value};
use tonic::Code;

use crate::labels::{self, MethodLabels};
use crate::{LATENCY_BUCKETS, RETRY_BUCKETS};

/// Records a retry layer's calls as OpenTelemetry instruments (see the
/// [crate docs](crate) for the table). Cheap to clone.
///
/// ```
/// # fn f(meter: opentelemetry::metrics::Meter, config: idem_core::ServiceConfig) -> Result<(), idem_client::BuildError> {
/// use idem_client::RetryLayer;
/// use idem_otel::ClientMetrics;
///
/// let metrics = ClientMetrics::new(&meter, "dns:///orders.internal:443", &config);
/// let layer = RetryLayer::builder().service_config(config).observer(metrics.clone()).build()?;
/// metrics.watch(&layer); // the throttle's tokens, read at each collection
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct ClientMetrics(Arc<Inner>);

struct Inner {
    meter: Meter,
    target: KeyValue,
    methods: MethodLabels,
    attempt_started: Counter<u64>,
    attempt_duration: Histogram<f64>,
    call_duration: Histogram<f64>,
    call_retries: Histogram<u64>,
    call_hedges: Histogram<u64>,
    retry_delay: Histogram<f64>,
    outcome: Counter<u64>,
}

impl std::fmt::Debug for ClientMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientMetrics")
            .field("target", &self.0.target.value)
            .finish_non_exhaustive()
    }
}

impl ClientMetrics {
    /// Instruments on `meter` for calls to `target` (the channel's target URI, A66's
    /// `grpc.target`). Methods named in `config` (exactly or by their service) are
    /// labelled by name, others `"other"`; add more with [`method`](Self::method).
    pub fn new(meter: &Meter, target: impl Into<String>, config: &ServiceConfig) -> Self {
        ClientMetrics(Arc::new(Inner {
            // Shared, not owned: an owned string value is copied at every clone.
            target: KeyValue::new("grpc.target", Value::from(Arc::<str>::from(target.into()))),
            methods: MethodLabels::from_config(config, true),
            attempt_started: meter
                .u64_counter("grpc.client.attempt.started")
                .with_unit("{attempt}")
                .with_description("Attempts started, retries included.")
                .build(),
            attempt_duration: meter
                .f64_histogram("grpc.client.attempt.duration")
                .with_unit("s")
                .with_description("Each attempt, from sending it to its status.")
                .with_boundaries(LATENCY_BUCKETS.to_vec())
                .build(),
            call_duration: meter
                .f64_histogram("grpc.client.call.duration")
                .with_unit("s")
                .with_description(
                    "Each call as the application sees it, every attempt and wait included.",
                )
                .with_boundaries(LATENCY_BUCKETS.to_vec())
                .build(),
            call_retries: meter
                .u64_histogram("grpc.client.call.retries")
                .with_unit("{retry}")
                .with_description(
                    "Retries per call that retried (calls without retries are not recorded).",
                )
                .with_boundaries(RETRY_BUCKETS.to_vec())
                .build(),
            call_hedges: meter
                .u64_histogram("grpc.client.call.hedges")
                .with_unit("{hedge}")
                .with_description(
                    "Hedges per hedged call beyond the first request (calls without hedges are not recorded).",
                )
                .with_boundaries(RETRY_BUCKETS.to_vec())
                .build(),
            retry_delay: meter
                .f64_histogram("grpc.client.call.retry_delay")
                .with_unit("s")
                .with_description(
                    "Per call, the time with no attempt in flight (backoff and pushback waits).",
                )
                .with_boundaries(LATENCY_BUCKETS.to_vec())
                .build(),
            outcome: meter
                .u64_counter("idem.client.call.outcome")
                .with_unit("{call}")
                .with_description("Finished calls by why the retry layer stopped (idem.outcome).")
                .build(),
            meter: meter.clone(),
        }))
    }

    /// Labels `method` (`pkg.Service/Method`) by its name too.
    pub fn method(mut self, method: &str) -> Self {
        match Arc::get_mut(&mut self.0) {
            Some(inner) => inner.methods.add(method),
            None => tracing::warn!("ClientMetrics::method called after the metrics were shared"),
        }
        self
    }

    /// Reports `layer`'s retry-throttle tokens (`idem.client.retry_throttle.tokens`) at
    /// each collection; nothing while the layer has no throttle.
    pub fn watch(&self, layer: &RetryLayer) {
        let layer = layer.clone();
        let target = self.0.target.clone();
        self.0
            .meter
            .f64_observable_gauge("idem.client.retry_throttle.tokens")
            .with_unit("{token}")
            .with_description("Tokens left in the A6 retry throttle; retries stop at or below half of the maximum.")
            .with_callback(move |g| {
                if let Some(t) = layer.throttle() {
                    g.observe(f64::from(t.milli_tokens()) / 1000.0, std::slice::from_ref(&target));
                }
            })
            .build();
    }
}

impl CallObserver for ClientMetrics {
    fn attempt_started(&self, method: &str) {
        let m = &self.0;
        let attrs = [
            KeyValue::new("grpc.method", m.methods.of(method)),
            m.target.clone(),
        ];
        m.attempt_started.add(1, &attrs);
    }

    fn call_ended(&self, call: &CallEnded<'_>) {
        let m = &self.0;
        let method = KeyValue::new("grpc.method", m.methods.of(call.method));
        let mut attrs = [method, m.target.clone(), labels::status(call.status)];
        let attempts = call.report.history().count();
        for (i, a) in call.report.history().enumerate() {
            let last = i + 1 == attempts;
            let (took, code) = match (last, call.last_attempt) {
                (true, Some(t)) => (t, call.status),
                _ => (a.took, attempt_code(a.end, call.status)),
            };
            attrs[2] = labels::status(code);
            m.attempt_duration.record(took.as_secs_f64(), &attrs);
        }
        attrs[2] = labels::status(call.status);
        m.call_duration.record(call.duration.as_secs_f64(), &attrs);
        let call_attrs = &attrs[..2];
        // A96: the requests beyond the first are hedges of a hedged call, retries of
        // any other; each is recorded only when there was at least one.
        let extra = u64::from(call.report.attempts.saturating_sub(1));
        let extra_of = if call.report.hedges().is_some() {
            &m.call_hedges
        } else {
            &m.call_retries
        };
        if extra > 0 {
            extra_of.record(extra, call_attrs);
        }
        m.retry_delay
            .record(call.retry_delay().as_secs_f64(), call_attrs);
        let outcome = KeyValue::new("idem.outcome", call.report.outcome.as_str());
        m.outcome
            .add(1, &[attrs[0].clone(), attrs[1].clone(), outcome]);
    }
}

/// The status an attempt that was not the last ended with.
fn attempt_code(end: AttemptEnd, call_status: Code) -> Code {
    match end {
        AttemptEnd::Status(code) => code,
        AttemptEnd::TransportError => Code::Unavailable,
        AttemptEnd::RecvTimeout => Code::Cancelled,
        AttemptEnd::Deadline => Code::DeadlineExceeded,
        _ => call_status,
    }
}
