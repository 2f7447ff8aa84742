//! One typed wrapper per kernel of kernels.cu: its parameters as named fields in the kernel's order (device
//! pointers typed by their elements, `kind`-like integers as enums), and its grid, block and shared memory.
//! A test checks every wrapper against the kernel's signature in kernels.cu.

use crate::devptr::DevPtr;
use crate::gpu::{Gpu, On};
use crate::launch::{int_param, kernel, launch, Kernel};
use crate::plan::matmul_ring_bytes;
use anyhow::Result;
use deltafin_models::describe::{self, DecayGate, QkNorm};

/// The gated MLP's activation (kernels.cu `actf`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Act {
    /// SiTU(gate, up): Kimi K3.
    Situ = 0,
    /// SiLU(gate) · up: Kimi Linear.
    Silu = 1,
}

/// The KDA variant of `kda_recurrence`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum KdaKind {
    /// K3's lower-bound sigmoid gate and clamped q/k norm.
    K3 = 0,
    /// Kimi Linear's softplus gate and eps-in-sqrt norm.
    KimiLinear = 1,
}

impl KdaKind {
    /// The variant computing a described KDA layer, with the decay's lower bound it takes (K3's only); `None`
    /// where the kernel computes neither pairing of decay gate and q/k norm.
    pub(crate) fn of(k: &describe::Kda) -> Option<(KdaKind, f32)> {
        match (k.decay, k.qk_norm) {
            (DecayGate::LowerBoundSigmoid { lower }, QkNorm::ClampedNorm) => {
                Some((KdaKind::K3, lower))
            }
            (DecayGate::Softplus, QkNorm::EpsInsideSqrt) => Some((KdaKind::KimiLinear, 0.0)),
            _ => None,
        }
    }
}

impl Act {
    pub(crate) fn of(act: deltafin_models::ops::Act) -> Act {
        match act {
            deltafin_models::ops::Act::Situ => Act::Situ,
            deltafin_models::ops::Act::SiluGlu => Act::Silu,
            deltafin_models::ops::Act::ClampedSwiglu { .. } => {
                unreachable!(
                    "only routed experts clamp (describe::moe), and their kernels take the limit"
                )
            }
        }
    }
}

int_param!(Act, KdaKind);

/// The expert kernels for a record's encoding and the x rows they take a pass over an expert's weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ExpertVariant {
    /// MXFP4, one row a pass.
    Mx,
    /// MXFP4, two rows a pass.
    Mx2,
    Bf16,
    /// FP8 e4m3 with 128×128 block scales (DeepSeek-V3).
    Fp8,
    /// INT4, group 32 (Kimi K2).
    Int4,
    /// MXFP4 with biases (gpt-oss), one row a pass.
    Mxb,
    /// MXFP4 with biases, two rows a pass.
    Mxb2,
}

impl ExpertVariant {
    pub(crate) fn up(self) -> &'static str {
        match self {
            ExpertVariant::Mx => "expert_up_mx",
            ExpertVariant::Mx2 => "expert_up_mx2",
            ExpertVariant::Bf16 => "expert_up_bf16",
            ExpertVariant::Fp8 => "expert_up_fp8",
            ExpertVariant::Int4 => "expert_up_int4",
            ExpertVariant::Mxb => "expert_up_mxb",
            ExpertVariant::Mxb2 => "expert_up_mxb2",
        }
    }

    pub(crate) fn down(self) -> &'static str {
        match self {
            ExpertVariant::Mx => "expert_down_mx",
            ExpertVariant::Mx2 => "expert_down_mx2",
            ExpertVariant::Bf16 => "expert_down_bf16",
            ExpertVariant::Fp8 => "expert_down_fp8",
            ExpertVariant::Int4 => "expert_down_int4",
            ExpertVariant::Mxb => "expert_down_mxb",
            ExpertVariant::Mxb2 => "expert_down_mxb2",
        }
    }

    /// The activation of the model whose experts are so encoded (MXFP4: K3); none for gpt-oss's, whose kernels
    /// (`ExpertUpBiased`) take the clamp's limit.
    pub(crate) fn act(self) -> Option<Act> {
        match self {
            ExpertVariant::Mx | ExpertVariant::Mx2 => Some(Act::Situ),
            ExpertVariant::Bf16 | ExpertVariant::Fp8 | ExpertVariant::Int4 => Some(Act::Silu),
            ExpertVariant::Mxb | ExpertVariant::Mxb2 => None,
        }
    }
}

