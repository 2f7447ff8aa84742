//! Model families, each in one file that reads like its contract: [`kimi_k3`] and [`kimi_linear`], built
//! from shared blocks ([`kda`], [`mla`], [`moe`]) over the CPU kernels.

pub mod blocks;
pub mod experts;
pub mod kda;
pub mod kimi_k3;
pub mod kimi_linear;
pub mod mla;
pub mod moe;
pub mod ops;
pub mod weights;

use anyhow::{bail, Result};
use blocks::LayerState;
use deltafin_formats::checkpoint::Checkpoint;
use deltafin_formats::config::{Family, ModelConfig};
pub use experts::Stats;
use std::path::Path;
use std::sync::Arc;

/// Which rows of a pass need logits: all of them (a scored prompt, verification) or only the last (generation).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogitRows {
    All,
    Last,
}

impl LogitRows {
    fn select(self, h: &mut [f32], hd: usize) -> &mut [f32] {
        match self {
            LogitRows::All => h,
            LogitRows::Last => {
                let n = h.len() / hd;
                &mut h[(n - 1) * hd..]
            }
        }
    }
}

/// One sequence's state: KDA recurrent states and MLA latent caches, one per layer.
#[derive(Clone)]
pub struct Session {
    pub layers: Vec<LayerState>,
    /// Tokens consumed so far.
    pub pos: usize,
}

pub enum Model {
    KimiK3(kimi_k3::KimiK3),
    KimiLinear(kimi_linear::KimiLinear),
}

impl Model {
    /// Loads the spine of the checkpoint in `dir`; routed experts stay on disk.
    pub fn load(dir: &Path) -> Result<Model> {
        let cfg = ModelConfig::from_dir(dir)?;
        let ck = Arc::new(Checkpoint::open(dir)?);
        Ok(match cfg.family {
            Family::KimiK3 => Model::KimiK3(kimi_k3::KimiK3::load(&ck, cfg)?),
            Family::KimiLinear => Model::KimiLinear(kimi_linear::KimiLinear::load(&ck, cfg)?),
        })
    }

    pub fn config(&self) -> &ModelConfig {
        match self {
            Model::KimiK3(m) => &m.cfg,
            Model::KimiLinear(m) => &m.cfg,
        }
    }

    pub fn new_session(&self) -> Session {
        let layers = match self {
            Model::KimiK3(m) => m.layer_states(),
            Model::KimiLinear(m) => m.layer_states(),
        };
        Session { layers, pos: 0 }
    }

    /// Runs `tokens` after the session's history (prefill, one decode step, or anything between: the same
    /// code path) and returns logits `[rows, vocab]`.
    pub fn forward(
        &self,
        session: &mut Session,
        tokens: &[u32],
        rows: LogitRows,
        stats: &Stats,
    ) -> Result<Vec<f32>> {
        if tokens.is_empty() {
            bail!("a forward pass needs at least one token");
        }
        match self {
            Model::KimiK3(m) => m.forward(session, tokens, rows, stats),
            Model::KimiLinear(m) => m.forward(session, tokens, rows, stats),
        }
    }
}
