//! What the caller gets of a handler's response ([`Forwarder`]): the response whole,
//! once its outcome is recorded, or (a stream) each message as it is produced, the end
//! held back until the outcome is recorded.

use std::collections::VecDeque;
use std::sync::Arc;

use bytes::Bytes;
use http::{HeaderMap, Response};
use http_body::Frame;
use http_body_util::StreamBody;
use tokio::sync::mpsc;
use tokio::time::Duration;
use tonic::Status;
use tonic::body::Body;

use super::body::ReplayBody;
use crate::metrics::{BodyEnd, CallTrace};

/// How many frames a stream holds for a caller that reads slowly.
const STREAM_BUFFER: usize = 16;

type Item = Result<Frame<Bytes>, Status>;

/// Holds the response back for the caller. The newest data frame is held back until the
/// next one arrives, so the last one leaves with the trailers (and a unary response
/// leaves whole, head included) after the outcome is recorded: a caller that saw the end
/// of its response and retries finds the record completed, and the end goes out in one
/// write, not a trailing small one that Nagle's algorithm would hold for the peer's
/// delayed ACK. A second data frame makes the response a stream: the head leaves with a
/// body fed from a channel ([`open`](Self::open)).
pub(crate) struct Forwarder {
    /// The head, until the response leaves.
    pub(crate) head: Option<http::response::Parts>,
    tx: Option<mpsc::Sender<Item>>,
    /// The newest data frame, held back.
    pending: Option<Bytes>,
    /// Frames to send before `pending`: earlier data frames, or the body's error.
    queued: VecDeque<Item>,
    /// How long a frame may wait for the caller to make room (`responseStallTimeout`).
    stall: Duration,
    /// The call's trace, for a response delivered whole: its body reports its end.
    trace: Option<Arc<CallTrace>>,
}

impl Forwarder {
    pub(crate) fn new(stall: Duration, trace: Option<Arc<CallTrace>>) -> Self {
        Forwarder {
            head: None,
            tx: None,
            pending: None,
            queued: VecDeque::new(),
            stall,
            trace,
        }
    }

    /// Holds `data` back; the frame it replaces is queued to leave.
    pub(crate) fn data(&mut self, data: Bytes) {
        if let Some(prev) = self.pending.replace(data) {
            self.queued.push_back(Ok(Frame::data(prev)));
        }
    }

    /// Whether a frame is queued: the response has more than one message.
    pub(crate) fn is_stream(&self) -> bool {
        !self.queued.is_empty()
    }

    /// The body failed mid-way: the caller gets what came before, then the error.
    pub(crate) fn fail(&mut self, status: Status) {
        if let Some(prev) = self.pending.take() {
            self.queued.push_back(Ok(Frame::data(prev)));
        }
        self.queued.push_back(Err(status));
    }

    /// The response, with a body fed from here: the run goes on (and records the
    /// outcome) when that body is dropped because the caller went away.
    pub(crate) fn open(&mut self) -> Response<Body> {
        let head = self.head.take().expect("the response head, once");
        let (tx, mut rx) = mpsc::channel(STREAM_BUFFER);
        self.tx = Some(tx);
        let frames = futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx));
        Response::from_parts(head, Body::new(StreamBody::new(frames)))
    }

    /// The response whole, its outcome recorded: the head, the frame held back and the
    /// trailers (or, after a body that failed, what came before and the error).
    pub(crate) fn whole(mut self, trailers: Option<HeaderMap>) -> Response<Body> {
        if !self.queued.is_empty() {
            let response = self.open();
            let tx = self.tx.take().expect("opened");
            // The error and the frame before it: within the channel's room.
            for item in self
                .queued
                .drain(..)
                .chain(self.pending.take().map(|d| Ok(Frame::data(d))))
            {
                let _ = tx.try_send(item);
            }
            return response;
        }
        let head = self.head.take().expect("the response head, once");
        let body = if self.pending.is_none() && trailers.is_none() {
            Body::empty()
        } else {
            let end = self.trace.take().map(BodyEnd::new);
            Body::new(ReplayBody::new(
                VecDeque::new(),
                self.pending.take(),
                trailers,
                end,
            ))
        };
        Response::from_parts(head, body)
    }

    /// Sends the queued frames to the caller of a stream.
    pub(crate) async fn flush(&mut self) {
        while let Some(item) = self.queued.pop_front() {
            self.send(item).await;
        }
    }

    /// Sends one frame to the caller, waiting at most `stall` for room. A caller that
    /// went away, or that has read nothing for that long, is sent nothing more: its
    /// stream ends (without trailers, which its client reports as an error), and the run
    /// goes on to record its outcome.
    async fn send(&mut self, item: Item) {
        let Some(tx) = &self.tx else { return };
        // Room now (the usual case): no timer.
        let item = match tx.try_send(item) {
            Ok(()) => return,
            Err(mpsc::error::TrySendError::Closed(_)) => {
                self.tx = None;
                return;
            }
            Err(mpsc::error::TrySendError::Full(item)) => item,
        };
        match tokio::time::timeout(self.stall, tx.send(item)).await {
            Ok(Ok(())) => {}
            Ok(Err(_)) => self.tx = None,
            Err(_) => {
                tracing::warn!(
                    stall_ms = u64::try_from(self.stall.as_millis()).unwrap_or(u64::MAX),
                    "the caller has read nothing of its streamed response for responseStallTimeout: its stream is ended; the handler's outcome is still recorded"
                );
                self.tx = None;
            }
        }
    }

    /// Delivers the end of a stream, once the outcome is recorded: the frame held back
    /// and the trailers.
    pub(crate) async fn finish(mut self, trailers: Option<HeaderMap>) {
        self.flush().await;
        if let Some(last) = self.pending.take() {
            self.send(Ok(Frame::data(last))).await;
        }
        if let Some(t) = trailers {
            self.send(Ok(Frame::trailers(t))).await;
        }
    }
}
