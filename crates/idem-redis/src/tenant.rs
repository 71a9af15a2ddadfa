//! The per-tenant quotas on Redis: the in-flight count and the stored-bytes charge, their
//! Lua (shared by the single-endpoint scripts, which run it in the record's own script,
//! and the Redis Cluster ones, which run it in a script on the tenant's slot), the
//! tenant steps a Cluster store takes apart from the record's, and the completion and
//! release that choose between the two.
//!
//! # Keys (all with the tenant as hash tag, so one slot)
//! | key | type | holds |
//! |-----|------|-------|
//! | `<prefix>tenant:{<tenant hex>}` | sorted set | in-flight claims: member scope + fence (big-endian), score lease end (ms) |
//! | `<prefix>tenant:{<tenant hex>}:bytes` | sorted set | charged records: member scope, score when the charge ends (ms) |
//! | `<prefix>tenant:{<tenant hex>}:sizes` | hash | each charged scope's bytes, and `n` their sum |
//!
//! # Stored bytes
//! As in the memory store (`maxBytesPerTenant`), a record is charged its stored response
//! plus [`RECORD_OVERHEAD_BYTES`]: the overhead from its claim (until its in-flight key
//! would expire, `2 × lease`), response and overhead from its completion (until its TTL).
//! A new record that does not fit is refused ([`StoreError::Full`], RESOURCE_EXHAUSTED
//! with a retry delay); a response that does not fit is recorded as not retained (the
//! handler ran: a duplicate gets a clear error, never a second run). Replays, waits and
//! takeovers are never refused for bytes. A release takes the charge back at once.
//!
//! Expiry: Redis expires a record on its own, so each script that reads the sum first
//! drops the charges whose time has passed (at most 256 a call, oldest
//! first: O(1) amortized, each charge is dropped once); the three keys expire a second
//! after the latest charge or lease in them. A record deleted by an operator
//! (`idem records delete`) keeps its charge until its TTL would have ended: the record
//! does not name its tenant.

use std::sync::Arc;
use std::time::Duration;

use idem_store::{CompleteRequest, Fence, Scope, StoreError, StoredOutcome, TenantId};
use redis::Value;

use crate::quota;
use crate::reply::{Decimal, array, corrupt, int, tag};
use crate::store::{RedisStore, ms};

/// Bytes charged per record on top of its stored response, as the memory store's
/// `RECORD_OVERHEAD_BYTES` (the same 240, so one `maxBytesPerTenant` means the same
/// number of records on either store). It is a charge, not Redis's memory: Redis's
/// `used_memory` grows by about 830 bytes per record of a 200-byte response (README,
/// `maxmemory`), so size `maxmemory` from that, not from the quota.
pub const RECORD_OVERHEAD_BYTES: usize = 240;

/// The tenant-side Lua: functions on the three tenant keys (`kif`, `kbz`, `kbh`).
/// Expects the prelude's helpers. Quotas `qin`/`qb` are numbers or `nil` (off).
pub(crate) const TENANT_LIB: &str = r#"
local function t_keep(k, ttl)
  if redis.call('PTTL', k) < ttl then redis.call('PEXPIRE', k, ttl) end
end
local function t_used(kbh)
  return tonumber(redis.call('HGET', kbh, 'n')) or 0
end
local function t_trim(kbz, kbh, now)
  local gone = redis.call('ZRANGEBYSCORE', kbz, '-inf', now, 'LIMIT', 0, 256)
  if #gone == 0 then return end
  local sizes = redis.call('HMGET', kbh, unpack(gone))
  local total = 0
  for i = 1, #gone do total = total + (tonumber(sizes[i]) or 0) end
  redis.call('HDEL', kbh, unpack(gone))
  redis.call('ZREM', kbz, unpack(gone))
  if total ~= 0 then redis.call('HINCRBY', kbh, 'n', -total) end
end
local function t_charge(kbz, kbh, scope, size, ends, now)
  local old = tonumber(redis.call('HGET', kbh, scope)) or 0
  redis.call('HSET', kbh, scope, size)
  if size ~= old then redis.call('HINCRBY', kbh, 'n', size - old) end
  redis.call('ZADD', kbz, ends, scope)
  local ttl = ends - now + 1000
  t_keep(kbz, ttl)
  t_keep(kbh, ttl)
