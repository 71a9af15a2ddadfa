//! The call's deadline over the response body.
//!
//! A tonic server does not enforce `grpc-timeout` once it has sent response headers (a
//! server-streaming handler can stall for ever), and tonic's channel timeout stops at
//! the headers too. [`DeadlineBody`] ends the body when the deadline passes: it drops the
//! stream (resetting it) and yields trailers with DEADLINE_EXCEEDED and the call's report,
//! which tonic reads as the call's status.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;
use tokio::time::{Instant, Sleep};

use crate::retry::Resp;
use crate::retry::outcome::{CallOutcome, CallReport};

pin_project! {
    /// A response body cut at the call's deadline.
    pub(crate) struct DeadlineBody {
        inner: Option<tonic::body::Body>,
        #[pin]
        sleep: Sleep,
        report: CallReport,
    }
}

/// Bounds `resp`'s body by `deadline`; `report` is the call's report (its outcome becomes
/// [`CallOutcome::Deadline`] in the trailers when the deadline cuts the body).
pub(crate) fn bound(resp: Resp, deadline: Option<Instant>, report: CallReport) -> Resp {
    match deadline {
        Some(at) if !resp.body().is_end_stream() => resp.map(|inner| {
            tonic::body::Body::new(DeadlineBody {
                inner: Some(inner),
                sleep: tokio::time::sleep_until(at),
                report,
            })
        }),
        _ => resp,
    }
}

impl Body for DeadlineBody {
    type Data = Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, tonic::Status>>> {
        let this = self.project();
        let Some(inner) = this.inner.as_mut() else {
            return Poll::Ready(None);
        };
        if let Poll::Ready(frame) = Pin::new(inner).poll_frame(cx) {
            if frame.is_none() {
                *this.inner = None;
            }
            return Poll::Ready(frame);
        }
        if this.sleep.poll(cx).is_pending() {
            return Poll::Pending;
        }
        // Dropping the body resets the stream: the server stops sending.
        *this.inner = None;
        let status =
            tonic::Status::deadline_exceeded("deadline exceeded while receiving the response");
        let trailers = this.report.trailers(CallOutcome::Deadline, &status);
        Poll::Ready(Some(Ok(Frame::trailers(trailers))))
    }

    fn is_end_stream(&self) -> bool {
        self.inner.as_ref().is_none_or(Body::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        self.inner
            .as_ref()
            .map_or(SizeHint::with_exact(0), Body::size_hint)
    }
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
        let mut body = bound(resp, Some(start + Duration::from_secs(1)), report).into_body();
        let first = body.frame().await.unwrap().unwrap();
        assert_eq!(first.into_data().unwrap(), &b"\0\0\0\0\0"[..]);
        let trailers = next_trailers(&mut body).await;
        assert_eq!(start.elapsed(), Duration::from_secs(1));
        assert!(body.frame().await.is_none());
        let status = tonic::Status::from_header_map(&trailers).unwrap();
        assert_eq!(deadline_report(&status).attempts, 1);
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
