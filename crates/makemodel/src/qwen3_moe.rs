//! Qwen3-MoE checkpoints in the released layout (Qwen3-30B-A3B's; tests/fixtures/qwen3_moe_tiny_bf16): all
//! BF16, GQA with `q_norm`/`k_norm`, a bias-free router `mlp.gate`, routed experts as
//! `mlp.experts.E.{down,gate,up}_proj` (each expert contiguous, in the order the released shards list them),
//! a byte-level BPE `tokenizer.json` with Qwen's pre-tokenizer and added tokens, and Qwen3's ChatML chat
//! template with its `<think>` handling.

use crate::fill::Init;
use crate::layout::{Layout, Spec};
use crate::Preset;
use anyhow::{bail, ensure, Context, Result};
use deltafin_formats::Dtype;
use serde_json::{json, Map, Value};
use std::path::Path;

/// Qwen's pre-tokenizer split (Qwen2 and Qwen3 alike).
const SPLIT_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const CHAT_TEMPLATE: &str = include_str!("qwen3_chat_template.jinja");

/// Qwen3's added tokens after the BPE ranks, in id order, and whether each is `special`.
const ADDED: [(&str, bool); 26] = [
    ("<|endoftext|>", true),
    ("<|im_start|>", true),
    ("<|im_end|>", true),
    ("<|object_ref_start|>", true),
    ("<|object_ref_end|>", true),
    ("<|box_start|>", true),
    ("<|box_end|>", true),
    ("<|quad_start|>", true),
    ("<|quad_end|>", true),
    ("<|vision_start|>", true),
    ("<|vision_end|>", true),
    ("<|vision_pad|>", true),
    ("<|image_pad|>", true),
    ("<|video_pad|>", true),
    ("<tool_call>", false),
    ("</tool_call>", false),
    ("<|fim_prefix|>", false),
    ("<|fim_middle|>", false),
    ("<|fim_suffix|>", false),
    ("<|fim_pad|>", false),
    ("<|repo_name|>", false),
    ("<|file_sep|>", false),
    ("<tool_response>", false),
    ("</tool_response>", false),
    ("<think>", false),
    ("</think>", false),
];
/// Positions in [`ADDED`] of `<|endoftext|>` (bos, pad, second eos) and `<|im_end|>` (eos).
const ENDOFTEXT: usize = 0;
const IM_END: usize = 2;

pub(crate) struct Dims {
    hidden: usize,
    layers: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    /// The dense MLP's width (`intermediate_size`), in `mlp_only_layers`.
    intermediate: usize,
    mlp_only_layers: &'static [usize],
    moe_intermediate: usize,
    experts: usize,
    experts_per_token: usize,
    n_ranks: usize,
    /// `vocab_size`: the ranks and added tokens, padded like the released 151936 (151669 used).
    vocab: usize,
}

pub(crate) fn dims(preset: Preset) -> Result<Dims> {
    Ok(match preset {
        // head_dim 32 ≠ hidden / heads, as in the released models; one dense layer, so both feed-forwards run.
        Preset::Tiny => Dims {
            hidden: 64,
            layers: 4,
            heads: 4,
            kv_heads: 2,
            head_dim: 32,
            intermediate: 96,
            mlp_only_layers: &[1],
            moe_intermediate: 32,
            experts: 16,
            experts_per_token: 4,
            n_ranks: 480,
            vocab: 512,
        },
        Preset::Small => Dims {
            hidden: 256,
            layers: 8,
            heads: 8,
            kv_heads: 4,
            head_dim: 64,
            intermediate: 512,
            mlp_only_layers: &[],
            moe_intermediate: 128,
            experts: 64,
            experts_per_token: 8,
            n_ranks: 4096,
            vocab: 4160,
        },
        Preset::Bench | Preset::Wide => {
            bail!("the {} preset does not exist for qwen3_moe", preset.name())
        }
    })
}

fn added_id(d: &Dims, k: usize) -> usize {
    d.n_ranks + k
}

