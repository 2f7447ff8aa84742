//! One request's generation as a step machine: each [`Generation::step`] runs exactly one forward pass (a
//! chunk of the prompt, or one generated token) — or [`Generation::plan`] says what that pass is, so a
//! scheduler can run many requests' passes as one batch — and cancellation is checked between passes.
//! Prefill chunks and token-by-token decoding give bit-identical logits, so how the work is cut never changes
//! the output.

use crate::{Draft, FinishReason, Flow, Request, Sampler};
use anyhow::{bail, Result};
use deltafin_models::{Backend, LogitRows, Stats};
use std::time::Instant;

/// A session that has already consumed `tokens` (a prefix of the prompt), and the logits after them.
pub struct Resume<B: Backend> {
    pub session: B::Session,
    pub tokens: usize,
    /// `[vocab]` logits after the consumed tokens: lets a prompt equal to the stored prefix skip prefill.
    pub logits: Vec<f32>,
}

/// The tokens a session consumed, the session, and the logits after them.
pub type Snapshot<B> = (Vec<u32>, <B as Backend>::Session, Vec<f32>);

/// A pass a generation needs ([`Generation::plan`], [`Generation::plan_speculative`]): its tokens and which
/// rows need logits. `S`: the model's session type.
pub struct Planned<S> {
    pub tokens: Vec<u32>,
    pub rows: LogitRows,
    kind: Kind<S>,
    t0: Instant,
}

enum Kind<S> {
    /// A piece of the prompt.
    Prefill,
    /// A chosen token.
    Token,
    /// A chosen token and the drafter's guesses after it, checked in one pass; the session as it was before,
    /// on a backend that cannot roll back.
    Check(Option<S>),
    /// The tokens a check of `checked` rows took, run again from before it (the check ran past them, on a
    /// backend that cannot roll back).
    Rerun { checked: usize },
}

impl<S> Planned<S> {
    /// A piece of the prompt (otherwise generated tokens).
    pub fn prefill(&self) -> bool {
        matches!(self.kind, Kind::Prefill)
    }

    /// One chosen token to feed: a decode step (`Backend::decode`).
    pub fn decode_step(&self) -> bool {
        matches!(self.kind, Kind::Token)
    }
}

