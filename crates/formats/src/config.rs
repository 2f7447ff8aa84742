//! `config.json` → [`ModelConfig`]: one normalised description of a model, whatever family wrote it.
//!
//! K3 nests its text model under `text_config` (with `linear_attn_config` inside it, or at the root in
//! some exports); Kimi Linear is flat. Every field we rely on is read explicitly and every value we do not
//! implement is rejected with the field's name, so a checkpoint can never be run with half-understood math.

use anyhow::{bail, Context, Result};
use serde_json::{Map, Value};
use std::path::Path;

mod deepseek;
mod gpt_oss;
mod qwen3_moe;
mod rope;
pub use gpt_oss::GqaConfig;
pub use rope::{Rope, Yarn};

/// The model families deltafin computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// Kimi K3: Block AttnRes, KDA with a lower-bound sigmoid gate, gated NoPE MLA, latent MXFP4 MoE, SiTU.
    KimiK3,
    /// Kimi Linear: plain residuals, softplus KDA gate, ungated MLA, full-width BF16 SiLU experts.
    KimiLinear,
    /// gpt-oss: GQA with sinks (sliding and full layers), YaRN RoPE, a biased softmax router, MXFP4 experts
    /// with biases and a clamped SwiGLU.
    GptOss,
    /// DeepSeek-V3 and Kimi K2: plain residuals, MLA with q LoRA and interleaved YaRN RoPE, grouped
    /// noaux_tc router, SiLU experts; BF16, FP8 or INT4 (routed experts) weights.
    DeepseekV3,
    /// Qwen3-MoE: GQA with per-head q/k RMSNorm and rotate-half RoPE, a softmax router over all experts,
    /// BF16 SiLU experts, dense MLP layers where `mlp_only_layers` / `decoder_sparse_step` say.
    Qwen3Moe,
}

/// How the linear weights are stored (`quantization_config`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Quant {
    /// No quantization_config: BF16 (K3's and gpt-oss's MXFP4 experts are implied by their family).
    None,
    /// DeepSeek-V3's FP8: e4m3 `weight` with F32 `weight_scale_inv` per 128×128 block.
    Fp8Block,
    /// K2 Thinking: compressed-tensors pack-quantized INT4 routed experts (symmetric, group 32).
    Int4Experts,
}

#[derive(Clone, Debug, Default)]
pub struct KdaConfig {
    pub heads: usize,
    pub head_dim: usize,
    pub conv_kernel: usize,
}

#[derive(Clone, Debug, Default)]
pub struct MlaConfig {
    pub heads: usize,
    /// `None`: queries come from one `q_proj` (Kimi Linear); `Some(r)`: `q_a_proj` → norm → `q_b_proj`.
    pub q_lora_rank: Option<usize>,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    /// eps of `q_a_layernorm` / `kv_a_layernorm` (K3: rms_norm_eps; transformers' Kimi Linear: 1e-6).
    pub latent_norm_eps: f32,
}

#[derive(Clone, Debug)]
pub struct MoeConfig {
    pub num_experts: usize,
    pub top_k: usize,
    pub intermediate: usize,
    /// K3's latent width (`routed_expert_hidden_size`); `None` when experts act on the hidden state directly.
    pub latent: Option<usize>,
    /// Width of the fused shared experts (`num_shared_experts × moe_intermediate_size`).
    pub shared_width: usize,
    pub routed_scaling_factor: f32,
    pub renormalize: bool,
    /// Expert groups (`n_group`, consecutive experts) and how many the router keeps (`topk_group`).
    pub groups: usize,
    pub topk_group: usize,
}

