//! The copy of a request that streams (client-streaming and bidi calls, or any body the
//! caller is still producing when the first attempt starts), read once from the caller
//! and handed to every attempt: the retries of a retried call, one after the other, and
//! the hedges of a hedged call, side by side. A retry is slot 0 sent again; a hedge is
//! its own slot.
//!
//! Each slot's body ([`SlotBody`]) sends the messages read so far, then follows the live
//! stream: whichever body is furthest along reads the next message from the caller, keeps
//! a copy and wakes the others, so a body that starts later (or is sent on a slower path)
//! sends the same bytes, in the same frames. As gRFC A6 says, the call commits
//! - when response headers arrive: the attempt or hedge gets the request
//!   ([`StreamCopy::commit`]); the bodies of other slots fail;
//! - when the copy would pass `maxReplayBytesPerCall` or what is left of the layer's
//!   `maxReplayBytesTotal` ([`BudgetLease::keep`]): to the slot that read the message that
//!   did not fit, one of those that sent the most messages (A6: "the currently in-flight
//!   attempt on which the maximum number of messages have already been sent"). A hedge
//!   race learns it from [`StreamCopy::poll_overflow`], cancels the other hedges and
//!   sends no more; a retried call from [`StreamCopy::overflow`].
//!
//! Once committed nothing more is kept: the messages the committed slot has sent are
//! freed and their bytes go back to the budget; those it has not sent yet stay counted in
//! the budget (as unsent, not as replay) until it sends them. The committed attempt goes
//! on after the call loop has answered the caller.
//!
//! A slot that is retired ([`StreamCopy::retire`]: the attempt failed, the hedge was
//! cancelled) or whose body is replaced by a new one has its old body fail on its next
//! poll (a task waiting on the caller is woken), so the transport resets its stream
//! instead of ending it as if the request were complete. When the caller's body fails
//! (or a message is over `maxRequestMessageBytes`), every body fails after the messages
//! before it, and the request cannot be sent again.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll, Wake, Waker};

use bytes::Bytes;
use http::HeaderMap;
use http_body::{Body, Frame};

use crate::BoxError;
use crate::retry::request::budget::{BudgetLease, Overflow};
use crate::retry::request::check::RequestCheck;
use crate::retry::request::read::Partial;

/// The call loop's handle on a streaming request. Dropping it ends the request unless
/// the call committed to a slot whose body is still out: the caller's body is dropped,
/// the copy is freed, and the bodies still held by the transport fail.
pub(crate) struct StreamCopy {
    fanout: Arc<Mutex<Fanout>>,
    wakers: Arc<Wakers>,
}

/// One slot's request body.
pub(crate) struct SlotBody {
    fanout: Arc<Mutex<Fanout>>,
    wakers: Arc<Wakers>,
    /// This body's reader (a slot sent again gets a new one).
    id: u64,
}

/// The error a body fails with once its slot no longer has the request.
#[derive(Debug, Clone, Copy, thiserror::Error)]
pub(crate) enum Retired {
    /// A retried call: a newer attempt took the request over, or the call ended.
    #[error("request stream taken over by a newer attempt")]
    Retry,
    /// A hedged call: the hedge was cancelled, the request went to another hedge, or the
    /// call ended.
    #[error("hedge cancelled: the request went to another hedge or the call ended")]
    Hedge,
}

/// The error the other slots' bodies fail with when the caller's body failed.
#[derive(Debug, thiserror::Error)]
#[error("the request stream failed: {0}")]
pub(crate) struct SourceFailed(Arc<str>);

/// Why the request commits to one slot.
#[derive(Debug, Clone, Copy)]
struct Commit {
    slot: u32,
    /// `None`: response headers came; else the limit it passed.
    overflow: Option<Overflow>,
}

/// Where one body is in the request.
#[derive(Debug)]
struct Reader {
    id: u64,
    slot: u32,
    /// How many messages of the request it has sent.
    pos: usize,
    trailers_sent: bool,
    /// It got the caller's error: nothing more.
    done: bool,
}

/// The request as read from the caller, shared by the call loop and every body.
struct Fanout {
    /// The caller's body, until it ends, fails, or the call is abandoned.
    source: Option<tonic::body::Body>,
    /// Polls the caller's body: wakes every body waiting for its next message.
    source_waker: Waker,
    ended: bool,
    trailers: Option<HeaderMap>,
    /// The caller's body failed before the first attempt: the first body to reach the
    /// end of what was read gets this.
    error: Option<BoxError>,
    /// The caller's body failed (or a message was over its limit), as text for the
    /// bodies that did not read the error themselves.
    failed: Option<Arc<str>>,
    /// Messages kept: every one read while uncommitted; afterwards, those the committed
    /// slot has not sent yet.
    chunks: VecDeque<Bytes>,
    /// Messages read from the caller in all: `chunks` are the last of them.
    read: usize,
    readers: Vec<Reader>,
    next_id: u64,
    commit: Option<Commit>,
    /// An overflow commit not yet seen by the race.
    announce: bool,
    /// The race's task, woken by an overflow commit.
    race: Option<Waker>,
    kept: usize,
    cap: usize,
    lease: BudgetLease,
    check: Option<RequestCheck>,
    /// What a stale body fails with.
    retired: Retired,
}

