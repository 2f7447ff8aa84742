//! Which cached record to evict. Chosen by replaying routing traces (`deltafin cache-sim`): recency, decayed
//! frequency, or a blend of the two.

use std::collections::HashMap;
use std::str::FromStr;

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Policy {
    /// Least recently used.
    Lru,
    /// Lowest use count, each past use decaying by half every `half_life` uses of the cache.
    DecayedFrequency { half_life: f64 },
    /// Recency first, with a frequency bonus: score = last use + `weight` · log2(1 + decayed count).
    Blend { half_life: f64, weight: f64 },
}

/// Decayed frequency: measured best on the trained model's routing trace (`deltafin cache-sim`, see
/// BENCHMARKS.md). A pass visits every layer in turn, a cyclic pattern under which LRU evicts exactly the
/// records the next pass wants first; frequency keeps the popular ones.
impl Default for Policy {
    fn default() -> Self {
        Policy::DecayedFrequency { half_life: 2048.0 }
    }
}

impl FromStr for Policy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "lru" => Ok(Policy::Lru),
            "lfu" => Ok(Policy::DecayedFrequency { half_life: 2048.0 }),
            "blend" => Ok(Policy::Blend {
                half_life: 2048.0,
                weight: 256.0,
            }),
            _ => Err(format!(
                "unknown cache policy {s:?}; choose lru, lfu or blend"
            )),
        }
    }
}

/// Use history per record (layer, expert), kept across evictions so frequency means something.
pub struct State {
    policy: Policy,
    tick: u64,
    /// (last use, decayed use count as of that use).
    history: HashMap<(usize, usize), (u64, f64)>,
}

impl State {
    pub fn new(policy: Policy) -> State {
        State {
            policy,
            tick: 0,
            history: HashMap::new(),
        }
    }

    /// Records a use of `key`.
    pub fn touch(&mut self, key: (usize, usize)) {
        self.tick += 1;
        let count = self.decayed(key) + 1.0;
        self.history.insert(key, (self.tick, count));
    }

    fn decayed(&self, key: (usize, usize)) -> f64 {
        let half_life = match self.policy {
            Policy::Lru => return 0.0,
            Policy::DecayedFrequency { half_life } | Policy::Blend { half_life, .. } => half_life,
        };
        let (last, count) = self.history.get(&key).copied().unwrap_or((0, 0.0));
        count * (-((self.tick - last) as f64) / half_life).exp2()
    }

    fn score(&self, key: (usize, usize)) -> f64 {
        let last = self.history.get(&key).map_or(0, |h| h.0) as f64;
        match self.policy {
            Policy::Lru => last,
            Policy::DecayedFrequency { .. } => self.decayed(key),
            Policy::Blend { weight, .. } => last + weight * (1.0 + self.decayed(key)).log2(),
        }
    }

    /// Of `(slot, key)` candidates, the slot whose record scores lowest (ties: the lowest slot).
    pub fn victim(
        &self,
        candidates: impl Iterator<Item = (usize, (usize, usize))>,
    ) -> Option<usize> {
        candidates
            .min_by(|a, b| {
                self.score(a.1)
                    .total_cmp(&self.score(b.1))
                    .then(a.0.cmp(&b.0))
            })
            .map(|c| c.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lru_evicts_the_oldest_and_lfu_the_rarest() {
        let mut lru = State::new(Policy::Lru);
        let mut lfu = State::new("lfu".parse().unwrap());
        for s in [&mut lru, &mut lfu] {
            for e in [0, 0, 0, 1, 2] {
                s.touch((0, e));
            }
        }
        let all = || (0..3).map(|e| (e, (0, e)));
        assert_eq!(lru.victim(all()), Some(0), "expert 0 was used longest ago");
        assert_eq!(
            lfu.victim(all()),
            Some(1),
            "experts 1 and 2 were used once; the lower slot wins the tie"
        );
        assert!("mru"
            .parse::<Policy>()
            .unwrap_err()
            .contains("lru, lfu or blend"));
    }
}
