//! Progress display for long work, on stderr and only when stderr is a terminal (indicatif hides itself
//! otherwise), so piped output and logs stay clean.

use indicatif::{ProgressBar, ProgressStyle};
use std::time::Duration;

/// Prompts at least this long show a spinner until their first token (prefill is one long pass).
const PREFILL_SPINNER_TOKENS: usize = 256;

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

/// A spinner for the prefill of a long prompt (hidden for short ones); finish it at the first token.
pub fn prefill_spinner(prompt_tokens: usize) -> ProgressBar {
    if prompt_tokens < PREFILL_SPINNER_TOKENS {
        return ProgressBar::hidden();
    }
    spinner(format!("prefilling {prompt_tokens} prompt tokens"))
}
