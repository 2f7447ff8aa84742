//! The expert store: where routed experts live (an unpacked checkpoint's shards or a pack striped over
//! drives), the read engine that brings them in, and the RAM cache — a fixed slab of record-sized slots
//! allocated once, so no token allocates — or, asked to and when the cache holds every record, the page cache
//! through read-only mappings of the data files ([`mapped`]).
//!
//! The model asks for one layer's experts at a time with [`ExpertStore::fetch`] and computes each one as its
//! bytes arrive; [`ExpertStore::prefetch`] queues predicted experts of the next layer into idle disk time.

mod fill;
pub mod io;
pub mod mapped;
pub mod os;
pub mod pack;
pub mod policy;
pub mod probe;
pub mod record;

use anyhow::{bail, Result};
use io::{
    align_down, align_up, AlignedBuf, Completion, DataFile, IoEngine, IoMode, Priority, ReadOp,
    ALIGN,
};
use policy::Policy;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// A contiguous byte range of one data file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Extent {
    pub file: usize,
    pub offset: u64,
    pub len: usize,
}

/// Where one expert's record lives, and its checksum when a pack manifest provides one.
#[derive(Clone, Debug)]
pub struct RecordLoc {
    pub extents: Vec<Extent>,
    pub checksum: Option<u64>,
}

/// A source below the local files: records that are not on local disk yet (a partial mirror of a remote
/// repository) are brought there before they are read.
pub trait Backfill: Send + Sync + std::fmt::Debug {
    /// Makes the records of `experts` of `layer` present in the local files, fetching what is missing. Room it
    /// makes must not come from records `busy(layer, expert)` says are being read.
    fn ensure(
        &self,
        layer: usize,
        experts: &[usize],
        busy: &dyn Fn(usize, usize) -> bool,
    ) -> Result<()>;
    /// Whether the record is in the local files now (prefetch reads only those).
    fn present(&self, layer: usize, expert: usize) -> bool;
    /// Lookahead: starts bringing predicted records that are not local, without waiting.
    fn prefetch(self: Arc<Self>, layer: usize, experts: &[usize]);
    /// xxh3-64 of the record as it was fetched and verified (known also after it was evicted), checked again
    /// on every read from disk.
    fn checksum(&self, layer: usize, expert: usize) -> Option<u64>;
    /// What it fetched so far, for the stats line.
    fn activity(&self) -> String;
}

#[derive(Clone, Debug)]
pub struct StoreOptions {
    /// Bytes of RAM for cached expert records beyond the working set.
    pub cache_bytes: u64,
    /// Records a pass may hold at once (the working set); at least 2.
    pub working_slots: usize,
    pub direct_io: bool,
    pub workers_per_drive: usize,
    /// Large records are split into chunks of this size, read in parallel.
    pub chunk_bytes: usize,
    pub policy: Policy,
    pub prefetch: bool,
    /// Reader threads or io_uring.
    pub backend: io::Backend,
    /// Faults injected into every expert read (tests of failing drives); none in normal use.
    pub faults: Option<Arc<dyn io::FaultInjector>>,
    /// When the cache holds every record, serve records from read-only mappings of the data files instead
    /// of the slab ([`mapped`]: no first-touch clearing, and the next process finds them cached). Off by
    /// default: on the VM measured, cold runs were no faster with it (BENCHMARKS.md, "First touch"). Without
    /// effect for the io_uring engine (whose one thread per drive would wait on each range in turn) or
    /// records split over several extents.
    pub map_files: bool,
}

impl Default for StoreOptions {
    fn default() -> Self {
        StoreOptions {
            cache_bytes: 0,
            working_slots: 32,
            direct_io: true,
            workers_per_drive: 8,
            chunk_bytes: 1 << 20,
            policy: Policy::default(),
            prefetch: true,
            backend: io::Backend::Pool,
            faults: None,
            map_files: false,
        }
    }
}

type Key = (usize, usize);

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Phase {
    Empty,
    Loading,
    Ready,
}

struct Slot {
    key: Option<Key>,
    phase: Phase,
    pins: u32,
    /// Offset of the record's first byte inside the slot (direct reads start at an aligned address).
    start: usize,
    done: Option<Arc<Completion>>,
    verified: bool,
    /// Loaded by a prefetch and not yet asked for.
    prefetched: bool,
}

struct SlabState {
    map: HashMap<Key, usize>,
    slots: Vec<Slot>,
    policy: policy::State,
}

/// Counters of what the store did (cumulative; read with [`ExpertStore::snapshot`]).
#[derive(Default)]
struct Counters {
    requests: AtomicU64,
    hits: AtomicU64,
    prefetch_hits: AtomicU64,
    prefetch_issued: AtomicU64,
    wait_ns: AtomicU64,
}

/// Per layer: prediction quality of the lookahead, and whether it is still on.
#[derive(Clone, Default, Debug)]
pub struct LayerPrediction {
    pub predicted: u64,
    pub correct: u64,
    pub actual: u64,
    pub disabled: bool,
}

