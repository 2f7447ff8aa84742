//! gpt-oss on the CPU: the released MXFP4 fixture against transformers' goldens (logits, greedy tokens,
//! routing; tools/oracle/gpt_oss_golden.py), and the engine's invariances on it — streamed vs cached experts,
//! thread counts, scalar vs SIMD kernels, prefill vs single steps, batching, rollback and forking.

mod common;
use common::*;
use deltafin_models::{Backend, LoadOptions, LogitRows, Model, Pass, Stats};
use deltafin_store::StoreOptions;
use std::path::PathBuf;

const TOL: f64 = 1e-4;

fn fixture() -> PathBuf {
    repo_root().join("tests/fixtures/gpt_oss_tiny_mxfp4")
}

fn golden() -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(fixture().join("golden.json")).unwrap()).unwrap()
}

fn ids(g: &serde_json::Value, k: &str) -> Vec<u32> {
    let list = g[k].as_array().unwrap();
    list.iter().map(|v| v.as_u64().unwrap() as u32).collect()
}

/// Golden row t follows token t of prompt + generated; `deltafin run` dumps the prompt rows, then the row that
/// chose each generated token (golden row P−1+j).
#[test]
fn gpt_oss_matches_transformers_goldens() {
    let g = golden();
    let (prompt, generated) = (ids(&g, "prompt_ids"), ids(&g, "generated_ids"));
    let gold = deltafin_formats::npy::read(&fixture().join("golden_logits.npy")).unwrap();
    let ours = run_dump(&fixture(), &prompt, generated.len(), &[]);
    let p = prompt.len();
    assert_eq!(ours.rows, p + generated.len());
    let mut worst = 0.0f64;
    for r in 0..ours.rows {
        let gr = if r < p { r } else { r - 1 };
        let what = format!("row {r} against transformers");
        worst = worst.max(assert_row_close(&what, ours.row(r), gold.row(gr), TOL));
    }
    let ours_generated: Vec<u32> = (0..generated.len())
        .map(|j| argmax(ours.row(p + j)))
        .collect();
    assert_eq!(
        ours_generated, generated,
        "greedy tokens differ from transformers"
    );
    eprintln!(
        "gpt-oss fixture: worst relative error {worst:e} over {} rows",
        ours.rows
    );
}

/// Every layer's chosen experts for every row (cached prefill, then one token a pass) are transformers'.
#[test]
fn gpt_oss_routes_as_transformers() {
    let g = golden();
    let seq = ids(&g, "sequence_ids");
    let p = ids(&g, "prompt_ids").len();
    let model = Model::load(&fixture()).unwrap();
    let stats = Stats::with_routes();
    let mut s = model.new_session();
    model
        .forward(&mut s, &seq[..p], LogitRows::Last, &stats)
        .unwrap();
    for &t in &seq[p..] {
        model
            .forward(&mut s, &[t], LogitRows::Last, &stats)
            .unwrap();
    }
    let routes = stats.take_routes();
    let layers = model.config().num_layers;
    assert_eq!(routes.len(), layers * seq.len());
    // A pass records each layer's rows in turn: the prefill's p rows per layer, then one row per layer.
    let mut rows = vec![0usize; layers];
    let golden: serde_json::Value = g["routing"].clone();
    for (layer, experts) in routes {
        let row = rows[layer];
        rows[layer] += 1;
        let want: Vec<usize> = golden[layer.to_string()]["experts"][row]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as usize)
            .collect();
        assert_eq!(experts, want, "layer {layer} row {row}");
    }
}

/// Prefill then 8 greedy steps, every logits row as bits.
fn bits(model: &Model) -> Vec<u32> {
    greedy_logit_bits(model, &ids(&golden(), "prompt_ids"), 8)
}

fn in_pool<T: Send>(threads: usize, f: impl FnOnce() -> T + Send) -> T {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap()
        .install(f)
}

