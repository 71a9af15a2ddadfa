//! `retryPolicy` and `hedgingPolicy` (per method, gRFC A6) and the top-level
//! `retryThrottling`: the validated policies and their readers.

use std::time::Duration;

use serde_json::{Number, Value};

use super::duration::format_duration;
use super::read::{Obj, Validator, Zero};
use crate::code::{Code, CodeSet, code_name};

/// A validated `retryPolicy` (gRFC A6).
#[derive(Debug, Clone, PartialEq)]
pub struct RetryPolicy {
    pub(crate) max_attempts: u32,
    pub(crate) initial_backoff: Duration,
    pub(crate) max_backoff: Duration,
    pub(crate) backoff_multiplier: f64,
    pub(crate) retryable_status_codes: CodeSet,
    pub(crate) per_attempt_recv_timeout: Option<Duration>,
}

/// Why [`RetryPolicy::new`] refused its arguments.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid retry policy: {0}")]
pub struct InvalidRetryPolicy(pub(crate) String);

/// Most attempts A6 allows; larger values are clamped to it.
pub const MAX_ATTEMPTS_LIMIT: u32 = 5;

impl RetryPolicy {
    /// Builds a policy, checking the A6 rules: `max_attempts >= 2` (clamped to 5),
    /// backoffs > 0, multiplier > 0 and finite, codes non-empty.
    pub fn new(
        max_attempts: u32,
        initial_backoff: Duration,
        max_backoff: Duration,
        backoff_multiplier: f64,
        retryable_status_codes: CodeSet,
    ) -> Result<Self, InvalidRetryPolicy> {
        if max_attempts < 2 {
            return Err(InvalidRetryPolicy("maxAttempts must be > 1".into()));
        }
        if initial_backoff.is_zero() || max_backoff.is_zero() {
            return Err(InvalidRetryPolicy("backoffs must be > 0".into()));
        }
        if !(backoff_multiplier.is_finite() && backoff_multiplier > 0.0) {
            return Err(InvalidRetryPolicy("backoffMultiplier must be > 0".into()));
        }
        if retryable_status_codes.is_empty() {
            return Err(InvalidRetryPolicy(
                "retryableStatusCodes must not be empty".into(),
            ));
        }
        Ok(RetryPolicy {
            max_attempts: max_attempts.min(MAX_ATTEMPTS_LIMIT),
            initial_backoff,
            max_backoff,
            backoff_multiplier,
            retryable_status_codes,
            per_attempt_recv_timeout: None,
        })
    }

    /// This policy with a `perAttemptRecvTimeout`.
    pub fn with_per_attempt_recv_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.per_attempt_recv_timeout = timeout;
        self
    }
    /// Attempts including the first, already clamped to 2..=5.
    pub fn max_attempts(&self) -> u32 {
        self.max_attempts
    }
    /// Backoff before the first retry (before jitter).
    pub fn initial_backoff(&self) -> Duration {
        self.initial_backoff
    }
    /// Cap on the backoff (before jitter).
    pub fn max_backoff(&self) -> Duration {
        self.max_backoff
    }
    /// Growth of the backoff per retry.
    pub fn backoff_multiplier(&self) -> f64 {
        self.backoff_multiplier
    }
    /// Codes that are retried.
    pub fn retryable_status_codes(&self) -> CodeSet {
        self.retryable_status_codes
    }
    /// Optional per-attempt receive timeout.
    pub fn per_attempt_recv_timeout(&self) -> Option<Duration> {
        self.per_attempt_recv_timeout
    }
}

/// A validated `hedgingPolicy` (gRFC A6), executed by the client layer (`idem-client`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HedgingPolicy {
    /// Attempts including the first, clamped to 2..=5.
    pub max_attempts: u32,
    /// Delay between hedges (`hedgingDelay`, default 0).
    pub hedging_delay: Duration,
    /// Codes that do not stop the other hedges.
    pub non_fatal_status_codes: CodeSet,
}

/// A validated `retryThrottling` (gRFC A6), kept in milli-tokens as C-core and
/// grpc-java do so a ratio keeps exactly 3 decimals.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryThrottling {
    /// `maxTokens × 1000`; `maxTokens` is in (0, 1000].
    pub max_milli_tokens: u32,
    /// `tokenRatio × 1000`, truncated to 3 decimals; > 0.
    pub token_ratio_milli: u32,
}

pub(super) const RETRY_FIELDS: &[&str] = &[
    "maxAttempts",
    "initialBackoff",
    "maxBackoff",
    "backoffMultiplier",
    "retryableStatusCodes",
    "perAttemptRecvTimeout",
];
pub(super) const HEDGING_FIELDS: &[&str] = &["maxAttempts", "hedgingDelay", "nonFatalStatusCodes"];
pub(super) const THROTTLING_FIELDS: &[&str] = &["maxTokens", "tokenRatio"];

