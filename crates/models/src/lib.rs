//! Model families, each described once as data that reads like its contract ([`describe`];
//! docs/k3-model-contract.md, cited as "contract §N"), and the CPU executor of that description: [`Model`],
//! built from shared blocks ([`kda`], [`mla`], [`moe`]) over the CPU kernels, which the engine drives through
//! the [`Backend`] trait.

pub mod backend;
pub mod blocks;
mod decoder;
pub mod describe;
pub mod experts;
pub mod gqa;
pub mod kda;
pub mod math;
pub mod mla;
pub mod moe;
pub mod ops;
pub mod rope;
mod session;
pub mod spine;
pub mod weights;

use anyhow::{bail, Context, Result};
pub use backend::{batch_tokens, split_rows, Backend, Pass};
use blocks::LayerState;
pub use blocks::ModelExperts;
use deltafin_formats::checkpoint::Checkpoint;
use deltafin_formats::config::ModelConfig;
use deltafin_store::record::{is_routed_expert, ExpertRecord};
use deltafin_store::{Backfill, ExpertStore, StoreOptions};
use describe::Description;
pub use experts::Stats;
use session::{logit_rows, split_logits};
pub use session::{LogitRows, Session};
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use decoder::Model;

/// How a model is opened.
#[derive(Clone, Debug, Default)]
pub struct LoadOptions {
    pub store: StoreOptions,
    /// Bytes the whole process may use for weights: spine layers that do not fit (after the embeddings,
    /// lm_head and the expert cache) are read from disk on every pass instead of staying resident.
    pub memory_budget: Option<u64>,
    /// Read routed experts from this pack (any of its stripe directories) instead of the checkpoint's shards.
    pub pack: Option<PathBuf>,
    /// Fills a partial mirror's missing experts from its remote source before they are read.
    pub backfill: Option<Arc<dyn Backfill>>,
}

impl Model {
    /// Loads the spine of the checkpoint in `dir` with default options; routed experts stay on disk.
    pub fn load(dir: &Path) -> Result<Model> {
        Model::load_with(dir, &LoadOptions::default())
    }

    pub fn load_with(dir: &Path, opts: &LoadOptions) -> Result<Model> {
        let cfg = ModelConfig::from_dir(dir)?;
        let ck = Arc::new(Checkpoint::open(dir)?);
        let experts = open_expert_store(dir, &ck, &cfg, opts)?;
        let desc = Arc::new(Description::of(&cfg)?);
        let resident = plan_spine(&ck, &desc, opts, &experts.store)?;
        Model::from_checkpoint(&ck, cfg, desc, &experts, &resident)
    }

    /// The expert store, for its counters.
    pub fn store(&self) -> &Arc<ExpertStore> {
        &self.experts
    }

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    pub fn new_session(&self) -> Session {
        Session::new(blocks::initial_states(self.config()))
    }
}

impl Backend for Model {
    type Session = Session;

    fn config(&self) -> &ModelConfig {
        Model::config(self)
    }

    fn store(&self) -> &Arc<ExpertStore> {
        Model::store(self)
    }

    fn kernels(&self) -> String {
        deltafin_kernels::isa().into()
    }

    fn reports_layers(&self) -> bool {
        true
    }

    fn new_session(&self) -> Result<Session> {
        Ok(Model::new_session(self))
    }

