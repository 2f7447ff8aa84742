//! On an NVIDIA GPU only, so ignored elsewhere (`tools/cuda/verify.sh` runs them on the GPU machine with
//! `--ignored`): the backend's contract where no CLI run reaches it.

use deltafin_cuda::{CudaModel, CudaOptions};
use deltafin_engine::{
    generate_in, generate_speculative_in, Draft, Flow, Guesser, Request, SamplingParams,
};
use deltafin_makemodel::{make_model, Arch, Preset};
use deltafin_models::{Backend, LoadOptions, LogitRows, Stats};
use std::path::Path;
use std::sync::Arc;

fn argmax(x: &[f32]) -> u32 {
    deltafin_engine::sampler::argmax(x)
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

fn tiny(arch: Arch, dir: &Path) -> CudaModel {
    make_model(arch, Preset::Tiny, 0, dir).unwrap();
    CudaModel::load(dir, &LoadOptions::default(), &CudaOptions::default()).unwrap()
}

/// Decode steps run ahead on the device's choice and taken over, discarded by another token, by a plain pass or
/// by another session's pass, or left in flight under a fork: every step's logits equal those of one pass over
/// the same tokens (a fresh session's prefill, another path through the kernels) bit for bit.
#[test]
#[ignore = "needs an NVIDIA GPU: tools/cuda/verify.sh runs it there"]
fn steps_run_ahead_compute_exactly_what_plain_passes_do() {
    // DeepSeek-V3 (FP8) and Kimi K2 (INT4 experts): RoPE at positions read on the device, the grouped router;
    // gpt-oss: the KV cache, sinks and the sliding window.
    for arch in [
        Arch::KimiK3,
        Arch::KimiLinear,
        Arch::DeepseekV3,
        Arch::KimiK2,
        Arch::GptOss,
    ] {
        let dir = tempfile::tempdir().unwrap();
        make_model(arch, Preset::Tiny, 0, dir.path()).unwrap();
        let model =
            CudaModel::load(dir.path(), &LoadOptions::default(), &CudaOptions::default()).unwrap();
        let (stats, vocab) = (Stats::default(), model.config().vocab_size as u32);
        let prompt = [3, 17, 42, 99, 7];
        let mut s = model.new_session().unwrap();
        let mut other = model.new_session().unwrap();
        let first = model
            .forward(&mut s, &prompt, LogitRows::Last, &stats)
            .unwrap();
        let (mut fed, mut rows) = (prompt.to_vec(), vec![first]);
        // 70 steps: the MLA and GQA caches outgrow their first 64 positions on the way (gpt-oss tiny's sliding
        // layers see 6).
        for i in 0..70 {
            let choice = argmax(rows.last().unwrap());
            let token = if i % 5 == 4 {
                (choice + 1) % vocab
            } else {
                choice
            };
            if i % 11 == 10 {
                model
                    .forward(&mut other, &[token], LogitRows::Last, &stats)
                    .unwrap();
            }
            let logits = if i % 7 == 6 {
                model.forward(&mut s, &[token], LogitRows::Last, &stats)
            } else {
                model.decode(&mut s, token, true, &stats)
            };
            fed.push(token);
            rows.push(logits.unwrap());
        }
        // A fork while a step runs ahead: the fork and the original both continue from the fed tokens.
        let token = argmax(rows.last().unwrap());
        let mut fork = model.fork(&s).unwrap();
        let from_fork = model.decode(&mut fork, token, true, &stats).unwrap();
        let from_original = model.decode(&mut s, token, true, &stats).unwrap();
        assert_eq!(bits(&from_fork), bits(&from_original), "{arch:?}: fork");
        fed.push(token);
        rows.push(from_original);

        let c = model.counters();
        assert!(
            c.ahead_taken >= 30 && c.ahead_discarded >= 10,
            "{arch:?}: {} steps run ahead taken over, {} discarded",
            c.ahead_taken,
            c.ahead_discarded
        );

        let mut fresh = model.new_session().unwrap();
        let all = model
            .forward(&mut fresh, &fed, LogitRows::All, &stats)
            .unwrap();
        let v = vocab as usize;
        for (i, row) in rows.iter().enumerate() {
            let at = prompt.len() - 1 + i;
            assert_eq!(
                bits(row),
                bits(&all[at * v..(at + 1) * v]),
                "{arch:?}: the step after token {at}"
            );
        }
    }
}

/// A checking pass that kept its rows, rolled back to each of them: its rows' logits and everything after
/// (passes of several rows, then graphed steps run ahead) equal those of a session that ran only those rows,
/// bit for bit; the session holds the same position, and a rollback consumes what the pass kept.
#[test]
#[ignore = "needs an NVIDIA GPU: tools/cuda/verify.sh runs it there"]
fn a_rollback_continues_as_a_shorter_pass_does() {
    for arch in [Arch::KimiK3, Arch::KimiLinear, Arch::GptOss] {
        let dir = tempfile::tempdir().unwrap();
        let model = tiny(arch, dir.path());
        let (stats, v) = (Stats::default(), model.config().vocab_size);
        let (prompt, pass) = ([3u32, 17, 42, 99, 7, 5, 11], [8u32, 21, 2, 64, 30]);
        let mut base = model.new_session().unwrap();
        model
            .forward(&mut base, &prompt, LogitRows::Last, &stats)
            .unwrap();
        for rows in 1..=pass.len() {
            let mut plain = model.fork(&base).unwrap();
            let want = model
                .forward(&mut plain, &pass[..rows], LogitRows::All, &stats)
                .unwrap();
            let mut kept = model.fork(&base).unwrap();
            assert!(model.keep_rows(&mut kept), "CUDA rolls back");
            let all = model
                .forward(&mut kept, &pass, LogitRows::All, &stats)
                .unwrap();
            assert!(bits(&all[..rows * v]) == bits(&want), "{arch:?}: rows");
            model.rollback(&mut kept, rows).unwrap();
            assert_eq!(model.position(&kept), model.position(&plain));
            assert!(model.rollback(&mut kept, 1).is_err(), "kept rows consumed");
            let mut next = argmax(&want[(rows - 1) * v..]);
            for step in 0..12 {
                let (a, b) = if step < 2 {
                    let toks = [next, (next + step + 1) % v as u32];
                    let a = model.forward(&mut kept, &toks, LogitRows::All, &stats);
                    (a, model.forward(&mut plain, &toks, LogitRows::All, &stats))
                } else {
                    let a = model.decode(&mut kept, next, true, &stats);
                    (a, model.decode(&mut plain, next, true, &stats))
                };
                let (a, b) = (a.unwrap(), b.unwrap());
                assert!(
                    bits(&a) == bits(&b),
                    "{arch:?}: step {step} after rolling back to {rows} rows"
                );
                next = argmax(&a[a.len() - v..]);
            }
        }
    }
}

/// Speculative generation on the GPU with every guesser — the model drafting for itself (on the GPU too) and
/// prompt lookup on a prompt that repeats — greedy and sampled: the tokens, the logits that chose them and the
/// session left behind are plain decoding's bit for bit, with no re-run after a refusal.
#[test]
#[ignore = "needs an NVIDIA GPU: tools/cuda/verify.sh runs it there"]
fn speculation_hands_out_plain_decodings_tokens_and_logits() {
    let dir = tempfile::tempdir().unwrap();
    let model = Arc::new(tiny(Arch::KimiK3, dir.path()));
    let stats = Stats::default();
    let run = |req: &Request, draft: Option<&mut Draft<CudaModel>>| {
        let mut logits = Vec::new();
        let on_token = |_: u32, l: &[f32]| {
            logits.push(bits(l));
            Flow::Continue
        };
        let session = model.new_session().unwrap();
        let (out, mut session) = match draft {
            Some(d) => generate_speculative_in(&*model, d, session, req, &stats, on_token),
            None => generate_in(&*model, session, req, &stats, on_token),
        }
        .unwrap();
        let after = model
            .forward(&mut session, &[3], LogitRows::Last, &stats)
            .unwrap();
        (out.tokens, logits, bits(&after))
    };
    // Prompt lookup finds few repeats in a random model's text: a few sampled checks (each refused) over
    // all seeds; the model drafting for itself checks on every step.
    let repeated: Vec<u32> = [1, 2, 3, 4, 5, 6, 7, 8].repeat(3);
    let mut refused = 0;
    for (guesser, name) in [
        (Guesser::Model(model.clone()), "drafter"),
        (Guesser::Ngram, "ngram"),
    ] {
        let mut passes = 0;
        for seed in 0..3u64 {
            let req = Request {
                prompt: repeated.clone(),
                max_new: 64,
                stop_ids: vec![],
                sampling: SamplingParams {
                    temperature: if seed == 0 { 0.0 } else { 0.2 * seed as f32 },
                    seed,
                    ..Default::default()
                },
                prompt_logits: false,
            };
            let plain = run(&req, None);
            let mut draft = Draft::new(guesser.clone(), &*model, 4).unwrap().fixed();
            let spec = run(&req, Some(&mut draft));
            assert_eq!(plain.0, spec.0, "{name}, seed {seed}: tokens");
            assert!(plain.1 == spec.1, "{name}, seed {seed}: logits");
            assert!(
                plain.2 == spec.2,
                "{name}, seed {seed}: the session left behind"
            );
            assert_eq!(draft.reruns, 0, "{name}, seed {seed}");
            passes += draft.passes;
            refused += draft.refused.iter().sum::<u64>();
        }
        assert!(passes > 0, "{name}: no checking pass");
    }
    assert!(refused > 0, "no guess was refused: rollback untested");
}
