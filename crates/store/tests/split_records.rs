//! Records split over several extents, as gpt-oss stores an expert: each of its tensors is a slice of one
//! `[E, …]` tensor per layer, so the pieces of one expert lie far apart, at offsets off the page grid. The
//! store must hand out each record whole and in order, and with direct I/O read it from the drive without
//! going through the page cache (a benchmark's replay of the same bytes would otherwise time the cache).

use deltafin_store::{io, ExpertStore, Extent, RecordLoc, StoreOptions};
use std::path::{Path, PathBuf};

const LAYERS: usize = 2;
const EXPERTS: usize = 6;
/// A record's pieces: a large one off the grid by half a page, a small one, one just past a page multiple.
const PARTS: [usize; 3] = [5 * 4096 + 512, 777, 3 * 4096 + 2048 + 8];
/// Bytes before the first tensor (a safetensors header is of any length).
const HEADER: usize = 1000;

fn record_len() -> usize {
    PARTS.iter().sum()
}

/// The byte at `i` of record (l, e).
fn byte(l: usize, e: usize, i: usize) -> u8 {
    (l * 131 + e * 31 + i * 7 + i / 251) as u8
}

/// A file laid out like a stacked checkpoint (per layer, per part: that part of every expert in turn), in a
/// directory on the build drive (a tmpfs /tmp would refuse direct I/O), and where each record lies in it.
fn stacked_file(name: &str) -> (tempfile::TempDir, PathBuf, Vec<Vec<RecordLoc>>) {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let path = dir.path().join(name);
    let mut data = vec![0xEEu8; HEADER];
    let mut layers = vec![vec![Vec::new(); EXPERTS]; LAYERS];
    for (l, layer) in layers.iter_mut().enumerate() {
        let mut part_start = 0;
        for len in PARTS {
            for (e, extents) in layer.iter_mut().enumerate() {
                extents.push(Extent {
                    file: 0,
                    offset: data.len() as u64,
                    len,
                });
                data.extend((part_start..part_start + len).map(|i| byte(l, e, i)));
            }
            part_start += len;
        }
    }
    std::fs::write(&path, &data).unwrap();
    let layers = layers
        .into_iter()
        .map(|layer| {
            layer
                .into_iter()
                .map(|extents| RecordLoc {
                    extents,
                    checksum: None,
                })
                .collect()
        })
        .collect();
    (dir, path, layers)
}

fn open(path: &Path, layers: &[Vec<RecordLoc>], opts: StoreOptions) -> ExpertStore {
    ExpertStore::new(
        &[(path.to_path_buf(), 0)],
        layers.to_vec(),
        record_len(),
        opts,
        "test".into(),
    )
    .unwrap()
}

/// Asks for every record of every layer and checks each byte.
fn read_all_and_check(store: &ExpertStore) {
    let all: Vec<usize> = (0..EXPERTS).collect();
    for l in 0..LAYERS {
        let mut fetch = store.fetch(l, &all);
        let mut seen = 0;
        while let Some(r) = fetch.next() {
            let r = r.unwrap();
            let bytes = r.bytes();
            let bad = (0..record_len()).find(|&i| bytes[i] != byte(l, r.expert, i));
            assert!(
                bad.is_none(),
                "layer {l} expert {}: wrong byte at {bad:?}",
                r.expert
            );
            seen += 1;
        }
        assert_eq!(seen, EXPERTS, "layer {l}: every record handed out");
    }
}

#[test]
fn split_records_arrive_whole_on_every_read_path() {
    let (_dir, path, layers) = stacked_file("stacked.bin");
    for direct_io in [true, false] {
        for backend in [io::Backend::Pool, io::Backend::Uring] {
            // Chunks of one page split every piece; 1 MiB chunks take each piece in one read.
            for chunk_bytes in [4096, 1 << 20] {
                let store = open(
                    &path,
                    &layers,
                    StoreOptions {
                        working_slots: 4,
                        direct_io,
                        workers_per_drive: 3,
                        chunk_bytes,
                        backend,
                        ..StoreOptions::default()
                    },
                );
                read_all_and_check(&store);
                let keys: Vec<(usize, usize)> = (0..EXPERTS).map(|e| (1, e)).collect();
                assert!(store.time_reads(&keys, 4).unwrap() > 0.0);
            }
        }
    }
}

/// Pages of `path` in the page cache (mincore over a mapping of it).
#[cfg(target_os = "linux")]
fn cached_pages(path: &Path) -> usize {
    use std::os::unix::io::AsRawFd;
    let file = std::fs::File::open(path).unwrap();
    let len = file.metadata().unwrap().len() as usize;
    // SAFETY: a read-only shared mapping of a file we hold open, unmapped below; mincore writes one byte per
    // page into a vector of that many bytes.
    unsafe {
        let map = libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ,
            libc::MAP_SHARED,
            file.as_raw_fd(),
            0,
        );
        assert_ne!(map, libc::MAP_FAILED);
        let mut pages = vec![0u8; len.div_ceil(4096)];
        assert_eq!(libc::mincore(map, len, pages.as_mut_ptr()), 0);
        libc::munmap(map, len);
        pages.iter().filter(|&&p| p & 1 == 1).count()
    }
}

#[cfg(target_os = "linux")]
#[test]
fn direct_reads_of_split_records_bypass_the_page_cache() {
    let (_dir, path, layers) = stacked_file("cold.bin");
    let file = std::fs::File::open(&path).unwrap();
    file.sync_all().unwrap();
    deltafin_store::os::drop_cached_pages(&file);
    assert_eq!(
        cached_pages(&path),
        0,
        "the kernel kept the test file's pages after POSIX_FADV_DONTNEED: nothing to measure"
    );
    let store = open(
        &path,
        &layers,
        StoreOptions {
            working_slots: 4,
            ..StoreOptions::default()
        },
    );
    assert_eq!(
        store.io_modes(),
        vec![io::IoMode::Direct],
        "{} refuses O_DIRECT: run the test on a drive that takes it",
        env!("CARGO_TARGET_TMPDIR")
    );
    read_all_and_check(&store);
    let keys: Vec<(usize, usize)> = (0..EXPERTS).map(|e| (0, e)).collect();
    store.time_reads(&keys, 4).unwrap();
    assert_eq!(
        cached_pages(&path),
        0,
        "direct reads of split records went through the page cache"
    );
}
