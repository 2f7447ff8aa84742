//! A CPU session (one sequence's KDA recurrent states and MLA latent caches), and which rows of a pass need
//! logits, with the bookkeeping that gathers those rows and splits the head's logits back per session.

use crate::backend::{self, Pass};
use crate::blocks::LayerState;

/// Which rows of a pass need logits: all of them (a scored prompt, verification) or only the last (generation).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogitRows {
    All,
    Last,
}

/// The rows of `h` (`[rows, hd]`, the batch's rows in order) that need logits: each session's last row, or all
/// of its rows.
pub(crate) fn logit_rows(h: &[f32], hd: usize, batch: &[Pass<'_, Session>]) -> Vec<f32> {
    let mut out = Vec::new();
    let mut at = 0;
    for p in batch {
        let n = p.tokens.len();
        out.extend_from_slice(&h[(at + n - p.logit_rows()) * hd..(at + n) * hd]);
        at += n;
    }
    out
}

/// The head's logits (`[rows, vocab]` for `logit_rows`' rows) split back into each session's, whose position
/// moves past its tokens.
pub(crate) fn split_logits(
    logits: Vec<f32>,
    vocab: usize,
    batch: &mut [Pass<'_, Session>],
) -> Vec<Vec<f32>> {
    for p in batch.iter_mut() {
        p.session.pos += p.tokens.len();
    }
    backend::split_rows(logits, vocab, batch)
}

/// One sequence's state: KDA recurrent states and MLA latent caches, one per layer.
#[derive(Clone)]
pub struct Session {
    pub layers: Vec<LayerState>,
    /// Tokens consumed so far.
    pub pos: usize,
}