/// The most taps of a KDA short convolution `kda_recurrence` holds in registers (kernels.cu KDA_KERN_MAX).
pub(crate) const KDA_KERN_MAX: usize = 8;

/// Dynamic shared memory of a `kda_recurrence` block: the head's state (dim × dim) and four vectors of dim.
pub(crate) fn kda_smem(dim: usize) -> usize {
    (dim + 4) * dim * 4
}

kernel! {
    /// y = W·x for `n` rows: x RMS-normalised first by `norm_w` (when not null) with `eps`; plus `add` (when not
    /// null), stored or, with `accumulate`, added into y.
    MatmulBf16 = ["matmul_bf16"] {
        w: DevPtr<u16>,
        x: DevPtr<f32>,
        y: DevPtr<f32>,
        rows: usize,
        cols: usize,
        n: usize,
        /// The x rows a block stages at once (`matmul_tile`).
        tile: usize,
        norm_w: DevPtr<f32>,
        eps: f32,
        add: DevPtr<f32>,
        accumulate: bool,
        /// The first row of each matrix fused in `w` (see `MatmulBf16::whole`), the unused ones `rows`.
        split: [u64; 6],
    }
}

impl MatmulBf16 {
    /// The split of a matrix that is one part.
    pub(crate) fn whole(rows: usize) -> [u64; 6] {
        let mut split = [rows as u64; 6];
        split[0] = 0;
        split
    }

    /// A warp per row, four a block (a 512-row matrix then spreads over 128 SMs); shared memory: each warp's
    /// ring of 4 KB pieces (as many as a row has, at most four), then the x rows of a tile.
    pub(crate) fn go(self, gpu: &Gpu, on: On) -> Result<()> {
        let (rows, cols) = (self.rows, self.cols);
        let (grid, smem) = matmul_shape(rows, cols, self.n, self.tile);
        launch(gpu, "matmul_bf16", grid, 128, smem, self)
            .on(on)
            .shape(rows, cols)
            .go()
    }
}

/// A matmul's grid and dynamic shared memory (`MatmulBf16::go`). An FP8 row has half a BF16 row's bytes, so its
/// ring needs at most the BF16 ring's room.
fn matmul_shape(rows: usize, cols: usize, n: usize, tile: usize) -> ((u32, u32), u32) {
    let smem = matmul_ring_bytes(cols) + 4 * n.min(tile) * cols;
    ((rows.div_ceil(4) as u32, 1), smem as u32)
}

kernel! {
    /// `MatmulBf16` for FP8 e4m3 weights, each row's 128-column blocks scaled by `sc` (ceil(cols / 128) a row).
    MatmulFp8 = ["matmul_fp8"] {
        w: DevPtr<u8>,
        sc: DevPtr<f32>,
        x: DevPtr<f32>,
        y: DevPtr<f32>,
        rows: usize,
        cols: usize,
        n: usize,
        tile: usize,
        norm_w: DevPtr<f32>,
        eps: f32,
        add: DevPtr<f32>,
        accumulate: bool,
        split: [u64; 6],
    }
}

impl MatmulFp8 {
    pub(crate) fn go(self, gpu: &Gpu, on: On) -> Result<()> {
        let (rows, cols) = (self.rows, self.cols);
        let (grid, smem) = matmul_shape(rows, cols, self.n, self.tile);
        launch(gpu, "matmul_fp8", grid, 128, smem, self)
            .on(on)
            .shape(rows, cols)
            .go()
    }
}

kernel! {
    /// out = act(g, u), elementwise over `len` values (an FP8 gated MLP's activation).
    ActRows = ["act_rows"] {
        g: DevPtr<f32>,
        u: DevPtr<f32>,
        out: DevPtr<f32>,
        len: usize,
        act: Act,
    }
}

