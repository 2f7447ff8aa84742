//! Rotary position embedding of MLA's rope part, as transformers' DeepSeek-V3 computes it: interleaved pairs
//! `(x[2i], x[2i+1])` rotated by `pos · inv_freq[i]`, YaRN's blended frequencies and its softmax mscale.
//! inv_freq and the angles are float32 as in transformers (`_compute_yarn_parameters`, the rotary forward).

use deltafin_formats::config::{Rope, Yarn};

pub struct Rotary {
    inv_freq: Vec<f32>,
    /// YaRN's attention factor on cos and sin (1 when `mscale == mscale_all_dim`).
    attn: f64,
}

/// YaRN's `get_mscale`.
fn mscale(factor: f64, m: f64) -> f64 {
    if factor <= 1.0 {
        1.0
    } else {
        0.1 * m * factor.ln() + 1.0
    }
}

impl Rotary {
    /// The rotation of `dim` (even) elements.
    pub fn new(rope: &Rope, dim: usize) -> Rotary {
        let half = dim / 2;
        let theta = rope.theta as f32;
        let pos: Vec<f32> = (0..half)
            .map(|i| theta.powf((2 * i) as f32 / dim as f32))
            .collect();
        let Some(y) = &rope.yarn else {
            return Rotary {
                inv_freq: pos.iter().map(|p| 1.0 / p).collect(),
                attn: 1.0,
            };
        };
        let (low, high) = correction_range(y, dim, rope.theta);
        let factor = y.factor as f32;
        let inv_freq = pos
            .iter()
            .enumerate()
            .map(|(i, &p)| {
                let (extra, inter) = (1.0 / p, 1.0 / (factor * p));
                let ramp = ((i as f32 - low) / (high - low)).clamp(0.0, 1.0);
                let e = 1.0 - ramp;
                inter * (1.0 - e) + extra * e
            })
            .collect();
        let attn = if y.mscale != 0.0 && y.mscale_all_dim != 0.0 {
            mscale(y.factor, y.mscale) / mscale(y.factor, y.mscale_all_dim)
        } else {
            mscale(y.factor, 1.0)
        };
        Rotary { inv_freq, attn }
    }

    /// Rotates `x`'s pairs for position `pos`.
    pub fn rotate(&self, x: &mut [f32], pos: usize) {
        for (pair, &f) in x.chunks_exact_mut(2).zip(&self.inv_freq) {
            let angle = (pos as f32 * f) as f64;
            let (c, s) = (
                (angle.cos() * self.attn) as f32,
                (angle.sin() * self.attn) as f32,
            );
            let (a, b) = (pair[0], pair[1]);
            pair[0] = a * c - b * s;
            pair[1] = b * c + a * s;
        }
    }
}

/// The band of frequency indices YaRN blends over, `[low, high]` (truncated, clamped, never empty).
fn correction_range(y: &Yarn, dim: usize, theta: f64) -> (f32, f32) {
    let d = dim as f64;
    let corr = |rot: f64| {
        d * (y.original_max_position as f64 / (rot * 2.0 * std::f64::consts::PI)).ln()
            / (2.0 * theta.ln())
    };
    let low = corr(y.beta_fast).floor().max(0.0);
    let mut high = corr(y.beta_slow).ceil().min(d - 1.0);
    if low == high {
        high += 0.001;
    }
    (low as f32, high as f32)
}

/// The attention softmax scale `qd^-0.5`, times YaRN's `mscale(factor, mscale_all_dim)²` where it applies.
pub fn softmax_scale(qd: usize, rope: Option<&Rope>) -> f32 {
    let base = 1.0 / (qd as f32).sqrt();
    match rope.and_then(|r| r.yarn.as_ref()) {
        Some(y) if y.mscale_all_dim != 0.0 => {
            let m = mscale(y.factor, y.mscale_all_dim);
            ((base as f64) * m * m) as f32
        }
        _ => base,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn yarn(factor: f64, beta_fast: f64) -> Rope {
        Rope {
            theta: 10000.0,
            yarn: Some(Yarn {
                factor,
                original_max_position: 4096,
                beta_fast,
                beta_slow: 1.0,
                mscale: 1.0,
                mscale_all_dim: 1.0,
            }),
        }
    }

    /// The high frequencies keep their RoPE value, the low ones are divided by the factor.
    #[test]
    fn yarn_blends_between_extrapolation_and_interpolation() {
        let plain = Rotary::new(
            &Rope {
                theta: 10000.0,
                yarn: None,
            },
            16,
        );
        let y = Rotary::new(&yarn(40.0, 32.0), 16);
        assert_eq!(y.inv_freq[0], plain.inv_freq[0]);
        let last = plain.inv_freq[7] / 40.0;
        assert!((y.inv_freq[7] - last).abs() <= last * 1e-6);
        assert!(y.inv_freq[4] < plain.inv_freq[4] && y.inv_freq[4] > plain.inv_freq[4] / 40.0);
    }

    /// Rotation keeps each pair's length and position 0 is the identity.
    #[test]
    fn rotation_is_a_rotation() {
        let r = Rotary::new(&yarn(40.0, 32.0), 8);
        let x = [1.0f32, 2.0, -3.0, 0.5, 0.25, 4.0, -1.0, -2.0];
        let mut y = x;
        r.rotate(&mut y, 0);
        assert_eq!(x, y);
        r.rotate(&mut y, 7);
        for (a, b) in x.chunks(2).zip(y.chunks(2)) {
            let (na, nb) = (a[0].hypot(a[1]), b[0].hypot(b[1]));
            assert!((na - nb).abs() < 1e-5, "{na} vs {nb}");
        }
        assert_ne!(x, y);
    }

    #[test]
    fn mscale_squares_into_the_softmax_scale() {
        let m = 0.1 * 40f64.ln() + 1.0;
        let s = softmax_scale(32, Some(&yarn(40.0, 32.0)));
        assert!((s as f64 - m * m / 32f64.sqrt()).abs() < 1e-6);
        assert_eq!(softmax_scale(32, None), 1.0 / 32f32.sqrt());
    }
}
