//! The replay buffer of a request that streams (client-streaming and bidi calls, or any
//! body the caller is still producing when the first attempt starts).
//!
//! Each message the caller produces goes to the current attempt as soon as the attempt
//! asks for it, and a copy is kept while the call is uncommitted and within its limits.
//! A retry's body sends the copy first, then goes on with the live remainder. As gRFC A6
//! says, the call commits when response headers arrive ([`StreamReplay::commit`]) or when
//! the copy would pass `maxReplayBytesPerCall` or what is left of the layer's
//! `maxReplayBytesTotal`; from then on nothing is kept (the bytes go back to the budget)
//! and the call is never retried, but the committed attempt goes on.
//!
//! One attempt reads at a time: starting an attempt (or retiring one) makes the bodies of
//! earlier attempts fail on their next poll (their waiting task is woken), so the
//! transport resets their streams instead of ending them as if the request were complete.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll, Waker};

use bytes::Bytes;
use http::HeaderMap;
use http_body::{Body, Frame};

use crate::BoxError;
use crate::retry::request::body::{Lease, Overflow, Partial};
use crate::retry::response::limit::RequestCheck;

/// The call loop's handle on a streaming request. Dropping it before the call committed
/// ends the request: the caller's body is dropped, the copy is freed, the bytes go back to
/// the budget, and an attempt body still held by the transport fails.
#[derive(Debug)]
pub(crate) struct StreamReplay {
    state: Arc<Mutex<State>>,
}

/// One attempt's request body.
#[derive(Debug)]
pub(crate) struct StreamBody {
    state: Arc<Mutex<State>>,
    attempt: u32,
}

/// The error an attempt's body fails with once a newer attempt (or none) owns the
/// request.
#[derive(Debug, thiserror::Error)]
#[error("request stream taken over by a newer attempt")]
pub(crate) struct Superseded;

#[derive(Debug)]
enum Keep {
    /// Every chunk is kept for replay.
    Recording,
    /// Response headers came: nothing more is kept.
    Committed,
    /// Not kept, for this reason: the call is committed to the current attempt.
    Overflowed(Overflow),
}

struct State {
    /// The caller's body, until it ends, fails, or the call is abandoned.
    source: Option<tonic::body::Body>,
    /// The caller's body has ended (after `trailers`, if any).
    ended: bool,
    trailers: Option<HeaderMap>,
    /// The caller's body failed: the current attempt gets this after `chunks`.
    error: Option<BoxError>,
    /// While recording, every chunk read; otherwise only those not yet sent.
    chunks: VecDeque<Bytes>,
    /// How many of `chunks` the current attempt has sent.
    sent: usize,
    /// Whether the current attempt has sent the trailers.
    trailers_sent: bool,
    /// Something read was dropped after it was sent: no attempt can send it again.
    drained: bool,
    keep: Keep,
    /// Response headers came: the current attempt has the request for good.
    committed: bool,
    kept: usize,
    cap: usize,
    lease: Lease,
    /// The attempt whose body may read; bodies of other attempts fail.
    attempt: u32,
    /// The task of the current attempt's body, while it waits on the caller.
    waker: Option<Waker>,
    check: Option<RequestCheck>,
}

impl std::fmt::Debug for State {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("State")
            .field("ended", &self.ended)
            .field("chunks", &self.chunks.len())
            .field("sent", &self.sent)
            .field("keep", &self.keep)
            .field("committed", &self.committed)
            .field("kept", &self.kept)
            .field("attempt", &self.attempt)
            .finish_non_exhaustive()
    }
}

fn lock(state: &Mutex<State>) -> MutexGuard<'_, State> {
    state.lock().unwrap_or_else(PoisonError::into_inner)
}

impl StreamReplay {
    /// Goes on from what [`read_ready`](crate::retry::request::body::read_ready) read of `source`;
    /// `lease` holds the bytes of `start.read` that are kept.
    pub(crate) fn new(
        start: Partial,
        source: tonic::body::Body,
        lease: Lease,
        cap: usize,
        check: Option<RequestCheck>,
    ) -> Self {
        let keep = start.overflow.map_or(Keep::Recording, Keep::Overflowed);
        let ended = start.error.is_some();
        let state = State {
            ended,
            source: (!ended).then_some(source),
            trailers: start.trailers,
            error: start.error,
            chunks: start.read,
            sent: 0,
            trailers_sent: false,
            drained: false,
            keep,
            committed: false,
            kept: start.kept,
            cap,
            lease,
            attempt: 0,
            waker: None,
            check,
        };
        StreamReplay {
            state: Arc::new(Mutex::new(state)),
        }
    }

