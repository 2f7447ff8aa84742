//! The NEON path (AArch64). The 32 lanes of the crate's reduction order live in eight `float32x4_t`
//! accumulators, register i holding lanes 4i..4i+4, and [`fold`] performs exactly the scalar path's tree.
//!
//! Why the bits equal the scalar and AVX2 paths' (x86 and Arm give the same logits):
//! - `vfmaq_f32(acc, w, x)` is one fused multiply-add with a single rounding, like `f32::mul_add` and
//!   `_mm256_fmadd_ps`; nothing else here multiplies and adds, and Rust never contracts a separate `*`
//!   and `+` into an fma on its own, so the fold's plain additions stay plain additions.
//! - Lane i of the 32 always receives elements i, i+32, i+64, ... in increasing order, wherever it sits
//!   (two 4-wide NEON registers cover one 8-wide AVX2 register's lanes in the same order).
//! - Denormals are kept: Linux and macOS run AArch64 user code with FPCR.FZ clear, like x86's MXCSR
//!   default, so subnormal weights and products are not flushed. (NaN payloads can differ between the
//!   ISAs, x86 producing the negative default NaN and Arm the positive one; only corrupt inputs, such as
//!   an E8M0 scale of 255, produce a NaN at all.)
//! - An MXFP4 or INT4 weight is looked up in a per-block table of the sixteen E2M1 or INT4 values times
//!   the block scale: the same f32 multiplication as the scalar decoder's `value * scale`. An FP8 weight
//!   is decoded by the scalar codec's bit moves and exact rescaling, then multiplied by its scale.
//!
//! Every function here is `unsafe` because it requires NEON; callers check first (every AArch64 CPU
//! that runs Linux or macOS has it, but the scalar switch stays the same as on x86).

use crate::codec::{bf16_to_f32, E2M1, E4M3_MAGNITUDE, E4M3_RESCALE, E8M0, INT4};
use crate::scalar::{add_rows_t, fma_tail};
use crate::{fp8_scale_row, Matrix, FP8_BLOCK};
use std::arch::aarch64::*;
use std::ops::Range;

/// The 32 lanes of one (row, token) pair, or the 32 weights of one block.
type Lanes = [float32x4_t; 8];

/// Decodes the weights of one matrix row, a 32-weight block at a time.
trait RowDecoder {
    /// Weights 32b..32b+32 of the row, in lane order.
    unsafe fn block(&self, b: usize) -> Lanes;
}

struct Bf16Row(*const u16);

impl RowDecoder for Bf16Row {
    #[inline]
    #[target_feature(enable = "neon")]
    unsafe fn block(&self, b: usize) -> Lanes {
        let p = self.0.add(b * 32);
        std::array::from_fn(|i| widen_bf16(vld1_u16(p.add(i * 4))))
    }
}

/// Four BF16 values -> f32: each goes into the top half of its 32-bit lane (exact).
#[inline]
#[target_feature(enable = "neon")]
unsafe fn widen_bf16(bits: uint16x4_t) -> float32x4_t {
    vreinterpretq_f32_u32(vshll_n_u16::<16>(bits))
}

struct Mxfp4Row {
    packed: *const u8,
    scales: *const u8,
}

/// For weights 4m..4m+4 of a 16-nibble half block: byte k of the table index vector picks nibble
/// 4m + k/4 (each 4-byte f32 needs its nibble four times)...
const SPREAD: [[u8; 16]; 4] = {
    let mut spread = [[0; 16]; 4];
    let mut m = 0;
    while m < 4 {
        let mut k = 0;
        while k < 16 {
            spread[m][k] = (4 * m + k / 4) as u8;
            k += 1;
        }
        m += 1;
    }
    spread
};
/// ...and adds the byte's place in its f32, so the lookup copies table entry `nibble` whole.
const BYTE_IN_WORD: [u8; 16] = [0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3];

impl RowDecoder for Mxfp4Row {
    #[inline]
    #[target_feature(enable = "neon")]
    unsafe fn block(&self, b: usize) -> Lanes {
        let scale = E8M0[usize::from(*self.scales.add(b))];
        decode_nibbles(&E2M1, scale, self.packed.add(b * 16))
    }
}

struct Int4Row {
    packed: *const u8,
    scales: *const u16,
}

impl RowDecoder for Int4Row {
    #[inline]
    #[target_feature(enable = "neon")]
    unsafe fn block(&self, b: usize) -> Lanes {
        let scale = bf16_to_f32(*self.scales.add(b));
        decode_nibbles(&INT4, scale, self.packed.add(b * 16))
    }
}

