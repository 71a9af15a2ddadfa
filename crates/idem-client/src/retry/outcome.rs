//! Why a call stopped, what each attempt did, and counters.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use http::{HeaderMap, HeaderValue};
use idem_core::code::code_name;
use idem_core::config::MAX_ATTEMPTS_LIMIT;
use idem_core::headers::{RETRY_ATTEMPTS, RETRY_OUTCOME};
use idem_core::striped::Striped;
use tonic::Code;

/// Declares [`CallOutcome`] from one list: each variant with its doc, its stable name and
/// the phrase [`CallReport`]'s `Display` uses; `ALL`, `COUNT`, the names, the counter
/// index and the counters all follow from it.
macro_rules! call_outcomes {
    ($($(#[doc = $doc:literal])* $variant:ident => $name:literal, $phrase:literal;)+) => {
        /// Why the retry layer stopped a call.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[non_exhaustive]
        pub enum CallOutcome {
            $($(#[doc = $doc])* $variant,)+
        }

        impl CallOutcome {
            /// Every outcome, in declaration order (the order of
            /// [`RetryStatsSnapshot::outcomes`]).
            pub const ALL: [CallOutcome; Self::COUNT] = [$(CallOutcome::$variant,)+];
            /// How many outcomes there are.
            pub const COUNT: usize = [$($name,)+].len();

            /// Stable snake-case name (`attempts_exhausted`), used in the header and tracing.
            pub fn as_str(self) -> &'static str {
                match self {
                    $(CallOutcome::$variant => $name,)+
                }
            }

            /// What happened, as a phrase ("gave up: attempts exhausted").
            pub fn describe(self) -> &'static str {
                match self {
                    $(CallOutcome::$variant => $phrase,)+
                }
            }

            /// The position in [`ALL`](Self::ALL): the discriminant, since `ALL` is the
            /// declaration order.
            fn index(self) -> usize {
                self as usize
            }
        }
    };
}

call_outcomes! {
    /// A Trailers-Only response with status OK.
    Ok => "ok", "ended OK (Trailers-Only)";
    /// The server sent real response headers: the call is committed and passed through
    /// untouched. Its final status comes in the trailers (usually OK). This is how every
    /// normal successful tonic call ends.
    Committed => "committed", "committed";
    /// The method has no retry policy: one attempt, passed through.
    NoRetryPolicy => "no_retry_policy", "passed through (no retry policy)";
    /// The status (or transport error) is not in `retryableStatusCodes`; for a hedged
    /// call, a hedge ended with a fatal status (not in `nonFatalStatusCodes`) and the
    /// others were cancelled.
    NonRetryableCode => "non_retryable_code", "stopped on a non-retryable status";
    /// `maxAttempts` attempts were made, the last one failed with a retryable code; for a
    /// hedged call, `maxAttempts` hedges went out and every one failed with a non-fatal
    /// code.
    AttemptsExhausted => "attempts_exhausted", "gave up: attempts exhausted";
    /// The A6 throttle refused the retry (or, hedging, the next hedge; the call ended
    /// when the hedges already sent had failed).
    Throttled => "throttled", "gave up: retries throttled";
    /// The server said not to retry (`grpc-retry-pushback-ms` negative, unparseable or
    /// repeated), or asked for a wait longer than the layer's maximum retry delay; for a
    /// hedged call, no hedge was sent after that answer and the others failed too.
    PushbackStop => "pushback_stop", "stopped: the server said not to retry now";
    /// The call's deadline passed, or the next retry could not have started (with at least
    /// the minimum attempt time left) before it.
    Deadline => "deadline", "stopped at the deadline";
    /// The request body was larger than the per-call replay buffer: sent once (hedging:
    /// the call committed to one hedge, the others were cancelled).
    BodyTooLarge => "body_too_large", "sent once: the request body was over the replay buffer";
    /// The channel's total replay budget was used up by other calls: sent once.
    ReplayBudgetExhausted => "replay_budget_exhausted", "sent once: the replay budget was used up";
    /// Reading the request body failed: sent once with what was read and the error.
    BodyError => "body_error", "sent once: reading the request body failed";
    /// The inner service failed to become ready for a retry.
    ServiceError => "service_error", "stopped: the inner service was not ready";
    /// A request message was over `maxRequestMessageBytes` (the call failed on the client
    /// with RESOURCE_EXHAUSTED), or a response message over `maxResponseMessageBytes`
    /// (the response ended with RESOURCE_EXHAUSTED; its trailers carry this outcome).
    MessageTooLarge => "message_too_large", "stopped: a message was over the method's size limit";
    /// `waitForReady`: the channel could not connect for the whole of
    /// [`wait_for_ready_limit`](crate::retry::RetryLayerBuilder::wait_for_ready_limit) (calls
    /// without a deadline; with one, the call ends as [`Deadline`](Self::Deadline)).
    NotReady => "not_ready", "gave up: the channel did not become ready (waitForReady)";
    /// No longer reported: hedging now sends streaming requests to every hedge (a
    /// request over a replay limit is reported as [`BodyTooLarge`](Self::BodyTooLarge) or
    /// [`ReplayBudgetExhausted`](Self::ReplayBudgetExhausted)). Kept so that reports and
    /// metrics of earlier versions still parse.
    NotHedged => "not_hedged", "sent once: the request was still streaming (hedging needs it whole)";
    /// The circuit breaker is open (or half-open with every probe out): nothing was sent,
    /// the call failed at once with UNAVAILABLE, `ErrorInfo` reason `CIRCUIT_OPEN` and a
    /// retry delay. The request never reached a server, so its idempotency key was never
    /// used: an application retry with the same key is safe. A call already under way
    /// when the breaker opened ends so too, with its last attempt's status, instead of
    /// retrying or hedging.
    CircuitOpen => "circuit_open", "refused: the circuit breaker is open";
    /// The retry budget (`retryBudget`) refused the retry (or, hedging, the next hedge).
    BudgetExhausted => "budget_exhausted", "gave up: the retry budget was used up";
    /// A half-open circuit breaker's probe failed: sent once, never retried or hedged.
    CircuitProbe => "circuit_probe", "sent once: a circuit breaker probe, never retried";
    /// The circuit breaker is closed, but half of its `failureRatio` of the recent
    /// attempts failed: the call's retry (or next hedge) was not sent, and the call ended
    /// with its last attempt's status (or UNAVAILABLE when it stopped after the wait).
    CircuitNoRetry => "circuit_no_retry", "gave up: the circuit breaker stopped retries (many recent failures)";
}

impl CallOutcome {
    /// Parses [`as_str`](Self::as_str).
    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|o| o.as_str() == name)
    }

    /// Whether the call gave up on retrying a retryable failure (exhausted, throttled or
    /// told to stop by the server). A server handler that returns this failure upstream
    /// should mark it `grpc-retry-pushback-ms: -1` so upstream clients do not retry it
    /// again (retry at one layer only).
    pub fn retries_gave_up(self) -> bool {
        matches!(
            self,
            CallOutcome::AttemptsExhausted
                | CallOutcome::Throttled
                | CallOutcome::PushbackStop
                | CallOutcome::NotReady
                | CallOutcome::CircuitOpen
                | CallOutcome::BudgetExhausted
                | CallOutcome::CircuitProbe
                | CallOutcome::CircuitNoRetry
        )
    }

    /// Why the layer stopped, for outcomes whose cause is not on the call itself: the
    /// report's `Display` ends with it.
    fn explanation(self) -> Option<&'static str> {
        Some(match self {
            CallOutcome::Throttled => {
                "retry throttle: the token bucket is at or below half; failures elsewhere on \
                 this channel spend tokens"
            }
            CallOutcome::CircuitNoRetry => {
                "circuit breaker: half of its failureRatio of the recent attempts failed; \
                 calls go out once each, without retries, until fewer fail (or it opens)"
            }
            CallOutcome::CircuitOpen => {
                "circuit breaker: the target kept failing; calls fail at once, with no \
                 retries, until probes succeed"
            }
            CallOutcome::BudgetExhausted => {
                "retry budget: retries are at most retryBudget.ratio of the calls over its window"
            }
            CallOutcome::BodyTooLarge => {
                "a call keeps at most maxReplayBytesPerCall request bytes for replay until it \
                 commits"
            }
            CallOutcome::ReplayBudgetExhausted => {
                "maxReplayBytesTotal is shared by every call of the layer"
            }
            _ => return None,
        })
    }

    /// The outcome of a call without a retry policy whose one attempt ended as `end`.
    pub(crate) fn without_policy(end: AttemptEnd) -> Self {
        match end {
            AttemptEnd::Deadline => CallOutcome::Deadline,
            _ => CallOutcome::NoRetryPolicy,
        }
    }
}