    /// The body of a new attempt: what is kept, then the rest as the caller produces it.
    pub(crate) fn body(&self) -> StreamBody {
        let mut s = lock(&self.state);
        s.next_attempt();
        StreamBody {
            state: self.state.clone(),
            attempt: s.attempt,
        }
    }

    /// The current attempt failed: its body stops reading (the transport resets it).
    pub(crate) fn retire(&self) {
        lock(&self.state).next_attempt();
    }

    /// Response headers came: the call is committed to the current attempt, which goes
    /// on when the call loop is done.
    pub(crate) fn commit(&self) {
        let mut s = lock(&self.state);
        s.committed = true;
        if matches!(s.keep, Keep::Recording) {
            s.stop_keeping(Keep::Committed);
        }
    }

    /// Why the request cannot be sent again, if it cannot: it passed a replay limit, or
    /// the caller's body failed.
    pub(crate) fn overflow(&self) -> Option<Overflow> {
        match lock(&self.state).keep {
            Keep::Overflowed(why) => Some(why),
            Keep::Recording | Keep::Committed => None,
        }
    }

    /// Whether a new attempt would send the whole request so far: true while recording,
    /// and after an overflow as long as nothing was sent (an attempt whose channel never
    /// connected).
    pub(crate) fn can_resend(&self) -> bool {
        let s = lock(&self.state);
        matches!(s.keep, Keep::Recording) || !s.drained
    }
}

impl Drop for StreamReplay {
    fn drop(&mut self) {
        let mut s = lock(&self.state);
        if s.committed {
            return;
        }
        // The call ended without committing (a final error, or the caller went away).
        s.next_attempt();
        s.source = None;
        s.ended = true;
        s.chunks.clear();
        s.stop_keeping(Keep::Committed);
    }
}

impl State {
    fn next_attempt(&mut self) {
        self.attempt = self.attempt.wrapping_add(1);
        self.sent = 0;
        self.trailers_sent = false;
        if let Some(w) = self.waker.take() {
            w.wake();
        }
    }

    /// Stops keeping chunks: those the current attempt has sent are freed, with their
    /// bytes in the budget.
    fn stop_keeping(&mut self, why: Keep) {
        self.keep = why;
        let sent = self.sent.min(self.chunks.len());
        self.drained |= sent > 0;
        self.chunks.drain(..sent);
        self.sent = 0;
        self.kept = 0;
        self.lease.release_all();
    }

    /// Keeps `chunk`, just read and sent, if the limits allow; else stops keeping.
    fn keep(&mut self, chunk: &Bytes) {
        if !matches!(self.keep, Keep::Recording) {
            self.drained = true;
            return;
        }
        let len = chunk.len();
        let why = if self.kept.saturating_add(len) > self.cap {
            Overflow::PerCall
        } else if !self.lease.reserve(len) {
            Overflow::Budget
        } else {
            self.kept += len;
            self.chunks.push_back(chunk.clone());
            self.sent += 1;
            return;
        };
        self.drained = true;
        self.stop_keeping(Keep::Overflowed(why));
    }

    /// The next chunk kept or read but not yet sent by the current attempt.
    fn unsent(&mut self) -> Option<Bytes> {
        if self.sent >= self.chunks.len() {
            return None;
        }
        if matches!(self.keep, Keep::Recording) {
            self.sent += 1;
            return self.chunks.get(self.sent - 1).cloned();
        }
        self.drained = true;
        self.chunks.pop_front()
    }

    /// The caller's stream failed, or a message broke a limit: the call fails, and
    /// nothing of it may be sent again.
    fn fail(&mut self) {
        self.source = None;
        self.ended = true;
        if matches!(self.keep, Keep::Recording) {
            self.stop_keeping(Keep::Overflowed(Overflow::Error));
        }
        self.drained = true;
    }

