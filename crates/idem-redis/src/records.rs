//! The operator's calls on Redis: reading and deleting one record
//! ([`Store::read_record`](idem_store::Store::read_record),
//! [`Store::delete_record`](idem_store::Store::delete_record)), and finding the records
//! whose scope starts with the hex prefix the logs print ([`RedisStore::find_scopes`]:
//! one node's `SCAN`, or every master's on a Redis Cluster).
//!
//! A forced delete of an in-flight record leaves its entry in the tenant's in-flight
//! count (see the crate docs, "Per-tenant quota") until its lease ends: the record names
//! no tenant, so the count cannot be found from it.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use idem_store::{DeleteMode, Deletion, RecordInfo, RecordState, Scope, StoreError};
use redis::Value;
use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};
use tokio::time::Instant;

use crate::conn::Conn;

use crate::reply::{
    array, bytes, corrupt, fence, fingerprint, int, millis, outcome, state_byte, tag,
};
use crate::store::RedisStore;

/// Most keys one `SCAN` step asks for.
const SCAN_COUNT: usize = 1000;

impl RedisStore {
    pub(crate) async fn read_record_at(
        &self,
        scope: &Scope,
    ) -> Result<Option<RecordInfo>, StoreError> {
        let key = self.key_for(scope);
        let v = self
            .eval_one(&self.backend.scripts.read, &key, &[b"1"])
            .await?;
        let items = array(v)?;
        if items.is_empty() {
            return Ok(None);
        }
        record_info(items).map(Some)
    }

    pub(crate) async fn delete_record_at(
        &self,
        scope: &Scope,
        mode: DeleteMode,
    ) -> Result<Deletion, StoreError> {
        let key = self.key_for(scope);
        let force: &[u8] = match mode {
            DeleteMode::Force => b"1",
            DeleteMode::UnlessInFlight => b"0",
        };
        let v = self
            .eval_one(&self.backend.scripts.delete, &key, &[force])
            .await?;
        let mut items = array(v)?;
        if items.is_empty() {
            return Ok(Deletion::NotFound);
        }
        let t = tag(Some(items.remove(0)))?;
        let info = record_info(items)?;
        match t.as_slice() {
            b"D" => Ok(Deletion::Deleted(info)),
            b"R" => Ok(Deletion::RefusedInFlight(info)),
            _ => Err(corrupt("unexpected delete reply tag")),
        }
    }

    /// The scopes of the records whose scope begins with `prefix` (bytes, e.g. the 8 of
    /// the 16 hex digits the logs print), at most `limit` of them, found with `SCAN`
    /// (non-blocking, 1000 keys a step; O(keys) in all). On a Redis Cluster, `SCAN`
    /// walks one node, so every master is walked in turn (the masters as `CLUSTER SLOTS`
    /// reports them, each reached through one of its slots); a slot that moves during
    /// the walk may be missed or seen twice (duplicates are dropped).
    ///
    /// # Errors
    /// `StoreError::Unavailable` when Redis (a master, on a Cluster) does not answer in
    /// time.
    pub async fn find_scopes(&self, prefix: &[u8], limit: usize) -> Result<Vec<Scope>, StoreError> {
        let hex: String = prefix.iter().map(|b| format!("{b:02x}")).collect();
        let pattern = format!("{}{{{hex}*}}", glob_escape(self.key_prefix()));
        let mut found = Vec::new();
        if self.is_cluster() {
            for slot in self.master_slots().await? {
                if found.len() >= limit {
                    break;
                }
                self.scan_node(Some(slot), &pattern, limit, &mut found)
                    .await?;
            }
        } else {
            self.scan_node(None, &pattern, limit, &mut found).await?;
        }
        found.truncate(limit);
        Ok(found)
    }

    /// `SCAN`s one node (on a Cluster: the master of `slot`) for keys matching
    /// `pattern`, adding the scopes they name to `found` until it holds `limit`.
    async fn scan_node(
        &self,
        slot: Option<u16>,
        pattern: &str,
        limit: usize,
        found: &mut Vec<Scope>,
    ) -> Result<(), StoreError> {
        let mut cursor = 0u64;
        loop {
            let mut conn = self.connection();
            let scan = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(pattern)
                .arg("COUNT")
                .arg(SCAN_COUNT)
                .to_owned();
            let (next, keys): (u64, Vec<String>) = self
                .bounded(self.command_timeout(), async move {
                    let v = match (&mut conn, slot) {
                        (Conn::Cluster(c), Some(slot)) => {
                            c.route_command(scan, on_master_of(slot)).await?
                        }
                        _ => scan.query_async::<Value>(&mut conn).await?,
                    };
                    Ok(redis::from_redis_value(v)?)
                })
                .await?;
            for key in keys {
                if let Some(scope) = self.scope_of_key(&key)
                    && !found.contains(&scope)
                {
                    found.push(scope);
                }
            }
            cursor = next;
            if cursor == 0 || found.len() >= limit {
                return Ok(());
            }
        }
    }

    /// One slot of each master of the Cluster (its first), from `CLUSTER SLOTS`.
    async fn master_slots(&self) -> Result<Vec<u16>, StoreError> {
        let Conn::Cluster(mut conn) = self.connection() else {
            return Ok(Vec::new());
        };
        let v = self
            .bounded(self.command_timeout(), async move {
                conn.route_command(
                    redis::cmd("CLUSTER").arg("SLOTS").to_owned(),
                    RoutingInfo::SingleNode(SingleNodeRoutingInfo::RandomPrimary),
                )
                .await
            })
            .await?;
        master_slots_of(v)
    }

