//! Qwen3-MoE's `config.json` as released (`Qwen3MoeForCausalLM`: Qwen3-30B-A3B, Qwen3-235B-A22B,
//! Qwen3-Coder-480B): flat, BF16, with transformers' `Qwen3MoeConfig` defaults for the optional fields.

use super::*;

pub(super) fn parse(root: &Map<String, Value>) -> Result<ModelConfig> {
    if let Some(a) = root.get("architectures") {
        let ok = a
            .as_array()
            .is_some_and(|a| a.iter().any(|v| v == "Qwen3MoeForCausalLM"));
        if !ok {
            bail!("field `architectures` is {a}; a qwen3_moe checkpoint must list \"Qwen3MoeForCausalLM\"");
        }
    }
    if root
        .get("quantization_config")
        .is_some_and(|v| !v.is_null())
    {
        bail!("field `quantization_config` is set; deltafin reads qwen3_moe checkpoints only in BF16 (the released form without a quantization_config)");
    }
    expect_str(root, "hidden_act", "silu")?;
    expect_bool(root, "attention_bias", false)?;
    let num_layers = bounded(root, "num_hidden_layers", MAX_LAYERS)?;
    let hidden = dim_field(root, "hidden_size")?;
    let (heads, kv_heads, head_dim) = gpt_oss::gqa_heads(root, Some(hidden))?;
    // transformers: `sliding_window` applies (to every layer) only with `use_sliding_window`.
    let window = if opt_bool(root, "use_sliding_window")?.unwrap_or(false) {
        let w = bounded(root, "sliding_window", MAX_DIM << 4)?;
        if w == 0 {
            bail!("field `sliding_window` is 0 but `use_sliding_window` is true");
        }
        Some(w)
    } else {
        None
    };
    let num_experts = bounded(root, "num_experts", MAX_EXPERTS)?;
    let cfg = ModelConfig {
        family: Family::Qwen3Moe,
        hidden,
        num_layers,
        vocab_size: bounded(root, "vocab_size", MAX_VOCAB)?,
        rms_norm_eps: f32_field(root, "rms_norm_eps")?,
        dense: dense_layers(root, num_layers)?,
        dense_intermediate: dim_field(root, "intermediate_size")?,
        is_mla: vec![false; num_layers],
        kda: KdaConfig::default(),
        mla: MlaConfig::default(),
        moe: MoeConfig {
            num_experts,
            top_k: usize_field(root, "num_experts_per_tok")?,
            intermediate: dim_field(root, "moe_intermediate_size")?,
            latent: None,
            shared_width: 0,
            routed_scaling_factor: 1.0,
            renormalize: opt_bool(root, "norm_topk_prob")?.unwrap_or(false),
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
            sliding: vec![window.is_some(); num_layers],
            window: window.unwrap_or(0),
        }),
        swiglu_limit: None,
        tied_embeddings: opt_bool(root, "tie_word_embeddings")?.unwrap_or(false),
    };
    validate(&cfg)?;
    Ok(cfg)
}

/// transformers' `Qwen3MoeDecoderLayer`: layer l is dense when it is in `mlp_only_layers` (0-based) or
/// `(l + 1) % decoder_sparse_step != 0`.
fn dense_layers(root: &Map<String, Value>, num_layers: usize) -> Result<Vec<bool>> {
    let step = opt_bounded(root, "decoder_sparse_step", MAX_LAYERS)?.unwrap_or(1);
    if step == 0 {
        bail!(
            "field `decoder_sparse_step` is 0; it must be at least 1 (every step-th layer is MoE)"
        );
    }
    let mut dense: Vec<bool> = (0..num_layers).map(|l| (l + 1) % step != 0).collect();
    match root.get("mlp_only_layers") {
        None | Some(Value::Null) => {}
        Some(v) => {
            let list = v.as_array().with_context(|| {
                format!(
                    "field `mlp_only_layers` must be a list of 0-based layer numbers, found {v}"
                )
            })?;
            for n in list {
                let l = n
                    .as_u64()
                    .filter(|&l| (l as usize) < num_layers)
                    .with_context(|| {
                        format!(
                            "`mlp_only_layers` holds {n}, not a layer number in 0..{num_layers}"
                        )
                    })?;
                dense[l as usize] = true;
            }
        }
    }
    Ok(dense)
}

