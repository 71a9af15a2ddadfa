//! [`Striped`]: counters that every worker thread adds to without sharing a cache line.
//!
//! Both layers count every call (the client's retry counters, the metrics of
//! `idem-otel`); a counter that one atomic holds moves its cache line between the cores
//! at every call, which costs more than the rest of the count.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// A counter added to from every worker thread: each thread adds to one of a few
/// stripes, each on its own cache line, and a collection sums them. One shared atomic
/// would move its cache line between the cores at every call.
///
/// ```
/// use idem_core::striped::Striped;
///
/// let counters = Striped::<2>::default();
/// std::thread::scope(|s| {
///     for _ in 0..3 {
///         s.spawn(|| counters.add(1));
///     }
/// });
/// assert_eq!((counters.get(0), counters.get(1)), (0, 3));
/// ```
pub struct Striped<const N: usize>([Stripe<N>; STRIPES]);

/// One stripe of `N` counters, alone on its cache lines (128 bytes: x86 fetches lines
/// in pairs).
#[repr(align(128))]
struct Stripe<const N: usize>([AtomicU64; N]);

/// Stripes per counter: enough for the few busy threads of a service.
pub const STRIPES: usize = 4;

impl<const N: usize> std::fmt::Debug for Striped<N> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries((0..N).map(|i| self.get(i))).finish()
    }
}

impl<const N: usize> Default for Striped<N> {
    fn default() -> Self {
        Striped([const { Stripe([const { AtomicU64::new(0) }; N]) }; STRIPES])
    }
}

impl<const N: usize> Striped<N> {
    /// Adds one to counter `i` (an `i` past `N` is ignored).
    pub fn add(&self, i: usize) {
        if let Some(n) = self.0[stripe()].0.get(i) {
            n.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Counter `i`'s total.
    pub fn get(&self, i: usize) -> u64 {
        self.0
            .iter()
            .filter_map(|s| s.0.get(i))
            .map(|n| n.load(Ordering::Relaxed))
            .fold(0, u64::wrapping_add)
    }
}

/// This thread's stripe: threads take stripes in turn at their first count.
pub fn stripe() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static STRIPE: Cell<usize> = const { Cell::new(usize::MAX) };
    }
    STRIPE.with(|s| {
        if s.get() == usize::MAX {
            s.set(NEXT.fetch_add(1, Ordering::Relaxed) % STRIPES);
        }
        s.get()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn striped_counters_sum_every_threads_adds() {
        let c = Striped::<3>::default();
        std::thread::scope(|s| {
            for _ in 0..STRIPES + 2 {
                s.spawn(|| {
                    for _ in 0..1000 {
                        c.add(1);
                    }
                    c.add(7); // past the end: ignored
                });
            }
        });
        assert_eq!(
            (c.get(0), c.get(1), c.get(2), c.get(7)),
            (0, 1000 * (STRIPES as u64 + 2), 0, 0)
        );
    }
}
