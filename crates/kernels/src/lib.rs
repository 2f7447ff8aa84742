//! CPU kernels for deltafin: products of f32 activations with BF16, MXFP4, FP8 (128×128 block scales) or
//! INT4 (group 32) weight matrices, the dequantisation fused into the product, on AVX2+FMA (x86-64, with
//! AVX-512 for the nibble encodings where the CPU has it) or NEON (AArch64), and a scalar path elsewhere.
//!
//! # Fixed reduction order
//!
//! Reproducibility and batch invariance (design.md, "Exactness" 2 and 3) come from computing every
//! dot product in one order, whatever the ISA path, thread count or number of rows in the batch:
//!
//! 1. 32 partial sums `acc[0..32]` start at +0.0. Element `i` of the multiple-of-32 prefix goes to
//!    lane `i % 32`, in increasing `i`: `acc[i % 32] = fma(w[i], x[i], acc[i % 32])` (one rounding).
//!    On AVX2 the lanes are four `__m256` accumulators holding lanes 0–7, 8–15, 16–23 and 24–31; on
//!    NEON eight `float32x4_t` holding lanes 0–3, 4–7, ..., 28–31; on AVX-512 (MXFP4 and INT4 with up to
//!    three x rows) two `__m512` holding the even and the odd lanes, interleaved back before the tree.
//! 2. The lanes fold by one tree: `acc[k] += acc[k + h]` for all `k < h`, with h = 16, 8, 4, 2, 1;
//!    the result is `acc[0]`.
//! 3. Elements past the multiple-of-32 prefix follow in increasing order: `s = fma(a[i], b[i], s)`.
//!    Only [`dot`] and BF16 and FP8 matrices have them (MXFP4 and INT4 widths are multiples of their
//!    32-element groups); every path computes them with the scalar code, after its own lanes and tree.
//!
//! Every weight is decoded to one f32 before its fma, so a product equals, bit for bit, [`dot`] with the
//! row dequantised to f32:
//! - MXFP4: `e2m1(nibble) * 2^(s-127)`, exact (or ±inf when s >= 253).
//! - INT4: `(nibble - 8) * bf16(scale)`, exact (4 × 8 significant bits; ±inf past f32's range).
//! - FP8: `e4m3(byte) * scale_inv`, one rounding (4 × 24 significant bits; exact when the scale has
//!   few, as in the tiny fixtures). Scaling each weight, rather than a 128-column block's partial
//!   sum, keeps the one reduction order above for every encoding and works for partial blocks and any
//!   split of the columns into lanes; the rounding costs at most 2^-24 relative per weight, below the
//!   sum's own rounding, for one multiply per weight.
//!
//! [`matvec_t_bf16`] has no lanes: each output column sums over rows in increasing order,
//! `y[c] = fma(W[r,c], x[r], y[c])` starting from +0.0, so it vectorises across columns without
//! reassociating anything.

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
pub mod codec;
#[cfg(target_arch = "aarch64")]
mod neon;
mod scalar;
#[cfg(test)]
mod tests;

use rayon::prelude::*;
use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

/// The FP8 block size: one `scale_inv` per 128 × 128 block of weights (edge blocks may be partial).
pub const FP8_BLOCK: usize = 128;

/// A row-major weight matrix [rows, cols] in its stored encoding. MXFP4 and INT4 widths are multiples of 32
/// (their group size); BF16 and FP8 widths are any.
#[derive(Clone, Copy)]
pub enum Matrix<'a> {
    /// BF16 bits; `data.len() == rows * cols`.
    Bf16 {
        data: &'a [u16],
        rows: usize,
        cols: usize,
    },
    /// MXFP4: `packed` holds rows*cols/2 bytes (byte j of a row = element 2j in the low nibble, 2j+1 in
    /// the high nibble), `scales` rows*cols/32 E8M0 bytes, one per 32 consecutive elements of a row.
    Mxfp4 {
        packed: &'a [u8],
        scales: &'a [u8],
        rows: usize,
        cols: usize,
    },
    /// FP8 float8_e4m3fn with 128 × 128 block scales (DeepSeek-V3, Kimi K2): `data` rows*cols bytes,
    /// `scale_inv` the row-major [ceil(rows/128), ceil(cols/128)] scales;
    /// `w[r][c] = e4m3(data[r*cols + c]) * scale_inv[r/128][c/128]`.
    Fp8Block {
        data: &'a [u8],
        scale_inv: &'a [f32],
        rows: usize,
        cols: usize,
    },
    /// INT4, symmetric, group 32 (compressed-tensors pack-quantized: Kimi K2 Thinking's experts): `packed`
    /// the little-endian bytes of the I32 words [rows, cols/8], element j of a row in nibble j%8 (low
    /// first) of word j/8 — so byte j/2, low nibble for even j, as in MXFP4 — holding q + 8; `scales` the
    /// BF16 [rows, cols/32]; `w = q * scale`.
    Int4Group {
        packed: &'a [u8],
        scales: &'a [u16],
        rows: usize,
        cols: usize,
    },
}

