//! Reproducibility (design.md, "Exactness" 2–3): bit-identical logits across runs and thread counts, and a
//! prefill of n tokens equal to n single-token steps.

mod common;
use common::*;
use deltafin_makemodel::Arch;
use deltafin_models::{Backend, LogitRows, Model, Stats};

const PROMPT: [u32; 10] = [5, 300, 17, 42, 511, 99, 256, 7, 64, 128];

/// Prefill then 6 greedy steps; returns every logits row as raw bits.
fn logits_bits(model: &Model) -> Vec<u32> {
    greedy_logit_bits(model, &PROMPT, 6)
}

fn in_pool<T: Send>(threads: usize, f: impl FnOnce() -> T + Send) -> T {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap()
        .install(f)
}

#[test]
fn bit_identical_across_runs_and_thread_counts() {
    for arch in [Arch::KimiK3, Arch::KimiLinear] {
        let t = tiny(arch, 3);
        let model = Model::load(&model_dir(&t)).unwrap();
        let one = in_pool(1, || logits_bits(&model));
        let again = in_pool(1, || logits_bits(&model));
        let two = in_pool(2, || logits_bits(&model));
        let three = in_pool(3, || logits_bits(&model));
        assert!(one == again, "{arch:?}: two runs differ");
        assert!(one == two, "{arch:?}: 1 vs 2 threads differ");
        assert!(one == three, "{arch:?}: 1 vs 3 threads differ");
        // And a fresh load of the same files gives the same bits.
        let reloaded = Model::load(&model_dir(&t)).unwrap();
        assert!(
            one == in_pool(2, || logits_bits(&reloaded)),
            "{arch:?}: reload differs"
        );
    }
}

#[test]
fn prefill_equals_single_token_steps() {
    for arch in [Arch::KimiK3, Arch::KimiLinear] {
        let t = tiny(arch, 4);
        let model = Model::load(&model_dir(&t)).unwrap();
        let stats = Stats::default();
        let mut batch = model.new_session();
        let prefill = model
            .forward(&mut batch, &PROMPT, LogitRows::All, &stats)
            .unwrap();
        let mut single = model.new_session();
        let mut steps = Vec::new();
        for &tok in &PROMPT {
            steps.extend(
                model
                    .forward(&mut single, &[tok], LogitRows::All, &stats)
                    .unwrap(),
            );
        }
        let max_diff = prefill
            .iter()
            .zip(&steps)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(
            max_diff <= 1e-5,
            "{arch:?}: prefill vs steps differ by {max_diff}"
        );
        // Stronger than required: every row's arithmetic is independent of its batch, so the bits agree.
        assert!(
            prefill == steps,
            "{arch:?}: prefill and steps agree to {max_diff} but not bit for bit"
        );
        // The states they leave behind continue identically.
        let a = model
            .forward(&mut batch, &[9], LogitRows::Last, &stats)
            .unwrap();
        let b = model
            .forward(&mut single, &[9], LogitRows::Last, &stats)
            .unwrap();
        assert!(
            a == b,
            "{arch:?}: continuation after prefill differs from continuation after steps"
        );
    }
}

#[test]
fn chunked_prefill_equals_one_pass() {
    let t = tiny(Arch::KimiK3, 5);
    let model = Model::load(&model_dir(&t)).unwrap();
    let stats = Stats::default();
    let mut whole = model.new_session();
    let one = model
        .forward(&mut whole, &PROMPT, LogitRows::All, &stats)
        .unwrap();
    let mut parts = model.new_session();
    let mut two = model
        .forward(&mut parts, &PROMPT[..4], LogitRows::All, &stats)
        .unwrap();
    two.extend(
        model
            .forward(&mut parts, &PROMPT[4..], LogitRows::All, &stats)
            .unwrap(),
    );
    assert!(
        one == two,
        "a prompt split in two chunks must give the same bits as one pass"
    );
}
