//! `deltafin make-model`: seeded random checkpoints in the exact on-disk layout of Kimi K3 and
//! Kimi Linear (docs/checkpoint-layout.md) at the sizes of docs/presets.md, so every loader, kernel and
//! store path can be tested end to end without the real 1.5 TB of weights.
//!
//! Weights are scaled so activations stay O(1) through all layers and routing differs between tokens;
//! they carry no knowledge. The same (arch, preset, seed) always gives byte-identical files.

mod deepseek;
mod fill;
mod gpt_oss;
mod layout;
mod qwen3_moe;

use std::fmt;
use std::path::Path;
use std::str::FromStr;

use anyhow::{bail, ensure, Context, Result};
use deltafin_formats::writer::{ShardLimit, ShardedWriter, TensorSpec};
use deltafin_tokenizer::K3_NUM_SPECIALS;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde_json::{json, Value};

use layout::{Layout, FIRST_K_DENSE, SHORT_CONV_KERNEL};

pub use deepseek::Quant;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    KimiK3,
    KimiLinear,
    GptOss,
    DeepseekV3,
    KimiK2,
    Qwen3Moe,
}

impl Arch {
    /// The name `--arch` takes (and config.json's model_type).
    pub fn name(self) -> &'static str {
        match self {
            Arch::KimiK3 => "kimi_k3",
            Arch::KimiLinear => "kimi_linear",
            Arch::GptOss => "gpt_oss",
            Arch::DeepseekV3 => "deepseek_v3",
            Arch::KimiK2 => "kimi_k2",
            Arch::Qwen3Moe => "qwen3_moe",
        }
    }
}

impl FromStr for Arch {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Arch> {
        match s {
            "kimi_k3" => Ok(Arch::KimiK3),
            "kimi_linear" => Ok(Arch::KimiLinear),
            "gpt_oss" => Ok(Arch::GptOss),
            "deepseek_v3" => Ok(Arch::DeepseekV3),
            "kimi_k2" => Ok(Arch::KimiK2),
            "qwen3_moe" => Ok(Arch::Qwen3Moe),
            _ => bail!(
                "unknown architecture {s:?}: expected one of kimi_k3, kimi_linear, gpt_oss, deepseek_v3, kimi_k2, qwen3_moe"
            ),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Preset {
    Tiny,
    Small,
    /// I/O-shaped K3 for `deltafin bench`: real 17,547,264-byte expert records with top-16 routing, 6 MoE
    /// layers of 96 experts (about 10 GB), a narrow spine.
    Bench,
    /// Compute-shaped K3 for `deltafin bench --compute`: K3's real widths (hidden 7168, KDA, MLA, latent,
    /// shared and expert shapes) in 3 layers of 24 experts with a small vocabulary (about 4 GB).
    Wide,
}

impl Preset {
    /// The name `--preset` takes.
    pub fn name(self) -> &'static str {
        match self {
            Preset::Tiny => "tiny",
            Preset::Small => "small",
            Preset::Bench => "bench",
            Preset::Wide => "wide",
        }
    }
}

impl FromStr for Preset {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Preset> {
        match s {
            "tiny" => Ok(Preset::Tiny),
            "small" => Ok(Preset::Small),
            "bench" => Ok(Preset::Bench),
            "wide" => Ok(Preset::Wide),
            _ => bail!("unknown preset {s:?}: expected one of tiny, small, bench, wide"),
        }
    }
}

/// What `make_model` wrote (weights only; config and tokenizer files are not counted).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Summary {
    pub tensors: usize,
    /// Tensor payload bytes, the index's `total_size`.
    pub bytes: u64,
    pub shards: usize,
    /// Payload bytes of the routed experts.
    pub expert_bytes: u64,
}

impl fmt::Display for Summary {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(
            f,
            "{} tensors, {} bytes in {} shards ({} bytes of routed experts)",
            self.tensors, self.bytes, self.shards, self.expert_bytes
        )
    }
}

