//! The idem demo application, shared by the `demo` binary (`cargo run --release -p
//! idem-demo`) and the workspace's end-to-end tests (chaos, crashes, `--metrics-out`):
//! not published.
//!
//! - [`options`]: what a run is asked for ([`Options`], the demo's [`DEFAULT_CONFIG`])
//!   and what it reports ([`RunReport`]);
//! - [`orders`]: the `shop.v1.Orders` service with a [`Ledger`](orders::Ledger) of
//!   orders per intent, and `pg_orders` (feature `postgres`), the same on PostgreSQL;
//! - [`faults`]: the seeded fault injector in front of every server instance;
//! - [`fleet`]: one run with every instance in this process ([`run`]), on a
//!   [`DemoStore`];
//! - [`workload`]: the intents fired at the instances, and the tally;
//! - [`outage`]: `--outage-after N --outage-for SECONDS`, every instance down for a while;
//! - [`crash`]: one run with instance processes killed with SIGKILL;
//! - [`metrics`]: `--metrics-out`, both layers' metrics as a Prometheus exposition;
//! - [`netfaults`]: `--net-faults`, a TCP fault proxy in front of instances and stores;
//! - [`history`]: the checker of every intent's attempts and the orders they made.
//!
//! Features: `redis` (`--store redis|redis-cluster`) and `postgres` (`--store
//! postgres`); without them the demo builds no Redis client, sqlx or PostgreSQL code.
//!
//! ```no_run
//! # async fn demo() -> Result<(), idem_demo::BoxError> {
//! use idem_core::config::ServiceConfig;
//! use idem_demo::{DEFAULT_CONFIG, DemoStore, Options, run};
//!
//! let config = ServiceConfig::from_json(DEFAULT_CONFIG)?;
//! let store = DemoStore::Memory(Default::default());
//! let report = run(&Options::default(), true, &config, &store).await?;
//! assert_eq!(report.duplicates, 0);
//! # Ok(())
//! # }
//! ```

pub mod cli;
pub mod crash;
pub mod faults;
pub mod fleet;
pub mod history;
pub mod metrics;
pub mod netfaults;
pub mod options;
pub mod orders;
pub mod outage;
#[cfg(feature = "postgres")]
pub mod pg_orders;
pub mod store;
pub mod workload;

pub use fleet::run;
pub use options::{DEFAULT_CONFIG, Options, RunReport};
pub use store::DemoStore;

/// The error of a run: whatever went wrong, boxed.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