#[derive(Clone, Debug)]
pub struct ModelConfig {
    pub family: Family,
    pub hidden: usize,
    pub num_layers: usize,
    pub vocab_size: usize,
    pub rms_norm_eps: f32,
    /// `dense[l]`: layer l has the dense MLP of width `dense_intermediate` instead of the MoE.
    pub dense: Vec<bool>,
    pub dense_intermediate: usize,
    /// `true` where the layer is MLA, `false` where it is KDA (0-based), from the 1-based lists.
    pub is_mla: Vec<bool>,
    pub kda: KdaConfig,
    pub mla: MlaConfig,
    pub moe: MoeConfig,
    /// K3's AttnRes block size; `None` for plain residuals.
    pub attn_res_block: Option<usize>,
    /// The rotary embedding (DeepSeek-V3's MLA, gpt-oss's GQA); `None`: NoPE.
    pub rope: Option<Rope>,
    pub quant: Quant,
    pub bos_token_id: Option<u32>,
    pub eos_token_id: Option<u32>,
    /// The GQA families' attention (every layer); `None` for the KDA/MLA families.
    pub gqa: Option<GqaConfig>,
    /// gpt-oss's clamped SwiGLU limit; `None` for the other families.
    pub swiglu_limit: Option<f32>,
    /// `tie_word_embeddings`: the logits use the embedding table (no `lm_head.weight`).
    pub tied_embeddings: bool,
}

impl ModelConfig {
    /// Reads and validates `dir/config.json`.
    pub fn from_dir(dir: &Path) -> Result<ModelConfig> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).with_context(|| {
            format!(
                "cannot read {}: a model directory needs its config.json",
                path.display()
            )
        })?;
        let root: Value = serde_json::from_str(&text)
            .with_context(|| format!("{} is not valid JSON", path.display()))?;
        Self::from_json(&root).with_context(|| format!("in {}", path.display()))
    }

    pub fn from_json(root: &Value) -> Result<ModelConfig> {
        let root = root
            .as_object()
            .context("the top level must be a JSON object")?;
        let model_type = str_field(root, "model_type")?;
        match model_type {
            "kimi_k3" => parse_k3(root),
            "kimi_linear" => parse_kimi_linear(root),
            "gpt_oss" => gpt_oss::parse(root),
            "deepseek_v3" | "kimi_k2" => deepseek::parse(root),
            "qwen3_moe" => qwen3_moe::parse(root),
            other => bail!(
                "field `model_type` is {other:?}; deltafin supports \"kimi_k3\", \"kimi_linear\", \"gpt_oss\", \"deepseek_v3\", \"kimi_k2\" and \"qwen3_moe\""
            ),
        }
    }

    /// Whether layer `l` (0-based) has the dense MLP rather than the MoE.
    pub fn is_dense(&self, l: usize) -> bool {
        self.dense[l]
    }

    /// Width of q/k/v in a KDA layer.
    pub fn kda_width(&self) -> usize {
        self.kda.heads * self.kda.head_dim
    }
}

