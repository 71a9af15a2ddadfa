//! Errors of building or reloading the layer.

use std::fmt;

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
