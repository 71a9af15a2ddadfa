//! What the private servers' launchers ([`redis`](crate::redis),
//! [`postgres`](crate::postgres)) share: finding the installed binaries (or saying why
//! the tests skip), waiting for a started server to answer, and starting it again on its
//! port.

use std::path::PathBuf;
use std::process::{Child, ExitStatus};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// `found`, or `None` after saying that `what` is missing and the `tests` tests skip;
/// under `CI` a missing binary panics instead, so CI never skips silently. `install`
/// says how to get it.
pub(crate) fn required<T>(found: Option<T>, what: &str, install: &str, tests: &str) -> Option<T> {
    if found.is_none() {
        if std::env::var_os("CI").is_some() {
            panic!(
                "{what} not found (CI is set): {install}; these tests must not be skipped in CI"
            );
        }
        eprintln!("SKIPPED: {what} not found ({install}); the {tests} tests did not run");
    }
    found
}

/// The program `name`: `$env` when set, else the first on `PATH`, `/usr/bin` or
/// `/usr/local/bin`.
#[cfg(feature = "redis")]
pub(crate) fn find_tool(name: &str, env: &str) -> Option<PathBuf> {
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

/// A path under the temporary directory for one server's files, `<prefix>-<pid>-<n>`:
/// unique in this process, and apart from other test processes'.
pub(crate) fn scratch_dir(prefix: &str) -> PathBuf {
    static N: AtomicU32 = AtomicU32::new(0);
    std::env::temp_dir().join(format!(
        "{prefix}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ))
}

/// Why a started server is not ready.
pub(crate) enum NotReady {
    /// The process exited.
    Exited(ExitStatus),
    /// It still runs, but `ready` did not hold within the limit.
    TimedOut,
}

/// Polls `ready` every `every` until it holds, the process `child` exits, or `limit`
/// has passed.
pub(crate) fn wait_ready(
    child: &mut Child,
    limit: Duration,
    every: Duration,
    ready: impl Fn() -> bool,
) -> Result<(), NotReady> {
    let started = Instant::now();
    while started.elapsed() < limit {
        if let Ok(Some(status)) = child.try_wait() {
            return Err(NotReady::Exited(status));
        }
        if ready() {
            return Ok(());
        }
        std::thread::sleep(every);
    }
    Err(NotReady::TimedOut)
}

/// Calls `spawn` until a server starts again on `port` after a stop (the old socket may
/// linger for a moment); panics with its last error, naming `what`, after `limit`.
pub(crate) fn respawn(
    what: &str,
    port: u16,
    limit: Duration,
    mut spawn: impl FnMut() -> Result<(), String>,
) {
    let started = Instant::now();
    loop {
        match spawn() {
            Ok(()) => return,
            Err(e) if started.elapsed() > limit => {
                panic!("{what} did not restart on port {port}: {e}")
            }
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}
