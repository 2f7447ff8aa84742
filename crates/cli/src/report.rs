//! The `[stats]` line: where the time and the bytes of a generation went.

use deltafin_engine::Output;
use deltafin_models::{Model, Stats};

pub fn stats_line(model: &Model, stats: &Stats, n_prompt: usize, out: &Output, load_secs: f64) -> String {
    let store = model.store().snapshot();
    // Decode passes: one per generated token after the first (the first comes from the prefill's logits).
    let steps = out.tokens.len().saturating_sub(1);
    let busy = out.prefill_secs + out.decode_secs;
    let predicted: Vec<String> = store
        .layers
        .iter()
        .enumerate()
        .filter(|(_, p)| p.predicted > 0)
        .map(|(l, p)| format!("{l}:{:.0}/{:.0}%", 100.0 * p.precision(), 100.0 * p.recall()))
        .collect();
    format!(
        "[stats] load {:.2}s | prefill {} tok {:.3}s ({:.1} tok/s) | decode {} tok {:.3}s ({:.2} tok/s) | experts used {} ({:.1} MB) | read {:.1} MB demand + {:.1} MB prefetch ({:.2} GB/s over the passes) | cache hits {:.1}% | I/O wait {:.3}s | lookahead precision/recall by layer {} | kernels {}",
        load_secs,
        n_prompt,
        out.prefill_secs,
        n_prompt as f64 / out.prefill_secs.max(1e-9),
        out.tokens.len(),
        out.decode_secs,
        steps as f64 / out.decode_secs.max(1e-9),
        stats.uses(),
        stats.bytes() as f64 / 1e6,
        store.demand_bytes as f64 / 1e6,
        store.prefetch_bytes as f64 / 1e6,
        store.bytes_read() as f64 / busy.max(1e-9) / 1e9,
        100.0 * store.hit_rate(),
        store.wait_secs,
        if predicted.is_empty() { "-".to_string() } else { predicted.join(" ") },
        deltafin_kernels::isa(),
    )
}
