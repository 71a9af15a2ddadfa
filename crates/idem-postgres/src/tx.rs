//! [`RecordTx`]: a handler's own transaction in which its writes and its record's
//! completion commit together.

use std::ops::{Deref, DerefMut};

use bytes::Bytes;
use idem_store::response::StoredResponse;
use idem_store::{RecordRef, StoreError};
use sqlx::postgres::{PgConnection, PgPool};
use sqlx::{Postgres, Transaction};

use crate::store::PostgresStore;

mod error;

pub use error::{CONFLICT_RETRY_DELAY, TxError, reason};

/// A transaction on the store's database, opened for a protected call with
/// [`PostgresStore::begin_for`] (or [`begin_on`](PostgresStore::begin_on)), in which the
/// handler's writes and its record's completion commit together.
///
/// It derefs to the [`PgConnection`] of the transaction: run the handler's statements
/// with `.execute(&mut *tx)`, as on a `sqlx::Transaction`. Then
/// [`commit_reply`](Self::commit_reply) stores the reply in the record, under the
/// record's fence, and commits. Dropped without a commit, it rolls back, and the layer
/// records the outcome the handler returns as usual.
pub struct RecordTx {
    tx: Transaction<'static, Postgres>,
    store: PostgresStore,
    record: RecordRef,
}

impl std::fmt::Debug for RecordTx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecordTx")
            .field("fence", &self.record.fence())
            .finish_non_exhaustive()
    }
}

impl Deref for RecordTx {
    type Target = PgConnection;
    fn deref(&self) -> &PgConnection {
        &self.tx
    }
}

impl DerefMut for RecordTx {
    fn deref_mut(&mut self) -> &mut PgConnection {
        &mut self.tx
    }
}

impl PostgresStore {
    /// Opens a transaction for the protected call `request` on the store's own pool.
    ///
    /// The store's connections carry its statement timeout (500 ms by default), which
    /// then bounds the handler's statements too; use [`begin_on`](Self::begin_on) with
    /// the service's own pool when they need longer, or more connections than the
    /// store's pool has.
    ///
    /// # Errors
    /// [`TxError::NoRecord`] when `request` is not a protected call;
    /// [`TxError::Database`] when no connection could be had within the statement
    /// timeout.
    pub async fn begin_for<T>(&self, request: &tonic::Request<T>) -> Result<RecordTx, TxError> {
        self.begin_on(self.pool(), request).await
    }

    /// Opens a transaction for the protected call `request` on `pool`, which must reach
    /// the same database as the store (the records are in it).
    ///
    /// The `BEGIN` runs in a task of its own: a call that gives up on it (its time
    /// limit, or a caller that went away) cannot leave one of `pool`'s connections
    /// inside a transaction, which a bare `pool.begin()` cut short in sqlx 0.8 does.
    ///
    /// # Errors
    /// As [`begin_for`](Self::begin_for).
    pub async fn begin_on<T>(
        &self,
        pool: &PgPool,
        request: &tonic::Request<T>,
    ) -> Result<RecordTx, TxError> {
        let record = request
            .extensions()
            .get::<RecordRef>()
            .cloned()
            .ok_or(TxError::NoRecord)?;
        let tx = begin_within(pool, self.statement_timeout()).await?;
        Ok(RecordTx {
            tx,
            store: self.clone(),
            record,
        })
    }
}

impl RecordTx {
    /// The record this transaction completes.
    pub fn record(&self) -> &RecordRef {
        &self.record
    }

    /// Stores `reply` as the call's outcome, "OK with this message", in the record
    /// (under its fence), then commits: the handler's writes and the stored reply land
    /// together or not at all. Return exactly `Ok(tonic::Response::new(reply))` after
    /// it: duplicates are answered with what is stored here, byte for byte what the
    /// layer would have recorded for that response
    /// ([`StoredResponse::unary_ok`]); the layer sees the record completed and does
    /// not record it again.
    ///
    /// # Errors
    /// [`TxError::Fenced`] (rolled back; return it as ABORTED), [`TxError::Database`]
    /// (rolled back, also when the database refused the `COMMIT`, e.g. for a deferred
    /// constraint) / [`TxError::Store`] (rolled back), [`TxError::CommitUnknown`].
    /// Convert with `tonic::Status::from`: the caller gets a fixed answer, the details
    /// go to the log.
    pub async fn commit_reply<M: prost::Message>(self, reply: &M) -> Result<(), TxError> {
        let response = StoredResponse::unary_ok(&reply.encode_to_vec()).encode();
        self.commit_response(response).await
    }

