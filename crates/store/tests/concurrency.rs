//! Passes on several threads share one store: demand and prefetch of overlapping records, a slab far smaller
//! than the records, so slots are evicted and refilled all the time. Every record handed out must hold its
//! own bytes — a slot refilled under a pass that still uses it would hand out another record's. The same
//! passes run over a cache holding every record, served from the file's mapping.

use deltafin_store::{ExpertStore, Extent, RecordLoc, StoreOptions};
use std::sync::Arc;

const LAYERS: usize = 3;
const EXPERTS: usize = 24;
const RECORD: usize = 16 * 4096 + 100;

/// The byte at `i` of record (l, e).
fn byte(l: usize, e: usize, i: usize) -> u8 {
    (l * 131 + e * 31 + i * 7 + i / 251) as u8
}

#[test]
fn concurrent_passes_always_get_their_own_bytes() {
    let t = tempfile::tempdir().unwrap();
    let path = t.path().join("records.bin");
    let mut data = Vec::new();
    let mut layers = Vec::new();
    for l in 0..LAYERS {
        let mut recs = Vec::new();
        for e in 0..EXPERTS {
            recs.push(RecordLoc {
                extents: vec![Extent {
                    file: 0,
                    offset: data.len() as u64,
                    len: RECORD,
                }],
                checksum: None,
            });
            data.extend((0..RECORD).map(|i| byte(l, e, i)));
        }
        layers.push(recs);
    }
    std::fs::write(&path, &data).unwrap();
    let all = (LAYERS * EXPERTS) as u64 * deltafin_store::slot_bytes(RECORD);
    // (direct reads, cache bytes, served from the page cache)
    for (direct_io, cache_bytes, mapped) in [
        (true, 2 * RECORD as u64, false),
        (false, 2 * RECORD as u64, false),
        (true, all, true),
    ] {
        let store = Arc::new(
            ExpertStore::new(
                &[(path.clone(), 0)],
                layers.clone(),
                RECORD,
                StoreOptions {
                    cache_bytes,
                    map_files: mapped,
                    working_slots: 8,
                    direct_io,
                    workers_per_drive: 2,
                    chunk_bytes: 4096,
                    ..StoreOptions::default()
                },
                "test".into(),
            )
            .unwrap(),
        );
        assert_eq!(store.in_page_cache(), mapped && cfg!(target_os = "linux"));
        let threads: Vec<_> = (0..8)
            .map(|id| {
                let store = store.clone();
                std::thread::spawn(move || {
                    let mut rng = id as u64 * 7919 + 1;
                    let mut next = || {
                        rng = rng
                            .wrapping_mul(6364136223846793005)
                            .wrapping_add(1442695040888963407);
                        (rng >> 33) as usize
                    };
                    for _ in 0..600 {
                        let l = next() % LAYERS;
                        let mut ids: Vec<usize> = (0..3).map(|_| next() % EXPERTS).collect();
                        ids.sort_unstable();
                        ids.dedup();
                        // Predicted just before they are asked for: demand finds them still loading.
                        store.prefetch(l, &ids);
                        let mut fetch = store.fetch(l, &ids);
                        let ahead: Vec<usize> = (0..3).map(|_| next() % EXPERTS).collect();
                        store.prefetch((l + 1) % LAYERS, &ahead);
                        while let Some(r) = fetch.next() {
                            let r = r.unwrap();
                            let bytes = r.bytes();
                            let bad = (0..RECORD).find(|&i| bytes[i] != byte(l, r.expert, i));
                            assert!(
                                bad.is_none(),
                                "layer {l} expert {}: wrong byte at {bad:?}",
                                r.expert
                            );
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
    }
}
