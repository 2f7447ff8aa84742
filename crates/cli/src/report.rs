//! The `[stats]` line: where the time and the bytes of a generation went.

use anyhow::{Context, Result};
use deltafin_engine::{Draft, Output};
use deltafin_models::{Backend, Stats};
use deltafin_store::Snapshot;
use serde_json::json;
use std::io::Write;
use std::path::Path;
use std::time::Instant;

/// Prints the `[stats]` line of a generation, and the `[speculative]` line when `draft` guessed for it.
/// `spine_per_pass`: the spine bytes every pass reads from disk (its streamed layers), when known.
pub fn print_stats<D: Backend>(
    model: &impl Backend,
    stats: &Stats,
    n_prompt: usize,
    out: &Output,
    load_secs: f64,
    spine_per_pass: Option<u64>,
    draft: Option<&Draft<D>>,
) {
    eprintln!(
        "{}",
        stats_line(model, stats, n_prompt, out, load_secs, spine_per_pass)
    );
    if let Some(d) = draft {
        eprintln!("{}", speculative_line(d, out.tokens.len()));
    }
}

fn stats_line(
    model: &impl Backend,
    stats: &Stats,
    n_prompt: usize,
    out: &Output,
    load_secs: f64,
    spine_per_pass: Option<u64>,
) -> String {
    let store = model.store().snapshot();
    // The decode passes' tokens: every generated token after the first, which comes from the prefill's
    // logits (and whose time is the prefill's).
    let steps = out.tokens.len().saturating_sub(1);
    let busy = out.prefill_secs + out.decode_secs;
    let predicted: Vec<String> = store
        .layers
        .iter()
        .enumerate()
        .filter(|(_, p)| p.predicted > 0)
        .map(|(l, p)| {
            format!(
                "{l}:{:.0}/{:.0}%",
                100.0 * p.precision(),
                100.0 * p.recall()
            )
        })
        .collect();
    // Per generated token, the prompt's reads included: what speculation is meant to lower.
    let per_token = |bytes: u64| bytes as f64 / out.tokens.len().max(1) as f64 / 1e6;
    let spine = spine_per_pass
        .map(|b| format!("spine {:.3} MB + ", per_token(b * stats.passes())))
        .unwrap_or_default();
    format!(
        "[stats] load {:.2}s | prefill {} tok {:.3}s ({:.1} tok/s) | decode {} tok {:.3}s ({:.2} tok/s) | experts used {} ({:.1} MB) | read {:.1} MB demand + {:.1} MB prefetch ({:.2} GB/s over the passes) + {:.1} MB background fill | expert slab {:.2} GiB{}, cache hits {:.1}% | I/O wait {:.3}s | read per generated token: {}experts {:.3} MB | lookahead precision/recall by layer {} | kernels {}",
        load_secs,
        n_prompt,
        out.prefill_secs,
        n_prompt as f64 / out.prefill_secs.max(1e-9),
        steps,
        out.decode_secs,
        steps as f64 / out.decode_secs.max(1e-9),
        stats.uses(),
        stats.bytes() as f64 / 1e6,
        store.demand_bytes as f64 / 1e6,
        store.prefetch_bytes as f64 / 1e6,
        store.bytes_read() as f64 / busy.max(1e-9) / 1e9,
        store.background_bytes as f64 / 1e6,
        model.store().slab_bytes() as f64 / (1u64 << 30) as f64,
        if model.store().in_page_cache() {
            " (page cache, mapped files)"
        } else {
            ""
        },
        100.0 * store.hit_rate(),
        store.wait_secs,
        spine,
        per_token(store.demand_bytes + store.prefetch_bytes),
        if predicted.is_empty() { "-".to_string() } else { predicted.join(" ") },
        model.kernels(),
    ) + &model
        .store()
        .backfill_activity()
        .map(|a| format!(" | {a}"))
        .unwrap_or_default()
}

/// The `[speculative]` line: how the guesses fared and how many each pass checked.
fn speculative_line<D: Backend>(d: &Draft<D>, generated: usize) -> String {
    let chosen: Vec<String> = d
        .chosen
        .iter()
        .enumerate()
        .map(|(k, n)| format!("{k}:{n}"))
        .collect();
    let refused: Vec<String> = d
        .refused
        .iter()
        .enumerate()
        .map(|(i, n)| format!("{}:{n}", i + 1))
        .collect();
    format!(
        "[speculative] up to {} guesses per pass: {} of {} taken ({:.1}%); {} generated tokens took {} checking passes + {} re-runs of the model | passes by guesses checked {} | refused at guess {} | drafting {:.1} ms in all | drafter expert bytes {:.1} MB",
        d.k,
        d.accepted,
        d.proposed,
        100.0 * d.acceptance(),
        generated,
        d.passes,
        d.reruns,
        chosen.join(" "),
        refused.join(" "),
        1e3 * d.drafting_secs,
        d.stats.bytes() as f64 / 1e6,
    )
}

/// `--events FILE.jsonl`: one line per generated token describing the pass that chose it (the first line's
/// pass is the prefill).
pub struct Events {
    file: std::io::BufWriter<std::fs::File>,
    last: Snapshot,
    last_layers: Vec<f64>,
    since: Instant,
    index: usize,
}

impl Events {
    pub fn create(path: &Path, model: &impl Backend) -> Result<Events> {
        let file = std::fs::File::create(path)
            .with_context(|| format!("cannot create {}", path.display()))?;
        Ok(Events {
            file: std::io::BufWriter::new(file),
            last: model.store().snapshot(),
            last_layers: Vec::new(),
            since: Instant::now(),
            index: 0,
        })
    }

    pub fn token(&mut self, model: &impl Backend, stats: &Stats, token: u32) -> Result<()> {
        let now = model.store().snapshot();
        let d = now.since(&self.last);
        let layers = stats.layer_secs();
        let layer_secs: Vec<f64> = layers
            .iter()
            .enumerate()
            .map(|(l, t)| t - self.last_layers.get(l).copied().unwrap_or(0.0))
            .collect();
        let routes: Vec<_> = stats
            .take_routes()
            .into_iter()
            .map(|(l, ids)| json!([l, ids]))
            .collect();
        let line = json!({
            "index": self.index,
            "pass": if self.index == 0 { "prefill" } else { "decode" },
            "token": token,
            "secs": self.since.elapsed().as_secs_f64(),
            "demand_bytes": d.demand_bytes,
            "prefetch_bytes": d.prefetch_bytes,
            "background_bytes": d.background_bytes,
            "requests": d.requests,
            "hits": d.hits,
            "prefetch_hits": d.prefetch_hits,
            "io_wait_secs": d.wait_secs,
            "disk_busy_secs": d.disk_busy_secs,
            "layer_secs": layer_secs,
            "routes": routes,
        });
        writeln!(self.file, "{line}")?;
        self.file.flush()?;
        self.last = now;
        self.last_layers = layers;
        self.since = Instant::now();
        self.index += 1;
        Ok(())
    }
}
