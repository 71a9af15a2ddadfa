//! Conformance of the operator's calls: [`Store::read_record`] and
//! [`Store::delete_record`].

use super::{LEASE, LONG, acquire, fp, resp, scope};
use crate::{
    Claim, CompleteRequest, DeleteMode, Deletion, RecordState, Store, StoreError, StoredOutcome,
};

async fn claim_fence<S: Store>(s: &S, sc: &crate::Scope) -> u64 {
    match s
        .claim(super::req(sc, &fp(1), crate::ClaimantId::random(), LONG))
        .await
        .unwrap()
    {
        Claim::Acquired { fence, .. } => fence,
        other => panic!("a deleted record is claimed again, got {other:?}"),
    }
}

/// A completed record reads back with its outcome; a delete removes it and reports it;
/// the next claim runs again with a higher fence.
pub async fn read_and_delete_a_completed_record<S: Store>(s: &S) {
    let sc = scope();
    let fence = acquire(s, &sc, &fp(1), LONG).await;
    s.complete(CompleteRequest {
        scope: &sc,
        fence,
        outcome: resp(b"IDR1 the reply"),
        ttl: LONG,
    })
    .await
    .unwrap();
    let info = s.read_record(&sc).await.unwrap().expect("the record reads");
    let want = RecordState::Completed {
        fence,
        fingerprint: fp(1),
        outcome: resp(b"IDR1 the reply"),
    };
    assert_eq!(info.state, want);
    assert!(!info.is_in_flight());
    if let Some(left) = info.expires_in {
        assert!(left <= LONG, "TTL left {left:?} over the TTL given");
    }
    // Times the store keeps come in order (the memory store's creation time is rounded
    // down to the second, so never after the completion).
    if let (Some(created), Some(completed)) = (info.created_at, info.completed_at) {
        assert!(
            created <= completed,
            "created {created:?} after {completed:?}"
        );
    }
    // Reading changed nothing: a claim with the same fingerprint still replays.
    let again = s
        .claim(super::req(&sc, &fp(1), crate::ClaimantId::random(), LONG))
        .await
        .unwrap();
    assert_eq!(again, Claim::Completed(resp(b"IDR1 the reply")));

    match s
        .delete_record(&sc, DeleteMode::UnlessInFlight)
        .await
        .unwrap()
    {
        Deletion::Deleted(gone) => assert_eq!(gone.state, want),
        other => panic!("a completed record is deleted without force, got {other:?}"),
    }
    assert!(s.read_record(&sc).await.unwrap().is_none());
    assert!(
        s.get(&sc)
            .await
            .unwrap()
            .is_none_or(|r| matches!(r, RecordState::Released { .. }))
    );
    let next = claim_fence(s, &sc).await;
    assert!(next > fence, "fence {next} after a delete of fence {fence}");
}

/// An in-flight record is not deleted without force, and the refusal changes nothing;
/// forced, it goes, its holder is fenced, and the next claim runs with a higher fence.
pub async fn delete_refuses_in_flight_unless_forced<S: Store>(s: &S) {
    let sc = scope();
    let fence = acquire(s, &sc, &fp(1), LONG).await;
    let info = s.read_record(&sc).await.unwrap().expect("the record reads");
    assert!(
        matches!(info.state, RecordState::InFlight { fence: f, fingerprint, .. }
            if f == fence && fingerprint == fp(1)),
        "read {info:?}"
    );
    match s
        .delete_record(&sc, DeleteMode::UnlessInFlight)
        .await
        .unwrap()
    {
        // The same claim (a networked store computes the lease end anew on each read).
        Deletion::RefusedInFlight(held) => assert!(
            matches!(held.state, RecordState::InFlight { fence: f, .. } if f == fence),
            "refused {held:?}"
        ),
        other => panic!("an in-flight record is refused without force, got {other:?}"),
    }
    // Still held: the holder renews.
    s.renew(&sc, fence, LONG).await.unwrap();

    match s.delete_record(&sc, DeleteMode::Force).await.unwrap() {
        Deletion::Deleted(gone) => assert!(gone.is_in_flight(), "deleted {gone:?}"),
        other => panic!("a forced delete deletes, got {other:?}"),
    }
    assert!(s.read_record(&sc).await.unwrap().is_none());
    let stale = s
        .complete(CompleteRequest {
            scope: &sc,
            fence,
            outcome: StoredOutcome::NotRetained,
            ttl: LONG,
        })
        .await;
    assert!(
        matches!(stale, Err(StoreError::Fenced { .. })),
        "the holder of a deleted record is fenced, got {stale:?}"
    );
    let next = claim_fence(s, &sc).await;
    assert!(
        next > fence,
        "fence {next} after a forced delete of fence {fence}"
    );
    s.release(&sc, next).await.unwrap();
}

/// No record: the read is `None`, the delete `NotFound`, and neither makes one.
pub async fn no_record_reads_none_and_deletes_nothing<S: Store>(s: &S) {
    let sc = scope();
    assert!(s.read_record(&sc).await.unwrap().is_none());
    for mode in [DeleteMode::UnlessInFlight, DeleteMode::Force] {
        assert_eq!(
            s.delete_record(&sc, mode).await.unwrap(),
            Deletion::NotFound
        );
    }
    // Released records are gone too (or a tombstone that reads as nothing to delete).
    let fence = acquire(s, &sc, &fp(1), LEASE).await;
    s.release(&sc, fence).await.unwrap();
    assert!(
        s.read_record(&sc)
            .await
            .unwrap()
            .is_none_or(|r| matches!(r.state, RecordState::Released { .. }))
    );
    assert!(
        s.get(&sc)
            .await
            .unwrap()
            .is_none_or(|r| matches!(r, RecordState::Released { .. }))
    );
}
