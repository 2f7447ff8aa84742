//! What the engine needs of a model, whichever device computes it: sessions, forward passes, and copies of a
//! session's state. [`crate::Model`] (the CPU) implements it here and `deltafin-cuda`'s `CudaModel` on the GPU,
//! so generation, sampling, prefix reuse, speculative decoding and serving are written once. It lives with the
//! models rather than the kernels because a session is model state (KDA recurrences, MLA latent caches).

use crate::{LogitRows, Stats};
use anyhow::Result;
use deltafin_formats::config::ModelConfig;
use deltafin_store::ExpertStore;
use std::sync::Arc;

pub trait Backend: Send + Sync {
    /// One sequence's state, where the backend keeps it (host or device memory).
    type Session: Send;

    fn config(&self) -> &ModelConfig;

    /// The store routed experts are read from (for its counters, which a server reads from other threads).
    fn store(&self) -> &Arc<ExpertStore>;

    /// What computes the passes, for reports: the CPU kernels' instruction set, or the GPU.
    fn kernels(&self) -> String;

    /// Whether a pass calls `Stats`' layer hook as each layer finishes (a progress bar can then follow a long
    /// prefill). A GPU pass is issued ahead of its execution, so it cannot say.
    fn reports_layers(&self) -> bool;

    /// A session that has consumed nothing.
    fn new_session(&self) -> Result<Self::Session>;

    /// Runs `tokens` after the session's history (prefill, one decode step, or anything between: the same
    /// code path) and returns logits `[rows, vocab]`: a batch of one.
    fn forward(
        &self,
        session: &mut Self::Session,
        tokens: &[u32],
        rows: LogitRows,
        stats: &Stats,
    ) -> Result<Vec<f32>> {
        let pass = Pass {
            session,
            tokens,
            rows,
        };
        let mut logits = self.forward_batch(&mut [pass], stats)?;
        Ok(logits.pop().expect("one pass, one result"))
    }

    /// One decode step: `forward(session, &[token], LogitRows::Last)`, the same logits. With `ahead`, the backend
    /// may also start the step after it on its own greedy choice from those logits (the lowest id of the
    /// largest) before returning them, so that a GPU never waits on the host between steps. The session's next
    /// one-token step takes that step over when its token is that choice; anything else (another token, a
    /// longer pass, another session's pass) discards it, and the session continues exactly as if it had never
    /// run.
    fn decode(
        &self,
        session: &mut Self::Session,
        token: u32,
        ahead: bool,
        stats: &Stats,
    ) -> Result<Vec<f32>> {
        let _ = ahead;
        self.forward(session, &[token], LogitRows::Last, stats)
    }

    /// Whether `session`'s next one-token step on `token` would take over a step [`Self::decode`] ran ahead
    /// (rather than discard it).
    fn runs_ahead_on(&self, session: &Self::Session, token: u32) -> bool {
        let _ = (session, token);
        false
    }

    /// One pass over several sessions at once: each `Pass` runs its tokens after its session's history, and
    /// gets its logits (`[rows, vocab]`, in batch order). A row's arithmetic never depends on the other rows, so
    /// each session's logits equal those of its own `forward` bit for bit; what the batch shares is the reading
    /// of the weights (a routed expert chosen by several rows is read once for all of them).
    fn forward_batch(
        &self,
        batch: &mut [Pass<'_, Self::Session>],
        stats: &Stats,
    ) -> Result<Vec<Vec<f32>>>;

    /// An independent copy of `session`, equal bit for bit: both continue exactly as the original would.
    fn fork(&self, session: &Self::Session) -> Result<Self::Session>;

    /// Asks `session`'s next pass to keep what [`Self::rollback`] needs to restore the state after any of its
    /// rows. `false` when this backend cannot roll back: the caller then forks before the pass and runs the
    /// rows it takes again.
    fn keep_rows(&self, session: &mut Self::Session) -> bool {
        let _ = session;
        false
    }

    /// Restores a session whose last pass kept its rows ([`Self::keep_rows`]) to the state after the first
    /// `rows` of them: bit for bit the state a pass over only those rows leaves, without reading any weights.
    /// `rows` equal to the pass's drops what was kept.
    fn rollback(&self, session: &mut Self::Session, rows: usize) -> Result<()> {
        let _ = (session, rows);
        anyhow::bail!("internal: this backend does not roll back; fork before the pass instead")
    }

    /// Seconds passes have waited so far for spine layers read from disk on every pass (0 where the spine is
    /// resident): with the store's wait for routed experts, what a pass spends on reads rather than compute.
    fn spine_wait_secs(&self) -> f64 {
        0.0
    }

    /// Tokens `session` has consumed.
    fn position(&self, session: &Self::Session) -> usize;

    /// Memory `session` holds (what the prefix cache counts against its budget).
    fn session_bytes(&self, session: &Self::Session) -> usize;
}

/// One session's part of a batched pass ([`Backend::forward_batch`]).
pub struct Pass<'a, S> {
    pub session: &'a mut S,
    pub tokens: &'a [u32],
    pub rows: LogitRows,
}

impl<S> Pass<'_, S> {
    /// How many rows of logits this session gets: all of its rows, or its last.
    pub fn logit_rows(&self) -> usize {
        match self.rows {
            LogitRows::All => self.tokens.len(),
            LogitRows::Last => 1,
        }
    }
}

/// A batched pass's rows: every session's tokens in batch order.
pub fn batch_tokens<S>(batch: &[Pass<'_, S>]) -> Vec<u32> {
    batch
        .iter()
        .flat_map(|p| p.tokens.iter().copied())
        .collect()
}

/// A batched pass's logits (`[rows, vocab]`, each session's logit rows in batch order) split into each
/// session's. Cut from the back, so the first session keeps the buffer itself (a batch of one copies nothing).
pub fn split_rows<S>(mut logits: Vec<f32>, vocab: usize, batch: &[Pass<'_, S>]) -> Vec<Vec<f32>> {
    let mut out: Vec<Vec<f32>> = batch
        .iter()
        .skip(1)
        .rev()
        .map(|p| logits.split_off(logits.len() - p.logit_rows() * vocab))
        .collect();
    out.push(logits);
    out.reverse();
    out
}
