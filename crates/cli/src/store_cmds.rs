//! `pack` and `disk-probe`: building expert packs and measuring drives.

use crate::store_args::parse_size;
use anyhow::{bail, Context, Result};
use clap::Args;
use deltafin_store::{pack, probe};
use indicatif::{ProgressBar, ProgressStyle};
use std::path::{Path, PathBuf};

#[derive(Args)]
pub struct PackArgs {
    /// The checkpoint directory whose routed experts are packed.
    #[arg(long)]
    model: PathBuf,
    /// One output directory per drive (repeat the flag to stripe over several drives).
    #[arg(long = "out", required = true)]
    outs: Vec<PathBuf>,
    /// Stripe weights, one per --out (e.g. 2,1 puts twice the bytes on the first drive). Default: measured
    /// read bandwidth of each directory's drive when there are several, else 1.
    #[arg(long, value_delimiter = ',')]
    weights: Option<Vec<f64>>,
}

#[derive(Args)]
pub struct DiskProbeArgs {
    /// Directory on the drive to measure (a probe file is written there once and reused).
    #[arg(default_value = ".")]
    dir: PathBuf,
    /// Bytes read per measurement.
    #[arg(long, default_value = "1G")]
    size: String,
    /// Record size of the scattered reads (a K3 expert is 17,547,264 bytes).
    #[arg(long, default_value_t = 17_547_264)]
    record: usize,
    /// Chunk size each record is split into.
    #[arg(long, default_value = "1M")]
    chunk: String,
    /// Reads in flight; several values are measured in turn (e.g. 1,4,8,16).
    #[arg(long, value_delimiter = ',', default_value = "8")]
    workers: Vec<usize>,
    /// Read through the page cache (the probe file's pages are dropped first) instead of O_DIRECT.
    #[arg(long)]
    buffered_io: bool,
    /// Which reader to measure: the engine's thread pool ("pool"), io_uring ("uring"), or both.
    #[arg(long, default_value = "pool", value_parser = ["pool", "uring", "both"])]
    engine: String,
}

pub fn pack(a: PackArgs) -> Result<()> {
    deltafin_formats::mirror::require_complete(&a.model, "packing it")?;
    let (sources, layers, record_len) = deltafin_store::record::expert_sources(&a.model)?;
    let identity = deltafin_models::model_identity(&a.model)?;
    let weights = match a.weights {
        Some(w) => w,
        None if a.outs.len() == 1 => vec![1.0],
        None => a
            .outs
            .iter()
            .map(|d| {
                let gbps = probe_stripe(d).with_context(|| {
                    format!(
                        "measuring the read bandwidth of {} to size its stripe; pass --weights (e.g. --weights {}) to skip the measurement",
                        d.display(),
                        vec!["1"; a.outs.len()].join(",")
                    )
                })?;
                eprintln!("{}: {gbps:.2} GB/s", d.display());
                Ok(gbps)
            })
            .collect::<Result<Vec<f64>>>()?,
    };
    let total: usize = layers.iter().map(Vec::len).sum();
    if total == 0 {
        bail!("{} has no routed experts to pack", a.model.display());
    }
    let bar = ProgressBar::new(total as u64);
    bar.set_style(
        ProgressStyle::with_template("packing {bar:40} {pos}/{len} experts ({eta} left)").unwrap(),
    );
    let m = pack::write_pack(
        &sources,
        &layers,
        record_len,
        &identity,
        &a.outs,
        &weights,
        &mut |done, _| bar.set_position(done as u64),
    )?;
    bar.finish_and_clear();
    println!(
        "packed {} experts of {} bytes into {} stripe(s): {}",
        m.records.len(),
        m.record_len,
        m.stripes.len(),
        m.stripes
            .iter()
            .map(|s| s.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    );
    Ok(())
}

/// The read bandwidth of a stripe directory's drive, in GB/s: 256 MiB written there, read back, removed.
fn probe_stripe(dir: &Path) -> Result<f64> {
    const PROBE_BYTES: u64 = 256 << 20;
    create_dir(dir)?;
    let f = probe::probe_file(dir, PROBE_BYTES)?;
    let r = probe::probe(&f, PROBE_BYTES, 4 << 20, 1 << 20, 8, true);
    let _ = std::fs::remove_file(&f);
    Ok(r?.gbps())
}

fn create_dir(dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))
}

