//! [`TxError`], and the one fixed answer a caller gets for each kind of it.
//!
//! The decision ([`TxError::failure`]: which [`TxFailure`] an error is) is apart from
//! the answer ([`TxFailure::status`]) and from the log line that keeps the details
//! ([`TxError::log`]). The table of codes, and why, is in the crate docs.

use std::collections::HashMap;
use std::time::Duration;

use idem_core::headers::ERROR_DOMAIN;
use idem_store::{Fence, StoreError};
use tonic::Code;
use tonic_types::{ErrorDetails, StatusExt};

/// Why a [`RecordTx`](crate::RecordTx) could not be opened or committed. Every variant
/// but [`CommitUnknown`](TxError::CommitUnknown) means the transaction did not commit.
///
/// Its `Display` names the details (SQL state, constraint, fences) for logs and for the
/// handler; the caller never sees it. [`From<TxError> for
/// tonic::Status`](#impl-From<TxError>-for-Status) answers with a fixed message and a
/// `google.rpc.ErrorInfo` reason (domain `idem`) per kind of failure, and logs the
/// details; the codes, and why, are in the crate docs ("What a caller sees when a
/// transaction fails"). The layer then records or releases the call as that code says.
#[derive(Debug, thiserror::Error)]
pub enum TxError {
    /// The request carries no [`RecordRef`](idem_store::RecordRef): the method is not
    /// protected, or the idempotency layer is not in front of the service. INTERNAL.
    #[error(
        "the call has no idempotency record: is the method protected and the layer in front of the service?"
    )]
    NoRecord,
    /// The lease ended and another claimant took the record over: this run is stale and
    /// its transaction was rolled back. ABORTED ([`reason::LEASE_LOST`]).
    #[error(
        "the idempotency record was taken over by another run (fence {presented} is stale, current {current:?}): rolled back"
    )]
    Fenced {
        /// The fence this run held.
        presented: Fence,
        /// The record's current fence, if there is a record.
        current: Option<Fence>,
    },
    /// A statement failed (the handler's own, or the `COMMIT`, which the database
    /// refused); the transaction rolls back. The code follows the SQL state: see the
    /// crate docs.
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
    /// The store's statement in the transaction failed (timeout, malformed reply).
    #[error(transparent)]
    Store(StoreError),
    /// The `COMMIT` got no answer (a lost connection): it may or may not have committed.
    /// UNAVAILABLE: if it did commit, the record holds the reply and the retry replays
    /// it; if not, the retry runs the handler again. Either way, once.
    #[error("the commit's outcome is unknown: {0}")]
    CommitUnknown(#[source] sqlx::Error),
}

/// The `ErrorInfo.reason` values (domain `idem`) of the statuses a [`TxError`] becomes.
/// Stable: clients match on them. They are re-exports of [`idem_core::headers::reason`],
/// the one home of every reason idem's layers send. `STORE_UNAVAILABLE`: the database
/// could not complete the call's transaction now (a statement timeout, a lost or refused
/// connection, a server shutting down or read-only, a `COMMIT` whose answer was lost),
/// the same reason as the layer's own when the store cannot answer.
pub mod reason {
    pub use idem_core::headers::reason::{
        CONSTRAINT_VIOLATED, LEASE_LOST, STORE_UNAVAILABLE, TX_CONFLICT, TX_FAILED, VALUE_REJECTED,
    };
}

/// The retry delay (`google.rpc.RetryInfo`) sent with [`reason::TX_CONFLICT`]: a
/// conflicting transaction usually ends within milliseconds.
pub const CONFLICT_RETRY_DELAY: Duration = Duration::from_millis(100);

/// What a [`TxError`] means for the caller: each kind has one fixed answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TxFailure {
    /// Another run holds the record now.
    LeaseLost,
    /// A concurrent transaction won; the same request can succeed at once.
    Conflict,
    /// The database could not answer now.
    Unavailable,
    /// The `COMMIT`'s answer was lost.
    CommitUnknown,
    /// A constraint rejected the writes: the same request fails the same way until the
    /// data changes.
    ConstraintViolated,
    /// The database rejected a value: the same request fails the same way.
    ValueRejected,
    /// Only the server can fix it (its SQL, its schema, its setup, a corrupt record).
    Internal,
}

