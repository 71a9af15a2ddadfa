//! Which failed attempts the server's application never saw (gRFC A6 "transparent
//! retries"), read from the transport's error types, never from their messages.
//!
//! What tonic 0.14 / hyper 1 / h2 0.4 expose, and what each case means:
//!
//! - **The request never left the client** ([`Unprocessed::Unsent`]): hyper answers a
//!   request it never wrote with an error whose [`hyper::Error::is_canceled`] is true
//!   ("connection closed": the connection task ended with the request still queued;
//!   "connection was not ready"). A6 retries these without limit, under the deadline.
//! - **The request reached the server, not its application** ([`Unprocessed::Refused`]):
//!   - an `RST_STREAM` with `REFUSED_STREAM` from the server: an [`h2::Error`] with
//!     [`is_reset`](h2::Error::is_reset), [`is_remote`](h2::Error::is_remote) and
//!     [`reason`](h2::Error::reason) `REFUSED_STREAM` (RFC 9113 §8.7: "the stream was
//!     closed prior to any processing");
//!   - a GOAWAY whose last stream id is below the attempt's stream: h2 gives exactly
//!     those streams an [`h2::Error`] with [`is_go_away`](h2::Error::is_go_away) and
//!     [`is_remote`](h2::Error::is_remote) (`Streams::recv_go_away` resets each stream
//!     above `last_stream_id`; streams at or below it go on, and end with their own
//!     response or an I/O error if the connection then breaks).
//!
//!   A6 retries these once per call.
//!
//! Everything else may have run: a connection reset, a broken pipe, a GOAWAY error the
//! client's own h2 made, a stream reset for any other reason. Those are left to the retry
//! policy, with the call's key. So are connect failures ([`tonic::ConnectError`]):
//! nothing was sent, but the channel is not ready, and a call without `waitForReady`
//! fails fast then, as gRPC's do (with `waitForReady` the layer waits for the channel).
//!
//! After the client's h2 has read a GOAWAY it opens no stream on that connection
//! (`send_request` fails with the GOAWAY: `Streams::ensure_no_conn_error`), and hyper's
//! connection task stops at its next `poll_ready`, so requests still queued for it end as
//! "connection closed" ([`Unprocessed::Unsent`]). What this cannot see past: a server that
//! closes its connection while the client's frames are still arriving gets them answered
//! by its kernel with a TCP reset, and the client's kernel may drop the GOAWAY the client
//! had not read yet. Its streams then fail as a reset connection, like a stream the
//! server was running, and are retried by the policy, with the key.

use std::error::Error;

/// Why the server's application never saw an attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Unprocessed {
    /// The request never left the client: resent without limit, under the deadline.
    Unsent,
    /// The server refused the stream before any processing (`REFUSED_STREAM`, or a
    /// GOAWAY below it): resent once per call.
    Refused,
}

/// What `err` (an attempt's error, with its whole source chain) says about the server's
/// application: `None` when it may have seen the request.
pub(crate) fn unprocessed(err: &(dyn Error + 'static)) -> Option<Unprocessed> {
    let mut cause = Some(err);
    while let Some(e) = cause {
        if let Some(h) = e.downcast_ref::<hyper::Error>()
            && h.is_canceled()
        {
            return Some(Unprocessed::Unsent);
        }
        if let Some(h2) = e.downcast_ref::<h2::Error>() {
            return refused(h2).then_some(Unprocessed::Refused);
        }
        cause = e.source();
    }
    None
}

/// Whether an h2 stream error says the server processed nothing of the stream.
fn refused(e: &h2::Error) -> bool {
    if !e.is_remote() {
        return false;
    }
    (e.is_reset() && e.reason() == Some(h2::Reason::REFUSED_STREAM)) || e.is_go_away()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::BoxError;

    /// `inner` as tonic's channel hands it over: boxed, under a wrapper with a source.
    #[derive(Debug)]
    struct Wrapped(BoxError);
    impl std::fmt::Display for Wrapped {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("transport error")
        }
    }
    impl Error for Wrapped {
        fn source(&self) -> Option<&(dyn Error + 'static)> {
            Some(self.0.as_ref())
        }
    }

    fn of(e: BoxError) -> Option<Unprocessed> {
        let wrapped = Wrapped(e);
        unprocessed(&wrapped)
    }

    #[test]
    fn only_refusals_and_unsent_requests_qualify() {
        // A reason made locally (h2's `From<Reason>`) is not the server's refusal.
        assert_eq!(
            of(Box::new(h2::Error::from(h2::Reason::REFUSED_STREAM))),
            None
        );
        assert_eq!(of(Box::new(h2::Error::from(h2::Reason::NO_ERROR))), None);
        assert_eq!(of(Box::new(tonic::ConnectError("refused".into()))), None);
        assert_eq!(of("REFUSED_STREAM canceled".into()), None);
    }
}