/// K3's specials follow the BPE ranks (id = n_ranks + k). Offsets of [BOS], <|end_of_msg|> (the stop token: K3's eos 163586 = 163584 + 2) and [PAD].
const BOS_OFFSET: usize = 0;
const EOS_OFFSET: usize = 2;
const PAD_OFFSET: usize = 255;
/// NoPE attention has no trained length; the released K3 value.
const MAX_POSITION_EMBEDDINGS: usize = 1_048_576;
const RMS_NORM_EPS: f64 = 1e-5;
/// Kimi Linear multiplies routed weights by this after renormalising (K3 uses 1.0).
const KIMI_LINEAR_ROUTED_SCALING: f64 = 2.446;

/// Sizes shared by both architectures (docs/presets.md).
pub(crate) struct Dims {
    hidden: usize,
    layers: usize,
    /// 1-based, as in config.json.
    full_attn_layers: &'static [usize],
    linear_heads: usize,
    linear_head_dim: usize,
    mla_heads: usize,
    kv_lora_rank: usize,
    qk_nope: usize,
    qk_rope: usize,
    v_head: usize,
    intermediate: usize,
    experts: usize,
    experts_per_token: usize,
    moe_intermediate: usize,
    shared_experts: usize,
    n_ranks: usize,
    /// Rows of the embedding table and lm_head past the ranks and specials, with no token behind them.
    padding_rows: usize,
}

/// Sizes only Kimi K3 has.
pub(crate) struct K3Dims {
    q_lora_rank: usize,
    /// routed_expert_hidden_size.
    latent: usize,
    attn_res_block_size: usize,
}

impl Dims {
    fn vocab(&self) -> usize {
        self.n_ranks + K3_NUM_SPECIALS as usize + self.padding_rows
    }

    /// `layer` is 0-based.
    fn is_full_attention(&self, layer: usize) -> bool {
        self.full_attn_layers.contains(&(layer + 1))
    }

    fn linear_attn_config(&self) -> Value {
        let kda: Vec<usize> = (1..=self.layers)
            .filter(|l| !self.full_attn_layers.contains(l))
            .collect();
        json!({
            "head_dim": self.linear_head_dim,
            "num_heads": self.linear_heads,
            "short_conv_kernel_size": SHORT_CONV_KERNEL,
            "kda_layers": kda,
            "full_attn_layers": self.full_attn_layers,
        })
    }

