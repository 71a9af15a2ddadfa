//! What every call carries, with or without retries, and how it answers its caller: the
//! attempt's own response, or a Trailers-Only status with the report, bounded by the
//! deadline and the response message limit.

use std::sync::Arc;

use idem_core::deadline::ExhaustedMarker;
use idem_core::headers::DOWNSTREAM_EXHAUSTED;
use tokio::time::Instant;
use tonic::Code;

use crate::BoxError;
use crate::metrics::{self, Started};
use crate::retry::Resp;
use crate::retry::config::Settings;
use crate::retry::config::{LayerShared, MessageLimits};
use crate::retry::outcome::{AttemptEnd, CallOutcome, CallReport};
use crate::retry::policy::Attempted;
use crate::retry::policy::breaker::{CallTicket, CircuitBreaker};
use crate::retry::policy::pushback::{Pushback, pushback, retry_info_delay};
use crate::retry::request::check::RequestFault;
use crate::retry::response::bound::{self, Bounds};
use crate::retry::response::peek::early_code;
use crate::retry::response::unprocessed::{Unprocessed, unprocessed};

/// A call's method path, kept without copying: a `PathAndQuery` is `Bytes` inside
/// (static for generated tonic clients), so cloning it out of the request is free.
#[derive(Debug, Clone)]
pub(crate) struct CallPath(Option<http::uri::PathAndQuery>);

impl CallPath {
    pub(crate) fn of(uri: &http::Uri) -> Self {
        CallPath(uri.path_and_query().cloned())
    }
    pub(crate) fn as_str(&self) -> &str {
        self.0.as_ref().map_or("", http::uri::PathAndQuery::path)
    }
}

impl std::fmt::Display for CallPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What every call needs to answer its caller, with or without retries.
#[derive(Debug)]
pub(crate) struct CallContext {
    pub(crate) shared: Arc<LayerShared>,
    pub(crate) path: CallPath,
    pub(crate) deadline: Option<Instant>,
    /// The inbound call's marker, when this call is made while serving one.
    pub(crate) marker: Option<ExhaustedMarker>,
    pub(crate) limits: MessageLimits,
    /// Set when a request message is over `maxRequestMessageBytes` (only with a limit).
    pub(crate) fault: Option<Arc<RequestFault>>,
    /// When the call started, read only for an observed layer.
    pub(crate) started: Option<Started>,
    /// The call's settings (and their retry throttle).
    pub(crate) settings: Arc<Settings>,
    /// The call's place in the circuit breaker, with a breaker: its result is recorded
    /// as it ends.
    pub(crate) ticket: Option<CallTicket>,
}

/// How one attempt ended, with what it left for the caller.
pub(crate) enum Attempt {
    Response(Resp),
    Error(BoxError),
    /// `perAttemptRecvTimeout` passed before response headers.
    RecvTimeout,
    /// The call's deadline passed before response headers.
    Deadline,
    /// The layer's own answer, for a call no server answered: the end of a
    /// `waitForReady` wait.
    Local(tonic::Status),
}

impl Attempt {
    /// What the decision needs to know about this attempt.
    pub(crate) fn observe(&self) -> Attempted {
        let (end, headers) = match self {
            Attempt::Response(r) => match early_code(r) {
                None => (AttemptEnd::Committed, None),
                Some(code) => (AttemptEnd::Status(code), Some(r.headers())),
            },
            Attempt::Error(_) => (AttemptEnd::TransportError, None),
            Attempt::RecvTimeout => (AttemptEnd::RecvTimeout, None),
            Attempt::Deadline => (AttemptEnd::Deadline, None),
            Attempt::Local(s) => (AttemptEnd::Status(s.code()), None),
        };
        Attempted {
            end,
            pushback: headers.map_or(Pushback::Absent, pushback),
            retry_info: headers.and_then(retry_info_delay),
        }
    }

    /// Why the server's application never saw this attempt, if it did not: see
    /// [`unprocessed`](crate::retry::response::unprocessed).
    pub(crate) fn unprocessed(&self) -> Option<Unprocessed> {
        match self {
            Attempt::Error(e) => unprocessed(e.as_ref()),
            _ => None,
        }
    }

    /// Whether the attempt failed before anything was sent: the channel could not
    /// connect (tonic's [`tonic::ConnectError`], or a refused connection).
    pub(crate) fn never_sent(&self) -> bool {
        let Attempt::Error(e) = self else {
            return false;
        };
        let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(e.as_ref());
        while let Some(err) = cause {
            if err.is::<tonic::ConnectError>() {
                return true;
            }
            if let Some(io) = err.downcast_ref::<std::io::Error>()
                && io.kind() == std::io::ErrorKind::ConnectionRefused
            {
                return true;
            }
            cause = err.source();
        }
        false
    }
}

impl CallContext {
    /// The caller's response: the attempt's own, or for a failure without one a
    /// Trailers-Only status (a transport error becomes the status tonic would make of it),
    /// so every failure carries the report. A request message over its limit makes it
    /// RESOURCE_EXHAUSTED, whatever the attempt was. Records the report (counters, hook,
    /// span), attaches it, and bounds the body by the deadline and the response limit.
    pub(crate) fn finish(&self, attempt: Attempt, report: CallReport) -> Resp {
        self.finish_into(attempt, report, http::Extensions::new())
    }

