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
///
/// `Debug` prints the same sentence as `Display`, so `?` in `main` names the fix.
#[derive(Clone, PartialEq, Eq)]
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

impl fmt::Debug for NoTenantSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl std::error::Error for NoTenantSource {}

/// Why [`IdempotencyLayer::check`](super::IdempotencyLayer::check) or
/// [`IdempotencyLayer::reload`](super::IdempotencyLayer::reload) refused the layer's
/// config.
#[derive(Clone, PartialEq, Eq, thiserror::Error)]
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

/// Debug is the sentence, as for [`NoTenantSource`]: what `?` in `main` prints.
impl fmt::Debug for CheckError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What `fn main() -> Result<(), Box<dyn Error>>` prints on `?`: the sentence with the
    /// fix, not the struct.
    #[test]
    fn debug_is_the_sentence() {
        let e = NoTenantSource {
            method: "shop.v1.Orders/CreateOrder".into(),
        };
        let boxed: Box<dyn std::error::Error> = Box::new(e.clone());
        assert_eq!(format!("{boxed:?}"), e.to_string());
        assert!(
            format!("{e:?}").starts_with(
                "no tenant source configured, but the config protects shop.v1.Orders/CreateOrder: \
                 set idem.tenant"
            ),
            "{e:?}"
        );
    }
}
