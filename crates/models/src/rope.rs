//! Rotary position embedding as transformers computes it: inv_freq (YaRN's blend of extrapolated and
//! interpolated frequencies, `_compute_yarn_parameters`) and the angles in float32, the cosines and sines of
//! those angles in f64 times YaRN's attention factor, rounded once. Which elements form a pair is the
//! family's ([`Pairing`]); MLA's softmax carries YaRN's mscale too ([`softmax_scale`]).

use deltafin_formats::config::{Rope, Yarn};

/// Which elements of a head rotate together.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pairing {
    /// `(x[2i], x[2i+1])`: DeepSeek-V3's MLA (`rope_interleave`).
    Interleaved,
    /// `(x[i], x[i + dim/2])`: rotate-half, gpt-oss.
    Half,
}

pub struct Rotary {
    /// One frequency per pair.
    inv_freq: Vec<f32>,
    /// YaRN's attention factor on cos and sin (so q·k carries its square); 1 without YaRN.
    attn: f64,
    pairing: Pairing,
}

/// YaRN's `get_mscale`.
fn mscale(factor: f64, m: f64) -> f64 {
    if factor <= 1.0 {
        1.0
    } else {
        0.1 * m * factor.ln() + 1.0
    }
}

/// A given, nonzero `mscale` field (transformers tests them for truth, so 0 counts as absent).
fn given(m: Option<f64>) -> Option<f64> {
    m.filter(|&m| m != 0.0)
}

