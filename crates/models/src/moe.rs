//! Feed-forward blocks: the dense gated MLP (layer 0 and the shared experts), the noaux_tc router, and the
//! routed experts, whose bytes are read from the checkpoint only when a row routes to them.

use crate::describe as desc;
use crate::describe::Scoring;
use crate::experts::{ExpertSet, Stats};
use crate::ops::{rms_norm, sigmoid, softmax, Act};
use crate::weights::{forward_many, Linear, Loader};
use anyhow::Result;
use rayon::prelude::*;

/// `down(act(gate x, up x))`.
pub struct Mlp {
    gate: Linear,
    up: Linear,
    down: Linear,
    act: Act,
}

impl Mlp {
    pub fn load(ld: &Loader, d: &desc::Mlp) -> Result<Mlp> {
        Ok(Mlp {
            gate: ld.linear(&d.gate)?,
            up: ld.linear(&d.up)?,
            down: ld.linear(&d.down)?,
            act: d.act,
        })
    }

    pub fn forward(&self, x: &[f32], n: usize) -> Vec<f32> {
        let [g, u] = forward_many([&self.gate, &self.up], x, n);
        self.finish(&g, &u, n)
    }

    /// `down(act(g, u))`, for callers that computed `g` and `u` with other products of the same input.
    fn finish(&self, g: &[f32], u: &[f32], n: usize) -> Vec<f32> {
        let mut a = vec![0.0; g.len()];
        self.act.apply(g, u, &mut a);
        self.down.forward(&a, n)
    }
}

/// The router ([`Scoring`]): noaux_tc (K3, Kimi Linear, DeepSeek-V3: sigmoid scores; the correction bias
/// only chooses, first among groups of consecutive experts, then among the kept groups' experts; weights
/// renormalised and scaled), gpt-oss's biased softmax over the top k, or Qwen3's softmax over all experts.
pub struct Router {
    gate: Linear,
    /// Zeros where the router has no bias.
    bias: Vec<f32>,
    scoring: Scoring,
    top_k: usize,
    renormalize: bool,
    scale: f32,
    groups: usize,
    topk_group: usize,
}

/// One row's selection: expert ids in ascending order (the canonical summation order) with their weights.
#[derive(Clone, Debug, PartialEq)]
pub struct Route {
    pub ids: Vec<usize>,
    pub weights: Vec<f32>,
}

impl Router {
    pub fn route(&self, x: &[f32], n: usize) -> Vec<Route> {
        let e = self.gate.rows;
        let logits = self.gate.forward(x, n);
        match self.scoring {
            Scoring::SoftmaxTopK => {
                return logits.chunks(e).map(|r| self.softmax_top_k(r)).collect()
            }
            Scoring::Softmax => return logits.chunks(e).map(|r| self.softmax_all(r)).collect(),
            Scoring::SigmoidCorrected => {}
        }
        logits
            .chunks(e)
            .map(|row| {
                let scores: Vec<f32> = row.iter().map(|&l| sigmoid(l)).collect();
                let choice = |i: usize| scores[i] + self.bias[i];
                let mut order: Vec<usize> = (0..e).collect();
                if self.groups > 1 {
                    // A group scores the sum of its two best choice scores; only the best groups' experts compete.
                    let size = e / self.groups;
                    let group_score: Vec<f32> = (0..self.groups)
                        .map(|g| {
                            let mut c: Vec<f32> = (g * size..(g + 1) * size).map(choice).collect();
                            c.sort_by(|a, b| b.total_cmp(a));
                            c.iter().take(2).sum::<f32>()
                        })
                        .collect();
                    let groups = top_k_by((0..self.groups).collect(), self.topk_group, |g| {
                        group_score[g]
                    });
                    order.retain(|i| groups.contains(&(i / size)));
                }
                let ids = top_k_by(order, self.top_k, choice);
                let picked: Vec<f32> = ids.iter().map(|&i| scores[i]).collect();
                let denom = if self.renormalize {
                    // Summed in ascending-id order, like everything downstream.
                    picked.iter().sum::<f32>() + 1e-20
                } else {
                    1.0
                };
                let weights = picked.iter().map(|s| s / denom * self.scale).collect();
                Route { ids, weights }
            })
            .collect()
    }

    /// gpt-oss: `l = x Wᵀ + b`; the k largest logits (ties: the lower id), softmaxed among themselves in
    /// ascending-id order.
    fn softmax_top_k(&self, row: &[f32]) -> Route {
        let logits: Vec<f32> = row.iter().zip(&self.bias).map(|(l, b)| l + b).collect();
        let ids = top_k(&logits, self.top_k);
        let mut weights: Vec<f32> = ids.iter().map(|&i| logits[i]).collect();
        softmax(&mut weights);
        Route { ids, weights }
    }

