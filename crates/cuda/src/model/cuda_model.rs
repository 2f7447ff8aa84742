//! What a `CudaModel` holds on the device, its options, and the pass scratch it sizes.

use super::expert_cache::{CudaCounters, Direct, ExpertCache};
use super::session::Arena;
use super::spine::{At, Layer, Lin, Streamed};
use crate::gpu::{DevBuf, Gpu, Pinned};
use anyhow::Result;
use cudarc::driver::{sys, CudaEvent};
use deltafin_formats::config::ModelConfig;
use deltafin_models::ops::Act;
use deltafin_store::record::ExpertRecord;
use deltafin_store::ExpertStore;
use std::sync::{Arc, Mutex};

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

pub struct CudaModel {
    pub(super) gpu: Gpu,
    pub(super) cfg: ModelConfig,
    pub(super) embed: Lin,
    pub(super) layers: Vec<Layer>,
    pub(super) out_res: Option<At>,
    pub(super) norm: At,
    pub(super) lm_head: Lin,
    /// The resident blocks' VRAM (the embeddings and head, and each resident layer).
    pub(super) _spine: Vec<DevBuf>,
    pub(super) streamed: Option<Streamed>,
    pub(super) store: Arc<ExpertStore>,
    pub(super) layout: Arc<ExpertRecord>,
    /// The routed experts' activation (the description's; gpt-oss's kernels take its clamp).
    pub(super) expert_act: Act,
    pub(super) cache: Mutex<ExpertCache>,
    pub(super) arena: Mutex<Arena>,
    pub(super) spine_bytes: u64,
    /// The store's slab is page-locked (registered with the driver): the DMA engine reads records in place.
    pub(super) slab_registered: bool,
    /// At most this many records stay pinned in the store while their copies run (half its slots).
    pub(super) held_cap: usize,
    /// Set when every expert is resident: decode then routes on the device with no host round trip.
    pub(super) direct: Option<Direct>,
    /// Timing events around each pass's work on the compute stream.
    pub(super) span: [CudaEvent; 2],
    /// Where graphed decode steps leave their results.
    pub(super) picks: Picks,
    /// The fork of K3's shared expert onto the side stream and its join, recorded again in every MoE layer (a
    /// stream's wait takes the event as last recorded when it is issued): no event made and destroyed a layer.
    pub(super) fork: CudaEvent,
    pub(super) join: CudaEvent,
    /// Why decode steps run without graphs, once a capture failed (the driver may not capture every launch).
    pub(super) graphs_off: Mutex<Option<String>>,
}

/// A graphed decode step's results, by the parity of its position (so a step run ahead never overwrites those
/// of the step before it): `decode_pick` writes the logits and the greedy choice into `out`, the copy stream
/// brings them into `host`.
pub(super) struct Picks {
    /// [2][vocab + 1] floats: the logits, then the choice's bits.
    pub(super) out: DevBuf,
    pub(super) host: Pinned,
    /// Around each step's graph on the compute stream (its GPU time; the copy back waits on the second).
    pub(super) span: [[CudaEvent; 2]; 2],
    /// Its results are in `host`.
    pub(super) done: [CudaEvent; 2],
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

impl CudaModel {
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

    pub(super) fn zeros(&self, n: usize) -> Result<DevBuf> {
        self.gpu.upload(&vec![0.0f32; n.max(1)])
    }

    /// Sizes the pass's scratch and upload area for `n` rows of sessions whose MLA or GQA caches hold `cap`
    /// positions.
    pub(super) fn size_arena(&self, arena: &mut Arena, n: usize, cap: usize) -> Result<()> {
        let c = &self.cfg;
        let (hd, w) = (c.hidden, c.kda.heads * c.kda.head_dim);
        let m = &c.mla;
        // GQA: q, k, v, the heads' outputs, the scores, o_proj's bias rows.
        let gqa = c.gqa.as_ref().map_or(0, |g| {
            g.heads * (2 * g.head_dim + cap) + 2 * g.kv_heads * g.head_dim + hd
        });
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
                + gqa
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
}