#[test]
fn gpt_oss_bits_do_not_depend_on_cache_threads_or_kernels() {
    let model = Model::load(&fixture()).unwrap();
    let one = in_pool(1, || bits(&model));
    assert!(one == in_pool(2, || bits(&model)), "1 vs 2 threads differ");
    let streamed = Model::load_with(
        &fixture(),
        &LoadOptions {
            store: StoreOptions {
                cache_bytes: 0,
                ..StoreOptions::default()
            },
            ..LoadOptions::default()
        },
    )
    .unwrap();
    assert!(
        one == bits(&streamed),
        "streamed (cache 0) vs cached differ"
    );
    // Choosing a kernel path is process-wide; the other tests of this binary compare bits that every path
    // must give, so they are not disturbed.
    for isa in deltafin_kernels::isas() {
        deltafin_kernels::set_isa(Some(isa)).unwrap();
        let other = bits(&model);
        deltafin_kernels::set_isa(None).unwrap();
        assert!(
            one == other,
            "{isa} and {} kernels differ",
            deltafin_kernels::isa()
        );
    }
}

fn f32_bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// The prompt is longer than the sliding window (6), so both prefill forms cross it.
#[test]
fn gpt_oss_prefill_equals_single_token_steps() {
    let model = Model::load(&fixture()).unwrap();
    let prompt = ids(&golden(), "sequence_ids");
    let stats = Stats::default();
    let mut whole = model.new_session();
    let all = model
        .forward(&mut whole, &prompt, LogitRows::All, &stats)
        .unwrap();
    let mut single = model.new_session();
    let mut steps = Vec::new();
    for &t in &prompt {
        steps.extend(
            model
                .forward(&mut single, &[t], LogitRows::All, &stats)
                .unwrap(),
        );
    }
    assert!(f32_bits(&all) == f32_bits(&steps), "logits differ");
    assert!(
        whole.state_bits() == single.state_bits(),
        "KV caches differ"
    );
}

/// Two sessions at different positions in one pass get the logits of their own passes.
#[test]
fn gpt_oss_batched_sessions_equal_their_own_passes() {
    let model = Model::load(&fixture()).unwrap();
    let seq = ids(&golden(), "sequence_ids");
    let stats = Stats::default();
    let mut a = model.new_session();
    model
        .forward(&mut a, &seq[..9], LogitRows::Last, &stats)
        .unwrap();
    let b = model.new_session();
    let work: [&[u32]; 2] = [&seq[9..12], &seq[2..10]];
    let own: Vec<Vec<f32>> = [&a, &b]
        .into_iter()
        .zip(work)
        .map(|(s, tokens)| {
            let mut s = s.clone();
            model
                .forward(&mut s, tokens, LogitRows::All, &stats)
                .unwrap()
        })
        .collect();
    let mut sessions = [a, b];
    let mut batch: Vec<Pass<'_, _>> = sessions
        .iter_mut()
        .zip(work)
        .map(|(session, tokens)| Pass {
            session,
            tokens,
            rows: LogitRows::All,
        })
        .collect();
    let together = model.forward_batch(&mut batch, &stats).unwrap();
    for (i, (t, o)) in together.iter().zip(&own).enumerate() {
        assert!(f32_bits(t) == f32_bits(o), "session {i} differs in a batch");
    }
}