fn lock(fanout: &Mutex<Fanout>) -> MutexGuard<'_, Fanout> {
    fanout.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The tasks of the bodies waiting for the caller's next message, by reader. The caller's
/// body is polled with a waker that wakes them all, so the next message reaches every
/// body whichever of them polled last, and a body that goes away strands no one.
#[derive(Default)]
struct Wakers(Mutex<Vec<(u64, Waker)>>);

impl Wakers {
    fn list(&self) -> MutexGuard<'_, Vec<(u64, Waker)>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
    fn register(&self, id: u64, waker: &Waker) {
        let mut list = self.list();
        match list.iter_mut().find(|(i, _)| *i == id) {
            Some((_, w)) => w.clone_from(waker),
            None => list.push((id, waker.clone())),
        }
    }
    /// Wakes the readers other than `except` (every one with `None`).
    fn wake_all_but(&self, except: Option<u64>) {
        let woken: Vec<Waker> = {
            let mut list = self.list();
            let mut woken = Vec::with_capacity(list.len());
            list.retain(|(i, w)| {
                if Some(*i) == except {
                    return true;
                }
                woken.push(w.clone());
                false
            });
            woken
        };
        woken.into_iter().for_each(Waker::wake);
    }
    /// Wakes (and forgets) reader `id`.
    fn wake_one(&self, id: u64) {
        let waker = {
            let mut list = self.list();
            let i = list.iter().position(|(r, _)| *r == id);
            i.map(|i| list.swap_remove(i).1)
        };
        if let Some(w) = waker {
            w.wake();
        }
    }
}

impl Wake for Wakers {
    fn wake(self: Arc<Self>) {
        self.wake_all_but(None);
    }
    fn wake_by_ref(self: &Arc<Self>) {
        self.wake_all_but(None);
    }
}

impl StreamCopy {
    /// Goes on from what [`read_ready`](crate::retry::request::read::read_ready) read of
    /// `source`; `lease` holds the bytes of `start.read` that are kept. A start that
    /// passed a limit (or failed) is committed to slot 0 already: it can be sent once.
    /// `hedged` says which [`Retired`] error stale bodies fail with.
    pub(crate) fn new(
        start: Partial,
        source: tonic::body::Body,
        lease: BudgetLease,
        cap: usize,
        check: Option<RequestCheck>,
        hedged: bool,
    ) -> Self {
        let wakers = Arc::new(Wakers::default());
        let failed = start.error.as_ref().map(|e| Arc::from(e.to_string()));
        let fanout = Fanout {
            ended: start.error.is_some(),
            source: start.error.is_none().then_some(source),
            source_waker: Waker::from(wakers.clone()),
            trailers: start.trailers,
            error: start.error,
            failed,
            read: start.read.len(),
            chunks: start.read,
            readers: Vec::new(),
            next_id: 0,
            commit: start.overflow.map(|why| Commit {
                slot: 0,
                overflow: Some(why),
            }),
            announce: false,
            race: None,
            kept: start.kept,
            cap,
            lease,
            check,
            retired: if hedged {
                Retired::Hedge
            } else {
                Retired::Retry
            },
        };
        StreamCopy {
            fanout: Arc::new(Mutex::new(fanout)),
            wakers,
        }
    }

    /// The body of `slot`, new or sent again (its earlier body fails): the whole request
    /// so far, then the live stream. Once the request committed to another slot, or
    /// freed what it sent, it fails at once.
    pub(crate) fn body(&self, slot: u32) -> SlotBody {
        let mut s = lock(&self.fanout);
        let id = s.next_id;
        s.next_id += 1;
        let stale: Vec<u64> = s.take_readers(|r| r.slot == slot);
        if s.may_send_whole(slot) {
            s.readers.push(Reader {
                id,
                slot,
                pos: 0,
                trailers_sent: false,
                done: false,
            });
        }
        drop(s);
        stale.into_iter().for_each(|id| self.wakers.wake_one(id));
        SlotBody {
            fanout: self.fanout.clone(),
            wakers: self.wakers.clone(),
            id,
        }
    }