impl LayerPrediction {
    pub fn precision(&self) -> f64 {
        self.correct as f64 / self.predicted.max(1) as f64
    }
    pub fn recall(&self) -> f64 {
        self.correct as f64 / self.actual.max(1) as f64
    }
}

/// A point-in-time copy of the counters.
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    pub requests: u64,
    pub hits: u64,
    pub prefetch_hits: u64,
    pub prefetch_issued: u64,
    pub demand_bytes: u64,
    pub prefetch_bytes: u64,
    /// Read by the background fill (not part of any pass).
    pub background_bytes: u64,
    pub reads: u64,
    pub wait_secs: f64,
    /// Wall time with reads outstanding.
    pub disk_busy_secs: f64,
    pub layers: Vec<LayerPrediction>,
}

impl Snapshot {
    pub fn hit_rate(&self) -> f64 {
        (self.hits + self.prefetch_hits) as f64 / self.requests.max(1) as f64
    }

    pub fn bytes_read(&self) -> u64 {
        self.demand_bytes + self.prefetch_bytes
    }

    /// `self − earlier`, for per-step deltas.
    pub fn since(&self, earlier: &Snapshot) -> Snapshot {
        Snapshot {
            requests: self.requests - earlier.requests,
            hits: self.hits - earlier.hits,
            prefetch_hits: self.prefetch_hits - earlier.prefetch_hits,
            prefetch_issued: self.prefetch_issued - earlier.prefetch_issued,
            demand_bytes: self.demand_bytes - earlier.demand_bytes,
            prefetch_bytes: self.prefetch_bytes - earlier.prefetch_bytes,
            background_bytes: self.background_bytes - earlier.background_bytes,
            reads: self.reads - earlier.reads,
            wait_secs: self.wait_secs - earlier.wait_secs,
            disk_busy_secs: self.disk_busy_secs - earlier.disk_busy_secs,
            layers: self.layers.clone(),
        }
    }
}

pub struct ExpertStore {
    files: Vec<Arc<DataFile>>,
    layers: Vec<Vec<RecordLoc>>,
    record_len: usize,
    slot_len: usize,
    memory: Memory,
    state: Mutex<SlabState>,
    notify: Arc<(Mutex<()>, Condvar)>,
    io: Arc<IoEngine>,
    counters: Counters,
    prediction: Mutex<Vec<(Option<Vec<usize>>, LayerPrediction)>>,
    opts: StoreOptions,
    backfill: Option<Arc<dyn Backfill>>,
    /// Describes where records come from, for messages ("pack at …", "checkpoint …").
    pub origin: String,
}

/// Where cached records' bytes live.
enum Memory {
    /// Slots of `slot_len` bytes, filled by reads.
    Slab(AlignedBuf),
    /// One read-only mapping per data file: a record lies where its file has it.
    Mapped(Vec<mapped::FileMap>),
}

/// Slab bytes one record takes: room for an aligned read that starts up to one page before the record and
/// ends past it.
pub fn slot_bytes(record_len: usize) -> u64 {
    align_up(record_len as u64) + 2 * ALIGN as u64
}

/// After this many predictions a layer whose lookahead is wrong more often than right stops prefetching: when
/// the drive is the bottleneck, a wasted read costs a whole record of bandwidth while a right one only moves a
/// read earlier (measured with `deltafin bench`: lookahead at ~15% precision made cold steps 12-20% slower).
const PREDICTION_WARMUP: u64 = 32;
const PREDICTION_MIN_PRECISION: f64 = 0.5;
/// A layer's predictions are read once this many have been scored (and at least half were right).
const PREDICTION_READ_AFTER: u64 = 8;

impl ExpertStore {
    /// `files[i]`: path and drive of data file i; `layers[l]`: the records of layer l (empty for dense layers).
    pub fn new(
        files: &[(std::path::PathBuf, usize)],
        layers: Vec<Vec<RecordLoc>>,
        record_len: usize,
        opts: StoreOptions,
        origin: String,
    ) -> Result<ExpertStore> {
        let drives = files.iter().map(|f| f.1 + 1).max().unwrap_or(1);
        let files: Vec<Arc<DataFile>> = files
            .iter()
            .map(|(p, d)| {
                let mut file = DataFile::open(p, opts.direct_io, *d)?;
                file.faults = opts.faults.clone();
                Ok(Arc::new(file))
            })
            .collect::<Result<_>>()?;
        for (l, recs) in layers.iter().enumerate() {
            for (e, r) in recs.iter().enumerate() {
                let len: usize = r.extents.iter().map(|x| x.len).sum();
                if len != record_len {
                    bail!("layer {l} expert {e}: record is {len} bytes, expected {record_len}");
                }
                if r.extents.iter().any(|x| x.file >= files.len()) {
                    bail!("layer {l} expert {e}: record names a data file that does not exist");
                }
            }
        }
        let slot_len = slot_bytes(record_len) as usize;
        let working = opts.working_slots.max(2);
        // No point in slots beyond every record the model has.
        let records: usize = layers.iter().map(Vec::len).sum();
        let cached =
            ((opts.cache_bytes / slot_len as u64) as usize).min(records.saturating_sub(working));
        let n_slots = working + cached;
        let memory = match map_files(&files, &layers, &opts, n_slots >= records) {
            Some(maps) => Memory::Mapped(maps),
            None => Memory::Slab(AlignedBuf::new(n_slots * slot_len)),
        };
        let slots = (0..n_slots)
            .map(|_| Slot {
                key: None,
                phase: Phase::Empty,
                pins: 0,
                start: 0,
                done: None,
                verified: false,
                prefetched: false,
            })
            .collect();
        let io = IoEngine::with_backend(drives, opts.workers_per_drive, opts.backend);
        Ok(ExpertStore {
            files,
            prediction: Mutex::new(vec![(None, LayerPrediction::default()); layers.len()]),
            layers,
            record_len,
            slot_len,
            memory,
            state: Mutex::new(SlabState {
                map: HashMap::new(),
                slots,
                policy: policy::State::new(opts.policy),
            }),
            notify: Arc::new((Mutex::new(()), Condvar::new())),
            io,
            counters: Counters::default(),
            opts,
            backfill: None,
            origin,
        })
    }