impl fmt::Display for CallOutcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How one attempt ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum AttemptEnd {
    /// Real response headers: the call committed to this attempt.
    Committed,
    /// A Trailers-Only response (or a non-200 HTTP response without `grpc-status`,
    /// mapped as gRPC does) with this code.
    Status(Code),
    /// The channel failed before anything came back (connection refused, reset…).
    TransportError,
    /// `perAttemptRecvTimeout` passed before response headers.
    RecvTimeout,
    /// The call's deadline passed during the attempt.
    Deadline,
    /// Hedging: cancelled by the layer, because another hedge won or ended the call.
    Cancelled,
}

impl AttemptEnd {
    /// Whether the attempt ended well for the A6 throttle: a committed response or a
    /// Trailers-Only OK.
    pub(crate) fn is_success(self) -> bool {
        matches!(self, AttemptEnd::Committed | AttemptEnd::Status(Code::Ok))
    }

    fn token(self) -> String {
        match self {
            AttemptEnd::Committed => "c".to_owned(),
            AttemptEnd::Status(code) => (code as i32).to_string(),
            AttemptEnd::TransportError => "t".to_owned(),
            AttemptEnd::RecvTimeout => "r".to_owned(),
            AttemptEnd::Deadline => "d".to_owned(),
            AttemptEnd::Cancelled => "x".to_owned(),
        }
    }