/// The released config.json form (Qwen3-30B-A3B's constants).
pub(crate) fn config(d: &Dims) -> Value {
    json!({
        "architectures": ["Qwen3MoeForCausalLM"],
        "attention_bias": false,
        "attention_dropout": 0.0,
        "bos_token_id": added_id(d, ENDOFTEXT),
        "decoder_sparse_step": 1,
        "eos_token_id": added_id(d, IM_END),
        "head_dim": d.head_dim,
        "hidden_act": "silu",
        "hidden_size": d.hidden,
        "initializer_range": 0.02,
        "intermediate_size": d.intermediate,
        "max_position_embeddings": 40960,
        "max_window_layers": d.layers,
        "mlp_only_layers": d.mlp_only_layers,
        "model_type": "qwen3_moe",
        "moe_intermediate_size": d.moe_intermediate,
        "norm_topk_prob": true,
        "num_attention_heads": d.heads,
        "num_experts": d.experts,
        "num_experts_per_tok": d.experts_per_token,
        "num_hidden_layers": d.layers,
        "num_key_value_heads": d.kv_heads,
        "output_router_logits": false,
        "rms_norm_eps": 1e-6,
        "rope_scaling": null,
        "rope_theta": 1_000_000.0,
        "router_aux_loss_coef": 0.001,
        "sliding_window": null,
        "tie_word_embeddings": false,
        "torch_dtype": "bfloat16",
        "use_cache": true,
        "use_sliding_window": false,
        "vocab_size": d.vocab,
    })
}

fn bf16(name: String, shape: &[usize], init: Init) -> Spec {
    Spec {
        name,
        dtype: Dtype::Bf16,
        shape: shape.to_vec(),
        init,
    }
}

/// `[out, inp]` with std gain/sqrt(inp).
fn linear(name: String, out: usize, inp: usize, gain: f32) -> Spec {
    bf16(name, &[out, inp], Init::Normal(gain / (inp as f32).sqrt()))
}

/// A SwiGLU MLP of width `w` under `p`, in the released shards' order: down, gate, up.
fn mlp(p: &str, h: usize, w: usize) -> Vec<Spec> {
    vec![
        linear(format!("{p}down_proj.weight"), h, w, 1.0),
        linear(format!("{p}gate_proj.weight"), w, h, 1.0),
        linear(format!("{p}up_proj.weight"), w, h, 1.0),
    ]
}

pub(crate) fn layout(d: &Dims) -> Layout {
    let (h, q, kv) = (d.hidden, d.heads * d.head_dim, d.kv_heads * d.head_dim);
    let norm = |name: String, len: usize| bf16(name, &[len], Init::Uniform(0.8, 1.2));
    let mut l = Layout::default();
    l.groups.push(vec![bf16(
        "model.embed_tokens.weight".into(),
        &[d.vocab, h],
        Init::Normal(1.0),
    )]);
    for i in 0..d.layers {
        let n = format!("model.layers.{i}.");
        let a = format!("{n}self_attn.");
        let mut specs = vec![
            norm(format!("{n}input_layernorm.weight"), h),
            linear(format!("{a}q_proj.weight"), q, h, 1.0),
            linear(format!("{a}k_proj.weight"), kv, h, 1.0),
            linear(format!("{a}v_proj.weight"), kv, h, 1.0),
            linear(format!("{a}o_proj.weight"), h, q, 1.0),
            norm(format!("{a}q_norm.weight"), d.head_dim),
            norm(format!("{a}k_norm.weight"), d.head_dim),
            norm(format!("{n}post_attention_layernorm.weight"), h),
        ];
        let m = format!("{n}mlp.");
        if d.mlp_only_layers.contains(&i) {
            specs.extend(mlp(&m, h, d.intermediate));
            l.groups.extend(specs.into_iter().map(|s| vec![s]));
            continue;
        }
        // Router weights twice the usual scale: decisive, token-dependent routing.
        specs.push(linear(format!("{m}gate.weight"), d.experts, h, 2.0));
        l.groups.extend(specs.into_iter().map(|s| vec![s]));
        for e in 0..d.experts {
            l.groups
                .push(mlp(&format!("{m}experts.{e}."), h, d.moe_intermediate));
        }
    }
    l.groups.push(vec![norm("model.norm.weight".into(), h)]);
    l.groups
        .push(vec![linear("lm_head.weight".into(), d.vocab, h, 1.0)]);
    l
}

