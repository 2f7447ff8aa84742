//! Routed experts stay on disk. At load only their locations are recorded (in the checkpoint's shards, where
//! an expert's tensors are one contiguous span, or in a pack); the store brings a record in when a row routes
//! to it, and the FFN runs on those bytes in place.

use crate::ops::Act;
use anyhow::{bail, Result};
use deltafin_formats::checkpoint::Checkpoint;
use deltafin_formats::config::{Family, ModelConfig};
use deltafin_formats::Dtype;
use deltafin_kernels::{matmul, Matrix};
use deltafin_store::{ExpertStore, Extent, RecordLoc};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// One row's routing in one layer: (layer, expert ids).
pub type Route = (usize, Vec<usize>);

/// What the passes did (the store counts what the disk did): expert bytes computed with, time per layer,
/// and — when asked for — every row's routing, the trace that cache and prefetch studies replay.
#[derive(Default)]
pub struct Stats {
    pub expert_bytes: AtomicU64,
    pub expert_uses: AtomicU64,
    layer_secs: Mutex<Vec<f64>>,
    routes: Option<Mutex<Vec<Route>>>,
    /// Called with each layer's index as a pass finishes it (a progress display for long prefills).
    on_layer: Option<Box<dyn Fn(usize) + Send + Sync>>,
}

impl Stats {
    /// Stats that also record routing: (layer, expert ids) per row, drained by [`Stats::take_routes`].
    pub fn with_routes() -> Stats {
        Stats {
            routes: Some(Mutex::new(Vec::new())),
            ..Stats::default()
        }
    }

    /// Calls `f(layer)` as each pass finishes each layer.
    pub fn on_layer(mut self, f: impl Fn(usize) + Send + Sync + 'static) -> Stats {
        self.on_layer = Some(Box::new(f));
        self
    }

    pub fn record_routes(&self, layer: usize, ids: impl Iterator<Item = Vec<usize>>) {
        if let Some(r) = &self.routes {
            r.lock().unwrap().extend(ids.map(|ids| (layer, ids)));
        }
    }

    pub fn take_routes(&self) -> Vec<Route> {
        self.routes
            .as_ref()
            .map(|r| std::mem::take(&mut *r.lock().unwrap()))
            .unwrap_or_default()
    }

    pub fn add_layer_time(&self, layer: usize, since: Instant) {
        let mut v = self.layer_secs.lock().unwrap();
        if v.len() <= layer {
            v.resize(layer + 1, 0.0);
        }
        v[layer] += since.elapsed().as_secs_f64();
        drop(v);
        if let Some(f) = &self.on_layer {
            f(layer);
        }
    }

    /// Seconds spent in each layer so far.
    pub fn layer_secs(&self) -> Vec<f64> {
        self.layer_secs.lock().unwrap().clone()
    }

