//! Loading: the spine's host images (`Block`), placed in VRAM or streamed, and the expert cache, from the shared
//! model description.

use super::cuda_model::{CudaModel, CudaOptions, Picks};
use super::expert_cache::{CudaCounters, ExpertCache, ExpertKernels};
use super::session::Arena;
use super::spine::{
    At, Attn, Base, Ffn, Gqa, Kda, Layer, Lin, Mla, Mlp, Moe, OutGate, QPath, Streamed,
};
use crate::gpu::{par_copy, DevBuf, Doing, Gpu, Pinned};
use crate::kernels::{kda_smem, Act, KdaKind, GQA_THREADS, KDA_KERN_MAX};
use crate::plan::{attn_res_values, plan_spine, Ring, SlotCache, MIX_VALUES};
use anyhow::{anyhow, bail, Context, Result};
use cudarc::driver::{result as cu, sys};
use deltafin_formats::checkpoint::Checkpoint;
use deltafin_formats::config::{Family, ModelConfig};
use deltafin_kernels::FP8_BLOCK;
use deltafin_models::describe::{self, Description, Mat, Vector};
use deltafin_models::rope::{softmax_scale, Pairing, Rotary};
use deltafin_models::weights::{Linear, Loader, Stored};
use deltafin_models::{open_expert_store, LoadOptions, ModelExperts};
use std::cell::Cell;
use std::path::Path;
use std::sync::{Arc, Mutex};

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

    fn lin(&mut self, m: Linear) -> Result<Lin> {
        let (_, mut parts) = self.fuse(vec![m])?;
        Ok(parts.pop().expect("one part"))
    }

    /// The current end of the image, as a tensor's place.
    fn here(&self) -> At {
        At {
            base: self.base.clone(),
            off: self.bytes.len() as u64,
        }
    }

    /// Matrices that multiply the same input, back to back in the order given: a one-row pass runs them as one
    /// matmul (`mm_parts`). Returns the fused matrix and each part. Every part's rows are whole 32-element
    /// blocks, so each part starts 32-byte aligned (FP8) or 64-byte aligned (BF16). FP8 parts' row scales follow
    /// their weights in the same order, so the fused matrix's row r has its scales at row r too.
    fn fuse(&mut self, parts: Vec<Linear>) -> Result<(Lin, Vec<Lin>)> {
        let cols = parts[0].cols;
        let rows = parts.iter().map(|p| p.rows).sum();
        let fp8 = parts[0].bf16().is_none();
        if let Some(p) = parts.iter().find(|p| p.bf16().is_none() != fp8) {
            bail!(
                "{} and {}: CUDA reads the matrices of one input all BF16 or all FP8; run this model on the CPU",
                parts[0].name,
                p.name
            );
        }
        let at = self.put(&[]);
        let mut placed = Vec::with_capacity(parts.len());
        for p in &parts {
            assert_eq!(p.cols, cols, "fused matrices share their input");
            self.matrix_bytes += p.bytes() as u64;
            placed.push(Lin {
                at: self.here(),
                rows: p.rows,
                cols,
                fp8: None,
            });
            match &p.weights {
                Stored::Bf16(data) => self.bytes.extend_from_slice(as_bytes(data)),
                Stored::Fp8Block { data, .. } => self.bytes.extend_from_slice(data),
            }
        }
        let scales = fp8.then(|| self.put(&[]));
        for (p, l) in parts.iter().zip(&mut placed) {
            if let Stored::Fp8Block { scale_inv, .. } = &p.weights {
                l.fp8 = Some(self.here());
                self.bytes
                    .extend_from_slice(as_bytes(&row_scales(scale_inv, p.rows, cols)));
            }
        }
        Ok((
            Lin {
                at,
                rows,
                cols,
                fp8: scales,
            },
            placed,
        ))
    }
}

/// An FP8 matrix's 128×128 block scales widened to one row of ceil(cols / 128) per matrix row (the kernels look
/// up row r's scales at row r, whichever matrix of a fused one it belongs to).
fn row_scales(scale_inv: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let per_row = cols.div_ceil(FP8_BLOCK);
    (0..rows)
        .flat_map(|r| &scale_inv[r / FP8_BLOCK * per_row..][..per_row])
        .copied()
        .collect()
}

