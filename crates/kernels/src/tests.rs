use super::codec::*;
use super::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

// ---------------------------------------------------------------------------------------------
// Codecs, against values written by hand.

/// Nibble 0..16 -> expected f32 bits, per scale byte, written out literally.
const SCALE_TABLES: [(u8, [u32; 16]); 6] = [
    // 2^-127: every value is subnormal (0.5 * 2^-127 = 2^-128 = bits 0x0020_0000).
    (
        0,
        [
            0x0000_0000,
            0x0020_0000,
            0x0040_0000,
            0x0060_0000,
            0x0080_0000,
            0x00C0_0000,
            0x0100_0000,
            0x0140_0000,
            0x8000_0000,
            0x8020_0000,
            0x8040_0000,
            0x8060_0000,
            0x8080_0000,
            0x80C0_0000,
            0x8100_0000,
            0x8140_0000,
        ],
    ),
    // 2^-126: 0.5 is subnormal (2^-127), the rest normal.
    (
        1,
        [
            0x0000_0000,
            0x0040_0000,
            0x0080_0000,
            0x00C0_0000,
            0x0100_0000,
            0x0140_0000,
            0x0180_0000,
            0x01C0_0000,
            0x8000_0000,
            0x8040_0000,
            0x8080_0000,
            0x80C0_0000,
            0x8100_0000,
            0x8140_0000,
            0x8180_0000,
            0x81C0_0000,
        ],
    ),
    // 0.5: 0, 0.25, 0.5, 0.75, 1, 1.5, 2, 3.
    (
        126,
        [
            0x0000_0000,
            0x3E80_0000,
            0x3F00_0000,
            0x3F40_0000,
            0x3F80_0000,
            0x3FC0_0000,
            0x4000_0000,
            0x4040_0000,
            0x8000_0000,
            0xBE80_0000,
            0xBF00_0000,
            0xBF40_0000,
            0xBF80_0000,
            0xBFC0_0000,
            0xC000_0000,
            0xC040_0000,
        ],
    ),
    // 1: 0, 0.5, 1, 1.5, 2, 3, 4, 6.
    (
        127,
        [
            0x0000_0000,
            0x3F00_0000,
            0x3F80_0000,
            0x3FC0_0000,
            0x4000_0000,
            0x4040_0000,
            0x4080_0000,
            0x40C0_0000,
            0x8000_0000,
            0xBF00_0000,
            0xBF80_0000,
            0xBFC0_0000,
            0xC000_0000,
            0xC040_0000,
            0xC080_0000,
            0xC0C0_0000,
        ],
    ),
    // 2: 0, 1, 2, 3, 4, 6, 8, 12.
    (
        128,
        [
            0x0000_0000,
            0x3F80_0000,
            0x4000_0000,
            0x4040_0000,
            0x4080_0000,
            0x40C0_0000,
            0x4100_0000,
            0x4140_0000,
            0x8000_0000,
            0xBF80_0000,
            0xC000_0000,
            0xC040_0000,
            0xC080_0000,
            0xC0C0_0000,
            0xC100_0000,
            0xC140_0000,
        ],
    ),
    // 2^127: 0.5 -> 2^126, 1 -> 2^127, 1.5 -> 1.5 * 2^127; 2 and above overflow to infinity.
    (
        254,
        [
            0x0000_0000,
            0x7E80_0000,
            0x7F00_0000,
            0x7F40_0000,
            0x7F80_0000,
            0x7F80_0000,
            0x7F80_0000,
            0x7F80_0000,
            0x8000_0000,
            0xFE80_0000,
            0xFF00_0000,
            0xFF40_0000,
            0xFF80_0000,
            0xFF80_0000,
            0xFF80_0000,
            0xFF80_0000,
        ],
    ),
];

/// All 256 byte values as 16 blocks, decoded by every available decoder.
fn decode_all_bytes(scale: u8) -> Vec<(&'static str, Vec<f32>)> {
    let bytes: Vec<u8> = (0..=255).collect();
    let mut scalar = vec![0.0; 512];
    decode_mxfp4_row(&bytes, &[scale; 16], &mut scalar);
    let mut decoded = vec![("scalar", scalar)];
    #[cfg(target_arch = "x86_64")]
    if supported_paths().contains(&Path::Avx2Fma) {
        let avx2 = bytes
            .chunks_exact(16)
            .flat_map(|b| avx2::decode_mxfp4_block(b.try_into().unwrap(), scale));
        decoded.push(("avx2", avx2.collect()));
    }
    #[cfg(target_arch = "aarch64")]
    if detected_path() == Path::Neon {
        let neon = bytes
            .chunks_exact(16)
            .flat_map(|b| neon::decode_mxfp4_block(b.try_into().unwrap(), scale));
        decoded.push(("neon", neon.collect()));
    }
    decoded
}

