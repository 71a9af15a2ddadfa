//! Scope and fingerprint digests.

#[cfg(test)]
use bytes::Bytes;
use sha2::{Digest, Sha256};

use idem_core::derive::Which;
use idem_core::key::IdempotencyKey;
use idem_store::{Fingerprint, Scope, TenantId};

/// The record name of a call: SHA-256 over the length-prefixed tenant, method path and
/// key (each as a big-endian `u64` length then the bytes), after a version tag. No
/// separator inside a value can make two triples collide. It is
/// [`Scope::for_call`], which lives with the `Scope` type so that tools (`idem records`)
/// compute it without this crate.
///
/// ```
/// # use idem_server::idempotency::scope_for;
/// assert_ne!(
///     scope_for("ab", "/s/m", "keykeykey"),
///     scope_for("a", "b/s/m", "keykeykey"),
/// );
/// ```
pub fn scope_for(tenant: &str, method_path: &str, key: &str) -> Scope {
    Scope::for_call(tenant, method_path, key)
}

/// The key of a call made while serving a protected call (see
/// [`idem_core::derive`]): the first 16 bytes, in lower-case hex (32 characters, a valid
/// key), of SHA-256 over a version tag, the inbound record's scope digest `seed`, the
/// length-prefixed method path, and the call's position or step:
///
/// ```text
/// SHA-256("idem-derived-key-v1" ‖ seed ‖ u64 len ‖ path ‖ "#" ‖ u64 n)     // n-th call
/// SHA-256("idem-derived-key-v1" ‖ seed ‖ u64 len ‖ path ‖ "@" ‖ step)      // named step
/// ```
///
/// The layer runs each handler with a `KeySource` that uses it, so a client layer in
/// the handler derives keys with it.
pub fn derived_key(seed: &[u8; 32], method_path: &str, which: Which<'_>) -> IdempotencyKey {
    let mut h = Sha256::new();
    h.update(b"idem-derived-key-v1");
    h.update(seed);
    h.update((method_path.len() as u64).to_be_bytes());
    h.update(method_path.as_bytes());
    match which {
        Which::Position(n) => {
            h.update(b"#");
            h.update(n.to_be_bytes());
        }
        Which::Step(step) => {
            h.update(b"@");
            h.update(step.as_bytes());
        }
    }
    let digest = h.finalize();
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut out = [0u8; 32];
    for (i, b) in digest[..16].iter().enumerate() {
        out[2 * i] = HEX[usize::from(b >> 4)];
        out[2 * i + 1] = HEX[usize::from(b & 0xf)];
    }
    // 32 hex digits are always a valid key.
    IdempotencyKey::parse(&out).unwrap_or_else(|_| IdempotencyKey::generate())
}

/// The store's name for a tenant: the first 16 bytes of SHA-256 over a version tag and
/// the tenant, so a store can keep per-tenant bounds without holding tenant names.
pub fn tenant_id(tenant: &str) -> TenantId {
    let mut h = Sha256::new();
    h.update(b"idem-tenant-v1");
    h.update(tenant.as_bytes());
    let d: [u8; 32] = h.finalize().into();
    let mut id = [0; 16];
    id.copy_from_slice(&d[..16]);
    TenantId(id)
}

/// [`tenant_id`] of the tenants a layer has seen, so a call pays a map lookup, not a
/// SHA-256. Bounded: tenants come from callers (a header source), so past
/// [`TENANT_IDS_MAX`] entries, or for names over [`TENANT_NAME_CACHED_MAX`] bytes, the
/// digest is computed each time instead.
#[derive(Debug, Default)]
pub(crate) struct TenantIds(std::sync::RwLock<std::collections::HashMap<String, TenantId>>);

/// Most tenants remembered by one layer.
pub(crate) const TENANT_IDS_MAX: usize = 4096;
/// Longest tenant name remembered.
pub(crate) const TENANT_NAME_CACHED_MAX: usize = 128;

impl TenantIds {
    /// The store's name for `tenant`.
    pub(crate) fn of(&self, tenant: &str) -> TenantId {
        use std::sync::PoisonError;
        if let Some(id) = self
            .0
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(tenant)
        {
            return *id;
        }
        let id = tenant_id(tenant);
        if tenant.len() <= TENANT_NAME_CACHED_MAX {
            let mut ids = self.0.write().unwrap_or_else(PoisonError::into_inner);
            if ids.len() < TENANT_IDS_MAX {
                ids.insert(tenant.to_owned(), id);
            }
        }
        id
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.0.read().unwrap().len()
    }
}

/// Version tag of the message-list fingerprint. Records hold fingerprints: changing
/// what is hashed makes every stored record a mismatch.
const FINGERPRINT_V1: &[u8] = b"idem-fp-v1";
/// Small messages are gathered to this size before SHA-256 sees them: one hash update
/// per message costs more than the message when messages are empty. The stage is
/// inline (the fingerprinter lives on the reading thread's stack): a unary request's
/// message usually fits, and a heap buffer per request costs more than hashing it.
const STAGE: usize = 1024;

