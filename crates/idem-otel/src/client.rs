//! [`ClientMetrics`]: gRPC's client metrics (gRFC A66, A96) and idem's, from a
//! [`RetryLayer`]'s observer events.

use std::sync::Arc;

use idem_client::metrics::{CallEnded, CallObserver};
use idem_client::retry::{AttemptEnd, BreakerState, CallOutcome, CircuitBreaker, RetryLayer};
use idem_core::config::ServiceConfig;
use opentelemetry::metrics::{AsyncInstrument, Histogram, Meter};
use opentelemetry::{KeyValue, Value};
use tonic::Code;

use crate::labels::{
    self, BoundSeries, MethodCounters, MethodLabels, PerMethod, STATUS_COUNT, Striped, status_index,
};
use crate::{observed_counter, per_call_histogram, seconds_histogram};

/// Records a retry layer's calls as OpenTelemetry instruments (see the
/// [crate docs](crate) for the table). Cheap to clone.
///
/// ```
/// # fn f(meter: opentelemetry::metrics::Meter, config: idem_core::config::ServiceConfig) -> Result<(), idem_client::retry::BuildError> {
/// use idem_client::retry::RetryLayer;
/// use idem_otel::ClientMetrics;
///
/// let metrics = ClientMetrics::new(&meter, "dns:///orders.internal:443", &config);
/// let layer = RetryLayer::builder().service_config(config).observer(metrics.clone()).build()?;
/// metrics.watch(&layer); // the throttle's tokens, read at each collection
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct ClientMetrics(Arc<ClientInstruments>);

struct ClientInstruments {
    meter: Meter,
    target: KeyValue,
    counts: Arc<MethodCounters<ClientCounts>>,
    attempt_duration: Histogram<f64>,
    call_duration: Histogram<f64>,
    call_retries: Histogram<u64>,
    call_hedges: Histogram<u64>,
    call_transparent: Histogram<u64>,
    retry_delay: Histogram<f64>,
}

/// The client's counters per method label (see [`MethodCounters`]).
#[derive(Default)]
struct ClientCounts {
    attempts: Striped<1>,
    outcomes: Striped<{ CallOutcome::COUNT }>,
    /// Calls that failed first and succeeded on a retry (or a later hedge).
    rescued: Striped<1>,
    /// The histograms' series of this method, per `grpc.status` where they have one.
    attempt_duration: BoundSeries<f64, STATUS_COUNT>,
    call_duration: BoundSeries<f64, STATUS_COUNT>,
    call_retries: BoundSeries<u64, 1>,
    call_hedges: BoundSeries<u64, 1>,
    call_transparent: BoundSeries<u64, 1>,
    retry_delay: BoundSeries<f64, 1>,
}

