//! The bounds on the response body the caller gets: the call's deadline, and
//! `maxResponseMessageBytes`.
//!
//! - **Deadline**: a tonic server does not enforce `grpc-timeout` once it has sent
//!   response headers (a server-streaming handler can stall for ever), and tonic's
//!   channel timeout stops at the headers too. When the deadline passes, the body drops
//!   the stream (resetting it) and yields trailers with DEADLINE_EXCEEDED and the call's
//!   report, which tonic reads as the call's status.
//! - **Message limit**: the length in each gRPC message's 5-byte frame header, read as
//!   the bytes stream past (the [`FrameScanner`] of the request side). A response message
//!   over its limit ends the body with RESOURCE_EXHAUSTED trailers, after the messages
//!   before it; so does a request message over its limit ([`RequestFault`]).
//!
//! One body does both, so a call with both bounds pays for one wrapper.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;
use tokio::time::{Instant, Sleep};

use crate::retry::Resp;
use crate::retry::outcome::{CallOutcome, CallReport};
use crate::retry::request::check::{FrameScanner, RequestFault};

/// What bounds a call's response body.
#[derive(Debug, Clone, Default)]
pub(crate) struct Bounds {
    /// The call's deadline.
    pub(crate) deadline: Option<Instant>,
    /// `maxResponseMessageBytes`.
    pub(crate) limit: Option<u64>,
    /// Set when a request message of the call was over its limit.
    pub(crate) fault: Option<Arc<RequestFault>>,
}

pin_project! {
    /// A response body cut at the call's deadline and at a message over its limit.
    struct BoundedBody {
        inner: Option<tonic::body::Body>,
        #[pin]
        sleep: Option<Sleep>,
        scanner: FrameScanner,
        limit: Option<u64>,
        fault: Option<Arc<RequestFault>>,
        report: CallReport,
        // Trailers to end with, after the data before a message over the limit.
        end: Option<HeaderMap>,
        // Trailers (or an error) were yielded: the body has ended (http-body's contract:
        // nothing comes after trailers).
        done: bool,
    }
}

/// Bounds `resp`'s body by `bounds`; `report` is the call's report (its outcome becomes
/// [`CallOutcome::Deadline`] or [`CallOutcome::MessageTooLarge`] in the trailers when a
/// bound cuts the body).
pub(crate) fn bound(resp: Resp, bounds: Bounds, report: CallReport) -> Resp {
    let Bounds {
        deadline,
        limit,
        fault,
    } = bounds;
    let unbounded = deadline.is_none() && limit.is_none() && fault.is_none();
    if unbounded || resp.body().is_end_stream() {
        return resp;
    }
    resp.map(|inner| {
        tonic::body::Body::new(BoundedBody {
            inner: Some(inner),
            sleep: deadline.map(tokio::time::sleep_until),
            scanner: FrameScanner::default(),
            limit,
            fault,
            report,
            end: None,
            done: false,
        })
    })
}

