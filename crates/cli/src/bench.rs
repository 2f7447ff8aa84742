//! `deltafin bench`: decode on an I/O-shaped K3 (real 17,547,264-byte expert records, top-16 routing, about
//! 10 GB) — or with `--arch` the `bench` preset of gpt_oss, deepseek_v3 or kimi_k2, each with its release's
//! expert records — against the drive's own bandwidth measured in the same run with the same read path.
//!
//! Per decode step: t_io = bytes read / disk bandwidth (the I/O bound), t_compute = step time minus the time
//! the model waited for reads (what the step costs with the bytes at hand), efficiency = max(t_io, t_compute)
//! / t_step. Medians over the steps of several runs.
//!
//! `--compute` measures the compute path instead: every expert cached, against the memory bandwidth (the CPU's
//! parallel read, or with `--device cuda` the GPU's device-to-device copy), measured in the same run.

use crate::device::DeviceArgs;
use crate::store_args::{parse_size, StoreArgs};
use anyhow::{bail, Context, Result};
use clap::Args;
use deltafin_cuda::Device;
use deltafin_makemodel::{config_json, make_model, Arch, Preset};
use deltafin_models::{Backend, LogitRows, Model, Pass, Stats};
use deltafin_store::{probe, Snapshot};
use serde_json::json;
use std::path::{Path, PathBuf};
use std::time::Instant;

#[derive(Args)]
pub struct BenchArgs {
    /// Where the bench model (about 10 GB) is created once and kept (default: the demo's cache directory).
    #[arg(long)]
    cache_dir: Option<PathBuf>,
    /// Decode steps measured per run.
    #[arg(long, default_value_t = 6)]
    tokens: usize,
    /// Runs per configuration (each on a fresh session and a fresh store; the median step is reported).
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// The expert cache of the third configuration (default: what `deltafin run` would choose here, sized
    /// from the memory this process may use). One that holds every record is filled in the background
    /// first, and its steps are measured once it is full.
    #[arg(long)]
    budget: Option<String>,
    /// Sessions decoding together, one batched pass a step (tok/s counts every session's token).
    #[arg(long, default_value_t = 1)]
    batch: usize,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
    /// Instead of the I/O benchmark: prefill and decode speed on a kimi_k3 model (--preset) with every expert
    /// cached, against the memory-bandwidth bound measured in the same run. With --device cuda: the bench
    /// model with every expert resident in VRAM, against the GPU's device-to-device copy bandwidth.
    #[arg(long)]
    compute: bool,
    /// With --compute on the CPU: the model, created in the cache directory on first use: small (hidden 512,
    /// 260 MB), wide (K3's real widths, about 4 GB) or bench (K3's expert shapes, about 10 GB).
    #[arg(long, default_value = "small", value_parser = compute_preset)]
    preset: Preset,
    /// The I/O benchmark's model: the bench preset of kimi_k3, gpt_oss, deepseek_v3 or kimi_k2
    /// (docs/presets.md), created in the cache directory on first use.
    #[arg(long, default_value = "kimi_k3")]
    arch: Arch,
    #[command(flatten)]
    device: DeviceArgs,
}

struct Step {
    secs: f64,
    bytes: u64,
    wait: f64,
    /// Time the drive had reads outstanding.
    busy: f64,
    /// The same records read again through the same path with nothing else to do (pure I/O time).
    replay: f64,
    requests: u64,
    hits: u64,
    /// Seconds the run waited, before its steps, for the background fill of a cache that holds every record.
    fill: f64,
    /// CPU seconds the process used in the step, all threads (on a shared machine, what the step cost
    /// whatever share of the cores it got).
    cpu: f64,
}