/// Codes whose retry cannot help: the server will answer the same (or there was no error).
const RISKY_RETRYABLE: CodeSet = CodeSet::of(Code::InvalidArgument)
    .with(Code::NotFound)
    .with(Code::PermissionDenied)
    .with(Code::Unauthenticated)
    .with(Code::FailedPrecondition)
    .with(Code::Unimplemented)
    .with(Code::DataLoss)
    .with(Code::Ok);

/// `maxTokens` is at most 1000, so a ratio above 1000 tokens refills as much as 1000 does.
const MAX_TOKEN_RATIO_MILLI: u32 = 1_000_000;
/// A6 (2024): the jitter multiplies each backoff by up to 1.2.
const MAX_JITTER: f64 = 1.2;

impl Validator {
    /// `maxAttempts` of a retry or hedging policy: required, > 1, clamped to 5.
    fn max_attempts(&mut self, o: &Obj<'_>) -> Option<u32> {
        const RULE: &str = "must be an integer > 1";
        let v = self.required(o, "maxAttempts", RULE)?;
        let n = self.integer(v, o.path("maxAttempts"), 2, u64::MAX, RULE)?;
        if n > u64::from(MAX_ATTEMPTS_LIMIT) {
            self.warn(
                o.path("maxAttempts"),
                format!("{n} is clamped to {MAX_ATTEMPTS_LIMIT} (gRPC allows at most {MAX_ATTEMPTS_LIMIT} attempts)"),
            );
        }
        Some(n.min(u64::from(MAX_ATTEMPTS_LIMIT)) as u32)
    }

    pub(super) fn retry_policy(&mut self, v: &Value, path: String) -> Option<RetryPolicy> {
        let o = self.object(v, path, RETRY_FIELDS)?;
        let max_attempts = self.max_attempts(&o);
        const BACKOFF_RULE: &str = "must be a duration > 0";
        let initial_backoff = self
            .required(&o, "initialBackoff", BACKOFF_RULE)
            .and_then(|v| self.duration(v, o.path("initialBackoff"), Zero::Refused));
        let max_backoff = self
            .required(&o, "maxBackoff", BACKOFF_RULE)
            .and_then(|v| self.duration(v, o.path("maxBackoff"), Zero::Refused));
        const MULTIPLIER_RULE: &str = "must be a number > 0";
        let multiplier = self
            .required(&o, "backoffMultiplier", MULTIPLIER_RULE)
            .and_then(|v| self.positive_number(v, o.path("backoffMultiplier"), MULTIPLIER_RULE))
            .and_then(Number::as_f64);
        let codes = self
            .required(
                &o,
                "retryableStatusCodes",
                "must be a non-empty array of status codes",
            )
            .and_then(|v| self.codes(v, o.path("retryableStatusCodes"), true));
        let per_attempt = self.duration_field(&o, "perAttemptRecvTimeout", Zero::Refused);

        if let Some(codes) = &codes {
            for (c, p) in codes {
                if RISKY_RETRYABLE.contains(*c) {
                    let why = if *c == Code::Ok {
                        "OK is not a failure"
                    } else {
                        "it means the server will answer the same, so retrying cannot help"
                    };
                    self.warn(
                        p.clone(),
                        format!("retrying {} is risky: {why}", code_name(*c)),
                    );
                }
            }
        }
        if let (Some(i), Some(m)) = (initial_backoff, max_backoff)
            && m < i
        {
            self.warn(
                o.path("maxBackoff"),
                format!(
                    "is less than initialBackoff {}: every backoff is {}",
                    format_duration(i),
                    format_duration(m)
                ),
            );
        }

        let codes: CodeSet = codes?.into_iter().map(|(c, _)| c).collect();
        let policy = RetryPolicy::new(
            max_attempts?,
            initial_backoff?,
            max_backoff?,
            multiplier?,
            codes,
        );
        match policy {
            Ok(p) => Some(p.with_per_attempt_recv_timeout(per_attempt)),
            Err(e) => {
                self.error(o.path.clone(), e.to_string());
                None
            }
        }
    }

