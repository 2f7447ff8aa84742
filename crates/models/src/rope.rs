//! Rotate-half rotary embeddings with optional YaRN scaling, as transformers computes them
//! (`_compute_yarn_parameters`, then `cos`/`sin` scaled by the attention factor): inv_freq and the angles in
//! f32 like transformers, the cosines and sines of those f32 angles in f64, rounded once.

use deltafin_formats::config::RopeConfig;

pub struct Rope {
    /// One frequency per pair `(x[i], x[i + dim/2])`.
    inv_freq: Vec<f32>,
    /// YaRN's factor on both cos and sin (so q·k carries its square); 1 without YaRN.
    factor: f64,
}

impl Rope {
    pub fn new(cfg: &RopeConfig, dim: usize) -> Rope {
        let half = dim / 2;
        let extrap: Vec<f64> = (0..half)
            .map(|i| cfg.theta.powf(-((2 * i) as f64) / dim as f64))
            .collect();
        let Some(y) = &cfg.yarn else {
            return Rope {
                inv_freq: extrap.iter().map(|&f| f as f32).collect(),
                factor: 1.0,
            };
        };
        let d = dim as f64;
        let corr = |rot: f64| {
            d * (y.original_max_position as f64 / (rot * 2.0 * std::f64::consts::PI)).ln()
                / (2.0 * cfg.theta.ln())
        };
        let (mut low, mut high) = (corr(y.beta_fast), corr(y.beta_slow));
        if y.truncate {
            (low, high) = (low.floor(), high.ceil());
        }
        let (low, mut high) = (low.max(0.0), high.min(d - 1.0));
        if low == high {
            high += 0.001;
        }
        let inv_freq = extrap
            .iter()
            .enumerate()
            .map(|(i, &e)| {
                // m = 1 − ramp: the share of the extrapolated (unscaled) frequency.
                let m = 1.0 - ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                (e / y.factor * (1.0 - m) + e * m) as f32
            })
            .collect();
        Rope {
            inv_freq,
            factor: if y.factor <= 1.0 {
                1.0
            } else {
                0.1 * y.factor.ln() + 1.0
            },
        }
    }

    /// Rotates `x` (one head, `dim` values) in place for position `pos`.
    pub fn apply(&self, x: &mut [f32], pos: usize) {
        let half = self.inv_freq.len();
        let (a, b) = x.split_at_mut(half);
        for ((a, b), &f) in a.iter_mut().zip(b.iter_mut()).zip(&self.inv_freq) {
            let angle = f64::from(pos as f32 * f);
            let (sin, cos) = (
                (angle.sin() * self.factor) as f32,
                (angle.cos() * self.factor) as f32,
            );
            let (x0, x1) = (*a, *b);
            *a = x0 * cos - x1 * sin;
            *b = x1 * cos + x0 * sin;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use deltafin_formats::config::YarnConfig;

    /// The released gpt-oss values (theta 150000, YaRN factor 32 over 4096, head_dim 64, truncate false), against
    /// the formula evaluated independently here: the ends of the ramp are pure extrapolation/interpolation.
    #[test]
    fn yarn_blends_between_extrapolation_and_interpolation() {
        let cfg = RopeConfig {
            theta: 150000.0,
            yarn: Some(YarnConfig {
                factor: 32.0,
                beta_fast: 32.0,
                beta_slow: 1.0,
                original_max_position: 4096,
                truncate: false,
            }),
        };
        let r = Rope::new(&cfg, 64);
        assert_eq!(r.inv_freq[0], 1.0);
        let last = 150000f64.powf(-62.0 / 64.0) / 32.0;
        assert_eq!(r.inv_freq[31], last as f32);
        assert!((r.factor - (0.1 * 32f64.ln() + 1.0)).abs() < 1e-15);
        // Position 0 only scales by the factor.
        let mut x = [1.0f32; 64];
        r.apply(&mut x, 0);
        assert!(x.iter().all(|&v| v == r.factor as f32));
    }
}
