//! What `tracing` prints, captured for tests that assert on log lines.
//!
//! A subscriber set for one thread still shares tracing's global callsite interest with
//! every other thread of the process: a test that asserts on a line another test of its
//! binary also logs (first, on a thread with no subscriber) can find that line disabled.
//! Such a test belongs alone in its own test binary.

use std::io::Write;
use std::sync::{Arc, Mutex};

/// A writer for `tracing_subscriber::fmt().with_writer(..)` that keeps what it is given;
/// clones share the text.
#[derive(Clone, Default)]
pub struct Sink(Arc<Mutex<Vec<u8>>>);

impl Sink {
    /// Everything written so far.
    pub fn text(&self) -> String {
        let bytes = self.0.lock().unwrap_or_else(|p| p.into_inner()).clone();
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

impl Write for Sink {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// What a plain `tracing_subscriber::fmt()` (no colours, events at `level` and above)
/// prints on this thread while `f` runs.
pub fn capture(level: tracing::Level, f: impl FnOnce()) -> String {
    let sink = Sink::default();
    let writer = sink.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_ansi(false)
        .with_max_level(level)
        .with_writer(move || writer.clone())
        .finish();
    tracing::subscriber::with_default(subscriber, f);
    sink.text()
}