    /// The scope a record key names, if it is one (`<prefix>{<64 hex digits>}`).
    fn scope_of_key(&self, key: &str) -> Option<Scope> {
        let hex = key
            .strip_prefix(self.key_prefix())?
            .strip_prefix('{')?
            .strip_suffix('}')?;
        let bytes = idem_store::records::parse_scope_hex(hex).ok()?;
        <[u8; 32]>::try_from(bytes).ok().map(Scope)
    }

    async fn eval_one(
        &self,
        script: &redis::Script,
        key: &str,
        args: &[&[u8]],
    ) -> Result<Value, StoreError> {
        Ok(self
            .eval_confirmed(script, &[key], args, self.command_timeout(), false)
            .await?
            .0)
    }
}

/// Routing to the master of `slot`.
fn on_master_of(slot: u16) -> RoutingInfo {
    RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(Route::new(
        slot,
        SlotAddr::Master,
    )))
}

/// The first slot of each master in a `CLUSTER SLOTS` reply: entries `[start, end,
/// [host, port, id…], replicas…]`, one per range.
fn master_slots_of(v: Value) -> Result<Vec<u16>, StoreError> {
    let mut masters: Vec<(Vec<u8>, i64, u16)> = Vec::new();
    for range in array(v)? {
        let mut it = array(range)?.into_iter();
        let start = u16::try_from(int(it.next())?)
            .map_err(|_| corrupt("CLUSTER SLOTS: slot out of range"))?;
        let _end = it.next();
        let mut node = array(it.next().unwrap_or(Value::Nil))?.into_iter();
        let host = bytes(node.next())?;
        let port = int(node.next())?;
        match masters
            .iter_mut()
            .find(|(h, p, _)| *h == host && *p == port)
        {
            Some(m) => m.2 = m.2.min(start),
            None => masters.push((host, port, start)),
        }
    }
    Ok(masters.into_iter().map(|(_, _, slot)| slot).collect())
}

/// `s` with the glob characters of `SCAN MATCH` escaped.
fn glob_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// The nine fields of the full read reply: state, fence, lease ms left, fingerprint,
/// outcome kind, outcome, created ms, completed ms, key TTL ms.
fn record_info(items: Vec<Value>) -> Result<RecordInfo, StoreError> {
    if items.len() != 9 {
        return Err(corrupt("record reply of unexpected length"));
    }
    let mut it = items.into_iter();
    let state = state_byte(it.next())?;
    let fence = fence(it.next())?;
    let left = millis(it.next())?;
    let fp = bytes(it.next())?;
    let kind = bytes(it.next())?;
    let body = bytes(it.next())?;
    let created = wall_ms(it.next())?;
    let completed = wall_ms(it.next())?;
    let pttl = int(it.next())?;
    let state = match state {
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
    };
    Ok(RecordInfo {
        state,
        // -1: no expiry (someone persisted the key); -2: gone since the read.
        expires_in: u64::try_from(pttl).ok().map(Duration::from_millis),
        created_at: created,
        completed_at: completed,
    })
}

/// A time field: `''` (not kept) or milliseconds since the Unix epoch.
fn wall_ms(v: Option<Value>) -> Result<Option<SystemTime>, StoreError> {
    let b = bytes(v)?;
    if b.is_empty() {
        return Ok(None);
    }
    let ms = int(Some(Value::BulkString(b)))?;
    Ok(u64::try_from(ms)
        .ok()
        .and_then(|ms| UNIX_EPOCH.checked_add(Duration::from_millis(ms))))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replies_of_the_wrong_shape_are_corrupt() {
        assert!(matches!(
            record_info(vec![Value::Int(1)]),
            Err(StoreError::Corrupt(_))
        ));
        let s = |b: &[u8]| Value::BulkString(b.to_vec());
        let ok = vec![
            s(b"c"),
            Value::Int(5),
            Value::Int(0),
            s(&[1; 32]),
            s(b"n"),
            s(b""),
            s(b"1700000000000"),
            s(b""),
            Value::Int(-1),
        ];
        let info = record_info(ok.clone()).unwrap();
        assert_eq!(info.expires_in, None);
        assert!(info.created_at.is_some() && info.completed_at.is_none());
        let mut bad = ok;
        bad[6] = s(b"soon");
        assert!(matches!(record_info(bad), Err(StoreError::Corrupt(_))));
        assert_eq!(glob_escape("a*b[1]?\\"), "a\\*b\\[1\\]\\?\\\\");
    }

    #[test]
    fn cluster_slots_give_one_slot_per_master() {
        let s = |b: &str| Value::BulkString(b.as_bytes().to_vec());
        let node = |port: i64| Value::Array(vec![s("127.0.0.1"), Value::Int(port), s("id")]);
        let range = |a: i64, b: i64, port: i64| {
            Value::Array(vec![
                Value::Int(a),
                Value::Int(b),
                node(port),
                node(port + 10),
            ])
        };
        let v = Value::Array(vec![
            range(10923, 16383, 7002),
            range(5461, 10922, 7001),
            range(0, 99, 7000),
            range(100, 5460, 7000),
        ]);
        assert_eq!(master_slots_of(v).unwrap(), vec![10923, 5461, 0]);
        assert!(master_slots_of(Value::Array(vec![Value::Int(1)])).is_err());
        assert!(master_slots_of(Value::Array(vec![Value::Array(vec![Value::Int(-1)])])).is_err());
    }
}