    /// Qwen3: `p = softmax(x Wᵀ)` over every expert; the k largest (ties: the lower id), divided by their sum
    /// (ascending-id order) with `norm_topk_prob`.
    fn softmax_all(&self, row: &[f32]) -> Route {
        let mut p = row.to_vec();
        softmax(&mut p);
        let ids = top_k(&p, self.top_k);
        let mut weights: Vec<f32> = ids.iter().map(|&i| p[i]).collect();
        if self.renormalize {
            let sum: f32 = weights.iter().sum();
            weights.iter_mut().for_each(|w| *w /= sum);
        }
        Route { ids, weights }
    }
}

/// The ids of the `k` largest scores (ties: the lower id), in ascending order.
fn top_k(scores: &[f32], k: usize) -> Vec<usize> {
    top_k_by((0..scores.len()).collect(), k, |i| scores[i])
}

/// The k of `ids` with the highest scores, in ascending id order; equal scores: the lower id wins. That is a
/// total order, so the set is the same however it is found: a selection, not a sort of all of them (a
/// decode step routes every MoE layer).
fn top_k_by(mut ids: Vec<usize>, k: usize, score: impl Fn(usize) -> f32) -> Vec<usize> {
    let k = k.min(ids.len());
    if k == 0 {
        return Vec::new();
    }
    ids.select_nth_unstable_by(k - 1, |&a, &b| {
        score(b).total_cmp(&score(a)).then(a.cmp(&b))
    });
    ids.truncate(k);
    ids.sort_unstable();
    ids
}

/// K3's latent projections around the routed experts.
struct Latent {
    down: Linear,
    norm: Vec<f32>,
    up: Linear,
}

pub struct Moe {
    router: Router,
    latent: Option<Latent>,
    experts: ExpertSet,
    shared: Option<Mlp>,
    eps: f32,
}

impl Moe {
    pub fn load(ld: &Loader, d: &desc::Moe, experts: ExpertSet) -> Result<Moe> {
        let r = &d.router;
        Ok(Moe {
            router: Router {
                gate: ld.linear(&r.gate)?,
                bias: match &r.bias {
                    Some(b) => ld.vector(b)?,
                    None => vec![0.0; r.gate.rows],
                },
                scoring: r.scoring,
                top_k: r.top_k,
                renormalize: r.renormalize,
                scale: r.scale,
                groups: r.groups,
                topk_group: r.topk_group,
            },
            latent: match &d.latent {
                Some(l) => Some(Latent {
                    down: ld.linear(&l.down)?,
                    norm: ld.vector(&l.norm)?,
                    up: ld.linear(&l.up)?,
                }),
                None => None,
            },
            experts,
            shared: d.shared.as_ref().map(|m| Mlp::load(ld, m)).transpose()?,
            eps: d.eps,
        })
    }

