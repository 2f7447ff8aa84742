//! gpt-oss checkpoints in the released layout (docs/checkpoint-layout.md, tests/fixtures/gpt_oss_tiny_mxfp4):
//! BF16 spine with q/k/v/o biases and sinks, a biased router, each layer's experts stacked in six tensors
//! (`gate_up_proj`/`down_proj` as MXFP4 `*_blocks` + E8M0 `*_scales`, BF16 `*_bias`), and the o200k_harmony
//! tokenizer as gpt-oss ships it (`tokenizer.json`, vocab 201088).

use crate::fill::Init;
use crate::layout::{Layout, Spec};
use crate::Preset;
use anyhow::{bail, Context, Result};
use base64::engine::general_purpose::STANDARD as BASE64;
use base64::Engine;
use deltafin_formats::Dtype;
use serde_json::{json, Value};
use std::path::Path;

/// o200k_harmony's ranks and the converter's `tokenizer.json` without its vocabulary (tests/fixtures/o200k_harmony).
const RANKS: &str = include_str!("../../../tests/fixtures/o200k_harmony/o200k_base.tiktoken");
const TOKENIZER_LAYOUT: &str =
    include_str!("../../../tests/fixtures/o200k_harmony/tokenizer_layout.json");
const TOKENIZER_CONFIG: &str =
    include_str!("../../../tests/fixtures/o200k_harmony/tokenizer_config.json");
/// bos `<|startoftext|>`, eos `<|return|>` `<|endoftext|>` `<|call|>`, pad `<|endoftext|>`, as released.
const GENERATION_CONFIG: &str =
    include_str!("../../../tests/fixtures/o200k_harmony/generation_config.json");
const VOCAB: usize = 201_088;

pub(crate) struct Dims {
    hidden: usize,
    layers: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    experts: usize,
    experts_per_token: usize,
    intermediate: usize,
    window: usize,
}

pub(crate) fn dims(preset: Preset) -> Result<Dims> {
    Ok(match preset {
        // The fixture's shape, with the released vocabulary.
        Preset::Tiny => Dims {
            hidden: 64,
            layers: 4,
            heads: 4,
            kv_heads: 2,
            head_dim: 32,
            experts: 16,
            experts_per_token: 4,
            intermediate: 64,
            window: 6,
        },
        Preset::Small => Dims {
            hidden: 256,
            layers: 8,
            heads: 8,
            kv_heads: 2,
            head_dim: 64,
            experts: 32,
            experts_per_token: 4,
            intermediate: 256,
            window: 128,
        },
        // I/O-shaped: gpt-oss-120b's 36 layers, attention and expert shapes (2880 → 2 × 2880 → 2880, one
        // layer-expert's blocks, scales and biases are 13.24 MB), so a token reads the released 144 records
        // (1.91 GB) against the released spine (1.92 GB of attention, a 1.16 GB lm_head). Only the experts a
        // layer are fewer (10 of 128, top-4 as released): 9.0 GB on disk. 10 rather than 8 so that a guessed
        // lookahead is right 40% of the time, under the 50% at which the engine keeps prefetching, as with 128.
        Preset::Bench => Dims {
            hidden: 2880,
            layers: 36,
            heads: 64,
            kv_heads: 8,
            head_dim: 64,
            experts: 10,
            experts_per_token: 4,
            intermediate: 2880,
            window: 128,
        },
        Preset::Wide => bail!("the wide preset exists for kimi_k3 only"),
    })
}

/// The released config's form (gpt-oss-120b's RoPE, router and SwiGLU constants).
pub(crate) fn config(d: &Dims) -> Value {
    let types: Vec<&str> = (0..d.layers)
        .map(|l| {
            if l % 2 == 0 {
                "sliding_attention"
            } else {
                "full_attention"
            }
        })
        .collect();
    json!({
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "attention_bias": true,
        "attention_dropout": 0.0,
        "bos_token_id": 199998,
        "eos_token_id": 200002,
        "pad_token_id": 199999,
        "experts_per_token": d.experts_per_token,
        "num_experts_per_tok": d.experts_per_token,
        "head_dim": d.head_dim,
        "hidden_act": "silu",
        "hidden_size": d.hidden,
        "initial_context_length": 4096,
        "intermediate_size": d.intermediate,
        "layer_types": types,
        "max_position_embeddings": 131072,
        "num_attention_heads": d.heads,
        "num_hidden_layers": d.layers,
        "num_key_value_heads": d.kv_heads,
        "num_local_experts": d.experts,
        "quantization_config": {
            "modules_to_not_convert": [
                "model.layers.*.self_attn",
                "model.layers.*.mlp.router",
                "model.embed_tokens",
                "lm_head"
            ],
            "quant_method": "mxfp4"
        },
        "rms_norm_eps": 1e-5,
        "rope_scaling": {
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "rope_type": "yarn",
            "truncate": false
        },
        "rope_theta": 150000,
        "sliding_window": d.window,
        "swiglu_limit": 7.0,
        "tie_word_embeddings": false,
        "torch_dtype": "bfloat16",
        "vocab_size": VOCAB,
    })
}

fn spec(name: String, dtype: Dtype, shape: &[usize], init: Init) -> Spec {
    Spec {
        name,
        dtype,
        shape: shape.to_vec(),
        init,
    }
}

/// BF16 `[out, in]` with std 1/sqrt(in), and its bias.
fn affine(a: &str, p: &str, out: usize, inp: usize) -> [Spec; 2] {
    [
        spec(
            format!("{a}{p}.weight"),
            Dtype::Bf16,
            &[out, inp],
            Init::Normal(1.0 / (inp as f32).sqrt()),
        ),
        spec(
            format!("{a}{p}.bias"),
            Dtype::Bf16,
            &[out],
            Init::Normal(0.02),
        ),
    ]
}

