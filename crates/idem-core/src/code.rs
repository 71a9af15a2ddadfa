//! gRPC status-code names and a small set type.

use std::fmt;

pub use tonic::Code;

/// Every status code, in numeric order (`OK` = 0 … `UNAUTHENTICATED` = 16).
pub const ALL_CODES: [Code; 17] = [
    Code::Ok,
    Code::Cancelled,
    Code::Unknown,
    Code::InvalidArgument,
    Code::DeadlineExceeded,
    Code::NotFound,
    Code::AlreadyExists,
    Code::PermissionDenied,
    Code::ResourceExhausted,
    Code::FailedPrecondition,
    Code::Aborted,
    Code::OutOfRange,
    Code::Unimplemented,
    Code::Internal,
    Code::Unavailable,
    Code::DataLoss,
    Code::Unauthenticated,
];

/// The canonical upper-case name of a code, as service configs spell it (`"UNAVAILABLE"`).
pub fn code_name(code: Code) -> &'static str {
    match code {
        Code::Ok => "OK",
        Code::Cancelled => "CANCELLED",
        Code::Unknown => "UNKNOWN",
        Code::InvalidArgument => "INVALID_ARGUMENT",
        Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
        Code::NotFound => "NOT_FOUND",
        Code::AlreadyExists => "ALREADY_EXISTS",
        Code::PermissionDenied => "PERMISSION_DENIED",
        Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        Code::FailedPrecondition => "FAILED_PRECONDITION",
        Code::Aborted => "ABORTED",
        Code::OutOfRange => "OUT_OF_RANGE",
        Code::Unimplemented => "UNIMPLEMENTED",
        Code::Internal => "INTERNAL",
        Code::Unavailable => "UNAVAILABLE",
        Code::DataLoss => "DATA_LOSS",
        Code::Unauthenticated => "UNAUTHENTICATED",
    }
}

/// Parses a code name, case-insensitively (`"unavailable"`, `"UNAVAILABLE"`).
pub fn parse_code_name(name: &str) -> Option<Code> {
    ALL_CODES
        .iter()
        .copied()
        .find(|c| code_name(*c).eq_ignore_ascii_case(name))
}

/// Maps an integer 0..=16 to its code; `None` outside that range.
pub fn code_from_i64(value: i64) -> Option<Code> {
    usize::try_from(value)
        .ok()
        .and_then(|i| ALL_CODES.get(i).copied())
}

/// The `grpc-status` in `headers` (response headers of a Trailers-Only response, or
/// trailers): `None` when absent; an unparseable value, or a number outside 0..=16, is
/// UNKNOWN (as tonic reads it).
///
/// ```
/// use idem_core::code::{Code, grpc_status_code};
/// let mut h = http::HeaderMap::new();
/// assert_eq!(grpc_status_code(&h), None);
/// h.insert("grpc-status", "14".parse().unwrap());
/// assert_eq!(grpc_status_code(&h), Some(Code::Unavailable));
/// h.insert("grpc-status", "x".parse().unwrap());
/// assert_eq!(grpc_status_code(&h), Some(Code::Unknown));
/// ```
pub fn grpc_status_code(headers: &http::HeaderMap) -> Option<Code> {
    let value = headers.get(crate::headers::GRPC_STATUS)?;
    let code = std::str::from_utf8(value.as_bytes())
        .ok()
        .and_then(|s| s.parse::<i64>().ok())
        .and_then(code_from_i64)
        .unwrap_or(Code::Unknown);
    Some(code)
}

/// How one poll of a gRPC response body ends the call, if it does: the trailers'
/// `grpc-status` (UNKNOWN when they carry none), the error's code, UNKNOWN for a body
/// that ends without trailers; `None` while the body goes on.
pub fn end_of_response<B>(
    polled: &std::task::Poll<Option<Result<http_body::Frame<B>, tonic::Status>>>,
) -> Option<Code> {
    use std::task::Poll;
    match polled {
        Poll::Ready(Some(Ok(frame))) => frame
            .trailers_ref()
            .map(|t| grpc_status_code(t).unwrap_or(Code::Unknown)),
        Poll::Ready(Some(Err(status))) => Some(status.code()),
        Poll::Ready(None) => Some(Code::Unknown),
        Poll::Pending => None,
    }
}

/// A gRPC response body that tells `on_end`, once, the code the call ended with: as
/// [`end_of_response`] reads it when the body ends, or CANCELLED when the body is dropped
/// first (the caller went away). Both layers' metrics watch responses with it.
///
/// ```
/// use idem_core::code::{Code, OnEnd};
/// use http_body_util::BodyExt;
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let (tx, rx) = std::sync::mpsc::channel();
/// let body = OnEnd::new(tonic::body::Body::empty(), move |code| tx.send(code).unwrap());
/// drop(body.collect().await);
/// assert_eq!(rx.recv().unwrap(), Code::Unknown); // ended without trailers
/// # }
/// ```
pub struct OnEnd<F: FnOnce(Code)> {
    inner: tonic::body::Body,
    on_end: Option<F>,
}