    /// Records missing from the local files are fetched through `backfill` before they are read.
    pub fn with_backfill(mut self, backfill: Arc<dyn Backfill>) -> ExpertStore {
        // A mirror's files change under a mapping (records fetched, room made by evicting): records are
        // read into the slab.
        if let Memory::Mapped(_) = self.memory {
            self.memory = Memory::Slab(AlignedBuf::new(self.slots() * self.slot_len));
        }
        self.backfill = Some(backfill);
        self
    }

    /// What the backfill (a remote source) did, when there is one.
    pub fn backfill_activity(&self) -> Option<String> {
        self.backfill.as_ref().map(|b| b.activity())
    }

    /// Reads of the record are in flight or its bytes are handed out.
    fn busy(&self, key: Key) -> bool {
        let st = self.state.lock().unwrap();
        st.map
            .get(&key)
            .is_some_and(|&s| st.slots[s].phase == Phase::Loading || st.slots[s].pins > 0)
    }

    fn checksum(&self, layer: usize, expert: usize) -> Option<u64> {
        self.layers[layer][expert].checksum.or_else(|| {
            self.backfill
                .as_ref()
                .and_then(|b| b.checksum(layer, expert))
        })
    }

    pub fn record_len(&self) -> usize {
        self.record_len
    }

    /// Reads the records of `keys` through the same read path (files, direct I/O, chunking, queue depth),
    /// `window` records at a time like a layer's demand, into scratch memory: no cache, no compute. The pure
    /// I/O time of exactly the bytes a pass read — the bound a benchmark compares the pass against.
    pub fn time_reads(&self, keys: &[(usize, usize)], window: usize) -> Result<f64> {
        let window = window.max(1);
        let scratch = AlignedBuf::new(window * self.slot_len);
        let t0 = Instant::now();
        for batch in keys.chunks(window) {
            let mut waits = Vec::new();
            for (i, &(l, e)) in batch.iter().enumerate() {
                let slot = scratch.as_ptr().wrapping_add(i * self.slot_len);
                for read in self
                    .plan_reads(&self.layers[l][e], self.opts.chunk_bytes.max(ALIGN))
                    .1
                {
                    let c = Completion::new(1, self.notify.clone());
                    self.io.submit(read.op(slot, false, &c), Priority::Demand);
                    waits.push(c);
                }
            }
            let (lock, cv) = &*self.notify;
            let mut g = lock.lock().unwrap();
            while !waits.iter().all(|c| c.is_done()) {
                g = cv.wait_timeout(g, Duration::from_millis(5)).unwrap().0;
            }
            drop(g);
            if let Some(e) = waits.iter().find_map(|c| c.error()) {
                bail!("timing reads: {e}");
            }
        }
        Ok(t0.elapsed().as_secs_f64())
    }

    /// Memory of the record slab (cache plus working set), or of every record when they are served from
    /// the page cache.
    pub fn slab_bytes(&self) -> u64 {
        match &self.memory {
            Memory::Slab(slab) => slab.len() as u64,
            Memory::Mapped(_) => (self.records_cached().0 * self.record_len) as u64,
        }
    }

    /// Whether records are served from the page cache through mappings of their files.
    pub fn in_page_cache(&self) -> bool {
        matches!(self.memory, Memory::Mapped(_))
    }

    /// The slab's address range, for page-locking it with a device driver so that copies to the device read
    /// records where they lie. It stays mapped, at this address, for the store's lifetime. Empty when
    /// records are served from the page cache (see [`StoreOptions::map_files`]).
    pub fn slab_range(&self) -> (*mut u8, usize) {
        match &self.memory {
            Memory::Slab(slab) => (slab.as_ptr(), slab.len()),
            Memory::Mapped(_) => (std::ptr::null_mut(), 0),
        }
    }

