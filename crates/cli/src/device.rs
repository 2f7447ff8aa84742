//! `--device cpu|cuda[:N]` for `run`, `chat` and `serve`: loading a model on the GPU backend (deltafin-cuda),
//! and the `[probe]` and `[cuda]` lines `run` prints of what the device did.

use crate::progress;
use anyhow::{Context, Result};
use clap::Args;
use deltafin_cuda::{CudaModel, CudaOptions, CudaSession, Device};
use deltafin_formats::config::ModelConfig;
use deltafin_models::{Backend, LoadOptions, Stats};
use deltafin_store::ExpertStore;
use std::path::Path;
use std::sync::{Arc, Mutex};
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
}

impl DeviceArgs {
    /// Loads `dir` on GPU `ordinal` (`--device cuda:ordinal`) within the VRAM budgets; `timeline`: `run
    /// --timeline`'s notes on.
    pub fn load_cuda(
        &self,
        ordinal: usize,
        dir: &Path,
        load: &LoadOptions,
        timeline: bool,
    ) -> Result<CudaModel> {
        let size = |s: &Option<String>| s.as_deref().map(crate::store_args::parse_size).transpose();
        let opts = CudaOptions {
            ordinal,
            expert_vram: size(&self.expert_vram)?,
            spine_vram: size(&self.spine_vram)?,
            timeline,
        };
        progress::while_busy("loading the model onto the GPU", || {
            CudaModel::load(dir, load, &opts)
        })
        .context("--device cuda")
    }
}

/// `--probe-bandwidth`: the raw pinned host-to-device and device-to-device copy bandwidths of the model's GPU.
pub fn probe_bandwidth(model: &CudaModel) -> Result<()> {
    let g = model.gpu();
    let h2d = deltafin_cuda::probe::h2d_pinned(g, 256 << 20, 5)?;
    let d2d = deltafin_cuda::probe::d2d(g, 1 << 30, 5)?;
    eprintln!(
        "[probe] pinned host->device {h2d:.1} GB/s; device->device {d2d:.1} GB/s (read+write)"
    );
    Ok(())
}

/// A CUDA model whose forward passes are each timed, with the bytes each copied to the device: what the
/// `[cuda]` line reports. A pass is timed from its call to its return (not the sampling or printing between
/// passes), except a decode step the previous one ran ahead: the GPU ran it while the host sampled and printed,
/// so it is timed from the previous step's return.
pub struct Timed<'m> {
    model: &'m CudaModel,
    passes: Mutex<Vec<Pass>>,
    /// When the last decode step returned, if it ran the next one ahead.
    ran_ahead: Mutex<Option<Instant>>,
}

struct Pass {
    tokens: usize,
    secs: f64,
    /// The host's part: issuing the pass's work.
    issue_secs: f64,
    /// The GPU's part: from the pass's first work to its last.
    gpu_secs: f64,
    h2d: u64,
    spine_h2d: u64,
    expert_bytes: u64,
}

impl<'m> Timed<'m> {
    /// Runs `pass` (of `tokens` rows) and notes its time, from `since` if given (else from now).
    fn timed<T>(
        &self,
        tokens: usize,
        since: Option<Instant>,
        stats: &Stats,
        pass: impl FnOnce() -> Result<T>,
    ) -> Result<T> {
        let (t, c0, bytes0) = (Instant::now(), self.model.counters(), stats.bytes());
        let out = pass()?;
        let secs = since.unwrap_or(t).elapsed().as_secs_f64();
        let c = self.model.counters();
        self.passes.lock().unwrap().push(Pass {
            tokens,
            secs,
            issue_secs: c.issue_secs - c0.issue_secs,
            gpu_secs: c.gpu_secs - c0.gpu_secs,
            h2d: c.h2d_bytes - c0.h2d_bytes,
            spine_h2d: c.spine_h2d_bytes - c0.spine_h2d_bytes,
            expert_bytes: stats.bytes() - bytes0,
        });
        Ok(out)
    }

