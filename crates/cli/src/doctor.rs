//! `deltafin doctor`: what this machine offers (CPU features and the kernel path, memory, GPUs, disk read
//! bandwidth) and whether a model directory is healthy, one line per problem.

use crate::chat::chat_format;
use anyhow::{bail, Result};
use clap::Args;
use deltafin_formats::config::ModelConfig;
use deltafin_models::{LoadOptions, Model};
use deltafin_store::probe;
use deltafin_tokenizer::Tokenizer;
use std::path::{Path, PathBuf};

#[derive(Args)]
pub struct DoctorArgs {
    /// Check this checkpoint directory: config, every tensor, tokenizer, chat format (default: no model check).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Measure the read bandwidth of the drive holding this directory (default: the --model directory,
    /// else the current directory).
    #[arg(long)]
    disk: Option<PathBuf>,
    /// Size of the temporary file read for the bandwidth measurement, in MiB (0 skips the measurement).
    #[arg(long, default_value_t = 256)]
    disk_mib: u64,
}

pub fn doctor(a: DoctorArgs) -> Result<()> {
    println!("cpu: {}", cpu_line());
    println!("memory: {}", memory_line());
    println!("expert cache: {}", expert_cache_line());
    match deltafin_cuda::gpu::describe() {
        Ok(gpus) => gpus.iter().for_each(|g| println!("gpu: {g}")),
        Err(e) => println!("gpu: none usable ({e:#})"),
    }
    let disk = a
        .disk
        .clone()
        .or_else(|| a.model.clone())
        .unwrap_or_else(|| PathBuf::from("."));
    if a.disk_mib > 0 {
        match disk_bandwidth(&disk, a.disk_mib << 20) {
            Ok(line) => println!("disk: {line}"),
            Err(e) => println!("disk: {}: cannot measure ({e:#})", disk.display()),
        }
    }
    let Some(dir) = &a.model else {
        return Ok(());
    };
    let problems = check_model(dir);
    if problems.is_empty() {
        println!("model {}: ok", dir.display());
        return Ok(());
    }
    for p in &problems {
        println!("problem: {p}");
    }
    bail!(
        "{} has {} problem(s), listed above; fix them or re-download the checkpoint.",
        dir.display(),
        problems.len()
    )
}

fn cpu_line() -> String {
    let name = crate::host::cpu_name().unwrap_or_else(|| std::env::consts::ARCH.to_string());
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    format!(
        "{name}, {cores} threads available; features: {}; kernels: {} (this CPU runs: {}; --isa chooses)",
        crate::host::cpu_features().join(" "),
        deltafin_kernels::isa(),
        deltafin_kernels::isas().join(", ")
    )
}

#[cfg(target_os = "macos")]
fn memory_line() -> String {
    let gib = |bytes: u64| bytes as f64 / (1u64 << 30) as f64;
    match crate::host::memory() {
        Some(m) => match m.available {
            Some(avail) => format!(
                "{:.1} GiB total, {:.1} GiB available",
                gib(m.total),
                gib(avail)
            ),
            None => format!("{:.1} GiB total", gib(m.total)),
        },
        None => "unknown (sysctl hw.memsize failed)".into(),
    }
}

#[cfg(not(target_os = "macos"))]
fn memory_line() -> String {
    let total = crate::memory::physical_memory().map_or("unknown".into(), |t| {
        format!("{:.1} GiB total", t as f64 / (1u64 << 30) as f64)
    });
    match crate::memory::allowance() {
        Some(a) => format!("{total}; this process: {a}"),
        None => total,
    }
}

/// Which memory the expert cache uses, and at what first-touch cost (BENCHMARKS.md, "First touch").
fn expert_cache_line() -> String {
    let slab = "an anonymous slab, each page cleared by the kernel on first use";
    if !cfg!(target_os = "linux") {
        return format!("{slab} (--map-experts needs Linux)");
    }
    // The mode is the bracketed word, e.g. "always [madvise] never".
    let thp = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
        .ok()
        .and_then(|s| {
            let mode = s.split_whitespace().find(|w| w.starts_with('['))?;
            Some(mode.trim_matches(['[', ']']).to_string())
        });
    let steps = match thp {
        Some(mode) => format!(
            "read ahead in 2 MiB steps (transparent huge pages available, mode {mode}; the mappings ask for \
             them with MADV_HUGEPAGE)"
        ),
        None => "read ahead in steps of the drive's read-ahead setting (this kernel has no transparent huge \
                 pages, which the mappings would ask for)"
            .into(),
    };
    let host = if free_page_reporting() {
        "; this VM hands freed memory back to its host, so a page first used after a drop of caches or \
         another process's exit is backed again by the host on first touch, whichever way the cache fills it"
    } else {
        ""
    };
    format!(
        "{slab}; with --map-experts and every expert fitting, the page cache through read-only mappings \
         of the model's files, {steps}, with no page to clear{host}"
    )
}