    fn forward_batch(
        &self,
        batch: &mut [Pass<'_, Session>],
        stats: &Stats,
    ) -> Result<Vec<Vec<f32>>> {
        if batch.is_empty() {
            return Ok(Vec::new());
        }
        check_batch(self.config(), batch)?;
        stats
            .passes
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        on_pool(|| self.forward(batch, stats))
    }

    fn fork(&self, session: &Session) -> Result<Session> {
        Ok(session.clone())
    }

    fn keep_rows(&self, session: &mut Session) -> bool {
        session.keep_rows = true;
        true
    }

    /// From the state before the pass and its rows' recurrence inputs, kept by every KDA layer (the MLA caches
    /// are cut): with `d` the KDA width (heads · head_dim), a state copy (`heads · head_dim²` + the windows)
    /// per KDA layer plus about `6d` values per row (K3: 6.7 MB + 0.3 MB per row for each of its 69 KDA
    /// layers — 464 MB, the KDA part of the fork it replaces, and 20 MB per row).
    fn rollback(&self, session: &mut Session, rows: usize) -> Result<()> {
        session.rollback(rows)
    }

    fn spine_wait_secs(&self) -> f64 {
        Model::spine_wait_secs(self)
    }

    fn position(&self, session: &Session) -> usize {
        session.pos
    }

    /// The MLA latent caches plus the KDA recurrent and convolution states.
    fn session_bytes(&self, session: &Session) -> usize {
        session.layers.iter().map(LayerState::bytes).sum()
    }
}

/// Runs `f` on a thread of the rayon pool. A pass makes dozens of parallel products; each one started from
/// a thread outside the pool wakes a worker and sleeps until the product is done, which costs more than
/// the split saves on the small ones. From a pool thread a product's first task starts at once on that
/// thread, and the pass pays one hand-off instead of one a product.
fn on_pool<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    if rayon::current_thread_index().is_some() {
        f()
    } else {
        rayon::scope(|_| f())
    }
}