impl<'a> Matrix<'a> {
    pub fn bf16(data: &'a [u16], rows: usize, cols: usize) -> Result<Self, String> {
        let len = element_count("BF16", rows, cols, 1)?;
        if data.len() != len {
            return Err(format!(
                "BF16 matrix [{rows}, {cols}] needs {len} values, got {}",
                data.len()
            ));
        }
        Ok(Matrix::Bf16 { data, rows, cols })
    }

    pub fn mxfp4(
        packed: &'a [u8],
        scales: &'a [u8],
        rows: usize,
        cols: usize,
    ) -> Result<Self, String> {
        let len = element_count("MXFP4", rows, cols, 32)?;
        if packed.len() != len / 2 || scales.len() != len / 32 {
            return Err(format!(
                "MXFP4 matrix [{rows}, {cols}] needs {} packed bytes and {} scales, got {} and {}",
                len / 2,
                len / 32,
                packed.len(),
                scales.len()
            ));
        }
        Ok(Matrix::Mxfp4 {
            packed,
            scales,
            rows,
            cols,
        })
    }

    /// An FP8 matrix with one `scale_inv` per 128 × 128 block ([`Matrix::Fp8Block`]).
    pub fn fp8_block(
        data: &'a [u8],
        scale_inv: &'a [f32],
        rows: usize,
        cols: usize,
    ) -> Result<Self, String> {
        let len = element_count("FP8", rows, cols, 1)?;
        let (block_rows, block_cols) = (rows.div_ceil(FP8_BLOCK), cols.div_ceil(FP8_BLOCK));
        if data.len() != len || scale_inv.len() != block_rows * block_cols {
            return Err(format!(
                "FP8 block matrix [{rows}, {cols}] needs {len} weight bytes and {block_rows} x {block_cols} \
                 scale_inv values (one per 128 x 128 block, edge blocks partial), got {} and {}",
                data.len(),
                scale_inv.len()
            ));
        }
        Ok(Matrix::Fp8Block {
            data,
            scale_inv,
            rows,
            cols,
        })
    }

    /// An INT4 matrix with one BF16 scale per 32 elements of a row ([`Matrix::Int4Group`]).
    pub fn int4_group(
        packed: &'a [u8],
        scales: &'a [u16],
        rows: usize,
        cols: usize,
    ) -> Result<Self, String> {
        let len = element_count("INT4", rows, cols, 32)?;
        if packed.len() != len / 2 || scales.len() != len / 32 {
            return Err(format!(
                "INT4 matrix [{rows}, {cols}] needs {} packed bytes ({rows} x {} I32 words) and {} BF16 \
                 scales ({rows} x {}), got {} and {}",
                len / 2,
                cols / 8,
                len / 32,
                cols / 32,
                packed.len(),
                scales.len()
            ));
        }
        Ok(Matrix::Int4Group {
            packed,
            scales,
            rows,
            cols,
        })
    }

    pub fn rows(&self) -> usize {
        match *self {
            Matrix::Bf16 { rows, .. }
            | Matrix::Mxfp4 { rows, .. }
            | Matrix::Fp8Block { rows, .. }
            | Matrix::Int4Group { rows, .. } => rows,
        }
    }

    pub fn cols(&self) -> usize {
        match *self {
            Matrix::Bf16 { cols, .. }
            | Matrix::Mxfp4 { cols, .. }
            | Matrix::Fp8Block { cols, .. }
            | Matrix::Int4Group { cols, .. } => cols,
        }
    }

