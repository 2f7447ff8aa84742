//! `deltafin disk-probe`: the drive's read bandwidth measured through the engine's own read path (same
//! direct-I/O mode, chunking and queue depth), reading expert-sized records in a scattered order.

use crate::io::{AlignedBuf, Completion, DataFile, IoEngine, IoMode, Priority, ReadOp};
use crate::os;
use anyhow::{Context, Result};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

pub struct ProbeResult {
    pub path: PathBuf,
    pub mode: IoMode,
    pub bytes: u64,
    pub secs: f64,
    pub workers: usize,
}

impl ProbeResult {
    pub fn gbps(&self) -> f64 {
        self.bytes as f64 / self.secs / 1e9
    }
}

/// Ensures `dir/.deltafin-probe` holds at least `size` bytes of incompressible data, out of the page cache.
pub fn probe_file(dir: &Path, size: u64) -> Result<PathBuf> {
    let path = dir.join(".deltafin-probe");
    let have = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
    if have < size {
        if let Err(e) = write_probe_file(&path, size) {
            // A half-written probe file only takes space the drive is short of.
            let _ = std::fs::remove_file(&path);
            return Err(e.context(format!(
                "writing the {} MiB probe file {} (it needs that much free space in {})",
                size.div_ceil(1 << 20),
                path.display(),
                dir.display()
            )));
        }
    }
    drop_cache(&path);
    Ok(path)
}

fn write_probe_file(path: &Path, size: u64) -> Result<()> {
    let mut f = std::fs::File::create(path).context("creating it")?;
    os::write_uncached(&f);
    let mut block = vec![0u8; 1 << 20];
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    for _ in 0..size.div_ceil(1 << 20) {
        for c in block.chunks_exact_mut(8) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            c.copy_from_slice(&x.to_le_bytes());
        }
        f.write_all(&block)?;
    }
    Ok(f.sync_all()?)
}

/// Asks the kernel to forget the file's cached pages, so buffered reads measure the drive (where the OS
/// can: see [`os::drop_cached_pages`]).
pub fn drop_cache(path: &Path) {
    if let Ok(f) = std::fs::File::open(path) {
        os::drop_cached_pages(&f);
    }
}

/// Reads `bytes` of the probe file as `record`-byte records in a scattered order, `chunk`-sized reads,
/// `workers` in flight.
pub fn probe(
    path: &Path,
    bytes: u64,
    record: usize,
    chunk: usize,
    workers: usize,
    direct: bool,
) -> Result<ProbeResult> {
    let file = Arc::new(DataFile::open(path, direct, 0)?);
    let len = std::fs::metadata(path)
        .with_context(|| format!("cannot read {}", path.display()))?
        .len();
    let records = (bytes.min(len) / record as u64).max(1);
    let engine = IoEngine::new(1, workers);
    // Reads land in a scratch ring; the bytes themselves are not used.
    let ring = AlignedBuf::new(workers * chunk * 2);
    let notify = Arc::new((Mutex::new(()), Condvar::new()));
    let t0 = Instant::now();
    let mut total = 0u64;
    let mut pending = Vec::new();
    for i in 0..records {
        // A fixed odd stride visits every record once in a scattered order.
        let r = (i * 7919) % records;
        let chunks = record.div_ceil(chunk);
        let done = Completion::new(chunks as u64, notify.clone());
        for c in 0..chunks {
            let at = c * chunk;
            let n = chunk.min(record - at);
            let slot = (total as usize / chunk) % (ring.len() / chunk);
            let op = ReadOp {
                file: file.clone(),
                offset: r * record as u64 + at as u64,
                len: n,
                need: n,
                dst: ring.as_ptr().wrapping_add(slot * chunk),
                mapped: false,
                done: done.clone(),
            };
            engine.submit(op, Priority::Demand);
            total += n as u64;
        }
        pending.push(done);
    }
    let (lock, cv) = &*notify;
    let mut g = lock.lock().unwrap();
    while !pending.iter().all(|d| d.is_done()) {
        g = cv
            .wait_timeout(g, std::time::Duration::from_millis(5))
            .unwrap()
            .0;
    }
    drop(g);
    let secs = t0.elapsed().as_secs_f64();
    if let Some(e) = pending.iter().find_map(|d| d.error()) {
        anyhow::bail!("probe read failed: {e}");
    }
    engine.shutdown();
    Ok(ProbeResult {
        path: path.to_path_buf(),
        mode: file.mode,
        bytes: total,
        secs,
        workers,
    })
}