impl<F: FnOnce(Code)> OnEnd<F> {
    /// Watches `inner`.
    pub fn new(inner: tonic::body::Body, on_end: F) -> Self {
        OnEnd {
            inner,
            on_end: Some(on_end),
        }
    }
}

impl<F: FnOnce(Code)> std::fmt::Debug for OnEnd<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OnEnd")
            .field("ended", &self.on_end.is_none())
            .finish_non_exhaustive()
    }
}

impl<F: FnOnce(Code)> Drop for OnEnd<F> {
    fn drop(&mut self) {
        if let Some(f) = self.on_end.take() {
            f(Code::Cancelled);
        }
    }
}

// `on_end` is never pinned: the body is `Unpin` whatever `F` is.
impl<F: FnOnce(Code)> Unpin for OnEnd<F> {}

impl<F: FnOnce(Code)> http_body::Body for OnEnd<F> {
    type Data = bytes::Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<bytes::Bytes>, tonic::Status>>> {
        let polled = std::pin::Pin::new(&mut self.inner).poll_frame(cx);
        if let Some(code) = end_of_response(&polled)
            && let Some(f) = self.on_end.take()
        {
            f(code);
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// A set of status codes, stored as a bitmap (cheap to copy and to test).
///
/// ```
/// use idem_core::code::{Code, CodeSet};
/// let set: CodeSet = [Code::Unavailable, Code::Aborted].into_iter().collect();
/// assert!(set.contains(Code::Unavailable));
/// assert!(!set.contains(Code::Internal));
/// ```
#[derive(Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct CodeSet(u32);

impl CodeSet {
    /// The empty set.
    pub const EMPTY: CodeSet = CodeSet(0);
    /// All seventeen codes.
    pub const ALL: CodeSet = CodeSet((1 << 17) - 1);

    /// A set holding one code.
    pub const fn of(code: Code) -> Self {
        CodeSet(1 << (code as i32 as u32))
    }
    /// This set with `code` added.
    pub const fn with(self, code: Code) -> Self {
        CodeSet(self.0 | Self::of(code).0)
    }
    /// Adds a code.
    pub fn insert(&mut self, code: Code) {
        *self = self.with(code);
    }
    /// Whether the set holds `code`.
    pub const fn contains(self, code: Code) -> bool {
        self.0 & Self::of(code).0 != 0
    }
    /// Whether the set is empty.
    pub const fn is_empty(self) -> bool {
        self.0 == 0
    }
    /// Number of codes in the set.
    pub const fn len(self) -> usize {
        self.0.count_ones() as usize
    }
    /// The codes not in this set.
    pub const fn complement(self) -> Self {
        CodeSet(!self.0 & Self::ALL.0)
    }
    /// The codes in both sets.
    pub const fn intersection(self, other: CodeSet) -> Self {
        CodeSet(self.0 & other.0)
    }
    /// The codes in either set.
    pub const fn union(self, other: CodeSet) -> Self {
        CodeSet(self.0 | other.0)
    }
    /// The codes, in numeric order.
    pub fn iter(self) -> impl Iterator<Item = Code> {
        ALL_CODES.into_iter().filter(move |c| self.contains(*c))
    }
}

impl FromIterator<Code> for CodeSet {
    fn from_iter<I: IntoIterator<Item = Code>>(iter: I) -> Self {
        let mut set = CodeSet::EMPTY;
        for c in iter {
            set.insert(c);
        }
        set
    }
}

impl fmt::Debug for CodeSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_set().entries(self.iter().map(code_name)).finish()
    }
}

impl fmt::Display for CodeSet {
    /// `UNAVAILABLE, ABORTED` (numeric order), or `-` when empty.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_empty() {
            return f.write_str("-");
        }
        for (i, c) in self.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            f.write_str(code_name(c))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_ignore_case() {
        for (i, c) in ALL_CODES.iter().enumerate() {
            assert_eq!(*c as i32, i as i32);
            assert_eq!(parse_code_name(code_name(*c)), Some(*c));
            assert_eq!(parse_code_name(&code_name(*c).to_lowercase()), Some(*c));
            assert_eq!(code_from_i64(i as i64), Some(*c));
        }
        assert_eq!(parse_code_name("UNAVAILABLEX"), None);
        assert_eq!(code_from_i64(17), None);
        assert_eq!(code_from_i64(-1), None);
    }

    #[test]
    fn set_ops() {
        let s = CodeSet::of(Code::Unavailable).with(Code::Ok);
        assert_eq!(s.len(), 2);
        assert_eq!(s.complement().len(), 15);
        assert!(!s.complement().contains(Code::Ok));
        assert_eq!(s.to_string(), "OK, UNAVAILABLE");
        assert_eq!(CodeSet::ALL.len(), 17);
    }
}