impl ActRows {
    pub(crate) fn go(self, gpu: &Gpu, on: On) -> Result<()> {
        let grid = (self.len.div_ceil(256) as u32, 1);
        launch(gpu, "act_rows", grid, 256, 0, self).on(on).go()
    }
}

kernel! {
    /// out = act(G·x, U·x): a gated MLP's first half.
    MlpUpAct = ["mlp_up_act"] {
        g: DevPtr<u16>,
        u: DevPtr<u16>,
        x: DevPtr<f32>,
        out: DevPtr<f32>,
        rows: usize,
        cols: usize,
        n: usize,
        act: Act,
    }
}

impl MlpUpAct {
    /// Eight threads per row (gate and up).
    pub(crate) fn go(self, gpu: &Gpu, on: On) -> Result<()> {
        let grid = (self.rows.div_ceil(32) as u32, 1);
        launch(gpu, "mlp_up_act", grid, 256, 0, self).on(on).go()
    }
}

kernel! {
    /// Each row's token's embedding: a block a row (so for the per-row kernels below).
    EmbedRows = ["embed_rows"] {
        table: DevPtr<u16>,
        tokens: DevPtr<u32>,
        out: DevPtr<f32>,
        n: usize,
        hd: usize,
    } grid (n as u32, 1), block 256, smem 0
}

kernel! {
    /// out = RMS-normalised x times w, per row.
    RmsNormRows = ["rms_norm_rows"] {
        x: DevPtr<f32>,
        w: DevPtr<f32>,
        out: DevPtr<f32>,
        n: usize,
        d: usize,
        eps: f32,
    } grid (n as u32, 1), block 256, smem 0
}

kernel! {
    /// AttnRes Mix of `cur` with `na` anchors; RMS-normalised by `norm_w` when not null.
    AttnResMix = ["attn_res_mix"] {
        anchors: DevPtr<f32>,
        na: usize,
        cur: DevPtr<f32>,
        w: DevPtr<f32>,
        out: DevPtr<f32>,
        n: usize,
        hd: usize,
        eps: f32,
        norm_w: DevPtr<f32>,
    } grid (n as u32, 1), block 256, smem 0
}

kernel! {
    /// KDA's convolution, gates and delta rule over the rows in order, one block a head of a thread per element
    /// (shared memory: `kda_smem`); `conv_state` and `s` hold the session's two copies of each.
    KdaRecurrence = ["kda_recurrence"] {
        q: DevPtr<f32>,
        k: DevPtr<f32>,
        v: DevPtr<f32>,
        g: DevPtr<f32>,
        beta: DevPtr<f32>,
        gate: DevPtr<f32>,
        dt_bias: DevPtr<f32>,
        a_log: DevPtr<f32>,
        /// K3's lower bound of the decay.
        lower: f32,
        conv_w: DevPtr<f32>,
        conv_state: DevPtr<f32>,
        s: DevPtr<f32>,
        /// A checking pass's snapshots after each row but the last (null: none; see `Keep`).
        keep: DevPtr<f32>,
        pos: DevPtr<u32>,
        o_norm: DevPtr<f32>,
        out: DevPtr<f32>,
        n: usize,
        heads: usize,
        dim: usize,
        kern: usize,
        kind: KdaKind,
        eps: f32,
    } grid (heads as u32, 1), block dim as u32, smem kda_smem(dim) as u32
}

kernel! {
    /// Appends the rows' normalised latents and rope keys (rotated where `inv_freq` is not null) to the MLA
    /// caches at the session's position.
    MlaAppend = ["mla_append"] {
        c: DevPtr<f32>,
        kv_norm: DevPtr<f32>,
        lat: DevPtr<f32>,
        pe: DevPtr<f32>,
        pos: DevPtr<u32>,
        n: usize,
        kvl: usize,
        rope: usize,
        eps: f32,
        /// RoPE's frequencies (rope / 2) and attention factor; null: NoPE.
        inv_freq: DevPtr<f32>,
        attn: f32,
    } grid (n as u32, 1), block 128, smem 0
}

