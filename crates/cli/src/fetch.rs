//! `fetch` and `checksums`: mirroring a remote repository, and publishing a checkpoint so mirrors can verify it.

use crate::store_args::{bytes_bar, parse_size, HttpArgs};
use anyhow::{bail, Result};
use clap::Args;
use deltafin_remote::MirrorOptions;
use deltafin_store::Backfill;
use std::path::PathBuf;

#[derive(Args)]
pub struct FetchArgs {
    /// The repository: a Hugging Face repo URL (https://huggingface.co/ORG/NAME) or the base URL of any HTTP(S)
    /// server that answers range requests (the directory holding config.json).
    #[arg(long, value_name = "URL")]
    from: String,
    /// The local directory (created; an interrupted fetch resumes into it).
    #[arg(long)]
    out: PathBuf,
    /// Fetch the small files and the spine only; routed experts then arrive on first use (`run --model OUT`).
    #[arg(long, conflicts_with = "layers")]
    spine_only: bool,
    /// Also fetch every routed expert of these layers, e.g. 1-3,5 (default: all layers, a complete copy).
    #[arg(long)]
    layers: Option<String>,
    /// Disk for routed experts (e.g. 200G); least recently used ones are removed beyond it.
    #[arg(long, value_name = "SIZE")]
    disk_cache: Option<String>,
    #[command(flatten)]
    http: HttpArgs,
}

/// Experts asked for at once: a whole K3 layer is 15 GB, more than one request should hold in memory.
const BATCH: usize = 16;

pub fn fetch(a: FetchArgs) -> Result<()> {
    let source = a.http.source(&a.from)?;
    let opts = MirrorOptions {
        disk_budget: a.disk_cache.as_deref().map(parse_size).transpose()?,
    };
    let bar = bytes_bar("spine");
    let mut m = deltafin_remote::open_mirror(&a.out, Some(source), opts, &|done, total| {
        bar.set_length(total);
        bar.set_position(done);
    })?;
    bar.finish_and_clear();
    let all = m.expert_layers();
    let layers: Vec<(usize, usize)> = match (&a.layers, a.spine_only) {
        (_, true) => Vec::new(),
        (None, false) => all.clone(),
        (Some(spec), false) => {
            let want = deltafin_remote::parse_layers(spec)?;
            if let Some(bad) = want.iter().find(|l| !all.iter().any(|(m, _)| m == *l)) {
                let moe: Vec<usize> = all.iter().map(|x| x.0).collect();
                bail!("--layers names layer {bad}, which has no routed experts; the MoE layers are {moe:?}");
            }
            all.iter()
                .filter(|(l, _)| want.contains(l))
                .copied()
                .collect()
        }
    };
    let total: usize = layers.iter().map(|x| x.1).sum();
    let bar = bytes_bar("experts");
    bar.set_length(total as u64 * m.record_len() as u64);
    for &(layer, n) in &layers {
        let ids: Vec<usize> = (0..n).collect();
        for batch in ids.chunks(BATCH) {
            m.ensure(layer, batch, &|_, _| false)?;
            bar.inc((batch.len() * m.record_len()) as u64);
        }
    }
    bar.finish_and_clear();
    let whole = m.complete()?;
    println!(
        "{}: mirror of {}: spine {}, {} experts local",
        a.out.display(),
        m.url(),
        match m.spine_status() {
            Some(true) => "verified",
            _ => "unverified",
        },
        m.experts_present(),
    );
    println!("{}", m.activity());
    println!("verification: {}", m.verification());
    match whole {
        Some(w) => println!("complete: {w}; an ordinary checkpoint from now on"),
        None => println!(
            "partial: missing experts are fetched on first use by `deltafin run --model {}`",
            a.out.display()
        ),
    }
    Ok(())
}

#[derive(Args)]
pub struct ChecksumsArgs {
    /// The checkpoint directory to describe; deltafin.checksums.json is written into it.
    #[arg(long)]
    model: PathBuf,
}

pub fn checksums(a: ChecksumsArgs) -> Result<()> {
    deltafin_formats::mirror::require_complete(&a.model, "hashing it")?;
    let c = crate::progress::while_busy("hashing every file and tensor", || {
        deltafin_formats::checksums::Checksums::compute(&a.model)
    })?;
    c.write(&a.model)?;
    println!(
        "{}: {} files and {} tensors; serve this directory and mirrors verify every byte they fetch",
        a.model
            .join(deltafin_formats::checksums::FILE)
            .display(),
        c.files.len(),
        c.tensors.len()
    );
    Ok(())
}
