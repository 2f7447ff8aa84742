//! The tiny checkpoints, read back with the `safetensors` crate and checked against a roster written
//! out here from docs/presets.md and docs/checkpoint-layout.md, independently of the crate's own tables.

use std::collections::BTreeMap;
use std::fs;
use std::path::Path;

use deltafin_makemodel::{make_model, make_padded_model, Arch, Preset};
use safetensors::{Dtype, SafeTensors};
use serde_json::Value;

/// name -> (dtype, shape)
type Roster = BTreeMap<String, (Dtype, Vec<usize>)>;

/// A tensor as found on disk.
struct Found {
    dtype: Dtype,
    shape: Vec<usize>,
    shard: String,
    offsets: (usize, usize),
    /// Position in the concatenation of all shards, in shard order.
    rank: usize,
    data: Vec<u8>,
}

const BF16: Dtype = Dtype::BF16;
const F32: Dtype = Dtype::F32;
const U8: Dtype = Dtype::U8;

fn add(r: &mut Roster, name: String, dtype: Dtype, shape: &[usize]) {
    assert!(r.insert(name, (dtype, shape.to_vec())).is_none());
}

/// Tiny kimi_k3: H 64, 7 layers, MLA at 1-based 4 and 7, KDA 2 × 32, MLA 2 heads, q/kv LoRA 32/32,
/// nope/rope/v 16/16/16, dense 128, 16 experts, moe 32, latent 32, 2 shared, vocab 768.
fn k3_tiny_roster() -> Roster {
    let mut r = Roster::new();
    let p = "language_model.model.";
    add(&mut r, format!("{p}embed_tokens.weight"), BF16, &[768, 64]);
    add(&mut r, format!("{p}norm.weight"), BF16, &[64]);
    add(
        &mut r,
        format!("{p}output_attn_res_norm.weight"),
        BF16,
        &[64],
    );
    add(
        &mut r,
        format!("{p}output_attn_res_proj.weight"),
        BF16,
        &[1, 64],
    );
    add(
        &mut r,
        "language_model.lm_head.weight".into(),
        BF16,
        &[768, 64],
    );
    for i in 0..7 {
        let l = format!("{p}layers.{i}.");
        for n in [
            "input_layernorm",
            "self_attention_res_norm",
            "post_attention_layernorm",
            "mlp_res_norm",
        ] {
            add(&mut r, format!("{l}{n}.weight"), BF16, &[64]);
        }
        add(
            &mut r,
            format!("{l}self_attention_res_proj.weight"),
            BF16,
            &[1, 64],
        );
        add(&mut r, format!("{l}mlp_res_proj.weight"), BF16, &[1, 64]);
        let a = format!("{l}self_attn.");
        if i == 3 || i == 6 {
            add(&mut r, format!("{a}q_a_proj.weight"), BF16, &[32, 64]);
            add(&mut r, format!("{a}q_a_layernorm.weight"), BF16, &[32]);
            add(&mut r, format!("{a}q_b_proj.weight"), BF16, &[64, 32]);
            add(
                &mut r,
                format!("{a}kv_a_proj_with_mqa.weight"),
                BF16,
                &[48, 64],
            );
            add(&mut r, format!("{a}kv_a_layernorm.weight"), BF16, &[32]);
            add(&mut r, format!("{a}kv_b_proj.weight"), BF16, &[64, 32]);
            add(&mut r, format!("{a}g_proj.weight"), BF16, &[32, 64]);
            add(&mut r, format!("{a}o_proj.weight"), BF16, &[64, 32]);
        } else {
            for x in ["q", "k", "v", "g"] {
                add(&mut r, format!("{a}{x}_proj.weight"), BF16, &[64, 64]);
            }
            for x in ["q", "k", "v"] {
                add(&mut r, format!("{a}{x}_conv1d.weight"), F32, &[64, 1, 4]);
            }
            add(&mut r, format!("{a}f_a_proj.weight"), BF16, &[32, 64]);
            add(&mut r, format!("{a}f_b_proj.weight"), BF16, &[64, 32]);
            add(&mut r, format!("{a}b_proj.weight"), BF16, &[2, 64]);
            add(&mut r, format!("{a}A_log"), F32, &[32]);
            add(&mut r, format!("{a}dt_bias"), F32, &[64]);
            add(&mut r, format!("{a}o_norm.weight"), F32, &[32]);
            add(&mut r, format!("{a}o_proj.weight"), BF16, &[64, 64]);
        }
        if i == 0 {
            add(&mut r, format!("{l}mlp.gate_proj.weight"), BF16, &[128, 64]);
            add(&mut r, format!("{l}mlp.up_proj.weight"), BF16, &[128, 64]);
            add(&mut r, format!("{l}mlp.down_proj.weight"), BF16, &[64, 128]);
            continue;
        }
        let m = format!("{l}block_sparse_moe.");
        add(&mut r, format!("{m}gate.weight"), BF16, &[16, 64]);
        add(
            &mut r,
            format!("{m}gate.e_score_correction_bias"),
            F32,
            &[16],
        );
        add(
            &mut r,
            format!("{m}routed_expert_down_proj.weight"),
            BF16,
            &[32, 64],
        );
        add(&mut r, format!("{m}routed_expert_norm.weight"), BF16, &[32]);
        add(
            &mut r,
            format!("{m}routed_expert_up_proj.weight"),
            BF16,
            &[64, 32],
        );
        add(
            &mut r,
            format!("{m}shared_experts.gate_proj.weight"),
            BF16,
            &[64, 64],
        );
        add(
            &mut r,
            format!("{m}shared_experts.up_proj.weight"),
            BF16,
            &[64, 64],
        );
        add(
            &mut r,
            format!("{m}shared_experts.down_proj.weight"),
            BF16,
            &[64, 64],
        );
        for e in 0..16 {
            for w in ["w1", "w2", "w3"] {
                // I = latent = 32: every packed matrix is [32, 16], every scale [32, 1].
                add(
                    &mut r,
                    format!("{m}experts.{e}.{w}.weight_packed"),
                    U8,
                    &[32, 16],
                );
                add(
                    &mut r,
                    format!("{m}experts.{e}.{w}.weight_scale"),
                    U8,
                    &[32, 1],
                );
            }
        }
    }
    r
}

