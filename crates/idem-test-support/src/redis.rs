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
#![allow(missing_docs)]

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// A reply of the tiny RESP client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resp {
    Simple(String),
    Error(String),
    Int(i64),
    Bulk(Option<Vec<u8>>),
    Array(Option<Vec<Resp>>),
}

impl Resp {
    pub fn text(&self) -> String {
        match self {
            Resp::Simple(s) | Resp::Error(s) => s.clone(),
            Resp::Int(i) => i.to_string(),
            Resp::Bulk(Some(b)) => String::from_utf8_lossy(b).into_owned(),
            Resp::Bulk(None) | Resp::Array(None) => String::new(),
            Resp::Array(Some(items)) => items.iter().map(Resp::text).collect::<Vec<_>>().join(" "),
        }
    }

    /// A bulk string reply as text, `None` for a nil one; panics with `what` and the
    /// reply on any other.
    pub fn bulk(self, what: &str) -> Option<String> {
        match self {
            Resp::Bulk(Some(b)) => Some(String::from_utf8_lossy(&b).into_owned()),
            Resp::Bulk(None) => None,
            other => panic!("{what}: {other:?}"),
        }
    }
}

pub struct RedisServer {
    binary: PathBuf,
    port: u16,
    dir: PathBuf,
    child: Option<Child>,
    /// Arguments after the standard ones (cluster mode).
    extra: Vec<String>,
}

fn find_binary() -> Option<PathBuf> {
    find_tool("redis-server", "REDIS_SERVER")
}

fn find_tool(name: &str, env: &str) -> Option<PathBuf> {
    if let Some(p) = std::env::var_os(env) {
        return Some(PathBuf::from(p));
    }
    let mut dirs: Vec<PathBuf> = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect())
        .unwrap_or_default();
    dirs.push("/usr/bin".into());
    dirs.push("/usr/local/bin".into());
    dirs.into_iter().map(|d| d.join(name)).find(|p| p.is_file())
}