/// The 32 weights of the 16 packed bytes at `packed` (MXFP4 and INT4 share the nibble layout): the sixteen
/// `values` times `scale` form a 64-byte table (four registers); the 32 nibbles, times four, index its
/// f32 entries byte by byte through `tbl`.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn decode_nibbles(values: &[f32; 16], scale: f32, packed: *const u8) -> Lanes {
    let entries = |i: usize| vreinterpretq_u8_f32(vmulq_n_f32(vld1q_f32(&values[i * 4]), scale));
    let table = uint8x16x4_t(entries(0), entries(1), entries(2), entries(3));
    let bytes = vld1q_u8(packed);
    let (low, high) = (vandq_u8(bytes, vdupq_n_u8(0xF)), vshrq_n_u8::<4>(bytes));
    // Byte k holds element 2k in its low nibble and 2k+1 in its high one: interleaving the two puts
    // the nibbles in element order, elements 0..16 then 16..32; times 4 gives each entry's offset.
    let offsets = [
        vshlq_n_u8::<2>(vzip1q_u8(low, high)),
        vshlq_n_u8::<2>(vzip2q_u8(low, high)),
    ];
    let byte_in_word = vld1q_u8(BYTE_IN_WORD.as_ptr());
    std::array::from_fn(|i| {
        let spread = vqtbl1q_u8(offsets[i / 4], vld1q_u8(SPREAD[i % 4].as_ptr()));
        vreinterpretq_f32_u8(vqtbl4q_u8(table, vaddq_u8(spread, byte_in_word)))
    })
}

/// One FP8 row: its bytes, and the scales of its 128-row block.
struct Fp8Row {
    data: *const u8,
    scales: *const f32,
}

impl RowDecoder for Fp8Row {
    #[inline]
    #[target_feature(enable = "neon")]
    unsafe fn block(&self, b: usize) -> Lanes {
        let scale = *self.scales.add(b * 32 / FP8_BLOCK);
        let p = self.data.add(b * 32).cast::<i8>();
        // Eight bytes at a time, sign-extended to two registers of four.
        let wide: [int16x8_t; 4] = std::array::from_fn(|k| vmovl_s8(vld1_s8(p.add(k * 8))));
        std::array::from_fn(|i| {
            let half = wide[i / 2];
            let four = if i % 2 == 0 {
                vmovl_s16(vget_low_s16(half))
            } else {
                vmovl_high_s16(half)
            };
            vmulq_n_f32(decode_e4m3(four), scale)
        })
    }
}

/// Four sign-extended e4m3 bytes -> f32, as `codec::e4m3_to_f32`: shifted left by 20, a byte has its
/// magnitude at bits 20..27 and copies of its sign at 27..32; keeping the magnitude and bit 31 gives the
/// value times 2^-120, and the multiplication by 2^120 is exact. NaN bytes become all ones.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn decode_e4m3(bytes: int32x4_t) -> float32x4_t {
    let shifted = vreinterpretq_u32_s32(vshlq_n_s32::<20>(bytes));
    let magnitude_bits = vdupq_n_u32(E4M3_MAGNITUDE);
    let bits = vandq_u32(shifted, vdupq_n_u32(E4M3_MAGNITUDE | 1 << 31));
    let value = vmulq_n_f32(vreinterpretq_f32_u32(bits), E4M3_RESCALE);
    let nan = vceqq_u32(vandq_u32(shifted, magnitude_bits), magnitude_bits);
    vreinterpretq_f32_u32(vorrq_u32(vreinterpretq_u32_f32(value), nan))
}

pub(crate) unsafe fn matmul_rows(
    w: &Matrix,
    x: &[f32],
    n: usize,
    range: Range<usize>,
    emit: &mut impl FnMut(usize, usize, f32),
) {
    match *w {
        Matrix::Bf16 { data, cols, .. } => rows_with(
            |r| Bf16Row(data[r * cols..].as_ptr()),
            cols,
            x,
            n,
            range,
            emit,
        ),
        Matrix::Mxfp4 {
            packed,
            scales,
            cols,
            ..
        } => rows_with(
            |r| Mxfp4Row {
                packed: packed[r * cols / 2..].as_ptr(),
                scales: scales[r * cols / 32..].as_ptr(),
            },
            cols,
            x,
            n,
            range,
            emit,
        ),
        Matrix::Fp8Block {
            data,
            scale_inv,
            cols,
            ..
        } => rows_with(
            |r| Fp8Row {
                data: data[r * cols..].as_ptr(),
                scales: fp8_scale_row(scale_inv, r, cols).as_ptr(),
            },
            cols,
            x,
            n,
            range,
            emit,
        ),
        Matrix::Int4Group {
            packed,
            scales,
            cols,
            ..
        } => rows_with(
            |r| Int4Row {
                packed: packed[r * cols / 2..].as_ptr(),
                scales: scales[r * cols / 32..].as_ptr(),
            },
            cols,
            x,
            n,
            range,
            emit,
        ),
    }
}

/// x rows that share one decoded weight block: 2 × 8 accumulators plus the block's 8 weights and the
/// MXFP4 table fill most of the 32 vector registers.
const TOKEN_BLOCK: usize = 2;