    fn from_token(token: &str) -> Option<Self> {
        Some(match token {
            "c" => AttemptEnd::Committed,
            "t" => AttemptEnd::TransportError,
            "r" => AttemptEnd::RecvTimeout,
            "d" => AttemptEnd::Deadline,
            "x" => AttemptEnd::Cancelled,
            n => AttemptEnd::Status(idem_core::code::code_from_i64(n.parse().ok()?)?),
        })
    }
}

impl fmt::Display for AttemptEnd {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AttemptEnd::Committed => f.write_str("response headers"),
            AttemptEnd::Status(code) => f.write_str(code_name(*code)),
            AttemptEnd::TransportError => f.write_str("transport error"),
            AttemptEnd::RecvTimeout => {
                f.write_str("no response headers within perAttemptRecvTimeout")
            }
            AttemptEnd::Deadline => f.write_str("deadline passed"),
            AttemptEnd::Cancelled => f.write_str("cancelled"),
        }
    }
}

/// One attempt of a call, as [`CallReport::history`] lists it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttemptRecord {
    /// How the attempt ended.
    pub end: AttemptEnd,
    /// From sending the request to response headers (or the failure).
    pub took: Duration,
    /// The wait before the next attempt; `None` for the last one. For a hedge: from its
    /// start to the next hedge's (`hedgingDelay`, cut short by a non-fatal status or
    /// lengthened by a server pushback).
    pub wait_after: Option<Duration>,
}

const HISTORY: usize = MAX_ATTEMPTS_LIMIT as usize;