/// The same measurement through io_uring: one thread keeps `depth` reads in flight in a submission ring.
/// Kept beside the thread pool so `disk-probe --engine uring` can compare the two on each machine.
pub fn probe_uring(
    path: &Path,
    bytes: u64,
    record: usize,
    chunk: usize,
    depth: usize,
    direct: bool,
) -> Result<ProbeResult> {
    #[cfg(target_os = "linux")]
    return uring_probe(path, bytes, record, chunk, depth, direct);
    #[cfg(not(target_os = "linux"))]
    {
        let _ = (path, bytes, record, chunk, depth, direct);
        anyhow::bail!("--engine uring needs Linux's io_uring; use --engine pool on this system")
    }
}

#[cfg(target_os = "linux")]
fn uring_probe(
    path: &Path,
    bytes: u64,
    record: usize,
    chunk: usize,
    depth: usize,
    direct: bool,
) -> Result<ProbeResult> {
    use io_uring::{opcode, types, IoUring};
    use std::os::unix::io::AsRawFd;
    let file = DataFile::open(path, direct, 0)?;
    let len = std::fs::metadata(path)
        .with_context(|| format!("cannot read {}", path.display()))?
        .len();
    let records = (bytes.min(len) / record as u64).max(1);
    // Every read, in the same scattered order as `probe`.
    let mut reads: Vec<(u64, usize)> = Vec::new();
    for i in 0..records {
        let r = (i * 7919) % records;
        let mut at = 0;
        while at < record {
            let n = chunk.min(record - at);
            reads.push((r * record as u64 + at as u64, n));
            at += n;
        }
    }
    let depth = depth.max(1);
    let mut ring =
        IoUring::new(depth as u32 * 2).context("io_uring is not available on this kernel")?;
    let bufs = AlignedBuf::new(depth * chunk);
    let fd = types::Fd(file.file.as_raw_fd());
    let mut free: Vec<usize> = (0..depth).collect();
    let (mut next, mut done, mut total) = (0usize, 0usize, 0u64);
    let t0 = Instant::now();
    while done < reads.len() {
        while next < reads.len() {
            let Some(slot) = free.pop() else { break };
            let (offset, n) = reads[next];
            let entry = opcode::Read::new(fd, bufs.as_ptr().wrapping_add(slot * chunk), n as u32)
                .offset(offset)
                .build()
                .user_data((slot as u64) << 32);
            // SAFETY: the buffer slot stays valid and unused until its completion is reaped.
            unsafe { ring.submission().push(&entry) }
                .map_err(|_| anyhow::anyhow!("io_uring submission queue full"))?;
            next += 1;
        }
        ring.submit_and_wait(1)?;
        for cqe in ring.completion() {
            let slot = (cqe.user_data() >> 32) as usize;
            if cqe.result() < 0 {
                anyhow::bail!(
                    "io_uring read failed: {}",
                    std::io::Error::from_raw_os_error(-cqe.result())
                );
            }
            // A short read (end of file) counts what arrived; the probe only measures bandwidth.
            total += cqe.result() as u64;
            free.push(slot);
            done += 1;
        }
    }
    Ok(ProbeResult {
        path: path.to_path_buf(),
        mode: file.mode,
        bytes: total,
        secs: t0.elapsed().as_secs_f64(),
        workers: depth,
    })
}