kernel! {
    /// Absorbed MLA attention over the latent cache, gated where `gate` is not null: one block a (row, head) of
    /// MLA_THREADS (kernels.cu) threads; shared memory: q's latent, the context and q's rope part.
    MlaAttend = ["mla_attend"] {
        q: DevPtr<f32>,
        kv_b: DevPtr<u16>,
        lat: DevPtr<f32>,
        pe: DevPtr<f32>,
        p_all: DevPtr<f32>,
        ctx_cap: usize,
        gate: DevPtr<f32>,
        out: DevPtr<f32>,
        n: usize,
        heads: usize,
        nope: usize,
        rope: usize,
        dv: usize,
        kvl: usize,
        pos: DevPtr<u32>,
        scale: f32,
        /// kv_b's FP8 scales (its bytes then e4m3), null for BF16.
        kv_sc: DevPtr<f32>,
        inv_freq: DevPtr<f32>,
        attn: f32,
    } grid ((n * heads) as u32, 1), block 512, smem ((2 * kvl + rope) * 4) as u32
}

kernel! {
    /// Rearranges a copied MXFP4 record in place into the expert kernels' layout.
    MxRepack = ["mx_repack"] {
        rec: DevPtr<u8>,
        parts: [u64; 6],
        width: usize,
        inter: usize,
    }
}

impl MxRepack {
    /// On the prep stream; a block a 32-row group of one of the six tensors, `smem` bytes of it staged.
    pub(crate) fn go(self, gpu: &Gpu, smem: usize) -> Result<()> {
        let grid = (self.width.max(self.inter).div_ceil(32) as u32, 6);
        launch(gpu, "mx_repack", grid, 256, smem as u32, self)
            .on(On::Prep)
            .go()
    }
}

kernel! {
    /// Each expert's gate and up projections and activation for its rows: expert u (`slots[u]`) takes entries
    /// `row_off[u]..row_off[u+1]`, entry e being row `rows[e]` of z, its output row e of `a`.
    ExpertUp = ["expert_up_mx", "expert_up_mx2", "expert_up_bf16", "expert_up_fp8", "expert_up_int4"] {
        slots: DevPtr<u64>,
        row_off: DevPtr<i32>,
        rows: DevPtr<i32>,
        z: DevPtr<f32>,
        a: DevPtr<f32>,
        width: usize,
        inter: usize,
        act: Act,
        parts: [u64; 6],
    }
}

impl ExpertUp {
    /// A block on 64 intermediate rows (gate and up, two groups in turn).
    pub(crate) fn go(self, gpu: &Gpu, run: ExpertRun, smem: usize) -> Result<()> {
        run.launch(gpu, run.variant.up(), self.inter, smem, self)
    }
}

kernel! {
    /// Each expert's down projection of its entries' activations `a` into rows of y.
    ExpertDown = [
        "expert_down_mx",
        "expert_down_mx2",
        "expert_down_bf16",
        "expert_down_fp8",
        "expert_down_int4",
        "expert_down_mxb",
        "expert_down_mxb2"
    ] {
        slots: DevPtr<u64>,
        row_off: DevPtr<i32>,
        a: DevPtr<f32>,
        y: DevPtr<f32>,
        width: usize,
        inter: usize,
        parts: [u64; 6],
    }
}

impl ExpertDown {
    /// A block on 64 output rows.
    pub(crate) fn go(self, gpu: &Gpu, run: ExpertRun, smem: usize) -> Result<()> {
        run.launch(gpu, run.variant.down(), self.width, smem, self)
    }
}

/// `count` experts (the grid's y) through the expert kernels of `variant`.
#[derive(Clone, Copy)]
pub(crate) struct ExpertRun {
    pub(crate) variant: ExpertVariant,
    pub(crate) count: usize,
}

impl ExpertRun {
    /// Four warps a block, a block per 64 of the kernel's `rows` of output and expert; `smem`: the variant's
    /// staging of x.
    fn launch<K: Kernel>(
        self,
        gpu: &Gpu,
        name: &'static str,
        rows: usize,
        smem: usize,
        k: K,
    ) -> Result<()> {
        let grid = (rows.div_ceil(64) as u32, self.count as u32);
        launch(gpu, name, grid, 128, smem as u32, k).go()
    }
}