/// What the retry layer did with one call. Put in the response's
/// [`http::Extensions`]; a tonic caller reads it with [`CallReport::from_response`]
/// (successful calls) or [`CallReport::from_status`] (every failure: the layer answers
/// failures Trailers-Only, with local headers tonic keeps as the status metadata).
///
/// Its `Display` reads as a sentence: `gave up: attempts exhausted after 3 attempts:
/// UNAVAILABLE in 12ms, then waited 20ms; transport error in 3ms, then waited 40ms;
/// UNAVAILABLE in 5ms`.
///
/// A hedged call (a method with a `hedgingPolicy`) reports its hedges:
/// [`hedges`](Self::hedges) says how many went out, [`winner`](Self::winner) which one
/// answered, and [`history`](Self::history) lists them in the order they were sent, the
/// ones still running when the call ended as [`AttemptEnd::Cancelled`]: `committed after
/// 2 hedges, won by hedge 1: cancelled in 52ms, next hedge after 50ms; response headers
/// in 2ms`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CallReport {
    /// Why the call stopped.
    pub outcome: CallOutcome,
    /// Attempts made, including the first (0 when the deadline had passed before any);
    /// for a hedged call, the hedges sent.
    pub attempts: u32,
    /// Attempts the layer sent again transparently (gRFC A6): after a failure the
    /// server's application never saw (a stream the server refused, or a request that
    /// never left the client). Not in [`attempts`](Self::attempts), not in
    /// [`history`](Self::history), and not counted against `maxAttempts`; the attempt
    /// that went out again is recorded once, as it finally ended.
    pub transparent: u32,
    /// The status code the caller gets when the call ended without committing: the last
    /// attempt's Trailers-Only code, or the code the layer made up (DEADLINE_EXCEEDED,
    /// CANCELLED, or the status tonic gives a transport error); `None` for committed
    /// responses.
    pub last_code: Option<Code>,
    history: [Option<AttemptRecord>; HISTORY],
    hedge: Option<HedgeReport>,
}

/// What a hedged call adds to its report.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct HedgeReport {
    /// The index (in `history`) of the hedge whose response the caller got.
    winner: Option<u32>,
}

impl CallReport {
    /// A report with no attempts recorded yet.
    pub(crate) fn new(outcome: CallOutcome) -> Self {
        CallReport {
            outcome,
            attempts: 0,
            transparent: 0,
            last_code: None,
            history: [None; HISTORY],
            hedge: None,
        }
    }

    /// A report for a hedged call, with no hedges recorded yet.
    pub(crate) fn hedged(outcome: CallOutcome) -> Self {
        CallReport {
            hedge: Some(HedgeReport { winner: None }),
            ..CallReport::new(outcome)
        }
    }

    /// For a hedged call, how many hedges went out (the first request included); `None`
    /// for a call that was not hedged.
    pub fn hedges(&self) -> Option<u32> {
        self.hedge.map(|_| self.attempts)
    }

    /// For a hedged call that succeeded (committed, or a Trailers-Only OK), which hedge
    /// won: its index in [`history`](Self::history), the value of
    /// `grpc-previous-rpc-attempts` it carried (0 for the first request). `None` for a
    /// failed call and a call that was not hedged.
    pub fn winner(&self) -> Option<u32> {
        self.hedge.and_then(|h| h.winner)
    }

    /// Hedging: records that hedge `index` answered the caller with a success.
    pub(crate) fn won(&mut self, index: u32) {
        if let Some(h) = self.hedge.as_mut() {
            h.winner = Some(index);
        }
    }

    /// Hedging: one more hedge was sent (its end is recorded when it comes).
    pub(crate) fn sent(&mut self) {
        self.attempts = self.attempts.saturating_add(1);
    }

    /// Hedging: hedge `index` ended as `end` after `took`.
    pub(crate) fn ended(&mut self, index: u32, end: AttemptEnd, took: Duration) {
        if let Some(slot) = self.history.get_mut(index as usize) {
            let wait_after = slot.and_then(|r| r.wait_after);
            *slot = Some(AttemptRecord {
                end,
                took,
                wait_after,
            });
        }
    }

    /// Hedging: the next hedge went out `after` the start of hedge `index`.
    pub(crate) fn next_after(&mut self, index: u32, after: Duration) {
        if let Some(slot) = self.history.get_mut(index as usize) {
            let r = slot.get_or_insert(AttemptRecord {
                end: AttemptEnd::Cancelled,
                took: Duration::ZERO,
                wait_after: None,
            });
            r.wait_after = Some(after);
        }
    }

