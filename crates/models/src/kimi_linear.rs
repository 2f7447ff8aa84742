//! Kimi Linear (contract §6), as transformers computes it: plain pre-norm residuals around KDA (softplus gate)
//! or ungated NoPE MLA, a dense SiLU MLP first, then BF16 SiLU experts + one shared expert, final norm, lm_head.

use crate::blocks::{Attention, FeedForward, ModelExperts};
use crate::experts::Stats;
use crate::ops::rms_norm;
use crate::spine::Spine;
use crate::weights::{context_layer, Embedding, Linear, Loader};
use crate::{batch_tokens, logit_rows, split_logits, Pass, Session};
use anyhow::Result;
use deltafin_formats::checkpoint::Checkpoint;
use deltafin_formats::config::ModelConfig;
use deltafin_store::ExpertStore;
use std::sync::Arc;

pub struct KimiLinear {
    pub cfg: ModelConfig,
    embed: Embedding,
    layers: Spine<Layer>,
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

const PREFIX: &str = "model.";

impl Layer {
    fn load(ck: &Checkpoint, cfg: &ModelConfig, l: usize, experts: &ModelExperts) -> Result<Layer> {
        let h = cfg.hidden;
        let ld = Loader::new(ck, format!("{PREFIX}layers.{l}."));
        let layer = (|| {
            Ok(Layer {
                input_norm: ld.vector("input_layernorm.weight", &[h])?,
                attn: Attention::load(&ld, cfg, l)?,
                post_norm: ld.vector("post_attention_layernorm.weight", &[h])?,
                ffn: FeedForward::load(&ld, cfg, l, experts)?,
            })
        })();
        context_layer(layer, l)
    }
}

impl KimiLinear {
    /// `resident[l]`: keep layer l in memory (otherwise it is read on every pass).
    pub fn load(
        ck: &Arc<Checkpoint>,
        cfg: ModelConfig,
        experts: &ModelExperts,
        resident: &[bool],
    ) -> Result<KimiLinear> {
        let (h, v) = (cfg.hidden, cfg.vocab_size);
        let root = Loader::new(ck, PREFIX);
        let layers = {
            let (ck, cfg, experts) = (ck.clone(), cfg.clone(), experts.clone());
            Spine::new(
                resident,
                Arc::new(move |l| Layer::load(&ck, &cfg, l, &experts)),
            )?
        };
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

    pub fn streamed_layers(&self) -> usize {
        self.layers.streamed()
    }

    /// One pass over the batch's rows (each session's tokens in turn), as in `KimiK3::forward`.
    pub fn forward(&self, batch: &mut [Pass<'_, Session>], stats: &Stats) -> Result<Vec<Vec<f32>>> {
        let tokens = batch_tokens(batch);
        let (n, hd, eps) = (tokens.len(), self.cfg.hidden, self.cfg.rms_norm_eps);
        let normed = |x: &[f32], w: &[f32]| {
            let mut y = x.to_vec();
            y.chunks_mut(hd).for_each(|r| rms_norm(r, w, eps));
            y
        };
        let mut h = self.embed.lookup(&tokens)?;
        self.layers.walk(|l, layer, next| {
            let t_layer = std::time::Instant::now();
            // h += Attn(RMS(h)); h += MLP(RMS(h)).
            let o = layer
                .attn
                .forward_batch(&normed(&h, &layer.input_norm), hd, batch, l);
            h.iter_mut().zip(&o).for_each(|(h, o)| *h += o);
            let y = context_layer(
                layer.ffn.forward(
                    &normed(&h, &layer.post_norm),
                    n,
                    stats,
                    next.map(|x| &x.ffn),
                ),
                l,
            )?;
            h.iter_mut().zip(&y).for_each(|(h, y)| *h += y);
            stats.add_layer_time(l, t_layer);
            Ok(())
        })?;
        let mut f = logit_rows(&h, hd, batch);
        f.chunks_mut(hd).for_each(|r| rms_norm(r, &self.norm, eps));
        let logits = self.lm_head.forward(&f, f.len() / hd);
        Ok(split_logits(logits, self.cfg.vocab_size, batch))
    }
}
