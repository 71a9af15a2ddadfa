//! [`RedisStore`]: the [`Store`] trait on Redis.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use idem_store::{
    Claim, ClaimRequest, CompleteRequest, DeleteMode, Deletion, Fence, RecordInfo, RecordState,
    Scope, Store, StoreError, TenantId, wait,
};
use redis::{RedisError, Script, Value};
use tokio::time::Instant;

use crate::builder::{NOTIFY_POLL_MAX, NOTIFY_POLL_MIN, RedisStoreBuilder};
use crate::conn::{Conn, Shared};
use crate::notify::Notifier;
use crate::quota::Held;
use crate::replica::ReplicaAcks;
use crate::reply::{
    Decimal, array, bytes, corrupt, fence, fingerprint, int, map_error, millis, outcome, push_hex,
    read_head, read_items, tag,
};
use crate::scripts::Scripts;
use crate::tenant::{self, TenantKeys};

/// An idempotency [`Store`] on Redis, shared by every server instance that points at the
/// same Redis (one endpoint, or one Redis Cluster). Cheap to clone (one `Arc`); every
/// clone shares one reconnecting connection (one per node on a cluster).
///
/// Build it with [`RedisStore::connect`], [`RedisStore::builder`] or
/// [`RedisStore::from_settings`]. See the [crate docs](crate) for the key layout, the
/// scripts and the Redis settings a deployment needs.
#[derive(Clone)]
pub struct RedisStore {
    pub(crate) backend: Arc<Backend>,
}

/// What every clone of a [`RedisStore`] shares: the connection, the key prefix, the
/// scripts, the per-tenant quota and the settings of waiting and of replica confirmation.
pub(crate) struct Backend {
    pub(crate) conn: Shared,
    pub(crate) prefix: String,
    pub(crate) command_timeout: Duration,
    pub(crate) max_in_flight_per_tenant: Option<usize>,
    pub(crate) max_bytes_per_tenant: Option<usize>,
    /// The quota arguments of the tenant scripts (in-flight, bytes, overhead), made once.
    pub(crate) quota_args: [String; 3],
    pub(crate) held: Held,
    /// The keys of the tenant named last ([`RedisStore::tenant_keys`]): a service with one
    /// tenant, or a burst of one tenant's calls, formats them once, not three strings a
    /// script.
    pub(crate) last_tenant: arc_swap::ArcSwapOption<crate::tenant::TenantKeys>,
    pub(crate) poll_min: Duration,
    pub(crate) poll_max: Duration,
    pub(crate) notifier: Option<Arc<Notifier>>,
    pub(crate) scripts: Scripts,
    pub(crate) replica_acks: Option<ReplicaAcks>,
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStore")
            .field("prefix", &self.backend.prefix)
            .field("command_timeout", &self.backend.command_timeout)
            .field(
                "max_in_flight_per_tenant",
                &self.backend.max_in_flight_per_tenant,
            )
            .field("max_bytes_per_tenant", &self.backend.max_bytes_per_tenant)
            .field("cluster", &self.backend.conn.is_cluster())
            .field("replica_acks", &self.backend.replica_acks)
            .finish_non_exhaustive()
    }
}

/// What the read script reports about a record.
struct Peek {
    state: u8,
    fence: Fence,
    lease_left: Duration,
}

impl RedisStore {
    /// A builder for `url` (`redis://host:port/db`, `rediss://…`, `unix://…`) with the
    /// documented defaults.
    pub fn builder(url: impl Into<String>) -> RedisStoreBuilder {
        RedisStoreBuilder::new(url)
    }

