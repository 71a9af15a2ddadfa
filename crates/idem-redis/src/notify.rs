//! Completion notifications for [`wait`](idem_store::Store::wait) over Redis
//! pub/sub.
//!
//! The complete and release scripts `PUBLISH` the record's fence on
//! `<prefix>{<scope hex>}:done` (on Redis Cluster `SPUBLISH`: a sharded channel, which
//! carries the record's hash tag, so it lives in the record's slot and the message stays
//! on that shard instead of crossing the whole cluster bus). A store that waits with
//! [`WaitStrategy::Notify`](crate::WaitStrategy::Notify) keeps one subscriber
//! connection (opened on the first wait), subscribes to a record's channel while
//! somebody in this process waits on it (one `SUBSCRIBE` per waiter, one `UNSUBSCRIBE`
//! when the last leaves), and wakes the waiters when a message arrives. Subscribing
//! completes before the waiter reads the record, so a completion between the read and
//! the wake-up is never missed while the connection lives; if the connection drops,
//! every waiter is woken and falls back to polling.
//!
//! On Redis Cluster the subscriber is a cluster connection of its own (RESP3, push
//! messages), which sends each `SSUBSCRIBE` to the master of the channel's slot and
//! subscribes again by itself after a reconnection or a slot move (a failover, a
//! resharding). Messages published while it was away are lost, so a disconnection
//! wakes every waiter: they read the record again and keep polling as a fallback.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use futures_util::StreamExt;
use redis::aio::PubSubSink;
use redis::cluster::ClusterClientBuilder;
use redis::cluster_async::ClusterConnection;
use redis::{ProtocolVersion, PushInfo, PushKind, Value};
use tokio::sync::Notify;

/// Waiters of one channel in this process.
#[derive(Debug)]
struct Channel {
    notify: Arc<Notify>,
    watchers: usize,
}

/// Every channel waited on in this process, shared with the dispatch task.
type Channels = Arc<Mutex<HashMap<String, Channel>>>;

/// Where the subscriber connects.
pub(crate) enum Target {
    /// One endpoint: `SUBSCRIBE` on a pub/sub connection.
    Single(redis::Client),
    /// Redis Cluster seed nodes: `SSUBSCRIBE` on a cluster connection.
    Cluster(Vec<String>),
}

/// The subscribing half of the live subscriber connection.
enum Sink {
    Single(PubSubSink),
    Cluster(ClusterConnection),
}

impl Sink {
    async fn subscribe(&mut self, channel: &str) -> redis::RedisResult<()> {
        match self {
            Sink::Single(s) => s.subscribe(channel).await,
            Sink::Cluster(c) => c.ssubscribe(channel).await,
        }
    }

    async fn unsubscribe(&mut self, channel: &str) -> redis::RedisResult<()> {
        match self {
            Sink::Single(s) => s.unsubscribe(channel).await,
            Sink::Cluster(c) => c.sunsubscribe(channel).await,
        }
    }
}

/// The live subscriber connection.
struct Conn {
    sink: Sink,
    dead: Arc<AtomicBool>,
}

/// Shared by every clone of a store.
pub(crate) struct Notifier {
    target: Target,
    connect_timeout: Duration,
    command_timeout: Duration,
    /// Serialises SUBSCRIBE / UNSUBSCRIBE with the watcher counts, so an unsubscribe
    /// can never overtake a later subscribe of the same channel.
    conn: tokio::sync::Mutex<Option<Conn>>,
    channels: Channels,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every critical section is a single map update: a poisoned map is still consistent.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A waiter's registration; dropping it unsubscribes when it was the last one.
pub(crate) struct Watch {
    notifier: Arc<Notifier>,
    channel: String,
    notify: Arc<Notify>,
}

impl Watch {
    /// Woken by a message on the channel or a lost subscriber connection.
    pub(crate) fn notify(&self) -> &Notify {
        &self.notify
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        let notifier = self.notifier.clone();
        let channel = std::mem::take(&mut self.channel);
        let notify = self.notify.clone();
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move { notifier.unwatch(channel, notify).await });
        }
    }
}

impl Notifier {
    pub(crate) fn new(
        target: Target,
        connect_timeout: Duration,
        command_timeout: Duration,
    ) -> Self {
        Notifier {
            target,
            connect_timeout,
            command_timeout,
            conn: tokio::sync::Mutex::new(None),
            channels: Arc::new(Mutex::new(HashMap::new())),
        }
    }

    /// Subscribes to `channel` for this waiter. `None` when Redis cannot be subscribed
    /// to right now: the waiter then polls.
    pub(crate) async fn watch(self: &Arc<Self>, channel: String) -> Option<Watch> {
        let mut conn = self.conn.lock().await;
        if conn.as_ref().is_none_or(|c| c.dead.load(Ordering::Acquire)) {
            *conn = self.connect().await;
        }
        let c = conn.as_mut()?;
        let notify = {
            let mut map = lock(&self.channels);
            let e = map.entry(channel.clone()).or_insert_with(|| Channel {
                notify: Arc::new(Notify::new()),
                watchers: 0,
            });
            e.watchers += 1;
            e.notify.clone()
        };
        let watch = Watch {
            notifier: self.clone(),
            channel: channel.clone(),
            notify,
        };
        match tokio::time::timeout(self.command_timeout, c.sink.subscribe(&channel)).await {
            Ok(Ok(())) => Some(watch),
            _ => {
                // Dropping `watch` takes the count back down.
                c.dead.store(true, Ordering::Release);
                None
            }
        }
    }