    fn special_ids(&self) -> [(&'static str, usize); 3] {
        [
            ("bos_token_id", self.n_ranks + BOS_OFFSET),
            ("eos_token_id", self.n_ranks + EOS_OFFSET),
            ("pad_token_id", self.n_ranks + PAD_OFFSET),
        ]
    }
}

fn k3_dims(preset: Preset) -> (Dims, K3Dims) {
    match preset {
        Preset::Tiny => (
            Dims {
                hidden: 64,
                layers: 7,
                full_attn_layers: &[4, 7],
                linear_heads: 2,
                linear_head_dim: 32,
                mla_heads: 2,
                kv_lora_rank: 32,
                qk_nope: 16,
                qk_rope: 16,
                v_head: 16,
                intermediate: 128,
                experts: 16,
                experts_per_token: 4,
                moe_intermediate: 32,
                shared_experts: 2,
                n_ranks: 512,
                padding_rows: 0,
            },
            K3Dims {
                q_lora_rank: 32,
                latent: 32,
                attn_res_block_size: 2,
            },
        ),
        Preset::Small => (
            Dims {
                hidden: 512,
                layers: 16,
                full_attn_layers: &[4, 8, 12, 16],
                linear_heads: 4,
                linear_head_dim: 64,
                mla_heads: 4,
                kv_lora_rank: 128,
                qk_nope: 64,
                qk_rope: 32,
                v_head: 64,
                intermediate: 1024,
                experts: 128,
                experts_per_token: 8,
                moe_intermediate: 256,
                shared_experts: 2,
                n_ranks: 4096,
                padding_rows: 0,
            },
            K3Dims {
                q_lora_rank: 128,
                latent: 256,
                attn_res_block_size: 4,
            },
        ),
        Preset::Bench => (
            Dims {
                hidden: 512,
                layers: 7,
                full_attn_layers: &[4, 7],
                linear_heads: 2,
                linear_head_dim: 64,
                mla_heads: 2,
                kv_lora_rank: 64,
                qk_nope: 32,
                qk_rope: 32,
                v_head: 32,
                intermediate: 1024,
                experts: 96,
                experts_per_token: 16,
                // K3's real expert shapes: 3584 → 3072 → 3584, one 17,547,264-byte record.
                moe_intermediate: 3072,
                shared_experts: 2,
                n_ranks: 4096,
                padding_rows: 0,
            },
            K3Dims {
                q_lora_rank: 64,
                latent: 3584,
                attn_res_block_size: 2,
            },
        ),
        // docs/k3-model-contract.md's widths; layer 0's dense MLP gets the shared experts' fused width
        // instead of 33,792 (1.45 GB for one layer of 93), the layers and experts are few, the vocabulary small.
        Preset::Wide => (
            Dims {
                hidden: 7168,
                layers: 3,
                full_attn_layers: &[3],
                linear_heads: 96,
                linear_head_dim: 128,
                mla_heads: 96,
                kv_lora_rank: 512,
                qk_nope: 128,
                qk_rope: 64,
                v_head: 128,
                intermediate: 6144,
                experts: 24,
                experts_per_token: 16,
                moe_intermediate: 3072,
                shared_experts: 2,
                n_ranks: 4096,
                padding_rows: 0,
            },
            K3Dims {
                q_lora_rank: 1536,
                latent: 3584,
                attn_res_block_size: 2,
            },
        ),
    }
}

fn kimi_linear_dims(preset: Preset) -> Dims {
    match preset {
        Preset::Tiny => Dims {
            hidden: 64,
            layers: 5,
            full_attn_layers: &[4, 5],
            linear_heads: 2,
            linear_head_dim: 32,
            mla_heads: 2,
            kv_lora_rank: 32,
            qk_nope: 16,
            qk_rope: 16,
            v_head: 16,
            intermediate: 128,
            experts: 16,
            experts_per_token: 4,
            moe_intermediate: 32,
            shared_experts: 1,
            n_ranks: 512,
            padding_rows: 0,
        },
        Preset::Small => Dims {
            hidden: 512,
            layers: 12,
            full_attn_layers: &[4, 8, 12],
            linear_heads: 4,
            linear_head_dim: 64,
            mla_heads: 4,
            kv_lora_rank: 128,
            qk_nope: 64,
            qk_rope: 32,
            v_head: 64,
            intermediate: 1024,
            experts: 64,
            experts_per_token: 8,
            moe_intermediate: 256,
            shared_experts: 1,
            n_ranks: 4096,
            padding_rows: 0,
        },
        Preset::Bench | Preset::Wide => {
            unreachable!("make_model rejects kimi_linear bench and wide before sizing them")
        }
    }
}

fn k3_config(d: &Dims, k: &K3Dims) -> Value {
    let mut text = json!({
        "model_type": "kimi_linear",
        "hidden_size": d.hidden,
        "num_hidden_layers": d.layers,
        "intermediate_size": d.intermediate,
        "moe_intermediate_size": d.moe_intermediate,
        "routed_expert_hidden_size": k.latent,
        "num_experts": d.experts,
        "num_experts_per_token": d.experts_per_token,
        "num_shared_experts": d.shared_experts,
        "num_attention_heads": d.mla_heads,
        "num_key_value_heads": d.mla_heads,
        "q_lora_rank": k.q_lora_rank,
        "kv_lora_rank": d.kv_lora_rank,
        "qk_nope_head_dim": d.qk_nope,
        "qk_rope_head_dim": d.qk_rope,
        "v_head_dim": d.v_head,
        "vocab_size": d.vocab(),
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "attn_res_block_size": k.attn_res_block_size,
        "first_k_dense_replace": FIRST_K_DENSE,
        "num_expert_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 1.0,
        "hidden_act": "situ",
        "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0,
        "moe_router_activation_func": "sigmoid",
        "topk_method": "noaux_tc",
        "moe_renormalize": true,
        "latent_moe_use_norm": true,
        "mla_use_nope": true,
        "mla_use_output_gate": true,
        "rms_norm_eps": RMS_NORM_EPS,
        "num_nextn_predict_layers": 0,
        "linear_attn_config": d.linear_attn_config(),
    });
    text["linear_attn_config"]["use_full_rank_gate"] = json!(true);
    text["linear_attn_config"]["gate_lower_bound"] = json!(-5.0);
    let mut root = json!({
        "architectures": ["KimiK3ForConditionalGeneration"],
        "model_type": "kimi_k3",
        "dtype": "bfloat16",
        "tie_word_embeddings": false,
        "text_config": text,
        "quantization_config": {
            "quant_method": "compressed-tensors",
            "format": "mxfp4-pack-quantized",
            "config_groups": {"group_0": {
                "weights": {"num_bits": 4, "type": "float", "group_size": 32, "symmetric": true, "scale_dtype": "uint8"},
                "targets": ["Linear"],
            }},
            // Everything but the routed experts stays BF16.
            "ignore": [
                "re:.*lm_head$",
                "re:.*self_attn\\..*",
                "re:.*mlp\\..*",
                "re:.*shared_experts\\..*",
                "re:.*block_sparse_moe\\.gate$",
                "re:.*routed_expert_(down|up)_proj$",
            ],
        },
    });
    for (key, id) in d.special_ids() {
        root[key] = json!(id);
    }
    root
}

fn kimi_linear_config(d: &Dims) -> Value {
    let mut root = json!({
        "architectures": ["KimiLinearForCausalLM"],
        "model_type": "kimi_linear",
        "dtype": "bfloat16",
        "vocab_size": d.vocab(),
        "hidden_size": d.hidden,
        "intermediate_size": d.intermediate,
        "moe_intermediate_size": d.moe_intermediate,
        "num_hidden_layers": d.layers,
        "num_attention_heads": d.mla_heads,
        "num_key_value_heads": d.mla_heads,
        "num_experts": d.experts,
        "num_experts_per_token": d.experts_per_token,
        "num_shared_experts": d.shared_experts,
        "routed_scaling_factor": KIMI_LINEAR_ROUTED_SCALING,
        "kv_lora_rank": d.kv_lora_rank,
        "q_lora_rank": null,
        "qk_nope_head_dim": d.qk_nope,
        "qk_rope_head_dim": d.qk_rope,
        "v_head_dim": d.v_head,
        "num_expert_group": 1,
        "topk_group": 1,
        "moe_renormalize": true,
        "moe_router_activation_func": "sigmoid",
        "hidden_act": "silu",
        "rms_norm_eps": RMS_NORM_EPS,
        "first_k_dense_replace": FIRST_K_DENSE,
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "tie_word_embeddings": false,
        "linear_attn_config": d.linear_attn_config(),
    });
    for (key, id) in d.special_ids() {
        root[key] = json!(id);
    }
    root
}

/// Creates the checkpoint directory `out` with its config.json.
fn write_config(out: &Path, config: &Value) -> Result<()> {
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    write_json(&out.join("config.json"), config)
}

fn write_json(path: &Path, value: &Value) -> Result<()> {
    std::fs::write(path, json_text(value)?).with_context(|| format!("writing {}", path.display()))
}

fn json_text(value: &Value) -> Result<String> {
    Ok(serde_json::to_string_pretty(value)? + "\n")
}

/// The exact text of the config.json that [`make_model`] writes for `arch` and `preset`: a made checkpoint
/// whose config.json differs was made by an earlier version of the preset (`deltafin bench` makes it again).
pub fn config_json(arch: Arch, preset: Preset) -> Result<String> {
    json_text(&plan(arch, preset, 0, None)?.config)
}

/// Writes a complete checkpoint directory at `out`: config.json, generation_config.json, the tokenizer
/// files, then the weights; the shard index comes last, so its presence marks a finished checkpoint.
pub fn make_model(arch: Arch, preset: Preset, seed: u64, out: &Path) -> Result<Summary> {
    make_padded_model(arch, preset, seed, 0, out)
}

/// [`make_model`] with `padding_rows` more rows in the embedding table and lm_head than the tokenizer has
/// ranks and specials (`vocab_size` grows by as much), as many released checkpoints have. Their ids have
/// no text, and the random model picks them like any other. 0 writes exactly what `make_model` does.
pub fn make_padded_model(
    arch: Arch,
    preset: Preset,
    seed: u64,
    padding_rows: usize,
    out: &Path,
) -> Result<Summary> {
    write_plan(plan(arch, preset, padding_rows, None)?, preset, seed, out)
}

/// A DeepSeek-V3 or Kimi K2 checkpoint (`arch`) with its linears stored as `quant`, like [`make_model`].
pub fn make_deepseek_model(
    arch: Arch,
    preset: Preset,
    seed: u64,
    quant: Quant,
    out: &Path,
) -> Result<Summary> {
    write_plan(plan(arch, preset, 0, Some(quant))?, preset, seed, out)
}

/// What a made checkpoint is, but for its weights' bytes: config.json, the tensors, and its tokenizer files.
/// [`config_json`] and the writers all start from here, so they cannot disagree.
struct Plan {
    config: Value,
    layout: Layout,
    tokenizer: TokenizerFiles,
}

enum TokenizerFiles {
    /// A K3-family tiktoken tokenizer of `n_ranks` ranks, its specials called `names(k)`; generation_config.json
    /// names `generation`; K2 has a chat template of its own.
    K3Family {
        n_ranks: usize,
        generation: Vec<(&'static str, usize)>,
        names: fn(u32) -> String,
        chat_template: Option<&'static str>,
    },
    GptOss,
    Qwen3Moe(qwen3_moe::Dims),
}

/// `arch` at `preset`, with `padding_rows` more vocabulary rows (the K3 family only) and, for DeepSeek-V3 and
/// Kimi K2, its linears stored as `quant` (`None`: as released).
fn plan(arch: Arch, preset: Preset, padding_rows: usize, quant: Option<Quant>) -> Result<Plan> {
    ensure!(
        quant.is_none() || matches!(arch, Arch::DeepseekV3 | Arch::KimiK2),
        "--quant applies to deepseek_v3 and kimi_k2 only; {} has one released format",
        arch.name()
    );
    match arch {
        Arch::GptOss if padding_rows > 0 => {
            bail!("gpt_oss has the released vocabulary (201088); it takes no padding rows")
        }
        Arch::DeepseekV3 | Arch::KimiK2 | Arch::Qwen3Moe if padding_rows > 0 => {
            bail!("deepseek_v3, kimi_k2 and qwen3_moe take no padding rows (qwen3_moe's vocabulary has its own, as released)")
        }
        Arch::KimiLinear if matches!(preset, Preset::Bench | Preset::Wide) => {
            bail!("the {} preset exists for kimi_k3 only", preset.name())
        }
        _ => {}
    }
    let k3_family = |d: &Dims| TokenizerFiles::K3Family {
        n_ranks: d.n_ranks,
        generation: d.special_ids().to_vec(),
        names: deltafin_tokenizer::k3_special_name,
        chat_template: None,
    };
    Ok(match arch {
        Arch::KimiK3 => {
            let (mut d, k) = k3_dims(preset);
            d.padding_rows = padding_rows;
            Plan {
                config: k3_config(&d, &k),
                layout: Layout::kimi_k3(&d, &k),
                tokenizer: k3_family(&d),
            }
        }
        Arch::KimiLinear => {
            let mut d = kimi_linear_dims(preset);
            d.padding_rows = padding_rows;
            Plan {
                config: kimi_linear_config(&d),
                layout: Layout::kimi_linear(&d),
                tokenizer: k3_family(&d),
            }
        }
        Arch::DeepseekV3 | Arch::KimiK2 => {
            let quant = quant.unwrap_or(Quant::default_for(arch));
            let d = deepseek::dims(arch, preset)?;
            Plan {
                config: deepseek::config(arch, &d, quant),
                layout: deepseek::layout(&d, quant),
                tokenizer: TokenizerFiles::K3Family {
                    n_ranks: d.n_ranks,
                    generation: deepseek::generation_ids(arch, &d).to_vec(),
                    names: deepseek::special_name(arch),
                    chat_template: (arch == Arch::KimiK2).then_some(deepseek::K2_CHAT_TEMPLATE),
                },
            }
        }
        Arch::GptOss => {
            let d = gpt_oss::dims(preset)?;
            Plan {
                config: gpt_oss::config(&d),
                layout: gpt_oss::layout(&d),
                tokenizer: TokenizerFiles::GptOss,
            }
        }
        Arch::Qwen3Moe => {
            let d = qwen3_moe::dims(preset)?;
            Plan {
                config: qwen3_moe::config(&d),
                layout: qwen3_moe::layout(&d),
                tokenizer: TokenizerFiles::Qwen3Moe(d),
            }
        }
    })
}

/// Writes `plan`'s checkpoint at `out`: config.json and the tokenizer files, then the weights.
fn write_plan(plan: Plan, preset: Preset, seed: u64, out: &Path) -> Result<Summary> {
    match &plan.tokenizer {
        TokenizerFiles::K3Family {
            n_ranks,
            generation,
            names,
            chat_template,
        } => {
            write_k3_family_files(out, &plan.config, *n_ranks, generation, *names)?;
            if let Some(template) = chat_template {
                let path = out.join("chat_template.jinja");
                std::fs::write(&path, template)
                    .with_context(|| format!("writing {}", path.display()))?;
            }
        }
        TokenizerFiles::GptOss => {
            write_config(out, &plan.config)?;
            gpt_oss::write_tokenizer(out).context("writing the tokenizer files")?;
        }
        TokenizerFiles::Qwen3Moe(d) => {
            write_config(out, &plan.config)?;
            qwen3_moe::write_tokenizer(d, out).context("writing the tokenizer files")?;
        }
    }
    write_weights(plan.layout, preset, seed, out)
}

/// config.json, generation_config.json with `special_ids`, and a K3-family tiktoken tokenizer of `n_ranks`
/// ranks trained on the built-in corpus, its 256 specials called `special_name(k)`.
fn write_k3_family_files(
    out: &Path,
    config: &Value,
    n_ranks: usize,
    special_ids: &[(&str, usize)],
    special_name: fn(u32) -> String,
) -> Result<()> {
    let ranks = deltafin_tokenizer::train_bpe(deltafin_tokenizer::builtin_corpus(), n_ranks);
    ensure!(
        ranks.len() == n_ranks,
        "BPE training on the built-in corpus gave {} ranks, but this preset needs {n_ranks}",
        ranks.len(),
    );
    write_config(out, config)?;
    let mut generation = json!({"do_sample": false});
    for (key, id) in special_ids {
        generation[*key] = json!(id);
    }
    write_json(&out.join("generation_config.json"), &generation)?;
    deltafin_tokenizer::write_tiktoken_files_named(out, &ranks, special_name)
        .context("writing the tokenizer files")
}

/// Writes `layout`'s tensors into shards at `out`, the index last.
fn write_weights(layout: Layout, preset: Preset, seed: u64, out: &Path) -> Result<Summary> {
    // One stream, drawn in file order on one thread: the bytes depend on the seed alone. The writer asks for
    // each tensor's bytes when it writes it, so nothing larger than one tensor is held in memory.
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut writer = ShardedWriter::new(out);
    let mut inits = std::collections::HashMap::new();
    let mut expert_bytes = 0u64;
    for group in layout.groups {
        let mut specs = Vec::with_capacity(group.len());
        for s in group {
            let spec = TensorSpec::new(s.name, s.dtype, &s.shape);
            if spec.name.contains(".experts.") {
                expert_bytes += spec.nbytes() as u64;
            }
            inits.insert(spec.name.clone(), s.init);
            specs.push(spec);
        }
        writer.add_group(specs);
    }
    let limit = match preset {
        Preset::Tiny => ShardLimit::Count(3),
        Preset::Small => ShardLimit::MaxBytes(64 << 20),
        // Like the released shards: a few GB each.
        Preset::Bench | Preset::Wide => ShardLimit::MaxBytes(2 << 30),
    };
    let written = writer.finish(limit, |spec| {
        Ok(fill::fill(
            &mut rng,
            inits[&spec.name],
            spec.dtype,
            spec.shape.iter().product(),
        ))
    })?;
    Ok(Summary {
        tensors: written.tensors,
        bytes: written.payload_bytes,
        shards: written.shards,
        expert_bytes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// [`config_json`] is byte for byte what [`make_model`] writes, for every family.
    #[test]
    fn config_json_is_what_make_model_writes() {
        let tmp = tempfile::tempdir().unwrap();
        for arch in [
            Arch::KimiK3,
            Arch::KimiLinear,
            Arch::GptOss,
            Arch::DeepseekV3,
            Arch::KimiK2,
            Arch::Qwen3Moe,
        ] {
            let out = tmp.path().join(arch.name());
            make_model(arch, Preset::Tiny, 0, &out).unwrap();
            assert_eq!(
                std::fs::read_to_string(out.join("config.json")).unwrap(),
                config_json(arch, Preset::Tiny).unwrap(),
                "{}",
                arch.name()
            );
        }
    }

    /// `wide` has the widths of docs/k3-model-contract.md's text_config (typed out here from the contract),
    /// KDA, MLA and MoE layers, and stays a few GB.
    #[test]
    fn wide_has_k3_widths_in_a_few_gb() {
        let (d, k) = k3_dims(Preset::Wide);
        let text = &k3_config(&d, &k)["text_config"];
        for (key, want) in [
            ("hidden_size", 7168),
            ("moe_intermediate_size", 3072),
            ("routed_expert_hidden_size", 3584),
            ("num_experts_per_token", 16),
            ("num_shared_experts", 2),
            ("num_attention_heads", 96),
            ("num_key_value_heads", 96),
            ("q_lora_rank", 1536),
            ("kv_lora_rank", 512),
            ("qk_nope_head_dim", 128),
            ("qk_rope_head_dim", 64),
            ("v_head_dim", 128),
        ] {
            assert_eq!(text[key], json!(want), "{key}");
        }
        let linear = &text["linear_attn_config"];
        assert_eq!(
            (&linear["num_heads"], &linear["head_dim"]),
            (&json!(96), &json!(128))
        );
        assert!(!linear["kda_layers"].as_array().unwrap().is_empty());
        assert!(!linear["full_attn_layers"].as_array().unwrap().is_empty());
        assert!(d.layers > FIRST_K_DENSE, "wide needs MoE layers");
        assert!(d.experts > d.experts_per_token, "the router must choose");
        let bytes: usize = Layout::kimi_k3(&d, &k)
            .groups
            .iter()
            .flatten()
            .map(|s| TensorSpec::new(s.name.clone(), s.dtype, &s.shape).nbytes())
            .sum();
        assert!(
            (2usize << 30..=6 << 30).contains(&bytes),
            "wide is {bytes} bytes"
        );
    }
}