    /// `slot`'s attempt ended (or is cancelled): its body stops reading.
    pub(crate) fn retire(&self, slot: u32) {
        let stale = lock(&self.fanout).take_readers(|r| r.slot == slot);
        stale.into_iter().for_each(|id| self.wakers.wake_one(id));
    }

    /// `slot`'s response headers came: the request is its own from now on, and goes on
    /// after the call loop.
    pub(crate) fn commit(&self, slot: u32) {
        let mut s = lock(&self.fanout);
        if s.commit.is_none() {
            s.commit_to(slot, None, &self.wakers);
        }
    }

    /// The slot the request committed to because it passed a replay limit, once.
    pub(crate) fn poll_overflow(&self, cx: &mut Context<'_>) -> Poll<u32> {
        let mut s = lock(&self.fanout);
        match s.commit {
            Some(c) if s.announce => {
                s.announce = false;
                Poll::Ready(c.slot)
            }
            _ => {
                s.race = Some(cx.waker().clone());
                Poll::Pending
            }
        }
    }

    /// Why the request cannot be sent again, if it cannot: it passed a replay limit, or
    /// the caller's body failed.
    pub(crate) fn overflow(&self) -> Option<Overflow> {
        let s = lock(&self.fanout);
        let failed = s.failed.as_ref().map(|_| Overflow::Error);
        s.commit.and_then(|c| c.overflow).or(failed)
    }

    /// Whether a new body would send the whole request so far: while uncommitted, and
    /// after an overflow as long as nothing was freed (an attempt whose channel never
    /// connected).
    pub(crate) fn can_resend(&self) -> bool {
        let s = lock(&self.fanout);
        // A failure read before the first attempt is still to be sent.
        let whole = s.failed.is_none() || s.error.is_some();
        whole && s.commit.is_none_or(|c| s.may_send_whole(c.slot))
    }
}

impl Drop for StreamCopy {
    fn drop(&mut self) {
        let mut s = lock(&self.fanout);
        if let Some(c) = s.commit
            && s.readers.iter().any(|r| r.slot == c.slot)
        {
            // The committed attempt goes on with the request.
            return;
        }
        // The call ended without an attempt to go on: every body fails.
        s.readers.clear();
        s.source = None;
        s.ended = true;
        s.chunks.clear();
        s.kept = 0;
        s.lease.release_all();
        drop(s);
        self.wakers.wake_all_but(None);
    }
}

impl Fanout {
    fn position(&self, id: u64) -> Option<usize> {
        self.readers.iter().position(|r| r.id == id)
    }

    /// Whether a new body for `slot` can send the whole request: while uncommitted, and
    /// for the committed slot while nothing it sent was freed.
    fn may_send_whole(&self, slot: u32) -> bool {
        match self.commit {
            None => true,
            Some(c) => c.slot == slot && self.read == self.chunks.len(),
        }
    }

    /// Removes the readers `f` picks; their ids, to wake them.
    fn take_readers(&mut self, f: impl Fn(&Reader) -> bool) -> Vec<u64> {
        let mut taken = Vec::new();
        self.readers.retain(|r| {
            if f(r) {
                taken.push(r.id);
                return false;
            }
            true
        });
        taken
    }

    /// The request is `slot`'s: the messages it has sent are freed, nothing more is
    /// kept, and the other slots' bodies fail.
    fn commit_to(&mut self, slot: u32, overflow: Option<Overflow>, wakers: &Wakers) {
        self.commit = Some(Commit { slot, overflow });
        let sent = self
            .readers
            .iter()
            .find(|r| r.slot == slot)
            .map_or(self.read, |r| r.pos);
        let base = self.read - self.chunks.len();
        let freed = sent.saturating_sub(base).min(self.chunks.len());
        self.chunks.drain(..freed);
        // What the slot has not sent yet stays counted until it sends it: request bytes
        // held after the commit stay within `maxReplayBytesTotal` too.
        self.kept = self.chunks.iter().map(Bytes::len).sum();
        self.lease.commit(self.kept);
        let others = self.take_readers(|r| r.slot != slot);
        others.into_iter().for_each(|id| wakers.wake_one(id));
    }

    /// The next message kept that reader `i` has not sent.
    fn unsent(&mut self, i: usize) -> Option<Bytes> {
        let pos = self.readers[i].pos;
        if pos >= self.read {
            return None;
        }
        let base = self.read - self.chunks.len();
        let chunk = if self.commit.is_some() {
            // Only the committed slot reads: what it has sent is freed.
            let chunk = self.chunks.pop_front();
            if let Some(c) = &chunk {
                self.kept = self.kept.saturating_sub(c.len());
                self.lease.sent(c.len());
            }
            chunk
        } else {
            self.chunks.get(pos.checked_sub(base)?).cloned()
        };
        self.readers[i].pos += 1;
        chunk
    }

