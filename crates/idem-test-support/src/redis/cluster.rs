//! [`RedisCluster`]: a private Redis Cluster of six `redis-server`s (three masters, one
//! replica each) on free loopback ports, joined with `redis-cli --cluster create`.
//!
//! [`RedisCluster::start_announcing`] starts one whose nodes tell clients other ports
//! (`cluster-announce-port`): a forwarder the test runs on each of those ports (a fault
//! proxy) is then the only way clients reach the nodes.

use std::io::BufReader;
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::reply::{RedisReply, connect, round_trip};
use super::{RedisServer, require_tool};
use crate::launch;

/// A node of a [`RedisCluster`], as `CLUSTER NODES` describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterNode {
    /// The node id.
    pub id: String,
    /// Its port on 127.0.0.1 (where it listens, also when it announces another one).
    pub port: u16,
    /// Whether it is a master.
    pub master: bool,
    /// The master's id, for a replica.
    pub master_id: Option<String>,
    /// Slots served (masters), as inclusive ranges.
    pub slots: Vec<(u16, u16)>,
    /// Whether its cluster-bus link is up and it is not failing.
    pub connected: bool,
}

/// A private Redis Cluster: 3 masters, 3 replicas, on free loopback ports.
pub struct RedisCluster {
    nodes: Vec<RedisServer>,
    cli: PathBuf,
    base: PathBuf,
    watchdog: Option<Child>,
    /// `(listening port, announced port)` of each node, when it announces another port
    /// to clients; empty otherwise.
    announced: Vec<(u16, u16)>,
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
        let base = launch::scratch_dir("idem-redis-cluster");
        std::fs::create_dir_all(&base).expect("cluster dir");
        let mut cluster = RedisCluster {
            nodes: Vec::new(),
            cli,
            base: base.clone(),
            watchdog: None,
            announced: Vec::new(),
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

    /// Starts a cluster (as [`start`](Self::start)) whose node `i` then announces
    /// `127.0.0.1:announce[i]` instead of its own port: in `CLUSTER SLOTS`,
    /// `CLUSTER SHARDS`, `CLUSTER NODES`, `MOVED` and `ASK`, and to its replicas, which
    /// replicate from there. The cluster bus keeps the nodes' own ports
    /// (`cluster-announce-bus-port`), so gossip, failure detection and failover votes
    /// never go through what listens on the announced ports. `None` as for
    /// [`start`](Self::start).
    ///
    /// The caller reserves the announced ports before the call (by holding listeners on
    /// them, so no node starts on one). Once the cluster is joined and healthy, `forward`
    /// is called with the nodes' own ports (same order as `announce`, and as
    /// [`ports`](Self::ports)); when it returns, something must forward each announced
    /// port to its node (a fault proxy). Then the nodes announce the new ports
    /// (`CONFIG SET`, kept for [`restart`](Self::restart)), and this returns once every
    /// node lists every other at its new port and the cluster is healthy again (the
    /// replicas reconnected through the forwarders). Clients seeded with
    /// [`urls`](Self::urls) then reach the nodes only through the forwarders.
    ///
    /// Everything else here speaks to the nodes' own ports and names nodes by them
    /// ([`ClusterNode::port`], [`cmd`](Self::cmd), [`kill`](Self::kill)), except
    /// [`reshard`](Self::reshard): redis-cli reaches the other nodes where they are
    /// announced.
    ///
    /// # Panics
    /// When `announce` does not name one port per node (`2 * MASTERS`), or the nodes do
    /// not all see the new ports and become healthy within 30 s each.
    pub fn start_announcing(
        announce: &[u16],
        forward: impl FnOnce(&[u16]),
    ) -> Option<RedisCluster> {
        assert_eq!(
            announce.len(),
            2 * Self::MASTERS,
            "one announced port per node"
        );
        let mut cluster = Self::start()?;
        forward(&cluster.ports());
        cluster.announce(announce);
        Some(cluster)
    }

    /// Makes node `i` announce `announce[i]`, then waits until every node sees it.
    fn announce(&mut self, announce: &[u16]) {
        for (node, &port) in self.nodes.iter_mut().zip(announce) {
            let bus = (node.port + 10_000).to_string();
            let settings = [
                ("cluster-announce-ip", "127.0.0.1".to_owned()),
                ("cluster-announce-bus-port", bus),
                ("cluster-announce-port", port.to_string()),
            ];
            for (name, value) in settings {
                node.config_set(name, &value);
                // A restarted node starts announcing it again.
                node.extra.extend([format!("--{name}"), value]);
            }
            self.announced.push((node.port, port));
        }
        let mut want: Vec<u16> = announce.to_vec();
        want.sort_unstable();
        let started = Instant::now();
        loop {
            // The ports each node lists, as it lists them (gossip spreads the change).
            let views: Vec<Result<Vec<u16>, String>> = self
                .nodes
                .iter()
                .map(|n| {
                    let text = n.cmd(&["CLUSTER", "NODES"])?.text();
                    let mut ports: Vec<u16> = text.lines().filter_map(listed_port).collect();
                    ports.sort_unstable();
                    Ok(ports)
                })
                .collect();
            if views.iter().all(|v| v.as_ref().is_ok_and(|p| *p == want)) {
                break;
            }
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "the nodes did not announce {want:?} within 30 s: {views:?}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        self.wait_healthy(Duration::from_secs(30));
    }

    /// The port the node listening on `port` announces to clients (`port` itself unless
    /// the cluster was started with [`start_announcing`](Self::start_announcing)).
    pub fn announced_port(&self, port: u16) -> u16 {
        self.announced
            .iter()
            .find(|(own, _)| *own == port)
            .map_or(port, |(_, announced)| *announced)
    }

    /// The port a node listens on, from a port `CLUSTER NODES` lists (announced or
    /// its own).
    fn own_port(&self, listed: u16) -> u16 {
        self.announced
            .iter()
            .find(|(_, announced)| *announced == listed)
            .map_or(listed, |(own, _)| *own)
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

    /// Seed node URLs (every node), `redis://127.0.0.1:PORT`, at the ports the nodes
    /// announce to clients (their own unless [`start_announcing`](Self::start_announcing)).
    pub fn urls(&self) -> Vec<String> {
        self.nodes
            .iter()
            .map(|n| format!("redis://127.0.0.1:{}", self.announced_port(n.port)))
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
    pub fn cmd(&self, port: u16, args: &[&str]) -> Result<RedisReply, String> {
        self.node(port).cmd(args)
    }

    /// One command to the node on `port`, binary arguments.
    pub fn cmd_bytes(&self, port: u16, args: &[&[u8]]) -> Result<RedisReply, String> {
        self.node(port).cmd_bytes(args)
    }

    /// Several commands on one connection to the node on `port` (e.g. `READONLY` then a
    /// read on a replica); the last reply.
    pub fn cmds(&self, port: u16, cmds: &[&[&str]]) -> Result<RedisReply, String> {
        let s = connect(port)?;
        let mut r = BufReader::new(&s);
        let mut last = RedisReply::Bulk(None);
        for args in cmds {
            last = round_trip(&mut &s, &mut r, args)?;
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
                let port = self.own_port(listed_port(line)?);
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
            Ok(RedisReply::Int(n)) => u16::try_from(n).expect("slot in range"),
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
            Ok(RedisReply::Simple(ok)) if ok == "OK" => {}
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
    ///
    /// On a loaded host a node that missed pings for a moment is flagged `fail?` in
    /// `CLUSTER NODES` until the next gossip clears it, so this looks again for up to
    /// 15 s before it panics.
    pub fn replica_of(&self, master_id: &str) -> ClusterNode {
        let started = Instant::now();
        loop {
            let topology = self.topology();
            if let Some(n) = topology
                .iter()
                .find(|n| n.master_id.as_deref() == Some(master_id) && n.connected)
            {
                return n.clone();
            }
            assert!(
                started.elapsed() < Duration::from_secs(15),
                "master {master_id} has no connected replica within 15 s: {topology:?}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
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
        // The view `masters` reads knows every running replica as one: right after the
        // cluster is made, a node can still list a replica as a master without slots
        // (the slot owners agree already), and a test that counts masters saw 5.
        let flagged = topology
            .iter()
            .filter(|n| n.master && running(n.port))
            .count();
        if flagged != Self::MASTERS {
            return Err(format!("{flagged} running nodes flagged master"));
        }
        for m in masters {
            let info = self.cmd(m.port, &["INFO", "replication"])?.text();
            if !info.contains("connected_slaves:1") || !info.contains("state=online") {
                return Err(format!("master {} has no replica in sync: {info}", m.port));
            }
        }
        Ok(())
    }

    /// Moves `slots` slots from the master serving slot `from` to the master serving
    /// slot `to` with `redis-cli --cluster reshard` (MIGRATING/IMPORTING, `MIGRATE` of
    /// every key, then `SETSLOT NODE`): clients meanwhile get `ASK` and `MOVED`. Returns
    /// the keys moved (the dots redis-cli prints per migrated key).
    ///
    /// The masters are named by a slot they serve, not by port, and looked up at the
    /// moment redis-cli runs: on a loaded host a replica may take over from a master
    /// that missed `cluster-node-timeout` of pings, and the slot then names the new
    /// master. redis-cli moves the source's lowest slots, so a slot at the top of a
    /// master's range names it before and after. When such a takeover races redis-cli
    /// ("not known or not a master"), this waits for the cluster to settle and runs it
    /// again, up to three times.
    pub fn reshard(&self, from: u16, to: u16, slots: usize) -> usize {
        let mut attempt = 0;
        let out = loop {
            attempt += 1;
            self.wait_healthy(Duration::from_secs(30));
            let (source, target) = (self.master_of_slot(from), self.master_of_slot(to));
            let out = Command::new(&self.cli)
                .args([
                    "--cluster",
                    "reshard",
                    &format!("127.0.0.1:{}", target.port),
                ])
                .args(["--cluster-from", &source.id, "--cluster-to", &target.id])
                .args(["--cluster-slots", &slots.to_string(), "--cluster-yes"])
                .args(["--cluster-pipeline", "20"])
                .stdin(Stdio::null())
                .output()
                .unwrap_or_else(|e| panic!("run redis-cli --cluster reshard: {e}"));
            let printed = format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            if out.status.success() {
                break out;
            }
            // Refused before any slot moved: the roles changed under redis-cli.
            let raced =
                printed.contains("not known or not a master") && !printed.contains("Moving slot");
            assert!(
                raced && attempt < 3,
                "redis-cli --cluster reshard failed (attempt {attempt}): {printed}"
            );
        };
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

/// The client port a `CLUSTER NODES` line lists (`id ip:port@bus …`).
fn listed_port(line: &str) -> Option<u16> {
    line.split_whitespace()
        .nth(1)?
        .split(['@', ':'])
        .nth(1)?
        .parse()
        .ok()
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