    /// Warns when the backoffs alone (each at its maximum jitter) outlast the timeout.
    pub(super) fn check_worst_case(&mut self, p: &RetryPolicy, timeout: Duration, path: String) {
        if timeout.is_zero() {
            return; // already warned about
        }
        let retries = p.max_attempts().saturating_sub(1);
        let max = p.max_backoff().as_secs_f64();
        let mut backoff = p.initial_backoff().as_secs_f64();
        let mut total = 0.0;
        for _ in 0..retries {
            total += backoff.min(max) * MAX_JITTER;
            backoff = (backoff * p.backoff_multiplier()).min(max);
        }
        if total > timeout.as_secs_f64() {
            let shown = Duration::try_from_secs_f64(total)
                .map(|d| format_duration(Duration::from_millis(d.as_millis() as u64)))
                .unwrap_or_else(|_| format!("{total}s"));
            self.warn(
                path,
                format!(
                    "worst case backoff {shown} ({retries} retries, each at 1.2 × its maximum) exceeds timeout {}: the last retries cannot run",
                    format_duration(timeout)
                ),
            );
        }
    }

    pub(super) fn hedging_policy(&mut self, v: &Value, path: String) -> Option<HedgingPolicy> {
        let o = self.object(v, path, HEDGING_FIELDS)?;
        let max_attempts = self.max_attempts(&o);
        let delay = match o.get("hedgingDelay") {
            Some(v) => self.duration(v, o.path("hedgingDelay"), Zero::Allowed),
            None => Some(Duration::ZERO),
        };
        let codes = match o.get("nonFatalStatusCodes") {
            Some(v) => self.codes(v, o.path("nonFatalStatusCodes"), false),
            None => Some(Vec::new()),
        };
        Some(HedgingPolicy {
            max_attempts: max_attempts?,
            hedging_delay: delay?,
            non_fatal_status_codes: codes?.into_iter().map(|(c, _)| c).collect(),
        })
    }

    pub(super) fn retry_throttling(&mut self, v: &Value, path: String) -> Option<RetryThrottling> {
        let o = self.object(v, path, THROTTLING_FIELDS)?;
        const TOKENS_RULE: &str = "must be an integer in (0, 1000]";
        let max_tokens = self
            .required(&o, "maxTokens", TOKENS_RULE)
            .and_then(|v| self.integer(v, o.path("maxTokens"), 1, 1000, TOKENS_RULE));
        const RATIO_RULE: &str = "must be a number > 0";
        let ratio = self
            .required(&o, "tokenRatio", RATIO_RULE)
            .and_then(|v| self.positive_number(v, o.path("tokenRatio"), RATIO_RULE));
        let token_ratio_milli = match ratio {
            Some(n) => {
                let (milli, exact) = milli_truncated(n);
                if milli == 0 {
                    self.error(
                        o.path("tokenRatio"),
                        "must be at least 0.001 (3 decimals are kept)",
                    );
                    None
                } else {
                    if !exact {
                        self.warn(
                            o.path("tokenRatio"),
                            format!(
                                "{n} is truncated to {} (3 decimals are kept)",
                                show_milli(milli)
                            ),
                        );
                    }
                    Some(milli)
                }
            }
            None => None,
        };
        Some(RetryThrottling {
            max_milli_tokens: u32::try_from(max_tokens? * 1000).ok()?,
            token_ratio_milli: token_ratio_milli?,
        })
    }
}

/// `tokenRatio × 1000`, truncated toward zero on the number's decimal text (as C-core
/// does), and whether nothing was cut off. Saturates at 1000 tokens.
fn milli_truncated(n: &Number) -> (u32, bool) {
    if let Some(whole) = n.as_u64() {
        let milli = whole
            .saturating_mul(1000)
            .min(u64::from(MAX_TOKEN_RATIO_MILLI));
        return (milli as u32, true);
    }
    let Some(f) = n.as_f64() else {
        return (0, false);
    };
    // Rust prints the shortest decimal that reads back as the same f64, without an
    // exponent: 0.251 → "0.251", 1e-7 → "0.0000001". That is the text the user wrote,
    // up to 17 significant digits.
    let text = format!("{f}");
    let (whole, fraction) = text.split_once('.').unwrap_or((text.as_str(), ""));
    let whole: u64 = whole.parse().unwrap_or(u64::MAX);
    let mut milli = whole.saturating_mul(1000);
    let mut digits = fraction.bytes();
    for scale in [100, 10, 1] {
        let d = digits
            .next()
            .map_or(0, |b| u64::from(b.wrapping_sub(b'0')).min(9));
        milli = milli.saturating_add(d * scale);
    }
    let exact = fraction.len() <= 3;
    (milli.min(u64::from(MAX_TOKEN_RATIO_MILLI)) as u32, exact)
}

/// `250` → `0.25`, `1000` → `1`.
fn show_milli(milli: u32) -> String {
    let whole = milli / 1000;
    let frac = milli % 1000;
    if frac == 0 {
        whole.to_string()
    } else {
        format!("{whole}.{}", format!("{frac:03}").trim_end_matches('0'))
    }
}

#[cfg(test)]
mod tests;
