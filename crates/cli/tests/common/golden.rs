//! Checks against a transformers golden fixture (tests/fixtures/NAME: golden.json and golden_logits.npy, made
//! by a tools/oracle/*_golden.py script): logits, greedy tokens and routing, and the engine's invariances on
//! the fixture's checkpoint.

use super::{argmax, assert_row_close, repo_root, run_dump};
use deltafin_models::{Backend, LoadOptions, LogitRows, Model, Stats};
use deltafin_store::StoreOptions;
use serde_json::Value;
use std::path::{Path, PathBuf};

pub const TOL: f64 = 1e-4;

pub fn fixture(name: &str) -> PathBuf {
    repo_root().join("tests/fixtures").join(name)
}

pub fn golden(dir: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(dir.join("golden.json")).unwrap()).unwrap()
}

pub fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// Prefill the prompt, then feed `tokens` one at a time: every logits row, prompt rows first.
pub fn rows(model: &Model, prompt: &[u32], tokens: &[u32], stats: &Stats) -> Vec<f32> {
    let mut s = model.new_session();
    let mut all = model
        .forward(&mut s, prompt, LogitRows::All, stats)
        .unwrap();
    for &t in tokens {
        all.extend(model.forward(&mut s, &[t], LogitRows::Last, stats).unwrap());
    }
    all
}

/// The checkpoint with an expert cache of `cache_bytes` (0: every expert read from the shards on each use).
pub fn load(dir: &Path, cache_bytes: u64) -> Model {
    let opts = LoadOptions {
        store: StoreOptions {
            cache_bytes,
            ..StoreOptions::default()
        },
        ..LoadOptions::default()
    };
    Model::load_with(dir, &opts).unwrap()
}

pub fn in_pool<T: Send>(threads: usize, f: impl FnOnce() -> T + Send) -> T {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap()
        .install(f)
}

/// Golden row t follows token t of prompt + generated; the engine is teacher-forced on the same ids, and its
/// greedy choice must be the golden one at every step; each MoE layer routes every row as transformers did.
pub fn matches_goldens(name: &str) {
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

/// The same bits whether experts are read from the shards on every use (cache 0) or cached, on 1 or 2
/// threads.
pub fn streamed_cached_and_threads_agree(name: &str) {
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

/// `deltafin run` on the fixture: the greedy tokens transformers chose.
pub fn cli_run_generates_the_golden(name: &str) {
    let dir = fixture(name);
    let g = golden(&dir);
    let (prompt, generated) = (ids(&g["prompt_ids"]), ids(&g["generated_ids"]));
    let ours = run_dump(&dir, &prompt, generated.len(), &[]);
    let p = prompt.len();
    let tokens: Vec<u32> = (0..generated.len())
        .map(|j| argmax(ours.row(p + j)))
        .collect();
    assert_eq!(tokens, generated, "{name}");
}

/// The CUDA backend does not compute the fixture's family yet: it says so before touching a GPU.
pub fn cuda_refuses(name: &str) {
    let dir = fixture(name);
    let opts = deltafin_cuda::CudaOptions::default();
    let e = match deltafin_cuda::CudaModel::load(&dir, &LoadOptions::default(), &opts) {
        Ok(_) => panic!("CUDA loaded {name}"),
        Err(e) => format!("{e:#}"),
    };
    assert!(
        e.contains("not yet on CUDA; use --device cpu"),
        "{name}: {e}"
    );
}
