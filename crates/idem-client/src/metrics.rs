//! What the retry layer tells an observer about each call, for metrics (gRFC A66 per
//! attempt and per call, A96 retries) without the layer knowing any metrics library.
//!
//! Give an observer to [`RetryLayerBuilder::observer`](crate::retry::RetryLayerBuilder::observer);
//! `idem-otel` turns these events into OpenTelemetry instruments. Without one, the layer
//! does nothing more than before (no clock reads, no wrapping).
//!
//! - [`CallObserver::attempt_started`] is called as each attempt is sent (not for
//!   `waitForReady` resends of an attempt the channel could not send), gRFC A6
//!   transparent retries included, as A66 counts them; the report's
//!   [`transparent`](CallReport::transparent) says how many of a call's were.
//! - [`CallObserver::call_ended`] is called once per call with its [`CallReport`], its
//!   final status and its duration. A call that failed before committing ends when the
//!   layer answers it; a committed call ends when its response body ends (the status
//!   then comes from the trailers), or when the caller drops the body (CANCELLED).
//!
//! ```
//! use idem_client::metrics::{CallEnded, CallObserver};
//! use idem_client::retry::RetryLayer;
//!
//! struct Log;
//! impl CallObserver for Log {
//!     fn call_ended(&self, call: &CallEnded<'_>) {
//!         println!("{} {:?} in {:?}: {}", call.method, call.status, call.duration, call.report);
//!     }
//! }
//! let layer = RetryLayer::builder().observer(Log).build().unwrap();
//! # let _ = layer;
//! ```

use std::sync::Arc;
use std::time::Duration;

use idem_core::code::OnEnd;
use tokio::time::Instant;
use tonic::Code;

use crate::retry::CallReport;

/// Told about every attempt and every call of a [`RetryLayer`](crate::retry::RetryLayer).
///
/// Called on the caller's task: keep it short and never block.
pub trait CallObserver: Send + Sync + 'static {
    /// An attempt of a call to `method` (`/shop.v1.Orders/CreateOrder`) was sent.
    fn attempt_started(&self, method: &str) {
        let _ = method;
    }

    /// A call ended.
    fn call_ended(&self, call: &CallEnded<'_>);
}

/// One finished call, as [`CallObserver::call_ended`] sees it.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct CallEnded<'a> {
    /// The method path (`/shop.v1.Orders/CreateOrder`).
    pub method: &'a str,
    /// What the layer did: outcome, attempts, each attempt's end, duration and the wait
    /// after it.
    pub report: &'a CallReport,
    /// The status the caller got: the Trailers-Only code, or for a committed call the
    /// `grpc-status` of its trailers (UNKNOWN when they had none, CANCELLED when the
    /// caller dropped the body before its end, the body's error code when it failed).
    pub status: Code,
    /// From the call's start in the layer to its end (see the module docs).
    pub duration: Duration,
    /// How long the last attempt took to its end: to its Trailers-Only response, or for
    /// a committed call to the end of its response body. `None` when no attempt was made.
    pub last_attempt: Option<Duration>,
}

impl CallEnded<'_> {
    /// Time with no attempt in flight: the sum of the waits between attempts.
    pub fn retry_delay(&self) -> Duration {
        self.report.history().filter_map(|a| a.wait_after).sum()
    }
}

/// The observer as the layer holds it.
pub(crate) type SharedObserver = Arc<dyn CallObserver>;

/// A call's start, for an observed layer.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Started(Instant);

impl Started {
    pub(crate) fn now(observer: Option<&SharedObserver>) -> Option<Self> {
        observer.map(|_| Started(Instant::now()))
    }
}

