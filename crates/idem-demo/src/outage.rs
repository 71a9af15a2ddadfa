//! `--outage-after N --outage-for SECONDS`: once N intents are done, every instance
//! answers UNAVAILABLE for that long (before the handler: nothing runs), then recovers.
//! The [`Outage`] counts the attempts that reached a server and the calls the
//! application made while it lasted, and the time from recovery to the first success.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

/// One outage of a run, shared by the fault injector and the workload.
#[derive(Debug, Clone, Default)]
pub struct Outage(Arc<State>);

#[derive(Debug, Default)]
struct State {
    /// When it started and ended, once started.
    window: OnceLock<(Instant, Instant)>,
    attempts: AtomicU64,
    calls: AtomicU64,
    /// Microseconds from the recovery to the first OK a caller got after it, plus one.
    first_success: AtomicU64,
}

/// What an outage did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OutageReport {
    /// Attempts that reached a server during the outage.
    pub attempts: u64,
    /// Calls the application made during the outage.
    pub calls: u64,
    /// From the recovery to the first OK after it; `None` if none came.
    pub first_success: Option<Duration>,
}

impl OutageReport {
    /// Attempts per call: the amplification.
    pub fn ratio(&self) -> f64 {
        self.attempts as f64 / self.calls.max(1) as f64
    }
}

impl std::fmt::Display for OutageReport {
    /// `outage: A attempts for C calls (R×)`, then the time to the first success.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "outage: {} attempts for {} calls ({:.2}×)",
            self.attempts,
            self.calls,
            self.ratio()
        )?;
        match self.first_success {
            Some(d) => write!(
                f,
                "; first success {:.0} ms after recovery",
                d.as_secs_f64() * 1e3
            ),
            None => write!(f, "; no success after recovery"),
        }
    }
}

impl Outage {
    /// Starts the outage now, for `length`.
    pub fn start(&self, length: Duration) {
        let now = Instant::now();
        let _ = self.0.window.set((now, now + length));
    }

    /// Whether it is under way now.
    pub fn active(&self) -> bool {
        self.0
            .window
            .get()
            .is_some_and(|(from, to)| (*from..*to).contains(&Instant::now()))
    }

    /// An attempt reached a server: `true` when it must fail (the outage is on).
    pub fn attempt(&self) -> bool {
        let on = self.active();
        if on {
            self.0.attempts.fetch_add(1, Ordering::Relaxed);
        }
        on
    }

    /// The application is making a call.
    pub fn call(&self) {
        if self.active() {
            self.0.calls.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A caller got an OK.
    pub fn success(&self) {
        let Some((_, to)) = self.0.window.get() else {
            return;
        };
        let now = Instant::now();
        if now >= *to {
            let micros = u64::try_from((now - *to).as_micros()).unwrap_or(u64::MAX - 1) + 1;
            let _ = self.0.first_success.compare_exchange(
                0,
                micros,
                Ordering::Relaxed,
                Ordering::Relaxed,
            );
        }
    }

    /// What it did; `None` if it never started.
    pub fn report(&self) -> Option<OutageReport> {
        self.0.window.get()?;
        let first = self.0.first_success.load(Ordering::Relaxed);
        Some(OutageReport {
            attempts: self.0.attempts.load(Ordering::Relaxed),
            calls: self.0.calls.load(Ordering::Relaxed),
            first_success: (first > 0).then(|| Duration::from_micros(first - 1)),
        })
    }

    /// The application's wait before calling again after a failure during an outage
    /// run: the server's (or the breaker's) `RetryInfo` delay when there is one, else
    /// 100 ms; plus up to 20 % jitter, so callers do not come back all at once.
    pub fn app_wait(status: &tonic::Status) -> Duration {
        use rand::Rng;
        use tonic_types::StatusExt;
        let asked = status
            .get_details_retry_info()
            .and_then(|r| r.retry_delay)
            .unwrap_or(Duration::from_millis(100));
        asked.mul_f64(1.0 + 0.2 * rand::rng().random::<f64>())
    }
}
