//! One request's generation as a step machine: each [`Generation::step`] runs exactly one forward pass (a
//! chunk of the prompt, or one generated token), so a scheduler can interleave many requests and check for
//! cancellation between passes. Prefill chunks and token-by-token decoding give bit-identical logits, so
//! how the work is cut never changes the output.

use crate::{FinishReason, Flow, Request, Sampler};
use anyhow::{bail, Result};
use deltafin_models::{LogitRows, Model, Session, Stats};
use std::time::Instant;

/// A session that has already consumed `tokens` (a prefix of the prompt), and the logits after them.
pub struct Resume {
    pub session: Session,
    pub tokens: usize,
    /// `[vocab]` logits after the consumed tokens: lets a prompt equal to the stored prefix skip prefill.
    pub logits: Vec<f32>,
}

pub struct Generation {
    session: Session,
    prompt: Vec<u32>,
    /// Tokens the session has consumed: a prefix of the prompt, then the fed generated tokens.
    history: Vec<u32>,
    /// Logits after `history` (the distribution of the next token); `None` until the prompt is consumed.
    last: Option<Vec<f32>>,
    prompt_logits: Option<Vec<f32>>,
    sampler: Sampler,
    tokens: Vec<u32>,
    max_new: usize,
    stop_ids: Vec<u32>,
    reused: usize,
    finish: Option<FinishReason>,
    prefill_secs: f64,
    decode_secs: f64,
}

impl Generation {
    /// Starts `req` on a fresh session, or on `resume` (whose consumed tokens must be a prefix of the prompt).
    pub fn new(model: &Model, req: &Request, resume: Option<Resume>) -> Result<Generation> {
        let Some(r) = resume else {
            return Generation::start(model, req, model.new_session(), 0, None);
        };
        if req.prompt_logits {
            bail!("prompt logits need the whole prompt computed; do not resume a session");
        }
        if r.tokens == 0 || r.tokens > req.prompt.len() || r.session.pos != r.tokens {
            bail!(
                "a resumed session must have consumed 1..={} prompt tokens (it has {}, at position {})",
                req.prompt.len(),
                r.tokens,
                r.session.pos
            );
        }
        if r.logits.len() != model.config().vocab_size {
            bail!(
                "resumed logits have {} entries, the vocabulary {}",
                r.logits.len(),
                model.config().vocab_size
            );
        }
        let last = (r.tokens == req.prompt.len()).then_some(r.logits);
        Generation::start(model, req, r.session, r.tokens, last)
    }

    /// Continues `session`, whose history (if any) precedes the whole of `req.prompt`.
    pub fn continuing(model: &Model, req: &Request, session: Session) -> Result<Generation> {
        Generation::start(model, req, session, 0, None)
    }

    fn start(
        model: &Model,
        req: &Request,
        session: Session,
        reused: usize,
        last: Option<Vec<f32>>,
    ) -> Result<Generation> {
        let vocab = model.config().vocab_size;
        if req.prompt.is_empty() {
            bail!("the prompt is empty; give at least one token");
        }
        if let Some(&bad) = req.prompt.iter().find(|&&t| t as usize >= vocab) {
            bail!("prompt token id {bad} is outside the vocabulary (size {vocab})");
        }
        let finish = (last.is_some() && req.max_new == 0).then_some(FinishReason::Length);
        Ok(Generation {
            sampler: Sampler::new(req.sampling.clone(), vocab)?,
            session,
            prompt: req.prompt.clone(),
            history: req.prompt[..reused].to_vec(),
            last,
            prompt_logits: req.prompt_logits.then(Vec::new),
            tokens: Vec::new(),
            max_new: req.max_new,
            stop_ids: req.stop_ids.clone(),
            reused,
            finish,
            prefill_secs: 0.0,
            decode_secs: 0.0,
        })
    }

    /// One forward pass: the next (at most `prefill_chunk`-token) piece of the prompt, or — once the prompt
    /// is consumed — choose a token, show it to `on_token(token, logits_that_chose_it)`, and feed it. Returns
    /// the finish reason once generation is over (and then does nothing more).
    pub fn step(
        &mut self,
        model: &Model,
        stats: &Stats,
        prefill_chunk: usize,
        mut on_token: impl FnMut(u32, &[f32]) -> Flow,
    ) -> Result<Option<FinishReason>> {
        if self.finish.is_some() {
            return Ok(self.finish);
        }
        let Some(last) = &self.last else {
            let t0 = Instant::now();
            let start = self.history.len();
            let end = self.prompt.len().min(start + prefill_chunk.max(1));
            let chunk = &self.prompt[start..end];
            let rows = if self.prompt_logits.is_some() {
                LogitRows::All
            } else {
                LogitRows::Last
            };
            let logits = model.forward(&mut self.session, chunk, rows, stats)?;
            let vocab = model.config().vocab_size;
            let last = logits[logits.len() - vocab..].to_vec();
            if let Some(all) = &mut self.prompt_logits {
                all.extend_from_slice(&logits);
            }
            self.history.extend_from_slice(chunk);
            if end == self.prompt.len() {
                self.last = Some(last);
                if self.max_new == 0 {
                    self.finish = Some(FinishReason::Length);
                }
            }
            self.prefill_secs += t0.elapsed().as_secs_f64();
            return Ok(self.finish);
        };
        let t0 = Instant::now();
        let next = self.sampler.pick(last);
        self.tokens.push(next);
        self.finish = if on_token(next, last) == Flow::Stop {
            Some(FinishReason::Caller)
        } else if self.stop_ids.contains(&next) {
            Some(FinishReason::StopToken)
        } else if self.tokens.len() >= self.max_new {
            Some(FinishReason::Length)
        } else {
            let logits = model.forward(&mut self.session, &[next], LogitRows::Last, stats)?;
            self.history.push(next);
            self.last = Some(logits);
            None
        };
        self.decode_secs += t0.elapsed().as_secs_f64();
        Ok(self.finish)
    }

    /// Whether the whole prompt has been consumed.
    pub fn prefilled(&self) -> bool {
        self.last.is_some()
    }

    /// Prompt tokens taken from a resumed session instead of being computed.
    pub fn reused(&self) -> usize {
        self.reused
    }

    pub fn prompt_len(&self) -> usize {
        self.prompt.len()
    }

    /// Generated tokens so far.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    pub fn finish_reason(&self) -> Option<FinishReason> {
        self.finish
    }

    pub fn prefill_secs(&self) -> f64 {
        self.prefill_secs
    }

    pub fn decode_secs(&self) -> f64 {
        self.decode_secs
    }

    /// The session and the tokens it consumed with the logits after them, once the prompt is consumed:
    /// exactly what a later request extending these tokens can resume from.
    pub fn snapshot(&self) -> Option<(Vec<u32>, Session, Vec<f32>)> {
        let last = self.last.as_ref()?;
        Some((self.history.clone(), self.session.clone(), last.clone()))
    }

    /// Like [`Self::snapshot`], consuming the generation (no copy of the session).
    pub fn into_snapshot(self) -> Option<(Vec<u32>, Session, Vec<f32>)> {
        let last = self.last?;
        Some((self.history, self.session, last))
    }

    /// The session, whatever state it is in.
    pub fn into_session(self) -> Session {
        self.session
    }

    /// The `[prompt_len, vocab]` logits, when the request asked for them and the prompt is consumed.
    pub fn take_prompt_logits(&mut self) -> Option<Vec<f32>> {
        if self.prefilled() {
            self.prompt_logits.take()
        } else {
            None
        }
    }
}
