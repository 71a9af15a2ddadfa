//! Lease renewal for every record a layer holds, from one task.
//!
//! A claimed record's lease is registered here when its handler starts and removed when
//! the outcome is recorded (or the [`Lease`](super::lease::Lease) is dropped). One task
//! per layer renews each registered lease every `leaseTtl / 3`: a call costs an insert
//! and a removal in a slab, not a task and a timer of its own. The task is not the
//! handler's, so a handler that blocks its thread keeps its lease while the process runs.
//! Renewals run concurrently, so one slow store answer does not hold the others back.
//!
//! The task starts with the first lease and ends when none is left (it notices at its
//! next wake-up); a later lease starts it again, also when the task died with its
//! runtime: the leases it was renewing are then due again at once. A renewal that
//! panics (a store's bug) counts as a failed renewal; the lease stays registered.
//!
//! A caller that starts or wakes the task yields once before its handler runs: the task
//! is then in that worker's next-task slot, which other workers cannot take, and a
//! handler that blocks its thread would hold every renewal of the layer back.

use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use futures_util::stream::FuturesUnordered;
use futures_util::{FutureExt, StreamExt};
use idem_store::{Fence, Scope, Store, StoreError};
use slab::Slab;
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::stats::{Counter, IdempotencyStats};

/// The leases one layer holds (shared by its clones).
#[derive(Debug, Default)]
pub(crate) struct Renewals {
    state: Mutex<Registry>,
    /// Wakes the task: a lease due earlier than its next wake-up was registered.
    wake: Notify,
}

/// The registered leases and the task that renews them, under one lock.
#[derive(Debug, Default)]
struct Registry {
    leases: Slab<Registered>,
    /// Tells a registration from a later one that reuses its slab slot.
    next_ticket: u64,
    task: Option<JoinHandle<()>>,
    /// When the task wakes next by its timer; `None` when it has none (it then wakes
    /// when told).
    wake_at: Option<Instant>,
}

/// One registered lease: which record, under which fence, and when it is due.
#[derive(Debug)]
struct Registered {
    ticket: u64,
    scope: Scope,
    fence: Fence,
    lease: Duration,
    due: Instant,
    /// A renewal of it is in flight.
    renewing: bool,
    /// The call's span, for what the renewal logs.
    span: tracing::Span,
}

/// One lease's place in [`Renewals`]; removing it stops the renewals.
#[derive(Debug)]
pub(crate) struct Registration {
    renewals: Arc<Renewals>,
    key: usize,
    ticket: u64,
    /// This registration started or woke the renewal task: the caller must yield before
    /// it runs anything that may block its thread.
    pub(crate) scheduled_task: bool,
}

impl Drop for Registration {
    fn drop(&mut self) {
        let mut state = self.renewals.lock();
        if state
            .leases
            .get(self.key)
            .is_some_and(|e| e.ticket == self.ticket)
        {
            state.leases.remove(self.key);
        }
    }
}

fn period(lease: Duration) -> Duration {
    (lease / 3).max(Duration::from_millis(1))
}

impl Renewals {
    fn lock(&self) -> std::sync::MutexGuard<'_, Registry> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Renews the lease held on `scope` with `fence` every `lease / 3` until the
    /// returned registration is dropped, or the store says the record is no longer
    /// this claimant's.
    pub(crate) fn register<St: Store>(
        self: &Arc<Self>,
        store: &St,
        stats: &IdempotencyStats,
        scope: Scope,
        fence: Fence,
        lease: Duration,
    ) -> Registration {
        let now = Instant::now();
        let due = now + period(lease);
        let span = tracing::Span::current();
        let mut state = self.lock();
        let ticket = state.next_ticket;
        state.next_ticket += 1;
        let key = state.leases.insert(Registered {
            ticket,
            scope,
            fence,
            lease,
            due,
            renewing: false,
            span,
        });
        let mut scheduled_task = true;
        if state.task.as_ref().is_none_or(JoinHandle::is_finished) {
            // A task that died (with its runtime) left the renewals it had in flight
            // marked: they are due again now.
            for (_, e) in state.leases.iter_mut().filter(|(_, e)| e.renewing) {
                e.renewing = false;
                e.due = now;
            }
            state.wake_at = None;
            let task = run(self.clone(), store.clone(), stats.clone());
            state.task = Some(tokio::spawn(task));
        } else if state.wake_at.is_none_or(|at| due < at) {
            state.wake_at = Some(due);
            self.wake.notify_one();
        } else {
            scheduled_task = false;
        }
        drop(state);
        Registration {
            renewals: self.clone(),
            key,
            ticket,
            scheduled_task,
        }
    }

