//! The generation loop over a loaded model: prefill the prompt, then one token per pass, choosing each token
//! with a [`Sampler`]. Sampling only picks among the logits — it never changes which experts run.
//!
//! Serving builds on it: [`Generation`] (one request as a step machine), [`Scheduler`] (a worker thread that
//! interleaves requests fairly, with a bounded queue and cancellation), [`PrefixCache`] (exact reuse of the
//! state of an earlier prompt), [`logprobs`] and [`StopMatcher`] (stop strings across token boundaries).

pub mod generation;
pub mod logprobs;
pub mod prefix_cache;
pub mod sampler;
pub mod scheduler;
pub mod speculative;
pub mod stop;

use anyhow::Result;
use deltafin_models::{Model, Session, Stats};
pub use generation::{Generation, Resume};
pub use logprobs::{logprobs, TokenLogprob};
pub use prefix_cache::{session_bytes, PrefixCache};
pub use sampler::{Sampler, SamplingParams};
pub use scheduler::{Finished, Job, Rejected, Scheduler, SchedulerConfig, Sink};
pub use speculative::Draft;
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
pub fn generate(
    model: &Model,
    req: &Request,
    stats: &Stats,
    on_token: impl FnMut(u32, &[f32]) -> Flow,
) -> Result<Output> {
    let mut session = model.new_session();
    generate_in(model, &mut session, req, stats, on_token)
}

/// Like [`generate`], continuing `session` (whose history precedes `req.prompt`).
pub fn generate_in(
    model: &Model,
    session: &mut Session,
    req: &Request,
    stats: &Stats,
    on_token: impl FnMut(u32, &[f32]) -> Flow,
) -> Result<Output> {
    run(model, session, req, stats, None, on_token)
}

/// Like [`generate`] with speculative decoding: `draft` guesses, `model` checks. The tokens and logits handed
/// out are exactly those of [`generate`].
pub fn generate_speculative(
    model: &Model,
    draft: &mut Draft,
    req: &Request,
    stats: &Stats,
    on_token: impl FnMut(u32, &[f32]) -> Flow,
) -> Result<Output> {
    let mut session = model.new_session();
    run(model, &mut session, req, stats, Some(draft), on_token)
}

fn run(
    model: &Model,
    session: &mut Session,
    req: &Request,
    stats: &Stats,
    mut draft: Option<&mut Draft>,
    mut on_token: impl FnMut(u32, &[f32]) -> Flow,
) -> Result<Output> {
    let taken = std::mem::replace(
        session,
        Session {
            layers: Vec::new(),
            pos: 0,
        },
    );
    let mut gen = Generation::continuing(model, req, taken)?;
    let result = loop {
        let step = match &mut draft {
            Some(d) => gen.step_speculative(model, d, stats, usize::MAX, &mut on_token),
            None => gen.step(model, stats, usize::MAX, &mut on_token),
        };
        match step {
            Ok(Some(finish)) => break Ok(finish),
            Ok(None) => {}
            Err(e) => break Err(e),
        }
    };
    let prompt_logits = gen.take_prompt_logits();
    let tokens = gen.tokens().to_vec();
    let (prefill_secs, decode_secs) = (gen.prefill_secs(), gen.decode_secs());
    *session = gen.into_session();
    Ok(Output {
        tokens,
        prompt_logits,
        finish: result?,
        prefill_secs,
        decode_secs,
    })
}