pub fn bench(a: BenchArgs) -> Result<()> {
    if a.tokens == 0 || a.runs == 0 || a.batch == 0 {
        bail!("--tokens, --runs and --batch must be at least 1");
    }
    let cache = match &a.cache_dir {
        Some(d) => d.clone(),
        None => crate::default_cache_dir()?,
    };
    if a.compute && a.arch != Arch::KimiK3 {
        bail!(
            "--compute measures kimi_k3 presets (--preset); --arch picks the I/O benchmark's model"
        );
    }
    match (a.compute, a.device.device) {
        (true, Device::Cpu) => return compute_bench(&cache, &a),
        (true, Device::Cuda(ordinal)) => return gpu_bench(&cache, &a, ordinal),
        (false, Device::Cuda(_)) => {
            bail!("--device cuda measures the compute path: add --compute (the I/O benchmark reads the drive)")
        }
        (false, Device::Cpu) => {}
    }
    if a.arch == Arch::KimiLinear {
        bail!("--arch kimi_linear has no bench preset: choose kimi_k3, gpt_oss, deepseek_v3 or kimi_k2");
    }
    let dir = cached_model(&cache, a.arch, Preset::Bench)?;
    // The probe reads in the model's own record size.
    let record = Model::load_with(&dir, &StoreArgs::default().load_options(&dir)?)?
        .store()
        .record_len();
    // The drive, measured through the engine's read path on the model's own largest shard — before every
    // configuration, since a shared virtual disk's speed drifts; the median is the bound.
    let shard = largest_shard(&dir)?;
    let measure = || probe::probe(&shard, 1 << 30, record, 1 << 20, 8, true);
    let disk = measure()?;
    let mut probes = vec![disk.gbps()];
    let dd_gbps = dd_direct(&shard);

    let budget = a.budget.as_deref().map(parse_size).transpose()?;
    let mut configs = Vec::new();
    for (name, cache, prefetch) in [
        ("cold, lookahead off", Some(0), false),
        ("cold, lookahead on", Some(0), true),
        ("budget, lookahead on", budget, true),
    ] {
        probes.push(measure()?.gbps());
        let mut steps = Vec::new();
        let mut cache_bytes = 0;
        for run in 0..a.runs {
            let mut store = StoreArgs {
                expert_cache: cache.map(|c| c.to_string()),
                ..StoreArgs::default()
            };
            store.no_prefetch = !prefetch;
            let load = store.load_options(&dir)?;
            cache_bytes = load.store.cache_bytes;
            let model = Model::load_with(&dir, &load)?;
            steps.extend(decode_steps(&model, a.tokens, run as u32, a.batch)?);
        }
        configs.push((name, cache_bytes, prefetch, steps));
    }
    let disk_gbps = median(probes.clone());
    let configs: Vec<_> = configs
        .into_iter()
        .map(|(n, c, p, steps)| (n, c, p, summarize(&steps, disk_gbps, a.batch)))
        .collect();

    if a.json {
        let out = json!({
            "machine": machine(),
            "disk_gbps": disk_gbps,
            "disk_probes_gbps": probes,
            "dd_direct_gbps": dd_gbps,
            "io_mode": format!("{:?}", disk.mode),
            "arch": a.arch.name(),
            "record_bytes": record,
            "batch": a.batch,
            "configs": configs.iter().map(|(name, cache, prefetch, s)| json!({
                "name": name, "expert_cache_bytes": cache, "prefetch": prefetch,
                "tok_per_s": s.tok_per_s, "step_s": s.step, "bytes_per_token": s.bytes,
                "achieved_read_gbps": s.read_gbps, "hit_rate": s.hit_rate,
                "t_io_s": s.t_io, "t_compute_s": s.t_compute, "efficiency": s.efficiency,
                "drive_busy_fraction": s.busy, "replay_gbps": s.replay_gbps,
                "achieved_over_probe": s.probe_ratio,
                "fill_wait_s": s.fill,
                "cpu_s": s.cpu,
            })).collect::<Vec<_>>(),
            // The headline keys: the cold configuration with lookahead on.
            "achieved_read_gbps": configs[1].3.read_gbps,
            "tok_per_s": configs[1].3.tok_per_s,
            "efficiency": configs[1].3.efficiency,
            "hit_rate": configs[2].3.hit_rate,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        println!("machine: {}", machine());
        if a.batch > 1 {
            println!(
                "{} sessions decode together, one batched pass a step",
                a.batch
            );
        }
        println!(
            "drive: {disk_gbps:.3} GB/s median of {} probes {:?} through deltafin's read path ({:?} I/O, 8 reads in flight); dd iflag=direct: {}",
            probes.len(),
            probes.iter().map(|p| format!("{p:.3}")).collect::<Vec<_>>(),
            disk.mode,
            dd_gbps.map_or("n/a".to_string(), |g| format!("{g:.3} GB/s"))
        );
        println!(
            "budget: an expert cache of {:.2} GiB ({}){}",
            configs[2].1 as f64 / (1u64 << 30) as f64,
            if a.budget.is_some() {
                "--budget"
            } else {
                "the default for this process's memory"
            },
            match configs[2].3.fill {
                0.0 => String::new(),
                f => format!(
                    "; it holds every record: steps measured after the background fill ({f:.1} s a run)"
                ),
            }
        );
        println!(
            "{:<22} {:>7} {:>7} {:>9} {:>9} {:>10} {:>6} {:>7} {:>8} {:>5} {:>5} {:>6}",
            "config",
            "tok/s",
            "step s",
            "MB/token",
            "read GB/s",
            "replay GB/s",
            "hit %",
            "t_io s",
            "t_comp s",
            "eff",
            "busy",
            "cpu s"
        );
        for (name, _, _, s) in &configs {
            println!(
                "{:<22} {:>7.3} {:>7.3} {:>9.1} {:>9.3} {:>10.3} {:>6.1} {:>7.3} {:>8.3} {:>5.2} {:>5.2} {:>6.3}",
                name,
                s.tok_per_s,
                s.step,
                s.bytes / 1e6,
                s.read_gbps,
                s.replay_gbps,
                100.0 * s.hit_rate,
                s.t_io,
                s.t_compute,
                s.efficiency,
                s.busy,
                s.cpu
            );
        }
        println!(
            "(medians over {} decode steps per config; read GB/s = bytes read / step time; t_io = the same bytes \
             re-read through the same path with nothing else running (replay GB/s); t_comp = step - I/O wait; \
             eff = max(t_io, t_comp) / step; busy = fraction of the step with reads outstanding; cpu s = CPU \
             time the process used in the step, all threads)",
            a.runs * a.tokens
        );
    }
    Ok(())
}

/// The seed-0 model of `arch` and `preset` (the bench presets: 4-10 GB) in `cache`, created on first use,
/// and again where the one there was made by an earlier version of the preset (its config.json differs),
/// so a changed preset is never measured on its old shape.
fn cached_model(cache: &Path, arch: Arch, preset: Preset) -> Result<PathBuf> {
    let dir = cache.join(format!("{}-{}-seed0", arch.name(), preset.name()));
    let config = dir.join("config.json");
    let want = config_json(arch, preset)?;
    match std::fs::read_to_string(&config) {
        Ok(have) if have == want => return Ok(dir),
        Ok(_) => {
            eprintln!(
                "{} was made by an earlier {} {} preset (its config.json differs from docs/presets.md's); \
                 removing it to make it again",
                dir.display(),
                arch.name(),
                preset.name()
            );
            std::fs::remove_dir_all(&dir)
                .with_context(|| format!("cannot remove the outdated {}", dir.display()))?;
        }
        Err(_) => {}
    }
    eprintln!(
        "creating the {} {} model in {} ...",
        arch.name(),
        preset.name(),
        dir.display()
    );
    crate::create_atomically(&dir, |tmp| make_model(arch, preset, 0, tmp).map(|_| ()))?;
    Ok(dir)
}

/// `tokens` greedy decode steps of `batch` sessions together (one batched pass a step), each after a 2-token
/// prompt whose ids depend on `seed` and its place in the batch (rotating prompts).
fn decode_steps(model: &Model, tokens: usize, seed: u32, batch: usize) -> Result<Vec<Step>> {
    let stats = Stats::with_routes();
    let mut sessions = Vec::with_capacity(batch);
    let mut next = Vec::with_capacity(batch);
    for i in 0..batch as u32 {
        let k = seed * batch as u32 + i;
        let mut session = model.new_session();
        let logits = model.forward(
            &mut session,
            &[17 + 31 * k, 400 + 7 * k],
            LogitRows::Last,
            &stats,
        )?;
        sessions.push(session);
        next.push(deltafin_engine::sampler::argmax(&logits));
    }
    let fill = wait_for_fill(model.store())?;
    let mut steps = Vec::with_capacity(tokens);
    stats.take_routes();
    for _ in 0..tokens {
        let before: Snapshot = model.store().snapshot();
        let (t0, cpu0) = (Instant::now(), process_cpu_secs());
        let chosen = greedy_step(model, &mut sessions, &next, false, &stats)?;
        let secs = t0.elapsed().as_secs_f64();
        let cpu = process_cpu_secs() - cpu0;
        let d = model.store().snapshot().since(&before);
        // Replay exactly the records this step read on demand (its misses), a layer's worth at a time.
        let mut keys: Vec<(usize, usize)> = stats
            .take_routes()
            .into_iter()
            .flat_map(|(l, ids)| ids.into_iter().map(move |e| (l, e)))
            .collect();
        keys.sort_unstable();
        keys.dedup();
        let misses = d.requests.saturating_sub(d.hits + d.prefetch_hits) as usize;
        let replay = if d.bytes_read() == 0 {
            0.0
        } else {
            // Hits were served from memory: replay as many records as the step actually read.
            let read_records = (d.bytes_read() as usize)
                .div_ceil(model.store().record_len())
                .min(keys.len())
                .max(misses.min(keys.len()));
            model
                .store()
                .time_reads(&keys[keys.len() - read_records..], 16)?
        };
        steps.push(Step {
            secs,
            bytes: d.bytes_read(),
            wait: d.wait_secs,
            busy: d.disk_busy_secs,
            replay,
            requests: d.requests,
            hits: d.hits + d.prefetch_hits,
            fill,
            cpu,
        });
        next = chosen;
    }
    Ok(steps)
}

/// A cache with a slot for every record is filled in the background from the first demand on, and until
/// the fill ends its reads, and the kernel zeroing the slab's pages they first touch, compete with the steps
/// for the drive and the cores (on the 2-core machine of BENCHMARKS.md this, not cached compute, made such
/// steps slower than cold ones). Waits for the fill, so the steps measure decoding from a full cache;
/// returns the seconds waited (0 where the cache cannot hold every record).
fn wait_for_fill(store: &deltafin_store::ExpertStore) -> Result<f64> {
    let t0 = Instant::now();
    while store.holds_every_record() && !store.all_cached() {
        if t0.elapsed().as_secs() >= 600 {
            bail!("the background fill of the expert cache did not finish within 10 minutes");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    Ok(if store.holds_every_record() {
        t0.elapsed().as_secs_f64()
    } else {
        0.0
    })
}

/// User and system CPU seconds of this process so far (all threads).
fn process_cpu_secs() -> f64 {
    // SAFETY: getrusage fills the struct it is given.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) } != 0 {
        return 0.0;
    }
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    secs(usage.ru_utime) + secs(usage.ru_stime)
}

/// One batched decode step: every session takes its token `next[i]`; returns each one's greedy choice. A lone
/// session's step lets the backend run the next one ahead (`Backend::decode`) when `more` follow, as `run`
/// does.
fn greedy_step<B: Backend>(
    model: &B,
    sessions: &mut [B::Session],
    next: &[u32],
    more: bool,
    stats: &Stats,
) -> Result<Vec<u32>> {
    if let ([session], [token]) = (&mut *sessions, next) {
        let logits = model.decode(session, *token, more, stats)?;
        return Ok(vec![deltafin_engine::sampler::argmax(&logits)]);
    }
    let mut passes: Vec<Pass<'_, _>> = sessions
        .iter_mut()
        .zip(next)
        .map(|(session, t)| Pass {
            session,
            tokens: std::slice::from_ref(t),
            rows: LogitRows::Last,
        })
        .collect();
    let logits = model.forward_batch(&mut passes, stats)?;
    Ok(logits
        .iter()
        .map(|l| deltafin_engine::sampler::argmax(l))
        .collect())
}

struct Summary {
    /// Median seconds a run waited for the background fill before its steps.
    fill: f64,
    /// Median CPU seconds a step.
    cpu: f64,
    replay_gbps: f64,
    probe_ratio: f64,
    busy: f64,
    step: f64,
    tok_per_s: f64,
    bytes: f64,
    read_gbps: f64,
    hit_rate: f64,
    t_io: f64,
    t_compute: f64,
    efficiency: f64,
}

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// t_io is the replay: the same records read again through the same path in the same run, nothing else
/// running — the drive's bandwidth on exactly these bytes. (The probe median is reported beside it: on a
/// shared virtual disk with a host cache, a probe of other bytes can be far off in either direction.)
fn summarize(steps: &[Step], disk_gbps: f64, batch: usize) -> Summary {
    let step = median(steps.iter().map(|s| s.secs).collect());
    let compute = |s: &Step| (s.secs - s.wait).max(0.0);
    Summary {
        fill: median(steps.iter().map(|s| s.fill).collect()),
        cpu: median(steps.iter().map(|s| s.cpu).collect()),
        busy: median(steps.iter().map(|s| s.busy / s.secs).collect()),
        step,
        tok_per_s: batch as f64 / step,
        bytes: median(
            steps
                .iter()
                .map(|s| s.bytes as f64 / batch as f64)
                .collect(),
        ),
        read_gbps: median(
            steps
                .iter()
                .map(|s| s.bytes as f64 / s.secs / 1e9)
                .collect(),
        ),
        replay_gbps: median(
            steps
                .iter()
                .filter(|s| s.replay > 0.0)
                .map(|s| s.bytes as f64 / s.replay / 1e9)
                .collect(),
        ),
        probe_ratio: median(
            steps
                .iter()
                .map(|s| s.bytes as f64 / s.secs / 1e9 / disk_gbps)
                .collect(),
        ),
        hit_rate: steps.iter().map(|s| s.hits).sum::<u64>() as f64
            / steps.iter().map(|s| s.requests).sum::<u64>().max(1) as f64,
        t_io: median(steps.iter().map(|s| s.replay).collect()),
        t_compute: median(steps.iter().map(compute).collect()),
        efficiency: median(
            steps
                .iter()
                .map(|s| s.replay.max(compute(s)) / s.secs)
                .collect(),
        ),
    }
}

fn largest_shard(dir: &Path) -> Result<PathBuf> {
    std::fs::read_dir(dir)
        .with_context(|| format!("cannot list {}", dir.display()))?
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().ends_with(".safetensors"))
        .max_by_key(|e| e.metadata().map(|m| m.len()).unwrap_or(0))
        .map(|e| e.path())
        .with_context(|| format!("{} has no shards", dir.display()))
}

/// The cross-check: `dd iflag=direct` over the same file (None where dd is missing or refuses).
fn dd_direct(file: &Path) -> Option<f64> {
    let out = std::process::Command::new("dd")
        .arg(format!("if={}", file.display()))
        .args(["of=/dev/null", "bs=4M", "count=256", "iflag=direct"])
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&out.stderr);
    // "... bytes (...) copied, 1.23 s, 870 MB/s"
    let line = text.lines().find(|l| l.contains("copied"))?;
    let bytes: f64 = line.split_whitespace().next()?.parse().ok()?;
    let secs: f64 = line
        .split(", ")
        .find(|p| p.ends_with(" s"))?
        .trim_end_matches(" s")
        .parse()
        .ok()?;
    Some(bytes / secs / 1e9)
}

fn machine() -> String {
    let cpu = crate::host::cpu_name()
        .unwrap_or_else(|| format!("unknown {} CPU", std::env::consts::ARCH));
    // Other processes' load, which a shared machine's timings depend on (Linux only).
    let load = std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|l| Some(format!(", load average {}", l.split_whitespace().next()?)))
        .unwrap_or_default();
    format!(
        "{cpu}, {} threads, {:.0} GiB RAM, kernels {}{load}",
        rayon::current_num_threads(),
        crate::memory::physical_memory().unwrap_or(0) as f64 / (1u64 << 30) as f64,
        deltafin_kernels::isa()
    )
}