    /// [`commit_reply`](Self::commit_reply) with a response already encoded in the
    /// [`StoredResponse`] format, for replies `commit_reply` cannot express (metadata).
    /// The handler must then return exactly that response.
    ///
    /// # Errors
    /// As [`commit_reply`](Self::commit_reply).
    pub async fn commit_response(mut self, response: Bytes) -> Result<(), TxError> {
        let completed = self
            .store
            .complete_in(&mut self.tx, &self.record, response)
            .await;
        let record = self.record.clone();
        self.finish(completed).await?;
        record.mark_completed();
        Ok(())
    }

    /// Marks the record "the handler's writes are committed" and commits, without a
    /// reply: the layer records the response the handler returns, as usual, after it
    /// returns. For responses that cannot be stored here (streams). A crash between
    /// this commit and the layer's record leaves a record that answers duplicates
    /// FAILED_PRECONDITION (`RESPONSE_NOT_RETAINED`): never a second run, but no replay.
    ///
    /// # Errors
    /// As [`commit_reply`](Self::commit_reply).
    pub async fn commit(mut self) -> Result<(), TxError> {
        let (scope, fence, lease) = (
            *self.record.scope(),
            self.record.fence(),
            self.record.lease_ttl(),
        );
        let marked = self
            .store
            .commit_in(&mut self.tx, &scope, fence, lease)
            .await;
        self.finish(marked).await
    }

    /// Rolls back the handler's writes; the record stays in flight for the layer.
    ///
    /// # Errors
    /// When the rollback could not be sent (the transaction ends with its connection).
    pub async fn rollback(self) -> Result<(), TxError> {
        Ok(self.tx.rollback().await?)
    }

    /// Commits after the store's statement succeeded; rolls back (by dropping) otherwise.
    async fn finish(self, store_step: Result<(), StoreError>) -> Result<(), TxError> {
        match store_step {
            Ok(()) => self.tx.commit().await.map_err(commit_failed),
            Err(StoreError::Fenced { presented, current }) => {
                let _ = self.tx.rollback().await;
                Err(TxError::Fenced { presented, current })
            }
            Err(e) => Err(TxError::Store(e)),
        }
    }
}

/// Begins a transaction on `pool`, waiting at most `limit` for it
/// ([`sqlx::Error::PoolTimedOut`] after that).
///
/// The `BEGIN` runs in a task of its own, so neither the time limit nor a caller that
/// drops this future can cut it short. sqlx 0.8 counts a transaction only once the
/// server has answered its `BEGIN`: a `begin()` future dropped while that answer is on
/// its way returns the connection to the pool *inside* a transaction nobody will end.
/// Every statement later run on that pooled connection (the store's claims included)
/// would then be part of that transaction, uncommitted, until one fails and leaves the
/// connection answering `25P02` ("current transaction is aborted") for good. Here a
/// late `BEGIN` completes in its task, and the transaction it opened is dropped there
/// and rolled back like any other.
pub(crate) async fn begin_within(
    pool: &PgPool,
    limit: std::time::Duration,
) -> Result<Transaction<'static, Postgres>, sqlx::Error> {
    let pool = pool.clone();
    let begin = tokio::spawn(async move { pool.begin().await });
    match tokio::time::timeout(limit, begin).await {
        Ok(Ok(tx)) => tx,
        // The task panicked or the runtime is shutting down.
        Ok(Err(_)) => Err(sqlx::Error::WorkerCrashed),
        Err(_) => Err(sqlx::Error::PoolTimedOut),
    }
}

/// A `COMMIT` the database answered with an error (a deferred constraint, a
/// serialization failure) rolled back; only one without an answer may have committed.
fn commit_failed(e: sqlx::Error) -> TxError {
    match e {
        sqlx::Error::Database(_) => TxError::Database(e),
        _ => TxError::CommitUnknown(e),
    }
}