    /// Each attempt in order: how it ended, how long it took, the wait after it.
    pub fn history(&self) -> impl Iterator<Item = &AttemptRecord> + '_ {
        self.history.iter().flatten()
    }

    /// Records an attempt that ended as `end` after `took`.
    pub(crate) fn record(&mut self, end: AttemptEnd, took: Duration) {
        if let Some(slot) = self.history.get_mut(self.attempts as usize) {
            *slot = Some(AttemptRecord {
                end,
                took,
                wait_after: None,
            });
        }
        self.attempts = self.attempts.saturating_add(1);
    }

    /// Records the wait after the last recorded attempt.
    pub(crate) fn waited(&mut self, wait: Duration) {
        let last = (self.attempts as usize).checked_sub(1);
        if let Some(Some(r)) = last.and_then(|i| self.history.get_mut(i)) {
            r.wait_after = Some(wait);
        }
    }

    /// The report of a successful tonic call.
    pub fn from_response<T>(response: &tonic::Response<T>) -> Option<CallReport> {
        response.extensions().get::<CallReport>().copied()
    }

    /// The report of a failed tonic call, from the local headers the layer adds to every
    /// failure it answers (and to the trailers it makes when the deadline cuts a response
    /// body). `None` for errors the layer did not make or see end (an error in the
    /// trailers of a committed call).
    pub fn from_status(status: &tonic::Status) -> Option<CallReport> {
        let md = status.metadata();
        let outcome = CallOutcome::parse(md.get(RETRY_OUTCOME.as_str())?.to_str().ok()?)?;
        let mut fields = md.get(RETRY_ATTEMPTS.as_str())?.to_str().ok()?.split(' ');
        let mut report = CallReport::new(outcome);
        let attempts: u32 = fields.next()?.parse().ok()?;
        let (mut history, mut hedge) = (None, None);
        for field in fields {
            if let Some(n) = field.strip_prefix('+') {
                report.transparent = n.parse().ok()?;
                continue;
            }
            match field.strip_prefix('h') {
                Some(winner) => hedge = Some(winner),
                None => history = Some(field),
            }
        }
        if let Some(winner) = hedge {
            report.hedge = Some(HedgeReport {
                winner: winner.parse().ok(),
            });
        }
        for record in history.into_iter().flat_map(|h| h.split(',')) {
            let (end, rest) = record.split_once(':')?;
            let (took, wait) = match rest.split_once('+') {
                Some((t, w)) => (t, Some(w)),
                None => (rest, None),
            };
            if report.hedge.is_some() {
                // Hedges are recorded by index, not one after the other.
                let index = u32::try_from(report.history().count()).ok()?;
                report.ended(index, AttemptEnd::from_token(end)?, micros(took)?);
                if let Some(w) = wait {
                    report.next_after(index, micros(w)?);
                }
                continue;
            }
            report.record(AttemptEnd::from_token(end)?, micros(took)?);
            if let Some(w) = wait {
                report.waited(micros(w)?);
            }
        }
        report.attempts = attempts;
        report.last_code = Some(status.code());
        Some(report)
    }

    /// The trailers that end a response the layer cuts short: `status`, and this report
    /// with `outcome` in the local report headers.
    pub(crate) fn trailers(mut self, outcome: CallOutcome, status: &tonic::Status) -> HeaderMap {
        self.outcome = outcome;
        self.last_code = Some(status.code());
        let mut trailers = HeaderMap::new();
        // `add_header` fails only on a message it cannot encode; ours are plain ASCII.
        let _ = status.add_header(&mut trailers);
        self.write_headers(&mut trailers);
        trailers
    }

    /// Writes the local report headers: the outcome, and the attempts with their
    /// history (`3 14:12000+20000,t:3000+40000,14:5000`: code or kind, µs taken, µs
    /// waited), then for a hedged call `h` and the winner's index (`h1`; `h` alone
    /// without one), then `+N` when N attempts were sent again transparently.
    pub(crate) fn write_headers(&self, headers: &mut http::HeaderMap) {
        headers.insert(
            RETRY_OUTCOME,
            HeaderValue::from_static(self.outcome.as_str()),
        );
        let mut value = self.attempts.to_string();
        for (i, r) in self.history().enumerate() {
            value.push(if i == 0 { ' ' } else { ',' });
            value.push_str(&format!("{}:{}", r.end.token(), r.took.as_micros()));
            if let Some(w) = r.wait_after {
                value.push_str(&format!("+{}", w.as_micros()));
            }
        }
        if let Some(h) = self.hedge {
            value.push_str(" h");
            if let Some(w) = h.winner {
                value.push_str(&w.to_string());
            }
        }
        if self.transparent > 0 {
            value.push_str(&format!(" +{}", self.transparent));
        }
        if let Ok(v) = HeaderValue::from_str(&value) {
            headers.insert(RETRY_ATTEMPTS, v);
        }
    }
}

