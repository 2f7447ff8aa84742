//! The read engine: positioned reads into page-aligned memory, direct I/O where the filesystem allows it,
//! many reads in flight per drive, and two queues per drive — demand always served before prefetch.

use crate::{mapped, os};
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
    /// nothing until used (an aligned heap allocation would memset it all up front). No transparent huge
    /// pages: on the virtual machine measured (BENCHMARKS.md) faulting them in was 7x slower than 4 KiB pages.
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

/// Faults the pages under `addr..addr+len` in for writing without changing a byte of them
/// (MADV_POPULATE_WRITE, Linux 5.14), before a read lands there: a direct read into pages never touched
/// faults them inside the read, which was measured several times slower per byte than populating them first
/// (BENCHMARKS.md, "First touch"). For pages already present it is a page-table walk; where the kernel
/// cannot, the read faults them as before.
fn populate(addr: usize, len: usize) {
    #[cfg(target_os = "linux")]
    {
        let start = addr / ALIGN * ALIGN;
        let end = (addr + len).div_ceil(ALIGN) * ALIGN;
        // SAFETY: callers pass ranges inside a live mapping of theirs; populating never changes the
        // contents of a page already present, so reads landing in it concurrently are unaffected.
        unsafe {
            libc::madvise(
                start as *mut libc::c_void,
                end - start,
                libc::MADV_POPULATE_WRITE,
            );
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (addr, len);
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
    /// Faults a test injects into this file's reads (none otherwise).
    pub faults: Option<Arc<dyn FaultInjector>>,
}

/// A test hook on the read path: what a failing drive would do to a read ([`crate::StoreOptions::faults`]).
pub trait FaultInjector: Send + Sync + std::fmt::Debug {
    /// Asked before each read of `len` bytes of `path` at `offset`: the fault it suffers, if any.
    fn before_read(&self, path: &Path, offset: u64, len: usize) -> Option<Fault>;
}

/// An injected read fault.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// The read fails with this OS error number (e.g. `libc::EIO`).
    Os(i32),
    /// Only this many bytes arrive (a short read).
    Short(usize),
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
                    faults: None,
                });
            }
        }
        let file = File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
        Ok(DataFile {
            path: path.to_path_buf(),
            file,
            mode: IoMode::Buffered,
            drive,
            faults: None,
        })
    }

    /// Fills `buf` from `offset`, stopping early only at end of file, and fails unless at least `need` bytes
    /// arrived (an aligned direct read of a file's last record may extend past its end). A direct read off the
    /// block grid goes through an aligned scratch buffer; one the filesystem refuses (EINVAL) goes buffered.
    pub fn read_at_least(&self, buf: &mut [u8], offset: u64, need: usize) -> std::io::Result<()> {
        let fault = self.fault(offset, buf.len());
        if let Some(Fault::Os(errno)) = fault {
            return Err(std::io::Error::from_raw_os_error(errno));
        }
        let got = if self.needs_bounce(buf.as_ptr(), offset, buf.len()) {
            self.read_bounced(buf, offset)?
        } else {
            self.read_in_place(buf, offset)?
        };
        let got = match fault {
            Some(Fault::Short(n)) => got.min(n),
            _ => got,
        };
        if got < need {
            return Err(short_read(got, need));
        }
        Ok(())
    }

    /// Whether a read of `len` bytes at `offset` into `dst` must go through [`DataFile::read_bounced`]:
    /// Linux's O_DIRECT refuses a file offset, address or length off the block grid (macOS's F_NOCACHE
    /// takes any).
    pub fn needs_bounce(&self, dst: *const u8, offset: u64, len: usize) -> bool {
        let off_grid = |x: u64| !x.is_multiple_of(ALIGN as u64);
        cfg!(target_os = "linux")
            && self.mode == IoMode::Direct
            && (off_grid(offset) || off_grid(dst as u64) || off_grid(len as u64))
    }

    /// Reads straight into `buf`; a filesystem that refuses a direct read (EINVAL) gets it buffered.
    fn read_in_place(&self, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
        match fill(&self.file, buf, offset) {
            Err(e) if self.mode == IoMode::Direct && e.raw_os_error() == Some(libc::EINVAL) => {
                fill(&File::open(&self.path)?, buf, offset)
            }
            r => r,
        }
    }

    /// A direct read off the block grid (an extent of a record split over several tensors, gpt-oss's): the
    /// whole pages around it are read into this thread's aligned scratch buffer and the wanted bytes copied
    /// out. It still bypasses the page cache — falling back to buffered reads instead filled the cache with
    /// every record read, and a benchmark's replay of them then measured the cache, not the drive.
    fn read_bounced(&self, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
        thread_local! {
            static SCRATCH: std::cell::RefCell<Option<AlignedBuf>> = const { std::cell::RefCell::new(None) };
        }
        let (from, to) = (align_down(offset), align_up(offset + buf.len() as u64));
        let span = (to - from) as usize;
        let skip = (offset - from) as usize;
        SCRATCH.with_borrow_mut(|scratch| {
            if scratch.as_ref().is_none_or(|s| s.len() < span) {
                *scratch = Some(AlignedBuf::new(span));
            }
            let pages = &mut scratch.as_mut().expect("allocated above").as_mut_slice()[..span];
            populate(pages.as_ptr() as usize, span);
            let got = self
                .read_in_place(pages, from)?
                .saturating_sub(skip)
                .min(buf.len());
            buf[..got].copy_from_slice(&pages[skip..skip + got]);
            Ok(got)
        })
    }

    /// Brings `len` bytes at `offset` of this file into the page cache through its read-only mapping at
    /// `dst` ([`mapped::bring_in`]); an injected fault fails it as it would fail a read.
    pub fn bring_in(
        &self,
        dst: *mut u8,
        offset: u64,
        len: usize,
        need: usize,
    ) -> std::io::Result<()> {
        match self.fault(offset, len) {
            Some(Fault::Os(errno)) => return Err(std::io::Error::from_raw_os_error(errno)),
            Some(Fault::Short(n)) if n < need => return Err(short_read(n, need)),
            _ => {}
        }
        let start = dst as usize / ALIGN * ALIGN;
        mapped::bring_in(start, dst as usize + len - start)
    }

    fn fault(&self, offset: u64, len: usize) -> Option<Fault> {
        self.faults
            .as_ref()
            .and_then(|f| f.before_read(&self.path, offset, len))
    }
}

