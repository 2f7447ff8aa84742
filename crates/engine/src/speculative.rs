//! The drafter side of speculative decoding: something that guesses the next tokens — a small model sharing the
//! tokenizer, run greedily, or prompt lookup ([`crate::ngram`]) for any model — and a [`CostModel`] that decides
//! how many guesses each pass checks. [`crate::Generation::step_speculative`] checks the guesses with one pass
//! of the target and keeps what the target itself would have chosen. A drafting model is any [`Backend`], not
//! necessarily the target's.

use crate::cost_model::{CostModel, PassCost};
use crate::ngram;
use crate::sampler::argmax;
use anyhow::{bail, Context, Result};
use deltafin_models::{Backend, LogitRows, Model, Stats};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

/// Where guesses come from.
pub enum Guesser<D> {
    /// A small model sharing the model's tokenizer, run greedily.
    Model(Arc<D>),
    /// Prompt lookup in the sequence's own tokens.
    Ngram,
}

impl<D> Clone for Guesser<D> {
    fn clone(&self) -> Self {
        match self {
            Guesser::Model(m) => Guesser::Model(m.clone()),
            Guesser::Ngram => Guesser::Ngram,
        }
    }
}

/// `--draft`: `ngram` (prompt lookup) or a drafting model's directory (`./ngram` for one named so).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DraftArg {
    Ngram,
    Model(PathBuf),
}

impl std::str::FromStr for DraftArg {
    type Err = std::convert::Infallible;

    fn from_str(s: &str) -> Result<DraftArg, Self::Err> {
        Ok(match s {
            "ngram" => DraftArg::Ngram,
            dir => DraftArg::Model(dir.into()),
        })
    }
}

impl DraftArg {
    /// The guesser it names, a drafting model loaded on the CPU.
    pub fn load(&self) -> Result<Guesser<Model>> {
        Ok(match self {
            DraftArg::Ngram => Guesser::Ngram,
            DraftArg::Model(dir) => Guesser::Model(Arc::new(
                Model::load(dir)
                    .with_context(|| format!("loading the drafter {}", dir.display()))?,
            )),
        })
    }
}

enum Source<D: Backend> {
    Model {
        model: Arc<D>,
        session: D::Session,
        /// Tokens the session has consumed: always a prefix of the target's history.
        consumed: Vec<u32>,
        /// The states guessing reached: after each guess (but the last) following `consumed`, so that the
        /// guesses the model takes need not be run again.
        ahead: Vec<(u32, D::Session)>,
    },
    Ngram,
}

pub struct Draft<D: Backend> {
    source: Source<D>,
    /// Most guesses checked per target pass.
    pub k: usize,
    /// Guesses compared with the model's choice, and those that matched (guesses past the end are neither).
    pub proposed: u64,
    pub accepted: u64,
    /// Target passes that checked guesses.
    pub passes: u64,
    /// Target passes that re-ran the taken tokens after a guess was refused (a backend that cannot roll back).
    pub reruns: u64,
    /// Decode passes by the number of guesses they checked (index 0: plain steps).
    pub chosen: Vec<u64>,
    /// Checks by the guess the model refused (index 0: the first guess).
    pub refused: Vec<u64>,
    cost: CostModel,
    /// Guess `k` on every pass, whatever the cost model says.
    fixed: bool,
    /// Seconds the drafter spent on guesses the next pass checks (not part of the pass's cost).
    drafting: f64,
    /// Seconds the drafter spent in all.
    pub drafting_secs: f64,
    /// Guesses the last step chose to check.
    last_choice: usize,
    /// Guesses a step chose but could not check, as the backend was already running that step ahead on its
    /// own: the next step checks them instead (see [`Self::guess`]).
    deferred: Option<usize>,
    /// The target's read counters when the current decode step began.
    start: Reads,
    pub stats: Stats,
}

impl<D: Backend> Draft<D> {
    /// Guesses from `guesser`, at most `k` per pass of `target`.
    pub fn new(guesser: Guesser<D>, target: &impl Backend, k: usize) -> Result<Draft<D>> {
        let source = match guesser {
            Guesser::Model(model) => {
                let (dv, tv) = (model.config().vocab_size, target.config().vocab_size);
                if dv != tv {
                    bail!("the drafter's vocabulary has {dv} tokens, the model's {tv}; a drafter must share the model's tokenizer");
                }
                Source::Model {
                    session: model.new_session()?,
                    model,
                    consumed: Vec::new(),
                    ahead: Vec::new(),
                }
            }
            Guesser::Ngram => Source::Ngram,
        };
        Ok(Draft {
            source,
            k,
            proposed: 0,
            accepted: 0,
            passes: 0,
            reruns: 0,
            chosen: vec![0; k + 1],
            refused: vec![0; k],
            cost: CostModel::new(k),
            fixed: false,
            drafting: 0.0,
            drafting_secs: 0.0,
            last_choice: 0,
            deferred: None,
            start: Reads::default(),
            stats: Stats::default(),
        })
    }

