//! Kimi Linear (contract §6), as transformers computes it: plain pre-norm residuals around KDA (softplus gate)
//! or ungated NoPE MLA, a dense SiLU MLP first, then BF16 SiLU experts + one shared expert, final norm, lm_head.

use crate::blocks::{Attention, FeedForward, ModelExperts};
use crate::experts::Stats;
use crate::ops::rms_norm;
use crate::weights::{context_layer, Embedding, Linear, Loader};
use crate::{LogitRows, Session};
use anyhow::Result;
use deltafin_formats::checkpoint::Checkpoint;
use deltafin_formats::config::ModelConfig;
use deltafin_store::ExpertStore;
use std::sync::Arc;

pub struct KimiLinear {
    pub cfg: ModelConfig,
    embed: Embedding,
    layers: Vec<Layer>,
    norm: Vec<f32>,
    lm_head: Linear,
    pub experts: Arc<ExpertStore>,
}

struct Layer {
    input_norm: Vec<f32>,
    attn: Attention,
    post_norm: Vec<f32>,
    ffn: FeedForward,
}

impl KimiLinear {
    pub fn load(ck: &Checkpoint, cfg: ModelConfig, experts: &ModelExperts) -> Result<KimiLinear> {
        let (h, v) = (cfg.hidden, cfg.vocab_size);
        let root = Loader::new(ck, "model.");
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for l in 0..cfg.num_layers {
            let ld = root.sub(&format!("layers.{l}."));
            let layer = (|| {
                Ok(Layer {
                    input_norm: ld.vector("input_layernorm.weight", &[h])?,
                    attn: Attention::load(&ld, &cfg, l)?,
                    post_norm: ld.vector("post_attention_layernorm.weight", &[h])?,
                    ffn: FeedForward::load(&ld, &cfg, l, experts)?,
                })
            })();
            layers.push(context_layer(layer, l)?);
        }
        Ok(KimiLinear {
            embed: Embedding {
                table: root.linear("embed_tokens.weight", v, h)?,
            },
            layers,
            norm: root.vector("norm.weight", &[h])?,
            lm_head: Loader::new(ck, "").linear("lm_head.weight", v, h)?,
            experts: experts.store.clone(),
            cfg,
        })
    }

    pub fn layer_states(&self) -> Vec<crate::blocks::LayerState> {
        self.layers.iter().map(|l| l.attn.new_state()).collect()
    }

    pub fn forward(
        &self,
        session: &mut Session,
        tokens: &[u32],
        rows: LogitRows,
        stats: &Stats,
    ) -> Result<Vec<f32>> {
        let (n, hd, eps) = (tokens.len(), self.cfg.hidden, self.cfg.rms_norm_eps);
        let normed = |x: &[f32], w: &[f32]| {
            let mut y = x.to_vec();
            y.chunks_mut(hd).for_each(|r| rms_norm(r, w, eps));
            y
        };
        let mut h = self.embed.lookup(tokens)?;
        for (l, layer) in self.layers.iter().enumerate() {
            // h += Attn(RMS(h)); h += MLP(RMS(h)).
            let o = layer
                .attn
                .forward(&normed(&h, &layer.input_norm), n, &mut session.layers[l]);
            h.iter_mut().zip(&o).for_each(|(h, o)| *h += o);
            let y = context_layer(
                layer.ffn.forward(
                    &normed(&h, &layer.post_norm),
                    n,
                    stats,
                    self.layers.get(l + 1).map(|x| &x.ffn),
                ),
                l,
            )?;
            h.iter_mut().zip(&y).for_each(|(h, y)| *h += y);
        }
        let f = rows.select(&mut h, hd);
        f.chunks_mut(hd).for_each(|r| rms_norm(r, &self.norm, eps));
        session.pos += n;
        Ok(self.lm_head.forward(f, f.len() / hd))
    }
}
