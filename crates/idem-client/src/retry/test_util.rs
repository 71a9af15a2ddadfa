//! Helpers shared by the retry module's tests.

use http::HeaderMap;
use http_body::Body;
use http_body_util::BodyExt;

use super::{CallOutcome, CallReport};

/// A valid retry policy that retries `UNAVAILABLE` only (the one the end-to-end tests
/// use too).
pub(super) use idem_test_support::unavailable_policy;

/// The body's next frame, which must be its trailers.
pub(super) async fn next_trailers<B>(body: &mut B) -> HeaderMap
where
    B: Body + Unpin,
    B::Error: std::fmt::Debug,
{
    body.frame()
        .await
        .unwrap()
        .unwrap()
        .into_trailers()
        .unwrap_or_else(|_| panic!("not trailers"))
}

/// The report of a call that ran out of time, whose status must be DEADLINE_EXCEEDED
/// with a report of [`CallOutcome::Deadline`].
#[track_caller]
pub(super) fn deadline_report(status: &tonic::Status) -> CallReport {
    assert_eq!(status.code(), tonic::Code::DeadlineExceeded, "{status:?}");
    let r = CallReport::from_status(status).unwrap();
    assert_eq!(r.outcome, CallOutcome::Deadline);
    r
}