    /// Reads the caller's body for reader `i`, at the front of the request.
    fn poll_source(
        &mut self,
        i: usize,
        wakers: &Wakers,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let id = self.readers[i].id;
        let Some(source) = self.source.as_mut() else {
            return Poll::Ready(None);
        };
        let waker = self.source_waker.clone();
        let frame = match Pin::new(source).poll_frame(&mut Context::from_waker(&waker)) {
            Poll::Pending => return Poll::Pending,
            Poll::Ready(None) => {
                self.source = None;
                self.ended = true;
                wakers.wake_all_but(Some(id));
                return Poll::Ready(self.end(i));
            }
            Poll::Ready(Some(Err(e))) => {
                return Poll::Ready(Some(Err(self.fail(i, e.into(), wakers))));
            }
            Poll::Ready(Some(Ok(frame))) => frame,
        };
        match frame.into_data() {
            Ok(chunk) => {
                if let Some(Err(e)) = self.check.as_mut().map(|c| c.check(&chunk)) {
                    // The call fails: nothing of it may be sent again.
                    return Poll::Ready(Some(Err(self.fail(i, e.into(), wakers))));
                }
                self.keep(id, &chunk, wakers);
                Poll::Ready(Some(Ok(Frame::data(chunk))))
            }
            Err(frame) => {
                if let Some(t) = frame.trailers_ref() {
                    self.trailers
                        .get_or_insert_with(HeaderMap::new)
                        .extend(t.clone());
                    self.readers[i].trailers_sent = true;
                }
                Poll::Ready(Some(Ok(frame)))
            }
        }
    }

    /// The end of the request for reader `i`: its trailers, if the caller sent some and
    /// it has not, then the end.
    fn end(&mut self, i: usize) -> Option<Result<Frame<Bytes>, BoxError>> {
        let r = &mut self.readers[i];
        if std::mem::replace(&mut r.trailers_sent, true) {
            return None;
        }
        self.trailers.clone().map(|t| Ok(Frame::trailers(t)))
    }

    /// The message reader `id` just read: kept for the other slots while A6's limits
    /// allow, else the request commits to this slot, the one furthest along.
    fn keep(&mut self, id: u64, chunk: &Bytes, wakers: &Wakers) {
        let Some(slot) = self.readers.iter().find(|r| r.id == id).map(|r| r.slot) else {
            return;
        };
        if self.commit.is_none() {
            match self.lease.keep(self.kept, chunk.len(), self.cap) {
                Ok(()) => {
                    self.kept += chunk.len();
                    self.chunks.push_back(chunk.clone());
                    wakers.wake_all_but(Some(id));
                }
                Err(why) => {
                    self.commit_to(slot, Some(why), wakers);
                    self.announce = true;
                    if let Some(w) = self.race.take() {
                        w.wake();
                    }
                }
            }
        }
        self.read += 1;
        if let Some(r) = self.readers.iter_mut().find(|r| r.id == id) {
            r.pos = self.read;
        }
    }

    /// The caller's body failed (or a message was over its limit) under reader `i`: it
    /// gets the error, every other body gets it as text after the messages before it.
    fn fail(&mut self, i: usize, e: BoxError, wakers: &Wakers) -> BoxError {
        // The caller's body is a tonic body: its errors are statuses.
        let message = match e.downcast_ref::<tonic::Status>() {
            Some(status) => status.message().to_owned(),
            None => e.to_string(),
        };
        self.failed = Some(Arc::from(message));
        self.source = None;
        self.ended = true;
        self.readers[i].done = true;
        if self.commit.is_none() {
            self.kept = 0;
            self.lease.release_all();
        }
        wakers.wake_all_but(Some(self.readers[i].id));
        e
    }
}

impl Body for SlotBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let mut s = lock(&self.fanout);
        let Some(i) = s.position(self.id) else {
            return Poll::Ready(Some(Err(s.retired.into())));
        };
        if let Some(chunk) = s.unsent(i) {
            return Poll::Ready(Some(Ok(Frame::data(chunk))));
        }
        if s.readers[i].done {
            return Poll::Ready(None);
        }
        if let Some(e) = s.error.take() {
            s.readers[i].done = true;
            return Poll::Ready(Some(Err(e)));
        }
        if let Some(message) = s.failed.clone() {
            s.readers[i].done = true;
            return Poll::Ready(Some(Err(SourceFailed(message).into())));
        }
        if s.ended {
            return Poll::Ready(s.end(i));
        }
        // At the front: register before polling, so a message that comes in between
        // wakes this body too.
        self.wakers.register(self.id, cx.waker());
        s.poll_source(i, &self.wakers)
    }

    fn is_end_stream(&self) -> bool {
        let s = lock(&self.fanout);
        s.readers.iter().find(|r| r.id == self.id).is_some_and(|r| {
            s.ended
                && s.failed.is_none()
                && r.pos >= s.read
                && (r.trailers_sent || s.trailers.is_none())
        })
    }

    // No `size_hint`: unknown, so hyper adds no `content-length` (see `WholeBody`).
}

