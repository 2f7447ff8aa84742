//! gpt-oss's `config.json` as released (`GptOssForCausalLM`): flat, with `layer_types`, YaRN `rope_scaling`
//! and an MXFP4 `quantization_config`. Facts: docs/checkpoint-layout.md and tests/fixtures/gpt_oss_tiny_mxfp4.

use super::*;

/// Grouped-query attention in every layer (gpt-oss, Qwen3-MoE); what differs between them is the family's.
#[derive(Clone, Debug)]
pub struct GqaConfig {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// `sliding[l]`: layer l sees only its last `window` positions (itself included); otherwise all.
    pub sliding: Vec<bool>,
    pub window: usize,
}

pub(super) fn parse(root: &Map<String, Value>) -> Result<ModelConfig> {
    expect_bool(root, "attention_bias", true)?;
    expect_bool(root, "tie_word_embeddings", false)?;
    quantization(root)?;
    let num_layers = bounded(root, "num_hidden_layers", MAX_LAYERS)?;
    let (heads, kv_heads, head_dim) = gqa_heads(root, None)?;
    let top_k = match opt_usize(root, "num_experts_per_tok")? {
        Some(k) => k,
        None => usize_field(root, "experts_per_token")?,
    };
    let inter = dim_field(root, "intermediate_size")?;
    let swiglu_limit = match root.get("swiglu_limit") {
        None => 7.0,
        Some(_) => f32_field(root, "swiglu_limit")?,
    };
    if !(swiglu_limit.is_finite() && swiglu_limit > 0.0) {
        bail!("field `swiglu_limit` is {swiglu_limit}; it must be a positive number");
    }
    let window = bounded(root, "sliding_window", MAX_DIM << 4)?;
    let sliding = layer_types(root, num_layers)?;
    if window == 0 && sliding.iter().any(|&s| s) {
        bail!("field `sliding_window` is 0 but `layer_types` has sliding_attention layers");
    }
    let cfg = ModelConfig {
        family: Family::GptOss,
        hidden: dim_field(root, "hidden_size")?,
        num_layers,
        vocab_size: bounded(root, "vocab_size", MAX_VOCAB)?,
        rms_norm_eps: f32_field(root, "rms_norm_eps")?,
        dense: vec![false; num_layers],
        dense_intermediate: 0,
        is_mla: vec![false; num_layers],
        kda: KdaConfig::default(),
        mla: MlaConfig::default(),
        moe: MoeConfig {
            num_experts: bounded(root, "num_local_experts", MAX_EXPERTS)?,
            top_k,
            intermediate: inter,
            latent: None,
            shared_width: 0,
            routed_scaling_factor: 1.0,
            renormalize: true,
            groups: 1,
            topk_group: 1,
        },
        attn_res_block: None,
        rope: Some(rope::parse(root)?),
        quant: Quant::None,
        bos_token_id: opt_u32(root, "bos_token_id")?,
        eos_token_id: opt_u32(root, "eos_token_id")?,
        gqa: Some(GqaConfig {
            heads,
            kv_heads,
            head_dim,
            sliding,
            window,
        }),
        swiglu_limit: Some(swiglu_limit),
        tied_embeddings: false,
    };
    validate(&cfg)?;
    Ok(cfg)
}

/// `(heads, kv_heads, head_dim)`: query heads a positive multiple of the KV heads, `head_dim` even for
/// rotate-half RoPE. Without a `head_dim` field it is `hidden / heads` where the family defaults it so
/// (`hidden`: Qwen3), else missing (gpt-oss).
pub(super) fn gqa_heads(
    root: &Map<String, Value>,
    hidden: Option<usize>,
) -> Result<(usize, usize, usize)> {
    let heads = dim_field(root, "num_attention_heads")?;
    let kv_heads = dim_field(root, "num_key_value_heads")?;
    if kv_heads == 0 || heads == 0 || !heads.is_multiple_of(kv_heads) {
        bail!("field `num_attention_heads` ({heads}) must be a positive multiple of `num_key_value_heads` ({kv_heads})");
    }
    let head_dim = match (opt_bounded(root, "head_dim", MAX_DIM)?, hidden) {
        (Some(d), _) => d,
        (None, Some(h)) => h / heads,
        (None, None) => bail!("missing field `head_dim`"),
    };
    if head_dim == 0 || !head_dim.is_multiple_of(2) {
        bail!("field `head_dim` is {head_dim}; rotate-half RoPE needs a positive even width");
    }
    Ok((heads, kv_heads, head_dim))
}

