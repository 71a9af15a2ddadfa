//! The schema: its SQL (rendered for a table prefix), the statements the store sends, and
//! the check, create or migrate step run at connect.

use std::time::Duration;

use sqlx::{Executor, PgConnection, Row};

/// The schema version this crate writes and reads.
pub const SCHEMA_VERSION: i32 = 2;

/// The schema SQL of version 1, with the default prefix, `idem_` (shown in the crate
/// docs). Never edited: a new database runs it, then every step of [`MIGRATIONS`], so
/// new and migrated databases are the same.
pub(crate) const SCHEMA_SQL: &str = include_str!("schema.sql");

/// `MIGRATIONS[i]` takes a schema from version `i + 1` to `i + 2`; each sets the version
/// row and may run again (it only adds, or replaces functions).
pub(crate) const MIGRATIONS: [&str; (SCHEMA_VERSION - 1) as usize] =
    [include_str!("schema_v2.sql")];

/// The SQL of a new database for `prefix`: version 1, then every migration.
pub(crate) fn full_schema(prefix: &str) -> String {
    let mut sql = render(SCHEMA_SQL, prefix);
    for step in MIGRATIONS {
        sql.push('\n');
        sql.push_str(&render(step, prefix));
    }
    sql
}

/// The prefix `SCHEMA_SQL` is written with.
const TEMPLATE_PREFIX: &str = "idem_";

/// Longest prefix: the longest name (`<prefix>records_expires_at`) must fit PostgreSQL's
/// 63-byte identifiers.
pub(crate) const MAX_PREFIX_LEN: usize = 63 - "records_expires_at".len();

/// Whether `prefix` can start every name of the schema unquoted: lower-case ASCII
/// letters, digits and `_`, not starting with a digit, at most [`MAX_PREFIX_LEN`] bytes.
pub(crate) fn valid_prefix(prefix: &str) -> bool {
    !prefix.is_empty()
        && prefix.len() <= MAX_PREFIX_LEN
        && prefix
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
        && !prefix.as_bytes()[0].is_ascii_digit()
}

/// `sql` with every name's `idem_` replaced by `prefix` (which [`valid_prefix`] accepted).
pub(crate) fn render(sql: &str, prefix: &str) -> String {
    sql.replace(TEMPLATE_PREFIX, prefix)
}

/// The statements the store sends, rendered once for its prefix.
#[derive(Debug)]
pub(crate) struct Queries {
    pub(crate) prefix: String,
    pub(crate) claim: String,
    pub(crate) renew: String,
    pub(crate) complete: String,
    pub(crate) release: String,
    pub(crate) commit: String,
    pub(crate) watch: String,
    pub(crate) peek: String,
    pub(crate) get: String,
    pub(crate) sweep: String,
    pub(crate) channel: String,
}

impl Queries {
    pub(crate) fn new(prefix: &str) -> Self {
        let r = |sql: &str| render(sql, prefix);
        Queries {
            prefix: prefix.to_owned(),
            claim: r(
                "SELECT o_tag, o_fence, o_takeover, o_lease_left_us, o_outcome_kind, \
                      o_outcome FROM idem_claim($1, $2, $3, $4, $5, $6, $7)",
            ),
            renew: r("SELECT o_ok, o_current FROM idem_renew($1, $2, $3, $4)"),
            complete: r("SELECT o_ok, o_current FROM idem_complete($1, $2, $3, $4, $5)"),
            release: r("SELECT o_ok, o_current FROM idem_release($1, $2, $3)"),
            commit: r("SELECT o_ok, o_current FROM idem_commit($1, $2, $3, $4)"),
            watch: r("SELECT o_state, o_fence, o_lease_left_us FROM idem_watch($1)"),
            peek: r(
                "SELECT state, fence, greatest(0, ceil(extract(epoch FROM lease_until - \
                     clock_timestamp()) * 1000000))::bigint FROM idem_records \
                     WHERE scope = $1 AND expires_at > clock_timestamp()",
            ),
            get: r(
                "SELECT state, fence, fingerprint, greatest(0, ceil(extract(epoch FROM \
                    lease_until - clock_timestamp()) * 1000000))::bigint, outcome_kind, \
                    outcome FROM idem_records \
                    WHERE scope = $1 AND expires_at > clock_timestamp()",
            ),
            sweep: r(
                "DELETE FROM idem_records WHERE scope IN (SELECT scope FROM idem_records \
                      WHERE expires_at <= clock_timestamp() ORDER BY expires_at LIMIT $1 \
                      FOR UPDATE SKIP LOCKED)",
            ),
            channel: r("idem_done"),
        }
    }
}

/// Why the schema could not be checked, created or migrated.
#[derive(Debug)]
pub(crate) enum SchemaError {
    Database(sqlx::Error),
    /// The schema exists with another version, or without its version row, or a
    /// migration step failed (the message says which and why).
    Version(String),
}

impl From<sqlx::Error> for SchemaError {
    fn from(e: sqlx::Error) -> Self {
        SchemaError::Database(e)
    }
}