fn micros(text: &str) -> Option<Duration> {
    text.parse().ok().map(Duration::from_micros)
}

impl fmt::Display for CallReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let plural = if self.attempts == 1 { "" } else { "s" };
        let (noun, then) = match self.hedge {
            Some(_) => ("hedge", "next hedge after"),
            None => ("attempt", "then waited"),
        };
        write!(
            f,
            "{} after {} {noun}{plural}",
            self.outcome.describe(),
            self.attempts
        )?;
        if self.transparent > 0 {
            let noun = if self.transparent == 1 {
                "retry"
            } else {
                "retries"
            };
            write!(f, " and {} transparent {noun}", self.transparent)?;
        }
        if let Some(w) = self.winner() {
            write!(f, ", won by hedge {w}")?;
        }
        for (i, r) in self.history().enumerate() {
            f.write_str(if i == 0 { ": " } else { "; " })?;
            write!(f, "{} in {:?}", r.end, r.took)?;
            if let Some(w) = r.wait_after {
                write!(f, ", {then} {w:?}")?;
            }
        }
        if let Some(why) = self.outcome.explanation() {
            write!(f, " ({why})")?;
        }
        Ok(())
    }
}

/// A callback told about every finished call: `(method path, report)`. Cross-hop marking
/// can use it (with [`CallOutcome::retries_gave_up`]) to tag failures passed upstream.
pub type OutcomeHook = Arc<dyn Fn(&str, &CallReport) + Send + Sync>;

/// Where [`RetryStats`] keeps each count.
const CALLS: usize = 0;
const ATTEMPTS: usize = 1;
const RETRIES: usize = 2;
const OUTCOMES: usize = 3;
const TRANSPARENT: usize = OUTCOMES + CallOutcome::COUNT;

type StatsInner = Striped<{ TRANSPARENT + 1 }>;

/// Counters of one layer and its clones. Cheap to clone (an `Arc`).
#[derive(Clone, Default)]
pub struct RetryStats(Arc<StatsInner>);

impl fmt::Debug for RetryStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("RetryStats").field(&self.snapshot()).finish()
    }
}

