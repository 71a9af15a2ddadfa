//! Errors of building or reloading the layer.

use std::fmt;

use idem_core::config::ConfigError;

/// The config protects methods but no tenant source was chosen: neither the config's
/// `idem.tenant` nor [`IdempotencyLayer::tenant`](super::IdempotencyLayer::tenant).
///
/// Returned by [`IdempotencyLayer::check`](super::IdempotencyLayer::check) and
/// [`IdempotencyLayer::reload`](super::IdempotencyLayer::reload). A layer used without
/// the check refuses every protected call with FAILED_PRECONDITION
/// (`TENANT_SOURCE_MISSING`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NoTenantSource {
    /// A method the config protects (the first one), to name in the message.
    pub(crate) method: String,
}

impl fmt::Display for NoTenantSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "no tenant source configured, but the config protects {}: set idem.tenant in the \
             config or call IdempotencyLayer::tenant (e.g. FromExtension after an auth layer)",
            self.method
        )
    }
}

impl std::error::Error for NoTenantSource {}

/// Why [`IdempotencyLayer::check`](super::IdempotencyLayer::check) or
/// [`IdempotencyLayer::reload`](super::IdempotencyLayer::reload) refused the layer's
/// config.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CheckError {
    /// Methods are protected but no tenant source was chosen.
    #[error(transparent)]
    NoTenantSource(#[from] NoTenantSource),
    /// The config does not match the descriptors given to
    /// [`IdempotencyLayer::descriptors`](super::IdempotencyLayer::descriptors): a name
    /// that matches no service or method, a misspelled field, a retry policy on an
    /// opted-out side-effecting method… (every mismatch, each with its JSON path).
    #[error("the service config does not match the descriptors: {0}")]
    Descriptors(ConfigError),
}
