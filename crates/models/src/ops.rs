//! Element-wise and per-vector operations, each with one fixed evaluation order so every row's result
//! depends on that row alone.

use crate::math::{tanh, tanh_div};
use deltafin_kernels::dot;

/// `RMS(x, w) = w ⊙ (x · rsqrt(mean(x²) + eps))`, in place.
pub fn rms_norm(x: &mut [f32], w: &[f32], eps: f32) {
    let inv = inv_rms(x, eps);
    for (v, g) in x.iter_mut().zip(w) {
        *v = g * (*v * inv);
    }
}

/// `1 / sqrt(mean(x²) + eps)`.
pub fn inv_rms(x: &[f32], eps: f32) -> f32 {
    1.0 / (dot(x, x) / x.len() as f32 + eps).sqrt()
}

pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

pub fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

/// `log(1 + eˣ)`, linear above 20 like the reference implementations (avoids overflow, exact in f32 there).
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        crate::math::ln_1p_exp(x)
    }
}

/// K3's SiTU gating: `4·tanh(g/4)·sigmoid(g) · 25·tanh(u/25)` (betas from the config, checked at load).
pub fn situ(gate: f32, up: f32) -> f32 {
    situ_with(gate, tanh(gate / 4.0), tanh(up / 25.0))
}

/// SiTU from `tanh(gate/4)` and `tanh(up/25)` computed beforehand.
fn situ_with(gate: f32, tanh_gate: f32, tanh_up: f32) -> f32 {
    let g = 4.0 * tanh_gate * sigmoid(gate);
    let u = 25.0 * tanh_up;
    g * u
}

/// In-place softmax, max-subtracted, summed left to right.
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f32;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

/// `y += a·x` (a separate multiply and add: `mul_add` would be a libm call on CPUs built without FMA).
pub fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    for (d, s) in y.iter_mut().zip(x) {
        *d += a * *s;
    }
}

pub fn add_assign(y: &mut [f32], x: &[f32]) {
    for (d, s) in y.iter_mut().zip(x) {
        *d += *s;
    }
}

/// The gated activation applied between an MLP's gate/up and down projections.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Act {
    /// K3: SiTU(gate, up).
    Situ,
    /// Kimi Linear: SiLU(gate) · up.
    SiluGlu,
    /// gpt-oss: `g = min(gate, limit)`, `u = clamp(up, ±limit)`, `(u + 1) · g · σ(1.702 g)`.
    ClampedSwiglu { limit: f32 },
}

impl Act {
    pub fn apply(self, gate: &[f32], up: &[f32], out: &mut [f32]) {
        match self {
            Act::Situ => {
                // The tanh of a chunk first, vectorised, then the rest of `situ` element by element.
                const CHUNK: usize = 256;
                let (mut tg, mut tu) = ([0.0f32; CHUNK], [0.0f32; CHUNK]);
                for ((o, g), u) in out
                    .chunks_mut(CHUNK)
                    .zip(gate.chunks(CHUNK))
                    .zip(up.chunks(CHUNK))
                {
                    let k = o.len().min(g.len()).min(u.len());
                    tanh_div(&g[..k], 4.0, &mut tg[..k]);
                    tanh_div(&u[..k], 25.0, &mut tu[..k]);
                    for (((o, &g), &a), &b) in o.iter_mut().zip(g).zip(&tg[..k]).zip(&tu[..k]) {
                        *o = situ_with(g, a, b);
                    }
                }
            }
            Act::SiluGlu => {
                for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
                    *o = silu(g) * u;
                }
            }
            Act::ClampedSwiglu { limit } => {
                for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
                    let (g, u) = (g.min(limit), u.clamp(-limit, limit));
                    *o = (u + 1.0) * (g * sigmoid(1.702 * g));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn situ_matches_its_definition_at_hand_picked_points() {
        // gate' = 4·tanh(g/4)·σ(g), up' = 25·tanh(u/25), evaluated independently in f64.
        for &(g, u) in &[
            (0.0f32, 1.0f32),
            (1.0, 1.0),
            (-3.0, 2.0),
            (8.0, -40.0),
            (100.0, 100.0),
        ] {
            let (gd, ud) = (g as f64, u as f64);
            let want = 4.0 * (gd / 4.0).tanh() / (1.0 + (-gd).exp()) * 25.0 * (ud / 25.0).tanh();
            let got = situ(g, u) as f64;
            assert!(
                (got - want).abs() <= 1e-5 * want.abs().max(1.0),
                "situ({g},{u}) = {got}, want {want}"
            );
        }
        // Saturation: SiTU is bounded (unlike SiLU·up), which is the point of it.
        assert!(situ(1e4, 1e4).abs() <= 100.0 + 1e-3);
    }

    #[test]
    fn softmax_sums_to_one_and_is_shift_invariant() {
        let mut a = [1.0f32, 2.0, 3.0];
        let mut b = [101.0f32, 102.0, 103.0];
        softmax(&mut a);
        softmax(&mut b);
        assert!((a.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert_eq!(a, b);
    }

    #[test]
    fn rms_norm_normalises() {
        let mut x = [3.0f32, 4.0];
        rms_norm(&mut x, &[1.0, 2.0], 0.0);
        let r = (12.5f32).sqrt();
        assert!((x[0] - 3.0 / r).abs() < 1e-6 && (x[1] - 8.0 / r).abs() < 1e-6);
    }
}
