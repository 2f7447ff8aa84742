//! gpt-oss's `config.json` as released (`GptOssForCausalLM`): flat, with `layer_types`, YaRN `rope_scaling`
//! and an MXFP4 `quantization_config`. Facts: docs/checkpoint-layout.md and tests/fixtures/gpt_oss_tiny_mxfp4.

use super::*;

/// Grouped-query attention with sinks, as gpt-oss has it in every layer.
#[derive(Clone, Debug)]
pub struct GqaConfig {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// `sliding[l]`: layer l sees only its last `window` positions (itself included); otherwise all.
    pub sliding: Vec<bool>,
    pub window: usize,
    pub rope: RopeConfig,
}

/// Rotate-half RoPE, optionally YaRN-scaled.
#[derive(Clone, Debug, PartialEq)]
pub struct RopeConfig {
    pub theta: f64,
    pub yarn: Option<YarnConfig>,
}

/// transformers' `_compute_yarn_parameters` inputs (no `mscale`/`mscale_all_dim`: gpt-oss has none).
#[derive(Clone, Debug, PartialEq)]
pub struct YarnConfig {
    pub factor: f64,
    pub beta_fast: f64,
    pub beta_slow: f64,
    pub original_max_position: usize,
    /// Whether the correction range is floored/ceiled (gpt-oss: false).
    pub truncate: bool,
}

pub(super) fn parse(root: &Map<String, Value>) -> Result<ModelConfig> {
    expect_bool(root, "attention_bias", true)?;
    expect_bool(root, "tie_word_embeddings", false)?;
    quantization(root)?;
    let num_layers = bounded(root, "num_hidden_layers", MAX_LAYERS)?;
    let heads = dim_field(root, "num_attention_heads")?;
    let kv_heads = dim_field(root, "num_key_value_heads")?;
    if kv_heads == 0 || heads == 0 || !heads.is_multiple_of(kv_heads) {
        bail!("field `num_attention_heads` ({heads}) must be a positive multiple of `num_key_value_heads` ({kv_heads})");
    }
    let head_dim = dim_field(root, "head_dim")?;
    if head_dim == 0 || !head_dim.is_multiple_of(2) {
        bail!("field `head_dim` is {head_dim}; rotate-half RoPE needs a positive even width");
    }
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
        first_k_dense: 0,
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
        },
        attn_res_block: None,
        bos_token_id: opt_u32(root, "bos_token_id")?,
        eos_token_id: opt_u32(root, "eos_token_id")?,
        gqa: Some(GqaConfig {
            heads,
            kv_heads,
            head_dim,
            sliding,
            window,
            rope: rope(root)?,
        }),
        swiglu_limit: Some(swiglu_limit),
    };
    validate(&cfg)?;
    Ok(cfg)
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

/// `rope_theta` with `rope_scaling` (or transformers 5's `rope_parameters`): none, or YaRN without mscale.
fn rope(root: &Map<String, Value>) -> Result<RopeConfig> {
    let scaling = ["rope_scaling", "rope_parameters"]
        .iter()
        .find(|f| root.get(**f).is_some_and(|v| !v.is_null()))
        .map(|f| obj_field(root, f).map(|o| (*f, o)))
        .transpose()?;
    let theta_in = |o: &Map<String, Value>| -> Result<Option<f64>> {
        o.get("rope_theta")
            .map(|v| {
                v.as_f64()
                    .with_context(|| format!("field `rope_theta` must be a number, found {v}"))
            })
            .transpose()
    };
    let theta = match (theta_in(root)?, scaling) {
        (Some(t), _) => t,
        (None, Some((_, o))) => theta_in(o)?.context("missing field `rope_theta`")?,
        (None, None) => bail!("missing field `rope_theta`"),
    };
    if !(theta.is_finite() && theta > 1.0) {
        bail!("field `rope_theta` is {theta}; it must be a number above 1");
    }
    let Some((field, s)) = scaling else {
        return Ok(RopeConfig { theta, yarn: None });
    };
    let kind = match s.get("rope_type").or(s.get("type")) {
        Some(v) => v.as_str().unwrap_or_default(),
        None => "default",
    };
    match kind {
        "default" => return Ok(RopeConfig { theta, yarn: None }),
        "yarn" => {}
        other => bail!("field `{field}.rope_type` is {other:?}; deltafin implements \"yarn\" (and none) for gpt-oss"),
    }
    for f in ["mscale", "mscale_all_dim", "attention_factor"] {
        if s.get(f).is_some_and(|v| !v.is_null()) {
            bail!("field `{field}.{f}` is set; deltafin implements gpt-oss's YaRN, whose attention factor is 0.1·ln(factor) + 1");
        }
    }
    let num = |f: &str, default: Option<f64>| -> Result<f64> {
        match (s.get(f), default) {
            (None | Some(Value::Null), Some(d)) => Ok(d),
            (None | Some(Value::Null), None) => bail!("missing field `{field}.{f}`"),
            (Some(v), _) => v
                .as_f64()
                .filter(|x| x.is_finite() && *x > 0.0)
                .with_context(|| {
                    format!("field `{field}.{f}` must be a positive number, found {v}")
                }),
        }
    };
    let truncate = match s.get("truncate") {
        None | Some(Value::Null) => true,
        Some(v) => v.as_bool().with_context(|| {
            format!("field `{field}.truncate` must be true or false, found {v}")
        })?,
    };
    let yarn = YarnConfig {
        factor: num("factor", None)?,
        beta_fast: num("beta_fast", Some(32.0))?,
        beta_slow: num("beta_slow", Some(1.0))?,
        original_max_position: bounded(s, "original_max_position_embeddings", MAX_DIM << 4)?,
        truncate,
    };
    if yarn.factor < 1.0 || yarn.original_max_position == 0 {
        bail!(
            "field `{field}` has factor {} and original_max_position_embeddings {}; YaRN needs factor ≥ 1 and a positive length",
            yarn.factor,
            yarn.original_max_position
        );
    }
    Ok(RopeConfig {
        theta,
        yarn: Some(yarn),
    })
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
        let y = g.rope.yarn.as_ref().unwrap();
        assert_eq!(
            (y.factor, y.original_max_position, y.truncate),
            (32.0, 4096, false)
        );
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
