//! Both families on the GPU, in the order of the CPU code (crates/models): the spine in VRAM (layers beyond
//! its budget streamed from page-locked host memory, one layer ahead), routed experts in a VRAM slot cache fed
//! from the CPU-side expert store (by DMA from its page-locked slab).

use crate::gpu::{par_copy, DevBuf, Doing, Gpu, Launch, On, Pinned};
use crate::plan::{
    attn_res_values, matmul_ring_bytes, matmul_tile, plan_spine, plan_waves, Ring, SlotCache,
    MIX_VALUES,
};
use anyhow::{anyhow, bail, Context, Result};
use cudarc::driver::{result as cu, sys, CudaContext, CudaEvent, CudaGraph};
use deltafin_formats::checkpoint::Checkpoint;
use deltafin_formats::config::{Family, ModelConfig};
use deltafin_models::describe::{self, DecayGate, Description, Mat, Vector};
use deltafin_models::weights::{Linear, Loader};
use deltafin_models::{
    open_expert_store, split_rows, Backend, LoadOptions, LogitRows, ModelExperts, Pass, Stats,
};
use deltafin_store::record::{Encoding, ExpertRecord};
use deltafin_store::{ExpertStore, RecordRef};
use std::cell::Cell;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

/// Options of the CUDA backend.
#[derive(Clone, Debug, Default)]
pub struct CudaOptions {
    pub ordinal: usize,
    /// VRAM for routed experts; default: every expert of the model, or what fits in free memory less 4 GiB.
    pub expert_vram: Option<u64>,
    /// VRAM for the spine's layers (the two streaming buffers count against it when any layer streams);
    /// default: every layer, or what fits in free memory less 4 GiB.
    pub spine_vram: Option<u64>,
    /// `run --timeline`: note where each decode step's time goes (timeline.rs).
    pub timeline: bool,
}

/// What the expert path did on the device (cumulative).
#[derive(Clone, Debug, Default)]
pub struct CudaCounters {
    pub vram_hits: u64,
    pub vram_misses: u64,
    pub h2d_bytes: u64,
    /// Bytes of streamed spine layers copied to the device.
    pub spine_h2d_bytes: u64,
    /// Host time spent getting records from the store and issuing their copies (including the staging memcpy
    /// where the store's slab is not page-locked).
    pub stage_secs: f64,
    /// Host time passes spent issuing their work: everything before waiting for the logits. Near a step's
    /// time, the GPU waits on the host.
    pub issue_secs: f64,
    /// GPU time from a pass's first piece of work to its last (events on the compute stream): the step less
    /// this is the host's start and the logits' return.
    pub gpu_secs: f64,
    /// Decode steps run ahead on the device's choice that the next step took over, and those discarded (the
    /// host chose another token, or the session was used otherwise).
    pub ahead_taken: u64,
    pub ahead_discarded: u64,
}

/// Where a block of spine tensors (a layer, or the embeddings and head) lies in VRAM: its own allocation or a
/// streaming buffer, known only once every layer's size is (the plan needs them all), after its tensors were
/// laid out.
type Base = Arc<OnceLock<u64>>;

/// A spine tensor: its offset in its block.
struct At {
    base: Base,
    off: u64,
}

impl At {
    fn ptr(&self) -> u64 {
        self.base.get().expect("every block is placed at load") + self.off
    }
}

struct Lin {
    at: At,
    rows: usize,
    cols: usize,
}

impl Lin {
    fn ptr(&self) -> u64 {
        self.at.ptr()
    }
}

/// A block's image in host memory, each tensor 256-byte aligned (as a VRAM allocation of its own would be).
struct Block {
    bytes: Vec<u8>,
    base: Base,
    /// BF16 matrix bytes, all read once per token.
    matrix_bytes: u64,
}

impl Block {
    fn new() -> Block {
        Block {
            bytes: Vec::new(),
            base: Arc::default(),
            matrix_bytes: 0,
        }
    }

    fn put(&mut self, data: &[u8]) -> At {
        let off = self.bytes.len().next_multiple_of(256);
        self.bytes.resize(off, 0);
        self.bytes.extend_from_slice(data);
        At {
            base: self.base.clone(),
            off: off as u64,
        }
    }

    fn vector(&mut self, v: &[f32]) -> At {
        self.put(as_bytes(v))
    }

    fn lin(&mut self, m: Linear) -> Lin {
        let (_, mut parts) = self.fuse(vec![m]);
        parts.pop().expect("one part")
    }

    /// Matrices that multiply the same input, back to back in the order given: a one-row pass runs them as one
    /// matmul (`mm_parts`). Returns the fused matrix and each part. Every part's rows are whole 32-element
    /// blocks, so each part starts 64-byte aligned.
    fn fuse(&mut self, parts: Vec<Linear>) -> (Lin, Vec<Lin>) {
        let cols = parts[0].cols;
        let rows = parts.iter().map(|p| p.rows).sum();
        let at = self.put(&[]);
        let mut placed = Vec::with_capacity(parts.len());
        for p in parts {
            assert_eq!(p.cols, cols, "fused matrices share their input");
            self.matrix_bytes += p.bytes() as u64;
            placed.push(Lin {
                at: At {
                    base: self.base.clone(),
                    off: self.bytes.len() as u64,
                },
                rows: p.rows,
                cols,
            });
            self.bytes.extend_from_slice(as_bytes(&p.data));
        }
        (Lin { at, rows, cols }, placed)
    }
}

/// Plain values (f32, u16) as their bytes.
fn as_bytes<T: Copy>(v: &[T]) -> &[u8] {
    // SAFETY: any initialised plain value is readable as bytes.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast(), std::mem::size_of_val(v)) }
}

enum OutGate {
    Full(Lin),
    Low(Lin, Lin),
}

struct Kda {
    /// q, k, v, f_a, the gate's first matrix, b: fused (`fuse`), in that order.
    xin: Lin,
    q: Lin,
    k: Lin,
    v: Lin,
    conv: At,
    f_a: Lin,
    f_b: Lin,
    b: Lin,
    a_log: At,
    dt_bias: At,
    o_norm: At,
    gate: OutGate,
    o: Lin,
    heads: usize,
    dim: usize,
    kern: usize,
    /// 0: K3's lower-bound sigmoid gate and clamped q/k norm; 1: Kimi Linear's softplus gate and eps-in-sqrt norm.
    kind: usize,
}

enum QPath {
    Low { a: Lin, norm: At, b: Lin },
    Direct(Lin),
}

impl QPath {
    /// The matrix applied to the layer's input.
    fn first(&self) -> &Lin {
        match self {
            QPath::Low { a, .. } => a,
            QPath::Direct(p) => p,
        }
    }
}

impl OutGate {
    fn first(&self) -> &Lin {
        match self {
            OutGate::Full(g) | OutGate::Low(g, _) => g,
        }
    }
}

struct Mla {
    /// q's first matrix, kv_a and the gate (K3): fused (`fuse`), in that order.
    xin: Lin,
    q: QPath,
    kv_a: Lin,
    kv_norm: At,
    kv_b: Lin,
    gate: Option<Lin>,
    o: Lin,
    heads: usize,
    nope: usize,
    rope: usize,
    dv: usize,
    kvl: usize,
    eps: f32,
}

enum Attn {
    Kda(Box<Kda>),
    Mla(Box<Mla>),
}

struct Mlp {
    gate: Lin,
    up: Lin,
    down: Lin,
}

struct Moe {
    /// K3: the latent down projection and the router, fused (`fuse`), in that order.
    xin: Option<Lin>,
    router: Lin,
    bias: At,
    latent: Option<(Lin, At, Lin)>,
    shared: Mlp,
}

enum Ffn {
    Dense(Mlp),
    Moe(Box<Moe>),
}

struct Layer {
    attn_res: Option<At>,
    input_norm: At,
    attn: Attn,
    mlp_res: Option<At>,
    post_norm: At,
    ffn: Ffn,
}

/// What the CUDA expert kernels need of the shared record layout ([`ExpertRecord`], the one description of
/// where an expert's tensors sit): which kernels read it, and the shared memory they stage it in.
trait ExpertKernels {
    fn mxfp4(&self) -> bool;
    /// The record's tensor offsets as the kernels take them (BF16 fills the first three).
    fn offsets(&self) -> [u64; 6];
    /// The expert kernels (up, down) of this encoding that take `rows` x rows a pass over the weights (see
    /// `rows_per_pass`), and the activation they apply (0 SiTU, 1 SiLU).
    fn kernels(&self, rows: usize) -> (&'static str, &'static str, usize);
    /// The x rows the expert kernels take a pass over an expert's weights when it has several: MXFP4 two (in the
    /// free columns of the same tensor-core MMAs), BF16 one.
    fn rows_per_pass(&self) -> usize;
    /// Dynamic shared memory of an expert kernel's block that stages `rows` x rows of `len` elements: for BF16
    /// four warps' double-buffered tiles and the x row (4 bytes an element); for MXFP4 per row the block scales'
    /// factors (256 floats) and the row as the tensor cores' fragments (three f16 parts: 6 bytes an element).
    fn expert_smem(&self, len: usize, rows: usize) -> usize;
    /// Dynamic shared memory of an `mx_repack` block: one 32-row group of a tensor, 16 bytes per column of the
    /// longer side.
    fn repack_smem(&self) -> usize;
}

impl ExpertKernels for ExpertRecord {
    fn mxfp4(&self) -> bool {
        self.encoding == Encoding::Mxfp4
    }

    fn offsets(&self) -> [u64; 6] {
        let mut at = [0u64; 6];
        let n = if self.mxfp4() { 6 } else { 3 };
        for (i, o) in at.iter_mut().enumerate().take(n) {
            *o = self.part(i).0 as u64;
        }
        at
    }

    fn kernels(&self, rows: usize) -> (&'static str, &'static str, usize) {
        match (self.mxfp4(), rows) {
            (true, 1) => ("expert_up_mx", "expert_down_mx", 0),
            (true, _) => ("expert_up_mx2", "expert_down_mx2", 0),
            (false, _) => ("expert_up_bf16", "expert_down_bf16", 1),
        }
    }

    fn rows_per_pass(&self) -> usize {
        if self.mxfp4() {
            2
        } else {
            1
        }
    }

    fn expert_smem(&self, len: usize, rows: usize) -> usize {
        if self.mxfp4() {
            rows * (4 * 256 + 6 * len)
        } else {
            4 * 2 * 32 * 9 * 16 + 4 * len
        }
    }

    fn repack_smem(&self) -> usize {
        16 * self.width.max(self.inter)
    }
}

/// The VRAM expert cache: slots, their bookkeeping, and the pinned staging ring (used only when the store's
/// slab could not be page-locked; otherwise records are copied from the slab directly).
struct ExpertCache {
    slots: DevBuf,
    slot_len: usize,
    plan: SlotCache,
    staging: Vec<(Pinned, CudaEvent)>,
    ring: Ring,
    /// Marks each record's copy for the prep stream to wait on (a wait takes the event as it is when issued, so
    /// one event serves every copy).
    copied: CudaEvent,
    counters: CudaCounters,
}

pub struct CudaModel {
    gpu: Gpu,
    cfg: ModelConfig,
    embed: Lin,
    layers: Vec<Layer>,
    out_res: Option<At>,
    norm: At,
    lm_head: Lin,
    /// The resident blocks' VRAM (the embeddings and head, and each resident layer).
    _spine: Vec<DevBuf>,
    streamed: Option<Streamed>,
    store: Arc<ExpertStore>,
    layout: Arc<ExpertRecord>,
    cache: Mutex<ExpertCache>,
    arena: Mutex<Arena>,
    spine_bytes: u64,
    /// The store's slab is page-locked (registered with the driver): the DMA engine reads records in place.
    slab_registered: bool,
    /// At most this many records stay pinned in the store while their copies run (half its slots).
    held_cap: usize,
    /// Set when every expert is resident: decode then routes on the device with no host round trip.
    direct: Option<Direct>,
    /// Timing events around each pass's work on the compute stream.
    span: [CudaEvent; 2],
    /// Where graphed decode steps leave their results.
    picks: Picks,
    /// The fork of K3's shared expert onto the side stream and its join, recorded again in every MoE layer (a
    /// stream's wait takes the event as last recorded when it is issued): no event made and destroyed a layer.
    fork: CudaEvent,
    join: CudaEvent,
    /// Why decode steps run without graphs, once a capture failed (the driver may not capture every launch).
    graphs_off: Mutex<Option<String>>,
}

