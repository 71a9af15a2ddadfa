//! gRFC A6 transparent retries against a raw HTTP/2 server (the h2 crate), so each test
//! chooses exactly what the server does with a stream: refuse it (`REFUSED_STREAM`),
//! read the request and reset it, or answer it (issue 32, item 5).

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use h2::Reason;
use idem_client::retry::{CallOutcome, CallReport, RetryLayer};
use idem_core::config::ServiceConfig;
use idem_test_support::shop::CreateOrderRequest;
use idem_test_support::shop::orders_client::OrdersClient;
use tokio::net::TcpListener;
use tower::ServiceBuilder;

/// What the server does with stream number `n` (0-based, over every connection).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Act {
    /// `RST_STREAM(REFUSED_STREAM)` before reading anything.
    Refuse,
    /// Reads the whole request, then `RST_STREAM(INTERNAL_ERROR)`: it may have run.
    ResetAfterReading,
    /// Answers with an empty `Order` and `grpc-status: 0`.
    Answer,
    /// A Trailers-Only `UNAVAILABLE`, before reading anything: a failure the server saw.
    Unavailable,
    /// Signals [`HELD`], waits for [`RELEASE`], then refuses like [`Act::Refuse`].
    RefuseOnRelease,
}

/// Signalled when a [`Act::RefuseOnRelease`] stream has reached the server.
static HELD: tokio::sync::Notify = tokio::sync::Notify::const_new();
/// Lets a [`Act::RefuseOnRelease`] stream be refused.
static RELEASE: tokio::sync::Notify = tokio::sync::Notify::const_new();

/// The streams the server saw: each one's `x-idempotency-key` (empty without one).
#[derive(Clone, Default)]
struct Seen(Arc<Mutex<Vec<String>>>);

impl Seen {
    fn keys(&self) -> Vec<String> {
        self.0.lock().unwrap().clone()
    }
}

/// A raw h2 server on 127.0.0.1 that treats stream `n` as `script(n)` says.
async fn serve(script: fn(usize) -> Act) -> (SocketAddr, Seen) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen = Seen::default();
    let log = seen.clone();
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                return;
            };
            let log = log.clone();
            tokio::spawn(async move {
                let Ok(mut conn) = h2::server::handshake(tcp).await else {
                    return;
                };
                while let Some(Ok((req, respond))) = conn.accept().await {
                    let n = {
                        let mut keys = log.0.lock().unwrap();
                        let key = req
                            .headers()
                            .get("x-idempotency-key")
                            .map(|v| v.to_str().unwrap().to_owned())
                            .unwrap_or_default();
                        keys.push(key);
                        keys.len() - 1
                    };
                    tokio::spawn(stream(req, respond, script(n)));
                }
            });
        }
    });
    (addr, seen)
}

async fn stream(
    req: http::Request<h2::RecvStream>,
    mut respond: h2::server::SendResponse<Bytes>,
    act: Act,
) {
    if act == Act::RefuseOnRelease {
        HELD.notify_one();
        RELEASE.notified().await;
    }
    if matches!(act, Act::Refuse | Act::RefuseOnRelease) {
        respond.send_reset(Reason::REFUSED_STREAM);
        return;
    }
    if act == Act::Unavailable {
        let head = http::Response::builder()
            .header("content-type", "application/grpc")
            .header("grpc-status", "14")
            .body(())
            .unwrap();
        let _ = respond.send_response(head, true);
        return;
    }
    let mut body = req.into_body();
    while let Some(chunk) = body.data().await {
        let Ok(chunk) = chunk else { return };
        let _ = body.flow_control().release_capacity(chunk.len());
    }
    if act == Act::ResetAfterReading {
        respond.send_reset(Reason::INTERNAL_ERROR);
        return;
    }
    let head = http::Response::builder()
        .header("content-type", "application/grpc")
        .body(())
        .unwrap();
    let Ok(mut send) = respond.send_response(head, false) else {
        return;
    };
    let _ = send.send_data(Bytes::from_static(b"\0\0\0\0\0"), false);
    let mut trailers = http::HeaderMap::new();
    trailers.insert("grpc-status", "0".parse().unwrap());
    let _ = send.send_trailers(trailers);
}

