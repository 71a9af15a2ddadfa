//! The mechanism of a hedged call (A6 `hedgingPolicy`): send the request, send it again
//! while no hedge has answered, race the hedges, give the caller the first answer that
//! ends the call, and drop the others (their streams are reset).
//!
//! Everything A6 decides lives in [`policy::hedge`](crate::retry::policy::hedge); this file does
//! the I/O, the clock, the counters and the tracing around it. Every hedge carries the
//! same request: the headers the call was given (so the same idempotency key, placed
//! once before the first hedge), `grpc-previous-rpc-attempts` set to the hedge's index,
//! `grpc-timeout` set to the time left, and the same body
//! ([`RequestCopy`]: a copy of a request complete at the start, or the messages of a
//! streaming request so far, then the live stream).
//!
//! With `waitForReady`, a hedge the channel could not send (it could not connect) is not
//! a hedge: it counts for neither `maxAttempts` nor the throttle, and goes out again after
//! the same waits as a retried call's ([`CallPlan::not_ready`]), in place of the next hedge:
//! while the channel cannot connect, one request at a time probes it. The call waits so
//! until its deadline (DEADLINE_EXCEEDED) or, without one, the layer's
//! `wait_for_ready_limit` (UNAVAILABLE), unless a hedge that was sent answers first.

use std::collections::VecDeque;
use std::future::{Future, poll_fn};
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::request::Parts;
use idem_core::config::HedgingPolicy;
use tokio::time::{Instant, Sleep};
use tower_service::Service;

use crate::BoxError;
use crate::retry::Resp;
use crate::retry::engine::attempts::{CallPlan, NotReady, ReadyWait};
use crate::retry::engine::context::Attempt;
use crate::retry::engine::timed::{Receive, Received};
use crate::retry::outcome::{AttemptEnd, CallOutcome, CallReport};
use crate::retry::policy::gate::Guards;
use crate::retry::policy::hedge::{
    self as hedge_policy, HedgeDecision, HedgeLimits, HedgeState, NextHedge,
};
use crate::retry::policy::throttle::RetryThrottle;
use crate::retry::request::RequestCopy;

/// A hedge's [`Receive`], boxed: the race asks whether its headers came.
trait Receiving: Future<Output = Received> + Send {
    fn headers_came(&self) -> bool;
}

impl<F, RB, E> Receiving for Receive<F>
where
    F: Future<Output = Result<http::Response<RB>, E>> + Send,
    RB: http_body::Body<Data = Bytes> + Send + 'static,
    RB::Error: Into<BoxError>,
    E: Into<BoxError>,
{
    fn headers_came(&self) -> bool {
        Receive::headers_came(self)
    }
}

type AttemptFuture<'a> = Pin<Box<dyn Receiving + 'a>>;

/// One hedge on its way.
struct Running<'a> {
    index: u32,
    started: Instant,
    response: AttemptFuture<'a>,
}

/// What the race waits for.
enum Event {
    /// A hedge ended (its position in `running`).
    Ended(usize, Received),
    /// The request passed a replay limit and committed to this hedge.
    Overflowed(u32),
    /// The next hedge is due.
    Due,
    /// The inner service is ready for the hedge that is due.
    Ready,
    /// The inner service failed to become ready.
    NotReady(BoxError),
}

/// The hedges of one call, and what the caller gets when the race ends.
struct Race<'a> {
    call: &'a CallPlan,
    parts: &'a Parts,
    body: &'a RequestCopy,
    policy: &'a HedgingPolicy,
    throttle: Option<&'a RetryThrottle>,
    peek: bool,
    state: HedgeState,
    running: Vec<Running<'a>>,
    /// When the next hedge is due; `None`: no more hedges.
    timer: Option<Pin<Box<Sleep>>>,
    /// The next hedge is due and waits for the inner service to be ready.
    due: bool,
    /// The call's deadline, while a due hedge waits for the service: the wait ends there.
    cut: Option<Pin<Box<Sleep>>>,
    /// `waitForReady`: hedges the channel could not send, to send again (their indices).
    unsent: VecDeque<u32>,
    ready: ReadyWait,
    /// When the last hedge was sent, for the report.
    last_sent: Option<(u32, Instant)>,
    /// The last hedge that failed while others ran: the caller's answer if no other
    /// hedge ends the call.
    last_failure: Option<Attempt>,
    report: CallReport,
}

