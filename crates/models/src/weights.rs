//! Loading spine weights: BF16 matrices kept in their stored encoding (the kernels dequantise on the fly),
//! small vectors widened to f32. Every tensor is checked for dtype and shape against the config.

use crate::describe::{Mat, ResScore, Vector};
use anyhow::{bail, Context, Result};
use deltafin_formats::checkpoint::Checkpoint;
use deltafin_formats::Dtype;
use deltafin_kernels::codec::bf16_to_f32;
use deltafin_kernels::{matmul, matmul_many, Matrix};

/// A BF16 weight matrix `[rows, cols]`.
pub struct Linear {
    pub name: String,
    pub data: Vec<u16>,
    pub rows: usize,
    pub cols: usize,
}

impl Linear {
    pub fn matrix(&self) -> Matrix<'_> {
        Matrix::Bf16 {
            data: &self.data,
            rows: self.rows,
            cols: self.cols,
        }
    }

    /// `y = W x` for `n` rows of x.
    pub fn forward(&self, x: &[f32], n: usize) -> Vec<f32> {
        let mut y = vec![0.0; n * self.rows];
        matmul(&self.matrix(), x, n, &mut y);
        y
    }

    pub fn bytes(&self) -> usize {
        self.data.len() * 2
    }
}

/// Reads the tensors a [`describe`](crate::describe) names, checking each one's dtype and shape.
pub struct Loader<'a> {
    pub ck: &'a Checkpoint,
}

impl<'a> Loader<'a> {
    pub fn new(ck: &'a Checkpoint) -> Self {
        Loader { ck }
    }

    pub fn linear(&self, m: &Mat) -> Result<Linear> {
        let (full, rows, cols) = (&m.name, m.rows, m.cols);
        if !cols.is_multiple_of(32) {
            bail!("tensor `{full}` has input width {cols}; deltafin's kernels need widths that are multiples of 32");
        }
        let info = self.ck.expect(full, &[Dtype::Bf16], &[rows, cols])?;
        let bytes = self.ck.read(info)?;
        Ok(Linear {
            name: full.clone(),
            data: u16s(&bytes),
            rows,
            cols,
        })
    }

    /// A BF16 or F32 tensor of the given shape, widened to f32.
    pub fn vector(&self, t: &Vector) -> Result<Vec<f32>> {
        let full = &t.name;
        let info = self.ck.expect(full, &[Dtype::Bf16, Dtype::F32], &t.shape)?;
        let bytes = self.ck.read(info)?;
        let v: Vec<f32> = match info.dtype {
            Dtype::Bf16 => u16s(&bytes).into_iter().map(bf16_to_f32).collect(),
            _ => bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        };
        if let Some(i) = v.iter().position(|x| !x.is_finite()) {
            bail!("tensor `{full}` holds a non-finite value at element {i}; the checkpoint is damaged");
        }
        Ok(v)
    }

    /// An AttnRes score vector `res_norm.weight ⊙ res_proj.weight`, folded once at load.
    pub fn res_score(&self, r: &ResScore) -> Result<Vec<f32>> {
        let n = self.vector(&r.norm)?;
        let p = self.vector(&r.proj)?;
        Ok(n.iter().zip(&p).map(|(a, b)| a * b).collect())
    }
}

pub fn u16s(bytes: &[u8]) -> Vec<u16> {
    bytes
        .chunks_exact(2)
        .map(|c| u16::from_le_bytes([c[0], c[1]]))
        .collect()
}

/// The embedding table, kept in BF16 and widened one row at a time.
pub struct Embedding {
    pub table: Linear,
}

impl Embedding {
    pub fn lookup(&self, tokens: &[u32]) -> Result<Vec<f32>> {
        let h = self.table.cols;
        let mut out = Vec::with_capacity(tokens.len() * h);
        for &t in tokens {
            let t = t as usize;
            if t >= self.table.rows {
                bail!(
                    "token id {t} is outside the vocabulary (size {})",
                    self.table.rows
                );
            }
            out.extend(
                self.table.data[t * h..(t + 1) * h]
                    .iter()
                    .map(|&b| bf16_to_f32(b)),
            );
        }
        Ok(out)
    }
}

pub fn context_layer<T>(r: Result<T>, layer: usize) -> Result<T> {
    r.with_context(|| format!("layer {layer}"))
}

/// `W x` for each of several matrices taking the same input, in one parallel region: a layer's
/// projections of one activation are each too small to be worth a hand-off to the pool of their own.
/// The bits are those of each [`Linear::forward`].
pub fn forward_many<const N: usize>(ls: [&Linear; N], x: &[f32], n: usize) -> [Vec<f32>; N] {
    let mut ys = ls.map(|l| vec![0.0; n * l.rows]);
    let mut products: Vec<(Matrix, &mut [f32])> = ls
        .iter()
        .zip(ys.iter_mut())
        .map(|(l, y)| (l.matrix(), y.as_mut_slice()))
        .collect();
    matmul_many(&mut products, x, n);
    ys
}