    /// Marks the leases due by `now` as renewing and returns them, with the next lease
    /// due after `now` (`None`: every lease is being renewed, or none is left).
    fn take_due(&self, now: Instant) -> (Vec<Due>, Option<Instant>) {
        let mut state = self.lock();
        let mut due = Vec::new();
        let mut next: Option<Instant> = None;
        for (key, e) in state.leases.iter_mut() {
            if e.renewing {
                continue;
            }
            if e.due <= now {
                e.renewing = true;
                due.push(Due {
                    key,
                    ticket: e.ticket,
                    scope: e.scope,
                    fence: e.fence,
                    lease: e.lease,
                });
            } else {
                next = Some(next.map_or(e.due, |n| n.min(e.due)));
            }
        }
        state.wake_at = next;
        (due, next)
    }

    /// A renewal ended: schedule the next, or forget a lease that is not this
    /// claimant's any more.
    fn renewed(
        &self,
        key: usize,
        ticket: u64,
        r: Result<(), StoreError>,
        stats: &IdempotencyStats,
    ) {
        let mut state = self.lock();
        let Some(e) = state.leases.get_mut(key).filter(|e| e.ticket == ticket) else {
            return;
        };
        if let Err(StoreError::Fenced { presented, current }) = &r {
            // Not lost when the record holds this fence but is no longer in flight: a
            // renewal that raced the completion. Either way nothing is left to renew.
            let lost = *current != Some(*presented);
            let (fence, span) = (e.fence, e.span.clone());
            state.leases.remove(key);
            drop(state);
            if lost {
                stats.inc(Counter::renew_failures);
                span.in_scope(|| {
                    tracing::warn!(fence, "lease lost: another claimant took the record over");
                });
            }
            return;
        }
        e.renewing = false;
        e.due = Instant::now() + period(e.lease);
        let (due, fence, span) = (e.due, e.fence, e.span.clone());
        if state.wake_at.is_none_or(|at| due < at) {
            state.wake_at = Some(due);
            self.wake.notify_one();
        }
        drop(state);
        if let Err(err) = r {
            stats.inc(Counter::renew_failures);
            span.in_scope(|| {
                tracing::warn!(error = %err, fence, "could not renew the idempotency lease");
            });
        }
    }

    /// The task ends if no lease came in meanwhile (decided under the lock that
    /// registrations take, so none is left without a task).
    fn exit_if_idle(&self) -> bool {
        let mut state = self.lock();
        if state.leases.is_empty() {
            state.task = None;
            true
        } else {
            false
        }
    }
}

/// A lease to renew now.
struct Due {
    key: usize,
    ticket: u64,
    scope: Scope,
    fence: Fence,
    lease: Duration,
}

