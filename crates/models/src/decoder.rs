//! The CPU executor of a [`Description`]: the embedding, then per layer attention (KDA or MLA) and the
//! feed-forward (dense or MoE) around the residual stream — K3's Block AttnRes (contract §4) or Kimi Linear's
//! plain pre-norm residuals (§6) — and the tail into the lm_head.

use crate::blocks::{Attention, FeedForward, ModelExperts};
use crate::describe::{Description, Residual};
use crate::experts::Stats;
use crate::ops::{axpy, inv_rms, rms_norm, softmax};
use crate::spine::Spine;
use crate::weights::{context_layer, Embedding, Linear, Loader};
use crate::{batch_tokens, logit_rows, split_logits, Pass, Session};
use anyhow::Result;
use deltafin_formats::checkpoint::Checkpoint;
use deltafin_formats::config::ModelConfig;
use deltafin_kernels::dot;
use deltafin_store::ExpertStore;
use std::sync::Arc;

/// A model on the CPU: the embeddings and head resident, the layers resident or streamed ([`Spine`]), the
/// routed experts read through the expert store.
pub struct Model {
    pub(crate) cfg: ModelConfig,
    embed: Embedding,
    layers: Spine<Layer>,
    /// The tail's AttnRes score vector `output_attn_res_norm ⊙ output_attn_res_proj`, where the model has one.
    out_res: Option<Vec<f32>>,
    norm: Vec<f32>,
    lm_head: Linear,
    pub(crate) experts: Arc<ExpertStore>,
}

struct Layer {
    res: Option<LayerRes>,
    input_norm: Vec<f32>,
    attn: Attention,
    post_norm: Vec<f32>,
    ffn: FeedForward,
}

/// A layer's AttnRes scores (folded), and whether it starts a block (its incoming state becomes an anchor).
struct LayerRes {
    attn: Vec<f32>,
    mlp: Vec<f32>,
    anchor: bool,
}

impl Layer {
    fn load(
        ck: &Checkpoint,
        desc: &Description,
        l: usize,
        experts: &ModelExperts,
    ) -> Result<Layer> {
        let (ld, d) = (Loader::new(ck), &desc.layers[l]);
        let layer = (|| {
            Ok(Layer {
                res: match (&d.res, &desc.residual) {
                    (Some(r), Residual::AttnRes { block, .. }) => Some(LayerRes {
                        attn: ld.res_score(&r.attn)?,
                        mlp: ld.res_score(&r.mlp)?,
                        anchor: l.is_multiple_of(*block),
                    }),
                    _ => None,
                },
                input_norm: ld.vector(&d.input_norm)?,
                attn: Attention::load(&ld, &d.attn)?,
                post_norm: ld.vector(&d.post_norm)?,
                ffn: FeedForward::load(&ld, &d.ffn, l, experts)?,
            })
        })();
        context_layer(layer, l)
    }
}

impl Model {
    /// `desc` is `cfg`'s description; `resident[l]`: keep layer l in memory (otherwise it is read on every
    /// pass).
    pub(crate) fn from_checkpoint(
        ck: &Arc<Checkpoint>,
        cfg: ModelConfig,
        desc: Arc<Description>,
        experts: &ModelExperts,
        resident: &[bool],
    ) -> Result<Model> {
        let ld = Loader::new(ck);
        let layers = {
            let (ck, desc, experts) = (ck.clone(), desc.clone(), experts.clone());
            Spine::new(
                resident,
                Arc::new(move |l| Layer::load(&ck, &desc, l, &experts)),
            )?
        };
        Ok(Model {
            embed: Embedding::load(&ld, &desc.embed)?,
            layers,
            out_res: match &desc.residual {
                Residual::AttnRes { out, .. } => Some(ld.res_score(out)?),
                Residual::PreNorm => None,
            },
            norm: ld.vector(&desc.norm)?,
            lm_head: ld.linear(&desc.lm_head)?,
            experts: experts.store.clone(),
            cfg,
        })
    }

    /// Spine layers read from disk on every pass (0 when the whole spine is resident).
    pub fn streamed_layers(&self) -> usize {
        self.layers.streamed()
    }

    /// Seconds passes have waited so far for streamed spine layers to be read.
    pub fn spine_wait_secs(&self) -> f64 {
        self.layers.waited_secs()
    }

