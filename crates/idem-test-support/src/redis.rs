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
}

pub struct RedisServer {
    binary: PathBuf,
    port: u16,
    dir: PathBuf,
    child: Option<Child>,
}

fn find_binary() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("REDIS_SERVER") {
        return Some(PathBuf::from(p));
    }
    let mut dirs: Vec<PathBuf> = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect())
        .unwrap_or_default();
    dirs.push("/usr/bin".into());
    dirs.push("/usr/local/bin".into());
    dirs.into_iter()
        .map(|d| d.join("redis-server"))
        .find(|p| p.is_file())
}

fn free_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
    l.local_addr().expect("local addr").port()
}

impl RedisServer {
    /// Starts a server, or returns `None` (outside CI only) when `redis-server` is
    /// missing. Panics when it cannot start.
    pub fn start() -> Option<RedisServer> {
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
                port: free_port(),
                dir: dir.clone(),
                child: None,
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
        let started = Instant::now();
        loop {
            match self.spawn() {
                Ok(()) => return,
                // The old socket may linger for a moment.
                Err(e) if started.elapsed() > Duration::from_secs(10) => {
                    panic!("redis-server did not restart on port {}: {e}", self.port)
                }
                Err(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        }
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
    /// `HMGET`, `HSET`, `HDEL`, `PEXPIRE`, `PTTL`, `PUBLISH`) are left out, and so are the
    /// harness's own (`INFO`, `CONFIG`, `PING`) and connection set-up (`CLIENT`, `HELLO`).
    pub fn round_trips(&self) -> u64 {
        const NOT_ROUND_TRIPS: &[&str] = &[
            "time", "hmget", "hset", "hdel", "pexpire", "pttl", "publish", "info", "ping", "hello",
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
