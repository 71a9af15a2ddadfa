//! JSON wire form → validated domain types. (Being written: see issue 2.)

use super::types::{ConfigError, IdemSettings, Parsed, ServiceConfig};

pub(crate) fn parse(text: &str) -> Result<Parsed, ConfigError> {
    let _: serde_json::Value = serde_json::from_str(text).map_err(|e| ConfigError::Json {
        line: e.line(),
        column: e.column(),
        message: e.to_string(),
    })?;
    let config = ServiceConfig::from_parts(Vec::new(), None, IdemSettings::default())?;
    Ok(Parsed { config, warnings: Vec::new() })
}
