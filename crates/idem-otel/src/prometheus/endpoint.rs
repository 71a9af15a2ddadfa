//! The scrape endpoint: `GET /metrics` over HTTP/1.1, one request per connection.
//!
//! It shares the process's file descriptors with the gRPC server it observes, so it
//! holds few of them and never for long:
//!
//! - at most [`max_connections`](Endpoint::max_connections) connections at once; beyond
//!   that it stops accepting, and new connections wait in the kernel's backlog (holding
//!   no descriptor of the process) until one closes;
//! - each connection has [`request_timeout`](Endpoint::request_timeout) for the whole
//!   exchange (request head in, exposition out), then it is closed: a peer that sends
//!   nothing, or stops reading, cannot keep it;
//! - an accept error (`EMFILE` when the process is out of descriptors, a connection
//!   reset before it was accepted…) is logged at WARN (once per run of errors) and
//!   retried after a backoff of 10 ms doubling to 1 s; the endpoint never stops serving
//!   on its own.

use std::io;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

use super::Prometheus;

/// How many scrape connections are served at once by default.
pub const DEFAULT_MAX_CONNECTIONS: usize = 16;
/// How long a scrape connection may take, request and response, by default.
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

const FIRST_BACKOFF: Duration = Duration::from_millis(10);
const MAX_BACKOFF: Duration = Duration::from_secs(1);
/// A scrape's request line and headers; a longer head is answered as it stands.
const MAX_HEAD_BYTES: usize = 4096;

/// A Prometheus scrape endpoint with bounded connections and timeouts.
///
/// ```no_run
/// # async fn f() -> std::io::Result<()> {
/// use std::time::Duration;
/// use idem_otel::prometheus::{Endpoint, Prometheus};
///
/// let prometheus = Prometheus::new();
/// let listener = tokio::net::TcpListener::bind("127.0.0.1:9464").await?;
/// Endpoint::new(prometheus)
///     .max_connections(4)
///     .request_timeout(Duration::from_secs(5))
///     .serve(listener)
///     .await
/// # }
/// ```
#[derive(Clone, Debug)]
pub struct Endpoint {
    prometheus: Prometheus,
    max_connections: usize,
    request_timeout: Duration,
}

impl Endpoint {
    /// An endpoint for `prometheus` with [`DEFAULT_MAX_CONNECTIONS`] and
    /// [`DEFAULT_REQUEST_TIMEOUT`].
    pub fn new(prometheus: Prometheus) -> Self {
        Self {
            prometheus,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            request_timeout: DEFAULT_REQUEST_TIMEOUT,
        }
    }

    /// At most `n` connections are served at once (at least 1).
    pub fn max_connections(mut self, n: usize) -> Self {
        self.max_connections = n.max(1);
        self
    }

    /// Each connection is closed once it has been open for `timeout`, answered or not.
    pub fn request_timeout(mut self, timeout: Duration) -> Self {
        self.request_timeout = timeout;
        self
    }

    /// Answers `GET /metrics` (any other path: 404) on `listener`. Runs until the
    /// future is dropped: accept errors are logged and retried, never returned.
    pub async fn serve(self, listener: TcpListener) -> io::Result<()> {
        self.serve_from(listener).await
    }

    pub(crate) async fn serve_from<A: Accept>(self, mut incoming: A) -> io::Result<()> {
        let slots = Arc::new(Semaphore::new(self.max_connections));
        let mut backoff = FIRST_BACKOFF;
        let mut failing = false;
        loop {
            let Ok(slot) = slots.clone().acquire_owned().await else {
                return Ok(()); // never closed
            };
            match incoming.accept().await {
                Ok(io) => {
                    if failing {
                        tracing::info!("metrics endpoint accepting connections again");
                    }
                    failing = false;
                    backoff = FIRST_BACKOFF;
                    let prometheus = self.prometheus.clone();
                    let timeout = self.request_timeout;
                    tokio::spawn(async move {
                        let _slot = slot;
                        let _ = tokio::time::timeout(timeout, answer(io, prometheus)).await;
                    });
                }
                Err(error) => {
                    drop(slot);
                    if !failing {
                        tracing::warn!(
                            %error,
                            "metrics endpoint cannot accept a connection; retrying with backoff"
                        );
                    } else {
                        tracing::debug!(%error, ?backoff, "metrics endpoint accept failed again");
                    }
                    failing = true;
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                }
            }
        }
    }
}

