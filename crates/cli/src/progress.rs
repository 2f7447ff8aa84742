//! Progress display for long work, on stderr and only when stderr is a terminal (indicatif hides itself
//! otherwise), so piped output and logs stay clean.

use deltafin_models::Stats;
use indicatif::{ProgressBar, ProgressStyle};
use std::time::Duration;

/// Prompts at least this long show a progress bar until their first token (prefill is one long pass).
const PREFILL_BAR_TOKENS: usize = 256;

/// A spinner with `message` and the elapsed time, ticking on its own until finished.
pub fn spinner(message: String) -> ProgressBar {
    let pb = ProgressBar::new_spinner();
    let style = ProgressStyle::with_template("{spinner} {msg} ({elapsed})")
        .expect("the built-in template parses");
    pb.set_style(style);
    pb.set_message(message);
    pb.enable_steady_tick(Duration::from_millis(120));
    pb
}

/// Runs `work` under a spinner saying `message`.
pub fn while_busy<T>(message: &str, work: impl FnOnce() -> T) -> T {
    let pb = spinner(message.to_string());
    let result = work();
    pb.finish_and_clear();
    result
}

/// A bar for the prefill of a long prompt (hidden for short ones), advanced layer by layer by the passes
/// `stats` watches, or a spinner where the passes do not report their layers (`layers` None); finish it at the
/// first token.
pub fn prefill_bar(
    prompt_tokens: usize,
    layers: Option<usize>,
    stats: Stats,
) -> (ProgressBar, Stats) {
    let Some(layers) = layers else {
        let pb = if prompt_tokens < PREFILL_BAR_TOKENS {
            ProgressBar::hidden()
        } else {
            spinner(format!("prefilling {prompt_tokens} prompt tokens"))
        };
        return (pb, stats);
    };
    let pb = bar(prompt_tokens, layers);
    let hook = pb.clone();
    let stats = stats.on_layer(move |l| {
        if !hook.is_finished() {
            hook.set_position(l as u64 + 1);
        }
    });
    (pb, stats)
}

fn bar(prompt_tokens: usize, layers: usize) -> ProgressBar {
    if prompt_tokens < PREFILL_BAR_TOKENS {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::new(layers as u64);
    let style = ProgressStyle::with_template(&format!(
        "prefilling {prompt_tokens} prompt tokens {{bar:30}} layer {{pos}}/{{len}} ({{elapsed}}, {{eta}} left)"
    ))
    .expect("the built-in template parses");
    pb.set_style(style);
    pb.enable_steady_tick(Duration::from_millis(200));
    pb
}
