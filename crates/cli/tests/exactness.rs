//! Exactness against independent references (design.md, "Exactness" 1): logits within 1e-4 relative of a
//! float64 reference at every prompt position and for 8 decode steps; Kimi Linear also against transformers.

mod common;
use common::*;
use deltafin_makemodel::Arch;

const TOL: f64 = 1e-4;

/// Engine rows are: P prompt rows, then row P+j = the logits that chose generated[j]. The reference is
/// teacher-forced on prompt + generated[..n-1], so engine row P+j is reference row P−1+j.
fn check_against_reference(arch: Arch, seed: u64, prompt: &[u32]) {
    let t = tiny(arch, seed);
    let model = model_dir(&t);
    let n_new = 8;
    let ours = run_dump(&model, prompt, n_new, &[]);
    let p = prompt.len();
    assert_eq!(ours.rows, p + n_new);
    let generated: Vec<u32> = (0..n_new).map(|j| argmax(ours.row(p + j))).collect();
    let mut ids = prompt.to_vec();
    ids.extend_from_slice(&generated[..n_new - 1]);
    let reference = reference_logits(&model, &ids);
    let mut worst = 0.0f64;
    for r in 0..ours.rows {
        let rr = if r < p { r } else { r - 1 };
        let what = format!("{arch:?} row {r}");
        worst = worst.max(assert_row_close(&what, ours.row(r), reference.row(rr), TOL));
    }
    // The references must agree on the tokens too (they are argmaxes of rows that agree to 1e-4).
    for (j, &g) in generated.iter().enumerate() {
        assert_eq!(
            argmax(reference.row(p - 1 + j)),
            g,
            "{arch:?}: greedy token {j} differs from the reference"
        );
    }
    eprintln!(
        "{arch:?}: worst relative error {worst:e} over {} rows; generated {generated:?}",
        ours.rows
    );
}

#[test]
fn kimi_k3_tiny_matches_the_float64_reference() {
    check_against_reference(
        Arch::KimiK3,
        1,
        &[5, 300, 17, 42, 511, 99, 256, 7, 64, 128, 1, 480],
    );
}

#[test]
fn kimi_k3_tiny_second_seed_matches_the_float64_reference() {
    check_against_reference(Arch::KimiK3, 7, &[200, 3, 3, 3, 77, 401, 12]);
}

#[test]
fn kimi_linear_tiny_matches_the_float64_reference() {
    check_against_reference(
        Arch::KimiLinear,
        1,
        &[5, 300, 17, 42, 511, 99, 256, 7, 64, 128, 1, 480],
    );
}

/// Goldens made by tools/oracle/kimi_linear_golden.py with transformers 5.17 (see the fixture's README).
#[test]
fn kimi_linear_matches_transformers_goldens() {
    let fixture = repo_root().join("tests/fixtures/kimi_linear_tiny");
    let golden: serde_json::Value =
        serde_json::from_slice(&std::fs::read(fixture.join("golden.json")).unwrap()).unwrap();
    let ids = |k: &str| -> Vec<u32> {
        golden[k]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect()
    };
    let (prompt, generated) = (ids("prompt_ids"), ids("generated_ids"));
    let gold = deltafin_formats::npy::read(&fixture.join("golden_logits.npy")).unwrap();
    let ours = run_dump(&fixture, &prompt, generated.len(), &[]);
    let p = prompt.len();
    // Golden row t follows token t of prompt + generated; ours as in check_against_reference.
    for r in 0..ours.rows {
        let gr = if r < p { r } else { r - 1 };
        let what = format!("row {r} against transformers");
        assert_row_close(&what, ours.row(r), gold.row(gr), TOL);
    }
    let ours_generated: Vec<u32> = (0..generated.len())
        .map(|j| argmax(ours.row(p + j)))
        .collect();
    assert_eq!(
        ours_generated, generated,
        "greedy tokens differ from transformers"
    );
}

/// The reference checks itself (hand-written MXFP4 values, KDA/MLA identities); CI runs it here.
#[test]
fn float64_reference_selftest_passes() {
    let out = python()
        .arg(repo_root().join("tools/reference/selftest.py"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "selftest failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The trained Shakespeare target and drafter (tools/train/) against their PyTorch float64 goldens: same
/// greedy tokens, every row within 1e-4 (see docs/trained-model.md).
#[test]
fn trained_models_match_their_pytorch_goldens() {
    let out = python()
        .arg(repo_root().join("tools/train/check_agreement.py"))
        .arg("--engine")
        .arg(env!("CARGO_BIN_EXE_deltafin"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "check_agreement failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
