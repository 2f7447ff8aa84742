//! The one description of a model, as plain data: every spine tensor's checkpoint name and shape, and each
//! family's choices as enums (contract §2 and §4 for K3, §6 for Kimi Linear). The CPU executor and the CUDA
//! executor both build their weights from it; no tensor name or family test lives anywhere else.

use crate::ops::Act;
use anyhow::{bail, Context, Result};
use deltafin_formats::config::{Family, GqaConfig, ModelConfig, Rope};
use deltafin_store::record::{layer_prefix, moe_prefix};

/// A BF16 matrix `[rows, cols]` of the checkpoint.
#[derive(Clone, Debug, PartialEq)]
pub struct Mat {
    pub name: String,
    pub rows: usize,
    pub cols: usize,
}

/// A BF16 or F32 tensor of the checkpoint, read as f32.
#[derive(Clone, Debug, PartialEq)]
pub struct Vector {
    pub name: String,
    pub shape: Vec<usize>,
}

/// An AttnRes score vector: `norm ⊙ proj`, folded once at load.
#[derive(Clone, Debug, PartialEq)]
pub struct ResScore {
    pub norm: Vector,
    pub proj: Vector,
}

/// How a layer's output goes back into the residual stream.
#[derive(Clone, Debug, PartialEq)]
pub enum Residual {
    /// K3's Block Attention Residuals: anchors every `block` layers, each layer's inputs a `Mix` of them.
    AttnRes { block: usize, out: ResScore },
    /// Kimi Linear's plain pre-norm residuals: `h += f(RMS(h))`.
    PreNorm,
}

/// How the per-channel decay `g` (a log-decay, ≤ 0) is formed from `raw = f_b(f_a x) + dt_bias`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum DecayGate {
    /// K3: `g = lower · sigmoid(exp(A_log[h]) · raw)`.
    LowerBoundSigmoid { lower: f32 },
    /// Kimi Linear: `g = −exp(A_log[h]) · softplus(raw)`.
    Softplus,
}

/// How `A_log` (one decay rate per head) is stored; the first `heads` values are the rates either way.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ALogLayout {
    /// K3: `[head_dim]`, one real entry per head and zero padding (contract §4 KDA step 5).
    PaddedToHeadDim,
    /// Kimi Linear: `[1, 1, heads, 1]`.
    PerHead,
}

/// How q and k are L2-normalised per head.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum QkNorm {
    /// K3 contract: `x / max(‖x‖, 1e−12)`.
    ClampedNorm,
    /// fla / transformers: `x / sqrt(Σx² + 1e−6)`.
    EpsInsideSqrt,
}

/// The gate applied to the normed output of each KDA head.
#[derive(Clone, Debug, PartialEq)]
pub enum OutputGate {
    /// K3: `sigmoid(g_proj x)`.
    FullRank(Mat),
    /// Kimi Linear: `sigmoid(g_b(g_a x))`.
    LowRank(Mat, Mat),
}

/// Kimi Delta Attention (contract §4 "KDA").
#[derive(Clone, Debug, PartialEq)]
pub struct Kda {
    pub q: Mat,
    pub k: Mat,
    pub v: Mat,
    /// Depthwise causal conv weights for q, k, v: `[width, 1, kernel]` each.
    pub conv: [Vector; 3],
    pub f_a: Mat,
    pub f_b: Mat,
    pub b: Mat,
    pub a_log: Vector,
    pub a_log_layout: ALogLayout,
    pub dt_bias: Vector,
    pub o_norm: Vector,
    pub decay: DecayGate,
    pub qk_norm: QkNorm,
    pub out_gate: OutputGate,
    pub o: Mat,
    pub heads: usize,
    pub dim: usize,
    pub kernel: usize,
    pub eps: f32,
}

/// Where the MLA queries come from.
#[derive(Clone, Debug, PartialEq)]
pub enum QueryPath {
    /// `q_b(RMS(q_a x))` (K3).
    LowRank { a: Mat, norm: Vector, b: Mat },
    /// `q_proj x` (Kimi Linear).
    Direct(Mat),
}

