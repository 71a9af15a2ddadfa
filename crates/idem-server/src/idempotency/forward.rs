//! Sending a handler's response to its caller as it is produced, holding the end back
//! until the outcome is recorded ([`Forwarder`]).

use std::collections::VecDeque;
use std::sync::Arc;

use bytes::Bytes;
use http::{HeaderMap, Response};
use http_body::Frame;
use http_body_util::StreamBody;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Duration;
use tonic::Status;
use tonic::body::Body;

use super::body::ReplayBody;
use crate::metrics::{BodyEnd, CallTrace};

/// Where the caller's answer goes: the response as soon as it starts, or the service's
/// error.
pub(crate) type Reply<E> = oneshot::Sender<Result<Response<Body>, E>>;

/// Sends the response to the caller as it is produced. The newest data frame is held
/// back until the next one arrives, so the last one leaves with the trailers (and a
/// unary response leaves whole, head included) after the outcome is recorded: a caller
/// that saw the end of its response and retries finds the record completed, and the
/// end goes out in one write, not a trailing small one that Nagle's algorithm would
/// hold for the peer's delayed ACK.
pub(crate) struct Forwarder<E> {
    reply: Option<Reply<E>>,
    /// The head, until the first frame is forwarded.
    pub(crate) head: Option<http::response::Parts>,
    tx: Option<mpsc::Sender<Result<Frame<Bytes>, Status>>>,
    pending: Option<Bytes>,
    /// How long a frame may wait for the caller to make room (`responseStallTimeout`).
    stall: Duration,
    /// The call's trace, for a response delivered whole: its body reports its end.
    trace: Option<Arc<CallTrace>>,
}

impl<E> Forwarder<E> {
    pub(crate) fn new(reply: Reply<E>, stall: Duration, trace: Option<Arc<CallTrace>>) -> Self {
        Forwarder {
            reply: Some(reply),
            head: None,
            tx: None,
            pending: None,
            stall,
            trace,
        }
    }

    pub(crate) async fn data(&mut self, data: Bytes) {
        if let Some(prev) = self.pending.replace(data) {
            self.open();
            self.send(Ok(Frame::data(prev))).await;
        }
    }

    /// The body failed mid-way: the caller gets what came before, then the error.
    pub(crate) async fn fail(&mut self, status: Status) {
        self.open();
        if let Some(prev) = self.pending.take() {
            self.send(Ok(Frame::data(prev))).await;
        }
        self.send(Err(status)).await;
    }

    pub(crate) fn fail_service(mut self, e: E) {
        if let Some(r) = self.reply.take() {
            let _ = r.send(Err(e));
        }
    }

    /// Sends the head with a body fed from here, once. The run goes on (and records
    /// the outcome) when that body is dropped because the caller went away.
    fn open(&mut self) {
        if let Some(head) = self.head.take() {
            let (tx, mut rx) = mpsc::channel(16);
            self.tx = Some(tx);
            let frames = futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx));
            let body = Body::new(StreamBody::new(frames));
            self.respond(Response::from_parts(head, body));
        }
    }

    fn respond(&mut self, resp: Response<Body>) {
        if let Some(r) = self.reply.take() {
            let _ = r.send(Ok(resp));
        }
    }

    /// Sends one frame to the caller, waiting at most `stall` for room. A caller that
    /// went away, or that has read nothing for that long, is sent nothing more: its
    /// stream ends (without trailers, which its client reports as an error), and the run
    /// goes on to record its outcome.
    async fn send(&mut self, item: Result<Frame<Bytes>, Status>) {
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

    /// Delivers what was held back, once the outcome is recorded: the head too when no
    /// frame was forwarded (a Trailers-Only or single-message response).
    pub(crate) async fn finish(mut self, trailers: Option<HeaderMap>) {
        if let Some(head) = self.head.take() {
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
            self.respond(Response::from_parts(head, body));
            return;
        }
        if let Some(last) = self.pending.take() {
            self.send(Ok(Frame::data(last))).await;
        }
        if let Some(t) = trailers {
            self.send(Ok(Frame::trailers(t))).await;
        }
    }
}