/// Tiny kimi_linear: H 64, 5 layers, MLA at 1-based 4 and 5, KDA 2 × 32, MLA 2 heads, kv LoRA 32,
/// nope/rope/v 16/16/16, dense 128, 16 experts of width 32, 1 shared, vocab 768.
fn kimi_linear_tiny_roster() -> Roster {
    let mut r = Roster::new();
    add(&mut r, "model.embed_tokens.weight".into(), BF16, &[768, 64]);
    add(&mut r, "model.norm.weight".into(), BF16, &[64]);
    add(&mut r, "lm_head.weight".into(), BF16, &[768, 64]);
    for i in 0..5 {
        let l = format!("model.layers.{i}.");
        add(&mut r, format!("{l}input_layernorm.weight"), BF16, &[64]);
        add(
            &mut r,
            format!("{l}post_attention_layernorm.weight"),
            BF16,
            &[64],
        );
        let a = format!("{l}self_attn.");
        if i >= 3 {
            add(&mut r, format!("{a}q_proj.weight"), BF16, &[64, 64]);
            add(
                &mut r,
                format!("{a}kv_a_proj_with_mqa.weight"),
                BF16,
                &[48, 64],
            );
            add(&mut r, format!("{a}kv_a_layernorm.weight"), BF16, &[32]);
            add(&mut r, format!("{a}kv_b_proj.weight"), BF16, &[64, 32]);
            add(&mut r, format!("{a}o_proj.weight"), BF16, &[64, 32]);
        } else {
            for x in ["q", "k", "v"] {
                add(&mut r, format!("{a}{x}_proj.weight"), BF16, &[64, 64]);
                add(&mut r, format!("{a}{x}_conv1d.weight"), BF16, &[64, 1, 4]);
            }
            add(&mut r, format!("{a}f_a_proj.weight"), BF16, &[32, 64]);
            add(&mut r, format!("{a}f_b_proj.weight"), BF16, &[64, 32]);
            add(&mut r, format!("{a}dt_bias"), F32, &[64]);
            add(&mut r, format!("{a}A_log"), F32, &[1, 1, 2, 1]);
            add(&mut r, format!("{a}b_proj.weight"), BF16, &[2, 64]);
            add(&mut r, format!("{a}g_a_proj.weight"), BF16, &[32, 64]);
            add(&mut r, format!("{a}g_b_proj.weight"), BF16, &[64, 32]);
            add(&mut r, format!("{a}o_norm.weight"), BF16, &[32]);
            add(&mut r, format!("{a}o_proj.weight"), BF16, &[64, 64]);
        }
        if i == 0 {
            add(&mut r, format!("{l}mlp.gate_proj.weight"), BF16, &[128, 64]);
            add(&mut r, format!("{l}mlp.up_proj.weight"), BF16, &[128, 64]);
            add(&mut r, format!("{l}mlp.down_proj.weight"), BF16, &[64, 128]);
            continue;
        }
        let m = format!("{l}block_sparse_moe.");
        add(&mut r, format!("{m}gate.weight"), BF16, &[16, 64]);
        add(
            &mut r,
            format!("{m}gate.e_score_correction_bias"),
            F32,
            &[16],
        );
        add(
            &mut r,
            format!("{m}shared_experts.gate_proj.weight"),
            BF16,
            &[32, 64],
        );
        add(
            &mut r,
            format!("{m}shared_experts.up_proj.weight"),
            BF16,
            &[32, 64],
        );
        add(
            &mut r,
            format!("{m}shared_experts.down_proj.weight"),
            BF16,
            &[64, 32],
        );
        for e in 0..16 {
            add(&mut r, format!("{m}experts.{e}.w1.weight"), BF16, &[32, 64]);
            add(&mut r, format!("{m}experts.{e}.w2.weight"), BF16, &[64, 32]);
            add(&mut r, format!("{m}experts.{e}.w3.weight"), BF16, &[32, 64]);
        }
    }
    r
}

