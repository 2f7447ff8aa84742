//! One sequence's device state, its decode graph, and the scratch of a pass.

use crate::devptr::DevPtr;
use crate::gpu::{DevBuf, Pinned};
use anyhow::{bail, Result};
use cudarc::driver::{CudaContext, CudaGraph};
use deltafin_models::Pass;
use std::cell::Cell;
use std::sync::Arc;

/// One sequence's device state.
pub struct CudaSession {
    pub(super) layers: Vec<State>,
    pub(super) pos: usize,
    /// Its one-row resident pass, captured at its first decode step and replayed after (see `DecodeGraph`).
    pub(super) graph: Option<DecodeGraph>,
    /// Its checking passes (several rows, kept for a rollback), one graph per row count (see `check`).
    pub(super) checks: Vec<DecodeGraph>,
    /// A decode step launched on the device's own choice and not yet taken over (`Backend::decode`).
    pub(super) ahead: Option<Ahead>,
    /// What a checking pass keeps for `Backend::rollback`.
    pub(super) keep: Keep,
}

/// A checking pass's snapshots of each KDA layer's state after each of its rows but the last (written by
/// kda_recurrence), so that a rollback is a copy on the device: no re-run of the model. The buffers stay with
/// the session, grown to the most rows a pass has kept, so a checking pass allocates nothing.
#[derive(Default)]
pub(super) struct Keep {
    /// Per layer (none for MLA layers): `rows` snapshots of S then the conv windows (one parity's worth each).
    pub(super) bufs: Vec<Option<DevBuf>>,
    pub(super) rows: usize,
    /// Times the buffers were allocated (a graph that writes them holds their addresses).
    pub(super) grown: u64,
    /// The next pass keeps its rows (`Backend::keep_rows`).
    pub(super) armed: bool,
    /// The last pass's start position and rows, when it kept them.
    pub(super) pass: Option<(usize, usize)>,
}

impl Keep {
    /// Where layer `l`'s snapshots go in the pass now issued (null unless it keeps more than one row).
    pub(super) fn at(&self, l: usize) -> DevPtr<f32> {
        match (self.pass, self.bufs.get(l)) {
            (Some((_, n)), Some(Some(b))) if n > 1 => b.typed(),
            _ => DevPtr::NULL,
        }
    }

    /// The device address of layer `l`'s snapshot after row `row` (`len` floats each).
    pub(super) fn at_row(&self, l: usize, row: usize, len: usize) -> u64 {
        let b = self.bufs[l].as_ref().expect("a KDA layer's snapshots");
        b.ptr + (4 * row * len) as u64
    }

    /// Device memory held.
    pub(super) fn bytes(&self) -> usize {
        self.bufs.iter().flatten().map(|b| b.bytes).sum()
    }
}

/// A step run ahead: the token the device chose for it, and the arena's count of passes once it was issued.
pub(super) struct Ahead {
    pub(super) token: u32,
    pub(super) ticket: u64,
}

/// A session's decode step as a CUDA graph: the whole pass launched at once, so the GPU never waits on the host
/// issuing it and runs its kernels back to back. What changes between steps (the token, the position) is read by
/// the kernels from the pass's header at the start of the scratch: uploaded before a launch, or written by the
/// step before (`decode_pick`) for a step run ahead. Everything else the graph holds is in its key.
pub(super) struct DecodeGraph {
    pub(super) graph: CudaGraph,
    pub(super) key: GraphKey,
    pub(super) ctx: Arc<CudaContext>,
    /// Where the pass leaves its logits, and each layer's count of chosen experts (0 for one row): in the
    /// scratch, which the key pins.
    pub(super) logits: u64,
    pub(super) groups: u64,
}

impl Drop for DecodeGraph {
    fn drop(&mut self) {
        // The graph (a field) is destroyed next, with the context current on whichever thread drops the session
        // (as a pass makes it) and no launch of it still running (a step run ahead may be).
        let _ = self.ctx.bind_to_thread();
        let _ = self.ctx.synchronize();
    }
}

#[derive(PartialEq, Eq, Clone, Copy)]
pub(super) struct GraphKey {
    pub(super) scratch: u64,
    /// The MLA caches' capacity (growing reallocates them).
    pub(super) cap: usize,
    /// The pass's rows, and the snapshot buffers' generation (`Keep::grown`; a one-row pass keeps none).
    pub(super) rows: usize,
    pub(super) keep: u64,
}

