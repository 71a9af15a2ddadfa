//! The operator's calls on Redis: reading and deleting one record
//! ([`Store::read_record`](idem_store::Store::read_record),
//! [`Store::delete_record`](idem_store::Store::delete_record)), and finding the records
//! whose scope starts with the hex prefix the logs print ([`RedisStore::find_scopes`]).
//!
//! A forced delete of an in-flight record leaves its entry in the tenant's in-flight
//! count (see the crate docs, "Per-tenant quota") until its lease ends: the record names
//! no tenant, so the count cannot be found from it.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use idem_store::{DeleteMode, Deletion, RecordInfo, RecordState, Scope, StoreError};
use redis::Value;
use tokio::time::Instant;

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
    /// (non-blocking, 1000 keys a step; O(keys) in all).
    ///
    /// # Errors
    /// On a Redis Cluster, `StoreError::Unavailable` saying to give the full scope:
    /// `SCAN` walks one node, so a prefix search would miss records on the others.
    /// Otherwise, as every call: `Unavailable` when Redis does not answer in time.
    pub async fn find_scopes(&self, prefix: &[u8], limit: usize) -> Result<Vec<Scope>, StoreError> {
        if self.is_cluster() {
            return Err(StoreError::Unavailable(
                "a scope prefix cannot be looked up on Redis Cluster (SCAN walks one \
                 node): give the full 64-digit scope, or the tenant, method and key"
                    .into(),
            ));
        }
        let hex: String = prefix.iter().map(|b| format!("{b:02x}")).collect();
        let pattern = format!("{}{{{hex}*}}", glob_escape(self.key_prefix()));
        let mut found = Vec::new();
        let mut cursor = 0u64;
        loop {
            let mut conn = self.connection();
            let scan = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(&pattern)
                .arg("COUNT")
                .arg(SCAN_COUNT)
                .to_owned();
            let (next, keys): (u64, Vec<String>) = self
                .bounded(self.command_timeout(), async move {
                    scan.query_async(&mut conn).await
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
                found.truncate(limit);
                return Ok(found);
            }
        }
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
}
