//! DeepSeek-V3 / Kimi K2 against transformers' goldens (tests/fixtures/{deepseek_v3_tiny_bf16,
//! deepseek_v3_tiny_fp8, kimi_k2_tiny_int4}, made by tools/oracle/deepseek_v3_golden.py): logits within 1e-4
//! relative at every prompt position and 8 decode steps, the same greedy tokens and routing; and the engine's
//! own invariances on these checkpoints (experts streamed or cached, thread counts).

mod common;
use common::*;
use deltafin_models::{Backend, LoadOptions, LogitRows, Model, Stats};
use deltafin_store::StoreOptions;
use serde_json::Value;
use std::path::{Path, PathBuf};

const TOL: f64 = 1e-4;
const FIXTURES: [&str; 3] = [
    "deepseek_v3_tiny_bf16",
    "deepseek_v3_tiny_fp8",
    "kimi_k2_tiny_int4",
];

fn fixture(name: &str) -> PathBuf {
    repo_root().join("tests/fixtures").join(name)
}

fn golden(dir: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(dir.join("golden.json")).unwrap()).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// Prefill the prompt, then feed `tokens` one at a time: every logits row, prompt rows first.
fn rows(model: &Model, prompt: &[u32], tokens: &[u32], stats: &Stats) -> Vec<f32> {
    let mut s = model.new_session();
    let mut all = model
        .forward(&mut s, prompt, LogitRows::All, stats)
        .unwrap();
    for &t in tokens {
        all.extend(model.forward(&mut s, &[t], LogitRows::Last, stats).unwrap());
    }
    all
}

fn load(dir: &Path, cache_bytes: u64) -> Model {
    let opts = LoadOptions {
        store: StoreOptions {
            cache_bytes,
            ..StoreOptions::default()
        },
        ..LoadOptions::default()
    };
    Model::load_with(dir, &opts).unwrap()
}

fn in_pool<T: Send>(threads: usize, f: impl FnOnce() -> T + Send) -> T {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap()
        .install(f)
}

/// Golden row t follows token t of prompt + generated; the engine is teacher-forced on the same ids, and its
/// greedy choice must be the golden one at every step.
fn matches_goldens(name: &str) {
    let dir = fixture(name);
    let g = golden(&dir);
    let (prompt, generated) = (ids(&g["prompt_ids"]), ids(&g["generated_ids"]));
    let gold = deltafin_formats::npy::read(&dir.join("golden_logits.npy")).unwrap();
    let model = load(&dir, 0);
    let stats = Stats::with_routes();
    let ours = rows(&model, &prompt, &generated, &stats);
    let vocab = model.config().vocab_size;
    assert_eq!(ours.len(), gold.rows * vocab, "{name}: row count");
    let mut worst = 0.0f64;
    for r in 0..gold.rows {
        let row: Vec<f64> = ours[r * vocab..(r + 1) * vocab]
            .iter()
            .map(|&x| x as f64)
            .collect();
        worst = worst.max(assert_row_close(
            &format!("{name} row {r}"),
            &row,
            gold.row(r),
            TOL,
        ));
        let want = match r + 1 - prompt.len() {
            j if r + 1 >= prompt.len() && j < generated.len() => generated[j],
            _ if r + 1 == gold.rows => g["next_id_after_generated"].as_u64().unwrap() as u32,
            _ => continue,
        };
        assert_eq!(argmax(&row), want, "{name}: greedy token after row {r}");
    }
    // Routing per MoE layer and row, as transformers chose (recorded prefill rows first, then each step's).
    let routes = stats.take_routes();
    for (layer, want) in g["routing"].as_object().unwrap() {
        let layer: usize = layer.parse().unwrap();
        let ours: Vec<Vec<usize>> = routes
            .iter()
            .filter(|r| r.0 == layer)
            .map(|r| r.1.clone())
            .collect();
        let want: Vec<Vec<usize>> = want["experts"]
            .as_array()
            .unwrap()
            .iter()
            .map(|row| ids(row).into_iter().map(|e| e as usize).collect())
            .collect();
        assert_eq!(ours, want, "{name}: routing of layer {layer}");
    }
    eprintln!(
        "{name}: worst relative error {worst:e} over {} rows",
        gold.rows
    );
}

#[test]
fn deepseek_v3_bf16_matches_transformers_goldens() {
    matches_goldens("deepseek_v3_tiny_bf16");
}

#[test]
fn deepseek_v3_fp8_matches_transformers_goldens() {
    matches_goldens("deepseek_v3_tiny_fp8");
}

#[test]
fn kimi_k2_int4_matches_transformers_goldens() {
    matches_goldens("kimi_k2_tiny_int4");
}

/// The same bits whether experts are read from the shards on every use (cache 0) or cached, on 1 or 2
/// threads.
#[test]
fn streamed_cached_and_thread_counts_give_identical_bits() {
    for name in FIXTURES {
        let dir = fixture(name);
        let g = golden(&dir);
        let (prompt, generated) = (ids(&g["prompt_ids"]), ids(&g["generated_ids"]));
        let bits = |m: &Model| -> Vec<u32> {
            rows(m, &prompt, &generated, &Stats::default())
                .iter()
                .map(|x| x.to_bits())
                .collect()
        };
        let streamed = load(&dir, 0);
        let cached = load(&dir, 1 << 30);
        let one = in_pool(1, || bits(&streamed));
        assert!(
            one == in_pool(2, || bits(&streamed)),
            "{name}: 1 vs 2 threads differ"
        );
        assert!(
            one == in_pool(2, || bits(&cached)),
            "{name}: streamed vs cached differ"
        );
        assert!(
            cached.store().snapshot().hits > 0,
            "{name}: the cache never hit"
        );
    }
}

/// `deltafin run` on a fixture: the greedy tokens transformers chose.
#[test]
fn cli_run_generates_the_golden_tokens() {
    let dir = fixture("kimi_k2_tiny_int4");
    let g = golden(&dir);
    let (prompt, generated) = (ids(&g["prompt_ids"]), ids(&g["generated_ids"]));
    let ours = run_dump(&dir, &prompt, generated.len(), &[]);
    let p = prompt.len();
    let tokens: Vec<u32> = (0..generated.len())
        .map(|j| argmax(ours.row(p + j)))
        .collect();
    assert_eq!(tokens, generated);
}

/// The CUDA backend takes this family in each stored format (tools/cuda/verify.sh compares its logits with the
/// CPU's and these goldens on a GPU): opening a checkpoint for it no longer stops at the family.
#[test]
fn cuda_opens_the_family_in_every_format() {
    for name in FIXTURES {
        let dir = fixture(name);
        if let Err(e) = deltafin_cuda::Source::open(&dir, &LoadOptions::default()) {
            panic!("{name}: {e:#}");
        }
    }
}