/// Each weight row streams once per TOKEN_BLOCK x rows, start to end. (The AVX2 path's column tiling
/// and many-token register blocking are not ported: they were tuned by measurement, and no Arm machine
/// has measured them yet.)
#[target_feature(enable = "neon")]
unsafe fn rows_with<R: RowDecoder>(
    row_at: impl Fn(usize) -> R,
    cols: usize,
    x: &[f32],
    n: usize,
    range: Range<usize>,
    emit: &mut impl FnMut(usize, usize, f32),
) {
    for r in range {
        let row = row_at(r);
        for t in (0..n).step_by(TOKEN_BLOCK) {
            let xt = x[t * cols..].as_ptr();
            let mut put = |lanes: &[Lanes]| {
                for (i, &lanes) in lanes.iter().enumerate() {
                    emit(t + i, r, fold(lanes));
                }
            };
            match n - t {
                1 => put(&accumulate::<R, 1>(&row, xt, cols)),
                _ => put(&accumulate::<R, TOKEN_BLOCK>(&row, xt, cols)),
            }
        }
    }
}

/// One weight row times NT consecutive x rows starting at `x`: every pair's 32 lanes.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn accumulate<R: RowDecoder, const NT: usize>(
    row: &R,
    x: *const f32,
    cols: usize,
) -> [Lanes; NT] {
    let mut acc = [[vdupq_n_f32(0.0); 8]; NT];
    for b in 0..cols / 32 {
        let w = row.block(b);
        for (t, acc) in acc.iter_mut().enumerate() {
            let xb = x.add(t * cols + b * 32);
            for (i, (acc, &w)) in acc.iter_mut().zip(&w).enumerate() {
                *acc = vfmaq_f32(*acc, w, vld1q_f32(xb.add(i * 4)));
            }
        }
    }
    acc
}

/// The crate's lane tree: h = 16, 8 and 4 on whole registers, then 2 and 1 within one.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn fold(acc: Lanes) -> f32 {
    let h16: [float32x4_t; 4] = std::array::from_fn(|i| vaddq_f32(acc[i], acc[i + 4]));
    let h8 = [vaddq_f32(h16[0], h16[2]), vaddq_f32(h16[1], h16[3])];
    let h4 = vaddq_f32(h8[0], h8[1]);
    let h2 = vadd_f32(vget_low_f32(h4), vget_high_f32(h4));
    vget_lane_f32::<0>(h2) + vget_lane_f32::<1>(h2)
}

#[target_feature(enable = "neon")]
pub(crate) unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
    let body = a.len() / 32 * 32;
    let mut acc = [vdupq_n_f32(0.0); 8];
    for i in (0..body).step_by(32) {
        for (j, acc) in acc.iter_mut().enumerate() {
            let k = i + j * 4;
            *acc = vfmaq_f32(*acc, vld1q_f32(a[k..].as_ptr()), vld1q_f32(b[k..].as_ptr()));
        }
    }
    fma_tail(fold(acc), &a[body..], &b[body..])
}

/// Columns `first_col..first_col + y.len()` of the transposed product. Rows are taken four at a time so
/// y is loaded and stored once per four rows; within a column they are still added in increasing order.
#[target_feature(enable = "neon")]
pub(crate) unsafe fn matvec_t(
    data: &[u16],
    cols: usize,
    x: &[f32],
    first_col: usize,
    y: &mut [f32],
) {
    y.fill(0.0);
    let mut r = 0;
    while r + 4 <= x.len() {
        rows_t::<4>(data, cols, &x[r..r + 4], r * cols + first_col, y);
        r += 4;
    }
    for r in r..x.len() {
        rows_t::<1>(data, cols, &x[r..r + 1], r * cols + first_col, y);
    }
}

/// Adds G consecutive rows (the first starting at `data[start]`, weights `x`) into y, in row order.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn rows_t<const G: usize>(
    data: &[u16],
    cols: usize,
    x: &[f32],
    start: usize,
    y: &mut [f32],
) {
    let rows: [&[u16]; G] = std::array::from_fn(|i| &data[start + i * cols..][..y.len()]);
    let vec_end = y.len() / 4 * 4;
    for c in (0..vec_end).step_by(4) {
        let mut acc = vld1q_f32(y[c..].as_ptr());
        for (row, &xr) in rows.iter().zip(x) {
            acc = vfmaq_f32(
                acc,
                widen_bf16(vld1_u16(row[c..].as_ptr())),
                vdupq_n_f32(xr),
            );
        }
        vst1q_f32(y[c..].as_mut_ptr(), acc);
    }
    add_rows_t(&rows, x, vec_end, y);
}

/// The NEON decoder's view of one MXFP4 block, for the codec tests.
#[cfg(test)]
pub(crate) fn decode_mxfp4_block(packed: &[u8; 16], scale: u8) -> [f32; 32] {
    let mut out = [0.0; 32];
    // SAFETY: tests call this only after checking that the CPU has NEON.
    unsafe {
        let row = Mxfp4Row {
            packed: packed.as_ptr(),
            scales: &scale,
        };
        for (i, lanes) in row.block(0).iter().enumerate() {
            vst1q_f32(out[i * 4..].as_mut_ptr(), *lanes);
        }
    }
    out
}
