//! The generation loop over a loaded model on any [`Backend`] (the CPU or a GPU): prefill the prompt, then one
//! token per pass, choosing each token with a [`Sampler`]. Sampling only picks among the logits — it never
//! changes which experts run.
//!
//! Serving builds on it: [`Generation`] (one request as a step machine), [`Scheduler`] (a worker thread that
//! advances every request in one batched pass, with a bounded queue and cancellation), [`PrefixCache`] (exact
//! reuse of the state of an earlier prompt), [`logprobs()`] and [`StopMatcher`] (stop strings across token
//! boundaries).

mod cost_model;
pub mod generation;
pub mod logprobs;
mod ngram;
pub mod prefix_cache;
pub mod sampler;
pub mod scheduler;
pub mod speculative;
pub mod stop;

use anyhow::Result;
use deltafin_models::{Backend, Stats};
pub use generation::{Generation, Planned, Resume, Snapshot};
pub use logprobs::{logprobs, TokenLogprob};
pub use prefix_cache::PrefixCache;
pub use sampler::{Sampler, SamplingParams};
pub use scheduler::{Drafter, Finished, Job, Rejected, Scheduler, SchedulerConfig, Sink};
pub use speculative::{Draft, DraftArg, Guesser};
pub use stop::StopMatcher;

/// What to generate.
#[derive(Clone, Debug)]
pub struct Request {
    pub prompt: Vec<u32>,
    pub max_new: usize,
    /// Stop after emitting one of these ids (typically the model's end-of-message token).
    pub stop_ids: Vec<u32>,
    pub sampling: SamplingParams,
    /// Keep the logits of every prompt position (costs a vocab-wide product per row).
    pub prompt_logits: bool,
}

/// The caller's verdict after each token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flow {
    Continue,
    Stop,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// `max_new` tokens were generated.
    Length,
    /// A stop id was generated.
    StopToken,
    /// The token callback asked to stop (stop sequence, cancelled client, ...).
    Caller,
}

pub struct Output {
    pub tokens: Vec<u32>,
    /// `[prompt_len, vocab]` when requested.
    pub prompt_logits: Option<Vec<f32>>,
    pub finish: FinishReason,
    pub prefill_secs: f64,
    pub decode_secs: f64,
}

/// Runs `req` on a fresh session. `on_token(token, logits_that_chose_it)` sees each token as it is chosen.
pub fn generate<B: Backend>(
    model: &B,
    req: &Request,
    stats: &Stats,
    mut on_token: impl FnMut(u32, &[f32]) -> Flow,
) -> Result<Output> {
    let gen = Generation::new(model, req, None)?;
    let (output, _) = run(gen, |g| g.step(model, stats, usize::MAX, &mut on_token))?;
    Ok(output)
}

/// Like [`generate`], continuing `session` (whose history precedes `req.prompt`). Returns the session too,
/// holding everything it consumed: the prompt and every generated token but the last (chosen, never fed).
pub fn generate_in<B: Backend>(
    model: &B,
    session: B::Session,
    req: &Request,
    stats: &Stats,
    mut on_token: impl FnMut(u32, &[f32]) -> Flow,
) -> Result<(Output, B::Session)> {
    let gen = Generation::continuing(model, req, session)?;
    run(gen, |g| g.step(model, stats, usize::MAX, &mut on_token))
}

/// Like [`generate_in`] with speculative decoding ([`generate_speculative`]).
pub fn generate_speculative_in<B: Backend, D: Backend>(
    model: &B,
    draft: &mut Draft<D>,
    session: B::Session,
    req: &Request,
    stats: &Stats,
    mut on_token: impl FnMut(u32, &[f32]) -> Flow,
) -> Result<(Output, B::Session)> {
    let gen = Generation::continuing(model, req, session)?;
    run(gen, |g| {
        g.step_speculative(model, draft, stats, usize::MAX, &mut on_token)
    })
}

/// Like [`generate`] with speculative decoding: `draft` guesses, `model` checks. The tokens and logits handed
/// out are exactly those of [`generate`]. The drafter may run on another backend than the model.
pub fn generate_speculative<B: Backend, D: Backend>(
    model: &B,
    draft: &mut Draft<D>,
    req: &Request,
    stats: &Stats,
    mut on_token: impl FnMut(u32, &[f32]) -> Flow,
) -> Result<Output> {
    let gen = Generation::new(model, req, None)?;
    let (output, _) = run(gen, |g| {
        g.step_speculative(model, draft, stats, usize::MAX, &mut on_token)
    })?;
    Ok(output)
}

/// Steps `gen` to its end (the prompt in one pass); what it produced, and its session.
fn run<B: Backend>(
    mut gen: Generation<B>,
    mut step: impl FnMut(&mut Generation<B>) -> Result<Option<FinishReason>>,
) -> Result<(Output, B::Session)> {
    let finish = loop {
        if let Some(finish) = step(&mut gen)? {
            break finish;
        }
    };
    let output = Output {
        prompt_logits: gen.take_prompt_logits(),
        tokens: gen.tokens().to_vec(),
        finish,
        prefill_secs: gen.prefill_secs(),
        decode_secs: gen.decode_secs(),
    };
    Ok((output, gen.into_session()))
}
