//! The read engine: positioned reads into page-aligned memory, direct I/O where the filesystem allows it,
//! many reads in flight per drive, and two queues per drive — demand always served before prefetch.

use crate::os;
use anyhow::{Context, Result};
use std::collections::VecDeque;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

/// Direct I/O needs buffer addresses, offsets and lengths aligned to the logical block size; one page covers
/// every drive we expect.
pub const ALIGN: usize = 4096;

pub fn align_down(x: u64) -> u64 {
    x / ALIGN as u64 * ALIGN as u64
}

pub fn align_up(x: u64) -> u64 {
    x.div_ceil(ALIGN as u64) * ALIGN as u64
}

/// A page-aligned, zero-initialised heap region, allocated once (the expert slab lives in one of these).
pub struct AlignedBuf {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the buffer is plain memory; concurrent access is coordinated by the slab's slot states.
unsafe impl Send for AlignedBuf {}
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// Anonymous memory straight from the kernel: page-aligned and zero-filled lazily, so a large cache costs
    /// nothing until used (an aligned heap allocation would memset it all up front).
    pub fn new(len: usize) -> AlignedBuf {
        let len = len.max(ALIGN).div_ceil(ALIGN) * ALIGN;
        // SAFETY: a private anonymous mapping with no address hint.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            panic!(
                "cannot map {len} bytes for the expert cache: {}",
                std::io::Error::last_os_error()
            );
        }
        AlignedBuf {
            ptr: ptr as *mut u8,
            len,
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr is valid for len bytes for the buffer's lifetime.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and &mut self guarantees exclusivity.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: mapped in `new` with this length.
        unsafe { libc::munmap(self.ptr as *mut libc::c_void, self.len) };
    }
}

/// How a file is read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IoMode {
    /// Bypasses the page cache (the engine keeps its own cache): O_DIRECT on Linux, which needs aligned
    /// requests, F_NOCACHE on macOS.
    Direct,
    /// Ordinary reads through the page cache.
    Buffered,
}

/// One file the engine reads, opened for direct I/O when possible (and when asked).
pub struct DataFile {
    pub path: PathBuf,
    pub file: File,
    pub mode: IoMode,
    /// The drive queue serving this file.
    pub drive: usize,
}

impl DataFile {
    /// Opens `path` bypassing the page cache if `want_direct` and the filesystem accepts it (tmpfs, for one,
    /// does not): see [`os::open_uncached`].
    pub fn open(path: &Path, want_direct: bool, drive: usize) -> Result<DataFile> {
        if want_direct {
            if let Ok(file) = os::open_uncached(path) {
                return Ok(DataFile {
                    path: path.to_path_buf(),
                    file,
                    mode: IoMode::Direct,
                    drive,
                });
            }
        }
        let file = File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
        Ok(DataFile {
            path: path.to_path_buf(),
            file,
            mode: IoMode::Buffered,
            drive,
        })
    }

    /// Fills `buf` from `offset`, stopping early only at end of file, and fails unless at least `need` bytes
    /// arrived (an aligned direct read of a file's last record may extend past its end). A filesystem that
    /// refuses a direct read (EINVAL) gets the same read buffered.
    pub fn read_at_least(&self, buf: &mut [u8], offset: u64, need: usize) -> std::io::Result<()> {
        let got = match fill(&self.file, buf, offset) {
            Err(e) if self.mode == IoMode::Direct && e.raw_os_error() == Some(libc::EINVAL) => {
                fill(&File::open(&self.path)?, buf, offset)?
            }
            r => r?,
        };
        if got < need {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                format!("short read: {got} of {need} bytes (the file ends early)"),
            ));
        }
        Ok(())
    }
}