/// Multi-head latent attention (contract §4 "Gated MLA, NoPE"; DeepSeek-V3 adds RoPE to the rope part).
#[derive(Clone, Debug, PartialEq)]
pub struct Mla {
    pub q: QueryPath,
    pub kv_a: Mat,
    pub kv_norm: Vector,
    /// `[heads × (nope + v), kv_lora]`: per head, nope rows of W_UK then v rows of W_UV.
    pub kv_b: Mat,
    /// K3's output gate `sigmoid(g_proj x)`; Kimi Linear has none.
    pub gate: Option<Mat>,
    pub o: Mat,
    pub heads: usize,
    pub nope: usize,
    pub rope: usize,
    pub v: usize,
    pub kv_lora: usize,
    pub latent_eps: f32,
    /// Rotation of q's and k's rope parts (DeepSeek-V3); `None`: NoPE.
    pub rotary: Option<Rope>,
}

/// A BF16 projection, with its bias where the family has one: `W x (+ b)`.
#[derive(Clone, Debug, PartialEq)]
pub struct Affine {
    pub weight: Mat,
    pub bias: Option<Vector>,
}

/// Grouped-query attention with rotate-half RoPE: gpt-oss's (biases, learned sinks) or Qwen3's (per-head
/// RMSNorm of q and k before the rotation).
#[derive(Clone, Debug, PartialEq)]
pub struct Gqa {
    pub q: Affine,
    pub k: Affine,
    pub v: Affine,
    pub o: Affine,
    /// One logit per query head that joins the softmax without a value (gpt-oss).
    pub sinks: Option<Vector>,
    /// RMSNorm weights `[dim]` applied to each head of q and of k (Qwen3), and their eps.
    pub head_norm: Option<HeadNorm>,
    pub heads: usize,
    pub kv_heads: usize,
    pub dim: usize,
    /// `Some(w)`: a query sees only the last `w` positions, itself included.
    pub window: Option<usize>,
    /// Rotate-half rotation of q and k.
    pub rope: Rope,
}

/// Qwen3's `q_norm` / `k_norm`: one RMSNorm over `head_dim`, shared by all heads of q (of k).
#[derive(Clone, Debug, PartialEq)]
pub struct HeadNorm {
    pub q: Vector,
    pub k: Vector,
    pub eps: f32,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Attention {
    Kda(Box<Kda>),
    Mla(Box<Mla>),
    Gqa(Box<Gqa>),
}

/// `down(act(gate x, up x))`.
#[derive(Clone, Debug, PartialEq)]
pub struct Mlp {
    pub gate: Mat,
    pub up: Mat,
    pub down: Mat,
    pub act: Act,
}

/// How the router turns its logits into a choice and weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scoring {
    /// noaux_tc: sigmoid scores; the correction bias only chooses; weights renormalised and scaled.
    SigmoidCorrected,
    /// gpt-oss: the bias is the linear's (`x Wᵀ + b`); the top-k logits, softmaxed among themselves.
    SoftmaxTopK,
    /// Qwen3-MoE: softmax over all experts, the top k probabilities, renormalised where configured.
    Softmax,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Router {
    pub gate: Mat,
    /// noaux_tc's correction bias or gpt-oss's linear bias; Qwen3's router has none.
    pub bias: Option<Vector>,
    pub scoring: Scoring,
    pub top_k: usize,
    pub renormalize: bool,
    pub scale: f32,
    /// Expert groups of consecutive ids, and how many of them the router keeps.
    pub groups: usize,
    pub topk_group: usize,
}

/// K3's latent projections around the routed experts: `z = down x`, `r = up · RMS(Σ w_i y_i, norm)`.
#[derive(Clone, Debug, PartialEq)]
pub struct Latent {
    pub down: Mat,
    pub norm: Vector,
    pub up: Mat,
}

/// Routed experts (their records: `deltafin_store::record`) plus shared experts.
#[derive(Clone, Debug, PartialEq)]
pub struct Moe {
    pub router: Router,
    pub latent: Option<Latent>,
    /// Shared experts, where the family has them (gpt-oss has none).
    pub shared: Option<Mlp>,
    /// The routed experts' activation.
    pub act: Act,
    pub eps: f32,
}

#[derive(Clone, Debug, PartialEq)]
pub enum FeedForward {
    Dense(Mlp),
    Moe(Box<Moe>),
}

/// Layer `l`: `res` is present exactly when the model's residual is [`Residual::AttnRes`].
#[derive(Clone, Debug, PartialEq)]
pub struct Layer {
    pub res: Option<LayerRes>,
    pub input_norm: Vector,
    pub attn: Attention,
    pub post_norm: Vector,
    pub ffn: FeedForward,
}

/// A layer's AttnRes score vectors: before attention and before the feed-forward.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerRes {
    pub attn: ResScore,
    pub mlp: ResScore,
}