/// Device tables of the resident decode path: each (layer, expert)'s record pointer, and the expert kernels'
/// fixed tables for one row of top_k entries (row offsets 0..=top_k, which are also the combine's entries, and
/// the row index 0 of every entry).
struct Direct {
    table: DevBuf,
    seq: DevBuf,
    row0: DevBuf,
}

/// A graphed decode step's results, by the parity of its position (so a step run ahead never overwrites those
/// of the step before it): `decode_pick` writes the logits and the greedy choice into `out`, the copy stream
/// brings them into `host`.
struct Picks {
    /// [2][vocab + 1] floats: the logits, then the choice's bits.
    out: DevBuf,
    host: Pinned,
    /// Around each step's graph on the compute stream (its GPU time; the copy back waits on the second).
    span: [[CudaEvent; 2]; 2],
    /// Its results are in `host`.
    done: [CudaEvent; 2],
}

/// The spine layers that stream: their images in page-locked host memory, each copied into one of two VRAM
/// buffers one layer ahead of compute. The j-th streamed layer always uses buffer j % 2, so its tensors'
/// addresses are fixed at load and the kernels read the same bytes as from a resident layer.
struct Streamed {
    host: Pinned,
    /// Per streamed layer in order: (layer, offset and length of its image in `host`).
    images: Vec<(usize, usize, usize)>,
    /// Per layer: its index in `images`, if it streams.
    index: Vec<Option<usize>>,
    /// Two, or one when a single layer streams.
    bufs: Vec<DevBuf>,
    /// Per buffer: its copy has landed (compute waits on it); its layer's kernels are done (the next copy into
    /// it waits on that).
    copied: [CudaEvent; 2],
    freed: [CudaEvent; 2],
}

/// One sequence's device state.
pub struct CudaSession {
    layers: Vec<State>,
    pos: usize,
    /// Its one-row resident pass, captured at its first decode step and replayed after (see `DecodeGraph`).
    graph: Option<DecodeGraph>,
    /// A decode step launched on the device's own choice and not yet taken over (`Backend::decode`).
    ahead: Option<Ahead>,
}

/// A step run ahead: the token the device chose for it, and the arena's count of passes once it was issued.
struct Ahead {
    token: u32,
    ticket: u64,
}

/// A session's decode step as a CUDA graph: the whole pass launched at once, so the GPU never waits on the host
/// issuing it and runs its kernels back to back. What changes between steps (the token, the position) is read by
/// the kernels from the pass's header at the start of the scratch: uploaded before a launch, or written by the
/// step before (`decode_pick`) for a step run ahead. Everything else the graph holds is in its key.
struct DecodeGraph {
    graph: CudaGraph,
    key: GraphKey,
    ctx: Arc<CudaContext>,
}

impl Drop for DecodeGraph {
    fn drop(&mut self) {
        // The graph (a field) is destroyed next, with the context current on whichever thread drops the session
        // (as a pass makes it) and no launch of it still running (a step run ahead may be).
        let _ = self.ctx.bind_to_thread();
        let _ = self.ctx.synchronize();
    }
}

#[derive(PartialEq, Eq, Clone, Copy)]
struct GraphKey {
    scratch: u64,
    /// The MLA caches' capacity (growing reallocates them).
    cap: usize,
}

// SAFETY: a graph is used only through its session, which a pass holds mutably (never two threads at once).
unsafe impl Send for DecodeGraph {}

impl CudaSession {
    /// Whether its MLA caches hold `n` more positions.
    fn holds(&self, n: usize) -> bool {
        self.layers
            .iter()
            .all(|st| !matches!(st, State::Mla { cap, .. } if *cap < self.pos + n))
    }

    /// The positions its MLA caches hold (0 without MLA layers).
    fn mla_cap(&self) -> usize {
        self.layers
            .iter()
            .map(|st| match st {
                State::Mla { cap, .. } => *cap,
                State::Kda { .. } => 0,
            })
            .max()
            .unwrap_or(0)
    }
}