    /// A builder for a Redis Cluster reached through `nodes` (seed nodes, e.g.
    /// `redis://10.0.0.1:7000`; one reachable node is enough to learn the rest), with
    /// the documented defaults. See [`RedisStoreBuilder::cluster`].
    pub fn cluster_builder<I, S>(nodes: I) -> RedisStoreBuilder
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        RedisStoreBuilder::cluster(nodes)
    }

    /// Whether the store talks to a Redis Cluster.
    pub fn is_cluster(&self) -> bool {
        self.backend.conn.is_cluster()
    }

    /// Connects to `url` with the default settings (see [`RedisStoreBuilder`]).
    ///
    /// # Errors
    /// See [`RedisStoreBuilder::connect`].
    pub async fn connect(url: impl Into<String>) -> Result<Self, crate::ConnectError> {
        Self::builder(url).connect().await
    }

    /// Connects with the settings of the `idem.redis` config object.
    ///
    /// # Errors
    /// See [`RedisStoreBuilder::connect`].
    pub async fn from_settings(
        settings: &idem_core::config::RedisSettings,
    ) -> Result<Self, crate::ConnectError> {
        RedisStoreBuilder::from_settings(settings).connect().await
    }

    pub(crate) fn from_backend(backend: Backend) -> Self {
        RedisStore {
            backend: Arc::new(backend),
        }
    }

    /// The Redis key holding the record of `scope`: `<prefix>{<scope hex>}`. The braces
    /// are a Redis Cluster hash tag, so a record always lives in one slot.
    pub fn key_for(&self, scope: &Scope) -> String {
        let mut k = String::with_capacity(self.backend.prefix.len() + 66);
        k.push_str(&self.backend.prefix);
        k.push('{');
        push_hex(&mut k, &scope.0);
        k.push('}');
        k
    }

    /// The Redis key counting `tenant`'s in-flight records: `<prefix>tenant:{<tenant hex>}`,
    /// a sorted set with the tenant as its hash tag (see the crate docs, "Per-tenant
    /// quota").
    pub fn tenant_key_for(&self, tenant: &TenantId) -> String {
        let mut k = String::with_capacity(self.backend.prefix.len() + 48);
        k.push_str(&self.backend.prefix);
        k.push_str("tenant:{");
        push_hex(&mut k, &tenant.0);
        k.push('}');
        k
    }

    /// The key prefix in use.
    pub fn key_prefix(&self) -> &str {
        &self.backend.prefix
    }

    pub(crate) fn connection(&self) -> Conn {
        self.backend.conn.handle()
    }

    pub(crate) fn command_timeout(&self) -> Duration {
        self.backend.command_timeout
    }

    /// Runs one command future under the command timeout. A timeout (the client's
    /// response timeout or this bound) makes a cluster connection suspect: it is rebuilt
    /// in the background (see `conn`), so a failover is followed even while the old
    /// master keeps its connection open without answering.
    pub(crate) async fn bounded<T>(
        &self,
        limit: Duration,
        fut: impl Future<Output = Result<T, RedisError>>,
    ) -> Result<T, StoreError> {
        match tokio::time::timeout(limit, fut).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => {
                if e.is_timeout() {
                    self.backend.conn.suspect();
                }
                Err(map_error(e))
            }
            Err(_) => {
                self.backend.conn.suspect();
                Err(StoreError::Unavailable(
                    format!("redis command timed out after {limit:?}").into(),
                ))
            }
        }
    }

    async fn eval(
        &self,
        script: &Script,
        key: &str,
        args: &[&[u8]],
        limit: Duration,
    ) -> Result<Value, StoreError> {
        Ok(self
            .eval_confirmed(script, &[key], args, limit, false)
            .await?
            .0)
    }

    /// Loads every script into the script cache, so the first calls are one `EVALSHA`
    /// each. (After a Redis restart the cache is empty; a `NOSCRIPT` reply then loads the
    /// script again transparently.)
    pub(crate) async fn load_scripts(&self) -> Result<(), StoreError> {
        for s in self.backend.scripts.all() {
            let mut conn = self.connection();
            self.bounded(self.backend.command_timeout, async move {
                s.prepare_invoke().load_async(&mut conn).await
            })
            .await?;
        }
        Ok(())
    }

    async fn peek(&self, key: &str, limit: Duration) -> Result<Option<Peek>, StoreError> {
        let v = self
            .eval(&self.backend.scripts.read, key, &[b"0"], limit)
            .await?;
        let Some(mut it) = read_items(v, 3)? else {
            return Ok(None);
        };
        let (state, fence, lease_left) = read_head(&mut it)?;
        Ok(Some(Peek {
            state,
            fence,
            lease_left,
        }))
    }

    /// [`peek`](Self::peek) bounded by `until` as well: a read cut short by `until` is
    /// "nothing changed yet", not a store failure.
    async fn peek_until(&self, key: &str, until: Instant) -> Result<Option<Peek>, StoreError> {
        let now = Instant::now();
        if now >= until {
            // Report it as changed-or-not-known: the caller claims again.
            return Ok(None);
        }
        let limit = self.backend.command_timeout.min(until - now);
        match self.peek(key, limit).await {
            Err(StoreError::Unavailable(_)) if Instant::now() >= until => Ok(None),
            r => r,
        }
    }

    /// Runs a fenced script (renew, complete, release). With `confirm` and replica
    /// confirmation on, the write is confirmed by `WAIT`; so is an earlier write of the
    /// same fence that this call finds already landed (a retry after a lost reply).
    pub(crate) async fn fenced(
        &self,
        script: &Script,
        scope: &Scope,
        fence_presented: Fence,
        rest: &[&[u8]],
        confirm: bool,
    ) -> Result<bool, StoreError> {
        self.fenced_with(script, scope, None, fence_presented, rest, confirm)
            .await
    }

    /// [`fenced`](Self::fenced) with the tenant's keys after the record's (the
    /// single-endpoint scripts with the quotas). `Ok(false)`: the completion script
    /// recorded the response as not retained (over the tenant's bytes quota).
    pub(crate) async fn fenced_with(
        &self,
        script: &Script,
        scope: &Scope,
        tenant: Option<&TenantKeys>,
        fence_presented: Fence,
        rest: &[&[u8]],
        confirm: bool,
    ) -> Result<bool, StoreError> {
        let key = self.key_for(scope);
        let fence_s = Decimal::new(fence_presented);
        let mut args: Vec<&[u8]> = Vec::with_capacity(rest.len() + 1);
        args.push(fence_s.as_bytes());
        args.extend_from_slice(rest);
        let keys_t;
        let keys: &[&str] = match tenant {
            Some(t) => {
                keys_t = [key.as_str(), &t.in_flight, &t.bytes, &t.sizes];
                &keys_t
            }
            None => &[&key],
        };
        let (v, acks) = self
            .eval_confirmed(script, keys, &args, self.backend.command_timeout, confirm)
            .await?;
        let items = array(v)?;
        let mut it = items.into_iter();
        match tag(it.next())?.as_slice() {
            b"OK" => {
                self.check_acks(acks)?;
                Ok(it.next().map(|v| int(Some(v))).transpose()? != Some(0))
            }
            b"F" => {
                let cur = int(it.next())?;
                if confirm
                    && self.backend.replica_acks.is_some()
                    && u64::try_from(cur).ok() == Some(fence_presented)
                {
                    // Landed earlier, reply lost: confirm it before saying so.
                    self.confirm(scope, fence_presented).await?;
                }
                Err(StoreError::Fenced {
                    presented: fence_presented,
                    current: u64::try_from(cur).ok(),
                })
            }
            _ => Err(corrupt("unexpected reply tag")),
        }
    }
}

