//! The whole document: [`ServiceConfig`] (the entries indexed by name, throttling and
//! idem's settings) and [`parse`], which reads the JSON and hands each top-level field to
//! its section's reader.

use std::collections::HashMap;
use std::sync::Arc;

use serde_json::{Map, Value};

use super::idem::IdemSettings;
use super::method::MethodConfig;
use super::read::{ConfigError, Diagnostic, Obj, Validator, kind, near_miss};
use super::retry::RetryThrottling;
use crate::descriptor::{Descriptors, nearest};

/// A valid config and the warnings its validation raised.
#[derive(Debug, Clone)]
pub struct Parsed {
    /// The validated config.
    pub config: ServiceConfig,
    /// Clamps, risky settings and unknown fields, each with its JSON path.
    pub warnings: Vec<Diagnostic>,
    /// What the descriptors decided that is no risk, said so a reader knows why
    /// (a bidirectional-streaming method left unprotected, a method protected through
    /// its level). Never errors, even in strict mode.
    pub notes: Vec<Diagnostic>,
}

/// A validated service config: method configs with their name index, throttling, and
/// idem's settings. Cheap to share behind an `Arc`.
#[derive(Debug, Clone, Default)]
pub struct ServiceConfig {
    pub(crate) method_configs: Vec<MethodConfig>,
    /// Keyed by `service/method`.
    pub(crate) by_method: HashMap<String, usize>,
    pub(crate) by_service: HashMap<String, usize>,
    pub(crate) default_entry: Option<usize>,
    pub(crate) retry_throttling: Option<RetryThrottling>,
    pub(crate) settings: IdemSettings,
    /// Unknown fields that are near misses of known ones (errors with descriptors).
    pub(crate) typos: Vec<Diagnostic>,
    /// The descriptors applied with [`with_descriptors`](Self::with_descriptors).
    pub(crate) descriptors: Option<Arc<Descriptors>>,
}

impl ServiceConfig {
    /// The config entry for `service`/`method`: exact `service/method`, else `service`,
    /// else the default entry (`{}`). The most specific entry wins whole.
    pub fn lookup(&self, service: &str, method: &str) -> Option<&MethodConfig> {
        self.lookup_split(&format!("{service}/{method}"), service)
    }

    /// [`lookup`](Self::lookup) by HTTP/2 path (`/shop.v1.Orders/CreateOrder`); does not
    /// allocate. `None` also when the path is not of that form.
    pub fn lookup_path(&self, path: &str) -> Option<&MethodConfig> {
        let (service, _) = split_path(path)?;
        self.lookup_split(&path[1..], service)
    }

    fn lookup_split(&self, service_method: &str, service: &str) -> Option<&MethodConfig> {
        self.by_method
            .get(service_method)
            .or_else(|| self.by_service.get(service))
            .copied()
            .or(self.default_entry)
            .map(|i| &self.method_configs[i])
    }

    /// Every entry, in document order.
    pub fn method_configs(&self) -> &[MethodConfig] {
        &self.method_configs
    }
    /// `retryThrottling`, if configured.
    pub fn retry_throttling(&self) -> Option<RetryThrottling> {
        self.retry_throttling
    }
    /// idem's top-level settings.
    pub fn settings(&self) -> &IdemSettings {
        &self.settings
    }

    /// Builds a config in code: entries are indexed by their names as the parser would.
    /// Fails when a name appears twice.
    pub fn from_parts(
        method_configs: Vec<MethodConfig>,
        retry_throttling: Option<RetryThrottling>,
        settings: IdemSettings,
    ) -> Result<Self, ConfigError> {
        let mut cfg = ServiceConfig {
            method_configs: Vec::new(),
            by_method: HashMap::new(),
            by_service: HashMap::new(),
            default_entry: None,
            retry_throttling,
            settings,
            typos: Vec::new(),
            descriptors: None,
        };
        let mut errors = Vec::new();
        for (i, mc) in method_configs.into_iter().enumerate() {
            for (j, name) in mc.names.iter().enumerate() {
                let dup = match (&name.service, &name.method) {
                    (None, _) => cfg.default_entry.replace(i).is_some(),
                    (Some(s), None) => cfg.by_service.insert(s.clone(), i).is_some(),
                    (Some(s), Some(m)) => cfg.by_method.insert(format!("{s}/{m}"), i).is_some(),
                };
                if dup {
                    errors.push(Diagnostic {
                        path: format!("methodConfig[{i}].name[{j}]"),
                        message: format!("duplicate name {name}"),
                    });
                }
            }
            cfg.method_configs.push(mc);
        }
        if errors.is_empty() {
            Ok(cfg)
        } else {
            Err(ConfigError::Invalid {
                errors,
                warnings: Vec::new(),
            })
        }
    }

