//! What the expert kernels need of a record, the VRAM expert cache and its counters, and the resident decode
//! path's tables.

use crate::gpu::{DevBuf, Pinned};
use crate::kernels::ExpertVariant;
use crate::plan::{Ring, SlotCache};
use cudarc::driver::CudaEvent;
use deltafin_store::record::{Encoding, ExpertRecord, Role};

/// What the CUDA expert kernels need of the shared record layout ([`ExpertRecord`], the one description of
/// where an expert's tensors sit): which kernels read it, and the shared memory they stage it in.
pub(super) trait ExpertKernels {
    fn mxfp4(&self) -> bool;
    /// The record's tensor offsets as the kernels take them (BF16 fills the first three).
    fn offsets(&self) -> [u64; 6];
    /// The MXFP4 tensors as `mx_repack` takes them: weights and scales of w1, w2, w3, each `inter` or `width`
    /// rows. gpt-oss's gate_up (2 · inter rows) is repacked as two of them, its halves (the repack moves rows
    /// only within a 32-row group, so the interleaving stays).
    fn repack_parts(&self) -> [u64; 6];
    /// The expert kernels of this encoding that take `rows` x rows a pass over the weights (see
    /// `rows_per_pass`).
    fn variant(&self, rows: usize) -> ExpertVariant;
    /// Their names (up, down).
    fn kernels(&self, rows: usize) -> (&'static str, &'static str) {
        let v = self.variant(rows);
        (v.up(), v.down())
    }
    /// The x rows the expert kernels take a pass over an expert's weights when it has several: MXFP4 two (in the
    /// free columns of the same tensor-core MMAs), BF16 one.
    fn rows_per_pass(&self) -> usize;
    /// Dynamic shared memory of an expert kernel's block that stages `rows` x rows of `len` elements: for BF16
    /// four warps' double-buffered tiles and the x row (4 bytes an element); for MXFP4 per row the block scales'
    /// factors (256 floats) and the row as the tensor cores' fragments (three f16 parts: 6 bytes an element); for
    /// FP8 and INT4 the x row.
    fn expert_smem(&self, len: usize, rows: usize) -> usize;
    /// Dynamic shared memory of an `mx_repack` block: one 32-row group of a tensor, 16 bytes per column of the
    /// longer side.
    fn repack_smem(&self) -> usize;
}

impl ExpertKernels for ExpertRecord {
    fn mxfp4(&self) -> bool {
        matches!(self.encoding, Encoding::Mxfp4 | Encoding::Mxfp4Biased)
    }

    fn offsets(&self) -> [u64; 6] {
        // The kernels' order: w1, w2, w3 (MXFP4, FP8, INT4: weights then scales of each); gpt-oss: gate_up's
        // blocks, scales and bias, then down's.
        let tensors: &[(Role, usize)] = if self.encoding == Encoding::Mxfp4Biased {
            &[
                (Role::GateUp, 0),
                (Role::GateUp, 1),
                (Role::GateUp, Encoding::BIAS),
                (Role::Down, 0),
                (Role::Down, 1),
                (Role::Down, Encoding::BIAS),
            ]
        } else if self.encoding != Encoding::Bf16 {
            &[
                (Role::Gate, 0),
                (Role::Gate, 1),
                (Role::Down, 0),
                (Role::Down, 1),
                (Role::Up, 0),
                (Role::Up, 1),
            ]
        } else {
            &[(Role::Gate, 0), (Role::Down, 0), (Role::Up, 0)]
        };
        let mut at = [0u64; 6];
        for (o, &(role, k)) in at.iter_mut().zip(tensors) {
            *o = self.tensor(role, k).0 as u64;
        }
        at
    }

    fn repack_parts(&self) -> [u64; 6] {
        if self.encoding != Encoding::Mxfp4Biased {
            return self.offsets();
        }
        let [gw, gs, _, dw, ds, _] = self.offsets();
        // The second half of gate_up: inter rows on, of width / 2 bytes of weights and width / 32 scales each.
        let (w, i) = (self.width as u64, self.inter as u64);
        [gw, gs, dw, ds, gw + i * w / 2, gs + i * w / 32]
    }

    fn variant(&self, rows: usize) -> ExpertVariant {
        match (self.encoding, rows) {
            (Encoding::Mxfp4, 1) => ExpertVariant::Mx,
            (Encoding::Mxfp4, _) => ExpertVariant::Mx2,
            (Encoding::Mxfp4Biased, 1) => ExpertVariant::Mxb,
            (Encoding::Mxfp4Biased, _) => ExpertVariant::Mxb2,
            (Encoding::Fp8Block, _) => ExpertVariant::Fp8,
            (Encoding::Int4Group, _) => ExpertVariant::Int4,
            (Encoding::Bf16, _) => ExpertVariant::Bf16,
        }
    }

    fn rows_per_pass(&self) -> usize {
        if self.mxfp4() {
            2
        } else {
            1
        }
    }

