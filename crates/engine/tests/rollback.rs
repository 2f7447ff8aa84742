//! Rolling a session back after a multi-row pass, which is what a refused speculative guess costs on the CPU:
//! the state after restoring to row r is bit for bit the state a plain pass over the first r rows leaves (on
//! every layer kind, with the spine streamed too), it continues the same, and speculative generation with a
//! refusal at every position of a pass hands out exactly the plain tokens and logits.

use deltafin_engine::*;
use deltafin_makemodel::{make_model, Arch, Preset};
use deltafin_models::{Backend, LoadOptions, LogitRows, Model, Stats};
use std::path::Path;
use std::sync::Arc;

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// `arch`'s tiny checkpoint, with every spine layer streamed from disk when `streamed`.
fn tiny(arch: Arch, dir: &Path, streamed: bool) -> Model {
    make_model(arch, Preset::Tiny, 3, dir).unwrap();
    if !streamed {
        return Model::load(dir).unwrap();
    }
    // The smallest budget the model accepts keeps no layer resident; its refusal names it.
    let too_small = LoadOptions {
        memory_budget: Some(1),
        ..Default::default()
    };
    let refusal = Model::load_with(dir, &too_small).err().unwrap().to_string();
    let floor: u64 = refusal
        .split("needs at least ")
        .nth(1)
        .and_then(|r| r.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no floor in: {refusal}"));
    let opts = LoadOptions {
        memory_budget: Some(floor),
        ..Default::default()
    };
    let model = Model::load_with(dir, &opts).unwrap();
    assert!(model.streamed_layers() > 0);
    model
}

fn rollback_leaves_what_a_shorter_pass_leaves(model: &Model) {
    let stats = Stats::default();
    let vocab = model.config().vocab_size;
    let ids =
        |n: usize, a: usize| -> Vec<u32> { (0..n).map(|i| ((i * a + 5) % vocab) as u32).collect() };
    let (prompt, pass) = (ids(9, 31), ids(5, 17));
    let mut base = Model::new_session(model);
    model
        .forward(&mut base, &prompt, LogitRows::Last, &stats)
        .unwrap();
    for rows in 1..=pass.len() {
        let mut plain = model.fork(&base).unwrap();
        let plain_logits = model
            .forward(&mut plain, &pass[..rows], LogitRows::All, &stats)
            .unwrap();
        let mut kept = model.fork(&base).unwrap();
        assert!(model.keep_rows(&mut kept), "the CPU rolls back");
        let all = model
            .forward(&mut kept, &pass, LogitRows::All, &stats)
            .unwrap();
        assert!(bits(&all[..rows * vocab]) == bits(&plain_logits));
        model.rollback(&mut kept, rows).unwrap();
        assert_eq!(model.position(&kept), prompt.len() + rows);
        assert!(
            kept.state_bits() == plain.state_bits(),
            "the state after {rows} of {} rows",
            pass.len()
        );
        assert_eq!(model.session_bytes(&kept), model.session_bytes(&plain));
        assert!(
            model.rollback(&mut kept, 1).is_err(),
            "a rollback consumes what the pass kept"
        );
        // Both continue the same, over several passes.
        for next in [&[7u32, 8][..], &[9]] {
            let a = model
                .forward(&mut kept, next, LogitRows::All, &stats)
                .unwrap();
            let b = model
                .forward(&mut plain, next, LogitRows::All, &stats)
                .unwrap();
            assert!(bits(&a) == bits(&b), "continuing after {rows} rows");
        }
    }
    // A pass that did not ask to keep its rows cannot be rolled back.
    let mut s = model.fork(&base).unwrap();
    model
        .forward(&mut s, &pass, LogitRows::Last, &stats)
        .unwrap();
    assert!(model.rollback(&mut s, 2).is_err());
}

#[test]
fn a_rollback_leaves_the_state_a_shorter_pass_leaves() {
    for (arch, streamed) in [
        (Arch::KimiK3, false),
        (Arch::KimiK3, true),
        (Arch::KimiLinear, false),
    ] {
        let dir = tempfile::tempdir().unwrap();
        rollback_leaves_what_a_shorter_pass_leaves(&tiny(arch, dir.path(), streamed));
    }
}

/// Runs `req` to the end: its tokens, the bits of every logit vector that chose them, and the session's
/// next logits after one more token (what the session left behind holds).
fn generate_all(
    model: &Model,
    req: &Request,
    draft: Option<&mut Draft<Model>>,
) -> (Vec<u32>, Vec<Vec<u32>>, Vec<u32>) {
    let stats = Stats::default();
    let mut logits = Vec::new();
    let on_token = |_: u32, l: &[f32]| {
        logits.push(bits(l));
        Flow::Continue
    };
    let session = Model::new_session(model);
    let (out, mut session) = match draft {
        Some(d) => generate_speculative_in(model, d, session, req, &stats, on_token),
        None => generate_in(model, session, req, &stats, on_token),
    }
    .unwrap();
    let after = model
        .forward(&mut session, &[3], LogitRows::Last, &stats)
        .unwrap();
    (out.tokens, logits, bits(&after))
}

#[test]
fn refusals_at_every_position_of_a_pass_change_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let model = Arc::new(tiny(Arch::KimiK3, dir.path(), false));
    let k = 4;
    let mut refused = vec![0; k];
    for seed in 0..4 {
        let req = Request {
            prompt: vec![1, 2, 3, 4, 5, 6, 7],
            max_new: 48,
            stop_ids: vec![],
            sampling: SamplingParams {
                temperature: 0.1 * (1 + seed) as f32,
                seed,
                ..Default::default()
            },
            prompt_logits: false,
        };
        let plain = generate_all(&model, &req, None);
        // The model guessing for itself greedily: its sampled choices refuse a guess here and there.
        let mut draft = Draft::new(Guesser::Model(model.clone()), &*model, k)
            .unwrap()
            .fixed();
        let spec = generate_all(&model, &req, Some(&mut draft));
        assert_eq!(plain.0, spec.0, "seed {seed}");
        assert!(plain.1 == spec.1, "logits, seed {seed}");
        assert!(plain.2 == spec.2, "the session left behind, seed {seed}");
        assert_eq!(draft.reruns, 0);
        refused
            .iter_mut()
            .zip(&draft.refused)
            .for_each(|(a, b)| *a += b);
    }
    assert!(
        refused.iter().all(|&n| n > 0),
        "a refusal at every guess position: {refused:?}"
    );
}
