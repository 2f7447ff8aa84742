//! The forward pass: embeddings, each layer's attention and FFN, the head; the matmuls and the small kernels
//! around them.

use super::cuda_model::CudaModel;
use super::session::{Arena, CudaSession, State};
use super::spine::{At, Attn, Ffn, Kda, Lin, Mla, Mlp, OutGate, QPath, Streamed};
use crate::devptr::DevPtr;
use crate::gpu::{Doing, On};
use crate::kernels::{
    ActRows, AttnResMix, EmbedRows, KdaRecurrence, MatmulBf16, MatmulFp8, MlaAppend, MlaAttend,
    MlpUpAct, RmsNormRows, TimelineMark,
};
use crate::plan::{matmul_ring_bytes, matmul_tile};
use anyhow::{bail, Context, Result};
use cudarc::driver::result as cu;
use deltafin_models::{Pass, Stats};
use deltafin_store::RecordRef;

/// How a matmul reads and writes its rows: x RMS-normalised first with `norm` (weights, eps) when given; y = W·x
/// plus `add` (a device row block of the same shape) when non-zero, stored or, with `accumulate`, added into y.
/// The forward pass's norms and residual adds are fused into the matmuls next to them (the same arithmetic).
#[derive(Clone, Copy, Default)]
pub(super) struct Mm {
    pub(super) norm: Option<(DevPtr<f32>, f32)>,
    pub(super) add: DevPtr<f32>,
    pub(super) accumulate: bool,
    /// On the side stream.
    pub(super) side: bool,
    /// Where the parts of a fused matrix begin (`MatmulBf16::split`); none: one matrix.
    pub(super) split: Option<[u64; 6]>,
}

impl CudaModel {
    pub(super) fn mm(&self, a: &Arena, w: &Lin, x: DevPtr<f32>, n: usize) -> Result<DevPtr<f32>> {
        self.mm_with(a, w, x, n, Mm::default())
    }

    pub(super) fn mm_with(
        &self,
        a: &Arena,
        w: &Lin,
        x: DevPtr<f32>,
        n: usize,
        mm: Mm,
    ) -> Result<DevPtr<f32>> {
        let y = a.f32s(n * w.rows)?;
        self.mm_into(w, x, y, n, mm)?;
        Ok(y)
    }

    /// `parts` times x, the parts fused back to back in `fused`, as one matmul whose output holds each part's
    /// output ([n][its rows]) in order. Returns where each lies. x is normalised first with `norm` when given.
    pub(super) fn mm_parts(
        &self,
        a: &Arena,
        fused: &Lin,
        parts: &[&Lin],
        x: DevPtr<f32>,
        n: usize,
        norm: Option<(DevPtr<f32>, f32)>,
    ) -> Result<Vec<DevPtr<f32>>> {
        let mut split = MatmulBf16::whole(fused.rows);
        if parts.len() > split.len() {
            bail!(
                "internal: {} matrices fused into one matmul (at most 6)",
                parts.len()
            );
        }
        let mut at = 0;
        for (s, p) in split.iter_mut().zip(parts) {
            *s = at as u64;
            at += p.rows;
        }
        let mm = Mm {
            norm,
            split: Some(split),
            ..Mm::default()
        };
        let y = self.mm_with(a, fused, x, n, mm)?;
        Ok(split[..parts.len()]
            .iter()
            .map(|&s| y.byte_add(4 * n as u64 * s))
            .collect())
    }