    /// Expert bytes the passes computed with (cached or read).
    pub fn bytes(&self) -> u64 {
        self.expert_bytes.load(Ordering::Relaxed)
    }
    pub fn uses(&self) -> u64 {
        self.expert_uses.load(Ordering::Relaxed)
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Encoding {
    /// K3: w1/w2/w3 each as `weight_packed` + `weight_scale` (MXFP4, e8m0 per 32 inputs).
    Mxfp4,
    /// Kimi Linear: w1/w2/w3 `.weight` in BF16.
    Bf16,
}

/// The shape of one expert record: its tensors in checkpoint order (w1, w2, w3; packed then scale for MXFP4).
#[derive(Debug)]
pub struct ExpertLayout {
    encoding: Encoding,
    act: Act,
    /// Input/output width (K3: the latent; Kimi Linear: hidden) and intermediate width.
    width: usize,
    inter: usize,
    tensors: Vec<(String, Dtype, Vec<usize>)>,
    /// (offset, length) of each tensor inside the record.
    parts: Vec<(usize, usize)>,
}

impl ExpertLayout {
    pub fn new(cfg: &ModelConfig) -> Result<ExpertLayout> {
        let inter = cfg.moe.intermediate;
        let (encoding, act, width) = match cfg.family {
            Family::KimiK3 => (
                Encoding::Mxfp4,
                Act::Situ,
                cfg.moe.latent.unwrap_or(cfg.hidden),
            ),
            Family::KimiLinear => (Encoding::Bf16, Act::SiluGlu, cfg.hidden),
        };
        if !width.is_multiple_of(32) || !inter.is_multiple_of(32) {
            bail!(
                "expert widths {width} and {inter} must be multiples of 32 (the MXFP4 group size)"
            );
        }
        let shapes = [
            ("w1", inter, width),
            ("w2", width, inter),
            ("w3", inter, width),
        ];
        let tensors: Vec<(String, Dtype, Vec<usize>)> = match encoding {
            Encoding::Mxfp4 => shapes
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
            Encoding::Bf16 => shapes
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
        Ok(ExpertLayout {
            encoding,
            act,
            width,
            inter,
            tensors,
            parts,
        })
    }

    pub fn record_len(&self) -> usize {
        self.parts.iter().map(|p| p.1).sum()
    }

    /// Where every expert of every MoE layer lives in the checkpoint (empty lists for dense layers), checking
    /// each tensor's dtype and shape. Consecutive tensors merge into one extent: one read per K3 expert.
    pub fn locate(
        &self,
        ck: &Checkpoint,
        prefix: &str,
        cfg: &ModelConfig,
    ) -> Result<Vec<Vec<RecordLoc>>> {
        (0..cfg.num_layers)
            .map(|l| {
                if cfg.is_dense(l) {
                    return Ok(Vec::new());
                }
                (0..cfg.moe.num_experts)
                    .map(|e| {
                        let mut extents: Vec<Extent> = Vec::new();
                        for (name, dtype, shape) in &self.tensors {
                            let full =
                                format!("{prefix}layers.{l}.block_sparse_moe.experts.{e}.{name}");
                            let info = ck.expect(&full, &[*dtype], shape)?;
                            match extents.last_mut() {
                                Some(x)
                                    if x.file == info.shard
                                        && x.offset + x.len as u64 == info.offset =>
                                {
                                    x.len += info.nbytes as usize
                                }
                                _ => extents.push(Extent {
                                    file: info.shard,
                                    offset: info.offset,
                                    len: info.nbytes as usize,
                                }),
                            }
                        }
                        Ok(RecordLoc {
                            extents,
                            checksum: None,
                        })
                    })
                    .collect()
            })
            .collect()
    }
}

/// One MoE layer's routed experts, served by the store.
pub struct ExpertSet {
    pub store: Arc<ExpertStore>,
    pub layer: usize,
    layout: Arc<ExpertLayout>,
}

impl ExpertSet {
    pub fn new(store: Arc<ExpertStore>, layer: usize, layout: Arc<ExpertLayout>) -> ExpertSet {
        ExpertSet {
            store,
            layer,
            layout,
        }
    }

    pub fn width(&self) -> usize {
        self.layout.width
    }

    /// `y = W2 · act(W1 x, W3 x)` for `n` rows of `x`, with expert `e`'s weights in `record`.
    pub fn apply(
        &self,
        e: usize,
        record: &[u8],
        x: &[f32],
        n: usize,
        stats: &Stats,
    ) -> Result<Vec<f32>> {
        let lay = &*self.layout;
        let part = |i: usize| &record[lay.parts[i].0..lay.parts[i].0 + lay.parts[i].1];
        let (inter, width) = (lay.inter, lay.width);
        let mut h1 = vec![0.0; n * inter];
        let mut h3 = vec![0.0; n * inter];
        let mut a = vec![0.0; n * inter];
        let mut y = vec![0.0; n * width];
        match lay.encoding {
            Encoding::Mxfp4 => {
                for i in [1, 3, 5] {
                    // A vector search: the check runs on every use of a record.
                    if let Some(pos) = memchr::memchr(255, part(i)) {
                        bail!(
                            "layer {} expert {e}: scale byte {pos} of w{} is 255 (NaN in e8m0); the checkpoint is damaged",
                            self.layer,
                            i / 2 + 1
                        );
                    }
                }
                let mx = |p: usize, rows, cols| Matrix::Mxfp4 {
                    packed: part(p),
                    scales: part(p + 1),
                    rows,
                    cols,
                };
                matmul(&mx(0, inter, width), x, n, &mut h1);
                matmul(&mx(4, inter, width), x, n, &mut h3);
                lay.act.apply(&h1, &h3, &mut a);
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
                lay.act.apply(&h1, &h3, &mut a);
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
        stats
            .expert_bytes
            .fetch_add(record.len() as u64, Ordering::Relaxed);
        stats.expert_uses.fetch_add(1, Ordering::Relaxed);
        Ok(y)
    }
}