/// The fingerprint of a request, fed one message at a time: SHA-256 over
/// `idem-fp-v1`, then each message as a big-endian `u64` length and its (decompressed)
/// bytes.
pub(crate) struct Fingerprinter {
    sha: Sha256,
    stage: [u8; STAGE],
    /// How much of `stage` is filled.
    staged: usize,
    /// Bytes fed to SHA-256 so far, prefixes included.
    pub(crate) hashed: u64,
}

impl Fingerprinter {
    pub(crate) fn new() -> Self {
        let mut sha = Sha256::new();
        sha.update(FINGERPRINT_V1);
        Fingerprinter {
            sha,
            stage: [0; STAGE],
            staged: 0,
            hashed: 0,
        }
    }

    pub(crate) fn message(&mut self, m: &[u8]) {
        self.hashed += 8 + m.len() as u64;
        self.stage(&(m.len() as u64).to_be_bytes());
        if self.staged + m.len() <= STAGE {
            self.stage(m);
        } else {
            self.flush();
            self.sha.update(m);
        }
    }

    /// Appends `bytes` (which fit after a flush: at most `STAGE`) to the stage.
    fn stage(&mut self, bytes: &[u8]) {
        if self.staged + bytes.len() > STAGE {
            self.flush();
        }
        self.stage[self.staged..self.staged + bytes.len()].copy_from_slice(bytes);
        self.staged += bytes.len();
    }

    fn flush(&mut self) {
        self.sha.update(&self.stage[..self.staged]);
        self.staged = 0;
    }

    pub(crate) fn finish(mut self) -> Fingerprint {
        self.flush();
        Fingerprint(self.sha.finalize().into())
    }
}

/// The fingerprint of a message list, as its definition reads ([`Fingerprinter`] must
/// agree with it).
#[cfg(test)]
pub(crate) fn fingerprint_messages(messages: &[Bytes]) -> Fingerprint {
    let mut h = Sha256::new();
    h.update(FINGERPRINT_V1);
    for m in messages {
        h.update((m.len() as u64).to_be_bytes());
        h.update(m);
    }
    Fingerprint(h.finalize().into())
}

/// Fingerprint of the canonical bytes a custom hook returned.
pub(crate) fn fingerprint_custom(canonical: &[u8]) -> Fingerprint {
    let mut h = Sha256::new();
    h.update(b"idem-fp-custom-v1");
    h.update(canonical);
    Fingerprint(h.finalize().into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remembered_tenant_ids_are_the_digest_and_bounded() {
        let ids = TenantIds::default();
        assert_eq!(ids.of("acme"), tenant_id("acme"));
        assert_eq!(ids.of("acme"), tenant_id("acme"));
        assert_eq!(ids.len(), 1);
        let long = "x".repeat(TENANT_NAME_CACHED_MAX + 1);
        assert_eq!(ids.of(&long), tenant_id(&long));
        assert_eq!(ids.len(), 1, "long names are not remembered");
        for i in 0..2 * TENANT_IDS_MAX {
            let t = format!("t{i}");
            assert_eq!(ids.of(&t), tenant_id(&t));
        }
        assert_eq!(ids.len(), TENANT_IDS_MAX);
    }

    #[test]
    fn derived_keys_are_valid_and_depend_on_every_input() {
        let k = derived_key(&[1; 32], "/s.S/M", Which::Position(0));
        assert_eq!(k.as_str().len(), 32);
        assert_eq!(k, derived_key(&[1; 32], "/s.S/M", Which::Position(0)));
        for other in [
            derived_key(&[2; 32], "/s.S/M", Which::Position(0)),
            derived_key(&[1; 32], "/s.S/N", Which::Position(0)),
            derived_key(&[1; 32], "/s.S/M", Which::Position(1)),
            derived_key(&[1; 32], "/s.S/M", Which::Step("0")),
        ] {
            assert_ne!(other, k);
        }
    }

    #[test]
    fn scope_parts_are_length_prefixed() {
        assert_ne!(
            scope_for("t", "/a/b", "kkkkkkkk"),
            scope_for("t", "/a/b", "kkkkkkkK")
        );
        assert_ne!(scope_for("t1", "/a/b", "k"), scope_for("t", "1/a/b", "k"));
        assert_eq!(
            scope_for("t", "/a/b", "kkkkkkkk"),
            scope_for("t", "/a/b", "kkkkkkkk")
        );
    }

    #[test]
    fn fingerprinter_agrees_with_the_definition_whatever_the_message_sizes() {
        let sizes = [
            0,
            1,
            7,
            8,
            STAGE - 9,
            STAGE - 8,
            STAGE,
            STAGE + 1,
            3 * STAGE,
            0,
            5,
            // 21 bytes staged before it: this one leaves the stage 2 short of full, so
            // the next length prefix flushes it.
            STAGE - 31,
            2,
            3,
        ];
        let msgs: Vec<Bytes> = sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| Bytes::from(vec![i as u8; n]))
            .collect();
        for k in 0..=msgs.len() {
            let mut f = Fingerprinter::new();
            for m in &msgs[..k] {
                f.message(m);
            }
            assert_eq!(f.finish(), fingerprint_messages(&msgs[..k]), "first {k}");
        }
    }
}
