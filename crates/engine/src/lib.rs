//! The generation loop over a loaded model: prefill the prompt in one pass, then one token per pass, choosing
//! each token with a [`Sampler`]. Sampling only picks among the logits — it never changes which experts run.

pub mod sampler;

use anyhow::{bail, Result};
use deltafin_models::{LogitRows, Model, Session, Stats};
pub use sampler::{Sampler, SamplingParams};
use std::time::Instant;

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
    mut on_token: impl FnMut(u32, &[f32]) -> Flow,
) -> Result<Output> {
    let vocab = model.config().vocab_size;
    if req.prompt.is_empty() {
        bail!("the prompt is empty; give at least one token");
    }
    if let Some(&bad) = req.prompt.iter().find(|&&t| t as usize >= vocab) {
        bail!("prompt token id {bad} is outside the vocabulary (size {vocab})");
    }
    let mut sampler = Sampler::new(req.sampling.clone(), vocab)?;
    let rows = if req.prompt_logits {
        LogitRows::All
    } else {
        LogitRows::Last
    };
    let t0 = Instant::now();
    let logits = model.forward(session, &req.prompt, rows, stats)?;
    let prefill_secs = t0.elapsed().as_secs_f64();
    let mut last = logits[logits.len() - vocab..].to_vec();
    let prompt_logits = req.prompt_logits.then_some(logits);

    let t1 = Instant::now();
    let mut tokens = Vec::new();
    let finish = loop {
        if tokens.len() == req.max_new {
            break FinishReason::Length;
        }
        let next = sampler.pick(&last);
        tokens.push(next);
        if on_token(next, &last) == Flow::Stop {
            break FinishReason::Caller;
        }
        if req.stop_ids.contains(&next) {
            break FinishReason::StopToken;
        }
        if tokens.len() == req.max_new {
            break FinishReason::Length;
        }
        last = model.forward(session, &[next], LogitRows::Last, stats)?;
    };
    Ok(Output {
        tokens,
        prompt_logits,
        finish,
        prefill_secs,
        decode_secs: t1.elapsed().as_secs_f64(),
    })
}
