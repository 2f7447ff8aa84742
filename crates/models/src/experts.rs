//! Routed experts stay on disk. At load only their locations are recorded (in the checkpoint's shards, where
//! an expert's tensors are one contiguous span, or in a pack); the store brings a record in when a row routes
//! to it, and the FFN runs on those bytes in place.

use crate::ops::Act;
use anyhow::{bail, Result};
use deltafin_kernels::codec::bf16_to_f32;
use deltafin_kernels::{matmul, Matrix};
use deltafin_store::record::{Encoding, ExpertRecord, Role};
use deltafin_store::ExpertStore;
use std::collections::HashSet;
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
    /// MXFP4 experts whose scales were found free of 255 (NaN): a record's bytes come from the same file
    /// every time it is read, so each is searched once, not on every use.
    scales_checked: Mutex<HashSet<usize>>,
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
            scales_checked: Mutex::default(),
        }
    }

    pub fn width(&self) -> usize {
        self.record.width
    }

    /// `y = W2 · act(W1 x, W3 x)` for `n` rows of `x`, with expert `e`'s weights in `record` (gpt-oss: gate
    /// and up as one interleaved matrix, and biases).
    pub fn apply(
        &self,
        e: usize,
        record: &[u8],
        x: &[f32],
        n: usize,
        stats: &Stats,
    ) -> Result<Vec<f32>> {
        let lay = &*self.record;
        let part = |role: Role, k: usize| {
            let (at, len) = lay.tensor(role, k);
            &record[at..at + len]
        };
        let mxfp4 = matches!(lay.encoding, Encoding::Mxfp4 | Encoding::Mxfp4Biased);
        if mxfp4 && !self.scales_checked.lock().unwrap().contains(&e) {
            for &(role, ..) in &lay.matrices {
                if let Some(pos) = memchr::memchr(255, part(role, 1)) {
                    bail!(
                        "layer {} expert {e}: scale byte {pos} of {role:?} is 255 (NaN in e8m0); the checkpoint is damaged",
                        self.layer,
                    );
                }
            }
            self.scales_checked.lock().unwrap().insert(e);
        }
        // Weights are read in place; only BF16 values (and scales, biases) are widened out of the byte record.
        let owned: Vec<Vec<u16>> = lay
            .matrices
            .iter()
            .map(|&(role, ..)| match lay.encoding {
                Encoding::Bf16 => crate::weights::u16s(part(role, 0)),
                Encoding::Int4Group => crate::weights::u16s(part(role, 1)),
                Encoding::Mxfp4 | Encoding::Mxfp4Biased | Encoding::Fp8Block => Vec::new(),
            })
            .collect();
        let scales_f32: Vec<Vec<f32>> = lay
            .matrices
            .iter()
            .map(|&(role, ..)| match lay.encoding {
                Encoding::Fp8Block => crate::weights::f32s(part(role, 1)),
                _ => Vec::new(),
            })
            .collect();
        let matrix = |role: Role| -> Result<Matrix> {
            let i = (lay.matrices.iter().position(|m| m.0 == role))
                .ok_or_else(|| anyhow::anyhow!("{:?} records have no {role:?}", lay.encoding))?;
            let (_, rows, cols) = lay.matrices[i];
            match lay.encoding {
                Encoding::Mxfp4 | Encoding::Mxfp4Biased => Ok(Matrix::Mxfp4 {
                    packed: part(role, 0),
                    scales: part(role, 1),
                    rows,
                    cols,
                }),
                Encoding::Bf16 => Ok(Matrix::Bf16 {
                    data: &owned[i],
                    rows,
                    cols,
                }),
                Encoding::Fp8Block => Matrix::fp8_block(part(role, 0), &scales_f32[i], rows, cols),
                Encoding::Int4Group => Matrix::int4_group(part(role, 0), &owned[i], rows, cols),
            }
            .map_err(|m| anyhow::anyhow!("layer {} expert {e} {role:?}: {m}", self.layer))
        };
        // Adds matrix `role`'s bias to each row of `y`, where the encoding has biases.
        let add_bias = |role: Role, y: &mut [f32]| {
            if lay.encoding == Encoding::Mxfp4Biased {
                let b: Vec<f32> = crate::weights::u16s(part(role, Encoding::BIAS))
                    .into_iter()
                    .map(bf16_to_f32)
                    .collect();
                y.chunks_mut(b.len())
                    .for_each(|r| r.iter_mut().zip(&b).for_each(|(v, b)| *v += b));
            }
        };
        let (inter, width) = (lay.inter, lay.width);
        let mut h1 = vec![0.0; n * inter];
        let mut h3 = vec![0.0; n * inter];
        let mut a = vec![0.0; n * inter];
        let mut y = vec![0.0; n * width];
        if lay.matrices.iter().any(|m| m.0 == Role::GateUp) {
            let mut gu = vec![0.0; n * 2 * inter];
            matmul(&matrix(Role::GateUp)?, x, n, &mut gu);
            add_bias(Role::GateUp, &mut gu);
            // Rows alternate gate (2j) and up (2j + 1).
            for (row, (g, u)) in gu
                .chunks(2 * inter)
                .zip(h1.chunks_mut(inter).zip(h3.chunks_mut(inter)))
            {
                for ((pair, g), u) in row.chunks_exact(2).zip(g).zip(u) {
                    (*g, *u) = (pair[0], pair[1]);
                }
            }
        } else {
            matmul(&matrix(Role::Gate)?, x, n, &mut h1);
            matmul(&matrix(Role::Up)?, x, n, &mut h3);
        }
        self.act.apply(&h1, &h3, &mut a);
        matmul(&matrix(Role::Down)?, &a, n, &mut y);
        add_bias(Role::Down, &mut y);
        stats
            .expert_bytes
            .fetch_add(record.len() as u64, Ordering::Relaxed);
        stats.expert_uses.fetch_add(1, Ordering::Relaxed);
        Ok(y)
    }
}
