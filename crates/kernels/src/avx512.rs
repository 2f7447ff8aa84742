//! The AVX-512 path for the nibble encodings (MXFP4, INT4) with one to three x rows: a 16-entry `vpermps`
//! table holds every signed weight of a 32-weight block, scale applied, so one permute decodes 16 weights
//! where AVX2 spends five instructions on eight. Everything else runs on the AVX2 path.
//!
//! Lane order: the 16 bytes of a block widen to 16 lanes, byte j in lane j, whose low nibble is element 2j
//! and high nibble element 2j + 1. So one accumulator holds the crate's even lanes (0, 2, .., 30) and one
//! its odd lanes, each lane still adding its elements in increasing order; x is read in that order (its
//! blocks de-interleaved once per product: [`lane_order`]), and the two accumulators are interleaved back
//! into lanes 0–31 before the crate's tree. The same fmas in the same order: the same bits as every other path.
//!
//! Every function here is `unsafe` because it requires a CPU with AVX-512F, AVX2, FMA and F16C; callers
//! check first.

use crate::avx2::{self, Lanes};
use crate::codec::{bf16_to_f32, E8M0};
use crate::Matrix;
use std::arch::x86_64::*;
use std::ops::Range;
use std::sync::OnceLock;

/// Whether this path computes some of `n` x rows times `w` itself (the rest go to AVX2).
pub(crate) fn takes(w: &Matrix, n: usize) -> bool {
    matches!(w, Matrix::Mxfp4 { .. } | Matrix::Int4Group { .. }) && avx2::gemm_tokens(n) < n
}

/// The x rows this path reads (those past AVX2's many-token blocks), each 32-element block's even elements
/// first, then its odd ones: arranged once per product, not per task.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
pub(crate) unsafe fn lane_order(x: &[f32], n: usize) -> Vec<f32> {
    let rest = &x[avx2::gemm_tokens(n) * (x.len() / n)..];
    let mut out = vec![0.0; rest.len()];
    for (from, to) in rest.chunks_exact(32).zip(out.chunks_exact_mut(32)) {
        deinterleave(from, to);
    }
    out
}

/// `lanes`: [`lane_order`] of x where [`takes`] holds.
pub(crate) unsafe fn matmul_rows(
    w: &Matrix,
    x: &[f32],
    lanes: &[f32],
    n: usize,
    range: Range<usize>,
    emit: &mut impl FnMut(usize, usize, f32),
) {
    if !takes(w, n) {
        return avx2::matmul_rows(w, x, n, range, emit);
    }
    // Four x rows or more go through AVX2's many-token path, which decodes each weight once for them all.
    let blocked = avx2::gemm_tokens(n);
    let cols = w.cols();
    if blocked > 0 {
        avx2::matmul_rows(w, &x[..blocked * cols], blocked, range.clone(), emit);
    }
    let emit = &mut |t, r, v| emit(blocked + t, r, v);
    match *w {
        Matrix::Mxfp4 { packed, scales, .. } => rows_with(
            Nibbles::<Mx>::at(packed, scales, cols),
            cols,
            lanes,
            range,
            emit,
        ),
        Matrix::Int4Group { packed, scales, .. } => rows_with(
            Nibbles::<Int4>::at(packed, scales, cols),
            cols,
            lanes,
            range,
            emit,
        ),
        Matrix::Bf16 { .. } | Matrix::Fp8Block { .. } => unreachable!("`takes` holds"),
    }
}

/// One row of a nibble encoding: its packed bytes and its per-block scales (`S` picks the table).
struct Nibbles<S> {
    packed: *const u8,
    scales: S,
}

impl<S: Scales> Nibbles<S> {
    /// The row decoder of row r of the matrix (packed, scales, cols).
    fn at<'a>(
        packed: &'a [u8],
        scales: &'a [S::Stored],
        cols: usize,
    ) -> impl Fn(usize) -> Self + 'a {
        move |r| Nibbles {
            packed: packed[r * cols / 2..].as_ptr(),
            scales: S::row(scales[r * cols / 32..].as_ptr()),
        }
    }

    /// The 16 weights a nibble of 32-weight block b can stand for, scale applied.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn table(&self, b: usize) -> __m512 {
        self.scales.table(b)
    }
}

/// A row's block scales and how they become a block's table.
trait Scales: Sized {
    /// The stored scale of one block.
    type Stored;
    /// The scales of the row whose first one `scales` points at.
    fn row(scales: *const Self::Stored) -> Self;
    unsafe fn table(&self, b: usize) -> __m512;
}