    /// Records of the model, and how many of them the cache holds or is reading in.
    pub fn records_cached(&self) -> (usize, usize) {
        let all = self.layers.iter().map(Vec::len).sum();
        (all, self.state.lock().unwrap().map.len())
    }

    /// Every record of the model is in the cache with its reads finished (where the slab holds them all,
    /// the background fill is done).
    pub fn all_cached(&self) -> bool {
        let st = self.state.lock().unwrap();
        st.map.len() == self.layers.iter().map(Vec::len).sum::<usize>() && loading(&st.slots) == 0
    }

    /// Slots whose reads (demand, prediction or fill) have not all finished.
    pub fn records_loading(&self) -> usize {
        loading(&self.state.lock().unwrap().slots)
    }

    /// The slab has a slot for every record of the model (the background fill's case).
    pub fn holds_every_record(&self) -> bool {
        self.state.lock().unwrap().slots.len() >= self.layers.iter().map(Vec::len).sum()
    }

    pub fn slots(&self) -> usize {
        self.state.lock().unwrap().slots.len()
    }

    pub fn io_modes(&self) -> Vec<IoMode> {
        self.files.iter().map(|f| f.mode).collect()
    }

    pub fn snapshot(&self) -> Snapshot {
        let c = &self.counters;
        let io = &self.io.counters;
        Snapshot {
            requests: c.requests.load(Ordering::Relaxed),
            hits: c.hits.load(Ordering::Relaxed),
            prefetch_hits: c.prefetch_hits.load(Ordering::Relaxed),
            prefetch_issued: c.prefetch_issued.load(Ordering::Relaxed),
            demand_bytes: io.demand_bytes.load(Ordering::Relaxed),
            prefetch_bytes: io.prefetch_bytes.load(Ordering::Relaxed),
            background_bytes: io.background_bytes.load(Ordering::Relaxed),
            reads: io.reads.load(Ordering::Relaxed),
            wait_secs: c.wait_ns.load(Ordering::Relaxed) as f64 * 1e-9,
            disk_busy_secs: io.busy_secs(),
            layers: self
                .prediction
                .lock()
                .unwrap()
                .iter()
                .map(|p| p.1.clone())
                .collect(),
        }
    }

