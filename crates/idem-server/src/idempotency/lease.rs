//! A claimed record's lease: kept alive by the layer's renewal task (see
//! [`renewal`](super::renewal)) while the handler runs and until the outcome is recorded,
//! then given up by recording it (complete or release).
//!
//! The renewal task is not the handler's, so a handler that blocks its thread (a
//! synchronous driver, a long computation) keeps its lease as long as the process
//! runs. A completion or release the store refuses transiently is retried with
//! backoff, the lease still renewed, for up to `completionRetryTimeout`: a duplicate
//! waiting for the outcome gets it, instead of running the handler again when the lease
//! ends.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use std::sync::Arc;

use idem_store::{Cause, CompleteRequest, RecordRef, Store, StoreError, StoredOutcome};
use tokio::sync::oneshot;
use tokio::time::Instant;

use super::layer::Shared;
use super::renewal::Registration;
use super::stats::{Counter, IdempotencyStats};
use crate::metrics::CallTrace;

/// Backoff between attempts to record an outcome: 20 ms doubling to 1 s, ±20 % jitter.
const FIRST_RETRY: Duration = Duration::from_millis(20);
const MAX_RETRY: Duration = Duration::from_secs(1);

/// The lease on a claimed record, renewed until this is consumed by
/// [`complete`](Self::complete) or [`release`](Self::release), or dropped.
pub(crate) struct Lease<St> {
    store: St,
    /// The record, held with its fence; the handler gets a clone.
    record: RecordRef,
    stats: IdempotencyStats,
    /// How long a completion or release the store refuses transiently is retried.
    retry_for: Duration,
    renewal: Registration,
    /// The call's trace, told what became of the record.
    trace: Option<Arc<CallTrace>>,
}

/// What an attempt to record an outcome leaves to do.
enum Step {
    Done(Result<(), Unrecorded>),
    /// The store failed transiently: try again.
    Retry(Cause),
}

/// Why an outcome could not be recorded.
enum Unrecorded {
    /// Another claimant took the record over after this lease ended.
    Fenced,
    /// The store kept failing, or answered something else; the record is left to its
    /// lease.
    Failed(StoreError),
}

impl<St: Store> Lease<St> {
    /// Starts renewing the lease on `record` every `leaseTtl / 3`, with the layer's
    /// renewal task; an outcome is then retried for up to `retry_for` and told to
    /// `trace`.
    pub(crate) fn start(
        layer: &Shared<St>,
        record: RecordRef,
        retry_for: Duration,
        trace: Option<Arc<CallTrace>>,
    ) -> Self {
        let renewal = layer.renewals.register(
            &layer.store,
            &layer.stats,
            *record.scope(),
            record.fence(),
            record.lease_ttl(),
        );
        Lease {
            store: layer.store.clone(),
            record,
            stats: layer.stats.clone(),
            retry_for,
            renewal,
            trace,
        }
    }

    /// The record this lease holds.
    pub(crate) fn record(&self) -> &RecordRef {
        &self.record
    }

    /// This lease started or woke the layer's renewal task. The task then sits in this
    /// worker's next-task slot, which other workers cannot take: the caller yields once
    /// before the handler runs, so that a handler that blocks its thread does not hold
    /// the renewals back.
    pub(crate) fn scheduled_renewal_task(&self) -> bool {
        self.renewal.scheduled_task
    }

    /// Records the outcome, so duplicates replay it. A response the store has no room
    /// for is recorded as not retained: a duplicate then learns that the call completed,
    /// rather than running it again.
    ///
    /// The first attempt is made here, and the caller gets its response after it, landed
    /// or not. What is left when it did not land (retries of a transient failure, or the
    /// not-retained record of a response that did not fit) is returned, to run apart;
    /// the lease is renewed meanwhile.
    pub(crate) async fn complete(
        self,
        outcome: StoredOutcome,
        ttl: Duration,
    ) -> Option<Pin<Box<dyn Future<Output = ()> + Send>>> {
        let first = self
            .store
            .complete(self.completion(outcome.clone(), ttl))
            .await;
        match self.step(first, false) {
            Step::Done(Err(Unrecorded::Failed(StoreError::Full(e))))
                if matches!(outcome, StoredOutcome::Response(_)) =>
            {
                Some(Box::pin(self.not_retained(e, ttl)))
            }
            Step::Done(r) => {
                self.report(r, "completion", Counter::stored);
                None
            }
            Step::Retry(e) => Some(Box::pin(async move {
                // Retried for `retry_for` from the first failure.
                let give_up = Instant::now() + self.retry_for;
                let store = &self.store;
                let op = || store.complete(self.completion(outcome.clone(), ttl));
                match self.retry(e, give_up, op, false).await {
                    Err(Unrecorded::Failed(StoreError::Full(e)))
                        if matches!(outcome, StoredOutcome::Response(_)) =>
                    {
                        self.not_retained(e, ttl).await;
                    }
                    r => self.report(r, "completion", Counter::stored),
                }
            })),
        }
    }

