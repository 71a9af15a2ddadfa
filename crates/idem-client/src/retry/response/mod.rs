//! What an attempt's response says, and the bounds on the body the caller gets.
//!
//! - [`peek`]: how an attempt ended, from its response head (Trailers-Only detection,
//!   and the opt-in peek at the first body frame);
//! - [`transport`]: connection failures in a response body read as UNAVAILABLE;
//! - [`bound`]: the call's deadline and `maxResponseMessageBytes` over the response
//!   body;
//! - [`unprocessed`]: which failed attempts the server's application never saw (gRFC A6
//!   transparent retries), from the transport's error types;
//! - [`wire`]: what a server's status headers may carry to the caller (no panic in
//!   tonic).

pub(crate) mod bound;
pub(crate) mod peek;
pub(crate) mod transport;
pub(crate) mod unprocessed;
pub(crate) mod wire;