/// No retry policy; `CreateOrder` protected (so it carries a key) with this timeout.
fn no_policy(timeout: &str) -> ServiceConfig {
    ServiceConfig::from_json(&format!(
        r#"{{"methodConfig": [{{"name": [{{"service": "shop.v1.Orders"}}],
            "timeout": "{timeout}", "idempotency": {{}}}}]}}"#
    ))
    .unwrap()
}

/// A 3-attempt policy on UNAVAILABLE, protected.
fn with_policy() -> ServiceConfig {
    ServiceConfig::from_json(
        r#"{"methodConfig": [{"name": [{"service": "shop.v1.Orders"}], "timeout": "10s",
            "retryPolicy": {"maxAttempts": 3, "initialBackoff": "0.01s", "maxBackoff": "0.05s",
                            "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]},
            "idempotency": {}}]}"#,
    )
    .unwrap()
}

type Client = OrdersClient<idem_client::retry::Retry<tonic::transport::Channel>>;

fn client(addr: SocketAddr, config: &ServiceConfig) -> (Client, RetryLayer) {
    let layer = RetryLayer::from_config(config);
    let channel = idem_test_support::net::channel(addr);
    let c = OrdersClient::new(ServiceBuilder::new().layer(layer.clone()).service(channel));
    (c, layer)
}

fn order() -> CreateOrderRequest {
    CreateOrderRequest {
        customer_id: "c".into(),
        sku: "s".into(),
        quantity: 1,
        note: String::new(),
    }
}

#[tokio::test]
async fn a_refused_first_stream_is_retried_transparently_without_a_retry_policy() {
    let (addr, seen) = serve(|n| if n == 0 { Act::Refuse } else { Act::Answer }).await;
    let (mut c, layer) = client(addr, &no_policy("10s"));
    let resp = c.create_order(order()).await.expect("the resend answers");
    let report = CallReport::from_response(&resp).unwrap();
    assert_eq!(
        (report.outcome, report.attempts, report.transparent),
        (CallOutcome::NoRetryPolicy, 1, 1),
        "{report}"
    );
    let keys = seen.keys();
    assert_eq!(keys.len(), 2);
    assert_eq!(keys[0], keys[1], "the resend carries the same key");
    let stats = layer.stats().snapshot();
    assert_eq!(
        (stats.attempts, stats.retries, stats.transparent),
        (2, 0, 1)
    );
}

#[tokio::test]
async fn a_stream_reset_after_the_server_read_it_is_not_retried_without_a_policy() {
    let (addr, seen) = serve(|n| {
        if n == 0 {
            Act::ResetAfterReading
        } else {
            Act::Answer
        }
    })
    .await;
    let (mut c, _) = client(addr, &no_policy("10s"));
    let err = c.create_order(order()).await.unwrap_err();
    let report = CallReport::from_status(&err).expect("a report");
    assert_eq!(
        (report.outcome, report.attempts, report.transparent),
        (CallOutcome::NoRetryPolicy, 1, 0),
        "{report}"
    );
    assert_eq!(seen.keys().len(), 1, "the server saw it once");
}

#[tokio::test]
async fn a_stream_reset_after_the_server_read_it_is_retried_by_the_policy_with_the_same_key() {
    let (addr, seen) = serve(|n| {
        if n == 0 {
            Act::ResetAfterReading
        } else {
            Act::Answer
        }
    })
    .await;
    let (mut c, _) = client(addr, &with_policy());
    let resp = c.create_order(order()).await.expect("the retry answers");
    let report = CallReport::from_response(&resp).unwrap();
    assert_eq!(
        (report.outcome, report.attempts, report.transparent),
        (CallOutcome::Committed, 2, 0),
        "a policy retry, not a transparent one: {report}"
    );
    let keys = seen.keys();
    assert_eq!(keys.len(), 2);
    assert!(!keys[0].is_empty());
    assert_eq!(keys[0], keys[1], "the retry carries the call's key");
}

