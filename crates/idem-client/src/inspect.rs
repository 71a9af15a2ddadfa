//! Reading what an idem server said: whether a response was replayed, and the reason of
//! an error the idem layers made themselves.

use tonic_types::StatusExt;

/// Whether an idem server answered `response` from its store (a duplicate of a call that
/// already ran) rather than by running the handler: it carries
/// `x-idempotency-replayed: true`.
///
/// ```
/// let mut response = tonic::Response::new(());
/// assert!(!idem_client::is_replayed(&response));
/// response
///     .metadata_mut()
///     .insert("x-idempotency-replayed", "true".parse().unwrap());
/// assert!(idem_client::is_replayed(&response));
/// ```
pub fn is_replayed<T>(response: &tonic::Response<T>) -> bool {
    response
        .metadata()
        .get(idem_core::headers::IDEMPOTENCY_REPLAYED.as_str())
        .is_some_and(|v| v == "true")
}

/// The `google.rpc.ErrorInfo` reason of an error an idem layer made (domain `idem`), such
/// as `KEY_REUSED` or `STORE_UNAVAILABLE` (the list is `idem_core::headers::reason`);
/// `None` for errors the handler made or that carry no idem reason.
///
/// ```
/// use tonic_types::{ErrorDetails, StatusExt};
/// let status = tonic::Status::with_error_details(
///     tonic::Code::FailedPrecondition,
///     "idempotency key reused with a different request",
///     ErrorDetails::with_error_info("KEY_REUSED", "idem", std::collections::HashMap::<String, String>::new()),
/// );
/// assert_eq!(idem_client::idem_reason(&status).as_deref(), Some("KEY_REUSED"));
/// assert_eq!(idem_client::idem_reason(&tonic::Status::internal("boom")), None);
/// ```
pub fn idem_reason(status: &tonic::Status) -> Option<String> {
    status
        .get_details_error_info()
        .filter(|info| info.domain == idem_core::headers::ERROR_DOMAIN)
        .map(|info| info.reason)
}
