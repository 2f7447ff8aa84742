//! The portable path: the crate's reduction order written out plainly. `f32::mul_add` is a fused
//! multiply-add with one rounding on every target, so this is bit-identical to the SIMD paths.

use crate::codec::{bf16_to_f32, decode_mxfp4_block};
use crate::Matrix;
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
            emit(t, r, dot_row(w, r, &x[t * cols..(t + 1) * cols]));
        }
    }
}

/// Row r of W dotted with x (of length cols), decoding 32 weights at a time.
fn dot_row(w: &Matrix, r: usize, x: &[f32]) -> f32 {
    let mut acc = [0.0; 32];
    let mut weights = [0.0; 32];
    for (b, x) in x.chunks_exact(32).enumerate() {
        match *w {
            Matrix::Bf16 { data, cols, .. } => {
                let block = &data[r * cols + b * 32..][..32];
                for (w, &bits) in weights.iter_mut().zip(block) {
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
                decode_mxfp4_block(block, scales[r * cols / 32 + b], &mut weights);
            }
        }
        fma_lanes(&mut acc, &weights, x);
    }
    fold_lanes(acc)
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
