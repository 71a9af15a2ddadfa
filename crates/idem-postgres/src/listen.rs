//! Completion notifications for [`wait`](idem_store::Store::wait) over
//! `LISTEN`/`NOTIFY`.
//!
//! `idem_complete` and `idem_release` send `NOTIFY <prefix>done, '<scope hex>'` when a
//! waiter has marked the record as watched. Each store keeps one dedicated connection
//! (opened by its first wait, outside the pool) that `LISTEN`s on that channel, and a
//! task that wakes the waiters of the scope named in each notification. Waiters register
//! here, in memory, with no round trip of their own.
//!
//! If the connection is lost, notifications sent meanwhile are lost with it: the task
//! marks the listener as not listening, wakes every waiter (they read the record again
//! and poll until the listener is back), and reconnects with backoff.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use idem_store::Scope;
use sqlx::postgres::{PgConnectOptions, PgListener, PgPoolOptions};
use tokio::sync::{Notify, oneshot};

/// First wait before reconnecting the listener; doubles up to [`RECONNECT_MAX`].
const RECONNECT_MIN: Duration = Duration::from_millis(50);
const RECONNECT_MAX: Duration = Duration::from_secs(2);

struct Waiters {
    notify: Arc<Notify>,
    count: usize,
}

/// State shared by the store and the listener task.
#[derive(Default)]
struct Shared {
    waiters: Mutex<HashMap<Scope, Waiters>>,
    listening: AtomicBool,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Each critical section is one map update: a poisoned map is still consistent.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Shared {
    fn wake(&self, scope: &Scope) {
        if let Some(w) = lock(&self.waiters).get(scope) {
            w.notify.notify_waiters();
        }
    }

    fn wake_all(&self) {
        for w in lock(&self.waiters).values() {
            w.notify.notify_waiters();
        }
    }
}

/// The store's listener: started by the first wait, stopped when the store is dropped.
pub(crate) struct Listener {
    shared: Arc<Shared>,
    options: PgConnectOptions,
    channel: String,
    connect_timeout: Duration,
    /// Dropping it (with the store) stops the task.
    stop: Mutex<Option<oneshot::Sender<()>>>,
}

impl Listener {
    pub(crate) fn new(
        options: PgConnectOptions,
        channel: String,
        connect_timeout: Duration,
    ) -> Self {
        Listener {
            shared: Arc::default(),
            options,
            channel,
            connect_timeout,
            stop: Mutex::new(None),
        }
    }

    /// Registers a waiter for `scope`, starting the listener task if it is not running.
    pub(crate) fn watch(&self, scope: Scope) -> Watch {
        self.start();
        let notify = {
            let mut map = lock(&self.shared.waiters);
            let w = map.entry(scope).or_insert_with(|| Waiters {
                notify: Arc::new(Notify::new()),
                count: 0,
            });
            w.count += 1;
            w.notify.clone()
        };
        Watch {
            shared: self.shared.clone(),
            scope,
            notify,
        }
    }

    fn start(&self) {
        let mut stop = lock(&self.stop);
        if stop.is_some() {
            return;
        }
        let (tx, rx) = oneshot::channel();
        *stop = Some(tx);
        tokio::spawn(run(
            self.shared.clone(),
            self.options.clone(),
            self.channel.clone(),
            self.connect_timeout,
            rx,
        ));
    }

    /// Whether the listener connection is up (for tests and diagnostics).
    pub(crate) fn is_listening(&self) -> bool {
        self.shared.listening.load(Ordering::Acquire)
    }
}

/// A waiter's registration; dropping it unregisters.
pub(crate) struct Watch {
    shared: Arc<Shared>,
    scope: Scope,
    notify: Arc<Notify>,
}

impl Watch {
    /// Woken by a notification for the scope, or when the listener connection is lost.
    pub(crate) fn notify(&self) -> &Notify {
        &self.notify
    }

