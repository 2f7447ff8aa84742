//! `deltafin`: run mixture-of-experts models far larger than memory, exactly.

mod bench;
mod chat;
mod demo;
mod device;
mod doctor;
mod fetch;
mod generate;
mod host;
mod memory;
mod progress;
mod report;
mod store_args;
mod store_cmds;
mod tokenize;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use deltafin_cuda::Device;
use deltafin_makemodel::{make_deepseek_model, make_padded_model, Arch, Preset, Quant};
use deltafin_models::Model;
use std::path::{Path, PathBuf};

#[derive(Parser)]
#[command(
    name = "deltafin",
    version,
    about = "Run mixture-of-experts models far larger than memory, exactly."
)]
struct Cli {
    /// Worker threads for the kernels (default: one per core). Results are bit-identical for any count.
    #[arg(long, global = true)]
    threads: Option<usize>,
    /// The CPU kernels' instruction set: scalar, avx2+fma, avx512 or neon, among those this CPU runs
    /// (default: the best; `doctor` lists them). Results are bit-identical on every one; only speed changes.
    #[arg(long, global = true, env = "DELTAFIN_ISA")]
    isa: Option<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generation from a checkpoint directory (greedy unless --temperature > 0), from raw text or (--chat) as a
    /// chat reply.
    Run(RunArgs),
    /// Talk to a model: an interactive conversation with streaming replies.
    Chat(chat::ChatArgs),
    /// Print the token ids of some text as a JSON list.
    Tokenize(tokenize::TokenizeArgs),
    /// Check this machine (CPU features, memory, disk bandwidth) and a model directory's health.
    Doctor(doctor::DoctorArgs),
    /// The main job: unpack the built-in trained K3-architecture model once and generate from it.
    Demo(demo::DemoArgs),
    /// Write a seeded random checkpoint in a released on-disk layout (any supported family).
    MakeModel(MakeModelArgs),
    /// Build an expert pack: one aligned record per expert, striped over one directory per drive.
    Pack(store_cmds::PackArgs),
    /// Mirror a remote repository (Hugging Face or any HTTP server) into a local directory: all of it, or the
    /// spine only with experts fetched on first use.
    Fetch(fetch::FetchArgs),
    /// Write deltafin.checksums.json into a checkpoint directory, so mirrors of it verify every byte.
    Checksums(fetch::ChecksumsArgs),
    /// Measure a drive's read bandwidth through deltafin's own read path.
    DiskProbe(store_cmds::DiskProbeArgs),
    /// Replay routing traces through the expert-cache eviction policies and compare hit rates.
    CacheSim(store_cmds::CacheSimArgs),
    /// Decode benchmark on an I/O-shaped K3 (about 10 GB, created once): tok/s, bytes, hit rate, efficiency.
    Bench(bench::BenchArgs),
    /// OpenAI- and Anthropic-compatible HTTP server: /v1/chat/completions, /v1/completions, /v1/responses,
    /// /v1/messages, /v1/models, /health, /metrics.
    Serve(ServeCmd),
}

#[derive(Args)]
struct ServeCmd {
    #[command(flatten)]
    serve: deltafin_server::ServeArgs,
    #[command(flatten)]
    store: store_args::StoreArgs,
    #[command(flatten)]
    device: device::DeviceArgs,
}

#[derive(Args)]
struct RunArgs {
    /// Hugging Face checkpoint directory (config.json, safetensors shards, tokenizer files).
    #[arg(long)]
    model: PathBuf,
    #[command(flatten)]
    gen: GenArgs,
    #[command(flatten)]
    store: store_args::StoreArgs,
    #[command(flatten)]
    device: device::DeviceArgs,
    /// With --device cuda: first measure the raw pinned host-to-device and device-to-device copy bandwidths.
    #[arg(long)]
    probe_bandwidth: bool,
    /// With --device cuda: after the [cuda] line, a [timeline] table of what each kernel (matmuls by shape)
    /// costs a decode step on the GPU's critical path (the kernels note when each block starts; a diagnostic:
    /// the notes cost a little time themselves).
    #[arg(long)]
    timeline: bool,
}