    /// Reads the caller's body for the current attempt.
    fn poll_source(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let Some(source) = self.source.as_mut() else {
            return Poll::Ready(None);
        };
        let frame = match Pin::new(source).poll_frame(cx) {
            Poll::Pending => {
                self.waker = Some(cx.waker().clone());
                return Poll::Pending;
            }
            Poll::Ready(None) => {
                self.source = None;
                self.ended = true;
                self.trailers_sent = true;
                return Poll::Ready(None);
            }
            Poll::Ready(Some(Err(e))) => {
                self.fail();
                return Poll::Ready(Some(Err(e.into())));
            }
            Poll::Ready(Some(Ok(frame))) => frame,
        };
        match frame.into_data() {
            Ok(chunk) => {
                if let Some(Err(e)) = self.check.as_mut().map(|c| c.check(&chunk)) {
                    self.fail();
                    return Poll::Ready(Some(Err(e.into())));
                }
                self.keep(&chunk);
                Poll::Ready(Some(Ok(Frame::data(chunk))))
            }
            Err(frame) => {
                if let Some(t) = frame.trailers_ref() {
                    self.trailers
                        .get_or_insert_with(HeaderMap::new)
                        .extend(t.clone());
                    self.trailers_sent = true;
                }
                Poll::Ready(Some(Ok(frame)))
            }
        }
    }
}

