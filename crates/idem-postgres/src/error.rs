//! Mapping driver errors and malformed rows to [`StoreError`].

use idem_store::{Cause, StoreError};

/// SQLSTATE the schema's functions raise for a record they cannot read.
pub(crate) const MALFORMED_RECORD: &str = "IC001";

/// Maps a driver error. A record the functions call malformed, a column of the wrong type
/// or NULL where a value belongs, and PostgreSQL's own corruption codes are `Corrupt`;
/// everything else (connection trouble, timeouts, cancelled statements, a closed or
/// exhausted pool, a shutting-down or read-only server, a missing schema, serialization
/// failures) is `Unavailable`: the store could not answer, and the layer fails closed.
pub(crate) fn map_error(e: sqlx::Error) -> StoreError {
    let corrupt = match &e {
        sqlx::Error::Database(db) => matches!(
            db.code().as_deref(),
            Some(MALFORMED_RECORD | "XX001" | "XX002")
        ),
        sqlx::Error::ColumnDecode { .. }
        | sqlx::Error::ColumnNotFound(_)
        | sqlx::Error::ColumnIndexOutOfBounds { .. }
        | sqlx::Error::Decode(_)
        | sqlx::Error::TypeNotFound { .. }
        | sqlx::Error::RowNotFound => true,
        _ => false,
    };
    let cause = Cause::new(format!("postgres: {e}"), e);
    if corrupt {
        StoreError::Corrupt(cause)
    } else {
        StoreError::Unavailable(cause)
    }
}

/// A row the store read does not hold what the schema promises.
pub(crate) fn corrupt(what: &str) -> StoreError {
    StoreError::Corrupt(format!("postgres: {what}").into())
}

/// The statement timeout ran out on the client side.
pub(crate) fn timed_out(limit: std::time::Duration) -> StoreError {
    StoreError::Unavailable(format!("postgres statement timed out after {limit:?}").into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn driver_errors_map_to_unavailable_or_corrupt() {
        let io = sqlx::Error::Io(std::io::Error::from(std::io::ErrorKind::ConnectionReset));
        assert!(matches!(map_error(io), StoreError::Unavailable(_)));
        assert!(matches!(
            map_error(sqlx::Error::PoolTimedOut),
            StoreError::Unavailable(_)
        ));
        assert!(matches!(
            map_error(sqlx::Error::PoolClosed),
            StoreError::Unavailable(_)
        ));
        assert!(matches!(
            map_error(sqlx::Error::Protocol("eh".into())),
            StoreError::Unavailable(_)
        ));
        assert!(matches!(
            map_error(sqlx::Error::ColumnNotFound("o_tag".into())),
            StoreError::Corrupt(_)
        ));
        assert!(matches!(
            map_error(sqlx::Error::Decode("bad".into())),
            StoreError::Corrupt(_)
        ));
        assert!(matches!(
            map_error(sqlx::Error::RowNotFound),
            StoreError::Corrupt(_)
        ));
    }
}