    /// The sub-matrix of rows [start, start+len) (for per-head slices of a projection).
    /// Panics if the range is not inside the matrix, or, for FP8, if it crosses a 128-row block boundary
    /// without starting on one (its rows could not find their scales).
    pub fn row_slice(&self, start: usize, len: usize) -> Matrix<'a> {
        let end = start.checked_add(len).filter(|&end| end <= self.rows());
        let Some(end) = end else {
            panic!(
                "row_slice: rows {start}..{start}+{len} outside a matrix of {} rows",
                self.rows()
            );
        };
        match *self {
            Matrix::Bf16 { data, cols, .. } => Matrix::Bf16 {
                data: &data[start * cols..end * cols],
                rows: len,
                cols,
            },
            Matrix::Mxfp4 {
                packed,
                scales,
                cols,
                ..
            } => Matrix::Mxfp4 {
                packed: &packed[start * cols / 2..end * cols / 2],
                scales: &scales[start * cols / 32..end * cols / 32],
                rows: len,
                cols,
            },
            Matrix::Fp8Block {
                data,
                scale_inv,
                cols,
                ..
            } => {
                // Row r of the slice reads scale row r / 128 of the sliced scales: right when the slice
                // starts on a block boundary or stays inside one block.
                let offset = start % FP8_BLOCK;
                if offset != 0 && offset + len > FP8_BLOCK {
                    panic!(
                        "row_slice: rows {start}..{end} of an FP8 block matrix cross a {FP8_BLOCK}-row \
                         block boundary without starting on one"
                    );
                }
                let block_cols = cols.div_ceil(FP8_BLOCK);
                let first = start / FP8_BLOCK;
                Matrix::Fp8Block {
                    data: &data[start * cols..end * cols],
                    scale_inv: &scale_inv
                        [first * block_cols..(first + len.div_ceil(FP8_BLOCK)) * block_cols],
                    rows: len,
                    cols,
                }
            }
            Matrix::Int4Group {
                packed,
                scales,
                cols,
                ..
            } => Matrix::Int4Group {
                packed: &packed[start * cols / 2..end * cols / 2],
                scales: &scales[start * cols / 32..end * cols / 32],
                rows: len,
                cols,
            },
        }
    }
}

/// The `scale_inv` values of row r's 128-row block of an FP8 matrix, one per 128 columns.
pub(crate) fn fp8_scale_row(scale_inv: &[f32], r: usize, cols: usize) -> &[f32] {
    let block_cols = cols.div_ceil(FP8_BLOCK);
    &scale_inv[r / FP8_BLOCK * block_cols..][..block_cols]
}

/// Shape and encoding only: the weights themselves are far too many to print.
impl std::fmt::Debug for Matrix<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self {
            Matrix::Bf16 { .. } => "Bf16",
            Matrix::Mxfp4 { .. } => "Mxfp4",
            Matrix::Fp8Block { .. } => "Fp8Block",
            Matrix::Int4Group { .. } => "Int4Group",
        };
        write!(f, "Matrix::{kind}[{}, {}]", self.rows(), self.cols())
    }
}

/// rows * cols, checking that cols is a multiple of the encoding's `group` of elements sharing a scale.
fn element_count(kind: &str, rows: usize, cols: usize, group: usize) -> Result<usize, String> {
    if !cols.is_multiple_of(group) {
        return Err(format!(
            "{kind} matrix [{rows}, {cols}]: cols must be a multiple of {group}, the {kind} group size \
             (elements sharing one scale along a row)"
        ));
    }
    rows.checked_mul(cols)
        .ok_or_else(|| format!("{kind} matrix [{rows}, {cols}]: rows * cols overflows usize"))
}

/// The instruction set a kernel runs on.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Path {
    Scalar,
    #[cfg(target_arch = "x86_64")]
    Avx2Fma,
    /// AVX2+FMA, with AVX-512 for the nibble encodings' decode (see avx512.rs).
    #[cfg(target_arch = "x86_64")]
    Avx512,
    #[cfg(target_arch = "aarch64")]
    Neon,
}

