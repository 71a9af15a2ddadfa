//! The one copy of the request that every attempt of a call sends: each retry of a
//! retried call, one after the other, and each hedge of a hedged call, side by side. A
//! retry is hedge slot 0 sent again.
//!
//! What the caller has ready when the call starts is read at once
//! ([`read`](read::read_ready)): a request complete by then (every unary and
//! server-streaming call) is kept whole and each attempt gets refcounted `Bytes` clones
//! of it, with no lock and no allocation but the attempt's body box; one the caller is
//! still producing is read once from the caller and fanned out to the attempts
//! ([`stream`]). Both count their bytes in the layer's budget ([`budget`]), where gRFC
//! A6's commit rule is written ([`BudgetLease::keep`]), and check each message against
//! `maxRequestMessageBytes` ([`check`]).
//!
//! Every request byte the copy holds stays counted in that budget, also after the call
//! committed, until the committed attempt hands it to the transport (issue 30, item 9):
//! a server that never reads cannot make the layer hold more than `maxReplayBytesTotal`
//! plus the one message that passed it. Nothing is read ahead of the attempt after a
//! commit: the caller's stream is polled only when the attempt's body is, with nothing
//! else left to send, so the transport's flow control reaches the caller.

use std::sync::Arc;
use std::task::{Context, Poll};

use crate::retry::CallOutcome;

pub(crate) mod budget;
pub(crate) mod check;
pub(crate) mod read;
pub(crate) mod stream;

use budget::{BudgetLease, ReplayBudget};
use check::RequestCheck;
use read::{Ready, WholeCopy, read_ready};
use stream::StreamCopy;

/// What every attempt (or hedge) of one call sends.
pub(crate) enum RequestCopy {
    /// Complete before the first attempt (every unary call): each attempt gets a copy;
    /// its bytes stay in the budget until the call ends.
    Whole {
        copy: WholeCopy,
        _lease: BudgetLease,
    },
    /// Still coming from the caller: read once, fanned out to the attempts.
    Stream(StreamCopy),
}

impl RequestCopy {
    /// Reads what the caller has ready of `source`, without waiting for more, keeping at
    /// most `cap` bytes (`maxReplayBytesPerCall`) from `budget`; `check` applies
    /// `maxRequestMessageBytes`. `None` when a request message is over it: nothing is
    /// sent. `hedged` names the attempts in the errors of stale bodies.
    pub(crate) fn read(
        mut source: tonic::body::Body,
        budget: Arc<ReplayBudget>,
        cap: usize,
        mut check: Option<RequestCheck>,
        hedged: bool,
        cx: &mut Context<'_>,
    ) -> Option<Self> {
        let mut lease = BudgetLease::new(budget);
        Some(
            match read_ready(&mut source, cap, &mut lease, check.as_mut(), cx) {
                Ready::TooLarge => return None,
                Ready::Complete(copy) => RequestCopy::Whole {
                    copy,
                    _lease: lease,
                },
                Ready::Partial(start) => {
                    RequestCopy::Stream(StreamCopy::new(start, source, lease, cap, check, hedged))
                }
            },
        )
    }

    /// The body of attempt slot `slot` (a retry sends slot 0 again).
    pub(crate) fn body(&self, slot: u32) -> tonic::body::Body {
        match self {
            RequestCopy::Whole { copy, .. } => tonic::body::Body::new(copy.body()),
            RequestCopy::Stream(s) => tonic::body::Body::new(s.body(slot)),
        }
    }

    /// `slot`'s attempt ended (or is cancelled): its body stops reading.
    pub(crate) fn retire(&self, slot: u32) {
        if let RequestCopy::Stream(s) = self {
            s.retire(slot);
        }
    }

    /// `slot`'s attempt got response headers: the request is its own from now on, and
    /// goes on after the call loop.
    pub(crate) fn commit(&self, slot: u32) {
        if let RequestCopy::Stream(s) = self {
            s.commit(slot);
        }
    }

    /// The slot the request committed to because it passed a replay limit, once.
    pub(crate) fn poll_overflow(&self, cx: &mut Context<'_>) -> Poll<u32> {
        match self {
            RequestCopy::Whole { .. } => Poll::Pending,
            RequestCopy::Stream(s) => s.poll_overflow(cx),
        }
    }

    /// Set when the request is not kept whole any more (it passed a replay limit, or the
    /// caller's body failed): the call's outcome if another attempt would otherwise go
    /// out.
    pub(crate) fn sent_once(&self) -> Option<CallOutcome> {
        match self {
            RequestCopy::Whole { .. } => None,
            RequestCopy::Stream(s) => s.overflow().map(budget::Overflow::outcome),
        }
    }