/// A pass that kept its rows, rolled back to its first rows, continues exactly as a session that only ever
/// saw those rows; a fork continues as the original would.
#[test]
fn gpt_oss_rollback_and_fork_are_exact() {
    let model = Model::load(&fixture()).unwrap();
    let seq = ids(&golden(), "sequence_ids");
    let stats = Stats::default();
    let mut s = model.new_session();
    model
        .forward(&mut s, &seq[..5], LogitRows::Last, &stats)
        .unwrap();
    let fork = model.fork(&s).unwrap();
    assert!(model.keep_rows(&mut s));
    model
        .forward(&mut s, &seq[5..11], LogitRows::All, &stats)
        .unwrap();
    model.rollback(&mut s, 2).unwrap();
    assert_eq!(model.position(&s), 7);
    let mut direct = model.new_session();
    model
        .forward(&mut direct, &seq[..7], LogitRows::Last, &stats)
        .unwrap();
    assert!(
        s.state_bits() == direct.state_bits(),
        "rolled-back caches differ"
    );
    let next = |s: &mut deltafin_models::Session| {
        f32_bits(
            &model
                .forward(s, &seq[7..15], LogitRows::All, &stats)
                .unwrap(),
        )
    };
    assert!(next(&mut s) == next(&mut direct), "continuations differ");
    let (mut f, mut orig) = (fork, model.new_session());
    model
        .forward(&mut orig, &seq[..5], LogitRows::Last, &stats)
        .unwrap();
    let cont = |s: &mut deltafin_models::Session| {
        f32_bits(
            &model
                .forward(s, &seq[5..14], LogitRows::All, &stats)
                .unwrap(),
        )
    };
    assert!(
        cont(&mut f) == cont(&mut orig),
        "a fork continues differently"
    );
}

/// `make-model --arch gpt_oss` writes the released layout: tools/oracle/released_ref.py (numpy, decoding the
/// files itself) gives the engine's logits at every position, and `deltafin run` generates from text with
/// the o200k_harmony tokenizer and gpt-oss's stop ids.
#[test]
fn made_gpt_oss_checkpoints_match_the_numpy_reference_and_run() {
    let t = tiny(deltafin_makemodel::Arch::GptOss, 3);
    let dir = model_dir(&t);
    let prompt: [u32; 9] = [200006, 1428, 200008, 13225, 11, 2375, 0, 199999, 201087];
    let model = Model::load(&dir).unwrap();
    let mut s = model.new_session();
    let ours = model
        .forward(&mut s, &prompt, LogitRows::All, &Stats::default())
        .unwrap();
    let out = t.path().join("ref.npy");
    let script = "import sys, numpy as np; sys.path.insert(0, sys.argv[1]); import released_ref as r; \
                  cfg, w = r.load_dir(sys.argv[2]); \
                  np.save(sys.argv[3], r.gpt_oss_forward(cfg, w, np.array([int(x) for x in sys.argv[4].split(',')]))[0])";
    let ids: Vec<String> = prompt.iter().map(|i| i.to_string()).collect();
    let run = python()
        .args(["-c", script])
        .arg(repo_root().join("tools/oracle"))
        .arg(&dir)
        .arg(&out)
        .arg(ids.join(","))
        .output()
        .unwrap();
    assert!(
        run.status.success(),
        "released_ref.py failed: {}",
        String::from_utf8_lossy(&run.stderr)
    );
    let reference = deltafin_formats::npy::read(&out).unwrap();
    let vocab = model.config().vocab_size;
    assert_eq!(
        (reference.rows, ours.len()),
        (prompt.len(), prompt.len() * vocab)
    );
    for r in 0..prompt.len() {
        let row: Vec<f64> = ours[r * vocab..(r + 1) * vocab]
            .iter()
            .map(|&x| x as f64)
            .collect();
        let what = format!("row {r} against released_ref.py");
        assert_row_close(&what, &row, reference.row(r), TOL);
    }
    let tok = deltafin_tokenizer::Tokenizer::from_dir(&dir).unwrap();
    let mut eos = tok.eos_ids();
    eos.sort_unstable();
    assert_eq!(
        eos,
        [199999, 200002, 200012],
        "<|endoftext|>, <|return|>, <|call|>"
    );
    let out = bin()
        .args(["run", "--model"])
        .arg(&dir)
        .args([
            "--prompt",
            "Experts stream from disk",
            "--max-new",
            "6",
            "--ignore-eos",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "deltafin run failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}
