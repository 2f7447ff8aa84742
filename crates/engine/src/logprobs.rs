//! Log-probabilities of the model's next-token distribution, from the fp32 logits that chose a token —
//! before temperature, penalties and top-p, i.e. what the model itself assigns (computed in f64).

/// The chosen token's log-probability and the `top.len()` most likely tokens (most likely first, ties to the
/// lower id).
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    pub token: u32,
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

/// `log softmax(logits)[token]` and the `top_n` highest entries.
pub fn logprobs(logits: &[f32], token: u32, top_n: usize) -> TokenLogprob {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = logits.iter().map(|&l| (l as f64 - max).exp()).sum();
    let lse = max + sum.ln();
    let lp = |id: u32| (logits[id as usize] as f64 - lse) as f32;

    // Selection of the top_n by a small sorted list: O(vocab · top_n) with top_n ≤ 20.
    let mut top: Vec<u32> = Vec::with_capacity(top_n + 1);
    let better = |a: u32, b: u32| logits[a as usize] > logits[b as usize];
    if top_n > 0 {
        for id in 0..logits.len() as u32 {
            if top.len() == top_n && !better(id, top[top_n - 1]) {
                continue;
            }
            let at = top.partition_point(|&t| !better(id, t));
            top.insert(at, id);
            top.truncate(top_n);
        }
    }
    TokenLogprob {
        token,
        logprob: lp(token),
        top: top.into_iter().map(|id| (id, lp(id))).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_a_direct_softmax_and_orders_the_top() {
        let logits = [1.0f32, 3.0, 3.0, -2.0, 0.5];
        let z: f64 = logits.iter().map(|&l| (l as f64).exp()).sum();
        let r = logprobs(&logits, 4, 3);
        assert!((r.logprob as f64 - (0.5f64.exp() / z).ln()).abs() < 1e-6);
        let ids: Vec<u32> = r.top.iter().map(|t| t.0).collect();
        assert_eq!(ids, [1, 2, 0], "descending, ties to the lower id");
        let total: f64 = logits
            .iter()
            .enumerate()
            .map(|(i, _)| (logprobs(&logits, i as u32, 0).logprob as f64).exp())
            .sum();
        assert!((total - 1.0).abs() < 1e-6);
        assert!(logprobs(&logits, 0, 0).top.is_empty());
        assert_eq!(logprobs(&logits, 0, 9).top.len(), 5);
    }
}
