//! A PostgreSQL-backed idempotency [`Store`](idem_store::Store) for `idem-server`, so
//! several instances of a service act as one, keeping their records in the database the
//! service already runs.
//!
//! # When to use it
//! The in-memory store (`idem_store::memory::MemoryStore`) is right when one process serves a
//! method. As soon as a service runs as two or more instances, a retry can land on
//! another instance than its first attempt; point every instance at one shared store so
//! a key runs once across all of them. Use [`PostgresStore`] when the service has a
//! PostgreSQL database anyway (no Redis to run, records backed up with the data), and
//! `idem-redis` when it has Redis. Records live in one table; each operation is one
//! statement.
//!
//! # Setup
//! ```no_run
//! # async fn f() -> Result<(), idem_postgres::ConnectError> {
//! use idem_postgres::PostgresStore;
//! // Defaults: table prefix "idem_", statement timeout 500 ms, connect timeout 2 s,
//! // a pool of 10 connections (plus one listener connection once something waits).
//! let store = PostgresStore::connect("postgres://app@db:5432/shop").await?;
//! // Then hand `store` to the server layer in place of the memory store.
//! # let _ = store; Ok(()) }
//! ```
//! All settings, with their defaults: [`PostgresStoreBuilder`]. TLS: the store uses
//! sqlx 0.8 without a TLS backend of its own; enable one (`tls-rustls`,
//! `tls-native-tls`) on your own `sqlx = "0.8"` dependency and cargo gives it to the
//! store too, then ask for it in the URL (`?sslmode=require`).
//!
//! # What it needs from PostgreSQL
//! - **Version**: tested with PostgreSQL 15; it uses nothing newer than PostgreSQL 10
//!   (PL/pgSQL, `ON CONFLICT`, `FOR UPDATE SKIP LOCKED`, `LISTEN`/`NOTIFY`).
//! - **Privileges**: the first start creates the schema below, which needs `CREATE` on
//!   the first schema of the role's `search_path` (PostgreSQL 15 no longer grants that on
//!   `public` to everyone). Or create it yourself from [`schema_sql`] (as a migration, or
//!   once as an owner role); the store then only checks its version, and the role it
//!   connects as needs (and migrations need the owner, see "Schema versions and
//!   migration"): `SELECT` on `idem_schema_version`; `SELECT, INSERT, UPDATE,
//!   DELETE` on `idem_records`; `USAGE` on the sequence `idem_fence`; `EXECUTE` on the
//!   functions (PostgreSQL grants that to everyone by default). `LISTEN` and `NOTIFY`
//!   need no privilege. (Test `a_role_without_create_privilege_uses_an_existing_schema`
//!   checks exactly this list.)
//! - **Poolers**: a session-level connection. PgBouncer in transaction mode passes
//!   neither `LISTEN` (use [`WaitStrategy::Poll`]) nor, before 1.21, prepared statements.
//! - **Durability** is the database's: with `synchronous_commit = off` a crash can lose
//!   the last records written, as it can lose the service's own rows; an asynchronous
//!   replica promoted after a failover can lack the latest ones.
//!
//! # Schema
//! Created by the first [`connect`](PostgresStoreBuilder::connect) in one transaction,
//! under an advisory lock so instances starting together create it once; later starts
//! read `idem_schema_version`, migrate an older version (below) and refuse a newer one
//! ([`ConnectError::Schema`]: "… is 3, newer than this idem-postgres knows (2) …
//! upgrade idem-postgres"). Every name carries the
//! [table prefix](PostgresStoreBuilder::table_prefix) (`idem_` below; [`schema_sql`]
//! renders it for another prefix). Unqualified, so the names land in the first schema
//! of the `search_path` (set one per service with `?options=-csearch_path%3Dmyschema`).
//!
//! The current version is [`SCHEMA_VERSION`], 2. A new database gets version 1, then
//! each migration step, so new and migrated databases are the same. Version 1:
//!
//! ```sql
#![doc = include_str!("schema.sql")]
//! ```
//!
//! ## Schema versions and migration
//! A start that finds an older version migrates it, in the same transaction and under
//! the same advisory lock as creating it: instances starting together migrate once (the
//! others wait for the lock, then find it current), and a step that fails changes
//! nothing (all steps or none) and is a [`ConnectError::Schema`] saying why. Every step
//! may run again. Rows written under version 1 are read as before; the times they lack
//! read as unknown (`None`). Version 1's functions keep their signatures, so instances of
//! the previous release still running go on working (without the tenant bound) until
//! they restart; a previous release cannot *start* against a migrated database (it
//! refuses the newer version), so roll back by restoring, not by restarting old code.
//!
//! - **Who may migrate**: the owner of the tables (`ALTER TABLE`, `CREATE INDEX`,
//!   `CREATE OR REPLACE FUNCTION`). A role with only the privileges below gets
//!   "migrating idem_records from schema version 1 to 2 failed (… it needs the tables'
//!   owner …)"; run the step as the owner first ([`migration_sql`] gives its SQL) and
//!   the application then finds the schema current.
//! - **Locks**: adding the two columns is a catalogue change (no rewrite) but takes a
//!   short exclusive lock on `idem_records`, and building the index locks out writes
//!   while it reads the table. The step waits for its locks at most the
//!   [connect timeout](PostgresStoreBuilder::connect_timeout) (`lock_timeout`, and the
//!   same `statement_timeout`), so live traffic queued behind it waits no longer. For a
//!   large table, create the index beforehand with `CREATE INDEX CONCURRENTLY
//!   idem_records_in_flight ON idem_records (tenant, lease_until) WHERE state IN ('i',
//!   'p')`: the step then skips it.
//!
//! Version 2 (`schema_v2.sql`, the step from version 1):
//!
//! ```sql
#![doc = include_str!("schema_v2.sql")]
//! ```
//!
//! # Record times
//! `created_at` is set by the claim that starts a run (a new record, or a new run of an
//! expired or released one; a takeover keeps it) and `completed_at` by the completion
//! (`complete`, `complete_in`, or a release after the handler's writes committed), both
//! from `clock_timestamp()` on the database server, to the microsecond.
//! [`Store::read_record`](idem_store::Store::read_record) returns them (`idem records
//! show --postgres` prints them); rows written under schema 1 have neither.
//!
//! # Per-tenant in-flight bound
//! [`max_in_flight_per_tenant`](PostgresStoreBuilder::max_in_flight_per_tenant) (1000
//! by default, as the Redis store's `maxInFlightPerTenant`; `None`: no bound) bounds the
//! in-flight records one tenant holds across every instance sharing the database. A
//! claim that would start a run (a new record, a new run of an expired or released one,
//! or a takeover of a lease that ended) past it is refused with `StoreError::Full`,
//! which the layer answers with RESOURCE_EXHAUSTED and a retry delay; nothing is written
//! and nothing runs. Replays, in-flight duplicates, mismatches and the same claimant's
//! re-claims are answered at any count. A record counts while its lease is live: an
//! instance that crashed holds its tenant's share until its leases end, not for the
//! tombstone TTL.
//!
//! - **Exact across instances**: inside `idem_claim`, such a claim takes its tenant's
//!   advisory transaction lock (`pg_advisory_xact_lock`, keyed by the table prefix and
//!   the tenant digest) before counting, and holds it until its statement commits, so two
//!   claims of one tenant never both count below the bound and both insert (test
//!   `racing_claims_on_three_instances_never_pass_the_bound`, which fails without the
//!   lock). Under READ COMMITTED (PostgreSQL's default) each statement of the function
//!   reads anew, so the count sees every claim committed before the lock was granted.
//!   With `default_transaction_isolation` set to `repeatable read` the count could miss
//!   a racing claim; at `serializable` PostgreSQL aborts one of two racing claims
//!   (UNAVAILABLE, retried).
//! - **Cost**: the count reads the partial index `idem_records_in_flight (tenant,
//!   lease_until) WHERE state IN ('i', 'p')`, at most `bound` entries; the lock
//!   serialises the fresh claims of one tenant (not its replays, and not other tenants),
//!   for the length of one claim. Still one statement per claim. A single-tenant
//!   service at high rates may prefer `None`.
//! - A rare lock-order cycle (two claims of one scope, one holding the tenant lock and
//!   the other the row, when the record expired in between) is broken by PostgreSQL's
//!   deadlock detection: one claim fails (UNAVAILABLE, retried), never a second run.
//!
//! # Operations and round trips
//! | call | statement | notes |
//! |------|-----------|-------|
//! | `claim` | `SELECT … FROM idem_claim(…)` | a replay gets the stored response in the same row; under the tenant bound, a claim that starts a run also takes the tenant's lock and counts (see "Per-tenant in-flight bound") |
//! | `renew` | `SELECT … FROM idem_renew(…)` | |
//! | `complete` | `SELECT … FROM idem_complete(…)` | notifies when someone waits |
//! | `release` | `SELECT … FROM idem_release(…)` | notifies when someone waits |
//! | `complete_in` | `SELECT … FROM idem_complete(…)` | in the handler's transaction ([`RecordTx::commit_reply`]); see below |
//! | `commit_in` | `SELECT … FROM idem_commit(…)` | in the handler's transaction ([`RecordTx::commit`]); see below |
//! | `get` | one `SELECT` on `idem_records` | |
//! | `wait` | `idem_watch(…)`, then a plain `SELECT` per wake-up | see "Waiting" |
//!
//! A fresh protected call is 2 statements (claim, complete) and a replay 1 (claim),
//! counted with `pg_stat_statements` by the test
//! `a_fresh_call_is_two_statements_and_a_replay_one`. Each is one network round trip
//! on a warm connection: sqlx prepares a statement the first time a pooled connection
//! runs it (one more round trip, once per connection and statement), and tests a
//! connection when it goes back to the pool (a protocol `Sync`, after the call has its
//! answer). The layer renews the lease every `leaseTtl / 3` while a handler runs, one
//! statement each.
//!
//! # Decisions
//! - **Fences** come from one sequence, `idem_fence`, for every scope, so they grow across
//!   release, takeover and expiry without depending on the row: a record created after an
//!   earlier one of the same scope expired and was deleted still gets a higher fence, and a
//!   claimant paused past the record TTL cannot complete its successor's run. The
//!   sequence starts at the database clock in microseconds when the schema is created
//!   (about 1.7e15 today, as the Redis store's first fences), so even a schema dropped and
//!   created again hands out fences above the old ones: the sequence advances once per
//!   claim, far slower than a million a second, and never catches up with the clock.
//!   Sequences never go back, also not on a crash (they log ahead).
//! - **Leases** are judged with `clock_timestamp()` on the database server, read after the
//!   row lock is taken, so instances with skewed clocks agree on who holds a lease and a
//!   claim that waited for a lock does not judge with a stale time.
//! - **Atomicity**: each function locks the record's row (`SELECT … FOR UPDATE`); a claim
//!   of a scope with no row inserts with `ON CONFLICT DO NOTHING` and, when a concurrent
//!   claim won, answers from the winner's row. Same-claimant re-claims extend the lease
//!   (never shorten it); renew after the lease ran out still succeeds while nobody took
//!   over; a different fingerprint is a mismatch whatever the lease.
//! - **Expiry**: completed records expire after the TTL given to `complete`; in-flight
//!   records whose lease ended, after the
//!   [tombstone TTL](PostgresStoreBuilder::tombstone_ttl) (24 h); a released record is
//!   deleted at once (fences come from one sequence, so none is needed for them). An expired row counts
//!   as absent to every function at once; a background task deletes them every
//!   [sweep interval](PostgresStoreBuilder::sweep_interval) (60 s), at most 1000 per
//!   `DELETE`, skipping rows others have locked, again after 50 ms while batches come back
//!   full. The task holds only a `Weak` reference and stops with the last clone of the
//!   store.
//! - **Tenants**: the tenant digest is stored with each record; each tenant's in-flight
//!   records are bounded (see "Per-tenant in-flight bound"); completed records are not
//!   bounded per tenant: size the database.
//!
//! # Waiting
//! [`wait`](idem_store::Store::wait) registers the waiter in memory, then calls
//! `idem_watch`, which marks the in-flight record as watched and reads it.
//! `idem_complete` and `idem_release` send `NOTIFY idem_done, '<scope hex>'` only for
//! watched records: PostgreSQL serialises the commits of notifying transactions, so the
//! store notifies only where someone listens. Each store opens one dedicated listener
//! connection (outside the pool, on the first wait) that `LISTEN`s on `idem_done` and
//! wakes the waiters of the scope named in each notification; waiters add no round trip
//! of their own. While it listens, a waiter also reads the record every
//! [`NOTIFY_SAFETY_POLL`] (1 s), in case the connection hangs without failing, and
//! one millisecond past the lease end. If the listener connection is lost, every waiter
//! is woken, reads the record, and polls (5 ms doubling to 100 ms) until the listener is
//! back (it reconnects with backoff, 50 ms to 2 s). `wait` returns at `until` at the
//! latest: its reads are bounded by the time left, and a read cut short by `until` is
//! "look again", not an error. [`WaitStrategy::Poll`] skips the listener and only polls.
//!
//! # Errors and failure behaviour
//! - Every statement is bounded twice: on the client by
//!   [`statement_timeout`](PostgresStoreBuilder::statement_timeout) (taking a pooled
//!   connection included), and on the server by the same `statement_timeout`, set on
//!   every connection at start-up, so a statement the client gave up on does not hold
//!   row locks. Either one, a lost or refused connection, a server shutting down or in
//!   recovery, a missing schema or a serialisation failure is
//!   `StoreError::Unavailable`: the layer fails closed (UNAVAILABLE) and the client
//!   retries. A dead pooled connection fails one call and is closed; the pool connects
//!   anew, so calls succeed again once the database is back (test
//!   `a_database_that_goes_away_is_unavailable_then_recovers`).
//! - A record that does not hold what the schema promises (an unknown state or outcome
//!   kind, a fingerprint that is not 32 bytes, a fence below 1, a lease missing) is
//!   `StoreError::Corrupt`, whether the function finds it (SQLSTATE `IC001`) or the client
//!   does. Nothing the database returns can panic the store.
//!
//! # Transactional completion
//! Every store that keeps outcomes apart from the business data is a cache of outcomes:
//! a process killed after the handler's write committed and before the layer recorded
//! the outcome leaves the record in flight, the lease ends, and the retry runs the
//! handler again. With the records in the service's own database, the handler can
//! instead commit its writes **and the record's completion, with its reply,** in one
//! transaction, guarded by its fence. A crash at any point then leaves either nothing
//! done (the retry takes the record over and runs the handler) or everything done (the
//! retry replays the stored reply):
//!
//! ```no_run
//! use idem_postgres::{PostgresStore, TxError};
//! # mod shop { #[derive(Clone, PartialEq, prost::Message)] pub struct CreateOrderRequest { #[prost(string, tag = "1")] pub sku: String } #[derive(Clone, PartialEq, prost::Message)] pub struct Order { #[prost(int64, tag = "1")] pub id: i64 } }
//! use shop::{CreateOrderRequest, Order};
//! use sqlx::Row;
//! use tonic::{Request, Response, Status};
//!
//! struct Orders {
//!     store: PostgresStore, // a clone of the store given to the IdempotencyLayer
//! }
//!
//! impl Orders {
//!     async fn create_order(&self, request: Request<CreateOrderRequest>) -> Result<Response<Order>, Status> {
//!         // A transaction on the store's database, for this call's record.
//!         let mut tx = self.store.begin_for(&request).await?;
//!         let row = sqlx::query("INSERT INTO orders (sku) VALUES ($1) RETURNING id")
//!             .bind(&request.get_ref().sku)
//!             .fetch_one(&mut *tx)
//!             .await
//!             .map_err(TxError::from)?;
//!         let reply = Order { id: row.get(0) };
//!         // The reply goes into the record, under the fence, in the same COMMIT.
//!         // A run taken over meanwhile gets TxError::Fenced (rolled back) → ABORTED.
//!         tx.commit_reply(&reply).await?;
//!         Ok(Response::new(reply)) // exactly what was committed
//!     }
//! }
//! ```
//!
//! - **How it fits the layer**: `idem-server` puts the call's
//!   [`RecordRef`](idem_store::RecordRef) (scope, fence, TTLs) into the request
//!   extensions; [`PostgresStore::begin_for`] reads it and opens a transaction on the
//!   store's pool ([`begin_on`](PostgresStore::begin_on): on the service's own pool of the
//!   same database, for handlers whose statements need longer than the store's
//!   statement timeout). [`RecordTx::commit_reply`] runs `idem_complete` in the
//!   transaction (it locks the record's row, checks the fence, stores the reply), then
//!   `COMMIT`s, and marks the `RecordRef` completed: the layer, seeing the mark, does not
//!   record the outcome again. (Without the mark it would try, find the record
//!   completed under its own fence, and take that as done: never an overwrite.)
//! - **What is stored** is [`StoredResponse::unary_ok`](idem_store::response::StoredResponse::unary_ok)
//!   of the reply: byte for byte what the layer records for `Ok(Response::new(reply))`
//!   (test `the_reply_committed_with_the_order_is_replayed_byte_for_byte`). Return
//!   exactly that response. Replies with metadata: encode them yourself
//!   ([`RecordTx::commit_response`]); response compression is not reproduced (a replay
//!   is uncompressed, which every gRPC client reads).
//! - **Fences**: `idem_complete` holds the record's row lock until the `COMMIT`, so a
//!   takeover cannot slip in between the fence check and the commit: it waits, then
//!   sees the record completed. A stale run gets [`TxError::Fenced`], its writes are
//!   rolled back, and `tonic::Status::from` makes it ABORTED `LEASE_LOST` (see "What a
//!   caller sees when a transaction fails").
//! - **A `COMMIT` whose answer is lost** ([`TxError::CommitUnknown`] → UNAVAILABLE; a
//!   `COMMIT` the database refuses, as for a deferred constraint, rolled back and is
//!   [`TxError::Database`]): if
//!   it committed, the record holds the reply and the layer's release finds it completed
//!   under its fence and leaves it; if not, the record is released. The retry replays or
//!   runs once.
//! - **Streams** and other replies `commit_reply` cannot express: [`RecordTx::commit`]
//!   marks the record "writes committed" (state `'p'`) in the transaction and the layer
//!   stores the response after the handler returns. A crash between the two leaves a
//!   record that answers duplicates FAILED_PRECONDITION (`RESPONSE_NOT_RETAINED`): never
//!   a second run, but no replay. [`PostgresStore::commit_in`] is that step alone.
//! - **Writes elsewhere** (another database, a queue, a payment API) are not in the
//!   transaction. Calls to other idem-protected services made with a `RetryLayer` in the
//!   handler derive their keys from this record, so a run after a crash replays them
//!   (`idem_core::derive`); guard anything else with the fence
//!   ([`RecordRef::fence`](idem_store::RecordRef::fence)).
//! - **Cost**: a fresh call is one statement outside the handler's transaction (the
//!   claim) and one more inside it (`idem_complete`), instead of claim + complete; a
//!   replay is one (test `a_fresh_call_is_one_statement_outside_the_handlers_transaction`).
//! - **Tests**: `tests/transactional.rs` (crash before and after the handler's commit, a
//!   stale fence, a takeover waiting for the transaction, release after commit),
//!   `tests/record_tx.rs` (through a tonic server), `tests/tx_status.rs` (what callers
//!   see when the transaction fails), and the workspace's
//!   `tests/crash.rs`: server processes killed with SIGKILL before the write, inside the
//!   transaction while the lease is renewed, and after the commit before the reply, and
//!   2,000 intents through 9 SIGKILLs: one order per intent every time.
//!
//! # What a caller sees when a transaction fails
//! `tonic::Status::from(TxError)` (what `?` does in a handler returning `Status`) gives
//! the caller one fixed message per kind of failure, with a `google.rpc.ErrorInfo` of
//! domain `idem` and a reason from [`reason`]. The details (SQL state, constraint,
//! table, the driver's message, the fences) go to the log with `tracing`: WARN, ERROR
//! for INTERNAL. None of them reaches the caller: constraint and table names are the
//! schema's, not the API's, and fences come from one store-wide sequence, so they would
//! tell any caller how many calls every tenant made.
//!
//! | failure | code | reason | why this code |
//! |---|---|---|---|
//! | [`TxError::Fenced`]: another run took the record over | ABORTED | `LEASE_LOST` | a sequencer check failed (gRPC's own example for ABORTED); the other run holds the key now, so a retry with the same key waits for it and gets its outcome |
//! | serialization failure `40001`, deadlock `40P01`, lock not available `55P03` | ABORTED, retry delay [`CONFLICT_RETRY_DELAY`] | `TX_CONFLICT` | a transaction abort over concurrency (gRPC: ABORTED); the same request can succeed at once, so the delay is short |
//! | statement timeout (`57014`), a lost or refused connection (`08…`, I/O), too many connections or no memory (`53…`), shutdown or recovery (`57P…`), read-only after a failover (`25006`), no pooled connection in time; the store's own statement timing out | UNAVAILABLE | `STORE_UNAVAILABLE` | transient: nothing was committed and retrying the same call can succeed (gRPC: "retry just the failing call") |
//! | [`TxError::CommitUnknown`]: the `COMMIT` got no answer | UNAVAILABLE | `STORE_UNAVAILABLE` | the retry replays the reply if the commit landed, or runs once if not |
//! | integrity constraint violation (`23…`: unique, foreign key, not null, check, exclusion; also at `COMMIT` for a deferred one), `WITH CHECK OPTION` (`44000`) | FAILED_PRECONDITION | `CONSTRAINT_VIOLATED` | deterministic: the same request fails the same way until the data changes, so it must not be retried as is (clients warn about retrying FAILED_PRECONDITION) |
//! | data exception (`22…`: a value too long or out of range, invalid text, division by zero) | INVALID_ARGUMENT | `VALUE_REJECTED` | deterministic whatever the data stored: gRPC's INVALID_ARGUMENT |
//! | anything else: SQL the database cannot run (`42…`: syntax, undefined table, privilege), a statement in an aborted transaction (`25P02`), rows that do not decode, a corrupt record, [`TxError::NoRecord`] | INTERNAL | `TX_FAILED` | only the server can fix it |
//!
//! Every failure but `CommitUnknown` rolled the transaction back. With the default
//! `cacheableStatusCodes`, the layer releases the record for ABORTED, UNAVAILABLE,
//! FAILED_PRECONDITION and INVALID_ARGUMENT (nothing was committed: the key stays free,
//! and a corrected request with the same key runs) and records INTERNAL, as for any
//! handler. A deterministic failure is never UNAVAILABLE: clients retry UNAVAILABLE, and
//! would send it again for ever. A handler that wants another answer matches on the
//! `TxError` before converting it (its `Display` has the details, for its own logs).

