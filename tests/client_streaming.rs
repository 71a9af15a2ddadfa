//! End-to-end tests of the client retry layer with streaming requests
//! (docs/semantics.md, section 2, "Commit"): a real tonic `Tally` server on 127.0.0.1
//! with a client-streaming method (`Sum`) and a bidirectional one (`Running`), whose
//! handler follows what each call's metadata asks for and records what every attempt
//! received; the generated client drives `RetryLayer` over a `Channel`, fed by a channel
//! the test writes to, so it controls when each request message exists.
//!
//! The commit rules of gRFC A6, as tested here:
//! - response headers commit the call: `bidi_headers_then_an_error_is_not_retried`;
//! - passing the per-call replay limit commits it (no retry; the call goes on):
//!   `a_stream_over_the_per_call_limit_is_sent_once_and_not_retried`,
//!   `a_bidi_call_committed_by_the_per_call_limit_goes_on_after_its_headers`;
//! - passing what is left of the layer's budget commits it:
//!   `concurrent_calls_share_the_layer_budget`;
//! - before either, a retryable status replays the stream and goes on live:
//!   `a_client_stream_that_failed_after_three_messages_is_replayed_whole`,
//!   `bidi_trailers_only_failure_replays_then_ping_pong_goes_on`.
//!
//! Time runs on tokio's paused clock (loopback I/O takes no virtual time), so the deadline
//! test measures exact virtual times.

use idem_test_support::net;
use idem_test_support::stream;

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::future::join_all;
use idem_client::retry::{
    CallOutcome, CallReport, Retry, RetryLayer, RetryLayerBuilder, backoff::FixedJitter,
};
use idem_core::deadline::parse_grpc_timeout;
use stream::tally_client::TallyClient;
use stream::tally_server::{Tally, TallyServer};
use stream::{Number, Total, number, padded};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_stream::Stream;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tonic::metadata::MetadataMap;
use tonic::transport::{Channel, Server};
use tonic::{Request, Response, Status, Streaming};

// ---------------------------------------------------------------- the server

/// What the server saw of one attempt.
#[derive(Debug, Clone, Default)]
struct AttemptLog {
    previous: u32,
    key: Option<String>,
    timeout: Option<Duration>,
    values: Vec<i64>,
}

/// Something the server did; tests wait for these.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Event {
    /// Attempt number `attempt` (its place in the log) received `value`.
    Received { attempt: usize, value: i64 },
    /// Attempt number `attempt` failed as its call asked.
    Failed { attempt: usize },
}

/// What one attempt does, from its call's metadata.
#[derive(Debug, Clone, Copy, Default)]
struct Plan {
    /// `x-fail-after: N`: on the first attempt, UNAVAILABLE after reading N messages.
    fail_after: Option<usize>,
    /// `x-headers-first`: `Running` sends response headers before it fails.
    headers_first: bool,
    /// `x-stall-attempt: K`: attempt K of `Running` sends headers, then nothing.
    stall: bool,
    /// `x-headers-after: N`: `Running` reads N messages before it sends headers.
    headers_after: usize,
}

#[derive(Clone)]
struct Tallies {
    log: Arc<Mutex<Vec<AttemptLog>>>,
    events: mpsc::UnboundedSender<Event>,
}

fn header<T: std::str::FromStr>(md: &MetadataMap, name: &str) -> Option<T> {
    md.get(name)?.to_str().ok()?.parse().ok()
}

impl Tallies {
    fn begin(&self, md: &MetadataMap) -> (usize, Plan) {
        let previous = header(md, "grpc-previous-rpc-attempts").unwrap_or(0);
        let mut log = self.log.lock().unwrap();
        log.push(AttemptLog {
            previous,
            key: header(md, "x-idempotency-key"),
            timeout: md
                .get("grpc-timeout")
                .and_then(|v| parse_grpc_timeout(v.as_bytes())),
            values: Vec::new(),
        });
        let plan = Plan {
            fail_after: header(md, "x-fail-after").filter(|_| previous == 0),
            headers_first: md.contains_key("x-headers-first"),
            stall: header(md, "x-stall-attempt") == Some(previous),
            headers_after: header(md, "x-headers-after").unwrap_or(0),
        };
        (log.len() - 1, plan)
    }