fn short_read(got: usize, need: usize) -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::UnexpectedEof,
        format!("short read: {got} of {need} bytes (the file ends early)"),
    )
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

/// A unit of work: read `len` bytes of `file` at `offset` into `dst`, then count down `done`.
pub struct ReadOp {
    pub file: Arc<DataFile>,
    pub offset: u64,
    pub len: usize,
    /// Bytes of `len` that must arrive (the rest is alignment padding past the data).
    pub need: usize,
    /// Destination; stays valid until `done` reaches zero (the slab guarantees it).
    pub dst: *mut u8,
    /// `dst` is `file`'s read-only mapping at `offset`: the read brings those pages into the page cache
    /// ([`DataFile::bring_in`]) instead of copying into memory of ours.
    pub mapped: bool,
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

/// Who waits for a read, which decides its queue: demand before prefetch before background.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Priority {
    /// A pass is waiting for it.
    Demand,
    /// Lookahead: a pass will probably want it soon.
    Prefetch,
    /// Filling the cache from idle drive time; nobody waits.
    Background,
}

#[derive(Default)]
struct Queues {
    demand: VecDeque<ReadOp>,
    prefetch: VecDeque<ReadOp>,
    background: VecDeque<ReadOp>,
    prefetch_in_flight: usize,
    background_in_flight: usize,
    shutdown: bool,
}

/// Background reads in flight per drive: enough to stream sequentially, few enough that a demand read
/// arriving waits behind little.
const MAX_BACKGROUND_IN_FLIGHT: usize = 2;

struct Drive {
    queues: Mutex<Queues>,
    wake: Condvar,
}

/// Counters of the read engine.
#[derive(Default)]
pub struct IoCounters {
    pub demand_bytes: AtomicU64,
    pub prefetch_bytes: AtomicU64,
    pub background_bytes: AtomicU64,
    pub reads: AtomicU64,
    /// Wall time with at least one read queued or in flight: the drive had work. In an I/O-bound pass,
    /// busy time / pass time says how well the engine kept the drive fed, whatever the drive's speed.
    busy: Mutex<Busy>,
}

/// Wall time with at least one of some reads outstanding.
#[derive(Default)]
struct Busy {
    outstanding: usize,
    since: Option<Instant>,
    total_ns: u64,
}