/// A copy of the counters at one moment.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RetryStatsSnapshot {
    /// Calls started.
    pub calls: u64,
    /// Attempts sent (first attempts included).
    pub attempts: u64,
    /// Retries started (attempts after the first). Transparent retries are not in it.
    pub retries: u64,
    /// Attempts sent again transparently (gRFC A6: the server's application never saw
    /// the one before): counted in `attempts`, not in `retries`, never against
    /// `maxAttempts`.
    pub transparent: u64,
    /// Finished calls by outcome, in [`CallOutcome::ALL`] order.
    pub outcomes: [u64; CallOutcome::COUNT],
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
        let mut outcomes = [0; CallOutcome::COUNT];
        for (i, o) in outcomes.iter_mut().enumerate() {
            *o = s.get(OUTCOMES + i);
        }
        RetryStatsSnapshot {
            calls: s.get(CALLS),
            attempts: s.get(ATTEMPTS),
            retries: s.get(RETRIES),
            transparent: s.get(TRANSPARENT),
            outcomes,
        }
    }
    pub(crate) fn call(&self) {
        self.0.add(CALLS);
    }
    pub(crate) fn attempt(&self, first: bool) {
        self.0.add(ATTEMPTS);
        if !first {
            self.0.add(RETRIES);
        }
    }
    /// A transparent retry went out (an attempt, not a retry).
    pub(crate) fn transparent(&self) {
        self.0.add(ATTEMPTS);
        self.0.add(TRANSPARENT);
    }
    pub(crate) fn finished(&self, outcome: CallOutcome) {
        self.0.add(OUTCOMES + outcome.index());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for (i, o) in CallOutcome::ALL.into_iter().enumerate() {
            assert_eq!(o.index(), i);
            assert_eq!(CallOutcome::parse(o.as_str()), Some(o));
            assert_eq!(CallOutcome::ALL[o.index()], o);
        }
        assert_eq!(CallOutcome::parse("nope"), None);
    }

    /// `report` written on an UNAVAILABLE status's headers and read back through tonic;
    /// asserts it comes back whole.
    fn through_status(report: &CallReport) -> CallReport {
        let mut resp = tonic::Status::unavailable("down").into_http::<tonic::body::Body>();
        report.write_headers(resp.headers_mut());
        let status = tonic::Status::from_header_map(resp.headers()).unwrap();
        let back = CallReport::from_status(&status).unwrap();
        assert_eq!(&back, report);
        back
    }

    #[test]
    fn report_survives_tonic_status_metadata() {
        let mut report = CallReport::new(CallOutcome::AttemptsExhausted);
        report.record(
            AttemptEnd::Status(Code::Unavailable),
            Duration::from_millis(12),
        );
        report.waited(Duration::from_millis(20));
        report.record(AttemptEnd::TransportError, Duration::from_millis(3));
        report.waited(Duration::from_millis(40));
        report.record(
            AttemptEnd::Status(Code::Unavailable),
            Duration::from_millis(5),
        );
        report.last_code = Some(Code::Unavailable);
        let back = through_status(&report);
        assert_eq!(
            back.to_string(),
            "gave up: attempts exhausted after 3 attempts: UNAVAILABLE in 12ms, then waited \
             20ms; transport error in 3ms, then waited 40ms; UNAVAILABLE in 5ms"
        );
    }

    #[test]
    fn a_hedged_report_survives_tonic_status_metadata() {
        let mut report = CallReport::hedged(CallOutcome::AttemptsExhausted);
        for _ in 0..3 {
            report.sent();
        }
        report.next_after(0, Duration::from_millis(50));
        report.ended(
            1,
            AttemptEnd::Status(Code::Unavailable),
            Duration::from_millis(2),
        );
        report.next_after(1, Duration::from_millis(2));
        report.ended(
            0,
            AttemptEnd::Status(Code::Unavailable),
            Duration::from_millis(60),
        );
        report.ended(
            2,
            AttemptEnd::Status(Code::Unavailable),
            Duration::from_millis(5),
        );
        report.last_code = Some(Code::Unavailable);
        let back = through_status(&report);
        assert_eq!((back.hedges(), back.winner()), (Some(3), None));
        assert_eq!(
            back.to_string(),
            "gave up: attempts exhausted after 3 hedges: UNAVAILABLE in 60ms, next hedge after \
             50ms; UNAVAILABLE in 2ms, next hedge after 2ms; UNAVAILABLE in 5ms"
        );
        let mut won = CallReport::hedged(CallOutcome::Committed);
        won.sent();
        won.sent();
        won.ended(0, AttemptEnd::Cancelled, Duration::from_millis(9));
        won.ended(1, AttemptEnd::Committed, Duration::from_millis(1));
        won.won(1);
        let mut headers = http::HeaderMap::new();
        won.write_headers(&mut headers);
        let md = tonic::metadata::MetadataMap::from_headers(headers);
        let status = tonic::Status::with_metadata(Code::Unknown, "", md);
        let back = CallReport::from_status(&status).unwrap();
        assert_eq!((back.hedges(), back.winner()), (Some(2), Some(1)));
        assert_eq!(back.history().next().unwrap().end, AttemptEnd::Cancelled);
        // A report that is not hedged says so.
        assert_eq!(CallReport::new(CallOutcome::Ok).hedges(), None);
    }

    #[test]
    fn bare_attempt_counts_still_parse() {
        let mut h = http::HeaderMap::new();
        h.insert(RETRY_OUTCOME, "deadline".parse().unwrap());
        h.insert(RETRY_ATTEMPTS, "2".parse().unwrap());
        let md = tonic::metadata::MetadataMap::from_headers(h);
        let status = tonic::Status::with_metadata(Code::DeadlineExceeded, "late", md);
        let r = CallReport::from_status(&status).unwrap();
        assert_eq!(
            (r.outcome, r.attempts, r.history().count()),
            (CallOutcome::Deadline, 2, 0)
        );
        assert_eq!(r.to_string(), "stopped at the deadline after 2 attempts");
    }
}