impl Path {
    fn name(self) -> &'static str {
        match self {
            Path::Scalar => "scalar",
            #[cfg(target_arch = "x86_64")]
            Path::Avx2Fma => "avx2+fma",
            #[cfg(target_arch = "x86_64")]
            Path::Avx512 => "avx512",
            #[cfg(target_arch = "aarch64")]
            Path::Neon => "neon",
        }
    }
}

/// Every path this CPU can run, scalar first and the best last; detected once.
fn supported_paths() -> &'static [Path] {
    static SUPPORTED: OnceLock<Vec<Path>> = OnceLock::new();
    SUPPORTED.get_or_init(|| {
        #[allow(unused_mut)]
        let mut paths = vec![Path::Scalar];
        #[cfg(target_arch = "x86_64")]
        // F16C (the FP8 decoder's exact e4m3 widening) came before AVX2: every AVX2 CPU has it.
        if is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
        {
            paths.push(Path::Avx2Fma);
            if is_x86_feature_detected!("avx512f") {
                paths.push(Path::Avx512);
            }
        }
        #[cfg(target_arch = "aarch64")]
        if std::arch::is_aarch64_feature_detected!("neon") {
            paths.push(Path::Neon);
        }
        paths
    })
}

/// The best path this CPU supports.
fn detected_path() -> Path {
    *supported_paths()
        .last()
        .expect("the scalar path is always there")
}

/// 1 + the index in `supported_paths` of the path chosen by [`set_isa`]; 0 for the best.
static CHOSEN: AtomicUsize = AtomicUsize::new(0);

fn active_path() -> Path {
    match CHOSEN.load(Ordering::Relaxed) {
        0 => detected_path(),
        i => supported_paths()[i - 1],
    }
}

/// "avx512", "avx2+fma", "neon" or "scalar": what the kernels use now.
pub fn isa() -> &'static str {
    active_path().name()
}

/// The instruction sets this CPU can run the kernels on, scalar first and the default last.
pub fn isas() -> Vec<&'static str> {
    supported_paths().iter().map(|p| p.name()).collect()
}

/// Runs the kernels on the named instruction set from now on, process-wide (None: the best this CPU has).
/// Results do not change, only speed: every path follows the same reduction order bit for bit, which is
/// what the tests and `doctor` compare.
pub fn set_isa(name: Option<&str>) -> Result<(), String> {
    let chosen = match name {
        None => 0,
        Some(name) => {
            1 + supported_paths()
                .iter()
                .position(|p| p.name() == name)
                .ok_or_else(|| {
                    format!(
                    "kernel instruction set {name:?} is not one this CPU runs; choose one of {}",
                    isas().join(", ")
                )
                })?
        }
    };
    CHOSEN.store(chosen, Ordering::Relaxed);
    Ok(())
}

/// Below this many multiply-adds (a few microseconds' work) a product runs on the calling thread:
/// splitting costs more than it saves. Products called from a pool thread split cheaply (the model's
/// passes run on one), so the limit is low enough for a 512-wide model's projections to split.
const PARALLEL_MIN_WORK: usize = 1 << 15;
/// Multiply-adds per parallel task of `matmul` (rounded to whole rows, at most 64 rows).
const TASK_WORK: usize = 1 << 16;
const MAX_ROWS_PER_TASK: usize = 64;
/// Fewest columns per parallel task of `matvec_t_bf16`, so each task reads long runs of every row.
const MIN_COLS_PER_TASK: usize = 256;

/// y[t*rows + r] = sum_c W[r,c] * x[t*cols + c] for t in 0..n (x: n rows of `cols`, y: n rows of `rows`).
///
/// Dequantisation is fused (no dequantised copy of W exists). Large products run on the current rayon
/// pool, split over blocks of output rows. The bits of each `y[t*rows + r]` depend only on W's row r and
/// x's row t (see the crate docs for the order), not on n, the thread count or the ISA path.
///
/// Panics if `x.len() != n * cols` or `y.len() != n * rows`.
pub fn matmul(w: &Matrix, x: &[f32], n: usize, y: &mut [f32]) {
    matmul_many(&mut [(*w, y)], x, n);
}