#[tokio::test]
async fn a_server_that_refuses_every_stream_gets_one_transparent_resend_per_call() {
    let (addr, seen) = serve(|_| Act::Refuse).await;
    // Without a policy: the attempt, its one transparent resend, then UNAVAILABLE.
    let (mut c, _) = client(addr, &no_policy("10s"));
    let err = c.create_order(order()).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unavailable, "{err:?}");
    let report = CallReport::from_status(&err).expect("a report");
    assert_eq!(
        (report.outcome, report.attempts, report.transparent),
        (CallOutcome::NoRetryPolicy, 1, 1),
        "{report}"
    );
    assert!(
        report.to_string().contains("1 transparent retry"),
        "{report}"
    );
    assert_eq!(seen.keys().len(), 2);
    // With a policy: maxAttempts 3 policy attempts, one transparent resend in all, with
    // the policy's backoff between them (no busy loop: 4 streams for the whole call).
    let (mut c, layer) = client(addr, &with_policy());
    let err = c.create_order(order()).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unavailable, "{err:?}");
    let report = CallReport::from_status(&err).expect("a report");
    assert_eq!(
        (report.outcome, report.attempts, report.transparent),
        (CallOutcome::AttemptsExhausted, 3, 1),
        "{report}"
    );
    assert_eq!(seen.keys().len(), 2 + 4);
    let stats = layer.stats().snapshot();
    assert_eq!((stats.attempts, stats.transparent), (4, 1));
}

/// Issue 32, "refuses every stream for ever", with a retry policy whose backoff runs
/// past a short deadline: the attempt, its one transparent resend (gRFC A6: a refused
/// stream is resent once, then the policy decides), then the policy's retry would start
/// after the deadline, so the call ends at once: UNAVAILABLE (the last attempt's status,
/// as a retry past the deadline is never started), or DEADLINE_EXCEEDED if a loaded
/// machine let the deadline pass during the two attempts. The report says the deadline
/// ended it, and the server saw at most 2 streams: no busy loop until the deadline.
#[tokio::test]
async fn refused_for_ever_with_a_backoff_past_the_deadline_ends_by_the_deadline() {
    let (addr, seen) = serve(|_| Act::Refuse).await;
    let config = ServiceConfig::from_json(
        r#"{"methodConfig": [{"name": [{"service": "shop.v1.Orders"}], "timeout": "1s",
            "retryPolicy": {"maxAttempts": 5, "initialBackoff": "10s", "maxBackoff": "10s",
                            "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]},
            "idempotency": {}}]}"#,
    )
    .unwrap();
    let (mut c, layer) = client(addr, &config);
    let err = c.create_order(order()).await.unwrap_err();
    assert!(
        matches!(
            err.code(),
            tonic::Code::Unavailable | tonic::Code::DeadlineExceeded
        ),
        "{err:?}"
    );
    let report = CallReport::from_status(&err).expect("a report");
    assert_eq!(report.outcome, CallOutcome::Deadline, "{report}");
    assert!(
        report.to_string().contains("stopped at the deadline"),
        "{report}"
    );
    assert_eq!(report.attempts, 1, "no policy retry could start: {report}");
    assert!(report.transparent <= 1, "{report}");
    let streams = seen.keys().len();
    assert!((1..=2).contains(&streams), "{streams} streams");
    let stats = layer.stats().snapshot();
    assert_eq!((stats.retries, stats.attempts), (0, streams as u64));
}