    /// [`finish`](Self::finish), with the report in `spare` (cleared first): the
    /// extensions of a request head the call no longer needs, whose map is already
    /// allocated. The response's own extensions join them.
    pub(crate) fn finish_into(
        &self,
        attempt: Attempt,
        mut report: CallReport,
        mut spare: http::Extensions,
    ) -> Resp {
        let attempt = match self.request_fault() {
            Some(status) => {
                report.outcome = CallOutcome::MessageTooLarge;
                Attempt::Local(status)
            }
            None => attempt,
        };
        let mut resp = match attempt {
            Attempt::Response(r) => r,
            Attempt::Error(e) => self.error_status(e, report.outcome).into_http(),
            Attempt::RecvTimeout => {
                tonic::Status::cancelled("perAttemptRecvTimeout exceeded").into_http()
            }
            Attempt::Deadline => tonic::Status::deadline_exceeded("deadline exceeded").into_http(),
            Attempt::Local(status) => status.into_http(),
        };
        report.last_code = early_code(&resp);
        if let Some(ticket) = &self.ticket {
            if ticket.is_probe()
                && report.outcome == CallOutcome::NoRetryPolicy
                && report.last_code.is_some_and(|c| c != Code::Ok)
            {
                report.outcome = CallOutcome::CircuitProbe;
            }
            ticket.settle(
                report.last_code,
                report.attempts,
                self.shared.jitter.unit(),
                self.path.as_str(),
            );
        }
        self.shared.report(self.path.as_str(), &report);
        // The `idem_retry` span is a `debug` span: skip the lookup when nothing listens.
        if tracing::level_enabled!(tracing::Level::DEBUG) {
            let span = tracing::Span::current();
            span.record("attempts", report.attempts);
            span.record("outcome", report.outcome.as_str());
            let delay: std::time::Duration = report.history().filter_map(|a| a.wait_after).sum();
            span.record("retry_delay_ms", delay.as_secs_f64() * 1e3);
            if let Some(code) = report.last_code {
                span.record("rpc.grpc.status_code", code as i32);
            }
        }
        if report.last_code.is_some_and(|c| c != Code::Ok) {
            report.write_headers(resp.headers_mut());
            // Retry at one layer only: the server layer swaps this marker for
            // `grpc-retry-pushback-ms: -1` upstream.
            if let Some(m) = self.marker.filter(|_| report.outcome.retries_gave_up()) {
                resp.headers_mut()
                    .insert(DOWNSTREAM_EXHAUSTED, m.to_header_value());
            }
        }
        let extensions = resp.extensions_mut();
        if extensions.is_empty() {
            spare.clear();
            *extensions = spare;
        }
        extensions.insert(report);
        let bounds = Bounds {
            deadline: self.deadline,
            limit: self.limits.response,
            fault: self.fault.clone(),
        };
        let resp = bound::bound(resp, bounds, report);
        let observer = self.shared.observer.as_ref();
        metrics::observe(resp, observer, &self.path, report, self.started)
    }

    /// The circuit breaker that admitted the call, if any.
    pub(crate) fn breaker(&self) -> Option<&CircuitBreaker> {
        self.ticket.as_ref().map(CallTicket::breaker)
    }

    /// An attempt ended as `end`: the circuit breaker, if any, counts it now.
    pub(crate) fn attempt_ended(&self, end: AttemptEnd) {
        if let Some(ticket) = &self.ticket {
            ticket.attempt_ended(end, self.shared.jitter.unit(), self.path.as_str());
        }
    }

    /// Tells the observer, if any, that an attempt was sent.
    pub(crate) fn attempt_started(&self) {
        if let Some(o) = &self.shared.observer {
            o.attempt_started(self.path.as_str());
        }
    }

    /// RESOURCE_EXHAUSTED, once a request message was over its limit.
    pub(crate) fn request_fault(&self) -> Option<tonic::Status> {
        self.fault.as_ref()?.status()
    }

    /// The status tonic would make of a transport error; a give-up under an inbound call
    /// says so, for the handler's logs upstream.
    fn error_status(&self, e: BoxError, outcome: CallOutcome) -> tonic::Status {
        let status = tonic::Status::from_error(e);
        // What tonic leaves UNKNOWN (a connection reset, a refused stream) is a channel
        // that failed before any response: UNAVAILABLE, as gRPC clients report it.
        let status = match status.code() {
            tonic::Code::Unknown => tonic::Status::unavailable(status.message()),
            _ => status,
        };
        if self.marker.is_some() && outcome.retries_gave_up() {
            let message = format!(
                "downstream call failed on every attempt: {}",
                status.message()
            );
            return tonic::Status::new(status.code(), message);
        }
        status
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_connect_failures_are_never_sent() {
        let connect: BoxError = Box::new(tonic::ConnectError("tcp connect error".into()));
        assert!(Attempt::Error(connect).never_sent());
        let refused: BoxError =
            Box::new(std::io::Error::from(std::io::ErrorKind::ConnectionRefused));
        assert!(Attempt::Error(refused).never_sent());
        let reset: BoxError = Box::new(std::io::Error::from(std::io::ErrorKind::ConnectionReset));
        assert!(!Attempt::Error(reset).never_sent());
        assert!(!Attempt::Error("connection refused".into()).never_sent());
        assert!(!Attempt::Deadline.never_sent());
    }
}