fn fill(file: &File, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
    let mut got = 0;
    while got < buf.len() {
        match file.read_at(&mut buf[got..], offset + got as u64) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(got)
}

impl DataFile {}

/// A unit of work: read `len` bytes of `file` at `offset` into `dst`, then count down `done`.
pub struct ReadOp {
    pub file: Arc<DataFile>,
    pub offset: u64,
    pub len: usize,
    /// Bytes of `len` that must arrive (the rest is alignment padding past the data).
    pub need: usize,
    /// Destination; stays valid until `done` reaches zero (the slab guarantees it).
    pub dst: *mut u8,
    pub done: Arc<Completion>,
}

// SAFETY: `dst` points into the slab, which outlives the engine's queues; one op writes one disjoint range.
unsafe impl Send for ReadOp {}

/// Counts the outstanding chunks of one record and records the first error.
pub struct Completion {
    remaining: AtomicU64,
    failed: Mutex<Option<String>>,
    notify: Arc<(Mutex<()>, Condvar)>,
}

impl Completion {
    pub fn new(chunks: u64, notify: Arc<(Mutex<()>, Condvar)>) -> Arc<Completion> {
        Arc::new(Completion {
            remaining: AtomicU64::new(chunks),
            failed: Mutex::new(None),
            notify,
        })
    }

    pub fn is_done(&self) -> bool {
        self.remaining.load(Ordering::Acquire) == 0
    }

    pub fn error(&self) -> Option<String> {
        self.failed.lock().unwrap().clone()
    }

    fn finish_chunk(&self, err: Option<String>) {
        if let Some(e) = err {
            self.failed.lock().unwrap().get_or_insert(e);
        }
        if self.remaining.fetch_sub(1, Ordering::AcqRel) == 1 {
            let (lock, cv) = &*self.notify;
            let _guard = lock.lock().unwrap();
            cv.notify_all();
        }
    }
}

#[derive(Default)]
struct Queues {
    demand: VecDeque<ReadOp>,
    prefetch: VecDeque<ReadOp>,
    prefetch_in_flight: usize,
    shutdown: bool,
}

struct Drive {
    queues: Mutex<Queues>,
    wake: Condvar,
}

/// Counters of the read engine.
#[derive(Default)]
pub struct IoCounters {
    pub demand_bytes: AtomicU64,
    pub prefetch_bytes: AtomicU64,
    pub reads: AtomicU64,
    /// Wall time with at least one read queued or in flight: the drive had work. In an I/O-bound pass,
    /// busy time / pass time says how well the engine kept the drive fed, whatever the drive's speed.
    busy: Mutex<Busy>,
}

#[derive(Default)]
struct Busy {
    outstanding: usize,
    since: Option<Instant>,
    total_ns: u64,
}

impl IoCounters {
    fn begin(&self) {
        let mut b = self.busy.lock().unwrap();
        if b.outstanding == 0 {
            b.since = Some(Instant::now());
        }
        b.outstanding += 1;
    }

    fn end(&self) {
        let mut b = self.busy.lock().unwrap();
        b.outstanding -= 1;
        if b.outstanding == 0 {
            if let Some(t) = b.since.take() {
                b.total_ns += t.elapsed().as_nanos() as u64;
            }
        }
    }

    /// Busy wall time so far, counting a busy period still in progress.
    pub fn busy_secs(&self) -> f64 {
        let b = self.busy.lock().unwrap();
        (b.total_ns + b.since.map_or(0, |t| t.elapsed().as_nanos() as u64)) as f64 * 1e-9
    }
}

/// Worker threads per drive pulling from that drive's demand queue first, then its prefetch queue.
pub struct IoEngine {
    drives: Vec<Arc<Drive>>,
    workers: Mutex<Vec<std::thread::JoinHandle<()>>>,
    pub counters: Arc<IoCounters>,
    /// Reads at most this many prefetch chunks at once per drive, so a demand read always finds a free worker
    /// soon (the rest of the time prefetch only uses idle disk time).
    max_prefetch_in_flight: usize,
    stopped: AtomicBool,
}

impl IoEngine {
    pub fn new(drives: usize, workers_per_drive: usize) -> Arc<IoEngine> {
        IoEngine::with_backend(drives, workers_per_drive, Backend::Pool)
    }

    /// `depth` reads in flight per drive: `depth` reader threads (pool), or one thread keeping `depth` reads
    /// in an io_uring submission ring.
    pub fn with_backend(drives: usize, depth: usize, backend: Backend) -> Arc<IoEngine> {
        let workers_per_drive = depth;
        let counters = Arc::new(IoCounters::default());
        let engine = Arc::new(IoEngine {
            drives: (0..drives.max(1))
                .map(|_| {
                    Arc::new(Drive {
                        queues: Mutex::new(Queues::default()),
                        wake: Condvar::new(),
                    })
                })
                .collect(),
            workers: Mutex::new(Vec::new()),
            counters: counters.clone(),
            max_prefetch_in_flight: (workers_per_drive / 2).max(1),
            stopped: AtomicBool::new(false),
        });
        // Elsewhere `Backend::Uring` cannot be chosen (see `from_str`): every drive gets reader threads.
        #[cfg(not(target_os = "linux"))]
        let _ = backend;
        let mut handles = Vec::new();
        for drive in &engine.drives {
            #[cfg(target_os = "linux")]
            if backend == Backend::Uring {
                let (drive, counters, cap) = (
                    drive.clone(),
                    counters.clone(),
                    engine.max_prefetch_in_flight,
                );
                let depth = workers_per_drive.max(1);
                handles.push(
                    std::thread::Builder::new()
                        .name("deltafin-uring".into())
                        .spawn(move || uring_worker(drive, counters, cap, depth))
                        .expect("spawn I/O worker"),
                );
                continue;
            }
            for i in 0..workers_per_drive.max(1) {
                let (drive, counters, cap) = (
                    drive.clone(),
                    counters.clone(),
                    engine.max_prefetch_in_flight,
                );
                handles.push(
                    std::thread::Builder::new()
                        .name(format!("deltafin-io-{i}"))
                        .spawn(move || worker(drive, counters, cap))
                        .expect("spawn I/O worker"),
                );
            }
        }
        *engine.workers.lock().unwrap() = handles;
        engine
    }

    pub fn submit(&self, op: ReadOp, demand: bool) {
        self.counters.begin();
        // A buffered prefetch may wait behind the in-flight cap: the kernel can read its range ahead meanwhile
        // (macOS; the pages land in the page cache either way, so this adds no memory pressure).
        if !demand && op.file.mode == IoMode::Buffered {
            os::advise_read(&op.file.file, op.offset, op.len);
        }
        let drive = &self.drives[op.file.drive.min(self.drives.len() - 1)];
        let mut q = drive.queues.lock().unwrap();
        if demand {
            q.demand.push_back(op);
        } else {
            q.prefetch.push_back(op);
        }
        drop(q);
        drive.wake.notify_one();
    }

    /// Moves queued prefetch chunks of `done` (not yet started) to the demand queue.
    pub fn promote(&self, done: &Arc<Completion>) {
        for drive in &self.drives {
            let mut q = drive.queues.lock().unwrap();
            let mut kept = VecDeque::with_capacity(q.prefetch.len());
            let mut moved = false;
            while let Some(op) = q.prefetch.pop_front() {
                if Arc::ptr_eq(&op.done, done) {
                    q.demand.push_back(op);
                    moved = true;
                } else {
                    kept.push_back(op);
                }
            }
            q.prefetch = kept;
            drop(q);
            if moved {
                drive.wake.notify_all();
            }
        }
    }

    pub fn shutdown(&self) {
        if self.stopped.swap(true, Ordering::SeqCst) {
            return;
        }
        for d in &self.drives {
            d.queues.lock().unwrap().shutdown = true;
            d.wake.notify_all();
        }
        for h in self.workers.lock().unwrap().drain(..) {
            let _ = h.join();
        }
    }
}

impl Drop for IoEngine {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// How reads are kept in flight.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// Reader threads doing positioned reads.
    Pool,
    /// One thread per drive driving an io_uring ring (Linux only).
    Uring,
}

impl std::str::FromStr for Backend {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "pool" => Ok(Backend::Pool),
            "uring" if cfg!(target_os = "linux") => Ok(Backend::Uring),
            "uring" => Err("the uring I/O engine needs Linux's io_uring; use pool".into()),
            _ => Err(format!("unknown I/O engine {s:?}; choose pool or uring")),
        }
    }
}

