//! Reading how an attempt ended from its response head: Trailers-Only detection, and the
//! opt-in peek at the first body frame for servers that send "headers, then error
//! trailers" instead of Trailers-Only.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame};
use idem_core::code::grpc_status_code;
use tonic::Code;

use crate::retry::Resp;

/// The status of an attempt that ended before the call committed: a Trailers-Only
/// response (`grpc-status` among the headers; an unparseable value is UNKNOWN), or a
/// non-200 HTTP response without `grpc-status` (a proxy's 503…), mapped as gRPC's
/// `http-grpc-status-mapping.md` says. `None` for a 200 response with real headers: the
/// call is committed.
pub(crate) fn early_code<RB>(resp: &http::Response<RB>) -> Option<Code> {
    if let Some(code) = grpc_status_code(resp.headers()) {
        return Some(code);
    }
    match resp.status().as_u16() {
        200 => None,
        400 => Some(Code::Internal),
        401 => Some(Code::Unauthenticated),
        403 => Some(Code::PermissionDenied),
        404 => Some(Code::Unimplemented),
        429 | 502 | 503 | 504 => Some(Code::Unavailable),
        _ => Some(Code::Unknown),
    }
}

/// A response body whose first frame was read by the layer: that frame, then the rest.
struct Peeked {
    first: Option<Frame<Bytes>>,
    error: Option<tonic::Status>,
    rest: Option<tonic::body::Body>,
}

impl Body for Peeked {
    type Data = Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, tonic::Status>>> {
        if let Some(frame) = self.first.take() {
            return Poll::Ready(Some(Ok(frame)));
        }
        if let Some(e) = self.error.take() {
            return Poll::Ready(Some(Err(e)));
        }
        match self.rest.as_mut() {
            Some(rest) => Pin::new(rest).poll_frame(cx),
            None => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.first.is_none()
            && self.error.is_none()
            && self.rest.as_ref().is_none_or(Body::is_end_stream)
    }
}

/// The opt-in "headers, then error trailers with no message" rule: a response with real
/// headers whose first body frame the layer reads before handing it on. When that frame
/// is trailers with a non-OK `grpc-status`, the response is reshaped as Trailers-Only
/// (the trailers join the headers, the body is empty), so the retry decision (and tonic)
/// treat it as one. Otherwise the response is rebuilt with the frame put back in front:
/// nothing is lost. A peek cut short gives the response back as it came.
pub(crate) struct Peek {
    parts: http::response::Parts,
    body: tonic::body::Body,
}

impl Peek {
    pub(crate) fn new(resp: Resp) -> Self {
        let (parts, body) = resp.into_parts();
        Peek { parts, body }
    }

    /// Polls the first frame of the body.
    pub(crate) fn poll_first(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, tonic::Status>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    /// The response, once its first frame (`first`) came: reshaped as Trailers-Only, or
    /// rebuilt with the frame in front.
    pub(crate) fn finish(self, first: Option<Result<Frame<Bytes>, tonic::Status>>) -> Resp {
        let Peek { mut parts, body } = self;
        let rebuilt = |parts, first, error, rest| {
            let body = tonic::body::Body::new(Peeked { first, error, rest });
            http::Response::from_parts(parts, body)
        };
        match first {
            None => http::Response::from_parts(parts, tonic::body::Body::empty()),
            Some(Err(e)) => rebuilt(parts, None, Some(e), None),
            Some(Ok(frame)) => match frame.into_trailers() {
                Ok(trailers) => {
                    let failed = grpc_status_code(&trailers).is_some_and(|c| c != Code::Ok);
                    if failed {
                        for (name, value) in &trailers {
                            parts.headers.append(name.clone(), value.clone());
                        }
                        http::Response::from_parts(parts, tonic::body::Body::empty())
                    } else {
                        rebuilt(parts, Some(Frame::trailers(trailers)), None, None)
                    }
                }
                Err(frame) => rebuilt(parts, Some(frame), None, Some(body)),
            },
        }
    }

    /// The response as it came, its first frame still to come: the peek was cut short
    /// after the headers, which committed the call.
    pub(crate) fn into_response(self) -> Resp {
        http::Response::from_parts(self.parts, self.body)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn early_codes() {
        let resp = |status: u16, grpc: Option<&str>| {
            let mut b = http::Response::builder().status(status);
            if let Some(g) = grpc {
                b = b.header("grpc-status", g);
            }
            b.body(()).unwrap()
        };
        assert_eq!(early_code(&resp(200, None)), None);
        assert_eq!(early_code(&resp(200, Some("14"))), Some(Code::Unavailable));
        assert_eq!(early_code(&resp(200, Some("0"))), Some(Code::Ok));
        assert_eq!(early_code(&resp(200, Some("nope"))), Some(Code::Unknown));
        assert_eq!(early_code(&resp(200, Some("99"))), Some(Code::Unknown));
        assert_eq!(early_code(&resp(503, None)), Some(Code::Unavailable));
        assert_eq!(early_code(&resp(404, None)), Some(Code::Unimplemented));
        assert_eq!(early_code(&resp(500, None)), Some(Code::Unknown));
    }
}
