//! The A6 `retryThrottling` token bucket, in milli-tokens (as C-core and grpc-java).

use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};

use idem_core::config::RetryThrottling;

#[derive(Debug)]
struct Bucket {
    tokens: u32,
    settings: RetryThrottling,
    /// Retries are refused (tokens at or below half): logged once per change.
    throttling: bool,
}

impl Bucket {
    fn allows(&self) -> bool {
        self.tokens > self.settings.max_milli_tokens / 2
    }

    /// Notes whether retries are allowed now; `Some` when that changed.
    fn transition(&mut self) -> Option<Transition> {
        let throttling = !self.allows();
        if throttling == self.throttling {
            return None;
        }
        self.throttling = throttling;
        Some(Transition {
            throttling,
            milli_tokens: self.tokens,
            max_milli_tokens: self.settings.max_milli_tokens,
        })
    }
}

/// The bucket crossed its threshold: logged (after the lock is released).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Transition {
    throttling: bool,
    milli_tokens: u32,
    max_milli_tokens: u32,
}

impl Transition {
    fn log(self) {
        let tokens = f64::from(self.milli_tokens) / 1000.0;
        let max_tokens = f64::from(self.max_milli_tokens) / 1000.0;
        if self.throttling {
            tracing::warn!(
                tokens,
                max_tokens,
                "retry throttle engaged: the token bucket is at or below half; retries stop \
                 until successful calls refill it (failures of any call on this channel \
                 spend tokens)"
            );
        } else {
            tracing::info!(
                tokens,
                max_tokens,
                "retry throttle released: the token bucket is above half again; retries resume"
            );
        }
    }
}

/// A shared A6 retry-throttling bucket.
///
/// It starts full (`maxTokens`). Every attempt that fails with a code in
/// `retryableStatusCodes` (or a transport error retried as UNAVAILABLE) takes one token;
/// every successful call gives back `tokenRatio`, up to `maxTokens`. Retries are allowed
/// only while more than `maxTokens / 2` tokens are left (checked after the failure is
/// counted, as grpc-go does).
///
/// The bucket logs when it crosses that threshold, not per call: a `WARN` when retries
/// stop, an `INFO` when they resume. Each call the throttle stops says so in its
/// [`CallReport`](crate::retry::CallReport) ([`CallOutcome::Throttled`](crate::retry::CallOutcome::Throttled)).
///
/// Cloning shares the bucket: every clone of a [`RetryLayer`](crate::retry::RetryLayer) uses the
/// same one, and the same handle can be given to layers on several channels to one target
/// ([`RetryLayerBuilder::throttle`](crate::retry::RetryLayerBuilder::throttle)). A config reload
/// keeps the bucket (see [`RetryThrottle::reconfigure`]).
///
/// ```
/// use idem_client::retry::RetryThrottle;
/// use idem_core::config::RetryThrottling;
/// let t = RetryThrottle::new(RetryThrottling { max_milli_tokens: 10_000, token_ratio_milli: 500 });
/// assert!(t.record_failure()); // 9 tokens left > 5: retry allowed
/// assert_eq!(t.milli_tokens(), 9_000);
/// t.record_success();
/// assert_eq!(t.milli_tokens(), 9_500);
/// ```
#[derive(Clone)]
pub struct RetryThrottle(Arc<Mutex<Bucket>>);

impl fmt::Debug for RetryThrottle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = self.lock();
        f.debug_struct("RetryThrottle")
            .field("milli_tokens", &b.tokens)
            .field("max_milli_tokens", &b.settings.max_milli_tokens)
            .field("token_ratio_milli", &b.settings.token_ratio_milli)
            .finish()
    }
}

impl RetryThrottle {
    /// A full bucket with these settings.
    pub fn new(settings: RetryThrottling) -> Self {
        RetryThrottle(Arc::new(Mutex::new(Bucket {
            tokens: settings.max_milli_tokens,
            settings,
            throttling: false,
        })))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Bucket> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Counts a failed attempt (−1000 milli-tokens) and says whether a retry is still
    /// allowed (tokens left > `maxTokens / 2`).
    pub fn record_failure(&self) -> bool {
        let (allowed, change) = {
            let mut b = self.lock();
            b.tokens = b.tokens.saturating_sub(1000);
            (b.allows(), b.transition())
        };
        if let Some(t) = change {
            t.log();
        }
        allowed
    }

    /// Counts a successful call (+`tokenRatio`, capped at `maxTokens`).
    pub fn record_success(&self) {
        let change = {
            let mut b = self.lock();
            b.tokens = b
                .tokens
                .saturating_add(b.settings.token_ratio_milli)
                .min(b.settings.max_milli_tokens);
            b.transition()
        };
        if let Some(t) = change {
            t.log();
        }
    }

    /// Whether retries are currently allowed.
    pub fn is_retry_allowed(&self) -> bool {
        self.lock().allows()
    }

    /// Tokens left, in milli-tokens.
    pub fn milli_tokens(&self) -> u32 {
        self.lock().tokens
    }

    /// The current settings.
    pub fn settings(&self) -> RetryThrottling {
        self.lock().settings
    }

    /// Applies new settings and keeps the bucket's fill ratio (as C-core does when a
    /// service config update changes `retryThrottling`): a half-full bucket stays half full.
    pub fn reconfigure(&self, settings: RetryThrottling) {
        let change = {
            let mut b = self.lock();
            if b.settings == settings {
                return;
            }
            let old_max = u64::from(b.settings.max_milli_tokens);
            let new_max = u64::from(settings.max_milli_tokens);
            b.tokens = (u64::from(b.tokens) * new_max)
                .checked_div(old_max)
                .map_or(settings.max_milli_tokens, |t| {
                    u32::try_from(t).unwrap_or(u32::MAX)
                });
            b.settings = settings;
            b.transition()
        };
        if let Some(t) = change {
            t.log();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn threshold_is_half_after_the_failure() {
        let t = RetryThrottle::new(RetryThrottling {
            max_milli_tokens: 10_000,
            token_ratio_milli: 500,
        });
        for expected_left in [9_000, 8_000, 7_000, 6_000] {
            assert!(t.record_failure());
            assert_eq!(t.milli_tokens(), expected_left);
        }
        assert!(!t.record_failure(), "5 tokens left is not > 5");
        assert!(!t.is_retry_allowed());
        t.record_success();
        assert!(t.is_retry_allowed());
        for _ in 0..100 {
            t.record_success();
        }
        assert_eq!(t.milli_tokens(), 10_000);
        for _ in 0..100 {
            t.record_failure();
        }
        assert_eq!(t.milli_tokens(), 0);
    }

    #[test]
    fn reconfigure_keeps_the_fill_ratio_and_clones_share() {
        let t = RetryThrottle::new(RetryThrottling {
            max_milli_tokens: 10_000,
            token_ratio_milli: 500,
        });
        let shared = t.clone();
        shared.record_failure();
        shared.record_failure();
        assert_eq!(t.milli_tokens(), 8_000);
        t.reconfigure(RetryThrottling {
            max_milli_tokens: 20_000,
            token_ratio_milli: 100,
        });
        assert_eq!(shared.milli_tokens(), 16_000);
        assert_eq!(shared.settings().token_ratio_milli, 100);
    }
}