/// A merge decision of the last session: the circuit breaker never stops a transparent
/// resend. The breaker opens while a call's first attempt is out (another call's failure
/// opens it: `minCalls` 1); that attempt is then refused, and its resend still goes out,
/// as the server's application never saw the first one.
#[tokio::test]
async fn an_open_circuit_breaker_does_not_stop_a_transparent_resend() {
    let (addr, seen) = serve(|n| match n {
        0 => Act::RefuseOnRelease,
        1 => Act::Unavailable,
        _ => Act::Answer,
    })
    .await;
    let config = ServiceConfig::from_json(
        r#"{"methodConfig": [{"name": [{"service": "shop.v1.Orders"}], "timeout": "30s",
            "idempotency": {}}],
            "idem": {"client": {"circuitBreaker": {"failureRatio": 1.0, "minCalls": 1,
                "window": "60s", "openFor": "60s", "failureStatusCodes": ["UNAVAILABLE"]}}}}"#,
    )
    .unwrap();
    let (c, layer) = client(addr, &config);
    let breaker = layer.circuit_breaker().expect("a breaker");
    let mut first = c.clone();
    let held = HELD.notified();
    let call = tokio::spawn(async move { first.create_order(order()).await });
    held.await;
    // The first call's attempt is at the server; another call fails and opens the breaker.
    let err = c.clone().create_order(order()).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unavailable, "{err:?}");
    assert_eq!(
        breaker.state(),
        idem_client::retry::BreakerState::Open,
        "one failure in one call opens it"
    );
    // A call that starts now is refused by the breaker without a stream.
    let refused = c.clone().create_order(order()).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::Unavailable, "{refused:?}");
    assert_eq!(seen.keys().len(), 2, "the breaker sent nothing for it");
    // The first call's attempt is refused: its transparent resend goes out all the same.
    RELEASE.notify_one();
    let resp = call.await.unwrap().expect("the resend answers");
    let report = CallReport::from_response(&resp).unwrap();
    assert_eq!(
        (report.outcome, report.attempts, report.transparent),
        (CallOutcome::NoRetryPolicy, 1, 1),
        "{report}"
    );
    let keys = seen.keys();
    assert_eq!(keys.len(), 3);
    assert_eq!(keys[0], keys[2], "the resend is the first call's");
    assert_eq!(breaker.state(), idem_client::retry::BreakerState::Open);
}

/// A TCP stream whose first bytes were read already (and are read again first).
struct Prefixed {
    pre: Vec<u8>,
    io: tokio::net::TcpStream,
}

impl tokio::io::AsyncRead for Prefixed {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        if !self.pre.is_empty() {
            let n = self.pre.len().min(buf.remaining());
            buf.put_slice(&self.pre[..n]);
            self.pre.drain(..n);
            return std::task::Poll::Ready(Ok(()));
        }
        std::pin::Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for Prefixed {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.io).poll_write(cx, buf)
    }
    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.io).poll_flush(cx)
    }
    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

/// Reads from `tcp` until the client's first HEADERS frame has arrived (after the
/// 24-byte preface, frames of a 9-byte header each): the request is on the wire.
async fn read_to_first_headers(tcp: &mut tokio::net::TcpStream) -> Vec<u8> {
    use tokio::io::AsyncReadExt;
    let mut buf = Vec::new();
    loop {
        let mut off = 24;
        while off + 9 <= buf.len() {
            if buf[off + 3] == 0x1 {
                return buf;
            }
            let len = usize::from(buf[off]) << 16 | usize::from(buf[off + 1]) << 8;
            off += 9 + (len | usize::from(buf[off + 2]));
        }
        let mut chunk = [0u8; 4096];
        let n = tcp.read(&mut chunk).await.unwrap();
        assert!(n > 0, "the client closed before its request");
        buf.extend_from_slice(&chunk[..n]);
    }
}

/// The first connection: once the client's first request is on the wire, a GOAWAY
/// whose last stream id is 0 (below it: h2 has parsed nothing past the preface), then
/// the connection closes. Later connections answer every stream.
async fn serve_goaway_first() -> (SocketAddr, Arc<Mutex<usize>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let answered = Arc::new(Mutex::new(0));
    let count = answered.clone();
    tokio::spawn(async move {
        let mut first = true;
        loop {
            let Ok((mut tcp, _)) = listener.accept().await else {
                return;
            };
            if std::mem::take(&mut first) {
                let pre = read_to_first_headers(&mut tcp).await;
                let mut conn = h2::server::handshake(Prefixed { pre, io: tcp })
                    .await
                    .unwrap();
                conn.abrupt_shutdown(Reason::NO_ERROR);
                tokio::spawn(async move { while let Some(Ok(_)) = conn.accept().await {} });
                continue;
            }
            let count = count.clone();
            tokio::spawn(async move {
                let Ok(mut conn) = h2::server::handshake(tcp).await else {
                    return;
                };
                while let Some(Ok((req, respond))) = conn.accept().await {
                    *count.lock().unwrap() += 1;
                    tokio::spawn(stream(req, respond, Act::Answer));
                }
            });
        }
    });
    (addr, answered)
}

