//! Kimi Delta Attention (contract §4 "KDA"): a gated delta-rule recurrence per head with a constant-size state.
//!
//! Projections run on all rows at once; the short convolution and the recurrence then walk the rows in order,
//! so a prefill of n tokens and n single-token steps perform the same arithmetic.

use crate::describe::{self as desc, DecayGate, QkNorm};
use crate::ops::{rms_norm, sigmoid, silu, softplus};
use crate::weights::{forward_many, Linear, Loader};
use anyhow::{bail, Result};
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
pub struct KdaState {
    conv: [Vec<f32>; 3],
    s: Vec<f32>,
    /// What the last pass kept to restore the state after any of its rows ([`KdaState::rollback`]).
    kept: Option<Box<KeptRows>>,
}

/// A copy carries the recurrence, not what its last pass kept: a copy is where a sequence continues, not one
/// to roll back.
impl Clone for KdaState {
    fn clone(&self) -> KdaState {
        KdaState {
            conv: self.conv.clone(),
            s: self.s.clone(),
            kept: None,
        }
    }
}

/// The state before a pass and each row's recurrence inputs, from which the state after any of its rows is
/// replayed without the projections (no weights read). Per row: the raw conv inputs of q, k, v (they only
/// move the windows), the normed k, the convolved v and the decay g (`heads·dim` each), and β (`heads`).
#[derive(Default)]
struct KeptRows {
    conv: [Vec<f32>; 3],
    s: Vec<f32>,
    raw: [Vec<f32>; 3],
    k: Vec<f32>,
    v: Vec<f32>,
    g: Vec<f32>,
    beta: Vec<f32>,
    heads: usize,
    dim: usize,
}

impl KdaState {
    pub fn zeros(heads: usize, dim: usize, kernel: usize) -> KdaState {
        let win = vec![0.0; heads * dim * (kernel - 1)];
        KdaState {
            conv: [win.clone(), win.clone(), win],
            s: vec![0.0; heads * dim * dim],
            kept: None,
        }
    }

    /// The recurrence and what the last pass kept for a rollback.
    pub fn bytes(&self) -> usize {
        let kept = self.kept.as_ref().map_or(0, |r| {
            let rows = [&r.k, &r.v, &r.g, &r.beta, &r.s].map(|v| v.len());
            let windows = r.conv.iter().chain(&r.raw).map(Vec::len);
            rows.iter().sum::<usize>() + windows.sum::<usize>()
        });
        4 * (self.conv.iter().map(Vec::len).sum::<usize>() + self.s.len() + kept)
    }

