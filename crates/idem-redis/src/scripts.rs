//! The Lua scripts: one per store operation, each atomic on one key (on a single
//! endpoint, the record's key and its tenant's: see `tenant.rs`).
//!
//! Record layout (a Redis hash at `<prefix>{<scope hex>}`):
//!
//! | field | meaning |
//! |-------|---------|
//! | `s`   | state: `i` in flight, `c` completed, `r` released (a tombstone, kept only while the server clock is behind its fence) |
//! | `f`   | fence, decimal |
//! | `fp`  | request fingerprint, 32 raw bytes (absent on a tombstone) |
//! | `c`   | claimant id, 32 hex digits (in flight only) |
//! | `l`   | lease deadline, milliseconds on the Redis server's clock (in flight only) |
//! | `k`   | outcome kind: `r` response bytes kept, `n` not retained (completed only) |
//! | `o`   | outcome bytes, binary-safe (completed only) |
//! | `t0`  | when the record was claimed (a new claim, not a takeover), ms on the server clock; absent on records written before this field |
//! | `t1`  | when it was completed, ms on the server clock (completed only; absent before this field) |
//!
//! Every script reads the clock with `redis.call('TIME')`, so lease expiry is judged on
//! the server's clock and instances whose clocks disagree still agree on who holds a
//! lease. Scripts that write set the key's expiry (`PEXPIRE`) in the same script.
//! Complete and release `PUBLISH` the fence on `<key>:done` for waiters (see
//! `notify.rs`; `SPUBLISH` on Redis Cluster, a sharded channel in the record's slot);
//! with no subscriber that costs next to nothing.
//! Errors the scripts raise themselves start with `IDEMCORRUPT` and become
//! `StoreError::Corrupt`.

use redis::Script;

use crate::tenant;

/// Shared helpers, prepended to every script.
const PRELUDE: &str = r#"
local function now_us()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end
local function now_ms()
  return math.floor(now_us() / 1000)
end
local function corrupt(what)
  return redis.error_reply('IDEMCORRUPT ' .. what)
end
local function dec(n)
  return string.format('%d', n)
end
"#;

/// `KEYS[1]` record; `ARGV`: fingerprint, claimant, lease ms. With the per-tenant
/// quotas on a single endpoint, `KEYS[2..4]` the tenant's keys and `ARGV[4..7]` the
/// scope, the quotas and the overhead: an acquired claim is admitted by the tenant's
/// quotas in the same script before anything is written (see `tenant.rs`).
///
/// An in-flight record's key expires one lease after its lease ends (`2 × lease`): a
/// stalled holder can still record its outcome while nobody took over, and an
/// abandoned claim costs memory for no longer than that.
///
/// Replies: `{'A', fence, takeover 0|1}`, `{'C', kind, bytes}`, `{'I', lease ms left}`,
/// `{'M'}`, and with the quotas `{'FULL', count}` / `{'FULLB', bytes}` (nothing written).
const CLAIM: &str = r#"
local key = KEYS[1]
local fp, claimant = ARGV[1], ARGV[2]
local lease = tonumber(ARGV[3])
local px = 2 * lease
local us = now_us()
local now = math.floor(us / 1000)
local r = redis.call('HMGET', key, 's', 'f', 'fp', 'c', 'l', 'k', 'o')
local s = r[1]
local function take(fence, takeover)
  local refused = admit(fence, takeover == 0, lease, now)
  if refused then return refused end
  redis.call('HSET', key, 's', 'i', 'f', dec(fence), 'fp', fp, 'c', claimant, 'l', dec(now + lease))
  if takeover == 0 then redis.call('HSET', key, 't0', dec(now)) end
  redis.call('HDEL', key, 'k', 'o', 't1')
  redis.call('PEXPIRE', key, px)
  return {'A', fence, takeover}
end
if not s then
  -- A new record's first fence is the server clock in microseconds: larger than any
  -- fence an earlier (expired) record of this scope handed out, since each fence step
  -- takes a script run (over a microsecond).
  return take(us, 0)
