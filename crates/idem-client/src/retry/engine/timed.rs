//! [`Timed`]: an attempt cut short at the call's deadline or its receive timeout.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use idem_core::deadline::earliest;
use pin_project_lite::pin_project;
use tokio::time::{Instant, Sleep};

use bytes::Bytes;

use crate::BoxError;
use crate::retry::engine::context::Attempt;
use crate::retry::response::transport::TransportBody;
use crate::retry::response::wire;

/// When an attempt is cut short, and how it then ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Cut {
    pub(crate) at: Instant,
    /// `true`: `at` is the call's deadline (the attempt ends as
    /// [`Attempt::Deadline`]); `false`: it is `perAttemptRecvTimeout`
    /// ([`Attempt::RecvTimeout`]).
    pub(crate) deadline: bool,
}

impl Cut {
    /// The earlier of the call's deadline and the attempt's receive timeout; a tie is the
    /// deadline's.
    pub(crate) fn earliest(
        deadline: Option<Instant>,
        recv_timeout: Option<Instant>,
    ) -> Option<Cut> {
        earliest([deadline, recv_timeout]).map(|at| Cut {
            at,
            deadline: deadline == Some(at),
        })
    }

    /// How the attempt it cut ends.
    pub(crate) fn attempt(self) -> Attempt {
        if self.deadline {
            Attempt::Deadline
        } else {
            Attempt::RecvTimeout
        }
    }
}

pin_project! {
    /// `fut`, unless its [`Cut`] comes first: then `Err` with the cut.
    ///
    /// The future is polled before the timer, so a response ready at the same instant
    /// wins. The timer is made at the first poll: making a `Timed` needs no runtime.
    pub(crate) struct Timed<F> {
        #[pin]
        fut: F,
        #[pin]
        timer: Option<Sleep>,
        cut: Option<Cut>,
    }
}

impl<F> Timed<F> {
    pub(crate) fn new(fut: F, cut: Option<Cut>) -> Self {
        Timed {
            fut,
            timer: None,
            cut,
        }
    }

    /// When it is cut short.
    pub(crate) fn cut(&self) -> Option<Cut> {
        self.cut
    }
}

/// How a timed attempt ended: the cut that came first, or the inner service's result as
/// of now. An error once the call's `deadline` has passed is the deadline's doing
/// (tonic's channel timeout fires at the `grpc-timeout` the layer wrote), not a
/// transport failure.
pub(crate) fn ended<RB, E>(
    result: Result<Result<http::Response<RB>, E>, Cut>,
    deadline: Option<Instant>,
) -> Attempt
where
    RB: http_body::Body<Data = Bytes> + Send + 'static,
    RB::Error: Into<BoxError>,
    E: Into<BoxError>,
{
    match result {
        Err(cut) => cut.attempt(),
        Ok(Ok(mut resp)) => {
            // What the server wrote is scrubbed, here and in the trailers.
            wire::scrub(resp.headers_mut());
            if resp.body().is_end_stream() {
                return Attempt::Response(resp.map(tonic::body::Body::new));
            }
            // A body still to come reads its transport failures as UNAVAILABLE.
            Attempt::Response(resp.map(|b| tonic::body::Body::new(TransportBody::new(b))))
        }
        Ok(Err(_)) if deadline.is_some_and(|d| d <= Instant::now()) => Attempt::Deadline,
        Ok(Err(e)) => Attempt::Error(e.into()),
    }
}

impl<F: Future> Future for Timed<F> {
    type Output = Result<F::Output, Cut>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        if let Poll::Ready(out) = this.fut.poll(cx) {
            return Poll::Ready(Ok(out));
        }
        let Some(cut) = *this.cut else {
            return Poll::Pending;
        };
        let mut timer = this.timer;
        if timer.is_none() {
            timer.set(Some(tokio::time::sleep_until(cut.at)));
        }
        match timer.as_pin_mut() {
            Some(timer) => timer.poll(cx).map(|()| Err(cut)),
            None => Poll::Pending,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn the_earlier_limit_cuts_and_a_tie_is_the_deadline() {
        let now = Instant::now();
        let (soon, later) = (now + Duration::from_secs(1), now + Duration::from_secs(2));
        let cut = |at, deadline| Some(Cut { at, deadline });
        assert_eq!(Cut::earliest(None, None), None);
        assert_eq!(Cut::earliest(Some(soon), None), cut(soon, true));
        assert_eq!(Cut::earliest(None, Some(soon)), cut(soon, false));
        assert_eq!(Cut::earliest(Some(later), Some(soon)), cut(soon, false));
        assert_eq!(Cut::earliest(Some(soon), Some(later)), cut(soon, true));
        assert_eq!(Cut::earliest(Some(soon), Some(soon)), cut(soon, true));
    }

    #[tokio::test(start_paused = true)]
    async fn a_cut_ends_the_attempt_as_what_it_is() {
        let at = Instant::now() + Duration::from_secs(1);
        let never = std::future::pending::<()>;
        let deadline = Timed::new(never(), Some(Cut { at, deadline: true })).await;
        assert!(matches!(
            deadline.map_err(Cut::attempt),
            Err(Attempt::Deadline)
        ));
        let at = Instant::now() + Duration::from_secs(1);
        let recv = Timed::new(
            never(),
            Some(Cut {
                at,
                deadline: false,
            }),
        )
        .await;
        assert!(matches!(
            recv.map_err(Cut::attempt),
            Err(Attempt::RecvTimeout)
        ));
        let ready = Timed::new(std::future::ready(7), Some(Cut { at, deadline: true })).await;
        assert!(matches!(ready, Ok(7)));
        assert!(matches!(Timed::new(async { 1 }, None).await, Ok(1)));
    }

    #[test]
    fn a_timed_attempt_is_made_outside_a_runtime() {
        let at = Instant::now() + Duration::from_secs(1);
        drop(Timed::new(
            std::future::pending::<()>(),
            Some(Cut { at, deadline: true }),
        ));
    }
}
