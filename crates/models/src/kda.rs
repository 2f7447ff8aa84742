//! Kimi Delta Attention (contract §4 "KDA"): a gated delta-rule recurrence per head with a constant-size state.
//!
//! Projections run on all rows at once; the short convolution and the recurrence then walk the rows in order,
//! so a prefill of n tokens and n single-token steps perform the same arithmetic.

use crate::describe::{self as desc, DecayGate, QkNorm};
use crate::ops::{forward_many, rms_norm, sigmoid, silu, softplus};
use crate::weights::{Linear, Loader};
use anyhow::Result;
use rayon::prelude::*;

/// The gate applied to the normed output of each head ([`desc::OutputGate`]).
pub enum OutputGate {
    FullRank(Linear),
    LowRank(Linear, Linear),
}

pub struct Kda {
    q: Linear,
    k: Linear,
    v: Linear,
    /// Depthwise causal conv weights for q, k, v: `[width, kernel]` each.
    conv: [Vec<f32>; 3],
    f_a: Linear,
    f_b: Linear,
    b: Linear,
    /// One decay rate per head.
    a_log: Vec<f32>,
    dt_bias: Vec<f32>,
    o_norm: Vec<f32>,
    decay: DecayGate,
    qk_norm: QkNorm,
    out_gate: OutputGate,
    o: Linear,
    heads: usize,
    dim: usize,
    kernel: usize,
    eps: f32,
}

/// Per-layer recurrent state: the last `kernel − 1` conv inputs of every channel and S `[heads, K, V]`.
#[derive(Clone)]
pub struct KdaState {
    conv: [Vec<f32>; 3],
    s: Vec<f32>,
}

impl KdaState {
    pub fn zeros(heads: usize, dim: usize, kernel: usize) -> KdaState {
        let win = vec![0.0; heads * dim * (kernel - 1)];
        KdaState {
            conv: [win.clone(), win.clone(), win],
            s: vec![0.0; heads * dim * dim],
        }
    }

    pub fn bytes(&self) -> usize {
        4 * (self.conv.iter().map(Vec::len).sum::<usize>() + self.s.len())
    }
}

impl Kda {
    pub fn load(ld: &Loader, d: &desc::Kda) -> Result<Kda> {
        let vec = |t| ld.vector(t);
        Ok(Kda {
            q: ld.linear(&d.q)?,
            k: ld.linear(&d.k)?,
            v: ld.linear(&d.v)?,
            conv: [vec(&d.conv[0])?, vec(&d.conv[1])?, vec(&d.conv[2])?],
            f_a: ld.linear(&d.f_a)?,
            f_b: ld.linear(&d.f_b)?,
            b: ld.linear(&d.b)?,
            // One rate per head, first in either layout.
            a_log: vec(&d.a_log)?[..d.heads].to_vec(),
            dt_bias: vec(&d.dt_bias)?,
            o_norm: vec(&d.o_norm)?,
            decay: d.decay,
            qk_norm: d.qk_norm,
            out_gate: match &d.out_gate {
                desc::OutputGate::FullRank(g) => OutputGate::FullRank(ld.linear(g)?),
                desc::OutputGate::LowRank(a, b) => {
                    OutputGate::LowRank(ld.linear(a)?, ld.linear(b)?)
                }
            },
            o: ld.linear(&d.o)?,
            heads: d.heads,
            dim: d.dim,
            kernel: d.kernel,
            eps: d.eps,
        })
    }

    pub fn new_state(&self) -> KdaState {
        let w = self.heads * self.dim;
        let win = vec![0.0; w * (self.kernel - 1)];
        KdaState {
            conv: [win.clone(), win.clone(), win],
            s: vec![0.0; self.heads * self.dim * self.dim],
        }
    }

    pub fn state_bytes(&self) -> usize {
        4 * (3 * self.heads * self.dim * (self.kernel - 1) + self.heads * self.dim * self.dim)
    }

