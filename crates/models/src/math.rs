//! `tanh` and `ln(1 + eˣ)` computed the same way on every CPU and C library.
//!
//! `f32::tanh` and `f32::ln_1p` call the C library's `tanhf` and `log1pf`, which differ between glibc on
//! x86-64 and on AArch64 in the last bit for about 0.1% of inputs (the AArch64 build fuses multiply-adds the
//! x86-64 one rounds twice), and Apple's libm is another implementation again. These are evaluated in f64
//! with + − × ÷ only, each correctly rounded by IEEE 754 on every ISA, and Rust never fuses them, so the
//! bits are the same everywhere; the f64 result is within a few f64 ulps, so the f32 rounding of it is the
//! correctly rounded value except within ~1e-15 of a rounding boundary.
//!
//! `f32::exp` is left to the C library: glibc's `expf` gives the same bits on x86-64 and AArch64 (checked
//! by tools/arm/check.sh through the logits); Apple's is untested (docs/arm.md).

use std::f64::consts::LN_2;

/// tanh(x), the same bits on every platform.
#[inline(always)]
pub fn tanh(x: f32) -> f32 {
    let a = f64::from(x.abs());
    // tanh(10) = 1 - 4e-9 already rounds to 1.0f32. Both sides are computed and one is chosen (no branch), so
    // a loop of these vectorises; the series runs on 0 for the saturated lanes, whose result is dropped.
    let saturated = a > 10.0;
    let t = exp_m1(2.0 * if saturated { 0.0 } else { a });
    let y = if saturated { 1.0 } else { t / (t + 2.0) };
    (y as f32).copysign(x)
}

/// `out[i] = tanh(x[i] / div)`, the bits of [`tanh`], several lanes at a time where the CPU has vectors
/// (SiTU takes two tanh an element, and one at a time they cost more than the expert's products).
pub fn tanh_div(x: &[f32], div: f32, out: &mut [f32]) {
    assert_eq!(x.len(), out.len(), "tanh_div: x and out differ in length");
    // The kernels' choice of instruction set (the CPU's best, or `--isa`) picks the lanes here too.
    #[cfg(target_arch = "x86_64")]
    match deltafin_kernels::isa() {
        // SAFETY: the kernels choose a path only where the CPU has its features (AVX-512F, AVX2).
        "avx512" => return unsafe { tanh_div_avx512(x, div, out) },
        "avx2+fma" => return unsafe { tanh_div_avx2(x, div, out) },
        _ => {}
    }
    tanh_div_lanes(x, div, out);
}

/// The loop [`tanh_div`] runs, inlined into each instruction set's entry.
#[inline(always)]
fn tanh_div_lanes(x: &[f32], div: f32, out: &mut [f32]) {
    for (o, &v) in out.iter_mut().zip(x) {
        *o = tanh(v / div);
    }
}

/// AVX2 (four f64 lanes) without FMA: Rust never fuses a multiply and an add, so every lane performs exactly
/// the scalar operations, each correctly rounded.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn tanh_div_avx2(x: &[f32], div: f32, out: &mut [f32]) {
    tanh_div_lanes(x, div, out);
}

/// AVX-512F: eight f64 lanes, the same scalar operations in each (3.75 against AVX2's 4.9 ns an element on
/// Zen 4, where SiTU's tanh was 6% of a `small` decode step).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn tanh_div_avx512(x: &[f32], div: f32, out: &mut [f32]) {
    tanh_div_lanes(x, div, out);
}

/// ln(1 + eˣ), the same bits on every platform (for x up to about 20, where softplus is linear).
pub fn ln_1p_exp(x: f32) -> f32 {
    // Below -200 the value is under 1e-87: +0 in f32.
    if x < -200.0 {
        return 0.0;
    }
    let (scale, em1) = reduce(f64::from(x));
    let e = scale * (1.0 + em1);
    // ln(1 + e) from ln(u), u = 1 + e rounded: the factor e / (u - 1) undoes u's rounding error, which
    // would otherwise dominate when e is small (Goldberg's log1p).
    let u = 1.0 + e;
    let y = if u == 1.0 { e } else { ln(u) * e / (u - 1.0) };
    y as f32
}

