//! `.proto` files compiled with protox (no `protoc`), behind the `protox` feature.

use std::path::Path;

use miette::Diagnostic as _;

use super::{DescriptorError, Descriptors};

impl Descriptors {
    /// Compiles `files` (paths, each found under one of `includes`, or relative to the
    /// working directory when `includes` is empty) with protox and reads their services.
    ///
    /// # Errors
    /// [`DescriptorError::Compile`] with protox's message, prefixed by `file:line:column`
    /// where it names a place: a syntax error, an unknown type, a missing import or file.
    pub fn compile(
        files: &[impl AsRef<Path>],
        includes: &[impl AsRef<Path>],
    ) -> Result<Self, DescriptorError> {
        let set = if includes.is_empty() {
            // protox needs an include path; each file's own directory is the natural one.
            let dirs: Vec<&Path> = files
                .iter()
                .map(|f| f.as_ref().parent().unwrap_or(Path::new("")))
                .map(|d| {
                    if d.as_os_str().is_empty() {
                        Path::new(".")
                    } else {
                        d
                    }
                })
                .collect();
            protox::compile(files, dirs)
        } else {
            protox::compile(files, includes)
        }
        .map_err(|e| DescriptorError::Compile(located(&e)))?;
        Self::from_set(&set)
    }
}

/// `file:line:column: message` for an error protox can place, else `file: message`.
fn located(e: &protox::Error) -> String {
    let place = e
        .labels()
        .and_then(|mut labels| labels.next())
        .and_then(|label| {
            let source = e.source_code()?;
            let span = source.read_span(label.inner(), 0, 0).ok()?;
            Some((span.line() + 1, span.column() + 1))
        });
    match (e.file(), place) {
        (Some(file), Some((line, column))) => format!("{file}:{line}:{column}: {e}"),
        (Some(file), None) if !e.to_string().contains(file) => format!("{file}: {e}"),
        _ => e.to_string(),
    }
}