/// A whole model: embeddings, layers, residual kind, the final norm and the head (the embedding
/// table itself where the model ties them).
#[derive(Clone, Debug, PartialEq)]
pub struct Description {
    pub embed: Mat,
    pub residual: Residual,
    pub layers: Vec<Layer>,
    pub norm: Vector,
    pub lm_head: Mat,
}

impl Layer {
    /// The names of the layer's spine tensors (its routed experts are records: `deltafin_store::record`).
    pub fn tensors(&self) -> Vec<&str> {
        let mut t: Vec<&str> = Vec::new();
        if let Some(r) = &self.res {
            for s in [&r.attn, &r.mlp] {
                t.extend([&*s.norm.name, &s.proj.name]);
            }
        }
        t.extend([&*self.input_norm.name, &self.post_norm.name]);
        match &self.attn {
            Attention::Kda(k) => {
                t.extend([
                    &*k.q.name,
                    &k.k.name,
                    &k.v.name,
                    &k.f_a.name,
                    &k.f_b.name,
                    &k.b.name,
                ]);
                t.extend(k.conv.iter().map(|c| &*c.name));
                t.extend([&*k.a_log.name, &k.dt_bias.name, &k.o_norm.name, &k.o.name]);
                match &k.out_gate {
                    OutputGate::FullRank(g) => t.push(&g.name),
                    OutputGate::LowRank(a, b) => t.extend([&*a.name, &b.name]),
                }
            }
            Attention::Mla(m) => {
                match &m.q {
                    QueryPath::LowRank { a, norm, b } => t.extend([&*a.name, &norm.name, &b.name]),
                    QueryPath::Direct(p) => t.push(&p.name),
                }
                t.extend([&*m.kv_a.name, &m.kv_norm.name, &m.kv_b.name, &m.o.name]);
                t.extend(m.gate.iter().map(|g| &*g.name));
            }
            Attention::Gqa(g) => {
                for a in [&g.q, &g.k, &g.v, &g.o] {
                    t.push(&a.weight.name);
                    t.extend(a.bias.iter().map(|b| &*b.name));
                }
                t.extend(g.sinks.iter().map(|s| &*s.name));
                if let Some(n) = &g.head_norm {
                    t.extend([&*n.q.name, &n.k.name]);
                }
            }
        }
        match &self.ffn {
            FeedForward::Dense(m) => t.extend(m.tensors()),
            FeedForward::Moe(m) => {
                t.push(&m.router.gate.name);
                t.extend(m.router.bias.iter().map(|b| &*b.name));
                if let Some(l) = &m.latent {
                    t.extend([&*l.down.name, &l.norm.name, &l.up.name]);
                }
                t.extend(m.shared.iter().flat_map(|s| s.tensors()));
            }
        }
        t
    }
}

impl Mlp {
    fn tensors(&self) -> [&str; 3] {
        [&self.gate.name, &self.up.name, &self.down.name]
    }
}

impl Description {
    /// The names of the tensors outside the layers: embeddings, the tail's AttnRes scores, norm, lm_head
    /// (once, where it is the embedding table).
    pub fn globals(&self) -> Vec<&str> {
        let mut t = vec![&*self.embed.name, &self.norm.name];
        if self.lm_head != self.embed {
            t.push(&self.lm_head.name);
        }
        if let Residual::AttnRes { out, .. } = &self.residual {
            t.extend([&*out.norm.name, &out.proj.name]);
        }
        t
    }
}

