//! Shared helpers for the CLI-level tests: make checkpoints, run the binary, call the Python references.
#![allow(dead_code)] // each test binary uses its own subset

pub mod golden;

use deltafin_formats::npy::{self, Array2};
use deltafin_makemodel::{make_model, Arch, Preset};
use deltafin_models::{Backend, LogitRows, Model, Stats};
use std::path::{Path, PathBuf};
use std::process::Command;

pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .unwrap()
}

pub fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_deltafin"))
}

pub fn tiny(arch: Arch, seed: u64) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("model");
    make_model(arch, Preset::Tiny, seed, &out).unwrap();
    dir
}

pub fn model_dir(t: &tempfile::TempDir) -> PathBuf {
    t.path().join("model")
}

/// Runs `deltafin run` greedily with `--dump-logits` and returns the logits rows.
pub fn run_dump(model: &Path, prompt: &[u32], max_new: usize, extra: &[&str]) -> Array2 {
    let dir = tempfile::tempdir().unwrap();
    let npy_path = dir.path().join("logits.npy");
    let ids: Vec<String> = prompt.iter().map(|i| i.to_string()).collect();
    let out = bin()
        .args(extra)
        .arg("run")
        .arg("--model")
        .arg(model)
        .arg("--prompt-ids")
        .arg(ids.join(","))
        .args([
            "--max-new",
            &max_new.to_string(),
            "--ignore-eos",
            "--dump-logits",
        ])
        .arg(&npy_path)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "deltafin run failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    npy::read(&npy_path).unwrap()
}

/// Index of the largest value, lowest index on ties (the engine's rule).
pub fn argmax(row: &[f64]) -> u32 {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best as u32
}

/// Prefill `prompt`, then `steps` greedy single-token steps; every logits row (prompt rows first) as raw bits.
pub fn greedy_logit_bits(model: &Model, prompt: &[u32], steps: usize) -> Vec<u32> {
    let stats = Stats::default();
    let mut s = model.new_session();
    let mut all = model
        .forward(&mut s, prompt, LogitRows::All, &stats)
        .unwrap();
    let vocab = model.config().vocab_size;
    for _ in 0..steps {
        let last: Vec<f64> = all[all.len() - vocab..].iter().map(|&x| x as f64).collect();
        let next = argmax(&last);
        all.extend(
            model
                .forward(&mut s, &[next], LogitRows::Last, &stats)
                .unwrap(),
        );
    }
    all.iter().map(|x| x.to_bits()).collect()
}

/// python3 with numpy, or a failure that says how to get it (never a silent skip).
pub fn python() -> Command {
    let ok = Command::new("python3")
        .args(["-c", "import numpy"])
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    assert!(
        ok,
        "these tests need python3 with numpy: run `python3 -m pip install numpy` (./test.sh does)"
    );
    Command::new("python3")
}

/// The float64 reference's logits for `ids` (teacher forcing, every position).
pub fn reference_logits(model: &Path, ids: &[u32]) -> Array2 {
    let dir = tempfile::tempdir().unwrap();
    let out_path = dir.path().join("ref.npy");
    let ids: Vec<String> = ids.iter().map(|i| i.to_string()).collect();
    let out = python()
        .arg(repo_root().join("tools/reference/reference.py"))
        .arg("--model")
        .arg(model)
        .args(["--ids", &ids.join(","), "--check-margins", "--out"])
        .arg(&out_path)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "reference failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!(
        "reference routing margins:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    npy::read(&out_path).unwrap()
}

/// [`rel_err`] of one row against its reference, failing above `tol`; `what` names the row.
pub fn assert_row_close(what: &str, ours: &[f64], reference: &[f64], tol: f64) -> f64 {
    let e = rel_err(ours, reference);
    assert!(e < tol, "{what}: relative error {e:e} exceeds {tol:e}");
    e
}

/// max |a − b| / max |b| over one row.
pub fn rel_err(a: &[f64], b: &[f64]) -> f64 {
    let err = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max);
    let scale = b.iter().map(|y| y.abs()).fold(0.0, f64::max);
    err / scale
}
