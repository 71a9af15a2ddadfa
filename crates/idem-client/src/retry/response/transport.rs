//! A response body whose connection failures read as UNAVAILABLE, and whose trailers
//! are scrubbed ([`wire`]).
//!
//! tonic reports a connection that breaks while a response's body is read (a server
//! killed after its response headers left) as UNKNOWN, "h2 protocol error". gRPC's
//! status-code table says a connection that breaks after some data was sent is
//! UNAVAILABLE, which a caller may retry (with the same key, the retry replays); UNKNOWN
//! it would not. The call is committed by then, so the layer itself does not retry it.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;
use tonic::{Code, Status};

use crate::BoxError;
use crate::retry::response::wire;

pin_project! {
    /// `inner`, with its transport failures as UNAVAILABLE and its trailers scrubbed.
    pub(crate) struct TransportBody<B> {
        #[pin]
        inner: B,
    }
}

impl<B> TransportBody<B> {
    pub(crate) fn new(inner: B) -> Self {
        TransportBody { inner }
    }
}

impl<B> Body for TransportBody<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        let frame = std::task::ready!(self.project().inner.poll_frame(cx));
        Poll::Ready(frame.map(|r| {
            let mut frame = r.map_err(|e| status_of(e.into()))?;
            if let Some(trailers) = frame.trailers_mut() {
                wire::scrub(trailers);
            }
            Ok(frame)
        }))
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// The status of a body error: UNAVAILABLE for one tonic made UNKNOWN out of a
/// transport error (it keeps that error as its source); any other status as it is.
fn status_of(e: BoxError) -> Status {
    let status = Status::from_error(e);
    if status.code() == Code::Unknown && std::error::Error::source(&status).is_some() {
        return Status::unavailable(format!(
            "the connection broke while the response was read: {}",
            status.message()
        ));
    }
    status
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    fn failing(err: Status) -> tonic::body::Body {
        let frames: Vec<Result<Frame<Bytes>, Status>> =
            vec![Ok(Frame::data(Bytes::from_static(b"\0\0\0\0\0"))), Err(err)];
        tonic::body::Body::new(http_body_util::StreamBody::new(tokio_stream::iter(frames)))
    }

    async fn error_after_one_frame(err: Status) -> Status {
        let mut body = TransportBody::new(failing(err));
        assert!(body.frame().await.unwrap().unwrap().is_data());
        body.frame().await.unwrap().unwrap_err()
    }

    #[tokio::test]
    async fn a_connection_that_breaks_mid_body_is_unavailable() {
        // What tonic makes of a reset connection: UNKNOWN with the transport error kept.
        let reset = std::io::Error::from(std::io::ErrorKind::ConnectionReset);
        let tonic_made = Status::from_error(Box::new(reset));
        assert_eq!(tonic_made.code(), Code::Unknown);
        let s = error_after_one_frame(tonic_made).await;
        assert_eq!(s.code(), Code::Unavailable, "{s:?}");
        assert!(s.message().contains("connection broke"), "{s:?}");
    }

    #[tokio::test]
    async fn statuses_the_server_or_a_layer_chose_are_kept() {
        for chosen in [
            Status::unknown("the handler said so"),
            Status::internal("boom"),
            Status::cancelled("stream reset"),
        ] {
            let code = chosen.code();
            assert_eq!(error_after_one_frame(chosen).await.code(), code);
        }
    }
}