impl Drop for SlotBody {
    fn drop(&mut self) {
        // Forget this body's task; its reader stays until the call loop retires the slot.
        let mut list = self.wakers.list();
        list.retain(|(id, _)| *id != self.id);
    }
}

#[cfg(test)]
mod retry_tests {
    use super::*;
    use crate::retry::request::budget::ReplayBudget;
    use crate::retry::request::fixtures::{StreamedCall, counter, feed, ok, started, started_on};
    use crate::retry::request::read::{Ready, read_ready};
    use http_body_util::BodyExt;
    use std::sync::atomic::Ordering;
    use tokio::sync::mpsc;

    /// A retried call's view of the copy: every attempt is slot 0.
    struct Retried(StreamCopy);

    impl Retried {
        fn body(&self) -> SlotBody {
            self.0.body(0)
        }
        fn retire(&self) {
            self.0.retire(0);
        }
        fn commit(&self) {
            self.0.commit(0);
        }
        fn overflow(&self) -> Option<Overflow> {
            self.0.overflow()
        }
        fn can_resend(&self) -> bool {
            self.0.can_resend()
        }
    }

    fn call(cap: usize, total: usize) -> StreamedCall<Retried> {
        started(cap, total).call(|start, source, lease| {
            Retried(StreamCopy::new(start, source, lease, cap, None, false))
        })
    }

    async fn next(body: &mut SlotBody) -> Option<Result<String, String>> {
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

    /// Issue 30, item 9: the messages read before the commit that the committed attempt
    /// has not sent (its server reads nothing more) stay counted in
    /// `maxReplayBytesTotal` until it sends them; the budget reported 0 while they were
    /// held, so other calls could hold that much again.
    #[tokio::test]
    async fn what_a_committed_attempt_has_not_sent_stays_in_the_budget() {
        let a = call(100, 10);
        let mut first = a.stream.body();
        a.send("abc");
        a.send("def");
        assert_eq!(next(&mut first).await, ok("abc"));
        assert_eq!(next(&mut first).await, ok("def"));
        a.stream.retire();
        let mut second = a.stream.body();
        assert_eq!(next(&mut second).await, ok("abc"));
        // Response headers come with "def" not sent yet.
        a.stream.commit();
        assert_eq!(a.budget.held(), 0, "nothing is kept for replay");
        assert_eq!(a.budget.unsent(), 3);
        // Another call of the layer has 10 - 3 bytes left.
        let retried =
            |start, source, lease| Retried(StreamCopy::new(start, source, lease, 100, None, false));
        let b = started_on(100, Arc::clone(&a.budget)).call(retried);
        let mut other = b.stream.body();
        b.send("1234567");
        b.send("8");
        assert_eq!(next(&mut other).await, ok("1234567"));
        assert_eq!(b.stream.overflow(), None);
        assert_eq!(next(&mut other).await, ok("8"));
        assert_eq!(
            b.stream.overflow(),
            Some(Overflow::Budget),
            "3 + 7 + 1 > 10"
        );
        drop((other, b));
        // Once the committed attempt sends "def", its bytes come back.
        assert_eq!(next(&mut second).await, ok("def"));
        assert_eq!((a.budget.held(), a.budget.unsent()), (0, 0));
        let c = started_on(100, Arc::clone(&a.budget)).call(retried);
        let mut third = c.stream.body();
        c.send("1234567890");
        assert_eq!(next(&mut third).await, ok("1234567890"));
        assert_eq!(c.stream.overflow(), None);
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
        let mut lease = BudgetLease::new(budget.clone());
        let mut source = feed(rx);
        let mut cx = Context::from_waker(Waker::noop());
        let Ready::Partial(start) = read_ready(&mut source, 3, &mut lease, None, &mut cx) else {
            panic!("over the limit");
        };
        let replay = Retried(StreamCopy::new(start, source, lease, 3, None, false));
        let _never_polled = replay.body();
        assert!(replay.can_resend());
        let mut again = replay.body();
        assert_eq!(next(&mut again).await, ok("abcdef"));
        assert!(!replay.can_resend());
        drop(tx);
        assert_eq!(next(&mut again).await, None);
    }
}

#[cfg(test)]
mod hedge_tests {
    use super::*;
    use crate::retry::CallOutcome;
    use crate::retry::request::RequestCopy;
    use crate::retry::request::fixtures::{StreamedCall, counter, ok, started};
    use http_body_util::BodyExt;
    use std::sync::atomic::Ordering;