impl ClientCounts {
    /// Hands the histogram values buffered since the last collection to the SDK (see
    /// [`BoundSeries`]).
    fn flush(&self) {
        self.attempt_duration.flush();
        self.call_duration.flush();
        self.call_retries.flush();
        self.call_hedges.flush();
        self.call_transparent.flush();
        self.retry_delay.flush();
    }
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
        // Shared, not owned: an owned string value is copied at every clone.
        let target = KeyValue::new("grpc.target", Value::from(Arc::<str>::from(target.into())));
        let counts = Arc::new(MethodCounters::<ClientCounts>::new(
            MethodLabels::from_config(config, true),
        ));
        type Observe = fn(&PerMethod<ClientCounts>, &KeyValue, &dyn AsyncInstrument<u64>);
        let counters: [(&str, &str, &str, Observe); 3] = [
            (
                "grpc.client.attempt.started",
                "{attempt}",
                "Attempts started, retries and hedges included.",
                |m, target, o| {
                    let n = m.counts.attempts.get(0);
                    if n > 0 {
                        o.observe(n, &[m.method.clone(), target.clone()]);
                    }
                },
            ),
            (
                "idem.client.call.outcome",
                "{call}",
                "Finished calls by why the retry layer stopped (idem.outcome).",
                |m, target, o| {
                    for (i, outcome) in CallOutcome::ALL.iter().enumerate() {
                        let n = m.counts.outcomes.get(i);
                        if n > 0 {
                            let outcome = KeyValue::new("idem.outcome", outcome.as_str());
                            o.observe(n, &[m.method.clone(), target.clone(), outcome]);
                        }
                    }
                },
            ),
            (
                "idem.client.call.rescued",
                "{call}",
                "Calls that ended OK after a failed attempt: rescued by a retry, or by a later hedge.",
                |m, target, o| {
                    let n = m.counts.rescued.get(0);
                    if n > 0 {
                        o.observe(n, &[m.method.clone(), target.clone()]);
                    }
                },
            ),
        ];
        for (name, unit, description, observe) in counters {
            let (c, t) = (counts.clone(), target.clone());
            observed_counter(meter, name, unit, description, move |o| {
                // The histograms are flushed in each counter's callback: a view may drop
                // either counter.
                c.each(|m| {
                    m.counts.flush();
                    observe(m, &t, o);
                })
            });
        }
        ClientMetrics(Arc::new(ClientInstruments {
            target,
            counts,
            attempt_duration: seconds_histogram(
                meter,
                "grpc.client.attempt.duration",
                "Each attempt, from sending it to its status.",
            ),
            call_duration: seconds_histogram(
                meter,
                "grpc.client.call.duration",
                "Each call as the application sees it, every attempt and wait included.",
            ),
            call_retries: per_call_histogram(
                meter,
                "grpc.client.call.retries",
                "{retry}",
                "Retries per call that retried (calls without retries are not recorded).",
            ),
            call_hedges: per_call_histogram(
                meter,
                "grpc.client.call.hedges",
                "{hedge}",
                "Hedges per hedged call beyond the first request (calls without hedges are not recorded).",
            ),
            call_transparent: per_call_histogram(
                meter,
                "grpc.client.call.transparent_retries",
                "{transparent_retry}",
                "Transparent retries per call that had any (gRFC A6: attempts the server's application never saw, sent again).",
            ),
            retry_delay: seconds_histogram(
                meter,
                "grpc.client.call.retry_delay",
                "Per call, the time with no attempt in flight (backoff and pushback waits).",
            ),
            meter: meter.clone(),
        }))
    }

    /// Labels `method` (`pkg.Service/Method`) by its name too.
    pub fn method(self, method: &str) -> Self {
        self.0.counts.add_method(method);
        self
    }

    /// Reports `layer`'s retry-throttle tokens (`idem.client.retry_throttle.tokens`), its
    /// circuit breaker's state and transitions (`idem.client.circuit_breaker.state`,
    /// `.transitions`) and its retry budget's refusals
    /// (`idem.client.retry_budget.refusals`) at each collection; nothing for a guard
    /// the layer does not have.
    pub fn watch(&self, layer: &RetryLayer) {
        self.watch_guards(layer);
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

impl ClientMetrics {
    fn watch_guards(&self, layer: &RetryLayer) {
        let meter = &self.0.meter;
        let (l, target) = (layer.clone(), self.0.target.clone());
        meter
            .u64_observable_gauge("idem.client.circuit_breaker.state")
            .with_unit("1")
            .with_description("The circuit breaker's state: 0 closed, 1 open, 2 half-open.")
            .with_callback(move |g| {
                for (b, attrs) in breakers(&l, &target) {
                    let state = BreakerState::ALL.iter().position(|s| *s == b.state());
                    g.observe(state.unwrap_or(0) as u64, &attrs);
                }
            })
            .build();
        let (l, target) = (layer.clone(), self.0.target.clone());
        observed_counter(
            meter,
            "idem.client.circuit_breaker.transitions",
            "{transition}",
            "Circuit breaker transitions, by the state entered (idem.breaker.state).",
            move |o| {
                for (b, mut attrs) in breakers(&l, &target) {
                    for state in BreakerState::ALL {
                        let n = b.transitions(state);
                        if n > 0 {
                            attrs.push(KeyValue::new("idem.breaker.state", state.as_str()));
                            o.observe(n, &attrs);
                            attrs.pop();
                        }
                    }
                }
            },
        );
        let (l, target) = (layer.clone(), self.0.target.clone());
        observed_counter(
            meter,
            "idem.client.retry_budget.refusals",
            "{retry}",
            "Retries and hedges the retry budget refused.",
            move |o| {
                if let Some(b) = l.retry_budget() {
                    o.observe(b.refused(), std::slice::from_ref(&target));
                }
            },
        );
    }
}

/// The layer's breaker (attributes: the target) and those of method config entries with
/// their own (also `grpc.method`: the entry's first name, `a.B/M` or `a.B/*`).
fn breakers(layer: &RetryLayer, target: &KeyValue) -> Vec<(CircuitBreaker, Vec<KeyValue>)> {
    let own = layer
        .method_circuit_breakers()
        .into_iter()
        .map(|(name, b)| {
            let method = KeyValue::new("grpc.method", name.to_string());
            (b, vec![method, target.clone()])
        });
    layer
        .circuit_breaker()
        .map(|b| (b, vec![target.clone()]))
        .into_iter()
        .chain(own)
        .collect()
}

impl CallObserver for ClientMetrics {
    fn attempt_started(&self, method: &str) {
        self.0.counts.with(method, |m| m.counts.attempts.add(0));
    }

    fn call_ended(&self, call: &CallEnded<'_>) {
        self.0.counts.with(call.method, |m| self.0.record(m, call));
    }
}

impl ClientInstruments {
    /// Records `call` on its method's `counts`.
    fn record(&self, counts: &PerMethod<ClientCounts>, call: &CallEnded<'_>) {
        let m = self;
        if let Some(i) = CallOutcome::ALL
            .iter()
            .position(|o| *o == call.report.outcome)
        {
            counts.counts.outcomes.add(i);
        }
        if rescued(call) {
            counts.counts.rescued.add(0);
        }
        let series = &counts.counts;
        let with_status = |code: Code| {
            [
                counts.method.clone(),
                m.target.clone(),
                labels::status(code),
            ]
        };
        let attempts = call.report.history().count();
        for (i, a) in call.report.history().enumerate() {
            let last = i + 1 == attempts;
            let (took, code) = match (last, call.last_attempt) {
                (true, Some(t)) => (t, call.status),
                _ => (a.took, attempt_code(a.end, call.status)),
            };
            series
                .attempt_duration
                .record(status_index(code), took.as_secs_f64(), || {
                    m.attempt_duration.bind(&with_status(code))
                });
        }
        let code = call.status;
        series
            .call_duration
            .record(status_index(code), call.duration.as_secs_f64(), || {
                m.call_duration.bind(&with_status(code))
            });
        let call_attrs = || [counts.method.clone(), m.target.clone()];
        // A96: the requests beyond the first are hedges of a hedged call, retries of
        // any other; each is recorded only when there was at least one.
        let extra = u64::from(call.report.attempts.saturating_sub(1));
        if extra > 0 {
            let (histogram, bound) = if call.report.hedges().is_some() {
                (&m.call_hedges, &series.call_hedges)
            } else {
                (&m.call_retries, &series.call_retries)
            };
            bound.record(0, extra, || histogram.bind(&call_attrs()));
        }
        // A96: transparent retries apart (they are in `grpc.client.attempt.started`, not
        // in `grpc.client.call.retries`).
        let transparent = u64::from(call.report.transparent);
        if transparent > 0 {
            series
                .call_transparent
                .record(0, transparent, || m.call_transparent.bind(&call_attrs()));
        }
        series
            .retry_delay
            .record(0, call.retry_delay().as_secs_f64(), || {
                m.retry_delay.bind(&call_attrs())
            });
    }
}

/// Whether a call ended OK after a failed attempt: retried, or won by a later hedge.
fn rescued(call: &CallEnded<'_>) -> bool {
    if call.status != Code::Ok {
        return false;
    }
    match call.report.hedges() {
        Some(_) => call.report.winner().is_some_and(|w| w > 0),
        None => call.report.attempts > 1,
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