end
local f = tonumber(r[2])
if not f then return corrupt('record without a fence') end
-- Past 2^53 - 1 a Lua number no longer grows by one: a takeover would hand out the
-- fence it replaces.
if f >= 9007199254740991 then return corrupt('fence out of range') end
if s == 'r' then
  -- A tombstone exists only while the clock is behind its fence.
  if f + 1 > us then return take(f + 1, 0) end
  return take(us, 0)
end
if s ~= 'c' and s ~= 'i' then return corrupt('unknown state') end
if r[3] ~= fp then
  return {'M'}
end
if s == 'c' then
  return {'C', r[6] or '', r[7] or ''}
end
local l = tonumber(r[5])
if not l then return corrupt('in-flight record without a lease') end
if l > now then
  if r[4] == claimant then
    -- Its own record: counted again if its entry was pruned (a late renewal), never
    -- refused for the count, and kept as long as the record's lease.
    local refused = admit(f, false, math.max(l - now, lease), now, true)
    if refused then return refused end
    if now + lease > l then
      redis.call('HSET', key, 'l', dec(now + lease))
      if redis.call('PTTL', key) < px then redis.call('PEXPIRE', key, px) end
    end
    return {'A', f, 0}
  end
  return {'I', l - now}
end
return take(f + 1, 1)
"#;

/// Reads the record's state and fence (`r`, and `cur` as a number); with no record,
/// returns the reply `{'F', -1}`. Begins the fenced scripts and the confirm script.
const READ_FENCE: &str = r#"
local key = KEYS[1]
local r = redis.call('HMGET', key, 's', 'f')
if not r[1] then return {'F', -1} end
local cur = tonumber(r[2])
if not cur then return corrupt('record without a fence') end
if cur >= 9007199254740991 then return corrupt('fence out of range') end
"#;

/// Checks that the record is in flight with fence `ARGV[1]`; on failure returns the
/// `{'F', current fence}` reply the caller maps to `StoreError::Fenced`.
const FENCE_CHECK: &str = r#"if r[1] ~= 'i' or r[2] ~= ARGV[1] then return {'F', cur} end
"#;

/// `ARGV`: fence, lease ms. Reply `{'OK'}` or `{'F', current}`.
const RENEW: &str = r#"
local lease = tonumber(ARGV[2])
redis.call('HSET', key, 'l', dec(now_ms() + lease))
if redis.call('PTTL', key) < 2 * lease then redis.call('PEXPIRE', key, 2 * lease) end
return {'OK'}
"#;

/// `ARGV`: fence, outcome kind, outcome bytes, record TTL ms. Reply `{'OK'}` or `{'F', current}`.
const COMPLETE: &str = r#"
redis.call('HSET', key, 's', 'c', 'k', ARGV[2], 'o', ARGV[3], 't1', dec(now_ms()))
redis.call('HDEL', key, 'c', 'l')
redis.call('PEXPIRE', key, tonumber(ARGV[4]))
redis.call('PUBLISH', key .. ':done', ARGV[1])
return {'OK'}
"#;

/// `ARGV`: fence. Reply `{'OK'}` or `{'F', current}`.
///
/// Deletes the record: the next claim's first fence is the server clock in
/// microseconds, already above this fence. Only when the clock is not (it stepped back)
/// does a tombstone keep the fence, until the clock passes it. See the crate docs,
/// "Fences".
const RELEASE: &str = r#"
local ahead_us = cur - now_us()
if ahead_us < 0 then
  redis.call('DEL', key)
else
  redis.call('HSET', key, 's', 'r')
  redis.call('HDEL', key, 'fp', 'c', 'l', 'k', 'o', 't0', 't1')
  redis.call('PEXPIRE', key, math.floor(ahead_us / 1000) + 1)
end
redis.call('PUBLISH', key .. ':done', ARGV[1])
return {'OK'}
"#;

/// [`COMPLETE`] with the tenant's quotas, single endpoint: `KEYS[2..4]` the tenant's
/// keys, `ARGV[5]` the in-flight member, `ARGV[6]` the bytes quota (`''` off),
/// `ARGV[7]` the overhead. A response that does not fit the bytes quota is recorded as
/// not retained. Reply `{'OK', 1 kept | 0 not retained}` or `{'F', current}`.
const COMPLETE_TENANT: &str = r#"
local kind, body = ARGV[2], ARGV[3]
local now = now_ms()
local ttl = tonumber(ARGV[4])
local kept = 1
if not t_complete(KEYS[2], KEYS[3], KEYS[4], ARGV[5], #body, tonumber(ARGV[6]),
                  tonumber(ARGV[7]), now + ttl, now) then
  kind, body, kept = 'n', '', 0