fn parse_k3(root: &Map<String, Value>) -> Result<ModelConfig> {
    let text = obj_field(root, "text_config")?;
    // Exports differ on where these live; the text model's own copy wins.
    let linear = match text.get("linear_attn_config") {
        Some(_) => obj_field(text, "linear_attn_config"),
        None => obj_field(root, "linear_attn_config"),
    }
    .context("K3 needs `linear_attn_config` in `text_config` (or at the root)")?;

    expect_str(text, "hidden_act", "situ")?;
    expect_str(text, "topk_method", "noaux_tc")?;
    expect_str(text, "moe_router_activation_func", "sigmoid")?;
    expect_f64(text, "activation_situ_beta", 4.0)?;
    expect_f64(text, "activation_situ_linear_beta", 25.0)?;
    expect_bool(text, "latent_moe_use_norm", true)?;
    expect_bool(text, "mla_use_nope", true)?;
    expect_bool(text, "mla_use_output_gate", true)?;
    expect_bool(linear, "use_full_rank_gate", true)?;
    expect_f64(linear, "gate_lower_bound", -5.0)?;
    expect_groups_trivial(text)?;
    if opt_usize(text, "num_nextn_predict_layers")?.unwrap_or(0) != 0 {
        bail!(
            "field `text_config.num_nextn_predict_layers` must be 0: MTP heads are not supported"
        );
    }
    let quant = obj_field(root, "quantization_config")?;
    let format = str_field(quant, "format")?;
    if format != "mxfp4-pack-quantized" {
        bail!("field `quantization_config.format` is {format:?}; K3 experts must be \"mxfp4-pack-quantized\"");
    }

    let rms_norm_eps = f32_field(text, "rms_norm_eps")?;
    let mut cfg = common(text, linear, Family::KimiK3, rms_norm_eps)?;
    cfg.mla.q_lora_rank = Some(dim_field(text, "q_lora_rank")?);
    cfg.moe.latent = Some(dim_field(text, "routed_expert_hidden_size")?);
    cfg.attn_res_block = Some(bounded(text, "attn_res_block_size", MAX_LAYERS)?);
    if cfg.attn_res_block == Some(0) {
        bail!("field `text_config.attn_res_block_size` must be at least 1");
    }
    cfg.bos_token_id = opt_u32(root, "bos_token_id")?.or(opt_u32(text, "bos_token_id")?);
    cfg.eos_token_id = opt_u32(root, "eos_token_id")?.or(opt_u32(text, "eos_token_id")?);
    validate(&cfg)?;
    Ok(cfg)
}

fn parse_kimi_linear(root: &Map<String, Value>) -> Result<ModelConfig> {
    let linear = obj_field(root, "linear_attn_config")?;
    expect_str(root, "hidden_act", "silu")?;
    expect_groups_trivial(root)?;
    let rms_norm_eps = f32_field(root, "rms_norm_eps")?;
    let mut cfg = common(root, linear, Family::KimiLinear, rms_norm_eps)?;
    cfg.mla.q_lora_rank = opt_bounded(root, "q_lora_rank", MAX_DIM)?;
    // transformers builds the latent norms with KimiLinearRMSNorm's default eps.
    cfg.mla.latent_norm_eps = 1e-6;
    cfg.bos_token_id = opt_u32(root, "bos_token_id")?;
    cfg.eos_token_id = opt_u32(root, "eos_token_id")?;
    validate(&cfg)?;
    Ok(cfg)
}

/// The fields both families spell the same way.
fn common(
    text: &Map<String, Value>,
    linear: &Map<String, Value>,
    family: Family,
    rms_norm_eps: f32,
) -> Result<ModelConfig> {
    let num_layers = bounded(text, "num_hidden_layers", MAX_LAYERS)?;
    let heads = dim_field(text, "num_attention_heads")?;
    if let Some(kv) = opt_usize(text, "num_key_value_heads")? {
        if kv != heads {
            bail!("field `num_key_value_heads` is {kv} but `num_attention_heads` is {heads}; MLA needs them equal");
        }
    }
    let moe_intermediate = dim_field(text, "moe_intermediate_size")?;
    let shared = bounded(text, "num_shared_experts", MAX_EXPERTS)?;
    Ok(ModelConfig {
        family,
        hidden: dim_field(text, "hidden_size")?,
        num_layers,
        vocab_size: bounded(text, "vocab_size", MAX_VOCAB)?,
        rms_norm_eps,
        dense: first_k_dense(
            opt_usize(text, "first_k_dense_replace")?.unwrap_or(1),
            num_layers,
        )?,
        dense_intermediate: dim_field(text, "intermediate_size")?,
        is_mla: layer_schedule(linear, num_layers)?,
        kda: KdaConfig {
            heads: dim_field(linear, "num_heads")?,
            head_dim: dim_field(linear, "head_dim")?,
            conv_kernel: dim_field(linear, "short_conv_kernel_size")?,
        },
        mla: MlaConfig {
            heads,
            q_lora_rank: None,
            kv_lora_rank: dim_field(text, "kv_lora_rank")?,
            qk_nope_head_dim: dim_field(text, "qk_nope_head_dim")?,
            qk_rope_head_dim: dim_field(text, "qk_rope_head_dim")?,
            v_head_dim: dim_field(text, "v_head_dim")?,
            latent_norm_eps: rms_norm_eps,
        },
        moe: MoeConfig {
            num_experts: bounded(text, "num_experts", MAX_EXPERTS)?,
            top_k: usize_field(text, "num_experts_per_token")?,
            intermediate: moe_intermediate,
            latent: None,
            shared_width: shared * moe_intermediate,
            routed_scaling_factor: f32_field(text, "routed_scaling_factor")?,
            renormalize: bool_field(text, "moe_renormalize")?,
            groups: 1,
            topk_group: 1,
        },
        attn_res_block: None,
        rope: None,
        quant: Quant::None,
        bos_token_id: None,
        eos_token_id: None,
        gqa: None,
        swiglu_limit: None,
        tied_embeddings: false,
    })
}

