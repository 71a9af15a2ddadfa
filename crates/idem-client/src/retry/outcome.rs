//! Why a call stopped, how many attempts it took, and counters.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use http::HeaderValue;
use tonic::Code;

/// Response header (local only: the layer adds it to Trailers-Only error responses, where
/// tonic exposes it as [`Status::metadata`](tonic::Status::metadata)) naming the
/// [`CallOutcome`].
pub const OUTCOME_HEADER: &str = idem_core::headers::RETRY_OUTCOME;
/// Response header (local only, see [`OUTCOME_HEADER`]) with the number of attempts.
pub const ATTEMPTS_HEADER: &str = idem_core::headers::RETRY_ATTEMPTS;

/// Why the retry layer stopped a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum CallOutcome {
    /// A Trailers-Only response with status OK.
    Ok,
    /// The server sent real response headers: the call is committed and passed through
    /// untouched. Its final status comes in the trailers (usually OK). This is how every
    /// normal successful tonic call ends.
    Committed,
    /// The method has no retry policy: one attempt, passed through.
    NoRetryPolicy,
    /// The status (or transport error) is not in `retryableStatusCodes`.
    NonRetryableCode,
    /// `maxAttempts` attempts were made, the last one failed with a retryable code.
    AttemptsExhausted,
    /// The A6 throttle refused the retry.
    Throttled,
    /// The server said not to retry (`grpc-retry-pushback-ms` negative, unparseable or
    /// repeated).
    PushbackStop,
    /// The call's deadline passed, or the next retry could not have started (with at least
    /// the minimum attempt time left) before it.
    Deadline,
    /// The request body was larger than the per-call replay buffer: sent once.
    BodyTooLarge,
    /// The channel's total replay budget was used up by other calls: sent once.
    ReplayBudgetExhausted,
    /// Reading the request body failed: sent once with what was read and the error.
    BodyError,
    /// The inner service failed to become ready for a retry; its error is returned.
    ServiceError,
}

impl CallOutcome {
    /// Every outcome, in declaration order.
    pub const ALL: [CallOutcome; 12] = [
        CallOutcome::Ok,
        CallOutcome::Committed,
        CallOutcome::NoRetryPolicy,
        CallOutcome::NonRetryableCode,
        CallOutcome::AttemptsExhausted,
        CallOutcome::Throttled,
        CallOutcome::PushbackStop,
        CallOutcome::Deadline,
        CallOutcome::BodyTooLarge,
        CallOutcome::ReplayBudgetExhausted,
        CallOutcome::BodyError,
        CallOutcome::ServiceError,
    ];

    /// Stable snake-case name (`attempts_exhausted`), used in the header and tracing.
    pub fn as_str(self) -> &'static str {
        match self {
            CallOutcome::Ok => "ok",
            CallOutcome::Committed => "committed",
            CallOutcome::NoRetryPolicy => "no_retry_policy",
            CallOutcome::NonRetryableCode => "non_retryable_code",
            CallOutcome::AttemptsExhausted => "attempts_exhausted",
            CallOutcome::Throttled => "throttled",
            CallOutcome::PushbackStop => "pushback_stop",
            CallOutcome::Deadline => "deadline",
            CallOutcome::BodyTooLarge => "body_too_large",
            CallOutcome::ReplayBudgetExhausted => "replay_budget_exhausted",
            CallOutcome::BodyError => "body_error",
            CallOutcome::ServiceError => "service_error",
        }
    }

    /// Parses [`as_str`](Self::as_str).
    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|o| o.as_str() == name)
    }

    /// Whether the call gave up on retrying a retryable failure (exhausted, throttled or
    /// told to stop by the server). A server handler that returns this failure upstream
    /// should mark it `grpc-retry-pushback-ms: -1` so upstream clients do not retry it
    /// again (retry at one layer only, DESIGN.md section 4).
    pub fn retries_gave_up(self) -> bool {
        matches!(
            self,
            CallOutcome::AttemptsExhausted | CallOutcome::Throttled | CallOutcome::PushbackStop
        )
    }

    fn index(self) -> usize {
        Self::ALL.iter().position(|o| *o == self).unwrap_or(0)
    }
}

impl fmt::Display for CallOutcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What the retry layer did with one call. Put in the response's
/// [`http::Extensions`]; a tonic caller reads it with [`CallReport::from_response`]
/// (successful calls) or [`CallReport::from_status`] (Trailers-Only errors, where tonic
/// keeps only the headers, so the layer also writes [`OUTCOME_HEADER`] and
/// [`ATTEMPTS_HEADER`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CallReport {
    /// Why the call stopped.
    pub outcome: CallOutcome,
    /// Attempts made, including the first (0 when the deadline had passed before any).
    pub attempts: u32,
    /// The status code of the last attempt when it ended Trailers-Only (or was made up by
    /// the layer: DEADLINE_EXCEEDED, CANCELLED); `None` for committed responses and
    /// transport errors.
    pub last_code: Option<Code>,
}