/// MXFP4 `[experts, rows, cols]` as blocks, scales and a BF16 bias per row.
fn experts(e: &str, p: &str, n: usize, rows: usize, cols: usize) -> [Spec; 3] {
    [
        spec(
            format!("{e}{p}_blocks"),
            Dtype::U8,
            &[n, rows, cols / 32, 16],
            Init::RandomBytes,
        ),
        spec(
            format!("{e}{p}_scales"),
            Dtype::U8,
            &[n, rows, cols / 32],
            Init::E8m0Scale { fan_in: cols },
        ),
        spec(
            format!("{e}{p}_bias"),
            Dtype::Bf16,
            &[n, rows],
            Init::Normal(0.02),
        ),
    ]
}

pub(crate) fn layout(d: &Dims) -> Layout {
    let h = d.hidden;
    let mut l = Layout::default();
    let norm = |name: String| spec(name, Dtype::Bf16, &[h], Init::Uniform(0.8, 1.2));
    l.groups.push(vec![spec(
        "model.embed_tokens.weight".into(),
        Dtype::Bf16,
        &[VOCAB, h],
        Init::Normal(1.0),
    )]);
    for i in 0..d.layers {
        let n = format!("model.layers.{i}.");
        let a = format!("{n}self_attn.");
        let (q, kv) = (d.heads * d.head_dim, d.kv_heads * d.head_dim);
        let mut specs = vec![norm(format!("{n}input_layernorm.weight"))];
        specs.extend(affine(&a, "q_proj", q, h));
        specs.extend(affine(&a, "k_proj", kv, h));
        specs.extend(affine(&a, "v_proj", kv, h));
        specs.extend(affine(&a, "o_proj", h, q));
        specs.push(spec(
            format!("{a}sinks"),
            Dtype::Bf16,
            &[d.heads],
            Init::Normal(1.0),
        ));
        specs.push(norm(format!("{n}post_attention_layernorm.weight")));
        let r = format!("{n}mlp.");
        specs.push(spec(
            format!("{r}router.weight"),
            Dtype::Bf16,
            &[d.experts, h],
            Init::Normal(2.0 / (h as f32).sqrt()),
        ));
        specs.push(spec(
            format!("{r}router.bias"),
            Dtype::Bf16,
            &[d.experts],
            Init::Normal(0.05),
        ));
        let e = format!("{r}experts.");
        specs.extend(experts(
            &e,
            "gate_up_proj",
            d.experts,
            2 * d.intermediate,
            h,
        ));
        specs.extend(experts(&e, "down_proj", d.experts, h, d.intermediate));
        l.groups.extend(specs.into_iter().map(|s| vec![s]));
    }
    l.groups.push(vec![norm("model.norm.weight".into())]);
    l.groups.push(vec![spec(
        "lm_head.weight".into(),
        Dtype::Bf16,
        &[VOCAB, h],
        Init::Normal(1.0 / (h as f32).sqrt()),
    )]);
    l
}

/// `tokenizer.json` (the converter's, with the ranks as its vocabulary and no merges, which deltafin's rank
/// BPE does not need), `tokenizer_config.json` and `generation_config.json`.
pub(crate) fn write_tokenizer(out: &Path) -> Result<()> {
    let mut layout: Value = serde_json::from_str(TOKENIZER_LAYOUT)?;
    let mut vocab = serde_json::Map::new();
    let alphabet = deltafin_tokenizer::byte_level_alphabet();
    for line in RANKS.lines() {
        let (b64, rank) = line
            .split_once(' ')
            .context("o200k_base.tiktoken: a line without a rank")?;
        let bytes = BASE64.decode(b64)?;
        vocab.insert(
            bytes.iter().map(|&b| alphabet[b as usize]).collect(),
            rank.parse::<u64>()?.into(),
        );
    }
    layout["model"]["vocab"] = Value::Object(vocab);
    let write = |name: &str, text: &str| {
        std::fs::write(out.join(name), text).with_context(|| format!("writing {name}"))
    };
    write("tokenizer.json", &layout.to_string())?;
    write("tokenizer_config.json", TOKENIZER_CONFIG)?;
    write("generation_config.json", GENERATION_CONFIG)
}

#[cfg(test)]
mod tests {
    use super::*;
    use deltafin_formats::writer::TensorSpec;

    /// One expert of a bench layer is gpt-oss-120b's: 2880 → 2 × 2880 MXFP4 blocks (16 bytes a group of 32)
    /// and e8m0 scales, BF16 biases, and the same for 2880 → 2880; a token routes to as many of them as in
    /// gpt-oss-120b (36 layers × top-4), and the checkpoint stays under 9 GB.
    #[test]
    fn bench_reads_the_released_records_a_token() {
        let d = dims(Preset::Bench).unwrap();
        let bytes = |prefix: &str| -> usize {
            layout(&d)
                .groups
                .iter()
                .flatten()
                .filter(|s| s.name.starts_with(prefix))
                .map(|s| TensorSpec::new(s.name.clone(), s.dtype, &s.shape).nbytes())
                .sum()
        };
        let (gate_up, down) = (2 * 2880, 2880);
        let want = gate_up * (90 * 17 + 2) + down * (90 * 17 + 2);
        assert_eq!(bytes("model.layers.0.mlp.experts.") / d.experts, want);
        assert_eq!(want, 13_236_480);
        assert_eq!((d.layers, d.experts_per_token), (36, 4));
        let types = config(&d)["layer_types"].clone();
        assert_eq!(types[0], "sliding_attention");
        assert_eq!(types[35], "full_attention");
        let total = bytes("");
        assert!(total < 9_000_000_000, "bench is {total} bytes");
    }
}
