//! `maxRequestMessageBytes`: the length in each gRPC message's 5-byte frame header, read
//! as the request's bytes stream past (no message is held to check it). A request message
//! over its limit fails the call on the client with RESOURCE_EXHAUSTED ([`RequestFault`]
//! says so to whoever answers the caller). The response side
//! ([`bound`](crate::retry::response::bound)) reads frames with the same [`FrameScanner`].

use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};

use crate::BoxError;

/// Reads gRPC message headers (a flag byte, then a 4-byte big-endian length) from bytes
/// cut into chunks anywhere.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct FrameScanner {
    /// Payload bytes of the current message not yet seen.
    skip: u64,
    header: [u8; 5],
    /// Header bytes seen so far.
    have: usize,
}

/// A message over its limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Oversize {
    /// Where its header starts in the chunk that completed it (0 when it started in an
    /// earlier chunk).
    pub(crate) at: usize,
    /// The length its header declares.
    pub(crate) len: u64,
    pub(crate) limit: u64,
}

impl FrameScanner {
    /// Reads `chunk`; the first message in it longer than `limit`, if any.
    pub(crate) fn scan(&mut self, chunk: &[u8], limit: u64) -> Option<Oversize> {
        let mut i = 0;
        let mut start = 0;
        while i < chunk.len() {
            if self.skip > 0 {
                let n = usize::try_from(self.skip).unwrap_or(usize::MAX);
                let n = n.min(chunk.len() - i);
                i += n;
                self.skip -= n as u64;
                continue;
            }
            if self.have == 0 {
                start = i;
            }
            let n = (5 - self.have).min(chunk.len() - i);
            self.header[self.have..self.have + n].copy_from_slice(&chunk[i..i + n]);
            self.have += n;
            i += n;
            if self.have == 5 {
                self.have = 0;
                let h = self.header;
                let len = u64::from(u32::from_be_bytes([h[1], h[2], h[3], h[4]]));
                if len > limit {
                    return Some(Oversize {
                        at: start,
                        len,
                        limit,
                    });
                }
                self.skip = len;
            }
        }
        None
    }
}

/// Set when a request message of the call was over `maxRequestMessageBytes`: whatever
/// the server answers, the caller gets RESOURCE_EXHAUSTED.
#[derive(Debug, Default)]
pub(crate) struct RequestFault(OnceLock<Oversize>);

impl RequestFault {
    pub(crate) fn set(&self, o: Oversize) {
        let _ = self.0.set(o);
    }

    /// Whether a message was too large.
    pub(crate) fn is_set(&self) -> bool {
        self.0.get().is_some()
    }

    /// The status the caller gets, once a message was too large.
    pub(crate) fn status(&self) -> Option<tonic::Status> {
        let o = self.0.get()?;
        Some(tonic::Status::resource_exhausted(format!(
            "request message of {} bytes is over maxRequestMessageBytes ({})",
            o.len, o.limit
        )))
    }
}

/// The error a request body ends with when a message is too large; sending it resets
/// the stream.
#[derive(Debug, thiserror::Error)]
#[error("request message of {len} bytes is over maxRequestMessageBytes ({limit})")]
pub(crate) struct RequestTooLarge {
    len: u64,
    limit: u64,
}

impl From<Oversize> for RequestTooLarge {
    fn from(o: Oversize) -> Self {
        RequestTooLarge {
            len: o.len,
            limit: o.limit,
        }
    }
}

/// The request-side check of one call: its limit, where it is in the frames, and where
/// it says a message was too large.
#[derive(Debug)]
pub(crate) struct RequestCheck {
    limit: u64,
    scanner: FrameScanner,
    fault: Arc<RequestFault>,
}

impl RequestCheck {
    pub(crate) fn new(limit: u64, fault: Arc<RequestFault>) -> Self {
        RequestCheck {
            limit,
            scanner: FrameScanner::default(),
            fault,
        }
    }

    /// Reads `chunk`; an error (and the fault set) when it holds a message over the limit.
    pub(crate) fn check(&mut self, chunk: &[u8]) -> Result<(), RequestTooLarge> {
        match self.scanner.scan(chunk, self.limit) {
            None => Ok(()),
            Some(o) => {
                self.fault.set(o);
                Err(o.into())
            }
        }
    }
}

/// The request body of a call without replay, checked as it streams.
pub(crate) struct CheckedBody {
    inner: tonic::body::Body,
    check: RequestCheck,
    failed: bool,
}

impl CheckedBody {
    pub(crate) fn new(inner: tonic::body::Body, check: RequestCheck) -> Self {
        CheckedBody {
            inner,
            check,
            failed: false,
        }
    }
}

impl Body for CheckedBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if self.failed {
            return Poll::Ready(None);
        }
        let this = &mut *self;
        let frame = std::task::ready!(Pin::new(&mut this.inner).poll_frame(cx));
        if let Some(Ok(f)) = &frame
            && let Some(data) = f.data_ref()
            && let Err(e) = this.check.check(data)
        {
            this.failed = true;
            return Poll::Ready(Some(Err(e.into())));
        }
        Poll::Ready(frame.map(|f| f.map_err(Into::into)))
    }

    fn is_end_stream(&self) -> bool {
        self.failed || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn frame(len: u32) -> Vec<u8> {
        let mut f = vec![0];
        f.extend_from_slice(&len.to_be_bytes());
        f.resize(5 + len as usize, 7);
        f
    }

    #[test]
    fn finds_the_first_message_over_the_limit() {
        let mut bytes = frame(3);
        bytes.extend(frame(10));
        bytes.extend(frame(2));
        let mut s = FrameScanner::default();
        assert_eq!(
            s.scan(&bytes, 9),
            Some(Oversize {
                at: 8,
                len: 10,
                limit: 9
            })
        );
        assert_eq!(FrameScanner::default().scan(&bytes, 10), None);
        assert_eq!(FrameScanner::default().scan(&frame(0), 0), None);
    }

    proptest! {
        /// However the bytes are cut, the scanner finds the same message, and a header
        /// that started in an earlier chunk is reported at 0.
        #[test]
        fn chunking_does_not_matter(
            lens in proptest::collection::vec(0u32..40, 1..8),
            cuts in proptest::collection::vec(0usize..400, 0..12),
            limit in 0u64..40,
        ) {
            let bytes: Vec<u8> = lens.iter().flat_map(|l| frame(*l)).collect();
            let whole = FrameScanner::default().scan(&bytes, limit);
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c % (bytes.len() + 1)).collect();
            cuts.push(bytes.len());
            cuts.sort_unstable();
            let mut s = FrameScanner::default();
            let mut from = 0;
            let mut found = None;
            for to in cuts {
                if let Some(o) = s.scan(&bytes[from..to], limit) {
                    found = Some((from, o));
                    break;
                }
                from = to;
            }
            match (whole, found) {
                (None, None) => {}
                (Some(w), Some((from, o))) => {
                    prop_assert_eq!(w.len, o.len);
                    prop_assert!(o.at == 0 && w.at <= from || from + o.at == w.at);
                }
                (w, f) => prop_assert!(false, "{:?} vs {:?}", w, f),
            }
        }
    }
}