/// Reads every shard the index names, checking the index against the shards on the way.
fn read_checkpoint(dir: &Path, shards: usize) -> BTreeMap<String, Found> {
    let index: Value =
        serde_json::from_slice(&fs::read(dir.join("model.safetensors.index.json")).unwrap())
            .unwrap();
    let weight_map = index["weight_map"].as_object().unwrap();
    let mut files: Vec<&str> = weight_map.values().map(|v| v.as_str().unwrap()).collect();
    files.sort();
    files.dedup();
    let expected: Vec<String> = (1..=shards)
        .map(|i| format!("model-{i:05}-of-{shards:05}.safetensors"))
        .collect();
    assert_eq!(files, expected);

    let mut found = BTreeMap::new();
    let mut total = 0u64;
    for file in &expected {
        let bytes = fs::read(dir.join(file)).unwrap();
        let (_, meta) = SafeTensors::read_metadata(&bytes).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        for name in meta.offset_keys() {
            let info = meta.info(&name).unwrap();
            let view = st.tensor(&name).unwrap();
            assert_eq!(weight_map[&name], file.as_str(), "{name}");
            total += view.data().len() as u64;
            let rank = found.len();
            let t = Found {
                dtype: info.dtype,
                shape: info.shape.clone(),
                shard: file.clone(),
                offsets: info.data_offsets,
                rank,
                data: view.data().to_vec(),
            };
            assert!(found.insert(name, t).is_none());
        }
    }
    assert_eq!(found.len(), weight_map.len());
    assert_eq!(index["metadata"]["total_size"], total);
    found
}

