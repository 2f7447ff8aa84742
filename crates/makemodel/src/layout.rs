//! The tensor roster of each architecture, in file order, per docs/checkpoint-layout.md.
//!
//! Order mirrors the released checkpoints: embedding first; per layer its spine tensors, then its routed
//! experts in id order (one expert = one group, kept contiguous in one shard); final norms and lm_head last.

use deltafin_formats::Dtype;

use crate::fill::Init;
use crate::{Dims, K3Dims};

/// One tensor to write: where it goes, what it is, how to fill it.
pub struct Spec {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub init: Init,
}

/// Tensors grouped for the writer: a group is never split across shards.
#[derive(Default)]
pub struct Layout {
    pub groups: Vec<Vec<Spec>>,
}

fn spec(name: impl Into<String>, dtype: Dtype, shape: &[usize], init: Init) -> Spec {
    Spec {
        name: name.into(),
        dtype,
        shape: shape.to_vec(),
        init,
    }
}

/// BF16 `[out, in]` with std gain/sqrt(in): gain 1 keeps activations O(1) layer after layer.
fn linear_with_gain(name: impl Into<String>, out: usize, inp: usize, gain: f32) -> Spec {
    spec(
        name,
        Dtype::Bf16,
        &[out, inp],
        Init::Normal(gain / (inp as f32).sqrt()),
    )
}

fn linear(name: impl Into<String>, out: usize, inp: usize) -> Spec {
    linear_with_gain(name, out, inp, 1.0)
}

/// Norm weights near 1, not exactly 1, so a reader that ignores them is caught.
const NORM_INIT: Init = Init::Uniform(0.8, 1.2);

fn norm(name: impl Into<String>, dtype: Dtype, len: usize) -> Spec {
    spec(name, dtype, &[len], NORM_INIT)
}

/// Router weights twice the usual scale and a small selection bias, so top-k choices are decisive
/// and differ between tokens.
const ROUTER_GAIN: f32 = 2.0;
const ROUTER_BIAS_INIT: Init = Init::Normal(0.05);

/// KDA short-conv taps and dt_bias.
const CONV_INIT: Init = Init::Normal(0.5);
const DT_BIAS_INIT: Init = Init::Uniform(-3.0, 0.0);

impl Layout {
    fn single(&mut self, spec: Spec) {
        self.groups.push(vec![spec]);
    }

    fn singles(&mut self, specs: impl IntoIterator<Item = Spec>) {
        specs.into_iter().for_each(|s| self.single(s));
    }