pub struct Generation<B: Backend> {
    session: B::Session,
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

impl<B: Backend> Generation<B> {
    /// Starts `req` on a fresh session, or on `resume` (whose consumed tokens must be a prefix of the prompt).
    pub fn new(model: &B, req: &Request, resume: Option<Resume<B>>) -> Result<Generation<B>> {
        let Some(r) = resume else {
            return Generation::start(model, req, model.new_session()?, 0, None);
        };
        if req.prompt_logits {
            bail!("prompt logits need the whole prompt computed; do not resume a session");
        }
        let pos = model.position(&r.session);
        if r.tokens == 0 || r.tokens > req.prompt.len() || pos != r.tokens {
            bail!(
                "a resumed session must have consumed 1..={} prompt tokens (it has {}, at position {pos})",
                req.prompt.len(),
                r.tokens,
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
    pub fn continuing(model: &B, req: &Request, session: B::Session) -> Result<Generation<B>> {
        Generation::start(model, req, session, 0, None)
    }

    fn start(
        model: &B,
        req: &Request,
        session: B::Session,
        reused: usize,
        last: Option<Vec<f32>>,
    ) -> Result<Generation<B>> {
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
        model: &B,
        stats: &Stats,
        prefill_chunk: usize,
        on_token: impl FnMut(u32, &[f32]) -> Flow,
    ) -> Result<Option<FinishReason>> {
        if let Some(next) = self.plan(prefill_chunk, on_token) {
            let logits = if next.decode_step() {
                let ahead = self.runs_ahead();
                model.decode(&mut self.session, next.tokens[0], ahead, stats)?
            } else {
                model.forward(&mut self.session, &next.tokens, next.rows, stats)?
            };
            self.apply(next, logits, model.config().vocab_size);
        }
        Ok(self.finish)
    }

    /// [`Self::step`] up to its pass: the prompt's next piece, or the chosen token (shown to `on_token`) to
    /// feed. `None` when no pass is needed: generation is over (perhaps with the token just chosen). The pass
    /// is then run on [`Self::session_mut`] — alone, or in a batch with other generations' passes
    /// ([`Backend::forward_batch`]) — and its logits handed to [`Self::apply`].
    pub fn plan(
        &mut self,
        prefill_chunk: usize,
        mut on_token: impl FnMut(u32, &[f32]) -> Flow,
    ) -> Option<Planned<B::Session>> {
        if self.finish.is_some() {
            return None;
        }
        let t0 = Instant::now();
        if self.last.is_none() {
            let start = self.history.len();
            let end = self.prompt.len().min(start + prefill_chunk.max(1));
            let rows = if self.prompt_logits.is_some() {
                LogitRows::All
            } else {
                LogitRows::Last
            };
            return Some(Planned {
                tokens: self.prompt[start..end].to_vec(),
                rows,
                kind: Kind::Prefill,
                t0,
            });
        }
        let next = self.choose(t0, &mut on_token)?;
        Some(Planned {
            tokens: vec![next],
            rows: LogitRows::Last,
            kind: Kind::Token,
            t0,
        })
    }

    /// Chooses the next token from the logits after the history and hands it out; `None` when generation
    /// ends with it (it is then not fed).
    fn choose(
        &mut self,
        t0: Instant,
        on_token: &mut impl FnMut(u32, &[f32]) -> Flow,
    ) -> Option<u32> {
        let last = self.last.take().expect("prefilled");
        let next = self.sampler.pick(&last);
        self.finish = self.emit(next, &last, on_token);
        self.last = Some(last);
        if self.finish.is_some() {
            self.decode_secs += t0.elapsed().as_secs_f64();
            return None;
        }
        Some(next)
    }

    /// Whether a decode step may let the backend run the step after it ahead on its own greedy choice
    /// (`Backend::decode`): a greedy generation with room for a token after the next. The sampler still picks
    /// every token from the logits, and another pick discards that step.
    pub fn runs_ahead(&self) -> bool {
        self.sampler.greedy() && self.tokens.len() + 1 < self.max_new
    }

    /// The session a planned pass runs on.
    pub fn session_mut(&mut self) -> &mut B::Session {
        &mut self.session
    }

    /// Runs the pass `planned` describes alone, on a session rebuilt from the tokens this generation's session
    /// had consumed (`history`, in pieces of `chunk`): for a batched pass that failed part way, which leaves
    /// every session of its batch in no defined state. A row never depends on the other rows of its pass, so
    /// the logits are those the batched pass would have given this generation.
    pub fn run_alone(
        &mut self,
        model: &B,
        planned: &Planned<B::Session>,
        chunk: usize,
        stats: &Stats,
    ) -> Result<Vec<f32>> {
        let mut session = model.new_session()?;
        for piece in self.history.chunks(chunk.max(1)) {
            model.forward(&mut session, piece, LogitRows::Last, stats)?;
        }
        if matches!(planned.kind, Kind::Check(None)) {
            model.keep_rows(&mut session);
        }
        self.session = session;
        model.forward(&mut self.session, &planned.tokens, planned.rows, stats)
    }

    /// Takes the logits of the pass `planned` described (run on this generation's session; planned by
    /// [`Self::plan`]).
    pub fn apply(&mut self, planned: Planned<B::Session>, logits: Vec<f32>, vocab: usize) {
        self.history.extend_from_slice(&planned.tokens);
        if !planned.prefill() {
            self.last = Some(logits);
            self.decode_secs += planned.t0.elapsed().as_secs_f64();
            return;
        }
        let last = logits[logits.len() - vocab..].to_vec();
        if let Some(all) = &mut self.prompt_logits {
            all.extend(logits);
        }
        if self.history.len() == self.prompt.len() {
            self.last = Some(last);
            if self.max_new == 0 {
                self.finish = Some(FinishReason::Length);
            }
        }
        self.prefill_secs += planned.t0.elapsed().as_secs_f64();
    }

    /// Hands a chosen token out; whether generation ends with it.
    fn emit(
        &mut self,
        token: u32,
        logits: &[f32],
        on_token: &mut impl FnMut(u32, &[f32]) -> Flow,
    ) -> Option<FinishReason> {
        self.tokens.push(token);
        if on_token(token, logits) == Flow::Stop {
            Some(FinishReason::Caller)
        } else if self.stop_ids.contains(&token) {
            Some(FinishReason::StopToken)
        } else if self.tokens.len() >= self.max_new {
            Some(FinishReason::Length)
        } else {
            None
        }
    }

    /// Like [`Self::step`], but once the prompt is consumed each step chooses the next token, lets `draft`
    /// guess up to `draft.k` more (as many as its cost model expects to pay, perhaps none), and checks them all
    /// with one multi-row pass of `model`. Every token is still chosen by this generation's sampler from
    /// `model`'s logits for exactly the same history, and a pass's rows equal single-token passes bit for bit,
    /// so the tokens and logits handed out are exactly those of [`Self::step`] — the drafter only decides how
    /// many come out of one pass.
    pub fn step_speculative<D: Backend>(
        &mut self,
        model: &B,
        draft: &mut Draft<D>,
        stats: &Stats,
        prefill_chunk: usize,
        mut on_token: impl FnMut(u32, &[f32]) -> Flow,
    ) -> Result<Option<FinishReason>> {
        let mut next = self.plan_speculative(model, draft, prefill_chunk, &mut on_token)?;
        while let Some(p) = next {
            let logits = if p.decode_step() {
                // A step run ahead would be thrown away by a checking pass after it: it runs unless the next
                // step is expected to check guesses (a check that finds it running takes it over instead).
                let ahead = self.runs_ahead() && !draft.expects_guesses();
                model.decode(&mut self.session, p.tokens[0], ahead, stats)?
            } else {
                model.forward(&mut self.session, &p.tokens, p.rows, stats)?
            };
            next = self.apply_speculative(model, p, logits, draft, &mut on_token)?;
        }
        Ok(self.finish)
    }

    /// [`Self::step_speculative`] up to its pass, as [`Self::plan`] is for [`Self::step`]: the chosen token
    /// (shown to `on_token`) and `draft`'s guesses after it, to check in one pass — or, when this step does not
    /// guess, what [`Self::plan`] plans. The session keeps what rolling back to any row of the check needs, or,
    /// on a backend that cannot roll back, the check carries a copy of the session as it was.
    pub fn plan_speculative<D: Backend>(
        &mut self,
        model: &B,
        draft: &mut Draft<D>,
        prefill_chunk: usize,
        mut on_token: impl FnMut(u32, &[f32]) -> Flow,
    ) -> Result<Option<Planned<B::Session>>> {
        let room = self.max_new.saturating_sub(self.tokens.len() + 1);
        let guesses = if self.finish.is_none() && self.last.is_some() {
            draft.choose(model, room)
        } else {
            0
        };
        if guesses == 0 {
            return Ok(self.plan(prefill_chunk, on_token));
        }
        let t0 = Instant::now();
        let Some(first) = self.choose(t0, &mut on_token) else {
            return Ok(None);
        };
        let ahead = model.runs_ahead_on(&self.session, first);
        let guesses = draft.guess(&self.history, first, guesses, ahead)?;
        let mut tokens = vec![first];
        tokens.extend_from_slice(&guesses);
        let kind = if guesses.is_empty() {
            Kind::Token
        } else if model.keep_rows(&mut self.session) {
            Kind::Check(None)
        } else {
            Kind::Check(Some(model.fork(&self.session)?))
        };
        let rows = if guesses.is_empty() {
            LogitRows::Last
        } else {
            LogitRows::All
        };
        Ok(Some(Planned {
            tokens,
            rows,
            kind,
            t0,
        }))
    }

    /// Takes the logits of a pass [`Self::plan_speculative`] planned. A check keeps each guess while this
    /// generation's sampler picks it from the pass's rows (showing it to `on_token`). If the pass ran past the
    /// tokens taken (a guess refused, or a token that ends generation, which is handed out but not fed), the
    /// session is rolled back to the taken rows — or, on a backend that cannot roll back, this returns the pass
    /// that runs them again from before the check; its logits come here too.
    pub fn apply_speculative<D: Backend>(
        &mut self,
        model: &B,
        planned: Planned<B::Session>,
        logits: Vec<f32>,
        draft: &mut Draft<D>,
        mut on_token: impl FnMut(u32, &[f32]) -> Flow,
    ) -> Result<Option<Planned<B::Session>>> {
        let vocab = model.config().vocab_size;
        let t0 = planned.t0;
        let before = match planned.kind {
            Kind::Prefill => {
                self.apply(planned, logits, vocab);
                return Ok(None);
            }
            Kind::Token => {
                self.apply(planned, logits, vocab);
                draft.passed(model, 1, t0);
                return Ok(None);
            }
            Kind::Rerun { checked } => {
                self.last = Some(logits);
                self.checked(&planned.tokens, t0);
                draft.passed(model, checked, t0);
                return Ok(None);
            }
            Kind::Check(before) => before,
        };
        let tokens = planned.tokens;
        let guesses = &tokens[1..];
        let row = |i: usize| &logits[i * vocab..(i + 1) * vocab];
        let mut fed = vec![tokens[0]];
        let mut compared = 0;
        for (i, &guess) in guesses.iter().enumerate() {
            compared += 1;
            let rewind = self.sampler.clone();
            if self.sampler.pick(row(i)) != guess {
                // The target chooses otherwise here: that choice is made again, from the same state, next step.
                self.sampler = rewind;
                break;
            }
            if let Some(f) = self.emit(guess, row(i), &mut on_token) {
                self.finish = Some(f);
                break;
            }
            fed.push(guess);
        }
        // A guess that ended generation was taken, though not fed.
        let taken = fed.len() - 1 + usize::from(self.finish.is_some());
        draft.compared(compared, taken);
        draft.passes += 1;
        match before {
            Some(before) if fed.len() < tokens.len() => {
                self.session = before;
                draft.reruns += 1;
                Ok(Some(Planned {
                    tokens: fed,
                    rows: LogitRows::Last,
                    kind: Kind::Rerun {
                        checked: tokens.len(),
                    },
                    t0,
                }))
            }
            _ => {
                // Rolled back to the fed rows (or, all of them fed, rid of what the pass kept for that).
                if before.is_none() {
                    model.rollback(&mut self.session, fed.len())?;
                }
                self.last = Some(row(fed.len() - 1).to_vec());
                self.checked(&fed, t0);
                draft.passed(model, tokens.len(), t0);
                Ok(None)
            }
        }
    }

    /// A check's taken tokens `fed` join the history.
    fn checked(&mut self, fed: &[u32], t0: Instant) {
        self.history.extend_from_slice(fed);
        self.decode_secs += t0.elapsed().as_secs_f64();
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

    /// A copy of the session and the tokens it consumed with the logits after them, once the prompt is
    /// consumed: exactly what a later request extending these tokens can resume from.
    pub fn snapshot(&self, model: &B) -> Result<Option<Snapshot<B>>> {
        let Some(last) = &self.last else {
            return Ok(None);
        };
        let session = model.fork(&self.session)?;
        Ok(Some((self.history.clone(), session, last.clone())))
    }

    /// Like [`Self::snapshot`], consuming the generation (no copy of the session).
    pub fn into_snapshot(self) -> Option<Snapshot<B>> {
        let last = self.last?;
        Some((self.history, self.session, last))
    }

    /// The session, whatever state it is in.
    pub fn into_session(self) -> B::Session {
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