fn assert_roster(found: &BTreeMap<String, Found>, roster: &Roster) {
    let missing: Vec<_> = roster.keys().filter(|n| !found.contains_key(*n)).collect();
    let extra: Vec<_> = found.keys().filter(|n| !roster.contains_key(*n)).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "missing {missing:?}, unexpected {extra:?}"
    );
    for (name, (dtype, shape)) in roster {
        assert_eq!(
            (&found[name].dtype, &found[name].shape),
            (dtype, shape),
            "{name}"
        );
    }
}

/// Each expert's tensors sit back to back in one shard in `parts` order, experts in id order, after
/// every spine tensor of their layer.
fn assert_experts_contiguous(
    found: &BTreeMap<String, Found>,
    moe_layers: &[String],
    experts: usize,
    parts: &[&str],
) {
    for layer in moe_layers {
        let last_spine = found
            .iter()
            .filter(|(n, _)| n.starts_with(layer.as_str()) && !n.contains(".experts."))
            .map(|(_, t)| t.rank)
            .max()
            .unwrap();
        let mut next_rank = last_spine + 1;
        for e in 0..experts {
            let first = &found[&format!("{layer}block_sparse_moe.experts.{e}.{}", parts[0])];
            let mut end = first.offsets.0;
            for part in parts {
                let t = &found[&format!("{layer}block_sparse_moe.experts.{e}.{part}")];
                assert_eq!(
                    (&t.shard, t.offsets.0, t.rank),
                    (&first.shard, end, next_rank),
                    "{layer} expert {e} {part}"
                );
                end = t.offsets.1;
                next_rank += 1;
            }
        }
    }
}

const K3_EXPERT_PARTS: [&str; 6] = [
    "w1.weight_packed",
    "w1.weight_scale",
    "w2.weight_packed",
    "w2.weight_scale",
    "w3.weight_packed",
    "w3.weight_scale",
];

fn all_files(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (
                e.file_name().to_string_lossy().into_owned(),
                fs::read(e.path()).unwrap(),
            )
        })
        .collect()
}

fn bf16_values(data: &[u8]) -> Vec<f32> {
    data.chunks_exact(2)
        .map(|b| f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16))
        .collect()
}

