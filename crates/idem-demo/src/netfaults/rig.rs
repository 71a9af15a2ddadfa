//! The proxies of one demo run: one in front of each instance (the client's way in) and
//! one between each instance and its store, named for the printed schedule.

use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::Arc;

use super::proxy::FaultProxy;
use super::schedule::{FaultDriver, ScheduleSpec};
use crate::BoxError;

/// The proxies of a run, started one by one, then driven together.
#[derive(Debug, Default)]
pub struct Rig {
    proxies: Vec<(String, Arc<FaultProxy>)>,
}

impl Rig {
    /// A proxy named `name` in front of `upstream`; returns where to connect instead.
    pub async fn front(
        &mut self,
        name: impl Into<String>,
        upstream: SocketAddr,
    ) -> std::io::Result<SocketAddr> {
        let proxy = Arc::new(FaultProxy::start(upstream).await?);
        let addr = proxy.addr();
        self.proxies.push((name.into(), proxy));
        Ok(addr)
    }

    /// A proxy named `name` in front of the server of `url` (`scheme://[user@]host:port…`);
    /// returns the same URL through the proxy.
    pub async fn front_url(
        &mut self,
        name: impl Into<String>,
        url: &str,
    ) -> Result<String, BoxError> {
        let (head, authority, tail) = split_url(url)?;
        let upstream = authority
            .to_socket_addrs()?
            .find(SocketAddr::is_ipv4)
            .ok_or_else(|| format!("{url}: no IPv4 address"))?;
        let addr = self.front(name, upstream).await?;
        Ok(format!("{head}{addr}{tail}"))
    }

    /// Drives `proxies` too (started elsewhere, e.g. shared by every instance: the
    /// proxies of a Redis Cluster's nodes), under their names.
    pub fn adopt(&mut self, proxies: &[(String, Arc<FaultProxy>)]) {
        self.proxies.extend(proxies.iter().cloned());
    }

    /// Runs every proxy's seeded schedule until [`FaultDriver::stop`].
    pub fn drive(&self, spec: &ScheduleSpec, print: bool) -> FaultDriver {
        FaultDriver::start(spec, self.proxies.clone(), print)
    }
}

/// `scheme://user@`, `host:port`, and the rest of `url`.
fn split_url(url: &str) -> Result<(&str, &str, &str), BoxError> {
    let bad = || format!("{url}: expected scheme://[user@]host:port[/…]");
    let start = url.find("://").ok_or_else(bad)? + 3;
    let rest = &url[start..];
    let end = rest.find(['/', '?']).unwrap_or(rest.len());
    let authority_start = rest[..end].rfind('@').map_or(0, |at| at + 1);
    let authority = &rest[authority_start..end];
    if !authority.contains(':') {
        return Err(bad().into());
    }
    let head = &url[..start + authority_start];
    Ok((head, authority, &rest[end..]))
}

#[cfg(test)]
mod tests {
    use super::split_url;

    #[test]
    fn splits_redis_and_postgres_urls() {
        assert_eq!(
            split_url("redis://127.0.0.1:6379").unwrap(),
            ("redis://", "127.0.0.1:6379", "")
        );
        assert_eq!(
            split_url("postgres://idem@127.0.0.1:5432/postgres").unwrap(),
            ("postgres://idem@", "127.0.0.1:5432", "/postgres")
        );
        assert!(split_url("redis://localhost").is_err());
    }
}
