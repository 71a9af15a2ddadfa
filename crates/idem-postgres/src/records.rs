//! The operator's calls on PostgreSQL: reading and deleting one record
//! ([`Store::read_record`](idem_store::Store::read_record),
//! [`Store::delete_record`](idem_store::Store::delete_record)), and finding the records
//! whose scope starts with the hex prefix the logs print ([`PostgresStore::find_scopes`]).
//!
//! `RecordInfo::created_at` and `completed_at` are the database clock's `created_at`
//! (set by the claim that started the run; a takeover keeps it) and `completed_at` (set
//! by the completion) of schema 2; `None` for rows written before the migration from
//! schema 1, and `completed_at` while in flight. A record in state `p` (the handler's
//! writes committed in its own transaction, its response not recorded yet) reads as in
//! flight.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use idem_store::{DeleteMode, Deletion, RecordInfo, Scope, StoreError};
use sqlx::Row;
use sqlx::postgres::PgRow;

use crate::error::{map_error, timed_out};
use crate::schema::render;
use crate::store::{PostgresStore, micros, record_state};

/// The columns of `Queries::get`, then the time left until the record expires (µs),
/// whether it is watched, and its creation and completion times (µs since the epoch).
const RECORD_COLUMNS: &str = "state, fence, fingerprint, greatest(0, ceil(extract(epoch FROM \
    lease_until - clock_timestamp()) * 1000000))::bigint, outcome_kind, outcome, \
    greatest(0, ceil(extract(epoch FROM expires_at - clock_timestamp()) * 1000000))::bigint, \
    watched, (extract(epoch FROM created_at) * 1000000)::bigint, \
    (extract(epoch FROM completed_at) * 1000000)::bigint";

impl PostgresStore {
    pub(crate) async fn read_record_at(
        &self,
        scope: &Scope,
    ) -> Result<Option<RecordInfo>, StoreError> {
        let sql = self.sql(&format!(
            "SELECT {RECORD_COLUMNS} FROM idem_records \
             WHERE scope = $1 AND expires_at > clock_timestamp()"
        ));
        let q = sqlx::query(&sql).bind(&scope.0[..]);
        let row = self.bounded(q.fetch_optional(self.pool())).await?;
        row.as_ref().map(info).transpose()
    }

    /// One transaction: lock the row, refuse an in-flight one unless forced, delete it,
    /// and notify waiters (delivered at commit).
    pub(crate) async fn delete_record_at(
        &self,
        scope: &Scope,
        mode: DeleteMode,
    ) -> Result<Deletion, StoreError> {
        let select = self.sql(&format!(
            "SELECT {RECORD_COLUMNS} FROM idem_records \
             WHERE scope = $1 AND expires_at > clock_timestamp() FOR UPDATE"
        ));
        let delete = self.sql("DELETE FROM idem_records WHERE scope = $1");
        let channel = self.sql("idem_done");
        let hex = scope.to_hex();
        let work = async {
            let mut tx = crate::tx::begin_within(self.pool(), self.statement_timeout()).await?;
            let Some(row) = sqlx::query(&select)
                .bind(&scope.0[..])
                .fetch_optional(&mut *tx)
                .await?
            else {
                return Ok(Err(Deletion::NotFound));
            };
            let watched: bool = row.try_get(7)?;
            let gone = match info(&row) {
                Ok(info) => info,
                Err(e) => return Ok(Ok(Err(e))),
            };
            // Fences come from one sequence: no tombstone is needed to keep them growing.
            if matches!(gone.state, idem_store::RecordState::Released { .. }) {
                return Ok(Err(Deletion::NotFound));
            }
            if gone.is_in_flight() && mode == DeleteMode::UnlessInFlight {
                return Ok(Err(Deletion::RefusedInFlight(gone)));
            }
            sqlx::query(&delete)
                .bind(&scope.0[..])
                .execute(&mut *tx)
                .await?;
            if watched || gone.is_in_flight() {
                sqlx::query("SELECT pg_notify($1, $2)")
                    .bind(&channel)
                    .bind(&hex)
                    .execute(&mut *tx)
                    .await?;
            }
            tx.commit().await?;
            Ok::<_, sqlx::Error>(Ok(Ok(Deletion::Deleted(gone))))
        };
        match self.bounded(work).await? {
            Ok(Ok(d)) => Ok(d),
            Ok(Err(e)) => Err(e),
            Err(d) => Ok(d),
        }
    }