fn compute_preset(s: &str) -> Result<Preset> {
    match s.parse()? {
        p @ (Preset::Small | Preset::Wide | Preset::Bench) => Ok(p),
        p => bail!(
            "--preset {}: the compute benchmark runs small, wide or bench",
            p.name()
        ),
    }
}

/// Prefill and decode on `a.preset` with all experts in the RAM cache: the compute path alone.
fn compute_bench(cache: &Path, a: &BenchArgs) -> Result<()> {
    let dir = cached_model(cache, Arch::KimiK3, a.preset)?;
    // Room for every record, so the warm-up run leaves each expert cached.
    let plain = StoreArgs::default();
    let needs = deltafin_models::memory_needs(&dir, &plain.load_options(&dir)?.store)?;
    let store = StoreArgs {
        expert_cache: Some((needs.records * needs.slot).to_string()),
        ..plain
    };
    let model = Model::load_with(&dir, &store.load_options(&dir)?)?;
    let prompt = compute_prompt();
    let memory = ReadProbe::new();
    sessions_decode(&model, &prompt, a)?; // warm the expert cache
                                          // Bytes one decode step touches: every resident spine matrix once, plus the routed experts its rows chose
                                          // (each once); a token's share is the step's over the batch.
    let spine = deltafin_models::spine_bytes(&dir)?;
    let batch = a.batch as f64;
    let (mut prefills, mut steps, mut expert_bytes) = (Vec::new(), Vec::new(), Vec::new());
    let (mut bandwidths, mut bounds, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..a.runs {
        let (p, s, e) = sessions_decode(&model, &prompt, a)?;
        // The bound is measured right after each run and the ratio taken per run: on a machine whose other
        // work comes and goes, a run and its bound then share the same conditions.
        let bw = memory.bandwidth();
        let step = s.iter().sum::<f64>() / s.len() as f64 / batch;
        let bound = (spine as f64 + e) / batch / bw;
        prefills.push(p);
        steps.push(step);
        expert_bytes.push(e);
        bandwidths.push(bw);
        bounds.push(bound);
        ratios.push(bound / step);
    }
    let expert_per_token = median(expert_bytes) / batch;
    let bw = median(bandwidths);
    let step = median(steps);
    let prefill = median(prefills);
    let bound = median(bounds);
    println!("machine: {}", machine());
    println!("model: kimi_k3 {} ({})", a.preset.name(), dir.display());
    if a.batch > 1 {
        println!(
            "{} sessions decode together, one batched pass a step (per-token figures: a step over {})",
            a.batch, a.batch
        );
    }
    println!(
        "memory read bandwidth: {:.2} GB/s (after each run, the median of 5 parallel reads of 1 GiB)",
        bw / 1e9
    );
    println!(
        "prefill: {:.1} tok/s ({} tokens in {:.3}s)",
        prompt.len() as f64 / prefill,
        prompt.len(),
        prefill
    );
    println!(
        "decode: {:.2} tok/s ({:.2} ms/token); bytes per token {:.1} MB (spine {:.1} MB + experts {:.1} MB); memory bound {:.2} ms/token; efficiency {:.2}",
        1.0 / step,
        step * 1e3,
        (spine as f64 / batch + expert_per_token) / 1e6,
        spine as f64 / batch / 1e6,
        expert_per_token / 1e6,
        bound * 1e3,
        median(ratios)
    );
    println!("(efficiency: the median over runs of each run's bound / its step)");
    print_runs(a, prompt.len());
    Ok(())
}

/// The compute benchmarks' last line: what their medians are over.
fn print_runs(a: &BenchArgs, prompt_len: usize) {
    println!(
        "(medians over {} runs of a {prompt_len}-token prefill and {} decode steps)",
        a.runs, a.tokens
    );
}

/// The compute benchmarks' 64-token prompt.
fn compute_prompt() -> Vec<u32> {
    (0..64).map(|i| (i * 37 + 11) % 4096).collect()
}

/// `a.batch` sessions, each after `prompt` rotated by its place (so the sessions route apart; the first one's
/// prefill is timed), then `a.tokens` greedy decode steps of all of them together. Returns (prefill secs, each
/// step's secs, expert bytes a step).
fn sessions_decode<B: Backend>(
    model: &B,
    prompt: &[u32],
    a: &BenchArgs,
) -> Result<(f64, Vec<f64>, f64)> {
    let stats = Stats::default();
    let mut sessions = Vec::with_capacity(a.batch);
    let mut next = Vec::with_capacity(a.batch);
    let mut prefill = 0.0;
    for i in 0..a.batch {
        let mut s = model.new_session()?;
        let mut p = prompt.to_vec();
        p.rotate_left(i % prompt.len());
        let t0 = Instant::now();
        let logits = model.forward(&mut s, &p, LogitRows::Last, &stats)?;
        if i == 0 {
            prefill = t0.elapsed().as_secs_f64();
        }
        sessions.push(s);
        next.push(deltafin_engine::sampler::argmax(&logits));
    }
    let bytes0 = stats.bytes();
    let mut steps = Vec::with_capacity(a.tokens);
    for i in 0..a.tokens {
        let t = Instant::now();
        next = greedy_step(model, &mut sessions, &next, i + 1 < a.tokens, &stats)?;
        steps.push(t.elapsed().as_secs_f64());
    }
    Ok((
        prefill,
        steps,
        (stats.bytes() - bytes0) as f64 / a.tokens as f64,
    ))
}

/// A 1 GiB buffer for measuring the memory read bandwidth, written (so faulted in) once.
struct ReadProbe(Vec<u64>);

impl ReadProbe {
    fn new() -> Self {
        ReadProbe((0..(1u64 << 27)).collect())
    }

    /// Bytes per second of a parallel sequential read of the buffer, median of 5.
    fn bandwidth(&self) -> f64 {
        use rayon::prelude::*;
        let mut runs: Vec<f64> = (0..5)
            .map(|_| {
                let t0 = Instant::now();
                let sum: u64 = self
                    .0
                    .par_chunks(1 << 16)
                    .map(|c| c.iter().fold(0u64, |a, &x| a ^ x))
                    .reduce(|| 0, |a, b| a ^ b);
                std::hint::black_box(sum);
                (self.0.len() * 8) as f64 / t0.elapsed().as_secs_f64()
            })
            .collect();
        runs.sort_by(f64::total_cmp);
        runs[2]
    }
}

/// Prefill and decode on the GPU: the bench model (K3's expert shapes) with every expert resident in VRAM,
/// `batch` sessions a step, against the device-to-device copy bandwidth measured in the same run. A step
/// touches the spine once and each expert its rows chose once.
fn gpu_bench(cache: &Path, a: &BenchArgs, ordinal: usize) -> Result<()> {
    // Before creating 10 GB for nothing.
    deltafin_cuda::availability().context("--device cuda")?;
    let dir = cached_model(cache, Arch::KimiK3, Preset::Bench)?;
    // The RAM expert cache holds every expert (about 10 GB), and from it the VRAM cache.
    let store = StoreArgs {
        expert_cache: Some("12G".into()),
        ..StoreArgs::default()
    };
    let model = a
        .device
        .load_cuda(ordinal, &dir, &store.load_options(&dir)?, false)?;
    let d2d = deltafin_cuda::probe::d2d(model.gpu(), 1 << 30, 5)? * 1e9;
    let prompt = compute_prompt();
    sessions_decode(&model, &prompt, a)?; // the kernels' first launches
    let (mut prefills, mut steps, mut expert_bytes) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..a.runs {
        let (p, s, e) = sessions_decode(&model, &prompt, a)?;
        prefills.push(p);
        steps.extend(s);
        expert_bytes.push(e);
    }
    let spine = model.spine_bytes_per_token() as f64;
    let experts = median(expert_bytes);
    let step = median(steps);
    let prefill = median(prefills);
    let bound = (spine + experts) / d2d;
    let batch = a.batch as f64;
    println!("machine: {}; GPU: {}", machine(), model.kernels());
    println!(
        "device->device copy bandwidth: {:.1} GB/s (read + write, median of 5 copies of 1 GiB)",
        d2d / 1e9
    );
    println!(
        "prefill: {:.1} tok/s ({} tokens in {:.4}s)",
        prompt.len() as f64 / prefill,
        prompt.len(),
        prefill
    );
    println!(
        "decode, {} session(s) a step: {:.1} tok/s, step {:.3} ms ({:.3} ms a token); bytes a step {:.1} MB \
         (spine {:.1} MB + experts {:.1} MB: {:.1} MB a token); bound {:.3} ms a step; {:.2} x the bound",
        a.batch,
        batch / step,
        step * 1e3,
        step * 1e3 / batch,
        (spine + experts) / 1e6,
        spine / 1e6,
        experts / 1e6,
        (spine + experts) / batch / 1e6,
        bound * 1e3,
        step / bound
    );
    print_runs(a, prompt.len());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A model made by an earlier version of a preset is made again, not measured on its old shape.
    #[test]
    fn a_cached_model_of_an_older_preset_is_made_again() {
        let cache = tempfile::tempdir().unwrap();
        let dir = cached_model(cache.path(), Arch::GptOss, Preset::Tiny).unwrap();
        let config = dir.join("config.json");
        let want = std::fs::read_to_string(&config).unwrap();
        let older = want.replace("\"num_hidden_layers\": 4", "\"num_hidden_layers\": 2");
        assert_ne!(older, want);
        std::fs::write(&config, older).unwrap();
        std::fs::write(dir.join("stale"), "").unwrap();
        assert_eq!(
            cached_model(cache.path(), Arch::GptOss, Preset::Tiny).unwrap(),
            dir
        );
        assert_eq!(std::fs::read_to_string(&config).unwrap(), want);
        assert!(
            !dir.join("stale").exists(),
            "the old directory was replaced"
        );
    }
}
