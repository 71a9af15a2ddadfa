//! The body of a response the layer delivers whole: a stored response replayed, or a
//! run's response held back until its outcome was recorded. (A run's streamed response
//! is the receiving end of the channel its run feeds, see `handler.rs`.)

use std::collections::VecDeque;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use idem_core::code::end_of_response;

use crate::metrics::BodyEnd;

/// A stored response's frames and trailers, replayed as they were.
#[derive(Debug)]
pub(crate) struct ReplayBody {
    pub(crate) frames: VecDeque<Bytes>,
    /// A frame after `frames` (a run's last frame, held back: a unary response's one
    /// frame needs no queue).
    pub(crate) last: Option<Bytes>,
    pub(crate) trailers: Option<HeaderMap>,
    /// Told how the body ended, when the call is traced: the body reports it itself, so
    /// the trace needs no wrapper around it (a box and a call per frame).
    pub(crate) end: Option<BodyEnd>,
}

impl ReplayBody {
    /// A body of `frames`, then `last`, then `trailers`, reporting its end to `end`.
    pub(crate) fn new(
        frames: VecDeque<Bytes>,
        last: Option<Bytes>,
        trailers: Option<HeaderMap>,
        end: Option<BodyEnd>,
    ) -> Self {
        ReplayBody {
            frames,
            last,
            trailers,
            end,
        }
    }
}

impl Body for ReplayBody {
    type Data = Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, tonic::Status>>> {
        if let Some(f) = self.frames.pop_front().or_else(|| self.last.take()) {
            return Poll::Ready(Some(Ok(Frame::data(f))));
        }
        let polled = Poll::Ready(self.trailers.take().map(|t| Ok(Frame::trailers(t))));
        if let Some(code) = end_of_response(&polled)
            && let Some(end) = self.end.take()
        {
            end.ended(code);
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.frames.is_empty() && self.last.is_none() && self.trailers.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        let n: usize = self.frames.iter().chain(&self.last).map(Bytes::len).sum();
        if self.trailers.is_none() {
            SizeHint::with_exact(n as u64)
        } else {
            let mut h = SizeHint::new();
            h.set_lower(n as u64);
            h
        }
    }
}