#[test]
fn mxfp4_every_byte_decodes_low_nibble_first_under_hand_written_scales() {
    for (scale, table) in SCALE_TABLES {
        for (path, out) in decode_all_bytes(scale) {
            for byte in 0..256 {
                let (lo, hi) = (out[2 * byte].to_bits(), out[2 * byte + 1].to_bits());
                let want = (table[byte & 15], table[byte >> 4]);
                assert_eq!(
                    (lo, hi),
                    want,
                    "{path}: byte {byte:#04x} under scale {scale}"
                );
            }
        }
    }
    for (path, out) in decode_all_bytes(255) {
        assert!(
            out.iter().all(|v| v.is_nan()),
            "{path}: scale 255 must decode to NaN"
        );
    }
}

#[test]
fn mxfp4_spot_bytes() {
    // (byte, low-nibble value, high-nibble value) at scale 1.
    let cases = [
        (0x00, 0.0, 0.0),
        (0x1F, -6.0, 0.5),
        (0x7A, -1.0, 6.0),
        (0x80, 0.0, -0.0),
        (0x36, 4.0, 1.5),
    ];
    for (path, out) in decode_all_bytes(127) {
        for (byte, lo, hi) in cases {
            let got = (out[2 * byte].to_bits(), out[2 * byte + 1].to_bits());
            assert_eq!(
                got,
                (f32::to_bits(lo), f32::to_bits(hi)),
                "{path}: byte {byte:#04x}"
            );
        }
    }
    assert_eq!(e2m1_to_f32(8).to_bits(), 0x8000_0000);
    assert_eq!(e2m1_to_f32(15), -6.0);
}

#[test]
fn e8m0_scales() {
    assert_eq!(e8m0_to_f32(0).to_bits(), 0x0040_0000);
    assert_eq!(e8m0_to_f32(1).to_bits(), 0x0080_0000);
    assert_eq!(e8m0_to_f32(127), 1.0);
    assert_eq!(e8m0_to_f32(130), 8.0);
    assert_eq!(e8m0_to_f32(254).to_bits(), 0x7F00_0000);
    assert!(e8m0_to_f32(255).is_nan());
}

#[test]
fn bf16_widening() {
    let cases = [
        (0x3F80, 0x3F80_0000), // 1
        (0xC000, 0xC000_0000), // -2
        (0x4049, 0x4049_0000), // 3.140625
        (0x8000, 0x8000_0000), // -0
        (0x0001, 0x0001_0000), // smallest subnormal, 2^-133
        (0x7F80, 0x7F80_0000), // inf
        (0xFF80, 0xFF80_0000), // -inf
    ];
    for (bf16, f32_bits) in cases {
        assert_eq!(bf16_to_f32(bf16).to_bits(), f32_bits, "bf16 {bf16:#06x}");
    }
    assert_eq!(bf16_to_f32(0x4049), 3.140625);
    assert!(bf16_to_f32(0x7FC1).is_nan());
}