end
local function t_uncharge(kbz, kbh, scope)
  local old = tonumber(redis.call('HGET', kbh, scope))
  if not old then return end
  redis.call('HDEL', kbh, scope)
  redis.call('ZREM', kbz, scope)
  redis.call('HINCRBY', kbh, 'n', -old)
end
-- An acquired claim: counted in flight (refused at qin unless already counted) and,
-- with qb, charged its overhead (a fresh record of a scope not yet charged refused
-- when it does not fit). `held`: the claimant already holds the record (its renewal,
-- its own re-claim): counted whatever the count, never refused for it. nil
-- when admitted, else the refusal reply.
local function t_admit(kif, kbz, kbh, member, lease, qin, qb, overhead, fresh, now, held)
  local scope = string.sub(member, 1, 32)
  if qin and not held then
    -- Reads only, before the record's first write: under maxmemory with noeviction,
    -- Redis refuses a script at its first write that may grow memory only when nothing
    -- was written before it, so pruning here (a write it allows) would let the whole
    -- claim through. Entries whose lease ended count as gone.
    local held = tonumber(redis.call('ZSCORE', kif, member))
    if not held or held <= now then
      local n = redis.call('ZCOUNT', kif, '(' .. dec(now), '+inf')
      if n >= qin then return {'FULL', n} end
    end
  end
  if qb then
    t_trim(kbz, kbh, now)
    local old = tonumber(redis.call('HGET', kbh, scope)) or 0
    local used = t_used(kbh)
    if fresh and old == 0 and used + overhead > qb then return {'FULLB', used} end
  end
  if qin then
    redis.call('ZADD', kif, now + lease, member)
    redis.call('ZREMRANGEBYSCORE', kif, '-inf', now)
    t_keep(kif, lease + 1000)
  end
  if qb then t_charge(kbz, kbh, scope, overhead, now + 2 * lease, now) end
  return nil
end
-- A completion: out of the in-flight count; with qb, charged overhead + nbody until
-- `ends` if that fits, else overhead only. Returns whether the response fits.
local function t_complete(kif, kbz, kbh, member, nbody, qb, overhead, ends, now)
  redis.call('ZREM', kif, member)
  if not qb then return true end
  local scope = string.sub(member, 1, 32)
  t_trim(kbz, kbh, now)
  local old = tonumber(redis.call('HGET', kbh, scope)) or 0
  local fits = nbody == 0 or t_used(kbh) - old + overhead + nbody <= qb
  if fits then
    t_charge(kbz, kbh, scope, overhead + nbody, ends, now)
  else
    t_charge(kbz, kbh, scope, overhead, ends, now)
  end
  return fits
end
-- A release: out of the in-flight count, its charge taken back.
local function t_release(kif, kbz, kbh, member)
  redis.call('ZREM', kif, member)
  t_uncharge(kbz, kbh, string.sub(member, 1, 32))
end
"#;

/// Cluster (and renewals): `KEYS` the tenant's three keys; `ARGV`: member, lease ms,
/// in-flight quota (`''` off), bytes quota (`''` off), overhead, `1` for a fresh
/// record, `1` for a record its claimant already holds (a renewal). Reply `{'OK'}`, `{'FULL', count}` or `{'FULLB', bytes}`.
pub(crate) const ACCOUNT: &str = r#"
local r = t_admit(KEYS[1], KEYS[2], KEYS[3], ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]),
                  tonumber(ARGV[4]), tonumber(ARGV[5]), ARGV[6] == '1', now_ms(),
                  ARGV[7] == '1')
if r then return r end
return {'OK'}
"#;

/// Cluster: `KEYS` the tenant's three keys; `ARGV`: member, response bytes, bytes quota
/// (`''` off), overhead, record TTL ms. Reply `{'OK', 1 fits | 0 not retained}`.
pub(crate) const COMPLETE: &str = r#"
local now = now_ms()
local fits = t_complete(KEYS[1], KEYS[2], KEYS[3], ARGV[1], tonumber(ARGV[2]),
                        tonumber(ARGV[3]), tonumber(ARGV[4]), now + tonumber(ARGV[5]), now)
