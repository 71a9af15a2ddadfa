//! The attempt loop of a retried call: read what the caller has ready of the request
//! into its [`RequestCopy`], send an attempt ([`Run::attempt`], the one way an attempt
//! goes out, for the first attempt's fast path and the loop alike), ask
//! [`policy::decide`] ([`Run::settle`]), wait, repeat; then answer the caller.
//!
//! Everything A6 decides lives in [`policy`]; this file does the I/O, the clock, the
//! counters and the tracing around it.

use std::future::poll_fn;
use std::task::Context;
use std::time::Duration;

use bytes::Bytes;
use http::HeaderValue;
use http::request::Parts;
use idem_core::config::{HedgingPolicy, RetryPolicy};
use idem_core::deadline::encode_grpc_timeout;
use idem_core::headers::{GRPC_TIMEOUT, PREVIOUS_RPC_ATTEMPTS};
use tokio::time::Instant;
use tower_service::Service;

use crate::BoxError;
use crate::retry::engine::context::{Attempt, CallContext};
use crate::retry::engine::timed::{Cut, Receive, Timed};
use crate::retry::engine::transparent::{Resend, TransparentState};
use crate::retry::outcome::{AttemptEnd, CallOutcome, CallReport};
use crate::retry::policy::gate::Guards;
use crate::retry::policy::throttle::RetryThrottle;
use crate::retry::policy::{
    self, AttemptBounds, Attempted, CallState, Decision, RetryLimits, decide,
};
use crate::retry::request::RequestCopy;
use crate::retry::request::check::RequestCheck;
use crate::retry::response::unprocessed::Unprocessed;
use crate::retry::{Req, Resp};

/// A call that may send more than one attempt: its context, and its plan (the retry or
/// hedging policy, `waitForReady`).
pub(crate) struct CallPlan {
    pub(crate) cx: CallContext,
    /// `None`: one attempt (a method without a retry policy, here for `waitForReady`).
    pub(crate) policy: Option<RetryPolicy>,
    /// `Some`: the call is hedged ([`race::run`](crate::retry::engine::race::run)), not retried.
    pub(crate) hedging: Option<HedgingPolicy>,
    pub(crate) wait_for_ready: bool,
}

/// What `waitForReady` does after an attempt the channel could not send.
pub(crate) enum NotReady {
    /// Send it again after this wait.
    Wait(Duration),
    /// Stop waiting: the caller gets this, with this outcome.
    GiveUp(Attempt, CallOutcome),
}

/// `waitForReady`: the waits since the channel failed to connect (reset once an attempt
/// is sent), and when a call without a deadline stops waiting for it.
#[derive(Debug, Default)]
pub(crate) struct ReadyWait {
    waits: u32,
    until: Option<Instant>,
}

impl CallPlan {
    /// Reads what the caller has ready of `source`, without waiting for more (see
    /// [`RequestCopy::read`]). `Err` with the status when a request message is over
    /// `maxRequestMessageBytes`: nothing is sent.
    pub(crate) fn read_request(
        &self,
        source: tonic::body::Body,
        cx: &mut Context<'_>,
    ) -> Result<RequestCopy, tonic::Status> {
        let check = self
            .cx
            .limits
            .request
            .zip(self.cx.fault.clone())
            .map(|(limit, fault)| RequestCheck::new(limit, fault));
        let budget = self.cx.shared.budget.clone();
        let cap = self.cx.settings.max_replay_bytes_per_call();
        let hedged = self.hedging.is_some();
        RequestCopy::read(source, budget, cap, check, hedged, cx).ok_or_else(|| {
            self.cx.request_fault().unwrap_or_else(|| {
                tonic::Status::resource_exhausted("request message over maxRequestMessageBytes")
            })
        })
    }

