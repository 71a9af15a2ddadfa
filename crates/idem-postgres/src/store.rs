//! [`PostgresStore`]: the [`Store`] trait on PostgreSQL.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use idem_store::{
    Claim, ClaimRequest, CompleteRequest, DeleteMode, Deletion, Fence, Fingerprint, RecordInfo,
    RecordState, Scope, Store, StoreError, StoredOutcome, wait,
};
use sqlx::Row;
use sqlx::postgres::{PgPool, PgRow};
use tokio::time::Instant;

use crate::builder::{NOTIFY_SAFETY_POLL, PostgresStoreBuilder};
use crate::error::{corrupt, map_error, timed_out};
use crate::listen::Listener;
use crate::schema::Queries;

/// An idempotency [`Store`] on PostgreSQL, shared by every server instance that points at
/// the same database. Cheap to clone (one `Arc`); every clone shares one pool.
///
/// Build it with [`PostgresStore::connect`] or [`PostgresStore::builder`]. See the
/// [crate docs](crate) for the schema, the round trips and the failure behaviour.
#[derive(Clone)]
pub struct PostgresStore {
    pub(crate) backend: Arc<Backend>,
}

/// What every clone of a [`PostgresStore`] shares: the pool, the queries for the table
/// prefix, the timeouts, the sweep batch and the listener of notifications.
pub(crate) struct Backend {
    pub(crate) pool: PgPool,
    pub(crate) sql: Queries,
    pub(crate) statement_timeout: Duration,
    pub(crate) tombstone_ttl: Duration,
    pub(crate) poll_min: Duration,
    pub(crate) poll_max: Duration,
    pub(crate) sweep_batch: u32,
    pub(crate) listener: Option<Arc<Listener>>,
    /// Most in-flight records per tenant, across every instance (`None`: no bound).
    pub(crate) max_in_flight_per_tenant: Option<usize>,
}

impl fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostgresStore")
            .field("table_prefix", &self.backend.sql.prefix)
            .field("statement_timeout", &self.backend.statement_timeout)
            .field("tombstone_ttl", &self.backend.tombstone_ttl)
            .field(
                "max_in_flight_per_tenant",
                &self.backend.max_in_flight_per_tenant,
            )
            .finish_non_exhaustive()
    }
}

/// What a waiter reads about a record.
struct Peek {
    state: RowState,
    fence: Fence,
    lease_left: Duration,
}

/// The state a record's row is in (its `state` letter).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RowState {
    InFlight,
    Completed,
    Released,
}

impl PostgresStore {
    /// A builder for `url` with the documented defaults.
    pub fn builder(url: impl Into<String>) -> PostgresStoreBuilder {
        PostgresStoreBuilder::new(url)
    }

    /// Connects to `url` with the default settings (see [`PostgresStoreBuilder`]).
    ///
    /// # Errors
    /// See [`PostgresStoreBuilder::connect`].
    pub async fn connect(url: impl Into<String>) -> Result<Self, crate::ConnectError> {
        Self::builder(url).connect().await
    }

    pub(crate) fn start(backend: Backend, sweep_interval: Option<Duration>) -> Self {
        let store = PostgresStore {
            backend: Arc::new(backend),
        };
        if let Some(interval) = sweep_interval {
            crate::sweep::spawn(Arc::downgrade(&store.backend), interval);
        }
        store
    }

    /// The table prefix in use.
    pub fn table_prefix(&self) -> &str {
        &self.backend.sql.prefix
    }

    /// The connection pool the store uses (to read its size, or to close it).
    pub fn pool(&self) -> &PgPool {
        &self.backend.pool
    }

    /// Whether the listener connection of [`WaitStrategy::Notify`](crate::WaitStrategy)
    /// is up. False before the first wait opens it, and while it reconnects.
    pub fn is_listening(&self) -> bool {
        self.backend
            .listener
            .as_ref()
            .is_some_and(|l| l.is_listening())
    }

    /// Deletes up to the sweep batch of expired records now and returns how many it
    /// deleted. The background sweeper calls this; call it yourself after
    /// [`no_sweep`](PostgresStoreBuilder::no_sweep).
    ///
    /// # Errors
    /// `StoreError::Unavailable` when PostgreSQL does not answer within the statement
    /// timeout.
    pub async fn sweep_expired(&self) -> Result<u64, StoreError> {
        self.backend.sweep().await
    }