#[derive(Args)]
struct GenArgs {
    /// Prompt text, tokenized with the checkpoint's tiktoken.model or tokenizer.json (no BOS is prepended).
    #[arg(
        long,
        conflicts_with = "prompt_ids",
        required_unless_present = "prompt_ids"
    )]
    prompt: Option<String>,
    /// Prompt as comma-separated token ids, e.g. 1,2,3.
    #[arg(long, value_delimiter = ',')]
    prompt_ids: Option<Vec<u32>>,
    /// Number of tokens to generate.
    #[arg(long, default_value_t = 32)]
    max_new: usize,
    /// Keep generating past the end-of-sequence token (default: stop at it).
    #[arg(long)]
    ignore_eos: bool,
    /// Write the logits as float32 .npy [rows, vocab]: every prompt position, then each generated token's.
    #[arg(long)]
    dump_logits: Option<PathBuf>,
    /// Print the generated token ids as a JSON list on stdout after the text.
    #[arg(long)]
    print_ids: bool,
    /// Write one JSON line per generated token to this file: the pass's time, bytes read, cache hits, I/O
    /// wait, time per layer and every row's routed experts (a routing trace `deltafin cache-sim` replays).
    #[arg(long, value_name = "FILE.jsonl", conflicts_with = "draft")]
    events: Option<PathBuf>,
    /// Treat --prompt as a user message: render the checkpoint's chat format and print the reply's
    /// reasoning and answer apart (default: off, raw completion).
    #[arg(long, conflicts_with = "prompt_ids")]
    chat: bool,
    /// With --chat: a system message before the user message (default: none).
    #[arg(long, requires = "chat")]
    system: Option<String>,
    /// With --chat: thinking effort announced to K3 (low, high or max), or harmony's reasoning effort (low or
    /// high; medium without it) (default: none).
    #[arg(long, requires = "chat")]
    effort: Option<deltafin_tokenizer::chat::Effort>,
    /// Print the [stats] line (time, tokens, expert reads, cache) to stderr at the end (default: off).
    #[arg(long)]
    stats: bool,
    #[command(flatten)]
    draft: DraftArgs,
    #[command(flatten)]
    sampling: SamplingArgs,
}

/// Speculative decoding (`run` and `chat`).
#[derive(Args)]
struct DraftArgs {
    /// Speculative decoding: `ngram` (prompt lookup: the tokens that followed the latest earlier occurrence of
    /// the last few, for any model) or a small model's directory (sharing the tokenizer) guesses the next
    /// tokens and the model checks them in one pass. The tokens and logits are exactly those of a run without
    /// it.
    #[arg(long, value_name = "ngram|DIR")]
    draft: Option<deltafin_engine::DraftArg>,
    /// Most tokens guessed per pass of the model; each pass guesses as many as measurements say pay (perhaps
    /// none).
    #[arg(long, default_value_t = 4, requires = "draft")]
    draft_tokens: usize,
    /// Guess --draft-tokens tokens on every pass, whatever the measurements say (for measuring what the
    /// choice saves; the output is the same).
    #[arg(long, requires = "draft")]
    draft_fixed: bool,
}

