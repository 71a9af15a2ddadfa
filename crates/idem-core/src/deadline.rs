//! Deadlines: the `grpc-timeout` header, and the inbound deadline a server records so
//! that client calls made while serving a request inherit what is left of it.
//!
//! The server side ([`scope_inbound_deadline`]) runs the handler inside a task-local that
//! holds the inbound call's absolute deadline; the client layer reads it with
//! [`inbound_deadline`]. Handlers that spawn tasks carry it over with
//! [`current_scope`] + [`InboundScope::run`].

use std::future::Future;
use std::time::Duration;

use http::HeaderValue;
use tokio::time::Instant;

/// The longest value `grpc-timeout` can carry: 8 digits.
const MAX_DIGITS_VALUE: u64 = 99_999_999;

/// Parses a `grpc-timeout` value (`"100m"`, `"5S"`, `"1H"`): 1 to 8 ASCII digits and a
/// unit among `H M S m u n`. `None` when malformed.
///
/// ```
/// use std::time::Duration;
/// use idem_core::deadline::parse_grpc_timeout;
/// assert_eq!(parse_grpc_timeout(b"250m"), Some(Duration::from_millis(250)));
/// assert_eq!(parse_grpc_timeout(b"1x"), None);
/// ```
pub fn parse_grpc_timeout(value: &[u8]) -> Option<Duration> {
    let (&unit, digits) = value.split_last()?;
    if digits.is_empty() || digits.len() > 8 || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    let n: u64 = std::str::from_utf8(digits).ok()?.parse().ok()?;
    Some(match unit {
        b'H' => Duration::from_secs(n * 3600),
        b'M' => Duration::from_secs(n * 60),
        b'S' => Duration::from_secs(n),
        b'm' => Duration::from_millis(n),
        b'u' => Duration::from_micros(n),
        b'n' => Duration::from_nanos(n),
        _ => return None,
    })
}

/// Encodes a duration as a `grpc-timeout` value, in the finest unit whose value fits in
/// 8 digits, rounding up (as grpc-go does) so a server never sees less than was meant.
pub fn encode_grpc_timeout(timeout: Duration) -> HeaderValue {
    let nanos = timeout.as_nanos();
    let units: [(u128, char); 6] = [
        (1, 'n'),
        (1_000, 'u'),
        (1_000_000, 'm'),
        (1_000_000_000, 'S'),
        (60_000_000_000, 'M'),
        (3_600_000_000_000, 'H'),
    ];
    for (per, unit) in units {
        let v = nanos.div_ceil(per);
        if v <= u128::from(MAX_DIGITS_VALUE) {
            return HeaderValue::from_str(&format!("{v}{unit}"))
                .unwrap_or_else(|_| HeaderValue::from_static("99999999H"));
        }
    }
    HeaderValue::from_static("99999999H")
}

tokio::task_local! {
    static INBOUND: InboundScope;
}

/// What a server records about the inbound call being served: its absolute deadline and
/// whether it is itself a retry. Read by client calls made while serving it.
///
/// Build it with [`InboundScope::new`]; copy the current one into spawned tasks with
/// [`current_scope`] and [`InboundScope::run`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct InboundScope {
    /// The inbound call's deadline, when it carried `grpc-timeout`.
    pub deadline: Option<Instant>,
    /// The inbound call's `grpc-previous-rpc-attempts` (0 for a first attempt).
    pub previous_attempts: u32,
    marker: Option<ExhaustedMarker>,
}

/// A per-inbound-call secret that the client layer puts on a failure it returns after
/// exhausting its retries (header [`DOWNSTREAM_EXHAUSTED`](crate::headers::DOWNSTREAM_EXHAUSTED)),
/// so the server side can tell "this error is an exhausted downstream call, passed up"
/// from any other error, and mark only that one with `grpc-retry-pushback-ms: -1`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ExhaustedMarker(u64);

impl ExhaustedMarker {
    /// A fresh random marker.
    pub fn random() -> Self {
        ExhaustedMarker(rand::random())
    }
    /// The header value that carries it.
    pub fn to_header_value(self) -> HeaderValue {
        HeaderValue::from_str(&format!("{:016x}", self.0))
            .unwrap_or_else(|_| HeaderValue::from_static("0"))
    }
    /// Whether `value` carries this marker.
    pub fn matches(self, value: &HeaderValue) -> bool {
        value.as_bytes() == self.to_header_value().as_bytes()
    }
}