// SAFETY: a graph is used only through its session, which a pass holds mutably (never two threads at once).
unsafe impl Send for DecodeGraph {}

impl CudaSession {
    /// Whether its MLA and GQA caches hold `n` more positions.
    pub(super) fn holds(&self, n: usize) -> bool {
        self.layers.iter().all(|st| {
            !matches!(st, State::Mla { cap, .. } | State::Gqa { cap, .. } if *cap < self.pos + n)
        })
    }

    /// The positions its MLA and GQA caches hold (0 without such layers).
    pub(super) fn mla_cap(&self) -> usize {
        self.layers
            .iter()
            .map(|st| match st {
                State::Mla { cap, .. } | State::Gqa { cap, .. } => *cap,
                State::Kda { .. } => 0,
            })
            .max()
            .unwrap_or(0)
    }
}

/// A pass's header, uploaded first: every row's token, then each session's position.
pub(super) fn header(batch: &[Pass<'_, CudaSession>]) -> Vec<u32> {
    let mut h = deltafin_models::batch_tokens(batch);
    h.extend(batch.iter().map(|p| p.session.pos as u32));
    h
}

pub(super) enum State {
    Kda {
        conv: DevBuf,
        s: DevBuf,
    },
    Mla {
        lat: DevBuf,
        pe: DevBuf,
        cap: usize,
    },
    /// Every position's rotated keys and values, sliding layers' too (as the CPU keeps them).
    Gqa {
        k: DevBuf,
        v: DevBuf,
        cap: usize,
    },
}

/// Scratch device memory for one pass, handed out by bumping an offset (allocation would synchronise).
pub(super) struct Arena {
    pub(super) buf: Option<DevBuf>,
    pub(super) off: Cell<usize>,
    /// Page-locked host memory for the pass's small uploads (token ids, expert tables), also bumped: a copy from
    /// pageable memory may synchronise the stream, and each of those costs a round trip. Not reused before the
    /// pass's final synchronisation.
    pub(super) host: Option<Pinned>,
    pub(super) host_off: Cell<usize>,
    /// Whether the pass issued work on the copy or prep stream (streamed layers, experts routed via the host),
    /// which its end must then wait for too.
    pub(super) copies: Cell<bool>,
    /// A pass of several resident rows: where each layer's count of chosen experts lands (0 otherwise).
    pub(super) groups: Cell<u64>,
    /// Passes issued so far: a step run ahead is taken over only if nothing was issued after it.
    pub(super) issued: Cell<u64>,
}

impl Arena {
    pub(super) fn take<T>(&self, bytes: usize) -> Result<DevPtr<T>> {
        let buf = self.buf.as_ref().expect("sized at pass start");
        let at = self.off.get();
        let end = at + bytes.div_ceil(256) * 256;
        if end > buf.bytes {
            bail!(
                "internal: the pass's scratch ({} bytes) is too small",
                buf.bytes
            );
        }
        self.off.set(end);
        Ok(DevPtr::new(buf.ptr + at as u64))
    }
    pub(super) fn f32s(&self, n: usize) -> Result<DevPtr<f32>> {
        self.take(4 * n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use deltafin_models::LogitRows;

    fn session(pos: usize) -> CudaSession {
        CudaSession {
            layers: Vec::new(),
            pos,
            graph: None,
            checks: Vec::new(),
            ahead: None,
            keep: Keep::default(),
        }
    }

    /// The kernels find row t's token at header[t] and session i's position at header[rows + i]; a graphed
    /// decode step's upload and `decode_pick` write the same layout for one row: [token, position].
    #[test]
    fn a_pass_header_holds_every_rows_token_then_each_sessions_position() {
        let (mut a, mut b) = (session(7), session(40));
        let batch = [
            Pass {
                session: &mut a,
                tokens: &[5],
                rows: LogitRows::Last,
            },
            Pass {
                session: &mut b,
                tokens: &[1, 2, 3],
                rows: LogitRows::All,
            },
        ];
        assert_eq!(header(&batch), vec![5, 1, 2, 3, 7, 40]);
        assert_eq!(session(3).mla_cap(), 0, "no MLA layers, no cache");
        assert!(session(3).holds(2), "no MLA layers, nothing to outgrow");
    }
}
