//! DeepSeek-V3 and Kimi K2 (`model_type` "deepseek_v3" / "kimi_k2", `DeepseekV3ForCausalLM`): every layer MLA
//! with q LoRA and interleaved (YaRN) RoPE, the grouped noaux_tc router, shared experts, BF16 or the released
//! FP8 (block 128×128) or compressed-tensors INT4 (routed experts, group 32) weights.

use super::*;

pub(super) fn parse(root: &Map<String, Value>) -> Result<ModelConfig> {
    if let Some(a) = root.get("architectures") {
        let ok = a
            .as_array()
            .is_some_and(|a| a.iter().any(|v| v == "DeepseekV3ForCausalLM"));
        if !ok {
            bail!("field `architectures` is {a}; a deepseek_v3/kimi_k2 checkpoint must list \"DeepseekV3ForCausalLM\"");
        }
    }
    expect_str(root, "hidden_act", "silu")?;
    expect_str(root, "topk_method", "noaux_tc")?;
    expect_str(root, "scoring_func", "sigmoid")?;
    expect_f64(root, "moe_layer_freq", 1.0)?;
    expect_bool(root, "attention_bias", false)?;
    expect_bool(root, "rope_interleave", true)?;
    expect_bool(root, "tie_word_embeddings", false)?;
    // `num_nextn_predict_layers`: DeepSeek-V3 ships an MTP layer after the last; like transformers, deltafin
    // never reads it (the description names layers below `num_hidden_layers` only).
    let num_layers = bounded(root, "num_hidden_layers", MAX_LAYERS)?;
    let heads = dim_field(root, "num_attention_heads")?;
    if let Some(kv) = opt_usize(root, "num_key_value_heads")? {
        if kv != heads {
            bail!("field `num_key_value_heads` is {kv} but `num_attention_heads` is {heads}; MLA needs them equal");
        }
    }
    let num_experts = bounded(root, "n_routed_experts", MAX_EXPERTS)?;
    let groups = bounded(root, "n_group", MAX_EXPERTS)?;
    let topk_group = bounded(root, "topk_group", MAX_EXPERTS)?;
    if groups == 0 || !num_experts.is_multiple_of(groups) {
        bail!("field `n_group` is {groups}; it must divide `n_routed_experts` ({num_experts})");
    }
    if topk_group == 0 || topk_group > groups {
        bail!("field `topk_group` is {topk_group}; it must be in 1..={groups} (`n_group`)");
    }
    let moe_intermediate = dim_field(root, "moe_intermediate_size")?;
    let rms_norm_eps = f32_field(root, "rms_norm_eps")?;
    let rope_dim = dim_field(root, "qk_rope_head_dim")?;
    if !rope_dim.is_multiple_of(2) {
        bail!("field `qk_rope_head_dim` is {rope_dim}; RoPE rotates pairs, so it must be even");
    }
    let cfg = ModelConfig {
        family: Family::DeepseekV3,
        hidden: dim_field(root, "hidden_size")?,
        num_layers,
        vocab_size: bounded(root, "vocab_size", MAX_VOCAB)?,
        rms_norm_eps,
        dense: first_k_dense(usize_field(root, "first_k_dense_replace")?, num_layers)?,
        dense_intermediate: dim_field(root, "intermediate_size")?,
        is_mla: vec![true; num_layers],
        kda: KdaConfig::default(),
        mla: MlaConfig {
            heads,
            q_lora_rank: opt_bounded(root, "q_lora_rank", MAX_DIM)?,
            kv_lora_rank: dim_field(root, "kv_lora_rank")?,
            qk_nope_head_dim: dim_field(root, "qk_nope_head_dim")?,
            qk_rope_head_dim: rope_dim,
            v_head_dim: dim_field(root, "v_head_dim")?,
            latent_norm_eps: rms_norm_eps,
        },
        moe: MoeConfig {
            num_experts,
            top_k: usize_field(root, "num_experts_per_tok")?,
            intermediate: moe_intermediate,
            latent: None,
            shared_width: bounded(root, "n_shared_experts", MAX_EXPERTS)? * moe_intermediate,
            routed_scaling_factor: f32_field(root, "routed_scaling_factor")?,
            renormalize: bool_field(root, "norm_topk_prob")?,
            groups,
            topk_group,
        },
        attn_res_block: None,
        rope: Some(rope::parse(root)?),
        quant: quant(root)?,
        bos_token_id: opt_u32(root, "bos_token_id")?,
        eos_token_id: opt_u32(root, "eos_token_id")?,
        gqa: None,
        swiglu_limit: None,
        tied_embeddings: false,
    };
    validate(&cfg)?;
    if cfg.moe.top_k > (num_experts / groups) * topk_group {
        bail!(
            "field `num_experts_per_tok` is {}, more than the {} experts of `topk_group` groups",
            cfg.moe.top_k,
            (num_experts / groups) * topk_group
        );
    }
    Ok(cfg)
}

