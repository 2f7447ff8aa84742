//! Kimi K3, top to bottom in the order of the contract (§4): embedding, then per layer the Block AttnRes mix,
//! attention (KDA or gated NoPE MLA), a second mix and the feed-forward (dense SiTU at layer 0, latent MXFP4
//! MoE + shared experts after), and the AttnRes tail into the untied lm_head.

use crate::blocks::{Attention, FeedForward, ModelExperts};
use crate::experts::Stats;
use crate::ops::{inv_rms, rms_norm, softmax};
use crate::spine::Spine;
use crate::weights::{context_layer, Embedding, Linear, Loader};
use crate::{batch_tokens, logit_rows, split_logits, Pass, Session};
use anyhow::Result;
use deltafin_formats::checkpoint::Checkpoint;
use deltafin_formats::config::ModelConfig;
use deltafin_kernels::dot;
use deltafin_store::ExpertStore;
use std::sync::Arc;

pub struct KimiK3 {
    pub cfg: ModelConfig,
    embed: Embedding,
    layers: Spine<Layer>,
    /// Tail AttnRes score vector `output_attn_res_norm ⊙ output_attn_res_proj`.
    out_res: Vec<f32>,
    norm: Vec<f32>,
    lm_head: Linear,
    pub experts: Arc<ExpertStore>,
}

struct Layer {
    attn_res: Vec<f32>,
    input_norm: Vec<f32>,
    attn: Attention,
    mlp_res: Vec<f32>,
    post_norm: Vec<f32>,
    ffn: FeedForward,
}

const PREFIX: &str = "language_model.model.";

impl Layer {
    fn load(ck: &Checkpoint, cfg: &ModelConfig, l: usize, experts: &ModelExperts) -> Result<Layer> {
        let h = cfg.hidden;
        let ld = Loader::new(ck, format!("{PREFIX}layers.{l}."));
        let layer = (|| {
            Ok(Layer {
                attn_res: ld.res_score(
                    "self_attention_res_norm.weight",
                    "self_attention_res_proj.weight",
                    h,
                )?,
                input_norm: ld.vector("input_layernorm.weight", &[h])?,
                attn: Attention::load(&ld, cfg, l)?,
                mlp_res: ld.res_score("mlp_res_norm.weight", "mlp_res_proj.weight", h)?,
                post_norm: ld.vector("post_attention_layernorm.weight", &[h])?,
                ffn: FeedForward::load(&ld, cfg, l, experts)?,
            })
        })();
        context_layer(layer, l)
    }
}

impl KimiK3 {
    /// `resident[l]`: keep layer l in memory (otherwise it is read on every pass).
    pub fn load(
        ck: &Arc<Checkpoint>,
        cfg: ModelConfig,
        experts: &ModelExperts,
        resident: &[bool],
    ) -> Result<KimiK3> {
        let (h, v) = (cfg.hidden, cfg.vocab_size);
        let root = Loader::new(ck, PREFIX);
        let layers = {
            let (ck, cfg, experts) = (ck.clone(), cfg.clone(), experts.clone());
            Spine::new(
                resident,
                Arc::new(move |l| Layer::load(&ck, &cfg, l, &experts)),
            )?
        };
        Ok(KimiK3 {
            embed: Embedding {
                table: root.linear("embed_tokens.weight", v, h)?,
            },
            layers,
            out_res: root.res_score(
                "output_attn_res_norm.weight",
                "output_attn_res_proj.weight",
                h,
            )?,
            norm: root.vector("norm.weight", &[h])?,
            lm_head: Loader::new(ck, "language_model.").linear("lm_head.weight", v, h)?,
            experts: experts.store.clone(),
            cfg,
        })
    }

    pub fn streamed_layers(&self) -> usize {
        self.layers.streamed()
    }

    /// One pass over the batch's rows (each session's tokens in turn): every row is computed on its own but in
    /// attention, which reads its own session's state.
    pub fn forward(&self, batch: &mut [Pass<'_, Session>], stats: &Stats) -> Result<Vec<Vec<f32>>> {
        let tokens = batch_tokens(batch);
        let (n, hd, eps) = (tokens.len(), self.cfg.hidden, self.cfg.rms_norm_eps);
        let block = self
            .cfg
            .attn_res_block
            .expect("K3 configs always carry attn_res_block_size");
        let norm_rows =
            |x: &mut [f32], w: &[f32]| x.chunks_mut(hd).for_each(|r| rms_norm(r, w, eps));

        // Embedding: h = E[token]; the partial sum h and the block anchors are per position.
        let mut h = self.embed.lookup(&tokens)?;
        let mut anchors: Vec<Vec<f32>> = Vec::new();
        self.layers.walk(|l, layer, next| {
            let t_layer = std::time::Instant::now();
            // 1. a = Mix([anchors…, h], w_attn), or h itself before the first anchor.
            let mut a = if anchors.is_empty() {
                h.clone()
            } else {
                mix(&anchors, &h, &layer.attn_res, hd, eps)
            };
            // 2. a block boundary makes h an anchor and restarts the partial sum.
            let prefix = if l % block == 0 {
                anchors.push(std::mem::take(&mut h));
                None
            } else {
                Some(std::mem::take(&mut h))
            };
            // 3. o = Attn(RMS(a, input_layernorm)).
            norm_rows(&mut a, &layer.input_norm);
            let o = layer.attn.forward_batch(&a, hd, batch, l);
            // 4. q = prefix + o.
            let q = match prefix {
                Some(mut p) => {
                    p.iter_mut().zip(&o).for_each(|(p, o)| *p += o);
                    p
                }
                None => o,
            };
            // 5. y = MLP(RMS(Mix([anchors…, q], w_mlp), post_attention_layernorm)).
            let mut m = mix(&anchors, &q, &layer.mlp_res, hd, eps);
            norm_rows(&mut m, &layer.post_norm);
            let y = context_layer(layer.ffn.forward(&m, n, stats, next.map(|x| &x.ffn)), l)?;
            // 6. next h = q + y.
            h = q;
            h.iter_mut().zip(&y).for_each(|(h, y)| *h += y);
            stats.add_layer_time(l, t_layer);
            Ok(())
        })?;
        // Tail: logits = lm_head · RMS(Mix([anchors…, h], w_out), norm), for the rows that need them.
        let mut f = logit_rows(&mix(&anchors, &h, &self.out_res, hd, eps), hd, batch);
        norm_rows(&mut f, &self.norm);
        let logits = self.lm_head.forward(&f, f.len() / hd);
        Ok(split_logits(logits, self.cfg.vocab_size, batch))
    }
}

/// AttnRes `Mix(values, w)` for every row: `α = softmax_i(rsqrt(mean(v_i²)+eps) · (v_i · w))`, `Σ α_i v_i`.
fn mix(anchors: &[Vec<f32>], cur: &[f32], w: &[f32], hd: usize, eps: f32) -> Vec<f32> {
    let values: Vec<&[f32]> = anchors.iter().map(|a| a.as_slice()).chain([cur]).collect();
    let n = cur.len() / hd;
    let mut out = vec![0.0f32; cur.len()];
    let mut alpha = vec![0.0f32; values.len()];
    for t in 0..n {
        let r = t * hd..(t + 1) * hd;
        for (s, v) in alpha.iter_mut().zip(&values) {
            let v = &v[r.clone()];
            *s = inv_rms(v, eps) * dot(v, w);
        }
        softmax(&mut alpha);
        let o = &mut out[r.clone()];
        for (&a, v) in alpha.iter().zip(&values) {
            crate::ops::axpy(o, a, &v[r.clone()]);
        }
    }
    out
}