#[tokio::test]
async fn a_goaway_below_the_stream_is_retried_transparently_without_a_retry_policy() {
    let (addr, answered) = serve_goaway_first().await;
    let (mut c, layer) = client(addr, &no_policy("10s"));
    let resp = c.create_order(order()).await.expect("the resend answers");
    let report = CallReport::from_response(&resp).unwrap();
    assert_eq!(
        (report.outcome, report.attempts, report.transparent),
        (CallOutcome::NoRetryPolicy, 1, 1),
        "{report}"
    );
    assert_eq!(
        *answered.lock().unwrap(),
        1,
        "the server's application saw it once"
    );
    assert_eq!(layer.stats().snapshot().transparent, 1);
}

/// Nothing listens: connect failures are not transparent (the channel is not ready; a
/// call without `waitForReady` fails fast, as gRPC's do).
#[tokio::test]
async fn a_connect_failure_is_not_a_transparent_retry() {
    let addr = {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        l.local_addr().unwrap()
    };
    let (mut c, _) = client(addr, &no_policy("10s"));
    let err = c.create_order(order()).await.unwrap_err();
    let report = CallReport::from_status(&err).expect("a report");
    assert_eq!((report.attempts, report.transparent), (1, 0), "{report}");
}

/// The first connection answers its first stream after starting a graceful shutdown: its
/// GOAWAY (last stream id 2³¹−1, then the last one it processed) is on the wire before
/// that stream's response, so the client has read it when the first call ends. Every
/// stream of later connections is answered. Counts the streams each connection accepted.
async fn serve_graceful_goaway_after_first() -> (SocketAddr, Arc<Mutex<Vec<usize>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let accepted = Arc::new(Mutex::new(Vec::new()));
    let log = accepted.clone();
    tokio::spawn(async move {
        let mut first = true;
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                return;
            };
            let draining = std::mem::take(&mut first);
            let log = log.clone();
            let conn_no = {
                let mut l = log.lock().unwrap();
                l.push(0);
                l.len() - 1
            };
            tokio::spawn(async move {
                let Ok(mut conn) = h2::server::handshake(tcp).await else {
                    return;
                };
                while let Some(Ok((req, respond))) = conn.accept().await {
                    log.lock().unwrap()[conn_no] += 1;
                    if draining {
                        conn.graceful_shutdown();
                    }
                    tokio::spawn(stream(req, respond, Act::Answer));
                }
            });
        }
    });
    (addr, accepted)
}

/// A call that starts after the client's h2 read the server's GOAWAY opens no stream on
/// that connection (h2's `send_request` fails with the GOAWAY and hyper's connection task
/// stops taking requests): tonic's channel connects again and the call goes out there, or,
/// if it was queued on the old connection already, it ends as "connection closed" and is
/// sent again transparently. Either way it succeeds without a retry policy, and the old
/// connection got no second stream to ignore (issue 32: "h2's client keeps opening
/// streams after the final GOAWAY" is not what h2 0.4.20 / hyper 1.12 do).
#[tokio::test]
async fn a_call_after_the_peers_goaway_goes_out_on_a_new_connection() {
    let (addr, accepted) = serve_graceful_goaway_after_first().await;
    let (mut c, _) = client(addr, &no_policy("10s"));
    c.create_order(order())
        .await
        .expect("the first call answers");
    let resp = c
        .create_order(order())
        .await
        .expect("the second call answers on a new connection");
    let report = CallReport::from_response(&resp).unwrap();
    assert_eq!(report.attempts, 1, "{report}");
    assert!(report.transparent <= 1, "{report}");
    assert_eq!(
        *accepted.lock().unwrap(),
        [1, 1],
        "one stream per connection: none opened after the GOAWAY"
    );
}