    /// Parses and validates a service-config JSON document.
    ///
    /// # Errors
    /// [`ConfigError::Json`] with the parser's line and column when the text is not JSON;
    /// [`ConfigError::Invalid`] listing every broken rule, each as `json.path: rule`
    /// (every warning too, when the document sets `idem.strict`).
    pub fn from_json(text: &str) -> Result<ServiceConfig, ConfigError> {
        parse(text, &ParseOptions::default()).map(|parsed| parsed.config)
    }

    /// Parses and validates a service-config JSON document, and returns the warnings
    /// (clamps, risky settings, unknown fields) with the config.
    ///
    /// # Errors
    /// As [`ServiceConfig::from_json`].
    pub fn from_json_with_warnings(text: &str) -> Result<Parsed, ConfigError> {
        parse(text, &ParseOptions::default())
    }

    /// Parses and validates a service-config JSON document with `options`: strict mode
    /// and the services' descriptors.
    ///
    /// # Errors
    /// As [`ServiceConfig::from_json`], and as
    /// [`with_descriptors`](Self::with_descriptors) when descriptors are given.
    pub fn from_json_with_options(
        text: &str,
        options: &ParseOptions,
    ) -> Result<Parsed, ConfigError> {
        parse(text, options)
    }

    /// Reads, parses and validates the service-config file at `path`, and logs each
    /// warning at WARN through `tracing` (use
    /// [`from_file_with_warnings`](Self::from_file_with_warnings) to have them instead).
    ///
    /// # Errors
    /// [`ConfigError::Read`] naming the path when the file cannot be read; otherwise as
    /// [`ServiceConfig::from_json`].
    pub fn from_file(path: impl AsRef<std::path::Path>) -> Result<ServiceConfig, ConfigError> {
        Self::from_file_with_options(path, &ParseOptions::default()).map(|parsed| {
            for w in &parsed.warnings {
                tracing::warn!(path = %w.path, "service config: {}", w.message);
            }
            parsed.config
        })
    }

    /// [`from_file`](Self::from_file), returning the warnings instead of logging them.
    ///
    /// # Errors
    /// As [`from_file`](Self::from_file).
    pub fn from_file_with_warnings(
        path: impl AsRef<std::path::Path>,
    ) -> Result<Parsed, ConfigError> {
        Self::from_file_with_options(path, &ParseOptions::default())
    }

    /// [`from_file_with_warnings`](Self::from_file_with_warnings) with `options`.
    ///
    /// # Errors
    /// As [`from_json_with_options`](Self::from_json_with_options), and
    /// [`ConfigError::Read`] when the file cannot be read.
    pub fn from_file_with_options(
        path: impl AsRef<std::path::Path>,
        options: &ParseOptions,
    ) -> Result<Parsed, ConfigError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError::Read {
            path: path.display().to_string(),
            message: e.to_string(),
        })?;
        parse(&text, options)
    }
}

/// How to read a config document: [`ServiceConfig::from_json_with_options`].
///
/// # Defaults
/// Not strict (unless the document sets `idem.strict`), no descriptors.
#[derive(Debug, Clone, Default)]
pub struct ParseOptions {
    pub(crate) strict: bool,
    pub(crate) descriptors: Option<Arc<Descriptors>>,
}

impl ParseOptions {
    /// The defaults.
    pub fn new() -> Self {
        Self::default()
    }
    /// Every warning is an error (as `"idem": {"strict": true}` in the document).
    pub fn strict(mut self, yes: bool) -> Self {
        self.strict = yes;
        self
    }
    /// Check the config against the services' descriptors and protect by their
    /// levels ([`ServiceConfig::with_descriptors`]).
    pub fn descriptors(mut self, descriptors: impl Into<Arc<Descriptors>>) -> Self {
        self.descriptors = Some(descriptors.into());
        self
    }
}

