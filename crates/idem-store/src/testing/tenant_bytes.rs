//! Conformance for a store's per-tenant stored-bytes bound (`maxBytesPerTenant`): a
//! tenant at its bound is refused new records and keeps no response that does not fit,
//! while other tenants, and its own replays, go on; a release or an expiry makes room.

use super::*;

/// The per-tenant bytes bound [`tenant_bytes_bound`] expects the store to have (and an
/// in-flight bound, if any, of at least 64).
pub const TENANT_BYTES_BOUND: usize = 8 * 1024;

/// Conformance, for a store built with a per-tenant bytes bound of
/// [`TENANT_BYTES_BOUND`] (not part of [`store_conformance_tests!`](crate::store_conformance_tests):
/// call it from a test that builds such a store). The store charges each record its
/// response plus some overhead of its own (at least one byte).
///
/// A response larger than the bound is recorded as not retained (the record completes;
/// its replay is `NotRetained`). Filling the bound with 1000-byte responses ends in a
/// claim refused with [`StoreError::Full`] (or, first, responses not retained); then
/// another tenant still claims and keeps its response, the tenant's kept responses
/// still replay, and releasing one of its in-flight records, or a record's TTL ending,
/// lets it claim again.
///
/// Takes about a lease (300 ms) of the store's clock.
pub async fn tenant_bytes_bound<S: Store>(s: &S) {
    let leak = |x: Scope| -> &'static Scope { Box::leak(Box::new(x)) };
    let a: &'static TenantId = Box::leak(Box::new(TenantId(rand::random())));
    let b: &'static TenantId = Box::leak(Box::new(TenantId(rand::random())));
    let claim = |t: &'static TenantId, sc: &'static Scope| {
        s.claim(ClaimRequest {
            tenant: t,
            ..req(sc, &FP16, ClaimantId::random(), LONG)
        })
    };
    let acquired = |c: Result<Claim, StoreError>| match c {
        Ok(Claim::Acquired { fence, .. }) => fence,
        other => panic!("expected Acquired, got {other:?}"),
    };
    let body = |n: usize| StoredOutcome::Response(Bytes::from(vec![0x5a; n]));

    // Held in flight from the start, released once the tenant is full.
    let held = leak(scope());
    let held_fence = acquired(claim(a, held).await);
    // Too large on its own: completed, not retained.
    let huge = leak(scope());
    let f = acquired(claim(a, huge).await);
    s.complete(completion(huge, f, body(TENANT_BYTES_BOUND + 1), LONG))
        .await
        .unwrap();
    assert_eq!(
        claim(a, huge).await.unwrap(),
        Claim::Completed(StoredOutcome::NotRetained)
    );

    // Fill the tenant's bytes until a claim is refused.
    let mut kept = Vec::new();
    let mut refused = None;
    for _ in 0..200 {
        let sc = leak(scope());
        match claim(a, sc).await {
            Ok(Claim::Acquired { fence, .. }) => {
                s.complete(completion(sc, fence, body(1000), LONG))
                    .await
                    .unwrap();
                if claim(a, sc).await.unwrap() == Claim::Completed(body(1000)) {
                    kept.push(sc);
                }
            }
            Err(StoreError::Full(e)) => {
                refused = Some(e);
                break;
            }
            other => panic!("expected Acquired or Full, got {other:?}"),
        }
    }
    assert!(
        refused.is_some(),
        "200 records of 1000 bytes never filled the tenant"
    );
    assert!(
        !kept.is_empty() && kept.len() <= TENANT_BYTES_BOUND / 1000,
        "{} responses of 1000 bytes kept within {TENANT_BYTES_BOUND} bytes",
        kept.len()
    );

    // Another tenant is not affected.
    let other = leak(scope());
    let f = acquired(claim(b, other).await);
    s.complete(completion(other, f, body(1000), LONG))
        .await
        .unwrap();
    assert_eq!(claim(b, other).await.unwrap(), Claim::Completed(body(1000)));
    // The full tenant's replays are answered, not refused.
    for sc in &kept {
        assert_eq!(claim(a, sc).await.unwrap(), Claim::Completed(body(1000)));
    }

    // A release makes room at once.
    s.release(held, held_fence).await.unwrap();
    let next = leak(scope());
    let f = acquired(claim(a, next).await);
    // Full again, until this record's TTL ends.
    s.complete(completion(next, f, StoredOutcome::NotRetained, LEASE))
        .await
        .unwrap();
    eventually("room after a record's ttl ended", || async {
        let sc = leak(scope());
        match claim(a, sc).await {
            Ok(Claim::Acquired { .. }) => Some(()),
            Err(StoreError::Full(_)) => None,
            other => panic!("expected Acquired or Full, got {other:?}"),
        }
    })
    .await;
}