fn f32_values(data: &[u8]) -> Vec<f32> {
    data.chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

fn rms(xs: &[f32]) -> f32 {
    (xs.iter().map(|x| x * x).sum::<f32>() / xs.len() as f32).sqrt()
}

#[test]
fn kimi_k3_tiny_layout() {
    let dir = tempfile::tempdir().unwrap();
    let summary = make_model(Arch::KimiK3, Preset::Tiny, 1, dir.path()).unwrap();
    assert_eq!(summary.shards, 3);
    let found = read_checkpoint(dir.path(), 3);
    let roster = k3_tiny_roster();
    assert_roster(&found, &roster);
    assert_eq!(summary.tensors, roster.len());
    assert_eq!(
        summary.bytes,
        found.values().map(|t| t.data.len() as u64).sum::<u64>()
    );
    // 6 MoE layers × 16 experts × 3 × (512 + 32) bytes.
    assert_eq!(summary.expert_bytes, 6 * 16 * 3 * 544);
    let moe: Vec<String> = (1..7)
        .map(|i| format!("language_model.model.layers.{i}."))
        .collect();
    assert_experts_contiguous(&found, &moe, 16, &K3_EXPERT_PARTS);
    assert_eq!(found["language_model.model.embed_tokens.weight"].rank, 0);
    assert_eq!(found["language_model.lm_head.weight"].rank, found.len() - 1);
}

#[test]
fn kimi_linear_tiny_layout() {
    let dir = tempfile::tempdir().unwrap();
    let summary = make_model(Arch::KimiLinear, Preset::Tiny, 1, dir.path()).unwrap();
    assert_eq!(summary.shards, 3);
    let found = read_checkpoint(dir.path(), 3);
    assert_roster(&found, &kimi_linear_tiny_roster());
    assert_eq!(summary.expert_bytes, 4 * 16 * 3 * 32 * 64 * 2);
    let moe: Vec<String> = (1..5).map(|i| format!("model.layers.{i}.")).collect();
    assert_experts_contiguous(&found, &moe, 16, &["w1.weight", "w2.weight", "w3.weight"]);
}

#[test]
fn same_seed_same_bytes_other_seed_other_weights() {
    for arch in [Arch::KimiK3, Arch::KimiLinear] {
        let dirs: Vec<_> = (0..3).map(|_| tempfile::tempdir().unwrap()).collect();
        for (dir, seed) in dirs.iter().zip([5, 5, 6]) {
            make_model(arch, Preset::Tiny, seed, dir.path()).unwrap();
        }
        let [a, b, c] = [0, 1, 2].map(|i| all_files(dirs[i].path()));
        assert_eq!(a, b, "{arch:?}: same seed, same files");
        assert_eq!(a.keys().collect::<Vec<_>>(), c.keys().collect::<Vec<_>>());
        for (name, bytes) in &a {
            let differs = bytes != &c[name];
            assert_eq!(
                differs,
                name.ends_with(".safetensors"),
                "{arch:?} {name}: only the weights depend on the seed"
            );
        }
    }
}

#[test]
fn kimi_k3_tiny_config_and_tokenizer() {
    let dir = tempfile::tempdir().unwrap();
    make_model(Arch::KimiK3, Preset::Tiny, 0, dir.path()).unwrap();
    let config: Value =
        serde_json::from_slice(&fs::read(dir.path().join("config.json")).unwrap()).unwrap();
    assert_eq!(config["model_type"], "kimi_k3");
    // As released: converters (llama.cpp's) detect the model by it.
    assert_eq!(
        config["architectures"],
        serde_json::json!(["KimiK3ForConditionalGeneration"])
    );
    assert_eq!(config["dtype"], "bfloat16");
    assert_eq!(config["tie_word_embeddings"], false);
    assert_eq!(
        (
            config["bos_token_id"].clone(),
            config["eos_token_id"].clone()
        ),
        (512.into(), 514.into())
    );
    assert_eq!(config["pad_token_id"], 767);
    let q = &config["quantization_config"];
    assert_eq!(
        (q["quant_method"].as_str(), q["format"].as_str()),
        (Some("compressed-tensors"), Some("mxfp4-pack-quantized"))
    );
    assert_eq!(q["config_groups"]["group_0"]["weights"]["group_size"], 32);
    assert!(!q["ignore"].as_array().unwrap().is_empty());

    let t = &config["text_config"];
    let expected = serde_json::from_str::<Value>(
        r#"{
        "model_type": "kimi_linear", "hidden_size": 64, "num_hidden_layers": 7, "intermediate_size": 128,
        "moe_intermediate_size": 32, "routed_expert_hidden_size": 32, "num_experts": 16,
        "num_experts_per_token": 4, "num_shared_experts": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
        "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16,
        "vocab_size": 768, "attn_res_block_size": 2, "first_k_dense_replace": 1, "num_expert_group": 1,
        "topk_group": 1, "routed_scaling_factor": 1.0, "hidden_act": "situ", "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0, "moe_router_activation_func": "sigmoid", "topk_method": "noaux_tc",
        "moe_renormalize": true, "latent_moe_use_norm": true, "mla_use_nope": true, "mla_use_output_gate": true,
        "rms_norm_eps": 1e-5, "num_nextn_predict_layers": 0,
        "linear_attn_config": {"head_dim": 32, "num_heads": 2, "short_conv_kernel_size": 4,
            "use_full_rank_gate": true, "gate_lower_bound": -5.0, "kda_layers": [1, 2, 3, 5, 6],
            "full_attn_layers": [4, 7]}
    }"#,
    )
    .unwrap();
    for (key, value) in expected.as_object().unwrap() {
        assert_eq!(&t[key], value, "text_config.{key}");
    }
    assert!(t["max_position_embeddings"].as_u64().unwrap() > 0);

    for file in [
        "tiktoken.model",
        "tokenizer_config.json",
        "generation_config.json",
    ] {
        assert!(dir.path().join(file).is_file(), "{file}");
    }
    let tokenizer = deltafin_tokenizer::Tokenizer::from_dir(dir.path()).unwrap();
    assert_eq!((tokenizer.num_ranks(), tokenizer.vocab_size()), (512, 768));
    let end_of_msg = deltafin_tokenizer::k3_special_name(2);
    assert_eq!(
        tokenizer.special_id(&end_of_msg),
        Some(514),
        "eos_token_id is {end_of_msg}"
    );
    let generation: Value =
        serde_json::from_slice(&fs::read(dir.path().join("generation_config.json")).unwrap())
            .unwrap();
    assert_eq!(generation["eos_token_id"], 514);
}