/// Creates the schema when it is missing, migrates an older one, and checks its version.
/// Runs in one transaction under an advisory lock, so instances starting together
/// create or migrate it once (the others wait, then find it current). An existing
/// schema of the right version needs no DDL (and no CREATE privilege).
pub(crate) async fn ensure(
    conn: &mut PgConnection,
    prefix: &str,
    timeout: Duration,
    manage: bool,
) -> Result<(), SchemaError> {
    conn.execute("BEGIN").await?;
    let r = ensure_in_transaction(conn, prefix, timeout, manage).await;
    // On an error the transaction is rolled back; the connection is closed anyway.
    conn.execute(if r.is_ok() { "COMMIT" } else { "ROLLBACK" })
        .await?;
    r
}

async fn ensure_in_transaction(
    conn: &mut PgConnection,
    prefix: &str,
    timeout: Duration,
    manage: bool,
) -> Result<(), SchemaError> {
    // The DDL may take longer than one store statement may; waiting for a table lock
    // (a migration behind a long transaction) is bounded too, so live traffic queued
    // behind the migration's lock waits no longer than that.
    let ms = timeout.as_millis().max(1);
    let limit = format!("SET LOCAL statement_timeout = {ms}; SET LOCAL lock_timeout = {ms}");
    conn.execute(limit.as_str()).await?;
    let lock_name = format!("idem-postgres schema {prefix}");
    sqlx::query("SELECT pg_advisory_xact_lock(hashtext($1))")
        .bind(lock_name)
        .execute(&mut *conn)
        .await?;
    let table = format!("{prefix}schema_version");
    let exists: bool = sqlx::query("SELECT to_regclass($1) IS NOT NULL")
        .bind(table)
        .fetch_one(&mut *conn)
        .await?
        .try_get(0)?;
    if !exists && !manage {
        return Err(SchemaError::Version(format!(
            "no idempotency schema with the prefix {prefix:?} in this database \
             ({prefix}schema_version does not exist); check the URL and the table prefix \
             (this connection does not create one)"
        )));
    }
    if !exists {
        conn.execute(full_schema(prefix).as_str()).await?;
        tracing::info!(target: "idem_postgres", prefix, version = SCHEMA_VERSION, "created the idempotency schema");
        return Ok(());
    }
    let read = format!("SELECT version FROM {prefix}schema_version");
    let version: Option<i32> = match sqlx::query(&read).fetch_optional(&mut *conn).await? {
        Some(row) => Some(row.try_get(0)?),
        None => None,
    };
    match version {
        Some(SCHEMA_VERSION) => Ok(()),
        Some(v) if v > SCHEMA_VERSION => Err(SchemaError::Version(format!(
            "{prefix}schema_version is {v}, newer than this idem-postgres knows \
             ({SCHEMA_VERSION}): a newer release migrated this database; upgrade \
             idem-postgres (older releases cannot use it)"
        ))),
        Some(v) if v >= 1 && !manage => Err(SchemaError::Version(format!(
            "{prefix}schema_version is {v}, older than this idem-postgres's \
             ({SCHEMA_VERSION}); this connection does not migrate: a server of this release \
             migrates it when it starts"
        ))),
        Some(v) if v >= 1 => migrate(conn, prefix, v).await,
        Some(v) => Err(SchemaError::Version(format!(
            "{prefix}schema_version is {v}, which no idem-postgres release wrote"
        ))),
        None => Err(SchemaError::Version(format!(
            "{prefix}schema_version has no row: the schema is incomplete"
        ))),
    }
}

/// Runs the migration steps from `from` to [`SCHEMA_VERSION`], in the caller's
/// transaction: all of them or none.
async fn migrate(conn: &mut PgConnection, prefix: &str, from: i32) -> Result<(), SchemaError> {
    for to in from + 1..=SCHEMA_VERSION {
        let step = MIGRATIONS[(to - 2) as usize];
        if let Err(e) = conn.execute(render(step, prefix).as_str()).await {
            return Err(SchemaError::Version(format!(
                "migrating {prefix}records from schema version {} to {to} failed (nothing \
                 was changed; it needs the tables' owner, and takes a short exclusive lock \
                 on {prefix}records, waited for up to the connect timeout): {e}",
                to - 1
            )));
        }
        tracing::info!(target: "idem_postgres", prefix, from = to - 1, to, "migrated the idempotency schema");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixes_are_plain_lower_case_identifiers() {
        for ok in ["idem_", "shop_idem_", "x", "_a1"] {
            assert!(valid_prefix(ok), "{ok}");
        }
        let long = "a".repeat(MAX_PREFIX_LEN + 1);
        for bad in [
            "",
            "Idem_",
            "1idem",
            "idem-",
            "idem\"",
            "a b",
            "é",
            long.as_str(),
        ] {
            assert!(!valid_prefix(bad), "{bad}");
        }
    }

    #[test]
    fn rendering_replaces_every_name() {
        let sql = full_schema("shop_x_");
        assert!(!sql.contains("idem_"), "{sql}");
        assert!(sql.contains("CREATE INDEX IF NOT EXISTS shop_x_records_in_flight"));
        assert!(sql.contains("CREATE TABLE shop_x_records"));
        assert!(sql.contains("pg_notify('shop_x_done'"));
        let q = Queries::new("shop_x_");
        for s in [
            &q.claim,
            &q.renew,
            &q.complete,
            &q.release,
            &q.watch,
            &q.peek,
            &q.get,
        ] {
            assert!(s.contains("shop_x_") && !s.contains("idem_"), "{s}");
        }
        assert_eq!(q.channel, "shop_x_done");
    }
}
