//! Reproducibility (design.md, "Exactness" 2–3): bit-identical logits across runs and thread counts, a
//! prefill of n tokens equal to n single-token steps, and a batch of sessions equal to each session's own pass.

mod common;
use common::*;
use deltafin_makemodel::Arch;
use deltafin_models::{Backend, LogitRows, Model, Pass, Stats};

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

/// Sessions at different positions in one batched pass — a decode token, a verification of three, a fresh
/// prompt — get exactly the logits of their own passes, and continue exactly as those would.
#[test]
fn batched_sessions_equal_their_own_passes() {
    for arch in [Arch::KimiK3, Arch::KimiLinear] {
        let t = tiny(arch, 5);
        let model = Model::load(&model_dir(&t)).unwrap();
        let stats = Stats::default();
        let mut a = model.new_session();
        model
            .forward(&mut a, &PROMPT, LogitRows::Last, &stats)
            .unwrap();
        let mut b = model.new_session();
        model
            .forward(&mut b, &PROMPT[..4], LogitRows::Last, &stats)
            .unwrap();
        let c = model.new_session();
        let work: [(&[u32], LogitRows); 3] = [
            (&[77], LogitRows::Last),
            (&[3, 8, 12], LogitRows::All),
            (&[400, 2, 9, 31, 6], LogitRows::Last),
        ];
        let mut own = Vec::new();
        for (s, (tokens, rows)) in [&a, &b, &c].into_iter().zip(work) {
            let mut s1 = s.clone();
            let first = model.forward(&mut s1, tokens, rows, &stats).unwrap();
            let next = model
                .forward(&mut s1, &[11], LogitRows::Last, &stats)
                .unwrap();
            own.push((first, next));
        }
        let mut sessions = [a.clone(), b.clone(), c.clone()];
        let mut batch: Vec<Pass<'_, _>> = sessions
            .iter_mut()
            .zip(work)
            .map(|(session, (tokens, rows))| Pass {
                session,
                tokens,
                rows,
            })
            .collect();
        let firsts = model.forward_batch(&mut batch, &stats).unwrap();
        // The same sessions continue together, one token each.
        let mut batch: Vec<Pass<'_, _>> = sessions
            .iter_mut()
            .map(|session| Pass {
                session,
                tokens: &[11],
                rows: LogitRows::Last,
            })
            .collect();
        let nexts = model.forward_batch(&mut batch, &stats).unwrap();
        for (i, (first, next)) in firsts.into_iter().zip(nexts).enumerate() {
            assert_eq!(
                first.len(),
                own[i].0.len(),
                "{arch:?}: session {i}'s logit rows"
            );
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert!(
                bits(&first) == bits(&own[i].0),
                "{arch:?}: session {i}'s batched logits differ"
            );
            assert!(
                bits(&next) == bits(&own[i].1),
                "{arch:?}: session {i}'s next step differs"
            );
            assert_eq!(
                model.position(&sessions[i]),
                [12, 8, 6][i],
                "{arch:?}: session {i}'s position"
            );
        }
    }
}
