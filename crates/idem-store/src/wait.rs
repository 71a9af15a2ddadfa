//! For a backend's [`Store::wait`](crate::Store::wait): a loop that reads the record and,
//! while it is the same live claim, sleeps until a notification, the next poll, the end
//! of the lease or the caller's deadline (whichever is first), then reads again.
//! `idem-redis` and `idem-postgres` wait this way; only their notifications differ
//! (pub/sub, `LISTEN`/`NOTIFY`).
//!
//! ```
//! # async fn f() {
//! use std::time::Duration;
//! use tokio::sync::Notify;
//! use tokio::time::Instant;
//!
//! let notify = Notify::new();
//! let until = Instant::now() + Duration::from_millis(20);
//! // Armed before the record is read, so a change published after the read still wakes.
//! let mut notified = std::pin::pin!(Some(notify.notified()));
//! if let Some(n) = notified.as_mut().as_pin_mut() {
//!     n.enable();
//! }
//! let now = Instant::now();
//! let wake = idem_store::wait::next_read(now, Duration::from_millis(5), Duration::from_secs(1), until);
//! idem_store::wait::sleep_or_notified(notified.as_mut(), wake).await;
//! # }
//! ```

use std::pin::Pin;
use std::time::Duration;

use tokio::sync::futures::Notified;
use tokio::time::Instant;

/// When a waiter reads the record next: `poll` after `now`, one millisecond past the end
/// of the lease (`lease_left` after `now`, so that the read sees it ended), or `until`,
/// whichever is first.
pub fn next_read(now: Instant, poll: Duration, lease_left: Duration, until: Instant) -> Instant {
    (now + poll)
        .min(now + lease_left + Duration::from_millis(1))
        .min(until)
}

/// Sleeps until `notified` is woken (never, when it is `None`: the waiter only polls) or
/// until `wake`, whichever is first.
pub async fn sleep_or_notified(notified: Pin<&mut Option<Notified<'_>>>, wake: Instant) {
    let woken = async {
        match notified.as_pin_mut() {
            Some(n) => n.await,
            None => std::future::pending().await,
        }
    };
    let _ = tokio::time::timeout_at(wake, woken).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_next_read_is_the_first_of_poll_lease_end_and_deadline() {
        let now = Instant::now();
        let ms = Duration::from_millis;
        let far = now + Duration::from_secs(60);
        assert_eq!(next_read(now, ms(5), ms(100), far), now + ms(5));
        assert_eq!(next_read(now, ms(500), ms(100), far), now + ms(101));
        assert_eq!(next_read(now, ms(500), ms(100), now + ms(7)), now + ms(7));
    }

    #[tokio::test(start_paused = true)]
    async fn a_notification_or_the_wake_time_ends_the_sleep() {
        let start = Instant::now();
        let mut none = std::pin::pin!(None);
        sleep_or_notified(none.as_mut(), start + Duration::from_millis(30)).await;
        assert_eq!(Instant::now(), start + Duration::from_millis(30));

        let notify = std::sync::Arc::new(tokio::sync::Notify::new());
        let mut notified = std::pin::pin!(Some(notify.notified()));
        if let Some(n) = notified.as_mut().as_pin_mut() {
            n.enable();
        }
        notify.notify_waiters();
        let before = Instant::now();
        sleep_or_notified(notified.as_mut(), before + Duration::from_secs(10)).await;
        assert_eq!(Instant::now(), before);
    }
}