#[test]
fn kimi_linear_tiny_config() {
    let dir = tempfile::tempdir().unwrap();
    make_model(Arch::KimiLinear, Preset::Tiny, 0, dir.path()).unwrap();
    let config: Value =
        serde_json::from_slice(&fs::read(dir.path().join("config.json")).unwrap()).unwrap();
    let expected = serde_json::from_str::<Value>(
        r#"{
        "architectures": ["KimiLinearForCausalLM"],
        "model_type": "kimi_linear", "vocab_size": 768, "hidden_size": 64, "intermediate_size": 128,
        "moe_intermediate_size": 32, "num_hidden_layers": 5, "num_attention_heads": 2, "num_key_value_heads": 2,
        "num_experts": 16, "num_experts_per_token": 4, "num_shared_experts": 1, "routed_scaling_factor": 2.446,
        "kv_lora_rank": 32, "q_lora_rank": null, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16,
        "v_head_dim": 16, "num_expert_group": 1, "topk_group": 1, "moe_renormalize": true, "hidden_act": "silu",
        "rms_norm_eps": 1e-5, "first_k_dense_replace": 1, "tie_word_embeddings": false,
        "linear_attn_config": {"head_dim": 32, "num_heads": 2, "short_conv_kernel_size": 4,
            "kda_layers": [1, 2, 3], "full_attn_layers": [4, 5]}
    }"#,
    )
    .unwrap();
    for (key, value) in expected.as_object().unwrap() {
        assert!(config.get(key).is_some(), "{key} missing");
        assert_eq!(&config[key], value, "{key}");
    }
    assert!(dir.path().join("tiktoken.model").is_file());
}