    fn expert_smem(&self, len: usize, rows: usize) -> usize {
        match self.encoding {
            Encoding::Mxfp4 | Encoding::Mxfp4Biased => rows * (4 * 256 + 6 * len),
            // The FP8 and INT4 kernels stage only the x row.
            Encoding::Fp8Block | Encoding::Int4Group => 4 * len,
            Encoding::Bf16 => 4 * 2 * 32 * 9 * 16 + 4 * len,
        }
    }

    fn repack_smem(&self) -> usize {
        16 * self.width.max(self.inter)
    }
}

/// What the expert path did on the device (cumulative).
#[derive(Clone, Debug, Default)]
pub struct CudaCounters {
    pub vram_hits: u64,
    pub vram_misses: u64,
    pub h2d_bytes: u64,
    /// Bytes of streamed spine layers copied to the device.
    pub spine_h2d_bytes: u64,
    /// Host time spent getting records from the store and issuing their copies (including the staging memcpy
    /// where the store's slab is not page-locked).
    pub stage_secs: f64,
    /// Host time passes spent issuing their work: everything before waiting for the logits. Near a step's
    /// time, the GPU waits on the host.
    pub issue_secs: f64,
    /// GPU time from a pass's first piece of work to its last (events on the compute stream): the step less
    /// this is the host's start and the logits' return.
    pub gpu_secs: f64,
    /// Decode steps run ahead on the device's choice that the next step took over, and those discarded (the
    /// host chose another token, or the session was used otherwise).
    pub ahead_taken: u64,
    pub ahead_discarded: u64,
}

/// The VRAM expert cache: slots, their bookkeeping, and the pinned staging ring (used only when the store's
/// slab could not be page-locked; otherwise records are copied from the slab directly).
pub(super) struct ExpertCache {
    pub(super) slots: DevBuf,
    pub(super) slot_len: usize,
    pub(super) plan: SlotCache,
    pub(super) staging: Vec<(Pinned, CudaEvent)>,
    pub(super) ring: Ring,
    /// Marks each record's copy for the prep stream to wait on (a wait takes the event as it is when issued, so
    /// one event serves every copy).
    pub(super) copied: CudaEvent,
    pub(super) counters: CudaCounters,
}

impl ExpertCache {
    /// The VRAM address of slot `s`.
    pub(super) fn slot(&self, s: usize) -> u64 {
        self.slots.ptr + (s * self.slot_len) as u64
    }

    /// Each `(union index, slot)` of a wave with its slot's address.
    pub(super) fn placed(&self, list: &[(usize, usize)]) -> Vec<(usize, u64)> {
        list.iter().map(|&(u, s)| (u, self.slot(s))).collect()
    }
}

/// Device tables of the resident decode path: each (layer, expert)'s record pointer, and the expert kernels'
/// fixed tables for one row of top_k entries (row offsets 0..=top_k, which are also the combine's entries, and
/// the row index 0 of every entry).
pub(super) struct Direct {
    pub(super) table: DevBuf,
    pub(super) seq: DevBuf,
    pub(super) row0: DevBuf,
}

#[cfg(test)]
mod tests {
    use super::*;
    use deltafin_formats::config::ModelConfig;
    use std::path::Path;

    /// gpt-oss's records (the released fixture's shape): the biased kernels read gate_up's and down's blocks,
    /// scales and biases where the record keeps them, two rows a pass; mx_repack sees gate_up as two tensors of
    /// `inter` rows, back to back, and down whole.
    #[test]
    fn gpt_oss_records_are_read_and_repacked_where_the_record_keeps_them() {
        let fixture =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/gpt_oss_tiny_mxfp4");
        let lay = ExpertRecord::new(&ModelConfig::from_dir(&fixture).unwrap()).unwrap();
        let at = |role, k| lay.tensor(role, k).0 as u64;
        let (gu, d) = (Role::GateUp, Role::Down);
        assert_eq!(
            lay.offsets(),
            [
                at(gu, 0),
                at(gu, 1),
                at(gu, 2),
                at(d, 0),
                at(d, 1),
                at(d, 2)
            ]
        );
        let (w, i) = (lay.width as u64, lay.inter as u64);
        let r = lay.repack_parts();
        assert_eq!(
            [r[0], r[1], r[2], r[3]],
            [at(gu, 0), at(gu, 1), at(d, 0), at(d, 1)]
        );
        // The second halves start after `inter` rows and end where the next tensor begins.
        assert_eq!([r[4], r[5]], [r[0] + i * w / 2, r[1] + i * w / 32]);
        assert_eq!(
            [r[4] + i * w / 2, r[5] + i * w / 32],
            [at(gu, 1), at(gu, 2)]
        );
        assert!(lay.mxfp4());
        assert_eq!(lay.rows_per_pass(), 2);
        assert_eq!(lay.kernels(1), ("expert_up_mxb", "expert_down_mxb"));
        assert_eq!(lay.kernels(2), ("expert_up_mxb2", "expert_down_mxb2"));
        assert_eq!(lay.variant(2).act(), None);
    }
}
