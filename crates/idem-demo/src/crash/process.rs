//! The demo's side of one instance process: how it is started, and the running child.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader, Lines};
use tokio::process::{Child, ChildStdout, Command};

use super::args::{SERVE_ENV, SERVE_FLAG, ServeArgs};
use crate::BoxError;

/// How an instance process is started.
#[derive(Debug, Clone)]
pub enum Launch {
    /// `exe --serve-instance ARGS…` (the demo binary).
    Binary(PathBuf),
    /// `exe TEST --exact --nocapture` with the arguments in [`SERVE_ENV`]: a test binary
    /// whose test `TEST` calls [`serve_from_env`](super::serve_from_env).
    Test {
        /// The test binary (`std::env::current_exe()` in a test).
        exe: PathBuf,
        /// The test that serves.
        test: String,
    },
}

impl Launch {
    fn command(&self, args: &ServeArgs) -> Command {
        match self {
            Launch::Binary(exe) => {
                let mut c = Command::new(exe);
                c.arg(SERVE_FLAG).args(args.to_args());
                c
            }
            Launch::Test { exe, test } => {
                let mut c = Command::new(exe);
                c.args([test.as_str(), "--exact", "--nocapture", "--test-threads=1"])
                    .env(SERVE_ENV, args.to_args().join("\n"));
                c
            }
        }
    }
}

/// A running instance process.
pub struct Instance {
    args: ServeArgs,
    child: Child,
    stdout: Lines<BufReader<ChildStdout>>,
}

impl Instance {
    /// Starts the process and waits (up to 30 s) for its `ready` line.
    pub async fn start(launch: &Launch, args: ServeArgs) -> Result<Instance, BoxError> {
        let mut child = launch
            .command(&args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()?;
        let stdout = child.stdout.take().ok_or("instance stdout")?;
        let mut instance = Instance {
            args,
            child,
            stdout: BufReader::new(stdout).lines(),
        };
        instance.wait_for("ready", Duration::from_secs(30)).await?;
        Ok(instance)
    }

    /// Waits for a line ending with `line` on the process's standard output (others are
    /// skipped). Ending with: a test binary's harness writes `test NAME ... ` first,
    /// without a newline.
    pub async fn wait_for(&mut self, line: &str, timeout: Duration) -> Result<(), BoxError> {
        let read = async {
            while let Some(l) = self.stdout.next_line().await? {
                if l.ends_with(line) {
                    return Ok(());
                }
            }
            Err::<(), BoxError>("the instance's output ended".into())
        };
        match tokio::time::timeout(timeout, read).await {
            Ok(r) => r.map_err(|e| {
                format!("instance {}: waiting for {line:?}: {e}", self.args.instance).into()
            }),
            Err(_) => Err(format!(
                "instance {}: no {line:?} within {timeout:?}",
                self.args.instance
            )
            .into()),
        }
    }

    /// The arguments it was started with.
    pub fn args(&self) -> &ServeArgs {
        &self.args
    }

    /// SIGTERM (the instance drains), then wait (up to `timeout`) for the process to
    /// exit; SIGKILL after that.
    pub async fn terminate(&mut self, timeout: Duration) -> Result<(), BoxError> {
        let pid = self.child.id().ok_or("the instance has exited")?;
        let status = Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status()
            .await?;
        if !status.success() {
            return Err(format!("kill -TERM {pid}: {status}").into());
        }
        match tokio::time::timeout(timeout, self.child.wait()).await {
            Ok(r) => {
                r?;
                Ok(())
            }
            Err(_) => {
                self.kill().await?;
                Err(format!(
                    "instance {}: no exit within {timeout:?} of SIGTERM",
                    self.args.instance
                )
                .into())
            }
        }
    }

    /// SIGKILL, then wait for the process to be gone.
    pub async fn kill(&mut self) -> Result<(), BoxError> {
        self.child.start_kill()?;
        self.child.wait().await?;
        Ok(())
    }
}