/// Tells the observer about a call the layer answered: now for a failure, at the end of
/// the body for a committed response.
pub(crate) fn observe(
    resp: crate::retry::Resp,
    observer: Option<&SharedObserver>,
    method: &crate::retry::CallPath,
    report: CallReport,
    started: Option<Started>,
) -> crate::retry::Resp {
    let (Some(observer), Some(Started(started))) = (observer, started) else {
        return resp;
    };
    let last_took = report.history().last().map(|a| a.took);
    let pending = Pending {
        observer: observer.clone(),
        method: method.clone(),
        report,
        started,
        headers_at: Instant::now(),
        last_took,
    };
    match report.last_code {
        Some(code) => {
            pending.end(code);
            resp
        }
        None => resp
            .map(|inner| tonic::body::Body::new(OnEnd::new(inner, move |code| pending.end(code)))),
    }
}

struct Pending {
    observer: SharedObserver,
    method: crate::retry::CallPath,
    report: CallReport,
    started: Instant,
    headers_at: Instant,
    last_took: Option<Duration>,
}

impl Pending {
    fn end(self, status: Code) {
        let now = Instant::now();
        let since_headers = now.saturating_duration_since(self.headers_at);
        let last_attempt = self.last_took.map(|t| match self.report.last_code {
            Some(_) => t,
            None => t + since_headers,
        });
        self.observer.call_ended(&CallEnded {
            method: self.method.as_str(),
            report: &self.report,
            status,
            duration: now.saturating_duration_since(self.started),
            last_attempt,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::retry::{CallOutcome, CallPath};
    use bytes::Bytes;
    use http_body::Frame;
    use http_body_util::BodyExt;
    use std::sync::Mutex;

    #[derive(Default)]
    struct Seen(Mutex<Vec<(String, Code, Option<Duration>)>>);
    impl CallObserver for Seen {
        fn call_ended(&self, call: &CallEnded<'_>) {
            let mut seen = self.0.lock().unwrap();
            seen.push((call.method.to_owned(), call.status, call.last_attempt));
        }
    }

    fn committed() -> CallReport {
        let mut r = CallReport::new(CallOutcome::Committed);
        r.record(
            crate::retry::AttemptEnd::Committed,
            Duration::from_millis(3),
        );
        r
    }

    #[tokio::test(start_paused = true)]
    async fn a_committed_call_ends_with_its_trailers() {
        let seen = Arc::new(Seen::default());
        let obs: SharedObserver = seen.clone();
        let path = CallPath::of(&"/a.B/C".parse().unwrap());
        let started = Started::now(Some(&obs));
        let mut trailers = http::HeaderMap::new();
        trailers.insert("grpc-status", "5".parse().unwrap());
        let body = http_body_util::StreamBody::new(tokio_stream::iter(vec![
            Ok::<_, tonic::Status>(Frame::data(Bytes::from_static(b"x"))),
            Ok(Frame::trailers(trailers)),
        ]));
        let resp = http::Response::new(tonic::body::Body::new(body));
        tokio::time::advance(Duration::from_millis(10)).await;
        let resp = observe(resp, Some(&obs), &path, committed(), started);
        assert!(
            seen.0.lock().unwrap().is_empty(),
            "not before the body ends"
        );
        tokio::time::advance(Duration::from_millis(5)).await;
        let _ = resp.into_body().collect().await.unwrap();
        let seen = seen.0.lock().unwrap();
        assert_eq!(
            seen.as_slice(),
            [(
                "/a.B/C".to_owned(),
                Code::NotFound,
                Some(Duration::from_millis(8))
            )]
        );
    }

    #[tokio::test]
    async fn a_dropped_body_is_cancelled() {
        let seen = Arc::new(Seen::default());
        let obs: SharedObserver = seen.clone();
        let path = CallPath::of(&"/a.B/C".parse().unwrap());
        let started = Started::now(Some(&obs));
        let body = http_body_util::StreamBody::new(tokio_stream::pending::<
            Result<Frame<Bytes>, tonic::Status>,
        >());
        let resp = http::Response::new(tonic::body::Body::new(body));
        drop(observe(resp, Some(&obs), &path, committed(), started));
        assert_eq!(seen.0.lock().unwrap()[0].1, Code::Cancelled);
    }
}
