//! Asked to, and when the cache holds every record, the store serves records from read-only mappings of their
//! files (the page cache) instead of the slab — only then, and never where a mapping could show wrong bytes. A failed read of
//! a mapped range fails its record like a failed read into the slab.

#![cfg(target_os = "linux")]

use deltafin_store::io::{Backend, Fault, FaultInjector};
use deltafin_store::{slot_bytes, ExpertStore, Extent, RecordLoc, StoreOptions};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

const EXPERTS: usize = 6;
/// Not a whole number of pages, so records straddle page boundaries.
const RECORD: usize = 3 * 4096 + 500;

fn byte(e: usize, i: usize) -> u8 {
    (e * 37 + i * 11 + i / 4093) as u8
}

/// One layer of `EXPERTS` records written back to back (the last ends mid-page at the end of the file).
fn records(dir: &Path) -> (std::path::PathBuf, Vec<Vec<RecordLoc>>) {
    let path = dir.join("records.bin");
    let data: Vec<u8> = (0..EXPERTS)
        .flat_map(|e| (0..RECORD).map(move |i| byte(e, i)))
        .collect();
    std::fs::write(&path, data).unwrap();
    let layer = (0..EXPERTS)
        .map(|e| RecordLoc {
            extents: vec![Extent {
                file: 0,
                offset: (e * RECORD) as u64,
                len: RECORD,
            }],
            checksum: None,
        })
        .collect();
    (path, vec![layer])
}

fn options(cached_records: usize) -> StoreOptions {
    StoreOptions {
        cache_bytes: cached_records as u64 * slot_bytes(RECORD),
        working_slots: 2,
        workers_per_drive: 2,
        chunk_bytes: 4096,
        map_files: true,
        ..StoreOptions::default()
    }
}

fn open(path: &Path, layers: Vec<Vec<RecordLoc>>, opts: StoreOptions) -> ExpertStore {
    ExpertStore::new(
        &[(path.to_path_buf(), 0)],
        layers,
        RECORD,
        opts,
        "test".into(),
    )
    .unwrap()
}

/// Every record of the layer, checked byte for byte.
fn check_all(store: &ExpertStore) {
    let ids: Vec<usize> = (0..EXPERTS).collect();
    let mut fetch = store.fetch(0, &ids);
    let mut seen = 0;
    while let Some(r) = fetch.next() {
        let r = r.unwrap();
        let bad = (0..RECORD).find(|&i| r.bytes()[i] != byte(r.expert, i));
        assert!(bad.is_none(), "expert {}: wrong byte at {bad:?}", r.expert);
        seen += 1;
    }
    assert_eq!(seen, EXPERTS);
}

#[test]
fn a_cache_holding_every_record_serves_them_from_the_mapping() {
    let t = tempfile::tempdir().unwrap();
    let (path, layers) = records(t.path());
    let store = open(&path, layers, options(EXPERTS));
    assert!(store.in_page_cache());
    assert_eq!(store.slab_range().1, 0, "no slab to page-lock");
    assert_eq!(store.slab_bytes(), (EXPERTS * RECORD) as u64);
    check_all(&store);
    // Each record is brought in from its first page to its last byte: the last one ends mid-page at the
    // file's end, and a page past it could not be mapped.
    let brought: usize = (0..EXPERTS)
        .map(|e| (e + 1) * RECORD - e * RECORD / 4096 * 4096)
        .sum();
    assert_eq!(store.snapshot().demand_bytes, brought as u64);
    // A second pass finds them all cached.
    check_all(&store);
    let s = store.snapshot();
    assert_eq!(s.hits, EXPERTS as u64);
    assert_eq!(s.demand_bytes, brought as u64);
}

#[test]
fn the_slab_stays_where_a_mapping_does_not_fit() {
    let t = tempfile::tempdir().unwrap();
    let (path, layers) = records(t.path());
    let slab = |opts: StoreOptions, layers: Vec<Vec<RecordLoc>>| {
        let store = open(&path, layers, opts);
        assert!(!store.in_page_cache());
        assert!(store.slab_range().1 > 0);
        store
    };
    // A cache short of every record evicts, and evicting a mapped record frees nothing.
    check_all(&slab(options(EXPERTS - 3), layers.clone()));
    // Not asked for (the default), or the io_uring engine.
    let off = StoreOptions {
        map_files: false,
        ..options(EXPERTS)
    };
    check_all(&slab(off, layers.clone()));
    let uring = StoreOptions {
        backend: Backend::Uring,
        ..options(EXPERTS)
    };
    check_all(&slab(uring, layers.clone()));
    // A record in two extents is not one range of the mapping.
    let mut split = layers.clone();
    let x = split[0][1].extents[0].clone();
    split[0][1].extents = vec![
        Extent {
            len: 100,
            ..x.clone()
        },
        Extent {
            offset: x.offset + 100,
            len: RECORD - 100,
            ..x
        },
    ];
    check_all(&slab(options(EXPERTS), split));
}

#[test]
fn a_record_past_the_file_end_stays_with_the_slab_and_fails_as_short() {
    let t = tempfile::tempdir().unwrap();
    let (path, mut layers) = records(t.path());
    layers[0][EXPERTS - 1].extents[0].offset += 4096;
    let store = open(&path, layers, options(EXPERTS));
    assert!(!store.in_page_cache());
    let mut fetch = store.fetch(0, &[EXPERTS - 1]);
    let err = fetch.next().unwrap().err().unwrap().to_string();
    assert!(err.contains("the file ends early"), "{err}");
}

/// Fails every read while armed.
#[derive(Debug, Default)]
struct Failing(AtomicBool);

impl FaultInjector for Failing {
    fn before_read(&self, _: &Path, _: u64, _: usize) -> Option<Fault> {
        self.0
            .load(Ordering::Relaxed)
            .then_some(Fault::Os(libc::EIO))
    }
}

#[test]
fn a_failed_read_of_a_mapped_record_fails_it_and_the_next_use_reads_again() {
    let t = tempfile::tempdir().unwrap();
    let (path, layers) = records(t.path());
    let faults = Arc::new(Failing(AtomicBool::new(true)));
    let opts = StoreOptions {
        faults: Some(faults.clone()),
        ..options(EXPERTS)
    };
    let store = open(&path, layers, opts);
    assert!(store.in_page_cache());
    let mut fetch = store.fetch(0, &[2]);
    let err = fetch.next().unwrap().err().unwrap().to_string();
    assert!(
        err.contains("layer 0 expert 2")
            && err.contains("records.bin")
            && err.contains("os error 5"),
        "{err}"
    );
    drop(fetch);
    faults.0.store(false, Ordering::Relaxed);
    check_all(&store);
}