#[test]
fn bf16_rounding_is_nearest_even() {
    let cases = [
        (0x3F80_0000, 0x3F80), // exact
        (0x3F80_8000, 0x3F80), // tie, even is below
        (0x3F81_8000, 0x3F82), // tie, even is above
        (0x3F80_8001, 0x3F81), // just above the tie
        (0x3F80_7FFF, 0x3F80), // just below the tie
        (0xBF80_8000, 0xBF80), // negative tie
        (0xBF81_8000, 0xBF82),
        (0x7F7F_FFFF, 0x7F80), // f32::MAX rounds to inf
        (0xFF80_0000, 0xFF80), // -inf
        (0x0000_8000, 0x0000), // subnormal tie to zero
        (0x0001_8000, 0x0002), // subnormal tie to even
    ];
    for (f32_bits, bf16) in cases {
        assert_eq!(
            f32_to_bf16(f32::from_bits(f32_bits)),
            bf16,
            "f32 {f32_bits:#010x}"
        );
    }
    // A NaN whose payload lies only in the dropped half must not become infinity.
    for nan in [0x7F80_0001, 0xFF80_0001, 0x7FC0_0000] {
        let bf16 = f32_to_bf16(f32::from_bits(nan));
        assert!(bf16_to_f32(bf16).is_nan(), "{nan:#010x} -> {bf16:#06x}");
        assert_eq!(
            bf16 & 0x8000,
            (nan >> 16) as u16 & 0x8000,
            "sign of {nan:#010x}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Matrices and products.

#[test]
fn constructors_check_shapes() {
    assert!(Matrix::bf16(&[0; 64], 2, 32).is_ok());
    assert!(Matrix::bf16(&[0; 48], 3, 16).is_ok());
    assert!(Matrix::bf16(&[0; 63], 2, 32)
        .unwrap_err()
        .contains("needs 64 values, got 63"));
    assert!(Matrix::mxfp4(&[0; 32], &[0; 2], 2, 32).is_ok());
    assert!(Matrix::mxfp4(&[0; 8], &[0; 1], 1, 16)
        .unwrap_err()
        .contains("multiple of 32"));
    assert!(Matrix::mxfp4(&[0; 32], &[0; 3], 2, 32)
        .unwrap_err()
        .contains("2 scales"));
    assert!(Matrix::mxfp4(&[0; 31], &[0; 2], 2, 32)
        .unwrap_err()
        .contains("32 packed bytes"));
    assert!(Matrix::bf16(&[], usize::MAX, 64)
        .unwrap_err()
        .contains("overflows"));
}

#[test]
fn fp8_constructor_checks_weights_and_block_scales() {
    // [200, 300]: 2 x 3 blocks, the last row and column of blocks partial.
    let (data, scales) = (vec![0; 200 * 300], vec![1.0; 6]);
    assert!(Matrix::fp8_block(&data, &scales, 200, 300).is_ok());
    assert!(Matrix::fp8_block(&data, &scales[..5], 200, 300)
        .unwrap_err()
        .contains("needs 60000 weight bytes and 2 x 3 scale_inv values"));
    assert!(Matrix::fp8_block(&data[1..], &scales, 200, 300)
        .unwrap_err()
        .contains("got 59999 and 6"));
    assert!(Matrix::fp8_block(&[0; 7], &[1.0], 1, 7).is_ok());
    assert!(Matrix::fp8_block(&[], &[], 11, 0).is_ok());
    assert!(Matrix::fp8_block(&[], &[], usize::MAX, 2)
        .unwrap_err()
        .contains("overflows"));
}

#[test]
fn int4_constructor_checks_packing_scales_and_group() {
    assert!(Matrix::int4_group(&[0; 64], &[0; 4], 2, 64).is_ok());
    let err = Matrix::int4_group(&[0; 60], &[0; 4], 2, 60).unwrap_err();
    assert!(
        err.contains("[2, 60]") && err.contains("multiple of 32"),
        "{err}"
    );
    assert!(Matrix::int4_group(&[0; 63], &[0; 4], 2, 64)
        .unwrap_err()
        .contains(
            "needs 64 packed bytes (2 x 8 I32 words) and 4 BF16 scales (2 x 2), got 63 and 4"
        ));
    assert!(Matrix::int4_group(&[0; 64], &[0; 3], 2, 64)
        .unwrap_err()
        .contains("got 64 and 3"));
}

/// Owned test matrix data in any encoding.
enum Weights {
    Bf16(Vec<u16>),
    Mxfp4(Vec<u8>, Vec<u8>),
    Fp8(Vec<u8>, Vec<f32>),
    Int4(Vec<u8>, Vec<u16>),
}

struct TestMatrix {
    weights: Weights,
    rows: usize,
    cols: usize,
}

/// FP8 scales with full 24-bit mantissas (the product with a weight rounds), and extremes: subnormal
/// weights, weights past f32's range, and a scale whose 2^8 multiple overflows (AVX2's HUGE_SCALES).
const FP8_SCALES: [f32; 4] = [1.7e-3, 3.1e-4, 0.0123, 0.31];
const FP8_EXTREME_SCALES: [f32; 5] = [1e-40, 1e-30, 1.0, 1e36, 3e36];
/// INT4 scales (rounded to BF16), and extremes as for FP8.
const INT4_SCALES: [f32; 4] = [0.003, 0.01, 0.05, 0.2];
const INT4_EXTREME_SCALES: [f32; 4] = [1e-39, 1e-30, 1.0, 3e38];

impl TestMatrix {
    fn new(weights: Weights, rows: usize, cols: usize) -> Self {
        TestMatrix {
            weights,
            rows,
            cols,
        }
    }

    fn bf16(rng: &mut ChaCha8Rng, rows: usize, cols: usize) -> Self {
        let data = (0..rows * cols)
            .map(|_| f32_to_bf16(rng.gen_range(-1.0..1.0)))
            .collect();
        Self::new(Weights::Bf16(data), rows, cols)
    }

    /// Random nibbles; scales drawn from `scales`.
    fn mxfp4(rng: &mut ChaCha8Rng, rows: usize, cols: usize, scales: &[u8]) -> Self {
        let packed = (0..rows * cols / 2).map(|_| rng.gen()).collect();
        let scales = pick(rng, rows * cols / 32, scales);
        Self::new(Weights::Mxfp4(packed, scales), rows, cols)
    }

    /// Random bytes but the two NaNs; scales drawn from `scales`.
    fn fp8(rng: &mut ChaCha8Rng, rows: usize, cols: usize, scales: &[f32]) -> Self {
        let data = (0..rows * cols)
            .map(|_| match rng.gen() {
                0x7F | 0xFF => 0x7E,
                byte => byte,
            })
            .collect();
        let blocks = rows.div_ceil(FP8_BLOCK) * cols.div_ceil(FP8_BLOCK);
        let scales = pick(rng, blocks, scales);
        Self::new(Weights::Fp8(data, scales), rows, cols)
    }

    /// Random nibbles; scales drawn from `scales`, rounded to BF16.
    fn int4(rng: &mut ChaCha8Rng, rows: usize, cols: usize, scales: &[f32]) -> Self {
        let packed = (0..rows * cols / 2).map(|_| rng.gen()).collect();
        let scales = pick(rng, rows * cols / 32, scales);
        let scales = scales.into_iter().map(f32_to_bf16).collect();
        Self::new(Weights::Int4(packed, scales), rows, cols)
    }

    /// Every encoding the width allows (MXFP4 and INT4 need multiples of 32), with ordinary scales.
    fn all(rng: &mut ChaCha8Rng, rows: usize, cols: usize) -> Vec<Self> {
        let mut all = vec![
            Self::bf16(rng, rows, cols),
            Self::fp8(rng, rows, cols, &FP8_SCALES),
        ];
        if cols.is_multiple_of(32) {
            all.push(Self::mxfp4(rng, rows, cols, &[122, 125, 127, 128, 131]));
            all.push(Self::int4(rng, rows, cols, &INT4_SCALES));
        }
        all
    }

    fn matrix(&self) -> Matrix<'_> {
        let (rows, cols) = (self.rows, self.cols);
        match &self.weights {
            Weights::Bf16(data) => Matrix::bf16(data, rows, cols),
            Weights::Mxfp4(packed, scales) => Matrix::mxfp4(packed, scales, rows, cols),
            Weights::Fp8(data, scales) => Matrix::fp8_block(data, scales, rows, cols),
            Weights::Int4(packed, scales) => Matrix::int4_group(packed, scales, rows, cols),
        }
        .unwrap()
    }

    fn name(&self) -> String {
        format!("{:?}", self.matrix())
    }

    /// Row r decoded to f32 as the crate docs define it, written independently of the kernels' decoders.
    fn dequantised_row(&self, r: usize) -> Vec<f32> {
        let c = self.cols;
        match &self.weights {
            Weights::Bf16(data) => data[r * c..(r + 1) * c]
                .iter()
                .map(|&b| bf16_to_f32(b))
                .collect(),
            Weights::Mxfp4(packed, scales) => {
                let mut out = vec![0.0; c];
                decode_mxfp4_row(
                    &packed[r * c / 2..(r + 1) * c / 2],
                    &scales[r * c / 32..(r + 1) * c / 32],
                    &mut out,
                );
                out
            }
            Weights::Fp8(data, scales) => (0..c)
                .map(|j| e4m3_reference(data[r * c + j]) as f32 * fp8_scale(scales, r, j, c))
                .collect(),
            Weights::Int4(packed, scales) => (0..c)
                .map(|j| {
                    // Element j: nibble j % 8 of the little-endian I32 word j / 8, holding q + 8.
                    let word = &packed[(r * c + j) / 8 * 4..][..4];
                    let nibble =
                        u32::from_le_bytes(word.try_into().unwrap()) >> (4 * (j % 8)) & 0xF;
                    (nibble as f32 - 8.0) * bf16_to_f32(scales[r * c / 32 + j / 32])
                })
                .collect(),
        }
    }

    /// Row r's exact weights: FP8's e4m3 times scale in f64 (f32 rounds it); the others decode exactly.
    fn exact_row(&self, r: usize) -> Vec<f64> {
        match &self.weights {
            Weights::Fp8(data, scales) => (0..self.cols)
                .map(|j| {
                    let scale = fp8_scale(scales, r, j, self.cols);
                    e4m3_reference(data[r * self.cols + j]) * f64::from(scale)
                })
                .collect(),
            _ => self.dequantised_row(r).into_iter().map(f64::from).collect(),
        }
    }
}

fn pick<T: Copy>(rng: &mut ChaCha8Rng, len: usize, values: &[T]) -> Vec<T> {
    (0..len)
        .map(|_| values[rng.gen_range(0..values.len())])
        .collect()
}

/// The scale of FP8 weight [r, j] of a matrix `cols` wide.
fn fp8_scale(scales: &[f32], r: usize, j: usize, cols: usize) -> f32 {
    scales[r / 128 * cols.div_ceil(128) + j / 128]
}

/// float8_e4m3fn by its definition (sign, 4-bit exponent of bias 7, 3-bit mantissa, subnormals, NaN at
/// magnitude 0x7f), independent of the codec's bit moves.
fn e4m3_reference(byte: u8) -> f64 {
    let sign = if byte & 0x80 == 0 { 1.0 } else { -1.0 };
    let (exponent, mantissa) = (i32::from(byte >> 3 & 0xF), f64::from(byte & 7));
    if byte & 0x7F == 0x7F {
        f64::NAN
    } else if exponent == 0 {
        sign * mantissa / 8.0 * 2f64.powi(-6)
    } else {
        sign * (1.0 + mantissa / 8.0) * 2f64.powi(exponent - 7)
    }
}

fn random_vec(rng: &mut ChaCha8Rng, len: usize) -> Vec<f32> {
    (0..len).map(|_| rng.gen_range(-1.0..1.0)).collect()
}

fn run_matmul(path: Path, w: &Matrix, x: &[f32], n: usize) -> Vec<f32> {
    let mut y = vec![f32::NAN; n * w.rows()];
    matmul_many_on(path, &mut [(*w, &mut y)], x, n);
    y
}

/// Equal bits, or both NaN (NaN payloads are not part of the contract).
fn assert_same_bits(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()),
            "{what}: element {i}: {x:e} vs {y:e}"
        );
    }
}

