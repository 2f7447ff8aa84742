//! The portable path: the crate's reduction order written out plainly. `f32::mul_add` is a fused
//! multiply-add with one rounding on every target, so this is bit-identical to the SIMD paths.

use crate::codec::{bf16_to_f32, decode_nibbles, e4m3_to_f32, e8m0_to_f32, E2M1, INT4};
use crate::{fp8_scale_row, Matrix, FP8_BLOCK};
use std::ops::Range;

pub(crate) fn matmul_rows(
    w: &Matrix,
    x: &[f32],
    n: usize,
    range: Range<usize>,
    emit: &mut impl FnMut(usize, usize, f32),
) {
    let cols = w.cols();
    for r in range {
        for t in 0..n {
            emit(t, r, dot_blocks(w, r, &x[t * cols..(t + 1) * cols]));
        }
    }
}

/// Row r of W's whole 32-column blocks dotted with x (of length cols): the lanes and the tree.
fn dot_blocks(w: &Matrix, r: usize, x: &[f32]) -> f32 {
    let mut acc = [0.0; 32];
    let mut weights = [0.0; 32];
    for (b, x) in x.chunks_exact(32).enumerate() {
        decode_block(w, r, b, &mut weights);
        fma_lanes(&mut acc, &weights, x);
    }
    fold_lanes(acc)
}

/// `sum` (row r's whole blocks, from any path) plus the columns past them times x (of length cols),
/// in order: the last step of every path.
#[inline]
pub(crate) fn add_tail(w: &Matrix, r: usize, x: &[f32], sum: f32) -> f32 {
    let body = x.len() / 32 * 32;
    if body == x.len() {
        return sum;
    }
    let mut weights = [0.0; 32];
    let weights = &mut weights[..x.len() - body];
    decode_block(w, r, body / 32, weights);
    fma_tail(sum, weights, &x[body..])
}

/// Weights 32b..32b + out.len() of row r: a whole block, or the partial last one of a BF16 or FP8 row.
fn decode_block(w: &Matrix, r: usize, b: usize, out: &mut [f32]) {
    match *w {
        Matrix::Bf16 { data, cols, .. } => {
            let block = &data[r * cols + b * 32..][..out.len()];
            for (w, &bits) in out.iter_mut().zip(block) {
                *w = bf16_to_f32(bits);
            }
        }
        Matrix::Mxfp4 {
            packed,
            scales,
            cols,
            ..
        } => {
            let block = &packed[(r * cols + b * 32) / 2..][..16];
            decode_nibbles(block, &E2M1, e8m0_to_f32(scales[r * cols / 32 + b]), out);
        }
        Matrix::Fp8Block {
            data,
            scale_inv,
            cols,
            ..
        } => {
            let scale = fp8_scale_row(scale_inv, r, cols)[b * 32 / FP8_BLOCK];
            let block = &data[r * cols + b * 32..][..out.len()];
            for (w, &byte) in out.iter_mut().zip(block) {
                *w = e4m3_to_f32(byte) * scale;
            }
        }
        Matrix::Int4Group {
            packed,
            scales,
            cols,
            ..
        } => {
            let block = &packed[(r * cols + b * 32) / 2..][..16];
            decode_nibbles(block, &INT4, bf16_to_f32(scales[r * cols / 32 + b]), out);
        }
    }
}

pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let body = a.len() / 32 * 32;
    let mut acc = [0.0; 32];
    for (a, b) in a[..body].chunks_exact(32).zip(b[..body].chunks_exact(32)) {
        fma_lanes(&mut acc, a, b);
    }
    fma_tail(fold_lanes(acc), &a[body..], &b[body..])
}

#[inline]
fn fma_lanes(acc: &mut [f32; 32], w: &[f32], x: &[f32]) {
    for ((acc, &w), &x) in acc.iter_mut().zip(w).zip(x) {
        *acc = w.mul_add(x, *acc);
    }
}

/// The fixed tree: acc[k] += acc[k + h] for k < h, h = 16, 8, 4, 2, 1.
fn fold_lanes(mut acc: [f32; 32]) -> f32 {
    for half in [16, 8, 4, 2, 1] {
        for k in 0..half {
            acc[k] += acc[k + half];
        }
    }
    acc[0]
}

/// Elements past the 32-lane prefix, in order after the tree (shared with the SIMD paths).
#[inline]
pub(crate) fn fma_tail(sum: f32, a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).fold(sum, |s, (&a, &b)| a.mul_add(b, s))
}

/// Columns `first_col..first_col + y.len()` of the transposed product, each summed over rows in order.
pub(crate) fn matvec_t(data: &[u16], cols: usize, x: &[f32], first_col: usize, y: &mut [f32]) {
    y.fill(0.0);
    for (row, &xr) in data.chunks_exact(cols).zip(x) {
        for (y, &w) in y.iter_mut().zip(&row[first_col..]) {
            *y = bf16_to_f32(w).mul_add(xr, *y);
        }
    }
}

/// Columns `from..` of y plus the given rows (weights `x`), rows in order: the SIMD paths' last columns.
pub(crate) fn add_rows_t(rows: &[&[u16]], x: &[f32], from: usize, y: &mut [f32]) {
    for c in from..y.len() {
        for (row, &xr) in rows.iter().zip(x) {
            y[c] = bf16_to_f32(row[c]).mul_add(xr, y[c]);
        }
    }
}
