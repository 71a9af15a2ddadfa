//! Shorthands for the store calls that the backends' own tests repeat.

use std::time::Duration;

use idem_store::{
    Claim, ClaimRequest, ClaimantId, CompleteRequest, Fence, Fingerprint, Scope, Store,
    StoredOutcome, TenantId,
};

/// The tenant of [`req`]'s claims.
pub const TENANT: TenantId = TenantId([3; 16]);
/// The fingerprint of [`req`]'s claims.
pub const FP: Fingerprint = Fingerprint([9; 32]);

/// A claim of `scope` by a new claimant, for [`TENANT`] with fingerprint [`FP`].
pub fn req(scope: &Scope, lease: Duration) -> ClaimRequest<'_> {
    ClaimRequest {
        scope,
        tenant: &TENANT,
        fingerprint: &FP,
        claimant: ClaimantId::random(),
        lease,
    }
}

/// Claims `scope` with [`req`] and returns the fence; panics unless the claim acquired
/// the record.
pub async fn acquire<S: Store>(store: &S, scope: &Scope, lease: Duration) -> Fence {
    match store.claim(req(scope, lease)).await {
        Ok(Claim::Acquired { fence, .. }) => fence,
        other => panic!("expected Acquired, got {other:?}"),
    }
}

/// Claims `scope` with [`req`] and returns the fence; panics unless the claim took over
/// a record whose lease ended.
pub async fn take_over<S: Store>(store: &S, scope: &Scope, lease: Duration) -> Fence {
    match store.claim(req(scope, lease)).await {
        Ok(Claim::Acquired {
            fence,
            takeover: true,
        }) => fence,
        other => panic!("expected a takeover, got {other:?}"),
    }
}

/// Completes `scope`'s record under `fence`, keeping no response, for a minute; panics
/// with `what` when the store refuses.
pub async fn complete_not_retained<S: Store>(store: &S, scope: &Scope, fence: Fence, what: &str) {
    store
        .complete(CompleteRequest {
            scope,
            fence,
            outcome: StoredOutcome::NotRetained,
            ttl: Duration::from_secs(60),
        })
        .await
        .expect(what);
}