impl Body for StreamBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let mut s = lock(&self.state);
        if s.attempt != self.attempt {
            return Poll::Ready(Some(Err(Superseded.into())));
        }
        if let Some(chunk) = s.unsent() {
            return Poll::Ready(Some(Ok(Frame::data(chunk))));
        }
        if let Some(e) = s.error.take() {
            s.drained = true;
            return Poll::Ready(Some(Err(e)));
        }
        if s.ended {
            if !s.trailers_sent {
                s.trailers_sent = true;
                if let Some(t) = s.trailers.clone() {
                    return Poll::Ready(Some(Ok(Frame::trailers(t))));
                }
            }
            return Poll::Ready(None);
        }
        s.poll_source(cx)
    }

    fn is_end_stream(&self) -> bool {
        let s = lock(&self.state);
        s.attempt == self.attempt
            && s.ended
            && s.sent >= s.chunks.len()
            && s.error.is_none()
            && (s.trailers_sent || s.trailers.is_none())
    }

    // No `size_hint`: unknown, so hyper adds no `content-length` (see `ReplayBody`).
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::retry::request::body::fixtures::{Call, Feed, counter, ok, started};
    use crate::retry::request::body::{Read, ReplayBudget, read_ready};
    use http_body_util::BodyExt;
    use std::sync::atomic::Ordering;
    use tokio::sync::mpsc;

    fn call(cap: usize, total: usize) -> Call<StreamReplay> {
        started(cap, total)
            .call(|start, source, lease| StreamReplay::new(start, source, lease, cap, None))
    }

    async fn next(body: &mut StreamBody) -> Option<Result<String, String>> {
        let frame = body.frame().await?;
        Some(match frame {
            Ok(f) => Ok(String::from_utf8(f.into_data().unwrap().to_vec()).unwrap()),
            Err(e) => Err(e.to_string()),
        })
    }

    const SUPERSEDED: &str = "request stream taken over by a newer attempt";

    #[tokio::test]
    async fn a_retry_replays_what_was_sent_then_goes_on_live() {
        let mut c = call(100, 100);
        let mut first = c.stream.body();
        c.send("a");
        assert_eq!(next(&mut first).await, ok("a"));
        c.send("bc");
        assert_eq!(next(&mut first).await, ok("bc"));
        assert_eq!(c.budget.held(), 3);
        c.stream.retire();
        assert_eq!(next(&mut first).await, Some(Err(SUPERSEDED.into())));
        let mut second = c.stream.body();
        assert_eq!(next(&mut second).await, ok("a"));
        assert_eq!(next(&mut second).await, ok("bc"));
        c.send("d");
        assert_eq!(next(&mut second).await, ok("d"));
        c.tx = None;
        assert_eq!(next(&mut second).await, None);
        assert!(second.is_end_stream());
        // A third attempt sends the whole request, which has ended.
        let third = c.stream.body();
        assert_eq!(&third.collect().await.unwrap().to_bytes()[..], b"abcd");
        assert_eq!(c.budget.held(), 4);
        drop(c.stream);
        assert_eq!(
            c.budget.held(),
            0,
            "an uncommitted call frees its copy when it ends"
        );
    }

    #[tokio::test]
    async fn a_commit_frees_the_copy_and_the_attempt_goes_on() {
        let mut c = call(100, 100);
        let mut first = c.stream.body();
        c.send("a");
        c.send("b");
        assert_eq!(next(&mut first).await, ok("a"));
        c.stream.retire();
        // The retry has sent "a" of "a", "b" when its response headers come.
        let mut second = c.stream.body();
        assert_eq!(next(&mut second).await, ok("a"));
        c.stream.commit();
        assert_eq!(c.budget.held(), 0);
        assert_eq!(c.stream.overflow(), None);
        assert_eq!(next(&mut second).await, ok("b"));
        c.send("c");
        assert_eq!(next(&mut second).await, ok("c"));
        assert_eq!(c.budget.held(), 0, "nothing is kept after the commit");
        let tx = c.tx.take().unwrap();
        drop(c);
        tx.send(Ok(Bytes::from_static(b"d"))).unwrap();
        assert_eq!(
            next(&mut second).await,
            ok("d"),
            "the committed attempt outlives the call loop"
        );
        drop(tx);
        assert_eq!(next(&mut second).await, None);
    }

    #[tokio::test]
    async fn past_a_limit_the_call_commits_and_the_attempt_goes_on() {
        for (cap, total, why) in [(3, 100, Overflow::PerCall), (100, 3, Overflow::Budget)] {
            let c = call(cap, total);
            let mut first = c.stream.body();
            c.send("ab");
            c.send("cd");
            c.send("ef");
            assert_eq!(next(&mut first).await, ok("ab"));
            assert_eq!(c.budget.held(), 2);
            assert_eq!(next(&mut first).await, ok("cd"));
            assert_eq!(c.stream.overflow(), Some(why));
            assert!(!c.stream.can_resend());
            assert_eq!(c.budget.held(), 0);
            assert_eq!(next(&mut first).await, ok("ef"));
            assert_eq!(c.budget.held(), 0);
            // Its response headers come, and the call loop ends: the attempt goes on.
            c.stream.commit();
            drop(c.stream);
            c.tx.as_ref()
                .unwrap()
                .send(Ok(Bytes::from_static(b"gh")))
                .unwrap();
            assert_eq!(next(&mut first).await, ok("gh"));
        }
    }

    #[test]
    fn a_stale_body_waiting_on_the_caller_is_woken_and_fails() {
        let c = call(100, 100);
        let (count, waker) = counter();
        let mut cx = Context::from_waker(&waker);
        let mut first = c.stream.body();
        assert!(Pin::new(&mut first).poll_frame(&mut cx).is_pending());
        let _second = c.stream.body();
        assert_eq!(
            count.0.load(Ordering::SeqCst),
            1,
            "woken, so the transport resets it"
        );
        let Poll::Ready(Some(Err(e))) = Pin::new(&mut first).poll_frame(&mut cx) else {
            panic!("a superseded body fails");
        };
        assert_eq!(e.to_string(), SUPERSEDED);
    }

    #[tokio::test]
    async fn an_attempt_never_sent_can_be_sent_again_even_over_the_limit() {
        // Over the limit before the first attempt: nothing kept, but nothing sent either.
        let (tx, rx) = mpsc::unbounded_channel();
        tx.send(Ok(Bytes::from_static(b"abcdef"))).unwrap();
        let budget = Arc::new(ReplayBudget::new(100));
        let mut lease = Lease::new(budget.clone());
        let mut source = tonic::body::Body::new(Feed(rx));
        let mut cx = Context::from_waker(Waker::noop());
        let Read::Partial(start) = read_ready(&mut source, 3, &mut lease, None, &mut cx) else {
            panic!("over the limit");
        };
        let replay = StreamReplay::new(start, source, lease, 3, None);
        let _never_polled = replay.body();
        assert!(replay.can_resend());
        let mut again = replay.body();
        assert_eq!(next(&mut again).await, ok("abcdef"));
        assert!(!replay.can_resend());
        drop(tx);
        assert_eq!(next(&mut again).await, None);
    }
}