    /// Kimi K3: AttnRes, KDA with per-head A_log and full-rank output gate, gated MLA with q LoRA,
    /// latent MoE with MXFP4 routed experts.
    pub fn kimi_k3(d: &Dims, k: &K3Dims) -> Layout {
        let mut l = Layout::default();
        let h = d.hidden;
        let p = "language_model.model.";
        l.single(spec(
            format!("{p}embed_tokens.weight"),
            Dtype::Bf16,
            &[d.vocab(), h],
            Init::Normal(1.0),
        ));
        for i in 0..d.layers {
            let n = format!("{p}layers.{i}.");
            l.single(norm(format!("{n}input_layernorm.weight"), Dtype::Bf16, h));
            l.singles(attn_res(&format!("{n}self_attention_res"), h));
            l.single(norm(
                format!("{n}post_attention_layernorm.weight"),
                Dtype::Bf16,
                h,
            ));
            l.singles(attn_res(&format!("{n}mlp_res"), h));
            let a = format!("{n}self_attn.");
            if d.is_full_attention(i) {
                let q_lora = k.q_lora_rank;
                let (heads, qk, v) = (d.mla_heads, d.qk_nope + d.qk_rope, d.v_head);
                l.singles([
                    linear(format!("{a}q_a_proj.weight"), q_lora, h),
                    norm(format!("{a}q_a_layernorm.weight"), Dtype::Bf16, q_lora),
                    linear(format!("{a}q_b_proj.weight"), heads * qk, q_lora),
                    linear(
                        format!("{a}kv_a_proj_with_mqa.weight"),
                        d.kv_lora_rank + d.qk_rope,
                        h,
                    ),
                    norm(
                        format!("{a}kv_a_layernorm.weight"),
                        Dtype::Bf16,
                        d.kv_lora_rank,
                    ),
                    linear(
                        format!("{a}kv_b_proj.weight"),
                        heads * (d.qk_nope + v),
                        d.kv_lora_rank,
                    ),
                    linear(format!("{a}g_proj.weight"), heads * v, h),
                    linear(format!("{a}o_proj.weight"), h, heads * v),
                ]);
            } else {
                let (heads, hd, qkv) = (
                    d.linear_heads,
                    d.linear_head_dim,
                    d.linear_heads * d.linear_head_dim,
                );
                l.singles(
                    ["q", "k", "v", "g"].map(|x| linear(format!("{a}{x}_proj.weight"), qkv, h)),
                );
                l.singles(kda_convs(&a, qkv, Dtype::F32));
                l.singles([
                    linear(format!("{a}f_a_proj.weight"), hd, h),
                    linear(format!("{a}f_b_proj.weight"), qkv, hd),
                    linear(format!("{a}b_proj.weight"), heads, h),
                    // Per head, padded with zeros to head_dim (contract KDA step 5).
                    spec(
                        format!("{a}A_log"),
                        Dtype::F32,
                        &[hd],
                        Init::LogUniform1To16 { real: heads },
                    ),
                    spec(format!("{a}dt_bias"), Dtype::F32, &[qkv], DT_BIAS_INIT),
                    norm(format!("{a}o_norm.weight"), Dtype::F32, hd),
                    linear(format!("{a}o_proj.weight"), h, qkv),
                ]);
            }
            if i < FIRST_K_DENSE {
                l.singles(gated_mlp(&format!("{n}mlp."), h, d.intermediate));
                continue;
            }
            let m = format!("{n}block_sparse_moe.");
            l.singles(router(&m, d.experts, h));
            l.singles([
                linear(format!("{m}routed_expert_down_proj.weight"), k.latent, h),
                norm(
                    format!("{m}routed_expert_norm.weight"),
                    Dtype::Bf16,
                    k.latent,
                ),
                linear(format!("{m}routed_expert_up_proj.weight"), h, k.latent),
            ]);
            l.singles(gated_mlp(
                &format!("{m}shared_experts."),
                h,
                d.shared_experts * d.moe_intermediate,
            ));
            for e in 0..d.experts {
                let x = format!("{m}experts.{e}.");
                let (inter, latent) = (d.moe_intermediate, k.latent);
                let mut group = Vec::with_capacity(6);
                for (w, rows, fan_in) in [
                    ("w1", inter, latent),
                    ("w2", latent, inter),
                    ("w3", inter, latent),
                ] {
                    group.push(spec(
                        format!("{x}{w}.weight_packed"),
                        Dtype::U8,
                        &[rows, fan_in / 2],
                        Init::RandomBytes,
                    ));
                    group.push(spec(
                        format!("{x}{w}.weight_scale"),
                        Dtype::U8,
                        &[rows, fan_in / MXFP4_GROUP],
                        Init::E8m0Scale { fan_in },
                    ));
                }
                l.groups.push(group);
            }
        }
        l.single(norm(format!("{p}norm.weight"), Dtype::Bf16, h));
        l.singles(attn_res(&format!("{p}output_attn_res"), h));
        l.single(linear("language_model.lm_head.weight", d.vocab(), h));
        l
    }

