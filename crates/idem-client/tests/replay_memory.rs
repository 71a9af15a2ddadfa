//! Issue 30, item 9: request bytes the layer holds after a call committed stay within
//! `maxReplayBytesTotal`, and the layer counts them. Bidi calls to a raw HTTP/2 server
//! (the h2 crate) that answers with response headers at once and never reads a byte of
//! the request: whatever the layer read from the caller and could not hand to the
//! transport stays held for as long as the call lives.
//!
//! The bytes are counted, not timed: one body around each caller's request stream counts
//! what the layer pulled from the caller, one around each attempt's body counts what the
//! layer handed to the transport. The difference is what the layer holds.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::Frame;
use idem_client::retry::RetryLayer;
use idem_core::config::ServiceConfig;
use idem_test_support::stream::tally_client::TallyClient;
use idem_test_support::stream::{Number, padded};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};
use tower::ServiceBuilder;

/// A raw h2 server: every stream gets `200` and `content-type: application/grpc` at once,
/// then nothing; its request body is never read (its flow-control window is never given
/// back). Every stream is kept open until `close` says true: then every connection
/// closes.
async fn headers_then_never_read(close: watch::Receiver<bool>) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                return;
            };
            let mut close = close.clone();
            tokio::spawn(async move {
                let Ok(mut conn) = h2::server::handshake(tcp).await else {
                    return;
                };
                let mut open = Vec::new();
                loop {
                    let (req, mut respond) = tokio::select! {
                        Some(Ok(stream)) = conn.accept() => stream,
                        _ = close.wait_for(|close| *close) => return,
                        else => return,
                    };
                    let head = http::Response::builder()
                        .header("content-type", "application/grpc")
                        .body(())
                        .unwrap();
                    let send = respond.send_response(head, false).unwrap();
                    open.push((req, send));
                }
            });
        }
    });
    addr
}

/// Counts the data bytes a body yields.
struct Counted {
    inner: tonic::body::Body,
    bytes: Arc<AtomicUsize>,
}

impl http_body::Body for Counted {
    type Data = Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, tonic::Status>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if let Poll::Ready(Some(Ok(frame))) = &polled
            && let Some(data) = frame.data_ref()
        {
            self.bytes.fetch_add(data.len(), Ordering::SeqCst);
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// A service that counts the request body bytes its inner service reads.
#[derive(Clone)]
struct CountBodies<S> {
    inner: S,
    bytes: Arc<AtomicUsize>,
}

impl<S> tower::Service<http::Request<tonic::body::Body>> for CountBodies<S>
where
    S: tower::Service<http::Request<tonic::body::Body>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<tonic::body::Body>) -> S::Future {
        let bytes = self.bytes.clone();
        self.inner
            .call(req.map(|inner| tonic::body::Body::new(Counted { inner, bytes })))
    }
}

fn counting<S>(bytes: &Arc<AtomicUsize>) -> impl Fn(S) -> CountBodies<S> + use<S> {
    let bytes = bytes.clone();
    move |inner| CountBodies {
        inner,
        bytes: bytes.clone(),
    }
}

const CALLS: usize = 48;
/// Messages per call, of about [`MESSAGE`] bytes: about 240 kB a call, under the default
/// `maxReplayBytesPerCall` (256 KiB), so each call alone could keep its whole request.
const MESSAGES: usize = 60;
const MESSAGE: usize = 4_000;
const TOTAL: usize = 2 << 20;

#[tokio::test]
async fn request_bytes_held_after_commit_stay_within_max_replay_bytes_total() {
    let (close, closed) = watch::channel(false);
    let addr = headers_then_never_read(closed).await;
    let config = ServiceConfig::from_json(
        r#"{"methodConfig": [{"name": [{"service": "stream.v1.Tally"}], "timeout": "600s",
            "retryPolicy": {"maxAttempts": 3, "initialBackoff": "0.01s", "maxBackoff": "0.05s",
                            "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]}}]}"#,
    )
    .unwrap();
    let layer = RetryLayer::builder()
        .service_config(config)
        .max_replay_bytes_total(TOTAL)
        .build()
        .unwrap();
    // Bytes the layer read from the callers, and bytes it handed to the transport.
    let pulled = Arc::new(AtomicUsize::new(0));
    let handed = Arc::new(AtomicUsize::new(0));
    let channel = idem_test_support::net::channel(addr);
    let service = ServiceBuilder::new()
        .layer_fn(counting(&pulled))
        .layer(layer.clone())
        .layer_fn(counting(&handed))
        .service(channel);
    let client = TallyClient::new(service);
    // Every caller's 240 kB are ready at once, and its stream stays open (a bidi call).
    let mut callers = Vec::new();
    let mut calls = Vec::new();
    for call in 0..CALLS {
        let (tx, rx) = mpsc::unbounded_channel::<Number>();
        for i in 0..MESSAGES {
            tx.send(padded((call * MESSAGES + i) as i64, MESSAGE))
                .unwrap();
        }
        callers.push(tx);
        let mut client = client.clone();
        calls.push(tokio::spawn(async move {
            let stream = tokio_stream::wrappers::UnboundedReceiverStream::new(rx);
            client.running(stream).await
        }));
    }
    // Every call gets its response headers: each one is committed.
    let mut responses = Vec::new();
    for call in calls {
        responses.push(call.await.unwrap().expect("response headers"));
    }
    // The transport takes what it can send and stops: the server reads nothing. Let every
    // task run until no body is polled any more (a count, not a time: the runtime is this
    // test's one thread, and each round lets every ready task run).
    let mut still = 0;
    let mut last = (0, 0);
    while still < 50 {
        tokio::task::yield_now().await;
        let now = (pulled.load(Ordering::SeqCst), handed.load(Ordering::SeqCst));
        still = if now == last { still + 1 } else { 0 };
        last = now;
    }
    let (pulled, handed) = last;
    let held = pulled - handed;
    let counted = layer.request_bytes_held();
    eprintln!("pulled {pulled} handed {handed} held {held} counted {counted}");
    assert!(
        pulled >= CALLS * 2 * MESSAGE,
        "every call read from its caller: {pulled}"
    );
    assert_eq!(
        held, counted,
        "what the layer holds is counted in maxReplayBytesTotal"
    );
    assert!(
        held <= TOTAL,
        "the layer holds {held} request bytes, over maxReplayBytesTotal {TOTAL}"
    );
    assert_eq!(
        layer.replay_bytes_held(),
        0,
        "nothing is kept for replay after the commits"
    );
    // The server closes its connections: the attempts fail, and every byte comes back.
    close.send(true).unwrap();
    tokio::time::timeout(std::time::Duration::from_secs(60), async {
        while layer.request_bytes_held() > 0 {
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("the bytes held come back once the attempts fail");
    drop((responses, callers));
}
