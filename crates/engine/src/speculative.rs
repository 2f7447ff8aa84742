//! The drafter side of speculative decoding: a small model sharing the tokenizer guesses the next tokens
//! greedily; [`crate::Generation::step_speculative`] checks the guesses with one pass of the target and keeps
//! what the target itself would have chosen. The drafter is any [`Backend`], not necessarily the target's.

use crate::sampler::argmax;
use anyhow::{bail, Result};
use deltafin_models::{Backend, LogitRows, Stats};
use std::sync::Arc;

/// Plain steps after guesses of a single token kept failing.
const PAUSE_STEPS: usize = 8;

pub struct Draft<D: Backend> {
    model: Arc<D>,
    session: D::Session,
    /// Tokens the session has consumed: always a prefix of the target's history.
    consumed: Vec<u32>,
    /// Tokens guessed per target pass.
    pub k: usize,
    /// Guesses compared with the model's choice, and those that matched (guesses past the end are neither).
    pub proposed: u64,
    pub accepted: u64,
    /// Target passes that checked guesses.
    pub passes: u64,
    /// Target passes that re-ran the taken tokens after a guess was refused.
    pub reruns: u64,
    /// Guesses to make next time: grows while all are taken, shrinks while none is.
    len: usize,
    /// Plain steps left before guessing again, after guesses of one token kept failing.
    pause: usize,
    pub stats: Stats,
}

impl<D: Backend> Draft<D> {
    pub fn new(drafter: Arc<D>, target: &impl Backend, k: usize) -> Result<Draft<D>> {
        let (dv, tv) = (drafter.config().vocab_size, target.config().vocab_size);
        if dv != tv {
            bail!("the drafter's vocabulary has {dv} tokens, the model's {tv}; a drafter must share the model's tokenizer");
        }
        Ok(Draft {
            session: drafter.new_session()?,
            model: drafter,
            consumed: Vec::new(),
            k,
            proposed: 0,
            accepted: 0,
            passes: 0,
            reruns: 0,
            len: k,
            pause: 0,
            stats: Stats::default(),
        })
    }

    /// Fraction of guesses the target took.
    pub fn acceptance(&self) -> f64 {
        self.accepted as f64 / self.proposed.max(1) as f64
    }

    /// Whether the next step should guess (and counts down a pause if not).
    pub(crate) fn speculate(&mut self) -> bool {
        if self.k == 0 {
            return false;
        }
        if self.pause > 0 {
            self.pause -= 1;
            return false;
        }
        true
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// After a pass took `taken` of `made` guesses: a drafter that keeps missing costs a re-run each time
    /// without saving a pass, so guess fewer, and after a miss at one guess, pause for a few plain steps.
    pub(crate) fn adapt(&mut self, taken: usize, made: usize) {
        if taken == made {
            self.len = (self.len + 1).min(self.k);
        } else if taken == 0 {
            if self.len == 1 {
                self.pause = PAUSE_STEPS;
            }
            self.len = (self.len - 1).max(1);
        }
    }

    /// Greedy guesses of the `n` tokens after `history` and `first`.
    pub(crate) fn guess(&mut self, history: &[u32], first: u32, n: usize) -> Result<Vec<u32>> {
        self.follow(history)?;
        let mut s = self.model.fork(&self.session)?;
        let mut out = Vec::with_capacity(n);
        let mut next = first;
        for _ in 0..n {
            let logits = self
                .model
                .forward(&mut s, &[next], LogitRows::Last, &self.stats)?;
            next = argmax(&logits);
            out.push(next);
        }
        Ok(out)
    }

    /// Brings the session to the end of `history`, which extends what it has consumed.
    pub(crate) fn follow(&mut self, history: &[u32]) -> Result<()> {
        if !history.starts_with(&self.consumed) {
            bail!("internal: the drafter's history is not a prefix of the model's");
        }
        let rest = &history[self.consumed.len()..];
        if !rest.is_empty() {
            self.model
                .forward(&mut self.session, rest, LogitRows::Last, &self.stats)?;
            self.consumed.extend_from_slice(rest);
        }
        Ok(())
    }
}