/// The hedging loop.
pub(crate) async fn run<S, RB>(
    mut svc: S,
    parts: Parts,
    body: tonic::body::Body,
    call: CallPlan,
    policy: HedgingPolicy,
) -> Result<Resp, S::Error>
where
    S: Service<http::Request<tonic::body::Body>, Response = http::Response<RB>>,
    S::Future: Send + 'static,
    S::Error: Into<BoxError> + 'static,
    RB: http_body::Body<Data = Bytes> + Send + 'static,
    RB::Error: Into<BoxError>,
{
    // What the caller has ready of the request is read now, with this task's waker.
    let mut source = Some(body);
    let read = poll_fn(|cx| Poll::Ready(source.take().map(|b| call.read_request(b, cx))));
    let body = match read.await.expect("read once") {
        // Over a replay limit before the first hedge (or unreadable): sent once.
        Ok(body) if body.sent_once().is_some() => {
            return Ok(once(&mut svc, &parts, &body, &call).await);
        }
        Ok(body) => body,
        Err(status) => {
            let report = CallReport::new(CallOutcome::MessageTooLarge);
            return Ok(call.cx.finish(Attempt::Local(status), report));
        }
    };
    if call.cx.deadline.is_some_and(|d| d <= Instant::now()) {
        let report = CallReport::hedged(CallOutcome::Deadline);
        return Ok(call.cx.finish(Attempt::Deadline, report));
    }
    let mut race = Race {
        call: &call,
        parts: &parts,
        body: &body,
        policy: &policy,
        throttle: call.cx.settings.throttle(),
        peek: call.cx.settings.peek_early_trailers() && body.is_whole(),
        state: HedgeState::default(),
        running: Vec::new(),
        timer: None,
        due: false,
        cut: None,
        unsent: VecDeque::new(),
        ready: ReadyWait::default(),
        last_sent: None,
        last_failure: None,
        report: CallReport::hedged(CallOutcome::Committed),
    };
    // The service is ready for the first request: the caller polled it.
    race.send(&mut svc);
    loop {
        let event = poll_fn(|cx| race.poll_event(&mut svc, cx)).await;
        let answer = match event {
            Event::Ended(pos, received) => race.ended(pos, received),
            Event::Overflowed(hedge) => race.overflowed(hedge),
            Event::Due => race.due(),
            // The service became ready only as the deadline passed: no hedge goes out.
            Event::Ready if race.past_deadline() => race.due(),
            Event::Ready => {
                race.send(&mut svc);
                None
            }
            Event::NotReady(e) => race.not_ready(e),
        };
        if let Some(resp) = answer {
            return Ok(resp);
        }
    }
}