if fits then return {'OK', 1} end
return {'OK', 0}
"#;

/// Cluster: `KEYS` the tenant's three keys; `ARGV[1]` member. Reply `{'OK'}`.
pub(crate) const RELEASE: &str = r#"
t_release(KEYS[1], KEYS[2], KEYS[3], ARGV[1])
return {'OK'}
"#;

/// Single endpoint, before the claim script: `admit` on `KEYS[2..4]` with `ARGV[4]` the
/// scope (raw), `ARGV[5..7]` the quotas and overhead.
pub(crate) const CLAIM_ADMIT: &str = r#"
local function admit(fence, fresh, lease, now, held)
  return t_admit(KEYS[2], KEYS[3], KEYS[4], ARGV[4] .. struct.pack('>I8', fence), lease,
                 tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7]), fresh, now, held)
end
"#;

/// Before the claim script alone: nothing to admit.
pub(crate) const CLAIM_ADMIT_NONE: &str = r#"
local function admit(fence, fresh, lease, now, held) return nil end
"#;

/// The three keys of one tenant.
pub(crate) struct TenantKeys {
    id: TenantId,
    pub(crate) in_flight: String,
    pub(crate) bytes: String,
    pub(crate) sizes: String,
}

impl RedisStore {
    /// Takes a finished claim (fenced) out of its tenant's in-flight count. Best
    /// effort: a failure only leaves the count until the lease ends.
    pub(crate) async fn uncount(&self, scope: &Scope, fence: Fence) {
        let Some(tenant) = self.backend.held.get(scope, fence) else {
            return;
        };
        let key = self.tenant_key_for(&tenant);
        let member = quota::member(scope, fence);
        let mut conn = self.connection();
        let zrem = redis::cmd("ZREM").arg(&key).arg(&member[..]).to_owned();
        let res = self
            .bounded(self.backend.command_timeout, async move {
                zrem.query_async::<i64>(&mut conn).await
            })
            .await;
        if let Err(e) = res {
            tracing::debug!(error = %e, "in-flight count not taken back; it lapses with the lease");
        }
    }

    /// Completes the record and takes the claim out of its tenant's quotas: on a single
    /// endpoint in the completion script itself (one round trip); on a Cluster, the
    /// tenant's step on its own slot, before the record's when the bytes quota must
    /// decide whether the response is kept, else beside it.
    pub(crate) async fn complete_with_tenant(
        &self,
        req: &CompleteRequest<'_>,
    ) -> Result<(), StoreError> {
        let ttl = Decimal::new(ms(req.ttl));
        let (kind, body): (&[u8], &[u8]) = match &req.outcome {
            StoredOutcome::Response(b) => (b"r", b),
            StoredOutcome::NotRetained => (b"n", b""),
        };
        let scripts = &self.backend.scripts;
        let (scope, fence) = (req.scope, req.fence);
        let tenant = self
            .has_tenant_quota()
            .then(|| self.backend.held.get(scope, fence))
            .flatten();
        let kept = match tenant {
            None => {
                self.fenced(
                    &scripts.complete,
                    scope,
                    fence,
                    &[kind, body, ttl.as_bytes()],
                    true,
                )
                .await
            }
            Some(t) if !self.is_cluster() => {
                let keys = self.tenant_keys(&t);
                let member = quota::member(scope, fence);
                let [_, qb, overhead] = &self.backend.quota_args;
                self.fenced_with(
                    &scripts.complete_tenant,
                    scope,
                    Some(&*keys),
                    fence,
                    &[
                        kind,
                        body,
                        ttl.as_bytes(),
                        &member,
                        qb.as_bytes(),
                        overhead.as_bytes(),
                    ],
                    true,
                )
                .await
            }
            Some(t) if self.backend.max_bytes_per_tenant.is_some() => {
                let fits = match self
                    .tenant_complete(&t, scope, fence, body.len(), req.ttl)
                    .await
                {
                    Ok(fits) => fits,
                    Err(e) => {
                        // The quota protects capacity, not correctness.
                        tracing::warn!(error = %e, "completion not charged to its tenant's bytes quota");
                        true
                    }
                };
                let (kind, body): (&[u8], &[u8]) = if fits { (kind, body) } else { (b"n", b"") };
                self.fenced(
                    &scripts.complete,
                    scope,
                    fence,
                    &[kind, body, ttl.as_bytes()],
                    true,
                )
                .await
                .map(|kept| kept && fits)
            }
            Some(t) => {
                let args: [&[u8]; 3] = [kind, body, ttl.as_bytes()];
                let (res, _) = tokio::join!(
                    self.fenced(&scripts.complete, scope, fence, &args, true),
                    self.tenant_complete(&t, scope, fence, 0, req.ttl)
                );
                res
            }
        };
        self.finished(scope, fence, &kept).await;
        if !kept? {
            tracing::warn!(
                bytes = body.len(),
                "idempotency redis store: response does not fit its tenant's stored-bytes \
                 quota (maxBytesPerTenant); recorded as not retained"
            );
        }
        Ok(())
    }

