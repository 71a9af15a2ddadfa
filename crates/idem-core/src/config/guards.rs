//! The client's guards against retry storms (`idem.client.retryBudget` and
//! `idem.client.circuitBreaker`): their validated settings and their readers.
//!
//! ```
//! use idem_core::config::ServiceConfig;
//! let config = ServiceConfig::from_json(r#"{"idem": {"client": {
//!   "retryBudget": {"ratio": 0.1, "minRetriesPerSecond": 10, "window": "10s"},
//!   "circuitBreaker": {"failureRatio": 0.5, "minCalls": 20, "window": "10s",
//!                      "openFor": "5s", "halfOpenProbes": 3}
//! }}}"#).unwrap();
//! let client = &config.settings().client;
//! assert_eq!(client.retry_budget.unwrap().ratio.get(), 0.1);
//! assert_eq!(client.circuit_breaker.unwrap().half_open_probes, 3);
//! ```

use std::fmt;
use std::time::Duration;

use serde_json::Value;

use super::read::{Obj, Validator, Zero};
use crate::code::{Code, CodeSet};

/// A ratio in (0, 1]: never NaN, so it is `Eq`.
#[derive(Debug, Clone, Copy, PartialEq, PartialOrd)]
pub struct Ratio(f64);

impl Eq for Ratio {}

impl Ratio {
    /// `Some` for a number in (0, 1].
    pub fn new(x: f64) -> Option<Ratio> {
        (x > 0.0 && x <= 1.0).then_some(Ratio(x))
    }
    /// The number.
    pub fn get(self) -> f64 {
        self.0
    }
}

impl fmt::Display for Ratio {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// `idem.client.retryBudget`: retries (and hedges) may be at most `ratio` of the calls
/// over the last `window`, plus `minRetriesPerSecond` × `window` retries that any
/// client may make (so a client with little traffic can still retry).
///
/// # Defaults
/// Absent: no budget. When present: `ratio` 0.1, `minRetriesPerSecond` 10, `window`
/// `"10s"` (each field may be left out).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryBudgetSettings {
    /// Retries allowed per call, over the window: in (0, 1].
    pub ratio: Ratio,
    /// Retries allowed per second whatever the traffic (0 allowed).
    pub min_retries_per_second: u32,
    /// How far back calls and retries are counted: > 0.
    pub window: Duration,
}

impl Default for RetryBudgetSettings {
    fn default() -> Self {
        RetryBudgetSettings {
            ratio: Ratio(0.1),
            min_retries_per_second: 10,
            window: Duration::from_secs(10),
        }
    }
}

/// `idem.client.circuitBreaker`: one breaker per layer (one channel, or one target when
/// layers share it); a `methodConfig[]` entry's own `circuitBreaker` (same fields) gives
/// its methods a breaker of their own instead.
///
/// Closed, it counts the **attempts** that end over the last `window` (each is a call to
/// the target: a call retried twice is three); once at least `minCalls` ended there and
/// `failureRatio` of them failed with a code in `failureStatusCodes`, it opens. At half
/// that ratio, calls still go out but are no longer retried or hedged. Open, calls fail
/// at once (UNAVAILABLE, reason `CIRCUIT_OPEN`) for `openFor`; then Half-Open lets
/// `halfOpenProbes` calls through (never retried, never hedged), judged by the same
/// ratio: `failureRatio` of them fail, it opens again for longer (× 2 per reopening, up
/// to 8 × `openFor`, ± 20 % jitter); else it closes.
///
/// # Defaults
/// Absent: no breaker. When present: `failureRatio` 0.5, `minCalls` 20, `window`
/// `"10s"`, `openFor` `"5s"`, `halfOpenProbes` 3, `failureStatusCodes` UNAVAILABLE,
/// DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CircuitBreakerSettings {
    /// Share of failed attempts that opens the breaker (half of it stops retries), and
    /// of failed probes that reopens it: in (0, 1].
    pub failure_ratio: Ratio,
    /// Attempts that must have ended in the window before it may open: > 0.
    pub min_calls: u32,
    /// How far back attempts are counted: > 0.
    pub window: Duration,
    /// How long it stays open the first time: > 0.
    pub open_for: Duration,
    /// Calls let through while half-open: > 0.
    pub half_open_probes: u32,
    /// The codes that count as a failure (a committed response never does).
    pub failure_status_codes: CodeSet,
}

