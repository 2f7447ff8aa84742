//! Speculative decoding changes how many tokens come out of one pass of the model, never which: tokens and
//! every dumped logit are bit-identical to a run without a drafter, greedy or sampled, whatever the drafter.

mod common;
use common::*;
use deltafin_makemodel::Arch;
use std::path::Path;

/// `run` with `extra` flags: (stdout, the raw bytes of the dumped logits).
fn run(model: &Path, prompt: &[&str], extra: &[&str]) -> (Vec<u8>, Vec<u8>) {
    let t = tempfile::tempdir().unwrap();
    let npy = t.path().join("l.npy");
    let out = bin()
        .arg("run")
        .arg("--model")
        .arg(model)
        .args(prompt)
        .args([
            "--max-new",
            "24",
            "--ignore-eos",
            "--print-ids",
            "--stats",
            "--dump-logits",
        ])
        .arg(&npy)
        .args(extra)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    if extra.contains(&"--draft") {
        assert!(err.contains("[speculative]"), "{err}");
    }
    (out.stdout, std::fs::read(npy).unwrap())
}

fn check(model: &Path, drafter: &Path, prompt: &[&str]) {
    for sampling in [
        &["--temperature", "0"][..],
        &["--temperature", "0.8", "--seed", "7"],
    ] {
        let plain = run(model, prompt, sampling);
        for k in ["1", "3", "6"] {
            let mut extra = sampling.to_vec();
            extra.extend(["--draft", drafter.to_str().unwrap(), "--draft-tokens", k]);
            let spec = run(model, prompt, &extra);
            assert!(plain.0 == spec.0, "tokens differ with {extra:?}");
            assert!(plain.1 == spec.1, "logits differ with {extra:?}");
        }
    }
}

#[test]
fn the_trained_drafter_changes_no_token_and_no_logit() {
    let root = repo_root().join("models");
    check(
        &root.join("shakespeare-k3"),
        &root.join("shakespeare-k3-drafter"),
        &["--prompt", "ROMEO:"],
    );
}

#[test]
fn a_random_drafter_that_is_mostly_wrong_changes_nothing_either() {
    let (target, drafter) = (tiny(Arch::KimiK3, 1), tiny(Arch::KimiK3, 2));
    check(
        &model_dir(&target),
        &model_dir(&drafter),
        &["--prompt-ids", "3,9,27,81"],
    );
    let linear = tiny(Arch::KimiLinear, 3);
    check(
        &model_dir(&linear),
        &model_dir(&drafter),
        &["--prompt-ids", "5,6"],
    );
}

#[test]
fn a_drafter_with_another_vocabulary_is_refused() {
    let t = tempfile::tempdir().unwrap();
    let small = t.path().join("small");
    deltafin_makemodel::make_model(Arch::KimiK3, deltafin_makemodel::Preset::Small, 0, &small)
        .unwrap();
    let target = tiny(Arch::KimiK3, 1);
    let out = bin()
        .args(["run", "--prompt-ids", "1,2", "--draft"])
        .arg(&small)
        .arg("--model")
        .arg(model_dir(&target))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("must share the model's tokenizer"), "{err}");
}
