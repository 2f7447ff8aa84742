//! `/metrics` in the Prometheus text format: HTTP requests, tokens in and out, throughput, queue depth,
//! prefix-cache use and expert bytes read.

use deltafin_engine::Scheduler;
use deltafin_store::ExpertStore;
use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::Ordering;
use std::sync::Mutex;

/// The endpoints requests are counted under (anything else is "other").
pub const ENDPOINTS: &[&str] = &[
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/responses",
    "/v1/models",
    "/health",
    "/metrics",
];

#[derive(Default)]
pub struct HttpCounters {
    by_endpoint_status: Mutex<BTreeMap<(&'static str, u16), u64>>,
}

impl HttpCounters {
    pub fn record(&self, path: &str, status: u16) {
        let endpoint = ENDPOINTS
            .iter()
            .find(|&&e| e == path || (e == "/v1/models" && path.starts_with("/v1/models/")))
            .copied()
            .unwrap_or("other");
        let mut m = self
            .by_endpoint_status
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        *m.entry((endpoint, status)).or_default() += 1;
    }
}

pub fn render(http: &HttpCounters, sched: &Scheduler, store: &ExpertStore) -> String {
    let mut out = String::new();
    let mut metric = |name: &str, kind: &str, help: &str, samples: &[(String, f64)]| {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for (labels, v) in samples {
            let _ = writeln!(out, "{name}{labels} {v}");
        }
    };
    let requests: Vec<(String, f64)> = http
        .by_endpoint_status
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .map(|((e, s), n)| (format!("{{endpoint=\"{e}\",status=\"{s}\"}}"), *n as f64))
        .collect();
    metric(
        "deltafin_http_requests_total",
        "counter",
        "HTTP requests answered, by endpoint and status code.",
        &requests,
    );
    let c = sched.counters();
    let get = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed) as f64;
    let one = |v: f64| vec![(String::new(), v)];
    metric(
        "deltafin_generations_total",
        "counter",
        "Generations by outcome (cancelled: the client went away).",
        &[
            ("{outcome=\"completed\"}".into(), get(&c.completed)),
            ("{outcome=\"failed\"}".into(), get(&c.failed)),
            ("{outcome=\"cancelled\"}".into(), get(&c.cancelled)),
        ],
    );
    let prompt = get(&c.prompt_tokens);
    let cached = get(&c.cached_tokens);
    let completion = get(&c.completion_tokens);
    let prefill_s = get(&c.prefill_ns) * 1e-9;
    let decode_s = get(&c.decode_ns) * 1e-9;
    metric(
        "deltafin_prompt_tokens_total",
        "counter",
        "Prompt tokens received (tokens in).",
        &one(prompt),
    );
    metric(
        "deltafin_prompt_tokens_cached_total",
        "counter",
        "Prompt tokens resumed from the prefix cache instead of computed.",
        &one(cached),
    );
    metric(
        "deltafin_completion_tokens_total",
        "counter",
        "Tokens generated (tokens out).",
        &one(completion),
    );
    metric(
        "deltafin_prefill_seconds_total",
        "counter",
        "Time in passes, the prompt rows' share of each.",
        &one(prefill_s),
    );
    metric(
        "deltafin_decode_seconds_total",
        "counter",
        "Time in passes, the generated rows' share of each.",
        &one(decode_s),
    );
    let rate = |n: f64, s: f64| if s > 0.0 { n / s } else { 0.0 };
    metric(
        "deltafin_decode_tokens_per_second",
        "gauge",
        "Generated tokens per second of generation passes, since start.",
        &one(rate(completion, decode_s)),
    );
    metric(
        "deltafin_prefill_tokens_per_second",
        "gauge",
        "Computed prompt tokens per second of prompt passes, since start.",
        &one(rate(prompt - cached, prefill_s)),
    );
    metric(
        "deltafin_draft_tokens_total",
        "counter",
        "Speculative decoding (--draft): tokens the drafter guessed, and those the model took.",
        &[
            ("{outcome=\"proposed\"}".into(), get(&c.draft_proposed)),
            ("{outcome=\"accepted\"}".into(), get(&c.draft_accepted)),
        ],
    );
    metric(
        "deltafin_batched_passes_total",
        "counter",
        "Batched forward passes (each advances every active generation; with --draft on a backend that cannot roll back, re-runs of refused guesses add one).",
        &one(get(&c.batched_passes)),
    );
    metric(
        "deltafin_isolated_passes_total",
        "counter",
        "Passes that failed (a failed expert read, say) and were run again one generation at a time, so that only the generations that fail again alone fail.",
        &one(get(&c.isolated_passes)),
    );
    metric(
        "deltafin_batched_generations_total",
        "counter",
        "Generations in those passes, summed (over the passes: the mean batch).",
        &one(get(&c.batched_jobs)),
    );
    metric(
        "deltafin_batched_rows_total",
        "counter",
        "Token rows in those passes, summed (prompt chunks and generated tokens).",
        &one(get(&c.batched_rows)),
    );
    metric(
        "deltafin_queue_depth",
        "gauge",
        "Requests waiting for a generation slot.",
        &one(get(&c.queued)),
    );
    metric(
        "deltafin_active_generations",
        "gauge",
        "Generations in progress.",
        &one(get(&c.active)),
    );
    metric(
        "deltafin_prefix_cache_entries",
        "gauge",
        "Stored conversation states.",
        &one(get(&c.prefix_cache_entries)),
    );
    metric(
        "deltafin_prefix_cache_bytes",
        "gauge",
        "Memory held by stored conversation states.",
        &one(get(&c.prefix_cache_bytes)),
    );
    metric(
        "deltafin_prefix_cache_hits_total",
        "counter",
        "Prompts that resumed a stored state.",
        &one(get(&c.prefix_cache_hits)),
    );
    metric(
        "deltafin_prefix_cache_misses_total",
        "counter",
        "Prompts computed from the start.",
        &one(get(&c.prefix_cache_misses)),
    );
    let used = sched.stats();
    metric(
        "deltafin_expert_bytes_used_total",
        "counter",
        "Routed-expert bytes the forward passes computed with (from cache or storage).",
        &one(used.bytes() as f64),
    );
    let store = store.snapshot();
    metric(
        "deltafin_expert_bytes_read_total",
        "counter",
        "Routed-expert bytes read from storage (demand and prefetch).",
        &one(store.bytes_read() as f64),
    );
    metric(
        "deltafin_expert_reads_total",
        "counter",
        "Routed-expert reads from storage.",
        &one(store.reads as f64),
    );
    metric(
        "deltafin_expert_read_wait_seconds_total",
        "counter",
        "Time passes waited for expert reads.",
        &one(store.wait_secs),
    );
    metric(
        "deltafin_expert_requests_total",
        "counter",
        "Routed-expert lookups in the expert cache.",
        &one(store.requests as f64),
    );
    if store.requests > 0 {
        metric(
            "deltafin_expert_cache_hit_ratio",
            "gauge",
            "Expert lookups served from memory (cached or prefetched), since start.",
            &one(store.hit_rate()),
        );
    } else {
        // Honest absence: no lookups yet, so no hit rate.
        out.push_str(
            "# deltafin_expert_cache_hit_ratio: absent until an expert has been looked up\n",
        );
    }
    out
}