    /// Guesses `k` tokens on every pass (fewer only at the end), whatever the measurements say: for tests of
    /// the machinery and for measuring what the cost model saves.
    pub fn fixed(mut self) -> Draft<D> {
        self.fixed = true;
        self
    }

    /// Guesses the next pass of `target` should check, at most `room`: as many as the cost model expects to
    /// pay.
    pub(crate) fn choose(&mut self, target: &impl Backend, room: usize) -> usize {
        self.start = Reads::of(target);
        self.last_choice = if let Some(k) = self.deferred.take() {
            k.min(room)
        } else if self.fixed {
            self.k.min(room)
        } else {
            self.cost.choose(room)
        };
        self.last_choice
    }

    /// Whether the next step is expected to check guesses, so that running it ahead as a plain step would be
    /// wasted: after a deferral, or when the cost model guesses with a drafting model (which always has
    /// guesses). Prompt lookup that found nothing here likely finds nothing next (text repeats in runs).
    pub(crate) fn expects_guesses(&self) -> bool {
        self.deferred.is_some()
            || (self.last_choice > 0 && matches!(self.source, Source::Model { .. }))
    }

    /// Fraction of guesses the target took.
    pub fn acceptance(&self) -> f64 {
        self.accepted as f64 / self.proposed.max(1) as f64
    }

    /// Up to `n` (≥ 1) guesses of the tokens after `history` and `first` (fewer when prompt lookup finds no
    /// match). `ahead`: the backend already runs this step ahead, as a plain step on `first`. Taking it over
    /// costs nothing, while a check would discard it (on a GPU, after waiting for it), so guesses there are
    /// none: the next step checks them instead — unless prompt lookup, which costs nothing to ask, finds none
    /// (then the next step is plain too, and may run ahead).
    pub(crate) fn guess(
        &mut self,
        history: &[u32],
        first: u32,
        n: usize,
        ahead: bool,
    ) -> Result<Vec<u32>> {
        debug_assert!(n > 0, "a step that guesses nothing is a plain step");
        let defer = |d: &mut Self| {
            d.deferred = Some(std::mem::take(&mut d.last_choice));
            Ok(Vec::new())
        };
        if ahead && matches!(self.source, Source::Model { .. }) {
            return defer(self);
        }
        let t0 = Instant::now();
        let guesses = match &mut self.source {
            Source::Ngram => {
                let guesses = ngram::guess(history, first, n);
                if ahead && !guesses.is_empty() {
                    return defer(self);
                }
                guesses
            }
            Source::Model {
                model,
                session,
                consumed,
                ahead,
            } => {
                // `first` is taken whatever the check says: the session itself consumes it.
                let logits = follow(
                    &**model,
                    session,
                    consumed,
                    ahead,
                    history,
                    first,
                    &self.stats,
                )?;
                let mut next = argmax(&logits);
                let mut out = vec![next];
                let mut s = model.fork(session)?;
                while out.len() < n {
                    let logits = model.forward(&mut s, &[next], LogitRows::Last, &self.stats)?;
                    ahead.push((next, model.fork(&s)?));
                    next = argmax(&logits);
                    out.push(next);
                }
                out
            }
        };
        self.drafting = t0.elapsed().as_secs_f64();
        self.drafting_secs += self.drafting;
        self.cost.guessed(n, self.drafting);
        Ok(guesses)
    }

    /// A pass checked `compared` guesses against the model's choices and took the first `taken`.
    pub(crate) fn compared(&mut self, compared: usize, taken: usize) {
        self.proposed += compared as u64;
        self.accepted += taken as u64;
        if taken < compared {
            self.refused[taken] += 1;
        }
        self.cost.compared(compared, taken);
    }

    /// A decode step of `target` whose pass had `rows` rows ends, `since` its start (drafting excluded).
    pub(crate) fn passed(&mut self, target: &impl Backend, rows: usize, since: Instant) {
        let secs = since.elapsed().as_secs_f64() - std::mem::take(&mut self.drafting);
        let reads = Reads::of(target);
        self.cost.passed(
            rows,
            PassCost {
                secs: secs.max(0.0),
                spine_wait: reads.spine_wait - self.start.spine_wait,
                expert_wait: reads.expert_wait - self.start.expert_wait,
                expert_bytes: reads.expert_bytes.saturating_sub(self.start.expert_bytes) as f64,
            },
        );
        self.chosen[rows - 1] += 1;
    }
}

