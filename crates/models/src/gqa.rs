//! Grouped-query attention with rotate-half RoPE on q and k. gpt-oss: biased q/k/v/o projections and per
//! query head a sink logit that joins the softmax without a value; Qwen3: each head of q and k RMS-normed
//! before the rotation. Sliding layers see their last `window` positions (the current one included), full
//! layers all of them.

use crate::describe as desc;
use crate::ops::{axpy, rms_norm};
use crate::rope::{Pairing, Rotary};
use crate::weights::{forward_many, Linear, Loader};
use anyhow::Result;
use deltafin_kernels::dot;
use rayon::prelude::*;

/// `W x (+ b)`.
pub struct Affine {
    w: Linear,
    b: Option<Vec<f32>>,
}

impl Affine {
    fn load(ld: &Loader, d: &desc::Affine) -> Result<Affine> {
        Ok(Affine {
            w: ld.linear(&d.weight)?,
            b: d.bias.as_ref().map(|b| ld.vector(b)).transpose()?,
        })
    }

    fn add_bias(&self, y: &mut [f32]) {
        if let Some(b) = &self.b {
            y.chunks_mut(self.w.rows)
                .for_each(|r| r.iter_mut().zip(b).for_each(|(v, b)| *v += b));
        }
    }
}

/// Qwen3's RMSNorm of every head of q and of k.
struct HeadNorm {
    q: Vec<f32>,
    k: Vec<f32>,
    eps: f32,
}

pub struct Gqa {
    q: Affine,
    k: Affine,
    v: Affine,
    o: Affine,
    sinks: Option<Vec<f32>>,
    head_norm: Option<HeadNorm>,
    heads: usize,
    kv_heads: usize,
    dim: usize,
    window: Option<usize>,
    rope: Rotary,
}

/// Every position's rotated keys and values (`kv_heads × dim` each); sliding layers keep all positions too,
/// so a rollback is a truncation whatever the window.
#[derive(Clone, Default)]
pub struct KvCache {
    k: Vec<f32>,
    v: Vec<f32>,
}

impl KvCache {
    pub fn bytes(&self) -> usize {
        4 * (self.k.len() + self.v.len())
    }

    /// Keeps the first `tokens` of the cache's `of` positions (an entry depends only on its own row).
    pub fn keep_first(&mut self, tokens: usize, of: usize) {
        let per = self.k.len() / of.max(1);
        self.k.truncate(tokens * per);
        self.v.truncate(tokens * per);
    }

    /// Every cached value, as bits (for tests of exact equality).
    pub fn bits(&self) -> impl Iterator<Item = u32> + '_ {
        self.k.iter().chain(&self.v).map(|v| v.to_bits())
    }
}

impl Gqa {
    pub fn load(ld: &Loader, d: &desc::Gqa) -> Result<Gqa> {
        Ok(Gqa {
            q: Affine::load(ld, &d.q)?,
            k: Affine::load(ld, &d.k)?,
            v: Affine::load(ld, &d.v)?,
            o: Affine::load(ld, &d.o)?,
            sinks: d.sinks.as_ref().map(|s| ld.vector(s)).transpose()?,
            head_norm: match &d.head_norm {
                Some(n) => Some(HeadNorm {
                    q: ld.vector(&n.q)?,
                    k: ld.vector(&n.k)?,
                    eps: n.eps,
                }),
                None => None,
            },
            heads: d.heads,
            kv_heads: d.kv_heads,
            dim: d.dim,
            window: d.window,
            rope: Rotary::new(&d.rope, d.dim, Pairing::Half),
        })
    }

    /// `x`: n rows of the normed input at positions `cache.len() ..`; appends their keys and values, returns
    /// the `o_proj` rows.
    pub fn forward(&self, x: &[f32], n: usize, cache: &mut KvCache) -> Vec<f32> {
        let (heads, kvh, dim) = (self.heads, self.kv_heads, self.dim);
        let kw = kvh * dim;
        let [mut q, mut k, mut v] = forward_many([&self.q.w, &self.k.w, &self.v.w], x, n);
        self.q.add_bias(&mut q);
        self.k.add_bias(&mut k);
        self.v.add_bias(&mut v);
        let start = cache.k.len() / kw;
        if let Some(n) = &self.head_norm {
            q.chunks_mut(dim).for_each(|h| rms_norm(h, &n.q, n.eps));
            k.chunks_mut(dim).for_each(|h| rms_norm(h, &n.k, n.eps));
        }
        for (t, (qr, kr)) in q.chunks_mut(heads * dim).zip(k.chunks_mut(kw)).enumerate() {
            qr.chunks_mut(dim)
                .chain(kr.chunks_mut(dim))
                .for_each(|h| self.rope.rotate(h, start + t));
        }
        cache.k.extend_from_slice(&k);
        cache.v.extend_from_slice(&v);
        let scale = 1.0 / (dim as f32).sqrt();
        let cache = &*cache;
        let mut attn = vec![0.0f32; n * heads * dim];
        attn.par_chunks_mut(dim).enumerate().for_each(|(idx, out)| {
            let (t, h) = (idx / heads, idx % heads);
            let g = h / (heads / kvh);
            let q_h = &q[idx * dim..(idx + 1) * dim];
            let pos = start + t;
            let first = self.window.map_or(0, |w| (pos + 1).saturating_sub(w));
            let at = |s: usize| s * kw + g * dim..s * kw + (g + 1) * dim;
            let mut p: Vec<f32> = (first..=pos)
                .map(|s| dot(q_h, &cache.k[at(s)]) * scale)
                .collect();
            // softmax over the scores and the sink (where there is one), whose probability is dropped.
            let sink = self.sinks.as_ref().map(|s| s[h]);
            let max = p
                .iter()
                .copied()
                .fold(sink.unwrap_or(f32::NEG_INFINITY), f32::max);
            let mut sum = 0.0f32;
            for s in p.iter_mut() {
                *s = (*s - max).exp();
                sum += *s;
            }
            let inv = 1.0 / (sum + sink.map_or(0.0, |s| (s - max).exp()));
            for (j, &ps) in p.iter().enumerate() {
                axpy(out, ps * inv, &cache.v[at(first + j)]);
            }
        });
        let mut y = self.o.w.forward(&attn, n);
        self.o.add_bias(&mut y);
        y
    }
}
