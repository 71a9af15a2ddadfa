//! Test harness: a private PostgreSQL server per test, on a free 127.0.0.1 port, with its
//! data and socket in a temporary directory; stopped and removed on drop.
//!
//! `PostgresServer::start()` returns `None` when no PostgreSQL server binaries are found
//! (looked up in `$PG_BIN`, then the newest `/usr/lib/postgresql/*/bin` where Debian puts
//! them, then `PATH`): the test prints why and returns. When the `CI` environment
//! variable is set, missing binaries panic instead, so CI never skips silently
//! (`scripts/setup-test-deps.sh` installs the `postgresql` package when it is missing).
//!
//! PostgreSQL refuses to run as root. Run as root, the harness runs `initdb` and
//! `postgres` as the `postgres` system user (which Debian's package creates), or creates
//! a system user `idem-pg` when there is none, and gives it the temporary directory.
//!
//! `initdb` runs once per test process (into a cluster template kept under the temporary
//! directory, reused by later runs of the same PostgreSQL version); each server starts
//! from a copy of it, so a server is ready in well under a second. The cluster trusts
//! local connections for the superuser `idem` and runs without fsync: it is for tests.
//! Commits are synchronous, so a server killed by [`PostgresServer::stop`] keeps every
//! committed row.

use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crate::launch::{self, NotReady};

/// The superuser of the test clusters.
pub const USER: &str = "idem";

/// Where the binaries are and whom the server runs as.
#[derive(Debug, Clone)]
struct Install {
    bin: PathBuf,
    /// `(uid, gid)` to run as when this process is root.
    run_as: Option<(u32, u32)>,
    version: String,
}

/// A private PostgreSQL server on a free 127.0.0.1 port; stopped and removed on drop.
pub struct PostgresServer {
    install: Install,
    dir: PathBuf,
    port: u16,
    settings: Vec<(String, String)>,
    child: Option<Child>,
}

fn has_server(dir: &Path) -> bool {
    ["initdb", "postgres", "pg_ctl"]
        .iter()
        .all(|b| dir.join(b).is_file())
}

fn find_bin() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("PG_BIN") {
        return Some(PathBuf::from(p)).filter(|d| has_server(d));
    }
    // Debian: /usr/lib/postgresql/<major>/bin, not on PATH. Newest major first.
    let mut debian: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let major = e.file_name().to_str()?.parse().ok()?;
            Some((major, e.path().join("bin")))
        })
        .filter(|(_, d)| has_server(d))
        .collect();
    debian.sort();
    if let Some((_, d)) = debian.pop() {
        return Some(d);
    }
    std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .unwrap_or_default()
        .into_iter()
        .find(|d| has_server(d))
}

