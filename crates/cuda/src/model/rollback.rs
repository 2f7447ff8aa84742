//! Rolling a session back to any row of its last checking pass: the KDA states from the pass's snapshots
//! (`Keep`), the MLA and GQA caches cut at the position (an entry depends on its own row only). No weight is read and
//! no row runs again.

use super::cuda_model::CudaModel;
use super::session::{CudaSession, State};
use super::spine::{Attn, Kda};
use anyhow::{bail, Result};

/// Floats of one KDA layer's state of one parity: S, then the conv windows (kda_recurrence's layout).
fn state_len(k: &Kda) -> (usize, usize) {
    (k.heads * k.dim * k.dim, 3 * k.heads * k.dim * (k.kern - 1))
}

impl CudaModel {
    /// Before a pass of `n` rows on `session`: whether it keeps them (as `Backend::keep_rows` asked), and room
    /// for its snapshots. The buffers grow to the most rows kept so far and are then reused.
    pub(super) fn begin_keep(&self, session: &mut CudaSession, n: usize) -> Result<()> {
        let keep = &mut session.keep;
        keep.pass = std::mem::take(&mut keep.armed).then_some((session.pos, n));
        if keep.pass.is_none() || n - 1 <= keep.rows {
            return Ok(());
        }
        keep.bufs = Vec::new();
        for layer in &self.layers {
            keep.bufs.push(match &layer.attn {
                Attn::Kda(k) => {
                    let (s, conv) = state_len(k);
                    Some(self.gpu.alloc(4 * (n - 1) * (s + conv))?)
                }
                Attn::Mla(_) | Attn::Gqa(_) => None,
            });
        }
        keep.rows = n - 1;
        keep.grown += 1;
        Ok(())
    }

    /// The state after the first `rows` rows of the session's last pass, which kept them: each KDA layer's
    /// snapshot copied into the copy of that position's parity, which the next pass reads.
    pub(super) fn roll_back(&self, session: &mut CudaSession, rows: usize) -> Result<()> {
        let Some((start, n)) = session.keep.pass.take() else {
            bail!("internal: a rollback without a pass that kept its rows");
        };
        if rows == 0 || rows > n {
            bail!("internal: a rollback to row {rows} of a pass of {n}");
        }
        if rows == n {
            return Ok(());
        }
        let par = (start + rows) & 1;
        for (l, layer) in self.layers.iter().enumerate() {
            let (Attn::Kda(k), State::Kda { conv, s }) = (&layer.attn, &session.layers[l]) else {
                continue;
            };
            let (s_len, conv_len) = state_len(k);
            let snap = session.keep.at_row(l, rows - 1, s_len + conv_len);
            self.gpu
                .dtod(s.ptr + (4 * par * s_len) as u64, snap, 4 * s_len)?;
            self.gpu.dtod(
                conv.ptr + (4 * par * conv_len) as u64,
                snap + (4 * s_len) as u64,
                4 * conv_len,
            )?;
        }
        session.pos = start + rows;
        session.ahead = None;
        Ok(())
    }
}