impl Busy {
    fn begin(&mut self) {
        if self.outstanding == 0 {
            self.since = Some(Instant::now());
        }
        self.outstanding += 1;
    }

    fn end(&mut self) {
        self.outstanding -= 1;
        if self.outstanding == 0 {
            if let Some(t) = self.since.take() {
                self.total_ns += t.elapsed().as_nanos() as u64;
            }
        }
    }

    /// Counting a busy period still in progress.
    fn secs(&self) -> f64 {
        (self.total_ns + self.since.map_or(0, |t| t.elapsed().as_nanos() as u64)) as f64 * 1e-9
    }
}

impl IoCounters {
    /// Busy wall time so far.
    pub fn busy_secs(&self) -> f64 {
        self.busy.lock().unwrap().secs()
    }
}

/// Worker threads per drive pulling from that drive's demand queue first, then its prefetch queue.
pub struct IoEngine {
    drives: Vec<Arc<Drive>>,
    workers: Mutex<Vec<std::thread::JoinHandle<()>>>,
    pub counters: Arc<IoCounters>,
    /// Reads at most this many prefetch chunks at once per drive — all but one reader — so a demand read always
    /// finds a free worker at once, while predictions alone still keep the drive's queue nearly full.
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
            max_prefetch_in_flight: workers_per_drive.saturating_sub(1).max(1),
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

    pub fn submit(&self, op: ReadOp, priority: Priority) {
        self.counters.busy.lock().unwrap().begin();
        // A buffered prefetch may wait behind the in-flight cap: the kernel can read its range ahead meanwhile
        // (macOS; the pages land in the page cache either way, so this adds no memory pressure).
        if priority != Priority::Demand && op.file.mode == IoMode::Buffered {
            os::advise_read(&op.file.file, op.offset, op.len);
        }
        let drive = &self.drives[op.file.drive.min(self.drives.len() - 1)];
        let mut q = drive.queues.lock().unwrap();
        match priority {
            Priority::Demand => q.demand.push_back(op),
            Priority::Prefetch => q.prefetch.push_back(op),
            Priority::Background => q.background.push_back(op),
        }
        drop(q);
        drive.wake.notify_one();
    }

    /// Moves queued prefetch and background chunks of `done` (not yet started) to the demand queue.
    pub fn promote(&self, done: &Arc<Completion>) {
        for drive in &self.drives {
            let mut q = drive.queues.lock().unwrap();
            let Queues {
                demand,
                prefetch,
                background,
                ..
            } = &mut *q;
            let mut moved = false;
            for queue in [prefetch, background] {
                let (mine, kept) = std::mem::take(queue)
                    .into_iter()
                    .partition::<VecDeque<_>, _>(|op| Arc::ptr_eq(&op.done, done));
                moved |= !mine.is_empty();
                demand.extend(mine);
                *queue = kept;
            }
            drop(q);
            if moved {
                drive.wake.notify_all();
            }
        }
    }