/// Every path this CPU runs: the SIMD-versus-scalar checks compare each with scalar.
fn paths() -> Vec<Path> {
    let paths = supported_paths().to_vec();
    if paths.len() == 1 {
        eprintln!(
            "note: this CPU has no SIMD path; SIMD-versus-scalar checks compare scalar with itself"
        );
    }
    #[cfg(target_arch = "x86_64")]
    if !paths.contains(&Path::Avx512) {
        eprintln!("note: this CPU has no AVX-512; its path is not compared here");
    }
    paths
}

/// Widths that are not multiples of 32 (BF16 and FP8 only) have a tail; 200 rows and widths past 128 give
/// partial FP8 blocks.
const SHAPES: [(usize, usize); 11] = [
    (1, 32),
    (3, 64),
    (17, 96),
    (40, 256),
    (33, 512),
    (5, 4096),
    (3, 7),
    (200, 144),
    (200, 160),
    (9, 300),
    // Wide enough for BF16's tiles with the next rows fetched ahead (avx2.rs), two row groups, a tail.
    (11, 2085),
];

#[test]
fn matmul_matches_f64_reference() {
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    for (rows, cols) in SHAPES {
        for m in TestMatrix::all(&mut rng, rows, cols) {
            let exact_rows: Vec<Vec<f64>> = (0..rows).map(|r| m.exact_row(r)).collect();
            for n in 1..=7 {
                let x = random_vec(&mut rng, n * cols);
                for path in paths() {
                    let y = run_matmul(path, &m.matrix(), &x, n);
                    for t in 0..n {
                        for (r, w) in exact_rows.iter().enumerate() {
                            let xt = &x[t * cols..(t + 1) * cols];
                            let exact: f64 =
                                w.iter().zip(xt).map(|(&w, &x)| w * f64::from(x)).sum();
                            let magnitude: f64 = w
                                .iter()
                                .zip(xt)
                                .map(|(&w, &x)| (w * f64::from(x)).abs())
                                .sum();
                            // Error bound of 32 fma chains of cols/32 terms, a 5-level tree, the tail's
                            // chain, and FP8's rounding of each weight.
                            let steps = cols / 32 + 5 + cols % 32 + 1;
                            let tolerance = steps as f64 * f64::from(f32::EPSILON) * magnitude;
                            let got = f64::from(y[t * rows + r]);
                            assert!(
                                (got - exact).abs() <= tolerance,
                                "{} {path:?} n={n} t={t} r={r}: {got} vs {exact} (tolerance {tolerance:e})",
                                m.name()
                            );
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn matmul_simd_and_scalar_are_bit_identical() {
    let mut rng = ChaCha8Rng::seed_from_u64(2);
    for (rows, cols) in SHAPES {
        let mut matrices = TestMatrix::all(&mut rng, rows, cols);
        // Subnormal, huge and infinite weights: their products must match too.
        matrices.push(TestMatrix::fp8(&mut rng, rows, cols, &FP8_EXTREME_SCALES));
        if cols.is_multiple_of(32) {
            let mxfp4 = [0, 1, 100, 127, 200, 254];
            matrices.push(TestMatrix::mxfp4(&mut rng, rows, cols, &mxfp4));
            matrices.push(TestMatrix::int4(&mut rng, rows, cols, &INT4_EXTREME_SCALES));
        }
        for m in matrices {
            // Past 9: several of the many-token path's 32-row chunks, with a remainder.
            for n in (1..=9).chain([36, 70]) {
                let mut x = random_vec(&mut rng, n * cols);
                for v in x.iter_mut().step_by(7) {
                    *v = [0.0, -0.0, 1e-40, -3e38, 1e-30][rng.gen_range(0..5)];
                }
                let scalar = run_matmul(Path::Scalar, &m.matrix(), &x, n);
                for path in paths() {
                    let simd = run_matmul(path, &m.matrix(), &x, n);
                    assert_same_bits(&scalar, &simd, &format!("{} {path:?} n={n}", m.name()));
                }
            }
        }
    }
}

#[test]
fn matmul_rows_do_not_depend_on_batch_size() {
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    for (rows, cols) in [(7, 64), (40, 256), (300, 1024), (130, 300)] {
        for m in TestMatrix::all(&mut rng, rows, cols) {
            for path in paths() {
                for n in [2, 3, 4, 5, 8, 9, 16, 33] {
                    let x = random_vec(&mut rng, n * cols);
                    let batched = run_matmul(path, &m.matrix(), &x, n);
                    for t in 0..n {
                        let single = run_matmul(path, &m.matrix(), &x[t * cols..(t + 1) * cols], 1);
                        let what = format!("{} {path:?} n={n} t={t}", m.name());
                        assert_same_bits(&batched[t * rows..(t + 1) * rows], &single, &what);
                    }
                }
            }
        }
    }
}

fn pool(threads: usize) -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap()
}

#[test]
fn matmul_does_not_depend_on_thread_count() {
    let mut rng = ChaCha8Rng::seed_from_u64(4);
    let (one, two) = (pool(1), pool(2));
    let matrices: Vec<TestMatrix> = [(300, 1024), (260, 1000)]
        .into_iter()
        .flat_map(|(rows, cols)| TestMatrix::all(&mut rng, rows, cols))
        .collect();
    for m in matrices {
        let (rows, cols) = (m.rows, m.cols);
        for n in [1, 3, 6, 16] {
            assert!(
                rows * cols * n >= PARALLEL_MIN_WORK,
                "the product must be large enough to split"
            );
            let x = random_vec(&mut rng, n * cols);
            let serial = one.install(|| run_matmul(detected_path(), &m.matrix(), &x, n));
            let parallel = two.install(|| run_matmul(detected_path(), &m.matrix(), &x, n));
            assert_same_bits(&serial, &parallel, &format!("{} n={n}", m.name()));
        }
    }
}

/// One region for several products gives each output the bits its own `matmul` gives, split or not:
/// matrices of every encoding and of different heights, on one and two threads.
#[test]
fn matmul_many_equals_one_matmul_per_matrix() {
    let mut rng = ChaCha8Rng::seed_from_u64(9);
    let cols = 512;
    let mut mats = TestMatrix::all(&mut rng, 300, cols);
    mats.push(TestMatrix::bf16(&mut rng, 7, cols));
    for n in [1, 5] {
        let x = random_vec(&mut rng, n * cols);
        for path in paths() {
            let alone: Vec<Vec<f32>> = mats
                .iter()
                .map(|m| run_matmul(path, &m.matrix(), &x, n))
                .collect();
            for threads in [1, 2] {
                let mut ys: Vec<Vec<f32>> = mats
                    .iter()
                    .map(|m| vec![f32::NAN; n * m.matrix().rows()])
                    .collect();
                pool(threads).install(|| {
                    let mut products: Vec<(Matrix, &mut [f32])> = mats
                        .iter()
                        .zip(ys.iter_mut())
                        .map(|(m, y)| (m.matrix(), y.as_mut_slice()))
                        .collect();
                    matmul_many_on(path, &mut products, &x, n);
                });
                for ((m, want), got) in mats.iter().zip(&alone).zip(&ys) {
                    let what = format!("{} n={n} {path:?} {threads} threads", m.name());
                    assert_same_bits(want, got, &what);
                }
            }
        }
    }
}

#[test]
fn matmul_equals_dot_with_the_dequantised_row() {
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    let matrices: Vec<TestMatrix> = [320, 300]
        .into_iter()
        .flat_map(|cols| TestMatrix::all(&mut rng, 9, cols))
        .collect();
    for m in matrices {
        let x = random_vec(&mut rng, m.cols);
        for path in paths() {
            let y = run_matmul(path, &m.matrix(), &x, 1);
            let via_dot: Vec<f32> = (0..9)
                .map(|r| dot_on(path, &m.dequantised_row(r), &x))
                .collect();
            assert_same_bits(&y, &via_dot, &format!("{} {path:?}", m.name()));
        }
    }
}

#[test]
fn a_matrix_without_columns_gives_zeros() {
    // The empty sum is +0.0 on every path, for single rows and token blocks alike.
    let empty = [Matrix::bf16(&[], 11, 0), Matrix::fp8_block(&[], &[], 11, 0)];
    for m in empty.map(Result::unwrap) {
        for path in paths() {
            for n in [1, 2, 3, 5] {
                let y = run_matmul(path, &m, &[], n);
                assert!(
                    y.iter().all(|v| v.to_bits() == 0),
                    "{m:?} {path:?} n={n}: {y:?}"
                );
            }
        }
    }
}

/// x = the identity (cols rows, one-hot) makes y[t, r] = W[r, t] exactly, on every path and through the
/// many-row kernels: checks each encoding's element order and scale lookup, partial FP8 blocks and BF16
/// and FP8 tails included, against the test's own decoding.
#[test]
fn identity_products_give_the_decoded_weights() {
    let mut rng = ChaCha8Rng::seed_from_u64(10);
    for m in [(130, 150), (257, 160), (3, 7)]
        .into_iter()
        .flat_map(|(rows, cols)| TestMatrix::all(&mut rng, rows, cols))
    {
        let (rows, cols) = (m.rows, m.cols);
        let mut identity = vec![0.0; cols * cols];
        for c in 0..cols {
            identity[c * cols + c] = 1.0;
        }
        for path in paths() {
            let y = run_matmul(path, &m.matrix(), &identity, cols);
            for r in 0..rows {
                for (c, &want) in m.dequantised_row(r).iter().enumerate() {
                    // Value equality: an fma onto +0.0 turns a -0.0 weight into +0.0.
                    let got = y[c * rows + r];
                    assert!(
                        got == want,
                        "{} {path:?} [{r}, {c}]: {got:e} vs {want:e}",
                        m.name()
                    );
                }
            }
        }
    }
}

/// INT4 packing written out by hand: element j of a row is nibble j % 8 (low first) of little-endian
/// I32 word j / 8, holding q + 8.
#[test]
fn int4_nibbles_are_little_endian_and_offset_by_8() {
    let words: [u32; 4] = [0x7654_3210, 0xFEDC_BA98, 0x0123_4567, 0x89AB_CDEF];
    let packed: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
    let scale = [f32_to_bf16(0.5)];
    let m = Matrix::int4_group(&packed, &scale, 1, 32).unwrap();
    let q = (-8..0).chain(0..8).chain((-8..0).rev()).chain((0..8).rev());
    let want: Vec<f32> = q.map(|q| q as f32 * 0.5).collect();
    let mut identity = vec![0.0; 32 * 32];
    for c in 0..32 {
        identity[c * 32 + c] = 1.0;
    }
    for path in paths() {
        assert_eq!(run_matmul(path, &m, &identity, 32), want, "{path:?}");
    }
}

#[test]
fn e4m3_decodes_every_byte_exactly() {
    for byte in 0..=255u8 {
        let (got, want) = (e4m3_to_f32(byte), e4m3_reference(byte));
        assert!(
            f64::from(got) == want || (got.is_nan() && want.is_nan()),
            "{byte:#04x}: {got:e} vs {want:e}"
        );
    }
    // Hand-written: one, the largest normal, the smallest normal and subnormal, signed zeros, NaNs.
    let spots: [(u8, u32); 9] = [
        (0x38, 0x3F80_0000),
        (0x7E, 0x43E0_0000),
        (0xFE, 0xC3E0_0000),
        (0x08, 0x3C80_0000),
        (0x01, 0x3B00_0000),
        (0x00, 0x0000_0000),
        (0x80, 0x8000_0000),
        (0x7F, f32::NAN.to_bits()),
        (0xFF, f32::NAN.to_bits()),
    ];
    for (byte, bits) in spots {
        let got = e4m3_to_f32(byte);
        assert!(
            got.to_bits() == bits || (got.is_nan() && f32::from_bits(bits).is_nan()),
            "{byte:#04x}: {got:e}"
        );
    }
}

/// A NaN byte (never in real weights) poisons its own row's product on every path, body or tail, and no
/// other row's.
#[test]
fn fp8_nan_bytes_give_nan_rows() {
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    let (rows, cols) = (4, 40);
    let mut m = TestMatrix::fp8(&mut rng, rows, cols, &FP8_SCALES);
    if let Weights::Fp8(data, _) = &mut m.weights {
        data[5] = 0x7F;
        data[2 * cols + 35] = 0xFF;
    }
    for n in [1, 4] {
        let x = random_vec(&mut rng, n * cols);
        for path in paths() {
            let y = run_matmul(path, &m.matrix(), &x, n);
            for (i, v) in y.iter().enumerate() {
                let poisoned = matches!(i % rows, 0 | 2);
                assert_eq!(v.is_nan(), poisoned, "{path:?} n={n} row {}: {v}", i % rows);
            }
        }
    }
}

#[test]
fn row_slice_selects_rows() {
    let mut rng = ChaCha8Rng::seed_from_u64(6);
    let (rows, cols) = (300, 160);
    for m in TestMatrix::all(&mut rng, rows, cols) {
        let x = random_vec(&mut rng, 2 * cols);
        let full = run_matmul(detected_path(), &m.matrix(), &x, 2);
        // Inside one 128-row block, and from block boundaries (the slices FP8 allows).
        for (start, len) in [(5, 4), (130, 20), (128, 150), (256, 44), (0, 300), (17, 0)] {
            let slice = m.matrix().row_slice(start, len);
            assert_eq!((slice.rows(), slice.cols()), (len, cols));
            let part = run_matmul(detected_path(), &slice, &x, 2);
            for t in 0..2 {
                assert_same_bits(
                    &part[t * len..(t + 1) * len],
                    &full[t * rows + start..t * rows + start + len],
                    &format!("{} rows {start}+{len}", m.name()),
                );
            }
        }
    }
}

#[test]
#[should_panic(expected = "cross a 128-row block boundary")]
fn fp8_row_slice_rejects_a_misaligned_slice_across_blocks() {
    Matrix::fp8_block(&[0; 300 * 7], &[1.0; 3], 300, 7)
        .unwrap()
        .row_slice(100, 50);
}

#[test]
#[should_panic(expected = "outside a matrix of 12 rows")]
fn row_slice_rejects_out_of_range() {
    Matrix::bf16(&[0; 12 * 32], 12, 32)
        .unwrap()
        .row_slice(10, 3);
}

// ---------------------------------------------------------------------------------------------
// matvec_t_bf16 and dot.

fn run_matvec_t(path: Path, data: &[u16], rows: usize, cols: usize, x: &[f32]) -> Vec<f32> {
    let mut y = vec![f32::NAN; cols];
    matvec_t_on(path, data, rows, cols, x, &mut y);
    y
}

#[test]
fn matvec_t_matches_reference_on_every_path() {
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    for (rows, cols) in [(1, 1), (3, 7), (5, 37), (64, 300), (129, 1000)] {
        let data: Vec<u16> = (0..rows * cols)
            .map(|_| f32_to_bf16(rng.gen_range(-1.0..1.0)))
            .collect();
        let x = random_vec(&mut rng, rows);
        let scalar = run_matvec_t(Path::Scalar, &data, rows, cols, &x);
        let simd = run_matvec_t(detected_path(), &data, rows, cols, &x);
        assert_same_bits(&scalar, &simd, &format!("[{rows}, {cols}]"));
        for (c, &got) in scalar.iter().enumerate() {
            let terms =
                (0..rows).map(|r| f64::from(bf16_to_f32(data[r * cols + c])) * f64::from(x[r]));
            let exact: f64 = terms.clone().sum();
            let magnitude: f64 = terms.map(f64::abs).sum();
            let tolerance = rows as f64 * f64::from(f32::EPSILON) * magnitude;
            assert!(
                (f64::from(got) - exact).abs() <= tolerance,
                "[{rows}, {cols}] column {c}: {got} vs {exact}"
            );
        }
    }
}

#[test]
fn matvec_t_does_not_depend_on_thread_count() {
    let mut rng = ChaCha8Rng::seed_from_u64(8);
    let (rows, cols) = (515, 1003);
    assert!(
        rows * cols >= PARALLEL_MIN_WORK,
        "the product must be large enough to split"
    );
    let data: Vec<u16> = (0..rows * cols)
        .map(|_| f32_to_bf16(rng.gen_range(-1.0..1.0)))
        .collect();
    let x = random_vec(&mut rng, rows);
    for path in paths() {
        let serial = pool(1).install(|| run_matvec_t(path, &data, rows, cols, &x));
        let parallel = pool(2).install(|| run_matvec_t(path, &data, rows, cols, &x));
        assert_same_bits(&serial, &parallel, &format!("{path:?}"));
    }
}

/// The crate docs' order, written out independently of the kernels.
fn documented_order_dot(a: &[f32], b: &[f32]) -> f32 {
    let body = a.len() - a.len() % 32;
    let mut acc = [0.0f32; 32];
    for i in 0..body {
        acc[i % 32] = a[i].mul_add(b[i], acc[i % 32]);
    }
    let mut half = 16;
    while half >= 1 {
        for k in 0..half {
            acc[k] += acc[k + half];
        }
        half /= 2;
    }
    (body..a.len()).fold(acc[0], |s, i| a[i].mul_add(b[i], s))
}

#[test]
fn dot_follows_the_documented_order_on_every_path() {
    let mut rng = ChaCha8Rng::seed_from_u64(9);
    for len in [0, 1, 5, 31, 32, 33, 64, 100, 1000, 4133] {
        let (a, b) = (random_vec(&mut rng, len), random_vec(&mut rng, len));
        let want = documented_order_dot(&a, &b);
        for path in paths() {
            let got = dot_on(path, &a, &b);
            assert_eq!(
                got.to_bits(),
                want.to_bits(),
                "{path:?} len {len}: {got:e} vs {want:e}"
            );
        }
        let exact: f64 = a
            .iter()
            .zip(&b)
            .map(|(&a, &b)| f64::from(a) * f64::from(b))
            .sum();
        let magnitude: f64 = a
            .iter()
            .zip(&b)
            .map(|(&a, &b)| f64::from(a * b).abs())
            .sum();
        let tolerance = (len / 32 + 5 + len % 32) as f64 * f64::from(f32::EPSILON) * magnitude;
        assert!(
            (f64::from(want) - exact).abs() <= tolerance,
            "len {len}: {want} vs {exact}"
        );
    }
}

#[test]
fn set_isa_switches_the_path_and_names_the_choices() {
    for name in isas() {
        set_isa(Some(name)).unwrap();
        assert_eq!(isa(), name);
    }
    let err = set_isa(Some("avx1024")).unwrap_err();
    assert!(err.contains("avx1024") && err.contains("scalar"), "{err}");
    set_isa(None).unwrap();
    assert_eq!(isa(), detected_path().name());
    assert_eq!(isas().last(), Some(&isa()));
}

/// Every AArch64 CPU that runs Linux or macOS has NEON: a scalar path here would mean the detection
/// broke and the SIMD-against-scalar tests above compared scalar with itself.
#[cfg(target_arch = "aarch64")]
#[test]
fn neon_is_detected_on_aarch64() {
    assert_eq!(detected_path(), Path::Neon);
}
