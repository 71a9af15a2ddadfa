//! Every status the layer itself makes (as opposed to the handler's).
//!
//! Each carries `google.rpc.ErrorInfo` with domain `idem` and a reason from
//! [`idem_core::headers::reason`], so clients can tell them from handler errors.
//! Messages name the problem and what the caller can do; what the store said goes to
//! the logs, never to the caller.

use std::collections::HashMap;
use std::time::Duration;

use idem_core::headers::{self, reason};
use idem_core::key::KEY_RULE;
use tonic::{Code, Status};
use tonic_types::{ErrorDetails, StatusExt};

use super::admission::Bound;

/// The retry delay sent when the store or the layer is at its bound: long enough for
/// in-progress calls to finish, short enough that a client's deadline usually covers it.
pub(crate) const BUSY_RETRY_DELAY: Duration = Duration::from_secs(1);

fn error_info(why: &str) -> ErrorDetails {
    ErrorDetails::with_error_info(why, headers::ERROR_DOMAIN, HashMap::<String, String>::new())
}

pub(crate) fn idem_status(code: Code, message: impl Into<String>, why: &str) -> Status {
    Status::with_error_details(code, message, error_info(why))
}

fn idem_status_retry_after(
    code: Code,
    message: impl Into<String>,
    why: &str,
    delay: Duration,
) -> Status {
    let mut details = error_info(why);
    details.set_retry_info(Some(delay));
    Status::with_error_details(code, message, details)
}

pub(crate) fn key_missing(header: &http::HeaderName) -> Status {
    idem_status(
        Code::InvalidArgument,
        format!("missing idempotency key ({header}): {KEY_RULE}"),
        reason::KEY_MISSING,
    )
}

pub(crate) fn key_repeated(header: &http::HeaderName) -> Status {
    idem_status(
        Code::InvalidArgument,
        format!("idempotency key ({header}) sent more than once: {KEY_RULE}"),
        reason::KEY_INVALID,
    )
}

pub(crate) fn key_invalid(e: impl std::fmt::Display) -> Status {
    idem_status(Code::InvalidArgument, e.to_string(), reason::KEY_INVALID)
}

pub(crate) fn tenant_missing() -> Status {
    idem_status(
        Code::Unauthenticated,
        "no tenant for an idempotent call: authenticate first; if you authenticate with \
         `Server::with_interceptor`/`XServer::with_interceptor`, it runs after this layer: \
         authenticate in a layer before `IdempotencyLayer`, e.g. \
         `tonic::service::InterceptorLayer`",
        reason::TENANT_MISSING,
    )
}

/// The server has no tenant source at all: nothing the caller sends can help, and
/// nothing ran (so FAILED_PRECONDITION, not UNAUTHENTICATED).
pub(crate) fn tenant_source_missing() -> Status {
    idem_status(
        Code::FailedPrecondition,
        "server misconfigured: no tenant source configured: set idem.tenant or \
         IdempotencyLayer::tenant",
        reason::TENANT_SOURCE_MISSING,
    )
}

pub(crate) fn request_too_large(max: usize) -> Status {
    idem_status(
        Code::ResourceExhausted,
        format!("request body over the idempotency buffer limit of {max} bytes"),
        reason::REQUEST_TOO_LARGE,
    )
}

/// A request message that is not well-formed protobuf: the service could not decode it.
pub(crate) fn request_malformed(what: impl std::fmt::Display) -> Status {
    idem_status(
        Code::InvalidArgument,
        format!(
            "request message is not valid protobuf ({what}); fix the request and send it again with the same key"
        ),
        reason::REQUEST_MALFORMED,
    )
}

pub(crate) fn store_unavailable() -> Status {
    idem_status(
        Code::Unavailable,
        "the idempotency store could not answer; retry the call with the same key",
        reason::STORE_UNAVAILABLE,
    )
}

/// [`store_unavailable`] with `google.rpc.RetryInfo`: for a call that saw its record in
/// flight, which must not run and may succeed (replay) once the store answers.
pub(crate) fn store_unavailable_retry_after(delay: Duration) -> Status {
    idem_status_retry_after(
        Code::Unavailable,
        "the idempotency store could not answer while a call with this idempotency key was in progress; retry the call with the same key after the delay",
        reason::STORE_UNAVAILABLE,
        delay,
    )
}

