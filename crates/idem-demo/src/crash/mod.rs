//! The demo with real crashes: each server instance is a separate OS process, killed with
//! SIGKILL every N intents and started again on the same port, while the workload runs.
//!
//! Orders survive the crash of the process that created it: with the memory and Redis
//! stores they are appended to a ledger file (one `write` per order); with the
//! PostgreSQL store they are rows of a table, written in the same transaction as the
//! record's completion ([`crate::pg_orders`]). They are counted at the end. What a crash
//! costs depends on where the records live: a process's memory store dies with it;
//! Redis keeps them, but a process killed after the handler ran and before the outcome
//! was recorded leaves the record in flight until its lease ends, and the retry then
//! runs the handler again; PostgreSQL commits the order and the record together.
//!
//! An instance process is started through a [`Launch`]: the demo binary with
//! [`SERVE_FLAG`] and the arguments of [`ServeArgs::to_args`], or a test binary running
//! one test that calls [`serve_from_env`]. A [`PausePoint`] makes an instance stop
//! inside its first `CreateOrder` and say so on standard output, so a test can kill it
//! exactly there.
//!
//! - [`args`]: what an instance process is told ([`ServeArgs`]) and where it may pause;
//! - [`serve`](mod@serve): the instance process's side: it serves until it is killed;
//! - [`process`]: the demo's side of one process ([`Launch`], [`Instance`]);
//! - [`run`]: one run with instances killed every N intents ([`run_with_crashes`]);
//! - [`rolling`]: one run with a rolling restart every N intents: SIGTERM, drain, exit,
//!   start again, one instance at a time ([`run_rolling`]).

pub mod args;
pub mod process;
pub mod rolling;
pub mod run;
pub mod serve;

pub use args::{Pause, PausePoint, SERVE_ENV, SERVE_FLAG, ServeArgs, StoreKind};
pub use process::{Instance, Launch};
pub use rolling::run_rolling;
pub use run::run_with_crashes;
pub use serve::{serve, serve_from_env};
