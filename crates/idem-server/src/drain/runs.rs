//! The protected runs of this process: counted from the claim to the recorded outcome.

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::sync::Notify;

/// A count of runs, and a wake-up when it reaches 0.
#[derive(Debug)]
pub(crate) struct Runs {
    count: AtomicUsize,
    idle: Notify,
}

/// Every idempotency layer of the process counts its runs here.
pub(crate) static PROCESS: Runs = Runs::new();

/// Protected runs of this process (every idempotency layer in it) between their claim
/// and their recorded outcome, including runs whose caller went away.
pub fn protected_runs() -> usize {
    PROCESS.count()
}

/// `run`, counted in the process's runs from now until it ends or is dropped.
pub(crate) fn protect<F: Future<Output = ()> + 'static>(
    run: F,
) -> impl Future<Output = ()> + use<F> {
    PROCESS.protect(run)
}

/// [`protect`] for a run that answers: counted from now until it ends or is dropped.
/// A struct, not an `async` block: the block would hold `run` twice (as its capture and
/// as the future it awaits), and a run is large.
pub(crate) fn protect_answering<F: Future>(run: F) -> Counted<F> {
    Counted {
        run,
        _guard: RunGuard::new(&PROCESS),
    }
}

pin_project_lite::pin_project! {
    /// A run counted in the process's runs while it is alive.
    pub(crate) struct Counted<F> {
        #[pin]
        run: F,
        _guard: RunGuard<'static>,
    }
}

impl<F: Future> Future for Counted<F> {
    type Output = F::Output;

    fn poll(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<F::Output> {
        self.project().run.poll(cx)
    }
}

impl Runs {
    pub(crate) const fn new() -> Self {
        Runs {
            count: AtomicUsize::new(0),
            idle: Notify::const_new(),
        }
    }

    pub(crate) fn count(&self) -> usize {
        self.count.load(Ordering::Acquire)
    }

    /// `run`, counted from now until it ends or is dropped.
    pub(crate) fn protect<'a, F: Future<Output = ()> + 'a>(
        &'a self,
        run: F,
    ) -> impl Future<Output = ()> + 'a {
        let guard = RunGuard::new(self);
        async move {
            let _guard = guard;
            run.await;
        }
    }

    /// Resolves once no run is left.
    pub(crate) async fn wait_idle(&self) {
        loop {
            let idle = self.idle.notified();
            let mut idle = std::pin::pin!(idle);
            // Registered before the count is read: a run ending in between still wakes
            // this waiter.
            idle.as_mut().enable();
            if self.count() == 0 {
                return;
            }
            idle.await;
        }
    }
}

/// Counts one run while it is alive.
pub(crate) struct RunGuard<'a>(&'a Runs);

impl<'a> RunGuard<'a> {
    fn new(runs: &'a Runs) -> Self {
        runs.count.fetch_add(1, Ordering::AcqRel);
        RunGuard(runs)
    }
}

impl Drop for RunGuard<'_> {
    fn drop(&mut self) {
        if self.0.count.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}