/// Takes the next op for a drive: demand first, prefetch only below its in-flight cap. `None` on shutdown.
fn next_op(drive: &Drive, max_prefetch: usize, block: bool) -> Option<Option<(ReadOp, bool)>> {
    let mut q = drive.queues.lock().unwrap();
    loop {
        if let Some(op) = q.demand.pop_front() {
            return Some(Some((op, true)));
        }
        if q.prefetch_in_flight < max_prefetch {
            if let Some(op) = q.prefetch.pop_front() {
                q.prefetch_in_flight += 1;
                return Some(Some((op, false)));
            }
        }
        if q.shutdown {
            return None;
        }
        if !block {
            return Some(None);
        }
        q = drive.wake.wait(q).unwrap();
    }
}

/// Accounts for a finished read and wakes whoever waits on it.
fn complete(drive: &Drive, counters: &IoCounters, op: &ReadOp, demand: bool, err: Option<String>) {
    counters.reads.fetch_add(1, Ordering::Relaxed);
    let bytes = if demand {
        &counters.demand_bytes
    } else {
        &counters.prefetch_bytes
    };
    bytes.fetch_add(op.len as u64, Ordering::Relaxed);
    if !demand {
        drive.queues.lock().unwrap().prefetch_in_flight -= 1;
        drive.wake.notify_one();
    }
    op.done.finish_chunk(err);
    counters.end();
}