    /// Marks the in-flight record held with `fence` as "the handler's writes are
    /// committed", on `conn`, which must be in the handler's own transaction, after its
    /// writes and just before its `COMMIT`. See the crate docs, "Transactional completion".
    ///
    /// The record's row stays locked until that transaction ends: the handler's writes
    /// then commit only while `fence` is current, and the mark only with them. After the
    /// commit, [`complete`](Store::complete) stores the response as usual; if the process
    /// ends first, duplicates wait out the lease (extended here by `lease`) and then get
    /// `Claim::Completed(StoredOutcome::NotRetained)`: never a second run. If the
    /// transaction rolls back, nothing happened and the record is in flight as before.
    ///
    /// `conn` is the caller's, so only the client side of the statement timeout applies.
    ///
    /// # Errors
    /// `StoreError::Fenced` when `fence` is no longer current (the lease ended and another
    /// claimant took over, or the record is gone): roll the transaction back.
    /// `StoreError::Unavailable` on a timeout or a connection error; `Corrupt` on a reply
    /// of the wrong shape.
    pub async fn commit_in(
        &self,
        conn: &mut sqlx::PgConnection,
        scope: &Scope,
        fence: Fence,
        lease: Duration,
    ) -> Result<(), StoreError> {
        let q = sqlx::query(&self.backend.sql.commit)
            .bind(&scope.0[..])
            .bind(fence_arg(fence))
            .bind(us(lease))
            .bind(us(self.backend.tombstone_ttl));
        let limit = self.backend.statement_timeout;
        let row = match tokio::time::timeout(limit, q.fetch_one(&mut *conn)).await {
            Ok(r) => r.map_err(map_error)?,
            Err(_) => return Err(timed_out(limit)),
        };
        fenced_reply(fence, &row)
    }

    /// Completes the record held with `record.fence()` with `response` (a
    /// [`StoredResponse`](idem_store::response::StoredResponse) encoding), on `conn`,
    /// which must be in the handler's own transaction, after its writes. The record
    /// becomes completed only if that transaction commits; after the commit, call
    /// [`RecordRef::mark_completed`](idem_store::RecordRef::mark_completed) so the layer
    /// does not record the outcome again. [`RecordTx`](crate::RecordTx) does all of this.
    ///
    /// The row stays locked until the transaction ends, so a takeover cannot slip in
    /// between this fence check and the commit.
    ///
    /// # Errors
    /// As [`commit_in`](Self::commit_in): `Fenced` means roll back.
    pub async fn complete_in(
        &self,
        conn: &mut sqlx::PgConnection,
        record: &idem_store::RecordRef,
        response: Bytes,
    ) -> Result<(), StoreError> {
        let q = sqlx::query(&self.backend.sql.complete)
            .bind(&record.scope().0[..])
            .bind(fence_arg(record.fence()))
            .bind("r")
            .bind(&response[..])
            .bind(us(record.record_ttl()));
        let limit = self.backend.statement_timeout;
        let row = match tokio::time::timeout(limit, q.fetch_one(&mut *conn)).await {
            Ok(r) => r.map_err(map_error)?,
            Err(_) => return Err(timed_out(limit)),
        };
        fenced_reply(record.fence(), &row)
    }

    pub(crate) fn statement_timeout(&self) -> Duration {
        self.backend.statement_timeout
    }

    async fn fenced(
        &self,
        presented: Fence,
        query: sqlx::query::Query<'_, sqlx::Postgres, sqlx::postgres::PgArguments>,
    ) -> Result<(), StoreError> {
        let row = self.backend.fetch_one(query).await?;
        fenced_reply(presented, &row)
    }

    /// Reads the record's state, fence and lease; `watch` also marks it as watched, so
    /// its completion or release notifies. `None`: no record, or `until` came first (a
    /// read cut short by `until` is "changed or not known", not a store failure).
    async fn peek_until(
        &self,
        scope: &Scope,
        until: Instant,
        watch: bool,
    ) -> Result<Option<Peek>, StoreError> {
        let now = Instant::now();
        if now >= until {
            return Ok(None);
        }
        let limit = self.backend.statement_timeout.min(until - now);
        let sql = if watch {
            &self.backend.sql.watch
        } else {
            &self.backend.sql.peek
        };
        let read = self
            .backend
            .fetch_optional_within(limit, sqlx::query(sql).bind(&scope.0[..]))
            .await;
        let row = match read {
            Err(StoreError::Unavailable(_)) if Instant::now() >= until => return Ok(None),
            r => r?,
        };
        let Some(row) = row else { return Ok(None) };
        // `idem_watch` answers one row of NULLs when there is no record.
        let Some(state) = row.try_get::<Option<String>, _>(0).map_err(map_error)? else {
            return Ok(None);
        };
        Ok(Some(Peek {
            state: state_of(&state)?,
            fence: fence(row.try_get(1).map_err(map_error)?)?,
            lease_left: micros(row.try_get(2).map_err(map_error)?),
        }))
    }
}