/// The dense-layer schedule of `first_k_dense_replace`: layers below `k` dense, the rest MoE.
fn first_k_dense(k: usize, num_layers: usize) -> Result<Vec<bool>> {
    if k > num_layers {
        bail!("field `first_k_dense_replace` ({k}) exceeds `num_hidden_layers` ({num_layers})");
    }
    Ok((0..num_layers).map(|l| l < k).collect())
}

/// Reads the layer kinds from the 1-based `kda_layers` / `full_attn_layers` lists (never from a formula).
fn layer_schedule(linear: &Map<String, Value>, num_layers: usize) -> Result<Vec<bool>> {
    let mut kind: Vec<Option<bool>> = vec![None; num_layers];
    for (field, is_mla) in [("kda_layers", false), ("full_attn_layers", true)] {
        let list = linear
            .get(field)
            .and_then(Value::as_array)
            .with_context(|| {
                format!(
                    "field `linear_attn_config.{field}` must be a list of 1-based layer numbers"
                )
            })?;
        for v in list {
            let n = v.as_u64().filter(|&n| n >= 1 && n as usize <= num_layers).with_context(|| {
                format!("`linear_attn_config.{field}` holds {v}, not a layer number in 1..={num_layers}")
            })? as usize;
            if kind[n - 1].replace(is_mla).is_some() {
                bail!("layer {n} (1-based) appears twice in `kda_layers`/`full_attn_layers`");
            }
        }
    }
    kind.iter()
        .enumerate()
        .map(|(i, k)| {
            k.with_context(|| {
                format!(
                    "layer {} (1-based) is in neither `kda_layers` nor `full_attn_layers`",
                    i + 1
                )
            })
        })
        .collect()
}

fn validate(cfg: &ModelConfig) -> Result<()> {
    let m = &cfg.moe;
    if m.top_k == 0 || m.top_k > m.num_experts {
        bail!(
            "field `num_experts_per_token` is {} but must be in 1..={} (`num_experts`)",
            m.top_k,
            m.num_experts
        );
    }
    if !cfg.rms_norm_eps.is_finite() || cfg.rms_norm_eps <= 0.0 {
        bail!(
            "field `rms_norm_eps` must be a positive number, found {}",
            cfg.rms_norm_eps
        );
    }
    let has_kda = cfg.gqa.is_none() && cfg.is_mla.contains(&false);
    if has_kda && cfg.kda.conv_kernel == 0 {
        bail!("field `short_conv_kernel_size` must be at least 1");
    }
    for (name, v) in [
        ("hidden_size", cfg.hidden),
        ("vocab_size", cfg.vocab_size),
        ("num_hidden_layers", cfg.num_layers),
    ] {
        if v == 0 {
            bail!("field `{name}` must be positive");
        }
    }
    Ok(())
}

/// Expert grouping with one group is a no-op; anything else changes routing and is not implemented.
fn expect_groups_trivial(obj: &Map<String, Value>) -> Result<()> {
    for field in ["num_expert_group", "topk_group"] {
        if let Some(v) = opt_usize(obj, field)? {
            if v != 1 {
                bail!("field `{field}` is {v}; only 1 (no expert grouping) is supported");
            }
        }
    }
    Ok(())
}