/// [`matmul`] of several matrices with the same input, in one parallel region: a pass's projections of
/// one activation (q, k, v, gates) are small, and handing each to the pool on its own costs about as much
/// as computing it. Every output element gets exactly the bits [`matmul`] gives it.
///
/// Panics if `x.len() != n * cols` or `y.len() != n * rows` for any of the products.
pub fn matmul_many(products: &mut [(Matrix, &mut [f32])], x: &[f32], n: usize) {
    matmul_many_on(active_path(), products, x, n);
}

fn matmul_many_on(path: Path, products: &mut [(Matrix, &mut [f32])], x: &[f32], n: usize) {
    for (w, y) in products.iter() {
        let (rows, cols) = (w.rows(), w.cols());
        assert_eq!(
            x.len(),
            n * cols,
            "matmul: x must hold n * cols = {n} * {cols} values"
        );
        assert_eq!(
            y.len(),
            n * rows,
            "matmul: y must hold n * rows = {n} * {rows} values"
        );
    }
    let outs: Vec<(Matrix, OutPtr)> = products
        .iter_mut()
        .map(|(w, y)| (*w, OutPtr(y.as_mut_ptr())))
        .collect();
    let lanes = lane_order(path, &outs, x, n);
    let run = |p: usize, range: Range<usize>| {
        let (w, out) = &outs[p];
        let rows = w.rows();
        // SAFETY: every (t, r) with r in `range` and t < n indexes inside product p's `y` (checked above),
        // and the (product, row range) pairs given to concurrent calls are disjoint, so no element is
        // written twice at once.
        let mut emit = |t: usize, r: usize, v: f32| unsafe { *out.get().add(t * rows + r) = v };
        matmul_rows(path, w, x, &lanes, n, range, &mut emit);
    };
    let work: usize = outs.iter().map(|(w, _)| w.rows() * w.cols() * n).sum();
    if work < PARALLEL_MIN_WORK || rayon::current_num_threads() == 1 {
        for (p, (w, _)) in outs.iter().enumerate() {
            run(p, 0..w.rows());
        }
        return;
    }
    let tasks: Vec<(usize, Range<usize>)> = outs
        .iter()
        .enumerate()
        .flat_map(|(p, (w, _))| {
            let rows = w.rows();
            let per_task = (TASK_WORK / (w.cols() * n).max(1))
                .clamp(1, MAX_ROWS_PER_TASK)
                .next_multiple_of(rows_together(path, n));
            (0..rows.div_ceil(per_task))
                .map(move |i| (p, i * per_task..((i + 1) * per_task).min(rows)))
        })
        .collect();
    tasks.into_par_iter().for_each(|(p, range)| run(p, range));
}

/// x as a path reads it besides its plain rows, arranged once per call rather than per task: the AVX-512
/// path's nibble products read it in their lane order (avx512.rs). Empty where nothing needs it.
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
fn lane_order(path: Path, products: &[(Matrix, OutPtr)], x: &[f32], n: usize) -> Vec<f32> {
    match path {
        // SAFETY: this path is only chosen when the CPU has AVX-512F, AVX2, FMA and F16C.
        #[cfg(target_arch = "x86_64")]
        Path::Avx512 if products.iter().any(|(w, _)| avx512::takes(w, n)) => unsafe {
            avx512::lane_order(x, n)
        },
        _ => Vec::new(),
    }
}

/// Computes rows `range` of W times every x row, handing each result to `emit(t, r, value)`; `lanes` is
/// [`lane_order`]'s x.
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
fn matmul_rows(
    path: Path,
    w: &Matrix,
    x: &[f32],
    lanes: &[f32],
    n: usize,
    range: Range<usize>,
    emit: &mut impl FnMut(usize, usize, f32),
) {
    // The paths sum the whole 32-column blocks (lanes and tree); the columns past them follow here.
    let cols = w.cols();
    let emit = &mut |t: usize, r: usize, sum: f32| {
        emit(
            t,
            r,
            scalar::add_tail(w, r, &x[t * cols..(t + 1) * cols], sum),
        );
    };
    match path {
        Path::Scalar => scalar::matmul_rows(w, x, n, range, emit),
        // SAFETY: this path is only chosen when the CPU has AVX2, FMA and F16C.
        #[cfg(target_arch = "x86_64")]
        Path::Avx2Fma => unsafe { avx2::matmul_rows(w, x, n, range, emit) },
        // SAFETY: this path is only chosen when the CPU has AVX-512F, AVX2, FMA and F16C.
        #[cfg(target_arch = "x86_64")]
        Path::Avx512 => unsafe { avx512::matmul_rows(w, x, lanes, n, range, emit) },
        // SAFETY: this path is only chosen when the CPU has NEON.
        #[cfg(target_arch = "aarch64")]
        Path::Neon => unsafe { neon::matmul_rows(w, x, n, range, emit) },
    }
}