/// What tells the families apart, beyond what config.json says.
struct Choices {
    /// Prefix of `lm_head.weight` (the rest live under the layer prefix of `deltafin_store::record`).
    head_prefix: &'static str,
    attn_res: bool,
    kda_gate_low_rank: bool,
    decay: DecayGate,
    a_log: ALogLayout,
    qk_norm: QkNorm,
    mla_gate: bool,
    act: Act,
    scoring: Scoring,
    /// The router bias's name under the MoE prefix, where it has one.
    router_bias: Option<&'static str>,
    /// GQA: biased projections and sinks (gpt-oss), RMSNorm of q's and k's heads (Qwen3).
    gqa_bias: bool,
    gqa_sinks: bool,
    gqa_head_norm: bool,
}

/// What the families in transformers' layout share: no head prefix, plain pre-norm residuals, no MLA gate,
/// SiLU GLU experts, the noaux_tc router's correction bias, GQA without biases, sinks or head norms; fla's KDA
/// conventions (Kimi Linear's — the families without KDA layers never read them).
const TRANSFORMERS: Choices = Choices {
    head_prefix: "",
    attn_res: false,
    kda_gate_low_rank: true,
    decay: DecayGate::Softplus,
    a_log: ALogLayout::PerHead,
    qk_norm: QkNorm::EpsInsideSqrt,
    mla_gate: false,
    act: Act::SiluGlu,
    scoring: Scoring::SigmoidCorrected,
    router_bias: Some("gate.e_score_correction_bias"),
    gqa_bias: false,
    gqa_sinks: false,
    gqa_head_norm: false,
};

fn choices(family: Family) -> Choices {
    match family {
        // Contract §1, §2 and §4.
        Family::KimiK3 => Choices {
            head_prefix: "language_model.",
            attn_res: true,
            kda_gate_low_rank: false,
            decay: DecayGate::LowerBoundSigmoid { lower: -5.0 },
            a_log: ALogLayout::PaddedToHeadDim,
            qk_norm: QkNorm::ClampedNorm,
            mla_gate: true,
            act: Act::Situ,
            ..TRANSFORMERS
        },
        // Contract §6 (transformers' Kimi Linear).
        Family::KimiLinear => TRANSFORMERS,
        // transformers' GptOssForCausalLM (tests/fixtures/gpt_oss_tiny_mxfp4/README.md); the experts' act comes
        // from `swiglu_limit`.
        Family::GptOss => Choices {
            scoring: Scoring::SoftmaxTopK,
            router_bias: Some("router.bias"),
            gqa_bias: true,
            gqa_sinks: true,
            ..TRANSFORMERS
        },
        // transformers' Qwen3MoeForCausalLM (tests/fixtures/qwen3_moe_tiny_bf16): every layer GQA.
        Family::Qwen3Moe => Choices {
            scoring: Scoring::Softmax,
            router_bias: None,
            gqa_head_norm: true,
            ..TRANSFORMERS
        },
        // transformers' DeepseekV3 (fixtures deepseek_v3_tiny_*, kimi_k2_tiny_int4): every layer MLA.
        Family::DeepseekV3 => TRANSFORMERS,
    }
}

/// Names under one prefix.
struct Names(String);

impl Names {
    fn sub(&self, more: &str) -> Names {
        Names(format!("{}{more}", self.0))
    }

    fn mat(&self, name: &str, rows: usize, cols: usize) -> Mat {
        Mat {
            name: format!("{}{name}", self.0),
            rows,
            cols,
        }
    }

    fn vector(&self, name: &str, shape: &[usize]) -> Vector {
        Vector {
            name: format!("{}{name}", self.0),
            shape: shape.to_vec(),
        }
    }

    fn res(&self, which: &str, hidden: usize) -> ResScore {
        ResScore {
            norm: self.vector(&format!("{which}_norm.weight"), &[hidden]),
            proj: self.vector(&format!("{which}_proj.weight"), &[1, hidden]),
        }
    }
}