kernel! {
    /// acc = Σ w·y over each row's experts, in ascending id order.
    MoeCombine = ["moe_combine"] {
        y: DevPtr<f32>,
        entry: DevPtr<i32>,
        wts: DevPtr<f32>,
        acc: DevPtr<f32>,
        n: usize,
        topk: usize,
        width: usize,
    } grid (n as u32, width.div_ceil(256) as u32), block 256, smem 0
}

kernel! {
    /// Groups the rows' chosen experts by expert on the device (every expert resident): each group's record,
    /// row offsets and rows, the combine's entries, and the count of groups. One block; shared memory: a
    /// counter per expert.
    MoeGroup = ["moe_group"] {
        ids: DevPtr<i32>,
        n: usize,
        topk: usize,
        e: usize,
        groups: usize,
        table: DevPtr<u64>,
        slots: DevPtr<u64>,
        row_off: DevPtr<i32>,
        rows: DevPtr<i32>,
        entry: DevPtr<i32>,
        count: DevPtr<i32>,
    } grid (1, 1), block 256, smem (4 * e) as u32
}

kernel! {
    /// The router's selection per row: ids and weights, and with `table` not null each choice's record
    /// pointer into `slots`.
    MoeRoute = ["moe_route"] {
        logits: DevPtr<f32>,
        bias: DevPtr<f32>,
        e: usize,
        topk: usize,
        renorm: bool,
        scale: f32,
        ids: DevPtr<i32>,
        wts: DevPtr<f32>,
        table: DevPtr<u64>,
        slots: DevPtr<u64>,
        /// noaux_tc's expert groups and how many of them stay in the race (groups ≤ 1: no group stage).
        groups: usize,
        topk_group: usize,
    }
}

impl MoeRoute {
    /// A block a row (`n` rows); shared memory: three values per expert and the selection.
    pub(crate) fn go(self, gpu: &Gpu, n: usize) -> Result<()> {
        let smem = (4 * (3 * self.e + self.topk)) as u32;
        launch(gpu, "moe_route", (n as u32, 1), 128, smem, self).go()
    }
}

// ==== gpt-oss (kernels.cu's last section) ====

kernel! {
    /// Each row's q, k, v plus biases, q and k rotated (rotate-half) at the row's position; k and v appended to
    /// the session's caches there. q is rotated in place.
    GqaAppend = ["gqa_append"] {
        q: DevPtr<f32>,
        k: DevPtr<f32>,
        v: DevPtr<f32>,
        bq: DevPtr<f32>,
        bk: DevPtr<f32>,
        bv: DevPtr<f32>,
        inv_freq: DevPtr<f32>,
        /// YaRN's attention factor on cos and sin.
        attn: f64,
        kc: DevPtr<f32>,
        vc: DevPtr<f32>,
        pos: DevPtr<u32>,
        n: usize,
        heads: usize,
        kv_heads: usize,
        dim: usize,
    } grid (n as u32, 1), block 128, smem 0
}

/// The threads of a `gqa_attend` block (kernels.cu GQA_THREADS): the largest head it computes.
pub(crate) const GQA_THREADS: usize = 128;

kernel! {
    /// Grouped-query attention with sinks over the caches, one block a (row, query head); `window` 0: every
    /// position, else the last `window`.
    GqaAttend = ["gqa_attend"] {
        q: DevPtr<f32>,
        kc: DevPtr<f32>,
        vc: DevPtr<f32>,
        sinks: DevPtr<f32>,
        p_all: DevPtr<f32>,
        ctx_cap: usize,
        out: DevPtr<f32>,
        n: usize,
        heads: usize,
        kv_heads: usize,
        dim: usize,
        window: usize,
        pos: DevPtr<u32>,
        scale: f32,
    } grid ((n * heads) as u32, 1), block GQA_THREADS as u32, smem 0
}

kernel! {
    /// `n` rows of the bias `b`, as a matmul's `add`.
    BiasRows = ["bias_rows"] {
        b: DevPtr<f32>,
        out: DevPtr<f32>,
        n: usize,
        len: usize,
    } grid (n as u32, 1), block 256, smem 0
}

kernel! {
    /// y += x over `len` floats.
    AddRows = ["add_rows"] {
        y: DevPtr<f32>,
        x: DevPtr<f32>,
        len: usize,
    } grid (len.div_ceil(256) as u32, 1), block 256, smem 0
}

