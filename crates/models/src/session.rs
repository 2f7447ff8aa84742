//! A CPU session (one sequence's KDA recurrent states and MLA latent caches), and which rows of a pass need
//! logits, with the bookkeeping that gathers those rows and splits the head's logits back per session.

use crate::backend::{self, Pass};
use crate::blocks::LayerState;
use anyhow::{bail, Result};

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
        let s = &mut *p.session;
        s.kept = s.keep_rows.then_some((s.pos, p.tokens.len()));
        s.keep_rows = false;
        s.pos += p.tokens.len();
    }
    backend::split_rows(logits, vocab, batch)
}

/// One sequence's state: KDA recurrent states and MLA latent caches, one per layer.
pub struct Session {
    pub layers: Vec<LayerState>,
    /// Tokens consumed so far.
    pub pos: usize,
    /// Whether the next pass keeps what a rollback needs (`Backend::keep_rows`).
    pub(crate) keep_rows: bool,
    /// The last pass, when it kept its rows: the position before it and its rows.
    pub(crate) kept: Option<(usize, usize)>,
}

/// A copy continues the sequence; it cannot roll back the original's last pass.
impl Clone for Session {
    fn clone(&self) -> Session {
        Session {
            layers: self.layers.clone(),
            pos: self.pos,
            keep_rows: false,
            kept: None,
        }
    }
}

impl Session {
    /// A session that has consumed nothing.
    pub(crate) fn new(layers: Vec<LayerState>) -> Session {
        Session {
            layers,
            pos: 0,
            keep_rows: false,
            kept: None,
        }
    }

    /// Every value of every layer's state, as bits (for tests of exact equality).
    pub fn state_bits(&self) -> Vec<u32> {
        self.layers.iter().flat_map(LayerState::bits).collect()
    }

    /// Restores the state after the first `rows` rows of the last pass, which kept them.
    pub(crate) fn rollback(&mut self, rows: usize) -> Result<()> {
        let Some((start, pass)) = self.kept.take() else {
            bail!("internal: a rollback of a session whose last pass kept no rows");
        };
        if rows == 0 || rows > pass {
            bail!("internal: a rollback to {rows} rows of a pass of {pass}");
        }
        for layer in &mut self.layers {
            layer.rollback(start, rows, pass)?;
        }
        self.pos = start + rows;
        Ok(())
    }
}
