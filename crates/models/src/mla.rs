//! Multi-head latent attention (contract §4 "Gated MLA, NoPE"; DeepSeek-V3's with RoPE on the rope part), in
//! the absorbed form: the cache keeps only the normed latent (kv_lora_rank values) and the shared `k_pe` per
//! token (rotated for its position, where the family has RoPE), and each head scores against the latent
//! through `W_UKᵀ q_nope`, expanding values with `W_UV` after the weighted sum. The rotation touches only the
//! rope part, so this equals the expanded form in real arithmetic.

use crate::describe as desc;
use crate::ops::{axpy, rms_norm, sigmoid, softmax};
use crate::rope::{softmax_scale, Pairing, Rotary};
use crate::weights::{forward_many, Linear, Loader, Stored};
use anyhow::{bail, Result};
use deltafin_kernels::{dot, matmul, FP8_BLOCK};
use rayon::prelude::*;

/// Where the queries come from ([`desc::QueryPath`]).
pub enum QueryPath {
    LowRank {
        a: Linear,
        norm: Vec<f32>,
        b: Linear,
    },
    Direct(Linear),
}

pub struct Mla {
    q: QueryPath,
    kv_a: Linear,
    kv_norm: Vec<f32>,
    /// `[heads × (nope + v), kv_lora]`: per head, nope rows of W_UK then v rows of W_UV.
    kv_b: Linear,
    /// The output gate `sigmoid(g_proj x)`, where the family has one.
    gate: Option<Linear>,
    o: Linear,
    heads: usize,
    nope: usize,
    rope: usize,
    v: usize,
    kv_lora: usize,
    latent_eps: f32,
    /// DeepSeek-V3's RoPE; `None`: NoPE.
    rotary: Option<Rotary>,
    /// The softmax scale (YaRN's mscale² included).
    scale: f32,
}

/// The compact per-layer cache: `kv_lora + rope` f32 values per token.
#[derive(Clone, Default)]
pub struct LatentCache {
    lat: Vec<f32>,
    pe: Vec<f32>,
}

impl LatentCache {
    pub fn bytes(&self) -> usize {
        4 * (self.lat.len() + self.pe.len())
    }

    /// Keeps the first `tokens` of the cache's `of` positions: an entry depends only on its own row, so this
    /// is the cache a pass over only those positions leaves.
    pub fn keep_first(&mut self, tokens: usize, of: usize) {
        let (lat, pe) = (self.lat.len() / of.max(1), self.pe.len() / of.max(1));
        self.lat.truncate(tokens * lat);
        self.pe.truncate(tokens * pe);
    }

    /// Every cached value, as bits (for tests of exact equality).
    pub fn bits(&self) -> impl Iterator<Item = u32> + '_ {
        self.lat.iter().chain(&self.pe).map(|v| v.to_bits())
    }
}

impl Mla {
    pub fn load(ld: &Loader, d: &desc::Mla) -> Result<Mla> {
        let kv_b = ld.linear(&d.kv_b)?;
        // Each head's value rows of an FP8 kv_b are read as a row slice, which must not straddle two
        // 128-row scale blocks (the kernel's slices keep one scale row per block).
        if matches!(kv_b.weights, Stored::Fp8Block { .. })
            && value_rows_straddle(d.heads, d.nope, d.v)
        {
            bail!(
                "tensor `{}` is FP8 with qk_nope_head_dim {} and v_head_dim {}: a head's value rows cross a \
                 128-row scale block, which deltafin's FP8 kernels do not slice; use a BF16 kv_b_proj",
                d.kv_b.name,
                d.nope,
                d.v
            );
        }
        Ok(Mla {
            q: match &d.q {
                desc::QueryPath::LowRank { a, norm, b } => QueryPath::LowRank {
                    a: ld.linear(a)?,
                    norm: ld.vector(norm)?,
                    b: ld.linear(b)?,
                },
                desc::QueryPath::Direct(p) => QueryPath::Direct(ld.linear(p)?),
            },
            kv_a: ld.linear(&d.kv_a)?,
            kv_norm: ld.vector(&d.kv_norm)?,
            kv_b,
            gate: d.gate.as_ref().map(|g| ld.linear(g)).transpose()?,
            o: ld.linear(&d.o)?,
            heads: d.heads,
            nope: d.nope,
            rope: d.rope,
            v: d.v,
            kv_lora: d.kv_lora,
            latent_eps: d.latent_eps,
            rotary: (d.rotary.as_ref()).map(|r| Rotary::new(r, d.rope, Pairing::Interleaved)),
            scale: softmax_scale(d.nope + d.rope, d.rotary.as_ref()),
        })
    }