/// eˣ − 1 for |x| ≤ 200: 2ᵏ(1 + (eʳ − 1)) − 1 (see [`reduce`]). For k = 0 the series alone is used,
/// accurate relative to x however small.
#[inline(always)]
fn exp_m1(x: f64) -> f64 {
    let (scale, em1) = reduce(x);
    if scale == 1.0 {
        em1
    } else {
        scale * em1 + (scale - 1.0)
    }
}

/// x = k·ln 2 + r with |r| ≤ ln 2 / 2, returned as (2ᵏ, eʳ − 1), for |x| ≤ 200 (2ᵏ stays normal).
#[inline(always)]
fn reduce(x: f64) -> (f64, f64) {
    let k = round_small(x / LN_2);
    // Through i32, which vector units convert to (none converts f64 to i64 before AVX-512).
    let scale = f64::from_bits(((1023 + k as i32) as u64) << 52);
    (scale, exp_m1_reduced(x - k * LN_2))
}

/// `y.round()` (half away from zero) for |y| < 2³¹, inline: `f64::round` is a C library call on x86-64
/// CPUs without SSE4.1, and SiTU's tanh calls it twice an element. The cast truncates, `y − t` is exact,
/// and the sign is y's as `round` keeps it (−0.5 < y ≤ −0 rounds to −0).
#[inline(always)]
fn round_small(y: f64) -> f64 {
    let t = y as i32 as f64;
    let frac = y - t;
    let r = if frac >= 0.5 {
        t + 1.0
    } else if frac <= -0.5 {
        t - 1.0
    } else {
        t
    };
    r.copysign(y)
}

/// eʳ − 1 for |r| ≤ 0.35 by its Taylor series to r¹⁴/14! (the next term is below 1e-19 relative), in
/// Horner form with the coefficients 1/k! rounded to f64 once, at compile time.
#[inline(always)]
fn exp_m1_reduced(r: f64) -> f64 {
    const INV_FACTORIAL: [f64; 15] = {
        let mut c = [1.0; 15];
        let mut k = 1;
        while k < 15 {
            c[k] = c[k - 1] / k as f64;
            k += 1;
        }
        c
    };
    let mut p = INV_FACTORIAL[14];
    for &c in INV_FACTORIAL[1..14].iter().rev() {
        p = p * r + c;
    }
    p * r
}

