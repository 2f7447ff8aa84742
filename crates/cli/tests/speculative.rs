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

/// The number after `label` in `line` (up to the next space, `(`, `,` or `%`).
fn number(line: &str, label: &str) -> f64 {
    let at = line
        .find(label)
        .unwrap_or_else(|| panic!("no {label:?} in {line}"))
        + label.len();
    let end = line[at..]
        .find([' ', '(', ',', '%'])
        .map_or(line.len(), |e| at + e);
    line[at..end]
        .parse()
        .unwrap_or_else(|_| panic!("{label:?} in {line}"))
}

/// `--stats` with the spine streamed: the `[speculative]` line accounts for every generated token (one from
/// the prompt's pass, one from each decode pass, one per guess taken) and every guess compared (taken or
/// refused), and the spine bytes per generated token are every pass's streamed spine — the same per pass as
/// plain decoding's, over fewer passes.
#[test]
fn the_stats_lines_account_for_every_pass_token_and_byte() {
    let model = repo_root().join("models").join("shakespeare-k3");
    let drafter = repo_root().join("models").join("shakespeare-k3-drafter");
    let stats = |extra: &[&str]| -> (String, String) {
        let out = bin()
            .arg("run")
            .arg("--model")
            .arg(&model)
            // The smallest budget with every expert cached: no spine layer stays resident.
            .args([
                "--prompt",
                "ROMEO:",
                "--max-new",
                "60",
                "--ignore-eos",
                "--stats",
            ])
            .args(["--expert-cache", "16M", "--memory-budget", "25598464"])
            .args(extra)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "{err}");
        let line = |tag: &str| {
            err.lines()
                .find(|l| l.starts_with(tag))
                .unwrap_or("")
                .to_string()
        };
        (line("[stats]"), line("[speculative]"))
    };
    let (plain, _) = stats(&[]);
    // Plain decoding: one pass per generated token (the prompt's, then one per decode step).
    let per_pass = number(&plain, "spine ");
    assert!(per_pass > 1.0, "the spine streams: {plain}");
    let drafter = drafter.to_str().unwrap();
    let (spec, line) = stats(&["--draft", drafter, "--draft-tokens", "3", "--draft-fixed"]);
    let generated = number(&line, "%); ");
    assert_eq!(generated, 60.0, "{line}");
    let (taken, proposed) = (number(&line, "guesses per pass: "), number(&line, " of "));
    assert!(
        (number(&line, "taken (") - 100.0 * taken / proposed).abs() < 0.06,
        "{line}"
    );
    let by_k: Vec<f64> = line
        .split("passes by guesses checked ")
        .nth(1)
        .unwrap()
        .split(" | ")
        .next()
        .unwrap()
        .split(' ')
        .map(|kn| kn.split(':').nth(1).unwrap().parse().unwrap())
        .collect();
    let refused: f64 = line
        .split("refused at guess ")
        .nth(1)
        .unwrap()
        .split(" | ")
        .next()
        .unwrap()
        .split(' ')
        .map(|kn| kn.split(':').nth(1).unwrap().parse::<f64>().unwrap())
        .sum();
    let passes: f64 = by_k.iter().sum();
    assert_eq!(by_k.len(), 4, "k = 0..=3: {line}");
    assert_eq!(
        number(&line, "took "),
        passes - by_k[0],
        "checking passes: {line}"
    );
    assert_eq!(1.0 + passes + taken, generated, "every token: {line}");
    assert_eq!(taken + refused, proposed, "every guess compared: {line}");
    // The prompt's pass and the decode passes each read the whole streamed spine.
    let spine = number(&spec, "spine ") * generated / (1.0 + passes);
    assert!((spine - per_pass).abs() < 0.01, "{spec} vs {plain}");
    assert!(number(&spec, "spine ") < number(&plain, "spine "));
}