    /// `x`: n rows of the post-attention-normed input. Each expert of the union of the rows' selections is read
    /// once and applied, as its bytes arrive (a few experts in parallel), to the rows that chose it; each row
    /// then sums its experts in ascending id order, whatever the arrival order. `next` is the following MoE
    /// layer, whose router predicts its experts from this state so their reads can start now (lookahead
    /// prefetch).
    pub fn forward(
        &self,
        x: &[f32],
        n: usize,
        stats: &Stats,
        next: Option<&Moe>,
    ) -> Result<Vec<f32>> {
        let routes = self.router.route(x, n);
        stats.record_routes(self.experts.layer, routes.iter().map(|r| r.ids.clone()));
        let mut union: Vec<usize> = routes.iter().flat_map(|r| r.ids.iter().copied()).collect();
        union.sort_unstable();
        union.dedup();
        let mut fetch = self.experts.store.fetch(self.experts.layer, &union);
        if let Some(next) = next {
            next.prefetch(x, n);
        }
        // 1. K3 works in the latent space: z = routed_expert_down_proj · x. The shared experts' gate and up
        // products of x join it in one parallel region.
        let (z, shared) = match (&self.latent, &self.shared) {
            (Some(l), Some(s)) => {
                let [z, g, u] = forward_many([&l.down, &s.gate, &s.up], x, n);
                (z, Some((g, u)))
            }
            (Some(l), None) => (l.down.forward(x, n), None),
            (None, Some(s)) => {
                let [g, u] = forward_many([&s.gate, &s.up], x, n);
                (x.to_vec(), Some((g, u)))
            }
            (None, None) => (x.to_vec(), None),
        };
        let width = z.len() / n;
        // 2. expert outputs, each into its union position. Every record that has arrived is taken and computed
        // in parallel, one expert a task (a decode step's experts are each too small to split well), so
        // experts in memory cost one parallel region a layer rather than one per pair; fewer than the slab's
        // slots are held at once, so the records still to come always find one. Only the first of a batch is
        // waited for: a record that arrives alone (streaming) is computed at once, its products split over
        // the pool, while the drive reads the next — waiting for a second record left the last ones'
        // products after the layer's final read, with the drive idle.
        let per_batch = self.experts.store.slots().saturating_sub(1).max(1);
        let mut outputs: Vec<(Vec<usize>, Vec<f32>)> = vec![(Vec::new(), Vec::new()); union.len()];
        let mut batch = Vec::with_capacity(per_batch);
        while let Some(first) = fetch.next() {
            batch.push(first?);
            while batch.len() < per_batch {
                match fetch.next_arrived() {
                    Some(record) => batch.push(record?),
                    None => break,
                }
            }
            let done = batch
                .par_drain(..)
                .map(|record| {
                    let e = record.expert;
                    let rows: Vec<usize> = (0..n).filter(|&t| routes[t].ids.contains(&e)).collect();
                    let mut input = Vec::with_capacity(rows.len() * width);
                    for &t in &rows {
                        input.extend_from_slice(&z[t * width..(t + 1) * width]);
                    }
                    let y = self
                        .experts
                        .apply(e, record.bytes(), &input, rows.len(), stats)?;
                    let pos = union
                        .binary_search(&e)
                        .expect("fetched experts come from the union");
                    Ok((pos, rows, y))
                })
                .collect::<Result<Vec<_>>>()?;
            for (pos, rows, y) in done {
                outputs[pos] = (rows, y);
            }
        }
        let outputs: Vec<(usize, Vec<usize>, Vec<f32>)> = union
            .iter()
            .zip(outputs)
            .map(|(&e, (rows, y))| (e, rows, y))
            .collect();
        // 3. acc = Σ w_i y_i, experts in ascending id order per row (union order is ascending too).
        let mut acc = vec![0.0f32; n * width];
        for (e, rows, y) in &outputs {
            for (j, &t) in rows.iter().enumerate() {
                let slot = routes[t]
                    .ids
                    .iter()
                    .position(|id| id == e)
                    .expect("row chose this expert");
                let w = routes[t].weights[slot];
                for (a, v) in acc[t * width..(t + 1) * width]
                    .iter_mut()
                    .zip(&y[j * width..(j + 1) * width])
                {
                    *a += w * v;
                }
            }
        }
        // 4. K3: r = up · RMS(acc, routed_expert_norm) — the norm comes after the weighted sum.
        let routed = match &self.latent {
            Some(l) => {
                for row in acc.chunks_mut(width) {
                    rms_norm(row, &l.norm, self.eps);
                }
                l.up.forward(&acc, n)
            }
            None => acc,
        };
        // 5. + shared experts.
        let (Some(s), Some((g, u))) = (&self.shared, shared) else {
            return Ok(routed);
        };
        let mut out = s.finish(&g, &u, n);
        for (o, r) in out.iter_mut().zip(&routed) {
            *o += r;
        }
        Ok(out)
    }

    /// Lookahead: this layer's router applied to an earlier layer's state; the predicted experts are queued
    /// for reading into idle disk time (where prediction has proven useful for this layer), the likeliest
    /// first — by its largest weight in any row — so the reads done when the demand comes are the best guesses.
    fn prefetch(&self, x: &[f32], n: usize) {
        let store = &self.experts.store;
        if !store.prediction_enabled(self.experts.layer) {
            return;
        }
        let mut picked: Vec<(usize, f32)> = self
            .router
            .route(x, n)
            .into_iter()
            .flat_map(|r| r.ids.into_iter().zip(r.weights))
            .collect();
        // By id, the heaviest of each id first, then one entry per id, heaviest first.
        picked.sort_by(|a, b| a.0.cmp(&b.0).then(b.1.total_cmp(&a.1)));
        picked.dedup_by_key(|p| p.0);
        picked.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        let ids: Vec<usize> = picked.into_iter().map(|(e, _)| e).collect();
        store.prefetch(self.experts.layer, &ids);
    }
}

#[cfg(test)]
mod tests {
    use super::top_k_by;

    /// The selection picks what sorting every id by (score descending, id ascending) and taking the first k
    /// picks — with ties, signed zeros, infinities and NaNs among the scores.
    #[test]
    fn top_k_by_is_the_first_k_of_the_full_order() {
        let values = [
            0.5,
            0.5,
            -0.0,
            0.0,
            f32::INFINITY,
            -1.0,
            f32::NAN,
            0.25,
            0.5,
            -f32::NAN,
        ];
        // A small deterministic generator: every score drawn from `values`.
        let mut state = 7u64;
        for len in 1..40 {
            let scores: Vec<f32> = (0..len)
                .map(|_| {
                    state = state
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    values[(state >> 33) as usize % values.len()]
                })
                .collect();
            for k in 0..=len {
                let mut all: Vec<usize> = (0..len).collect();
                all.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
                let mut want = all[..k].to_vec();
                want.sort_unstable();
                let got = top_k_by((0..len).collect(), k, |i| scores[i]);
                assert_eq!(got, want, "len {len}, k {k}, scores {scores:?}");
            }
        }
    }
}