impl CallReport {
    /// The report of a successful tonic call.
    pub fn from_response<T>(response: &tonic::Response<T>) -> Option<CallReport> {
        response.extensions().get::<CallReport>().copied()
    }

    /// The report of a failed tonic call, from the local headers the layer adds to
    /// Trailers-Only errors. `None` for errors the layer did not see end (transport
    /// errors, errors in the trailers of a committed call).
    pub fn from_status(status: &tonic::Status) -> Option<CallReport> {
        let md = status.metadata();
        let outcome = CallOutcome::parse(md.get(OUTCOME_HEADER)?.to_str().ok()?)?;
        let attempts = md.get(ATTEMPTS_HEADER)?.to_str().ok()?.parse().ok()?;
        Some(CallReport {
            outcome,
            attempts,
            last_code: Some(status.code()),
        })
    }

    pub(crate) fn write_headers(&self, headers: &mut http::HeaderMap) {
        headers.insert(
            OUTCOME_HEADER,
            HeaderValue::from_static(self.outcome.as_str()),
        );
        headers.insert(ATTEMPTS_HEADER, HeaderValue::from(self.attempts));
    }
}

/// A callback told about every finished call: `(method path, report)`. The cross-hop
/// issue uses it (and [`CallOutcome::retries_gave_up`]) to mark upstream failures.
pub type OutcomeHook = Arc<dyn Fn(&str, &CallReport) + Send + Sync>;

#[derive(Debug, Default)]
struct StatsInner {
    calls: AtomicU64,
    attempts: AtomicU64,
    retries: AtomicU64,
    outcomes: [AtomicU64; 12],
}

/// Counters of one layer and its clones. Cheap to clone (an `Arc`).
#[derive(Debug, Clone, Default)]
pub struct RetryStats(Arc<StatsInner>);

/// A copy of the counters at one moment.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RetryStatsSnapshot {
    /// Calls started.
    pub calls: u64,
    /// Attempts sent (first attempts included).
    pub attempts: u64,
    /// Retries started (attempts after the first).
    pub retries: u64,
    /// Finished calls by outcome, in [`CallOutcome::ALL`] order.
    pub outcomes: [u64; 12],
}

impl RetryStatsSnapshot {
    /// Finished calls with this outcome.
    pub fn outcome(&self, outcome: CallOutcome) -> u64 {
        self.outcomes[outcome.index()]
    }
}

impl RetryStats {
    /// The counters now.
    pub fn snapshot(&self) -> RetryStatsSnapshot {
        let s = &self.0;
        let mut outcomes = [0; 12];
        for (o, a) in outcomes.iter_mut().zip(s.outcomes.iter()) {
            *o = a.load(Ordering::Relaxed);
        }
        RetryStatsSnapshot {
            calls: s.calls.load(Ordering::Relaxed),
            attempts: s.attempts.load(Ordering::Relaxed),
            retries: s.retries.load(Ordering::Relaxed),
            outcomes,
        }
    }
    pub(crate) fn call(&self) {
        self.0.calls.fetch_add(1, Ordering::Relaxed);
    }
    pub(crate) fn attempt(&self, first: bool) {
        self.0.attempts.fetch_add(1, Ordering::Relaxed);
        if !first {
            self.0.retries.fetch_add(1, Ordering::Relaxed);
        }
    }
    pub(crate) fn finished(&self, outcome: CallOutcome) {
        self.0.outcomes[outcome.index()].fetch_add(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for o in CallOutcome::ALL {
            assert_eq!(CallOutcome::parse(o.as_str()), Some(o));
            assert_eq!(CallOutcome::ALL[o.index()], o);
        }
        assert_eq!(CallOutcome::parse("nope"), None);
    }

    #[test]
    fn report_survives_tonic_status_metadata() {
        let mut resp = tonic::Status::unavailable("down").into_http::<tonic::body::Body>();
        let report = CallReport {
            outcome: CallOutcome::AttemptsExhausted,
            attempts: 3,
            last_code: None,
        };
        report.write_headers(resp.headers_mut());
        let status = tonic::Status::from_header_map(resp.headers()).unwrap();
        let back = CallReport::from_status(&status).unwrap();
        assert_eq!(back.outcome, CallOutcome::AttemptsExhausted);
        assert_eq!(back.attempts, 3);
        assert_eq!(back.last_code, Some(Code::Unavailable));
    }
}
