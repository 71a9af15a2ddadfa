//! Metadata names idem reads and writes, and the `google.rpc.ErrorInfo` vocabulary of the
//! errors its layers make (so clients can tell them from handler errors).
//!
//! Every header is a [`HeaderName`] constant, usable directly with `http::HeaderMap`
//! (`headers.get(GRPC_TIMEOUT)`); a tonic `MetadataMap` reads them as `NAME.as_str()`.

use http::HeaderName;

/// The idempotency key header (the default; configurable in the `idem` object).
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("x-idempotency-key");
/// Set to `true` on a response the server layer replayed from its store.
pub const IDEMPOTENCY_REPLAYED: HeaderName = HeaderName::from_static("x-idempotency-replayed");
/// gRFC A6 server pushback, in milliseconds; `-1` (any negative) means "do not retry".
pub const RETRY_PUSHBACK_MS: HeaderName = HeaderName::from_static("grpc-retry-pushback-ms");
/// gRFC A6: how many attempts preceded this one.
pub const PREVIOUS_RPC_ATTEMPTS: HeaderName = HeaderName::from_static("grpc-previous-rpc-attempts");
/// The status code of a Trailers-Only response or of the trailers.
pub const GRPC_STATUS: HeaderName = HeaderName::from_static("grpc-status");
/// The gRPC deadline header.
pub const GRPC_TIMEOUT: HeaderName = HeaderName::from_static("grpc-timeout");
/// Binary `google.rpc.Status` with details (RetryInfo, ErrorInfo).
pub const GRPC_STATUS_DETAILS: HeaderName = HeaderName::from_static("grpc-status-details-bin");

/// Internal: set by the client layer on a failure it returns after exhausting retries
/// while serving an inbound call; the server side swaps it for
/// `grpc-retry-pushback-ms: -1` and never lets it leave the process.
pub const DOWNSTREAM_EXHAUSTED: HeaderName = HeaderName::from_static("x-idem-downstream-exhausted");

/// Local: the client layer's `CallOutcome` for a failed call, readable from the
/// `Status` metadata by the caller in this process. Never sent upstream (the server side
/// strips it).
pub const RETRY_OUTCOME: HeaderName = HeaderName::from_static("x-idem-retry-outcome");
/// Local: attempts the client layer made for a failed call (as [`RETRY_OUTCOME`]).
pub const RETRY_ATTEMPTS: HeaderName = HeaderName::from_static("x-idem-retry-attempts");

/// The `ErrorInfo.domain` of every error an idem layer makes.
pub const ERROR_DOMAIN: &str = "idem";

/// `ErrorInfo.reason` values of the errors idem's layers make. Stable: clients match on them.
pub mod reason {
    /// A protected method was called without a key (INVALID_ARGUMENT).
    pub const KEY_MISSING: &str = "KEY_MISSING";
    /// The key breaks the format rule (INVALID_ARGUMENT).
    pub const KEY_INVALID: &str = "KEY_INVALID";
    /// The key was used before with a different request (FAILED_PRECONDITION).
    pub const KEY_REUSED: &str = "KEY_REUSED";
    /// A call with this key is running and the method's policy is ABORT (ABORTED).
    pub const IN_PROGRESS: &str = "IN_PROGRESS";
    /// The store could not answer (UNAVAILABLE).
    pub const STORE_UNAVAILABLE: &str = "STORE_UNAVAILABLE";
    /// No tenant could be resolved for a protected call (UNAUTHENTICATED).
    pub const TENANT_MISSING: &str = "TENANT_MISSING";
    /// The server layer has no tenant source configured, so it refuses every protected
    /// call (FAILED_PRECONDITION): a server misconfiguration, nothing the caller can fix.
    pub const TENANT_SOURCE_MISSING: &str = "TENANT_SOURCE_MISSING";
    /// The request body is over the method's buffering limit (RESOURCE_EXHAUSTED).
    pub const REQUEST_TOO_LARGE: &str = "REQUEST_TOO_LARGE";
    /// The call completed but its response was over the size limit and was not kept
    /// (FAILED_PRECONDITION); it will not run again.
    pub const RESPONSE_NOT_RETAINED: &str = "RESPONSE_NOT_RETAINED";
    /// The request uses a `grpc-encoding` the layer cannot decode (UNIMPLEMENTED).
    pub const ENCODING_UNSUPPORTED: &str = "ENCODING_UNSUPPORTED";
    /// The store, or the tenant's share of it, is at its bound (RESOURCE_EXHAUSTED, with
    /// a retry delay). Nothing ran.
    pub const STORE_FULL: &str = "STORE_FULL";
    /// The server is running as many protected handlers as it allows
    /// (RESOURCE_EXHAUSTED, with a retry delay). Nothing ran. The `ErrorInfo` metadata
    /// `bound` says which bound: `handlers` (`idem.maxHandlersInFlight`),
    /// `tenant_handlers` (`idem.maxHandlersPerTenant`) or `detached_handlers`
    /// (`idem.maxDetachedHandlers`: runs whose caller went away).
    pub const OVERLOADED: &str = "OVERLOADED";
    /// Too many duplicates are waiting for calls in progress: the layer's
    /// `idem.maxWaiters`, or the caller's tenant's `idem.maxWaitersPerTenant`
    /// (RESOURCE_EXHAUSTED, with a retry delay; the `ErrorInfo` metadata `bound` says
    /// which: `waiters` or `tenant_waiters`). Nothing ran.
    pub const TOO_MANY_WAITING: &str = "TOO_MANY_WAITING";
    /// The call in progress that this duplicate waited for ended without an outcome to
    /// replay (it was released, or its lease ended). A waiting duplicate keeps the
    /// request's fingerprint, not its body, so it cannot run in its place: it answers
    /// UNAVAILABLE with a short retry delay, and the retry (which carries the request)
    /// runs.
    pub const IN_PROGRESS_ENDED: &str = "IN_PROGRESS_ENDED";
    /// The request's messages are not well-formed protobuf (INVALID_ARGUMENT). Nothing
    /// ran and the key stays free for a corrected request.
    pub const REQUEST_MALFORMED: &str = "REQUEST_MALFORMED";
    /// Retries were exhausted downstream (set with `grpc-retry-pushback-ms: -1`).
    pub const RETRIES_EXHAUSTED: &str = "RETRIES_EXHAUSTED";
    /// The client layer's circuit breaker is open (UNAVAILABLE, with a retry delay):
    /// nothing was sent, so the key was never used and a retry with it is safe.
    pub const CIRCUIT_OPEN: &str = "CIRCUIT_OPEN";
    /// PostgreSQL: another run took the call's record over while this one ran; this
    /// run's writes were rolled back (ABORTED).
    pub const LEASE_LOST: &str = "LEASE_LOST";
    /// PostgreSQL: the transaction lost a race with a concurrent one (serialization
    /// failure, deadlock, lock not available) and was rolled back (ABORTED, with a retry
    /// delay).
    pub const TX_CONFLICT: &str = "TX_CONFLICT";
    /// PostgreSQL: a database constraint rejected the call's writes (FAILED_PRECONDITION).
    pub const CONSTRAINT_VIOLATED: &str = "CONSTRAINT_VIOLATED";
    /// PostgreSQL: the database rejected a value in the call's writes (INVALID_ARGUMENT).
    pub const VALUE_REJECTED: &str = "VALUE_REJECTED";
    /// PostgreSQL: the transaction failed in a way only the server can fix (INTERNAL).
    pub const TX_FAILED: &str = "TX_FAILED";
}
