//! The lookahead reads a layer's predictions only once their precision is measured, and never evicts what
//! the expert cache holds: a prediction takes a free slot, the slot of an earlier prediction nobody asked
//! for, or one of the working set's records beyond the cache's slots; a wrong one stops being read when the
//! layer's demand comes.

use deltafin_store::{ExpertStore, Extent, RecordLoc, StoreOptions};
use std::time::{Duration, Instant};

const EXPERTS: usize = 8;
const RECORD: usize = 4096;

/// A store over 2 layers of 8 one-page records with room for 8 records (4 working slots + 4 cached).
fn store(dir: &std::path::Path) -> ExpertStore {
    store_caching(dir, 4)
}

/// 2 layers of 8 records of `len` bytes, back to back in file 0.
fn layout(len: usize) -> Vec<Vec<RecordLoc>> {
    (0..2)
        .map(|l| {
            (0..EXPERTS)
                .map(|e| RecordLoc {
                    extents: vec![Extent {
                        file: 0,
                        offset: ((l * EXPERTS + e) * len) as u64,
                        len,
                    }],
                    checksum: None,
                })
                .collect()
        })
        .collect()
}

fn store_caching(dir: &std::path::Path, cached_records: u64) -> ExpertStore {
    let path = dir.join("records.bin");
    let layers = layout(RECORD);
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

/// Waits until `bytes` of predictions were read and every read has finished (a read's bytes are counted
/// just before its record is marked done).
fn wait_for_prefetch_bytes(store: &ExpertStore, bytes: u64) {
    let t0 = Instant::now();
    while store.snapshot().prefetch_bytes < bytes || store.records_loading() > 0 {
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
fn a_prediction_never_takes_a_record_the_cache_holds() {
    let t = tempfile::tempdir().unwrap();
    let s = store(t.path());
    assert_eq!(s.slots(), 8);
    measure_layer_1(&s);
    // 8 demanded records in 8 slots: the cache's 4 most recent, and 4 left in the working set.
    demand(&s, 0, &(0..7).collect::<Vec<_>>());
    s.prefetch(1, &[1, 2, 3, 4, 5]);
    assert_eq!(
        s.snapshot().prefetch_issued,
        4,
        "predictions take the working set's records, not the cache's"
    );
    wait_for_prefetch_bytes(&s, 4 * RECORD as u64);
    // The misses take the unclaimed predictions' slots (never used, they score lowest): whichever 4 records
    // the policy kept, they are hits.
    let hits = s.snapshot().hits;
    demand(&s, 0, &(0..7).collect::<Vec<_>>());
    demand(&s, 1, &[0]);
    assert_eq!(
        s.snapshot().hits - hits,
        4,
        "the cache's records are still there"
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

/// Holds every read of one file range at the gate until it opens; counts the reads waiting there.
#[derive(Debug, Default)]
struct Gate {
    range: std::ops::Range<u64>,
    state: std::sync::Mutex<(bool, usize)>,
    cv: std::sync::Condvar,
}

impl deltafin_store::io::FaultInjector for Gate {
    fn before_read(
        &self,
        _: &std::path::Path,
        offset: u64,
        _: usize,
    ) -> Option<deltafin_store::io::Fault> {
        if self.range.contains(&offset) {
            let mut s = self.state.lock().unwrap();
            s.1 += 1;
            self.cv.notify_all();
            while !s.0 {
                s = self.cv.wait(s).unwrap();
            }
        }
        None
    }
}

#[test]
fn a_wrong_prediction_stops_being_read_when_the_demand_comes() {
    const PAGES: usize = 16;
    const BIG: usize = PAGES * 4096;
    let t = tempfile::tempdir().unwrap();
    let path = t.path().join("records.bin");
    let layers = layout(BIG);
    let bytes: Vec<u8> = (0..2 * EXPERTS * BIG).map(|i| (i / BIG) as u8).collect();
    std::fs::write(&path, bytes).unwrap();
    // Layer 1 expert 5: its reads wait at the gate.
    let at = ((EXPERTS + 5) * BIG) as u64;
    let gate = std::sync::Arc::new(Gate {
        range: at..at + BIG as u64,
        ..Gate::default()
    });
    let opts = StoreOptions {
        cache_bytes: 4 * deltafin_store::slot_bytes(BIG),
        working_slots: 4,
        // One prediction read in flight at a time, one worker left for demand.
        workers_per_drive: 2,
        chunk_bytes: 4096,
        faults: Some(gate.clone()),
        ..StoreOptions::default()
    };
    let s = ExpertStore::new(&[(path, 0)], layers, BIG, opts, "test".into()).unwrap();
    let check = |layer: usize, experts: &[usize]| {
        let mut f = s.fetch(layer, experts);
        while let Some(r) = f.next() {
            let r = r.unwrap();
            let want = (layer * EXPERTS + r.expert) as u8;
            assert!(r.bytes().iter().all(|&b| b == want), "expert {}", r.expert);
        }
    };
    for _ in 0..8 {
        s.prefetch(1, &[0]);
        check(1, &[0]);
    }
    let before = s.snapshot();
    s.prefetch(1, &[5]);
    assert_eq!(s.snapshot().prefetch_issued - before.prefetch_issued, 1);
    let t0 = Instant::now();
    while gate.state.lock().unwrap().1 == 0 {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "no read reached the gate"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    // The demand names another expert: the guess's reads not yet started are dropped.
    check(1, &[1]);
    *gate.state.lock().unwrap() = (true, 1);
    gate.cv.notify_all();
    // The guessed record, asked for now, is read again by demand, whole and right.
    check(1, &[5]);
    // The chunk that was in flight is counted once its reader, released with the gate, finishes.
    wait_for_prefetch_bytes(&s, before.prefetch_bytes + 4096);
    let after = s.snapshot().since(&before);
    assert_eq!(
        after.prefetch_bytes, 4096,
        "only the chunk in flight was read"
    );
    assert_eq!(after.prefetch_hits, 0);
    assert_eq!(after.demand_bytes, 2 * BIG as u64);
}