fn opt_bool(obj: &Map<String, Value>, field: &str) -> Result<Option<bool>> {
    match obj.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_bool()
            .map(Some)
            .with_context(|| format!("field `{field}` must be true or false, found {v}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Qwen3-30B-A3B's released config.json, shrunk.
    fn released() -> Value {
        json!({
            "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
            "attention_bias": false, "attention_dropout": 0.0, "bos_token_id": 151643,
            "eos_token_id": 151645, "decoder_sparse_step": 1, "head_dim": 32, "hidden_act": "silu",
            "hidden_size": 64, "intermediate_size": 96, "max_position_embeddings": 40960,
            "max_window_layers": 4, "mlp_only_layers": [], "moe_intermediate_size": 32,
            "norm_topk_prob": true, "num_attention_heads": 4, "num_experts": 8, "num_experts_per_tok": 2,
            "num_hidden_layers": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "rope_scaling": null,
            "rope_theta": 1000000.0, "sliding_window": null, "tie_word_embeddings": false,
            "torch_dtype": "bfloat16", "use_sliding_window": false, "vocab_size": 512
        })
    }

    #[test]
    fn parses_the_released_form() {
        let cfg = ModelConfig::from_json(&released()).unwrap();
        assert_eq!(cfg.family, Family::Qwen3Moe);
        let g = cfg.gqa.as_ref().unwrap();
        assert_eq!((g.heads, g.kv_heads, g.head_dim), (4, 2, 32));
        assert_eq!(g.sliding, [false; 4]);
        assert_eq!(
            cfg.rope,
            Some(Rope {
                theta: 1e6,
                yarn: None
            })
        );
        assert_eq!(
            (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.intermediate),
            (8, 2, 32)
        );
        assert!(cfg.moe.renormalize && !cfg.tied_embeddings);
        assert_eq!(cfg.dense, [false; 4]);
        assert_eq!((cfg.rms_norm_eps, cfg.eos_token_id), (1e-6, Some(151645)));
    }

    #[test]
    fn reads_dense_layers_window_ties_and_yarn() {
        let mut v = released();
        v["decoder_sparse_step"] = json!(2);
        v["mlp_only_layers"] = json!([3]);
        v["use_sliding_window"] = json!(true);
        v["sliding_window"] = json!(6);
        v["tie_word_embeddings"] = json!(true);
        v["rope_scaling"] =
            json!({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768});
        v.as_object_mut().unwrap().remove("head_dim");
        v.as_object_mut().unwrap().remove("norm_topk_prob");
        let cfg = ModelConfig::from_json(&v).unwrap();
        assert_eq!(cfg.dense, [true, false, true, true]);
        let g = cfg.gqa.as_ref().unwrap();
        assert_eq!(
            (g.sliding.clone(), g.window, g.head_dim),
            (vec![true; 4], 6, 16)
        );
        assert!(cfg.tied_embeddings && !cfg.moe.renormalize);
        assert_eq!(cfg.rope.unwrap().yarn.unwrap().factor, 4.0);
    }

    #[test]
    fn unsupported_values_are_refused_by_name() {
        type Edit = fn(&mut Value);
        let err = |edit: Edit| {
            let mut v = released();
            edit(&mut v);
            format!("{:#}", ModelConfig::from_json(&v).unwrap_err())
        };
        let cases: [(Edit, &str); 11] = [
            (
                |v| v["attention_bias"] = json!(true),
                "`attention_bias` is true",
            ),
            (
                |v| v["hidden_act"] = json!("gelu"),
                "`hidden_act` is \"gelu\"",
            ),
            (
                |v| v["quantization_config"] = json!({"quant_method": "fp8"}),
                "`quantization_config` is set",
            ),
            (
                |v| v["decoder_sparse_step"] = json!(0),
                "`decoder_sparse_step` is 0",
            ),
            (
                |v| v["mlp_only_layers"] = json!([4]),
                "`mlp_only_layers` holds 4",
            ),
            (
                |v| v["num_key_value_heads"] = json!(3),
                "`num_key_value_heads` (3)",
            ),
            (|v| v["head_dim"] = json!(31), "`head_dim` is 31"),
            (
                |v| v["use_sliding_window"] = json!(true),
                "missing field `sliding_window`",
            ),
            (
                |v| v["num_experts_per_tok"] = json!(9),
                "`num_experts_per_token` is 9",
            ),
            (
                |v| v["architectures"] = json!(["Qwen3ForCausalLM"]),
                "\"Qwen3MoeForCausalLM\"",
            ),
            (
                |v| v["rope_scaling"] = json!({"rope_type": "dynamic", "factor": 2.0}),
                "\"dynamic\"",
            ),
        ];
        for (edit, want) in cases {
            let e = err(edit);
            assert!(e.contains(want), "{want}: {e}");
        }
    }
}