    impl StreamedCall<RequestCopy> {
        fn body(&self, hedge: u32) -> tonic::body::Body {
            self.stream.body(hedge)
        }
    }

    /// A hedged call whose caller has produced nothing yet; `cap` per call, `total` in
    /// the layer's budget.
    fn call(cap: usize, total: usize) -> StreamedCall<RequestCopy> {
        started(cap, total).call(|start, source, lease| {
            RequestCopy::Stream(StreamCopy::new(start, source, lease, cap, None, true))
        })
    }

    async fn next(body: &mut tonic::body::Body) -> Option<Result<String, String>> {
        let frame = body.frame().await?;
        Some(match frame {
            Ok(f) => Ok(String::from_utf8(f.into_data().unwrap().to_vec()).unwrap()),
            Err(e) => Err(e.message().to_owned()),
        })
    }

    const RETIRED: &str = "hedge cancelled: the request went to another hedge or the call ended";

    fn poll_once(
        body: &mut tonic::body::Body,
        waker: &Waker,
    ) -> Poll<Option<Result<Frame<Bytes>, tonic::Status>>> {
        Pin::new(body).poll_frame(&mut Context::from_waker(waker))
    }

    #[tokio::test]
    async fn a_later_hedge_sends_what_was_read_then_follows_the_live_stream() {
        let mut c = call(100, 100);
        let mut first = c.body(0);
        c.send("a");
        c.send("bc");
        assert_eq!(next(&mut first).await, ok("a"));
        assert_eq!(next(&mut first).await, ok("bc"));
        assert_eq!(c.budget.held(), 3);
        // Hedge 1 starts: the messages so far, then what the caller sends next; hedge 0
        // gets the next message too, whichever of them read it from the caller.
        let mut second = c.body(1);
        assert_eq!(next(&mut second).await, ok("a"));
        assert_eq!(next(&mut second).await, ok("bc"));
        c.send("d");
        assert_eq!(next(&mut second).await, ok("d"));
        assert_eq!(next(&mut first).await, ok("d"));
        c.tx = None;
        assert_eq!(next(&mut first).await, None);
        assert!(first.is_end_stream());
        assert_eq!(next(&mut second).await, None);
        // A third hedge after the end sends the whole request.
        let third = c.body(2);
        assert_eq!(&third.collect().await.unwrap().to_bytes()[..], b"abcd");
        assert_eq!(c.budget.held(), 4);
        assert_eq!(c.stream.sent_once(), None);
        drop(c.stream);
        assert_eq!(
            c.budget.held(),
            0,
            "an uncommitted call frees its copy when it ends"
        );
    }

    #[test]
    fn every_hedge_waiting_on_the_caller_is_woken_by_its_next_message() {
        let c = call(100, 100);
        let (count0, waker0) = counter();
        let (count1, waker1) = counter();
        let mut first = c.body(0);
        let mut second = c.body(1);
        assert!(poll_once(&mut first, &waker0).is_pending());
        assert!(poll_once(&mut second, &waker1).is_pending());
        // The caller's body remembers only the last waker it was polled with; both wake.
        c.send("x");
        assert_eq!(count0.0.load(Ordering::SeqCst), 1);
        assert_eq!(count1.0.load(Ordering::SeqCst), 1);
        let Poll::Ready(Some(Ok(f))) = poll_once(&mut second, &waker1) else {
            panic!("hedge 1 reads the message");
        };
        assert_eq!(f.into_data().unwrap(), "x");
        let Poll::Ready(Some(Ok(f))) = poll_once(&mut first, &waker0) else {
            panic!("hedge 0 gets the copy");
        };
        assert_eq!(f.into_data().unwrap(), "x");
        // A hedge whose body went away strands no one.
        assert!(poll_once(&mut first, &waker0).is_pending());
        assert!(poll_once(&mut second, &waker1).is_pending());
        drop(second);
        c.send("y");
        assert_eq!(count0.0.load(Ordering::SeqCst), 2);
        let Poll::Ready(Some(Ok(f))) = poll_once(&mut first, &waker0) else {
            panic!("hedge 0 reads on");
        };
        assert_eq!(f.into_data().unwrap(), "y");
    }