    async fn next(&self, attempt: usize, input: &mut Streaming<Number>) -> Option<Number> {
        let n = input.message().await.ok()??;
        self.log.lock().unwrap()[attempt].values.push(n.value);
        let _ = self.events.send(Event::Received {
            attempt,
            value: n.value,
        });
        Some(n)
    }

    fn fail(&self, attempt: usize) -> Status {
        let _ = self.events.send(Event::Failed { attempt });
        Status::unavailable("try again")
    }

    /// `Running` after its headers: the running total for each number; or, with
    /// `fail_after`, UNAVAILABLE after that many numbers and no message.
    async fn answers(
        &self,
        attempt: usize,
        plan: Plan,
        mut input: Streaming<Number>,
    ) -> TotalStream {
        let (tx, rx) = mpsc::unbounded_channel();
        let mut total = Total::default();
        for _ in 0..plan.headers_after {
            let Some(n) = self.next(attempt, &mut input).await else {
                break;
            };
            total.sum += n.value;
            total.count += 1;
            let _ = tx.send(Ok(total));
        }
        let server = self.clone();
        tokio::spawn(async move {
            while let Some(n) = server.next(attempt, &mut input).await {
                total.sum += n.value;
                total.count += 1;
                if plan.fail_after == Some(total.count as usize) {
                    let _ = tx.send(Err(server.fail(attempt)));
                    return;
                }
                if plan.fail_after.is_none() {
                    let _ = tx.send(Ok(total));
                }
            }
        });
        Box::pin(UnboundedReceiverStream::new(rx))
    }
}

type TotalStream = Pin<Box<dyn Stream<Item = Result<Total, Status>> + Send>>;

#[tonic::async_trait]
impl Tally for Tallies {
    async fn sum(&self, request: Request<Streaming<Number>>) -> Result<Response<Total>, Status> {
        let (attempt, plan) = self.begin(request.metadata());
        let mut input = request.into_inner();
        let mut total = Total::default();
        while let Some(n) = self.next(attempt, &mut input).await {
            total.sum += n.value;
            total.count += 1;
            if plan.fail_after == Some(total.count as usize) {
                return Err(self.fail(attempt));
            }
        }
        Ok(Response::new(total))
    }

    type RunningStream = TotalStream;

    async fn running(
        &self,
        request: Request<Streaming<Number>>,
    ) -> Result<Response<TotalStream>, Status> {
        let (attempt, plan) = self.begin(request.metadata());
        let mut input = request.into_inner();
        if plan.stall {
            return Ok(Response::new(Box::pin(futures_util::stream::pending())));
        }
        match plan.fail_after {
            // Trailers-Only: the handler fails before it answers.
            Some(n) if !plan.headers_first => {
                for _ in 0..n {
                    self.next(attempt, &mut input).await;
                }
                Err(self.fail(attempt))
            }
            _ => Ok(Response::new(self.answers(attempt, plan, input).await)),
        }
    }
}

/// The server's events, kept so a test can wait for one that already happened.
struct Events {
    rx: mpsc::UnboundedReceiver<Event>,
    seen: Vec<Event>,
}

impl Events {
    /// Waits (at most a minute of virtual time) until the server did `event`.
    async fn until(&mut self, event: Event) {
        let wait = async {
            while !self.seen.contains(&event) {
                let next = self.rx.recv().await.expect("server gone");
                self.seen.push(next);
            }
        };
        tokio::time::timeout(Duration::from_secs(60), wait)
            .await
            .unwrap_or_else(|_| panic!("the server never saw {event:?}; it saw {:?}", self.seen));
    }
}