    /// Whether a new attempt would send the whole request (see
    /// [`StreamCopy::can_resend`]).
    pub(crate) fn can_resend(&self) -> bool {
        match self {
            RequestCopy::Whole { .. } => true,
            RequestCopy::Stream(s) => s.can_resend(),
        }
    }

    /// Whether the request was complete before the first attempt. Only then may a
    /// response be peeked at before the caller gets it: the caller of a streaming
    /// request may wait for the headers before it sends more.
    pub(crate) fn is_whole(&self) -> bool {
        matches!(self, RequestCopy::Whole { .. })
    }
}

/// The start of a streamed request, for the tests of the [`StreamCopy`] that hands it to
/// every retry and hedge.
#[cfg(test)]
pub(crate) mod fixtures {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::task::{Wake, Waker};

    use tokio::sync::mpsc;

    use std::sync::Arc;
    use std::task::Context;

    use bytes::Bytes;
    use http_body::Frame;

    use super::budget::{BudgetLease, ReplayBudget};
    use super::read::{Partial, Ready, read_ready};
    use crate::BoxError;

    /// The caller's request stream: chunks (or an error) as they are sent, the end when
    /// the sender drops.
    pub(crate) fn feed(rx: mpsc::UnboundedReceiver<Result<Bytes, String>>) -> tonic::body::Body {
        use tokio_stream::StreamExt as _;
        let frames = tokio_stream::wrappers::UnboundedReceiverStream::new(rx)
            .map(|chunk| chunk.map(Frame::data).map_err(BoxError::from));
        tonic::body::Body::new(http_body_util::StreamBody::new(frames))
    }

    /// A streamed request whose caller has produced nothing yet, read as far as it goes.
    pub(crate) struct StreamStart {
        /// What the first read found (nothing).
        pub(crate) start: Partial,
        /// The rest of the caller's stream.
        pub(crate) source: tonic::body::Body,
        /// The bytes held for it.
        pub(crate) lease: BudgetLease,
        /// Where the test sends the caller's chunks.
        pub(crate) tx: mpsc::UnboundedSender<Result<Bytes, String>>,
        /// The layer's budget the lease draws on.
        pub(crate) budget: Arc<ReplayBudget>,
    }

    /// A streamed request with nothing sent yet; `cap` per call, `total` in the layer's
    /// budget.
    pub(crate) fn started(cap: usize, total: usize) -> StreamStart {
        started_on(cap, Arc::new(ReplayBudget::new(total)))
    }

    /// [`started`], on a layer's `budget` that other calls share.
    pub(crate) fn started_on(cap: usize, budget: Arc<ReplayBudget>) -> StreamStart {
        let (tx, rx) = mpsc::unbounded_channel();
        let mut lease = BudgetLease::new(budget.clone());
        let mut source = feed(rx);
        let mut cx = Context::from_waker(Waker::noop());
        let Ready::Partial(start) = read_ready(&mut source, cap, &mut lease, None, &mut cx) else {
            panic!("a stream with nothing ready yet is partial");
        };
        StreamStart {
            start,
            source,
            lease,
            tx,
            budget,
        }
    }

    impl StreamStart {
        /// The call whose request stream `keep` keeps, built on this start.
        pub(crate) fn call<S>(
            self,
            keep: impl FnOnce(Partial, tonic::body::Body, BudgetLease) -> S,
        ) -> StreamedCall<S> {
            StreamedCall {
                stream: keep(self.start, self.source, self.lease),
                tx: Some(self.tx),
                budget: self.budget,
            }
        }
    }

    /// A streamed call under test: what keeps its request stream, the caller's end of
    /// that stream (`None` once the caller has ended it) and the layer's budget.
    pub(crate) struct StreamedCall<S> {
        pub(crate) stream: S,
        pub(crate) tx: Option<mpsc::UnboundedSender<Result<Bytes, String>>>,
        pub(crate) budget: Arc<ReplayBudget>,
    }

    impl<S> StreamedCall<S> {
        /// The caller sends `chunk`.
        pub(crate) fn send(&self, chunk: &'static str) {
            let tx = self.tx.as_ref().unwrap();
            tx.send(Ok(Bytes::from(chunk))).unwrap();
        }

        /// The caller's stream fails with `message`.
        pub(crate) fn fail(&self, message: &str) {
            let tx = self.tx.as_ref().unwrap();
            tx.send(Err(message.to_owned())).unwrap();
        }
    }

    /// A message read from a body, as [`ok`] says it.
    pub(crate) fn ok(s: &str) -> Option<Result<String, String>> {
        Some(Ok(s.to_owned()))
    }

    /// Counts its wakes.
    pub(crate) struct Count(pub(crate) AtomicUsize);

    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// A waker and the count of its wakes.
    pub(crate) fn counter() -> (Arc<Count>, Waker) {
        let count = Arc::new(Count(AtomicUsize::new(0)));
        (count.clone(), Waker::from(count))
    }
}