fn get<'a>(obj: &'a Map<String, Value>, field: &str) -> Result<&'a Value> {
    obj.get(field)
        .with_context(|| format!("missing field `{field}`"))
}

fn obj_field<'a>(obj: &'a Map<String, Value>, field: &str) -> Result<&'a Map<String, Value>> {
    get(obj, field)?
        .as_object()
        .with_context(|| format!("field `{field}` must be an object"))
}

fn str_field<'a>(obj: &'a Map<String, Value>, field: &str) -> Result<&'a str> {
    let v = get(obj, field)?;
    v.as_str()
        .with_context(|| format!("field `{field}` must be a string, found {v}"))
}

/// Upper bounds on sizes, far above any real model's (K3: widths up to 33792, 93 layers, 896 experts,
/// vocabulary 163840), so that a damaged or hostile config is refused before anything is allocated from it
/// and products of up to three sizes cannot overflow.
const MAX_DIM: usize = 1 << 20;
const MAX_LAYERS: usize = 1 << 12;
const MAX_EXPERTS: usize = 1 << 16;
const MAX_VOCAB: usize = 1 << 24;

/// A width or head count.
fn dim_field(obj: &Map<String, Value>, field: &str) -> Result<usize> {
    bounded(obj, field, MAX_DIM)
}

fn bounded(obj: &Map<String, Value>, field: &str, max: usize) -> Result<usize> {
    opt_bounded(obj, field, max)?.with_context(|| format!("missing field `{field}`"))
}

fn opt_bounded(obj: &Map<String, Value>, field: &str, max: usize) -> Result<Option<usize>> {
    match opt_usize(obj, field)? {
        Some(n) if n > max => bail!(
            "field `{field}` is {n}, above the {max} deltafin accepts; the config is damaged or not a real model's"
        ),
        n => Ok(n),
    }
}

fn usize_field(obj: &Map<String, Value>, field: &str) -> Result<usize> {
    opt_usize(obj, field)?.with_context(|| format!("missing field `{field}`"))
}

fn opt_usize(obj: &Map<String, Value>, field: &str) -> Result<Option<usize>> {
    match obj.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .map(|n| Some(n as usize))
            .with_context(|| format!("field `{field}` must be a non-negative integer, found {v}")),
    }
}

fn opt_u32(obj: &Map<String, Value>, field: &str) -> Result<Option<u32>> {
    match opt_usize(obj, field)? {
        None => Ok(None),
        Some(n) => u32::try_from(n)
            .map(Some)
            .with_context(|| format!("field `{field}` is {n}, too large for a token id")),
    }
}

fn f32_field(obj: &Map<String, Value>, field: &str) -> Result<f32> {
    let v = get(obj, field)?;
    v.as_f64()
        .map(|x| x as f32)
        .with_context(|| format!("field `{field}` must be a number, found {v}"))
}

fn bool_field(obj: &Map<String, Value>, field: &str) -> Result<bool> {
    let v = get(obj, field)?;
    v.as_bool()
        .with_context(|| format!("field `{field}` must be true or false, found {v}"))
}

/// A field whose other values select math deltafin does not implement: absent means the default.
fn expect_str(obj: &Map<String, Value>, field: &str, want: &str) -> Result<()> {
    match obj.get(field) {
        None => Ok(()),
        Some(v) if v.as_str() == Some(want) => Ok(()),
        Some(v) => bail!("field `{field}` is {v}; deltafin implements only {want:?}"),
    }
}

fn expect_f64(obj: &Map<String, Value>, field: &str, want: f64) -> Result<()> {
    match obj.get(field) {
        None => Ok(()),
        Some(v) if v.as_f64() == Some(want) => Ok(()),
        Some(v) => bail!("field `{field}` is {v}; deltafin implements only {want}"),
    }
}