impl<'a> Race<'a> {
    /// The first hedge to end, else a commit of the request to one hedge, else the next
    /// hedge due, else the inner service ready for it.
    fn poll_event<S, RB>(&mut self, svc: &mut S, cx: &mut Context<'_>) -> Poll<Event>
    where
        S: Service<http::Request<tonic::body::Body>, Response = http::Response<RB>>,
        S::Error: Into<BoxError>,
    {
        for (pos, r) in self.running.iter_mut().enumerate() {
            if let Poll::Ready(received) = r.response.as_mut().poll(cx) {
                return Poll::Ready(Event::Ended(pos, received));
            }
        }
        if let Poll::Ready(hedge) = self.body.poll_overflow(cx) {
            return Poll::Ready(Event::Overflowed(hedge));
        }
        // A hedge's response headers came (the peek awaits its first frame): they commit
        // the call, so no hedge goes out unless that frame says the hedge failed (its end
        // then plans the next one).
        if self.running.iter().any(|r| r.response.headers_came()) {
            return Poll::Pending;
        }
        if let Some(timer) = self.timer.as_mut()
            && timer.as_mut().poll(cx).is_ready()
        {
            self.timer = None;
            return Poll::Ready(Event::Due);
        }
        if self.due {
            match svc.poll_ready(cx) {
                Poll::Ready(Ok(())) => return Poll::Ready(Event::Ready),
                Poll::Ready(Err(e)) => return Poll::Ready(Event::NotReady(e.into())),
                Poll::Pending => {}
            }
            // A service that stays busy is waited for only until the deadline.
            if let Some(deadline) = self.call.cx.deadline {
                let cut = self
                    .cut
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
                if cut.as_mut().poll(cx).is_ready() {
                    return Poll::Ready(Event::Due);
                }
            }
        }
        Poll::Pending
    }

    /// The call's deadline has passed.
    fn past_deadline(&self) -> bool {
        self.call.cx.deadline.is_some_and(|d| d <= Instant::now())
    }

    /// Sends the next hedge (or one the channel could not send before) on a ready
    /// service, and plans the one after it.
    fn send<S, RB>(&mut self, svc: &mut S)
    where
        S: Service<http::Request<tonic::body::Body>, Response = http::Response<RB>>,
        S::Future: Send + 'a,
        S::Error: Into<BoxError> + 'a,
        RB: http_body::Body<Data = Bytes> + Send + 'static,
        RB::Error: Into<BoxError>,
    {
        self.due = false;
        let now = Instant::now();
        let index = match self.unsent.pop_front() {
            Some(index) => index,
            None => self.new_hedge(now),
        };
        let req = self
            .call
            .request(self.parts, self.body.body(index), index + 1);
        let response = self.call.receive(self.call.timed(svc.call(req)), self.peek);
        self.running.push(Running {
            index,
            started: now,
            response: Box::pin(response),
        });
        let limits = self.limits();
        let next = match hedge_policy::after_send(&mut self.state, &limits) {
            // Hedges the channel could not send still go, one hedging delay apart.
            NextHedge::Never if !self.unsent.is_empty() && self.may_resend() => {
                NextHedge::After(self.policy.hedging_delay)
            }
            next => next,
        };
        self.plan(next);
    }

    /// Counts a new hedge; its index.
    fn new_hedge(&mut self, now: Instant) -> u32 {
        let index = self.state.sent;
        if let Some((previous, at)) = self.last_sent {
            self.report.next_after(previous, now - at);
        }
        self.last_sent = Some((index, now));
        self.state.sent += 1;
        self.report.sent();
        self.call.cx.shared.stats.attempt(index == 0);
        self.call.cx.attempt_started();
        if index > 0 {
            tracing::debug!(hedge = index, "hedging");
        }
        index
    }

    /// The next hedge is due: it goes out once the service is ready, if the throttle and
    /// the deadline still allow it. A hedge the channel could not send goes first,
    /// without asking the throttle again.
    fn due(&mut self) -> Option<Resp> {
        if self.past_deadline() {
            // The hedges running end at the deadline too; with none, the call ends now.
            // No hedge waits for the service any more; one that did was cut by the
            // deadline, not by the last hedge's failure.
            let busy = std::mem::take(&mut self.due);
            self.state.frozen.get_or_insert(CallOutcome::Deadline);
            let waiting = !self.unsent.is_empty();
            self.unsent.clear();
            return self.running.is_empty().then(|| {
                let last = match (waiting, busy) {
                    (true, _) => Attempt::Local(tonic::Status::deadline_exceeded(
                        "deadline exceeded while waiting for the channel to become ready",
                    )),
                    (false, true) => Attempt::Deadline,
                    (false, false) => self.last_failure.take().unwrap_or(Attempt::Deadline),
                };
                self.finish(last, CallOutcome::Deadline)
            });
        }
        if let Some(outcome) = self.body.sent_once() {
            self.state.frozen.get_or_insert(outcome);
        }
        if !self.unsent.is_empty() {
            if self.may_resend() {
                self.due = true;
                return None;
            }
            self.unsent.clear();
        }
        self.state.running = self.running.len() as u32;
        let guards = Guards {
            throttle: self.throttle,
            breaker: self.call.cx.breaker(),
            ..self.call.cx.settings.guards()
        };
        match hedge_policy::may_send(&mut self.state, || guards.hedge()) {
            None => {
                self.due = true;
                None
            }
            Some(HedgeDecision::Continue(next)) => {
                self.plan(next);
                None
            }
            Some(HedgeDecision::Done(outcome)) => {
                let last = self.last_failure.take().unwrap_or(Attempt::Deadline);
                Some(self.finish(last, outcome))
            }
        }
    }

    /// Whether a hedge the channel could not send may still go: only `maxAttempts`, which
    /// counted it when it first went, has stopped new hedges.
    fn may_resend(&self) -> bool {
        matches!(
            self.state.frozen,
            None | Some(CallOutcome::AttemptsExhausted)
        ) && self.body.sent_once().is_none()
    }

    /// A hedge ended: the call ends with it, or the race goes on.
    fn ended(&mut self, pos: usize, received: Received) -> Option<Resp> {
        let done = self.running.remove(pos);
        self.state.running = self.running.len() as u32;
        let Received { attempt, at } = received;
        let took = at.saturating_duration_since(done.started);
        if self.call.cx.request_fault().is_some() {
            // A request message was over its limit: no hedge may send the rest.
            self.report.ended(done.index, attempt.observe().end, took);
            return Some(self.finish(attempt, CallOutcome::MessageTooLarge));
        }
        if self.call.wait_for_ready && attempt.never_sent() {
            return self.wait_for_ready(done, attempt);
        }
        self.ready = ReadyWait::default();
        let attempted = attempt.observe();
        self.report.ended(done.index, attempted.end, took);
        self.call.cx.attempt_ended(attempted.end);
        let limits = self.limits();
        let throttle = self.throttle;
        let decision = hedge_policy::decide(&mut self.state, &attempted, &limits, || {
            throttle.is_none_or(RetryThrottle::record_failure)
        });
        match decision {
            HedgeDecision::Done(outcome) => {
                if attempted.end.is_success() {
                    if let Some(t) = self.throttle {
                        t.record_success();
                    }
                    self.report.won(done.index);
                    self.body.commit(done.index);
                }
                Some(self.finish(attempt, outcome))
            }
            HedgeDecision::Continue(next) => {
                tracing::debug!(hedge = done.index, end = %attempted.end, "hedge failed");
                self.body.retire(done.index);
                self.last_failure = Some(attempt);
                self.plan(next);
                None
            }
        }
    }

    /// `waitForReady`: a hedge the channel could not send uses no attempt and no token;
    /// it goes out again after a wait, in place of the next hedge. The call gives up at
    /// its deadline (or the layer's limit), or when no more hedges may go out, once no
    /// hedge that was sent is left.
    fn wait_for_ready(&mut self, done: Running<'a>, attempt: Attempt) -> Option<Resp> {
        self.body.retire(done.index);
        self.report.ended(
            done.index,
            AttemptEnd::TransportError,
            done.started.elapsed(),
        );
        if !self.may_resend() {
            let why = self.state.frozen.unwrap_or(CallOutcome::NotReady);
            return self.give_up(attempt, why);
        }
        match self.call.not_ready(&mut self.ready, &attempt) {
            NotReady::Wait(wait) => {
                tracing::debug!(
                    hedge = done.index,
                    wait_ms = u64::try_from(wait.as_millis()).unwrap_or(u64::MAX),
                    "waiting for the channel to be ready"
                );
                self.unsent.push_back(done.index);
                self.last_failure = Some(attempt);
                self.plan(NextHedge::After(wait));
                None
            }
            NotReady::GiveUp(answer, outcome) => self.give_up(answer, outcome),
        }
    }

    /// No more requests go out: the call ends with `answer` now, or with the hedges still
    /// running.
    fn give_up(&mut self, answer: Attempt, outcome: CallOutcome) -> Option<Resp> {
        self.unsent.clear();
        self.state.frozen = Some(outcome);
        self.plan(NextHedge::Never);
        if self.running.is_empty() {
            return Some(self.finish(answer, outcome));
        }
        self.last_failure = Some(answer);
        None
    }

    /// The request passed a replay limit and committed to `hedge` (A6: the hedge that sent
    /// the most): the others are cancelled and no more hedges go out.
    fn overflowed(&mut self, hedge: u32) -> Option<Resp> {
        let outcome = self.body.sent_once().unwrap_or(CallOutcome::BodyTooLarge);
        tracing::debug!(
            hedge,
            outcome = outcome.as_str(),
            "request committed to one hedge"
        );
        self.state.frozen.get_or_insert(outcome);
        self.unsent.clear();
        self.plan(NextHedge::Never);
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].index == hedge {
                i += 1;
                continue;
            }
            let r = self.running.remove(i);
            self.body.retire(r.index);
            self.report
                .ended(r.index, AttemptEnd::Cancelled, r.started.elapsed());
        }
        self.state.running = self.running.len() as u32;
        if !self.running.is_empty() {
            return None;
        }
        let last = self.last_failure.take().unwrap_or_else(|| {
            Attempt::Local(tonic::Status::unavailable(
                "the hedge the request committed to was gone",
            ))
        });
        Some(self.finish(last, outcome))
    }

    /// The inner service failed: no more hedges; the call ends when none is running.
    fn not_ready(&mut self, e: BoxError) -> Option<Resp> {
        self.due = false;
        self.unsent.clear();
        self.state.frozen = Some(CallOutcome::ServiceError);
        self.plan(NextHedge::Never);
        self.running
            .is_empty()
            .then(|| self.finish(Attempt::Error(e), CallOutcome::ServiceError))
    }

    fn plan(&mut self, next: NextHedge) {
        self.timer = match next {
            NextHedge::After(wait) => Some(Box::pin(tokio::time::sleep(wait))),
            NextHedge::Never => {
                self.due = false;
                None
            }
        };
    }

    fn limits(&self) -> HedgeLimits<'a> {
        HedgeLimits {
            policy: self.policy,
            bounds: self.call.bounds(self.body),
        }
    }

    /// Cancels the hedges still running (dropping a response resets its stream, and their
    /// request bodies fail) and answers the caller with `attempt`.
    fn finish(&mut self, attempt: Attempt, outcome: CallOutcome) -> Resp {
        for r in self.running.drain(..) {
            self.body.retire(r.index);
            self.report
                .ended(r.index, AttemptEnd::Cancelled, r.started.elapsed());
        }
        self.report.outcome = outcome;
        self.call.cx.finish(attempt, self.report)
    }
}

