//! Turns a tensor's `Init` into bytes, drawing from one seeded stream in a fixed order.
//!
//! Every draw is integer arithmetic or a float multiply/add, never a libm call whose last bit may
//! differ between platforms, so a seed gives the same stream everywhere. (The one libm call, `ln` for
//! A_log, happens after its draws and only touches that stored F32 value.)

use deltafin_formats::Dtype;
use deltafin_kernels::codec::f32_to_bf16;
use rand::{Rng, RngCore};
use rand_chacha::ChaCha8Rng;

/// How a tensor's values are drawn.
#[derive(Clone, Copy, Debug)]
pub enum Init {
    /// Approximately N(0, std²).
    Normal(f32),
    /// U(lo, hi).
    Uniform(f32, f32),
    /// ln(U(1, 16)) in the first `real` entries, 0 in the rest (K3's per-head A_log padded to head_dim).
    LogUniform1To16 { real: usize },
    /// Uniform random bytes: packed MXFP4, where every one of the 16 nibble values occurs.
    RandomBytes,
    /// e8m0 group scales making the dequantised weights' std about 1/sqrt(fan_in).
    E8m0Scale { fan_in: usize },
    /// FP8 e4m3 bytes with magnitudes in [0.25, 3.75]: every sign and mantissa, never NaN.
    E4m3,
    /// F32 `weight_scale_inv` of [`Init::E4m3`] weights: 2^b · (1 + k/8), 4 significant bits so every
    /// fp8 × scale is a BF16 value, making the weights' std about 1/sqrt(fan_in).
    Fp8BlockScale { fan_in: usize },
    /// The two I64 values of compressed-tensors' `weight_shape`.
    Shape([u64; 2]),
}

/// Mean of e2m1² over the 16 nibble values (0, ±0.5, ±1, ±1.5, ±2, ±3, ±4, ±6): 68.5 / 8.
const E2M1_MEAN_SQUARE: f64 = 8.5625;

/// The scale byte 127 + base puts the weights' std near 1/sqrt(fan_in) once the random offset of -1, 0
/// or +1 (mean of 4^offset = 1.75) is applied: E[w²] = 8.5625 · 1.75 · 4^base ≈ 1/fan_in.
fn e8m0_base(fan_in: usize) -> i32 {
    127 - ((E2M1_MEAN_SQUARE * 1.75 * fan_in as f64).log2() / 2.0).round() as i32
}

/// E[w²] of [`Init::E4m3`] draws (exponents -2..=1, mantissas 1 + m/8): 1.328 · 2.148.
const E4M3_MEAN_SQUARE: f64 = 2.853;
/// E[(1 + k/8)²] over k in 0..8: the mantissa of both the e4m3 draws and their scales.
const MANTISSA3_MEAN_SQUARE: f64 = 2.148;

/// The power of two b making 2^b · (1 + k/8) · e4m3 have std about 1/sqrt(fan_in).
fn fp8_scale_exponent(fan_in: usize) -> i32 {
    -((E4M3_MEAN_SQUARE * MANTISSA3_MEAN_SQUARE * fan_in as f64).log2() / 2.0).round() as i32
}

/// std of the sum of four uniform u16 values: sqrt(4 · (65536² − 1) / 12).
const SUM4_U16_STD: f32 = 37_837.23;

/// Irwin–Hall with n = 4: the centred sum of four uniform 16-bit values from one u64, scaled to unit
/// variance. Close enough to a Gaussian for test weights (tails cut at ±3.46σ), platform-independent,
/// and one RNG word per sample.
fn standard_normal(rng: &mut ChaCha8Rng) -> f32 {
    let x = rng.next_u64();
    let sum = (x & 0xffff) + (x >> 16 & 0xffff) + (x >> 32 & 0xffff) + (x >> 48);
    (sum as i64 - 2 * 65_535) as f32 / SUM4_U16_STD
}

/// Draws `count` elements of `dtype` per `init`, little-endian.
pub fn fill(rng: &mut ChaCha8Rng, init: Init, dtype: Dtype, count: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(count * dtype.size());
    let mut push = |x: f32| match dtype {
        Dtype::Bf16 => out.extend_from_slice(&f32_to_bf16(x).to_le_bytes()),
        Dtype::F32 => out.extend_from_slice(&x.to_le_bytes()),
        other => unreachable!("floating-point init for a {} tensor", other.name()),
    };
    match init {
        Init::Normal(std) => (0..count).for_each(|_| push(std * standard_normal(rng))),
        Init::Uniform(lo, hi) => (0..count).for_each(|_| push(rng.gen_range(lo..hi))),
        Init::LogUniform1To16 { real } => {
            // Draw all the uniforms first, so the stream does not depend on ln's result.
            let u: Vec<f32> = (0..real.min(count))
                .map(|_| rng.gen_range(1.0f32..16.0))
                .collect();
            (0..count).for_each(|i| push(u.get(i).map_or(0.0, |v| v.ln())));
        }
        Init::RandomBytes => {
            out.resize(count * dtype.size(), 0);
            rng.fill_bytes(&mut out);
        }
        Init::E8m0Scale { fan_in } => {
            let base = e8m0_base(fan_in);
            out.extend((0..count).map(|_| (base + rng.gen_range(-1..=1)) as u8));
        }
        Init::E4m3 => out.extend((0..count).map(|_| {
            // Sign, exponent field 5..=8 (bias 7), mantissa: the field never reaches 15, e4m3fn's NaN.
            let (sign, exp, mant) = (
                rng.gen_range(0..2u8),
                rng.gen_range(5..=8u8),
                rng.gen_range(0..8u8),
            );
            sign << 7 | exp << 3 | mant
        })),
        Init::Fp8BlockScale { fan_in } => {
            let unit = 2f32.powi(fp8_scale_exponent(fan_in));
            (0..count).for_each(|_| push(unit * (1.0 + rng.gen_range(0..8u8) as f32 / 8.0)));
        }
        Init::Shape(values) => {
            assert_eq!(
                count,
                values.len(),
                "a weight_shape tensor holds two values"
            );
            values
                .iter()
                .for_each(|v| out.extend_from_slice(&(*v as i64).to_le_bytes()));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn normal_has_unit_variance() {
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let xs: Vec<f64> = (0..100_000)
            .map(|_| standard_normal(&mut rng) as f64)
            .collect();
        let mean = xs.iter().sum::<f64>() / xs.len() as f64;
        let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / xs.len() as f64;
        assert!(
            mean.abs() < 0.01 && (var - 1.0).abs() < 0.02,
            "mean {mean}, var {var}"
        );
    }

    #[test]
    fn e8m0_base_matches_fan_in() {
        // fan_in 32: 8.5625 · 1.75 · 32 = 479.5, log2 = 8.9, half rounds to 4.
        assert_eq!(e8m0_base(32), 123);
        // fan_in 256: 3836, log2 = 11.9, half rounds to 6.
        assert_eq!(e8m0_base(256), 121);
    }
}