    /// Every value of the recurrence, as bits (for tests of exact equality).
    pub fn bits(&self) -> impl Iterator<Item = u32> + '_ {
        self.conv
            .iter()
            .chain([&self.s])
            .flatten()
            .map(|v| v.to_bits())
    }

    /// Drops what the last pass kept (its rows were all taken).
    pub fn forget_rows(&mut self) {
        self.kept = None;
    }

    /// Restores the state after the first `rows` rows of the last pass, which kept them: from the state
    /// before it, the windows move and the delta rule updates S exactly as that pass did for those rows.
    pub fn rollback(&mut self, rows: usize) -> Result<()> {
        let Some(r) = self.kept.take() else {
            bail!("internal: a KDA rollback needs the rows its last pass kept");
        };
        let KeptRows {
            conv,
            s,
            raw,
            k,
            v,
            g,
            beta,
            heads,
            dim,
        } = *r;
        let w = heads * dim;
        if rows > beta.len() / heads {
            bail!(
                "internal: a rollback to row {rows} of a pass of {}",
                beta.len() / heads
            );
        }
        (self.conv, self.s) = (conv, s);
        for t in 0..rows {
            for (window, raw) in self.conv.iter_mut().zip(&raw) {
                let taps = window.len() / w;
                for (c, &x) in raw[t * w..(t + 1) * w].iter().enumerate() {
                    push_window(&mut window[c * taps..(c + 1) * taps], x);
                }
            }
            let (k, v, g, beta) = (&k[t * w..], &v[t * w..], &g[t * w..], &beta[t * heads..]);
            per_head(
                heads * dim * dim,
                self.s.chunks_mut(dim * dim),
                |(hd, s)| {
                    let r = hd * dim..(hd + 1) * dim;
                    delta_update(s, &k[r.clone()], &v[r.clone()], &g[r], beta[hd]);
                },
            );
        }
        Ok(())
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
            kept: None,
        }
    }

    pub fn state_bytes(&self) -> usize {
        4 * (3 * self.heads * self.dim * (self.kernel - 1) + self.heads * self.dim * self.dim)
    }

    /// `x`: n rows of the normed input. Returns n rows of `o_proj` output. With `keep`, the state keeps what
    /// [`KdaState::rollback`] needs to go back to after any of the rows; otherwise it keeps nothing.
    pub fn forward(&self, x: &[f32], n: usize, st: &mut KdaState, keep: bool) -> Vec<f32> {
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
        // Buffers of the last pass's kept rows are reused by this one's.
        let mut kept = st.kept.take().filter(|_| keep);
        if keep {
            let r = kept.get_or_insert_with(Box::default);
            r.s.clone_from(&st.s);
            r.conv.clone_from(&st.conv);
            r.raw.clone_from(&qkv);
            r.g.clone_from(&g);
            r.beta.clone_from(&beta);
            (r.heads, r.dim) = (heads, dim);
        }

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
                delta_update(s, &k[r.clone()], &v[r.clone()], &g_t[r.clone()], beta_t[hd]);
                read_out(s, &q[r], o);
            };
            per_head(
                heads * dim * dim,
                st.s.chunks_mut(dim * dim).zip(o_t.chunks_mut(dim)),
                step,
            );
            // 7. per-head RMS norm, then the output gate.
            for (hd, o) in o_t.chunks_mut(dim).enumerate() {
                rms_norm(o, &self.o_norm, self.eps);
                for (i, v) in o.iter_mut().enumerate() {
                    *v *= sigmoid(gate[t * w + hd * dim + i]);
                }
            }
        }
        if let Some(mut r) = kept {
            r.k.clone_from(&qkv[1]);
            r.v.clone_from(&qkv[2]);
            st.kept = Some(r);
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
            push_window(win, *v);
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

/// Runs `step` on each head's share of a `state`-value recurrence (independent, so in parallel for large states without changing any
/// sum).
fn per_head<T: Send>(
    state: usize,
    heads: impl Iterator<Item = T>,
    step: impl Fn((usize, T)) + Send + Sync,
) {
    if state >= 1 << 16 {
        heads
            .enumerate()
            .collect::<Vec<_>>()
            .into_par_iter()
            .for_each(step);
    } else {
        heads.enumerate().for_each(step);
    }
}

/// A channel's window of its last `kernel − 1` inputs moves on by `x`.
fn push_window(win: &mut [f32], x: f32) {
    if let Some(last) = win.len().checked_sub(1) {
        win.copy_within(1.., 0);
        win[last] = x;
    }
}

/// One head, one step of the delta rule: `S ← S ⊙ exp(g)[:,None]; δ = v − Sᵀk; S ← S + (β·k) ⊗ δ`.
/// S is `[K, V]` row-major; every sum runs over the key index in increasing order.
fn delta_update(s: &mut [f32], k: &[f32], v: &[f32], g: &[f32], beta: f32) {
    let dv = v.len();
    let mut delta = v.to_vec();
    for (i, row) in s.chunks_mut(dv).enumerate() {
        let decay = g[i].exp();
        for (sv, d) in row.iter_mut().zip(delta.iter_mut()) {
            *sv *= decay;
            *d -= *sv * k[i];
        }
    }
    for (i, row) in s.chunks_mut(dv).enumerate() {
        let bk = beta * k[i];
        for (sv, d) in row.iter_mut().zip(&delta) {
            *sv += bk * d;
        }
    }
}

/// One head's output after its update: `o = Sᵀq`, summed over the key index in increasing order.
fn read_out(s: &[f32], q: &[f32], o: &mut [f32]) {
    o.fill(0.0);
    for (row, &qi) in s.chunks(o.len()).zip(q) {
        for (ov, sv) in o.iter_mut().zip(row) {
            *ov += *sv * qi;
        }
    }
}
