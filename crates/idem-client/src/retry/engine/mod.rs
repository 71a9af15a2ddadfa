//! The mechanism around the decisions of [`policy`](crate::retry::policy): I/O, the
//! clock, the counters and the tracing.
//!
//! - [`context`]: what every call carries, with or without retries, and how it answers
//!   its caller (the attempt's response, or a Trailers-Only status with the report);
//! - [`attempts`]: the attempt loop of a retried call;
//! - [`race`]: the hedge race of a hedged call;
//! - [`timed`]: an attempt cut short at the deadline or its receive timeout;
//! - [`transparent`]: gRFC A6 transparent retries (after an attempt the server's
//!   application never saw).

pub(crate) mod attempts;
pub(crate) mod context;
pub(crate) mod race;
pub(crate) mod timed;
pub(crate) mod transparent;
