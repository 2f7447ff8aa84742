//! The AVX2+FMA path. The 32 lanes of the crate's reduction order live in four `__m256` accumulators
//! (lanes 0–7, 8–15, 16–23, 24–31), and [`fold`] performs exactly the scalar path's tree.
//!
//! Every function here is `unsafe` because it requires a CPU with AVX2, FMA and F16C; callers check first.

use crate::codec::bf16_to_f32;
use crate::scalar::{add_rows_t, fma_tail};
use crate::{fp8_scale_row, Matrix, FP8_BLOCK};
use std::arch::x86_64::*;
use std::mem::MaybeUninit;
use std::ops::Range;

/// Yields the weights of one matrix row as f32, eight at a time, so each vector is consumed by its fmas
/// right away and the token block's accumulators keep the registers.
trait RowDecoder {
    /// What a 32-weight block needs decoded once (the MXFP4 scaled table, the FP8 and INT4 scale).
    type Block: Copy;
    /// Whether each 32-weight block is one 64-byte line of the row (BF16). Such rows decode faster than
    /// one core's stream from DRAM feeds them, and [`tile_rows`] fetches the rows it computes next into L2.
    const LINE_BLOCKS: bool = false;
    /// The address of block `b`, where LINE_BLOCKS.
    fn line(&self, _b: usize) -> *const u8 {
        std::ptr::null()
    }
    unsafe fn block(&self, b: usize) -> Self::Block;
    /// Weights 32b+8j..32b+8j+8 of the row: lanes 8j..8j+8 of the crate's 32.
    unsafe fn eight(&self, block: Self::Block, b: usize, j: usize) -> __m256;
}

struct Bf16Row(*const u16);

impl RowDecoder for Bf16Row {
    type Block = ();
    const LINE_BLOCKS: bool = true;

    fn line(&self, b: usize) -> *const u8 {
        self.0.wrapping_add(b * 32).cast()
    }

    #[inline]
    unsafe fn block(&self, _: usize) {}

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn eight(&self, _: (), b: usize, j: usize) -> __m256 {
        widen_bf16(self.0.add(b * 32 + j * 8))
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn widen_bf16(p: *const u16) -> __m256 {
    let halves = _mm256_cvtepu16_epi32(_mm_loadu_si128(p.cast()));
    _mm256_castsi256_ps(_mm256_slli_epi32::<16>(halves))
}

struct Mxfp4Row {
    packed: *const u8,
    scales: *const u8,
}

impl RowDecoder for Mxfp4Row {
    type Block = __m256;

    /// The eight magnitudes times the block scale (exact, so equal to scaling each weight), with the
    /// magnitude index m pre-XORed into bits 28..31: see `eight`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn block(&self, b: usize) -> __m256 {
        let magnitudes = _mm256_setr_ps(0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0);
        let scale = _mm256_broadcast_ss(&crate::codec::E8M0[usize::from(*self.scales.add(b))]);
        let index_bits = _mm256_setr_epi32(
            0,
            1 << 28,
            2 << 28,
            3 << 28,
            4 << 28,
            5 << 28,
            6 << 28,
            7 << 28,
        );
        _mm256_xor_ps(
            _mm256_mul_ps(magnitudes, scale),
            _mm256_castsi256_ps(index_bits),
        )
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn eight(&self, table: __m256, b: usize, j: usize) -> __m256 {
        decode_eight(table, self.packed.add(b * 16 + j * 4))
    }
}

/// Eight MXFP4 weights from the four bytes at `p`.
///
/// vpermps reads only the low three bits of each lane of [`nibble_lanes`], the magnitude m. Shifting the
/// lane left by 28 leaves exactly the nibble in bits 28..31; XORing it onto the table entry (which holds m
/// there already) cancels m and sets the sign bit, which gives the signed weight in four instructions.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn decode_eight(table: __m256, p: *const u8) -> __m256 {
    let lanes = nibble_lanes(p);
    let entry = _mm256_permutevar8x32_ps(table, lanes);
    _mm256_xor_ps(entry, _mm256_castsi256_ps(_mm256_slli_epi32::<28>(lanes)))
}

/// The little-endian word at `p` shifted right by 4i in lane i, so the lane's low four bits are nibble i
/// (element i of eight packed MXFP4 or INT4 weights); the bits above are the following nibbles.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn nibble_lanes(p: *const u8) -> __m256i {
    let word = _mm256_set1_epi32(p.cast::<i32>().read_unaligned());
    _mm256_srlv_epi32(word, _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28))
}