    /// Demand: the records of `experts` of `layer`, handed out as they arrive (in no particular order).
    pub fn fetch(&self, layer: usize, experts: &[usize]) -> Fetch<'_> {
        self.score_prediction(layer, experts);
        self.cancel_wrong_predictions(layer, experts);
        self.counters
            .requests
            .fetch_add(experts.len() as u64, Ordering::Relaxed);
        Fetch {
            store: self,
            layer,
            pending: experts.to_vec(),
            loading: Vec::new(),
            backfilled: self.backfill.is_none(),
        }
    }

    /// Queues predicted records of `layer` into idle disk time where that pays (`lookahead_pays`), into the
    /// slots `take_slot` allows a prediction, never waiting, in the order given (the likeliest first).
    /// Predictions are scored against the next demand for the layer.
    pub fn prefetch(&self, layer: usize, experts: &[usize]) {
        let measured = {
            let mut p = self.prediction.lock().unwrap();
            if p[layer].1.disabled {
                return;
            }
            p[layer].0 = Some(experts.to_vec());
            p[layer].1.clone()
        };
        if !self.opts.prefetch {
            return;
        }
        // Disk reads only for what is on local disk; the backfill starts bringing the rest. Asked before
        // taking the slab lock (the backfill takes its own lock first).
        let (experts, remote): (Vec<usize>, Vec<usize>) = experts
            .iter()
            .partition(|&&e| self.backfill.as_ref().is_none_or(|b| b.present(layer, e)));
        if let (Some(b), false) = (&self.backfill, remote.is_empty()) {
            b.clone().prefetch(layer, &remote);
        }
        if !self.lookahead_pays(&measured) {
            return;
        }
        let mut st = self.state.lock().unwrap();
        // Keep at least half the working set free for demand.
        let reserve = self.opts.working_slots.max(2) / 2;
        for &e in &experts {
            if st.map.contains_key(&(layer, e)) {
                continue;
            }
            settle_prefetched(&mut st);
            let free_slots = st
                .slots
                .iter()
                .filter(|s| s.pins == 0 && s.phase != Phase::Loading)
                .count();
            if free_slots <= reserve {
                break;
            }
            let Some(slot) = self.take_slot(&mut st, Some((layer, &experts))) else {
                break;
            };
            self.start_load(&mut st, slot, (layer, e), Priority::Prefetch);
            st.slots[slot].prefetched = true;
            self.counters
                .prefetch_issued
                .fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Drops the reads not yet started of this layer's predicted records that its demand did not ask for.
    /// Demand is read before predictions, so a wrong guess then costs only the chunks in flight when the
    /// demand came, not a whole record read later, ahead of the next layer's guesses.
    fn cancel_wrong_predictions(&self, layer: usize, wanted: &[usize]) {
        if self.holds_every_record() {
            // The background fill reads every record once, skipping those already mapped: a cancelled
            // guess would never be filled. Here a wrong guess only reads a record early.
            return;
        }
        let mut cancelled = Vec::new();
        {
            let mut st = self.state.lock().unwrap();
            let SlabState { slots, map, .. } = &mut *st;
            for s in slots.iter_mut() {
                let Some((l, e)) = s.key else { continue };
                if l != layer || !s.prefetched || s.pins > 0 || wanted.contains(&e) {
                    continue;
                }
                if let Some(done) = s.done.as_ref().filter(|d| !d.is_done()) {
                    // Unmapped now, so no demand can claim the partial record; the slot is settled (freed)
                    // once the reads in flight have landed.
                    cancelled.push(done.clone());
                    map.remove(&(l, e));
                    s.key = None;
                    s.prefetched = false;
                }
            }
        }
        for done in &cancelled {
            self.io.cancel(done);
        }
    }

    /// Whether reading a layer's predictions from the local drive is expected to save more drive time than it
    /// costs. Predictions are read after the layer's demand, so they take the drive's idle time — the
    /// layer's tail of compute, the next attention and router — and a right one hides a read the next pass
    /// would wait for. A wrong one costs only its chunks in flight when the next demand comes
    /// (`cancel_wrong_predictions` drops the rest). Predictions are scored whether read or not, so a layer is
    /// read once its precision is measured and at least [`PREDICTION_MIN_PRECISION`]. (Before wrong reads
    /// were cancelled, a random-weight model's guesses, p ≈ 0.55, cost 20–40% of decode speed under a tight
    /// cache: BENCHMARKS.md, issue 26.)
    fn lookahead_pays(&self, measured: &LayerPrediction) -> bool {
        if self.holds_every_record() {
            // Nothing is evicted and the background fill reads every record anyway: a wrong guess only
            // reads one of them earlier.
            return true;
        }
        measured.predicted >= PREDICTION_READ_AFTER
            && measured.precision() >= PREDICTION_MIN_PRECISION
    }

    pub fn prediction_enabled(&self, layer: usize) -> bool {
        self.opts.prefetch && !self.prediction.lock().unwrap()[layer].1.disabled
    }

    fn score_prediction(&self, layer: usize, actual: &[usize]) {
        let mut p = self.prediction.lock().unwrap();
        let (pred, stats) = &mut p[layer];
        if let Some(pred) = pred.take() {
            stats.predicted += pred.len() as u64;
            stats.actual += actual.len() as u64;
            stats.correct += pred.iter().filter(|e| actual.contains(e)).count() as u64;
            if stats.predicted >= PREDICTION_WARMUP && stats.precision() < PREDICTION_MIN_PRECISION
            {
                stats.disabled = true;
            }
        }
    }

    /// A free slot, or the unpinned ready slot the policy values least — for a prediction of `experts` of `layer`
    /// (`prediction`), only among the prefetched records nobody asked for yet (not those same predictions, which
    /// may land while later ones are queued) and the records demand brought in beyond the
    /// expert cache's own slots (those sit in the working set, which the next demand recycles anyway), never a
    /// record the cache holds: a prediction is right about half the time on some models, and evicting cached
    /// records for guesses cost 40% of decode speed at a 3 GiB limit (BENCHMARKS.md, "Stop 23"). A
    /// prefetched record joins the ordinary cache on its first demand use.
    fn take_slot(
        &self,
        st: &mut SlabState,
        prediction: Option<(usize, &[usize])>,
    ) -> Option<usize> {
        settle_prefetched(st);
        let SlabState { slots, policy, map } = st;
        let victim = if let Some(i) = slots.iter().position(|s| s.phase == Phase::Empty) {
            i
        } else {
            let cache_slots = slots.len().saturating_sub(self.opts.working_slots.max(2));
            let demanded = slots
                .iter()
                .filter(|s| s.key.is_some() && s.phase == Phase::Ready && !s.prefetched)
                .count();
            let spare = prediction.is_none() || demanded > cache_slots;
            let same_batch =
                |key: Key| prediction.is_some_and(|(l, es)| l == key.0 && es.contains(&key.1));
            policy.victim(
                slots
                    .iter()
                    .enumerate()
                    .filter(|(_, s)| s.pins == 0 && s.phase == Phase::Ready)
                    .filter(|(_, s)| s.prefetched || spare)
                    .filter_map(|(i, s)| Some((i, s.key?)))
                    .filter(|&(_, k)| !same_batch(k)),
            )?
        };
        if let Some(k) = slots[victim].key.take() {
            map.remove(&k);
        }
        slots[victim].phase = Phase::Empty;
        Some(victim)
    }

    /// Issues the reads of `key` into `slot`; background reads come in larger chunks, being sequential.
    fn start_load(&self, st: &mut SlabState, slot: usize, key: Key, priority: Priority) {
        let chunk = match priority {
            Priority::Background => fill::CHUNK_BYTES,
            _ => self.opts.chunk_bytes,
        }
        .max(ALIGN);
        let rec = &self.layers[key.0][key.1];
        let (base, mapped) = match &self.memory {
            Memory::Slab(slab) => (slab.as_ptr().wrapping_add(slot * self.slot_len), false),
            Memory::Mapped(maps) => (maps[rec.extents[0].file].as_ptr(), true),
        };
        let (start, ops) = if mapped {
            self.plan_mapped(rec, chunk)
        } else {
            self.plan_reads(rec, chunk)
        };
        let done = Completion::new(ops.len() as u64, self.notify.clone());
        let s = &mut st.slots[slot];
        *s = Slot {
            key: Some(key),
            phase: Phase::Loading,
            pins: 0,
            start,
            done: Some(done.clone()),
            verified: false,
            prefetched: false,
        };
        st.map.insert(key, slot);
        if priority == Priority::Demand {
            // A speculative load is not a use: an unclaimed prefetch is the first thing LRU evicts.
            st.policy.touch(key);
        }
        for read in ops {
            self.io.submit(read.op(base, mapped, &done), priority);
        }
    }

    /// How `rec` is read into a slot of `slot_len` bytes: where its first byte lands in the slot, and the
    /// reads, each at most `chunk` bytes. Direct reads need the file offset and the slot address to agree
    /// modulo the page, and one record-wide shift (`start`) can make that so for the largest extent (others
    /// only where their offsets happen to agree). An extent so aligned is read in place, whole pages where
    /// they spill only into the slot's padding (always, for a one-extent record); any other bytes are read
    /// off the grid, through a scratch page buffer ([`io::DataFile::needs_bounce`]). A buffered file reads
    /// every extent as it is.
    fn plan_reads(&self, rec: &RecordLoc, chunk: usize) -> (usize, Vec<PlannedRead>) {
        let direct = |x: &Extent| self.files[x.file].mode == IoMode::Direct;
        let mut at = 0;
        let placed: Vec<(&Extent, usize)> = rec
            .extents
            .iter()
            .map(|x| {
                at += x.len;
                (x, at - x.len)
            })
            .collect();
        let start = placed
            .iter()
            .filter(|(x, _)| direct(x))
            .max_by_key(|(x, _)| x.len)
            .map_or(0, |(x, d)| (x.offset as usize).wrapping_sub(*d) % ALIGN);
        let last = placed.len().saturating_sub(1);
        let mut reads = Vec::new();
        for (i, &(x, d)) in placed.iter().enumerate() {
            let (file, end) = (&self.files[x.file], x.offset + x.len as u64);
            let slot_at = (start + d) as u64;
            let mut read = |from: u64, to: u64, need_to: u64| {
                let mut at = from;
                while at < to {
                    let len = ((to - at) as usize).min(chunk);
                    reads.push(PlannedRead {
                        file: file.clone(),
                        offset: at,
                        len,
                        need: (need_to.min(at + len as u64) - at) as usize,
                        dst: (slot_at + at - x.offset) as usize,
                    });
                    at += len as u64;
                }
            };
            if !direct(x) || (x.offset.wrapping_sub(slot_at)) % ALIGN as u64 != 0 {
                read(x.offset, end, end);
                continue;
            }
            // The pages around the extent: whole where they spill into padding, else trimmed to it.
            let from = if i == 0 {
                align_down(x.offset)
            } else {
                align_up(x.offset)
            };
            let to = if i == last {
                align_up(end)
            } else {
                align_down(end)
            };
            if from >= to {
                read(x.offset, end, end);
                continue;
            }
            read(x.offset, from, from);
            read(from, to, end);
            read(to, end, end);
        }
        (start, reads)
    }

    /// How a record served from the page cache ([`Memory::Mapped`], always one extent) is brought in: from
    /// its first page to its last byte (a page wholly past the file's end cannot be mapped), each read's
    /// destination its offset in the file's mapping.
    fn plan_mapped(&self, rec: &RecordLoc, chunk: usize) -> (usize, Vec<PlannedRead>) {
        let x = &rec.extents[0];
        let (a, end) = (align_down(x.offset), x.offset + x.len as u64);
        let mut reads = Vec::new();
        let mut at = a;
        while at < end {
            let len = ((end - at) as usize).min(chunk);
            reads.push(PlannedRead {
                file: self.files[x.file].clone(),
                offset: at,
                len,
                need: len,
                dst: at as usize,
            });
            at += len as u64;
        }
        ((x.offset - a) as usize, reads)
    }

    /// The bytes of record `key` held by `slot`, `start` bytes into it.
    fn record(&self, slot: usize, key: Key, start: usize) -> &[u8] {
        match &self.memory {
            Memory::Slab(slab) => {
                &slab.as_slice()[slot * self.slot_len + start..][..self.record_len]
            }
            Memory::Mapped(maps) => {
                let x = &self.layers[key.0][key.1].extents[0];
                &maps[x.file].as_slice()[x.offset as usize..][..self.record_len]
            }
        }
    }

    fn release(&self, slot: usize) {
        let mut st = self.state.lock().unwrap();
        st.slots[slot].pins -= 1;
        drop(st);
        let (lock, cv) = &*self.notify;
        let _g = lock.lock().unwrap();
        cv.notify_all();
    }
}

/// One read of a record's plan ([`ExpertStore::plan_reads`]), its destination relative to the slot.
struct PlannedRead {
    file: Arc<DataFile>,
    offset: u64,
    len: usize,
    need: usize,
    dst: usize,
}

impl PlannedRead {
    fn op(self, slot: *mut u8, mapped: bool, done: &Arc<Completion>) -> ReadOp {
        ReadOp {
            file: self.file,
            offset: self.offset,
            len: self.len,
            need: self.need,
            dst: slot.wrapping_add(self.dst),
            mapped,
            done: done.clone(),
        }
    }
}

/// Read-only mappings of `files` when records are to be served from the page cache: the cache holds every
/// record (`holds_all`, so nothing is ever evicted from a slot), each record is one extent inside its file,
/// and the options allow it. `None` keeps the slab (also where a file cannot be mapped).
fn map_files(
    files: &[Arc<DataFile>],
    layers: &[Vec<RecordLoc>],
    opts: &StoreOptions,
    holds_all: bool,
) -> Option<Vec<mapped::FileMap>> {
    if !(cfg!(target_os = "linux")
        && holds_all
        && opts.map_files
        && opts.backend == io::Backend::Pool)
    {
        return None;
    }
    let maps: Vec<mapped::FileMap> = files
        .iter()
        .map(|f| mapped::FileMap::open(&f.path))
        .collect::<Option<_>>()?;
    // A record past its file's end stays with the slab, whose reads report the file as short.
    let inside = |x: &Extent| x.offset + x.len as u64 <= maps[x.file].len() as u64;
    layers
        .iter()
        .flatten()
        .all(|r| matches!(&r.extents[..], [x] if inside(x)))
        .then_some(maps)
}

/// Prefetched records whose reads finished while nobody waited on them become ordinary ready (evictable)
/// entries; failed ones are dropped so that a later demand reads them again and reports the error itself.
/// How many of `slots` have reads still outstanding.
fn loading(slots: &[Slot]) -> usize {
    slots
        .iter()
        .filter(|s| s.done.as_ref().is_some_and(|d| !d.is_done()))
        .count()
}

fn settle_prefetched(st: &mut SlabState) {
    let SlabState { slots, map, .. } = st;
    for s in slots.iter_mut() {
        if s.phase == Phase::Loading && s.pins == 0 && s.done.as_ref().is_some_and(|d| d.is_done())
        {
            // A cancelled prediction (no key) is freed whether or not its last reads got in first.
            let failed = s.done.take().and_then(|d| d.error()).is_some() || s.key.is_none();
            s.phase = if failed { Phase::Empty } else { Phase::Ready };
            if failed {
                if let Some(k) = s.key.take() {
                    map.remove(&k);
                }
            }
        }
    }
}

impl Drop for ExpertStore {
    fn drop(&mut self) {
        // Workers write into the slab: stop them before it is freed.
        self.io.shutdown();
    }
}

/// One layer's demand, yielding records as their reads complete.
pub struct Fetch<'a> {
    store: &'a ExpertStore,
    layer: usize,
    pending: Vec<usize>,
    loading: Vec<(usize, usize)>,
    /// The backfill (if any) has made every pending record local.
    backfilled: bool,
}