fn output(cmd: &mut Command) -> Result<String, String> {
    let out = cmd.output().map_err(|e| format!("{cmd:?}: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "{cmd:?}: {}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

fn is_root() -> bool {
    output(Command::new("id").arg("-u")).is_ok_and(|u| u == "0")
}

fn ids(user: &str) -> Option<(u32, u32)> {
    let uid = output(Command::new("id").args(["-u", user])).ok()?;
    let gid = output(Command::new("id").args(["-g", user])).ok()?;
    Some((uid.parse().ok()?, gid.parse().ok()?))
}

/// The unprivileged user to run PostgreSQL as, when we are root.
fn server_user() -> Result<(u32, u32), String> {
    if let Some(ids) = ids("postgres").or_else(|| ids("idem-pg")) {
        return Ok(ids);
    }
    output(Command::new("useradd").args([
        "--system",
        "--user-group",
        "--no-create-home",
        "--shell",
        "/usr/sbin/nologin",
        "idem-pg",
    ]))?;
    ids("idem-pg").ok_or_else(|| "useradd idem-pg did not create the user".to_owned())
}

fn install() -> Option<Result<Install, String>> {
    static INSTALL: OnceLock<Option<Result<Install, String>>> = OnceLock::new();
    INSTALL
        .get_or_init(|| {
            let bin = find_bin()?;
            Some((|| {
                let run_as = if is_root() {
                    Some(server_user()?)
                } else {
                    None
                };
                let version = output(Command::new(bin.join("postgres")).arg("--version"))?;
                Ok(Install {
                    bin,
                    run_as,
                    version,
                })
            })())
        })
        .clone()
}

impl Install {
    fn command(&self, program: &str) -> Command {
        use std::os::unix::process::CommandExt;
        let mut c = Command::new(self.bin.join(program));
        if let Some((uid, gid)) = self.run_as {
            c.uid(uid).gid(gid);
        }
        c.stdin(Stdio::null());
        c
    }

    fn give(&self, path: &Path) -> Result<(), String> {
        if let Some((uid, gid)) = self.run_as {
            std::os::unix::fs::chown(path, Some(uid), Some(gid))
                .map_err(|e| format!("chown {}: {e}", path.display()))?;
        }
        Ok(())
    }

    /// A cluster made by `initdb` once, copied for every server.
    fn template(&self) -> Result<PathBuf, String> {
        static TEMPLATE: OnceLock<Result<PathBuf, String>> = OnceLock::new();
        TEMPLATE.get_or_init(|| self.make_template()).clone()
    }

    fn make_template(&self) -> Result<PathBuf, String> {
        let tag: String = self
            .version
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
            .collect();
        let uid = self
            .run_as
            .map_or_else(|| "self".to_owned(), |(u, _)| u.to_string());
        let root = std::env::temp_dir().join(format!("idem-pg-template-{tag}-{uid}"));
        if root.join("data/PG_VERSION").is_file() {
            return Ok(root.join("data"));
        }
        let staging = std::env::temp_dir().join(format!(
            "idem-pg-template-{tag}-{uid}.{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&staging);
        std::fs::create_dir_all(&staging).map_err(|e| format!("create template dir: {e}"))?;
        self.give(&staging)?;
        output(
            self.command("initdb")
                .arg("-D")
                .arg(staging.join("data"))
                .args(["-U", USER, "--auth=trust", "--no-sync", "-E", "UTF8"])
                .args(["--locale=C", "--no-instructions"]),
        )?;
        // Another test process may have won the race: theirs is as good as ours.
        if std::fs::rename(&staging, &root).is_err() {
            let _ = std::fs::remove_dir_all(&staging);
        }
        if root.join("data/PG_VERSION").is_file() {
            Ok(root.join("data"))
        } else {
            Err(format!("no cluster template at {}", root.display()))
        }
    }
}

impl PostgresServer {
    /// Starts a server, or returns `None` (outside CI only) when PostgreSQL is not
    /// installed. Panics when it cannot start.
    pub fn start() -> Option<PostgresServer> {
        Self::start_with(&[])
    }

    /// [`start`](Self::start) with extra server settings (`-c name=value`), such as
    /// `("shared_preload_libraries", "pg_stat_statements")`.
    pub fn start_with(settings: &[(&str, &str)]) -> Option<PostgresServer> {
        let install = match install() {
            Some(Ok(i)) => i,
            Some(Err(e)) => panic!("PostgreSQL is installed but cannot be used: {e}"),
            None => {
                launch::required(
                    None::<()>,
                    "PostgreSQL server binaries (initdb, postgres)",
                    "set PG_BIN, or install them: apt-get install -y postgresql, whose binaries \
                     are found in /usr/lib/postgresql/*/bin",
                    "PostgreSQL",
                );
                return None;
            }
        };
        let template = install
            .template()
            .unwrap_or_else(|e| panic!("initdb failed: {e}"));
        let dir = launch::scratch_dir("idem-pg-test");
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create the test server's directory");
        install
            .give(&dir)
            .expect("give the directory to the server user");
        output(
            Command::new("cp")
                .arg("-a")
                .arg(&template)
                .arg(dir.join("data")),
        )
        .expect("copy the cluster template");
        let mut server = PostgresServer {
            install,
            dir,
            port: 0,
            settings: settings
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            child: None,
        };
        // A free port can be taken between our probe and the server binding it.
        let mut last = String::new();
        for _ in 0..5 {
            server.port = crate::net::free_port();
            match server.spawn() {
                Ok(()) => return Some(server),
                Err(e) => last = e,
            }
        }
        panic!("postgres did not start: {last}");
    }

    fn spawn(&mut self) -> Result<(), String> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("server.log"))
            .map_err(|e| format!("open server.log: {e}"))?;
        let mut cmd = self.install.command("postgres");
        cmd.arg("-D")
            .arg(self.dir.join("data"))
            .args(["-p", &self.port.to_string()])
            .arg("-k")
            .arg(&self.dir)
            .args(["-c", "listen_addresses=127.0.0.1"])
            // No fsync (the machine does not crash under a test), but commits still
            // reach the OS before they are acknowledged: a test that kills the server
            // finds every committed record after the restart.
            .args(["-c", "fsync=off", "-c", "full_page_writes=off"])
            .args(["-c", "shared_buffers=16MB"])
            .args(["-c", "max_connections=50"]);
        for (k, v) in &self.settings {
            cmd.arg("-c").arg(format!("{k}={v}"));
        }
        let mut child = cmd
            .stdout(log.try_clone().map_err(|e| e.to_string())?)
            .stderr(log)
            .spawn()
            .map_err(|e| format!("spawn postgres: {e}"))?;
        let limit = Duration::from_secs(20);
        let waited = launch::wait_ready(&mut child, limit, Duration::from_millis(20), || {
            self.is_ready()
        });
        match waited {
            Ok(()) => {
                self.child = Some(child);
                Ok(())
            }
            Err(NotReady::Exited(status)) => {
                Err(format!("postgres exited ({status}): {}", self.log_tail()))
            }
            Err(NotReady::TimedOut) => {
                self.child = Some(child);
                self.stop();
                Err(format!(
                    "postgres did not accept connections within 20s: {}",
                    self.log_tail()
                ))
            }
        }
    }

    fn is_ready(&self) -> bool {
        let probe = self.install.bin.join("pg_isready");
        if probe.is_file() {
            return Command::new(probe)
                .args(["-q", "-h", "127.0.0.1", "-p", &self.port.to_string()])
                .args(["-U", USER, "-d", "postgres"])
                .stdin(Stdio::null())
                .status()
                .is_ok_and(|s| s.success());
        }
        TcpStream::connect(("127.0.0.1", self.port)).is_ok()
    }

    fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(self.dir.join("server.log")).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(10)..].join("\n")
    }

    /// The port it listens on (127.0.0.1).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `postgres://idem@127.0.0.1:<port>/postgres` (trust authentication).
    pub fn url(&self) -> String {
        format!("postgres://{USER}@127.0.0.1:{}/postgres", self.port)
    }

    /// A pool of at most `max_connections` connections to the server, for a test's own
    /// SQL; panics when it cannot connect.
    pub async fn pool(&self, max_connections: u32) -> sqlx::PgPool {
        sqlx::postgres::PgPoolOptions::new()
            .max_connections(max_connections)
            .connect(&self.url())
            .await
            .expect("a pool on the test postgres")
    }

    /// The server's version line (`postgres (PostgreSQL) 15.x`).
    pub fn version(&self) -> &str {
        &self.install.version
    }

    /// Stops the server at once (SIGQUIT: immediate shutdown, like a crash; the data
    /// stays) and waits for it to exit.
    pub fn stop(&mut self) {
        let Some(mut c) = self.child.take() else {
            return;
        };
        // `pg_ctl kill` (as the server's user) rather than a `kill` binary, which a
        // slim system may lack.
        let _ = self
            .install
            .command("pg_ctl")
            .args(["kill", "QUIT", &c.id().to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        let started = Instant::now();
        while started.elapsed() < Duration::from_secs(10) {
            if let Ok(Some(_)) = c.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = c.kill();
        let _ = c.wait();
    }

    /// Starts the server again on the same port with the same data, after [`stop`]
    /// (crash recovery runs first, as after a real crash).
    ///
    /// [`stop`]: Self::stop
    pub fn start_again(&mut self) {
        self.stop();
        let port = self.port;
        launch::respawn("postgres", port, Duration::from_secs(20), || self.spawn());
    }
}

impl Drop for PostgresServer {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