#[test]
fn kimi_k3_tiny_weight_scales() {
    let dir = tempfile::tempdir().unwrap();
    make_model(Arch::KimiK3, Preset::Tiny, 3, dir.path()).unwrap();
    let found = read_checkpoint(dir.path(), 3);
    let l = "language_model.model.layers.";

    let embed = bf16_values(&found["language_model.model.embed_tokens.weight"].data);
    assert!(
        (rms(&embed) - 1.0).abs() < 0.05,
        "embedding rms {}",
        rms(&embed)
    );
    let q = bf16_values(&found[&format!("{l}0.self_attn.q_proj.weight")].data);
    assert!(
        (rms(&q) * 8.0 - 1.0).abs() < 0.1,
        "q_proj rms {} vs 1/sqrt(64)",
        rms(&q)
    );
    let norm = bf16_values(&found[&format!("{l}0.input_layernorm.weight")].data);
    assert!(norm.iter().all(|w| (0.8..=1.2).contains(w)));

    let a_log = f32_values(&found[&format!("{l}0.self_attn.A_log")].data);
    assert!(
        a_log[..2]
            .iter()
            .all(|a| (0.0..16f32.ln()).contains(a) && *a != 0.0),
        "{a_log:?}"
    );
    assert!(a_log[2..].iter().all(|&a| a == 0.0), "padding is zero");
    let dt = f32_values(&found[&format!("{l}0.self_attn.dt_bias")].data);
    assert!(dt.iter().all(|d| (-3.0..0.0).contains(d)));

    // Dequantise one expert's w1 (E2M1 low nibble first; 32 inputs per row, so one scale 2^(s-127) per row).
    let e2m1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
    let packed = &found[&format!("{l}1.block_sparse_moe.experts.0.w1.weight_packed")].data;
    let scales = &found[&format!("{l}1.block_sparse_moe.experts.0.w1.weight_scale")].data;
    let mut seen = [false; 16];
    let mut w = Vec::new();
    for (row, bytes) in packed.chunks_exact(16).enumerate() {
        for &b in bytes {
            for nibble in [b & 15, b >> 4] {
                seen[nibble as usize] = true;
                let v = e2m1[(nibble & 7) as usize] * if nibble & 8 != 0 { -1.0 } else { 1.0 };
                w.push(v * 2f32.powi(scales[row] as i32 - 127));
            }
        }
    }
    assert!(seen.iter().all(|&s| s), "all 16 nibble values occur");
    let target = 1.0 / 32f32.sqrt();
    assert!(
        (0.5..2.0).contains(&(rms(&w) / target)),
        "expert rms {} vs {target}",
        rms(&w)
    );
}

#[test]
fn parse_errors_list_the_choices() {
    assert_eq!("kimi_k3".parse::<Arch>().unwrap(), Arch::KimiK3);
    assert_eq!("kimi_linear".parse::<Arch>().unwrap(), Arch::KimiLinear);
    assert_eq!("small".parse::<Preset>().unwrap(), Preset::Small);
    let arch = "k3".parse::<Arch>().unwrap_err().to_string();
    assert!(
        arch.contains("kimi_k3") && arch.contains("kimi_linear"),
        "{arch}"
    );
    let preset = "huge".parse::<Preset>().unwrap_err().to_string();
    assert!(
        preset.contains("tiny") && preset.contains("small"),
        "{preset}"
    );
}

#[test]
fn padding_rows_widen_the_vocabulary_past_the_tokenizer() {
    for (arch, embed, head) in [
        (
            Arch::KimiK3,
            "language_model.model.embed_tokens.weight",
            "language_model.lm_head.weight",
        ),
        (
            Arch::KimiLinear,
            "model.embed_tokens.weight",
            "lm_head.weight",
        ),
    ] {
        let (plain, padded) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        make_model(arch, Preset::Tiny, 0, plain.path()).unwrap();
        make_padded_model(arch, Preset::Tiny, 0, 100, padded.path()).unwrap();
        let config: Value =
            serde_json::from_slice(&fs::read(padded.path().join("config.json")).unwrap()).unwrap();
        let vocab = match arch {
            Arch::KimiK3 => &config["text_config"]["vocab_size"],
            _ => &config["vocab_size"],
        };
        assert_eq!(vocab, 868, "{arch:?}");
        let found = read_checkpoint(padded.path(), 3);
        for name in [embed, head] {
            assert_eq!(found[name].shape, [868, 64], "{arch:?} {name}");
        }
        // The tokenizer is the same: the 100 ids past it have no text.
        for file in ["tiktoken.model", "tokenizer_config.json"] {
            assert_eq!(
                fs::read(plain.path().join(file)).unwrap(),
                fs::read(padded.path().join(file)).unwrap(),
                "{arch:?} {file}"
            );
        }
        // No padding writes exactly the unpadded checkpoint.
        let zero = tempfile::tempdir().unwrap();
        make_padded_model(arch, Preset::Tiny, 0, 0, zero.path()).unwrap();
        assert_eq!(all_files(plain.path()), all_files(zero.path()), "{arch:?}");
    }
}