/// A pass's header, uploaded first: every row's token, then each session's position.
fn header(batch: &[Pass<'_, CudaSession>]) -> Vec<u32> {
    let mut h = deltafin_models::batch_tokens(batch);
    h.extend(batch.iter().map(|p| p.session.pos as u32));
    h
}

enum State {
    Kda { conv: DevBuf, s: DevBuf },
    Mla { lat: DevBuf, pe: DevBuf, cap: usize },
}

/// How a matmul reads and writes its rows: x RMS-normalised first with `norm` (weights, eps) when given; y = W·x
/// plus `add` (a device row block of the same shape) when non-zero, stored or, with `accumulate`, added into y.
/// The forward pass's norms and residual adds are fused into the matmuls next to them (the same arithmetic).
#[derive(Clone, Copy, Default)]
struct Mm {
    norm: Option<(u64, f32)>,
    add: u64,
    accumulate: bool,
    /// On the side stream.
    side: bool,
}

/// Scratch device memory for one pass, handed out by bumping an offset (allocation would synchronise).
struct Arena {
    buf: Option<DevBuf>,
    off: Cell<usize>,
    /// Page-locked host memory for the pass's small uploads (token ids, expert tables), also bumped: a copy from
    /// pageable memory may synchronise the stream, and each of those costs a round trip. Not reused before the
    /// pass's final synchronisation.
    host: Option<Pinned>,
    host_off: Cell<usize>,
    /// Whether the pass issued work on the copy or prep stream (streamed layers, experts routed via the host),
    /// which its end must then wait for too.
    copies: Cell<bool>,
    /// A pass of several resident rows: where each layer's count of chosen experts lands (0 otherwise).
    groups: Cell<u64>,
    /// Passes issued so far: a step run ahead is taken over only if nothing was issued after it.
    issued: Cell<u64>,
}

impl Arena {
    fn take(&self, bytes: usize) -> Result<u64> {
        let buf = self.buf.as_ref().expect("sized at pass start");
        let at = self.off.get();
        let end = at + bytes.div_ceil(256) * 256;
        if end > buf.bytes {
            bail!(
                "internal: the pass's scratch ({} bytes) is too small",
                buf.bytes
            );
        }
        self.off.set(end);
        Ok(buf.ptr + at as u64)
    }
    fn f32s(&self, n: usize) -> Result<u64> {
        self.take(4 * n)
    }
}

impl Drop for CudaModel {
    fn drop(&mut self) {
        // A decode step run ahead may still be running.
        let _ = self.gpu.ctx.synchronize();
        if self.slab_registered {
            let _ = self.gpu.ctx.bind_to_thread();
            // SAFETY: registered in `load`; no copy is in flight (every pass synchronises both streams).
            unsafe { sys::cuMemHostUnregister(self.store.slab_range().0.cast()) };
        }
    }
}

/// The CPU model's contract on the device: the same sessions, passes and logits (within the tolerance of the
/// GPU's math functions; docs/cuda.md).
impl Backend for CudaModel {
    type Session = CudaSession;

    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn store(&self) -> &Arc<ExpertStore> {
        &self.store
    }

    /// The GPU's name and compute capability.
    fn kernels(&self) -> String {
        let off = self.graphs_off.lock().unwrap();
        let graphs = off.as_ref().map_or(String::new(), |why| {
            format!(", decode steps without graphs: {why}")
        });
        format!(
            "{} (sm_{}{}){graphs}",
            self.gpu.name, self.gpu.sm.0, self.gpu.sm.1
        )
    }

    fn reports_layers(&self) -> bool {
        false
    }

    fn new_session(&self) -> Result<CudaSession> {
        let layers = self
            .layers
            .iter()
            .map(|l| match &l.attn {
                Attn::Kda(k) => {
                    let w = k.heads * k.dim;
                    // Two copies of each: see kda_recurrence.
                    Ok(State::Kda {
                        conv: self.zeros(2 * 3 * w * (k.kern - 1))?,
                        s: self.zeros(2 * k.heads * k.dim * k.dim)?,
                    })
                }
                Attn::Mla(m) => {
                    let cap = 64;
                    Ok(State::Mla {
                        lat: self.zeros(cap * m.kvl)?,
                        pe: self.zeros(cap * m.rope)?,
                        cap,
                    })
                }
            })
            .collect::<Result<_>>()?;
        Ok(CudaSession {
            layers,
            pos: 0,
            graph: None,
            ahead: None,
        })
    }

    /// One pass over every session's rows: each runs attention on its own state, the rest of the layer on
    /// all rows at once (a routed expert read once for every row that chose it).
    fn forward_batch(
        &self,
        batch: &mut [Pass<'_, CudaSession>],
        stats: &Stats,
    ) -> Result<Vec<Vec<f32>>> {
        if batch.is_empty() {
            return Ok(Vec::new());
        }
        deltafin_models::check_batch(&self.cfg, batch)?;
        // A server runs passes on its own worker thread: the context must be current there.
        self.gpu
            .ctx
            .bind_to_thread()
            .doing("binding the GPU context to this thread")?;
        let n: usize = batch.iter().map(|p| p.tokens.len()).sum();
        if n == 1 && self.graphed() {
            let p = &mut batch[0];
            return Ok(vec![self.step(p.session, p.tokens[0], false, stats)?]);
        }
        let t0 = Instant::now();
        for p in batch.iter_mut() {
            // A step run ahead is discarded: this pass reads the state from before it (see kda_recurrence).
            if p.session.ahead.take().is_some() {
                self.cache.lock().unwrap().counters.ahead_discarded += 1;
            }
            self.reserve(p.session, p.tokens.len())?;
        }
        let cap = batch.iter().map(|p| p.session.mla_cap()).max().unwrap_or(0);
        let mut arena = self.arena.lock().unwrap();
        self.size_arena(&mut arena, n, cap)?;
        arena.issued.set(arena.issued.get() + 1);
        let mut held = Vec::new();
        if let Some(t) = &self.gpu.timeline {
            t.begin();
            self.gpu.htod_sync(t.count, &[0u32])?;
        }
        let issued = self.stage(&arena, &header(batch)).and_then(|hdr| {
            self.gpu.record(&self.span[0])?;
            self.pass(&arena, batch, stats, &mut held, hdr)
        });
        let result = issued.and_then(|(logits, len)| {
            self.gpu.record(&self.span[1])?;
            self.cache.lock().unwrap().counters.issue_secs += t0.elapsed().as_secs_f64();
            let out = self.gpu.dtoh(logits, len)?;
            let ms = self.span[0]
                .elapsed_ms(&self.span[1])
                .doing("timing a pass")?;
            self.cache.lock().unwrap().counters.gpu_secs += ms as f64 / 1e3;
            Ok(out)
        });
        // Every asynchronous copy from host memory has completed once the logits came back (or on error here).
        // Once they came back, the compute stream is done and with it the side stream's work (joined into it);
        // the copy and prep streams had work only if the pass copied.
        if result.is_err() || arena.copies.get() {
            let _ = self.gpu.stream.synchronize();
            let _ = self.gpu.side.synchronize();
            let _ = self.gpu.copy.synchronize();
            let _ = self.gpu.prep.synchronize();
        }
        drop(held);
        let out = result?;
        // Resident experts are counted here: a decode step's are top_k a layer; a pass of several rows counted
        // its layers' on the device.
        if self.direct.is_some() && n == 1 {
            self.count_step_uses(stats);
        } else if arena.groups.get() != 0 {
            let moe = (0..self.cfg.num_layers).filter(|&l| !self.cfg.is_dense(l));
            let counts = self
                .gpu
                .dtoh::<i32>(arena.groups.get(), self.cfg.num_layers)?;
            self.count_uses(stats, moe.map(|l| counts[l] as usize).sum(), true);
        }
        // A decode step's notes (a longer pass's blocks may wait more than once).
        if let Some(t) = self.gpu.timeline.as_ref().filter(|_| n == 1) {
            let count = self.gpu.dtoh::<u32>(t.count, 1)?[0] as usize;
            t.end_step(&mut self.gpu.dtoh::<u64>(t.notes, count.min(t.cap))?);
        }
        // Each session's logit rows, in batch order; its position moves past its tokens.
        for p in batch.iter_mut() {
            p.session.pos += p.tokens.len();
        }
        Ok(split_rows(out, self.cfg.vocab_size, batch))
    }

    /// A graphed step run ahead when asked (see `step`); otherwise a plain pass.
    fn decode(
        &self,
        session: &mut CudaSession,
        token: u32,
        ahead: bool,
        stats: &Stats,
    ) -> Result<Vec<f32>> {
        if !self.graphed() {
            return self.forward(session, &[token], LogitRows::Last, stats);
        }
        let pass = Pass {
            session,
            tokens: &[token],
            rows: LogitRows::Last,
        };
        deltafin_models::check_batch(&self.cfg, std::slice::from_ref(&pass))?;
        self.gpu
            .ctx
            .bind_to_thread()
            .doing("binding the GPU context to this thread")?;
        self.step(pass.session, token, ahead, stats)
    }

    /// Every state buffer copied whole on the device (the MLA caches with their spare capacity). The copies have
    /// landed when it returns, so the original may be dropped (freed) or run on at once.
    fn fork(&self, session: &CudaSession) -> Result<CudaSession> {
        let copy = |b: &DevBuf| -> Result<DevBuf> {
            let c = self.gpu.alloc(b.bytes)?;
            self.gpu.dtod(c.ptr, b.ptr, b.bytes)?;
            Ok(c)
        };
        let layers = session
            .layers
            .iter()
            .map(|st| {
                Ok(match st {
                    State::Kda { conv, s } => State::Kda {
                        conv: copy(conv)?,
                        s: copy(s)?,
                    },
                    State::Mla { lat, pe, cap } => State::Mla {
                        lat: copy(lat)?,
                        pe: copy(pe)?,
                        cap: *cap,
                    },
                })
            })
            .collect::<Result<_>>()?;
        self.gpu
            .stream
            .synchronize()
            .map_err(|e| anyhow!("copying a session: {e:?}"))?;
        Ok(CudaSession {
            layers,
            pos: session.pos,
            graph: None,
            ahead: None,
        })
    }

    fn position(&self, session: &CudaSession) -> usize {
        session.pos
    }

    /// VRAM held: every state buffer, the MLA caches with their spare capacity.
    fn session_bytes(&self, session: &CudaSession) -> usize {
        session
            .layers
            .iter()
            .map(|st| match st {
                State::Kda { conv, s } => conv.bytes + s.bytes,
                State::Mla { lat, pe, .. } => lat.bytes + pe.bytes,
            })
            .sum()
    }
}

/// What a CUDA model is built from, all of it taken from the shared model description: the config, the
/// checkpoint, and the routed experts opened by [`open_expert_store`] exactly as the CPU opens them (a partial
/// mirror fills and verifies an expert before it is read, or the load is refused with the CPU's message). It
/// needs no GPU, so tests inspect it on any machine.
pub struct Source {
    pub cfg: ModelConfig,
    pub ck: Checkpoint,
    pub experts: ModelExperts,
}

impl Source {
    pub fn open(dir: &Path, load: &LoadOptions) -> Result<Source> {
        let cfg = ModelConfig::from_dir(dir)?;
        let ck = Checkpoint::open(dir)?;
        let mut load = load.clone();
        // The GPU path does not run the lookahead router; prediction scoring would only disable itself.
        load.store.prefetch = false;
        let experts = open_expert_store(dir, &ck, &cfg, &load)?;
        Ok(Source { cfg, ck, experts })
    }
}

impl CudaModel {
    pub fn load(dir: &Path, load: &LoadOptions, opts: &CudaOptions) -> Result<CudaModel> {
        let Source {
            cfg,
            ck,
            experts:
                ModelExperts {
                    store,
                    record: layout,
                },
        } = Source::open(dir, load)?;
        let values = attn_res_values(cfg.num_layers, cfg.attn_res_block);
        if values > MIX_VALUES {
            bail!(
                "{}: attn_res_block_size {} over {} layers makes AttnRes mixes of {values} values; the CUDA \
                 kernels mix at most {MIX_VALUES}: run this model on the CPU",
                dir.display(),
                cfg.attn_res_block.unwrap_or(0),
                cfg.num_layers
            );
        }
        let gpu = Gpu::open(opts.ordinal, opts.timeline)?;
        // Shared memory per block: the expert kernels stage their x (width elements up, inter down); mx_repack
        // rearranges one 32-row group of a tensor.
        let mut needs = Vec::new();
        for rows in [1, layout.rows_per_pass()] {
            let (up, down, _) = layout.kernels(rows);
            needs.push((up, layout.expert_smem(layout.width, rows)));
            needs.push((down, layout.expert_smem(layout.inter, rows)));
        }
        if layout.mxfp4() {
            needs.push(("mx_repack", layout.repack_smem()));
        }
        for (k, need) in needs {
            if need > gpu.dynamic_smem(k) {
                bail!(
                    "experts of shape {}x{} need {need} bytes of shared memory per block in {k}; this GPU offers \
                     {}: run this model on the CPU",
                    layout.inter,
                    layout.width,
                    gpu.dynamic_smem(k)
                );
            }
        }
        let desc = Description::of(&cfg)?;
        let ld = Loader::new(&ck);
        // Each layer's tensors are laid out in a host image first: where it goes (VRAM of its own, or a
        // streaming buffer) depends on every layer's size.
        let mut layers = Vec::with_capacity(cfg.num_layers);
        let mut blocks = Vec::with_capacity(cfg.num_layers);
        for (l, d) in desc.layers.iter().enumerate() {
            let mut b = Block::new();
            let mat = |m: &Mat| ld_mat(&ld, m);
            let layer = (|| -> Result<Layer> {
                let b = &mut b;
                let vecf =
                    |b: &mut Block, t: &Vector| -> Result<At> { Ok(b.vector(&ld.vector(t)?)) };
                let (attn_res, mlp_res) = match &d.res {
                    Some(r) => (
                        Some(b.vector(&ld.res_score(&r.attn)?)),
                        Some(b.vector(&ld.res_score(&r.mlp)?)),
                    ),
                    None => (None, None),
                };
                let attn = match &d.attn {
                    describe::Attention::Mla(m) => {
                        if m.kv_lora % 32 != 0 {
                            bail!("kv_lora_rank {} must be a multiple of 32", m.kv_lora);
                        }
                        let q_first = match &m.q {
                            describe::QueryPath::LowRank { a, .. } => a,
                            describe::QueryPath::Direct(p) => p,
                        };
                        let mut parts = vec![mat(q_first)?, mat(&m.kv_a)?];
                        if let Some(g) = &m.gate {
                            parts.push(mat(g)?);
                        }
                        let (xin, parts) = b.fuse(parts);
                        let mut parts = parts.into_iter();
                        let (q_in, kv_a, gate) = (
                            parts.next().expect("q"),
                            parts.next().expect("kv_a"),
                            parts.next(),
                        );
                        let q = match &m.q {
                            describe::QueryPath::LowRank { norm, b: q_b, .. } => QPath::Low {
                                a: q_in,
                                norm: vecf(b, norm)?,
                                b: b.lin(mat(q_b)?),
                            },
                            describe::QueryPath::Direct(_) => QPath::Direct(q_in),
                        };
                        Attn::Mla(Box::new(Mla {
                            xin,
                            q,
                            kv_a,
                            kv_norm: vecf(b, &m.kv_norm)?,
                            kv_b: b.lin(mat(&m.kv_b)?),
                            gate,
                            o: b.lin(mat(&m.o)?),
                            heads: m.heads,
                            nope: m.nope,
                            rope: m.rope,
                            dv: m.v,
                            kvl: m.kv_lora,
                            eps: m.latent_eps,
                        }))
                    }
                    describe::Attention::Kda(k) => {
                        let (heads, dim, kern) = (k.heads, k.dim, k.kernel);
                        if dim % 32 != 0 || dim > 1024 || kern == 0 {
                            bail!("the CUDA KDA kernel needs head_dim a multiple of 32 up to 1024 (got {dim}) and a conv kernel");
                        }
                        // The recurrence holds a head's state and four of its vectors in shared memory.
                        let smem = kda_smem(dim);
                        if smem > gpu.dynamic_smem("kda_recurrence") {
                            bail!(
                                "a KDA head of dimension {dim} needs {smem} bytes of shared memory on the GPU; this GPU \
                                 offers {}: run this model on the CPU",
                                gpu.dynamic_smem("kda_recurrence")
                            );
                        }
                        let mut conv = Vec::with_capacity(3 * heads * dim * kern);
                        for c in &k.conv {
                            conv.extend(ld.vector(c)?);
                        }
                        // One rate per head, first in either layout.
                        let a_log = ld.vector(&k.a_log)?[..heads].to_vec();
                        let (g_in, g_b) = match &k.out_gate {
                            describe::OutputGate::FullRank(g) => (g, None),
                            describe::OutputGate::LowRank(g_a, g_b) => (g_a, Some(g_b)),
                        };
                        // b last: its few rows would misalign the 16-byte loads of a part read as a matmul input.
                        let (xin, parts) = b.fuse(vec![
                            mat(&k.q)?,
                            mat(&k.k)?,
                            mat(&k.v)?,
                            mat(&k.f_a)?,
                            mat(g_in)?,
                            mat(&k.b)?,
                        ]);
                        let [q, k_proj, v, f_a, g_in, b_proj]: [Lin; 6] =
                            parts.try_into().map_err(|_| anyhow!("six parts"))?;
                        let gate = match g_b {
                            None => OutGate::Full(g_in),
                            Some(g_b) => OutGate::Low(g_in, b.lin(mat(g_b)?)),
                        };
                        Attn::Kda(Box::new(Kda {
                            xin,
                            q,
                            k: k_proj,
                            v,
                            conv: b.vector(&conv),
                            f_a,
                            f_b: b.lin(mat(&k.f_b)?),
                            b: b_proj,
                            a_log: b.vector(&a_log),
                            dt_bias: vecf(b, &k.dt_bias)?,
                            o_norm: vecf(b, &k.o_norm)?,
                            gate,
                            o: b.lin(mat(&k.o)?),
                            heads,
                            dim,
                            kern,
                            kind: if k.decay == DecayGate::Softplus { 1 } else { 0 },
                        }))
                    }
                };
                let mlp = |b: &mut Block, m: &describe::Mlp| -> Result<Mlp> {
                    Ok(Mlp {
                        gate: b.lin(mat(&m.gate)?),
                        up: b.lin(mat(&m.up)?),
                        down: b.lin(mat(&m.down)?),
                    })
                };
                let ffn = match &d.ffn {
                    describe::FeedForward::Dense(m) => Ffn::Dense(mlp(b, m)?),
                    describe::FeedForward::Moe(m) => {
                        let router = mat(&m.router.gate)?;
                        let (xin, router, latent) = match &m.latent {
                            Some(lt) => {
                                let (xin, parts) = b.fuse(vec![mat(&lt.down)?, router]);
                                let [down, router]: [Lin; 2] =
                                    parts.try_into().map_err(|_| anyhow!("two parts"))?;
                                let norm = vecf(b, &lt.norm)?;
                                let up = b.lin(mat(&lt.up)?);
                                (Some(xin), router, Some((down, norm, up)))
                            }
                            None => (None, b.lin(router), None),
                        };
                        Ffn::Moe(Box::new(Moe {
                            xin,
                            router,
                            bias: vecf(b, &m.router.bias)?,
                            latent,
                            shared: mlp(b, &m.shared)?,
                        }))
                    }
                };
                Ok(Layer {
                    attn_res,
                    input_norm: vecf(b, &d.input_norm)?,
                    attn,
                    mlp_res,
                    post_norm: vecf(b, &d.post_norm)?,
                    ffn,
                })
            })();
            layers.push(layer.with_context(|| format!("layer {l}"))?);
            blocks.push(b);
        }
        // The embeddings and head: always resident.
        let mut head = Block::new();
        let embed = ld_mat(&ld, &desc.embed)?;
        // One row of the embedding table is read per token: not counted as matrix bytes.
        let embed = Lin {
            at: head.put(as_bytes(&embed.data)),
            rows: embed.rows,
            cols: embed.cols,
        };
        let lm_head = head.lin(ld_mat(&ld, &desc.lm_head)?);
        let out_res = match &desc.residual {
            describe::Residual::AttnRes { out, .. } => Some(head.vector(&ld.res_score(out)?)),
            describe::Residual::PreNorm => None,
        };
        let norm = head.vector(&ld.vector(&desc.norm)?);
        let spine_bytes = head.matrix_bytes + blocks.iter().map(|b| b.matrix_bytes).sum::<u64>();
        let (spine, streamed) = place_spine(&gpu, head, blocks, opts.spine_vram)?;

        // The VRAM expert cache.
        let slot_len = layout.len().div_ceil(256) * 256;
        let records: usize =
            (0..cfg.num_layers).filter(|&l| !cfg.is_dense(l)).count() * cfg.moe.num_experts;
        let (free, _) = cu::mem_get_info().doing("reading the GPU's free memory")?;
        let budget = match opts.expert_vram {
            Some(b) => b,
            None => ((records * slot_len) as u64).min((free as u64).saturating_sub(4 << 30)),
        };
        let n_slots = ((budget / slot_len as u64) as usize).min(records.max(1));
        if n_slots == 0 {
            bail!("--expert-vram {budget} bytes holds no expert record of {slot_len} bytes; give at least one record's worth");
        }
        let slots = gpu
            .alloc(n_slots * slot_len)
            .with_context(|| format!("allocating {n_slots} VRAM expert slots"))?;
        // Page-lock the RAM expert cache so that copies read records where they lie: no staging memcpy on the
        // host, and the copy engine runs at the pinned rate. Where the driver refuses, stage through a ring.
        let (slab, slab_len) = store.slab_range();
        // SAFETY: the range is the store's mapping, alive until after `Drop` unregisters it.
        let slab_registered = unsafe { sys::cuMemHostRegister_v2(slab.cast(), slab_len, 0) }
            == sys::CUresult::CUDA_SUCCESS;
        let held_cap = (store.slots() / 2).max(1);
        let resident = n_slots == records;
        let staging = (0..if slab_registered { 0 } else { 4 })
            .map(|_| Ok((Pinned::new(&gpu, layout.len(), true)?, gpu.event()?)))
            .collect::<Result<Vec<_>>>()?;
        let cache = ExpertCache {
            slots,
            slot_len,
            plan: SlotCache::new(n_slots),
            ring: Ring::new(staging.len().max(1)),
            staging,
            copied: gpu.event()?,
            counters: CudaCounters::default(),
        };
        let span = [gpu.event()?, gpu.event()?];
        let picks = Picks {
            out: gpu.alloc(4 * 2 * (cfg.vocab_size + 1))?,
            host: Pinned::new(&gpu, 4 * 2 * (cfg.vocab_size + 1), false)?,
            span: [[gpu.event()?, gpu.event()?], [gpu.event()?, gpu.event()?]],
            done: [gpu.event()?, gpu.event()?],
        };
        let untimed = || gpu.ctx.new_event(None).doing("creating an event");
        let (fork, join) = (untimed()?, untimed()?);
        let mut model = CudaModel {
            span,
            picks,
            graphs_off: Mutex::new(None),
            fork,
            join,
            gpu,
            cfg,
            embed,
            layers,
            out_res,
            norm,
            lm_head,
            _spine: spine,
            streamed,
            store,
            layout,
            cache: Mutex::new(cache),
            arena: Mutex::new(Arena {
                buf: None,
                off: Cell::new(0),
                host: None,
                host_off: Cell::new(0),
                copies: Cell::new(false),
                groups: Cell::new(0),
                issued: Cell::new(0),
            }),
            spine_bytes,
            slab_registered,
            held_cap,
            direct: None,
        };
        if resident {
            model.preload().context("loading the experts into VRAM")?;
            model.direct = Some(model.direct_tables()?);
        }
        Ok(model)
    }

    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// BF16 spine bytes read per decode token (every matrix but the embedding table, of which one row).
    pub fn spine_bytes_per_token(&self) -> u64 {
        self.spine_bytes + 2 * self.cfg.hidden as u64
    }

    /// How many spine layers stream from host memory (each pass copies every one of them once).
    pub fn spine_layers_streamed(&self) -> usize {
        self.streamed.as_ref().map_or(0, |st| st.images.len())
    }

    pub fn record_len(&self) -> usize {
        self.layout.len()
    }

    pub fn expert_slots(&self) -> usize {
        self.cache.lock().unwrap().plan.slots()
    }

    /// Whether expert copies read the page-locked store slab directly (else through staging buffers).
    pub fn copies_from_slab(&self) -> bool {
        self.slab_registered
    }

    /// With `timeline` on: the `[timeline]` table of the decode steps so far.
    pub fn timeline_report(&self) -> Option<String> {
        self.gpu.timeline.as_ref().map(|t| t.report())
    }

    pub fn counters(&self) -> CudaCounters {
        self.cache.lock().unwrap().counters.clone()
    }

    fn zeros(&self, n: usize) -> Result<DevBuf> {
        self.gpu.upload(&vec![0.0f32; n.max(1)])
    }

    /// Sizes the pass's scratch and upload area for `n` rows of sessions whose MLA caches hold `cap` positions.
    fn size_arena(&self, arena: &mut Arena, n: usize, cap: usize) -> Result<()> {
        let c = &self.cfg;
        let (hd, w) = (c.hidden, c.kda.heads * c.kda.head_dim);
        let m = &c.mla;
        let anchors = c.attn_res_block.map_or(0, |b| c.num_layers.div_ceil(b)) + 1;
        let lay = &self.layout;
        let per_row = 4
            * ((anchors + 8) * hd
                + 9 * w
                + 2 * c.kda.head_dim
                + c.kda.heads
                + m.heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + 2 * m.v_head_dim)
                + m.q_lora_rank.unwrap_or(0)
                + m.kv_lora_rank
                + m.qk_rope_head_dim
                + m.heads * cap
                + c.moe.num_experts
                + 2 * lay.width
                + c.moe.top_k * (lay.inter + lay.width + 8)
                + c.moe.shared_width
                + c.dense_intermediate
                + c.vocab_size)
            + 1024;
        let need = n * per_row + (1 << 20);
        if arena.buf.as_ref().is_none_or(|b| b.bytes < need) {
            arena.buf = None;
            arena.buf = Some(self.gpu.alloc(need.next_power_of_two())?);
        }
        arena.off.set(0);
        arena.copies.set(false);
        arena.groups.set(0);
        // Uploads: the tokens, then per MoE layer up to one wave per expert (slots, row offsets, rows: three
        // 16-byte-rounded tables) and the combine's entries.
        let e = c.moe.num_experts;
        let host_need = 16
            + 8 * n
            + c.num_layers
                * (e * (3 * 16 + 16) + 2 * 16 + n * c.moe.top_k * 12 + 8 * n * c.moe.top_k);
        if arena.host.as_ref().is_none_or(|h| h.bytes < host_need) {
            arena.host = None;
            // Cacheable (not write-combined): small tables, written just before their copies.
            arena.host = Some(Pinned::new(
                &self.gpu,
                host_need.next_power_of_two(),
                false,
            )?);
        }
        arena.host_off.set(0);
        Ok(())
    }

    fn mm(&self, a: &Arena, w: &Lin, x: u64, n: usize) -> Result<u64> {
        self.mm_with(a, w, x, n, Mm::default())
    }

    fn mm_with(&self, a: &Arena, w: &Lin, x: u64, n: usize, mm: Mm) -> Result<u64> {
        let y = a.f32s(n * w.rows)?;
        self.mm_into(w, x, y, n, mm)?;
        Ok(y)
    }

    /// `parts` times x, the parts fused back to back in `fused`: for one row a single matmul, whose output holds
    /// the parts' outputs in order; otherwise one per part. Returns each part's output ([n][rows]). x is
    /// normalised first with `norm` when given.
    fn mm_parts(
        &self,
        a: &Arena,
        fused: &Lin,
        parts: &[&Lin],
        x: u64,
        n: usize,
        norm: Option<(u64, f32)>,
    ) -> Result<Vec<u64>> {
        let mm = Mm {
            norm,
            ..Mm::default()
        };
        if n > 1 {
            return parts.iter().map(|p| self.mm_with(a, p, x, n, mm)).collect();
        }
        let mut at = self.mm_with(a, fused, x, 1, mm)?;
        Ok(parts
            .iter()
            .map(|p| {
                let o = at;
                at += 4 * p.rows as u64;
                o
            })
            .collect())
    }

    fn mm_into(&self, w: &Lin, x: u64, y: u64, n: usize, mm: Mm) -> Result<()> {
        let (norm_w, eps) = mm.norm.unwrap_or((0, 0.0));
        // A warp per row, four a block (a 512-row matrix then spreads over 128 SMs); shared memory: each warp's
        // ring of 4 KB pieces (as many as a row has, at most four), then the x rows of a tile (as many as fit,
        // at most four).
        let smem = self.gpu.dynamic_smem("matmul_bf16");
        let Some(tile) = matmul_tile(smem, w.cols) else {
            bail!(
                "a {}-column matrix needs {} bytes of shared memory per block on the GPU; this GPU offers {smem}: \
                 run this model on the CPU",
                w.cols,
                matmul_ring_bytes(w.cols) + 4 * w.cols,
            );
        };
        Launch::new(
            &self.gpu,
            "matmul_bf16",
            (w.rows.div_ceil(4) as u32, 1),
            128,
            (matmul_ring_bytes(w.cols) + 4 * n.min(tile) * w.cols) as u32,
        )
        .on(if mm.side { On::Side } else { On::Compute })
        .shape(w.rows, w.cols)
        .p(w.ptr())
        .p(x)
        .p(y)
        .i(w.rows)
        .i(w.cols)
        .i(n)
        .i(tile)
        .p(norm_w)
        .f(eps)
        .p(mm.add)
        .i(mm.accumulate as usize)
        .go()
    }

    fn rms(&self, x: u64, w: u64, out: u64, n: usize, d: usize, eps: f32) -> Result<()> {
        Launch::new(&self.gpu, "rms_norm_rows", (n as u32, 1), 256, 0)
            .p(x)
            .p(w)
            .p(out)
            .i(n)
            .i(d)
            .f(eps)
            .go()
    }

    /// AttnRes Mix of `cur` with the anchors into `out`; with `norm`, RMS-normalised by that weight (fused).
    #[allow(clippy::too_many_arguments)]
    fn mix(
        &self,
        anchors: u64,
        na: usize,
        cur: u64,
        w: &At,
        out: u64,
        n: usize,
        norm: Option<&At>,
    ) -> Result<()> {
        let hd = self.cfg.hidden;
        Launch::new(&self.gpu, "attn_res_mix", (n as u32, 1), 256, 0)
            .p(anchors)
            .i(na)
            .p(cur)
            .p(w.ptr())
            .p(out)
            .i(n)
            .i(hd)
            .f(self.cfg.rms_norm_eps)
            .p(norm.map_or(0, At::ptr))
            .go()
    }

    /// The gated MLP of x into `y` (see [`Mm`]).
    fn mlp(&self, a: &Arena, m: &Mlp, x: u64, n: usize, y: u64, out: Mm) -> Result<()> {
        let act = a.f32s(n * m.gate.rows)?;
        let kind = if self.cfg.family == Family::KimiK3 {
            0
        } else {
            1
        };
        // Eight threads per row (gate and up).
        Launch::new(
            &self.gpu,
            "mlp_up_act",
            (m.gate.rows.div_ceil(32) as u32, 1),
            256,
            0,
        )
        .on(if out.side { On::Side } else { On::Compute })
        .p(m.gate.ptr())
        .p(m.up.ptr())
        .p(x)
        .p(act)
        .i(m.gate.rows)
        .i(m.gate.cols)
        .i(n)
        .i(kind)
        .go()?;
        self.mm_into(&m.down, act, y, n, out)
    }

    /// Issues the pass's work; returns the logits' device address and length. `held`: store records whose
    /// copies to the device may still be in flight (see `moe`).
    /// `tok`: the pass's header on the device (see `header`).
    fn pass<'s>(
        &'s self,
        a: &Arena,
        batch: &mut [Pass<'_, CudaSession>],
        stats: &Stats,
        held: &mut Vec<RecordRef<'s>>,
        tok: u64,
    ) -> Result<(u64, usize)> {
        let (n, hd, eps) = (
            batch.iter().map(|p| p.tokens.len()).sum::<usize>(),
            self.cfg.hidden,
            self.cfg.rms_norm_eps,
        );
        let pos = tok + 4 * n as u64;
        // The residual stream h lies in the slot after the anchors: a block boundary makes h an anchor by moving
        // h on to the next slot (no copy).
        let block = self.cfg.attn_res_block;
        let max_anchors = block.map_or(0, |b| self.cfg.num_layers.div_ceil(b));
        let anchors = a.f32s((max_anchors + 1) * n * hd)?;
        let slot = (4 * n * hd) as u64;
        let mut h = anchors;
        Launch::new(&self.gpu, "embed_rows", (n as u32, 1), 256, 0)
            .p(self.embed.ptr())
            .p(tok)
            .p(h)
            .i(n)
            .i(hd)
            .go()?;
        let mut na = 0usize;
        if self.direct.is_some() && n > 1 {
            a.groups.set(a.take(4 * self.cfg.num_layers)?);
        }
        let mark = a.off.get();
        // The first two streamed layers' copies start now, under the resident layers' compute.
        if let Some(st) = &self.streamed {
            a.copies.set(true);
            for j in 0..st.images.len().min(2) {
                self.copy_layer(st, j)?;
            }
        }
        for (l, layer) in self.layers.iter().enumerate() {
            a.off.set(mark);
            let streamed = self
                .streamed
                .as_ref()
                .and_then(|st| Some((st, st.index[l]?)));
            if let Some((st, j)) = streamed {
                self.gpu.wait(&st.copied[j % 2])?;
            }
            match block {
                Some(block) => {
                    // K3: a = Mix([anchors…, h]) (or h); a block boundary makes h an anchor and restarts the sum.
                    let res = layer
                        .attn_res
                        .as_ref()
                        .expect("K3 layers carry AttnRes weights");
                    let restart = l % block == 0;
                    // The mix over no anchors is h itself. Its RMS norm is fused into the attention's input
                    // matmul.
                    let mixed = if na == 0 {
                        h
                    } else {
                        let x = a.f32s(n * hd)?;
                        self.mix(anchors, na, h, res, x, n, None)?;
                        x
                    };
                    if restart {
                        na += 1;
                        h = anchors + na as u64 * slot;
                    }
                    // q = prefix + o, kept in h (a block boundary restarts the sum: h = o).
                    let out = Mm {
                        accumulate: !restart,
                        ..Mm::default()
                    };
                    let norm = (layer.input_norm.ptr(), eps);
                    self.attention_batch(a, &layer.attn, mixed, norm, batch, pos, l, h, out)?;
                    let m = a.f32s(n * hd)?;
                    let res = layer.mlp_res.as_ref().expect("K3");
                    self.mix(anchors, na, h, res, m, n, Some(&layer.post_norm))?;
                    self.ffn(a, l, &layer.ffn, m, n, stats, held, h)?;
                }
                None => {
                    // Kimi Linear: h += Attn(RMS(h)); h += MLP(RMS(h)).
                    let out = Mm {
                        accumulate: true,
                        ..Mm::default()
                    };
                    let norm = (layer.input_norm.ptr(), eps);
                    self.attention_batch(a, &layer.attn, h, norm, batch, pos, l, h, out)?;
                    let m = a.f32s(n * hd)?;
                    self.rms(h, layer.post_norm.ptr(), m, n, hd, eps)?;
                    self.ffn(a, l, &layer.ffn, m, n, stats, held, h)?;
                }
            }
            if let Some((st, j)) = streamed {
                // The buffer is free once this layer's kernels are done: the layer two ahead goes in next.
                self.gpu.record(&st.freed[j % 2])?;
                if j + 2 < st.images.len() {
                    self.copy_layer(st, j + 2)?;
                }
            }
        }
        a.off.set(mark);
        let f = match &self.out_res {
            Some(w) => {
                let f = a.f32s(n * hd)?;
                self.mix(anchors, na, h, w, f, n, None)?;
                f
            }
            None => h,
        };
        // The rows that need logits (each session's last row, or all of its rows), copied together unless they
        // lie together already (a decode batch: one row each).
        let row = (4 * hd) as u64;
        let mut runs: Vec<(usize, usize)> = Vec::new();
        let mut at = 0;
        for p in batch.iter() {
            let (len, k) = (p.tokens.len(), p.logit_rows());
            match runs.last_mut() {
                Some((start, count)) if *start + *count == at + len - k => *count += k,
                _ => runs.push((at + len - k, k)),
            }
            at += len;
        }
        let m: usize = runs.iter().map(|r| r.1).sum();
        let f = match runs[..] {
            [(start, _)] => f + start as u64 * row,
            _ => {
                let g = a.f32s(m * hd)?;
                let mut to = g;
                for &(start, count) in &runs {
                    self.gpu.dtod(to, f + start as u64 * row, count * 4 * hd)?;
                    to += count as u64 * row;
                }
                g
            }
        };
        // The final norm is fused into the head.
        let norm = Mm {
            norm: Some((self.norm.ptr(), eps)),
            ..Mm::default()
        };
        let logits = self.mm_with(a, &self.lm_head, f, m, norm)?;
        if self.gpu.timeline.is_some() {
            Launch::new(&self.gpu, "timeline_mark", (1, 1), 32, 0).go()?;
        }
        Ok((logits, m * self.cfg.vocab_size))
    }

    /// Layer `l`'s attention for every session's rows (`x`, `y`: `[rows, hidden]`, the sessions' rows in batch
    /// order), each on its own state; `pos`: the sessions' positions on the device (the header's).
    #[allow(clippy::too_many_arguments)]
    fn attention_batch(
        &self,
        a: &Arena,
        attn: &Attn,
        x: u64,
        norm: (u64, f32),
        batch: &mut [Pass<'_, CudaSession>],
        pos: u64,
        l: usize,
        y: u64,
        out: Mm,
    ) -> Result<()> {
        let row = (4 * self.cfg.hidden) as u64;
        let mut r0 = 0u64;
        for (i, p) in batch.iter_mut().enumerate() {
            let n = p.tokens.len();
            let st = &mut p.session.layers[l];
            let pos = pos + 4 * i as u64;
            self.attention(a, attn, x + r0 * row, norm, n, st, pos, y + r0 * row, out)?;
            r0 += n as u64;
        }
        Ok(())
    }

    /// Copies the `j`-th streamed layer into its buffer on the copy stream, after the kernels of the layer
    /// that used the buffer before it.
    fn copy_layer(&self, st: &Streamed, j: usize) -> Result<()> {
        let (_, off, len) = st.images[j];
        let copy = &self.gpu.copy;
        copy.wait(&st.freed[j % 2])
            .doing("ordering a spine layer's copy after its buffer is free")?;
        // SAFETY: the buffer holds the largest streamed layer; the page-locked images are never written after
        // load.
        unsafe {
            cu::memcpy_htod_async(
                st.bufs[j % 2].ptr,
                &st.host.as_slice()[off..off + len],
                copy.cu_stream(),
            )
        }
        .map_err(|e| anyhow!("copying spine layer {} to the GPU: {e:?}", st.images[j].0))?;
        st.copied[j % 2]
            .record(copy)
            .doing("recording a spine layer's copy")?;
        self.cache.lock().unwrap().counters.spine_h2d_bytes += len as u64;
        Ok(())
    }

    /// The attention block of RMS(x) (`norm`: its weights and eps), its output projection into `y` (see
    /// [`Mm`]); `pos`: the session's position on the device.
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        a: &Arena,
        attn: &Attn,
        x: u64,
        norm: (u64, f32),
        n: usize,
        st: &State,
        pos: u64,
        y: u64,
        out: Mm,
    ) -> Result<()> {
        match (attn, st) {
            (Attn::Kda(k), State::Kda { conv, s }) => {
                let o = self.kda(a, k, x, norm, n, (conv.ptr, s.ptr), pos)?;
                self.mm_into(&k.o, o, y, n, out)
            }
            (Attn::Mla(m), State::Mla { lat, pe, cap }) => {
                let o = self.mla(a, m, x, norm, n, (lat.ptr, pe.ptr, *cap), pos)?;
                self.mm_into(&m.o, o, y, n, out)
            }
            _ => unreachable!("a session's states are made by the same model's layers"),
        }
    }

    /// Grows `session`'s MLA caches (doubling, keeping what they hold) so that `n` more tokens fit. Before the
    /// pass: its issue (and a graph's capture) cannot allocate or synchronise.
    fn reserve(&self, session: &mut CudaSession, n: usize) -> Result<()> {
        let (pos, need) = (session.pos, session.pos + n);
        for (layer, st) in self.layers.iter().zip(&mut session.layers) {
            let (Attn::Mla(m), State::Mla { lat, pe, cap }) = (&layer.attn, st) else {
                continue;
            };
            if need > *cap {
                let new_cap = need.next_power_of_two();
                let (nl, np) = (self.zeros(new_cap * m.kvl)?, self.zeros(new_cap * m.rope)?);
                self.gpu.dtod(nl.ptr, lat.ptr, 4 * pos * m.kvl)?;
                self.gpu.dtod(np.ptr, pe.ptr, 4 * pos * m.rope)?;
                self.gpu
                    .stream
                    .synchronize()
                    .doing("waiting for the GPU to finish a pass")?;
                (*lat, *pe, *cap) = (nl, np, new_cap);
            }
        }
        Ok(())
    }

    /// Whether one-row steps run as graphs: every expert resident, no streamed layers (their copies are issued
    /// per pass), no `--timeline` (its notes are too), and no capture refused so far.
    fn graphed(&self) -> bool {
        self.direct.is_some()
            && self.streamed.is_none()
            && self.gpu.timeline.is_none()
            && self.graphs_off.lock().unwrap().is_none()
    }

    /// A decode step of `session` on `token` through its graph, returning its logits. It takes over the step run
    /// ahead on the device's choice when that choice was `token` and nothing was issued since; otherwise the
    /// header is uploaded and the graph launched (captured first if the session has none that fits). With
    /// `ahead`, the step after it is launched on the device's choice before the logits are waited for, while the
    /// caches and scratch hold it unchanged. A capture the driver refuses turns graphs off for the model.
    fn step(
        &self,
        session: &mut CudaSession,
        token: u32,
        ahead: bool,
        stats: &Stats,
    ) -> Result<Vec<f32>> {
        let t0 = Instant::now();
        let pos = session.pos;
        let mut arena = self.arena.lock().unwrap();
        // Whether a step ran ahead, and whether it is taken over.
        let ran = session
            .ahead
            .take()
            .map(|g| g.token == token && g.ticket == arena.issued.get());
        let taken = ran == Some(true);
        if !taken {
            self.reserve(session, if ahead { 2 } else { 1 })?;
            self.size_arena(&mut arena, 1, session.mla_cap())?;
            let a = &*arena;
            let hdr = self.stage(a, &[token, pos as u32])?;
            let key = self.graph_key(a, session);
            if session.graph.as_ref().is_none_or(|g| g.key != key) {
                session.graph = None;
                match self.capture(a, session, hdr, stats, key) {
                    Ok(graph) => session.graph = Some(graph),
                    Err(e) => {
                        *self.graphs_off.lock().unwrap() = Some(format!("{e:#}"));
                        drop(arena);
                        self.note_step(ran, 0.0, 0.0);
                        return self.forward(session, &[token], LogitRows::Last, stats);
                    }
                }
            }
            self.launch_step(a, session, pos)?;
        }
        let next = ahead && session.holds(2) && {
            let key = self.graph_key(&arena, session);
            session.graph.as_ref().is_some_and(|g| g.key == key)
        };
        if next {
            self.launch_step(&arena, session, pos + 1)?;
        }
        let issue_secs = t0.elapsed().as_secs_f64();
        // This step's results.
        let par = pos & 1;
        let pk = &self.picks;
        pk.done[par]
            .synchronize()
            .map_err(|e| anyhow!("a decode step failed: {e:?}"))?;
        let ms = pk.span[par][0]
            .elapsed_ms(&pk.span[par][1])
            .doing("timing a decode step")?;
        self.note_step(ran, issue_secs, ms as f64 / 1e3);
        let v = self.cfg.vocab_size;
        // SAFETY: the host buffer holds [2][v + 1] floats, written by a copy that has completed.
        let out = unsafe {
            std::slice::from_raw_parts((pk.host.ptr as *const f32).add(par * (v + 1)), v + 1)
        };
        self.count_step_uses(stats);
        session.pos += 1;
        session.ahead = next.then(|| Ahead {
            token: out[v].to_bits(),
            ticket: arena.issued.get(),
        });
        Ok(out[..v].to_vec())
    }

    /// A graphed step's counters, under one lock: the step run ahead before it (`Some(taken over)`), the host's
    /// time issuing and the GPU's span.
    fn note_step(&self, ran: Option<bool>, issue_secs: f64, gpu_secs: f64) {
        let c = &mut self.cache.lock().unwrap().counters;
        match ran {
            Some(true) => c.ahead_taken += 1,
            Some(false) => c.ahead_discarded += 1,
            None => {}
        }
        c.issue_secs += issue_secs;
        c.gpu_secs += gpu_secs;
    }

    /// What a session's graph must have been captured with to replay now.
    fn graph_key(&self, a: &Arena, session: &CudaSession) -> GraphKey {
        GraphKey {
            scratch: a.buf.as_ref().expect("sized at pass start").ptr,
            cap: session.mla_cap(),
        }
    }

    /// Launches the session's graph for its step at `pos` (the header already in place on the device), and
    /// copies its results back on the copy stream.
    fn launch_step(&self, a: &Arena, session: &CudaSession, pos: usize) -> Result<()> {
        let g = session.graph.as_ref().expect("captured before its launch");
        let par = pos & 1;
        let pk = &self.picks;
        let v = self.cfg.vocab_size;
        self.gpu.record(&pk.span[par][0])?;
        g.graph
            .launch()
            .map_err(|e| anyhow!("launching a decode step: {e:?}"))?;
        self.gpu.record(&pk.span[par][1])?;
        let copy = &self.gpu.copy;
        copy.wait(&pk.span[par][1])
            .doing("ordering the logits copy after a decode step")?;
        let bytes = 4 * (v + 1);
        // SAFETY: both buffers hold [2][v + 1] floats; the host's half `par` is read only after `done[par]`, and
        // written again only by the step two after this one, launched after that read.
        unsafe {
            let dst = std::slice::from_raw_parts_mut(pk.host.ptr.add(par * bytes), bytes);
            cu::memcpy_dtoh_async(dst, pk.out.ptr + (par * bytes) as u64, copy.cu_stream())
        }
        .map_err(|e| anyhow!("copying a decode step's logits back: {e:?}"))?;
        pk.done[par]
            .record(copy)
            .doing("recording the logits copy")?;
        a.issued.set(a.issued.get() + 1);
        Ok(())
    }

    /// The one-row pass on the header at `hdr`, and its pick, captured as a graph (not run).
    fn capture(
        &self,
        a: &Arena,
        session: &mut CudaSession,
        hdr: u64,
        stats: &Stats,
        key: GraphKey,
    ) -> Result<DecodeGraph> {
        let stream = &self.gpu.stream;
        let staged = a.host_off.get();
        stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(|e| anyhow!("capturing a decode step: {e:?}"))?;
        let mut pass = [Pass {
            session,
            tokens: &[0],
            rows: LogitRows::Last,
        }];
        let issued = self
            .pass(a, &mut pass, stats, &mut Vec::new(), hdr)
            .and_then(|(logits, _)| {
                Launch::new(&self.gpu, "decode_pick", (1, 1), 1024, 0)
                    .p(logits)
                    .i(self.cfg.vocab_size)
                    .p(hdr)
                    .p(self.picks.out.ptr)
                    .go()
            });
        // The capture ends whatever the issue did, so the stream is usable again.
        let graph = stream.end_capture(sys::CUgraphInstantiate_flags(0));
        issued?;
        // The graph holds no upload (the key does not cover the upload area): only the header, staged before it.
        if a.host_off.get() != staged {
            bail!("internal: a decode step uploads more than its header");
        }
        let graph = graph
            .map_err(|e| anyhow!("capturing a decode step: {e:?}"))?
            .ok_or_else(|| anyhow!("capturing a decode step: the graph is empty"))?;
        Ok(DecodeGraph {
            graph,
            key,
            ctx: self.gpu.ctx.clone(),
        })
    }

    /// KDA of RMS(x) up to its output projection (the gated, normalised heads). `(conv_state, s)`: the session's
    /// two copies of each (see kda_recurrence); `pos`: its position on the device.
    #[allow(clippy::too_many_arguments)]
    fn kda(
        &self,
        a: &Arena,
        k: &Kda,
        x: u64,
        norm: (u64, f32),
        n: usize,
        (conv_state, s): (u64, u64),
        pos: u64,
    ) -> Result<u64> {
        let (heads, dim) = (k.heads, k.dim);
        let w = heads * dim;
        let y = self.mm_parts(
            a,
            &k.xin,
            &[&k.q, &k.k, &k.v, &k.f_a, k.gate.first(), &k.b],
            x,
            n,
            Some(norm),
        )?;
        let (q, kk, v, fa, gate_in, beta) = (y[0], y[1], y[2], y[3], y[4], y[5]);
        let g = self.mm(a, &k.f_b, fa, n)?;
        let gate = match &k.gate {
            OutGate::Full(_) => gate_in,
            OutGate::Low(_, gb) => self.mm(a, gb, gate_in, n)?,
        };
        let out = a.f32s(n * w)?;
        Launch::new(
            &self.gpu,
            "kda_recurrence",
            (heads as u32, 1),
            dim as u32,
            kda_smem(dim) as u32,
        )
        .p(q)
        .p(kk)
        .p(v)
        .p(g)
        .p(beta)
        .p(gate)
        .p(k.dt_bias.ptr())
        .p(k.a_log.ptr())
        .f(-5.0) // K3's lower bound of the decay (kind 0)
        .p(k.conv.ptr())
        .p(conv_state)
        .p(s)
        .p(pos)
        .p(k.o_norm.ptr())
        .p(out)
        .i(n)
        .i(heads)
        .i(dim)
        .i(k.kern)
        .i(k.kind)
        .f(self.cfg.rms_norm_eps)
        .go()?;
        Ok(out)
    }

    /// MLA of RMS(x) up to its output projection (the heads' attention outputs, gated where the layer has a gate).
    #[allow(clippy::too_many_arguments)]
    fn mla(
        &self,
        a: &Arena,
        m: &Mla,
        x: u64,
        norm: (u64, f32),
        n: usize,
        (lat, pe, cap): (u64, u64, usize),
        pos: u64,
    ) -> Result<u64> {
        let mut parts = vec![m.q.first(), &m.kv_a];
        parts.extend(m.gate.as_ref());
        let y = self.mm_parts(a, &m.xin, &parts, x, n, Some(norm))?;
        let q = match &m.q {
            QPath::Low { norm, b, .. } => {
                let norm = Mm {
                    norm: Some((norm.ptr(), m.eps)),
                    ..Mm::default()
                };
                self.mm_with(a, b, y[0], n, norm)?
            }
            QPath::Direct(_) => y[0],
        };
        let c = y[1];
        Launch::new(&self.gpu, "mla_append", (n as u32, 1), 128, 0)
            .p(c)
            .p(m.kv_norm.ptr())
            .p(lat)
            .p(pe)
            .p(pos)
            .i(n)
            .i(m.kvl)
            .i(m.rope)
            .f(m.eps)
            .go()?;
        let p = a.f32s(n * m.heads * cap)?;
        let attn = a.f32s(n * m.heads * m.dv)?;
        let scale = 1.0 / ((m.nope + m.rope) as f32).sqrt();
        Launch::new(
            &self.gpu,
            "mla_attend",
            ((n * m.heads) as u32, 1),
            512, // MLA_THREADS in kernels.cu
            (2 * m.kvl * 4) as u32,
        )
        .p(q)
        .p(m.kv_b.ptr())
        .p(lat)
        .p(pe)
        .p(p)
        .i(cap)
        .p(m.gate.as_ref().map_or(0, |_| y[2]))
        .p(attn)
        .i(n)
        .i(m.heads)
        .i(m.nope)
        .i(m.rope)
        .i(m.dv)
        .i(m.kvl)
        .p(pos)
        .f(scale)
        .go()?;
        Ok(attn)
    }

    /// h += FFN(x).
    #[allow(clippy::too_many_arguments)]
    fn ffn<'s>(
        &'s self,
        a: &Arena,
        l: usize,
        ffn: &Ffn,
        x: u64,
        n: usize,
        stats: &Stats,
        held: &mut Vec<RecordRef<'s>>,
        h: u64,
    ) -> Result<()> {
        match ffn {
            Ffn::Dense(m) => self.mlp(
                a,
                m,
                x,
                n,
                h,
                Mm {
                    accumulate: true,
                    ..Mm::default()
                },
            ),
            Ffn::Moe(m) => self
                .moe(a, l, m, x, n, stats, held, h)
                .with_context(|| format!("layer {l}")),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn moe<'s>(
        &'s self,
        a: &Arena,
        layer: usize,
        m: &Moe,
        x: u64,
        n: usize,
        stats: &Stats,
        held: &mut Vec<RecordRef<'s>>,
        h: u64,
    ) -> Result<()> {
        let mc = &self.cfg.moe;
        let (e_count, top_k) = (mc.num_experts, mc.top_k);
        let lay = &self.layout;
        // K3: the shared expert needs nothing of the routed ones until the last add, so it runs on the side
        // stream meanwhile, and the latent up-projection adds its output: h += routed + shared, the same sum as
        // the CPU's shared + routed (an addition of two values does not depend on their order).
        let shared = match &m.latent {
            Some(_) => {
                self.gpu.record(&self.fork)?;
                self.gpu
                    .side
                    .wait(&self.fork)
                    .doing("ordering the shared experts' stream")?;
                let s = a.f32s(n * self.cfg.hidden)?;
                let side = Mm {
                    side: true,
                    ..Mm::default()
                };
                self.mlp(a, &m.shared, x, n, s, side)?;
                self.join
                    .record(&self.gpu.side)
                    .doing("recording the shared experts' end")?;
                Some(s)
            }
            None => None,
        };
        // Router logits and the selection on the device, in both paths (the same weights, bit for bit).
        let (z, logits) = match (&m.latent, &m.xin) {
            (Some((down, _, _)), Some(xin)) => {
                let y = self.mm_parts(a, xin, &[down, &m.router], x, n, None)?;
                (y[0], y[1])
            }
            _ => (x, self.mm(a, &m.router, x, n)?),
        };
        let ids = a.take(4 * n * top_k)?;
        let wts = a.f32s(n * top_k)?;
        // Every expert resident: the selected records come from the layer's device table and nothing goes to the
        // host; one row's (decode) straight from the router, several rows' grouped by expert on the device.
        // Otherwise the host takes the ids, plans the copies and runs each chosen expert once per pass.
        let direct = self.direct.as_ref();
        let table = direct.map_or(0, |d| d.table.ptr + (8 * layer * e_count) as u64);
        let (route_table, slots) = match direct {
            Some(_) if n == 1 => (table, a.take(8 * top_k)?),
            _ => (0, 0),
        };
        Launch::new(
            &self.gpu,
            "moe_route",
            (n as u32, 1),
            128,
            (4 * (3 * e_count + top_k)) as u32,
        )
        .p(logits)
        .p(m.bias.ptr())
        .i(e_count)
        .i(top_k)
        .i(mc.renormalize as usize)
        .f(mc.routed_scaling_factor)
        .p(ids)
        .p(wts)
        .p(route_table)
        .p(slots)
        .go()?;
        let (entry, y) = match direct {
            Some(d) if n == 1 => {
                let act = a.f32s(top_k * lay.inter)?;
                let y = a.f32s(top_k * lay.width)?;
                self.launch_experts(top_k, 1, slots, d.seq.ptr, d.row0.ptr, z, act, y)?;
                (d.seq.ptr, y)
            }
            Some(_) => {
                // As many groups as there can be distinct experts: the empty ones cost a block start each.
                let (pairs, groups) = (n * top_k, (n * top_k).min(e_count));
                let (slots, row_off) = (a.take(8 * groups)?, a.take(4 * (groups + 1))?);
                let (rows, entry) = (a.take(4 * pairs)?, a.take(4 * pairs)?);
                Launch::new(&self.gpu, "moe_group", (1, 1), 256, (4 * e_count) as u32)
                    .p(ids)
                    .i(n)
                    .i(top_k)
                    .i(e_count)
                    .i(groups)
                    .p(table)
                    .p(slots)
                    .p(row_off)
                    .p(rows)
                    .p(entry)
                    .p(a.groups.get() + 4 * layer as u64)
                    .go()?;
                let act = a.f32s(pairs * lay.inter)?;
                let y = a.f32s(pairs * lay.width)?;
                let per_pass = lay.rows_per_pass();
                self.launch_experts(groups, per_pass, slots, row_off, rows, z, act, y)?;
                (entry, y)
            }
            None => {
                let (entry, y, uses) = self.routed_via_host(a, layer, ids, z, n, held)?;
                self.count_uses(stats, uses, false);
                (entry, y)
            }
        };
        // acc = Σ w_i y_i per row, experts in ascending id order.
        let acc = a.f32s(n * lay.width)?;
        Launch::new(
            &self.gpu,
            "moe_combine",
            (n as u32, lay.width.div_ceil(256) as u32),
            256,
            0,
        )
        .p(y)
        .p(entry)
        .p(wts)
        .p(acc)
        .i(n)
        .i(top_k)
        .i(lay.width)
        .go()?;
        match (&m.latent, shared) {
            (Some((_, norm, up)), Some(s)) => {
                self.gpu.wait(&self.join)?;
                let out = Mm {
                    norm: Some((norm.ptr(), self.cfg.rms_norm_eps)),
                    add: s,
                    accumulate: true,
                    ..Mm::default()
                };
                self.mm_into(up, acc, h, n, out)
            }
            // h += shared + routed, the sum as the CPU forms it (shared output, then the routed part added).
            _ => self.mlp(
                a,
                &m.shared,
                x,
                n,
                h,
                Mm {
                    add: acc,
                    accumulate: true,
                    ..Mm::default()
                },
            ),
        }
    }

    /// The routed experts with the selection `ids` ([n][top_k] on the device) brought to the host: each chosen
    /// expert runs once for all its rows, resident ones at once, misses in waves as their copies arrive.
    /// Returns the combine's entries ([n][top_k] indices into the outputs, on the device), the outputs, and
    /// the number of experts used.
    fn routed_via_host<'s>(
        &'s self,
        a: &Arena,
        layer: usize,
        ids: u64,
        z: u64,
        n: usize,
        held: &mut Vec<RecordRef<'s>>,
    ) -> Result<(u64, u64, usize)> {
        let top_k = self.cfg.moe.top_k;
        a.copies.set(true);
        let ids: Vec<i32> = self.gpu.dtoh(ids, n * top_k)?;
        // The compute stream is idle here, so it has passed its waits on every earlier copy: their records may
        // move again.
        held.clear();
        let routes: Vec<&[i32]> = ids.chunks(top_k).collect();
        let mut union: Vec<usize> = ids.iter().map(|&e| e as usize).collect();
        union.sort_unstable();
        union.dedup();
        let lay = &self.layout;
        let rows_of: Vec<Vec<usize>> = union
            .iter()
            .map(|&e| {
                (0..n)
                    .filter(|&t| routes[t].contains(&(e as i32)))
                    .collect()
            })
            .collect();
        let mut cache = self.cache.lock().unwrap();
        let waves = plan_waves(&mut cache.plan, layer, &union);
        // Entries (expert, row) numbered in execution order; entry_of[u] = first entry of union index u.
        let mut entry_of = vec![0usize; union.len()];
        let mut next = 0;
        for w in &waves {
            for &(u, _) in w.hits.iter().chain(&w.misses) {
                entry_of[u] = next;
                next += rows_of[u].len();
            }
        }
        let total = next;
        let act = a.f32s(total * lay.inter)?;
        let y = a.f32s(total * lay.width)?;
        let slot_ptr = |c: &ExpertCache, s: usize| c.slots.ptr + (s * c.slot_len) as u64;
        for (wi, w) in waves.iter().enumerate() {
            // Resident experts run at once (overlapping the copies below on the other stream).
            let hits: Vec<(usize, u64)> = w
                .hits
                .iter()
                .map(|&(u, s)| (u, slot_ptr(&cache, s)))
                .collect();
            self.launch_group(a, &hits, &rows_of, &entry_of, z, act, y)?;
            if w.misses.is_empty() {
                continue;
            }
            let t0 = Instant::now();
            if wi > 0 {
                // The misses may overwrite slots the previous wave's kernels read.
                let done = self.gpu.mark()?;
                self.gpu
                    .copy
                    .wait(&done)
                    .doing("ordering expert copies after the previous wave")?;
            }
            let todo: Vec<(usize, u64)> = w
                .misses
                .iter()
                .map(|&(u, s)| (union[u], slot_ptr(&cache, s)))
                .collect();
            self.copy_in(&mut cache, layer, &todo, held)?;
            cache.counters.stage_secs += t0.elapsed().as_secs_f64();
            let copied = self.copies_done()?;
            self.gpu.wait(&copied)?;
            let misses: Vec<(usize, u64)> = w
                .misses
                .iter()
                .map(|&(u, s)| (u, slot_ptr(&cache, s)))
                .collect();
            self.launch_group(a, &misses, &rows_of, &entry_of, z, act, y)?;
        }
        let hits: u64 = waves.iter().map(|w| w.hits.len() as u64).sum();
        cache.counters.vram_hits += hits;
        cache.counters.vram_misses += union.len() as u64 - hits;
        drop(cache);
        let mut entry = Vec::with_capacity(n * top_k);
        for (t, r) in routes.iter().enumerate() {
            for id in r.iter() {
                let u = union.binary_search(&(*id as usize)).expect("in the union");
                let j = rows_of[u]
                    .iter()
                    .position(|&x| x == t)
                    .expect("row chose it");
                entry.push((entry_of[u] + j) as i32);
            }
        }
        Ok((self.stage(a, &entry)?, y, union.len()))
    }

    /// Copies records `(expert, VRAM destination)` of `layer` from the store on the copy stream, in the order
    /// they arrive. `held`: the store records whose copies may still be running.
    fn copy_in<'s>(
        &'s self,
        cache: &mut ExpertCache,
        layer: usize,
        todo: &[(usize, u64)],
        held: &mut Vec<RecordRef<'s>>,
    ) -> Result<()> {
        let len = self.layout.len();
        let ids: Vec<usize> = todo.iter().map(|t| t.0).collect();
        let mut fetch = self.store.fetch(layer, &ids);
        while let Some(rec) = fetch.next() {
            let rec = rec?;
            let dst = todo
                .iter()
                .find(|t| t.0 == rec.expert)
                .expect("asked for")
                .1;
            if self.slab_registered {
                // SAFETY: the slot holds slot_len >= len bytes; the record stays pinned in the store (held)
                // until the copy has completed.
                unsafe { cu::memcpy_htod_async(dst, rec.bytes(), self.gpu.copy.cu_stream()) }
                    .map_err(|e| anyhow!("copying an expert to the GPU: {e:?}"))?;
                held.push(rec);
                // Held records pin store slots that this fetch may need for records still to load.
                if held.len() >= self.held_cap {
                    self.gpu
                        .copy
                        .synchronize()
                        .map_err(|e| anyhow!("copying an expert to the GPU: {e:?}"))?;
                    held.clear();
                }
            } else {
                let k = cache.ring.take();
                let (pinned, ev) = &mut cache.staging[k];
                ev.synchronize()
                    .map_err(|e| anyhow!("staging copy failed: {e:?}"))?;
                par_copy(pinned.as_mut_slice(), rec.bytes());
                drop(rec);
                // SAFETY: the slot holds slot_len >= len bytes; the pinned buffer is not rewritten before `ev`.
                unsafe {
                    cu::memcpy_htod_async(dst, &pinned.as_slice()[..len], self.gpu.copy.cu_stream())
                }
                .map_err(|e| anyhow!("copying an expert to the GPU: {e:?}"))?;
                ev.record(&self.gpu.copy)
                    .doing("recording an expert's copy")?;
            }
            if self.layout.mxfp4() {
                cache
                    .copied
                    .record(&self.gpu.copy)
                    .doing("recording the experts' copies")?;
                self.gpu
                    .prep
                    .wait(&cache.copied)
                    .doing("ordering the experts' use after their copies")?;
                self.repack(dst)?;
            }
            cache.counters.h2d_bytes += len as u64;
        }
        Ok(())
    }

    /// Rearranges a just-copied MXFP4 record into the expert kernels' device layout (kernels.cu, `mx_repack`),
    /// on the prep stream, ordered after its copy.
    fn repack(&self, dst: u64) -> Result<()> {
        let lay = &self.layout;
        // A block holds one 32-row group of a tensor (its size checked at load).
        Launch::new(
            &self.gpu,
            "mx_repack",
            (lay.width.max(lay.inter).div_ceil(32) as u32, 6),
            256,
            lay.repack_smem() as u32,
        )
        .on(On::Prep)
        .p(dst)
        .parts(lay.offsets())
        .i(lay.width)
        .i(lay.inter)
        .go()
    }

    /// An event after every copy issued so far and, for MXFP4 experts, their rearrangement.
    fn copies_done(&self) -> Result<CudaEvent> {
        let s = if self.layout.mxfp4() {
            &self.gpu.prep
        } else {
            &self.gpu.copy
        };
        s.record_event(None).doing("recording an event")
    }

    /// Fills the VRAM cache with every routed expert (when it holds them all): "resident" then means resident
    /// from the first token, with no first-touch copies in the passes.
    fn preload(&self) -> Result<()> {
        let mut cache = self.cache.lock().unwrap();
        let ids: Vec<usize> = (0..self.cfg.moe.num_experts).collect();
        for layer in (0..self.cfg.num_layers).filter(|&l| !self.cfg.is_dense(l)) {
            let mut held = Vec::new();
            for w in plan_waves(&mut cache.plan, layer, &ids) {
                let todo: Vec<(usize, u64)> = w
                    .misses
                    .iter()
                    .map(|&(u, s)| (ids[u], cache.slots.ptr + (s * cache.slot_len) as u64))
                    .collect();
                self.copy_in(&mut cache, layer, &todo, &mut held)?;
            }
            self.gpu
                .copy
                .synchronize()
                .map_err(|e| anyhow!("copying experts to the GPU: {e:?}"))?;
        }
        self.gpu
            .prep
            .synchronize()
            .map_err(|e| anyhow!("readying experts on the GPU: {e:?}"))?;
        cache.counters = CudaCounters::default();
        Ok(())
    }

    /// The resident decode path's device tables (after `preload`: every expert has its slot for good).
    fn direct_tables(&self) -> Result<Direct> {
        let (e, k) = (self.cfg.moe.num_experts, self.cfg.moe.top_k);
        let mut cache = self.cache.lock().unwrap();
        let mut table = vec![0u64; self.cfg.num_layers * e];
        for layer in (0..self.cfg.num_layers).filter(|&l| !self.cfg.is_dense(l)) {
            for id in 0..e {
                let s = cache
                    .plan
                    .lookup((layer, id))
                    .context("internal: a preloaded expert has no slot")?;
                table[layer * e + id] = cache.slots.ptr + (s * cache.slot_len) as u64;
            }
        }
        cache.plan.unpin_all();
        Ok(Direct {
            table: self.gpu.upload(&table)?,
            seq: self.gpu.upload(&(0..=k as i32).collect::<Vec<_>>())?,
            row0: self.gpu.upload(&vec![0i32; k])?,
        })
    }

    /// `uses` chosen experts, each read once from VRAM (`resident`: found there without the host's plan, which
    /// counts its own hits).
    /// A resident decode step's experts: top_k a MoE layer.
    fn count_step_uses(&self, stats: &Stats) {
        let moe = (0..self.cfg.num_layers).filter(|&l| !self.cfg.is_dense(l));
        self.count_uses(stats, moe.count() * self.cfg.moe.top_k, true);
    }

    fn count_uses(&self, stats: &Stats, uses: usize, resident: bool) {
        if resident {
            self.cache.lock().unwrap().counters.vram_hits += uses as u64;
        }
        stats.expert_uses.fetch_add(uses as u64, Ordering::Relaxed);
        stats
            .expert_bytes
            .fetch_add((uses * self.layout.len()) as u64, Ordering::Relaxed);
    }

    /// Copies host values into the pass's scratch, asynchronously through the pass's page-locked upload area.
    fn stage<T: Copy>(&self, a: &Arena, v: &[T]) -> Result<u64> {
        let src = self.put(a, v)?;
        let dst = a.take(src.len().max(4))?;
        self.gpu.htod_async(dst, src)?;
        Ok(dst)
    }

    /// Writes `v` into the pass's upload area (bumped) and returns where it lies there.
    fn put<'a, T: Copy>(&self, a: &'a Arena, v: &[T]) -> Result<&'a [u8]> {
        let bytes = std::mem::size_of_val(v);
        let host = a.host.as_ref().expect("sized at pass start");
        let at = a.host_off.get();
        if at + bytes > host.bytes {
            bail!(
                "internal: the pass's upload area ({} bytes) is too small",
                host.bytes
            );
        }
        a.host_off.set(at + bytes.div_ceil(16) * 16);
        // SAFETY: `at + bytes` is inside the allocation; no copy reads this range before the caller issues one
        // (the area is bumped, and reset only after the pass has synchronised).
        Ok(unsafe {
            let p = host.ptr.add(at);
            std::ptr::copy_nonoverlapping(v.as_ptr() as *const u8, p, bytes);
            std::slice::from_raw_parts(p, bytes)
        })
    }

    /// Stages one group's tables (record pointers, row offsets, rows) and launches its experts.
    #[allow(clippy::too_many_arguments)]
    fn launch_group(
        &self,
        a: &Arena,
        group: &[(usize, u64)],
        rows_of: &[Vec<usize>],
        entry_of: &[usize],
        z: u64,
        act: u64,
        y: u64,
    ) -> Result<()> {
        if group.is_empty() {
            return Ok(());
        }
        let lay = &self.layout;
        let slots: Vec<u64> = group.iter().map(|g| g.1).collect();
        let mut row_off = Vec::with_capacity(group.len() + 1);
        let mut rows: Vec<i32> = Vec::new();
        // Entries of this group are consecutive in execution order.
        let first = entry_of[group[0].0];
        for &(u, _) in group {
            row_off.push((entry_of[u] - first) as i32);
            rows.extend(rows_of[u].iter().map(|&t| t as i32));
        }
        row_off.push(rows.len() as i32);
        let per_pass = if rows.len() > group.len() {
            lay.rows_per_pass()
        } else {
            1
        };
        let slots_dev = self.stage(a, &slots)?;
        let off_dev = self.stage(a, &row_off)?;
        let rows_dev = self.stage(a, &rows)?;
        self.launch_experts(
            group.len(),
            per_pass,
            slots_dev,
            off_dev,
            rows_dev,
            z,
            act + (4 * first * lay.inter) as u64,
            y + (4 * first * lay.width) as u64,
        )
    }

    /// `g` experts from device tables: `slots[u]` its record, entries `row_off[u]..row_off[u+1]` its rows of z
    /// (`rows[entry]`); entry e's activations and outputs at row e of `act` and `y`. `per_pass`: the kernels that
    /// take that many of an expert's rows a pass over its weights (1, or `rows_per_pass` when some have several).
    #[allow(clippy::too_many_arguments)]
    fn launch_experts(
        &self,
        g: usize,
        per_pass: usize,
        slots: u64,
        row_off: u64,
        rows: u64,
        z: u64,
        act: u64,
        y: u64,
    ) -> Result<()> {
        let lay = &self.layout;
        let (up, down, act_kind) = lay.kernels(per_pass);
        let g = g as u32;
        // Four warps a block, each on 32 rows over half of their blocks: 64 intermediate rows (gate and up, two
        // groups in turn) in expert_up, 64 output rows in expert_down.
        Launch::new(
            &self.gpu,
            up,
            (lay.inter.div_ceil(64) as u32, g),
            128,
            lay.expert_smem(lay.width, per_pass) as u32,
        )
        .p(slots)
        .p(row_off)
        .p(rows)
        .p(z)
        .p(act)
        .i(lay.width)
        .i(lay.inter)
        .i(act_kind)
        .parts(lay.offsets())
        .go()?;
        Launch::new(
            &self.gpu,
            down,
            (lay.width.div_ceil(64) as u32, g),
            128,
            lay.expert_smem(lay.inter, per_pass) as u32,
        )
        .p(slots)
        .p(row_off)
        .p(act)
        .p(y)
        .i(lay.width)
        .i(lay.inter)
        .parts(lay.offsets())
        .go()
    }
}

