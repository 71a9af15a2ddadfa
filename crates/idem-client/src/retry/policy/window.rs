//! Counts over a sliding window of time, in ten slots (as tower's `TpsBudget` and
//! Finagle's budgets keep them): what happened in the last `window`, give or take a
//! tenth of it. Pure: the caller passes the time.

use std::time::Duration;

use tokio::time::Instant;

/// Slots in a window: counts leave the window a tenth of it at a time.
const SLOTS: usize = 10;

/// `N` counters over the last `window`.
#[derive(Debug, Clone)]
pub(crate) struct RollingCounts<const N: usize> {
    slot_len: Duration,
    /// The start of slot 0 of the ring's first turn.
    epoch: Instant,
    /// The absolute number of the newest slot (its index in the ring: `head % SLOTS`).
    head: u64,
    slots: [[u64; N]; SLOTS],
}

impl<const N: usize> RollingCounts<N> {
    /// Empty counts over `window` (at least 10 ns), starting at `now`.
    pub(crate) fn new(window: Duration, now: Instant) -> Self {
        RollingCounts {
            slot_len: (window / SLOTS as u32).max(Duration::from_nanos(1)),
            epoch: now,
            head: 0,
            slots: [[0; N]; SLOTS],
        }
    }

    /// Moves the window to `now`: slots older than it are emptied.
    fn advance(&mut self, now: Instant) {
        let elapsed = now.saturating_duration_since(self.epoch);
        let slot = u64::try_from(elapsed.as_nanos() / self.slot_len.as_nanos()).unwrap_or(u64::MAX);
        if slot <= self.head {
            return;
        }
        let stale = (slot - self.head).min(SLOTS as u64);
        for k in 1..=stale {
            self.slots[((self.head + k) % SLOTS as u64) as usize] = [0; N];
        }
        self.head = slot;
    }

    /// Adds `n` to counter `i`, at `now`.
    pub(crate) fn add(&mut self, now: Instant, i: usize, n: u64) {
        self.advance(now);
        let slot = &mut self.slots[(self.head % SLOTS as u64) as usize][i];
        *slot = slot.saturating_add(n);
    }

    /// Each counter's sum over the window, at `now`.
    pub(crate) fn sums(&mut self, now: Instant) -> [u64; N] {
        self.advance(now);
        let mut sums = [0u64; N];
        for slot in &self.slots {
            for (sum, x) in sums.iter_mut().zip(slot) {
                *sum = sum.saturating_add(*x);
            }
        }
        sums
    }

    /// Forgets every count.
    pub(crate) fn clear(&mut self) {
        self.slots = [[0; N]; SLOTS];
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn counts_leave_a_tenth_of_the_window_at_a_time() {
        let t0 = Instant::now();
        let mut c = RollingCounts::<1>::new(Duration::from_secs(10), t0);
        c.add(t0, 0, 5);
        c.add(t0 + Duration::from_secs(5), 0, 3);
        assert_eq!(c.sums(t0 + Duration::from_millis(9_999)), [8]);
        assert_eq!(c.sums(t0 + Duration::from_secs(10)), [3]);
        assert_eq!(c.sums(t0 + Duration::from_secs(15)), [0]);
        c.add(t0 + Duration::from_secs(1000), 0, 1);
        assert_eq!(c.sums(t0 + Duration::from_secs(1000)), [1]);
    }

    proptest! {
        /// The sums are exactly the adds of the last 9 to 10 slots.
        #[test]
        fn sums_are_the_adds_within_the_window(
            steps in proptest::collection::vec((0u64..3_000, 0u64..5), 1..60),
        ) {
            let window = Duration::from_secs(1);
            let t0 = Instant::now();
            let mut c = RollingCounts::<1>::new(window, t0);
            let mut at = Duration::ZERO;
            let mut adds = Vec::new();
            for (dt, n) in steps {
                at += Duration::from_millis(dt);
                c.add(t0 + at, 0, n);
                adds.push((at, n));
                let slot = |d: Duration| d.as_millis() as u64 / 100;
                let expected: u64 = adds
                    .iter()
                    .filter(|(t, _)| slot(at) - slot(*t) < SLOTS as u64)
                    .map(|(_, n)| n)
                    .sum();
                prop_assert_eq!(c.sums(t0 + at), [expected]);
            }
        }
    }
}