    /// Drops the queued prefetch reads of `done` (those in flight finish): each counts as a failed chunk, so
    /// `done` completes, as failed, once the reads already started have landed.
    pub fn cancel(&self, done: &Arc<Completion>) {
        for drive in &self.drives {
            let dropped = {
                let mut q = drive.queues.lock().unwrap();
                let (mine, kept) = std::mem::take(&mut q.prefetch)
                    .into_iter()
                    .partition::<VecDeque<_>, _>(|op| Arc::ptr_eq(&op.done, done));
                q.prefetch = kept;
                mine.len()
            };
            for _ in 0..dropped {
                done.finish_chunk(Some("cancelled: the prediction was wrong".into()));
                self.counters.busy.lock().unwrap().end();
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

/// Takes the next op for a drive: demand first, prefetch only below its in-flight cap, background only when
/// no prefetch waits and below its own cap. `None` on shutdown.
fn next_op(drive: &Drive, max_prefetch: usize, block: bool) -> Option<Option<(ReadOp, Priority)>> {
    let mut q = drive.queues.lock().unwrap();
    loop {
        if let Some(op) = q.demand.pop_front() {
            return Some(Some((op, Priority::Demand)));
        }
        if q.prefetch_in_flight < max_prefetch {
            if let Some(op) = q.prefetch.pop_front() {
                q.prefetch_in_flight += 1;
                return Some(Some((op, Priority::Prefetch)));
            }
        }
        if q.prefetch.is_empty() && q.background_in_flight < MAX_BACKGROUND_IN_FLIGHT {
            if let Some(op) = q.background.pop_front() {
                q.background_in_flight += 1;
                return Some(Some((op, Priority::Background)));
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
fn complete(
    drive: &Drive,
    counters: &IoCounters,
    op: &ReadOp,
    priority: Priority,
    err: Option<String>,
) {
    counters.reads.fetch_add(1, Ordering::Relaxed);
    let bytes = match priority {
        Priority::Demand => &counters.demand_bytes,
        Priority::Prefetch => &counters.prefetch_bytes,
        Priority::Background => &counters.background_bytes,
    };
    bytes.fetch_add(op.len as u64, Ordering::Relaxed);
    if priority != Priority::Demand {
        let mut q = drive.queues.lock().unwrap();
        match priority {
            Priority::Prefetch => q.prefetch_in_flight -= 1,
            _ => q.background_in_flight -= 1,
        }
        drop(q);
        drive.wake.notify_one();
    }
    op.done.finish_chunk(err);
    counters.busy.lock().unwrap().end();
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
    let mut in_flight: Vec<Option<(ReadOp, Priority)>> = (0..depth).map(|_| None).collect();
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
            let Some((op, priority)) = next else { break };
            if op.file.faults.is_some()
                || op.mapped
                || op.file.needs_bounce(op.dst, op.offset, op.len)
            {
                // Injected faults, mapped ranges and reads off the O_DIRECT grid live on the positioned-read path.
                let err = positioned_read(&op);
                complete(&drive, &counters, &op, priority, err);
                continue;
            }
            populate(op.dst as usize, op.len);
            let entry =
                opcode::Read::new(types::Fd(op.file.file.as_raw_fd()), op.dst, op.len as u32)
                    .offset(op.offset)
                    .build()
                    .user_data(slot as u64);
            // SAFETY: `op.dst..+len` stays valid and untouched until this read completes (the slab's promise),
            // and `op` (holding the file open) lives in `in_flight` until then.
            if unsafe { ring.submission().push(&entry) }.is_err() {
                let err = positioned_read(&op);
                complete(&drive, &counters, &op, priority, err);
                continue;
            }
            in_flight[slot] = Some((op, priority));
        }
        if in_flight.iter().all(|s| s.is_none()) {
            continue;
        }
        if let Err(e) = ring.submit_and_wait(1) {
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            // The ring failed as a whole: finish what it held with positioned reads.
            for (op, priority) in in_flight.iter_mut().filter_map(Option::take) {
                let err = positioned_read(&op);
                complete(&drive, &counters, &op, priority, err);
            }
            continue;
        }
        let done: Vec<(usize, i32)> = ring
            .completion()
            .map(|c| (c.user_data() as usize, c.result()))
            .collect();
        for (slot, res) in done {
            let Some((op, priority)) = in_flight[slot].take() else {
                continue;
            };
            // Whatever the ring could not finish in one go (EINVAL from a direct read, a short read) is completed
            // with the same positioned read the pool uses.
            let err = if res >= 0 && res as usize >= op.need {
                None
            } else {
                positioned_read(&op)
            };
            complete(&drive, &counters, &op, priority, err);
        }
    }
}

/// Performs `op` with a positioned read (the pool's way, and the ring's fallback); the error text if it failed.
fn positioned_read(op: &ReadOp) -> Option<String> {
    if op.mapped {
        return op
            .file
            .bring_in(op.dst, op.offset, op.len, op.need)
            .err()
            .map(|e| read_error(op, e));
    }
    // SAFETY: the slab keeps `dst..dst+len` valid, and written by this op alone, until the op completes.
    let buf = unsafe { std::slice::from_raw_parts_mut(op.dst, op.len) };
    populate(op.dst as usize, op.len);
    op.file
        .read_at_least(buf, op.offset, op.need)
        .err()
        .map(|e| read_error(op, e))
}

fn worker(drive: Arc<Drive>, counters: Arc<IoCounters>, max_prefetch: usize) {
    while let Some(Some((op, priority))) = next_op(&drive, max_prefetch, true) {
        complete(&drive, &counters, &op, priority, positioned_read(&op));
    }
}