impl Backend {
    /// Runs one statement on a pooled connection, bounded by the statement timeout.
    async fn fetch_one(
        &self,
        query: sqlx::query::Query<'_, sqlx::Postgres, sqlx::postgres::PgArguments>,
    ) -> Result<PgRow, StoreError> {
        self.fetch_optional_within(self.statement_timeout, query)
            .await?
            .ok_or_else(|| corrupt("a function returned no row"))
    }

    async fn fetch_optional_within(
        &self,
        limit: Duration,
        query: sqlx::query::Query<'_, sqlx::Postgres, sqlx::postgres::PgArguments>,
    ) -> Result<Option<PgRow>, StoreError> {
        match tokio::time::timeout(limit, query.fetch_optional(&self.pool)).await {
            Ok(r) => r.map_err(map_error),
            Err(_) => Err(timed_out(limit)),
        }
    }

    pub(crate) async fn sweep(&self) -> Result<u64, StoreError> {
        let q = sqlx::query(&self.sql.sweep).bind(i64::from(self.sweep_batch));
        match tokio::time::timeout(self.statement_timeout, q.execute(&self.pool)).await {
            Ok(r) => Ok(r.map_err(map_error)?.rows_affected()),
            Err(_) => Err(timed_out(self.statement_timeout)),
        }
    }

    pub(crate) fn sweep_batch(&self) -> u64 {
        u64::from(self.sweep_batch)
    }
}

impl Store for PostgresStore {
    /// One statement, `idem_claim`. Under a per-tenant bound, a claim that would start a
    /// run first takes its tenant's advisory lock and counts the tenant's live leases
    /// (see the crate docs, "Per-tenant in-flight bound"); past the bound it is refused
    /// with [`StoreError::Full`] and nothing is written.
    async fn claim(&self, req: ClaimRequest<'_>) -> Result<Claim, StoreError> {
        let claimant = req.claimant.0.to_be_bytes();
        let bound = self.backend.max_in_flight_per_tenant;
        let q = sqlx::query(&self.backend.sql.claim)
            .bind(&req.scope.0[..])
            .bind(&req.tenant.0[..])
            .bind(&req.fingerprint.0[..])
            .bind(&claimant[..])
            .bind(us(req.lease))
            .bind(us(self.backend.tombstone_ttl))
            .bind(bound.map(|n| i64::try_from(n).unwrap_or(i64::MAX)));
        let row = self.backend.fetch_one(q).await?;
        let get = |i| row.try_get::<Option<i64>, _>(i).map_err(map_error);
        let tag: Option<String> = row.try_get(0).map_err(map_error)?;
        match tag.as_deref() {
            Some("A") => Ok(Claim::Acquired {
                fence: fence(get(1)?.ok_or_else(|| corrupt("claim without a fence"))?)?,
                takeover: row
                    .try_get::<Option<bool>, _>(2)
                    .map_err(map_error)?
                    .ok_or_else(|| corrupt("claim without takeover"))?,
            }),
            Some("C") => {
                let kind: Option<String> = row.try_get(4).map_err(map_error)?;
                let body: Option<Vec<u8>> = row.try_get(5).map_err(map_error)?;
                Ok(Claim::Completed(outcome(kind.as_deref(), body)?))
            }
            Some("I") => Ok(Claim::InFlight {
                lease_remaining: micros(get(3)?),
            }),
            Some("M") => Ok(Claim::Mismatch),
            Some("F") => Err(StoreError::Full(
                format!(
                    "tenant at its in-flight record bound ({})",
                    bound.unwrap_or_default()
                )
                .into(),
            )),
            _ => Err(corrupt("unexpected claim reply")),
        }
    }

    async fn renew(&self, scope: &Scope, fence: Fence, lease: Duration) -> Result<(), StoreError> {
        let q = sqlx::query(&self.backend.sql.renew)
            .bind(&scope.0[..])
            .bind(fence_arg(fence))
            .bind(us(lease))
            .bind(us(self.backend.tombstone_ttl));
        self.fenced(fence, q).await
    }

