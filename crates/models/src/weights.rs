//! Loading spine weights: BF16 or FP8 block-scaled matrices kept in their stored encoding (the kernels
//! dequantise on the fly), small vectors widened to f32. Every tensor is checked for dtype and shape against
//! the config.

use crate::describe::{Mat, ResScore, Vector};
use anyhow::{bail, Context, Result};
use deltafin_formats::checkpoint::Checkpoint;
use deltafin_formats::Dtype;
use deltafin_kernels::codec::{bf16_to_f32, e4m3_to_f32};
use deltafin_kernels::{matmul, matmul_many, matvec_t_bf16, Matrix, FP8_BLOCK};

/// A weight matrix `[rows, cols]` in its checkpoint encoding.
pub struct Linear {
    pub name: String,
    pub weights: Stored,
    pub rows: usize,
    pub cols: usize,
}

/// How a [`Linear`] is stored.
pub enum Stored {
    Bf16(Vec<u16>),
    /// e4m3 bytes and one F32 `scale_inv` per 128×128 block (`[ceil(rows/128), ceil(cols/128)]`).
    Fp8Block {
        data: Vec<u8>,
        scale_inv: Vec<f32>,
    },
}

impl Linear {
    pub fn matrix(&self) -> Matrix<'_> {
        match &self.weights {
            Stored::Bf16(data) => Matrix::Bf16 {
                data,
                rows: self.rows,
                cols: self.cols,
            },
            Stored::Fp8Block { data, scale_inv } => Matrix::Fp8Block {
                data,
                scale_inv,
                rows: self.rows,
                cols: self.cols,
            },
        }
    }

    /// The BF16 values, where the matrix is BF16.
    pub fn bf16(&self) -> Option<&[u16]> {
        match &self.weights {
            Stored::Bf16(data) => Some(data),
            Stored::Fp8Block { .. } => None,
        }
    }

    /// `y = W[start..start+len]ᵀ x` (`x`: len values, `y`: cols), each output summed over rows in increasing
    /// order as [`matvec_t_bf16`] defines.
    pub fn matvec_t_rows(&self, start: usize, len: usize, x: &[f32], y: &mut [f32]) {
        let c = self.cols;
        match &self.weights {
            Stored::Bf16(data) => matvec_t_bf16(&data[start * c..(start + len) * c], len, c, x, y),
            // The same order, each weight decoded as the kernels decode it (`e4m3 · scale_inv`).
            Stored::Fp8Block { data, scale_inv } => {
                let blocks = c.div_ceil(FP8_BLOCK);
                y.fill(0.0);
                for (r, &xr) in (start..start + len).zip(x) {
                    let scales = &scale_inv[r / FP8_BLOCK * blocks..][..blocks];
                    for (col, (yc, &w)) in y.iter_mut().zip(&data[r * c..(r + 1) * c]).enumerate() {
                        *yc = (e4m3_to_f32(w) * scales[col / FP8_BLOCK]).mul_add(xr, *yc);
                    }
                }
            }
        }
    }

    /// `y = W x` for `n` rows of x.
    pub fn forward(&self, x: &[f32], n: usize) -> Vec<f32> {
        let mut y = vec![0.0; n * self.rows];
        matmul(&self.matrix(), x, n, &mut y);
        y
    }

    pub fn bytes(&self) -> usize {
        match &self.weights {
            Stored::Bf16(data) => data.len() * 2,
            Stored::Fp8Block { data, scale_inv } => data.len() + scale_inv.len() * 4,
        }
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
        let info = self
            .ck
            .expect(full, &[Dtype::Bf16, Dtype::F8E4M3], &[rows, cols])?;
        let bytes = self.ck.read(info)?;
        let weights = match info.dtype {
            Dtype::Bf16 => Stored::Bf16(u16s(&bytes)),
            _ => {
                // DeepSeek-V3's FP8: `<name>_scale_inv` beside `<name>` (`...weight` → `...weight_scale_inv`).
                let s = self.ck.expect(
                    &format!("{full}_scale_inv"),
                    &[Dtype::F32],
                    &[rows.div_ceil(FP8_BLOCK), cols.div_ceil(FP8_BLOCK)],
                )?;
                let scale_inv = f32s(&self.ck.read(s)?);
                if let Some(i) = scale_inv.iter().position(|x| !x.is_finite()) {
                    bail!("tensor `{full}_scale_inv` holds a non-finite value at element {i}; the checkpoint is damaged");
                }
                Stored::Fp8Block {
                    data: bytes,
                    scale_inv,
                }
            }
        };
        Ok(Linear {
            name: full.clone(),
            weights,
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
            _ => f32s(&bytes),
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

pub fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// The embedding table, kept in BF16 and widened one row at a time.
pub struct Embedding {
    table: Vec<u16>,
    rows: usize,
    cols: usize,
}

impl Embedding {
    pub fn load(ld: &Loader, m: &Mat) -> Result<Embedding> {
        let info = ld.ck.expect(&m.name, &[Dtype::Bf16], &[m.rows, m.cols])?;
        Ok(Embedding {
            table: u16s(&ld.ck.read(info)?),
            rows: m.rows,
            cols: m.cols,
        })
    }

    pub fn lookup(&self, tokens: &[u32]) -> Result<Vec<f32>> {
        let h = self.cols;
        let mut out = Vec::with_capacity(tokens.len() * h);
        for &t in tokens {
            let t = t as usize;
            if t >= self.rows {
                bail!(
                    "token id {t} is outside the vocabulary (size {})",
                    self.rows
                );
            }
            out.extend(
                self.table[t * h..(t + 1) * h]
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
