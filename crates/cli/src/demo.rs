//! `deltafin demo`, the README's main job: a real trained K3-architecture model (Shakespeare, 64 MXFP4 experts
//! per layer, built by tools/train/) is embedded in the binary, unpacked once into the cache directory, and
//! generates with its experts read from disk on demand.

use crate::device::DeviceArgs;
use crate::{
    create_atomically, default_cache_dir, generate, progress, store_args::StoreArgs, GenArgs,
};
use anyhow::{Context, Result};
use clap::Args;
use deltafin_makemodel::{make_model, Arch, Preset};
use std::path::{Path, PathBuf};

/// The trained checkpoint, file by file, exactly as committed under models/shakespeare-k3.
const SHAKESPEARE: &[(&str, &[u8])] = &[
    (
        "config.json",
        include_bytes!("../../../models/shakespeare-k3/config.json"),
    ),
    (
        "generation_config.json",
        include_bytes!("../../../models/shakespeare-k3/generation_config.json"),
    ),
    (
        "model.safetensors.index.json",
        include_bytes!("../../../models/shakespeare-k3/model.safetensors.index.json"),
    ),
    (
        "model-00001-of-00002.safetensors",
        include_bytes!("../../../models/shakespeare-k3/model-00001-of-00002.safetensors"),
    ),
    (
        "model-00002-of-00002.safetensors",
        include_bytes!("../../../models/shakespeare-k3/model-00002-of-00002.safetensors"),
    ),
    (
        "tiktoken.model",
        include_bytes!("../../../models/shakespeare-k3/tiktoken.model"),
    ),
    (
        "tokenizer_config.json",
        include_bytes!("../../../models/shakespeare-k3/tokenizer_config.json"),
    ),
];

const DRAFTER: &[(&str, &[u8])] = &[
    (
        "config.json",
        include_bytes!("../../../models/shakespeare-k3-drafter/config.json"),
    ),
    (
        "generation_config.json",
        include_bytes!("../../../models/shakespeare-k3-drafter/generation_config.json"),
    ),
    (
        "model.safetensors",
        include_bytes!("../../../models/shakespeare-k3-drafter/model.safetensors"),
    ),
    (
        "tiktoken.model",
        include_bytes!("../../../models/shakespeare-k3-drafter/tiktoken.model"),
    ),
    (
        "tokenizer_config.json",
        include_bytes!("../../../models/shakespeare-k3-drafter/tokenizer_config.json"),
    ),
];

#[derive(Args)]
pub struct DemoArgs {
    /// Where the demo model is unpacked and kept (default: $DELTAFIN_CACHE, else ~/.cache/deltafin, on macOS
    /// ~/Library/Caches/deltafin).
    #[arg(long)]
    cache_dir: Option<PathBuf>,
    /// Prompt text.
    #[arg(long, default_value = "ROMEO:")]
    prompt: String,
    /// Number of tokens to generate.
    #[arg(long, default_value_t = 120)]
    max_new: usize,
    /// Use the random-weight `small` preset (128 experts per layer, ~260 MB, written on first use) instead of
    /// the trained model: more expert bytes per token, noise for text.
    #[arg(long)]
    random: bool,
    /// Seed of the sampler (temperature 0.8, top-p 0.95).
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Speculative decoding with the built-in drafter (trained alongside the model): the same text, fewer
    /// passes of the model.
    #[arg(long, conflicts_with = "random")]
    speculative: bool,
    #[command(flatten)]
    store: StoreArgs,
    #[command(flatten)]
    device: DeviceArgs,
}

pub fn run(a: DemoArgs) -> Result<()> {
    let cache = match a.cache_dir {
        Some(d) => d,
        None => default_cache_dir()?,
    };
    let dir = if a.random {
        let dir = cache.join("kimi_k3-small-seed0");
        if !dir.join("config.json").exists() {
            eprintln!(
                "creating the random demo model (kimi_k3, small preset) in {} ...",
                dir.display()
            );
            progress::while_busy("writing the demo model", || {
                create_atomically(&dir, |tmp| {
                    make_model(Arch::KimiK3, Preset::Small, 0, tmp).map(|_| ())
                })
            })?;
        }
        dir
    } else {
        unpack(&cache.join("shakespeare-k3"), SHAKESPEARE)?
    };
    let draft = if a.speculative {
        Some(unpack(&cache.join("shakespeare-k3-drafter"), DRAFTER)?)
    } else {
        None
    };
    let gen = GenArgs {
        prompt: Some(a.prompt),
        prompt_ids: None,
        max_new: a.max_new,
        ignore_eos: false,
        dump_logits: None,
        print_ids: false,
        events: None,
        chat: false,
        system: None,
        effort: None,
        stats: true,
        draft: crate::DraftArgs {
            draft: draft.map(deltafin_engine::DraftArg::Model),
            draft_tokens: 4,
            draft_fixed: false,
        },
        // A little randomness keeps a small model out of greedy loops; seeded, so the demo is reproducible.
        sampling: crate::SamplingArgs {
            temperature: 0.8,
            top_p: 0.95,
            seed: a.seed,
        },
    };
    generate::run(
        &dir,
        &gen,
        &a.store.load_options(&dir)?,
        &a.device,
        false,
        false,
    )
}

/// Writes the built-in `files` into `dir` once (atomically) and returns it.
fn unpack(dir: &Path, files: &[(&str, &[u8])]) -> Result<PathBuf> {
    if !dir.join("config.json").exists() {
        eprintln!("unpacking a built-in model into {} ...", dir.display());
        create_atomically(dir, |tmp| {
            std::fs::create_dir_all(tmp)?;
            for (name, bytes) in files {
                std::fs::write(tmp.join(name), bytes)?;
            }
            Ok(())
        })
        .with_context(|| {
            format!(
                "unpacking the built-in model into {}; choose another place with --cache-dir or DELTAFIN_CACHE",
                dir.display()
            )
        })?;
    }
    Ok(dir.to_path_buf())
}