/// One FP8 row: its bytes, and the scales of its 128-row block. HUGE_SCALES when some scale times 2^8
/// overflows: see `eight`.
struct Fp8Row<const HUGE_SCALES: bool> {
    data: *const u8,
    scales: *const f32,
}

impl<const HUGE_SCALES: bool> Fp8Row<HUGE_SCALES> {
    /// The decoder of row r of the FP8 matrix (data, scale_inv, cols).
    fn at<'a>(
        (data, scale_inv, cols): (&'a [u8], &'a [f32], usize),
    ) -> impl Fn(usize) -> Self + 'a {
        move |r| Fp8Row {
            data: data[r * cols..].as_ptr(),
            scales: fp8_scale_row(scale_inv, r, cols).as_ptr(),
        }
    }
}

impl<const HUGE_SCALES: bool> RowDecoder for Fp8Row<HUGE_SCALES> {
    type Block = __m256;

    /// The scale of the 128-column block holding 32-column block b, times 2^8 unless HUGE_SCALES. NaN
    /// when one of the block's bytes is NaN: one NaN weight makes the row's sum NaN on every path, so
    /// poisoning the whole block gives the same result for one test per 32 weights instead of one per 8.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn block(&self, b: usize) -> __m256 {
        let magnitudes = _mm256_and_si256(
            _mm256_loadu_si256(self.data.add(b * 32).cast()),
            _mm256_set1_epi8(0x7F),
        );
        let nan = _mm256_cmpeq_epi8(magnitudes, _mm256_set1_epi8(0x7F));
        let scale = *self.scales.add(b * 32 / FP8_BLOCK);
        _mm256_set1_ps(if _mm256_movemask_epi8(nan) != 0 {
            f32::NAN
        } else if HUGE_SCALES {
            scale
        } else {
            scale * 256.0
        })
    }

    /// `e4m3 * scale` with one rounding, as the scalar decoder: (e4m3 × 2^-8, exact) × (scale × 2^8,
    /// exact unless it overflows, which HUGE_SCALES rules out) is the same exact product.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn eight(&self, scale: __m256, b: usize, j: usize) -> __m256 {
        let v = e4m3_times_2_pow_minus_8(self.data.add(b * 32 + j * 8));
        if HUGE_SCALES {
            _mm256_mul_ps(_mm256_mul_ps(v, _mm256_set1_ps(256.0)), scale)
        } else {
            _mm256_mul_ps(v, scale)
        }
    }
}

/// Whether an FP8 scale in rows `rows` times 2^8 overflows (never in real checkpoints: scale_inv is a
/// block's largest magnitude / 448).
fn huge_fp8_scales(scale_inv: &[f32], rows: Range<usize>, cols: usize) -> bool {
    let block_cols = cols.div_ceil(FP8_BLOCK);
    let blocks = rows.start / FP8_BLOCK * block_cols..rows.end.div_ceil(FP8_BLOCK) * block_cols;
    scale_inv[blocks].iter().any(|s| (s * 256.0).is_infinite())
}