impl Description {
    /// The model `cfg` describes; fails where the config cannot be a checkpoint of its family.
    pub fn of(cfg: &ModelConfig) -> Result<Description> {
        let c = choices(cfg.family);
        let (h, v) = (cfg.hidden, cfg.vocab_size);
        let root = Names(layer_prefix(cfg.family).to_string());
        let residual = if c.attn_res {
            Residual::AttnRes {
                block: cfg
                    .attn_res_block
                    .context("an AttnRes model needs attn_res_block_size in its config.json")?,
                out: root.res("output_attn_res", h),
            }
        } else {
            Residual::PreNorm
        };
        let layers = (0..cfg.num_layers)
            .map(|l| layer(cfg, &c, &root.sub(&format!("layers.{l}.")), l))
            .collect::<Result<_>>()?;
        let embed = root.mat("embed_tokens.weight", v, h);
        Ok(Description {
            lm_head: if cfg.tied_embeddings {
                embed.clone()
            } else {
                Names(c.head_prefix.into()).mat("lm_head.weight", v, h)
            },
            embed,
            residual,
            layers,
            norm: root.vector("norm.weight", &[h]),
        })
    }
}

fn layer(cfg: &ModelConfig, c: &Choices, n: &Names, l: usize) -> Result<Layer> {
    let h = cfg.hidden;
    let attn = if let Some(g) = &cfg.gqa {
        let rope = cfg.rope.as_ref().context("GQA layers need a RoPE config")?;
        Attention::Gqa(Box::new(gqa(cfg, g, c, rope, &n.sub("self_attn."), l)))
    } else if cfg.is_mla[l] {
        Attention::Mla(Box::new(mla(cfg, c, n)))
    } else {
        Attention::Kda(Box::new(
            kda(cfg, c, n).with_context(|| format!("layer {l}"))?,
        ))
    };
    let ffn = if cfg.is_dense(l) {
        FeedForward::Dense(mlp(&n.sub("mlp."), h, cfg.dense_intermediate, c.act))
    } else {
        FeedForward::Moe(Box::new(moe(cfg, c, n)))
    };
    Ok(Layer {
        res: c.attn_res.then(|| LayerRes {
            attn: n.res("self_attention_res", h),
            mlp: n.res("mlp_res", h),
        }),
        input_norm: n.vector("input_layernorm.weight", &[h]),
        attn,
        post_norm: n.vector("post_attention_layernorm.weight", &[h]),
        ffn,
    })
}

fn kda(cfg: &ModelConfig, c: &Choices, n: &Names) -> Result<Kda> {
    let (h, heads, dim, kernel) = (
        cfg.hidden,
        cfg.kda.heads,
        cfg.kda.head_dim,
        cfg.kda.conv_kernel,
    );
    let w = heads * dim;
    let a = n.sub("self_attn.");
    let a_log_shape = match c.a_log {
        ALogLayout::PaddedToHeadDim => {
            if heads > dim {
                bail!(
                    "K3 stores A_log with head_dim = {dim} entries, fewer than the {heads} heads"
                );
            }
            vec![dim]
        }
        ALogLayout::PerHead => vec![1, 1, heads, 1],
    };
    let conv = |p: &str| a.vector(&format!("{p}_conv1d.weight"), &[w, 1, kernel]);
    Ok(Kda {
        q: a.mat("q_proj.weight", w, h),
        k: a.mat("k_proj.weight", w, h),
        v: a.mat("v_proj.weight", w, h),
        conv: [conv("q"), conv("k"), conv("v")],
        f_a: a.mat("f_a_proj.weight", dim, h),
        f_b: a.mat("f_b_proj.weight", w, dim),
        b: a.mat("b_proj.weight", heads, h),
        a_log: a.vector("A_log", &a_log_shape),
        a_log_layout: c.a_log,
        dt_bias: a.vector("dt_bias", &[w]),
        o_norm: a.vector("o_norm.weight", &[dim]),
        decay: c.decay,
        qk_norm: c.qk_norm,
        out_gate: if c.kda_gate_low_rank {
            OutputGate::LowRank(
                a.mat("g_a_proj.weight", dim, h),
                a.mat("g_b_proj.weight", w, dim),
            )
        } else {
            OutputGate::FullRank(a.mat("g_proj.weight", w, h))
        },
        o: a.mat("o_proj.weight", h, w),
        heads,
        dim,
        kernel,
        eps: cfg.rms_norm_eps,
    })
}