/// MXFP4's E8M0 scales, each block's table looked up among the 256 a byte can give.
struct Mx {
    scales: *const u8,
    tables: &'static Mxfp4Tables,
}

/// MXFP4's table for each scale byte (16 KiB, built once): the magnitudes times the scale, then the sign bit
/// set on entries 8..16. AVX2's decoder applies the sign the same way after the same multiply, so even a NaN
/// scale gives the same bits; one load per block instead of a broadcast, a multiply and a xor (the decoder
/// is bound by its vector instructions, not by the bytes it reads).
#[repr(C, align(64))]
struct Mxfp4Tables([[f32; 16]; 256]);

impl Mxfp4Tables {
    fn get() -> &'static Self {
        static TABLES: OnceLock<Box<Mxfp4Tables>> = OnceLock::new();
        TABLES.get_or_init(|| {
            let mut tables = Box::new(Mxfp4Tables([[0.0; 16]; 256]));
            for (table, &scale) in tables.0.iter_mut().zip(&E8M0) {
                // SAFETY: this path is only chosen when the CPU has AVX-512F.
                unsafe { _mm512_storeu_ps(table.as_mut_ptr(), Self::scaled(scale)) }
            }
            tables
        })
    }

    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn scaled(scale: f32) -> __m512 {
        let magnitudes = _mm512_setr_ps(
            0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
        );
        let sign = i32::MIN;
        let signs = _mm512_setr_epi32(
            0, 0, 0, 0, 0, 0, 0, 0, sign, sign, sign, sign, sign, sign, sign, sign,
        );
        let scaled = _mm512_castps_si512(_mm512_mul_ps(magnitudes, _mm512_set1_ps(scale)));
        _mm512_castsi512_ps(_mm512_xor_si512(scaled, signs))
    }
}

impl Scales for Mx {
    type Stored = u8;
    fn row(scales: *const u8) -> Self {
        Mx {
            scales,
            tables: Mxfp4Tables::get(),
        }
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn table(&self, b: usize) -> __m512 {
        _mm512_load_ps(self.tables.0[usize::from(*self.scales.add(b))].as_ptr())
    }
}

/// INT4's BF16 scales.
struct Int4(*const u16);

impl Scales for Int4 {
    type Stored = u16;
    fn row(scales: *const u16) -> Self {
        Int4(scales)
    }
    /// (nibble - 8) times the scale, AVX2's and the codec's product, one multiply each.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn table(&self, b: usize) -> __m512 {
        let q = _mm512_setr_ps(
            -8.0, -7.0, -6.0, -5.0, -4.0, -3.0, -2.0, -1.0, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0,
        );
        _mm512_mul_ps(q, _mm512_set1_ps(bf16_to_f32(*self.0.add(b))))
    }
}

/// Rows `range` of W times the 1 to 3 lane-ordered x rows `xp`, several weight rows through each block
/// together: each accumulator's fma waits for the previous one, so more rows' chains keep the FMA units busy,
/// and each x vector loaded serves them all. Four rows of at most 2048 columns with one x row (four such rows
/// are one short run of memory; 256 columns: 9.4 -> 10.4 GB/s on one thread), else two: four long rows are
/// more streams than the prefetching serves (4096 columns from DRAM: 13.5 -> 10 GB/s on one thread).
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn rows_with<S>(
    row_at: impl Fn(usize) -> Nibbles<S>,
    cols: usize,
    xp: &[f32],
    range: Range<usize>,
    emit: &mut impl FnMut(usize, usize, f32),
) where
    S: Scales,
{
    let n = xp.len() / cols.max(1);
    let xp = xp.as_ptr();
    let r = if n == 1 && cols <= 2048 {
        groups_of::<S, 4>(&row_at, n, xp, cols, range.clone(), emit)
    } else {
        groups_of::<S, 2>(&row_at, n, xp, cols, range.clone(), emit)
    };
    for r in r..range.end {
        group::<S, 1>(&row_at, r, n, xp, cols, emit);
    }
}

/// The whole groups of NR rows from `range.start`; returns the first row left.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn groups_of<S, const NR: usize>(
    row_at: &impl Fn(usize) -> Nibbles<S>,
    n: usize,
    xp: *const f32,
    cols: usize,
    range: Range<usize>,
    emit: &mut impl FnMut(usize, usize, f32),
) -> usize
where
    S: Scales,
{
    let mut r = range.start;
    while r + NR <= range.end {
        group::<S, NR>(row_at, r, n, xp, cols, emit);
        r += NR;
    }
    r
}

