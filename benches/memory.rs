//! Memory per stored record in `MemoryStore`: `cargo bench --bench memory`.
//!
//! A counting global allocator (`stats_alloc`) sees every heap byte. The bench inserts
//! 100,000 completed records through the `Store` trait (claim, then complete with a
//! response of `RESPONSE` bytes) and reports the live heap bytes they added, minus the
//! response bytes themselves, per record. It is its own bench binary so the counting
//! allocator does not slow the timing benchmarks in `layers`.
//!
//! What is not counted: the allocator's own per-allocation headers and free-list slack
//! (glibc malloc adds 8-16 bytes per allocation), which only the resident set shows.

use std::alloc::System;
use std::time::Duration;

use bytes::Bytes;
use idem_store::memory::{MemoryStore, MemoryStoreSettings};
use idem_store::{
    Claim, ClaimRequest, ClaimantId, CompleteRequest, Fingerprint, RecordState, Scope, Store,
    StoredOutcome,
};
use stats_alloc::{INSTRUMENTED_SYSTEM, Region, StatsAlloc};

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

const RECORDS: usize = 100_000;
const TARGET: f64 = 256.0;

/// Net heap bytes of a region. `stats_alloc` counts a `realloc`'s growth (or shrink) in
/// `bytes_allocated` (or `bytes_deallocated`) already; its `bytes_reallocated` is the
/// same amount again, so adding it would count every grown `VecDeque` twice.
fn live(stats: stats_alloc::Stats) -> i64 {
    stats.bytes_allocated as i64 - stats.bytes_deallocated as i64
}

/// Inserts `RECORDS` completed records with `response` bytes each; returns net heap
/// bytes added per record beyond the response.
async fn per_record(response: usize) -> (f64, f64) {
    let store = MemoryStore::new(MemoryStoreSettings {
        max_entries: 10 * RECORDS,
        max_bytes: 1 << 34,
        ..MemoryStoreSettings::default()
    });
    // Scopes and fingerprints made before measuring: the store copies them in.
    let scopes: Vec<Scope> = (0..RECORDS)
        .map(|_| Scope(rand::random::<[u8; 32]>()))
        .collect();
    let fingerprint = Fingerprint(rand::random::<[u8; 32]>());
    let lease = Duration::from_secs(60);
    let ttl = Duration::from_secs(24 * 3600);

    let region = Region::new(GLOBAL);
    for scope in &scopes {
        let claim = store
            .claim(ClaimRequest {
                scope,
                tenant: &idem_store::TenantId::default(),
                fingerprint: &fingerprint,
                claimant: ClaimantId(1),
                lease,
            })
            .await
            .expect("claim");
        let Claim::Acquired { fence, .. } = claim else {
            panic!("fresh scope not acquired: {claim:?}");
        };
        let body = Bytes::from(vec![7u8; response]);
        store
            .complete(CompleteRequest {
                scope,
                fence,
                outcome: StoredOutcome::Response(body),
                ttl,
            })
            .await
            .expect("complete");
    }
    let added = live(region.change());
    assert_eq!(store.len(), RECORDS);
    // Every record is there and holds its response.
    match store.get(&scopes[RECORDS / 2]).await.expect("get") {
        Some(RecordState::Completed { outcome, .. }) => assert_eq!(outcome.len(), response),
        other => panic!("record not completed: {other:?}"),
    }
    let total = added as f64 / RECORDS as f64;
    drop(store);
    (total, total - response as f64)
}

fn main() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        println!("MemoryStore, {RECORDS} completed records inserted through the Store trait");
        println!("| response bytes | heap bytes per record | beyond the response | target ≤ 256 |");
        println!("|---:|---:|---:|---|");
        for response in [16usize, 128, 1024] {
            let (total, beyond) = per_record(response).await;
            println!(
                "| {response} | {total:.0} | **{beyond:.0}** | {} |",
                if beyond <= TARGET { "met" } else { "MISSED" }
            );
        }
        println!(
            "(live heap bytes from a counting global allocator; the map's power-of-two \
             growth puts the table between 44 % and 88 % full, so the number moves with \
             the record count)"
        );
    });
}
