//! `run --device cuda[:N]`: greedy generation on the GPU backend (deltafin-cuda), with the same outputs as
//! the CPU path (text, ids, `--dump-logits` rows) and a stats line of what the device did.

use crate::GenArgs;
use anyhow::{bail, Context, Result};
use clap::Args;
use deltafin_cuda::{CudaModel, CudaOptions, Device};
use deltafin_engine::sampler::argmax;
use deltafin_formats::npy;
use deltafin_models::{Backend, LoadOptions, LogitRows, Stats};
use deltafin_tokenizer::Tokenizer;
use std::io::Write;
use std::path::Path;
use std::time::Instant;

#[derive(Args, Clone, Debug)]
pub struct DeviceArgs {
    /// Where the model runs: cpu, or cuda / cuda:N (an NVIDIA GPU; the CUDA driver and NVRTC are loaded at
    /// run time, and their absence is reported).
    #[arg(long, default_value = "cpu")]
    pub device: Device,
    /// With --device cuda: VRAM for routed experts, e.g. 16G (default: every expert, or free VRAM less 4 GiB).
    /// Experts beyond it stream from host memory (the RAM expert cache, then disk) over PCIe.
    #[arg(long, value_name = "SIZE")]
    pub expert_vram: Option<String>,
    /// With --device cuda: VRAM for the spine's layers, e.g. 8G (default: every layer, or free VRAM less
    /// 4 GiB). Layers beyond it stay in page-locked host memory and are copied in one layer ahead of compute,
    /// through two buffers of the largest layer's size that count against it (0 streams every layer).
    #[arg(long, value_name = "SIZE")]
    pub spine_vram: Option<String>,
    /// With --device cuda: first measure the raw pinned host-to-device and device-to-device copy bandwidths.
    #[arg(long)]
    pub probe_bandwidth: bool,
}

pub fn run(dir: &Path, args: &GenArgs, load: &LoadOptions, dev: &DeviceArgs) -> Result<()> {
    let Device::Cuda(ordinal) = dev.device else {
        bail!("internal: cuda_run::run called for the CPU");
    };
    let t_load = Instant::now();
    let opts = CudaOptions {
        ordinal,
        expert_vram: dev
            .expert_vram
            .as_deref()
            .map(crate::store_args::parse_size)
            .transpose()?,
        spine_vram: dev
            .spine_vram
            .as_deref()
            .map(crate::store_args::parse_size)
            .transpose()?,
    };
    let model = CudaModel::load(dir, load, &opts).context("--device cuda")?;
    let load_secs = t_load.elapsed().as_secs_f64();
    let cfg = model.config().clone();
    let tokenizer = if Tokenizer::present_in(dir) {
        Some(Tokenizer::from_dir(dir)?)
    } else {
        None
    };
    let prompt: Vec<u32> = match (&args.prompt, &args.prompt_ids) {
        (_, Some(ids)) => ids.clone(),
        (Some(text), None) => tokenizer
            .as_ref()
            .with_context(|| {
                format!(
                    "{} has no tiktoken.model or tokenizer.json; pass --prompt-ids",
                    dir.display()
                )
            })?
            .encode(text),
        (None, None) => bail!("pass --prompt TEXT or --prompt-ids 1,2,3"),
    };
    if prompt.is_empty() {
        bail!("the prompt is empty; give at least one token");
    }
    if dev.probe_bandwidth {
        let g = model.gpu();
        let h2d = deltafin_cuda::probe::h2d_pinned(g, 256 << 20, 5)?;
        let d2d = deltafin_cuda::probe::d2d(g, 1 << 30, 5)?;
        eprintln!(
            "[probe] pinned host->device {h2d:.1} GB/s; device->device {d2d:.1} GB/s (read+write)"
        );
    }
    let stats = Stats::default();
    let vocab = cfg.vocab_size;
    let dump = args.dump_logits.is_some();
    let mut session = model.new_session()?;
    let t0 = Instant::now();
    let rows = if dump {
        LogitRows::All
    } else {
        LogitRows::Last
    };
    let logits = model.forward(&mut session, &prompt, rows, &stats)?;
    let prefill_secs = t0.elapsed().as_secs_f64();
    let after_prefill = model.counters();
    let mut dumped = if dump { logits.clone() } else { Vec::new() };
    let mut last = logits[logits.len() - vocab..].to_vec();
    let stop: Vec<u32> = if args.ignore_eos {
        vec![]
    } else {
        cfg.eos_token_id.into_iter().collect()
    };
    let mut tokens = Vec::new();
    let mut step_secs = Vec::new();
    let mut step_h2d = Vec::new();
    let mut out = std::io::stdout().lock();
    for _ in 0..args.max_new {
        let next = argmax(&last);
        tokens.push(next);
        if dump {
            dumped.extend_from_slice(&last);
        }
        if let Some(tok) = &tokenizer {
            out.write_all(&tok.decode_bytes(&[next])?)?;
            out.flush()?;
        }
        if stop.contains(&next) || tokens.len() == args.max_new {
            break;
        }
        let (t, c0) = (Instant::now(), model.counters());
        last = model.forward(&mut session, &[next], LogitRows::Last, &stats)?;
        step_secs.push(t.elapsed().as_secs_f64());
        step_h2d.push(model.counters().h2d_bytes - c0.h2d_bytes);
    }
    if tokenizer.is_some() {
        writeln!(out)?;
    }
    if args.print_ids || tokenizer.is_none() {
        writeln!(out, "{}", serde_json::to_string(&tokens)?)?;
    }
    if let Some(path) = &args.dump_logits {
        npy::write_f32(path, dumped.len() / vocab, vocab, &dumped)?;
    }
    let c = model.counters();
    let decode: f64 = step_secs.iter().sum();
    // Steady state: the second half of the decode steps (caches warm).
    let half = &step_secs[step_secs.len() / 2..];
    let half_h2d: u64 = step_h2d[step_h2d.len() / 2..].iter().sum();
    let half_secs: f64 = half.iter().sum();
    let mut sorted = step_secs.clone();
    let med = deltafin_cuda::probe::median(&mut sorted);
    eprintln!(
        "[cuda] {} | load {load_secs:.2}s | prefill {} tok {prefill_secs:.3}s | decode {} steps {decode:.3}s, median step {:.3} ms ({:.1} tok/s) | expert slots {} x {} B | VRAM hits {} misses {} | h2d {:.1} MB ({}), host copy time {:.3}s | 2nd half: {:.1} MB/step h2d, {:.2} GB/s | spine {:.1} MB/token, experts {:.1} MB/token | spine layers streamed {} of {}, {:.1} MB h2d/token",
        model.kernels(),
        prompt.len(),
        step_secs.len(),
        med * 1e3,
        1.0 / med.max(1e-12),
        model.expert_slots(),
        model.record_len(),
        c.vram_hits,
        c.vram_misses,
        c.h2d_bytes as f64 / 1e6,
        if model.copies_from_slab() {
            "from the page-locked RAM cache"
        } else {
            "staged"
        },
        c.stage_secs,
        half_h2d as f64 / 1e6 / half.len().max(1) as f64,
        half_h2d as f64 / half_secs.max(1e-12) / 1e9,
        model.spine_bytes_per_token() as f64 / 1e6,
        stats.bytes() as f64 / 1e6 / (prompt.len() + step_secs.len()) as f64,
        model.spine_layers_streamed(),
        cfg.num_layers,
        (c.spine_h2d_bytes - after_prefill.spine_h2d_bytes) as f64
            / 1e6
            / step_secs.len().max(1) as f64,
    );
    Ok(())
}