    fn completion(&self, outcome: StoredOutcome, ttl: Duration) -> CompleteRequest<'_> {
        CompleteRequest {
            scope: self.record.scope(),
            fence: self.record.fence(),
            outcome,
            ttl,
        }
    }

    /// The store has no room for the response: record that the call completed, without
    /// it.
    async fn not_retained(self, e: Cause, ttl: Duration) {
        self.stats.inc(Counter::not_retained);
        tracing::warn!(error = %e, scope = %self.short_scope(), "no room in the store for the response: recorded as not retained");
        let (attempted, _) = oneshot::channel();
        let store = &self.store;
        let r = self
            .settle(
                attempted,
                || store.complete(self.completion(StoredOutcome::NotRetained, ttl)),
                false,
            )
            .await;
        self.report(r, "completion", Counter::stored);
    }

    /// The record was completed under this fence by the handler's own transaction (see
    /// `RecordRef`): nothing is left to record; renewal stops.
    pub(crate) fn completed_elsewhere(self) {
        self.stats.inc(Counter::stored);
    }

    /// Gives the record up (nothing was done), so the next claim runs the handler.
    ///
    /// Unlike a completion's, `attempted` fires once the release has landed (or been
    /// given up, past `retry_for`), retries included: the caller's answer (often "fix
    /// your request") waits for it, so a corrected request sent right after it finds the
    /// key free instead of held (`KEY_REUSED`).
    pub(crate) async fn release(self, attempted: oneshot::Sender<()>) {
        let (store, scope, fence) = (&self.store, self.record.scope(), self.record.fence());
        let (first, _) = oneshot::channel();
        let r = self
            .settle(first, || store.release(scope, fence), true)
            .await;
        let _ = attempted.send(());
        self.report(r, "release", Counter::released);
    }

    /// Runs `op` until it lands, retrying transient store failures with backoff for up
    /// to `retry_for`; the renewal task keeps the lease meanwhile. `gone_is_landed`: see
    /// [`retry`](Self::retry).
    async fn settle<F, Fut>(
        &self,
        attempted: oneshot::Sender<()>,
        mut op: F,
        gone_is_landed: bool,
    ) -> Result<(), Unrecorded>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<(), StoreError>>,
    {
        let give_up = Instant::now() + self.retry_for;
        let r = op().await;
        let _ = attempted.send(());
        match self.step(r, false) {
            Step::Done(r) => r,
            Step::Retry(e) => self.retry(e, give_up, op, gone_is_landed).await,
        }
    }

    /// What an attempt's answer leaves to do. `gone_is_landed`: this is a release retried
    /// after a transient failure, so "no record at all" means the failed attempt landed.
    fn step(&self, r: Result<(), StoreError>, gone_is_landed: bool) -> Step {
        match r {
            Ok(()) => Step::Done(Ok(())),
            // The record holds this fence but is no longer in flight: an earlier
            // attempt landed and only its reply was lost.
            Err(StoreError::Fenced { presented, current }) if current == Some(presented) => {
                Step::Done(Ok(()))
            }
            // A release retried after a transient failure finds no record: the failed
            // attempt had deleted it (only its reply was lost). A takeover would have
            // left a record under a newer fence.
            Err(StoreError::Fenced { current: None, .. }) if gone_is_landed => Step::Done(Ok(())),
            Err(StoreError::Fenced { .. }) => Step::Done(Err(Unrecorded::Fenced)),
            Err(StoreError::Unavailable(e)) => Step::Retry(e),
            Err(e) => Step::Done(Err(Unrecorded::Failed(e))),
        }
    }

    /// Retries `op` after its attempt failed transiently with `e`, with backoff, until
    /// it lands or `give_up` passes. `gone_is_landed` (a release): an attempt that finds
    /// no record at all counts as landed, since the failed attempt may have deleted it.
    async fn retry<F, Fut>(
        &self,
        mut e: Cause,
        give_up: Instant,
        mut op: F,
        gone_is_landed: bool,
    ) -> Result<(), Unrecorded>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<(), StoreError>>,
    {
        let mut wait = FIRST_RETRY;
        loop {
            self.stats.inc(Counter::store_errors);
            let jittered = jitter(wait);
            if Instant::now() + jittered > give_up {
                return Err(Unrecorded::Failed(StoreError::Unavailable(e)));
            }
            tracing::debug!(error = %e, "store refused to record the outcome; retrying");
            self.stats.inc(Counter::record_retries);
            tokio::time::sleep(jittered).await;
            wait = (wait * 2).min(MAX_RETRY);
            match self.step(op().await, gone_is_landed) {
                Step::Done(r) => return r,
                Step::Retry(next) => e = next,
            }
        }
    }

    fn report(&self, r: Result<(), Unrecorded>, what: &str, landed: Counter) {
        if let Some(t) = &self.trace {
            t.recorded(match (&r, what) {
                (Ok(()), "completion") => "stored",
                (Ok(()), _) => "released",
                (Err(Unrecorded::Fenced), _) => "stale_fence",
                (Err(Unrecorded::Failed(_)), _) => "unrecorded",
            });
        }
        match r {
            Ok(()) => self.stats.inc(landed),
            Err(Unrecorded::Fenced) => {
                self.stats.inc(Counter::stale_fence);
                tracing::warn!(
                    fence = self.record.fence(),
                    "{what} refused: the lease was taken over"
                );
            }
            Err(Unrecorded::Failed(e)) => {
                if !matches!(e, StoreError::Unavailable(_)) {
                    self.stats.inc(Counter::store_errors);
                }
                self.stats.inc(Counter::unrecorded);
                tracing::warn!(
                    error = %e,
                    scope = %self.short_scope(),
                    fence = self.record.fence(),
                    "{what} could not be recorded within {:?}: the record stays in flight until its lease ends",
                    self.retry_for,
                );
            }
        }
    }

    fn short_scope(&self) -> String {
        self.record.scope().short_hex()
    }
}

/// `d` × U(0.8, 1.2).
fn jitter(d: Duration) -> Duration {
    let u = f64::from(rand::random::<u32>()) / f64::from(u32::MAX);
    d.mul_f64(0.8 + 0.4 * u)
}