    pub fn new(model: &'m CudaModel) -> Timed<'m> {
        Timed {
            model,
            passes: Mutex::new(Vec::new()),
            ran_ahead: Mutex::new(None),
        }
    }

    /// The `[cuda]` line: the first pass is the prompt's, every later one a decode step (with --draft, a step
    /// checks several tokens at once).
    pub fn line(&self, load_secs: f64) -> String {
        let passes = self.passes.lock().unwrap();
        let Some((prefill, steps)) = passes.split_first() else {
            return "[cuda] no forward pass ran".into();
        };
        let m = self.model;
        let c = m.counters();
        let step_secs: Vec<f64> = steps.iter().map(|p| p.secs).collect();
        let decode: f64 = step_secs.iter().sum();
        // Steady state: the second half of the decode steps (caches warm).
        let half = &steps[steps.len() / 2..];
        let half_h2d: u64 = half.iter().map(|p| p.h2d).sum();
        let half_secs: f64 = half.iter().map(|p| p.secs).sum();
        let med = deltafin_cuda::probe::median(&mut step_secs.clone());
        let mut issue: Vec<f64> = steps.iter().map(|p| p.issue_secs).collect();
        let med_issue = deltafin_cuda::probe::median(&mut issue);
        let mut gpu: Vec<f64> = steps.iter().map(|p| p.gpu_secs).collect();
        let med_gpu = deltafin_cuda::probe::median(&mut gpu);
        // Bytes a decode token touches (the prompt's pass reads each expert once for all its rows).
        let tokens: usize = steps.iter().map(|p| p.tokens).sum();
        let expert_bytes: u64 = steps.iter().map(|p| p.expert_bytes).sum();
        let step_spine_h2d: u64 = steps.iter().map(|p| p.spine_h2d).sum();
        format!(
            "[cuda] {} | load {load_secs:.2}s | prefill {} tok {:.3}s | decode {} steps {decode:.3}s, median step {:.3} ms ({:.1} tok/s), issued by the host in {:.3} ms, run by the GPU in {:.3} ms, {} steps run ahead taken over ({} discarded) | expert slots {} x {} B | VRAM hits {} misses {} | h2d {:.1} MB ({}), host copy time {:.3}s | 2nd half: {:.1} MB/step h2d, {:.2} GB/s | spine {:.1} MB/token, experts {:.1} MB/token | spine layers streamed {} of {}, {:.1} MB h2d/token",
            m.kernels(),
            prefill.tokens,
            prefill.secs,
            steps.len(),
            med * 1e3,
            1.0 / med.max(1e-12),
            med_issue * 1e3,
            med_gpu * 1e3,
            c.ahead_taken,
            c.ahead_discarded,
            m.expert_slots(),
            m.record_len(),
            c.vram_hits,
            c.vram_misses,
            c.h2d_bytes as f64 / 1e6,
            if m.copies_from_slab() {
                "from the page-locked RAM cache"
            } else {
                "staged"
            },
            c.stage_secs,
            half_h2d as f64 / 1e6 / half.len().max(1) as f64,
            half_h2d as f64 / half_secs.max(1e-12) / 1e9,
            m.spine_bytes_per_token() as f64 / 1e6,
            expert_bytes as f64 / 1e6 / tokens.max(1) as f64,
            m.spine_layers_streamed(),
            m.config().num_layers,
            step_spine_h2d as f64 / 1e6 / steps.len().max(1) as f64,
        )
    }
}

impl Backend for Timed<'_> {
    type Session = CudaSession;

    fn config(&self) -> &ModelConfig {
        self.model.config()
    }

    fn store(&self) -> &Arc<ExpertStore> {
        self.model.store()
    }

    fn kernels(&self) -> String {
        self.model.kernels()
    }

    fn reports_layers(&self) -> bool {
        self.model.reports_layers()
    }

    fn new_session(&self) -> Result<CudaSession> {
        self.model.new_session()
    }

    fn decode(
        &self,
        session: &mut CudaSession,
        token: u32,
        ahead: bool,
        stats: &Stats,
    ) -> Result<Vec<f32>> {
        let since = self.ran_ahead.lock().unwrap().take();
        let logits = self.timed(1, since, stats, || {
            self.model.decode(session, token, ahead, stats)
        })?;
        if ahead {
            *self.ran_ahead.lock().unwrap() = Some(Instant::now());
        }
        Ok(logits)
    }

    fn runs_ahead_on(&self, session: &CudaSession, token: u32) -> bool {
        self.model.runs_ahead_on(session, token)
    }

    fn forward_batch(
        &self,
        batch: &mut [deltafin_models::Pass<'_, CudaSession>],
        stats: &Stats,
    ) -> Result<Vec<Vec<f32>>> {
        *self.ran_ahead.lock().unwrap() = None;
        let tokens: usize = batch.iter().map(|p| p.tokens.len()).sum();
        self.timed(tokens, None, stats, || {
            self.model.forward_batch(batch, stats)
        })
    }

    fn fork(&self, session: &CudaSession) -> Result<CudaSession> {
        self.model.fork(session)
    }

    fn keep_rows(&self, session: &mut CudaSession) -> bool {
        self.model.keep_rows(session)
    }

    fn rollback(&self, session: &mut CudaSession, rows: usize) -> Result<()> {
        self.model.rollback(session, rows)
    }

    fn position(&self, session: &CudaSession) -> usize {
        self.model.position(session)
    }

    fn session_bytes(&self, session: &CudaSession) -> usize {
        self.model.session_bytes(session)
    }
}
