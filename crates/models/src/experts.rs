//! Routed experts stay on disk. At load only their locations are recorded (in the checkpoint's shards, where
//! an expert's tensors are one contiguous span, or in a pack); the store brings a record in when a row routes
//! to it, and the FFN runs on those bytes in place.

use crate::ops::Act;
use anyhow::{bail, Result};
use deltafin_kernels::codec::bf16_to_f32;
use deltafin_kernels::{matmul, Matrix};
use deltafin_store::record::{Encoding, ExpertRecord};
use deltafin_store::ExpertStore;
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
    /// Forward passes run (each reads every streamed spine layer once).
    pub passes: AtomicU64,
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
    pub fn passes(&self) -> u64 {
        self.passes.load(Ordering::Relaxed)
    }
}

/// One MoE layer's routed experts, served by the store.
pub struct ExpertSet {
    pub store: Arc<ExpertStore>,
    pub layer: usize,
    record: Arc<ExpertRecord>,
    act: Act,
}

impl ExpertSet {
    pub fn new(
        store: Arc<ExpertStore>,
        layer: usize,
        record: Arc<ExpertRecord>,
        act: Act,
    ) -> ExpertSet {
        ExpertSet {
            store,
            layer,
            record,
            act,
        }
    }

    pub fn width(&self) -> usize {
        self.record.width
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
        let lay = &*self.record;
        let part = |i: usize| {
            let (at, len) = lay.part(i);
            &record[at..at + len]
        };
        let (inter, width) = (lay.inter, lay.width);
        let mut h1 = vec![0.0; n * inter];
        let mut h3 = vec![0.0; n * inter];
        let mut a = vec![0.0; n * inter];
        let mut y = vec![0.0; n * width];
        match lay.encoding {
            Encoding::Mxfp4 => {
                self.check_scales(e, [("w1", part(1)), ("w2", part(3)), ("w3", part(5))])?;
                let mx = |p: usize, rows, cols| Matrix::Mxfp4 {
                    packed: part(p),
                    scales: part(p + 1),
                    rows,
                    cols,
                };
                matmul(&mx(0, inter, width), x, n, &mut h1);
                matmul(&mx(4, inter, width), x, n, &mut h3);
                self.act.apply(&h1, &h3, &mut a);
                matmul(&mx(2, width, inter), &a, n, &mut y);
            }
            Encoding::Mxfp4Biased => {
                self.check_scales(e, [("gate_up_proj", part(1)), ("down_proj", part(4))])?;
                let mx = |p: usize, rows, cols| Matrix::Mxfp4 {
                    packed: part(p),
                    scales: part(p + 1),
                    rows,
                    cols,
                };
                let bias = |p: usize| crate::weights::u16s(part(p)).into_iter().map(bf16_to_f32);
                // gate_up rows alternate gate (2j) and up (2j + 1).
                let mut gu = vec![0.0; n * 2 * inter];
                matmul(&mx(0, 2 * inter, width), x, n, &mut gu);
                for (row, (g, u)) in gu
                    .chunks(2 * inter)
                    .zip(h1.chunks_mut(inter).zip(h3.chunks_mut(inter)))
                {
                    for (j, b) in bias(2).enumerate() {
                        let v = row[j] + b;
                        if j % 2 == 0 {
                            g[j / 2] = v;
                        } else {
                            u[j / 2] = v;
                        }
                    }
                }
                self.act.apply(&h1, &h3, &mut a);
                matmul(&mx(3, width, inter), &a, n, &mut y);
                let b: Vec<f32> = bias(5).collect();
                y.chunks_mut(width)
                    .for_each(|r| r.iter_mut().zip(&b).for_each(|(v, b)| *v += b));
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
        stats
            .expert_bytes
            .fetch_add(record.len() as u64, Ordering::Relaxed);
        stats.expert_uses.fetch_add(1, Ordering::Relaxed);
        Ok(y)
    }

    /// E8M0 255 is NaN: refused (a vector search, so the check runs on every use of a record). `scales`:
    /// (the matrix's name, its scale bytes).
    fn check_scales<const N: usize>(&self, e: usize, scales: [(&str, &[u8]); N]) -> Result<()> {
        for (w, bytes) in scales {
            if let Some(pos) = memchr::memchr(255, bytes) {
                bail!(
                    "layer {} expert {e}: scale byte {pos} of {w} is 255 (NaN in e8m0); the checkpoint is damaged",
                    self.layer
                );
            }
        }
        Ok(())
    }
}