impl RedisStore {
    /// The claim script: on the record alone, or (`with_tenant`, single endpoint) with
    /// the tenant's quotas in the same script, refused there with `StoreError::Full`.
    async fn claim_record(
        &self,
        req: &ClaimRequest<'_>,
        with_tenant: bool,
    ) -> Result<Claim, StoreError> {
        let key = self.key_for(req.scope);
        let mut claimant = String::with_capacity(32);
        push_hex(&mut claimant, &req.claimant.0.to_be_bytes());
        let lease = Decimal::new(ms(req.lease));
        let v = if with_tenant {
            let t = self.tenant_keys(req.tenant);
            let [qin, qb, overhead] = &self.backend.quota_args;
            self.eval_confirmed(
                &self.backend.scripts.claim_tenant,
                &[&key, &t.in_flight, &t.bytes, &t.sizes],
                &[
                    &req.fingerprint.0,
                    claimant.as_bytes(),
                    lease.as_bytes(),
                    &req.scope.0,
                    qin.as_bytes(),
                    qb.as_bytes(),
                    overhead.as_bytes(),
                ],
                self.backend.command_timeout,
                false,
            )
            .await?
            .0
        } else {
            self.eval(
                &self.backend.scripts.claim,
                &key,
                &[&req.fingerprint.0, claimant.as_bytes(), lease.as_bytes()],
                self.backend.command_timeout,
            )
            .await?
        };
        let mut it = array(v)?.into_iter();
        match tag(it.next())?.as_slice() {
            b"A" => {
                let fence = fence(it.next())?;
                let takeover = int(it.next())? != 0;
                Ok(Claim::Acquired { fence, takeover })
            }
            b"C" => {
                let kind = bytes(it.next())?;
                let body = bytes(it.next())?;
                Ok(Claim::Completed(outcome(&kind, body)?))
            }
            b"I" => Ok(Claim::InFlight {
                lease_remaining: millis(it.next())?,
            }),
            b"M" => Ok(Claim::Mismatch),
            b"FULL" => Err(tenant::full_in_flight(int(it.next())?)),
            b"FULLB" => Err(tenant::full_bytes(int(it.next())?)),
            _ => Err(corrupt("unexpected claim reply tag")),
        }
    }
}

