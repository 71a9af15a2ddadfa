//! A graceful drain for rolling deploys: stop taking calls, let the protected ones finish
//! and record their outcome, then exit, bounded by a drain timeout.
//!
//! What each part does:
//!
//! - **New streams are refused, in a way clients retry transparently: GOAWAY, then
//!   REFUSED_STREAM.** tonic's `Server::serve_with_shutdown` closes the listener when its
//!   signal fires and asks every connection to shut down gracefully: hyper (h2) sends
//!   GOAWAY with the last stream id 2³¹−1, waits one round trip (a PING), then GOAWAY
//!   with the last stream id it processed. Streams that reach the server after the drain
//!   started (the client sent them before it read the GOAWAY) are reset with
//!   `RST_STREAM(REFUSED_STREAM)` by [`Drain::layer`] before any service sees them (see
//!   [`RefuseLayer`] for how a tower layer gets hyper to send that reset through tonic).
//!   Streams above the final GOAWAY's last stream id are never given to a service at all:
//!   h2's server drops their frames, and RFC 9113 §6.8 says such streams "have not been
//!   processed in any way" and may be retried on a new connection; the client's h2 fails
//!   exactly those streams with a remote GOAWAY error (`Streams::recv_go_away`). For
//!   the client the two are the same answer, and idem's `RetryLayer` sends either again
//!   transparently (gRFC A6, once per call), on another connection. A client's h2 that
//!   has read a GOAWAY opens no new stream on that connection (`send_request` fails with
//!   the GOAWAY, and hyper's connection task stops taking requests: tonic's channel
//!   connects again, and a request queued on the old connection gets hyper's
//!   "connection closed", which idem resends as never sent). Streams the
//!   server took before the drain started run to completion; tonic then waits for every
//!   connection to close.
//! - **In-flight protected runs finish and record their outcome before exit.** A run of
//!   the idempotency layer whose caller went away (the connection closed) goes on in a
//!   task of its own until its outcome is recorded; the server future does not wait for
//!   those. [`Drain::run`] does: after the server future returns, it waits until no
//!   protected run is left ([`protected_runs`], counted for the whole process).
//! - **Bounded.** Once the drain starts, all of this is bounded by the drain timeout
//!   (30 s by default, [`Drain::timeout`]); keep it below Kubernetes'
//!   `terminationGracePeriodSeconds` (30 s by default too: set that to the timeout plus a
//!   few seconds). A run cut short by the timeout keeps its record in flight until its
//!   lease ends, as after a crash: a retry then takes it over.
//!
//! # The SIGTERM recipe
//!
//! ```no_run
//! # async fn serve(routes: tonic::service::Routes) -> Result<(), Box<dyn std::error::Error>> {
//! use std::time::Duration;
//! use idem_server::drain::Drain;
//! use tokio::signal::unix::{SignalKind, signal};
//! use tonic::transport::Server;
//!
//! let drain = Drain::new().timeout(Duration::from_secs(20));
//! let mut sigterm = signal(SignalKind::terminate())?;
//! let on_term = drain.clone();
//! tokio::spawn(async move {
//!     sigterm.recv().await;
//!     on_term.start();
//! });
//! let addr = "0.0.0.0:50051".parse()?;
//! // `routes`: your services; the drain's layer first, then `IdempotencyLayer…`.
//! let server = Server::builder()
//!     .layer(drain.layer())
//!     .add_routes(routes)
//!     .serve_with_shutdown(addr, drain.signal());
//! let drained = drain.run(server).await?;
//! eprintln!("drained: {drained:?}");
//! # Ok(()) }
//! ```
//!
//! What no server can prevent: when the server closes a connection while the client's
//! frames are still arriving, the server's kernel answers them with a TCP reset, and the
//! client's kernel may drop the GOAWAY it had not read yet. The streams on it then fail
//! as a reset connection, which may have run: only the retry policy retries those, with
//! the call's key, so nothing runs twice.

mod refuse;
mod runs;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

pub use refuse::{Refuse, RefuseFuture, RefuseLayer, StreamRefused};
pub use runs::protected_runs;
pub(crate) use runs::{protect, protect_answering};

/// The default drain timeout.
pub const DEFAULT_DRAIN_TIMEOUT: Duration = Duration::from_secs(30);

/// A server's drain: [`signal`](Self::signal) for `serve_with_shutdown`,
/// [`start`](Self::start) from a SIGTERM handler, [`run`](Self::run) around the server
/// future. Cheap to clone; clones share the drain.
#[derive(Debug, Clone)]
pub struct Drain {
    started: Arc<watch::Sender<bool>>,
    timeout: Duration,
    /// The runs it waits for: the process's (tests count their own).
    runs: &'static runs::Runs,
}

impl Default for Drain {
    fn default() -> Self {
        Drain::new()
    }
}

/// How a drain ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Drained {
    /// Protected runs still going when the drain ended (0 unless it timed out).
    pub runs_left: usize,
    /// The drain timeout passed before the server and its runs were done.
    pub timed_out: bool,
    /// From the start of the drain to its end.
    pub took: Duration,
}

impl Drain {
    /// A drain not started yet, with the default timeout ([`DEFAULT_DRAIN_TIMEOUT`]).
    pub fn new() -> Self {
        Drain {
            started: Arc::new(watch::channel(false).0),
            timeout: DEFAULT_DRAIN_TIMEOUT,
            runs: &runs::PROCESS,
        }
    }

    /// How long the drain may take, from [`start`](Self::start) to the end of
    /// [`run`](Self::run).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Starts the drain (again: no effect).
    pub fn start(&self) {
        self.started.send_replace(true);
    }

    /// The layer that refuses new streams with `REFUSED_STREAM` once the drain started
    /// (see the [module docs](self)): put it first, `Server::builder().layer(drain.layer())`.
    pub fn layer(&self) -> RefuseLayer {
        RefuseLayer::new(self.started.subscribe())
    }

    /// Whether the drain started.
    pub fn is_started(&self) -> bool {
        *self.started.borrow()
    }

    /// Resolves once the drain starts: the shutdown signal for tonic's
    /// `serve_with_shutdown`.
    pub fn signal(&self) -> impl Future<Output = ()> + Send + 'static {
        let mut rx = self.started.subscribe();
        async move {
            // An error: every sender is gone, so the drain can never start.
            if rx.wait_for(|s| *s).await.is_err() {
                std::future::pending::<()>().await;
            }
        }
    }

    /// Awaits `server` (a `serve_with_shutdown(…, self.signal())` future), then the
    /// protected runs still going; from the drain's start, all of it within the drain
    /// timeout. `Err` with the server's error.
    pub async fn run<E>(&self, server: impl Future<Output = Result<(), E>>) -> Result<Drained, E> {
        let mut server = std::pin::pin!(server);
        let stopped = tokio::select! {
            r = &mut server => {
                r?;
                true
            }
            () = self.signal() => false,
        };
        let start = Instant::now();
        // A server that stopped by itself (no drain) still lets its runs finish.
        let rest = async {
            if !stopped {
                server.await?;
            }
            self.runs.wait_idle().await;
            Ok::<(), E>(())
        };
        let timed_out = match tokio::time::timeout_at(start + self.timeout, rest).await {
            Ok(r) => {
                r?;
                false
            }
            Err(_) => true,
        };
        let drained = Drained {
            runs_left: self.runs.count(),
            timed_out,
            took: start.elapsed(),
        };
        if timed_out {
            tracing::warn!(runs_left = drained.runs_left, "drain timeout passed");
        }
        Ok(drained)
    }
}

#[cfg(test)]
mod tests;
