//! DeepSeek-V3 / Kimi K2 checkpoints in the released layouts (docs/checkpoint-layout.md,
//! tests/fixtures/{deepseek_v3_tiny_fp8,kimi_k2_tiny_int4,deepseek_v3_tiny_bf16}): MLA with q LoRA, a dense
//! first layer, then a sigmoid router with `e_score_correction_bias`, one shared expert and routed experts
//! (`model.layers.L.mlp.experts.E.*`, one expert kept contiguous). Linears are FP8 e4m3 with 128×128 F32
//! `weight_scale_inv` blocks (DeepSeek-V3, Kimi K2), compressed-tensors INT4 `pack-quantized` routed experts
//! with a BF16 rest (Kimi K2 Thinking), or all BF16. The tokenizer is K3's tiktoken family, as K2 ships it;
//! a K2 checkpoint's specials carry K2's chat markup names, and it ships its chat template.

use std::str::FromStr;

use anyhow::{bail, Result};
use deltafin_formats::Dtype;
use serde_json::{json, Value};

use crate::fill::Init;
use crate::layout::{Layout, Spec};
use crate::{Arch, Preset};

/// How the linears are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Quant {
    Bf16,
    /// e4m3 weights, F32 `weight_scale_inv` per 128×128 block: every linear but the router and lm_head.
    Fp8,
    /// compressed-tensors INT4, group 32, symmetric: the routed experts; the rest BF16.
    Int4,
}

impl Quant {
    /// What each architecture was released as.
    pub fn default_for(arch: Arch) -> Quant {
        match arch {
            Arch::KimiK2 => Quant::Int4,
            _ => Quant::Fp8,
        }
    }
}

impl FromStr for Quant {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Quant> {
        match s {
            "bf16" => Ok(Quant::Bf16),
            "fp8" => Ok(Quant::Fp8),
            "int4" => Ok(Quant::Int4),
            _ => bail!("unknown quantization {s:?}: expected one of bf16, fp8, int4"),
        }
    }
}

/// FP8 block edge (`weight_block_size`) and INT4 group size.
const FP8_BLOCK: usize = 128;
const INT4_GROUP: usize = 32;
/// E[q²] of a uniformly drawn signed nibble (-8..=7): 344 / 16.
const INT4_MEAN_SQUARE: f32 = 21.5;
/// Layers before this one have a dense MLP (both releases: 3 for V3, 1 for K2; 1 keeps the presets small).
const FIRST_K_DENSE: usize = 1;

pub(crate) struct Dims {
    hidden: usize,
    layers: usize,
    heads: usize,
    q_lora: usize,
    kv_lora: usize,
    nope: usize,
    rope: usize,
    v: usize,
    /// Dense MLP width (layers before FIRST_K_DENSE).
    intermediate: usize,
    moe_intermediate: usize,
    experts: usize,
    experts_per_token: usize,
    shared_experts: usize,
    n_group: usize,
    topk_group: usize,
    /// Tokenizer ranks; the vocabulary adds K3's 256 specials.
    pub(crate) n_ranks: usize,
}

pub(crate) fn dims(arch: Arch, preset: Preset) -> Result<Dims> {
    // K2 routes over one group; V3 over 8 groups, keeping 4 (tiny: 4 keeping 2, as the fixture).
    let groups = |v3: (usize, usize)| if arch == Arch::KimiK2 { (1, 1) } else { v3 };
    Ok(match preset {
        // The fixtures' shape (tests/fixtures/deepseek_v3_tiny_fp8): partial FP8 blocks at 144, 160 and 192.
        Preset::Tiny => {
            let (n_group, topk_group) = groups((4, 2));
            Dims {
                hidden: 64,
                layers: 3,
                heads: 4,
                q_lora: 96,
                kv_lora: 144,
                nope: 16,
                rope: 16,
                v: 16,
                intermediate: 192,
                moe_intermediate: 32,
                experts: 16,
                experts_per_token: 4,
                shared_experts: 1,
                n_group,
                topk_group,
                n_ranks: 256,
            }
        }
        Preset::Small => {
            let (n_group, topk_group) = groups((8, 4));
            Dims {
                hidden: 512,
                layers: 8,
                heads: 4,
                q_lora: 256,
                kv_lora: 256,
                nope: 64,
                rope: 32,
                v: 64,
                intermediate: 1024,
                moe_intermediate: 256,
                experts: 64,
                experts_per_token: 6,
                shared_experts: 1,
                n_group,
                topk_group,
                n_ranks: 4096,
            }
        }
        // I/O-shaped: the released expert shapes (7168 → 2048 → 7168; one record is 44.05 MB in FP8, 24.77 MB
        // in INT4), top-8 of 40 experts in 4 MoE layers, a narrow attention and dense MLP.
        Preset::Bench => {
            let (n_group, topk_group) = groups((8, 4));
            Dims {
                hidden: 7168,
                layers: 5,
                heads: 2,
                q_lora: 64,
                kv_lora: 64,
                nope: 32,
                rope: 32,
                v: 32,
                intermediate: 2048,
                moe_intermediate: 2048,
                experts: 40,
                experts_per_token: 8,
                shared_experts: 1,
                n_group,
                topk_group,
                n_ranks: 4096,
            }
        }
        Preset::Wide => bail!("the wide preset exists for kimi_k3 only"),
    })
}