kernel! {
    /// gpt-oss's router per row: the top k of logit + bias, softmaxed among themselves; with `table` not null
    /// each choice's record pointer into `slots`.
    MoeRouteSoftmax = ["moe_route_softmax"] {
        logits: DevPtr<f32>,
        bias: DevPtr<f32>,
        e: usize,
        topk: usize,
        ids: DevPtr<i32>,
        wts: DevPtr<f32>,
        table: DevPtr<u64>,
        slots: DevPtr<u64>,
    }
}

impl MoeRouteSoftmax {
    /// A block a row (`n` rows); shared memory: three values per expert, the selection and its weights.
    pub(crate) fn go(self, gpu: &Gpu, n: usize) -> Result<()> {
        let smem = (4 * (3 * self.e + 2 * self.topk)) as u32;
        launch(gpu, "moe_route_softmax", (n as u32, 1), 128, smem, self).go()
    }
}

kernel! {
    /// gpt-oss's experts' gate_up projection (interleaved rows, biases) and clamped SwiGLU for their rows, as
    /// `ExpertUp`; `parts`: gate_up's blocks, scales, bias, then down's.
    ExpertUpBiased = ["expert_up_mxb", "expert_up_mxb2"] {
        slots: DevPtr<u64>,
        row_off: DevPtr<i32>,
        rows: DevPtr<i32>,
        z: DevPtr<f32>,
        a: DevPtr<f32>,
        width: usize,
        inter: usize,
        limit: f32,
        parts: [u64; 6],
    }
}

impl ExpertUpBiased {
    /// A block on 64 gate_up rows (32 intermediate outputs).
    pub(crate) fn go(self, gpu: &Gpu, run: ExpertRun, smem: usize) -> Result<()> {
        run.launch(gpu, run.variant.up(), 2 * self.inter, smem, self)
    }
}

kernel! {
    /// A graphed decode step's logits and greedy choice into `out` (by the parity of the position in `hdr`),
    /// and the choice as the next step's token in `hdr`.
    DecodePick = ["decode_pick"] {
        logits: DevPtr<f32>,
        vocab: usize,
        hdr: DevPtr<u32>,
        out: DevPtr<f32>,
    } grid (1, 1), block 1024, smem 0
}

