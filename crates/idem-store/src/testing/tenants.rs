//! Conformance for a store's per-tenant in-flight bound: a tenant at its bound is
//! refused new records while other tenants, and its own replays, go on.

use super::*;

/// The per-tenant in-flight bound [`tenant_in_flight_bound`] expects the store to have.
pub const TENANT_IN_FLIGHT_BOUND: usize = 4;

/// Conformance, for a store built with a per-tenant in-flight bound of
/// [`TENANT_IN_FLIGHT_BOUND`] (not part of [`store_conformance_tests!`](crate::store_conformance_tests):
/// call it from a test that builds such a store).
///
/// A tenant at its bound gets [`StoreError::Full`] for new records while another tenant
/// still acquires; the tenant's replays, in-flight duplicates and own re-claims are
/// not refused; completing or releasing one of its records makes room again.
pub async fn tenant_in_flight_bound<S: Store>(s: &S) {
    let a = TenantId(rand::random());
    let b = TenantId(rand::random());
    let as_tenant = |t: &'static TenantId, sc: &'static Scope, who| ClaimRequest {
        tenant: t,
        ..req(sc, &FP16, who, LONG)
    };
    let leak = |x: Scope| -> &'static Scope { Box::leak(Box::new(x)) };
    let a: &'static TenantId = Box::leak(Box::new(a));
    let b: &'static TenantId = Box::leak(Box::new(b));
    let mut held = Vec::new();
    for _ in 0..TENANT_IN_FLIGHT_BOUND {
        let sc = leak(scope());
        let who = ClaimantId::random();
        match s.claim(as_tenant(a, sc, who)).await.unwrap() {
            Claim::Acquired { fence, .. } => held.push((sc, who, fence)),
            other => panic!("expected Acquired, got {other:?}"),
        }
    }
    let refused = s
        .claim(as_tenant(a, leak(scope()), ClaimantId::random()))
        .await;
    assert!(matches!(refused, Err(StoreError::Full(_))), "{refused:?}");
    // Another tenant is not affected.
    let other = s
        .claim(as_tenant(b, leak(scope()), ClaimantId::random()))
        .await;
    assert!(matches!(other, Ok(Claim::Acquired { .. })), "{other:?}");
    // At its bound, A's duplicates and own re-claims are answered, not refused.
    let (sc0, who0, fence0) = held[0];
    assert!(matches!(
        s.claim(as_tenant(a, sc0, ClaimantId::random()))
            .await
            .unwrap(),
        Claim::InFlight { .. }
    ));
    assert_eq!(
        s.claim(as_tenant(a, sc0, who0)).await.unwrap(),
        Claim::Acquired {
            fence: fence0,
            takeover: false
        }
    );
    // Completing one makes room; its replay is not refused either.
    s.complete(completion(sc0, fence0, resp(b"a0"), LONG))
        .await
        .unwrap();
    assert_eq!(
        s.claim(as_tenant(a, sc0, ClaimantId::random()))
            .await
            .unwrap(),
        Claim::Completed(resp(b"a0"))
    );
    let next = s
        .claim(as_tenant(a, leak(scope()), ClaimantId::random()))
        .await;
    assert!(matches!(next, Ok(Claim::Acquired { .. })), "{next:?}");
    let full = s
        .claim(as_tenant(a, leak(scope()), ClaimantId::random()))
        .await;
    assert!(matches!(full, Err(StoreError::Full(_))), "{full:?}");
    // Releasing one makes room too.
    let (sc1, _, fence1) = held[1];
    s.release(sc1, fence1).await.unwrap();
    let again = s
        .claim(as_tenant(a, leak(scope()), ClaimantId::random()))
        .await;
    assert!(matches!(again, Ok(Claim::Acquired { .. })), "{again:?}");
}

/// Conformance across instances, for stores built as for [`tenant_in_flight_bound`]:
/// `3 ×` [`TENANT_IN_FLIGHT_BOUND`] claims of one tenant for new records, released at
/// once (a barrier) through `stores` in turn (instances sharing one backend, or clones
/// of one store), acquire exactly [`TENANT_IN_FLIGHT_BOUND`] records; every other claim
/// is refused with [`StoreError::Full`]. A bound checked before an insert without a
/// lock lets racing claims through.
pub async fn tenant_in_flight_bound_across_instances<S: Store>(stores: &[S]) {
    let tenant: &'static TenantId = Box::leak(Box::new(TenantId(rand::random())));
    let claims = 3 * TENANT_IN_FLIGHT_BOUND;
    let start = std::sync::Arc::new(tokio::sync::Barrier::new(claims));
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..claims {
        let (s, start) = (stores[i % stores.len()].clone(), start.clone());
        tasks.spawn(async move {
            let sc = scope();
            start.wait().await;
            s.claim(ClaimRequest {
                tenant,
                ..req(&sc, &FP16, ClaimantId::random(), LONG)
            })
            .await
        });
    }
    let (mut acquired, mut full) = (0, 0);
    while let Some(r) = tasks.join_next().await {
        match r.expect("a claim task") {
            Ok(Claim::Acquired { .. }) => acquired += 1,
            Err(StoreError::Full(_)) => full += 1,
            other => panic!("expected Acquired or Full, got {other:?}"),
        }
    }
    assert_eq!(
        (acquired, full),
        (TENANT_IN_FLIGHT_BOUND, claims - TENANT_IN_FLIGHT_BOUND),
        "claims acquired and refused"
    );
}