/// `tokenizer.json` (a byte-level BPE trained on the built-in corpus, merges as transformers' tiktoken
/// converter derives them from the ranks, Qwen's normalizer, pre-tokenizer and added tokens),
/// `tokenizer_config.json` with the chat template, and `generation_config.json` as Qwen3 ships them.
pub(crate) fn write_tokenizer(d: &Dims, out: &Path) -> Result<()> {
    let ranks = deltafin_tokenizer::train_bpe(deltafin_tokenizer::builtin_corpus(), d.n_ranks);
    ensure!(
        ranks.len() == d.n_ranks,
        "BPE training on the built-in corpus gave {} ranks, but this preset needs {}",
        ranks.len(),
        d.n_ranks
    );
    let alphabet = deltafin_tokenizer::byte_level_alphabet();
    let text = |bytes: &[u8]| -> String { bytes.iter().map(|&b| alphabet[b as usize]).collect() };
    let rank_of: std::collections::HashMap<&[u8], usize> =
        ranks.iter().enumerate().map(|(r, t)| (&t[..], r)).collect();
    let mut vocab = Map::new();
    let mut merges = Vec::new();
    for (r, token) in ranks.iter().enumerate() {
        vocab.insert(text(token), r.into());
        // Every split into two tokens, by their ranks: HF's merge-based BPE then encodes as rank BPE does.
        let mut splits: Vec<(usize, usize, usize)> = (1..token.len())
            .filter_map(|i| {
                let (a, b) = token.split_at(i);
                Some((rank_of.get(a)?.to_owned(), rank_of.get(b)?.to_owned(), i))
            })
            .collect();
        splits.sort_unstable();
        merges.extend(splits.into_iter().map(|(_, _, i)| {
            let (a, b) = token.split_at(i);
            json!([text(a), text(b)])
        }));
    }
    let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false});
    let added: Vec<Value> = ADDED
        .iter()
        .enumerate()
        .map(|(k, (content, special))| {
            json!({"id": added_id(d, k), "content": content, "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": special})
        })
        .collect();
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": SPLIT_PATTERN}, "behavior": "Isolated", "invert": false},
            byte_level,
        ]},
        "post_processor": byte_level,
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": vocab, "merges": merges},
    });
    let decoder: Map<String, Value> = ADDED
        .iter()
        .enumerate()
        .map(|(k, (content, special))| {
            let entry = json!({"content": content, "lstrip": false, "normalized": false, "rstrip": false,
                               "single_word": false, "special": special});
            (added_id(d, k).to_string(), entry)
        })
        .collect();
    let tokenizer_config = json!({
        "add_bos_token": false,
        "add_prefix_space": false,
        "added_tokens_decoder": decoder,
        "additional_special_tokens": ADDED[1..14].iter().map(|a| a.0).collect::<Vec<_>>(),
        "bos_token": null,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": false,
        "eos_token": ADDED[IM_END].0,
        "errors": "replace",
        "model_max_length": 131072,
        "pad_token": ADDED[ENDOFTEXT].0,
        "split_special_tokens": false,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": null,
    });
    let generation_config = json!({
        "bos_token_id": added_id(d, ENDOFTEXT),
        "do_sample": true,
        "eos_token_id": [added_id(d, IM_END), added_id(d, ENDOFTEXT)],
        "pad_token_id": added_id(d, ENDOFTEXT),
        "temperature": 0.6,
        "top_k": 20,
        "top_p": 0.95,
    });
    for (name, value) in [
        ("tokenizer.json", &tokenizer),
        ("tokenizer_config.json", &tokenizer_config),
        ("generation_config.json", &generation_config),
    ] {
        crate::write_json(&out.join(name), value).with_context(|| format!("writing {name}"))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use deltafin_formats::config::ModelConfig;

    /// Every preset's config parses as the engine reads it, its vocabulary holds the ranks and added tokens,
    /// and the layout's dense layers are the config's.
    #[test]
    fn every_preset_parses_as_the_engine_reads_it() {
        for preset in [Preset::Tiny, Preset::Small] {
            let d = dims(preset).unwrap();
            let c = ModelConfig::from_json(&config(&d)).unwrap();
            assert!(d.n_ranks + ADDED.len() <= d.vocab, "{preset:?}");
            let got = (c.hidden, c.num_layers, c.moe.num_experts, c.moe.top_k);
            assert_eq!(got, (d.hidden, d.layers, d.experts, d.experts_per_token));
            let routers: Vec<bool> = (0..d.layers)
                .map(|i| {
                    let router = format!("model.layers.{i}.mlp.gate.weight");
                    layout(&d).groups.iter().flatten().any(|s| s.name == router)
                })
                .collect();
            let moe: Vec<bool> = c.dense.iter().map(|&dense| !dense).collect();
            assert_eq!(routers, moe, "{preset:?}");
        }
    }
}