    /// The request of attempt number `attempts` (1-based): `grpc-previous-rpc-attempts`
    /// on retries, `grpc-timeout` rewritten to the time left.
    pub(crate) fn request(
        &self,
        parts: &Parts,
        body: tonic::body::Body,
        attempts: u32,
    ) -> http::Request<tonic::body::Body> {
        let mut req = http::Request::from_parts(parts.clone(), body);
        let headers = req.headers_mut();
        if attempts > 1 {
            headers.insert(PREVIOUS_RPC_ATTEMPTS, HeaderValue::from(attempts - 1));
        } else {
            headers.remove(PREVIOUS_RPC_ATTEMPTS);
        }
        if let Some(d) = self.cx.deadline {
            let left = d.saturating_duration_since(Instant::now());
            headers.insert(GRPC_TIMEOUT, encode_grpc_timeout(left));
        }
        req
    }

    /// An attempt's response future, sent now: cut short at the call's deadline, or at
    /// `perAttemptRecvTimeout` from now.
    pub(crate) fn timed<F>(&self, fut: F) -> Timed<F> {
        let recv_timeout = self
            .policy
            .as_ref()
            .and_then(RetryPolicy::per_attempt_recv_timeout)
            .and_then(|t| Instant::now().checked_add(t));
        Timed::new(fut, Cut::earliest(self.cx.deadline, recv_timeout))
    }

    /// Awaits one attempt's response headers (and, with `peek`, its first body frame,
    /// under the same cut; headers commit the call, so a cut after them ends only the
    /// peek).
    pub(crate) fn receive<F>(&self, attempt: Timed<F>, peek: bool) -> Receive<F> {
        Receive::new(attempt, self.cx.deadline, peek)
    }

    /// Before an attempt: a passed deadline ends the call.
    fn expired(&self, ready: &ReadyWait) -> Option<Attempt> {
        if self.cx.deadline.is_none_or(|d| d > Instant::now()) {
            return None;
        }
        Some(match ready.waits {
            0 => Attempt::Deadline,
            _ => Attempt::Local(tonic::Status::deadline_exceeded(
                "deadline exceeded while waiting for the channel to become ready",
            )),
        })
    }

    /// `waitForReady` after an attempt the channel could not send: the wait before sending
    /// it again, or how the call ends (at its deadline, or after the layer's limit
    /// without one).
    pub(crate) fn not_ready(&self, ready: &mut ReadyWait, attempt: &Attempt) -> NotReady {
        let now = Instant::now();
        let limit = self.cx.settings.wait_for_ready_limit();
        let end = match self.cx.deadline {
            Some(deadline) => deadline,
            None => *ready
                .until
                .get_or_insert_with(|| now.checked_add(limit).unwrap_or(now)),
        };
        let left = end.saturating_duration_since(now);
        if let Some(wait) = policy::ready_wait(ready.waits, left, self.cx.shared.jitter.as_ref()) {
            ready.waits += 1;
            return NotReady::Wait(wait);
        }
        if self.cx.deadline.is_some() {
            let status = tonic::Status::deadline_exceeded(
                "deadline exceeded while waiting for the channel to become ready",
            );
            return NotReady::GiveUp(Attempt::Local(status), CallOutcome::Deadline);
        }
        let cause = match attempt {
            Attempt::Error(e) => connect_cause(e),
            _ => String::new(),
        };
        let status = tonic::Status::unavailable(format!(
            "the channel did not become ready within {limit:?} (waitForReady): {cause}"
        ));
        NotReady::GiveUp(Attempt::Local(status), CallOutcome::NotReady)
    }

    /// What bounds the next attempt (or hedge), as of now.
    pub(crate) fn bounds(&self, copy: &RequestCopy) -> AttemptBounds {
        AttemptBounds {
            sent_once: copy.sent_once(),
            time_left: self
                .cx
                .deadline
                .map(|d| d.saturating_duration_since(Instant::now())),
            min_attempt_time: self.cx.settings.min_attempt_time(),
            max_retry_delay: self.cx.settings.max_retry_delay(),
        }
    }

    /// What follows an attempt: A6's decision for a call with a retry policy, one
    /// attempt without.
    fn decide(
        &self,
        state: &mut CallState,
        attempted: &Attempted,
        copy: &RequestCopy,
        throttle: Option<&RetryThrottle>,
    ) -> Decision {
        let Some(policy) = &self.policy else {
            return Decision::Done(CallOutcome::without_policy(attempted.end));
        };
        let limits = RetryLimits {
            policy,
            bounds: self.bounds(copy),
            jitter: self.cx.shared.jitter.as_ref(),
        };
        let gate = Guards {
            throttle,
            breaker: self.cx.breaker(),
            ..self.cx.settings.guards()
        };
        decide(state, attempted, &limits, gate)
    }
}