    /// Kimi Linear 48B's layout: plain residuals, KDA with softplus gate and low-rank output gate,
    /// MLA without q LoRA or output gate, BF16 SwiGLU experts at full width.
    pub fn kimi_linear(d: &Dims) -> Layout {
        let mut l = Layout::default();
        let h = d.hidden;
        l.single(spec(
            "model.embed_tokens.weight",
            Dtype::Bf16,
            &[d.vocab(), h],
            Init::Normal(1.0),
        ));
        for i in 0..d.layers {
            let n = format!("model.layers.{i}.");
            l.single(norm(format!("{n}input_layernorm.weight"), Dtype::Bf16, h));
            l.single(norm(
                format!("{n}post_attention_layernorm.weight"),
                Dtype::Bf16,
                h,
            ));
            let a = format!("{n}self_attn.");
            if d.is_full_attention(i) {
                let (heads, v) = (d.mla_heads, d.v_head);
                l.singles([
                    linear(
                        format!("{a}q_proj.weight"),
                        heads * (d.qk_nope + d.qk_rope),
                        h,
                    ),
                    linear(
                        format!("{a}kv_a_proj_with_mqa.weight"),
                        d.kv_lora_rank + d.qk_rope,
                        h,
                    ),
                    norm(
                        format!("{a}kv_a_layernorm.weight"),
                        Dtype::Bf16,
                        d.kv_lora_rank,
                    ),
                    linear(
                        format!("{a}kv_b_proj.weight"),
                        heads * (d.qk_nope + v),
                        d.kv_lora_rank,
                    ),
                    linear(format!("{a}o_proj.weight"), h, heads * v),
                ]);
            } else {
                let (heads, hd, qkv) = (
                    d.linear_heads,
                    d.linear_head_dim,
                    d.linear_heads * d.linear_head_dim,
                );
                l.singles(["q", "k", "v"].map(|x| linear(format!("{a}{x}_proj.weight"), qkv, h)));
                l.singles(kda_convs(&a, qkv, Dtype::Bf16));
                l.singles([
                    linear(format!("{a}f_a_proj.weight"), hd, h),
                    linear(format!("{a}f_b_proj.weight"), qkv, hd),
                    spec(format!("{a}dt_bias"), Dtype::F32, &[qkv], DT_BIAS_INIT),
                    spec(
                        format!("{a}A_log"),
                        Dtype::F32,
                        &[1, 1, heads, 1],
                        Init::LogUniform1To16 { real: heads },
                    ),
                    linear(format!("{a}b_proj.weight"), heads, h),
                    linear(format!("{a}g_a_proj.weight"), hd, h),
                    linear(format!("{a}g_b_proj.weight"), qkv, hd),
                    norm(format!("{a}o_norm.weight"), Dtype::Bf16, hd),
                    linear(format!("{a}o_proj.weight"), h, qkv),
                ]);
            }
            if i < FIRST_K_DENSE {
                l.singles(gated_mlp(&format!("{n}mlp."), h, d.intermediate));
                continue;
            }
            let m = format!("{n}block_sparse_moe.");
            l.singles(router(&m, d.experts, h));
            l.singles(gated_mlp(
                &format!("{m}shared_experts."),
                h,
                d.shared_experts * d.moe_intermediate,
            ));
            for e in 0..d.experts {
                let x = format!("{m}experts.{e}.");
                let i = d.moe_intermediate;
                l.groups.push(vec![
                    linear(format!("{x}w1.weight"), i, h),
                    linear(format!("{x}w2.weight"), h, i),
                    linear(format!("{x}w3.weight"), i, h),
                ]);
            }
        }
        l.single(norm("model.norm.weight", Dtype::Bf16, h));
        l.single(linear("lm_head.weight", d.vocab(), h));
        l
    }
}

/// Layers below this index use the dense MLP (both architectures; written to config.json too).
pub const FIRST_K_DENSE: usize = 1;

/// KDA short-convolution taps (`short_conv_kernel_size`).
pub const SHORT_CONV_KERNEL: usize = 4;

/// MXFP4 elements per e8m0 scale.
const MXFP4_GROUP: usize = 32;

/// AttnRes score vector `w = res_norm ⊙ res_proj`. The keys are RMS-normalised, so a score's std is
/// about ‖w‖; std 1/sqrt(H) per entry keeps scores O(1): block mixing neither uniform nor one-hot.
fn attn_res(prefix: &str, h: usize) -> [Spec; 2] {
    [
        norm(format!("{prefix}_norm.weight"), Dtype::Bf16, h),
        spec(
            format!("{prefix}_proj.weight"),
            Dtype::Bf16,
            &[1, h],
            Init::Normal(1.0 / (h as f32).sqrt()),
        ),
    ]
}

fn kda_convs(attn: &str, qkv: usize, dtype: Dtype) -> [Spec; 3] {
    ["q", "k", "v"].map(|x| {
        spec(
            format!("{attn}{x}_conv1d.weight"),
            dtype,
            &[qkv, 1, SHORT_CONV_KERNEL],
            CONV_INIT,
        )
    })
}

fn gated_mlp(prefix: &str, h: usize, width: usize) -> [Spec; 3] {
    [
        linear(format!("{prefix}gate_proj.weight"), width, h),
        linear(format!("{prefix}up_proj.weight"), width, h),
        linear(format!("{prefix}down_proj.weight"), h, width),
    ]
}

fn router(moe: &str, experts: usize, h: usize) -> [Spec; 2] {
    [
        linear_with_gain(format!("{moe}gate.weight"), experts, h, ROUTER_GAIN),
        spec(
            format!("{moe}gate.e_score_correction_bias"),
            Dtype::F32,
            &[experts],
            ROUTER_BIAS_INIT,
        ),
    ]
}
