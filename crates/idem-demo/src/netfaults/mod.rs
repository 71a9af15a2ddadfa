//! Real network faults: a TCP proxy on 127.0.0.1 between the demo's client and each
//! instance, and between each instance and its store, that partitions, delays, resets,
//! stops reading and drips, on a seeded schedule.
//!
//! Unlike the in-process [`crate::faults`] (which fails gRPC calls), these faults act on
//! the bytes of real connections: a store that stops answering without closing its
//! connection, a reset in the middle of a response, a peer that stops reading.
//!
//! ```no_run
//! # async fn demo(redis: std::net::SocketAddr) -> std::io::Result<()> {
//! use std::sync::Arc;
//! use std::time::Duration;
//! use idem_demo::netfaults::{Direction, FaultDriver, FaultProxy, NetFault, ScheduleSpec};
//!
//! let proxy = Arc::new(FaultProxy::start(redis).await?);
//! // Explicit control...
//! proxy.set(Some(NetFault::Partition(Direction::Both)));
//! proxy.heal();
//! // ...or a seeded schedule, each fault printed as it is applied.
//! let spec = ScheduleSpec::new(7, Duration::from_millis(100)..Duration::from_secs(2));
//! let driver = FaultDriver::start(&spec, vec![("store".into(), proxy.clone())], true);
//! // ... run the workload against proxy.addr() ...
//! println!("{}", driver.stop()); // "12 network faults: 3 partitions, …"
//! # Ok(())
//! # }
//! ```
//!
//! - [`proxy`]: the proxy ([`FaultProxy`]) and its faults ([`NetFault`]);
//! - [`rig`]: the proxies of one demo run ([`Rig`]);
//! - [`cluster`]: a private Redis Cluster reached only through one proxy per node
//!   ([`ProxiedCluster`]);
//! - [`schedule`]: the seeded schedule ([`steps`], [`FaultDriver`]) and the counts by
//!   kind ([`FaultCounts`]).

pub mod cluster;
pub mod proxy;
pub mod rig;
pub mod schedule;

pub use cluster::ProxiedCluster;
pub use proxy::{Direction, FaultProxy, NetFault, ProxyStats};
pub use rig::Rig;
pub use schedule::{FaultCounts, FaultDriver, ScheduleSpec, Step, steps};

#[cfg(test)]
mod tests;