/// Eight e4m3 bytes at `p` times 2^-8, exactly, as f32 (no f32 subnormals, which cost ~4x here: the
/// codec's 2^-120 form has them). Sign-extended and shifted left by 7, a byte has its magnitude at bits
/// 7..14 and copies of its sign at 14..16; keeping the magnitude and bit 15 gives the fp16 of the same
/// bits, whose exponent bias is 8 more than e4m3's and whose subnormals line up with e4m3's, so its value
/// is the e4m3 value times 2^-8; vcvtph2ps widens it exactly. NaN bytes are the caller's: see `block`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn e4m3_times_2_pow_minus_8(p: *const u8) -> __m256 {
    let halves = _mm_slli_epi16::<7>(_mm_cvtepi8_epi16(_mm_loadl_epi64(p.cast())));
    _mm256_cvtph_ps(_mm_and_si128(halves, _mm_set1_epi16(0xBF80u16 as i16)))
}

/// One INT4 row: its packed nibbles and BF16 scales.
struct Int4Row {
    packed: *const u8,
    scales: *const u16,
}

impl RowDecoder for Int4Row {
    type Block = __m256;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn block(&self, b: usize) -> __m256 {
        _mm256_set1_ps(bf16_to_f32(*self.scales.add(b)))
    }

    /// (nibble - 8) converted exactly to f32, times the scale: the codec's `INT4[nibble] * scale`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn eight(&self, scale: __m256, b: usize, j: usize) -> __m256 {
        let nibbles = _mm256_and_si256(
            nibble_lanes(self.packed.add(b * 16 + j * 4)),
            _mm256_set1_epi32(0xF),
        );
        let q = _mm256_cvtepi32_ps(_mm256_sub_epi32(nibbles, _mm256_set1_epi32(8)));
        _mm256_mul_ps(q, scale)
    }
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
        } => {
            let w = (data, scale_inv, cols);
            if huge_fp8_scales(scale_inv, range.clone(), cols) {
                rows_with(Fp8Row::<true>::at(w), cols, x, n, range, emit)
            } else {
                rows_with(Fp8Row::<false>::at(w), cols, x, n, range, emit)
            }
        }
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

/// Tokens processed per pass over a weight row: each decoded weight feeds this many accumulator sets.
/// Three keeps the 12 accumulators, the weights and the MXFP4 table in the 16 ymm registers; four spills.
const TOKEN_BLOCK: usize = 3;
/// Rows that share one pass over a tile of x, and the tile's width in 32-column blocks. A tile of
/// TOKEN_BLOCK x rows (6 KiB) and the rows' matching weights stay in L1; without the tiling every weight
/// row would stream the whole x block from L2 again. (A single x row is not tiled: see `tile_rows`.)
const ROW_GROUP: usize = 8;
const TILE_BLOCKS: usize = 16;
/// The column tile of a single x row over LINE_BLOCKS rows wider than it: 8 KiB of x stays in L1.
const LINE_TILE_BLOCKS: usize = 64;

/// The 32 lanes of one (row, token) pair.
pub(crate) type Lanes = [__m256; 4];

/// From this many x rows on, whole blocks of GEMM_TOKENS of them go through [`gemm`].
const GEMM_MIN_TOKENS: usize = 4;
/// [`gemm`]'s register block: each weight vector feeds GEMM_TOKENS accumulators and each x vector
/// GEMM_ROWS, 12 in all (one lane group of each pair at a time), plus 3 weights and 1 x: 16 ymm.
const GEMM_ROWS: usize = 3;
const GEMM_TOKENS: usize = 4;
/// x rows whose lanes a row group keeps while it walks the column tiles (3 × 32 pairs: 12 KiB).
const GEMM_CHUNK: usize = 32;
/// [`gemm`]'s column tile in 32-column blocks: its decoded weights (12 KiB) and 4 x rows' part (16 KiB)
/// stay in L1. At 64 x rows 32 measured ~10–15% faster than 16 or 64.
const GEMM_TILE_BLOCKS: usize = 32;

/// How many of `n` x rows go through [`gemm`]: whole blocks of GEMM_TOKENS, once there are enough.
pub(crate) fn gemm_tokens(n: usize) -> usize {
    if n >= GEMM_MIN_TOKENS {
        n / GEMM_TOKENS * GEMM_TOKENS
    } else {
        0
    }
}

