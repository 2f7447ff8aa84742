//! The per-layer building blocks both families share: which attention, which feed-forward, and their state.

use crate::describe as desc;
use crate::experts::{ExpertSet, Stats};
use crate::gqa::{Gqa, KvCache};
use crate::kda::{Kda, KdaState};
use crate::mla::{LatentCache, Mla};
use crate::moe::{Mlp, Moe};
use crate::weights::Loader;
use crate::{Pass, Session};
use anyhow::Result;
use deltafin_formats::config::ModelConfig;
use deltafin_store::record::ExpertRecord;
use deltafin_store::ExpertStore;
use std::sync::Arc;

pub enum Attention {
    Kda(Box<Kda>),
    Mla(Box<Mla>),
    Gqa(Box<Gqa>),
}

/// What one layer carries from token to token.
#[derive(Clone)]
pub enum LayerState {
    Kda(KdaState),
    Mla(LatentCache),
    Kv(KvCache),
}

impl LayerState {
    pub fn bytes(&self) -> usize {
        match self {
            LayerState::Kda(s) => s.bytes(),
            LayerState::Mla(c) => c.bytes(),
            LayerState::Kv(c) => c.bytes(),
        }
    }

    /// Restores the state after the first `rows` of the `pass` rows of its last pass (which kept them), `start`
    /// tokens having come before it. Reads no weights: a streamed layer need not be in memory.
    pub fn rollback(&mut self, start: usize, rows: usize, pass: usize) -> Result<()> {
        match self {
            LayerState::Kda(s) if rows == pass => s.forget_rows(),
            LayerState::Kda(s) => s.rollback(rows)?,
            LayerState::Mla(c) => c.keep_first(start + rows, start + pass),
            LayerState::Kv(c) => c.keep_first(start + rows, start + pass),
        }
        Ok(())
    }

    /// Every value of the state, as bits (for tests of exact equality).
    pub fn bits(&self) -> Vec<u32> {
        match self {
            LayerState::Kda(s) => s.bits().collect(),
            LayerState::Mla(c) => c.bits().collect(),
            LayerState::Kv(c) => c.bits().collect(),
        }
    }
}

impl Attention {
    pub fn load(ld: &Loader, d: &desc::Attention) -> Result<Attention> {
        Ok(match d {
            desc::Attention::Mla(m) => Attention::Mla(Box::new(Mla::load(ld, m)?)),
            desc::Attention::Kda(k) => Attention::Kda(Box::new(Kda::load(ld, k)?)),
            desc::Attention::Gqa(g) => Attention::Gqa(Box::new(Gqa::load(ld, g)?)),
        })
    }

    /// With `keep`, the state keeps what [`Self::rollback`] needs.
    pub fn forward(&self, x: &[f32], n: usize, state: &mut LayerState, keep: bool) -> Vec<f32> {
        match (self, state) {
            (Attention::Kda(k), LayerState::Kda(s)) => k.forward(x, n, s, keep),
            (Attention::Mla(m), LayerState::Mla(c)) => m.forward(x, n, c),
            (Attention::Gqa(g), LayerState::Kv(c)) => g.forward(x, n, c),
            _ => unreachable!("a session's layer states are made by the same model's layers"),
        }
    }

    /// Layer `l`'s attention over a batch's rows (`x`: `[rows, hd]`, the sessions' rows in batch order): each
    /// session's rows through its own state.
    pub fn forward_batch(
        &self,
        x: &[f32],
        hd: usize,
        batch: &mut [Pass<'_, Session>],
        l: usize,
    ) -> Vec<f32> {
        let mut out = Vec::with_capacity(x.len());
        let mut at = 0;
        for p in batch {
            let n = p.tokens.len();
            let keep = p.session.keep_rows;
            out.extend(self.forward(
                &x[at * hd..(at + n) * hd],
                n,
                &mut p.session.layers[l],
                keep,
            ));
            at += n;
        }
        out
    }
}

pub enum FeedForward {
    Dense(Box<Mlp>),
    Moe(Box<Moe>),
}

impl FeedForward {
    pub fn load(
        ld: &Loader,
        d: &desc::FeedForward,
        layer: usize,
        experts: &ModelExperts,
    ) -> Result<FeedForward> {
        Ok(match d {
            desc::FeedForward::Dense(m) => FeedForward::Dense(Box::new(Mlp::load(ld, m)?)),
            desc::FeedForward::Moe(m) => {
                let set =
                    ExpertSet::new(experts.store.clone(), layer, experts.record.clone(), m.act);
                FeedForward::Moe(Box::new(Moe::load(ld, m, set)?))
            }
        })
    }

    /// `next` is the following layer's feed-forward (its router drives the lookahead prefetch).
    pub fn forward(
        &self,
        x: &[f32],
        n: usize,
        stats: &Stats,
        next: Option<&FeedForward>,
    ) -> Result<Vec<f32>> {
        match self {
            FeedForward::Dense(m) => Ok(m.forward(x, n)),
            FeedForward::Moe(m) => {
                let next = match next {
                    Some(FeedForward::Moe(next)) => Some(&**next),
                    _ => None,
                };
                m.forward(x, n, stats, next)
            }
        }
    }
}

/// The state each layer of a fresh session starts with (zeros; an empty cache).
pub fn initial_states(cfg: &ModelConfig) -> Vec<LayerState> {
    (0..cfg.num_layers)
        .map(|l| {
            if cfg.gqa.is_some() {
                LayerState::Kv(KvCache::default())
            } else if cfg.is_mla[l] {
                LayerState::Mla(LatentCache::default())
            } else {
                LayerState::Kda(KdaState::zeros(
                    cfg.kda.heads,
                    cfg.kda.head_dim,
                    cfg.kda.conv_kernel,
                ))
            }
        })
        .collect()
}

/// The routed experts of a whole model: where they are read from and the shape of one record.
#[derive(Clone)]
pub struct ModelExperts {
    pub store: Arc<ExpertStore>,
    pub record: Arc<ExpertRecord>,
}