    #[tokio::test]
    async fn past_a_limit_the_request_commits_to_the_hedge_furthest_along() {
        for (cap, total, why) in [
            (3, 100, CallOutcome::BodyTooLarge),
            (100, 3, CallOutcome::ReplayBudgetExhausted),
        ] {
            let c = call(cap, total);
            let mut first = c.body(0);
            let mut second = c.body(1);
            c.send("ab");
            assert_eq!(next(&mut second).await, ok("ab"));
            assert_eq!(c.budget.held(), 2);
            let mut cx = Context::from_waker(Waker::noop());
            assert!(c.stream.poll_overflow(&mut cx).is_pending());
            // Hedge 1 reads the message that does not fit: the request is its own.
            c.send("cd");
            assert_eq!(next(&mut second).await, ok("cd"));
            assert_eq!(c.stream.poll_overflow(&mut cx), Poll::Ready(1));
            assert!(c.stream.poll_overflow(&mut cx).is_pending(), "said once");
            assert_eq!(c.stream.sent_once(), Some(why));
            assert_eq!(c.budget.held(), 0);
            assert_eq!(next(&mut first).await, Some(Err(RETIRED.into())));
            // No hedge starts now.
            let mut late = c.body(2);
            assert_eq!(next(&mut late).await, Some(Err(RETIRED.into())));
            // The committed hedge goes on, after the race too; nothing is kept.
            c.send("ef");
            assert_eq!(next(&mut second).await, ok("ef"));
            assert_eq!(c.budget.held(), 0);
            let tx = c.tx.clone().unwrap();
            drop(c);
            tx.send(Ok(Bytes::from_static(b"gh"))).unwrap();
            assert_eq!(next(&mut second).await, ok("gh"));
            drop(tx);
            assert_eq!(next(&mut second).await, None);
        }
    }

    #[tokio::test]
    async fn a_winner_behind_the_others_gets_the_rest_of_the_copy_then_the_live_stream() {
        let c = call(100, 100);
        let mut first = c.body(0);
        let mut second = c.body(1);
        c.send("a");
        c.send("b");
        assert_eq!(next(&mut first).await, ok("a"));
        assert_eq!(next(&mut first).await, ok("b"));
        assert_eq!(next(&mut second).await, ok("a"));
        // Hedge 1 gets response headers having sent "a" of "a", "b".
        c.stream.commit(1);
        assert_eq!(c.budget.held(), 0);
        assert_eq!(
            c.stream.sent_once(),
            None,
            "committed by headers, not by a limit"
        );
        assert_eq!(next(&mut first).await, Some(Err(RETIRED.into())));
        let tx = c.tx.clone().unwrap();
        drop(c);
        assert_eq!(next(&mut second).await, ok("b"));
        tx.send(Ok(Bytes::from_static(b"c"))).unwrap();
        assert_eq!(next(&mut second).await, ok("c"));
        drop(tx);
        assert_eq!(next(&mut second).await, None);
    }

    #[tokio::test]
    async fn the_callers_error_reaches_every_hedge_after_the_messages_before_it() {
        let c = call(100, 100);
        let mut first = c.body(0);
        let mut second = c.body(1);
        c.send("a");
        assert_eq!(next(&mut first).await, ok("a"));
        c.fail("caller broke");
        assert_eq!(next(&mut first).await, Some(Err("caller broke".into())));
        assert_eq!(next(&mut first).await, None);
        assert_eq!(next(&mut second).await, ok("a"));
        assert_eq!(
            next(&mut second).await,
            Some(Err("the request stream failed: caller broke".into()))
        );
        assert_eq!(c.stream.sent_once(), Some(CallOutcome::BodyError));
        assert_eq!(c.budget.held(), 0);
    }

    #[test]
    fn a_retired_hedge_waiting_on_the_caller_is_woken_and_fails() {
        let c = call(100, 100);
        let (count, waker) = counter();
        let mut first = c.body(0);
        assert!(poll_once(&mut first, &waker).is_pending());
        c.stream.retire(0);
        assert_eq!(
            count.0.load(Ordering::SeqCst),
            1,
            "woken, so the transport resets it"
        );
        let Poll::Ready(Some(Err(e))) = poll_once(&mut first, &waker) else {
            panic!("a retired hedge's body fails");
        };
        assert_eq!(e.message(), RETIRED);
        // The same hedge sent again (waitForReady) gets a new body with the whole request.
        c.send("a");
        let mut again = c.body(0);
        let Poll::Ready(Some(Ok(f))) = poll_once(&mut again, &waker) else {
            panic!("the hedge sent again reads");
        };
        assert_eq!(f.into_data().unwrap(), "a");
    }

