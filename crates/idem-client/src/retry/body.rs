//! The replay buffer: the request body read once, then handed to every attempt as cheap
//! `Bytes` clones; and the body of a call that did not fit, which streams what was read
//! followed by the rest.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};

use bytes::{Buf, Bytes};
use http::HeaderMap;
use http_body::{Body, Frame};
use http_body_util::BodyExt;

use crate::BoxError;

/// Bytes held for replay across all calls of one layer (and its clones).
#[derive(Debug)]
pub(crate) struct ReplayBudget {
    held: AtomicUsize,
    limit: AtomicUsize,
}

impl ReplayBudget {
    pub(crate) fn new(limit: usize) -> Self {
        ReplayBudget {
            held: AtomicUsize::new(0),
            limit: AtomicUsize::new(limit),
        }
    }
    pub(crate) fn set_limit(&self, limit: usize) {
        self.limit.store(limit, Ordering::Relaxed);
    }
    pub(crate) fn held(&self) -> usize {
        self.held.load(Ordering::Relaxed)
    }
    fn try_reserve(&self, n: usize) -> bool {
        let limit = self.limit.load(Ordering::Relaxed);
        self.held
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |h| {
                h.checked_add(n).filter(|t| *t <= limit)
            })
            .is_ok()
    }
    fn release(&self, n: usize) {
        let _ = self
            .held
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |h| {
                Some(h.saturating_sub(n))
            });
    }
}

/// Bytes of one call reserved in the budget; released when dropped (the call ended).
#[derive(Debug)]
pub(crate) struct Lease {
    budget: Arc<ReplayBudget>,
    bytes: usize,
}

impl Lease {
    pub(crate) fn new(budget: Arc<ReplayBudget>) -> Self {
        Lease { budget, bytes: 0 }
    }
    fn reserve(&mut self, n: usize) -> bool {
        if self.budget.try_reserve(n) {
            self.bytes += n;
            true
        } else {
            false
        }
    }
    fn release_all(&mut self) {
        self.budget.release(self.bytes);
        self.bytes = 0;
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.release_all();
    }
}

/// The chunks of a buffered body. A unary call's body is one chunk: held without a
/// `Vec` or an `Arc` slice (a `Bytes` clone is a refcount), so buffering it allocates
/// nothing.
#[derive(Debug, Clone)]
enum Chunks {
    One(Bytes),
    Many(Arc<[Bytes]>),
}

impl Chunks {
    fn new(first: Option<Bytes>, more: Vec<Bytes>) -> Self {
        match first {
            Some(one) if more.is_empty() => Chunks::One(one),
            Some(one) => Chunks::Many(std::iter::once(one).chain(more).collect()),
            None => Chunks::Many(Arc::from(more)),
        }
    }
    fn get(&self, i: usize) -> Option<&Bytes> {
        match self {
            Chunks::One(b) => (i == 0).then_some(b),
            Chunks::Many(all) => all.get(i),
        }
    }
    fn len(&self) -> usize {
        match self {
            Chunks::One(_) => 1,
            Chunks::Many(all) => all.len(),
        }
    }
}

/// A fully read request body; [`Replay::body`] is one attempt's copy (refcount clones).
#[derive(Debug, Clone)]
pub(crate) struct Replay {
    chunks: Chunks,
    trailers: Option<HeaderMap>,
}

impl Replay {
    pub(crate) fn body(&self) -> ReplayBody {
        ReplayBody {
            chunks: self.chunks.clone(),
            next: 0,
            trailers: self.trailers.clone(),
        }
    }
}

/// One attempt's request body.
#[derive(Debug)]
pub(crate) struct ReplayBody {
    chunks: Chunks,
    next: usize,
    trailers: Option<HeaderMap>,
}

impl Body for ReplayBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if let Some(chunk) = self.chunks.get(self.next).cloned() {
            self.next += 1;
            return Poll::Ready(Some(Ok(Frame::data(chunk))));
        }
        Poll::Ready(self.trailers.take().map(|t| Ok(Frame::trailers(t))))
    }

    fn is_end_stream(&self) -> bool {
        self.next >= self.chunks.len() && self.trailers.is_none()
    }

    // No exact `size_hint`: hyper would turn it into a `content-length` header on every
    // attempt (an allocation, HPACK work and a parse on the server), which gRPC requests
    // do not carry; the default (unknown) keeps the request as the bare channel sends it.
}

/// The body of a call that is sent once: what was read while trying to buffer it, then
/// the rest of the original body (or the error that stopped the reading).
pub(crate) struct PartialBody<B> {
    read: VecDeque<Bytes>,
    error: Option<BoxError>,
    rest: Option<B>,
}

impl<B> Body for PartialBody<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if let Some(chunk) = self.read.pop_front() {
            return Poll::Ready(Some(Ok(Frame::data(chunk))));
        }
        if let Some(e) = self.error.take() {
            self.rest = None;
            return Poll::Ready(Some(Err(e)));
        }
        match self.rest.as_mut() {
            Some(rest) => Pin::new(rest).poll_frame(cx).map_err(Into::into),
            None => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.read.is_empty()
            && self.error.is_none()
            && self.rest.as_ref().is_none_or(|r| r.is_end_stream())
    }
}

/// The result of reading a request body for replay.
pub(crate) enum Buffered<B> {
    /// The whole body, within the per-call cap and the channel's budget.
    Complete(Replay),
    /// The body did not fit (or failed): send it once.
    Partial(PartialBody<B>, Overflow),
}