kernel! {
    /// `run --timeline`: a note after a pass's last kernel.
    TimelineMark = ["timeline_mark"] {} grid (1, 1), block 32, smem 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::{KERNEL_NAMES, KERNEL_SOURCE};
    use crate::launch::Kernel;
    use std::collections::BTreeMap;

    /// Every `extern "C" __global__` kernel of kernels.cu: its parameters' names and C types (`const` and
    /// spaces dropped), a parameter macro (EXPERT_UP_ARGS) expanded.
    fn signatures(src: &str) -> BTreeMap<String, Vec<(String, String)>> {
        let mut out = BTreeMap::new();
        for piece in src.split("extern \"C\" __global__ void").skip(1) {
            let mut head = piece.trim_start();
            if let Some(rest) = head.strip_prefix("__launch_bounds__(") {
                head = rest[rest.find(')').expect("bounds close") + 1..].trim_start();
            }
            let open = head.find('(').expect("a parameter list");
            let name = head[..open].trim().to_string();
            let close = head.find(')').expect("the list closes");
            let mut params = head[open + 1..close].trim().to_string();
            if let Some(body) = define(src, &params) {
                params = body;
            }
            let list = params
                .split(',')
                .map(str::trim)
                .filter(|p| !p.is_empty())
                .map(|p| {
                    let p = p.replace("const ", "");
                    let split = p.rfind(|c: char| !(c.is_alphanumeric() || c == '_'));
                    let at = split.expect("a type before the name") + 1;
                    let ty: String = p[..at].chars().filter(|c| !c.is_whitespace()).collect();
                    (p[at..].to_string(), ty)
                })
                .collect();
            assert!(out.insert(name.clone(), list).is_none(), "{name} twice");
        }
        out
    }

    /// The body of `#define name …` (continued lines joined), if `name` is a macro.
    fn define(src: &str, name: &str) -> Option<String> {
        let start = src.find(&format!("#define {name} "))? + "#define ".len() + name.len();
        let mut body = String::new();
        for line in src[start..].lines() {
            match line.trim_end().strip_suffix('\\') {
                Some(more) => body.push_str(more),
                None => {
                    body.push_str(line);
                    break;
                }
            }
        }
        Some(body)
    }

    fn wrapper<K: Kernel>() -> (
        &'static [&'static str],
        &'static [(&'static str, &'static str)],
    ) {
        (K::NAMES, K::PARAMS)
    }

    /// Each wrapper's fields, in order, are its kernels' parameters: the same names (case aside: Rust fields
    /// are lower case) and the same C types; every kernel has a wrapper, and the device loads them all.
    #[test]
    fn every_wrapper_matches_its_kernels_signature_in_kernels_cu() {
        let cu = signatures(KERNEL_SOURCE);
        let wrappers = [
            wrapper::<MatmulBf16>(),
            wrapper::<MatmulFp8>(),
            wrapper::<ActRows>(),
            wrapper::<MlpUpAct>(),
            wrapper::<EmbedRows>(),
            wrapper::<RmsNormRows>(),
            wrapper::<AttnResMix>(),
            wrapper::<KdaRecurrence>(),
            wrapper::<MlaAppend>(),
            wrapper::<MlaAttend>(),
            wrapper::<MxRepack>(),
            wrapper::<ExpertUp>(),
            wrapper::<ExpertDown>(),
            wrapper::<MoeCombine>(),
            wrapper::<MoeGroup>(),
            wrapper::<MoeRoute>(),
            wrapper::<DecodePick>(),
            wrapper::<GqaAppend>(),
            wrapper::<GqaAttend>(),
            wrapper::<BiasRows>(),
            wrapper::<AddRows>(),
            wrapper::<MoeRouteSoftmax>(),
            wrapper::<ExpertUpBiased>(),
            wrapper::<TimelineMark>(),
        ];
        let mut wrapped = Vec::new();
        for (names, params) in wrappers {
            let ours: Vec<(String, String)> = params
                .iter()
                .map(|(n, t)| (n.to_string(), t.to_string()))
                .collect();
            for name in names {
                let theirs: Vec<(String, String)> = cu
                    .get(*name)
                    .unwrap_or_else(|| panic!("{name} is not a kernel of kernels.cu"))
                    .iter()
                    .map(|(n, t)| (n.to_lowercase(), t.clone()))
                    .collect();
                assert_eq!(
                    ours, theirs,
                    "{name}: the wrapper's fields against kernels.cu"
                );
                wrapped.push(name.to_string());
            }
        }
        wrapped.sort();
        let mut loaded: Vec<String> = KERNEL_NAMES.iter().map(|k| k.to_string()).collect();
        loaded.sort();
        assert_eq!(
            wrapped,
            cu.keys().cloned().collect::<Vec<_>>(),
            "kernels without a wrapper"
        );
        assert_eq!(wrapped, loaded, "KERNEL_NAMES against the wrappers");
    }

    /// The parser reads what the kernels are declared with: a drifted wrapper is caught, not parsed away.
    #[test]
    fn the_signature_parser_reads_types_names_and_macros() {
        let src = "#define ARGS \\\n    const u64 *slots, int n, \\\n    Parts parts\n\
                   extern \"C\" __global__ void a(const float* x, u32* hdr, float eps) {}\n\
                   extern \"C\" __global__ void __launch_bounds__(512)\n    b(ARGS) {}\n\
                   extern \"C\" __global__ void c() {}\n";
        let s = signatures(src);
        let pairs = |v: &[(&str, &str)]| -> Vec<(String, String)> {
            v.iter()
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .collect()
        };
        assert_eq!(
            s["a"],
            pairs(&[("x", "float*"), ("hdr", "u32*"), ("eps", "float")])
        );
        assert_eq!(
            s["b"],
            pairs(&[("slots", "u64*"), ("n", "int"), ("parts", "Parts")])
        );
        assert!(s["c"].is_empty());
        assert_eq!(s.len(), 3);
    }
}