impl Default for CircuitBreakerSettings {
    fn default() -> Self {
        CircuitBreakerSettings {
            failure_ratio: Ratio(0.5),
            min_calls: 20,
            window: Duration::from_secs(10),
            open_for: Duration::from_secs(5),
            half_open_probes: 3,
            failure_status_codes: [
                Code::Unavailable,
                Code::DeadlineExceeded,
                Code::ResourceExhausted,
            ]
            .into_iter()
            .collect(),
        }
    }
}

pub(super) const BUDGET_FIELDS: &[&str] = &["ratio", "minRetriesPerSecond", "window"];
pub(super) const BREAKER_FIELDS: &[&str] = &[
    "failureRatio",
    "minCalls",
    "window",
    "openFor",
    "halfOpenProbes",
    "failureStatusCodes",
];

const RATIO_RULE: &str = "must be a number in (0, 1]";

impl Validator {
    pub(super) fn retry_budget(&mut self, v: &Value, path: String) -> Option<RetryBudgetSettings> {
        let o = self.object(v, path, BUDGET_FIELDS)?;
        let errors_before = self.errors.len();
        let mut b = RetryBudgetSettings::default();
        if let Some(r) = self.ratio_field(&o, "ratio") {
            b.ratio = r;
        }
        let rule = "must be an integer in 0..=1000000";
        if let Some(n) = self.integer_field(&o, "minRetriesPerSecond", 0, 1_000_000, rule) {
            b.min_retries_per_second = n as u32;
        }
        if let Some(d) = self.window_field(&o, "window") {
            b.window = d;
        }
        (self.errors.len() == errors_before).then_some(b)
    }

    pub(super) fn circuit_breaker(
        &mut self,
        v: &Value,
        path: String,
    ) -> Option<CircuitBreakerSettings> {
        let o = self.object(v, path, BREAKER_FIELDS)?;
        let errors_before = self.errors.len();
        let mut b = CircuitBreakerSettings::default();
        if let Some(r) = self.ratio_field(&o, "failureRatio") {
            b.failure_ratio = r;
        }
        let rule = "must be an integer in 1..=1000000";
        if let Some(n) = self.integer_field(&o, "minCalls", 1, 1_000_000, rule) {
            b.min_calls = n as u32;
        }
        if let Some(d) = self.window_field(&o, "window") {
            b.window = d;
        }
        if let Some(d) = self.window_field(&o, "openFor") {
            b.open_for = d;
        }
        let rule = "must be an integer in 1..=1000";
        if let Some(n) = self.integer_field(&o, "halfOpenProbes", 1, 1000, rule) {
            b.half_open_probes = n as u32;
        }
        if let Some(codes) = self.codes_field(&o, "failureStatusCodes", true) {
            b.failure_status_codes = CodeSet::EMPTY;
            for (code, p) in codes {
                if code == Code::Ok {
                    self.error(p, "must not be OK: a success never opens the breaker");
                }
                b.failure_status_codes.insert(code);
            }
        }
        (self.errors.len() == errors_before).then_some(b)
    }

    fn ratio_field(&mut self, o: &Obj<'_>, key: &str) -> Option<Ratio> {
        let n = self.positive_number(o.get(key)?, o.path(key), RATIO_RULE)?;
        let ratio = n.as_f64().and_then(Ratio::new);
        if ratio.is_none() {
            self.error(o.path(key), RATIO_RULE);
        }
        ratio
    }

    /// A window or open time: > 0, at least the timer resolution, at most a day.
    fn window_field(&mut self, o: &Obj<'_>, key: &str) -> Option<Duration> {
        let d = self.duration_field(o, key, Zero::Refused)?;
        const DAY: Duration = Duration::from_secs(24 * 3600);
        if d < Duration::from_millis(10) || d > DAY {
            self.error(
                o.path(key),
                "must be a duration from \"0.010s\" to \"86400s\"",
            );
            return None;
        }
        Some(d)
    }
}

#[cfg(test)]
mod tests;