/// Experts in MXFP4 (`*_blocks`/`*_scales`), everything else unconverted: the released form.
fn quantization(root: &Map<String, Value>) -> Result<()> {
    let q = obj_field(root, "quantization_config").context(
        "gpt-oss is read as released, with MXFP4 experts: `quantization_config` (quant_method \"mxfp4\") is needed",
    )?;
    let method = str_field(q, "quant_method")?;
    if method != "mxfp4" {
        bail!("field `quantization_config.quant_method` is {method:?}; deltafin reads gpt-oss experts only as \"mxfp4\"");
    }
    if let Some(list) = q.get("modules_to_not_convert") {
        let list = list
            .as_array()
            .context("field `quantization_config.modules_to_not_convert` must be a list")?;
        for m in list {
            let m = m.as_str().with_context(|| {
                format!("`quantization_config.modules_to_not_convert` holds {m}, not a module name")
            })?;
            // The experts are the only converted modules; a list that keeps them unconverted (or
            // all of an MLP) describes a BF16 checkpoint.
            if m.contains("experts") || m.ends_with(".mlp") || m.ends_with("layers.*") {
                bail!("`quantization_config.modules_to_not_convert` keeps {m:?} unconverted; deltafin reads gpt-oss experts only in MXFP4");
            }
        }
    }
    Ok(())
}

/// `layer_types`: "sliding_attention" or "full_attention" per layer.
fn layer_types(root: &Map<String, Value>, num_layers: usize) -> Result<Vec<bool>> {
    let list = get(root, "layer_types")?
        .as_array()
        .context("field `layer_types` must be a list")?;
    if list.len() != num_layers {
        bail!(
            "field `layer_types` has {} entries but `num_hidden_layers` is {num_layers}",
            list.len()
        );
    }
    list.iter()
        .enumerate()
        .map(|(l, v)| match v.as_str() {
            Some("sliding_attention") => Ok(true),
            Some("full_attention") => Ok(false),
            _ => bail!("field `layer_types[{l}]` is {v}; deltafin implements \"sliding_attention\" and \"full_attention\""),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn fixture() -> Value {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../tests/fixtures/gpt_oss_tiny_mxfp4/config.json"
        );
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
    }

    #[test]
    fn parses_the_released_form() {
        let cfg = ModelConfig::from_json(&fixture()).unwrap();
        assert_eq!(cfg.family, Family::GptOss);
        let g = cfg.gqa.as_ref().unwrap();
        assert_eq!((g.heads, g.kv_heads, g.head_dim, g.window), (4, 2, 32, 6));
        assert_eq!(g.sliding, vec![true, false, true, false]);
        let y = cfg.rope.as_ref().unwrap().yarn.as_ref().unwrap();
        assert_eq!(
            (y.factor, y.original_max_position, y.truncate),
            (32.0, 4096, false)
        );
        assert_eq!((y.mscale, y.mscale_all_dim), (None, None));
        assert_eq!((cfg.moe.num_experts, cfg.moe.top_k), (16, 4));
        assert_eq!(cfg.swiglu_limit, Some(7.0));
    }

    fn err(edit: impl FnOnce(&mut Value)) -> String {
        let mut v = fixture();
        edit(&mut v);
        format!("{:#}", ModelConfig::from_json(&v).unwrap_err())
    }

    #[test]
    fn unsupported_values_are_refused_by_name() {
        let e = err(|v| v["layer_types"][1] = json!("chunked_attention"));
        assert!(
            e.contains("`layer_types[1]` is \"chunked_attention\""),
            "{e}"
        );
        let e = err(|v| v["rope_scaling"]["rope_type"] = json!("llama3"));
        assert!(e.contains("`rope_scaling.rope_type` is \"llama3\""), "{e}");
        let e = err(|v| v["quantization_config"]["quant_method"] = json!("fp8"));
        assert!(
            e.contains("`quantization_config.quant_method` is \"fp8\""),
            "{e}"
        );
        let e = err(|v| {
            v["quantization_config"]["modules_to_not_convert"][0] =
                json!("model.layers.*.mlp.experts")
        });
        assert!(
            e.contains("keeps \"model.layers.*.mlp.experts\" unconverted"),
            "{e}"
        );
        let e = err(|v| {
            v.as_object_mut().unwrap().remove("quantization_config");
        });
        assert!(e.contains("`quantization_config` (quant_method"), "{e}");
        let e = err(|v| v["num_key_value_heads"] = json!(3));
        assert!(e.contains("multiple of `num_key_value_heads` (3)"), "{e}");
        let e = err(|v| v["layer_types"] = json!(["full_attention"]));
        assert!(e.contains("`layer_types` has 1 entries"), "{e}");
        let e = err(|v| v["tie_word_embeddings"] = json!(true));
        assert!(e.contains("`tie_word_embeddings`"), "{e}");
    }
}