    async fn complete(&self, req: CompleteRequest<'_>) -> Result<(), StoreError> {
        let (kind, body): (&str, &[u8]) = match &req.outcome {
            StoredOutcome::Response(b) => ("r", b),
            StoredOutcome::NotRetained => ("n", b""),
        };
        let q = sqlx::query(&self.backend.sql.complete)
            .bind(&req.scope.0[..])
            .bind(fence_arg(req.fence))
            .bind(kind)
            .bind(body)
            .bind(us(req.ttl));
        self.fenced(req.fence, q).await
    }

    async fn release(&self, scope: &Scope, fence: Fence) -> Result<(), StoreError> {
        let q = sqlx::query(&self.backend.sql.release)
            .bind(&scope.0[..])
            .bind(fence_arg(fence))
            .bind(us(self.backend.tombstone_ttl));
        self.fenced(fence, q).await
    }

    async fn get(&self, scope: &Scope) -> Result<Option<RecordState>, StoreError> {
        let q = sqlx::query(&self.backend.sql.get).bind(&scope.0[..]);
        let Some(row) = self
            .backend
            .fetch_optional_within(self.backend.statement_timeout, q)
            .await?
        else {
            return Ok(None);
        };
        record_state(&row).map(Some)
    }

    async fn read_record(&self, scope: &Scope) -> Result<Option<RecordInfo>, StoreError> {
        self.read_record_at(scope).await
    }

    async fn delete_record(&self, scope: &Scope, mode: DeleteMode) -> Result<Deletion, StoreError> {
        self.delete_record_at(scope, mode).await
    }

    /// Registers with the listener, marks the record as watched and reads it; while it is
    /// the same live claim, sleeps until a notification, the lease end, `until`, or the
    /// next read (every [`NOTIFY_SAFETY_POLL`] while notifications arrive, with the
    /// polling backoff while they cannot), and reads again. See the crate docs, "Waiting".
    async fn wait(&self, scope: &Scope, until: Instant) -> Result<(), StoreError> {
        let watch = self.backend.listener.as_ref().map(|l| l.watch(*scope));
        let mut interval = self.backend.poll_min;
        let mut marked = false;
        let mut watched_fence = None;
        loop {
            // Armed before the read, so a notification (or a lost listener) after it
            // still wakes us.
            let mut notified = std::pin::pin!(watch.as_ref().map(|w| w.notify().notified()));
            if let Some(n) = notified.as_mut().as_pin_mut() {
                n.enable();
            }
            let listening = watch.as_ref().is_some_and(|w| w.listening());
            // Mark the record once notifications can reach us; plain reads after that.
            let mark = listening && !marked;
            let Some(p) = self.peek_until(scope, until, mark).await? else {
                return Ok(());
            };
            marked |= mark;
            if p.state != RowState::InFlight
                || p.lease_left.is_zero()
                || watched_fence.is_some_and(|f| f != p.fence)
            {
                return Ok(());
            }
            watched_fence = Some(p.fence);
            let now = Instant::now();
            if now >= until {
                return Ok(());
            }
            let step = if listening {
                NOTIFY_SAFETY_POLL
            } else {
                let s = interval;
                interval = (interval * 2).min(self.backend.poll_max);
                s
            };
            let wake = wait::next_read(now, step, p.lease_left, until);
            wait::sleep_or_notified(notified.as_mut(), wake).await;
        }
    }
}

/// A record from a row whose first six columns are those of `Queries::get`: state,
/// fence, fingerprint, lease µs left, outcome kind, outcome.
pub(crate) fn record_state(row: &PgRow) -> Result<RecordState, StoreError> {
    let state: String = row.try_get(0).map_err(map_error)?;
    let fence = fence(row.try_get(1).map_err(map_error)?)?;
    let fp = |row: &PgRow| -> Result<Fingerprint, StoreError> {
        fingerprint(row.try_get::<Option<Vec<u8>>, _>(2).map_err(map_error)?)
    };
    Ok(match state_of(&state)? {
        RowState::InFlight => RecordState::InFlight {
            fence,
            fingerprint: fp(row)?,
            lease_until: Instant::now() + micros(row.try_get(3).map_err(map_error)?),
        },
        RowState::Completed => RecordState::Completed {
            fence,
            fingerprint: fp(row)?,
            outcome: outcome(
                row.try_get::<Option<String>, _>(4)
                    .map_err(map_error)?
                    .as_deref(),
                row.try_get(5).map_err(map_error)?,
            )?,
        },
        RowState::Released => RecordState::Released { fence },
    })
}