end
redis.call('HSET', key, 's', 'c', 'k', kind, 'o', body, 't1', dec(now))
redis.call('HDEL', key, 'c', 'l')
redis.call('PEXPIRE', key, ttl)
redis.call('PUBLISH', key .. ':done', ARGV[1])
return {'OK', kept}
"#;

/// Begins [`RELEASE`] with the tenant's quotas, single endpoint: `KEYS[2..4]` the
/// tenant's keys, `ARGV[2]` the in-flight member.
const RELEASE_TENANT: &str = r#"
t_release(KEYS[2], KEYS[3], KEYS[4], ARGV[2])
"#;

/// `ARGV[1]`: fence; runs after [`READ_FENCE`]. Reply `{'OK'}` or `{'F', current or -1}`.
///
/// Used before `WAIT` when claims and completions are confirmed on replicas: it writes
/// (sets the fence field to the value it has), so the `WAIT` that follows on the same
/// connection has a write of its own to wait for, after the claim or completion it
/// confirms in the replication stream. It checks the fence, in flight or completed: on
/// a master that lost the record (a failover) it answers `F`.
const CONFIRM: &str = r#"if r[2] ~= ARGV[1] or (r[1] ~= 'i' and r[1] ~= 'c') then return {'F', cur} end
redis.call('HSET', key, 'f', r[2])
return {'OK'}
"#;

/// `ARGV[1]`: `1` to include the fingerprint and outcome. Reply `{}` (no record) or
/// `{state, fence, lease ms left (0 when expired or not in flight), fp, kind, bytes,
/// created ms, completed ms, key TTL ms}` (the times `''` when absent).
const READ: &str = r#"
local key = KEYS[1]
local full = ARGV[1] == '1'
local r
if full then
  r = redis.call('HMGET', key, 's', 'f', 'l', 'fp', 'k', 'o', 't0', 't1')
else
  r = redis.call('HMGET', key, 's', 'f', 'l')
end
if not r[1] then return {} end
local f = tonumber(r[2])
if not f then return corrupt('record without a fence') end
local left = 0
if r[1] == 'i' then
  local l = tonumber(r[3])
  if not l then return corrupt('in-flight record without a lease') end
  left = l - now_ms()
  if left < 0 then left = 0 end
end
if full then
  return {r[1], f, left, r[4] or '', r[5] or '', r[6] or '', r[7] or '', r[8] or '',
          redis.call('PTTL', key)}
end
return {r[1], f, left}
"#;

/// `KEYS[1]` record; `ARGV[1]`: `1` to delete an in-flight record too. Reply `{}` (no
/// record, or only a tombstone), `{'R', …}` (in flight, not forced: nothing changed)
/// or `{'D', …}` (deleted), `…` being the nine fields of the full [`READ`] reply as
/// they were.
///
/// Deletes as [`RELEASE`] does: the next claim's first fence is the server clock in
/// microseconds, above this fence; only while the clock is behind it does a tombstone
/// keep the fence. Publishes on `<key>:done`, so waiters claim again.
const DELETE: &str = r#"
local key = KEYS[1]
local r = redis.call('HMGET', key, 's', 'f', 'l', 'fp', 'k', 'o', 't0', 't1')
if not r[1] or r[1] == 'r' then return {} end
local cur = tonumber(r[2])
if not cur then return corrupt('record without a fence') end
local us = now_us()
local left = 0
if r[1] == 'i' then
  local l = tonumber(r[3])
  if not l then return corrupt('in-flight record without a lease') end
  left = l - math.floor(us / 1000)
  if left < 0 then left = 0 end
end
local tag = 'D'
if r[1] == 'i' and ARGV[1] ~= '1' then tag = 'R' end
local info = {tag, r[1], cur, left, r[4] or '', r[5] or '', r[6] or '', r[7] or '',
              r[8] or '', redis.call('PTTL', key)}