fn read_error(op: &ReadOp, e: std::io::Error) -> String {
    format!(
        "{}: {} bytes at offset {}: {e}",
        op.file.path.display(),
        op.len,
        op.offset
    )
}

/// The io_uring reader of one drive: keeps up to `depth` reads in the ring, refilling as they complete.
#[cfg(target_os = "linux")]
fn uring_worker(drive: Arc<Drive>, counters: Arc<IoCounters>, max_prefetch: usize, depth: usize) {
    use io_uring::{opcode, types, IoUring};
    use std::os::unix::io::AsRawFd;
    let mut ring = match IoUring::new((depth * 2) as u32) {
        Ok(r) => r,
        // No io_uring on this kernel: serve the queue with positioned reads instead.
        Err(_) => return worker(drive, counters, max_prefetch),
    };
    let mut in_flight: Vec<Option<(ReadOp, bool)>> = (0..depth).map(|_| None).collect();
    loop {
        // Refill free slots; block for work only when nothing is in flight.
        let busy = in_flight.iter().filter(|s| s.is_some()).count();
        for slot in 0..depth {
            if in_flight[slot].is_some() {
                continue;
            }
            let block = busy == 0 && in_flight.iter().all(|s| s.is_none());
            let Some(next) = next_op(&drive, max_prefetch, block) else {
                return;
            };
            let Some((op, demand)) = next else { break };
            let entry =
                opcode::Read::new(types::Fd(op.file.file.as_raw_fd()), op.dst, op.len as u32)
                    .offset(op.offset)
                    .build()
                    .user_data(slot as u64);
            // SAFETY: `op.dst..+len` stays valid and untouched until this read completes (the slab's promise),
            // and `op` (holding the file open) lives in `in_flight` until then.
            if unsafe { ring.submission().push(&entry) }.is_err() {
                let err = positioned_read(&op);
                complete(&drive, &counters, &op, demand, err);
                continue;
            }
            in_flight[slot] = Some((op, demand));
        }
        if in_flight.iter().all(|s| s.is_none()) {
            continue;
        }
        if let Err(e) = ring.submit_and_wait(1) {
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            // The ring failed as a whole: finish what it held with positioned reads.
            for (op, demand) in in_flight.iter_mut().filter_map(Option::take) {
                let err = positioned_read(&op);
                complete(&drive, &counters, &op, demand, err);
            }
            continue;
        }
        let done: Vec<(usize, i32)> = ring
            .completion()
            .map(|c| (c.user_data() as usize, c.result()))
            .collect();
        for (slot, res) in done {
            let Some((op, demand)) = in_flight[slot].take() else {
                continue;
            };
            // Whatever the ring could not finish in one go (EINVAL from a direct read, a short read) is completed
            // with the same positioned read the pool uses.
            let err = if res >= 0 && res as usize >= op.need {
                None
            } else {
                positioned_read(&op)
            };
            complete(&drive, &counters, &op, demand, err);
        }
    }
}

/// Performs `op` with a positioned read (the pool's way, and the ring's fallback); the error text if it failed.
fn positioned_read(op: &ReadOp) -> Option<String> {
    // SAFETY: the slab keeps `dst..dst+len` valid, and written by this op alone, until the op completes.
    let buf = unsafe { std::slice::from_raw_parts_mut(op.dst, op.len) };
    op.file
        .read_at_least(buf, op.offset, op.need)
        .err()
        .map(|e| read_error(op, e))
}

fn worker(drive: Arc<Drive>, counters: Arc<IoCounters>, max_prefetch: usize) {
    while let Some(Some((op, demand))) = next_op(&drive, max_prefetch, true) {
        complete(&drive, &counters, &op, demand, positioned_read(&op));
    }
}