/// Rows [`rows_with`] computes together for `n` x rows.
pub(crate) fn rows_together(n: usize) -> usize {
    if n >= GEMM_MIN_TOKENS {
        GEMM_ROWS
    } else {
        1
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rows_with<R: RowDecoder>(
    row_at: impl Fn(usize) -> R,
    cols: usize,
    x: &[f32],
    n: usize,
    range: Range<usize>,
    emit: &mut impl FnMut(usize, usize, f32),
) {
    let blocked = gemm_tokens(n);
    if blocked > 0 {
        gemm(&row_at, cols, x.as_ptr(), blocked, range.clone(), emit);
    }
    for first_row in range.clone().step_by(ROW_GROUP) {
        let rows = first_row..(first_row + ROW_GROUP).min(range.end);
        for t in (blocked..n).step_by(TOKEN_BLOCK) {
            let xt = x[t * cols..].as_ptr();
            let mut put = |r: usize, lanes: &[Lanes]| {
                for (i, &lanes) in lanes.iter().enumerate() {
                    emit(t + i, r, fold(lanes));
                }
            };
            match n - t {
                1 => tile_rows::<R, 1>(&row_at, rows.clone(), xt, cols, &mut put),
                2 => tile_rows::<R, 2>(&row_at, rows.clone(), xt, cols, &mut put),
                _ => tile_rows::<R, TOKEN_BLOCK>(&row_at, rows.clone(), xt, cols, &mut put),
            }
        }
    }
}

/// Rows `range` of W times x rows 0..n (n a multiple of GEMM_TOKENS), for many x rows: GEMM_ROWS weight
/// rows at a time are decoded once per column tile into f32, then every GEMM_TOKENS x rows take one lane
/// group (j) of all 12 pairs through the tile, so a weight vector is loaded once for 4 fmas and an x vector
/// once for 3, where [`tile_rows`] decodes a weight vector for 3. A lane still adds its blocks in
/// increasing order, so each (row, token) pair gets exactly [`tile_rows`]' fmas: the same bits.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn gemm<R: RowDecoder>(
    row_at: &impl Fn(usize) -> R,
    cols: usize,
    x: *const f32,
    n: usize,
    range: Range<usize>,
    emit: &mut impl FnMut(usize, usize, f32),
) {
    const TILE: usize = GEMM_TILE_BLOCKS * 32;
    let blocks = cols / 32;
    // A short last row group computes its missing rows from stale (initialised) weights and drops them.
    let mut weights = [[0.0f32; TILE]; GEMM_ROWS];
    // Written by the first tile (there is always one, empty when cols is 0) before any is read.
    let mut lanes = [[MaybeUninit::<Lanes>::uninit(); GEMM_CHUNK]; GEMM_ROWS];
    for first_row in range.clone().step_by(GEMM_ROWS) {
        let rows = first_row..(first_row + GEMM_ROWS).min(range.end);
        for t0 in (0..n).step_by(GEMM_CHUNK) {
            let chunk = (n - t0).min(GEMM_CHUNK);
            for first in (0..blocks.max(1)).step_by(GEMM_TILE_BLOCKS) {
                let tile = first..(first + GEMM_TILE_BLOCKS).min(blocks);
                for (r, w) in rows.clone().zip(&mut weights) {
                    let row = row_at(r);
                    for b in tile.clone() {
                        let block = row.block(b);
                        for j in 0..4 {
                            let at = w.as_mut_ptr().add((b - first) * 32 + j * 8);
                            _mm256_storeu_ps(at, row.eight(block, b, j));
                        }
                    }
                }
                for tb in (0..chunk).step_by(GEMM_TOKENS) {
                    let xt = x.add((t0 + tb) * cols);
                    for j in 0..4 {
                        let mut acc = [[_mm256_setzero_ps(); GEMM_TOKENS]; GEMM_ROWS];
                        if first > 0 {
                            for (acc, lanes) in acc.iter_mut().zip(&lanes) {
                                for (a, l) in acc.iter_mut().zip(&lanes[tb..]) {
                                    *a = l.assume_init()[j];
                                }
                            }
                        }
                        for b in tile.clone() {
                            let at = (b - first) * 32 + j * 8;
                            let w: [__m256; GEMM_ROWS] = std::array::from_fn(|i| {
                                _mm256_loadu_ps(weights[i].as_ptr().add(at))
                            });
                            for t in 0..GEMM_TOKENS {
                                let xv = _mm256_loadu_ps(xt.add(t * cols + b * 32 + j * 8));
                                for (acc, &w) in acc.iter_mut().zip(&w) {
                                    acc[t] = _mm256_fmadd_ps(w, xv, acc[t]);
                                }
                            }
                        }
                        for (acc, lanes) in acc.iter().zip(&mut lanes) {
                            for (&a, l) in acc.iter().zip(&mut lanes[tb..]) {
                                if first == 0 && j == 0 {
                                    l.write([a; 4]);
                                } else {
                                    l.assume_init_mut()[j] = a;
                                }
                            }
                        }
                    }
                }
            }
            for (r, lanes) in rows.clone().zip(&lanes) {
                for (t, l) in lanes[..chunk].iter().enumerate() {
                    emit(t0 + t, r, fold(l.assume_init()));
                }
            }
        }
    }
}

/// Up to ROW_GROUP weight rows times NT consecutive x rows starting at `x`, one column tile at a time;
/// hands each row's NT lane sets to `put`. Every (row, token) pair has its own lanes and sees the same
/// fmas in the same order as when computed alone, so tiling changes no bits.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_rows<R: RowDecoder, const NT: usize>(
    row_at: &impl Fn(usize) -> R,
    rows: Range<usize>,
    x: *const f32,
    cols: usize,
    put: &mut impl FnMut(usize, &[Lanes]),
) {
    let blocks = cols / 32;
    let zero = [[_mm256_setzero_ps(); 4]; NT];
    // Left uninitialised: zeroing these 3 KB (a memset call) took ~9% of a 512-wide prefill. The first
    // tile (there is always one, empty when cols is 0) writes every slot of `rows` before any is read.
    let mut lanes = [MaybeUninit::<[Lanes; NT]>::uninit(); ROW_GROUP];
    // Wide BF16 rows are tiled so that x's part stays in L1, and while a group is computed the next one is
    // fetched into L2 in address order (`ahead`, one line a block): x reread from L2 for every row made a
    // second stream beside the weights', and one core reading two streams from DRAM gets about two thirds
    // of one stream's rate (7168-column rows: 11-12 -> 22-23 GB/s on one thread, 20-22 -> 36-40 on two,
    // Zen 4). Other rows are not tiled for one x row, which is reread from L1 or L2 cheaply: each weight row
    // then streams from start to end, which the hardware prefetcher follows (a cold 3072 x 3584 MXFP4
    // matrix: 3.7 -> 5.2 GB/s on one thread), where tiles alone would hop between ROW_GROUP rows.
    let fetch_ahead = R::LINE_BLOCKS && blocks > LINE_TILE_BLOCKS;
    let width = match (NT, fetch_ahead) {
        (1, true) => LINE_TILE_BLOCKS,
        (1, false) => blocks.max(1),
        _ => TILE_BLOCKS,
    };
    // Past the group's last row (its whole blocks): about where the next group starts. Prefetches never
    // fault, so running past the matrix is harmless.
    let mut ahead = match rows.clone().last() {
        Some(last) if fetch_ahead => row_at(last).line(blocks),
        _ => std::ptr::null(),
    };
    for first in (0..blocks.max(1)).step_by(width) {
        let tile = first..(first + width).min(blocks);
        for (r, slot) in rows.clone().zip(&mut lanes) {
            let start = if first == 0 { zero } else { slot.assume_init() };
            slot.write(accumulate(
                &row_at(r),
                x,
                cols,
                tile.clone(),
                start,
                &mut ahead,
            ));
        }
    }
    for (r, slot) in rows.zip(&lanes) {
        put(r, slot.assume_init_ref());
    }
}