impl Store for RedisStore {
    /// The claim script. With a per-tenant quota on a single endpoint, the tenant's
    /// quotas are checked and counted in the same script (one round trip). On a Redis
    /// Cluster the tenant's keys are in another slot: for a claim acquired there, the
    /// account script on the tenant's keys is a second step; over a quota, the record
    /// is released again (nothing ran). Either way a claim over a quota is refused with
    /// [`StoreError::Full`]. Replays, waits and mismatches never reach the quotas.
    async fn claim(&self, req: ClaimRequest<'_>) -> Result<Claim, StoreError> {
        let quota = self.has_tenant_quota();
        let in_script = quota && !self.is_cluster();
        let claim = self.claim_record(&req, in_script).await?;
        let Claim::Acquired { fence, takeover } = claim else {
            return Ok(claim);
        };
        if in_script {
            self.backend
                .held
                .insert(req.scope, fence, *req.tenant, req.lease);
        } else if quota {
            match self
                .account(req.tenant, req.scope, fence, req.lease, !takeover, false)
                .await
            {
                Ok(None) => {
                    self.backend
                        .held
                        .insert(req.scope, fence, *req.tenant, req.lease);
                }
                Ok(Some(full)) => {
                    if let Err(e) = self
                        .fenced(&self.backend.scripts.release, req.scope, fence, &[], false)
                        .await
                    {
                        // The record stays in flight until its lease ends; then the next
                        // claim takes it over.
                        tracing::debug!(error = %e, "claim over the tenant quota not released");
                    }
                    return Err(full);
                }
                Err(e) => {
                    // The quota protects capacity, not correctness: a claim Redis could
                    // not count stands, uncounted.
                    tracing::warn!(error = %e, "in-flight claim not counted against its tenant's quota");
                }
            }
        }
        if self.backend.replica_acks.is_some() {
            self.confirm_claim(&req, fence).await?;
        }
        Ok(claim)
    }

    /// Renews the record's lease, then its entry in the tenant's count (best effort).
    async fn renew(&self, scope: &Scope, fence: Fence, lease: Duration) -> Result<(), StoreError> {
        let lease_ms = Decimal::new(ms(lease));
        let res = self
            .fenced(
                &self.backend.scripts.renew,
                scope,
                fence,
                &[lease_ms.as_bytes()],
                // Not confirmed: see `RedisStoreBuilder::replica_acks`.
                false,
            )
            .await
            .map(|_| ());
        match &res {
            Ok(()) if self.has_tenant_quota() => {
                if let Some(tenant) = self.backend.held.renewed(scope, fence, lease) {
                    let _ = self
                        .account(&tenant, scope, fence, lease, false, true)
                        .await;
                }
            }
            Err(StoreError::Fenced { .. }) => {
                self.uncount(scope, fence).await;
                self.backend.held.remove(scope, fence);
            }
            _ => {}
        }
        res
    }

    async fn complete(&self, req: CompleteRequest<'_>) -> Result<(), StoreError> {
        self.complete_with_tenant(&req).await
    }

    async fn release(&self, scope: &Scope, fence: Fence) -> Result<(), StoreError> {
        self.release_with_tenant(scope, fence).await
    }

