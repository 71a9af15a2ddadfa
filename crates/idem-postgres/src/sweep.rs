//! The background sweep of expired records.
//!
//! Expired rows already count as absent to every function; the sweep only reclaims their
//! space. One task per store, holding only a `Weak` reference, so it stops with the last
//! clone of the store. Each sweep is one bounded `DELETE` (at most the sweep batch, rows
//! locked by others skipped), so instances sweeping the same table do not contend.

use std::sync::Weak;
use std::time::Duration;

use crate::store::Backend;

/// After a full batch, the next sweep comes this soon: bounded work per `DELETE`, and a
/// backlog cleared at about a batch per 50 ms, not left for a whole interval.
///
/// It was 1 s: a batch of 1000 a second plus the `DELETE`'s own time is less than the
/// 1000 records a second that expire at 1000 fresh calls/s, so the backlog a 60 s
/// interval leaves never cleared and the table grew for as long as the load lasted
/// (BENCHMARKS.md, "Soak with the default settings").
const AGAIN: Duration = Duration::from_millis(50);

/// The pause before the next sweep, after one that deleted `deleted` of at most `batch`.
fn pause(deleted: u64, batch: u64, interval: Duration) -> Duration {
    if deleted >= batch {
        AGAIN.min(interval)
    } else {
        interval
    }
}

pub(crate) fn spawn(backend: Weak<Backend>, interval: Duration) {
    tokio::spawn(async move {
        let mut next = interval;
        loop {
            tokio::time::sleep(next).await;
            let Some(backend) = backend.upgrade() else {
                return;
            };
            next = match backend.sweep().await {
                Ok(n) => pause(n, backend.sweep_batch(), interval),
                Err(e) => {
                    tracing::debug!(target: "idem_postgres", error = %e, "sweep failed");
                    interval
                }
            };
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_batch_sweeps_again_soon_and_a_partial_one_waits_the_interval() {
        let minute = Duration::from_secs(60);
        assert_eq!(pause(1000, 1000, minute), Duration::from_millis(50));
        assert_eq!(pause(999, 1000, minute), minute);
        assert_eq!(pause(0, 1000, minute), minute);
        // Never later than the interval itself.
        let short = Duration::from_millis(10);
        assert_eq!(pause(1000, 1000, short), short);
    }
}