/// The store refused a new record. `bound` names the bound that refused when the store
/// says (`tenant_entries`, `store_bytes`…: the memory store's `MemoryBound`): it goes in
/// the `ErrorInfo` metadata as `bound`. It names the caller's own tenant's bound or the
/// store's, never another tenant's usage.
pub(crate) fn store_full(bound: Option<&'static str>) -> Status {
    let mut details = ErrorDetails::with_error_info(
        reason::STORE_FULL,
        headers::ERROR_DOMAIN,
        bound
            .map(|b| ("bound".to_owned(), b.to_owned()))
            .into_iter()
            .collect::<HashMap<_, _>>(),
    );
    details.set_retry_info(Some(BUSY_RETRY_DELAY));
    Status::with_error_details(
        Code::ResourceExhausted,
        "the idempotency store has no room for another call right now; retry the call with the same key after the delay",
        details,
    )
}

/// The retry delay of a duplicate whose call in progress ended without an outcome: its
/// retry runs at once, so only long enough not to meet the release on its way.
pub(crate) const ENDED_RETRY_DELAY: Duration = Duration::from_millis(100);

/// An `ErrorInfo` of `why` naming `bound` in its metadata, with a retry delay.
fn bound_status(code: Code, message: String, why: &str, bound: Bound, delay: Duration) -> Status {
    let metadata = HashMap::from([("bound".to_owned(), bound.as_str().to_owned())]);
    let mut details = ErrorDetails::with_error_info(why, headers::ERROR_DOMAIN, metadata);
    details.set_retry_info(Some(delay));
    Status::with_error_details(code, message, details)
}

/// No handler run is free under `bound` (of `limit` runs).
pub(crate) fn overloaded(bound: Bound, limit: usize) -> Status {
    let what = match bound {
        Bound::TenantHandlers => "this tenant's idempotent calls",
        Bound::DetachedHandlers => "idempotent calls whose callers went away",
        _ => "idempotent calls",
    };
    bound_status(
        Code::ResourceExhausted,
        format!(
            "the server is running as many {what} as it allows ({limit}, {}); retry the call with the same key after the delay",
            bound.field()
        ),
        reason::OVERLOADED,
        bound,
        BUSY_RETRY_DELAY,
    )
}

/// The call's key is in flight and no room is left to wait under `bound`.
pub(crate) fn too_many_waiting(bound: Bound, limit: usize) -> Status {
    let whose = if bound == Bound::TenantWaiters {
        "this tenant's "
    } else {
        ""
    };
    bound_status(
        Code::ResourceExhausted,
        format!(
            "a call with this idempotency key is in progress and as many of {whose}duplicates wait as the server allows ({limit}, {}); retry the call with the same key after the delay",
            bound.field()
        ),
        reason::TOO_MANY_WAITING,
        bound,
        BUSY_RETRY_DELAY,
    )
}

/// The call in progress this duplicate waited for ended without an outcome to replay;
/// the duplicate kept only its fingerprint, so its retry (with the request) must run.
pub(crate) fn in_progress_ended() -> Status {
    idem_status_retry_after(
        Code::Unavailable,
        "the call in progress with this idempotency key ended without an outcome to replay; retry the call with the same key: it will run",
        reason::IN_PROGRESS_ENDED,
        ENDED_RETRY_DELAY,
    )
}

pub(crate) fn in_progress_aborted(retry_delay: Duration) -> Status {
    idem_status_retry_after(
        Code::Aborted,
        "a call with this idempotency key is in progress",
        reason::IN_PROGRESS,
        retry_delay,
    )
}

pub(crate) fn in_progress_past_deadline() -> Status {
    idem_status(
        Code::DeadlineExceeded,
        "deadline reached while a call with this idempotency key was in progress",
        reason::IN_PROGRESS,
    )
}

pub(crate) fn response_not_retained() -> Status {
    idem_status(
        Code::FailedPrecondition,
        "this key's call already completed, but its response was over the size limit and was not retained; it will not run again",
        reason::RESPONSE_NOT_RETAINED,
    )
}

pub(crate) fn key_reused() -> Status {
    idem_status(
        Code::FailedPrecondition,
        "idempotency key reused with a different request",
        reason::KEY_REUSED,
    )
}

/// A stored response that does not decode: the store holds something the layer did
/// not write (or a newer format).
pub(crate) fn stored_response_unreadable() -> Status {
    idem_status(
        Code::Unavailable,
        "the stored outcome of this key could not be read; retry the call with the same key",
        reason::STORE_UNAVAILABLE,
    )
}

/// The answer to a handler (or its response stream) that panicked. Not an idem error:
/// it is the handler's outcome, stored like any INTERNAL.
pub(crate) fn handler_panicked() -> Status {
    Status::internal("handler panicked")
}

pub(crate) fn handler_task_lost() -> Status {
    Status::internal("the idempotent handler's task ended without a response")
}