/// How tokens are picked (`run` and `chat`).
#[derive(Args)]
struct SamplingArgs {
    /// Sampling temperature; 0 is greedy (argmax, lowest id on ties). Sampling never changes which experts run.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Nucleus sampling: keep the smallest set of tokens whose probability reaches this.
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Seed of the sampler: the same seed and input give the same tokens.
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

impl SamplingArgs {
    fn params(&self) -> deltafin_engine::SamplingParams {
        deltafin_engine::SamplingParams {
            temperature: self.temperature,
            top_p: self.top_p,
            seed: self.seed,
            ..Default::default()
        }
    }
}

#[derive(Args)]
struct MakeModelArgs {
    /// Architecture: kimi_k3, kimi_linear, gpt_oss, deepseek_v3, kimi_k2 or qwen3_moe.
    #[arg(long)]
    arch: Arch,
    /// Size: tiny (unit tests, a few MB), small (>= 64 experts per layer, a few hundred MB), bench (the
    /// released expert records, 4-10 GB; not kimi_linear) or for kimi_k3 wide (K3's real widths in 3 layers,
    /// about 4 GB). docs/presets.md lists them.
    #[arg(long)]
    preset: Preset,
    /// Seed of the random weights: the same seed writes byte-identical files.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Output directory (created; must not already hold a checkpoint).
    #[arg(long)]
    out: PathBuf,
    /// Add N padding rows to the embedding table and lm_head past the tokenizer's ranks and specials
    /// (vocab_size grows by N), as many released checkpoints have: the model can pick their ids, which
    /// have no text (default: none).
    #[arg(long, default_value_t = 0, value_name = "N")]
    pad_vocab: usize,
    /// deepseek_v3 and kimi_k2: how the linears are stored: fp8 (e4m3, 128×128 block scales; deepseek_v3's
    /// default), int4 (compressed-tensors pack-quantized routed experts; kimi_k2's default) or bf16.
    #[arg(long)]
    quant: Option<Quant>,
}

fn main() {
    let cli = Cli::parse();
    if let Err(e) = run(cli) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn run(cli: Cli) -> Result<()> {
    if let Some(n) = cli.threads {
        if n == 0 {
            bail!("--threads must be at least 1");
        }
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build_global()?;
    }
    deltafin_kernels::set_isa(cli.isa.as_deref()).map_err(anyhow::Error::msg)?;
    match cli.command {
        Command::Run(a) => generate::run(
            &a.model,
            &a.gen,
            &a.store.load_options(&a.model)?,
            &a.device,
            a.probe_bandwidth,
            a.timeline,
        ),
        Command::Chat(a) => chat::chat(a),
        Command::Tokenize(a) => tokenize::tokenize(a),
        Command::Doctor(a) => doctor::doctor(a),
        Command::Pack(a) => store_cmds::pack(a),
        Command::Fetch(a) => fetch::fetch(a),
        Command::Checksums(a) => fetch::checksums(a),
        Command::DiskProbe(a) => store_cmds::disk_probe(a),
        Command::Bench(a) => bench::bench(a),
        Command::CacheSim(a) => store_cmds::cache_sim(a),
        Command::Serve(a) => {
            let load = a.store.load_options(&a.serve.model)?;
            match a.device.device {
                Device::Cpu => deltafin_server::run(a.serve, |dir| Model::load_with(dir, &load)),
                Device::Cuda(ordinal) => deltafin_server::run(a.serve, |dir| {
                    a.device.load_cuda(ordinal, dir, &load, false)
                }),
            }
        }
        Command::Demo(a) => demo::run(a),
        Command::MakeModel(a) => {
            if a.out.join("config.json").exists() {
                bail!(
                    "{} already holds a checkpoint; choose an empty --out directory",
                    a.out.display()
                );
            }
            let s = progress::while_busy("writing the checkpoint", || match a.quant {
                Some(q) if a.pad_vocab > 0 => bail!("--quant {q:?} takes no --pad-vocab"),
                Some(q) => make_deepseek_model(a.arch, a.preset, a.seed, q, &a.out),
                None => make_padded_model(a.arch, a.preset, a.seed, a.pad_vocab, &a.out),
            })?;
            println!("{}: {s}", a.out.display());
            Ok(())
        }
    }
}

fn default_cache_dir() -> Result<PathBuf> {
    if let Some(d) = std::env::var_os("DELTAFIN_CACHE") {
        return Ok(PathBuf::from(d));
    }
    let home = std::env::var_os("HOME")
        .context("neither DELTAFIN_CACHE nor HOME is set; pass --cache-dir")?;
    Ok(cache_dir_under(Path::new(&home), std::env::consts::OS))
}

/// The per-user cache directory's place by the OS's convention: ~/Library/Caches on macOS, ~/.cache
/// elsewhere.
fn cache_dir_under(home: &Path, os: &str) -> PathBuf {
    let caches = if os == "macos" {
        home.join("Library").join("Caches")
    } else {
        home.join(".cache")
    };
    caches.join("deltafin")
}

/// Builds `dir` in a sibling temp directory and renames it into place, so an interrupted run never leaves a
/// half-written model where the next run would trust it.
fn create_atomically(dir: &Path, build: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let parent = dir.parent().context("the model directory needs a parent")?;
    std::fs::create_dir_all(parent)
        .with_context(|| format!("cannot create {}", parent.display()))?;
    let tmp = parent.join(format!(
        ".{}.partial-{}",
        dir.file_name().and_then(|n| n.to_str()).unwrap_or("model"),
        std::process::id()
    ));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp)
            .with_context(|| format!("cannot remove the leftover {}", tmp.display()))?;
    }
    build(&tmp)?;
    std::fs::rename(&tmp, dir)
        .with_context(|| format!("cannot move {} to {}", tmp.display(), dir.display()))
}

#[cfg(test)]
mod tests {
    use super::cache_dir_under;
    use std::path::Path;

    #[test]
    fn the_cache_lives_where_each_os_keeps_caches() {
        let home = Path::new("/Users/ada");
        assert_eq!(
            cache_dir_under(home, "macos"),
            Path::new("/Users/ada/Library/Caches/deltafin")
        );
        assert_eq!(
            cache_dir_under(home, "linux"),
            Path::new("/Users/ada/.cache/deltafin")
        );
    }
}
