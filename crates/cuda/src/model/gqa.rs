//! Grouped-query attention with learned sinks (gpt-oss; deltafin_models::gqa) on the device: the biased q/k/v
//! projections as one matmul, their biases, rotation and cache append (`gqa_append`), the attention over the
//! session's caches (`gqa_attend`), and the biased output projection.

use super::cuda_model::CudaModel;
use super::forward::Mm;
use super::session::Arena;
use super::spine::Gqa;
use crate::devptr::DevPtr;
use crate::gpu::{DevBuf, Doing};
use crate::kernels::{BiasRows, GqaAppend, GqaAttend};
use anyhow::Result;

impl CudaModel {
    /// The attention of RMS(x) (`norm`) up to the output projection; `(kc, vc, cap)`: the session's caches
    /// and the positions they hold (every position: a rollback only moves the session's position back).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn gqa(
        &self,
        a: &Arena,
        g: &Gqa,
        x: DevPtr<f32>,
        norm: (DevPtr<f32>, f32),
        n: usize,
        (kc, vc, cap): (DevPtr<f32>, DevPtr<f32>, usize),
        pos: DevPtr<u32>,
    ) -> Result<DevPtr<f32>> {
        let y = self.mm_parts(a, &g.xin, &[&g.q, &g.k, &g.v], x, n, Some(norm))?;
        let [bq, bk, bv] = &g.bias;
        GqaAppend {
            q: y[0],
            k: y[1],
            v: y[2],
            bq: bq.ptr(),
            bk: bk.ptr(),
            bv: bv.ptr(),
            inv_freq: g.inv_freq.ptr(),
            attn: g.attn,
            kc,
            vc,
            pos,
            n,
            heads: g.heads,
            kv_heads: g.kv_heads,
            dim: g.dim,
        }
        .go(&self.gpu)?;
        let out = a.f32s(n * g.heads * g.dim)?;
        GqaAttend {
            q: y[0],
            kc,
            vc,
            sinks: g.sinks.ptr(),
            p_all: a.f32s(n * g.heads * cap)?,
            ctx_cap: cap,
            out,
            n,
            heads: g.heads,
            kv_heads: g.kv_heads,
            dim: g.dim,
            window: g.window,
            pos,
            scale: 1.0 / (g.dim as f32).sqrt(),
        }
        .go(&self.gpu)?;
        Ok(out)
    }

    /// `o_proj` of the heads' outputs plus its bias, into `y` as `out` says: the bias goes in as the matmul's
    /// added rows, so y gets (W·o + b) as the CPU forms it.
    pub(super) fn gqa_out(
        &self,
        a: &Arena,
        g: &Gqa,
        o: DevPtr<f32>,
        y: DevPtr<f32>,
        n: usize,
        out: Mm,
    ) -> Result<()> {
        let b = a.f32s(n * g.o.rows)?;
        BiasRows {
            b: g.o_bias.ptr(),
            out: b,
            n,
            len: g.o.rows,
        }
        .go(&self.gpu)?;
        self.mm_into(&g.o, o, y, n, Mm { add: b, ..out })
    }

    /// Grows a session's caches of `g` (doubling, keeping the `pos` positions they hold) to hold `need`.
    pub(super) fn grow_gqa(
        &self,
        g: &Gqa,
        (k, v, cap): (&mut DevBuf, &mut DevBuf, &mut usize),
        pos: usize,
        need: usize,
    ) -> Result<()> {
        if need <= *cap {
            return Ok(());
        }
        let (new_cap, w) = (need.next_power_of_two(), g.kv_width());
        let (nk, nv) = (self.zeros(new_cap * w)?, self.zeros(new_cap * w)?);
        self.gpu.dtod(nk.ptr, k.ptr, 4 * pos * w)?;
        self.gpu.dtod(nv.ptr, v.ptr, 4 * pos * w)?;
        self.gpu
            .stream
            .synchronize()
            .doing("waiting for the GPU to finish a pass")?;
        (*k, *v, *cap) = (nk, nv, new_cap);
        Ok(())
    }
}