    /// `x`: n rows of the normed input at positions `cache.len() ..`; appends their latents, returns `o_proj` rows.
    pub fn forward(&self, x: &[f32], n: usize, cache: &mut LatentCache) -> Vec<f32> {
        let (heads, nope, rope, dv, kvl) = (self.heads, self.nope, self.rope, self.v, self.kv_lora);
        let qd = nope + rope;
        // The products of x (query, latent, output gate) in one parallel region.
        let q_in = match &self.q {
            QueryPath::LowRank { a, .. } => a,
            QueryPath::Direct(p) => p,
        };
        let (q_x, c, gate) = match &self.gate {
            Some(g) => {
                let [q_x, c, g] = forward_many([q_in, &self.kv_a, g], x, n);
                (q_x, c, Some(g))
            }
            None => {
                let [q_x, c] = forward_many([q_in, &self.kv_a], x, n);
                (q_x, c, None)
            }
        };
        // 1. queries.
        let q = match &self.q {
            QueryPath::LowRank { a, norm, b } => {
                let mut cq = q_x;
                for row in cq.chunks_mut(a.rows) {
                    rms_norm(row, norm, self.latent_eps);
                }
                b.forward(&cq, n)
            }
            QueryPath::Direct(_) => q_x,
        };
        // 2. the latent and the shared k_pe (rotated for its position), appended to the cache before attending
        // (causal within the pass).
        let start = cache.lat.len() / kvl;
        for (t, row) in c.chunks(kvl + rope).enumerate() {
            let mut lat = row[..kvl].to_vec();
            rms_norm(&mut lat, &self.kv_norm, self.latent_eps);
            cache.lat.extend_from_slice(&lat);
            let mut pe = row[kvl..].to_vec();
            if let Some(r) = &self.rotary {
                r.rotate(&mut pe, start + t);
            }
            cache.pe.extend_from_slice(&pe);
        }
        let mut q = q;
        if let Some(r) = &self.rotary {
            for (i, q_h) in q.chunks_mut(qd).enumerate() {
                r.rotate(&mut q_h[nope..], start + i / heads);
            }
        }
        // 3–4. per row and head: absorbed scores, softmax over positions ≤ its own, weighted latent, W_UV.
        let scale = self.scale;
        let mut attn = vec![0.0f32; n * heads * dv];
        let cache = &*cache;
        attn.par_chunks_mut(dv).enumerate().for_each(|(idx, out)| {
            let (t, hd) = (idx / heads, idx % heads);
            let q_h = &q[t * heads * qd + hd * qd..][..qd];
            let base = hd * (nope + dv);
            let mut q_lat = vec![0.0f32; kvl];
            self.kv_b
                .matvec_t_rows(base, nope, &q_h[..nope], &mut q_lat);
            let upto = start + t + 1;
            let mut p: Vec<f32> = (0..upto)
                .map(|s| {
                    let lat = &cache.lat[s * kvl..(s + 1) * kvl];
                    let pe = &cache.pe[s * rope..(s + 1) * rope];
                    (dot(&q_lat, lat) + dot(&q_h[nope..], pe)) * scale
                })
                .collect();
            softmax(&mut p);
            let mut ctx = vec![0.0f32; kvl];
            for (s, &ps) in p.iter().enumerate() {
                axpy(&mut ctx, ps, &cache.lat[s * kvl..(s + 1) * kvl]);
            }
            matmul(&self.kv_b.matrix().row_slice(base + nope, dv), &ctx, 1, out);
        });
        // 5. output gate and projection.
        if let Some(g) = gate {
            for (a, gv) in attn.iter_mut().zip(g) {
                *a *= sigmoid(gv);
            }
        }
        self.o.forward(&attn, n)
    }
}

/// Whether some head's value rows in kv_b (`[heads × (nope + v)]`, per head nope rows then v rows) start inside
/// a 128-row scale block and run past its end.
fn value_rows_straddle(heads: usize, nope: usize, v: usize) -> bool {
    (0..heads).any(|h| {
        let start = h * (nope + v) + nope;
        !start.is_multiple_of(FP8_BLOCK) && start / FP8_BLOCK != (start + v.max(1) - 1) / FP8_BLOCK
    })
}

#[cfg(test)]
mod tests {
    use super::value_rows_straddle;

    #[test]
    fn value_rows_that_cross_a_scale_block_are_found() {
        // DeepSeek-V3 / Kimi K2 (128 + 128): every head's value rows are one whole block.
        assert!(!value_rows_straddle(128, 128, 128));
        // 32 + 32: four heads a block, none crossing.
        assert!(!value_rows_straddle(8, 32, 32));
        // 96 + 64: head 0's value rows are 96..160, across the boundary at 128.
        assert!(value_rows_straddle(2, 96, 64));
        // 48 + 16: value rows at 48, 112, 176, 240 (16 each), all inside a block; 40 + 40: head 1's at
        // 120..160, across 128 (head 0's are not).
        assert!(!value_rows_straddle(4, 48, 16));
        assert!(value_rows_straddle(4, 40, 40));
    }
}
