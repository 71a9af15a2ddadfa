//! A graceful drain for rolling deploys: stop taking calls, let the protected ones finish
//! and record their outcome, then exit, bounded by a drain timeout.
//!
//! What each part does:
//!
//! - **New streams are refused, in a way clients retry transparently.** tonic's
//!   `Server::serve_with_shutdown` closes the listener when its signal fires and asks
//!   every connection to shut down gracefully: hyper (h2) sends GOAWAY with the last
//!   stream id 2³¹−1, waits one round trip (a PING), then GOAWAY with the last stream id
//!   it processed. A stream the client opened above it is refused by that GOAWAY: h2
//!   gives the client a remote GOAWAY error for it, which idem's `RetryLayer` sends
//!   again transparently (gRFC A6) on another connection. Streams at or below it run to
//!   completion. tonic then waits for every connection to close.
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
//! # async fn serve(router: tonic::transport::server::Router) -> Result<(), Box<dyn std::error::Error>> {
//! use std::time::Duration;
//! use idem_server::drain::Drain;
//! use tokio::signal::unix::{SignalKind, signal};
//!
//! let drain = Drain::new().timeout(Duration::from_secs(20));
//! let mut sigterm = signal(SignalKind::terminate())?;
//! let on_term = drain.clone();
//! tokio::spawn(async move {
//!     sigterm.recv().await;
//!     on_term.start();
//! });
//! let addr = "0.0.0.0:50051".parse()?;
//! // `router`: `Server::builder().layer(IdempotencyLayer…).add_service(…)`.
//! let server = router.serve_with_shutdown(addr, drain.signal());
//! let drained = drain.run(server).await?;
//! eprintln!("drained: {drained:?}");
//! # Ok(()) }
//! ```
//!
//! A limit of h2 0.4 the drain cannot remove: a client's h2 keeps opening streams on a
//! connection after the final GOAWAY, and the server's h2 ignores those streams; they fail
//! when the connection closes, as a broken connection, which only the retry policy
//! retries (with the call's key, so nothing runs twice).

mod runs;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

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