/// `quantization_config`: absent (BF16), the released FP8, or K2 Thinking's compressed-tensors INT4 experts.
fn quant(root: &Map<String, Value>) -> Result<Quant> {
    let Some(q) = root.get("quantization_config").filter(|v| !v.is_null()) else {
        return Ok(Quant::None);
    };
    let q = q
        .as_object()
        .context("field `quantization_config` must be an object")?;
    match str_field(q, "quant_method")? {
        "fp8" => {
            expect_str(q, "fmt", "e4m3")?;
            expect_str(q, "activation_scheme", "dynamic")?;
            let block = q.get("weight_block_size");
            if block != Some(&serde_json::json!([128, 128])) {
                bail!("field `quantization_config.weight_block_size` is {}; deltafin implements [128, 128]", block.unwrap_or(&Value::Null));
            }
            Ok(Quant::Fp8Block)
        }
        "compressed-tensors" => {
            let format = str_field(q, "format")?;
            if format != "pack-quantized" {
                bail!("field `quantization_config.format` is {format:?}; deltafin implements \"pack-quantized\"");
            }
            let groups = obj_field(q, "config_groups")?;
            if groups.len() != 1 {
                bail!("field `quantization_config.config_groups` has {} groups; deltafin implements one (the routed experts)", groups.len());
            }
            let g = groups.values().next().and_then(Value::as_object).context(
                "field `quantization_config.config_groups.*` must be an object",
            )?;
            for f in ["input_activations", "output_activations"] {
                if g.get(f).is_some_and(|v| !v.is_null()) {
                    bail!("field `quantization_config.config_groups.*.{f}` is set; deltafin implements weight-only quantization");
                }
            }
            let w = obj_field(g, "weights")?;
            expect_str(w, "type", "int")?;
            expect_str(w, "strategy", "group")?;
            expect_bool(w, "symmetric", true)?;
            expect_bool(w, "dynamic", false)?;
            for (f, want) in [("num_bits", 4), ("group_size", 32)] {
                let v = usize_field(w, f)?;
                if v != want {
                    bail!("field `quantization_config.config_groups.*.weights.{f}` is {v}; deltafin implements {want}");
                }
            }
            if w.get("actorder").is_some_and(|v| !v.is_null()) {
                bail!("field `quantization_config.config_groups.*.weights.actorder` is set; deltafin implements none");
            }
            Ok(Quant::Int4Experts)
        }
        other => bail!("field `quantization_config.quant_method` is {other:?}; deltafin implements \"fp8\" and \"compressed-tensors\""),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(name: &str) -> Value {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures")
            .join(name)
            .join("config.json");
        serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
    }

    #[test]
    fn parses_the_released_configs() {
        let v3 = ModelConfig::from_json(&fixture("deepseek_v3_tiny_bf16")).unwrap();
        assert_eq!(v3.family, Family::DeepseekV3);
        assert_eq!((v3.moe.groups, v3.moe.topk_group, v3.moe.top_k), (4, 2, 4));
        assert_eq!((v3.moe.num_experts, v3.moe.shared_width), (16, 32));
        assert_eq!(v3.moe.routed_scaling_factor, 2.5);
        assert_eq!(v3.dense, [true, false, false]);
        assert_eq!(v3.mla.q_lora_rank, Some(96));
        assert_eq!(v3.quant, Quant::None);
        let y = v3.rope.unwrap().yarn.unwrap();
        assert_eq!(
            (y.factor, y.beta_fast, y.original_max_position, y.truncate),
            (40.0, 32.0, 4096, true)
        );
        let fp8 = ModelConfig::from_json(&fixture("deepseek_v3_tiny_fp8")).unwrap();
        assert_eq!(fp8.quant, Quant::Fp8Block);
        let k2 = ModelConfig::from_json(&fixture("kimi_k2_tiny_int4")).unwrap();
        assert_eq!(
            (k2.quant, k2.moe.groups, k2.eos_token_id),
            (Quant::Int4Experts, 1, Some(257))
        );
    }

    fn err(mut v: Value, edit: impl FnOnce(&mut Value)) -> String {
        edit(&mut v);
        format!("{:#}", ModelConfig::from_json(&v).unwrap_err())
    }

    #[test]
    fn unsupported_values_are_refused_by_name() {
        let v3 = fixture("deepseek_v3_tiny_fp8");
        let k2 = fixture("kimi_k2_tiny_int4");
        for (v, edit, want) in [
            (
                &v3,
                ("n_group", serde_json::json!(3)),
                "field `n_group` is 3",
            ),
            (
                &v3,
                ("topk_group", serde_json::json!(5)),
                "field `topk_group` is 5",
            ),
            (
                &v3,
                ("scoring_func", serde_json::json!("softmax")),
                "field `scoring_func`",
            ),
            (
                &v3,
                ("topk_method", serde_json::json!("greedy")),
                "field `topk_method`",
            ),
            (
                &v3,
                ("architectures", serde_json::json!(["LlamaForCausalLM"])),
                "field `architectures`",
            ),
        ] {
            let e = err(v.clone(), |v| v[edit.0] = edit.1);
            assert!(e.contains(want), "{e}");
        }
        let e = err(v3.clone(), |v| v["rope_scaling"]["type"] = "linear".into());
        assert!(e.contains("`rope_scaling.type` is \"linear\""), "{e}");
        let e = err(v3.clone(), |v| {
            v["quantization_config"]["weight_block_size"] = serde_json::json!([64, 64])
        });
        assert!(e.contains("weight_block_size"), "{e}");
        let e = err(v3.clone(), |v| {
            v["quantization_config"]["quant_method"] = "gptq".into()
        });
        assert!(
            e.contains("`quantization_config.quant_method` is \"gptq\""),
            "{e}"
        );
        let e = err(k2.clone(), |v| {
            v["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] = 8.into()
        });
        assert!(e.contains("weights.num_bits` is 8"), "{e}");
        let e = err(k2, |v| {
            v["quantization_config"]["config_groups"]["group_0"]["weights"]["symmetric"] =
                false.into()
        });
        assert!(e.contains("`symmetric` is false"), "{e}");
    }
}
