//! The copy of the request that every attempt (and every hedge) of a call sends.
//!
//! - [`body`]: the replay budget, the read of what the caller has ready, and the copy of
//!   a request complete before the first attempt;
//! - [`replay`]: the copy of a request that streams, for retries;
//! - [`hedge_body`]: the copy of a request that streams, for hedges.

pub(crate) mod body;
pub(crate) mod hedge_body;
pub(crate) mod replay;
