//! Start-up checks of the Redis server's settings.

use idem_store::StoreError;
use redis::Value;

use crate::store::RedisStore;

/// What [`RedisStore::check_server`] found. A field is `None` when the server would not
/// say (e.g. `CONFIG` renamed or forbidden by an ACL, as on some managed services).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ServerReport {
    /// `maxmemory-policy`.
    pub maxmemory_policy: Option<String>,
    /// `appendonly` is `yes`.
    pub append_only: Option<bool>,
    /// `save` (RDB snapshot schedule; empty means no snapshots).
    pub save: Option<String>,
    /// Each risk found, as logged with `tracing::warn!`.
    pub warnings: Vec<String>,
}

impl ServerReport {
    /// Whether `maxmemory-policy` may evict idempotency records (they all carry a TTL,
    /// so both `allkeys-*` and `volatile-*` policies may drop them).
    pub fn may_evict_records(&self) -> bool {
        self.maxmemory_policy
            .as_deref()
            .is_some_and(|p| p.starts_with("allkeys-") || p.starts_with("volatile-"))
    }

    /// Whether neither AOF nor RDB snapshots are on: a restart loses every record.
    pub fn persistence_off(&self) -> bool {
        self.append_only == Some(false) && self.save.as_deref().is_some_and(|s| s.trim().is_empty())
    }
}

impl RedisStore {
    /// Reads the server's eviction and persistence settings and warns (`tracing::warn!`)
    /// about the ones that break idempotency:
    ///
    /// - `maxmemory-policy` other than `noeviction`: under memory pressure Redis would
    ///   evict records, and a duplicate would then run a second time.
    /// - no persistence (`appendonly no` and `save ""`): a Redis restart forgets every
    ///   record, so retries after it run again.
    ///
    /// Called by [`RedisStoreBuilder::connect`](crate::RedisStoreBuilder::connect) unless
    /// skipped. On a Redis Cluster the cluster client sends `CONFIG GET` to one node
    /// (any), so the report is that node's settings: keep them the same on every node. A server that refuses `CONFIG GET` gets a warning that the settings could
    /// not be checked, not an error.
    ///
    /// # Errors
    /// [`StoreError::Unavailable`] when Redis does not answer.
    pub async fn check_server(&self) -> Result<ServerReport, StoreError> {
        let mut report = ServerReport {
            maxmemory_policy: self.config_get("maxmemory-policy").await?,
            append_only: self.config_get("appendonly").await?.map(|v| v == "yes"),
            save: self.config_get("save").await?,
            warnings: Vec::new(),
        };
        if report.maxmemory_policy.is_none() {
            report.warnings.push(
                "could not read the redis settings (CONFIG GET refused); make sure \
                 maxmemory-policy is noeviction and persistence is on"
                    .to_owned(),
            );
        }
        if report.may_evict_records() {
            report.warnings.push(format!(
                "redis maxmemory-policy is {}: under memory pressure redis may evict \
                 idempotency records and a duplicate would run again; use noeviction",
                report.maxmemory_policy.as_deref().unwrap_or_default()
            ));
        }
        if report.persistence_off() {
            report.warnings.push(
                "redis persistence is off (appendonly no, no save points): a redis restart \
                 forgets every idempotency record; use appendonly yes with appendfsync everysec"
                    .to_owned(),
            );
        }
        for w in &report.warnings {
            tracing::warn!(target: "idem_redis", prefix = %self.key_prefix(), "{w}");
        }
        Ok(report)
    }

    /// Whether the server says `cluster_enabled:1` (`INFO cluster`); `false` when it
    /// does not answer or refuses `INFO`, so only a clear yes stops a connect.
    pub(crate) async fn is_cluster_node(&self) -> bool {
        let mut conn = self.connection();
        let mut cmd = redis::cmd("INFO");
        cmd.arg("cluster");
        let reply = self
            .bounded(self.command_timeout(), async move {
                cmd.query_async::<Value>(&mut conn).await
            })
            .await;
        match reply {
            Ok(Value::BulkString(b)) => cluster_enabled(&String::from_utf8_lossy(&b)),
            Ok(Value::VerbatimString { text, .. }) => cluster_enabled(&text),
            _ => false,
        }
    }

