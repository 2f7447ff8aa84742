//! The lookahead reads a layer's predictions only once their precision is measured, and never evicts what
//! demand brought in: a prediction takes a free slot or the slot of an earlier prediction nobody asked for,
//! so a full cache keeps every record the next pass may reuse.

use deltafin_store::{ExpertStore, Extent, RecordLoc, StoreOptions};
use std::time::{Duration, Instant};

const EXPERTS: usize = 8;
const RECORD: usize = 4096;

/// A store over 2 layers of 8 one-page records with room for 8 records (4 working slots + 4 cached).
fn store(dir: &std::path::Path) -> ExpertStore {
    store_caching(dir, 4)
}

fn store_caching(dir: &std::path::Path, cached_records: u64) -> ExpertStore {
    let path = dir.join("records.bin");
    let layers: Vec<Vec<RecordLoc>> = (0..2)
        .map(|l| {
            (0..EXPERTS)
                .map(|e| RecordLoc {
                    extents: vec![Extent {
                        file: 0,
                        offset: ((l * EXPERTS + e) * RECORD) as u64,
                        len: RECORD,
                    }],
                    checksum: None,
                })
                .collect()
        })
        .collect();
    std::fs::write(&path, vec![7u8; 2 * EXPERTS * RECORD]).unwrap();
    let opts = StoreOptions {
        cache_bytes: cached_records * deltafin_store::slot_bytes(RECORD),
        working_slots: 4,
        workers_per_drive: 2,
        ..StoreOptions::default()
    };
    ExpertStore::new(&[(path, 0)], layers, RECORD, opts, "test".into()).unwrap()
}

/// Demand for `experts` of `layer`, every record taken and released.
fn demand(store: &ExpertStore, layer: usize, experts: &[usize]) {
    let mut f = store.fetch(layer, experts);
    while let Some(r) = f.next() {
        assert_eq!(r.unwrap().bytes()[0], 7);
    }
}

fn wait_for_prefetch_bytes(store: &ExpertStore, bytes: u64) {
    let t0 = Instant::now();
    while store.snapshot().prefetch_bytes < bytes {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "prefetch never completed"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// 32 right predictions of layer 1 (expert 0), which is then cached. On an idle drive, a layer predicted
/// right every time passes the lookahead's cost test.
fn measure_layer_1(store: &ExpertStore) {
    for _ in 0..32 {
        store.prefetch(1, &[0]);
        demand(store, 1, &[0]);
    }
}

#[test]
fn an_unmeasured_prediction_is_not_read() {
    let t = tempfile::tempdir().unwrap();
    let s = store(t.path());
    s.prefetch(1, &[0]);
    assert_eq!(s.snapshot().prefetch_issued, 0);
    measure_layer_1(&s);
    s.prefetch(1, &[1]);
    assert_eq!(
        s.snapshot().prefetch_issued,
        1,
        "a measured layer's prediction is read"
    );
}

#[test]
fn a_cache_holding_every_record_reads_predictions_at_once() {
    // The background fill would read a wrong guess anyway: nothing to weigh.
    let t = tempfile::tempdir().unwrap();
    let s = store_caching(t.path(), 12);
    assert_eq!(s.slots(), 16);
    s.prefetch(1, &[0]);
    assert_eq!(s.snapshot().prefetch_issued, 1);
}

#[test]
fn a_full_cache_of_demanded_records_takes_no_prediction() {
    let t = tempfile::tempdir().unwrap();
    let s = store(t.path());
    assert_eq!(s.slots(), 8);
    measure_layer_1(&s);
    demand(&s, 0, &(0..7).collect::<Vec<_>>());
    s.prefetch(1, &[1, 2, 3]);
    assert_eq!(
        s.snapshot().prefetch_issued,
        0,
        "no slot may be taken from demand"
    );
    let hits = s.snapshot().hits;
    demand(&s, 0, &(0..7).collect::<Vec<_>>());
    demand(&s, 1, &[0]);
    assert_eq!(
        s.snapshot().hits - hits,
        8,
        "every demanded record is still cached"
    );
}

#[test]
fn a_prediction_takes_a_free_slot_then_recycles_unclaimed_ones() {
    let t = tempfile::tempdir().unwrap();
    let s = store(t.path());
    measure_layer_1(&s);
    demand(&s, 0, &(0..6).collect::<Vec<_>>());
    s.prefetch(1, &[1]);
    assert_eq!(s.snapshot().prefetch_issued, 1, "the free slot is taken");
    wait_for_prefetch_bytes(&s, RECORD as u64);
    s.prefetch(1, &[2]);
    assert_eq!(
        s.snapshot().prefetch_issued,
        2,
        "the unclaimed prediction's slot is reused"
    );
    wait_for_prefetch_bytes(&s, 2 * RECORD as u64);
    let before = s.snapshot();
    demand(&s, 0, &(0..6).collect::<Vec<_>>());
    demand(&s, 1, &[0, 2]);
    let after = s.snapshot();
    assert_eq!(after.hits - before.hits, 7, "the demanded records stayed");
    assert_eq!(after.prefetch_hits - before.prefetch_hits, 1);
}