impl InboundScope {
    /// The scope of an inbound call with this deadline and `grpc-previous-rpc-attempts`.
    pub fn new(deadline: Option<Instant>, previous_attempts: u32) -> Self {
        InboundScope {
            deadline,
            previous_attempts,
            marker: None,
        }
    }

    /// This scope with a marker for exhausted downstream failures.
    pub fn with_marker(mut self, marker: ExhaustedMarker) -> Self {
        self.marker = Some(marker);
        self
    }

    /// The marker for exhausted downstream failures, if the server side set one.
    pub fn marker(&self) -> Option<ExhaustedMarker> {
        self.marker
    }

    /// Runs `fut` with this scope as the inbound scope (for tasks a handler spawns).
    /// The current [`KeySource`](crate::derive::KeySource), if any, goes along, so
    /// client calls in `fut` derive their keys as the handler's own do.
    pub fn run<F: Future>(self, fut: F) -> impl Future<Output = F::Output> {
        let keys = crate::derive::KeySource::current();
        INBOUND.scope(self, crate::derive::run_in(keys, fut))
    }

    /// Runs `f` synchronously with this scope as the inbound scope.
    pub fn sync_run<R>(self, f: impl FnOnce() -> R) -> R {
        INBOUND.sync_scope(self, f)
    }
}

/// Runs `fut` inside `scope`: client calls made by it see `scope.deadline` as the
/// inbound deadline.
pub fn scope_inbound_deadline<F: Future>(
    scope: InboundScope,
    fut: F,
) -> impl Future<Output = F::Output> {
    INBOUND.scope(scope, fut)
}

/// The scope of the inbound call being served by the current task, if any.
pub fn current_scope() -> Option<InboundScope> {
    INBOUND.try_with(|s| *s).ok()
}

/// The deadline of the inbound call being served by the current task, if any.
pub fn inbound_deadline() -> Option<Instant> {
    current_scope().and_then(|s| s.deadline)
}

/// The earliest of some optional deadlines.
pub fn earliest(deadlines: impl IntoIterator<Item = Option<Instant>>) -> Option<Instant> {
    deadlines.into_iter().flatten().min()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_forms() {
        assert_eq!(parse_grpc_timeout(b"1H"), Some(Duration::from_secs(3600)));
        assert_eq!(parse_grpc_timeout(b"2M"), Some(Duration::from_secs(120)));
        assert_eq!(parse_grpc_timeout(b"3S"), Some(Duration::from_secs(3)));
        assert_eq!(parse_grpc_timeout(b"4m"), Some(Duration::from_millis(4)));
        assert_eq!(parse_grpc_timeout(b"5u"), Some(Duration::from_micros(5)));
        assert_eq!(parse_grpc_timeout(b"6n"), Some(Duration::from_nanos(6)));
        assert_eq!(
            parse_grpc_timeout(b"99999999S"),
            Some(Duration::from_secs(99_999_999))
        );
        for bad in [
            &b""[..],
            b"S",
            b"123456789S",
            b"-1S",
            b"1s",
            b"1.5S",
            b" 1S",
            b"1",
        ] {
            assert_eq!(
                parse_grpc_timeout(bad),
                None,
                "{:?}",
                std::str::from_utf8(bad)
            );
        }
    }

    #[test]
    fn encode_round_trips_without_shrinking() {
        for d in [
            Duration::ZERO,
            Duration::from_nanos(1),
            Duration::from_millis(100),
            Duration::from_millis(99_999_999),
            Duration::from_secs(100_000),
            Duration::from_secs(u64::MAX / 4),
        ] {
            let v = encode_grpc_timeout(d);
            let back = parse_grpc_timeout(v.as_bytes()).unwrap();
            assert!(
                back >= d.min(Duration::from_secs(99_999_999 * 3600)),
                "{d:?} -> {v:?}"
            );
        }
        assert_eq!(encode_grpc_timeout(Duration::from_millis(250)), "250000u");
    }

    #[tokio::test]
    async fn inbound_scope_is_visible_inside_only() {
        assert_eq!(inbound_deadline(), None);
        let d = Instant::now() + Duration::from_secs(1);
        let seen =
            scope_inbound_deadline(InboundScope::new(Some(d), 0), async { inbound_deadline() })
                .await;
        assert_eq!(seen, Some(d));
        assert_eq!(inbound_deadline(), None);
    }
}