/// A request over a replay limit before its first hedge: sent once, as a call without a
/// policy (hedging needs the whole request to send it again).
async fn once<S, RB>(svc: &mut S, parts: &Parts, body: &RequestCopy, call: &CallPlan) -> Resp
where
    S: Service<http::Request<tonic::body::Body>, Response = http::Response<RB>>,
    S::Error: Into<BoxError>,
    RB: http_body::Body<Data = Bytes> + Send + 'static,
    RB::Error: Into<BoxError>,
{
    call.cx.shared.stats.attempt(true);
    call.cx.attempt_started();
    let started = Instant::now();
    let attempt = call
        .receive(
            call.timed(svc.call(call.request(parts, body.body(0), 1))),
            false,
        )
        .await
        .attempt;
    let end = attempt.observe().end;
    match end {
        AttemptEnd::Committed => body.commit(0),
        // Only a committed attempt goes on with the request.
        _ => body.retire(0),
    }
    let outcome = match end {
        AttemptEnd::Deadline => CallOutcome::Deadline,
        _ => body.sent_once().unwrap_or(CallOutcome::BodyTooLarge),
    };
    let mut report = CallReport::new(outcome);
    report.record(end, started.elapsed());
    if let Some(t) = call.cx.settings.throttle().filter(|_| end.is_success()) {
        t.record_success();
    }
    call.cx.finish(attempt, report)
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use bytes::Bytes;
    use http_body::Frame;
    use http_body_util::BodyExt;
    use idem_core::config::ServiceConfig;
    use tokio::time::Instant;
    use tonic::body::Body;
    use tower::{Layer, Service, ServiceExt};

    use crate::BoxError;
    use crate::retry::policy::backoff::FixedJitter;
    use crate::retry::tests::late_first_frame;
    use crate::retry::{AttemptEnd, CallOutcome, CallReport, RetryLayer, RetryLayerBuilder};

    const PATH: &str = "/shop.v1.Orders/CreateOrder";

    /// A test service below the layer.
    type Inner = tower::util::BoxCloneService<http::Request<Body>, http::Response<Body>, BoxError>;

    /// The request's `grpc-previous-rpc-attempts`.
    fn previous(req: &http::Request<Body>) -> Option<String> {
        req.headers()
            .get("grpc-previous-rpc-attempts")
            .map(|v| v.to_str().unwrap().to_owned())
    }

    fn layer() -> RetryLayer {
        let config = ServiceConfig::from_json(
            r#"{"methodConfig": [{"name": [{"service": "shop.v1.Orders"}],
                "hedgingPolicy": {"maxAttempts": 3, "hedgingDelay": "0.01s",
                                  "nonFatalStatusCodes": ["UNAVAILABLE"]}}]}"#,
        )
        .unwrap();
        RetryLayer::from_config(&config)
    }

    /// Answers every request UNAVAILABLE (a non-fatal code), counting them.
    fn unavailable(calls: Arc<AtomicU32>) -> Inner {
        Inner::new(tower::service_fn(move |_: http::Request<Body>| {
            calls.fetch_add(1, Ordering::SeqCst);
            async { Ok::<_, BoxError>(tonic::Status::unavailable("busy").into_http()) }
        }))
    }

    /// A request as a test service saw it: when, its `grpc-previous-rpc-attempts`, and
    /// (for `recording`) its body.
    type Received = (Instant, Option<String>, Bytes);
    type Arrived = (Instant, Option<String>);

    /// Reads each request whole, records it (when, `grpc-previous-rpc-attempts`, the
    /// body), then answers UNAVAILABLE.
    fn recording(seen: Arc<Mutex<Vec<Received>>>) -> Inner {
        Inner::new(tower::service_fn(move |req: http::Request<Body>| {
            let seen = seen.clone();
            async move {
                let previous = previous(&req);
                let at = Instant::now();
                let body = req.into_body().collect().await?.to_bytes();
                seen.lock().unwrap().push((at, previous, body));
                Ok::<_, BoxError>(tonic::Status::unavailable("busy").into_http())
            }
        }))
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_still_streaming_is_hedged_and_every_hedge_sends_all_of_it() {
        let seen = Arc::default();
        let layer = layer();
        let mut svc = layer.layer(recording(Arc::clone(&seen)));
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, BoxError>>(4);
        tx.send(Ok(Frame::data(Bytes::from_static(b"\0\0\0\0\x02hi"))))
            .await
            .unwrap();
        let body = http_body_util::StreamBody::new(tokio_stream::wrappers::ReceiverStream::new(rx));
        let req = http::Request::builder()
            .uri(format!("http://test{PATH}"))
            .body(Body::new(body))
            .unwrap();
        let call = ServiceExt::<http::Request<Body>>::ready(&mut svc)
            .await
            .unwrap()
            .call(req);
        let call = tokio::spawn(call);
        // Hedges at 0 and 10 ms get the first message; the rest comes at 15 ms, while
        // both are out. They fail then, and the third hedge goes out at once with the
        // whole request.
        tokio::time::sleep(Duration::from_millis(15)).await;
        tx.send(Ok(Frame::data(Bytes::from_static(b"\0\0\0\0\x03you"))))
            .await
            .unwrap();
        drop(tx);
        let resp = call.await.unwrap().unwrap();
        let report = *resp.extensions().get::<CallReport>().unwrap();
        assert_eq!(report.outcome, CallOutcome::AttemptsExhausted);
        assert_eq!(report.hedges(), Some(3));
        let seen = seen.lock().unwrap().clone();
        assert_eq!(seen.len(), 3);
        let start = seen[0].0;
        for (i, (at, previous, body)) in seen.iter().enumerate() {
            assert_eq!(&body[..], b"\0\0\0\0\x02hi\0\0\0\0\x03you", "hedge {i}");
            assert_eq!(previous.as_deref(), [None, Some("1"), Some("2")][i]);
            assert_eq!(*at - start, Duration::from_millis([0, 10, 15][i]));
        }
        assert_eq!(layer.replay_bytes_held(), 0);
    }

    fn hedged_layer(
        extra: &str,
        builder: impl FnOnce(RetryLayerBuilder) -> RetryLayerBuilder,
    ) -> RetryLayer {
        let config = ServiceConfig::from_json(&format!(
            r#"{{"methodConfig": [{{"name": [{{"service": "shop.v1.Orders"}}], {extra}
                "hedgingPolicy": {{"maxAttempts": 2, "hedgingDelay": "0.05s",
                                  "nonFatalStatusCodes": ["UNAVAILABLE"]}}}}],
                "retryThrottling": {{"maxTokens": 10, "tokenRatio": 0.1}}}}"#
        ))
        .unwrap();
        builder(
            RetryLayer::builder()
                .service_config(config)
                .jitter(FixedJitter(0.5)),
        )
        .build()
        .unwrap()
    }

    /// What a request gets: a connect failure (nothing sent), a response after a wait.
    #[derive(Clone, Copy)]
    enum Answer {
        NotConnected,
        OkAfter(u64),
    }

    /// Answers requests from `script` (then OK at once), recording when each came and its
    /// `grpc-previous-rpc-attempts`.
    fn scripted(script: Vec<Answer>, seen: Arc<Mutex<Vec<Arrived>>>) -> Inner {
        let script = Arc::new(Mutex::new(std::collections::VecDeque::from(script)));
        Inner::new(tower::service_fn(move |req: http::Request<Body>| {
            let previous = previous(&req);
            seen.lock().unwrap().push((Instant::now(), previous));
            let answer = script
                .lock()
                .unwrap()
                .pop_front()
                .unwrap_or(Answer::OkAfter(0));
            async move {
                match answer {
                    Answer::NotConnected => Err(Box::new(tonic::ConnectError(
                        "tcp connect error: Connection refused".into(),
                    )) as BoxError),
                    Answer::OkAfter(ms) => {
                        tokio::time::sleep(Duration::from_millis(ms)).await;
                        Ok(http::Response::new(Body::empty()))
                    }
                }
            }
        }))
    }

    async fn send<S>(svc: &mut S) -> http::Response<Body>
    where
        S: Service<http::Request<Body>, Response = http::Response<Body>, Error = BoxError>,
    {
        let req = http::Request::builder()
            .uri(format!("http://test{PATH}"))
            .body(Body::new(http_body_util::Full::new(Bytes::from_static(
                b"\0\0\0\0\x02hi",
            ))))
            .unwrap();
        ServiceExt::<http::Request<Body>>::ready(svc)
            .await
            .unwrap()
            .call(req)
            .await
            .unwrap()
    }

    fn gaps(seen: &[Arrived]) -> Vec<u64> {
        seen.windows(2)
            .map(|w| (w[1].0 - w[0].0).as_millis() as u64)
            .collect()
    }

    /// Answers each request from `responses` (then OK), recording when it came.
    fn answering(responses: Vec<http::Response<Body>>, seen: Arc<Mutex<Vec<Arrived>>>) -> Inner {
        let responses = Arc::new(Mutex::new(std::collections::VecDeque::from(responses)));
        Inner::new(tower::service_fn(move |req: http::Request<Body>| {
            seen.lock().unwrap().push((Instant::now(), previous(&req)));
            let next = responses.lock().unwrap().pop_front();
            async move { Ok::<_, BoxError>(next.unwrap_or_else(|| http::Response::new(Body::empty()))) }
        }))
    }

    /// Issue 30, item 8, hedged: with the opt-in peek, the first hedge's headers came at
    /// once and its first message a second later. The headers committed the call: no
    /// hedge goes out after them (two more went, one hedging delay apart), and the report
    /// says when they came.
    #[tokio::test(start_paused = true)]
    async fn no_hedge_goes_out_after_a_hedges_headers() {
        let seen = Arc::default();
        let layer = hedged_layer("", |b| b.retry_headers_then_error(true));
        let late = |_| late_first_frame(Duration::from_secs(1), None);
        let mut svc = layer.layer(answering((0..2).map(late).collect(), Arc::clone(&seen)));
        let start = Instant::now();
        let resp = send(&mut svc).await;
        assert_eq!(start.elapsed(), Duration::from_secs(1));
        let report = *resp.extensions().get::<CallReport>().unwrap();
        assert_eq!(report.outcome, CallOutcome::Committed);
        assert_eq!((report.hedges(), report.winner()), (Some(1), Some(0)));
        let first = *report.history().next().unwrap();
        assert_eq!(
            (first.end, first.took),
            (AttemptEnd::Committed, Duration::ZERO)
        );
        assert_eq!(seen.lock().unwrap().len(), 1);
        let collected = resp.into_body().collect().await.unwrap();
        assert_eq!(&collected.to_bytes()[..], b"\0\0\0\0\0");
    }

    /// ... and when the first frame says the hedge failed (headers, then UNAVAILABLE
    /// trailers), the next hedge goes out then, as after any non-fatal failure.
    #[tokio::test(start_paused = true)]
    async fn a_hedge_whose_peek_finds_an_error_sends_the_next_then() {
        let seen = Arc::default();
        let layer = hedged_layer("", |b| b.retry_headers_then_error(true));
        let failing = late_first_frame(Duration::from_millis(300), Some("14"));
        let mut svc = layer.layer(answering(vec![failing], Arc::clone(&seen)));
        let resp = send(&mut svc).await;
        let report = *resp.extensions().get::<CallReport>().unwrap();
        assert_eq!((report.hedges(), report.winner()), (Some(2), Some(1)));
        let ends: Vec<_> = report.history().map(|r| (r.end, r.took)).collect();
        assert_eq!(
            ends,
            [
                (
                    AttemptEnd::Status(tonic::Code::Unavailable),
                    Duration::from_millis(300)
                ),
                (AttemptEnd::Committed, Duration::ZERO),
            ]
        );
        assert_eq!(gaps(&seen.lock().unwrap()), [300]);
    }

    #[tokio::test(start_paused = true)]
    async fn wait_for_ready_hedges_wait_for_the_channel_without_using_hedges_or_tokens() {
        use Answer::*;
        let seen = Arc::default();
        let layer = hedged_layer(r#""waitForReady": true,"#, |b| b);
        // The channel connects on the third try; that request is slow, so the second
        // hedge goes out one hedgingDelay after it, and wins.
        let script = vec![NotConnected, NotConnected, OkAfter(1000), OkAfter(0)];
        let mut svc = layer.layer(scripted(script, Arc::clone(&seen)));
        let resp = send(&mut svc).await;
        let report = *resp.extensions().get::<CallReport>().unwrap();
        assert_eq!(report.outcome, CallOutcome::Committed);
        assert_eq!((report.hedges(), report.winner()), (Some(2), Some(1)));
        let seen = seen.lock().unwrap().clone();
        // Waits of 100 and 160 ms (jitter at its midpoint) between the tries of the first
        // request, which keeps its index; no hedge goes out while the channel cannot
        // connect; the second hedge 50 ms after the request that got through.
        assert_eq!(gaps(&seen), [100, 160, 50]);
        let previous: Vec<_> = seen.iter().map(|s| s.1.as_deref()).collect();
        assert_eq!(previous, [None, None, None, Some("1")]);
        // No token for the connect failures; one tenth back for the success.
        assert_eq!(layer.throttle().unwrap().milli_tokens(), 10_000);
        let stats = layer.stats().snapshot();
        assert_eq!((stats.attempts, stats.retries), (2, 1));
    }

    #[tokio::test(start_paused = true)]
    async fn wait_for_ready_hedges_wait_until_the_deadline_and_end_with_deadline_exceeded() {
        let seen = Arc::default();
        let layer = hedged_layer(r#""waitForReady": true, "timeout": "1s","#, |b| b);
        let script = vec![Answer::NotConnected; 100];
        let mut svc = layer.layer(scripted(script, Arc::clone(&seen)));
        let start = Instant::now();
        let resp = send(&mut svc).await;
        assert_eq!(start.elapsed(), Duration::from_secs(1));
        let status = tonic::Status::from_header_map(resp.headers()).unwrap();
        assert_eq!(status.code(), tonic::Code::DeadlineExceeded);
        assert_eq!(
            status.message(),
            "deadline exceeded while waiting for the channel to become ready"
        );
        let report = CallReport::from_status(&status).unwrap();
        assert_eq!(
            (report.outcome, report.hedges()),
            (CallOutcome::Deadline, Some(1))
        );
        // One request at a time, every one the first hedge's.
        let seen = seen.lock().unwrap().clone();
        assert!(seen.iter().all(|s| s.1.is_none()), "{seen:?}");
        assert_eq!(gaps(&seen)[..3], [100, 160, 256]);
        assert_eq!(layer.throttle().unwrap().milli_tokens(), 10_000);
    }

    #[tokio::test(start_paused = true)]
    async fn wait_for_ready_hedges_without_a_deadline_give_up_after_the_limit() {
        let layer = hedged_layer(r#""waitForReady": true,"#, |b| {
            b.wait_for_ready_limit(Duration::from_secs(5))
        });
        let script = vec![Answer::NotConnected; 100];
        let mut svc = layer.layer(scripted(script, Arc::default()));
        let start = Instant::now();
        let resp = send(&mut svc).await;
        assert_eq!(start.elapsed(), Duration::from_secs(5));
        let status = tonic::Status::from_header_map(resp.headers()).unwrap();
        assert_eq!(status.code(), tonic::Code::Unavailable);
        assert_eq!(
            status.message(),
            "the channel did not become ready within 5s (waitForReady): tcp connect error: \
             Connection refused"
        );
        let report = CallReport::from_status(&status).unwrap();
        assert_eq!(report.outcome, CallOutcome::NotReady);
        assert_eq!(layer.throttle().unwrap().milli_tokens(), 10_000);
    }

    #[tokio::test(start_paused = true)]
    async fn without_wait_for_ready_a_connect_failure_is_a_failed_hedge() {
        let seen = Arc::default();
        let layer = hedged_layer("", |b| b);
        let script = vec![Answer::NotConnected, Answer::OkAfter(0)];
        let mut svc = layer.layer(scripted(script, Arc::clone(&seen)));
        let resp = send(&mut svc).await;
        let report = *resp.extensions().get::<CallReport>().unwrap();
        // UNAVAILABLE is non-fatal: the next hedge goes out at once, and wins.
        assert_eq!((report.hedges(), report.winner()), (Some(2), Some(1)));
        assert_eq!(gaps(&seen.lock().unwrap()), [0]);
        // The failure took a token; the success gave a tenth back.
        assert_eq!(layer.throttle().unwrap().milli_tokens(), 9_100);

        // Fatal (UNAVAILABLE not listed): the call fails at once.
        let config = ServiceConfig::from_json(
            r#"{"methodConfig": [{"name": [{"service": "shop.v1.Orders"}],
                "hedgingPolicy": {"maxAttempts": 3, "hedgingDelay": "0.05s",
                                  "nonFatalStatusCodes": ["ABORTED"]}}]}"#,
        )
        .unwrap();
        let layer = RetryLayer::from_config(&config);
        let mut svc = layer.layer(scripted(vec![Answer::NotConnected], Arc::default()));
        let start = Instant::now();
        let resp = send(&mut svc).await;
        assert_eq!(start.elapsed(), Duration::ZERO);
        let status = tonic::Status::from_header_map(resp.headers()).unwrap();
        assert_eq!(status.code(), tonic::Code::Unavailable);
        let report = CallReport::from_status(&status).unwrap();
        assert_eq!(
            (report.outcome, report.hedges()),
            (CallOutcome::NonRetryableCode, Some(1))
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_over_the_replay_limit_at_the_start_is_sent_once() {
        // A6: a request that does not fit the buffer is not retried (hedged), "but the
        // original RPC will still be sent".
        let calls = Arc::new(AtomicU32::new(0));
        let config = ServiceConfig::from_json(
            r#"{"methodConfig": [{"name": [{"service": "shop.v1.Orders"}],
                "hedgingPolicy": {"maxAttempts": 3, "hedgingDelay": "0.01s",
                                  "nonFatalStatusCodes": ["UNAVAILABLE"]}}]}"#,
        )
        .unwrap();
        let layer = RetryLayer::builder()
            .service_config(config)
            .max_replay_bytes_per_call(4)
            .build()
            .unwrap();
        let mut svc = layer.layer(unavailable(calls.clone()));
        let resp = send(&mut svc).await;
        let report = *resp.extensions().get::<CallReport>().unwrap();
        assert_eq!(report.outcome, CallOutcome::BodyTooLarge);
        assert_eq!((report.attempts, report.hedges()), (1, None));
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        assert_eq!(layer.replay_bytes_held(), 0);
    }

    /// Ready once (for the caller), then fails `poll_ready`; every request is answered OK
    /// after `answer_after`.
    #[derive(Clone)]
    struct ReadyOnce {
        polls: Arc<AtomicU32>,
        calls: Arc<AtomicU32>,
        answer_after: Duration,
    }

    impl Service<http::Request<Body>> for ReadyOnce {
        type Response = http::Response<Body>;
        type Error = BoxError;
        type Future = std::pin::Pin<
            Box<dyn std::future::Future<Output = Result<http::Response<Body>, BoxError>> + Send>,
        >;
        fn poll_ready(
            &mut self,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Result<(), BoxError>> {
            match self.polls.fetch_add(1, Ordering::SeqCst) {
                0 => std::task::Poll::Ready(Ok(())),
                _ => std::task::Poll::Ready(Err("the channel's worker is gone".into())),
            }
        }
        fn call(&mut self, _: http::Request<Body>) -> Self::Future {
            self.calls.fetch_add(1, Ordering::SeqCst);
            let wait = self.answer_after;
            Box::pin(async move {
                tokio::time::sleep(wait).await;
                Ok(http::Response::new(Body::empty()))
            })
        }
    }

    #[tokio::test(start_paused = true)]
    async fn an_inner_service_that_fails_readiness_sends_no_more_hedges_and_the_one_out_answers() {
        let layer = hedged_layer(r#""waitForReady": true,"#, |b| b);
        let calls = Arc::new(AtomicU32::new(0));
        let mut svc = layer.layer(ReadyOnce {
            polls: Arc::default(),
            calls: calls.clone(),
            answer_after: Duration::from_millis(200),
        });
        let start = Instant::now();
        let resp = send(&mut svc).await;
        // The second hedge was due at 50 ms; the service failed to become ready for it, so
        // it never went out, and the first request's answer came at 200 ms.
        assert_eq!(start.elapsed(), Duration::from_millis(200));
        let report = *resp.extensions().get::<CallReport>().unwrap();
        assert_eq!((report.hedges(), report.winner()), (Some(1), Some(0)));
        assert_eq!(report.outcome, CallOutcome::Committed);
        assert_eq!(calls.load(Ordering::SeqCst), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn hedges_count_as_attempts_and_retries_in_the_stats() {
        let calls = Arc::new(AtomicU32::new(0));
        let layer = layer();
        let mut svc = layer.layer(unavailable(calls.clone()));
        let req = http::Request::builder()
            .uri(format!("http://test{PATH}"))
            .body(Body::new(http_body_util::Full::new(
                bytes::Bytes::from_static(b"\0\0\0\0\x02hi"),
            )))
            .unwrap();
        let resp = ServiceExt::<http::Request<Body>>::ready(&mut svc)
            .await
            .unwrap()
            .call(req)
            .await
            .unwrap();
        let report = *resp.extensions().get::<CallReport>().unwrap();
        assert_eq!(report.outcome, CallOutcome::AttemptsExhausted);
        assert_eq!(report.hedges(), Some(3));
        let stats = layer.stats().snapshot();
        assert_eq!((stats.calls, stats.attempts, stats.retries), (1, 3, 2));
        assert_eq!(stats.outcome(CallOutcome::AttemptsExhausted), 1);
        assert_eq!(calls.load(Ordering::SeqCst), 3);
    }
}