async fn run<St: Store>(renewals: Arc<Renewals>, store: St, stats: IdempotencyStats) {
    let mut in_flight = FuturesUnordered::new();
    loop {
        let (due, next) = renewals.take_due(Instant::now());
        for Due {
            key,
            ticket,
            scope,
            fence,
            lease,
        } in due
        {
            let store = &store;
            in_flight.push(async move {
                // A store that panics keeps the lease registered, as a failed renewal.
                let renewed = AssertUnwindSafe(store.renew(&scope, fence, lease))
                    .catch_unwind()
                    .await
                    .unwrap_or_else(|_| {
                        Err(StoreError::Unavailable("the store's renew panicked".into()))
                    });
                (key, ticket, renewed)
            });
        }
        // Nothing due later and nothing in flight: no lease is left, unless one was
        // registered since the scan.
        if next.is_none() && in_flight.is_empty() {
            if renewals.exit_if_idle() {
                return;
            }
            continue;
        }
        // Without a next lease, wake when a renewal ends or a lease is registered.
        let sleep = async {
            match next {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            Some((key, ticket, r)) = in_flight.next(), if !in_flight.is_empty() => {
                renewals.renewed(key, ticket, r, &stats);
                // Every other renewal that is done, before the next scan of the leases.
                while let Some(Some((key, ticket, r))) = in_flight.next().now_or_never() {
                    renewals.renewed(key, ticket, r, &stats);
                }
            }
            () = renewals.wake.notified() => {}
            () = sleep => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use idem_store::faulty::{FaultyStore, StoreFault as Fault};
    use idem_store::instrumented::StoreOp as Op;
    use idem_store::memory::MemoryStore;
    use idem_store::{Claim, ClaimRequest, ClaimantId, Fingerprint, TenantId};

    use super::*;

    async fn claim(store: &impl Store, n: u8, lease: Duration) -> (Scope, Fence) {
        let scope = Scope([n; 32]);
        let req = ClaimRequest {
            scope: &scope,
            tenant: &TenantId([0; 16]),
            fingerprint: &Fingerprint([n; 32]),
            claimant: ClaimantId(1),
            lease,
        };
        match store.claim(req).await.unwrap() {
            Claim::Acquired { fence, .. } => (scope, fence),
            other => panic!("{other:?}"),
        }
    }

    fn idle(renewals: &Renewals) -> bool {
        let state = renewals.lock();
        state.leases.is_empty() && state.task.is_none()
    }

    /// Lets the renewal task run what is due at the paused clock's current instant.
    async fn settle() {
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test(start_paused = true)]
    async fn each_lease_is_renewed_every_third_of_its_own_ttl_until_dropped() {
        let store = FaultyStore::new(MemoryStore::default());
        let stats = IdempotencyStats::default();
        let renewals = Arc::new(Renewals::default());
        let (short, long) = (Duration::from_secs(3), Duration::from_secs(30));
        let (a, fa) = claim(&store, 1, short).await;
        let (b, fb) = claim(&store, 2, long).await;
        let ra = renewals.register(&store, &stats, a, fa, short);
        let rb = renewals.register(&store, &stats, b, fb, long);
        assert!(ra.scheduled_task, "the first lease starts the task");
        assert!(renewals.lock().task.is_some());
        settle().await;
        // The task now sleeps until the 3 s lease's first renewal (1 s): a lease due
        // later does not wake it, one due sooner does, and its caller must yield.
        let (d, fd) = claim(&store, 4, long).await;
        assert!(
            !renewals
                .register(&store, &stats, d, fd, long)
                .scheduled_task
        );
        let quick = Duration::from_millis(300);
        let (e, fe) = claim(&store, 5, quick).await;
        assert!(
            renewals
                .register(&store, &stats, e, fe, quick)
                .scheduled_task,
            "it woke the task"
        );

        tokio::time::sleep(Duration::from_millis(3500)).await;
        settle().await;
        assert_eq!(
            store.calls(Op::Renew),
            3,
            "the 3 s lease at 1 s, 2 s and 3 s (the two dropped at once, never)"
        );
        // Past its first 3 s the short lease is alive only because it was renewed.
        assert!(matches!(store.renew(&a, fa, short).await, Ok(())));
        drop(ra);
        tokio::time::sleep(Duration::from_secs(7)).await;
        settle().await;
        assert_eq!(
            store.calls(Op::Renew),
            4 + 1,
            "the short lease is no longer renewed; the long one once, at 10 s"
        );
        drop(rb);
        tokio::time::sleep(Duration::from_secs(60)).await;
        settle().await;
        assert_eq!(store.calls(Op::Renew), 5);
        assert!(idle(&renewals), "the task ends with the last lease");
        assert_eq!(stats.snapshot().renew_failures, 0);

        // A later lease starts it again.
        let (c, fc) = claim(&store, 3, short).await;
        let rc = renewals.register(&store, &stats, c, fc, short);
        assert!(rc.scheduled_task);
        tokio::time::sleep(Duration::from_millis(1100)).await;
        settle().await;
        assert_eq!(store.calls(Op::Renew), 6);
    }

    #[tokio::test(start_paused = true)]
    async fn a_lease_taken_over_stops_being_renewed_and_failures_keep_trying() {
        let store = FaultyStore::new(MemoryStore::default());
        let stats = IdempotencyStats::default();
        let renewals = Arc::new(Renewals::default());
        let lease = Duration::from_secs(3);
        let (a, fa) = claim(&store, 1, lease).await;
        let (b, fb) = claim(&store, 2, lease).await;
        // `b`'s claimant already recorded its outcome: the record holds its fence but is
        // not in flight; `a` was never this fence's.
        store
            .complete(idem_store::CompleteRequest {
                scope: &b,
                fence: fb,
                outcome: idem_store::StoredOutcome::NotRetained,
                ttl: lease * 10,
            })
            .await
            .unwrap();
        let _ra = renewals.register(&store, &stats, a, fa + 1, lease);
        let _rb = renewals.register(&store, &stats, b, fb, lease);
        tokio::time::sleep(Duration::from_millis(1100)).await;
        settle().await;
        assert_eq!(store.calls(Op::Renew), 2);
        assert!(
            renewals.lock().leases.is_empty(),
            "neither is renewed again"
        );
        assert_eq!(
            stats.snapshot().renew_failures,
            1,
            "only the lease lost to another fence counts as a failure"
        );

        // A store that cannot answer: the lease stays registered and is tried again.
        let (c, fc) = claim(&store, 3, lease).await;
        store.inject(Op::Renew, Fault::Unavailable, 1);
        let _rc = renewals.register(&store, &stats, c, fc, lease);
        tokio::time::sleep(Duration::from_millis(2100)).await;
        settle().await;
        assert_eq!(store.calls(Op::Renew), 2 + 2);
        assert_eq!(stats.snapshot().renew_failures, 1 + 1);
        tokio::time::sleep(Duration::from_millis(2000)).await;
        assert!(
            matches!(store.renew(&c, fc, lease).await, Ok(())),
            "the second renewal kept the lease past its first 3 s"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_renewal_that_panics_counts_as_failed_and_the_lease_is_renewed_after() {
        let store = FaultyStore::new(MemoryStore::default());
        store.inject(Op::Renew, Fault::Panic, 1);
        let stats = IdempotencyStats::default();
        let renewals = Arc::new(Renewals::default());
        let lease = Duration::from_secs(3);
        let (a, fa) = claim(&store, 1, lease).await;
        let _ra = renewals.register(&store, &stats, a, fa, lease);
        tokio::time::sleep(Duration::from_millis(1100)).await;
        settle().await;
        assert_eq!(
            stats.snapshot().renew_failures,
            1,
            "the panic, as a failure"
        );
        // Renewed at 2 s and 3 s: alive past its first 3 s.
        tokio::time::sleep(Duration::from_millis(2500)).await;
        settle().await;
        assert!(matches!(store.renew(&a, fa, lease).await, Ok(())));
        assert_eq!(stats.snapshot().renew_failures, 1);
    }

    #[test]
    fn a_task_that_died_with_its_runtime_is_started_again_with_its_renewals_due() {
        let store = FaultyStore::new(MemoryStore::default());
        let stats = IdempotencyStats::default();
        let renewals = Arc::new(Renewals::default());
        let lease = Duration::from_secs(3);
        let paused = || {
            tokio::runtime::Builder::new_current_thread()
                .enable_time()
                .start_paused(true)
                .build()
                .unwrap()
        };
        let first = paused();
        let (a, fa, ra) = first.block_on(async {
            let (a, fa) = claim(&store, 1, lease).await;
            let ra = renewals.register(&store, &stats, a, fa, lease);
            settle().await;
            (a, fa, ra)
        });
        // The runtime goes with the task; the lease is still registered, and (as if its
        // renewal had been in flight) marked as being renewed.
        drop(first);
        renewals
            .lock()
            .leases
            .iter_mut()
            .for_each(|(_, e)| e.renewing = true);
        let second = paused();
        second.block_on(async {
            let (b, fb) = claim(&store, 2, lease).await;
            let rb = renewals.register(&store, &stats, b, fb, lease);
            assert!(rb.scheduled_task, "a new task");
            settle().await;
            assert_eq!(store.calls(Op::Renew), 1, "the stranded renewal, at once");
            tokio::time::sleep(Duration::from_millis(1100)).await;
            settle().await;
            assert_eq!(store.calls(Op::Renew), 3, "then both, a second later");
            assert!(matches!(store.renew(&a, fa, lease).await, Ok(())));
            drop((ra, rb));
        });
    }
}
