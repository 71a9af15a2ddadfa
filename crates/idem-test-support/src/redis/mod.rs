//! Test harness: a private `redis-server` on a free 127.0.0.1 port, killed on drop.
//!
//! `RedisServer::start()` returns `None` when no `redis-server` binary is found (looked
//! up as `$REDIS_SERVER`, then on `PATH`, then `/usr/bin` and `/usr/local/bin`): the
//! test prints why and returns. When the `CI` environment variable is set, a missing
//! binary panics instead, so CI never skips silently (`.ci/run` installs
//! `redis-server` with apt-get when it is missing).
//!
//! It also has a tiny blocking RESP client (`RedisServer::cmd`) so tests can read
//! `INFO commandstats` or plant records without another dependency.
//!
//! `RedisCluster` is a private Redis Cluster: six `redis-server`s in cluster mode (three
//! masters, one replica each) on free ports, joined with `redis-cli --cluster create`,
//! with a short `cluster-node-timeout` (1 s) so a failover takes seconds. Tests can
//! SIGKILL a master, restart it, and move slots (`redis-cli --cluster reshard`).
//! `RedisCluster::shared()` is one cluster per test process for tests that only need
//! distinct key prefixes; a watchdog process kills every node when the test process
//! exits (statics are never dropped).

mod cluster;
mod reply;

use std::collections::HashMap;
use std::io::BufReader;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub use cluster::{ClusterNode, RedisCluster};
pub use reply::RedisReply;

use crate::launch::{self, NotReady};
use reply::round_trip;

/// A private `redis-server` on a free 127.0.0.1 port, killed on drop.
pub struct RedisServer {
    binary: PathBuf,
    port: u16,
    dir: PathBuf,
    child: Option<Child>,
    /// Arguments after the standard ones (cluster mode).
    extra: Vec<String>,
}

/// `redis-server` or `redis-cli` (`name`, or `$env`), or `None` after saying why the
/// Redis tests skip (a panic under `CI`).
fn require_tool(name: &str, env: &str) -> Option<std::path::PathBuf> {
    let install = format!(
        "set {env}, or install it: apt-get install -y redis-server, which brings redis-cli"
    );
    launch::required(launch::find_tool(name, env), name, &install, "Redis")
}

impl RedisServer {
    /// Starts a server, or returns `None` (outside CI only) when `redis-server` is
    /// missing. Panics when it cannot start.
    pub fn start() -> Option<RedisServer> {
        Self::start_with(&[])
    }

    /// A replica of `master` (`--replicaof`), once the master counts its acknowledgements
    /// (`WAIT 1` answers 1); `None` as for
    /// [`start`](Self::start).
    pub fn start_replica_of(master: &RedisServer) -> Option<RedisServer> {
        // The master syncs a new replica at once, not after its default 5 s delay.
        master
            .cmd(&["CONFIG", "SET", "repl-diskless-sync-delay", "0"])
            .expect("CONFIG SET on the master");
        let port = master.port.to_string();
        let replica = Self::start_with(&["--replicaof", "127.0.0.1", &port])?;
        let started = Instant::now();
        // Polls `ready` until it holds; after 20 s (from the start), panics: the replica
        // never `did` something to the master.
        let wait = |did: &str, ready: &dyn Fn() -> bool| {
            while !ready() {
                assert!(
                    started.elapsed() < Duration::from_secs(20),
                    "the replica on {} never {did} {}",
                    replica.port,
                    master.port
                );
                std::thread::sleep(Duration::from_millis(20));
            }
        };
        wait("synced with", &|| {
            replica
                .cmd(&["INFO", "replication"])
                .is_ok_and(|r| r.text().contains("master_link_status:up"))
        });
        // The replica's side of the link comes up before the master counts it as online
        // and acknowledging: until then `WAIT` answers 0. Wait until a write is
        // acknowledged (then the key is removed, replicated too).
        wait("acknowledged a write to", &|| {
            master.cmd(&["SET", "idem-test:replica-sync", "1"]).is_ok()
                && matches!(master.cmd(&["WAIT", "1", "500"]), Ok(RedisReply::Int(n)) if n >= 1)
        });
        let _ = master.cmd(&["DEL", "idem-test:replica-sync"]);
        Some(replica)
    }

    /// Starts a server with `extra` arguments after the standard ones.
    pub fn start_with(extra: &[&str]) -> Option<RedisServer> {
        let binary = require_tool("redis-server", "REDIS_SERVER")?;
        let dir = launch::scratch_dir("idem-redis-test");
        // A free port can be taken between our probe and redis binding it: try a few.
        for _ in 0..5 {
            let mut server = RedisServer {
                binary: binary.clone(),
                port: crate::net::free_port(),
                dir: dir.clone(),
                child: None,
                extra: extra.iter().map(|a| (*a).to_owned()).collect(),
            };
            if server.spawn().is_ok() {
                return Some(server);
            }
        }
        panic!("redis-server ({}) did not start", binary.display());
    }