    pub(super) fn mm_into(
        &self,
        w: &Lin,
        x: DevPtr<f32>,
        y: DevPtr<f32>,
        n: usize,
        mm: Mm,
    ) -> Result<()> {
        let (norm_w, eps) = mm.norm.unwrap_or((DevPtr::NULL, 0.0));
        // The x rows of a tile: as many as fit, at most eight.
        let smem = self.gpu.dynamic_smem("matmul_bf16");
        let Some(tile) = matmul_tile(smem, w.cols) else {
            bail!(
                "a {}-column matrix needs {} bytes of shared memory per block on the GPU; this GPU offers {smem}: \
                 run this model on the CPU",
                w.cols,
                matmul_ring_bytes(w.cols) + 4 * w.cols,
            );
        };
        let on = if mm.side { On::Side } else { On::Compute };
        let split = mm.split.unwrap_or(MatmulBf16::whole(w.rows));
        if w.fp8.is_some() {
            return MatmulFp8 {
                w: DevPtr::new(w.ptr().addr()),
                sc: w.scales(),
                x,
                y,
                rows: w.rows,
                cols: w.cols,
                n,
                tile,
                norm_w,
                eps,
                add: mm.add,
                accumulate: mm.accumulate,
                split,
            }
            .go(&self.gpu, on);
        }
        MatmulBf16 {
            w: w.ptr(),
            x,
            y,
            rows: w.rows,
            cols: w.cols,
            n,
            tile,
            norm_w,
            eps,
            add: mm.add,
            accumulate: mm.accumulate,
            split,
        }
        .go(&self.gpu, on)
    }

