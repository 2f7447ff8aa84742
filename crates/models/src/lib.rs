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
use blocks::ModelExperts;
use deltafin_formats::checkpoint::Checkpoint;
use deltafin_formats::config::{Family, ModelConfig};
use deltafin_store::{ExpertStore, StoreOptions};
use experts::ExpertLayout;
pub use experts::Stats;
use std::path::{Path, PathBuf};
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

/// How a model is opened.
#[derive(Clone, Debug, Default)]
pub struct LoadOptions {
    pub store: StoreOptions,
    /// Read routed experts from this pack (any of its stripe directories) instead of the checkpoint's shards.
    pub pack: Option<PathBuf>,
}

impl Model {
    /// Loads the spine of the checkpoint in `dir` with default options; routed experts stay on disk.
    pub fn load(dir: &Path) -> Result<Model> {
        Model::load_with(dir, &LoadOptions::default())
    }

    pub fn load_with(dir: &Path, opts: &LoadOptions) -> Result<Model> {
        let cfg = ModelConfig::from_dir(dir)?;
        let ck = Checkpoint::open(dir)?;
        let experts = open_experts(dir, &ck, &cfg, opts)?;
        Ok(match cfg.family {
            Family::KimiK3 => Model::KimiK3(kimi_k3::KimiK3::load(&ck, cfg, &experts)?),
            Family::KimiLinear => {
                Model::KimiLinear(kimi_linear::KimiLinear::load(&ck, cfg, &experts)?)
            }
        })
    }

    /// The expert store, for its counters.
    pub fn store(&self) -> &ExpertStore {
        match self {
            Model::KimiK3(m) => &m.experts,
            Model::KimiLinear(m) => &m.experts,
        }
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

/// The tensor-name prefix of a family's layers.
pub fn layer_prefix(family: Family) -> &'static str {
    match family {
        Family::KimiK3 => "language_model.model.",
        Family::KimiLinear => "model.",
    }
}

/// Identifies a checkpoint for packs: a hash of its config and its tensor index (names, shapes, places).
pub fn model_identity(dir: &Path) -> Result<String> {
    let mut bytes = std::fs::read(dir.join("config.json"))?;
    if let Ok(index) = std::fs::read(dir.join("model.safetensors.index.json")) {
        bytes.extend_from_slice(&index);
    }
    Ok(format!("{:016x}", xxhash_rust::xxh3::xxh3_64(&bytes)))
}

/// Where the routed experts of a checkpoint are, and the record layout: for `deltafin pack`.
pub fn expert_sources(
    dir: &Path,
) -> Result<(Vec<PathBuf>, Vec<Vec<deltafin_store::RecordLoc>>, usize)> {
    let cfg = ModelConfig::from_dir(dir)?;
    let ck = Checkpoint::open(dir)?;
    let layout = ExpertLayout::new(&cfg)?;
    let layers = layout.locate(&ck, layer_prefix(cfg.family), &cfg)?;
    Ok((
        ck.shards.iter().map(|s| s.path.clone()).collect(),
        layers,
        layout.record_len(),
    ))
}

fn open_experts(
    dir: &Path,
    ck: &Checkpoint,
    cfg: &ModelConfig,
    opts: &LoadOptions,
) -> Result<ModelExperts> {
    let layout = ExpertLayout::new(cfg)?;
    let record_len = layout.record_len();
    let mut store_opts = opts.store.clone();
    // A pass holds one layer's experts at once; give the reads of a whole top-k room to be in flight together,
    // plus as many again for the lookahead.
    store_opts.working_slots = store_opts.working_slots.max(2 * cfg.moe.top_k);
    let store = match &opts.pack {
        None => {
            let layers = layout.locate(ck, layer_prefix(cfg.family), cfg)?;
            let files: Vec<(PathBuf, usize)> =
                ck.shards.iter().map(|s| (s.path.clone(), 0)).collect();
            ExpertStore::new(
                &files,
                layers,
                record_len,
                store_opts,
                format!("checkpoint {}", dir.display()),
            )?
        }
        Some(pack) => {
            let manifest = deltafin_store::pack::open_pack(pack, &model_identity(dir)?)?;
            if manifest.record_len != record_len {
                bail!(
                    "the pack at {} has {}-byte records; this model's are {record_len}",
                    pack.display(),
                    manifest.record_len
                );
            }
            let (files, layers) = manifest.records(cfg.num_layers)?;
            for (l, recs) in layers.iter().enumerate() {
                let want = if cfg.is_dense(l) {
                    0
                } else {
                    cfg.moe.num_experts
                };
                if recs.len() != want {
                    bail!(
                        "the pack has {} experts for layer {l}, the model {want}",
                        recs.len()
                    );
                }
            }
            ExpertStore::new(
                &files,
                layers,
                record_len,
                store_opts,
                format!("pack {}", pack.display()),
            )?
        }
    };
    Ok(ModelExperts {
        store: Arc::new(store),
        layout: Arc::new(layout),
    })
}
