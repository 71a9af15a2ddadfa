//! gRFC A6 transparent retries: what the attempt loop does after an attempt the server's
//! application never saw ([`Unprocessed`]), for every method, with or without a retry
//! policy.
//!
//! - A request that never left the client is sent again without limit, under the
//!   deadline (without one: under the layer's `wait_for_ready_limit`). The first resend
//!   goes at once; a channel that keeps failing before it writes anything is then given
//!   the `waitForReady` pace (100 ms growing to 2 s), so a call never spins on it.
//! - A stream the server refused (`REFUSED_STREAM`, or above a GOAWAY's last stream
//!   id) is sent again once per call, at once; a second refusal is the retry policy's
//!   to decide, as any UNAVAILABLE is.
//! - No backoff, no throttle token, not counted against `maxAttempts`, no
//!   `grpc-previous-rpc-attempts` increment.

use std::time::Duration;

use crate::retry::policy::backoff::Jitter;
use crate::retry::policy::ready_wait;
use crate::retry::response::unprocessed::Unprocessed;

/// What a call has used of its transparent retries.
#[derive(Debug, Default)]
pub(crate) struct TransparentState {
    /// The one resend of a refused stream is spent.
    refused: bool,
    /// Resends of requests that never left the client.
    unsent: u32,
}

/// What follows an attempt the server's application never saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Resend {
    /// Send it again after this wait (zero: at once).
    After(Duration),
    /// Not transparently: the retry policy decides, as for any other failure.
    ToPolicy,
    /// A request that never left the client, and the next resend would come at or after
    /// the end (the deadline): the call ends now with this attempt's failure.
    Stop,
}

impl TransparentState {
    /// The decision after an attempt that ended `why`, with `left` until the call's
    /// end (its deadline, or the layer's limit without one).
    pub(crate) fn next(&mut self, why: Unprocessed, left: Duration, jitter: &dyn Jitter) -> Resend {
        if left.is_zero() {
            return match why {
                Unprocessed::Unsent => Resend::Stop,
                Unprocessed::Refused => Resend::ToPolicy,
            };
        }
        match why {
            Unprocessed::Refused if self.refused => Resend::ToPolicy,
            Unprocessed::Refused => {
                self.refused = true;
                Resend::After(Duration::ZERO)
            }
            Unprocessed::Unsent => {
                let wait = match self.unsent.checked_sub(1) {
                    None => Some(Duration::ZERO),
                    Some(waits) => ready_wait(waits, left, jitter).filter(|w| *w < left),
                };
                match wait {
                    Some(w) => {
                        self.unsent += 1;
                        Resend::After(w)
                    }
                    None => Resend::Stop,
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::retry::policy::backoff::FixedJitter;
    use proptest::prelude::*;

    #[test]
    fn a_refused_stream_is_resent_once() {
        let mut s = TransparentState::default();
        let j = FixedJitter(0.5);
        let left = Duration::from_secs(1);
        assert_eq!(
            s.next(Unprocessed::Refused, left, &j),
            Resend::After(Duration::ZERO)
        );
        assert_eq!(s.next(Unprocessed::Refused, left, &j), Resend::ToPolicy);
        // Unsent requests keep their own count.
        assert_eq!(
            s.next(Unprocessed::Unsent, left, &j),
            Resend::After(Duration::ZERO)
        );
    }

    proptest! {
        /// Unsent requests are resent until the end, never in a busy loop: after the
        /// first resend every wait is at least 80 ms (100 ms, jitter -20 %), and the
        /// resends stop before the end.
        #[test]
        fn unsent_requests_are_paced_and_stop_at_the_end(
            left_ms in 0u64..20_000,
            unit in 0.0f64..1.0,
        ) {
            let mut s = TransparentState::default();
            let j = FixedJitter(unit);
            let mut left = Duration::from_millis(left_ms);
            let mut resends = 0u32;
            loop {
                match s.next(Unprocessed::Unsent, left, &j) {
                    Resend::After(w) => {
                        prop_assert!(w < left || left.is_zero());
                        if resends > 0 {
                            prop_assert!(w >= Duration::from_millis(80), "{w:?}");
                        }
                        resends += 1;
                        left -= w;
                    }
                    Resend::Stop => break,
                    Resend::ToPolicy => prop_assert!(false, "never for unsent requests"),
                }
            }
            prop_assert!(u64::from(resends) <= 2 + left_ms / 80);
        }
    }
}