/// `acc` plus blocks `tile` of one weight row times NT x rows; where `ahead` is not null, one line from it
/// is fetched into L2 per block and it moves on.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn accumulate<R: RowDecoder, const NT: usize>(
    row: &R,
    x: *const f32,
    cols: usize,
    tile: Range<usize>,
    mut acc: [Lanes; NT],
    ahead: &mut *const u8,
) -> [Lanes; NT] {
    for b in tile {
        if R::LINE_BLOCKS && !ahead.is_null() {
            _mm_prefetch::<_MM_HINT_T1>(ahead.cast());
            *ahead = ahead.wrapping_add(64);
        }
        let block = row.block(b);
        for j in 0..4 {
            let w = row.eight(block, b, j);
            for (t, acc) in acc.iter_mut().enumerate() {
                acc[j] =
                    _mm256_fmadd_ps(w, _mm256_loadu_ps(x.add(t * cols + b * 32 + j * 8)), acc[j]);
            }
        }
    }
    acc
}

/// The crate's lane tree: h = 16 and 8 on whole vectors, then 4, 2, 1 within one.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn fold(acc: Lanes) -> f32 {
    let h8 = _mm256_add_ps(_mm256_add_ps(acc[0], acc[2]), _mm256_add_ps(acc[1], acc[3]));
    let h4 = _mm_add_ps(_mm256_castps256_ps128(h8), _mm256_extractf128_ps::<1>(h8));
    let h2 = _mm_add_ps(h4, _mm_movehl_ps(h4, h4));
    let h1 = _mm_add_ss(h2, _mm_shuffle_ps::<1>(h2, h2));
    _mm_cvtss_f32(h1)
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
    let body = a.len() / 32 * 32;
    let mut acc = [_mm256_setzero_ps(); 4];
    for i in (0..body).step_by(32) {
        for (j, acc) in acc.iter_mut().enumerate() {
            let k = i + j * 8;
            *acc = _mm256_fmadd_ps(
                _mm256_loadu_ps(a[k..].as_ptr()),
                _mm256_loadu_ps(b[k..].as_ptr()),
                *acc,
            );
        }
    }
    fma_tail(fold(acc), &a[body..], &b[body..])
}