/// Splits `/package.Service/Method` into `("package.Service", "Method")`.
pub fn split_path(path: &str) -> Option<(&str, &str)> {
    let rest = path.strip_prefix('/')?;
    let (service, method) = rest.split_once('/')?;
    if service.is_empty() || method.is_empty() || method.contains('/') {
        return None;
    }
    Some((service, method))
}

/// Top-level fields idem reads. Every other top-level field (loadBalancingConfig,
/// healthCheckConfig, …) belongs to another part of gRPC and is ignored.
pub(super) const TOP_FIELDS: &[&str] = &["methodConfig", "retryThrottling", "idem"];

pub(super) fn parse(text: &str, options: &ParseOptions) -> Result<Parsed, ConfigError> {
    let read = super::json::read(text).map_err(|e| {
        // serde_json's Display ends in " at line L column C"; the fields carry those.
        let full = e.to_string();
        let suffix = format!(" at line {} column {}", e.line(), e.column());
        let message = full.strip_suffix(&suffix).unwrap_or(&full).to_owned();
        ConfigError::Json {
            line: e.line(),
            column: e.column(),
            message,
        }
    })?;
    let doc = read.value;
    let Value::Object(top) = &doc else {
        let (line, column) = first_token_position(text);
        return Err(ConfigError::Json {
            line,
            column,
            message: format!(
                "the service config must be a JSON object, not {}",
                kind(&doc)
            ),
        });
    };
    let mut v = Validator::default();
    for path in read.repeated {
        v.error(
            path,
            "duplicate key: C-core refuses the document (grpc-go and grpc-java keep the last value)",
        );
    }
    let config = v.document(top);
    let strict = options.strict || config.as_ref().is_some_and(|c| c.settings.strict);
    let parsed = match config {
        Some(mut config) if v.errors.is_empty() => {
            config.typos = v.typos;
            Parsed {
                config,
                warnings: v.warnings,
                notes: Vec::new(),
            }
        }
        _ => {
            return Err(ConfigError::Invalid {
                errors: v.errors,
                warnings: v.warnings,
            });
        }
    };
    let parsed = match &options.descriptors {
        Some(d) => parsed
            .config
            .apply_descriptors(d.clone(), parsed.warnings)?,
        None => parsed,
    };
    if strict {
        super::proto::strict(parsed)
    } else {
        Ok(parsed)
    }
}

/// 1-based line and column of the first non-blank character (where the value starts).
fn first_token_position(text: &str) -> (usize, usize) {
    let (mut line, mut column) = (1, 1);
    for c in text.chars() {
        match c {
            '\n' => {
                line += 1;
                column = 1;
            }
            ' ' | '\t' | '\r' => column += 1,
            _ => break,
        }
    }
    (line, column)
}

impl Validator {
    fn document(&mut self, top: &Map<String, Value>) -> Option<ServiceConfig> {
        let o = Obj {
            map: top,
            path: String::new(),
        };
        for key in top.keys() {
            // Other unknown top-level fields belong to other parts of gRPC
            // (loadBalancingConfig, healthCheckConfig, …) and are ignored silently.
            if TOP_FIELDS.contains(&key.as_str()) {
                continue;
            }
            if let Some(known) = near_miss(key, TOP_FIELDS) {
                self.typo(
                    o.path(key),
                    format!("not read: field names are case-sensitive; did you mean \"{known}\"?"),
                );
            } else if let Some(known) = nearest(key, TOP_FIELDS.iter().copied()) {
                self.typo(o.path(key), format!("not read; did you mean \"{known}\"?"));
            }
        }

        let entries = match o.get("methodConfig") {
            Some(list) => self.method_configs(list, o.path("methodConfig")),
            None => Vec::new(),
        };
        let throttling = o
            .get("retryThrottling")
            .and_then(|v| self.retry_throttling(v, o.path("retryThrottling")));
        let settings = match o.get("idem") {
            Some(v) => self.idem_settings(v, o.path("idem")),
            None => Some(IdemSettings::default()),
        };

        let settings = settings?;
        match ServiceConfig::from_parts(entries, throttling, settings) {
            Ok(config) => Some(config),
            Err(ConfigError::Invalid { errors, .. }) => {
                // Unreachable in practice: duplicates are found above, with document paths.
                self.errors.extend(errors);
                None
            }
            Err(e @ (ConfigError::Json { .. } | ConfigError::Read { .. })) => {
                self.error("$", e.to_string());
                None
            }
        }
    }
}

#[cfg(test)]
mod tests;