    /// `x`: n rows of the normed input. Returns n rows of `o_proj` output.
    pub fn forward(&self, x: &[f32], n: usize, st: &mut KdaState) -> Vec<f32> {
        let (heads, dim) = (self.heads, self.dim);
        let w = heads * dim;
        // 1. projections, 4. β, 5. decay logits, 7. output gate — all row-wise, so batched.
        let gate_in = match &self.out_gate {
            OutputGate::FullRank(g) | OutputGate::LowRank(g, _) => g,
        };
        let [q, k, v, b, f_a, gate] = forward_many(
            [&self.q, &self.k, &self.v, &self.b, &self.f_a, gate_in],
            x,
            n,
        );
        let mut qkv = [q, k, v];
        let beta: Vec<f32> = b.into_iter().map(sigmoid).collect();
        let mut g = self.f_b.forward(&f_a, n);
        for row in g.chunks_mut(w) {
            for (i, v) in row.iter_mut().enumerate() {
                let hd = i / dim;
                let raw = *v + self.dt_bias[i];
                *v = match self.decay {
                    DecayGate::LowerBoundSigmoid { lower } => {
                        lower * sigmoid(self.a_log[hd].exp() * raw)
                    }
                    DecayGate::Softplus => -self.a_log[hd].exp() * softplus(raw),
                };
            }
        }
        let gate = match &self.out_gate {
            OutputGate::FullRank(_) => gate,
            OutputGate::LowRank(_, b) => b.forward(&gate, n),
        };

        let mut out = vec![0.0f32; n * w];
        for t in 0..n {
            // 2. causal short conv over [x_{t−K+1} … x_t], then SiLU.
            for (c, proj) in qkv.iter_mut().enumerate() {
                self.conv_step(
                    &mut proj[t * w..(t + 1) * w],
                    &self.conv[c],
                    &mut st.conv[c],
                );
            }
            // 3. per-head normalisation of q (with the 1/√K scale) and k.
            let scale = 1.0 / (dim as f32).sqrt();
            for hd in 0..heads {
                let r = t * w + hd * dim..t * w + (hd + 1) * dim;
                self.normalize(&mut qkv[0][r.clone()], scale);
                self.normalize(&mut qkv[1][r], 1.0);
            }
            // 6. the delta rule, head by head (independent, so parallel without changing any sum).
            let (q, k, v) = (&qkv[0][t * w..], &qkv[1][t * w..], &qkv[2][t * w..]);
            let (g_t, beta_t) = (&g[t * w..], &beta[t * heads..]);
            let o_t = &mut out[t * w..(t + 1) * w];
            let step = |(hd, (s, o)): (usize, (&mut [f32], &mut [f32]))| {
                let r = hd * dim..(hd + 1) * dim;
                delta_rule(
                    s,
                    &q[r.clone()],
                    &k[r.clone()],
                    &v[r.clone()],
                    &g_t[r],
                    beta_t[hd],
                    o,
                );
            };
            let work =
                st.s.chunks_mut(dim * dim)
                    .zip(o_t.chunks_mut(dim))
                    .enumerate();
            if heads * dim * dim >= 1 << 16 {
                work.collect::<Vec<_>>().into_par_iter().for_each(step);
            } else {
                work.for_each(step);
            }
            // 7. per-head RMS norm, then the output gate.
            for (hd, o) in o_t.chunks_mut(dim).enumerate() {
                rms_norm(o, &self.o_norm, self.eps);
                for (i, v) in o.iter_mut().enumerate() {
                    *v *= sigmoid(gate[t * w + hd * dim + i]);
                }
            }
        }
        self.o.forward(&out, n)
    }

    fn conv_step(&self, x: &mut [f32], weight: &[f32], window: &mut [f32]) {
        let k = self.kernel;
        for (c, v) in x.iter_mut().enumerate() {
            let win = &mut window[c * (k - 1)..(c + 1) * (k - 1)];
            let wt = &weight[c * k..(c + 1) * k];
            let mut acc = 0.0f32;
            for j in 0..k - 1 {
                acc += wt[j] * win[j];
            }
            acc += wt[k - 1] * *v;
            if k > 1 {
                win.copy_within(1.., 0);
                win[k - 2] = *v;
            }
            *v = silu(acc);
        }
    }

    fn normalize(&self, x: &mut [f32], scale: f32) {
        let ss: f32 = x.iter().map(|v| v * v).sum();
        let norm = match self.qk_norm {
            QkNorm::ClampedNorm => ss.sqrt().max(1e-12),
            QkNorm::EpsInsideSqrt => (ss + 1e-6).sqrt(),
        };
        let f = scale / norm;
        for v in x.iter_mut() {
            *v *= f;
        }
    }
}

/// One head, one step: `S ← S ⊙ exp(g)[:,None]; δ = v − Sᵀk; S ← S + (β·k) ⊗ δ; o = Sᵀq`.
/// S is `[K, V]` row-major; every sum runs over the key index in increasing order.
fn delta_rule(s: &mut [f32], q: &[f32], k: &[f32], v: &[f32], g: &[f32], beta: f32, o: &mut [f32]) {
    let dv = v.len();
    let mut delta = v.to_vec();
    for (i, row) in s.chunks_mut(dv).enumerate() {
        let decay = g[i].exp();
        for (sv, d) in row.iter_mut().zip(delta.iter_mut()) {
            *sv *= decay;
            *d -= *sv * k[i];
        }
    }
    o.fill(0.0);
    for (i, row) in s.chunks_mut(dv).enumerate() {
        let bk = beta * k[i];
        for ((sv, d), ov) in row.iter_mut().zip(&delta).zip(o.iter_mut()) {
            *sv += bk * d;
            *ov += *sv * q[i];
        }
    }
}