/// The reply of a fenced function: `(o_ok, o_current)`.
fn fenced_reply(presented: Fence, row: &PgRow) -> Result<(), StoreError> {
    let ok: bool = row.try_get(0).map_err(map_error)?;
    if ok {
        return Ok(());
    }
    let current: Option<i64> = row.try_get(1).map_err(map_error)?;
    Err(StoreError::Fenced {
        presented,
        current: current.map(fence).transpose()?,
    })
}

/// Longest duration sent to PostgreSQL: about 100 years, in microseconds. Longer ones are
/// cut to it, so timestamps stay in range.
const MAX_US: i64 = 100 * 365 * 24 * 3600 * 1_000_000;

/// Microseconds for a function argument, in `1..=MAX_US`.
fn us(d: Duration) -> i64 {
    i64::try_from(d.as_micros())
        .unwrap_or(MAX_US)
        .clamp(1, MAX_US)
}

/// A fence as a `bigint`. Fences the store hands out fit; a larger one (never handed out)
/// becomes -1, which matches no record.
fn fence_arg(f: Fence) -> i64 {
    i64::try_from(f).unwrap_or(-1)
}

fn fence(v: i64) -> Result<Fence, StoreError> {
    Fence::try_from(v)
        .ok()
        .filter(|f| *f > 0)
        .ok_or_else(|| corrupt("fence out of range"))
}

pub(crate) fn micros(v: Option<i64>) -> Duration {
    Duration::from_micros(v.and_then(|v| u64::try_from(v).ok()).unwrap_or(0))
}

fn state_of(s: &str) -> Result<RowState, StoreError> {
    match s {
        // 'p': in flight, the handler's writes committed (see `commit_in`).
        "i" | "p" => Ok(RowState::InFlight),
        "c" => Ok(RowState::Completed),
        "r" => Ok(RowState::Released),
        _ => Err(corrupt("unknown record state")),
    }
}

fn fingerprint(b: Option<Vec<u8>>) -> Result<Fingerprint, StoreError> {
    b.and_then(|b| <[u8; 32]>::try_from(b).ok())
        .map(Fingerprint)
        .ok_or_else(|| corrupt("fingerprint is not 32 bytes"))
}

fn outcome(kind: Option<&str>, body: Option<Vec<u8>>) -> Result<StoredOutcome, StoreError> {
    match (kind, body) {
        (Some("r"), Some(body)) => Ok(StoredOutcome::Response(Bytes::from(body))),
        (Some("n"), _) => Ok(StoredOutcome::NotRetained),
        _ => Err(corrupt("unknown outcome kind, or a response without bytes")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_of_the_wrong_shape_are_corrupt_not_panics() {
        assert!(matches!(fence(0), Err(StoreError::Corrupt(_))));
        assert!(matches!(fence(-4), Err(StoreError::Corrupt(_))));
        assert_eq!(fence(7).ok(), Some(7));
        assert!(matches!(state_of("z"), Err(StoreError::Corrupt(_))));
        assert!(matches!(
            fingerprint(Some(vec![1, 2])),
            Err(StoreError::Corrupt(_))
        ));
        assert!(matches!(fingerprint(None), Err(StoreError::Corrupt(_))));
        assert!(matches!(
            outcome(Some("?"), Some(vec![])),
            Err(StoreError::Corrupt(_))
        ));
        assert!(matches!(
            outcome(Some("r"), None),
            Err(StoreError::Corrupt(_))
        ));
        assert!(matches!(outcome(None, None), Err(StoreError::Corrupt(_))));
        assert_eq!(
            outcome(Some("n"), None).ok(),
            Some(StoredOutcome::NotRetained)
        );
        assert_eq!(micros(Some(-5)), Duration::ZERO);
        assert_eq!(micros(None), Duration::ZERO);
    }

    #[test]
    fn durations_and_fences_stay_in_range() {
        assert_eq!(us(Duration::ZERO), 1);
        assert_eq!(us(Duration::from_millis(2)), 2000);
        assert_eq!(us(Duration::MAX), MAX_US);
        assert_eq!(fence_arg(5), 5);
        assert_eq!(fence_arg(u64::MAX), -1);
    }
}
