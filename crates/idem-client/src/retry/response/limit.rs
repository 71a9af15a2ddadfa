//! `maxResponseMessageBytes`: the length in each gRPC message's 5-byte frame header, read
//! as the response's bytes stream past (the [`FrameScanner`] of the request side). A
//! response message over its limit ends the response body with RESOURCE_EXHAUSTED
//! trailers, after the messages before it ([`bound`]); so does a request message over
//! its limit ([`RequestFault`]).

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::HeaderMap;
use http_body::{Body, Frame};

use crate::retry::Resp;
use crate::retry::outcome::{CallOutcome, CallReport};
use crate::retry::request::check::{FrameScanner, RequestFault};

/// Bounds `resp`'s body by `limit` (bytes per response message) and ends it with
/// RESOURCE_EXHAUSTED when the call's request `fault` is set; `report` is the call's.
pub(crate) fn bound(
    resp: Resp,
    limit: Option<u64>,
    fault: Option<Arc<RequestFault>>,
    report: CallReport,
) -> Resp {
    if (limit.is_none() && fault.is_none()) || resp.body().is_end_stream() {
        return resp;
    }
    resp.map(|inner| {
        tonic::body::Body::new(LimitBody {
            inner: Some(inner),
            scanner: FrameScanner::default(),
            limit,
            fault,
            report,
            end: None,
        })
    })
}

/// A response body checked against `maxResponseMessageBytes` (and the request's fault).
struct LimitBody {
    inner: Option<tonic::body::Body>,
    scanner: FrameScanner,
    limit: Option<u64>,
    fault: Option<Arc<RequestFault>>,
    report: CallReport,
    /// Trailers to end with, after the data before a message over the limit.
    end: Option<HeaderMap>,
}

impl LimitBody {
    /// Stops reading the response (dropping it resets the stream) and ends with `status`.
    fn cut(&mut self, status: &tonic::Status) -> HeaderMap {
        self.inner = None;
        self.report.trailers(CallOutcome::MessageTooLarge, status)
    }

    fn request_fault(&mut self) -> Option<HeaderMap> {
        let status = self.fault.as_ref()?.status()?;
        Some(self.cut(&status))
    }
}

impl Body for LimitBody {
    type Data = Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, tonic::Status>>> {
        let this = &mut *self;
        if let Some(trailers) = this.end.take().or_else(|| this.request_fault()) {
            return Poll::Ready(Some(Ok(Frame::trailers(trailers))));
        }
        let Some(inner) = this.inner.as_mut() else {
            return Poll::Ready(None);
        };
        let frame = std::task::ready!(Pin::new(inner).poll_frame(cx));
        let data = match frame {
            Some(Ok(frame)) => match frame.into_data() {
                Ok(data) => data,
                Err(frame) => return Poll::Ready(Some(Ok(frame))),
            },
            // The stream ended or failed: when the request side broke it, say why.
            other => {
                if let Some(trailers) = this.request_fault() {
                    return Poll::Ready(Some(Ok(Frame::trailers(trailers))));
                }
                return Poll::Ready(other);
            }
        };
        let Some(limit) = this.limit else {
            return Poll::Ready(Some(Ok(Frame::data(data))));
        };
        let Some(o) = this.scanner.scan(&data, limit) else {
            return Poll::Ready(Some(Ok(Frame::data(data))));
        };
        let status = tonic::Status::resource_exhausted(format!(
            "response message of {} bytes is over maxResponseMessageBytes ({})",
            o.len, o.limit
        ));
        let trailers = this.cut(&status);
        if o.at == 0 {
            return Poll::Ready(Some(Ok(Frame::trailers(trailers))));
        }
        // The messages before it are the caller's: deliver them, then end.
        this.end = Some(trailers);
        Poll::Ready(Some(Ok(Frame::data(data.slice(..o.at)))))
    }

    fn is_end_stream(&self) -> bool {
        self.end.is_none() && self.inner.as_ref().is_none_or(Body::is_end_stream)
    }
}