if tag == 'R' then return info end
local ahead_us = cur - us
if ahead_us < 0 then
  redis.call('DEL', key)
else
  redis.call('HSET', key, 's', 'r')
  redis.call('HDEL', key, 'fp', 'c', 'l', 'k', 'o', 't0', 't1')
  redis.call('PEXPIRE', key, math.floor(ahead_us / 1000) + 1)
end
redis.call('PUBLISH', key .. ':done', dec(cur))
return info
"#;

/// The loaded scripts (SHA-1 computed once; `EVALSHA`, loading on `NOSCRIPT`).
#[derive(Debug)]
pub(crate) struct Scripts {
    pub(crate) claim: Script,
    /// The claim with the tenant's quotas in the same script (single endpoint).
    pub(crate) claim_tenant: Script,
    pub(crate) renew: Script,
    pub(crate) complete: Script,
    /// The completion with the tenant's quotas (single endpoint).
    pub(crate) complete_tenant: Script,
    pub(crate) release: Script,
    /// The release with the tenant's quotas (single endpoint).
    pub(crate) release_tenant: Script,
    pub(crate) read: Script,
    pub(crate) delete: Script,
    /// The tenant's own steps, on its slot (Redis Cluster; renewals).
    pub(crate) t_account: Script,
    pub(crate) t_complete: Script,
    pub(crate) t_release: Script,
    pub(crate) confirm: Script,
}

impl Scripts {
    /// The scripts; `sharded` (Redis Cluster) publishes completions with `SPUBLISH`.
    pub(crate) fn new(sharded: bool) -> Self {
        let publish = |body: &str| {
            if sharded {
                body.replace("redis.call('PUBLISH'", "redis.call('SPUBLISH'")
            } else {
                body.to_owned()
            }
        };
        let fenced = |lib: &str, head: &str, body: &str| {
            Script::new(&format!(
                "{PRELUDE}{lib}{READ_FENCE}{FENCE_CHECK}{head}{}",
                publish(body)
            ))
        };
        let lib = tenant::TENANT_LIB;
        let tenant = |body: &str| Script::new(&format!("{PRELUDE}{lib}{body}"));
        Scripts {
            claim: Script::new(&format!("{PRELUDE}{}{CLAIM}", tenant::CLAIM_ADMIT_NONE)),
            claim_tenant: Script::new(&format!("{PRELUDE}{lib}{}{CLAIM}", tenant::CLAIM_ADMIT)),
            renew: fenced("", "", RENEW),
            complete: fenced("", "", COMPLETE),
            complete_tenant: fenced(lib, "", COMPLETE_TENANT),
            release: fenced("", "", RELEASE),
            release_tenant: fenced(lib, RELEASE_TENANT, RELEASE),
            read: Script::new(&format!("{PRELUDE}{READ}")),
            delete: Script::new(&format!("{PRELUDE}{}", publish(DELETE))),
            t_account: tenant(tenant::ACCOUNT),
            t_complete: tenant(tenant::COMPLETE),
            t_release: tenant(tenant::RELEASE),
            confirm: Script::new(&format!("{PRELUDE}{READ_FENCE}{CONFIRM}")),
        }
    }

    pub(crate) fn all(&self) -> [&Script; 13] {
        [
            &self.claim,
            &self.claim_tenant,
            &self.renew,
            &self.complete,
            &self.complete_tenant,
            &self.release,
            &self.release_tenant,
            &self.read,
            &self.delete,
            &self.t_account,
            &self.t_complete,
            &self.t_release,
            &self.confirm,
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cluster_scripts_publish_on_the_sharded_channel() {
        let plain = Scripts::new(false);
        let sharded = Scripts::new(true);
        assert_ne!(plain.complete.get_hash(), sharded.complete.get_hash());
        assert_ne!(plain.release.get_hash(), sharded.release.get_hash());
        assert_eq!(plain.claim.get_hash(), sharded.claim.get_hash());
        assert!(COMPLETE.contains("redis.call('PUBLISH'"));
        assert!(RELEASE.contains("redis.call('PUBLISH'"));
    }
}