    /// One pass over the batch's rows (each session's tokens in turn): every row is computed on its own but in
    /// attention, which reads its own session's state.
    pub(crate) fn forward(
        &self,
        batch: &mut [Pass<'_, Session>],
        stats: &Stats,
    ) -> Result<Vec<Vec<f32>>> {
        let tokens = batch_tokens(batch);
        let (n, hd, eps) = (tokens.len(), self.cfg.hidden, self.cfg.rms_norm_eps);
        let norm_rows =
            |x: &mut [f32], w: &[f32]| x.chunks_mut(hd).for_each(|r| rms_norm(r, w, eps));
        let mut s = Stream {
            h: self.embed.lookup(&tokens)?,
            anchors: Vec::new(),
            base: Base::H,
            hd,
            eps,
        };
        self.layers.walk(|l, layer, next| {
            let t_layer = std::time::Instant::now();
            let res = layer.res.as_ref();
            // o = Attn(RMS(attention input, input_layernorm)).
            let mut a = s.attn_input(res);
            norm_rows(&mut a, &layer.input_norm);
            s.add_attn(layer.attn.forward_batch(&a, hd, batch, l));
            // y = MLP(RMS(feed-forward input, post_attention_layernorm)).
            let mut m = s.mlp_input(res);
            norm_rows(&mut m, &layer.post_norm);
            let y = context_layer(layer.ffn.forward(&m, n, stats, next.map(|x| &x.ffn)), l)?;
            s.add(&y);
            stats.add_layer_time(l, t_layer);
            Ok(())
        })?;
        // Tail: logits = lm_head · RMS(output, norm), for the rows that need them.
        let mut f = match &self.out_res {
            Some(w) => logit_rows(&s.mix(w), hd, batch),
            None => logit_rows(&s.h, hd, batch),
        };
        norm_rows(&mut f, &self.norm);
        let logits = self.lm_head.forward(&f, f.len() / hd);
        Ok(split_logits(logits, self.cfg.vocab_size, batch))
    }
}

/// The residual stream of a pass, per row: the running state `h`, and with AttnRes the block anchors and the
/// partial sum of the current block. A layer without AttnRes scores is a plain pre-norm residual.
struct Stream {
    h: Vec<f32>,
    anchors: Vec<Vec<f32>>,
    /// What attention's output is added to.
    base: Base,
    hd: usize,
    eps: f32,
}

enum Base {
    /// `h` (pre-norm residual).
    H,
    /// AttnRes: the block's partial sum.
    Prefix(Vec<f32>),
    /// AttnRes after a block boundary: nothing, the partial sum restarts.
    Restart,
}

impl Stream {
    /// What attention reads (before its norm). AttnRes: `a = Mix([anchors…, h], w_attn)`, or h itself
    /// before the first anchor; a block boundary then makes h an anchor and restarts the partial sum.
    fn attn_input(&mut self, res: Option<&LayerRes>) -> Vec<f32> {
        let Some(r) = res else {
            return self.h.clone();
        };
        let a = if self.anchors.is_empty() {
            self.h.clone()
        } else {
            self.mix(&r.attn)
        };
        let h = std::mem::take(&mut self.h);
        self.base = if r.anchor {
            self.anchors.push(h);
            Base::Restart
        } else {
            Base::Prefix(h)
        };
        a
    }

    /// `h += o`; with AttnRes `h = prefix + o`, or `o` after a restart.
    fn add_attn(&mut self, o: Vec<f32>) {
        match std::mem::replace(&mut self.base, Base::H) {
            Base::H => self.add(&o),
            Base::Prefix(p) => {
                self.h = p;
                self.add(&o);
            }
            Base::Restart => self.h = o,
        }
    }

    /// What the feed-forward reads (before its norm). AttnRes: `Mix([anchors…, h], w_mlp)`.
    fn mlp_input(&self, res: Option<&LayerRes>) -> Vec<f32> {
        match res {
            Some(r) => self.mix(&r.mlp),
            None => self.h.clone(),
        }
    }

    fn add(&mut self, y: &[f32]) {
        self.h.iter_mut().zip(y).for_each(|(h, y)| *h += y);
    }

    /// AttnRes `Mix([anchors…, h], w)` for every row: `α = softmax_i(rsqrt(mean(v_i²)+eps) · (v_i · w))`,
    /// `Σ α_i v_i`.
    fn mix(&self, w: &[f32]) -> Vec<f32> {
        let (hd, cur) = (self.hd, self.h.as_slice());
        let values: Vec<&[f32]> = self
            .anchors
            .iter()
            .map(|a| a.as_slice())
            .chain([cur])
            .collect();
        let n = cur.len() / hd;
        let mut out = vec![0.0f32; cur.len()];
        let mut alpha = vec![0.0f32; values.len()];
        for t in 0..n {
            let r = t * hd..(t + 1) * hd;
            for (s, v) in alpha.iter_mut().zip(&values) {
                let v = &v[r.clone()];
                *s = inv_rms(v, self.eps) * dot(v, w);
            }
            softmax(&mut alpha);
            let o = &mut out[r.clone()];
            for (&a, v) in alpha.iter().zip(&values) {
                axpy(o, a, &v[r.clone()]);
            }
        }
        out
    }
}
