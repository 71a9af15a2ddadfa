//! [`Timed`]: an attempt cut short at the call's deadline or its receive timeout;
//! [`Receive`]: its response, with the opt-in peek at the first body frame under the
//! same cut.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use idem_core::deadline::earliest;
use pin_project_lite::pin_project;
use tokio::time::{Instant, Sleep};

use bytes::Bytes;

use crate::BoxError;
use crate::retry::engine::context::Attempt;
use crate::retry::response::peek::{Peek, early_code};
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

pin_project! {
    /// Awaits one attempt's response headers and, with `peek`, its first body frame
    /// (the opt-in "headers, then error" rule), under the attempt's [`Cut`].
    ///
    /// Response headers commit the call (gRFC A6), with or without the peek: a cut that
    /// comes after them ends the peek, not the attempt. The response goes on, committed,
    /// with its first frame still to come; the deadline then bounds its body as any
    /// other's. Never a receive timeout (so never a retry or a hedge) after headers.
    pub(crate) struct Receive<F> {
        #[pin]
        attempt: Timed<F>,
        deadline: Option<Instant>,
        peek: bool,
        // Set once headers came and the first frame is awaited.
        peeking: Option<(Peek, Instant)>,
        #[pin]
        timer: Option<Sleep>,
    }
}

/// What [`Receive`] gives: how the attempt ended, and when its response headers came
/// (or, for one that failed, when it ended).
pub(crate) struct Received {
    pub(crate) attempt: Attempt,
    pub(crate) at: Instant,
}

impl<F> Receive<F> {
    /// The response of `attempt`, peeked at with `peek`; `deadline` is the call's.
    pub(crate) fn new(attempt: Timed<F>, deadline: Option<Instant>, peek: bool) -> Self {
        Receive {
            attempt,
            deadline,
            peek,
            peeking: None,
            timer: None,
        }
    }

    /// Whether the response headers came and the first frame is awaited: the call is
    /// committed unless that frame says "error".
    pub(crate) fn headers_came(&self) -> bool {
        self.peeking.is_some()
    }
}

impl<F, RB, E> Future for Receive<F>
where
    F: Future<Output = Result<http::Response<RB>, E>>,
    RB: http_body::Body<Data = Bytes> + Send + 'static,
    RB::Error: Into<BoxError>,
    E: Into<BoxError>,
{
    type Output = Received;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Received> {
        let mut this = self.project();
        loop {
            if let Some((mut peek, headers_at)) = this.peeking.take() {
                if let Poll::Ready(first) = peek.poll_first(cx) {
                    let resp = peek.finish(first);
                    // Reshaped as Trailers-Only: the attempt failed when its trailers came.
                    let at = match early_code(&resp) {
                        Some(_) => Instant::now(),
                        None => headers_at,
                    };
                    let attempt = Attempt::Response(resp);
                    return Poll::Ready(Received { attempt, at });
                }
                if let Some(timer) = this.timer.as_mut().as_pin_mut()
                    && timer.poll(cx).is_ready()
                {
                    let attempt = Attempt::Response(peek.into_response());
                    return Poll::Ready(Received {
                        attempt,
                        at: headers_at,
                    });
                }
                *this.peeking = Some((peek, headers_at));
                return Poll::Pending;
            }
            let result = std::task::ready!(this.attempt.as_mut().poll(cx));
            let at = Instant::now();
            match ended(result, *this.deadline) {
                Attempt::Response(r) if *this.peek && early_code(&r).is_none() => {
                    if let Some(cut) = this.attempt.cut() {
                        this.timer.set(Some(tokio::time::sleep_until(cut.at)));
                    }
                    *this.peeking = Some((Peek::new(r), at));
                }
                attempt => return Poll::Ready(Received { attempt, at }),
            }
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