/// A pinned record: its bytes stay put until this is dropped.
pub struct RecordRef<'a> {
    store: &'a ExpertStore,
    slot: usize,
    bytes: &'a [u8],
    pub expert: usize,
}

impl RecordRef<'_> {
    pub fn bytes(&self) -> &[u8] {
        self.bytes
    }
}

impl Drop for RecordRef<'_> {
    fn drop(&mut self) {
        self.store.release(self.slot);
    }
}

impl<'a> Fetch<'a> {
    /// The next arrived record, waiting for one; `None` when all were handed out.
    #[allow(clippy::should_implement_trait)] // blocking and fallible, unlike Iterator::next's contract
    pub fn next(&mut self) -> Option<Result<RecordRef<'a>>> {
        self.take(true)
    }

    /// A record that has already arrived, without waiting; `None` when none has (or all were handed out).
    pub fn next_arrived(&mut self) -> Option<Result<RecordRef<'a>>> {
        self.take(false)
    }

    fn take(&mut self, wait: bool) -> Option<Result<RecordRef<'a>>> {
        let store = self.store;
        let t0 = Instant::now();
        if !self.backfilled {
            self.backfilled = true;
            if let Some(b) = &store.backfill {
                if let Err(e) = b.ensure(self.layer, &self.pending, &|l, e| store.busy((l, e))) {
                    self.pending.clear();
                    return Some(Err(e));
                }
            }
        }
        let result = loop {
            self.issue();
            if self.pending.is_empty() && self.loading.is_empty() {
                break None;
            }
            if let Some(i) = self.loading.iter().position(|&(_, slot)| {
                store.state.lock().unwrap().slots[slot]
                    .done
                    .as_ref()
                    .is_none_or(|d| d.is_done())
            }) {
                let (e, slot) = self.loading.swap_remove(i);
                break Some(self.finish(e, slot));
            }
            if !wait {
                break None;
            }
            let (lock, cv) = &*store.notify;
            let g = lock.lock().unwrap();
            // Re-check under the lock is unnecessary: completions notify under it; the timeout only bounds a
            // missed wake-up when a slot frees up through another fetch.
            let _ = cv.wait_timeout(g, Duration::from_millis(5)).unwrap();
        };
        store
            .counters
            .wait_ns
            .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        result
    }

    /// Assigns slots to pending experts while slots are available: first those the slab holds, pinned before
    /// any miss takes a victim (a request's misses never evict its own records), then the rest in request
    /// order.
    fn issue(&mut self) {
        let store = self.store;
        let mut st = store.state.lock().unwrap();
        let layer = self.layer;
        self.pending
            .sort_by_key(|&e| !st.map.contains_key(&(layer, e)));
        while let Some(&e) = self.pending.first() {
            let key = (self.layer, e);
            let slot = if let Some(&slot) = st.map.get(&key) {
                // Pinned before the lock may be dropped below: an unpinned slot can be settled, evicted
                // and refilled with another record by a concurrent pass in that window.
                st.slots[slot].pins += 1;
                let s = &mut st.slots[slot];
                if s.prefetched {
                    s.prefetched = false;
                    store.counters.prefetch_hits.fetch_add(1, Ordering::Relaxed);
                } else if s.phase == Phase::Ready || s.done.as_ref().is_some_and(|d| d.is_done()) {
                    // Ready, or filled in the background and not claimed yet.
                    store.counters.hits.fetch_add(1, Ordering::Relaxed);
                }
                // A prefetch or background read still queued is now awaited: it moves to the demand queue.
                if let Some(d) = s.done.clone().filter(|d| !d.is_done()) {
                    drop(st);
                    store.io.promote(&d);
                    st = store.state.lock().unwrap();
                }
                st.policy.touch(key);
                slot
            } else {
                let Some(slot) = store.take_slot(&mut st, None) else {
                    break;
                };
                store.start_load(&mut st, slot, key, Priority::Demand);
                st.slots[slot].pins += 1;
                slot
            };
            self.loading.push((e, slot));
            self.pending.remove(0);
        }
    }

    fn finish(&self, e: usize, slot: usize) -> Result<RecordRef<'a>> {
        let store = self.store;
        // Before the slab lock: the backfill takes its own lock first.
        let want = store.checksum(self.layer, e);
        let mut st = store.state.lock().unwrap();
        let (done, start) = (st.slots[slot].done.take(), st.slots[slot].start);
        let fail = |st: &mut SlabState, msg: String| -> Result<RecordRef<'a>> {
            // Never leave bad bytes where a later request would trust them.
            st.slots[slot].pins -= 1;
            st.slots[slot].phase = Phase::Empty;
            if let Some(k) = st.slots[slot].key.take() {
                st.map.remove(&k);
            }
            bail!("layer {} expert {e}: {msg}", self.layer)
        };
        if let Some(err) = done.as_ref().and_then(|d| d.error()) {
            return fail(
                &mut st,
                format!(
                    "read failed ({}): {err}; nothing was computed from it, and the next use reads it again — if that fails too, check the drive (dmesg) and the file",
                    store.origin
                ),
            );
        }
        if st.slots[slot].phase == Phase::Empty {
            // Another pass sharing this load saw it fail and dropped it.
            return fail(&mut st, "its read failed in a concurrent pass".into());
        }
        st.slots[slot].phase = Phase::Ready;
        if !st.slots[slot].verified {
            if let Some(want) = want {
                let got = xxhash_rust::xxh3::xxh3_64(store.record(slot, (self.layer, e), start));
                if got != want {
                    let file = &store.files[store.layers[self.layer][e].extents[0].file].path;
                    return fail(
                        &mut st,
                        format!(
                            "checksum mismatch in {} (expected {want:016x}, read {got:016x}); the file is damaged — re-run `deltafin pack`, or for a mirror delete it and fetch again",
                            file.display()
                        ),
                    );
                }
            }
            st.slots[slot].verified = true;
        }
        Ok(RecordRef {
            store,
            slot,
            bytes: store.record(slot, (self.layer, e), start),
            expert: e,
        })
    }
}

impl Drop for Fetch<'_> {
    fn drop(&mut self) {
        // Records issued but never handed out (an error cut the pass short): wait for their reads, unpin them.
        for &(_, slot) in &self.loading {
            let done = self.store.state.lock().unwrap().slots[slot].done.clone();
            while let Some(d) = &done {
                if d.is_done() {
                    break;
                }
                std::thread::sleep(Duration::from_micros(200));
            }
            let mut st = self.store.state.lock().unwrap();
            st.slots[slot].pins -= 1;
            if st.slots[slot].phase == Phase::Loading {
                st.slots[slot].phase = Phase::Empty;
                if let Some(k) = st.slots[slot].key.take() {
                    st.map.remove(&k);
                }
            }
        }
    }
}