    fn spawn(&mut self) -> Result<(), String> {
        std::fs::create_dir_all(&self.dir)
            .map_err(|e| format!("create {}: {e}", self.dir.display()))?;
        let mut child = Command::new(&self.binary)
            .arg("--port")
            .arg(self.port.to_string())
            .args(["--bind", "127.0.0.1"])
            .args(["--save", ""])
            .args(["--appendonly", "no"])
            .args(["--daemonize", "no"])
            .arg("--dir")
            .arg(&self.dir)
            .arg("--pidfile")
            .arg(self.dir.join("redis.pid"))
            .args(&self.extra)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("spawn {}: {e}", self.binary.display()))?;
        let pong = || matches!(self.cmd(&["PING"]), Ok(RedisReply::Simple(ref s)) if s == "PONG");
        let limit = Duration::from_secs(10);
        let waited = launch::wait_ready(&mut child, limit, Duration::from_millis(10), pong);
        match waited {
            Ok(()) => {
                self.child = Some(child);
                Ok(())
            }
            Err(NotReady::Exited(status)) => Err(format!("redis-server exited: {status}")),
            Err(NotReady::TimedOut) => {
                self.child = Some(child);
                self.stop();
                Err("redis-server did not answer PING within 10s".into())
            }
        }
    }

    /// The port it listens on (127.0.0.1).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `redis://127.0.0.1:<port>/0`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }

    /// Kills the server (SIGKILL, like a crash) and waits for it to exit.
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts the server again on the same port (empty: persistence is off).
    pub fn restart(&mut self) {
        self.stop();
        let port = self.port;
        launch::respawn("redis-server", port, Duration::from_secs(10), || {
            self.spawn()
        });
    }

    /// `CONFIG SET name value`; panics when the server refuses.
    pub fn config_set(&self, name: &str, value: &str) {
        self.cmd(&["CONFIG", "SET", name, value])
            .unwrap_or_else(|e| panic!("CONFIG SET {name} {value}: {e}"));
    }

    /// The time to live of `key` in milliseconds (`PTTL`: -1 without one, -2 without the
    /// key).
    pub fn pttl(&self, key: &str) -> i64 {
        self.cmd(&["PTTL", key]).unwrap().text().parse().unwrap()
    }

    /// Sends one command on a fresh connection and reads its reply.
    pub fn cmd(&self, args: &[&str]) -> Result<RedisReply, String> {
        self.cmd_bytes(&args.iter().map(|a| a.as_bytes()).collect::<Vec<_>>())
    }

    /// [`cmd`](Self::cmd) with binary arguments.
    pub fn cmd_bytes(&self, args: &[&[u8]]) -> Result<RedisReply, String> {
        let s = reply::connect(self.port)?;
        round_trip(&mut &s, &mut BufReader::new(&s), args)
    }

    /// `INFO commandstats` as command name (lower case) → calls.
    pub fn command_calls(&self) -> HashMap<String, u64> {
        let info = self
            .cmd(&["INFO", "commandstats"])
            .expect("INFO commandstats")
            .text();
        info.lines()
            .filter_map(|l| {
                let rest = l.strip_prefix("cmdstat_")?;
                let (name, stats) = rest.split_once(':')?;
                let calls = stats
                    .split(',')
                    .find_map(|kv| kv.strip_prefix("calls="))?
                    .parse()
                    .ok()?;
                Some((name.to_owned(), calls))
            })
            .collect()
    }

    /// Commands clients sent (round trips), from `INFO commandstats`. Redis also counts
    /// the commands a Lua script calls, so those (the idem scripts call only `TIME`,
    /// `HMGET`, `HSET`, `HDEL`, `PEXPIRE`, `PTTL`, `PUBLISH`, and for the tenant quotas
    /// `ZADD`, `ZREM`, `ZCARD`, `ZSCORE`, `ZREMRANGEBYSCORE`, `ZRANGEBYSCORE`, `HGET`,
    /// `HINCRBY`) are left out, and so are
    /// the harness's own (`INFO`, `CONFIG`, `PING`) and connection set-up (`CLIENT`,
    /// `HELLO`).
    pub fn round_trips(&self) -> u64 {
        const NOT_ROUND_TRIPS: &[&str] = &[
            "time",
            "hmget",
            "hset",
            "hdel",
            "pexpire",
            "pttl",
            "publish",
            "zadd",
            "zrem",
            "zcard",
            "zscore",
            "zremrangebyscore",
            "zrangebyscore",
            "hget",
            "hincrby",
            "info",
            "ping",
            "hello",
        ];
        self.command_calls()
            .into_iter()
            .filter(|(n, _)| {
                !NOT_ROUND_TRIPS.contains(&n.as_str())
                    && !n.starts_with("config")
                    && !n.starts_with("client")
            })
            .map(|(_, c)| c)
            .sum()
    }

    /// Zeroes `INFO commandstats` (`CONFIG RESETSTAT`).
    pub fn reset_stats(&self) {
        self.cmd(&["CONFIG", "RESETSTAT"])
            .expect("CONFIG RESETSTAT");
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
