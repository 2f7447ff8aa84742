//! On an NVIDIA GPU only, so ignored elsewhere (`tools/cuda/verify.sh` runs them on the GPU machine with
//! `--ignored`): the backend's contract where no CLI run reaches it.

use deltafin_cuda::{CudaModel, CudaOptions};
use deltafin_makemodel::{make_model, Arch, Preset};
use deltafin_models::{Backend, LoadOptions, LogitRows, Stats};

fn argmax(x: &[f32]) -> u32 {
    deltafin_engine::sampler::argmax(x)
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// Decode steps run ahead on the device's choice and taken over, discarded by another token, by a plain pass or
/// by another session's pass, or left in flight under a fork: every step's logits equal those of one pass over
/// the same tokens (a fresh session's prefill, another path through the kernels) bit for bit.
#[test]
#[ignore = "needs an NVIDIA GPU: tools/cuda/verify.sh runs it there"]
fn steps_run_ahead_compute_exactly_what_plain_passes_do() {
    for arch in [Arch::KimiK3, Arch::KimiLinear] {
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
        // 70 steps: the MLA caches outgrow their first 64 positions on the way.
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