impl Body for BoundedBody {
    type Data = Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, tonic::Status>>> {
        if self.done {
            return Poll::Ready(None);
        }
        let polled = self.as_mut().poll_bounded(cx);
        if let Poll::Ready(Some(frame)) = &polled
            && !frame.as_ref().is_ok_and(Frame::is_data)
        {
            let this = self.project();
            *this.done = true;
            *this.inner = None;
            *this.end = None;
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        let fault_pending = self.fault.as_ref().is_some_and(|f| f.is_set());
        self.done
            || (self.end.is_none()
                && !fault_pending
                && self.inner.as_ref().is_none_or(Body::is_end_stream))
    }

    fn size_hint(&self) -> SizeHint {
        match &self.inner {
            // Only the deadline bounds it: the size is the inner body's, unless cut.
            Some(inner) if self.limit.is_none() && self.fault.is_none() => inner.size_hint(),
            Some(_) => SizeHint::default(),
            None => SizeHint::with_exact(0),
        }
    }
}

impl BoundedBody {
    /// The next frame, bounded; [`Body::poll_frame`] ends the body after trailers.
    fn poll_bounded(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, tonic::Status>>> {
        let mut this = self.project();
        let fault = this.fault.as_ref();
        if let Some(trailers) =
            (this.end.take()).or_else(|| request_fault(fault, this.inner, this.report))
        {
            return Poll::Ready(Some(Ok(Frame::trailers(trailers))));
        }
        let Some(inner) = this.inner.as_mut() else {
            return Poll::Ready(None);
        };
        let frame = match Pin::new(inner).poll_frame(cx) {
            Poll::Ready(frame) => frame,
            Poll::Pending => {
                let Some(sleep) = this.sleep.as_mut().as_pin_mut() else {
                    return Poll::Pending;
                };
                std::task::ready!(sleep.poll(cx));
                let status = tonic::Status::deadline_exceeded(
                    "deadline exceeded while receiving the response",
                );
                let trailers = cut(this.inner, this.report, CallOutcome::Deadline, &status);
                return Poll::Ready(Some(Ok(Frame::trailers(trailers))));
            }
        };
        let data = match frame {
            Some(Ok(frame)) => match frame.into_data() {
                Ok(data) => data,
                Err(frame) => {
                    let fault = request_fault(fault, this.inner, this.report);
                    return Poll::Ready(Some(Ok(fault.map_or(frame, Frame::trailers))));
                }
            },
            // The stream ended or failed: when the request side broke it, say why.
            other => {
                if other.is_none() {
                    *this.inner = None;
                }
                if let Some(trailers) = request_fault(fault, this.inner, this.report) {
                    return Poll::Ready(Some(Ok(Frame::trailers(trailers))));
                }
                return Poll::Ready(other);
            }
        };
        let Some(o) = this.limit.and_then(|limit| this.scanner.scan(&data, limit)) else {
            return Poll::Ready(Some(Ok(Frame::data(data))));
        };
        let status = tonic::Status::resource_exhausted(format!(
            "response message of {} bytes is over maxResponseMessageBytes ({})",
            o.len, o.limit
        ));
        let trailers = cut(
            this.inner,
            this.report,
            CallOutcome::MessageTooLarge,
            &status,
        );
        if o.at == 0 {
            return Poll::Ready(Some(Ok(Frame::trailers(trailers))));
        }
        // The messages before it are the caller's: deliver them, then end.
        *this.end = Some(trailers);
        Poll::Ready(Some(Ok(Frame::data(data.slice(..o.at)))))
    }
}

/// Once a request message was over its limit: the trailers that end the response.
fn request_fault(
    fault: Option<&Arc<RequestFault>>,
    inner: &mut Option<tonic::body::Body>,
    report: &CallReport,
) -> Option<HeaderMap> {
    let status = fault?.status()?;
    Some(cut(inner, report, CallOutcome::MessageTooLarge, &status))
}

/// Stops reading the response (dropping it resets the stream): the trailers it ends
/// with, `status` and the report with `outcome`.
fn cut(
    inner: &mut Option<tonic::body::Body>,
    report: &CallReport,
    outcome: CallOutcome,
    status: &tonic::Status,
) -> HeaderMap {
    *inner = None;
    report.trailers(outcome, status)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::retry::tests::{deadline_report, next_trailers};
    use http_body_util::BodyExt;
    use std::time::Duration;

    #[tokio::test(start_paused = true)]
    async fn a_stalled_body_ends_at_the_deadline_with_deadline_exceeded() {
        let resp = http::Response::new(tonic::body::Body::new(Stalled(true)));
        let mut report = CallReport::new(CallOutcome::Committed);
        report.record(crate::retry::AttemptEnd::Committed, Duration::ZERO);
        let start = Instant::now();
        let bounds = Bounds {
            deadline: Some(start + Duration::from_secs(1)),
            ..Bounds::default()
        };
        let mut body = bound(resp, bounds, report).into_body();
        let first = body.frame().await.unwrap().unwrap();
        assert_eq!(first.into_data().unwrap(), &b"\0\0\0\0\0"[..]);
        let trailers = next_trailers(&mut body).await;
        assert_eq!(start.elapsed(), Duration::from_secs(1));
        assert!(body.frame().await.is_none());
        let status = tonic::Status::from_header_map(&trailers).unwrap();
        assert_eq!(deadline_report(&status).attempts, 1);
    }

    /// Issue 30, item 10: a request message over its limit after the response began
    /// ends the body with RESOURCE_EXHAUSTED trailers, once: then `None` (it returned the
    /// trailers on every poll, and `collect` spun for ever).
    #[tokio::test(start_paused = true)]
    async fn trailers_end_the_body_once_a_request_message_was_too_large() {
        let fault = Arc::new(RequestFault::default());
        let resp = http::Response::new(tonic::body::Body::new(Stalled(true)));
        let bounds = Bounds {
            fault: Some(Arc::clone(&fault)),
            ..Bounds::default()
        };
        let report = CallReport::new(CallOutcome::Committed);
        let mut body = bound(resp, bounds, report).into_body();
        assert!(body.frame().await.unwrap().unwrap().is_data());
        assert!(!body.is_end_stream());
        fault.set(crate::retry::request::check::Oversize {
            at: 0,
            len: 10,
            limit: 4,
        });
        let trailers = next_trailers(&mut body).await;
        let status = tonic::Status::from_header_map(&trailers).unwrap();
        assert_eq!(status.code(), tonic::Code::ResourceExhausted);
        assert!(body.is_end_stream());
        for _ in 0..3 {
            assert!(body.frame().await.is_none());
        }
        // The caller's `collect` ends, with the one set of trailers.
        let resp = http::Response::new(tonic::body::Body::new(Stalled(true)));
        let bounds = Bounds {
            fault: Some(fault),
            ..Bounds::default()
        };
        let body = bound(resp, bounds, report).into_body();
        let collected = body.collect().await.unwrap();
        assert_eq!(collected.trailers().unwrap()["grpc-status"], "8");
    }

    /// One message, then nothing for ever.
    struct Stalled(bool);
    impl Body for Stalled {
        type Data = Bytes;
        type Error = tonic::Status;
        fn poll_frame(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, tonic::Status>>> {
            if std::mem::take(&mut self.0) {
                return Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(b"\0\0\0\0\0")))));
            }
            Poll::Pending
        }
    }
}
