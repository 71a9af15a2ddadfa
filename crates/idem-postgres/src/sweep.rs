//! The background sweep of expired records.
//!
//! Expired rows already count as absent to every function; the sweep only reclaims their
//! space. One task per store, holding only a `Weak` reference, so it stops with the last
//! clone of the store. Each sweep is one bounded `DELETE` (at most the sweep batch, rows
//! locked by others skipped), so instances sweeping the same table do not contend.

use std::sync::Weak;
use std::time::Duration;

use crate::store::Backend;

/// After a full batch, the next sweep comes this soon (bounded work per sweep, and no
/// backlog left for a whole interval).
const AGAIN: Duration = Duration::from_secs(1);

pub(crate) fn spawn(backend: Weak<Backend>, interval: Duration) {
    tokio::spawn(async move {
        let mut next = interval;
        loop {
            tokio::time::sleep(next).await;
            let Some(backend) = backend.upgrade() else {
                return;
            };
            next = match backend.sweep().await {
                Ok(n) if n >= backend.sweep_batch() => AGAIN.min(interval),
                Ok(_) => interval,
                Err(e) => {
                    tracing::debug!(target: "idem_postgres", error = %e, "sweep failed");
                    interval
                }
            };
        }
    });
}