/// Where connections come from: a `TcpListener`, or a scripted source in tests.
pub(crate) trait Accept: Send + 'static {
    type Io: AsyncRead + AsyncWrite + Unpin + Send + 'static;
    fn accept(&mut self) -> impl Future<Output = io::Result<Self::Io>> + Send;
}

impl Accept for TcpListener {
    type Io = tokio::net::TcpStream;
    async fn accept(&mut self) -> io::Result<Self::Io> {
        TcpListener::accept(self).await.map(|(stream, _)| stream)
    }
}

/// Reads one request head, answers it, and closes the connection.
async fn answer<Io: AsyncRead + AsyncWrite + Unpin>(mut stream: Io, prometheus: Prometheus) {
    let mut buf = vec![0u8; MAX_HEAD_BYTES];
    let mut read = 0;
    // The request line and headers; a scrape has no body.
    while read < buf.len() {
        match stream.read(&mut buf[read..]).await {
            Ok(0) | Err(_) => break,
            Ok(n) => read += n,
        }
        if buf[..read].windows(4).any(|w| w == b"\r\n\r\n") {
            break;
        }
    }
    if read == 0 {
        return; // the peer left without asking
    }
    let head = String::from_utf8_lossy(&buf[..read]);
    let mut words = head.split_whitespace();
    let (method, path) = (words.next(), words.next());
    let path = path.map(|p| p.split('?').next().unwrap_or(p));
    let (status, body) = match (method, path) {
        (Some("GET"), Some("/metrics")) => {
            let text = tokio::task::spawn_blocking(move || prometheus.render()).await;
            ("200 OK", text.unwrap_or_default())
        }
        _ => (
            "404 Not Found",
            "not found: scrape GET /metrics\n".to_owned(),
        ),
    };
    let response = format!(
        "HTTP/1.1 {status}\r\ncontent-type: text/plain; version=0.0.4; charset=utf-8\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = stream.write_all(response.as_bytes()).await;
    let _ = stream.shutdown().await;
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use tokio::io::DuplexStream;
    use tokio::sync::mpsc;
    use tokio::time::Instant;

    use super::*;

    /// Hands out what the test sends it, and counts and times the accepts it was asked for.
    struct Scripted {
        next: mpsc::UnboundedReceiver<io::Result<DuplexStream>>,
        asked: Arc<AtomicUsize>,
        at: Arc<std::sync::Mutex<Vec<Instant>>>,
    }

    impl Accept for Scripted {
        type Io = DuplexStream;
        async fn accept(&mut self) -> io::Result<DuplexStream> {
            self.asked.fetch_add(1, Ordering::SeqCst);
            self.at.lock().unwrap().push(Instant::now());
            match self.next.recv().await {
                Some(next) => next,
                None => std::future::pending().await,
            }
        }
    }

    struct Script {
        send: mpsc::UnboundedSender<io::Result<DuplexStream>>,
        asked: Arc<AtomicUsize>,
        at: Arc<std::sync::Mutex<Vec<Instant>>>,
    }

    impl Script {
        /// A new connection; returns the client's end.
        fn connect(&self) -> DuplexStream {
            let (client, server) = tokio::io::duplex(64 * 1024);
            self.send.send(Ok(server)).unwrap();
            client
        }
        fn fail(&self, kind: io::ErrorKind) {
            self.send.send(Err(io::Error::from(kind))).unwrap();
        }
        fn asked(&self) -> usize {
            self.asked.load(Ordering::SeqCst)
        }
    }

    fn start(endpoint: Endpoint) -> Script {
        let (send, next) = mpsc::unbounded_channel();
        let asked = Arc::new(AtomicUsize::new(0));
        let at = Arc::new(std::sync::Mutex::new(Vec::new()));
        let incoming = Scripted {
            next,
            asked: asked.clone(),
            at: at.clone(),
        };
        tokio::spawn(endpoint.serve_from(incoming));
        Script { send, asked, at }
    }

    async fn scrape(mut client: DuplexStream) -> String {
        client
            .write_all(b"GET /metrics HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .unwrap();
        let mut out = String::new();
        client.read_to_string(&mut out).await.unwrap();
        out
    }

    #[tokio::test(start_paused = true)]
    async fn accept_errors_back_off_and_serving_goes_on() {
        let script = start(Endpoint::new(Prometheus::new()));
        for _ in 0..4 {
            script.fail(io::ErrorKind::OutOfMemory); // what EMFILE-like exhaustion looks like
        }
        let client = script.connect();
        let answer = scrape(client).await;
        assert!(answer.starts_with("HTTP/1.1 200 OK\r\n"), "{answer}");

        let at = script.at.lock().unwrap().clone();
        let gaps: Vec<Duration> = at.windows(2).map(|w| w[1] - w[0]).collect();
        assert_eq!(
            &gaps[..4],
            &[
                Duration::from_millis(10),
                Duration::from_millis(20),
                Duration::from_millis(40),
                Duration::from_millis(80),
            ],
            "backoff doubles after each failed accept"
        );
        // A success resets the backoff: the next error waits 10 ms again.
        script.fail(io::ErrorKind::ConnectionAborted);
        let answer = scrape(script.connect()).await;
        assert!(answer.starts_with("HTTP/1.1 200 OK\r\n"), "{answer}");
        // Accepts 1–5 failed four times and then served; the 6th failed, the 7th served.
        let at = script.at.lock().unwrap().clone();
        assert_eq!(at[6] - at[5], Duration::from_millis(10));
    }

    #[tokio::test(start_paused = true)]
    async fn the_backoff_stops_growing_at_one_second() {
        let script = start(Endpoint::new(Prometheus::new()));
        for _ in 0..12 {
            script.fail(io::ErrorKind::OutOfMemory);
        }
        let answer = scrape(script.connect()).await;
        assert!(answer.starts_with("HTTP/1.1 200 OK\r\n"), "{answer}");
        let at = script.at.lock().unwrap().clone();
        let longest = at.windows(2).map(|w| w[1] - w[0]).max().unwrap();
        assert_eq!(longest, MAX_BACKOFF);
    }

    #[tokio::test(start_paused = true)]
    async fn a_connection_that_sends_nothing_is_closed_at_the_request_timeout() {
        let script =
            start(Endpoint::new(Prometheus::new()).request_timeout(Duration::from_secs(3)));
        let mut idle = script.connect();
        let began = Instant::now();
        let mut out = Vec::new();
        let n = idle.read_to_end(&mut out).await.unwrap();
        assert_eq!(n, 0, "closed without an answer");
        assert_eq!(began.elapsed(), Duration::from_secs(3));
    }

    #[tokio::test(start_paused = true)]
    async fn a_peer_that_stops_reading_is_closed_at_the_request_timeout() {
        let script =
            start(Endpoint::new(Prometheus::new()).request_timeout(Duration::from_secs(3)));
        // A pipe of 16 bytes that the client never drains: the answer cannot be written.
        let (mut client, server) = tokio::io::duplex(16);
        script.send.send(Ok(server)).unwrap();
        client
            .write_all(b"GET /nothing HTTP/1.1\r\n\r\n")
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_secs(4)).await;
        // The server's end is gone: reading drains the 16 bytes it wrote, then ends.
        let mut out = Vec::new();
        client.read_to_end(&mut out).await.unwrap();
        assert_eq!(out.len(), 16, "{out:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn connections_beyond_the_cap_are_not_accepted_until_one_closes() {
        let script = start(
            Endpoint::new(Prometheus::new())
                .max_connections(2)
                .request_timeout(Duration::from_secs(60)),
        );
        let first = script.connect();
        let _second = script.connect();
        let third = script.connect();
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert_eq!(script.asked(), 2, "two slots, two accepts");

        drop(first); // its handler sees end of stream and frees its slot
        let answer = scrape(third).await;
        assert!(answer.starts_with("HTTP/1.1 200 OK\r\n"), "{answer}");
        tokio::time::sleep(Duration::from_secs(1)).await; // the third's slot comes back
        assert_eq!(
            script.asked(),
            4,
            "the third was accepted, and the next is awaited"
        );
    }
}