/// Plain values (f32, u16) as their bytes.
fn as_bytes<T: Copy>(v: &[T]) -> &[u8] {
    // SAFETY: any initialised plain value is readable as bytes.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast(), std::mem::size_of_val(v)) }
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
        if cfg.family == Family::Qwen3Moe {
            bail!(
                "{}: Qwen3-MoE is not yet on CUDA; use --device cpu",
                dir.display()
            );
        }
        let ck = Checkpoint::open(dir)?;
        let mut load = load.clone();
        // The GPU path does not run the lookahead router; prediction scoring would only disable itself.
        load.store.prefetch = false;
        // Copies to the GPU read records from the page-locked slab: keep records there (--map-experts is for
        // the CPU).
        load.store.map_files = false;
        let experts = open_expert_store(dir, &ck, &cfg, &load)?;
        Ok(Source { cfg, ck, experts })
    }
}

/// A part of gpt-oss's attention that the description leaves optional (Qwen3 has none of them).
fn needed<'a>(v: &'a Option<Vector>, what: &str) -> Result<&'a Vector> {
    v.as_ref()
        .with_context(|| format!("attention without {what} is not yet on CUDA; use --device cpu"))
}

/// A matrix for the matmul kernels (BF16 or FP8).
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
            let (up, down) = layout.kernels(rows);
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
        let expert_act = desc
            .layers
            .iter()
            .find_map(|d| match &d.ffn {
                describe::FeedForward::Moe(m) => Some(m.act),
                describe::FeedForward::Dense(_) => None,
            })
            .unwrap_or(deltafin_models::ops::Act::SiluGlu);
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
                        let q_first = match &m.q {
                            describe::QueryPath::LowRank { a, .. } => a,
                            describe::QueryPath::Direct(p) => p,
                        };
                        let mut parts = vec![mat(q_first)?, mat(&m.kv_a)?];
                        if let Some(g) = &m.gate {
                            parts.push(mat(g)?);
                        }
                        let (xin, parts) = b.fuse(parts)?;
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
                                b: b.lin(mat(q_b)?)?,
                            },
                            describe::QueryPath::Direct(_) => QPath::Direct(q_in),
                        };
                        Attn::Mla(Box::new(Mla {
                            xin,
                            q,
                            kv_a,
                            kv_norm: vecf(b, &m.kv_norm)?,
                            // Read by mla_attend alone, element by element: any kv_lora_rank.
                            kv_b: b.lin(ld.linear(&m.kv_b)?)?,
                            gate,
                            o: b.lin(mat(&m.o)?)?,
                            heads: m.heads,
                            nope: m.nope,
                            rope: m.rope,
                            dv: m.v,
                            kvl: m.kv_lora,
                            eps: m.latent_eps,
                            rotary: m.rotary.as_ref().map(|r| {
                                let r = Rotary::new(r, m.rope, Pairing::Interleaved);
                                (b.vector(r.inv_freq()), r.attn_factor() as f32)
                            }),
                            scale: softmax_scale(m.nope + m.rope, m.rotary.as_ref()),
                        }))
                    }
                    describe::Attention::Gqa(g) => {
                        if g.dim > GQA_THREADS || g.dim % 2 != 0 {
                            bail!(
                                "the CUDA attention kernel takes an even head_dim up to {GQA_THREADS} (got {}): run \
                                 this model on the CPU",
                                g.dim
                            );
                        }
                        let (xin, parts) = b.fuse(vec![
                            mat(&g.q.weight)?,
                            mat(&g.k.weight)?,
                            mat(&g.v.weight)?,
                        ])?;
                        let [q, k, v]: [Lin; 3] =
                            parts.try_into().map_err(|_| anyhow!("three parts"))?;
                        // gpt-oss's attention: biases and sinks, no per-head norms (Qwen3 is refused above).
                        if g.head_norm.is_some() {
                            bail!("per-head q/k norms are not yet on CUDA; use --device cpu");
                        }
                        let rope = Rotary::new(&g.rope, g.dim, Pairing::Half);
                        Attn::Gqa(Box::new(Gqa {
                            xin,
                            q,
                            k,
                            v,
                            bias: [
                                vecf(b, needed(&g.q.bias, "a q bias")?)?,
                                vecf(b, needed(&g.k.bias, "a k bias")?)?,
                                vecf(b, needed(&g.v.bias, "a v bias")?)?,
                            ],
                            o: b.lin(mat(&g.o.weight)?)?,
                            o_bias: vecf(b, needed(&g.o.bias, "an o bias")?)?,
                            sinks: vecf(b, needed(&g.sinks, "sinks")?)?,
                            inv_freq: b.vector(rope.inv_freq()),
                            attn: rope.attn_factor(),
                            heads: g.heads,
                            kv_heads: g.kv_heads,
                            dim: g.dim,
                            window: g.window.unwrap_or(0),
                        }))
                    }
                    describe::Attention::Kda(k) => {
                        let (heads, dim, kern) = (k.heads, k.dim, k.kernel);
                        let Some((kind, lower)) = KdaKind::of(k) else {
                            bail!("the CUDA KDA kernel computes K3's and Kimi Linear's gates, not {:?} with {:?}: run this model on the CPU", k.decay, k.qk_norm);
                        };
                        if dim % 32 != 0 || dim > 1024 || !(1..=KDA_KERN_MAX).contains(&kern) {
                            bail!("the CUDA KDA kernel needs head_dim a multiple of 32 up to 1024 (got {dim}) and a short \
                                   convolution of 1 to {KDA_KERN_MAX} taps (got {kern}): run this model on the CPU");
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
                        ])?;
                        let [q, k_proj, v, f_a, g_in, b_proj]: [Lin; 6] =
                            parts.try_into().map_err(|_| anyhow!("six parts"))?;
                        let gate = match g_b {
                            None => OutGate::Full(g_in),
                            Some(g_b) => OutGate::Low(g_in, b.lin(mat(g_b)?)?),
                        };
                        Attn::Kda(Box::new(Kda {
                            xin,
                            q,
                            k: k_proj,
                            v,
                            conv: b.vector(&conv),
                            f_a,
                            f_b: b.lin(mat(&k.f_b)?)?,
                            b: b_proj,
                            a_log: b.vector(&a_log),
                            dt_bias: vecf(b, &k.dt_bias)?,
                            o_norm: vecf(b, &k.o_norm)?,
                            gate,
                            o: b.lin(mat(&k.o)?)?,
                            heads,
                            dim,
                            kern,
                            kind,
                            lower,
                        }))
                    }
                };
                let mlp = |b: &mut Block, m: &describe::Mlp| -> Result<Mlp> {
                    Ok(Mlp {
                        act: Act::of(m.act),
                        gate: b.lin(mat(&m.gate)?)?,
                        up: b.lin(mat(&m.up)?)?,
                        down: b.lin(mat(&m.down)?)?,
                    })
                };
                let ffn = match &d.ffn {
                    describe::FeedForward::Dense(m) => Ffn::Dense(mlp(b, m)?),
                    describe::FeedForward::Moe(m) => {
                        let router = mat(&m.router.gate)?;
                        let (xin, router, latent) = match &m.latent {
                            Some(lt) => {
                                let (xin, parts) = b.fuse(vec![mat(&lt.down)?, router])?;
                                let [down, router]: [Lin; 2] =
                                    parts.try_into().map_err(|_| anyhow!("two parts"))?;
                                let norm = vecf(b, &lt.norm)?;
                                let up = b.lin(mat(&lt.up)?)?;
                                (Some(xin), router, Some((down, norm, up)))
                            }
                            None => (None, b.lin(router)?, None),
                        };
                        Ffn::Moe(Box::new(Moe {
                            xin,
                            router,
                            bias: vecf(
                                b,
                                m.router.bias.as_ref().context(
                                    "a router without a bias is not yet on CUDA; use --device cpu",
                                )?,
                            )?,
                            latent,
                            shared: m.shared.as_ref().map(|s| mlp(b, s)).transpose()?,
                            scoring: m.router.scoring,
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
            at: head.put(as_bytes(embed.bf16().with_context(|| {
                format!("{}: CUDA reads the embeddings in BF16 only", embed.name)
            })?)),
            rows: embed.rows,
            cols: embed.cols,
            fp8: None,
        };
        let lm_head = head.lin(ld_mat(&ld, &desc.lm_head)?)?;
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
            expert_act,
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
}