/// bos and eos of config.json: K2's `[BOS]` and `[EOS]`, the first two specials after the ranks.
pub(crate) fn special_ids(d: &Dims) -> [(&'static str, usize); 2] {
    [("bos_token_id", d.n_ranks), ("eos_token_id", d.n_ranks + 1)]
}

/// bos and eos of generation_config.json: Kimi K2's generation ends its turn at `<|im_end|>` (the third
/// special), as its release's does; DeepSeek-V3's at `[EOS]`.
pub(crate) fn generation_ids(arch: Arch, d: &Dims) -> [(&'static str, usize); 2] {
    let [bos, (eos, id)] = special_ids(d);
    [bos, (eos, if arch == Arch::KimiK2 { id + 1 } else { id })]
}

/// The names of the specials: Kimi K2's chat markup where its tokenizer_config.json has it, K3's names
/// elsewhere (DeepSeek-V3's own tokenizer is not modelled: its checkpoints chat through a template the
/// caller gives).
pub(crate) fn special_name(arch: Arch) -> fn(u32) -> String {
    match arch {
        Arch::KimiK2 => k2_special_name,
        _ => deltafin_tokenizer::k3_special_name,
    }
}

fn k2_special_name(k: u32) -> String {
    let name = match k {
        2 => "<|im_end|>",
        3 => "<|im_user|>",
        4 => "<|im_assistant|>",
        6 => "<|start_header_id|>",
        7 => "<|end_header_id|>",
        10 => "<|im_system|>",
        11 => "<|tool_calls_section_begin|>",
        12 => "<|tool_calls_section_end|>",
        13 => "<|tool_call_begin|>",
        14 => "<|tool_call_argument_begin|>",
        15 => "<|tool_call_end|>",
        17 => "<|im_middle|>",
        _ => return deltafin_tokenizer::k3_special_name(k),
    };
    name.into()
}

/// Kimi K2's chat format as a Jinja template (written as chat_template.jinja): an optional tool
/// declaration, a default system turn when the conversation opens without one, then every turn as
/// `<|im_ROLE|>ROLE<|im_middle|>TEXT<|im_end|>` (a tool's result in a system turn named `tool`).
pub(crate) const K2_CHAT_TEMPLATE: &str = include_str!("kimi_k2_chat_template.jinja");

fn quantization_config(quant: Quant) -> Option<Value> {
    match quant {
        Quant::Bf16 => None,
        Quant::Fp8 => Some(json!({
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
        })),
        Quant::Int4 => Some(json!({
            "config_groups": {"group_0": {
                "input_activations": null,
                "output_activations": null,
                "targets": ["Linear"],
                "weights": {
                    "actorder": null, "block_structure": null, "dynamic": false,
                    "group_size": INT4_GROUP, "num_bits": 4, "observer": "minmax",
                    "observer_kwargs": {}, "strategy": "group", "symmetric": true, "type": "int",
                },
            }},
            "format": "pack-quantized",
            "ignore": [
                "lm_head",
                "re:.*self_attn.*",
                "re:.*shared_experts.*",
                "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
            ],
            "kv_cache_scheme": null,
            "quant_method": "compressed-tensors",
            "quantization_status": "compressed",
        })),
    }
}

/// The released config.json form, with each release's RoPE, routing and length constants.
pub(crate) fn config(arch: Arch, d: &Dims, quant: Quant) -> Value {
    let k2 = arch == Arch::KimiK2;
    let mut c = json!({
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": if k2 { "kimi_k2" } else { "deepseek_v3" },
        "vocab_size": d.n_ranks + deltafin_tokenizer::K3_NUM_SPECIALS as usize,
        "hidden_size": d.hidden,
        "intermediate_size": d.intermediate,
        "moe_intermediate_size": d.moe_intermediate,
        "num_hidden_layers": d.layers,
        "num_nextn_predict_layers": 0,
        "num_attention_heads": d.heads,
        "num_key_value_heads": d.heads,
        "n_shared_experts": d.shared_experts,
        "n_routed_experts": d.experts,
        "ep_size": 1,
        "routed_scaling_factor": if k2 { 2.827 } else { 2.5 },
        "kv_lora_rank": d.kv_lora,
        "q_lora_rank": d.q_lora,
        "qk_rope_head_dim": d.rope,
        "v_head_dim": d.v,
        "qk_nope_head_dim": d.nope,
        "topk_method": "noaux_tc",
        "n_group": d.n_group,
        "topk_group": d.topk_group,
        "num_experts_per_tok": d.experts_per_token,
        "moe_layer_freq": 1,
        "first_k_dense_replace": FIRST_K_DENSE,
        "norm_topk_prob": true,
        "scoring_func": "sigmoid",
        "hidden_act": "silu",
        "max_position_embeddings": if k2 { 262_144 } else { 163_840 },
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-6,
        // Spelled as each release spells them (integers in V3's, floats in K2's).
        "rope_theta": if k2 { json!(50_000.0) } else { json!(10_000) },
        "rope_scaling": if k2 {
            json!({"beta_fast": 1.0, "beta_slow": 1.0, "factor": 64.0})
        } else {
            json!({"beta_fast": 32, "beta_slow": 1, "factor": 40})
        },
        "attention_bias": false,
        "attention_dropout": 0.0,
        "tie_word_embeddings": false,
        "use_cache": true,
        "torch_dtype": "bfloat16",
    });
    for (key, value) in [
        ("mscale", json!(1.0)),
        ("mscale_all_dim", json!(1.0)),
        ("original_max_position_embeddings", json!(4096)),
        ("type", json!("yarn")),
    ] {
        c["rope_scaling"][key] = value;
    }
    for (key, id) in special_ids(d) {
        c[key] = json!(id);
    }
    if let Some(q) = quantization_config(quant) {
        c["quantization_config"] = q;
    }
    c
}

fn spec(name: String, dtype: Dtype, shape: &[usize], init: Init) -> Spec {
    Spec {
        name,
        dtype,
        shape: shape.to_vec(),
        init,
    }
}

/// `[out, inp]` linear `p` (without `.weight`) stored as `quant`; std about gain/sqrt(inp) once decoded.
fn linear(p: &str, out: usize, inp: usize, quant: Quant) -> Vec<Spec> {
    match quant {
        Quant::Bf16 => vec![spec(
            format!("{p}.weight"),
            Dtype::Bf16,
            &[out, inp],
            Init::Normal(1.0 / (inp as f32).sqrt()),
        )],
        Quant::Fp8 => vec![
            spec(
                format!("{p}.weight"),
                Dtype::F8E4M3,
                &[out, inp],
                Init::E4m3,
            ),
            spec(
                format!("{p}.weight_scale_inv"),
                Dtype::F32,
                &[out.div_ceil(FP8_BLOCK), inp.div_ceil(FP8_BLOCK)],
                Init::Fp8BlockScale { fan_in: inp },
            ),
        ],
        // Eight nibbles a word, every nibble (q + 8) a valid value; positive BF16 scales per group of 32.
        Quant::Int4 => {
            let unit = 1.0 / (INT4_MEAN_SQUARE * inp as f32).sqrt();
            vec![
                spec(
                    format!("{p}.weight_packed"),
                    Dtype::I32,
                    &[out, inp / 8],
                    Init::RandomBytes,
                ),
                spec(
                    format!("{p}.weight_scale"),
                    Dtype::Bf16,
                    &[out, inp / INT4_GROUP],
                    Init::Uniform(0.75 * unit, 1.25 * unit),
                ),
                spec(
                    format!("{p}.weight_shape"),
                    Dtype::I64,
                    &[2],
                    Init::Shape([out as u64, inp as u64]),
                ),
            ]
        }
    }
}

/// gate, up and down of a SwiGLU MLP of width `w`.
fn mlp(p: &str, h: usize, w: usize, quant: Quant) -> Vec<Spec> {
    let mut specs = linear(&format!("{p}gate_proj"), w, h, quant);
    specs.extend(linear(&format!("{p}up_proj"), w, h, quant));
    specs.extend(linear(&format!("{p}down_proj"), h, w, quant));
    specs
}

pub(crate) fn layout(d: &Dims, quant: Quant) -> Layout {
    let h = d.hidden;
    let vocab = d.n_ranks + deltafin_tokenizer::K3_NUM_SPECIALS as usize;
    // INT4 covers the routed experts alone; everything else of that release is BF16.
    let spine = if quant == Quant::Int4 {
        Quant::Bf16
    } else {
        quant
    };
    let norm = |name: String, len| spec(name, Dtype::Bf16, &[len], Init::Uniform(0.8, 1.2));
    let mut l = Layout::default();
    l.groups.push(vec![spec(
        "model.embed_tokens.weight".into(),
        Dtype::Bf16,
        &[vocab, h],
        Init::Normal(1.0),
    )]);
    for i in 0..d.layers {
        let n = format!("model.layers.{i}.");
        let a = format!("{n}self_attn.");
        let mut specs = vec![norm(format!("{n}input_layernorm.weight"), h)];
        specs.extend(linear(&format!("{a}q_a_proj"), d.q_lora, h, spine));
        specs.push(norm(format!("{a}q_a_layernorm.weight"), d.q_lora));
        let q = d.heads * (d.nope + d.rope);
        specs.extend(linear(&format!("{a}q_b_proj"), q, d.q_lora, spine));
        let kv_a = d.kv_lora + d.rope;
        specs.extend(linear(&format!("{a}kv_a_proj_with_mqa"), kv_a, h, spine));
        specs.push(norm(format!("{a}kv_a_layernorm.weight"), d.kv_lora));
        let kv_b = d.heads * (d.nope + d.v);
        specs.extend(linear(&format!("{a}kv_b_proj"), kv_b, d.kv_lora, spine));
        specs.extend(linear(&format!("{a}o_proj"), h, d.heads * d.v, spine));
        specs.push(norm(format!("{n}post_attention_layernorm.weight"), h));
        let m = format!("{n}mlp.");
        if i < FIRST_K_DENSE {
            specs.extend(mlp(&m, h, d.intermediate, spine));
            l.groups.extend(specs.into_iter().map(|s| vec![s]));
            continue;
        }
        // Router weights twice the usual scale and a small selection bias: decisive, token-dependent routing.
        specs.push(spec(
            format!("{m}gate.weight"),
            Dtype::Bf16,
            &[d.experts, h],
            Init::Normal(2.0 / (h as f32).sqrt()),
        ));
        specs.push(spec(
            format!("{m}gate.e_score_correction_bias"),
            Dtype::F32,
            &[d.experts],
            Init::Normal(0.05),
        ));
        let shared = d.moe_intermediate * d.shared_experts;
        specs.extend(mlp(&format!("{m}shared_experts."), h, shared, spine));
        l.groups.extend(specs.into_iter().map(|s| vec![s]));
        for e in 0..d.experts {
            let p = format!("{m}experts.{e}.");
            l.groups.push(mlp(&p, h, d.moe_intermediate, quant));
        }
    }
    l.groups.push(vec![norm("model.norm.weight".into(), h)]);
    l.groups.push(vec![spec(
        "lm_head.weight".into(),
        Dtype::Bf16,
        &[vocab, h],
        Init::Normal(1.0 / (h as f32).sqrt()),
    )]);
    l
}

#[cfg(test)]
mod tests {
    use super::*;
    use deltafin_formats::config::ModelConfig;
    use deltafin_formats::writer::TensorSpec;

    fn bytes(specs: &[Spec]) -> usize {
        specs
            .iter()
            .map(|s| TensorSpec::new(s.name.clone(), s.dtype, &s.shape).nbytes())
            .sum()
    }

    /// Every preset's config parses as the family the engine runs, with the sizes written.
    #[test]
    fn every_preset_parses_as_the_engine_reads_it() {
        for arch in [Arch::DeepseekV3, Arch::KimiK2] {
            for preset in [Preset::Tiny, Preset::Small, Preset::Bench] {
                for quant in [Quant::Bf16, Quant::Fp8, Quant::Int4] {
                    let d = dims(arch, preset).unwrap();
                    let c = ModelConfig::from_json(&config(arch, &d, quant))
                        .unwrap_or_else(|e| panic!("{arch:?} {preset:?} {quant:?}: {e:#}"));
                    let got = (c.hidden, c.num_layers, c.moe.num_experts, c.moe.top_k);
                    let want = (d.hidden, d.layers, d.experts, d.experts_per_token);
                    assert_eq!(got, want, "{arch:?} {preset:?} {quant:?}");
                    assert_eq!((c.moe.groups, c.moe.topk_group), (d.n_group, d.topk_group));
                }
            }
        }
    }

    /// The bench preset's expert records are the released ones: 7168 → 2048 → 7168 in FP8 (e4m3 and
    /// 16 × 56 F32 block scales per matrix) and INT4 (packed words, BF16 group scales, the shape).
    #[test]
    fn bench_records_have_the_released_sizes() {
        let d = dims(Arch::DeepseekV3, Preset::Bench).unwrap();
        let m = 2048 * 7168;
        for (quant, want) in [
            (Quant::Fp8, 3 * (m + 16 * 56 * 4)),
            (Quant::Int4, 3 * (m / 2 + m / 32 * 2 + 16)),
        ] {
            let l = layout(&d, quant);
            let record = l
                .groups
                .iter()
                .find(|g| g[0].name.contains(".experts.0."))
                .unwrap();
            assert_eq!(bytes(record), want, "{quant:?}");
        }
    }
}