impl Rotary {
    /// The rotation of `dim` (even) elements.
    pub fn new(rope: &Rope, dim: usize, pairing: Pairing) -> Rotary {
        let half = dim / 2;
        let theta = rope.theta as f32;
        let pos: Vec<f32> = (0..half)
            .map(|i| theta.powf((2 * i) as f32 / dim as f32))
            .collect();
        let Some(y) = &rope.yarn else {
            return Rotary {
                inv_freq: pos.iter().map(|p| 1.0 / p).collect(),
                attn: 1.0,
                pairing,
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
        let attn = match (given(y.mscale), given(y.mscale_all_dim)) {
            (Some(m), Some(all)) => mscale(y.factor, m) / mscale(y.factor, all),
            _ => mscale(y.factor, 1.0),
        };
        Rotary {
            inv_freq,
            attn,
            pairing,
        }
    }

    /// One frequency per pair, in float32 (a device rotating as [`Rotary::rotate`] does reads them).
    pub fn inv_freq(&self) -> &[f32] {
        &self.inv_freq
    }

    /// YaRN's attention factor on cos and sin (1 without YaRN).
    pub fn attn_factor(&self) -> f64 {
        self.attn
    }

    /// Rotates `x` (one head's `dim` rotated elements) in place for position `pos`.
    pub fn rotate(&self, x: &mut [f32], pos: usize) {
        let rot = |a: &mut f32, b: &mut f32, f: f32| {
            let angle = (pos as f32 * f) as f64;
            let (c, s) = (
                (angle.cos() * self.attn) as f32,
                (angle.sin() * self.attn) as f32,
            );
            let (x0, x1) = (*a, *b);
            *a = x0 * c - x1 * s;
            *b = x1 * c + x0 * s;
        };
        match self.pairing {
            Pairing::Interleaved => {
                for (pair, &f) in x.chunks_exact_mut(2).zip(&self.inv_freq) {
                    let (a, b) = pair.split_at_mut(1);
                    rot(&mut a[0], &mut b[0], f);
                }
            }
            Pairing::Half => {
                let (a, b) = x.split_at_mut(self.inv_freq.len());
                for ((a, b), &f) in a.iter_mut().zip(b).zip(&self.inv_freq) {
                    rot(a, b, f);
                }
            }
        }
    }
}

/// The band of frequency indices YaRN blends over, `[low, high]` (truncated where asked, clamped, never
/// empty).
fn correction_range(y: &Yarn, dim: usize, theta: f64) -> (f32, f32) {
    let d = dim as f64;
    let corr = |rot: f64| {
        d * (y.original_max_position as f64 / (rot * 2.0 * std::f64::consts::PI)).ln()
            / (2.0 * theta.ln())
    };
    let (mut low, mut high) = (corr(y.beta_fast), corr(y.beta_slow));
    if y.truncate {
        (low, high) = (low.floor(), high.ceil());
    }
    let (low, mut high) = (low.max(0.0), high.min(d - 1.0));
    if low == high {
        high += 0.001;
    }
    (low as f32, high as f32)
}

/// MLA's attention softmax scale `qd^-0.5`, times YaRN's `mscale(factor, mscale_all_dim)²` where it applies.
pub fn softmax_scale(qd: usize, rope: Option<&Rope>) -> f32 {
    let base = 1.0 / (qd as f32).sqrt();
    match rope.and_then(|r| r.yarn.as_ref()) {
        Some(y) => match given(y.mscale_all_dim) {
            Some(all) => {
                let m = mscale(y.factor, all);
                ((base as f64) * m * m) as f32
            }
            None => base,
        },
        None => base,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn yarn(theta: f64, factor: f64, mscale: Option<f64>, truncate: bool) -> Rope {
        Rope {
            theta,
            yarn: Some(Yarn {
                factor,
                original_max_position: 4096,
                beta_fast: 32.0,
                beta_slow: 1.0,
                mscale,
                mscale_all_dim: mscale,
                truncate,
            }),
        }
    }

    fn plain(theta: f64) -> Rope {
        Rope { theta, yarn: None }
    }

    /// The high frequencies keep their RoPE value, the low ones are divided by the factor.
    #[test]
    fn yarn_blends_between_extrapolation_and_interpolation() {
        let p = Rotary::new(&plain(10000.0), 16, Pairing::Interleaved);
        let y = Rotary::new(
            &yarn(10000.0, 40.0, Some(1.0), true),
            16,
            Pairing::Interleaved,
        );
        assert_eq!(y.inv_freq[0], p.inv_freq[0]);
        let last = p.inv_freq[7] / 40.0;
        assert!((y.inv_freq[7] - last).abs() <= last * 1e-6);
        assert!(y.inv_freq[4] < p.inv_freq[4] && y.inv_freq[4] > p.inv_freq[4] / 40.0);
    }

    /// The released gpt-oss values (theta 150000, YaRN factor 32 over 4096, head_dim 64, truncate false, no
    /// mscale): the ends of the ramp are pure extrapolation / interpolation, in float32 as transformers has
    /// them, and the attention factor is 0.1·ln(factor) + 1.
    #[test]
    fn gpt_oss_yarn_in_float32() {
        let r = Rotary::new(&yarn(150000.0, 32.0, None, false), 64, Pairing::Half);
        assert_eq!(r.inv_freq[0], 1.0);
        let p31 = 150000f32.powf(62.0 / 64.0);
        assert_eq!(r.inv_freq[31], 1.0 / (32.0 * p31));
        assert!((r.attn - (0.1 * 32f64.ln() + 1.0)).abs() < 1e-15);
        // Position 0 only scales by the factor.
        let mut x = [1.0f32; 64];
        r.rotate(&mut x, 0);
        assert!(x.iter().all(|&v| v == r.attn as f32));
    }

    /// Both pairings rotate: each pair keeps its length and position 0 is the identity. The pairs differ:
    /// interleaved pairs neighbours, rotate-half pairs the halves.
    #[test]
    fn rotation_is_a_rotation() {
        let x = [1.0f32, 2.0, -3.0, 0.5, 0.25, 4.0, -1.0, -2.0];
        for (pairing, pair) in [
            (Pairing::Interleaved, [(0, 1), (2, 3), (4, 5), (6, 7)]),
            (Pairing::Half, [(0, 4), (1, 5), (2, 6), (3, 7)]),
        ] {
            let r = Rotary::new(&yarn(10000.0, 40.0, Some(1.0), true), 8, pairing);
            let mut y = x;
            r.rotate(&mut y, 0);
            assert_eq!(x, y);
            r.rotate(&mut y, 7);
            for (i, j) in pair {
                let (na, nb) = (x[i].hypot(x[j]), y[i].hypot(y[j]));
                assert!((na - nb).abs() < 1e-5, "{pairing:?}: {na} vs {nb}");
            }
            assert_ne!(x, y);
        }
    }

    /// With mscale == mscale_all_dim the rotation is unscaled and the softmax carries mscale²; without them
    /// the rotation carries 0.1·ln(f) + 1 and the softmax nothing.
    #[test]
    fn mscale_goes_to_the_rotation_or_the_softmax() {
        let m = 0.1 * 40f64.ln() + 1.0;
        let with = yarn(10000.0, 40.0, Some(1.0), true);
        assert_eq!(Rotary::new(&with, 8, Pairing::Interleaved).attn, 1.0);
        let s = softmax_scale(32, Some(&with));
        assert!((s as f64 - m * m / 32f64.sqrt()).abs() < 1e-6);
        let without = yarn(10000.0, 40.0, None, true);
        assert!((Rotary::new(&without, 8, Pairing::Interleaved).attn - m).abs() < 1e-15);
        assert_eq!(softmax_scale(32, Some(&without)), 1.0 / 32f32.sqrt());
        assert_eq!(softmax_scale(32, None), 1.0 / 32f32.sqrt());
    }
}