/// `None` (a skip outside CI, a panic under CI) when `name` is not installed.
fn require_tool(name: &str, env: &str) -> Option<PathBuf> {
    let found = find_tool(name, env);
    if found.is_none() {
        if std::env::var_os("CI").is_some() {
            panic!(
                "{name} not found (CI is set): install it (apt-get install -y redis-server, \
                 which brings redis-cli) or set {env}; these tests must not be skipped in CI"
            );
        }
        eprintln!(
            "SKIPPED: {name} not found on PATH (set {env} or install redis-server); \
             the Redis tests did not run"
        );
    }
    found
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
                && matches!(master.cmd(&["WAIT", "1", "500"]), Ok(Resp::Int(n)) if n >= 1)
        });
        let _ = master.cmd(&["DEL", "idem-test:replica-sync"]);
        Some(replica)
    }

    /// Starts a server with `extra` arguments after the standard ones.
    pub fn start_with(extra: &[&str]) -> Option<RedisServer> {
        let Some(binary) = find_binary() else {
            if std::env::var_os("CI").is_some() {
                panic!(
                    "redis-server not found (CI is set): install it (apt-get install -y \
                     redis-server) or set REDIS_SERVER; these tests must not be skipped in CI"
                );
            }
            eprintln!(
                "SKIPPED: redis-server not found on PATH (set REDIS_SERVER or install \
                 redis-server); the Redis tests did not run"
            );
            return None;
        };
        static N: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "idem-redis-test-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
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
        let child = Command::new(&self.binary)
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
        self.child = Some(child);
        let started = Instant::now();
        while started.elapsed() < Duration::from_secs(10) {
            if let Some(c) = self.child.as_mut()
                && let Ok(Some(status)) = c.try_wait()
            {
                self.child = None;
                return Err(format!("redis-server exited: {status}"));
            }
            if matches!(self.cmd(&["PING"]), Ok(Resp::Simple(ref s)) if s == "PONG") {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        self.stop();
        Err("redis-server did not answer PING within 10s".into())
    }

    pub fn port(&self) -> u16 {
        self.port
    }

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
        crate::net::respawn("redis-server", port, Duration::from_secs(10), || {
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
    pub fn cmd(&self, args: &[&str]) -> Result<Resp, String> {
        self.cmd_bytes(&args.iter().map(|a| a.as_bytes()).collect::<Vec<_>>())
    }

    pub fn cmd_bytes(&self, args: &[&[u8]]) -> Result<Resp, String> {
        let mut s = TcpStream::connect(("127.0.0.1", self.port)).map_err(|e| e.to_string())?;
        s.set_read_timeout(Some(Duration::from_secs(5)))
            .map_err(|e| e.to_string())?;
        let mut out = format!("*{}\r\n", args.len()).into_bytes();
        for a in args {
            out.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
            out.extend_from_slice(a);
            out.extend_from_slice(b"\r\n");
        }
        s.write_all(&out).map_err(|e| e.to_string())?;
        read_reply(&mut BufReader::new(s))
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
    /// `HMGET`, `HSET`, `HDEL`, `PEXPIRE`, `PTTL`, `PUBLISH`, and for the tenant quota
    /// `ZADD`, `ZREM`, `ZCARD`, `ZSCORE`, `ZREMRANGEBYSCORE`) are left out, and so are
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

    pub fn reset_stats(&self) {
        self.cmd(&["CONFIG", "RESETSTAT"])
            .expect("CONFIG RESETSTAT");
    }
}

/// A Redis store with the default settings: a Redis Cluster when `url` is a
/// comma-separated list of seed nodes (how the demo passes a cluster around), else one
/// endpoint.
pub async fn connect_store(url: &str) -> Result<idem_redis::RedisStore, idem_redis::ConnectError> {
    if url.contains(',') {
        let nodes = url.split(',').map(str::trim).filter(|n| !n.is_empty());
        idem_redis::RedisStore::cluster_builder(nodes)
            .connect()
            .await
    } else {
        idem_redis::RedisStore::connect(url.to_owned()).await
    }
}

/// A node of a [`RedisCluster`], as `CLUSTER NODES` describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterNode {
    pub id: String,
    pub port: u16,
    pub master: bool,
    /// The master's id, for a replica.
    pub master_id: Option<String>,
    /// Slots served (masters), as inclusive ranges.
    pub slots: Vec<(u16, u16)>,
    pub connected: bool,
}

/// A private Redis Cluster: 3 masters, 3 replicas, on free loopback ports.
pub struct RedisCluster {
    nodes: Vec<RedisServer>,
    cli: PathBuf,
    base: PathBuf,
    watchdog: Option<Child>,
}

/// A port whose cluster bus port (+10000) is free too.
fn free_cluster_port(taken: &[u16]) -> u16 {
    loop {
        let port = crate::net::free_port();
        if port > 55_000 || taken.contains(&port) {
            continue;
        }
        if TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok() {
            return port;
        }
    }
}

impl RedisCluster {
    /// Masters, each with one replica.
    pub const MASTERS: usize = 3;

    /// Starts a cluster, or `None` (outside CI only) when `redis-server` or `redis-cli`
    /// is missing. Panics when it cannot start.
    pub fn start() -> Option<RedisCluster> {
        let binary = require_tool("redis-server", "REDIS_SERVER")?;
        let cli = require_tool("redis-cli", "REDIS_CLI")?;
        static N: AtomicU32 = AtomicU32::new(0);
        let base = std::env::temp_dir().join(format!(
            "idem-redis-cluster-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&base).expect("cluster dir");
        let mut cluster = RedisCluster {
            nodes: Vec::new(),
            cli,
            base: base.clone(),
            watchdog: None,
        };
        cluster.watchdog = Some(cluster.spawn_watchdog());
        let mut ports = Vec::new();
        for i in 0..2 * Self::MASTERS {
            let node = (0..5)
                .find_map(|_| {
                    let port = free_cluster_port(&ports);
                    let mut node = RedisServer {
                        binary: binary.clone(),
                        port,
                        dir: base.join(format!("node-{i}")),
                        child: None,
                        extra: [
                            "--cluster-enabled",
                            "yes",
                            "--cluster-config-file",
                            "nodes.conf",
                            "--cluster-node-timeout",
                            "1000",
                            // A replica whose master died may always take over.
                            "--cluster-replica-validity-factor",
                            "0",
                            "--maxmemory-policy",
                            "noeviction",
                            // A replica that (re)joins syncs at once, not after 5 s.
                            "--repl-diskless-sync-delay",
                            "0",
                        ]
                        .map(String::from)
                        .to_vec(),
                    };
                    node.spawn().ok().map(|()| node)
                })
                .expect("a cluster node started");
            ports.push(node.port);
            cluster.nodes.push(node);
        }
        let mut create = Command::new(&cluster.cli);
        create.arg("--cluster").arg("create");
        for p in &ports {
            create.arg(format!("127.0.0.1:{p}"));
        }
        cluster_cli(
            create.args(["--cluster-replicas", "1", "--cluster-yes"]),
            "create",
        );
        cluster.wait_healthy(Duration::from_secs(30));
        Some(cluster)
    }

    /// One cluster for the whole test process (never dropped: the watchdog stops it
    /// when the process exits). `None` as for [`start`](Self::start).
    pub fn shared() -> Option<&'static RedisCluster> {
        static SHARED: std::sync::OnceLock<Option<RedisCluster>> = std::sync::OnceLock::new();
        SHARED.get_or_init(RedisCluster::start).as_ref()
    }

    /// A shell that waits for this process to exit, then kills every node (from their
    /// pid files, so restarted nodes too) and removes the files.
    fn spawn_watchdog(&self) -> Child {
        let script = format!(
            "while kill -0 {pid} 2>/dev/null; do sleep 0.5; done; \
             for f in '{base}'/*/redis.pid; do [ -f \"$f\" ] && kill -9 \"$(cat \"$f\")\" 2>/dev/null; done; \
             rm -rf '{base}'",
            pid = std::process::id(),
            base = self.base.display()
        );
        Command::new("sh")
            .arg("-c")
            .arg(script)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn the cluster watchdog")
    }

    /// Seed node URLs (every node), `redis://127.0.0.1:PORT`.
    pub fn urls(&self) -> Vec<String> {
        self.nodes
            .iter()
            .map(|n| format!("redis://127.0.0.1:{}", n.port))
            .collect()
    }

    /// Every node's port.
    pub fn ports(&self) -> Vec<u16> {
        self.nodes.iter().map(|n| n.port).collect()
    }

    fn node(&self, port: u16) -> &RedisServer {
        self.nodes
            .iter()
            .find(|n| n.port == port)
            .unwrap_or_else(|| panic!("no cluster node on port {port}"))
    }

    /// One command to the node on `port`.
    pub fn cmd(&self, port: u16, args: &[&str]) -> Result<Resp, String> {
        self.node(port).cmd(args)
    }

    /// One command to the node on `port`, binary arguments.
    pub fn cmd_bytes(&self, port: u16, args: &[&[u8]]) -> Result<Resp, String> {
        self.node(port).cmd_bytes(args)
    }

    /// Several commands on one connection to the node on `port` (e.g. `READONLY` then a
    /// read on a replica); the last reply.
    pub fn cmds(&self, port: u16, cmds: &[&[&str]]) -> Result<Resp, String> {
        let s = TcpStream::connect(("127.0.0.1", port)).map_err(|e| e.to_string())?;
        s.set_read_timeout(Some(Duration::from_secs(5)))
            .map_err(|e| e.to_string())?;
        let mut w = s.try_clone().map_err(|e| e.to_string())?;
        let mut r = BufReader::new(s);
        let mut last = Resp::Bulk(None);
        for args in cmds {
            let mut out = format!("*{}\r\n", args.len()).into_bytes();
            for a in *args {
                out.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
                out.extend_from_slice(a.as_bytes());
                out.extend_from_slice(b"\r\n");
            }
            w.write_all(&out).map_err(|e| e.to_string())?;
            last = read_reply(&mut r)?;
        }
        Ok(last)
    }

    /// The cluster as `CLUSTER NODES` on a live node describes it.
    pub fn topology(&self) -> Vec<ClusterNode> {
        let text = self
            .nodes
            .iter()
            .filter(|n| n.child.is_some())
            .find_map(|n| n.cmd(&["CLUSTER", "NODES"]).ok())
            .expect("a live node answers CLUSTER NODES")
            .text();
        text.lines()
            .filter_map(|line| {
                let f: Vec<&str> = line.split_whitespace().collect();
                let port = f.get(1)?.split(['@', ':']).nth(1)?.parse().ok()?;
                let flags = f.get(2)?;
                Some(ClusterNode {
                    id: f[0].to_owned(),
                    port,
                    master: flags.contains("master"),
                    master_id: f.get(3).filter(|m| **m != "-").map(|m| (*m).to_owned()),
                    slots: f
                        .iter()
                        .skip(8)
                        .filter(|s| !s.starts_with('['))
                        .filter_map(|s| {
                            let (a, b) = s.split_once('-').unwrap_or((s, s));
                            Some((a.parse().ok()?, b.parse().ok()?))
                        })
                        .collect(),
                    connected: f.get(7) == Some(&"connected") && !flags.contains("fail"),
                })
            })
            .collect()
    }

    /// The hash slot of `key` (`CLUSTER KEYSLOT`).
    pub fn slot_of(&self, key: &str) -> u16 {
        let port = self.live_port();
        match self.cmd(port, &["CLUSTER", "KEYSLOT", key]) {
            Ok(Resp::Int(n)) => u16::try_from(n).expect("slot in range"),
            other => panic!("CLUSTER KEYSLOT: {other:?}"),
        }
    }

    fn live_port(&self) -> u16 {
        self.nodes
            .iter()
            .find(|n| n.child.is_some())
            .expect("a live node")
            .port
    }

    /// The master serving `slot` now.
    pub fn master_of_slot(&self, slot: u16) -> ClusterNode {
        self.topology()
            .into_iter()
            .find(|n| n.master && n.slots.iter().any(|(a, b)| (*a..=*b).contains(&slot)))
            .unwrap_or_else(|| panic!("no master serves slot {slot}"))
    }

    /// The masters now.
    pub fn masters(&self) -> Vec<ClusterNode> {
        self.topology().into_iter().filter(|n| n.master).collect()
    }

    /// SIGKILLs the node on `port` (a crash: no failover handshake).
    pub fn kill(&mut self, port: u16) {
        self.nodes
            .iter_mut()
            .find(|n| n.port == port)
            .expect("node")
            .stop();
    }

    /// Cuts the replica on `replica` off from its master on `master`, as a partition
    /// between them would: the replica is given a `masterauth` the master does not
    /// know and its link is killed (`CLIENT KILL TYPE replica`), so its reconnections
    /// fail authentication and the writes the master acknowledges from now on reach no
    /// replica. A master SIGKILLed meanwhile takes them along: the replica it fails
    /// over to (`cluster-replica-validity-factor 0` keeps it eligible) lacks them.
    pub fn cut_replication(&self, master: u16, replica: u16) {
        match self.cmd(replica, &["CONFIG", "SET", "masterauth", "idem-test-cut"]) {
            Ok(Resp::Simple(ok)) if ok == "OK" => {}
            other => panic!("CONFIG SET masterauth on {replica}: {other:?}"),
        }
        let started = Instant::now();
        loop {
            let _ = self.cmd(master, &["CLIENT", "KILL", "TYPE", "replica"]);
            std::thread::sleep(Duration::from_millis(20));
            let info = self
                .cmd(master, &["INFO", "replication"])
                .expect("INFO replication")
                .text();
            if info.contains("connected_slaves:0") {
                return;
            }
            assert!(
                started.elapsed() < Duration::from_secs(5),
                "the replica stayed connected: {info}"
            );
        }
    }

    /// The replica of the master with id `master_id`.
    pub fn replica_of(&self, master_id: &str) -> ClusterNode {
        self.topology()
            .into_iter()
            .find(|n| n.master_id.as_deref() == Some(master_id) && n.connected)
            .unwrap_or_else(|| panic!("master {master_id} has no connected replica"))
    }

    /// Starts the node on `port` again (empty, persistence is off; its `nodes.conf`
    /// makes it rejoin, as a replica once its slots were failed over).
    pub fn restart(&mut self, port: u16) {
        self.nodes
            .iter_mut()
            .find(|n| n.port == port)
            .expect("node")
            .restart();
    }

    /// Waits until every live node says `cluster_state:ok`, every slot is served and
    /// every master has a replica in sync. Panics after `limit`.
    pub fn wait_healthy(&self, limit: Duration) {
        let started = Instant::now();
        let mut last = String::new();
        while started.elapsed() < limit {
            match self.health() {
                Ok(()) => return,
                Err(e) => last = e,
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!("redis cluster not healthy within {limit:?}: {last}");
    }

    fn health(&self) -> Result<(), String> {
        for n in self.nodes.iter().filter(|n| n.child.is_some()) {
            let info = n.cmd(&["CLUSTER", "INFO"])?.text();
            if !info.contains("cluster_state:ok") || !info.contains("cluster_slots_ok:16384") {
                return Err(format!("node {}: {info}", n.port));
            }
        }
        // Every node sees the same slot owners (what `redis-cli --cluster check` calls
        // agreeing about the configuration).
        let mut views = Vec::new();
        for n in self.nodes.iter().filter(|n| n.child.is_some()) {
            let text = n.cmd(&["CLUSTER", "NODES"])?.text();
            let mut view: Vec<String> = text
                .lines()
                .filter_map(|l| {
                    let f: Vec<&str> = l.split_whitespace().collect();
                    (f.len() > 8).then(|| format!("{} {}", f[0], f[8..].join(" ")))
                })
                .collect();
            view.sort();
            views.push(view);
        }
        if views.windows(2).any(|w| w[0] != w[1]) {
            return Err("nodes do not agree about the slot owners yet".into());
        }
        let topology = self.topology();
        // Every running node's cluster-bus link is up in the view `topology` reads (a
        // restarted node can be in sync with its master before that view says
        // `connected`, and `replica_of` goes by it).
        let running = |port: u16| {
            self.nodes
                .iter()
                .any(|n| n.port == port && n.child.is_some())
        };
        if let Some(n) = topology.iter().find(|n| running(n.port) && !n.connected) {
            return Err(format!("node {} is not connected yet", n.port));
        }
        let masters: Vec<_> = topology
            .iter()
            .filter(|n| n.master && !n.slots.is_empty())
            .collect();
        if masters.len() != Self::MASTERS {
            return Err(format!("{} masters with slots", masters.len()));
        }
        for m in masters {
            let info = self.cmd(m.port, &["INFO", "replication"])?.text();
            if !info.contains("connected_slaves:1") || !info.contains("state=online") {
                return Err(format!("master {} has no replica in sync: {info}", m.port));
            }
        }
        Ok(())
    }

    /// Moves `slots` slots from the master on `from` to the master on `to` with
    /// `redis-cli --cluster reshard` (MIGRATING/IMPORTING, `MIGRATE` of every key, then
    /// `SETSLOT NODE`): clients meanwhile get `ASK` and `MOVED`. Returns the keys moved
    /// (the dots redis-cli prints per migrated key).
    pub fn reshard(&self, from: u16, to: u16, slots: usize) -> usize {
        let topology = self.topology();
        let id = |port| {
            topology
                .iter()
                .find(|n| n.port == port)
                .map(|n| n.id.clone())
                .unwrap_or_else(|| panic!("no node on {port}"))
        };
        let out = cluster_cli(
            Command::new(&self.cli)
                .args(["--cluster", "reshard", &format!("127.0.0.1:{to}")])
                .args(["--cluster-from", &id(from), "--cluster-to", &id(to)])
                .args(["--cluster-slots", &slots.to_string(), "--cluster-yes"])
                .args(["--cluster-pipeline", "20"]),
            "reshard",
        );
        // Until every node knows the slots' new owner, another reshard would refuse.
        self.wait_healthy(Duration::from_secs(30));
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.strip_prefix("Moving slot "))
            .map(|l| {
                l.rsplit(':')
                    .next()
                    .map_or(0, |dots| dots.matches('.').count())
            })
            .sum()
    }
}

impl Drop for RedisCluster {
    fn drop(&mut self) {
        for n in &mut self.nodes {
            n.stop();
        }
        if let Some(mut w) = self.watchdog.take() {
            let _ = w.kill();
            let _ = w.wait();
        }
        let _ = std::fs::remove_dir_all(&self.base);
    }
}

fn read_line(r: &mut impl BufRead) -> Result<String, String> {
    let mut line = String::new();
    let n = r.read_line(&mut line).map_err(|e| e.to_string())?;
    if n == 0 {
        return Err("connection closed".into());
    }
    Ok(line.trim_end_matches(['\r', '\n']).to_owned())
}

fn read_reply(r: &mut impl BufRead) -> Result<Resp, String> {
    let line = read_line(r)?;
    let (kind, rest) = line.split_at(line.len().min(1));
    let num = || {
        rest.parse::<i64>()
            .map_err(|e| format!("bad RESP length {rest:?}: {e}"))
    };
    Ok(match kind {
        "+" => Resp::Simple(rest.to_owned()),
        "-" => Resp::Error(rest.to_owned()),
        ":" => Resp::Int(num()?),
        "$" => {
            let n = num()?;
            if n < 0 {
                Resp::Bulk(None)
            } else {
                let mut buf = vec![0; n as usize + 2];
                r.read_exact(&mut buf).map_err(|e| e.to_string())?;
                buf.truncate(n as usize);
                Resp::Bulk(Some(buf))
            }
        }
        "*" => {
            let n = num()?;
            if n < 0 {
                Resp::Array(None)
            } else {
                let mut items = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    items.push(read_reply(r)?);
                }
                Resp::Array(Some(items))
            }
        }
        _ => return Err(format!("unexpected RESP line {line:?}")),
    })
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Runs `redis-cli --cluster <what> …` (`cmd`) to its end, with no input; panics with
/// what it printed unless it succeeded.
fn cluster_cli(cmd: &mut Command, what: &str) -> std::process::Output {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("run redis-cli --cluster {what}: {e}"));
    assert!(
        out.status.success(),
        "redis-cli --cluster {what} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}
