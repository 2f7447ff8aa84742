//! Exact reuse of conversation state: a memory-bounded, least-recently-used store of sessions keyed by the
//! tokens they consumed. A prompt that extends a stored key continues from a copy of that session (its KDA
//! states and MLA latent caches, forked where the backend keeps them) and computes only the rest — the same
//! logits as recomputing, because a prefix run in any number of passes gives bit-identical state.

use crate::Resume;
use anyhow::Result;
use deltafin_models::Backend;

struct Entry<B: Backend> {
    tokens: Vec<u32>,
    session: B::Session,
    /// Logits after `tokens`.
    logits: Vec<f32>,
    bytes: usize,
    last_used: u64,
}

pub struct PrefixCache<B: Backend> {
    budget: usize,
    used: usize,
    clock: u64,
    entries: Vec<Entry<B>>,
    hits: u64,
    misses: u64,
}

impl<B: Backend> PrefixCache<B> {
    /// A cache holding at most `budget_bytes` of sessions, tokens and logits (0 disables it).
    pub fn new(budget_bytes: usize) -> PrefixCache<B> {
        PrefixCache {
            budget: budget_bytes,
            used: 0,
            clock: 0,
            entries: Vec::new(),
            hits: 0,
            misses: 0,
        }
    }

    /// The longest stored key that is a prefix of `prompt` (possibly all of it), as a copy to resume from.
    pub fn lookup(&mut self, model: &B, prompt: &[u32]) -> Result<Option<Resume<B>>> {
        self.clock += 1;
        let best = self
            .entries
            .iter_mut()
            .filter(|e| prompt.starts_with(&e.tokens))
            .max_by_key(|e| e.tokens.len());
        let Some(e) = best else {
            self.misses += 1;
            return Ok(None);
        };
        self.hits += 1;
        e.last_used = self.clock;
        Ok(Some(Resume {
            session: model.fork(&e.session)?,
            tokens: e.tokens.len(),
            logits: e.logits.clone(),
        }))
    }

    /// Stores `session`, the state after `tokens` (replacing an entry with the same key), evicting least
    /// recently used entries to stay within the budget; an entry larger than the whole budget is not stored.
    pub fn insert(&mut self, model: &B, tokens: Vec<u32>, session: B::Session, logits: Vec<f32>) {
        if tokens.is_empty() {
            return;
        }
        self.remove_where(|e| e.tokens == tokens);
        let bytes = model.session_bytes(&session) + 4 * (tokens.len() + logits.len());
        if bytes > self.budget {
            return;
        }
        while self.used + bytes > self.budget {
            let Some(oldest) = self
                .entries
                .iter()
                .enumerate()
                .min_by_key(|(_, e)| e.last_used)
                .map(|(i, _)| i)
            else {
                break;
            };
            self.used -= self.entries.swap_remove(oldest).bytes;
        }
        self.clock += 1;
        self.used += bytes;
        self.entries.push(Entry {
            tokens,
            session,
            logits,
            bytes,
            last_used: self.clock,
        });
    }

    fn remove_where(&mut self, pred: impl Fn(&Entry<B>) -> bool) {
        let used = &mut self.used;
        self.entries.retain(|e| {
            let remove = pred(e);
            if remove {
                *used -= e.bytes;
            }
            !remove
        });
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Bytes held (sessions, keys and logits).
    pub fn used_bytes(&self) -> usize {
        self.used
    }

    pub fn budget_bytes(&self) -> usize {
        self.budget
    }

    /// Lookups that found a stored prefix / that found none.
    pub fn hits(&self) -> u64 {
        self.hits
    }

    pub fn misses(&self) -> u64 {
        self.misses
    }
}