async fn serve() -> (Tallies, Events, std::net::SocketAddr) {
    let (tx, rx) = mpsc::unbounded_channel();
    let tallies = Tallies {
        log: Arc::default(),
        events: tx,
    };
    let (addr, incoming) = net::bind().await;
    tokio::spawn(
        Server::builder()
            .add_service(TallyServer::new(tallies.clone()))
            .serve_with_incoming(incoming),
    );
    let events = Events {
        rx,
        seen: Vec::new(),
    };
    (tallies, events, addr)
}

impl Tallies {
    fn log(&self) -> Vec<AttemptLog> {
        self.log.lock().unwrap().clone()
    }
}

// ---------------------------------------------------------------- client helpers

type Client = TallyClient<Retry<Channel>>;

/// No service config: one policy for every method (3 attempts, 20 ms backoff exactly),
/// and every call gets a key.
fn builder() -> RetryLayerBuilder {
    RetryLayer::builder().jitter(FixedJitter(0.5))
}

fn client(addr: std::net::SocketAddr, layer: &RetryLayer) -> Client {
    TallyClient::new(tower::Layer::layer(layer, net::channel(addr)))
}

/// The server, its events, the layer `builder` builds and a client through it.
async fn start(builder: RetryLayerBuilder) -> (Tallies, Events, RetryLayer, Client) {
    let (server, events, addr) = serve().await;
    let layer = builder.build().unwrap();
    let client = client(addr, &layer);
    (server, events, layer, client)
}

type Sender = mpsc::UnboundedSender<Number>;

/// A streaming request with `metadata`, and the sender that feeds it.
fn streaming(
    metadata: &[(&'static str, &'static str)],
) -> (Sender, Request<UnboundedReceiverStream<Number>>) {
    let (tx, rx) = mpsc::unbounded_channel();
    let mut req = Request::new(UnboundedReceiverStream::new(rx));
    for (k, v) in metadata {
        req.metadata_mut().insert(*k, v.parse().unwrap());
    }
    (tx, req)
}

/// Asserts that the call behind `resp` committed after `attempts` attempts.
#[track_caller]
fn assert_committed<T>(resp: &tonic::Response<T>, attempts: u32) {
    let report = CallReport::from_response(resp).unwrap();
    assert_eq!(
        (report.outcome, report.attempts),
        (CallOutcome::Committed, attempts)
    );
}

fn received(attempt: usize, value: i64) -> Event {
    Event::Received { attempt, value }
}

fn total(sum: i64, count: i64) -> Total {
    Total { sum, count }
}

// ---------------------------------------------------------------- tests

#[tokio::test(start_paused = true)]
async fn a_client_stream_that_failed_after_three_messages_is_replayed_whole() {
    let (server, mut events, layer, mut client) = start(builder()).await;
    let (tx, req) = streaming(&[("x-fail-after", "3")]);
    let call = tokio::spawn(async move { client.sum(req).await });
    for v in 1..=3 {
        tx.send(number(v)).unwrap();
    }
    events.until(Event::Failed { attempt: 0 }).await;
    // Produced after the first attempt failed: the retry sends them live.
    tx.send(number(4)).unwrap();
    tx.send(number(5)).unwrap();
    drop(tx);
    let resp = call.await.unwrap().unwrap();
    assert_eq!(resp.get_ref(), &total(15, 5));
    assert_committed(&resp, 2);
    let log = server.log();
    assert_eq!(log.len(), 2);
    assert_eq!(log[0].values, [1, 2, 3]);
    assert_eq!(log[1].values, [1, 2, 3, 4, 5]);
    assert_eq!((log[0].previous, log[1].previous), (0, 1));
    // A builder without a config keys every method: the same key on both attempts.
    assert!(log[0].key.is_some());
    assert_eq!(log[0].key, log[1].key);
    assert_eq!(layer.replay_bytes_held(), 0);
}