pub fn disk_probe(a: DiskProbeArgs) -> Result<()> {
    let size = parse_size(&a.size)?;
    let chunk = parse_size(&a.chunk)? as usize;
    if chunk == 0 || !chunk.is_multiple_of(deltafin_store::io::ALIGN) || a.record == 0 {
        bail!("--chunk must be a positive multiple of 4096 and --record positive");
    }
    create_dir(&a.dir)?;
    let file = probe::probe_file(&a.dir, size)?;
    let engines: &[&str] = match a.engine.as_str() {
        "both" => &["pool", "uring"],
        "uring" => &["uring"],
        _ => &["pool"],
    };
    for (&w, &engine) in a
        .workers
        .iter()
        .flat_map(|w| engines.iter().map(move |e| (w, e)))
    {
        probe::drop_cache(&file);
        let r = if engine == "uring" {
            probe::probe_uring(&file, size, a.record, chunk, w.max(1), !a.buffered_io)?
        } else {
            probe::probe(&file, size, a.record, chunk, w.max(1), !a.buffered_io)?
        };
        println!(
            "{} [{engine}]: {:.3} GB/s ({} MB in {:.2}s, {:?} I/O, {} reads in flight, {} KiB chunks)",
            a.dir.display(),
            r.gbps(),
            r.bytes / 1_000_000,
            r.secs,
            r.mode,
            r.workers,
            chunk / 1024
        );
    }
    Ok(())
}

#[derive(Args)]
pub struct CacheSimArgs {
    /// Routing traces: `deltafin run --events` files (JSON lines with a "routes" list of [layer, ids]).
    #[arg(required = true)]
    traces: Vec<PathBuf>,
    /// Cache capacities to simulate, in expert records.
    #[arg(long, value_delimiter = ',', default_value = "64,128,256,512")]
    capacity: Vec<usize>,
}

/// Replays routing traces through each eviction policy at several capacities and prints the hit rates: the
/// measurement behind the default `--cache-policy`.
pub fn cache_sim(a: CacheSimArgs) -> Result<()> {
    let mut passes: Vec<Vec<(usize, usize)>> = Vec::new();
    for path in &a.traces {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read {}", path.display()))?;
        for (n, line) in text
            .lines()
            .enumerate()
            .filter(|(_, l)| !l.trim().is_empty())
        {
            let v: serde_json::Value = serde_json::from_str(line)
                .with_context(|| format!("{}:{}: not a JSON line", path.display(), n + 1))?;
            let routes = v["routes"]
                .as_array()
                .with_context(|| format!("{}:{}: no \"routes\" list", path.display(), n + 1))?;
            // One pass requests each layer's union once, in layer order.
            let mut keys: Vec<(usize, usize)> = Vec::new();
            for r in routes {
                let (Some(layer), Some(ids)) = (r[0].as_u64(), r[1].as_array()) else {
                    bail!(
                        "{}:{}: a route must be [layer, [ids]]",
                        path.display(),
                        n + 1
                    );
                };
                for id in ids {
                    let key = (
                        layer as usize,
                        id.as_u64().context("expert ids must be integers")? as usize,
                    );
                    if !keys.contains(&key) {
                        keys.push(key);
                    }
                }
            }
            passes.push(keys);
        }
    }
    let requests: usize = passes.iter().map(Vec::len).sum();
    println!("{} passes, {requests} expert requests", passes.len());
    println!("{:>9} {:>8} {:>8} {:>8}", "capacity", "lru", "lfu", "blend");
    for &cap in &a.capacity {
        let rates: Vec<String> = ["lru", "lfu", "blend"]
            .iter()
            .map(|p| {
                format!(
                    "{:>7.1}%",
                    100.0 * simulate(&passes, cap, p.parse().expect("known policy"))
                )
            })
            .collect();
        println!("{cap:>9} {}", rates.join(" "));
    }
    Ok(())
}

fn simulate(
    passes: &[Vec<(usize, usize)>],
    capacity: usize,
    policy: deltafin_store::policy::Policy,
) -> f64 {
    let mut state = deltafin_store::policy::State::new(policy);
    let mut slots: Vec<(usize, usize)> = Vec::new();
    let (mut hits, mut total) = (0usize, 0usize);
    for pass in passes {
        for &key in pass {
            total += 1;
            if slots.contains(&key) {
                hits += 1;
            } else if slots.len() < capacity {
                slots.push(key);
            } else if let Some(v) = state.victim(slots.iter().copied().enumerate()) {
                slots[v] = key;
            }
            state.touch(key);
        }
    }
    hits as f64 / total.max(1) as f64
}