    /// `CONFIG GET name` → its value; `None` when the server refuses the command.
    async fn config_get(&self, name: &str) -> Result<Option<String>, StoreError> {
        let mut conn = self.connection();
        let mut cmd = redis::cmd("CONFIG");
        cmd.arg("GET").arg(name);
        let reply = self
            .bounded(self.command_timeout(), async move {
                cmd.query_async::<Value>(&mut conn).await
            })
            .await;
        match reply {
            Ok(v) => Ok(config_value(v, name)),
            Err(StoreError::Unavailable(cause)) if !refused(cause.message()) => {
                Err(StoreError::Unavailable(cause))
            }
            Err(e) => {
                tracing::debug!(target: "idem_redis", error = %e, "CONFIG GET {name} refused");
                Ok(None)
            }
        }
    }
}

/// `cluster_enabled:1` in an `INFO cluster` reply.
fn cluster_enabled(info: &str) -> bool {
    info.lines().any(|l| l.trim() == "cluster_enabled:1")
}

/// Whether an error message is the server refusing `CONFIG` (unknown/renamed command,
/// ACL), rather than the server not answering.
fn refused(msg: &str) -> bool {
    msg.contains("unknown command") || msg.contains("NOPERM") || msg.contains("no permissions")
}

/// Picks `name`'s value out of a `CONFIG GET` reply (a flat array in RESP2, a map in
/// RESP3).
fn config_value(v: Value, name: &str) -> Option<String> {
    let text = |v: &Value| match v {
        Value::BulkString(b) => String::from_utf8(b.clone()).ok(),
        Value::SimpleString(s) => Some(s.clone()),
        _ => None,
    };
    match v {
        Value::Array(items) => items
            .chunks(2)
            .find(|kv| kv.first().and_then(text).as_deref() == Some(name))
            .and_then(|kv| kv.get(1).and_then(text)),
        Value::Map(pairs) => pairs
            .iter()
            .find(|(k, _)| text(k).as_deref() == Some(name))
            .and_then(|(_, v)| text(v)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_replies_in_both_protocols() {
        let bulk = |s: &str| Value::BulkString(s.as_bytes().to_vec());
        let resp2 = Value::Array(vec![bulk("maxmemory-policy"), bulk("noeviction")]);
        assert_eq!(
            config_value(resp2, "maxmemory-policy").as_deref(),
            Some("noeviction")
        );
        let resp3 = Value::Map(vec![(bulk("save"), bulk(""))]);
        assert_eq!(config_value(resp3, "save").as_deref(), Some(""));
        assert_eq!(config_value(Value::Array(vec![]), "save"), None);
        assert_eq!(config_value(Value::Int(1), "save"), None);
    }

    #[test]
    fn cluster_mode_is_read_from_info_cluster() {
        assert!(cluster_enabled("# Cluster\r\ncluster_enabled:1\r\n"));
        assert!(!cluster_enabled("# Cluster\r\ncluster_enabled:0\r\n"));
        assert!(!cluster_enabled(""));
        assert!(!cluster_enabled("cluster_enabled:10"));
    }

    #[test]
    fn risky_settings_are_recognised() {
        let r = |policy: &str, aof: bool, save: &str| ServerReport {
            maxmemory_policy: Some(policy.into()),
            append_only: Some(aof),
            save: Some(save.into()),
            warnings: vec![],
        };
        assert!(!r("noeviction", true, "").may_evict_records());
        assert!(r("allkeys-lru", true, "").may_evict_records());
        assert!(r("volatile-ttl", true, "").may_evict_records());
        assert!(r("noeviction", false, "").persistence_off());
        assert!(!r("noeviction", false, "3600 1").persistence_off());
        assert!(!r("noeviction", true, "").persistence_off());
    }
}
