//! Routed experts stay on disk: at load only their locations are recorded, and an expert's bytes are read
//! (one positioned read when its tensors are contiguous, as in K3's shards) when a row routes to it.

use crate::ops::Act;
use anyhow::{bail, Context, Result};
use deltafin_formats::checkpoint::Checkpoint;
use deltafin_formats::config::{Family, ModelConfig};
use deltafin_formats::Dtype;
use deltafin_kernels::{matmul, Matrix};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// What happened on the expert path (shared by parallel tasks).
#[derive(Default)]
pub struct Stats {
    pub expert_bytes: AtomicU64,
    pub expert_reads: AtomicU64,
    pub expert_read_ns: AtomicU64,
}

impl Stats {
    pub fn bytes(&self) -> u64 {
        self.expert_bytes.load(Ordering::Relaxed)
    }
    pub fn reads(&self) -> u64 {
        self.expert_reads.load(Ordering::Relaxed)
    }
    pub fn read_secs(&self) -> f64 {
        self.expert_read_ns.load(Ordering::Relaxed) as f64 * 1e-9
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Encoding {
    /// K3: w1/w2/w3 each as `weight_packed` + `weight_scale` (MXFP4, e8m0 per 32 inputs).
    Mxfp4,
    /// Kimi Linear: w1/w2/w3 `.weight` in BF16.
    Bf16,
}

/// One contiguous file range of an expert.
struct Extent {
    shard: usize,
    offset: u64,
    len: usize,
}

struct Location {
    extents: Vec<Extent>,
}

pub struct ExpertSet {
    ck: Arc<Checkpoint>,
    layer: usize,
    encoding: Encoding,
    act: Act,
    /// Expert input/output width (K3: the latent; Kimi Linear: hidden) and intermediate width.
    width: usize,
    inter: usize,
    /// Offsets of each tensor inside the record, in file order (w1, w2, w3; packed then scale for MXFP4).
    parts: Vec<(usize, usize)>,
    locations: Vec<Location>,
}

impl ExpertSet {
    pub fn load(
        ck: &Arc<Checkpoint>,
        prefix: &str,
        layer: usize,
        cfg: &ModelConfig,
    ) -> Result<ExpertSet> {
        let m = &cfg.moe;
        let inter = m.intermediate;
        let (encoding, act, width) = match cfg.family {
            Family::KimiK3 => (Encoding::Mxfp4, Act::Situ, m.latent.unwrap_or(cfg.hidden)),
            Family::KimiLinear => (Encoding::Bf16, Act::SiluGlu, cfg.hidden),
        };
        if !width.is_multiple_of(32) || !inter.is_multiple_of(32) {
            bail!(
                "expert widths {width} and {inter} must be multiples of 32 (the MXFP4 group size)"
            );
        }
        // (name, dtype, shape) of each tensor of one expert, in the order K3 stores them.
        let tensors: Vec<(String, Dtype, Vec<usize>)> = match encoding {
            Encoding::Mxfp4 => [
                ("w1", inter, width),
                ("w2", width, inter),
                ("w3", inter, width),
            ]
            .iter()
            .flat_map(|&(w, rows, cols)| {
                [
                    (
                        format!("{w}.weight_packed"),
                        Dtype::U8,
                        vec![rows, cols / 2],
                    ),
                    (
                        format!("{w}.weight_scale"),
                        Dtype::U8,
                        vec![rows, cols / 32],
                    ),
                ]
            })
            .collect(),
            Encoding::Bf16 => [
                ("w1", inter, width),
                ("w2", width, inter),
                ("w3", inter, width),
            ]
            .iter()
            .map(|&(w, rows, cols)| (format!("{w}.weight"), Dtype::Bf16, vec![rows, cols]))
            .collect(),
        };
        let mut parts = Vec::new();
        let mut at = 0;
        for (_, dtype, shape) in &tensors {
            let len = shape.iter().product::<usize>() * dtype.size();
            parts.push((at, len));
            at += len;
        }
        let mut locations = Vec::with_capacity(m.num_experts);
        for e in 0..m.num_experts {
            let mut extents: Vec<Extent> = Vec::new();
            for (name, dtype, shape) in &tensors {
                let info = ck.expect(&format!("{prefix}experts.{e}.{name}"), &[*dtype], shape)?;
                match extents.last_mut() {
                    Some(last)
                        if last.shard == info.shard
                            && last.offset + last.len as u64 == info.offset =>
                    {
                        last.len += info.nbytes as usize
                    }
                    _ => extents.push(Extent {
                        shard: info.shard,
                        offset: info.offset,
                        len: info.nbytes as usize,
                    }),
                }
            }
            locations.push(Location { extents });
        }
        Ok(ExpertSet {
            ck: ck.clone(),
            layer,
            encoding,
            act,
            width,
            inter,
            parts,
            locations,
        })
    }

    pub fn record_bytes(&self) -> usize {
        self.parts.iter().map(|p| p.1).sum()
    }

    /// Reads expert `e`'s record.
    fn read(&self, e: usize, stats: &Stats) -> Result<Vec<u8>> {
        let t0 = Instant::now();
        let mut buf = vec![0u8; self.record_bytes()];
        let mut at = 0;
        for x in &self.locations[e].extents {
            self.ck
                .read_at(x.shard, x.offset, &mut buf[at..at + x.len])
                .with_context(|| format!("reading layer {} expert {e}", self.layer))?;
            at += x.len;
        }
        stats
            .expert_bytes
            .fetch_add(buf.len() as u64, Ordering::Relaxed);
        stats.expert_reads.fetch_add(1, Ordering::Relaxed);
        stats
            .expert_read_ns
            .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        Ok(buf)
    }

    /// `y = W2 · act(W1 x, W3 x)` for `n` rows of `x` (width `self.width`).
    pub fn apply(&self, e: usize, x: &[f32], n: usize, stats: &Stats) -> Result<Vec<f32>> {
        let buf = self.read(e, stats)?;
        let part = |i: usize| &buf[self.parts[i].0..self.parts[i].0 + self.parts[i].1];
        let (inter, width) = (self.inter, self.width);
        let mut h1 = vec![0.0; n * inter];
        let mut h3 = vec![0.0; n * inter];
        let mut y = vec![0.0; n * width];
        match self.encoding {
            Encoding::Mxfp4 => {
                for i in [1, 3, 5] {
                    if let Some(pos) = part(i).iter().position(|&s| s == 255) {
                        bail!(
                            "layer {} expert {e}: scale byte {pos} of w{} is 255 (NaN in e8m0); the checkpoint is damaged",
                            self.layer,
                            i / 2 + 1
                        );
                    }
                }
                let mx = |p: usize, rows: usize, cols: usize| Matrix::Mxfp4 {
                    packed: part(p),
                    scales: part(p + 1),
                    rows,
                    cols,
                };
                matmul(&mx(0, inter, width), x, n, &mut h1);
                matmul(&mx(4, inter, width), x, n, &mut h3);
                let mut a = vec![0.0; n * inter];
                self.act.apply(&h1, &h3, &mut a);
                matmul(&mx(2, width, inter), &a, n, &mut y);
            }
            Encoding::Bf16 => {
                let w = |p: usize| crate::weights::u16s(part(p));
                let (w1, w2, w3) = (w(0), w(1), w(2));
                matmul(
                    &Matrix::Bf16 {
                        data: &w1,
                        rows: inter,
                        cols: width,
                    },
                    x,
                    n,
                    &mut h1,
                );
                matmul(
                    &Matrix::Bf16 {
                        data: &w3,
                        rows: inter,
                        cols: width,
                    },
                    x,
                    n,
                    &mut h3,
                );
                let mut a = vec![0.0; n * inter];
                self.act.apply(&h1, &h3, &mut a);
                matmul(
                    &Matrix::Bf16 {
                        data: &w2,
                        rows: width,
                        cols: inter,
                    },
                    &a,
                    n,
                    &mut y,
                );
            }
        }
        Ok(y)
    }
}