impl TxFailure {
    /// The caller's answer: code, fixed message, reason, retry delay. Nothing in it
    /// depends on the error, so nothing of the error can leak.
    fn answer(self) -> (Code, &'static str, &'static str, Option<Duration>) {
        match self {
            TxFailure::LeaseLost => (
                Code::Aborted,
                "another run of this call took it over while this one ran; this run's \
                 writes were rolled back; retry the call with the same key for that run's \
                 outcome",
                reason::LEASE_LOST,
                None,
            ),
            TxFailure::Conflict => (
                Code::Aborted,
                "the call's transaction conflicted with a concurrent one and was rolled \
                 back; retry the call with the same key after the delay",
                reason::TX_CONFLICT,
                Some(CONFLICT_RETRY_DELAY),
            ),
            TxFailure::Unavailable => (
                Code::Unavailable,
                "the database could not complete the call's transaction; nothing was \
                 committed; retry the call with the same key",
                reason::STORE_UNAVAILABLE,
                None,
            ),
            TxFailure::CommitUnknown => (
                Code::Unavailable,
                "the database's answer to the call's commit was lost; retry the call with \
                 the same key: it replays the outcome if the commit landed, or runs once",
                reason::STORE_UNAVAILABLE,
                None,
            ),
            TxFailure::ConstraintViolated => (
                Code::FailedPrecondition,
                "the call's writes conflict with data already stored; nothing was \
                 committed; the same request fails the same way until that data changes",
                reason::CONSTRAINT_VIOLATED,
                None,
            ),
            TxFailure::ValueRejected => (
                Code::InvalidArgument,
                "the database rejected a value in the call's writes; nothing was \
                 committed; fix the request before sending it again",
                reason::VALUE_REJECTED,
                None,
            ),
            TxFailure::Internal => (
                Code::Internal,
                "the call's transaction failed on the server",
                reason::TX_FAILED,
                None,
            ),
        }
    }

    /// The status the caller gets.
    pub(crate) fn status(self) -> tonic::Status {
        let (code, message, why, delay) = self.answer();
        let mut details =
            ErrorDetails::with_error_info(why, ERROR_DOMAIN, HashMap::<String, String>::new());
        if delay.is_some() {
            details.set_retry_info(delay);
        }
        tonic::Status::with_error_details(code, message, details)
    }
}

/// The kind of failure a SQL state is, by PostgreSQL's error classes (Appendix A of
/// its manual).
fn sqlstate_failure(code: &str) -> TxFailure {
    match code {
        // serialization_failure, deadlock_detected, lock_not_available.
        "40001" | "40P01" | "55P03" => TxFailure::Conflict,
        // query_canceled (statement_timeout), read_only_sql_transaction (a standby
        // after a failover), idle_in_transaction_session_timeout,
        // statement_completion_unknown, system_error, io_error.
        "57014" | "25006" | "25P03" | "40003" | "58000" | "58030" => TxFailure::Unavailable,
        // Connection exceptions, insufficient resources (too many connections, out of
        // memory or disk), operator intervention (shutdown, cannot connect now).
        c if c.starts_with("08") || c.starts_with("53") || c.starts_with("57P") => {
            TxFailure::Unavailable
        }
        // Integrity constraint violations (unique, foreign key, not null, check,
        // exclusion) and WITH CHECK OPTION violations.
        c if c.starts_with("23") || c.starts_with("44") => TxFailure::ConstraintViolated,
        // Data exceptions (value too long or out of range, invalid text representation,
        // division by zero, ...).
        c if c.starts_with("22") => TxFailure::ValueRejected,
        // Syntax and access rules, undefined objects, privileges, a statement run in an
        // aborted transaction (25P02), the store's own IC001, internal errors, ...
        _ => TxFailure::Internal,
    }
}

