//! Choosing the next token from fp32 logits: greedy at temperature 0, otherwise seeded sampling with
//! temperature, nucleus (top-p), OpenAI-style presence/frequency penalties and per-token logit biases.

use anyhow::{bail, Result};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha20Rng;

#[derive(Clone, Debug)]
pub struct SamplingParams {
    /// 0 = greedy (argmax, lowest id on ties).
    pub temperature: f32,
    pub top_p: f32,
    /// Same seed and request → the same tokens.
    pub seed: u64,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    /// Added to these ids' logits before choosing (OpenAI's `logit_bias`, each in [-100, 100]).
    pub logit_bias: Vec<(u32, f32)>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_p: 1.0,
            seed: 0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logit_bias: Vec::new(),
        }
    }
}

/// Cloning snapshots the random stream: speculative decoding rewinds it when a draft is rejected.
#[derive(Clone)]
pub struct Sampler {
    params: SamplingParams,
    rng: ChaCha20Rng,
    /// How often each id has been generated (for the penalties).
    counts: Vec<u32>,
}

impl Sampler {
    pub fn new(params: SamplingParams, vocab: usize) -> Result<Sampler> {
        if !(params.temperature >= 0.0 && params.temperature.is_finite()) {
            bail!(
                "temperature must be a finite number >= 0, got {}",
                params.temperature
            );
        }
        if !(params.top_p > 0.0 && params.top_p <= 1.0) {
            bail!("top_p must be in (0, 1], got {}", params.top_p);
        }
        for (name, v) in [
            ("presence_penalty", params.presence_penalty),
            ("frequency_penalty", params.frequency_penalty),
        ] {
            if !(-2.0..=2.0).contains(&v) {
                bail!("{name} must be in [-2, 2], got {v}");
            }
        }
        for &(id, bias) in &params.logit_bias {
            if id as usize >= vocab {
                bail!("logit_bias names token {id}, outside the vocabulary (size {vocab})");
            }
            if !(-100.0..=100.0).contains(&bias) {
                bail!("logit_bias for token {id} must be in [-100, 100], got {bias}");
            }
        }
        Ok(Sampler {
            rng: ChaCha20Rng::seed_from_u64(params.seed),
            params,
            counts: vec![0; vocab],
        })
    }

    /// Whether `pick` is the plain argmax of the logits (temperature 0, no penalties, no biases).
    pub fn greedy(&self) -> bool {
        let p = &self.params;
        p.temperature == 0.0
            && p.presence_penalty == 0.0
            && p.frequency_penalty == 0.0
            && p.logit_bias.is_empty()
    }

    pub fn pick(&mut self, logits: &[f32]) -> u32 {
        let p = &self.params;
        let mut penalised: Vec<f32> = if p.presence_penalty == 0.0 && p.frequency_penalty == 0.0 {
            logits.to_vec()
        } else {
            logits
                .iter()
                .zip(&self.counts)
                .map(|(&l, &c)| {
                    if c == 0 {
                        l
                    } else {
                        l - p.presence_penalty - p.frequency_penalty * c as f32
                    }
                })
                .collect()
        };
        for &(id, bias) in &p.logit_bias {
            penalised[id as usize] += bias;
        }
        let id = if p.temperature == 0.0 {
            argmax(&penalised)
        } else {
            self.sample(&penalised)
        };
        self.counts[id as usize] += 1;
        id
    }

    fn sample(&mut self, logits: &[f32]) -> u32 {
        let t = self.params.temperature;
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        // Probabilities in f64, sorted descending (ties by id) so the nucleus is well defined. Ids are distinct,
        // so the order is total and an unstable sort gives the stable one's (o200k: 201,088 ids each token).
        let mut probs: Vec<(u32, f64)> = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| (i as u32, (((l - max) / t) as f64).exp()))
            .collect();
        probs.sort_unstable_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        let total: f64 = probs.iter().map(|p| p.1).sum();
        let mut kept = 0.0;
        let mut cut = probs.len();
        for (i, p) in probs.iter().enumerate() {
            kept += p.1 / total;
            if kept >= self.params.top_p as f64 {
                cut = i + 1;
                break;
            }
        }
        let probs = &probs[..cut];
        let mass: f64 = probs.iter().map(|p| p.1).sum();
        let mut r = self.rng.gen::<f64>() * mass;
        for &(id, p) in probs {
            if r < p {
                return id;
            }
            r -= p;
        }
        probs[probs.len() - 1].0
    }
}

/// The highest logit; ties go to the lowest id.
pub fn argmax(x: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_the_lowest_id_on_ties() {
        let mut s = Sampler::new(SamplingParams::default(), 4).unwrap();
        assert_eq!(s.pick(&[1.0, 3.0, 3.0, 0.0]), 1);
    }

    #[test]
    fn same_seed_same_tokens_other_seed_differs() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let run = |seed| {
            let params = SamplingParams {
                temperature: 1.0,
                seed,
                ..Default::default()
            };
            let mut s = Sampler::new(params, 50).unwrap();
            (0..40).map(|_| s.pick(&logits)).collect::<Vec<_>>()
        };
        assert_eq!(run(7), run(7));
        assert_ne!(run(7), run(8));
    }

    #[test]
    fn tiny_top_p_is_greedy_and_penalties_push_away_repeats() {
        let logits = [0.0f32, 2.0, 1.9];
        let params = SamplingParams {
            temperature: 1.0,
            top_p: 1e-6,
            ..Default::default()
        };
        let mut s = Sampler::new(params, 3).unwrap();
        assert!((0..20).all(|_| s.pick(&logits) == 1));
        let params = SamplingParams {
            frequency_penalty: 1.0,
            ..Default::default()
        };
        let mut s = Sampler::new(params, 3).unwrap();
        assert_eq!(s.pick(&logits), 1);
        assert_eq!(
            s.pick(&logits),
            2,
            "after one use, id 1 loses 1.0 and id 2 wins"
        );
    }

    #[test]
    fn logit_bias_shifts_the_choice() {
        let logits = [0.0f32, 2.0, 1.9];
        let biased = |logit_bias: Vec<(u32, f32)>| {
            let params = SamplingParams {
                logit_bias,
                ..Default::default()
            };
            Sampler::new(params, 3).unwrap().pick(&logits)
        };
        assert_eq!(biased(vec![]), 1);
        assert_eq!(biased(vec![(1, -100.0)]), 2, "a ban");
        assert_eq!(biased(vec![(0, 2.5)]), 0, "a nudge past the best");
        for bad in [vec![(3, 1.0)], vec![(0, 101.0)], vec![(0, f32::NAN)]] {
            let params = SamplingParams {
                logit_bias: bad,
                ..Default::default()
            };
            let e = Sampler::new(params, 3).err().unwrap().to_string();
            assert!(e.contains("logit_bias"), "{e}");
        }
    }

    #[test]
    fn bad_parameters_are_rejected_with_their_names() {
        let bad = SamplingParams {
            top_p: 0.0,
            ..Default::default()
        };
        assert!(Sampler::new(bad, 3)
            .err()
            .unwrap()
            .to_string()
            .contains("top_p"));
        let bad = SamplingParams {
            temperature: -1.0,
            ..Default::default()
        };
        assert!(Sampler::new(bad, 3)
            .err()
            .unwrap()
            .to_string()
            .contains("temperature"));
    }
}