    async fn get(&self, scope: &Scope) -> Result<Option<RecordState>, StoreError> {
        let key = self.key_for(scope);
        let v = self
            .eval(
                &self.backend.scripts.read,
                &key,
                &[b"1"],
                self.backend.command_timeout,
            )
            .await?;
        let Some(mut it) = read_items(v, 9)? else {
            return Ok(None);
        };
        let (state, fence, left) = read_head(&mut it)?;
        let fp = bytes(it.next())?;
        let kind = bytes(it.next())?;
        let body = bytes(it.next())?;
        Ok(Some(match state {
            b'i' => RecordState::InFlight {
                fence,
                fingerprint: fingerprint(&fp)?,
                lease_until: Instant::now() + left,
            },
            b'c' => RecordState::Completed {
                fence,
                fingerprint: fingerprint(&fp)?,
                outcome: outcome(&kind, body)?,
            },
            _ => RecordState::Released { fence },
        }))
    }

    /// The read script with the record's times and TTL (see `records.rs`).
    async fn read_record(&self, scope: &Scope) -> Result<Option<RecordInfo>, StoreError> {
        self.read_record_at(scope).await
    }

    /// The delete script: one atomic step (see `records.rs`).
    async fn delete_record(&self, scope: &Scope, mode: DeleteMode) -> Result<Deletion, StoreError> {
        self.delete_record_at(scope, mode).await
    }

    /// Reads the record's state, fence and lease; while it is the same live claim,
    /// sleeps until a notification ([`WaitStrategy::Notify`](crate::WaitStrategy)), the
    /// next poll (exponential backoff), the lease end or `until`, whichever is first, and
    /// reads again. See the crate docs, "Waiting".
    async fn wait(&self, scope: &Scope, until: Instant) -> Result<(), StoreError> {
        let key = self.key_for(scope);
        let Some(first) = self.peek_until(&key, until).await? else {
            return Ok(());
        };
        if first.state != b'i' || first.lease_left.is_zero() {
            return Ok(());
        }
        let watched = first.fence;
        // Subscribing (and, the first time, connecting) never runs past `until`.
        let watch = match &self.backend.notifier {
            Some(n) => tokio::time::timeout_at(until, n.watch(format!("{key}:done")))
                .await
                .ok()
                .flatten(),
            None => None,
        };
        let poll_max = if watch.is_some() {
            NOTIFY_POLL_MAX.max(self.backend.poll_max)
        } else {
            self.backend.poll_max
        };
        // Subscribed, polling only covers a lost notification connection: start slower.
        let mut interval = if watch.is_some() {
            NOTIFY_POLL_MIN.max(self.backend.poll_min)
        } else {
            self.backend.poll_min
        };
        let mut lease_left = first.lease_left;
        // Subscribed: read again now that the subscription is live. Not subscribed: the
        // first read stands; sleep first.
        let mut read_now = watch.is_some();
        loop {
            // Armed before the read, so a completion published after it still wakes us.
            let mut notified = std::pin::pin!(watch.as_ref().map(|w| w.notify().notified()));
            if let Some(n) = notified.as_mut().as_pin_mut() {
                n.enable();
            }
            if read_now {
                let Some(p) = self.peek_until(&key, until).await? else {
                    return Ok(());
                };
                if p.state != b'i' || p.lease_left.is_zero() || p.fence != watched {
                    return Ok(());
                }
                lease_left = p.lease_left;
            }
            read_now = true;
            let now = Instant::now();
            if now >= until {
                return Ok(());
            }
            let wake = wait::next_read(now, interval, lease_left, until);
            wait::sleep_or_notified(notified.as_mut(), wake).await;
            interval = (interval * 2).min(poll_max);
        }
    }
}

/// Longest lease or TTL sent to Redis: ten years, in milliseconds. Longer durations are
/// cut to it, so the numbers stay exact in Lua (doubles) and `PEXPIRE` accepts them.
const MAX_MS: u64 = 10 * 365 * 24 * 3600 * 1000;

/// Milliseconds for a script argument, in `1..=MAX_MS` (a `PEXPIRE 0` would delete the key).
pub(crate) fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis())
        .unwrap_or(MAX_MS)
        .clamp(1, MAX_MS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_become_at_least_one_millisecond() {
        assert_eq!(ms(Duration::ZERO), 1);
        assert_eq!(ms(Duration::from_micros(1500)), 1);
        assert_eq!(ms(Duration::from_secs(2)), 2000);
        assert_eq!(ms(Duration::MAX), MAX_MS);
    }
}