/// What every backend's forward pass requires of each session's tokens in a batch.
pub fn check_batch<S>(cfg: &ModelConfig, batch: &[Pass<'_, S>]) -> Result<()> {
    for p in batch {
        if p.tokens.is_empty() {
            bail!("a forward pass needs at least one token");
        }
        if let Some(&t) = p.tokens.iter().find(|&&t| t as usize >= cfg.vocab_size) {
            bail!(
                "token id {t} is outside the vocabulary (size {})",
                cfg.vocab_size
            );
        }
    }
    Ok(())
}

/// Identifies a checkpoint for packs: a hash of its config and its tensor index (names, shapes, places).
pub fn model_identity(dir: &Path) -> Result<String> {
    let path = dir.join("config.json");
    let mut bytes = std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
    if let Ok(index) = std::fs::read(dir.join("model.safetensors.index.json")) {
        bytes.extend_from_slice(&index);
    }
    Ok(format!("{:016x}", xxhash_rust::xxh3::xxh3_64(&bytes)))
}

/// Bytes of the spine one decode step reads: every described tensor except the embedding table, of which a
/// step reads one row.
pub fn spine_bytes(dir: &Path) -> Result<u64> {
    let ck = Checkpoint::open(dir)?;
    let desc = Description::of(&ModelConfig::from_dir(dir)?)?;
    let mut names = desc.globals();
    // A step reads all of a tied head, though only one row of the same table as embeddings.
    names.retain(|&n| n != desc.embed.name || desc.lm_head == desc.embed);
    names.extend(desc.layers.iter().flat_map(|l| l.tensors()));
    described_bytes(&ck, &names)
}

/// Bytes of the named tensors of `ck`.
fn described_bytes(ck: &Checkpoint, names: &[&str]) -> Result<u64> {
    names.iter().map(|n| Ok(ck.info(n)?.nbytes)).sum()
}

/// Bytes of every tensor but the routed experts: what stays in memory without a memory budget.
pub fn resident_bytes(dir: &Path) -> Result<u64> {
    let ck = Checkpoint::open(dir)?;
    Ok(ck
        .tensors()
        .filter(|t| !is_routed_expert(&t.name))
        .map(|t| t.nbytes)
        .sum())
}

/// What a checkpoint's weights take in memory, for sizing the expert cache before loading it.
#[derive(Clone, Copy, Debug)]
pub struct MemoryNeeds {
    /// Every tensor but the routed experts (resident without a memory budget).
    pub spine: u64,
    /// Slab bytes of one routed expert record.
    pub slot: u64,
    /// Routed expert records of the model.
    pub records: u64,
    /// Slots a pass holds at once (the working set), as [`Model::load_with`] sizes it from `store`.
    pub working_slots: u64,
}

pub fn memory_needs(dir: &Path, store: &StoreOptions) -> Result<MemoryNeeds> {
    let cfg = ModelConfig::from_dir(dir)?;
    let record = ExpertRecord::new(&cfg)?.len();
    let routed: u64 = Checkpoint::open(dir)?
        .tensors()
        .filter(|t| is_routed_expert(&t.name))
        .map(|t| t.nbytes)
        .sum();
    Ok(MemoryNeeds {
        spine: resident_bytes(dir)?,
        slot: deltafin_store::slot_bytes(record),
        records: routed / record.max(1) as u64,
        working_slots: working_slots(store, &cfg) as u64,
    })
}

/// A pass holds one layer's experts at once; give the reads of a whole top-k room to be in flight together,
/// plus as many again for the lookahead.
fn working_slots(store: &StoreOptions, cfg: &ModelConfig) -> usize {
    store.working_slots.max(2 * cfg.moe.top_k).max(2)
}

/// Which spine layers stay resident under the memory budget (all of them without one).
fn plan_spine(
    ck: &Checkpoint,
    desc: &Description,
    opts: &LoadOptions,
    store: &ExpertStore,
) -> Result<Vec<bool>> {
    let Some(budget) = opts.memory_budget else {
        return Ok(vec![true; desc.layers.len()]);
    };
    let (layer_bytes, global) = spine_layer_bytes(ck, desc)?;
    let largest = layer_bytes.iter().copied().max().unwrap_or(0);
    // Always in memory: globals, the expert slab, and two streamed layers (the one computing, the next loading).
    let floor = global + store.slab_bytes() + 2 * largest;
    if budget < floor {
        bail!(
            "--memory-budget {budget} bytes is too small for this model: it needs at least {floor} (embeddings and lm_head {global}, expert cache and working set {}, two streamed layers {}); raise it or lower --expert-cache",
            store.slab_bytes(),
            2 * largest
        );
    }
    Ok(spine::plan_resident(&layer_bytes, budget - floor))
}

/// Bytes of each layer's described spine tensors, and of the rest (embeddings, lm_head, final norm).
fn spine_layer_bytes(ck: &Checkpoint, desc: &Description) -> Result<(Vec<u64>, u64)> {
    let layer_bytes = desc
        .layers
        .iter()
        .enumerate()
        .map(|(l, d)| described_bytes(ck, &d.tensors()).with_context(|| format!("layer {l}")))
        .collect::<Result<Vec<u64>>>()?;
    Ok((layer_bytes, described_bytes(ck, &desc.globals())?))
}

/// Bytes every pass reads of a spine whose last `streamed` layers are read from disk on each pass (the
/// memory budget keeps a prefix of the layers resident).
pub fn streamed_spine_bytes(dir: &Path, streamed: usize) -> Result<u64> {
    let desc = Description::of(&ModelConfig::from_dir(dir)?)?;
    let (layers, _) = spine_layer_bytes(&Checkpoint::open(dir)?, &desc)?;
    Ok(layers.iter().rev().take(streamed).sum())
}

/// Opens the routed experts of the checkpoint in `dir` as every backend reads them: a partial mirror only
/// with its remote source to fill it (`opts.backfill`), otherwise refused; a pack only when its records and
/// per-layer expert counts are this model's.
pub fn open_expert_store(
    dir: &Path,
    ck: &Checkpoint,
    cfg: &ModelConfig,
    opts: &LoadOptions,
) -> Result<ModelExperts> {
    if opts.backfill.is_none() {
        deltafin_formats::mirror::require_complete(dir, "loading it without its remote source")?;
    }
    let record = ExpertRecord::new(cfg)?;
    let record_len = record.len();
    let mut store_opts = opts.store.clone();
    store_opts.working_slots = working_slots(&opts.store, cfg);
    let store = match &opts.pack {
        None => {
            let layers = record.locate(ck, cfg)?;
            let files: Vec<(PathBuf, usize)> =
                ck.shards.iter().map(|s| (s.path.clone(), 0)).collect();
            let store = ExpertStore::new(
                &files,
                layers,
                record_len,
                store_opts,
                format!("checkpoint {}", dir.display()),
            )?;
            match &opts.backfill {
                Some(b) => store.with_backfill(b.clone()),
                None => store,
            }
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
    let store = Arc::new(store);
    store.fill_in_background();
    Ok(ModelExperts {
        store,
        record: Arc::new(record),
    })
}