/// A virtio balloon (device id 5) offering free page reporting (feature bit 5): the guest's free memory goes
/// back to the host, which makes first touches dear (BENCHMARKS.md, "First touch").
fn free_page_reporting() -> bool {
    let Ok(devices) = std::fs::read_dir("/sys/bus/virtio/devices") else {
        return false;
    };
    devices.flatten().any(|d| {
        let read = |f: &str| std::fs::read_to_string(d.path().join(f)).unwrap_or_default();
        // `features` lists the negotiated bits as '0'/'1' characters, bit 0 first.
        read("device").trim() == "0x0005" && read("features").as_bytes().get(5) == Some(&b'1')
    })
}

/// Reads a temporary file of `bytes` in `dir` with direct I/O where the filesystem allows it, then
/// removes it. A quick look; `deltafin disk-probe` measures more thoroughly.
fn disk_bandwidth(dir: &Path, bytes: u64) -> Result<String> {
    let existed = dir.join(".deltafin-probe").exists();
    let file = crate::progress::while_busy("measuring disk read bandwidth", || {
        probe::probe_file(dir, bytes)
    })?;
    let result = probe::probe(&file, bytes, 8 << 20, 1 << 20, 4, true);
    if !existed {
        let _ = std::fs::remove_file(&file);
    }
    let r = result?;
    Ok(format!(
        "{}: {:.2} GB/s reading {} MiB ({:?} I/O, 4 reads in flight)",
        dir.display(),
        r.gbps(),
        r.bytes >> 20,
        r.mode
    ))
}

/// Every problem found in checkpoint `dir`, one sentence each (empty when healthy).
fn check_model(dir: &Path) -> Vec<String> {
    let mut problems = Vec::new();
    if !dir.is_dir() {
        return vec![format!("{} is not a directory", dir.display())];
    }
    let config = match ModelConfig::from_dir(dir) {
        Ok(c) => {
            println!(
                "config: {:?}, {} layers, vocab {}",
                c.family, c.num_layers, c.vocab_size
            );
            Some(c)
        }
        Err(e) => {
            problems.push(format!("config.json: {e:#}"));
            None
        }
    };
    let mut load = LoadOptions::default();
    match deltafin_formats::mirror::read_state(dir) {
        Ok(Some(state)) if !state.complete => {
            match deltafin_remote::Mirror::open(dir, None, Default::default()) {
                Ok(m) => {
                    let all: usize = m.expert_layers().iter().map(|l| l.1).sum();
                    println!(
                        "mirror of {}: {} of {all} experts local, {:.2} GB of shards on disk; {}",
                        state.url,
                        m.experts_present(),
                        deltafin_remote::mirror::disk_usage(dir).unwrap_or(0) as f64 / 1e9,
                        m.verification()
                    );
                    if m.spine_status().is_none() {
                        problems.push(format!(
                            "mirror: the spine is not fully fetched; run `deltafin fetch --from {} --out {}` to finish it",
                            state.url,
                            dir.display()
                        ));
                    }
                    load.backfill = Some(std::sync::Arc::new(m));
                }
                Err(e) => problems.push(format!("mirror: {e:#}")),
            }
        }
        Ok(_) => {}
        Err(e) => problems.push(format!("mirror: {e:#}")),
    }
    if config.is_some() {
        match crate::progress::while_busy("loading every tensor", || Model::load_with(dir, &load)) {
            Ok(_) => println!("weights: every expected tensor present with the right shape"),
            Err(e) => problems.push(format!("weights: {e:#}")),
        }
    }
    match Tokenizer::from_dir(dir) {
        Ok(tok) => {
            println!(
                "tokenizer: {} ranks, vocab {}",
                tok.num_ranks(),
                tok.vocab_size()
            );
            if let Some(c) = &config {
                if tok.vocab_size() > c.vocab_size {
                    problems.push(format!(
                        "tokenizer: ids go up to {} but config.json has vocab_size {}",
                        tok.vocab_size() - 1,
                        c.vocab_size
                    ));
                }
                if let Some(eos) = c.eos_token_id {
                    if tok.special_name(eos).is_none() {
                        problems.push(format!(
                            "tokenizer: eos_token_id {eos} of config.json is not a special token of tokenizer_config.json"
                        ));
                    }
                }
                match chat_format(dir, &tok, c.family) {
                    Ok(format) => println!("chat: {}", format.name()),
                    Err(e) => problems.push(format!("chat: {e:#}")),
                }
            }
        }
        Err(e) => problems.push(format!("tokenizer: {e:#}")),
    }
    problems
}
