//! `make-model --arch deepseek_v3|kimi_k2` checkpoints run end to end: `deltafin run` on each stored form
//! (FP8, INT4, BF16) agrees with tools/oracle/released_ref.py, which decodes the same released-layout files
//! itself in numpy float64, within 1e-4 relative at every prompt position and 8 decode steps, with the same
//! greedy tokens.

mod common;
use common::*;
use deltafin_formats::npy;
use deltafin_makemodel::{make_deepseek_model, Arch, Preset, Quant};
use std::path::Path;

const TOL: f64 = 1e-4;
const PROMPT: [u32; 6] = [5, 300, 17, 42, 260, 99];
const STEPS: usize = 8;

/// released_ref.py's logits for `ids`, teacher-forced.
fn released_ref(model: &Path, ids: &[u32]) -> npy::Array2 {
    let dir = tempfile::tempdir().unwrap();
    let out_path = dir.path().join("ref.npy");
    let script = "import sys, numpy as np, released_ref as r\n\
                  cfg, w = r.load_dir(sys.argv[1])\n\
                  ids = np.array([int(x) for x in sys.argv[2].split(',')])\n\
                  np.save(sys.argv[3], r.deepseek_forward(cfg, w, ids)[0].astype(np.float64))\n";
    let ids: Vec<String> = ids.iter().map(|i| i.to_string()).collect();
    let out = python()
        .current_dir(repo_root().join("tools/oracle"))
        .args(["-c", script])
        .arg(model)
        .arg(ids.join(","))
        .arg(&out_path)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "released_ref.py failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    npy::read(&out_path).unwrap()
}

fn runs_like_the_reference(arch: Arch, quant: Quant) {
    let dir = tempfile::tempdir().unwrap();
    make_deepseek_model(arch, Preset::Tiny, 2, quant, dir.path()).unwrap();
    let ours = run_dump(dir.path(), &PROMPT, STEPS, &[]);
    let p = PROMPT.len();
    assert_eq!(ours.rows, p + STEPS, "{arch:?} {quant:?}: rows");
    // Row p + j chose generated token j; row p repeats the last prompt row.
    let generated: Vec<u32> = (p..p + STEPS).map(|r| argmax(ours.row(r))).collect();
    let mut ids = PROMPT.to_vec();
    ids.extend(&generated[..STEPS - 1]);
    let want = released_ref(dir.path(), &ids);
    assert_eq!(want.rows, ids.len());
    let ours_rows = (0..p).chain(p + 1..p + STEPS).map(|r| ours.row(r));
    for (t, row) in ours_rows.enumerate() {
        let what = format!("{arch:?} {quant:?} position {t}");
        assert_row_close(&what, row, want.row(t), TOL);
        if t + 1 >= p {
            assert_eq!(
                argmax(row),
                argmax(want.row(t)),
                "{arch:?} {quant:?}: greedy token after position {t}"
            );
        }
    }
    assert!(
        generated.windows(2).any(|w| w[0] != w[1]),
        "{arch:?} {quant:?}: a constant generation {generated:?} would not test the decode"
    );
}

#[test]
fn deepseek_v3_fp8_runs_like_the_reference() {
    runs_like_the_reference(Arch::DeepseekV3, Quant::Fp8);
}

#[test]
fn kimi_k2_int4_runs_like_the_reference() {
    runs_like_the_reference(Arch::KimiK2, Quant::Int4);
}

#[test]
fn deepseek_v3_bf16_runs_like_the_reference() {
    runs_like_the_reference(Arch::DeepseekV3, Quant::Bf16);
}

#[test]
fn kimi_k2_fp8_runs_like_the_reference() {
    runs_like_the_reference(Arch::KimiK2, Quant::Fp8);
}