/// The kind of failure a driver error is.
fn driver_failure(e: &sqlx::Error) -> TxFailure {
    match e {
        sqlx::Error::Database(db) => db
            .code()
            .as_deref()
            .map_or(TxFailure::Internal, sqlstate_failure),
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::Protocol(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => TxFailure::Unavailable,
        // Decoding the handler's rows, a row it expected and did not get, its
        // configuration, its encoding of arguments: the server's to fix.
        _ => TxFailure::Internal,
    }
}

/// The driver error behind a store error, if there is one.
fn driver_error(e: &StoreError) -> Option<&sqlx::Error> {
    let cause: &(dyn std::error::Error + 'static) = match e {
        StoreError::Unavailable(c) | StoreError::Corrupt(c) | StoreError::Full(c) => c,
        _ => return None,
    };
    cause.source()?.downcast_ref()
}

/// The kind of failure a store error in the transaction is. The store calls a
/// statement in a transaction the handler's earlier statement aborted "unavailable",
/// as it calls every driver error but a malformed record; here that is the handler's
/// bug (it went on after an error), and a conflict is a conflict.
fn store_failure(e: &StoreError) -> TxFailure {
    let by_driver = driver_error(e).map(driver_failure);
    match e {
        StoreError::Fenced { .. } => TxFailure::LeaseLost,
        StoreError::Corrupt(_) => TxFailure::Internal,
        _ => match by_driver {
            Some(f @ (TxFailure::Conflict | TxFailure::Internal)) => f,
            _ => TxFailure::Unavailable,
        },
    }
}

impl TxError {
    /// The kind of failure this is, for the caller's answer.
    pub(crate) fn failure(&self) -> TxFailure {
        match self {
            TxError::NoRecord => TxFailure::Internal,
            TxError::Fenced { .. } => TxFailure::LeaseLost,
            TxError::Database(e) => driver_failure(e),
            TxError::Store(e) => store_failure(e),
            TxError::CommitUnknown(_) => TxFailure::CommitUnknown,
        }
    }

    /// The driver's database error, if the database answered with one.
    fn database_error(&self) -> Option<&dyn sqlx::error::DatabaseError> {
        let driver = match self {
            TxError::Database(e) | TxError::CommitUnknown(e) => Some(e),
            TxError::Store(e) => driver_error(e),
            _ => None,
        };
        match driver? {
            sqlx::Error::Database(db) => Some(&**db),
            _ => None,
        }
    }

    /// Logs the details the caller is not told: the SQL state, the constraint and
    /// table, the fences, the driver's message.
    fn log(&self, failure: TxFailure) {
        let (_, _, why, _) = failure.answer();
        let db = self.database_error();
        let sqlstate = db.and_then(|d| d.code()).map(|c| c.into_owned());
        let constraint = db.and_then(|d| d.constraint());
        let table = db.and_then(|d| d.table());
        let (presented, current) = match self {
            TxError::Fenced { presented, current } => (Some(*presented), *current),
            TxError::Store(StoreError::Fenced { presented, current }) => {
                (Some(*presented), *current)
            }
            _ => (None, None),
        };
        macro_rules! event {
            ($level:ident) => {
                tracing::$level!(
                    reason = why,
                    sqlstate,
                    constraint,
                    table,
                    fence = presented,
                    current_fence = current,
                    error = %self,
                    "a protected call's transaction failed"
                )
            };
        }
        match failure {
            TxFailure::Internal => event!(error),
            _ => event!(warn),
        }
    }
}

impl From<TxError> for tonic::Status {
    /// The fixed answer for `e`'s kind of failure (see the crate docs); `e` itself goes
    /// to the log (WARN, or ERROR for INTERNAL), never to the caller.
    fn from(e: TxError) -> Self {
        let failure = e.failure();
        e.log(failure);
        failure.status()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sql_states_map_by_class() {
        let cases = [
            ("23505", TxFailure::ConstraintViolated), // unique_violation
            ("23503", TxFailure::ConstraintViolated), // foreign_key_violation
            ("23502", TxFailure::ConstraintViolated), // not_null_violation
            ("23514", TxFailure::ConstraintViolated), // check_violation
            ("23P01", TxFailure::ConstraintViolated), // exclusion_violation
            ("44000", TxFailure::ConstraintViolated), // with_check_option_violation
            ("22001", TxFailure::ValueRejected),      // string_data_right_truncation
            ("22003", TxFailure::ValueRejected),      // numeric_value_out_of_range
            ("22P02", TxFailure::ValueRejected),      // invalid_text_representation
            ("22012", TxFailure::ValueRejected),      // division_by_zero
            ("40001", TxFailure::Conflict),           // serialization_failure
            ("40P01", TxFailure::Conflict),           // deadlock_detected
            ("55P03", TxFailure::Conflict),           // lock_not_available
            ("57014", TxFailure::Unavailable),        // query_canceled
            ("57P01", TxFailure::Unavailable),        // admin_shutdown
            ("57P03", TxFailure::Unavailable),        // cannot_connect_now
            ("08006", TxFailure::Unavailable),        // connection_failure
            ("53300", TxFailure::Unavailable),        // too_many_connections
            ("25006", TxFailure::Unavailable),        // read_only_sql_transaction
            ("25P02", TxFailure::Internal),           // in_failed_sql_transaction
            ("42P01", TxFailure::Internal),           // undefined_table
            ("42601", TxFailure::Internal),           // syntax_error
            ("42501", TxFailure::Internal),           // insufficient_privilege
            ("IC001", TxFailure::Internal),           // the store's malformed record
            ("XX000", TxFailure::Internal),           // internal_error
            ("P0001", TxFailure::Internal),           // raise_exception
            ("", TxFailure::Internal),
        ];
        for (code, want) in cases {
            assert_eq!(sqlstate_failure(code), want, "{code}");
        }
    }

    #[test]
    fn driver_errors_without_a_sql_state() {
        let io = sqlx::Error::Io(std::io::Error::from(std::io::ErrorKind::ConnectionReset));
        assert_eq!(driver_failure(&io), TxFailure::Unavailable);
        assert_eq!(
            driver_failure(&sqlx::Error::PoolTimedOut),
            TxFailure::Unavailable
        );
        assert_eq!(
            driver_failure(&sqlx::Error::RowNotFound),
            TxFailure::Internal
        );
        assert_eq!(
            driver_failure(&sqlx::Error::ColumnNotFound("id".into())),
            TxFailure::Internal
        );
    }

    #[test]
    fn store_errors_keep_the_stores_verdict_but_for_conflicts_and_handler_bugs() {
        let fenced = StoreError::Fenced {
            presented: 1_796_163_405_328_615,
            current: Some(1_796_163_405_328_616),
        };
        assert_eq!(store_failure(&fenced), TxFailure::LeaseLost);
        let timed_out = StoreError::Unavailable("postgres statement timed out".into());
        assert_eq!(store_failure(&timed_out), TxFailure::Unavailable);
        let io = crate::error::map_error(sqlx::Error::Io(std::io::Error::from(
            std::io::ErrorKind::BrokenPipe,
        )));
        assert_eq!(store_failure(&io), TxFailure::Unavailable);
        let corrupt = crate::error::map_error(sqlx::Error::RowNotFound);
        assert_eq!(store_failure(&corrupt), TxFailure::Internal);
    }

    #[test]
    fn every_answer_is_fixed_and_carries_an_idem_reason() {
        let all = [
            TxFailure::LeaseLost,
            TxFailure::Conflict,
            TxFailure::Unavailable,
            TxFailure::CommitUnknown,
            TxFailure::ConstraintViolated,
            TxFailure::ValueRejected,
            TxFailure::Internal,
        ];
        for f in all {
            let (code, message, why, delay) = f.answer();
            let status = f.status();
            assert_eq!(status.code(), code);
            assert_eq!(status.message(), message);
            let info = status.get_details_error_info().expect("ErrorInfo");
            assert_eq!((info.domain.as_str(), info.reason.as_str()), ("idem", why));
            let retry = status.get_details_retry_info().and_then(|r| r.retry_delay);
            assert_eq!(retry, delay, "{f:?}");
            assert!(!message.chars().any(|c| c.is_ascii_digit()), "{message}");
        }
        // A deterministic failure is never UNAVAILABLE: clients would retry it for ever.
        for f in [
            TxFailure::ConstraintViolated,
            TxFailure::ValueRejected,
            TxFailure::Internal,
        ] {
            assert_ne!(f.status().code(), Code::Unavailable, "{f:?}");
        }
    }
}