/// Columns `first_col..first_col + y.len()` of the transposed product. Rows are taken four at a time so
/// y is loaded and stored once per four rows; within a column they are still added in increasing order.
#[target_feature(enable = "avx2,fma,f16c")]
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
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rows_t<const G: usize>(
    data: &[u16],
    cols: usize,
    x: &[f32],
    start: usize,
    y: &mut [f32],
) {
    let rows: [&[u16]; G] = std::array::from_fn(|i| &data[start + i * cols..][..y.len()]);
    let vec_end = y.len() / 8 * 8;
    for c in (0..vec_end).step_by(8) {
        let mut acc = _mm256_loadu_ps(y[c..].as_ptr());
        for (row, &xr) in rows.iter().zip(x) {
            acc = _mm256_fmadd_ps(widen_bf16(row[c..].as_ptr()), _mm256_set1_ps(xr), acc);
        }
        _mm256_storeu_ps(y[c..].as_mut_ptr(), acc);
    }
    add_rows_t(&rows, x, vec_end, y);
}

/// The AVX2 decoder's view of one MXFP4 block, for the codec tests.
#[cfg(test)]
pub(crate) fn decode_mxfp4_block(packed: &[u8; 16], scale: u8) -> [f32; 32] {
    let mut out = [0.0; 32];
    // SAFETY: tests call this only after checking that the CPU has AVX2, FMA and F16C.
    unsafe {
        let row = Mxfp4Row {
            packed: packed.as_ptr(),
            scales: &scale,
        };
        for j in 0..4 {
            _mm256_storeu_ps(out[j * 8..].as_mut_ptr(), row.eight(row.block(0), 0, j));
        }
    }
    out
}