fn expect_bool(obj: &Map<String, Value>, field: &str, want: bool) -> Result<()> {
    match obj.get(field) {
        None => Ok(()),
        Some(v) if v.as_bool() == Some(want) => Ok(()),
        Some(v) => bail!("field `{field}` is {v}; deltafin implements only {want}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn k3() -> Value {
        json!({
            "model_type": "kimi_k3", "bos_token_id": 512, "eos_token_id": 514,
            "quantization_config": {"format": "mxfp4-pack-quantized"},
            "text_config": {
                "model_type": "kimi_linear", "hidden_size": 64, "num_hidden_layers": 3,
                "intermediate_size": 128, "moe_intermediate_size": 32, "routed_expert_hidden_size": 32,
                "num_experts": 8, "num_experts_per_token": 2, "num_shared_experts": 2,
                "num_attention_heads": 2, "num_key_value_heads": 2, "q_lora_rank": 32, "kv_lora_rank": 32,
                "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16, "vocab_size": 768,
                "attn_res_block_size": 2, "first_k_dense_replace": 1, "routed_scaling_factor": 1.0,
                "moe_renormalize": true, "rms_norm_eps": 1e-5, "hidden_act": "situ",
                "linear_attn_config": {"head_dim": 32, "num_heads": 2, "short_conv_kernel_size": 4,
                    "kda_layers": [1, 2], "full_attn_layers": [3]}
            }
        })
    }

    #[test]
    fn parses_k3_schedule_and_widths() {
        let cfg = ModelConfig::from_json(&k3()).unwrap();
        assert_eq!(cfg.family, Family::KimiK3);
        assert_eq!(cfg.is_mla, vec![false, false, true]);
        assert_eq!(cfg.moe.shared_width, 64);
        assert_eq!(cfg.moe.latent, Some(32));
        assert_eq!(cfg.mla.q_lora_rank, Some(32));
        assert_eq!(cfg.eos_token_id, Some(514));
    }

    fn err(v: Value) -> String {
        format!("{:#}", ModelConfig::from_json(&v).unwrap_err())
    }

    #[test]
    fn errors_name_the_field() {
        let mut v = k3();
        v["model_type"] = json!("llama");
        assert!(err(v).contains("`model_type` is \"llama\""));

        let mut v = k3();
        v["text_config"]
            .as_object_mut()
            .unwrap()
            .remove("hidden_size");
        assert!(err(v).contains("missing field `hidden_size`"));

        let mut v = k3();
        v["text_config"]["hidden_act"] = json!("silu");
        assert!(err(v).contains("`hidden_act`"));

        let mut v = k3();
        v["text_config"]["linear_attn_config"]["full_attn_layers"] = json!([2, 3]);
        assert!(err(v).contains("layer 2 (1-based) appears twice"));

        let mut v = k3();
        v["text_config"]["linear_attn_config"]["full_attn_layers"] = json!([]);
        assert!(err(v).contains("layer 3 (1-based) is in neither"));

        let mut v = k3();
        v["text_config"]["num_experts_per_token"] = json!(9);
        assert!(err(v).contains("num_experts_per_token"));

        let mut v = k3();
        v["text_config"]["vocab_size"] = json!("big");
        assert!(err(v).contains("`vocab_size` must be a non-negative integer"));
    }

    /// `num_hidden_layers` used to size a vector before any check, so a huge value aborted on allocation;
    /// sizes are now bounded before use.
    #[test]
    fn absurd_sizes_are_refused_before_allocation() {
        for (field, n) in [
            ("num_hidden_layers", 1u64 << 40),
            ("hidden_size", 1_000_000_000_000),
            ("vocab_size", u64::MAX),
            ("num_experts", 1 << 33),
        ] {
            let mut v = k3();
            v["text_config"][field] = json!(n);
            let e = err(v);
            assert!(
                e.contains(&format!("field `{field}` is {n}, above the")),
                "{field}: {e}"
            );
        }
    }
}