/// How many rows a path computes together for `n` x rows: a task of fewer would waste the rest.
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
fn rows_together(path: Path, n: usize) -> usize {
    match path {
        Path::Scalar => 1,
        #[cfg(target_arch = "x86_64")]
        Path::Avx2Fma | Path::Avx512 => avx2::rows_together(n),
        #[cfg(target_arch = "aarch64")]
        Path::Neon => 1,
    }
}

/// The output pointer shared by the tasks of one `matmul`, each writing its own rows.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: tasks write disjoint elements, and `matmul` holds `&mut y` until they all finish.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}
impl OutPtr {
    /// A method, not field access, so closures capture the whole (Sync) wrapper.
    fn get(self) -> *mut f32 {
        self.0
    }
}

/// y[c] = sum_r W[r,c] * x[r] for c in 0..cols (transposed product of a row-major BF16 [rows, cols]),
/// each column summed over r in increasing order. Large products split columns over the rayon pool.
///
/// Panics if `data.len() != rows * cols`, `x.len() != rows` or `y.len() != cols`.
pub fn matvec_t_bf16(data: &[u16], rows: usize, cols: usize, x: &[f32], y: &mut [f32]) {
    matvec_t_on(active_path(), data, rows, cols, x, y);
}

fn matvec_t_on(path: Path, data: &[u16], rows: usize, cols: usize, x: &[f32], y: &mut [f32]) {
    assert_eq!(
        data.len(),
        rows * cols,
        "matvec_t_bf16: data must hold rows * cols = {rows} * {cols} values"
    );
    assert_eq!(
        x.len(),
        rows,
        "matvec_t_bf16: x must hold rows = {rows} values"
    );
    assert_eq!(
        y.len(),
        cols,
        "matvec_t_bf16: y must hold cols = {cols} values"
    );
    if cols == 0 {
        return;
    }
    let run = |first_col: usize, y: &mut [f32]| match path {
        Path::Scalar => scalar::matvec_t(data, cols, x, first_col, y),
        // SAFETY: this path is only chosen when the CPU has AVX2, FMA and F16C.
        #[cfg(target_arch = "x86_64")]
        Path::Avx2Fma | Path::Avx512 => unsafe { avx2::matvec_t(data, cols, x, first_col, y) },
        // SAFETY: this path is only chosen when the CPU has NEON.
        #[cfg(target_arch = "aarch64")]
        Path::Neon => unsafe { neon::matvec_t(data, cols, x, first_col, y) },
    };
    let threads = rayon::current_num_threads();
    if rows * cols < PARALLEL_MIN_WORK || threads == 1 {
        run(0, y);
    } else {
        let per_task = cols
            .div_ceil(2 * threads)
            .next_multiple_of(8)
            .max(MIN_COLS_PER_TASK);
        y.par_chunks_mut(per_task)
            .enumerate()
            .for_each(|(i, y)| run(i * per_task, y));
    }
}

/// Dot product of two f32 slices of any length, in the crate's fixed order (32 lanes, tree, then the
/// tail in order) on every path. Panics if the lengths differ.
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    dot_on(active_path(), a, b)
}

fn dot_on(path: Path, a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "dot: slices of different lengths");
    match path {
        Path::Scalar => scalar::dot(a, b),
        // SAFETY: this path is only chosen when the CPU has AVX2, FMA and F16C.
        #[cfg(target_arch = "x86_64")]
        Path::Avx2Fma | Path::Avx512 => unsafe { avx2::dot(a, b) },
        // SAFETY: this path is only chosen when the CPU has NEON.
        #[cfg(target_arch = "aarch64")]
        Path::Neon => unsafe { neon::dot(a, b) },
    }
}
