//! The spine on the device: where each tensor lies (`At`, `Lin`), each layer's tensors, and the layers that
//! stream from host memory.

use crate::devptr::DevPtr;
use crate::gpu::{DevBuf, Pinned};
use crate::kernels::{Act, KdaKind};
use cudarc::driver::CudaEvent;
use deltafin_models::describe::Scoring;
use std::sync::{Arc, OnceLock};

/// Where a block of spine tensors (a layer, or the embeddings and head) lies in VRAM: its own allocation or a
/// streaming buffer, known only once every layer's size is (the plan needs them all), after its tensors were
/// laid out.
pub(super) type Base = Arc<OnceLock<u64>>;

/// A spine tensor: its offset in its block.
pub(super) struct At {
    pub(super) base: Base,
    pub(super) off: u64,
}

impl At {
    fn addr(&self) -> u64 {
        self.base.get().expect("every block is placed at load") + self.off
    }

    /// A vector's address.
    pub(super) fn ptr(&self) -> DevPtr<f32> {
        DevPtr::new(self.addr())
    }
}

pub(super) struct Lin {
    pub(super) at: At,
    pub(super) rows: usize,
    pub(super) cols: usize,
    /// FP8 (e4m3 weights at `at`): each row's 128-column block scales, ceil(cols / 128) a row; `None`: BF16.
    pub(super) fp8: Option<At>,
}

impl Lin {
    /// Its weights' address (BF16, or e4m3 bytes where `fp8` is set).
    pub(super) fn ptr(&self) -> DevPtr<u16> {
        DevPtr::new(self.at.addr())
    }

    /// Its FP8 scales' address; null for BF16.
    pub(super) fn scales(&self) -> DevPtr<f32> {
        self.fp8.as_ref().map_or(DevPtr::NULL, At::ptr)
    }
}

pub(super) enum OutGate {
    Full(Lin),
    Low(Lin, Lin),
}

pub(super) struct Kda {
    /// q, k, v, f_a, the gate's first matrix, b: fused (`fuse`), in that order.
    pub(super) xin: Lin,
    pub(super) q: Lin,
    pub(super) k: Lin,
    pub(super) v: Lin,
    pub(super) conv: At,
    pub(super) f_a: Lin,
    pub(super) f_b: Lin,
    pub(super) b: Lin,
    pub(super) a_log: At,
    pub(super) dt_bias: At,
    pub(super) o_norm: At,
    pub(super) gate: OutGate,
    pub(super) o: Lin,
    pub(super) heads: usize,
    pub(super) dim: usize,
    pub(super) kern: usize,
    pub(super) kind: KdaKind,
    /// K3's decay bound (`KdaKind::K3` only).
    pub(super) lower: f32,
}

pub(super) enum QPath {
    Low { a: Lin, norm: At, b: Lin },
    Direct(Lin),
}

impl QPath {
    /// The matrix applied to the layer's input.
    pub(super) fn first(&self) -> &Lin {
        match self {
            QPath::Low { a, .. } => a,
            QPath::Direct(p) => p,
        }
    }
}

impl OutGate {
    pub(super) fn first(&self) -> &Lin {
        match self {
            OutGate::Full(g) | OutGate::Low(g, _) => g,
        }
    }
}

pub(super) struct Mla {
    /// q's first matrix, kv_a and the gate (K3): fused (`fuse`), in that order.
    pub(super) xin: Lin,
    pub(super) q: QPath,
    pub(super) kv_a: Lin,
    pub(super) kv_norm: At,
    pub(super) kv_b: Lin,
    pub(super) gate: Option<Lin>,
    pub(super) o: Lin,
    pub(super) heads: usize,
    pub(super) nope: usize,
    pub(super) rope: usize,
    pub(super) dv: usize,
    pub(super) kvl: usize,
    pub(super) eps: f32,
    /// RoPE on the rope part (DeepSeek-V3): its inv_freq (rope / 2 values) and YaRN's attention factor.
    pub(super) rotary: Option<(At, f32)>,
    /// The softmax scale (YaRN's mscale² included).
    pub(super) scale: f32,
}

/// Grouped-query attention with learned sinks (gpt-oss; its forward: `gqa.rs`).
pub(super) struct Gqa {
    /// q, k, v: fused (`fuse`), in that order.
    pub(super) xin: Lin,
    pub(super) q: Lin,
    pub(super) k: Lin,
    pub(super) v: Lin,
    /// q's, k's and v's biases.
    pub(super) bias: [At; 3],
    pub(super) o: Lin,
    pub(super) o_bias: At,
    pub(super) sinks: At,
    /// The rotation's frequencies (`Rotary::inv_freq`) and its factor on cos and sin.
    pub(super) inv_freq: At,
    pub(super) attn: f64,
    pub(super) heads: usize,
    pub(super) kv_heads: usize,
    pub(super) dim: usize,
    /// 0: every position; else the last `window` (the current one included).
    pub(super) window: usize,
}

impl Gqa {
    /// Floats of one position in each cache.
    pub(super) fn kv_width(&self) -> usize {
        self.kv_heads * self.dim
    }
}

pub(super) enum Attn {
    Kda(Box<Kda>),
    Mla(Box<Mla>),
    Gqa(Box<Gqa>),
}

pub(super) struct Mlp {
    pub(super) act: Act,
    pub(super) gate: Lin,
    pub(super) up: Lin,
    pub(super) down: Lin,
}

pub(super) struct Moe {
    /// K3: the latent down projection and the router, fused (`fuse`), in that order.
    pub(super) xin: Option<Lin>,
    pub(super) router: Lin,
    pub(super) bias: At,
    pub(super) latent: Option<(Lin, At, Lin)>,
    /// gpt-oss has none.
    pub(super) shared: Option<Mlp>,
    pub(super) scoring: Scoring,
}

pub(super) enum Ffn {
    Dense(Mlp),
    Moe(Box<Moe>),
}

pub(super) struct Layer {
    pub(super) attn_res: Option<At>,
    pub(super) input_norm: At,
    pub(super) attn: Attn,
    pub(super) mlp_res: Option<At>,
    pub(super) post_norm: At,
    pub(super) ffn: Ffn,
}

/// The spine layers that stream: their images in page-locked host memory, each copied into one of two VRAM
/// buffers one layer ahead of compute. The j-th streamed layer always uses buffer j % 2, so its tensors'
/// addresses are fixed at load and the kernels read the same bytes as from a resident layer.
pub(super) struct Streamed {
    pub(super) host: Pinned,
    /// Per streamed layer in order: (layer, offset and length of its image in `host`).
    pub(super) images: Vec<(usize, usize, usize)>,
    /// Per layer: its index in `images`, if it streams.
    pub(super) index: Vec<Option<usize>>,
    /// Two, or one when a single layer streams.
    pub(super) bufs: Vec<DevBuf>,
    /// Per buffer: its copy has landed (compute waits on it); its layer's kernels are done (the next copy into
    /// it waits on that).
    pub(super) copied: [CudaEvent; 2],
    pub(super) freed: [CudaEvent; 2],
}