    /// Releases the record and takes the claim out of its tenant's quotas (as
    /// [`complete_with_tenant`](Self::complete_with_tenant); on a Cluster after the
    /// release, so a charge is never taken back from a record that is not ours).
    pub(crate) async fn release_with_tenant(
        &self,
        scope: &Scope,
        fence: Fence,
    ) -> Result<(), StoreError> {
        let scripts = &self.backend.scripts;
        let tenant = self
            .has_tenant_quota()
            .then(|| self.backend.held.get(scope, fence))
            .flatten();
        let res = match tenant {
            None => {
                self.fenced(&scripts.release, scope, fence, &[], false)
                    .await
            }
            Some(t) if !self.is_cluster() => {
                let keys = self.tenant_keys(&t);
                let member = quota::member(scope, fence);
                self.fenced_with(
                    &scripts.release_tenant,
                    scope,
                    Some(&*keys),
                    fence,
                    &[&member],
                    false,
                )
                .await
            }
            Some(t) => {
                let res = self
                    .fenced(&scripts.release, scope, fence, &[], false)
                    .await;
                if res.is_ok() {
                    self.tenant_release(&t, scope, fence).await;
                }
                res
            }
        };
        self.finished(scope, fence, &res).await;
        res.map(|_| ())
    }

    /// After a completion or release: a fenced one (the record is not ours) leaves the
    /// in-flight count; the note is forgotten unless the layer will retry (Unavailable).
    async fn finished<T>(&self, scope: &Scope, fence: Fence, res: &Result<T, StoreError>) {
        if matches!(res, Err(StoreError::Fenced { .. })) {
            self.uncount(scope, fence).await;
        }
        if !matches!(res, Err(StoreError::Unavailable(_))) {
            self.backend.held.remove(scope, fence);
        }
    }

    /// The tenant's three keys (see the module docs).
    pub(crate) fn tenant_keys(&self, tenant: &TenantId) -> Arc<TenantKeys> {
        if let Some(last) = self.backend.last_tenant.load_full()
            && last.id == *tenant
        {
            return last;
        }
        let keys = Arc::new(self.format_tenant_keys(tenant));
        self.backend.last_tenant.store(Some(keys.clone()));
        keys
    }

    fn format_tenant_keys(&self, tenant: &TenantId) -> TenantKeys {
        let in_flight = self.tenant_key_for(tenant);
        let with = |suffix: &str| {
            let mut k = String::with_capacity(in_flight.len() + suffix.len());
            k.push_str(&in_flight);
            k.push_str(suffix);
            k
        };
        TenantKeys {
            id: *tenant,
            bytes: with(":bytes"),
            sizes: with(":sizes"),
            in_flight,
        }
    }

    /// Whether either per-tenant quota is on (then claims are noted in `held`).
    pub(crate) fn has_tenant_quota(&self) -> bool {
        self.backend.max_in_flight_per_tenant.is_some()
            || self.backend.max_bytes_per_tenant.is_some()
    }