    /// AttnRes Mix of `cur` with the anchors into `out`; with `norm`, RMS-normalised by that weight (fused).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn mix(
        &self,
        anchors: DevPtr<f32>,
        na: usize,
        cur: DevPtr<f32>,
        w: &At,
        out: DevPtr<f32>,
        n: usize,
        norm: Option<&At>,
    ) -> Result<()> {
        AttnResMix {
            anchors,
            na,
            cur,
            w: w.ptr(),
            out,
            n,
            hd: self.cfg.hidden,
            eps: self.cfg.rms_norm_eps,
            norm_w: norm.map_or(DevPtr::NULL, At::ptr),
        }
        .go(&self.gpu)
    }

    /// The gated MLP of x into `y` (see [`Mm`]).
    pub(super) fn mlp(
        &self,
        a: &Arena,
        m: &Mlp,
        x: DevPtr<f32>,
        n: usize,
        y: DevPtr<f32>,
        out: Mm,
    ) -> Result<()> {
        let act = a.f32s(n * m.gate.rows)?;
        let on = if out.side { On::Side } else { On::Compute };
        if m.gate.fp8.is_some() {
            // FP8: gate and up as matmuls, then the activation.
            let side = Mm {
                side: out.side,
                ..Mm::default()
            };
            let g = self.mm_with(a, &m.gate, x, n, side)?;
            let u = self.mm_with(a, &m.up, x, n, side)?;
            ActRows {
                g,
                u,
                out: act,
                len: n * m.gate.rows,
                act: m.act,
            }
            .go(&self.gpu, on)?;
            return self.mm_into(&m.down, act, y, n, out);
        }
        MlpUpAct {
            g: m.gate.ptr(),
            u: m.up.ptr(),
            x,
            out: act,
            rows: m.gate.rows,
            cols: m.gate.cols,
            n,
            act: m.act,
        }
        .go(&self.gpu, on)?;
        self.mm_into(&m.down, act, y, n, out)
    }

    /// Issues the pass's work; returns the logits' device address and length. `held`: store records whose
    /// copies to the device may still be in flight (see `moe`).
    /// `tok`: the pass's header on the device (see `header`).
    pub(super) fn pass<'s>(
        &'s self,
        a: &Arena,
        batch: &mut [Pass<'_, CudaSession>],
        stats: &Stats,
        held: &mut Vec<RecordRef<'s>>,
        tok: DevPtr<u32>,
    ) -> Result<(DevPtr<f32>, usize)> {
        let (n, hd, eps) = (
            batch.iter().map(|p| p.tokens.len()).sum::<usize>(),
            self.cfg.hidden,
            self.cfg.rms_norm_eps,
        );
        let pos = tok.byte_add(4 * n as u64);
        // The residual stream h lies in the slot after the anchors: a block boundary makes h an anchor by moving
        // h on to the next slot (no copy).
        let block = self.cfg.attn_res_block;
        let max_anchors = block.map_or(0, |b| self.cfg.num_layers.div_ceil(b));
        let anchors = a.f32s((max_anchors + 1) * n * hd)?;
        let slot = (4 * n * hd) as u64;
        let mut h = anchors;
        EmbedRows {
            table: self.embed.ptr(),
            tokens: tok,
            out: h,
            n,
            hd,
        }
        .go(&self.gpu)?;
        let mut na = 0usize;
        if self.direct.is_some() && n > 1 {
            a.groups.set(a.take::<i32>(4 * self.cfg.num_layers)?.addr());
        }
        let mark = a.off.get();
        // The first two streamed layers' copies start now, under the resident layers' compute.
        if let Some(st) = &self.streamed {
            a.copies.set(true);
            for j in 0..st.images.len().min(2) {
                self.copy_layer(st, j)?;
            }
        }
        for (l, layer) in self.layers.iter().enumerate() {
            a.off.set(mark);
            let streamed = self
                .streamed
                .as_ref()
                .and_then(|st| Some((st, st.index[l]?)));
            if let Some((st, j)) = streamed {
                self.gpu.wait(&st.copied[j % 2])?;
            }
            match block {
                Some(block) => {
                    // K3: a = Mix([anchors…, h]) (or h); a block boundary makes h an anchor and restarts the sum.
                    let res = layer
                        .attn_res
                        .as_ref()
                        .expect("K3 layers carry AttnRes weights");
                    let restart = l % block == 0;
                    // The mix over no anchors is h itself. Its RMS norm is fused into the attention's input
                    // matmul.
                    let mixed = if na == 0 {
                        h
                    } else {
                        let x = a.f32s(n * hd)?;
                        self.mix(anchors, na, h, res, x, n, None)?;
                        x
                    };
                    if restart {
                        na += 1;
                        h = anchors.byte_add(na as u64 * slot);
                    }
                    // q = prefix + o, kept in h (a block boundary restarts the sum: h = o).
                    let out = Mm {
                        accumulate: !restart,
                        ..Mm::default()
                    };
                    let norm = (layer.input_norm.ptr(), eps);
                    self.attention_batch(a, &layer.attn, mixed, norm, batch, pos, l, h, out)?;
                    let m = a.f32s(n * hd)?;
                    let res = layer.mlp_res.as_ref().expect("K3");
                    self.mix(anchors, na, h, res, m, n, Some(&layer.post_norm))?;
                    self.ffn(a, l, &layer.ffn, m, n, stats, held, h)?;
                }
                None => {
                    // Kimi Linear: h += Attn(RMS(h)); h += MLP(RMS(h)).
                    let out = Mm {
                        accumulate: true,
                        ..Mm::default()
                    };
                    let norm = (layer.input_norm.ptr(), eps);
                    self.attention_batch(a, &layer.attn, h, norm, batch, pos, l, h, out)?;
                    let m = a.f32s(n * hd)?;
                    RmsNormRows {
                        x: h,
                        w: layer.post_norm.ptr(),
                        out: m,
                        n,
                        d: hd,
                        eps,
                    }
                    .go(&self.gpu)?;
                    self.ffn(a, l, &layer.ffn, m, n, stats, held, h)?;
                }
            }
            if let Some((st, j)) = streamed {
                // The buffer is free once this layer's kernels are done: the layer two ahead goes in next.
                self.gpu.record(&st.freed[j % 2])?;
                if j + 2 < st.images.len() {
                    self.copy_layer(st, j + 2)?;
                }
            }
        }
        a.off.set(mark);
        let f = match &self.out_res {
            Some(w) => {
                let f = a.f32s(n * hd)?;
                self.mix(anchors, na, h, w, f, n, None)?;
                f
            }
            None => h,
        };
        // The rows that need logits (each session's last row, or all of its rows), copied together unless they
        // lie together already (a decode batch: one row each).
        let row = (4 * hd) as u64;
        let mut runs: Vec<(usize, usize)> = Vec::new();
        let mut at = 0;
        for p in batch.iter() {
            let (len, k) = (p.tokens.len(), p.logit_rows());
            match runs.last_mut() {
                Some((start, count)) if *start + *count == at + len - k => *count += k,
                _ => runs.push((at + len - k, k)),
            }
            at += len;
        }
        let m: usize = runs.iter().map(|r| r.1).sum();
        let f = match runs[..] {
            [(start, _)] => f.byte_add(start as u64 * row),
            _ => {
                let g = a.f32s(m * hd)?;
                let mut to = g;
                for &(start, count) in &runs {
                    let from = f.byte_add(start as u64 * row);
                    self.gpu.dtod(to.addr(), from.addr(), count * 4 * hd)?;
                    to = to.byte_add(count as u64 * row);
                }
                g
            }
        };
        // The final norm is fused into the head.
        let norm = Mm {
            norm: Some((self.norm.ptr(), eps)),
            ..Mm::default()
        };
        let logits = self.mm_with(a, &self.lm_head, f, m, norm)?;
        if self.gpu.timeline.is_some() {
            TimelineMark {}.go(&self.gpu)?;
        }
        Ok((logits, m * self.cfg.vocab_size))
    }

    /// Layer `l`'s attention for every session's rows (`x`, `y`: `[rows, hidden]`, the sessions' rows in batch
    /// order), each on its own state; `pos`: the sessions' positions on the device (the header's).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attention_batch(
        &self,
        a: &Arena,
        attn: &Attn,
        x: DevPtr<f32>,
        norm: (DevPtr<f32>, f32),
        batch: &mut [Pass<'_, CudaSession>],
        pos: DevPtr<u32>,
        l: usize,
        y: DevPtr<f32>,
        out: Mm,
    ) -> Result<()> {
        let row = (4 * self.cfg.hidden) as u64;
        let mut r0 = 0u64;
        for (i, p) in batch.iter_mut().enumerate() {
            let n = p.tokens.len();
            let keep = p.session.keep.at(l);
            let st = &p.session.layers[l];
            let pos = pos.byte_add(4 * i as u64);
            let (x, y) = (x.byte_add(r0 * row), y.byte_add(r0 * row));
            self.attention(a, attn, x, norm, n, (st, keep), pos, y, out)?;
            r0 += n as u64;
        }
        Ok(())
    }

    /// Copies the `j`-th streamed layer into its buffer on the copy stream, after the kernels of the layer
    /// that used the buffer before it.
    pub(super) fn copy_layer(&self, st: &Streamed, j: usize) -> Result<()> {
        let (_, off, len) = st.images[j];
        let copy = &self.gpu.copy;
        copy.wait(&st.freed[j % 2])
            .doing("ordering a spine layer's copy after its buffer is free")?;
        // SAFETY: the buffer holds the largest streamed layer; the page-locked images are never written after
        // load.
        unsafe {
            cu::memcpy_htod_async(
                st.bufs[j % 2].ptr,
                &st.host.as_slice()[off..off + len],
                copy.cu_stream(),
            )
        }
        .doing_with(|| format!("copying spine layer {} to the GPU", st.images[j].0))?;
        st.copied[j % 2]
            .record(copy)
            .doing("recording a spine layer's copy")?;
        self.cache.lock().unwrap().counters.spine_h2d_bytes += len as u64;
        Ok(())
    }

    /// The attention block of RMS(x) (`norm`: its weights and eps), its output projection into `y` (see
    /// [`Mm`]); `st`: the session's state of this layer and where a KDA layer's snapshots go (see `Keep`);
    /// `pos`: the session's position on the device.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attention(
        &self,
        a: &Arena,
        attn: &Attn,
        x: DevPtr<f32>,
        norm: (DevPtr<f32>, f32),
        n: usize,
        (st, keep): (&State, DevPtr<f32>),
        pos: DevPtr<u32>,
        y: DevPtr<f32>,
        out: Mm,
    ) -> Result<()> {
        match (attn, st) {
            (Attn::Kda(k), State::Kda { conv, s }) => {
                let o = self.kda(a, k, x, norm, n, (conv.typed(), s.typed(), keep), pos)?;
                self.mm_into(&k.o, o, y, n, out)
            }
            (Attn::Mla(m), State::Mla { lat, pe, cap }) => {
                let o = self.mla(a, m, x, norm, n, (lat.typed(), pe.typed(), *cap), pos)?;
                self.mm_into(&m.o, o, y, n, out)
            }
            (Attn::Gqa(g), State::Gqa { k, v, cap }) => {
                let o = self.gqa(a, g, x, norm, n, (k.typed(), v.typed(), *cap), pos)?;
                self.gqa_out(a, g, o, y, n, out)
            }
            _ => unreachable!("a session's states are made by the same model's layers"),
        }
    }

    /// Grows `session`'s MLA and GQA caches (doubling, keeping what they hold) so that `n` more tokens fit.
    /// Before the pass: its issue (and a graph's capture) cannot allocate or synchronise.
    pub(super) fn reserve(&self, session: &mut CudaSession, n: usize) -> Result<()> {
        let (pos, need) = (session.pos, session.pos + n);
        for (layer, st) in self.layers.iter().zip(&mut session.layers) {
            if let (Attn::Gqa(g), State::Gqa { k, v, cap }) = (&layer.attn, &mut *st) {
                self.grow_gqa(g, (k, v, cap), pos, need)?;
                continue;
            }
            let (Attn::Mla(m), State::Mla { lat, pe, cap }) = (&layer.attn, st) else {
                continue;
            };
            if need > *cap {
                let new_cap = need.next_power_of_two();
                let (nl, np) = (self.zeros(new_cap * m.kvl)?, self.zeros(new_cap * m.rope)?);
                self.gpu.dtod(nl.ptr, lat.ptr, 4 * pos * m.kvl)?;
                self.gpu.dtod(np.ptr, pe.ptr, 4 * pos * m.rope)?;
                self.gpu
                    .stream
                    .synchronize()
                    .doing("waiting for the GPU to finish a pass")?;
                (*lat, *pe, *cap) = (nl, np, new_cap);
            }
        }
        Ok(())
    }

    /// KDA of RMS(x) up to its output projection (the gated, normalised heads). `(conv_state, s)`: the session's
    /// two copies of each (see kda_recurrence), `keep`: where its snapshots go (null: none); `pos`: its
    /// position on the device.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn kda(
        &self,
        a: &Arena,
        k: &Kda,
        x: DevPtr<f32>,
        norm: (DevPtr<f32>, f32),
        n: usize,
        (conv_state, s, keep): (DevPtr<f32>, DevPtr<f32>, DevPtr<f32>),
        pos: DevPtr<u32>,
    ) -> Result<DevPtr<f32>> {
        let (heads, dim) = (k.heads, k.dim);
        let w = heads * dim;
        let y = self.mm_parts(
            a,
            &k.xin,
            &[&k.q, &k.k, &k.v, &k.f_a, k.gate.first(), &k.b],
            x,
            n,
            Some(norm),
        )?;
        let (q, kk, v, fa, gate_in, beta) = (y[0], y[1], y[2], y[3], y[4], y[5]);
        let g = self.mm(a, &k.f_b, fa, n)?;
        let gate = match &k.gate {
            OutGate::Full(_) => gate_in,
            OutGate::Low(_, gb) => self.mm(a, gb, gate_in, n)?,
        };
        let out = a.f32s(n * w)?;
        KdaRecurrence {
            q,
            k: kk,
            v,
            g,
            beta,
            gate,
            dt_bias: k.dt_bias.ptr(),
            a_log: k.a_log.ptr(),
            lower: k.lower,
            conv_w: k.conv.ptr(),
            conv_state,
            s,
            keep,
            pos,
            o_norm: k.o_norm.ptr(),
            out,
            n,
            heads,
            dim,
            kern: k.kern,
            kind: k.kind,
            eps: self.cfg.rms_norm_eps,
        }
        .go(&self.gpu)?;
        Ok(out)
    }

    /// MLA of RMS(x) up to its output projection (the heads' attention outputs, gated where the layer has a gate).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn mla(
        &self,
        a: &Arena,
        m: &Mla,
        x: DevPtr<f32>,
        norm: (DevPtr<f32>, f32),
        n: usize,
        (lat, pe, cap): (DevPtr<f32>, DevPtr<f32>, usize),
        pos: DevPtr<u32>,
    ) -> Result<DevPtr<f32>> {
        let mut parts = vec![m.q.first(), &m.kv_a];
        parts.extend(m.gate.as_ref());
        let y = self.mm_parts(a, &m.xin, &parts, x, n, Some(norm))?;
        let q = match &m.q {
            QPath::Low { norm, b, .. } => {
                let norm = Mm {
                    norm: Some((norm.ptr(), m.eps)),
                    ..Mm::default()
                };
                self.mm_with(a, b, y[0], n, norm)?
            }
            QPath::Direct(_) => y[0],
        };
        let (inv_freq, rot_attn) = m
            .rotary
            .as_ref()
            .map_or((DevPtr::NULL, 1.0), |(f, a)| (f.ptr(), *a));
        MlaAppend {
            c: y[1],
            kv_norm: m.kv_norm.ptr(),
            lat,
            pe,
            pos,
            n,
            kvl: m.kvl,
            rope: m.rope,
            eps: m.eps,
            inv_freq,
            attn: rot_attn,
        }
        .go(&self.gpu)?;
        let p = a.f32s(n * m.heads * cap)?;
        let attn = a.f32s(n * m.heads * m.dv)?;
        MlaAttend {
            q,
            kv_b: m.kv_b.ptr(),
            lat,
            pe,
            p_all: p,
            ctx_cap: cap,
            gate: m.gate.as_ref().map_or(DevPtr::NULL, |_| y[2]),
            out: attn,
            n,
            heads: m.heads,
            nope: m.nope,
            rope: m.rope,
            dv: m.dv,
            kvl: m.kvl,
            pos,
            scale: m.scale,
            kv_sc: m.kv_b.scales(),
            inv_freq,
            attn: rot_attn,
        }
        .go(&self.gpu)?;
        Ok(attn)
    }

    /// h += FFN(x).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn ffn<'s>(
        &'s self,
        a: &Arena,
        l: usize,
        ffn: &Ffn,
        x: DevPtr<f32>,
        n: usize,
        stats: &Stats,
        held: &mut Vec<RecordRef<'s>>,
        h: DevPtr<f32>,
    ) -> Result<()> {
        match ffn {
            Ffn::Dense(m) => self.mlp(
                a,
                m,
                x,
                n,
                h,
                Mm {
                    accumulate: true,
                    ..Mm::default()
                },
            ),
            Ffn::Moe(m) => self
                .moe(a, l, m, x, n, stats, held, h)
                .with_context(|| format!("layer {l}")),
        }
    }

    /// Copies host values into the pass's scratch, asynchronously through the pass's page-locked upload area.
    pub(super) fn stage<T: Copy>(&self, a: &Arena, v: &[T]) -> Result<DevPtr<T>> {
        let src = self.put(a, v)?;
        let dst = a.take(src.len().max(4))?;
        self.gpu.htod_async(dst.addr(), src)?;
        Ok(dst)
    }

    /// Writes `v` into the pass's upload area (bumped) and returns where it lies there.
    pub(super) fn put<'a, T: Copy>(&self, a: &'a Arena, v: &[T]) -> Result<&'a [u8]> {
        let bytes = std::mem::size_of_val(v);
        let host = a.host.as_ref().expect("sized at pass start");
        let at = a.host_off.get();
        if at + bytes > host.bytes {
            bail!(
                "internal: the pass's upload area ({} bytes) is too small",
                host.bytes
            );
        }
        a.host_off.set(at + bytes.div_ceil(16) * 16);
        // SAFETY: `at + bytes` is inside the allocation; no copy reads this range before the caller issues one
        // (the area is bumped, and reset only after the pass has synchronised).
        Ok(unsafe {
            let p = host.ptr.add(at);
            std::ptr::copy_nonoverlapping(v.as_ptr() as *const u8, p, bytes);
            std::slice::from_raw_parts(p, bytes)
        })
    }
}
