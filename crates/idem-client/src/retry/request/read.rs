//! The read of what the caller has ready of a request, without waiting: a request
//! complete before the first attempt (every unary call) is kept whole ([`WholeCopy`]) and
//! handed to every attempt as cheap `Bytes` clones; the start of one that streams goes on
//! in a [`StreamCopy`](crate::retry::request::stream::StreamCopy).

use std::collections::VecDeque;
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::HeaderMap;
use http_body::{Body, Frame};

use crate::BoxError;
use crate::retry::request::budget::{BudgetLease, Overflow};
use crate::retry::request::check::RequestCheck;

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

/// A fully read request body; [`WholeCopy::body`] is one attempt's copy (refcount clones).
#[derive(Debug, Clone)]
pub(crate) struct WholeCopy {
    chunks: Chunks,
    trailers: Option<HeaderMap>,
}

impl WholeCopy {
    pub(crate) fn body(&self) -> WholeBody {
        WholeBody {
            chunks: self.chunks.clone(),
            next: 0,
            trailers: self.trailers.clone(),
        }
    }
}

/// One attempt's copy of a whole request.
#[derive(Debug)]
pub(crate) struct WholeBody {
    chunks: Chunks,
    next: usize,
    trailers: Option<HeaderMap>,
}

impl Body for WholeBody {
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

/// What the layer could read of a request body without waiting for the caller.
pub(crate) enum Ready {
    /// The whole body, within the limits: every attempt gets a copy of it.
    Complete(WholeCopy),
    /// The caller has more to send (or the body did not fit, or failed): the attempts
    /// stream it ([`StreamCopy`](crate::retry::request::stream::StreamCopy)).
    Partial(Partial),
    /// A request message over `maxRequestMessageBytes`: nothing is sent.
    TooLarge,
}

/// The start of a body that streams: what was read of it.
pub(crate) struct Partial {
    pub(crate) read: VecDeque<Bytes>,
    /// Bytes of `read` reserved in the lease (0 when they are not kept for replay).
    pub(crate) kept: usize,
    pub(crate) trailers: Option<HeaderMap>,
    /// The caller's body failed after `read`: nothing more comes from it.
    pub(crate) error: Option<BoxError>,
    /// Why `read` is not kept for replay, if it is not.
    pub(crate) overflow: Option<Overflow>,
}

/// Why [`read_ready`] stopped.
enum Stop {
    End,
    Pending,
    /// The message of this many bytes passed a limit.
    Overflow(Overflow, usize),
    Failed(BoxError),
}

/// Reads `body` while its frames are ready, up to `cap` bytes reserved in `lease`,
/// without waiting: a unary request (one ready frame, then the end) is read whole here,
/// so it never pays for streaming; a request whose caller has not produced everything
/// yet is handed on as [`Ready::Partial`] at the first `Pending`, so its first message is
/// sent at once. `check` applies `maxRequestMessageBytes` to every frame read.
pub(crate) fn read_ready(
    body: &mut tonic::body::Body,
    cap: usize,
    lease: &mut BudgetLease,
    mut check: Option<&mut RequestCheck>,
    cx: &mut Context<'_>,
) -> Ready {
    // The first chunk apart: a one-chunk body (every unary call) needs no `Vec`.
    let mut first: Option<Bytes> = None;
    let mut more: Vec<Bytes> = Vec::new();
    let mut total = 0usize;
    let mut trailers: Option<HeaderMap> = None;
    let stop = loop {
        if body.is_end_stream() {
            break Stop::End;
        }
        let frame = match Pin::new(&mut *body).poll_frame(cx) {
            Poll::Pending => break Stop::Pending,
            Poll::Ready(None) => break Stop::End,
            Poll::Ready(Some(Err(e))) => break Stop::Failed(e.into()),
            Poll::Ready(Some(Ok(frame))) => frame,
        };
        let chunk = match frame.into_data() {
            Ok(chunk) => chunk,
            Err(frame) => {
                if let Ok(t) = frame.into_trailers() {
                    match trailers.as_mut() {
                        Some(all) => all.extend(t),
                        None => trailers = Some(t),
                    }
                }
                continue;
            }
        };
        if check.as_mut().is_some_and(|c| c.check(&chunk).is_err()) {
            return Ready::TooLarge;
        }
        let len = chunk.len();
        if first.is_none() {
            first = Some(chunk);
        } else {
            more.push(chunk);
        }
        if let Err(why) = lease.keep(total, len, cap) {
            break Stop::Overflow(why, len);
        }
        total += len;
    };
    let (overflow, error) = match stop {
        Stop::End => {
            return Ready::Complete(WholeCopy {
                chunks: Chunks::new(first, more),
                trailers,
            });
        }
        Stop::Pending => (None, None),
        Stop::Overflow(why, len) => {
            // Committed before the first attempt: nothing is kept for replay, but every
            // byte read is held until that attempt sends it, and stays counted
            // (issue 30, item 9), the message that passed the limit too.
            lease.commit(total);
            lease.hold(len);
            (Some(why), None)
        }
        Stop::Failed(e) => {
            lease.commit(total);
            (Some(Overflow::Error), Some(e))
        }
    };
    if overflow.is_some() {
        total = 0;
    }
    Ready::Partial(Partial {
        read: first.into_iter().chain(more).collect(),
        kept: total,
        trailers,
        error,
        overflow,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::retry::request::budget::ReplayBudget;
    use crate::retry::request::check::RequestFault;

    use http_body_util::{BodyExt, Full};
    use std::task::Waker;

    fn budget(limit: usize) -> Arc<ReplayBudget> {
        Arc::new(ReplayBudget::new(limit))
    }

    /// A body that yields one frame per part, then `Pending` if `more` (the caller is
    /// still producing), else the end.
    struct Chunked(VecDeque<Bytes>, bool);
    impl Body for Chunked {
        type Data = Bytes;
        type Error = Infallible;
        fn poll_frame(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
            match self.0.pop_front() {
                Some(b) => Poll::Ready(Some(Ok(Frame::data(b)))),
                None if self.1 => Poll::Pending,
                None => Poll::Ready(None),
            }
        }
    }
    fn chunked(parts: &[&'static [u8]], more: bool) -> tonic::body::Body {
        let parts = parts.iter().map(|p| Bytes::from_static(p)).collect();
        tonic::body::Body::new(Chunked(parts, more))
    }

    fn read(mut body: tonic::body::Body, cap: usize, lease: &mut BudgetLease) -> Ready {
        let mut cx = Context::from_waker(Waker::noop());
        read_ready(&mut body, cap, lease, None, &mut cx)
    }

    fn concat(read: &VecDeque<Bytes>) -> Vec<u8> {
        read.iter().flat_map(|b| b.iter().copied()).collect()
    }

    #[tokio::test]
    async fn a_complete_body_replays_the_same_bytes_every_time() {
        let b = budget(1 << 20);
        let mut lease = BudgetLease::new(b.clone());
        let Ready::Complete(replay) = read(chunked(&[b"ab", b"cd"], false), 10, &mut lease) else {
            panic!("should be complete");
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
        let mut lease = BudgetLease::new(budget(1 << 20));
        for parts in [&[&b"abcd"[..]][..], &[b"ab", b"cd"]] {
            let Ready::Complete(replay) = read(chunked(parts, false), 10, &mut lease) else {
                panic!("should be complete");
            };
            let body = replay.body();
            assert_eq!(body.size_hint().exact(), None);
            assert!(!body.is_end_stream());
            assert_eq!(&body.collect().await.unwrap().to_bytes()[..], b"abcd");
        }
    }

    #[test]
    fn a_body_still_coming_is_partial_and_keeps_what_was_read() {
        let b = budget(1 << 20);
        let mut lease = BudgetLease::new(b.clone());
        let Ready::Partial(p) = read(chunked(&[b"ab"], true), 10, &mut lease) else {
            panic!("should be partial");
        };
        assert_eq!(
            (concat(&p.read), p.kept, p.overflow),
            (b"ab".to_vec(), 2, None)
        );
        assert_eq!(b.held(), 2);
        let Ready::Partial(p) = read(chunked(&[], true), 10, &mut lease) else {
            panic!("nothing ready yet is partial too");
        };
        assert!(p.read.is_empty());
    }

    /// Issue 30, item 9: before the fix the bytes read were held uncounted until the
    /// attempt sent them (a server that never reads: for as long as the call lived).
    #[test]
    fn an_overflow_keeps_every_byte_read_counted_until_the_attempt_sends_it() {
        let b = budget(1 << 20);
        let mut lease = BudgetLease::new(b.clone());
        let Ready::Partial(p) = read(chunked(&[b"ab", b"cd", b"ef", b"gh"], false), 3, &mut lease)
        else {
            panic!("should overflow");
        };
        assert_eq!(p.overflow, Some(Overflow::PerCall));
        assert_eq!((concat(&p.read), p.kept), (b"abcd".to_vec(), 0));
        assert_eq!(b.held(), 0, "nothing is kept for replay");
        assert_eq!((b.total(), b.unsent()), (4, 4), "but all of it is held");
        lease.sent(2);
        assert_eq!(b.total(), 2);
        drop(lease);
        assert_eq!(b.total(), 0);
    }

    #[test]
    fn a_failed_body_keeps_what_was_read_before_counted() {
        /// "ab", then an error.
        struct Fails(bool);
        impl Body for Fails {
            type Data = Bytes;
            type Error = tonic::Status;
            fn poll_frame(
                mut self: Pin<&mut Self>,
                _: &mut Context<'_>,
            ) -> Poll<Option<Result<Frame<Bytes>, tonic::Status>>> {
                if std::mem::replace(&mut self.0, true) {
                    return Poll::Ready(Some(Err(tonic::Status::internal("caller broke"))));
                }
                Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(b"ab")))))
            }
        }
        let b = budget(1 << 20);
        let mut lease = BudgetLease::new(b.clone());
        let Ready::Partial(p) = read(tonic::body::Body::new(Fails(false)), 10, &mut lease) else {
            panic!("a failed body is partial");
        };
        assert_eq!(p.overflow, Some(Overflow::Error));
        assert_eq!((b.held(), b.total()), (0, 2));
    }

    #[test]
    fn the_budget_is_shared() {
        let b = budget(5);
        let mut first = BudgetLease::new(b.clone());
        let body = tonic::body::Body::new(Full::new(Bytes::from_static(b"1234")));
        assert!(matches!(read(body, 10, &mut first), Ready::Complete(_)));
        let mut second = BudgetLease::new(b.clone());
        let body = tonic::body::Body::new(Full::new(Bytes::from_static(b"5678")));
        let Ready::Partial(p) = read(body, 10, &mut second) else {
            panic!("budget should be full");
        };
        assert_eq!(p.overflow, Some(Overflow::Budget));
        assert_eq!(concat(&p.read), b"5678");
        drop(first);
        assert_eq!(b.held(), 0);
    }

    /// What tonic's generated clients send: `EncodeBody` over the caller's messages.
    fn tonic_body<S>(messages: S) -> tonic::body::Body
    where
        S: tokio_stream::Stream<Item = Result<String, tonic::Status>> + Send + 'static,
    {
        use tonic::codec::{Codec, EncodeBody};
        let encoder = tonic_prost::ProstCodec::<String, String>::default().encoder();
        tonic::body::Body::new(EncodeBody::new_client(encoder, messages, None, None))
    }

    #[test]
    fn a_tonic_unary_request_is_complete_and_a_client_stream_is_partial() {
        let mut lease = BudgetLease::new(budget(1 << 20));
        // `Grpc::unary` and `Grpc::server_streaming`: one ready message.
        let unary = tonic_body(tokio_stream::once(Ok("hi".to_owned())));
        assert!(matches!(
            read(unary, 1 << 20, &mut lease),
            Ready::Complete(_)
        ));
        // A client stream whose caller has sent one message so far.
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        tx.send(Ok("hi".to_owned())).unwrap();
        let stream = tonic_body(tokio_stream::wrappers::UnboundedReceiverStream::new(rx));
        let Ready::Partial(p) = read(stream, 1 << 20, &mut lease) else {
            panic!("a stream still open streams");
        };
        assert_eq!(concat(&p.read), b"\0\0\0\0\x04\x0a\x02hi");
        // A client stream whose messages are all there is as good as complete.
        let all = tonic_body(tokio_stream::iter([Ok("a".to_owned()), Ok("b".to_owned())]));
        assert!(matches!(read(all, 1 << 20, &mut lease), Ready::Complete(_)));
    }

    #[test]
    fn a_message_over_the_request_limit_sends_nothing() {
        let fault = Arc::new(RequestFault::default());
        let mut check = RequestCheck::new(3, fault.clone());
        let mut body = chunked(&[b"\0\0\0\0\x02hi", b"\0\0\0\0\x04long"], false);
        let mut cx = Context::from_waker(Waker::noop());
        let mut lease = BudgetLease::new(budget(1 << 20));
        let read = read_ready(&mut body, 1 << 20, &mut lease, Some(&mut check), &mut cx);
        assert!(matches!(read, Ready::TooLarge));
        let status = fault.status().unwrap();
        assert_eq!(status.code(), tonic::Code::ResourceExhausted);
        assert_eq!(
            status.message(),
            "request message of 4 bytes is over maxRequestMessageBytes (3)"
        );
    }
}