/// A retrying call between its attempts: what the next one needs, and what the call has
/// seen so far.
///
/// The layer sends the first attempt of most calls itself, on the service it was handed
/// ready, and the response future awaits it without an allocation; [`Run::run`], the
/// loop, takes over (boxed, on a clone of the service) when a retry is due, or from the
/// start for the calls that need more than one await per attempt (`waitForReady`, the
/// early-trailers peek).
pub(crate) struct Run {
    parts: Parts,
    copy: RequestCopy,
    call: CallPlan,
    /// Peeking at the response for a streaming request would hold its headers back from
    /// a caller that may wait for them before it sends more.
    peek: bool,
    state: CallState,
    ready: ReadyWait,
    /// gRFC A6 transparent retries used, and when a call without a deadline stops
    /// resending a request that never left the client.
    transparent: TransparentState,
    unsent_until: Option<Instant>,
    /// The next attempt is a transparent resend: it does not count as an attempt.
    resending: bool,
    report: CallReport,
}

/// What follows an attempt.
pub(crate) enum AfterAttempt {
    /// The caller's answer.
    Answer(Resp),
    /// Another attempt after this wait (or the same one again, while `waitForReady`
    /// waits for the channel).
    After(Duration),
}

impl Run {
    /// Reads what the caller has ready of the request, without waiting for more. `Err`
    /// with the caller's answer when a request message is over
    /// `maxRequestMessageBytes`: nothing is sent.
    #[expect(
        clippy::result_large_err,
        reason = "the answer is smaller than the call it replaces, and rare"
    )]
    pub(crate) fn start(
        parts: Parts,
        source: tonic::body::Body,
        call: CallPlan,
        cx: &mut Context<'_>,
    ) -> Result<Self, Resp> {
        let copy = match call.read_request(source, cx) {
            Ok(copy) => copy,
            Err(status) => {
                let report = CallReport::new(CallOutcome::MessageTooLarge);
                return Err(call.cx.finish(Attempt::Local(status), report));
            }
        };
        // Peeking is for the retry decision: a call without a policy has none to make
        // (transparent retries follow transport errors only).
        let decides = call.policy.is_some() || call.wait_for_ready;
        Ok(Run {
            peek: decides && call.cx.settings.peek_early_trailers() && copy.is_whole(),
            parts,
            copy,
            call,
            state: CallState::default(),
            ready: ReadyWait::default(),
            transparent: TransparentState::default(),
            unsent_until: None,
            resending: false,
            report: CallReport::new(CallOutcome::Committed),
        })
    }

    /// Whether an attempt needs the loop: a peek awaits the response's first frame, and
    /// `waitForReady` resends without counting.
    pub(crate) fn needs_loop(&self) -> bool {
        self.peek || self.call.wait_for_ready
    }

    /// The call's deadline.
    pub(crate) fn deadline(&self) -> Option<Instant> {
        self.call.cx.deadline
    }

    /// Sends the next attempt (or, while `waitForReady` waits, the same one again) on
    /// `svc`, which is ready: its response future, cut at the deadline or the receive
    /// timeout, and when it was sent; `Err` with the caller's answer when the deadline
    /// has passed. The one way an attempt goes out: the first attempt's fast path (the
    /// layer's `call`, then [`ResponseFuture`](crate::retry::future::ResponseFuture)) and
    /// the loop ([`Run::run`]) both send through it, and hand what came back to
    /// [`Run::settle`].
    #[expect(
        clippy::result_large_err,
        reason = "the answer is smaller than the attempt it replaces, and rare"
    )]
    pub(crate) fn attempt<S: Service<Req>>(
        &mut self,
        svc: &mut S,
    ) -> Result<(Timed<S::Future>, Instant), Resp> {
        if let Some(attempt) = self.call.expired(&self.ready) {
            return Err(self.answer(attempt, CallOutcome::Deadline));
        }
        // A transparent resend is not a retry: the breaker does not stop it.
        if !self.resending
            && self.state.attempts > 0
            && self.ready.waits == 0
            && let Some(b) = self.call.cx.breaker()
            && let Some((status, outcome)) = b.refuse_retry(self.call.cx.path.as_str())
        {
            // The breaker opened (or stopped retries) during the wait: the retry is not sent.
            return Err(self.answer(Attempt::Local(status), outcome));
        }
        if std::mem::take(&mut self.resending) {
            self.call.cx.shared.stats.transparent();
            self.call.cx.attempt_started();
        } else if self.ready.waits == 0 {
            self.state.attempts += 1;
            self.call.cx.shared.stats.attempt(self.state.attempts == 1);
            self.call.cx.attempt_started();
        }
        let started = Instant::now();
        let req = self
            .call
            .request(&self.parts, self.copy.body(0), self.state.attempts);
        Ok((self.call.timed(svc.call(req)), started))
    }

    /// The loop on `svc`, from before an attempt (after `wait`, if any): wait, attempt,
    /// decide. `svc` is ready for the first attempt of a call, and polled ready again
    /// for any other.
    pub(crate) async fn run<S, RB>(
        mut self,
        mut svc: S,
        mut wait: Option<Duration>,
    ) -> Result<Resp, S::Error>
    where
        S: Service<Req, Response = http::Response<RB>>,
        S::Error: Into<BoxError>,
        RB: http_body::Body<Data = Bytes> + Send + 'static,
        RB::Error: Into<BoxError>,
    {
        loop {
            if let Some(wait) = wait.take() {
                sleep(wait).await;
            }
            if self.state.attempts > 0 {
                // A service that stays busy (a full channel buffer, a rate limit) is
                // waited for only until the deadline: the call ends there.
                match ready_until(&mut svc, self.call.cx.deadline).await {
                    Some(Ok(())) => {}
                    Some(Err(e)) => {
                        let e = Attempt::Error(e.into());
                        return Ok(self.answer(e, CallOutcome::ServiceError));
                    }
                    None => {
                        let attempt = self.call.expired(&self.ready);
                        let attempt = attempt.unwrap_or(Attempt::Deadline);
                        return Ok(self.answer(attempt, CallOutcome::Deadline));
                    }
                }
            }
            let (sent, started) = match self.attempt(&mut svc) {
                Ok(sent) => sent,
                Err(answer) => return Ok(answer),
            };
            let received = self.call.receive(sent, self.peek).await;
            let took = received.at.saturating_duration_since(started);
            match self.settle(received.attempt, took) {
                AfterAttempt::Answer(answer) => return Ok(answer),
                AfterAttempt::After(next) => wait = Some(next),
            }
        }
    }

    /// What follows an attempt that `took` this long (to its response headers, or its
    /// end): the caller's answer, or another attempt after a wait.
    pub(crate) fn settle(&mut self, attempt: Attempt, took: Duration) -> AfterAttempt {
        let call = &self.call;
        if call.cx.request_fault().is_some() {
            // A request message was over its limit: the stream was reset, and the rest of
            // the request must never be replayed as if it were complete.
            self.copy.retire(0);
            self.report.record(attempt.observe().end, took);
            return AfterAttempt::Answer(self.answer(attempt, self.report.outcome));
        }
        if let Some(why) = attempt.unprocessed()
            && self.copy.can_resend()
        {
            match self.transparent_retry(why) {
                Resend::After(wait) => {
                    tracing::debug!(?why, wait_ms = millis(wait), "transparent retry");
                    self.copy.retire(0);
                    self.report.transparent += 1;
                    self.resending = true;
                    return AfterAttempt::After(wait);
                }
                Resend::Stop => {
                    self.copy.retire(0);
                    self.report.record(attempt.observe().end, took);
                    let outcome = match self.call.cx.deadline {
                        Some(_) => CallOutcome::Deadline,
                        None => CallOutcome::NotReady,
                    };
                    return AfterAttempt::Answer(self.answer(attempt, outcome));
                }
                Resend::ToPolicy => {}
            }
        }
        let call = &self.call;
        if call.wait_for_ready && attempt.never_sent() && self.copy.can_resend() {
            self.copy.retire(0);
            return match call.not_ready(&mut self.ready, &attempt) {
                NotReady::Wait(wait) => {
                    tracing::debug!(
                        wait_ms = millis(wait),
                        "waiting for the channel to be ready"
                    );
                    AfterAttempt::After(wait)
                }
                NotReady::GiveUp(answer, outcome) => {
                    AfterAttempt::Answer(self.answer(answer, outcome))
                }
            };
        }
        self.ready = ReadyWait::default();
        let attempted = attempt.observe();
        self.report.record(attempted.end, took);
        call.cx.attempt_ended(attempted.end);
        if attempted.end == AttemptEnd::Committed {
            self.copy.commit(0);
        }
        let throttle = call.cx.settings.throttle();
        match call.decide(&mut self.state, &attempted, &self.copy, throttle) {
            Decision::Done(outcome) => {
                if attempted.end != AttemptEnd::Committed {
                    // Only a committed attempt goes on with the request.
                    self.copy.retire(0);
                }
                if let Some(t) = throttle.filter(|_| attempted.end.is_success()) {
                    t.record_success();
                }
                AfterAttempt::Answer(self.answer(attempt, outcome))
            }
            Decision::RetryAfter(wait) => {
                self.report.waited(wait);
                tracing::debug!(
                    attempt = self.state.attempts,
                    end = %attempted.end,
                    wait_ms = millis(wait),
                    "retrying"
                );
                drop(attempt);
                self.copy.retire(0);
                AfterAttempt::After(wait)
            }
        }
    }

    /// What A6's transparent retries do after an attempt the server's application never
    /// saw, with the time left to the deadline (without one: to the layer's
    /// `wait_for_ready_limit` from the first such attempt).
    fn transparent_retry(&mut self, why: Unprocessed) -> Resend {
        let now = Instant::now();
        let end = match self.call.cx.deadline {
            Some(d) => d,
            None => *self.unsent_until.get_or_insert_with(|| {
                let limit = self.call.cx.settings.wait_for_ready_limit();
                now.checked_add(limit).unwrap_or(now)
            }),
        };
        let left = end.saturating_duration_since(now);
        let jitter = self.call.cx.shared.jitter.as_ref();
        self.transparent.next(why, left, jitter)
    }

    /// The caller's answer: `attempt`, with the report and `outcome`.
    fn answer(&mut self, attempt: Attempt, outcome: CallOutcome) -> Resp {
        self.report.outcome = outcome;
        // The call is over: the request head's extensions map carries the report.
        let spare = std::mem::take(&mut self.parts.extensions);
        self.call.cx.finish_into(attempt, self.report, spare)
    }
}

/// What a connect failure says, as tonic's status of it would (the connect error's own
/// message, wherever it is in the chain).
fn connect_cause(e: &BoxError) -> String {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(e.as_ref());
    while let Some(err) = cause {
        if let Some(c) = err.downcast_ref::<tonic::ConnectError>() {
            return c.to_string();
        }
        cause = err.source();
    }
    e.to_string()
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

async fn sleep(wait: Duration) {
    if !wait.is_zero() {
        tokio::time::sleep(wait).await;
    }
}

/// `svc` polled ready, or `None` once `deadline` passes first.
async fn ready_until<S: Service<Req>>(
    svc: &mut S,
    deadline: Option<Instant>,
) -> Option<Result<(), S::Error>> {
    let Some(deadline) = deadline else {
        return Some(poll_fn(|cx| svc.poll_ready(cx)).await);
    };
    let mut cut = std::pin::pin!(tokio::time::sleep_until(deadline));
    poll_fn(|cx| match svc.poll_ready(cx) {
        std::task::Poll::Ready(r) => std::task::Poll::Ready(Some(r)),
        std::task::Poll::Pending => cut.as_mut().poll(cx).map(|()| None),
    })
    .await
}