    async fn unwatch(&self, channel: String, notify: Arc<Notify>) {
        let mut conn = self.conn.lock().await;
        let last = {
            let mut map = lock(&self.channels);
            match map.get_mut(&channel) {
                // Only the registration we counted in (a lost connection clears the map).
                Some(e) if Arc::ptr_eq(&e.notify, &notify) => {
                    e.watchers -= 1;
                    if e.watchers == 0 {
                        map.remove(&channel);
                        true
                    } else {
                        false
                    }
                }
                _ => false,
            }
        };
        if last
            && let Some(c) = conn.as_mut()
            && !matches!(
                tokio::time::timeout(self.command_timeout, c.sink.unsubscribe(&channel)).await,
                Ok(Ok(()))
            )
        {
            c.dead.store(true, Ordering::Release);
        }
    }

    /// Opens a subscriber connection and its dispatch task.
    async fn connect(&self) -> Option<Conn> {
        match &self.target {
            Target::Single(client) => self.connect_single(client).await,
            Target::Cluster(nodes) => self.connect_cluster(nodes).await,
        }
    }

    async fn connect_single(&self, client: &redis::Client) -> Option<Conn> {
        let pubsub = self.connect_within(client.get_async_pubsub()).await?;
        let (sink, mut stream) = pubsub.split();
        Some(self.start(Sink::Single(sink), |channels| async move {
            while let Some(msg) = stream.next().await {
                if let Some(c) = lock(&channels).get(msg.get_channel_name()) {
                    c.notify.notify_waiters();
                }
            }
        }))
    }

    async fn connect_cluster(&self, nodes: &[String]) -> Option<Conn> {
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<PushInfo>();
        let client = ClusterClientBuilder::new(nodes.to_vec())
            .use_protocol(ProtocolVersion::RESP3)
            .push_sender(tx)
            .connection_timeout(self.connect_timeout)
            .response_timeout(self.command_timeout)
            .build()
            .map_err(|e| tracing::debug!(target: "idem_redis", error = %e, "pub/sub client"))
            .ok()?;
        let conn = self.connect_within(client.get_async_connection()).await?;
        Some(self.start(Sink::Cluster(conn), |channels| async move {
            while let Some(push) = rx.recv().await {
                match push.kind {
                    PushKind::SMessage | PushKind::Message => {
                        if let Some(name) = channel_name(&push.data)
                            && let Some(c) = lock(&channels).get(name)
                        {
                            c.notify.notify_waiters();
                        }
                    }
                    // A node connection dropped: what was published meanwhile is lost.
                    // The client subscribes again by itself; the waiters read again now.
                    PushKind::Disconnection => {
                        for c in lock(&channels).values() {
                            c.notify.notify_waiters();
                        }
                    }
                    _ => {}
                }
            }
        }))
    }

    /// `connect`, within the connect timeout; `None` (logged) when it fails or times out.
    async fn connect_within<T>(
        &self,
        connect: impl Future<Output = redis::RedisResult<T>>,
    ) -> Option<T> {
        tokio::time::timeout(self.connect_timeout, connect)
            .await
            .ok()?
            .map_err(
                |e| tracing::debug!(target: "idem_redis", error = %e, "pub/sub connect failed"),
            )
            .ok()
    }

    /// The live connection of `sink`, and its dispatch task: `dispatch` wakes the waiters
    /// of each message until the connection ends (the store was dropped or it failed);
    /// then the connection is gone.
    fn start<F>(&self, sink: Sink, dispatch: impl FnOnce(Channels) -> F) -> Conn
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let dead = Arc::new(AtomicBool::new(false));
        let channels = self.channels.clone();
        let task_dead = dead.clone();
        let messages = dispatch(channels.clone());
        tokio::spawn(async move {
            messages.await;
            connection_gone(&channels, &task_dead);
        });
        Conn { sink, dead }
    }
}

/// A subscriber connection is gone, and its subscriptions with it: wakes every waiter
/// (they read the record again and poll from now on), forgets the registrations made on
/// it, and marks it dead so that the next watch connects again.
fn connection_gone(channels: &Mutex<HashMap<String, Channel>>, dead: &AtomicBool) {
    for (_, c) in lock(channels).drain() {
        c.notify.notify_waiters();
    }
    dead.store(true, Ordering::Release);
}

/// The channel of a pushed `message`/`smessage` (`[channel, payload]`); `None` for a
/// push of another shape (a reply from the server is never trusted to be well formed).
fn channel_name(data: &[Value]) -> Option<&str> {
    match data.first()? {
        Value::BulkString(b) => std::str::from_utf8(b).ok(),
        Value::SimpleString(s) => Some(s),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pushed_channel_names_of_any_shape_never_panic() {
        assert_eq!(
            channel_name(&[Value::BulkString(b"a:done".to_vec()), Value::Int(1)]),
            Some("a:done")
        );
        assert_eq!(channel_name(&[]), None);
        assert_eq!(channel_name(&[Value::Int(3)]), None);
        assert_eq!(channel_name(&[Value::BulkString(vec![0xff, 0xfe])]), None);
    }
}