/// ln(u) for normal u ≥ 1: u = 2ʲ·m with m in [√½, √2), ln m = 2·atanh(s), s = (m − 1)/(m + 1), |s| < 0.172,
/// by its series to s²³ (the next term is below 1e-20).
fn ln(u: f64) -> f64 {
    let bits = u.to_bits();
    let mut j = ((bits >> 52) & 0x7FF) as i64 - 1023;
    let mut m = f64::from_bits((bits & ((1 << 52) - 1)) | (1023 << 52));
    if m > std::f64::consts::SQRT_2 {
        m /= 2.0;
        j += 1;
    }
    let s = (m - 1.0) / (m + 1.0);
    let s2 = s * s;
    const INV_ODD: [f64; 12] = {
        let mut c = [0.0; 12];
        let mut k = 0;
        while k < 12 {
            c[k] = 1.0 / (2 * k + 1) as f64;
            k += 1;
        }
        c
    };
    let mut series = 0.0;
    for &c in INV_ODD.iter().rev() {
        series = c + s2 * series;
    }
    j as f64 * LN_2 + 2.0 * s * series
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Inputs spread over every scale that matters: tiny, around 1, up to saturation, both signs.
    fn samples() -> impl Iterator<Item = f32> {
        let mut state = 0x2545_F491_4F6C_DD1Du64;
        (0..200_000).map(move |i| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let unit = (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
            unit * [1e-6, 1e-2, 1.0, 8.0, 30.0, 300.0][i % 6]
        })
    }

    /// `got` is `want` (an f64 value) rounded to f32, unless `want` lies so near the midpoint between two
    /// f32 values that an error of a few f64 ulps could legitimately round it either way.
    fn correctly_rounded(got: f32, want: f64) -> bool {
        let nearest = want as f32;
        if got == nearest {
            return true;
        }
        let below = if (nearest as f64) > want {
            nearest.next_down()
        } else {
            nearest
        };
        let midpoint = (f64::from(below) + f64::from(below.next_up())) / 2.0;
        (want - midpoint).abs() <= 1e-14 * want.abs()
    }

    #[test]
    fn tanh_is_correctly_rounded() {
        for x in samples() {
            let want = f64::from(x).tanh();
            assert!(
                correctly_rounded(tanh(x), want),
                "tanh({x:e}) = {:e}, want {want:e}",
                tanh(x)
            );
        }
        assert_eq!(tanh(0.0).to_bits(), 0.0f32.to_bits());
        assert_eq!(tanh(-0.0).to_bits(), (-0.0f32).to_bits());
        assert_eq!((tanh(50.0), tanh(-50.0)), (1.0, -1.0));
        assert!(tanh(f32::NAN).is_nan());
    }

    /// The vectorised loop gives every element the bits of the scalar function, on each path this CPU has.
    #[test]
    fn tanh_div_is_tanh_of_the_quotient() {
        let mut x: Vec<f32> = samples().collect();
        x.extend([
            0.0,
            -0.0,
            40.0,
            -40.0,
            250.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::MAX,
        ]);
        for div in [4.0, 25.0] {
            let want: Vec<u32> = x.iter().map(|&v| tanh(v / div).to_bits()).collect();
            let mut out = vec![f32::NAN; x.len()];
            tanh_div(&x, div, &mut out);
            assert_eq!(out.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), want);
            type TanhDiv = fn(&[f32], f32, &mut [f32]);
            // Only x86-64 has more than one path.
            #[cfg_attr(not(target_arch = "x86_64"), allow(unused_mut))]
            let mut paths: Vec<(&str, TanhDiv)> = vec![("lanes", tanh_div_lanes)];
            #[cfg(target_arch = "x86_64")]
            {
                if is_x86_feature_detected!("avx2") {
                    // SAFETY: the CPU has AVX2.
                    paths.push(("avx2", |x, d, o| unsafe { tanh_div_avx2(x, d, o) }));
                }
                if is_x86_feature_detected!("avx512f") {
                    // SAFETY: the CPU has AVX-512F.
                    paths.push(("avx512", |x, d, o| unsafe { tanh_div_avx512(x, d, o) }));
                }
            }
            for (path, f) in paths {
                let mut out = vec![f32::NAN; x.len()];
                f(&x, div, &mut out);
                let got: Vec<u32> = out.iter().map(|v| v.to_bits()).collect();
                assert_eq!(got, want, "{path}, divisor {div}");
            }
        }
        let mut nan = [0.0];
        tanh_div(&[f32::NAN], 4.0, &mut nan);
        assert!(nan[0].is_nan());
    }

    #[test]
    fn round_small_is_round() {
        let halves = (-600..=600).map(|i| i as f64 / 2.0);
        let near = halves.clone().flat_map(|h| [h.next_down(), h.next_up()]);
        let spread = samples().map(|x| f64::from(x) / LN_2);
        for y in halves.chain(near).chain(spread).chain([0.0, -0.0]) {
            assert_eq!(
                round_small(y).to_bits(),
                y.round().to_bits(),
                "round({y:e})"
            );
        }
    }

    #[test]
    fn ln_1p_exp_is_correctly_rounded() {
        for x in samples().filter(|&x| x <= 20.0) {
            let want = f64::from(x).exp().ln_1p();
            let got = ln_1p_exp(x);
            assert!(
                correctly_rounded(got, want),
                "ln_1p_exp({x:e}) = {got:e}, want {want:e}"
            );
        }
        assert_eq!(ln_1p_exp(-1000.0), 0.0);
    }
}