#[tokio::test(start_paused = true)]
async fn the_first_message_reaches_the_server_before_the_second_is_produced() {
    let (server, mut events, layer, mut client) = start(builder()).await;
    let (tx, req) = streaming(&[]);
    let call = tokio::spawn(async move { client.sum(req).await });
    tx.send(number(1)).unwrap();
    events.until(received(0, 1)).await;
    assert!(layer.replay_bytes_held() > 0, "kept for a retry meanwhile");
    tx.send(number(2)).unwrap();
    events.until(received(0, 2)).await;
    drop(tx);
    let resp = call.await.unwrap().unwrap();
    assert_eq!(resp.get_ref(), &total(3, 2));
    assert_eq!(server.log().len(), 1);
    assert_eq!(layer.replay_bytes_held(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_stream_over_the_per_call_limit_is_sent_once_and_not_retried() {
    let (server, mut events, layer, mut client) =
        start(builder().max_replay_bytes_per_call(1000)).await;
    let (tx, req) = streaming(&[("x-fail-after", "3")]);
    let call = tokio::spawn(async move { client.sum(req).await });
    tx.send(padded(1, 600)).unwrap();
    events.until(received(0, 1)).await;
    assert!(layer.replay_bytes_held() >= 600);
    // The second message passes the limit: the call commits to this attempt, frees its
    // copy, and goes on.
    tx.send(padded(2, 600)).unwrap();
    events.until(received(0, 2)).await;
    assert_eq!(layer.replay_bytes_held(), 0);
    tx.send(padded(3, 10)).unwrap();
    drop(tx);
    let status = call.await.unwrap().unwrap_err();
    assert_eq!(status.code(), tonic::Code::Unavailable);
    let report = CallReport::from_status(&status).unwrap();
    assert_eq!(
        (report.outcome, report.attempts),
        (CallOutcome::BodyTooLarge, 1)
    );
    assert!(
        report.to_string().contains("maxReplayBytesPerCall"),
        "{report}"
    );
    let log = server.log();
    assert_eq!(log.len(), 1, "sent once");
    assert_eq!(log[0].values, [1, 2, 3]);
    assert_eq!(layer.replay_bytes_held(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_bidi_call_committed_by_the_per_call_limit_goes_on_after_its_headers() {
    let (server, _events, layer, mut client) =
        start(builder().max_replay_bytes_per_call(1000)).await;
    // The server answers headers only after two messages; the second passes the limit.
    let (tx, req) = streaming(&[("x-headers-after", "2")]);
    tx.send(padded(1, 600)).unwrap();
    tx.send(padded(2, 600)).unwrap();
    let resp = client.running(req).await.unwrap();
    assert_eq!(CallReport::from_response(&resp).unwrap().attempts, 1);
    let mut answers = resp.into_inner();
    assert_eq!(answers.message().await.unwrap(), Some(total(1, 1)));
    assert_eq!(answers.message().await.unwrap(), Some(total(3, 2)));
    tx.send(padded(3, 600)).unwrap();
    assert_eq!(answers.message().await.unwrap(), Some(total(6, 3)));
    drop(tx);
    assert_eq!(answers.message().await.unwrap(), None);
    assert_eq!(server.log()[0].values, [1, 2, 3]);
    assert_eq!(layer.replay_bytes_held(), 0);
}

#[tokio::test(start_paused = true)]
async fn concurrent_calls_share_the_layer_budget() {
    let (server, mut events, addr) = serve().await;
    let layer = builder()
        .max_replay_bytes_per_call(1200)
        .max_replay_bytes_total(1500)
        .build()
        .unwrap();
    let (a_tx, a_req) = streaming(&[("x-fail-after", "2")]);
    let (b_tx, b_req) = streaming(&[("x-fail-after", "2")]);
    let mut a_client = client(addr, &layer);
    let mut b_client = a_client.clone();
    let a = tokio::spawn(async move { a_client.sum(a_req).await });
    a_tx.send(padded(1, 600)).unwrap();
    events.until(received(0, 1)).await;
    let b = tokio::spawn(async move { b_client.sum(b_req).await });
    b_tx.send(padded(10, 600)).unwrap();
    events.until(received(1, 10)).await;
    let both = layer.replay_bytes_held();
    assert!((1200..=1500).contains(&both), "{both}");
    // B's second message fits its own limit but not what A leaves of the budget.
    b_tx.send(padded(20, 400)).unwrap();
    events.until(received(1, 20)).await;
    let a_only = layer.replay_bytes_held();
    assert!(
        a_only * 2 == both,
        "B's copy went back to the budget: {a_only} of {both}"
    );
    a_tx.send(number(2)).unwrap();
    drop((a_tx, b_tx));
    // A is retried and succeeds; B is committed and gets its UNAVAILABLE.
    let a = a.await.unwrap().unwrap();
    assert_eq!(a.get_ref(), &total(3, 2));
    assert_eq!(CallReport::from_response(&a).unwrap().attempts, 2);
    let status = b.await.unwrap().unwrap_err();
    let report = CallReport::from_status(&status).unwrap();
    assert_eq!(
        (report.outcome, report.attempts),
        (CallOutcome::ReplayBudgetExhausted, 1)
    );
    let attempts_with_b: usize = server
        .log()
        .iter()
        .filter(|l| l.values.first() == Some(&10))
        .count();
    assert_eq!(attempts_with_b, 1);
    assert_eq!(layer.replay_bytes_held(), 0);
}

#[tokio::test(start_paused = true)]
async fn bidi_headers_then_an_error_is_not_retried() {
    let (server, _events, layer, mut client) = start(builder()).await;
    let (tx, req) = streaming(&[("x-fail-after", "1"), ("x-headers-first", "1")]);
    tx.send(number(1)).unwrap();
    let resp = client.running(req).await.unwrap();
    assert_committed(&resp, 1);
    assert_eq!(
        layer.replay_bytes_held(),
        0,
        "headers commit the call and free its copy"
    );
    let mut answers = resp.into_inner();
    let status = answers.message().await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::Unavailable);
    drop(tx);
    assert_eq!(server.log().len(), 1);
}

#[tokio::test(start_paused = true)]
async fn bidi_trailers_only_failure_replays_then_ping_pong_goes_on() {
    let (server, mut events, layer, mut client) = start(builder()).await;
    let (tx, req) = streaming(&[("x-fail-after", "2")]);
    // Two messages without waiting for anything.
    tx.send(number(1)).unwrap();
    tx.send(number(2)).unwrap();
    let resp = client.running(req).await.unwrap();
    assert_committed(&resp, 2);
    let mut answers = resp.into_inner();
    assert_eq!(answers.message().await.unwrap(), Some(total(1, 1)));
    assert_eq!(answers.message().await.unwrap(), Some(total(3, 2)));
    // Request, response, request, response on the new attempt.
    tx.send(number(3)).unwrap();
    assert_eq!(answers.message().await.unwrap(), Some(total(6, 3)));
    tx.send(number(4)).unwrap();
    assert_eq!(answers.message().await.unwrap(), Some(total(10, 4)));
    drop(tx);
    assert_eq!(answers.message().await.unwrap(), None);
    events.until(received(1, 4)).await;
    let log = server.log();
    assert_eq!(log[0].values, [1, 2]);
    assert_eq!(log[1].values, [1, 2, 3, 4]);
    assert_eq!(log[0].key, log[1].key);
    assert_eq!(layer.replay_bytes_held(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_request_message_over_its_limit_ends_a_committed_bidi_call() {
    let (server, mut events, _layer, mut client) =
        start(builder().max_request_message_bytes(100)).await;
    let (tx, req) = streaming(&[]);
    tx.send(number(1)).unwrap();
    let mut answers = client.running(req).await.unwrap().into_inner();
    assert_eq!(answers.message().await.unwrap(), Some(total(1, 1)));
    // Committed; then a message over maxRequestMessageBytes: it is never sent, and the
    // call ends with RESOURCE_EXHAUSTED.
    tx.send(padded(2, 200)).unwrap();
    let status = answers.message().await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
    assert!(
        status.message().contains("maxRequestMessageBytes (100)"),
        "{status:?}"
    );
    let report = CallReport::from_status(&status).unwrap();
    assert_eq!(report.outcome, CallOutcome::MessageTooLarge);
    events.until(received(0, 1)).await;
    assert_eq!(server.log()[0].values, [1]);
}

#[tokio::test(start_paused = true)]
async fn the_deadline_holds_across_the_attempts_of_a_stream() {
    let (server, _events, _layer, mut client) = start(builder()).await;
    // The first attempt fails after one message; the second answers headers, then
    // nothing: the call's 1 s deadline ends it, 1 s after it started.
    let (tx, mut req) = streaming(&[("x-fail-after", "1"), ("x-stall-attempt", "1")]);
    req.set_timeout(Duration::from_secs(1));
    tx.send(number(1)).unwrap();
    let start = Instant::now();
    let resp = client.running(req).await.unwrap();
    assert_eq!(start.elapsed(), Duration::from_millis(20), "one backoff");
    let status = resp.into_inner().message().await.unwrap_err();
    assert_eq!(start.elapsed(), Duration::from_secs(1));
    assert_eq!(status.code(), tonic::Code::DeadlineExceeded);
    let report = CallReport::from_status(&status).unwrap();
    assert_eq!(
        (report.outcome, report.attempts),
        (CallOutcome::Deadline, 2)
    );
    let log = server.log();
    assert_eq!(log[0].timeout, Some(Duration::from_secs(1)));
    assert_eq!(
        log[1].timeout,
        Some(Duration::from_millis(980)),
        "the time left"
    );
    drop(tx);
}

fn alive_tasks() -> usize {
    tokio::runtime::Handle::current()
        .metrics()
        .num_alive_tasks()
}

#[tokio::test(start_paused = true)]
async fn ten_thousand_cancelled_streaming_calls_leave_the_budget_full() {
    let (server, mut events, layer, client) = start(builder()).await;
    // One call first, to see the copy held while it runs.
    let (tx, req) = streaming(&[]);
    tx.send(number(1)).unwrap();
    let mut first = client.clone();
    let call = tokio::spawn(async move { first.sum(req).await });
    events.until(received(0, 1)).await;
    assert!(layer.replay_bytes_held() > 0);
    call.abort();
    let _ = call.await;
    assert_eq!(layer.replay_bytes_held(), 0);
    tokio::time::sleep(Duration::from_millis(10)).await;
    // The server, its connection, the channel's connection and buffer worker.
    let tasks = alive_tasks();

    // The request streams of the calls dropped before their headers stay open: the
    // layer, not the end of the caller's stream, must end those attempts.
    let mut open = Vec::new();
    for _ in 0..100 {
        let calls = (0..100).map(|i| {
            let mut client = client.clone();
            async move {
                let (tx, req) = streaming(&[]);
                tx.send(number(i)).unwrap();
                if i % 2 == 0 {
                    // Dropped before response headers (`Sum` answers at the end).
                    let cut = tokio::time::timeout(Duration::from_millis(10), client.sum(req));
                    assert!(cut.await.is_err());
                    Some(tx)
                } else {
                    // Committed by its headers, then both streams dropped mid-call.
                    let mut answers = client.running(req).await.unwrap().into_inner();
                    assert_eq!(answers.message().await.unwrap(), Some(total(i, 1)));
                    None
                }
            }
        });
        open.extend(join_all(calls).await.into_iter().flatten());
        assert_eq!(layer.replay_bytes_held(), 0);
    }
    // Every stream's tasks (the transport's body senders, the server's handlers) end.
    let settled = async {
        while alive_tasks() > tasks {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), settled)
        .await
        .unwrap_or_else(|_| panic!("{} tasks left behind", alive_tasks() - tasks));
    assert_eq!(open.len(), 5_000);
    drop(open);
    assert_eq!(layer.replay_bytes_held(), 0);
    let stats = layer.stats().snapshot();
    assert_eq!((stats.calls, stats.retries), (10_001, 0));
    assert!(server.log().len() >= 10_001);
}