    /// Whether notifications reach this process now. Read before the record: if it is
    /// true then, any later change of the record wakes the waiter (by its notification,
    /// or by the wake-up that follows losing the connection).
    pub(crate) fn listening(&self) -> bool {
        self.shared.listening.load(Ordering::Acquire)
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        let mut map = lock(&self.shared.waiters);
        if let Some(w) = map.get_mut(&self.scope) {
            w.count -= 1;
            if w.count == 0 {
                map.remove(&self.scope);
            }
        }
    }
}

/// The listener task: connect, `LISTEN`, dispatch; on loss wake everyone and reconnect.
async fn run(
    shared: Arc<Shared>,
    options: PgConnectOptions,
    channel: String,
    connect_timeout: Duration,
    mut stop: oneshot::Receiver<()>,
) {
    let mut backoff = RECONNECT_MIN;
    loop {
        let connected = tokio::select! {
            _ = &mut stop => return,
            r = tokio::time::timeout(connect_timeout, connect(&options, &channel)) => r,
        };
        let mut listener = match connected {
            Ok(Ok(l)) => l,
            Ok(Err(e)) => {
                tracing::debug!(target: "idem_postgres", error = %e, "listener connect failed");
                if sleep_or_stop(&mut stop, &mut backoff).await {
                    return;
                }
                continue;
            }
            Err(_) => {
                tracing::debug!(target: "idem_postgres", "listener connect timed out");
                if sleep_or_stop(&mut stop, &mut backoff).await {
                    return;
                }
                continue;
            }
        };
        shared.listening.store(true, Ordering::Release);
        backoff = RECONNECT_MIN;
        let why = loop {
            let next = tokio::select! {
                _ = &mut stop => return,
                n = listener.try_recv() => n,
            };
            match next {
                Ok(Some(n)) => match parse_scope(n.payload()) {
                    Some(scope) => shared.wake(&scope),
                    None => {
                        tracing::debug!(target: "idem_postgres", payload = n.payload(), "ignored a notification")
                    }
                },
                Ok(None) => break "connection lost".to_owned(),
                Err(e) => break e.to_string(),
            }
        };
        shared.listening.store(false, Ordering::Release);
        // Notifications sent while we were away are lost: waiters read the record again.
        shared.wake_all();
        tracing::warn!(target: "idem_postgres", reason = %why, "listener connection lost; waiters poll until it is back");
        drop(listener);
        if sleep_or_stop(&mut stop, &mut backoff).await {
            return;
        }
    }
}

/// A listener on a connection of its own: a pool of one, outside the store's pool.
async fn connect(options: &PgConnectOptions, channel: &str) -> Result<PgListener, sqlx::Error> {
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .min_connections(0)
        .max_lifetime(None)
        .idle_timeout(None)
        .connect_with(options.clone())
        .await?;
    let mut listener = PgListener::connect_with(&pool).await?;
    // Reconnection is ours to do, so that we know when notifications may have been lost.
    listener.eager_reconnect(false);
    listener.listen(channel).await?;
    Ok(listener)
}

/// Sleeps for the backoff (then doubles it); true when the store was dropped meanwhile.
async fn sleep_or_stop(stop: &mut oneshot::Receiver<()>, backoff: &mut Duration) -> bool {
    let d = *backoff;
    *backoff = (*backoff * 2).min(RECONNECT_MAX);
    tokio::select! {
        _ = stop => true,
        _ = tokio::time::sleep(d) => false,
    }
}

/// The scope named by a notification: 64 lower-case hex digits.
pub(crate) fn parse_scope(payload: &str) -> Option<Scope> {
    let b = payload.as_bytes();
    if b.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, pair) in b.chunks_exact(2).enumerate() {
        let hi = (pair[0] as char).to_digit(16)?;
        let lo = (pair[1] as char).to_digit(16)?;
        out[i] = (hi * 16 + lo) as u8;
    }
    Some(Scope(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notification_payloads_parse_or_are_ignored() {
        let s = Scope([0xab; 32]);
        assert_eq!(parse_scope(&s.to_hex()), Some(s));
        assert_eq!(parse_scope(""), None);
        assert_eq!(parse_scope(&"g".repeat(64)), None);
        assert_eq!(parse_scope(&"a".repeat(63)), None);
        assert_eq!(parse_scope(&"é".repeat(32)), None);
    }

    #[tokio::test]
    async fn waiters_register_and_unregister() {
        let l = Listener::new(
            "postgres://127.0.0.1:1/x".parse().unwrap(),
            "idem_done".into(),
            Duration::from_millis(50),
        );
        let s = Scope([1; 32]);
        let a = l.watch(s);
        let b = l.watch(s);
        assert!(Arc::ptr_eq(&a.notify, &b.notify));
        assert!(!a.listening());
        drop(a);
        assert_eq!(lock(&l.shared.waiters).get(&s).map(|w| w.count), Some(1));
        drop(b);
        assert!(lock(&l.shared.waiters).is_empty());
    }
}