    /// Counts a claim against its tenant's quotas on the tenant's slot (a Cluster's
    /// second step; a renewal's refresh): `Ok(None)` counted, `Ok(Some(why))` refused.
    pub(crate) async fn account(
        &self,
        tenant: &TenantId,
        scope: &Scope,
        fence: Fence,
        lease: Duration,
        fresh: bool,
        held: bool,
    ) -> Result<Option<StoreError>, StoreError> {
        let k = self.tenant_keys(tenant);
        let member = quota::member(scope, fence);
        let lease = Decimal::new(ms(lease));
        let [qin, qb, overhead] = &self.backend.quota_args;
        let fresh: &[u8] = if fresh { b"1" } else { b"0" };
        let held: &[u8] = if held { b"1" } else { b"0" };
        let v = self
            .eval_keys(
                &self.backend.scripts.t_account,
                &[&k.in_flight, &k.bytes, &k.sizes],
                &[
                    &member,
                    lease.as_bytes(),
                    qin.as_bytes(),
                    qb.as_bytes(),
                    overhead.as_bytes(),
                    fresh,
                    held,
                ],
            )
            .await?;
        admission(v)
    }

    /// A Cluster completion's tenant step: out of the in-flight count, the response
    /// charged. `Ok(false)`: the response does not fit (the record must not keep it).
    pub(crate) async fn tenant_complete(
        &self,
        tenant: &TenantId,
        scope: &Scope,
        fence: Fence,
        body_len: usize,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        let k = self.tenant_keys(tenant);
        let member = quota::member(scope, fence);
        let [_, qb, overhead] = &self.backend.quota_args;
        let n = Decimal::new(u64::try_from(body_len).unwrap_or(u64::MAX));
        let ttl = Decimal::new(ms(ttl));
        let v = self
            .eval_keys(
                &self.backend.scripts.t_complete,
                &[&k.in_flight, &k.bytes, &k.sizes],
                &[
                    &member,
                    n.as_bytes(),
                    qb.as_bytes(),
                    overhead.as_bytes(),
                    ttl.as_bytes(),
                ],
            )
            .await?;
        let mut it = array(v)?.into_iter();
        match tag(it.next())?.as_slice() {
            b"OK" => Ok(int(it.next())? != 0),
            _ => Err(corrupt("unexpected tenant completion reply tag")),
        }
    }

    /// A Cluster release's tenant step: out of the in-flight count, the charge taken
    /// back. Best effort: a failure leaves them until the lease ends.
    pub(crate) async fn tenant_release(&self, tenant: &TenantId, scope: &Scope, fence: Fence) {
        let k = self.tenant_keys(tenant);
        let member = quota::member(scope, fence);
        let res = self
            .eval_keys(
                &self.backend.scripts.t_release,
                &[&k.in_flight, &k.bytes, &k.sizes],
                &[&member],
            )
            .await;
        if let Err(e) = res {
            tracing::debug!(error = %e, "tenant quota not taken back; it lapses with the lease");
        }
    }

    async fn eval_keys(
        &self,
        script: &redis::Script,
        keys: &[&str],
        args: &[&[u8]],
    ) -> Result<Value, StoreError> {
        Ok(self
            .eval_confirmed(script, keys, args, self.command_timeout(), false)
            .await?
            .0)
    }
}

/// An admission reply: `{'OK'}` (or an `'A'` claim reply) admitted; `{'FULL', n}` or
/// `{'FULLB', bytes}` refused, as the [`StoreError::Full`] to return.
pub(crate) fn admission(v: Value) -> Result<Option<StoreError>, StoreError> {
    let mut it = array(v)?.into_iter();
    match tag(it.next())?.as_slice() {
        b"OK" => Ok(None),
        b"FULL" => Ok(Some(full_in_flight(int(it.next())?))),
        b"FULLB" => Ok(Some(full_bytes(int(it.next())?))),
        _ => Err(corrupt("unexpected account reply tag")),
    }
}

/// The refusal of a claim over the in-flight quota.
pub(crate) fn full_in_flight(n: i64) -> StoreError {
    StoreError::Full(format!("tenant at its in-flight record quota ({n})").into())
}

/// The refusal of a claim over the stored-bytes quota.
pub(crate) fn full_bytes(used: i64) -> StoreError {
    StoreError::Full(
        format!("tenant at its stored-bytes quota (maxBytesPerTenant; {used} bytes stored)").into(),
    )
}