/// Dynamic shared memory of a `kda_recurrence` block: the head's state (dim × dim) and four vectors of dim.
fn kda_smem(dim: usize) -> usize {
    (dim + 4) * dim * 4
}

fn ld_mat(ld: &Loader, m: &Mat) -> Result<Linear> {
    // The kernels read rows in whole 32-element blocks with 16-byte loads.
    if !m.cols.is_multiple_of(32) {
        bail!(
            "{}: {} columns; the CUDA kernels need a multiple of 32",
            m.name,
            m.cols
        );
    }
    ld.linear(m)
}

/// Puts the embeddings and head, and the layers that fit in `spine_vram` (`plan_spine`), in VRAM of their own;
/// the other layers' images in page-locked host memory, with the two VRAM buffers they stream through.
fn place_spine(
    gpu: &Gpu,
    head: Block,
    blocks: Vec<Block>,
    spine_vram: Option<u64>,
) -> Result<(Vec<DevBuf>, Option<Streamed>)> {
    let upload = |b: &Block| -> Result<DevBuf> {
        let mem = gpu
            .upload(&b.bytes)
            .with_context(|| format!("allocating {} bytes of spine in VRAM", b.bytes.len()))?;
        b.base.set(mem.ptr).expect("a block is placed once");
        Ok(mem)
    };
    let sizes: Vec<u64> = blocks.iter().map(|b| b.bytes.len() as u64).collect();
    let (free, _) = cu::mem_get_info().doing("reading the GPU's free memory")?;
    let allowance = spine_vram
        .unwrap_or_else(|| (free as u64).saturating_sub(head.bytes.len() as u64 + (4 << 30)));
    let mut resident = vec![upload(&head)?];
    let mut index = vec![None; blocks.len()];
    let (mut images, mut stream) = (Vec::new(), Vec::new());
    let mut at = 0;
    for (l, (b, keep)) in blocks
        .into_iter()
        .zip(plan_spine(&sizes, allowance))
        .enumerate()
    {
        if keep {
            resident.push(upload(&b)?);
        } else {
            index[l] = Some(images.len());
            images.push((l, at, b.bytes.len()));
            at += b.bytes.len();
            stream.push(b);
        }
    }
    if stream.is_empty() {
        return Ok((resident, None));
    }
    // Write-combined: the CPU only writes it (here), the copy engine reads it.
    let mut host = Pinned::new(gpu, at, true)
        .with_context(|| format!("page-locking {at} bytes of streamed spine layers"))?;
    for (b, &(_, off, len)) in stream.iter().zip(&images) {
        par_copy(&mut host.as_mut_slice()[off..off + len], &b.bytes);
    }
    let largest = images
        .iter()
        .map(|i| i.2)
        .max()
        .expect("some layer streams");
    let bufs = (0..images.len().min(2))
        .map(|_| gpu.alloc(largest))
        .collect::<Result<Vec<_>>>()?;
    for (j, b) in stream.iter().enumerate() {
        b.base.set(bufs[j % 2].ptr).expect("a block is placed once");
    }
    Ok((
        resident,
        Some(Streamed {
            host,
            images,
            index,
            bufs,
            copied: [gpu.event()?, gpu.event()?],
            freed: [gpu.event()?, gpu.event()?],
        }),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use deltafin_models::LogitRows;

    fn session(pos: usize) -> CudaSession {
        CudaSession {
            layers: Vec::new(),
            pos,
            graph: None,
            ahead: None,
        }
    }

    /// The kernels find row t's token at header[t] and session i's position at header[rows + i]; a graphed
    /// decode step's upload and `decode_pick` write the same layout for one row: [token, position].
    #[test]
    fn a_pass_header_holds_every_rows_token_then_each_sessions_position() {
        let (mut a, mut b) = (session(7), session(40));
        let batch = [
            Pass {
                session: &mut a,
                tokens: &[5],
                rows: LogitRows::Last,
            },
            Pass {
                session: &mut b,
                tokens: &[1, 2, 3],
                rows: LogitRows::All,
            },
        ];
        assert_eq!(header(&batch), vec![5, 1, 2, 3, 7, 40]);
        assert_eq!(session(3).mla_cap(), 0, "no MLA layers, no cache");
        assert!(session(3).holds(2), "no MLA layers, nothing to outgrow");
    }
}