    #[test]
    fn the_call_ending_uncommitted_fails_every_hedge_and_frees_the_budget() {
        let c = call(100, 100);
        let (count, waker) = counter();
        let mut first = c.body(0);
        let mut second = c.body(1);
        c.send("abc");
        let Poll::Ready(Some(Ok(_))) = poll_once(&mut first, &waker) else {
            panic!("reads");
        };
        assert!(poll_once(&mut first, &waker).is_pending());
        assert_eq!(c.budget.held(), 3);
        drop(c.stream);
        assert_eq!(c.budget.held(), 0);
        assert!(count.0.load(Ordering::SeqCst) >= 1);
        for body in [&mut first, &mut second] {
            let Poll::Ready(Some(Err(e))) = poll_once(body, &waker) else {
                panic!("every hedge's body fails");
            };
            assert_eq!(e.message(), RETIRED);
        }
    }

    /// One step of a hedged streaming call, as the property test plays it.
    #[derive(Debug, Clone)]
    enum Op {
        /// The caller sends a message of this many bytes.
        Send(usize),
        /// The caller's stream ends, or fails.
        End,
        Fail,
        /// A new body for hedge `h` (a new hedge, or one sent again).
        Start(u32),
        /// The transport polls hedge `h`'s body once.
        Poll(u32),
        Retire(u32),
        Commit(u32),
        /// The transport drops hedge `h`'s body.
        Drop(u32),
    }

    fn ops() -> impl proptest::strategy::Strategy<Value = Op> {
        use proptest::prelude::*;
        prop_oneof![
            3 => (1usize..40).prop_map(Op::Send),
            1 => Just(Op::End),
            1 => Just(Op::Fail),
            2 => (0u32..4).prop_map(Op::Start),
            8 => (0u32..4).prop_map(Op::Poll),
            1 => (0u32..4).prop_map(Op::Retire),
            1 => (0u32..4).prop_map(Op::Commit),
            1 => (0u32..4).prop_map(Op::Drop),
        ]
    }

    /// What one hedge's body has yielded.
    #[derive(Default)]
    struct Seen {
        chunks: Vec<Bytes>,
        failed: bool,
        ended: bool,
    }

    proptest::proptest! {
        #[test]
        fn every_hedge_sends_a_prefix_of_the_request_and_the_budget_comes_back(
            steps in proptest::collection::vec(ops(), 0..80),
            cap in 1usize..200,
        ) {
            let mut c = call(cap, 150);
            let mut sent: Vec<Bytes> = Vec::new();
            let (mut ended, mut failed) = (false, false);
            let mut bodies: Vec<Option<(tonic::body::Body, Seen)>> = (0..4).map(|_| None).collect();
            let waker = Waker::noop();
            for op in steps {
                match op {
                    Op::Send(n) if !ended && !failed => {
                        // Distinct messages: a byte of their position, n times.
                        let chunk = Bytes::from(vec![sent.len() as u8; n]);
                        c.tx.as_ref().unwrap().send(Ok(chunk.clone())).unwrap();
                        sent.push(chunk);
                    }
                    Op::End if !ended && !failed => {
                        c.tx = None;
                        ended = true;
                    }
                    Op::Fail if !ended && !failed => {
                        c.fail("caller broke");
                        failed = true;
                    }
                    Op::Start(h) => bodies[h as usize] = Some((c.body(h), Seen::default())),
                    Op::Poll(h) => {
                        let Some((body, seen)) = bodies[h as usize].as_mut() else { continue };
                        if seen.failed || seen.ended {
                            continue;
                        }
                        match poll_once(body, waker) {
                            Poll::Ready(Some(Ok(f))) => {
                                if let Ok(d) = f.into_data() {
                                    seen.chunks.push(d);
                                }
                            }
                            Poll::Ready(Some(Err(_))) => seen.failed = true,
                            Poll::Ready(None) => seen.ended = true,
                            Poll::Pending => {}
                        }
                    }
                    Op::Retire(h) => c.stream.retire(h),
                    Op::Commit(h) => c.stream.commit(h),
                    Op::Drop(h) => bodies[h as usize] = None,
                    _ => {}
                }
                let mut cx = Context::from_waker(waker);
                let _ = c.stream.poll_overflow(&mut cx);
                proptest::prop_assert!(c.budget.held() <= cap.min(150));
                for (_, seen) in bodies.iter().flatten() {
                    // What a hedge sent is the request's first messages, in order.
                    proptest::prop_assert!(seen.chunks.len() <= sent.len());
                    proptest::prop_assert_eq!(&seen.chunks[..], &sent[..seen.chunks.len()]);
                    if seen.ended {
                        proptest::prop_assert!(ended && !failed);
                        proptest::prop_assert_eq!(seen.chunks.len(), sent.len());
                    }
                }
            }
            drop(bodies);
            drop(c.stream);
            proptest::prop_assert_eq!(c.budget.held(), 0);
        }
    }
}