/// A backend's read counters: what its passes have waited on reads so far, and the expert bytes read.
#[derive(Default)]
struct Reads {
    spine_wait: f64,
    expert_wait: f64,
    expert_bytes: u64,
}

impl Reads {
    fn of(model: &impl Backend) -> Reads {
        let store = model.store().snapshot();
        Reads {
            spine_wait: model.spine_wait_secs(),
            expert_wait: store.wait_secs,
            expert_bytes: store.demand_bytes,
        }
    }
}

/// The most tokens a drafting model that fell behind reads to catch up. Where guessing does not pay, the cost
/// model checks a guess only every 32–256 steps; reading every token in between cost the built-in drafter
/// 70 ms of a 0.48 s decode (BENCHMARKS.md, "Stop 26"). It starts again on the latest tokens instead: its
/// guesses may be worse, never the output, which the target checks. (8 measured no better than 32 and cost
/// acceptance where guessing pays.)
const CATCH_UP_MOST: usize = 32;

/// Brings a drafting model's session to the end of `history` and then `first`, returning the logits after
/// `first`: lazily, when it next guesses, so plain steps cost the drafter nothing, and from the furthest state
/// its last guesses reached along it — or, more than [`CATCH_UP_MOST`] tokens behind, from the latest of them.
/// The tokens it had not read and `first` go through one pass (rows of a pass compute the same bits as one at a
/// time; a pass each cost the built-in drafter twice its per-pass overhead). A history that does not extend
/// what it consumed is a new sequence (the next generation on a reused drafter), which it starts afresh with
/// the whole prompt.
fn follow<D: Backend>(
    model: &D,
    session: &mut D::Session,
    consumed: &mut Vec<u32>,
    ahead: &mut Vec<(u32, D::Session)>,
    history: &[u32],
    first: u32,
    stats: &Stats,
) -> Result<Vec<f32>> {
    if !history.starts_with(consumed) {
        *session = model.new_session()?;
        consumed.clear();
        ahead.clear();
    }
    let rest = &history[consumed.len()..];
    let reached = ahead
        .iter()
        .zip(rest)
        .take_while(|((guess, _), token)| guess == *token)
        .count();
    let states = std::mem::take(ahead);
    if let Some((_, state)) = reached
        .checked_sub(1)
        .and_then(|i| states.into_iter().nth(i))
    {
        *session = state;
        consumed.extend_from_slice(&rest[..reached]);
    }
    let mut rest = &history[consumed.len()..];
    if !consumed.is_empty() && rest.len() > CATCH_UP_MOST {
        *session = model.new_session()?;
        rest = &rest[rest.len() - CATCH_UP_MOST..];
        consumed.clear();
        consumed.extend_from_slice(&history[..history.len() - CATCH_UP_MOST]);
    }
    let rows: Vec<u32> = rest.iter().copied().chain([first]).collect();
    let logits = model.forward(session, &rows, LogitRows::Last, stats)?;
    consumed.extend_from_slice(&rows);
    Ok(logits)
}

#[cfg(test)]
mod tests {
    use super::*;
    use deltafin_makemodel::{make_model, Arch, Preset};

    fn drafter_position(d: &Draft<Model>) -> usize {
        match &d.source {
            Source::Model { model, session, .. } => model.position(session),
            Source::Ngram => unreachable!("a model drafts here"),
        }
    }

    #[test]
    fn a_drafter_far_behind_catches_up_on_the_latest_tokens_only() {
        let dir = tempfile::tempdir().unwrap();
        make_model(Arch::KimiK3, Preset::Tiny, 0, dir.path()).unwrap();
        let m = Arc::new(Model::load(dir.path()).unwrap());
        let mut d = Draft::new(Guesser::Model(m.clone()), &*m, 2).unwrap();
        // The first guess reads the whole prompt, however long, and the first token after it.
        let mut history: Vec<u32> = (0..40).map(|i| 5 + i % 50).collect();
        d.guess(&history, 3, 2, false).unwrap();
        assert_eq!(drafter_position(&d), 41);
        // Fewer than CATCH_UP_MOST tokens behind (the first guess's token, then three more): it reads them.
        history.extend([3, 9, 11, 12]);
        d.guess(&history, 4, 2, false).unwrap();
        assert_eq!(drafter_position(&d), 45);
        // 100 tokens behind: it starts again on the latest CATCH_UP_MOST of them.
        history.push(4);
        history.extend((0..100).map(|i| 7 + i % 30));
        d.guess(&history, 6, 2, false).unwrap();
        assert_eq!(drafter_position(&d), CATCH_UP_MOST + 1);
        // And follows the sequence from there.
        history.extend([6, 8]);
        d.guess(&history, 9, 2, false).unwrap();
        assert_eq!(drafter_position(&d), CATCH_UP_MOST + 3);
    }
}