    /// The scopes of the records whose scope begins with `prefix` (bytes, e.g. the 8 of
    /// the 16 hex digits the logs print), at most `limit` of them: a range scan of the
    /// primary key.
    ///
    /// # Errors
    /// `StoreError::Unavailable` when PostgreSQL does not answer within the statement
    /// timeout.
    pub async fn find_scopes(&self, prefix: &[u8], limit: usize) -> Result<Vec<Scope>, StoreError> {
        let sql = self.sql(
            "SELECT scope FROM idem_records WHERE scope >= $1 \
             AND ($2::bytea IS NULL OR scope < $2) AND expires_at > clock_timestamp() \
             ORDER BY scope LIMIT $3",
        );
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let q = sqlx::query(&sql)
            .bind(prefix)
            .bind(prefix_end(prefix))
            .bind(limit);
        let rows = self.bounded(q.fetch_all(self.pool())).await?;
        Ok(rows
            .iter()
            .filter_map(|r| r.try_get::<Vec<u8>, _>(0).ok())
            .filter_map(|b| <[u8; 32]>::try_from(b).ok().map(Scope))
            .collect())
    }

    fn sql(&self, sql: &str) -> String {
        render(sql, self.table_prefix())
    }

    async fn bounded<T>(
        &self,
        fut: impl Future<Output = Result<T, sqlx::Error>>,
    ) -> Result<T, StoreError> {
        let limit = self.statement_timeout();
        match tokio::time::timeout(limit, fut).await {
            Ok(r) => r.map_err(map_error),
            Err(_) => Err(timed_out(limit)),
        }
    }
}

/// The first byte string after every string that starts with `prefix`; `None` when
/// there is none (a prefix of `0xff` bytes only).
fn prefix_end(prefix: &[u8]) -> Option<Vec<u8>> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return Some(end);
        }
    }
    None
}

fn info(row: &PgRow) -> Result<RecordInfo, StoreError> {
    let expires: Option<i64> = row.try_get(6).map_err(map_error)?;
    Ok(RecordInfo {
        state: record_state(row)?,
        expires_in: Some(micros(expires)).filter(|d| *d > Duration::ZERO),
        created_at: wall(row.try_get(8).map_err(map_error)?),
        completed_at: wall(row.try_get(9).map_err(map_error)?),
    })
}

/// A time from microseconds since the Unix epoch (`None` stays unknown).
fn wall(us: Option<i64>) -> Option<SystemTime> {
    let us = us?;
    let d = Duration::from_micros(us.unsigned_abs());
    if us >= 0 {
        UNIX_EPOCH.checked_add(d)
    } else {
        UNIX_EPOCH.checked_sub(d)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_ends_carry() {
        assert_eq!(prefix_end(&[1, 2]), Some(vec![1, 3]));
        assert_eq!(prefix_end(&[1, 0xff]), Some(vec![2]));
        assert_eq!(prefix_end(&[0xff, 0xff]), None);
        assert_eq!(prefix_end(&[]), None);
    }

    #[test]
    fn times_are_microseconds_since_the_epoch() {
        assert_eq!(wall(None), None);
        assert_eq!(wall(Some(0)), Some(UNIX_EPOCH));
        assert_eq!(
            wall(Some(1_500_000)),
            Some(UNIX_EPOCH + Duration::from_micros(1_500_000))
        );
        assert!(wall(Some(-1)).is_some_and(|t| t < UNIX_EPOCH));
        let _ = wall(Some(i64::MIN));
        let _ = wall(Some(i64::MAX));
    }
}