mod builder;
mod error;
mod listen;
mod records;
mod schema;
mod store;
mod sweep;
mod tx;

pub use builder::{
    ConnectError, DEFAULT_CONNECT_TIMEOUT, DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_IN_FLIGHT_PER_TENANT, DEFAULT_POLL_MAX, DEFAULT_POLL_MIN,
    DEFAULT_STATEMENT_TIMEOUT, DEFAULT_SWEEP_BATCH, DEFAULT_SWEEP_INTERVAL, DEFAULT_TABLE_PREFIX,
    DEFAULT_TOMBSTONE_TTL, NOTIFY_SAFETY_POLL, PostgresStoreBuilder, WaitStrategy,
};
pub use schema::SCHEMA_VERSION;
/// The driver this store is built on, so a handler writes through the same `sqlx`.
pub use sqlx;
pub use store::PostgresStore;
pub use tx::{CONFLICT_RETRY_DELAY, RecordTx, TxError, reason};

/// The schema SQL of a new database for `prefix` (the schema in the crate docs, version
/// 1, then every migration up to [`SCHEMA_VERSION`], with every `idem_` replaced), for
/// creating it by hand or in a migration tool. `None` when `prefix` is not a valid table
/// prefix (see [`PostgresStoreBuilder::table_prefix`]).
pub fn schema_sql(prefix: &str) -> Option<String> {
    schema::valid_prefix(prefix).then(|| schema::full_schema(prefix))
}

/// The SQL that takes a schema of version `to - 1` to version `to` for `prefix` (see
/// "Schema versions and migration" in the crate docs), for running the migration by
/// hand or in a migration tool before the new release starts. `None` when `prefix` is
/// not valid or no such step exists (`to` is 2 to [`SCHEMA_VERSION`]).
pub fn migration_sql(prefix: &str, to: i32) -> Option<String> {
    let step = usize::try_from(to).ok()?.checked_sub(2)?;
    let sql = schema::MIGRATIONS.get(step)?;
    schema::valid_prefix(prefix).then(|| schema::render(sql, prefix))
}