/// Why a body is sent once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Overflow {
    PerCall,
    Budget,
    Error,
}

/// Reads `body` up to `cap` bytes, reserving them in `lease`. Nothing read is lost: on
/// overflow the chunks read so far go first in the [`PartialBody`].
///
/// `B: Unpin` (the caller passes a [`tonic::body::Body`], which is): the body is read in
/// place, without a `Box::pin` per call.
pub(crate) async fn buffer<B>(mut body: B, cap: usize, lease: &mut Lease) -> Buffered<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    // The first chunk apart: a one-chunk body (every unary call) needs no `Vec`.
    let mut first: Option<Bytes> = None;
    let mut more: Vec<Bytes> = Vec::new();
    let mut total = 0usize;
    let mut trailers: Option<HeaderMap> = None;
    loop {
        if body.is_end_stream() {
            break;
        }
        let overflow = match body.frame().await {
            None => break,
            Some(Err(e)) => Some((Overflow::Error, Some(e.into()))),
            Some(Ok(frame)) => match frame.into_data() {
                Ok(mut data) => {
                    let chunk = data.copy_to_bytes(data.remaining());
                    let len = chunk.len();
                    if first.is_none() {
                        first = Some(chunk);
                    } else {
                        more.push(chunk);
                    }
                    if total.saturating_add(len) > cap {
                        Some((Overflow::PerCall, None))
                    } else if !lease.reserve(len) {
                        Some((Overflow::Budget, None))
                    } else {
                        total += len;
                        None
                    }
                }
                Err(frame) => {
                    if let Ok(t) = frame.into_trailers() {
                        match trailers.as_mut() {
                            Some(all) => all.extend(t),
                            None => trailers = Some(t),
                        }
                    }
                    None
                }
            },
        };
        if let Some((why, error)) = overflow {
            lease.release_all();
            // Request trailers seen before the overflow are dropped: gRPC requests carry
            // none, and an attempt sent once streams the rest of the original body.
            return Buffered::Partial(
                PartialBody {
                    read: first.into_iter().chain(more).collect(),
                    error,
                    rest: Some(body),
                },
                why,
            );
        }
    }
    Buffered::Complete(Replay {
        chunks: Chunks::new(first, more),
        trailers,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::{BodyExt, Full};

    fn budget(limit: usize) -> Arc<ReplayBudget> {
        Arc::new(ReplayBudget::new(limit))
    }

    /// A body that yields one frame per part (with `Pending` never needed).
    struct Chunked(VecDeque<Bytes>);
    impl Body for Chunked {
        type Data = Bytes;
        type Error = Infallible;
        fn poll_frame(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
            Poll::Ready(self.0.pop_front().map(|b| Ok(Frame::data(b))))
        }
    }
    fn chunked(parts: &[&'static [u8]]) -> Chunked {
        Chunked(parts.iter().map(|p| Bytes::from_static(p)).collect())
    }

    #[tokio::test]
    async fn replays_the_same_bytes_every_time() {
        let b = budget(1 << 20);
        let mut lease = Lease::new(b.clone());
        let Buffered::Complete(replay) = buffer(chunked(&[b"ab", b"cd"]), 10, &mut lease).await
        else {
            panic!("should fit");
        };
        assert_eq!(b.held(), 4);
        for _ in 0..3 {
            let got = replay.body().collect().await.unwrap().to_bytes();
            assert_eq!(&got[..], b"abcd");
        }
        drop(lease);
        assert_eq!(b.held(), 0);
    }

    #[tokio::test]
    async fn replay_bodies_give_no_exact_size() {
        // hyper turns an exact size hint into a `content-length` header on every attempt.
        let mut lease = Lease::new(budget(1 << 20));
        for parts in [&[&b"abcd"[..]][..], &[b"ab", b"cd"]] {
            let Buffered::Complete(replay) = buffer(chunked(parts), 10, &mut lease).await else {
                panic!("should fit");
            };
            let body = replay.body();
            assert_eq!(body.size_hint().exact(), None);
            assert!(!body.is_end_stream());
            assert_eq!(&body.collect().await.unwrap().to_bytes()[..], b"abcd");
        }
    }

    #[tokio::test]
    async fn overflow_keeps_every_byte() {
        let b = budget(1 << 20);
        let mut lease = Lease::new(b.clone());
        let Buffered::Partial(partial, why) =
            buffer(chunked(&[b"ab", b"cd", b"ef", b"gh"]), 3, &mut lease).await
        else {
            panic!("should overflow");
        };
        assert_eq!(why, Overflow::PerCall);
        assert_eq!(b.held(), 0);
        let got = partial.collect().await.unwrap().to_bytes();
        assert_eq!(&got[..], b"abcdefgh");
    }

    #[tokio::test]
    async fn budget_is_shared() {
        let b = budget(5);
        let mut first = Lease::new(b.clone());
        assert!(matches!(
            buffer(Full::new(Bytes::from_static(b"1234")), 10, &mut first).await,
            Buffered::Complete(_)
        ));
        let mut second = Lease::new(b.clone());
        let Buffered::Partial(partial, why) =
            buffer(Full::new(Bytes::from_static(b"5678")), 10, &mut second).await
        else {
            panic!("budget should be full");
        };
        assert_eq!(why, Overflow::Budget);
        assert_eq!(&partial.collect().await.unwrap().to_bytes()[..], b"5678");
        drop(first);
        assert_eq!(b.held(), 0);
    }
}