/// Rows first..first + NR times the n lane-ordered x rows at `xp`.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn group<S, const NR: usize>(
    row_at: &impl Fn(usize) -> Nibbles<S>,
    first: usize,
    n: usize,
    xp: *const f32,
    cols: usize,
    emit: &mut impl FnMut(usize, usize, f32),
) where
    S: Scales,
{
    let rows: [Nibbles<S>; NR] = std::array::from_fn(|i| row_at(first + i));
    match n {
        1 => put(first, block_rows::<S, NR, 1>(&rows, xp, cols), emit),
        2 => put(first, block_rows::<S, NR, 2>(&rows, xp, cols), emit),
        _ => put(first, block_rows::<S, NR, 3>(&rows, xp, cols), emit),
    }
}

/// One 32-element block of x in lane order: the even elements, then the odd ones.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn deinterleave(from: &[f32], to: &mut [f32]) {
    let (a, b) = (
        _mm512_loadu_ps(from.as_ptr()),
        _mm512_loadu_ps(from.as_ptr().add(16)),
    );
    let even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    let odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    _mm512_storeu_ps(to.as_mut_ptr(), _mm512_permutex2var_ps(a, even, b));
    _mm512_storeu_ps(to.as_mut_ptr().add(16), _mm512_permutex2var_ps(a, odd, b));
}

/// How far ahead of a row's block its bytes are prefetched. The hardware prefetcher alone left one thread at
/// 6.5–7 GB/s of MXFP4 from DRAM (11.7 in L3); 2–8 KiB ahead gave 10–11 (Zen 4, `examples/bench --rows
/// 32768`), 512 bytes 7.6.
const PREFETCH_AHEAD: usize = 4096;

/// The even and odd lanes of one (row, x row) pair.
type Halves = (__m512, __m512);

/// NR weight rows times NT lane-ordered x rows (`xp`, NT rows of `cols`).
#[inline]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn block_rows<S, const NR: usize, const NT: usize>(
    rows: &[Nibbles<S>; NR],
    xp: *const f32,
    cols: usize,
) -> [[Halves; NT]; NR]
where
    S: Scales,
{
    let zero = _mm512_setzero_ps();
    let mut acc = [[(zero, zero); NT]; NR];
    for b in 0..cols / 32 {
        for (row, acc) in rows.iter().zip(&mut acc) {
            let table = row.table(b);
            // Past the matrix's end this names bytes it never reads: prefetches do not fault.
            _mm_prefetch::<_MM_HINT_T1>(row.packed.wrapping_add(b * 16 + PREFETCH_AHEAD).cast());
            let bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(row.packed.add(b * 16).cast()));
            // vpermps reads the index's low four bits: the low nibble, then (shifted) the high one.
            let even = _mm512_permutexvar_ps(bytes, table);
            let odd = _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(bytes), table);
            for (t, (e, o)) in acc.iter_mut().enumerate() {
                let x = xp.add(t * cols + b * 32);
                *e = _mm512_fmadd_ps(even, _mm512_loadu_ps(x), *e);
                *o = _mm512_fmadd_ps(odd, _mm512_loadu_ps(x.add(16)), *o);
            }
        }
    }
    acc
}

/// Hands each (row, x row) pair's sum to `emit`, its lanes put back in the crate's order for the tree.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn put<const NR: usize, const NT: usize>(
    first_row: usize,
    acc: [[Halves; NT]; NR],
    emit: &mut impl FnMut(usize, usize, f32),
) {
    for (i, acc) in acc.iter().enumerate() {
        for (t, &(even, odd)) in acc.iter().enumerate() {
            emit(t, first_row + i, avx2::fold(interleave(even, odd)));
        }
    }
}

/// Lanes 0–31 from the even and odd ones.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn interleave(even: __m512, odd: __m512) -> Lanes {
    let low = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    let high = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    let (a, b) = (
        _mm512_permutex2var_ps(even, low, odd),
        _mm512_permutex2var_ps(even, high, odd),
    );
    [halve(a, 0), halve(a, 1), halve(b, 0), halve(b, 1)]
}

#[inline]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn halve(v: __m512, upper: usize) -> __m256 {
    let v = _mm512_castps_pd(v);
    _mm256_castpd_ps(if upper == 1 {
        _mm512_extractf64x4_pd::<1>(v)
    } else {
        _mm512_castpd512_pd256(v)
    })
}
