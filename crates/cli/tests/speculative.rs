//! Speculative decoding changes how many tokens come out of one pass of the model, never which: tokens and
//! every dumped logit are bit-identical to a run without a drafter, greedy or sampled, whatever the drafter
//! (a model or prompt lookup) and however many guesses each pass checks; a refused guess is rolled back, never
//! run again.

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
        assert!(err.contains("+ 0 re-runs of the model"), "{err}");
    }
    (out.stdout, std::fs::read(npy).unwrap())
}

/// `drafter`: a directory, or `ngram`. Every pass guessing 1, 3 or 6 tokens, and as many as the cost model
/// chooses.
fn check(model: &Path, drafter: &str, prompt: &[&str]) {
    for sampling in [
        &["--temperature", "0"][..],
        &["--temperature", "0.8", "--seed", "7"],
    ] {
        let plain = run(model, prompt, sampling);
        for k in [
            &["1", "--draft-fixed"][..],
            &["3", "--draft-fixed"],
            &["6", "--draft-fixed"],
            &["4"],
        ] {
            let mut extra = sampling.to_vec();
            extra.extend(["--draft", drafter, "--draft-tokens"]);
            extra.extend(k);
            let spec = run(model, prompt, &extra);
            assert!(plain.0 == spec.0, "tokens differ with {extra:?}");
            assert!(plain.1 == spec.1, "logits differ with {extra:?}");
        }
    }
}

#[test]
fn the_trained_drafter_changes_no_token_and_no_logit() {
    let root = repo_root().join("models");
    let drafter = root.join("shakespeare-k3-drafter");
    check(
        &root.join("shakespeare-k3"),
        drafter.to_str().unwrap(),
        &["--prompt", "ROMEO:"],
    );
}

#[test]
fn prompt_lookup_changes_no_token_and_no_logit() {
    let quoted =
        "ROMEO: But soft, what light through yonder window breaks?\nJULIET: ROMEO: But soft,";
    check(
        &repo_root().join("models").join("shakespeare-k3"),
        "ngram",
        &["--prompt", quoted],
    );
    let target = tiny(Arch::KimiK3, 1);
    check(
        &model_dir(&target),
        "ngram",
        &["--prompt-ids", "3,9,27,3,9,27,3"],
    );
}

#[test]
fn a_random_drafter_that_is_mostly_wrong_changes_nothing_either() {
    let (target, drafter) = (tiny(Arch::KimiK3, 1), tiny(Arch::KimiK3, 2));
    let drafter = model_dir(&drafter);
    let drafter = drafter.to_str().unwrap();
    check(&model_dir(&target), drafter, &["--prompt-ids", "3,9,27,81"]);
    let linear = tiny(Arch::KimiLinear, 3);
    check(&model_dir(&linear), drafter, &["--prompt-ids", "5,6"]);
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