fn mla(cfg: &ModelConfig, c: &Choices, n: &Names) -> Mla {
    let m = &cfg.mla;
    let (h, heads, nope, rope, v, kv_lora) = (
        cfg.hidden,
        m.heads,
        m.qk_nope_head_dim,
        m.qk_rope_head_dim,
        m.v_head_dim,
        m.kv_lora_rank,
    );
    let a = n.sub("self_attn.");
    Mla {
        q: match m.q_lora_rank {
            Some(r) => QueryPath::LowRank {
                a: a.mat("q_a_proj.weight", r, h),
                norm: a.vector("q_a_layernorm.weight", &[r]),
                b: a.mat("q_b_proj.weight", heads * (nope + rope), r),
            },
            None => QueryPath::Direct(a.mat("q_proj.weight", heads * (nope + rope), h)),
        },
        kv_a: a.mat("kv_a_proj_with_mqa.weight", kv_lora + rope, h),
        kv_norm: a.vector("kv_a_layernorm.weight", &[kv_lora]),
        kv_b: a.mat("kv_b_proj.weight", heads * (nope + v), kv_lora),
        gate: c.mla_gate.then(|| a.mat("g_proj.weight", heads * v, h)),
        o: a.mat("o_proj.weight", h, heads * v),
        heads,
        nope,
        rope,
        v,
        kv_lora,
        latent_eps: m.latent_norm_eps,
        rotary: cfg.rope.clone(),
    }
}

fn gqa(cfg: &ModelConfig, g: &GqaConfig, c: &Choices, rope: &Rope, a: &Names, l: usize) -> Gqa {
    let (h, q, kv) = (cfg.hidden, g.heads * g.head_dim, g.kv_heads * g.head_dim);
    let affine = |p: &str, rows, cols| Affine {
        weight: a.mat(&format!("{p}.weight"), rows, cols),
        bias: c.gqa_bias.then(|| a.vector(&format!("{p}.bias"), &[rows])),
    };
    Gqa {
        q: affine("q_proj", q, h),
        k: affine("k_proj", kv, h),
        v: affine("v_proj", kv, h),
        o: affine("o_proj", h, q),
        sinks: c.gqa_sinks.then(|| a.vector("sinks", &[g.heads])),
        head_norm: c.gqa_head_norm.then(|| HeadNorm {
            q: a.vector("q_norm.weight", &[g.head_dim]),
            k: a.vector("k_norm.weight", &[g.head_dim]),
            eps: cfg.rms_norm_eps,
        }),
        heads: g.heads,
        kv_heads: g.kv_heads,
        dim: g.head_dim,
        window: g.sliding[l].then_some(g.window),
        rope: rope.clone(),
    }
}

fn mlp(n: &Names, hidden: usize, width: usize, act: Act) -> Mlp {
    Mlp {
        gate: n.mat("gate_proj.weight", width, hidden),
        up: n.mat("up_proj.weight", width, hidden),
        down: n.mat("down_proj.weight", hidden, width),
        act,
    }
}

fn moe(cfg: &ModelConfig, c: &Choices, n: &Names) -> Moe {
    let (h, m) = (cfg.hidden, &cfg.moe);
    let b = n.sub(moe_prefix(cfg.family));
    let gate = match c.scoring {
        Scoring::SigmoidCorrected | Scoring::Softmax => "gate.weight",
        Scoring::SoftmaxTopK => "router.weight",
    };
    Moe {
        router: Router {
            gate: b.mat(gate, m.num_experts, h),
            bias: c.router_bias.map(|n| b.vector(n, &[m.num_experts])),
            scoring: c.scoring,
            top_k: m.top_k,
            renormalize: m.renormalize,
            scale: m.routed_scaling_factor,
            groups: m.groups,
            topk_group: m.topk_group,
        },
        latent: m.latent.map(|l| Latent {
            down: b.mat("routed_expert_down_proj.weight", l, h),
            norm: b.vector("routed_expert_norm.weight", &[l]),
            up: b.mat("routed_expert_up_proj.weight", h, l),
        }),
        shared: (m.shared_width > 0)
            .then(|| mlp(&b.sub("shared_experts."), h, m.shared_width, c.act)),
        act: match cfg.swiglu_limit {
            Some(limit) => Act::ClampedSwiglu { limit },
            None => c.act,
        },
        eps: cfg.rms_norm_eps,
    }
}
