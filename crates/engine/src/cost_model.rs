//! How many guesses a speculative step checks, from measurements: a pass over k+1 rows costs what it costs in
//! this configuration (the union of the rows' experts that are not cached, the spine layers that stream, the
//! compute), and yields 1 + the guesses taken. Each step picks the k with the most expected tokens per second —
//! 0 (a plain step) whenever guessing would not pay. It only decides how many tokens a pass checks, never
//! which tokens come out.

use std::collections::VecDeque;

/// Weight of a new measurement in the running average of drafting times.
const SMOOTHING: f64 = 0.25;
/// Recent passes per row count whose fastest is its cost: waiting on a shared machine (other processes, a
/// cache filling in the background) only ever adds time — a pass can take several times as long as the next —
/// so the fastest of the last few is the cost of the work, and follows a lasting change within a few passes.
const RECENT: usize = 5;
/// Plain passes measured before the first guess: the baseline everything is compared with.
const PLAIN_FIRST: usize = 3;
/// How much of the acceptance history each new comparison keeps: costs and drafters' luck drift.
const MEMORY: f64 = 0.95;
/// Steps after which a neighbour of the best k is tried instead, so that its cost and acceptance stay
/// measured as they move (the cache warms, text turns repetitive): one guess after this many plain steps in a
/// row — twice as many after each probe that changed nothing, up to `PROBE_EVERY_MOST`, as a probe costs
/// where guessing does not pay — and every quarter as many steps one more or one fewer than the best when
/// guessing.
const PROBE_EVERY: usize = 32;
const PROBE_EVERY_MOST: usize = 256;

pub struct CostModel {
    /// Seconds of the most recent decode passes by their rows − 1 (taking their logits included, drafting
    /// not); empty until measured. The first pass of each row count is not counted: it warms caches and
    /// allocates buffers, and can take several times as long.
    pass: Vec<VecDeque<f64>>,
    warmed: Vec<bool>,
    /// Running average of the seconds the drafter spends per guess.
    guess: f64,
    /// Per guess position: (taken, compared), decayed, counting only comparisons whose earlier guesses were
    /// taken — the chance of a guess being taken given its predecessors were.
    accept: Vec<(f64, f64)>,
    /// Steps since the last probe, plain steps in a row before the next probe of a guess, and whether the
    /// next probe of a guessing k tries one more (or one fewer).
    since_probe: usize,
    plain_probe_every: usize,
    probe_up: bool,
}

impl CostModel {
    /// For up to `max` guesses per pass.
    pub fn new(max: usize) -> CostModel {
        CostModel {
            pass: vec![VecDeque::with_capacity(RECENT); max + 1],
            warmed: vec![false; max + 1],
            guess: 0.0,
            accept: vec![(0.0, 0.0); max],
            since_probe: 0,
            plain_probe_every: PROBE_EVERY,
            probe_up: true,
        }
    }

    /// Guesses to check in the next pass, at most `room`. A row count not measured yet is estimated by
    /// extending the measured ones in a straight line (at no extra cost beyond the largest measured until a
    /// second is known), and tried only one row beyond the largest measured: growing k costs one probe a row.
    pub fn choose(&mut self, room: usize) -> usize {
        let Some(plain) = self.cost(0).filter(|_| self.pass[0].len() >= PLAIN_FIRST) else {
            return 0;
        };
        let measured = (0..self.pass.len())
            .rfind(|&r| !self.pass[r].is_empty())
            .unwrap_or(0);
        let (mut best, mut best_rate) = (0, 1.0 / plain);
        for k in 1..=room.min(measured + 1).min(self.accept.len()) {
            let rate = self.expected_tokens(k) / (self.estimate(k + 1) + k as f64 * self.guess);
            if rate > best_rate {
                (best, best_rate) = (k, rate);
            }
        }
        self.probe(best, room.min(self.accept.len()))
    }

    /// `best`, or — every so often — a neighbour of it up to `most`.
    fn probe(&mut self, best: usize, most: usize) -> usize {
        if most == 0 {
            return 0;
        }
        self.since_probe += 1;
        let every = if best == 0 {
            self.plain_probe_every
        } else {
            self.plain_probe_every = PROBE_EVERY;
            PROBE_EVERY / 4
        };
        if self.since_probe < every {
            return best;
        }
        self.since_probe = 0;
        if best == 0 {
            self.plain_probe_every = (2 * every).min(PROBE_EVERY_MOST);
        }
        self.probe_up = !self.probe_up;
        if best == 0 || (!self.probe_up && best < most) {
            best + 1
        } else {
            best - 1
        }
    }

    /// A decode pass over `rows` rows took `secs`.
    pub fn passed(&mut self, rows: usize, secs: f64) {
        let at = rows - 1;
        if at >= self.pass.len() || !std::mem::replace(&mut self.warmed[at], true) {
            return;
        }
        let recent = &mut self.pass[at];
        if recent.len() == RECENT {
            recent.pop_front();
        }
        recent.push_back(secs);
    }

    /// The fastest of the recent passes with `at` + 1 rows.
    fn cost(&self, at: usize) -> Option<f64> {
        self.pass[at].iter().copied().min_by(f64::total_cmp)
    }

    /// The drafter took `secs` to make `guesses` guesses.
    pub fn guessed(&mut self, guesses: usize, secs: f64) {
        if guesses > 0 {
            self.guess += SMOOTHING * (secs / guesses as f64 - self.guess);
        }
    }

    /// A pass compared `compared` guesses with the model's choices and took the first `taken`.
    pub fn compared(&mut self, compared: usize, taken: usize) {
        for (i, (t, c)) in self.accept.iter_mut().enumerate().take(compared) {
            *t = *t * MEMORY + f64::from(u8::from(i < taken));
            *c = *c * MEMORY + 1.0;
        }
    }

    /// Tokens a pass checking `k` guesses yields on average: the chosen one, and each guess while all before
    /// it were taken. With no history a guess counts as even odds.
    fn expected_tokens(&self, k: usize) -> f64 {
        let mut all_taken = 1.0;
        let mut tokens = 1.0;
        for &(t, c) in &self.accept[..k] {
            all_taken *= (t + 1.0) / (c + 2.0);
            tokens += all_taken;
        }
        tokens
    }

    /// Seconds of a pass over `rows` rows: measured, or on the line through the nearest measured row counts.
    fn estimate(&self, rows: usize) -> f64 {
        let at = rows - 1;
        if let Some(secs) = self.cost(at) {
            return secs;
        }
        let measured = |r: &usize| self.cost(*r).map(|s| (*r as f64, s));
        let below: Vec<(f64, f64)> = (0..at).rev().filter_map(|r| measured(&r)).take(2).collect();
        let above = (at + 1..self.pass.len()).find_map(|r| measured(&r));
        let (lo, hi) = match (below.as_slice(), above) {
            ([lo, ..], Some(hi)) => (*lo, hi),
            ([hi, lo], None) => (*lo, *hi),
            ([only], None) => return only.1,
            _ => unreachable!("a plain pass is measured before any guess"),
        };
        let slope = ((hi.1 - lo.1) / (hi.0 - lo.0)).max(0.0);
        lo.1 + slope * (at as f64 - lo.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A model whose passes of each row count took `secs` (index: rows − 1), enough times to be trusted.
    fn measured(max: usize, secs: &[f64]) -> CostModel {
        let mut m = CostModel::new(max);
        for (at, &s) in secs.iter().enumerate() {
            for _ in 0..=PLAIN_FIRST {
                m.passed(at + 1, s);
            }
        }
        m
    }

    #[test]
    fn measures_plain_steps_first_then_grows_one_row_at_a_time() {
        let mut m = CostModel::new(4);
        for _ in 0..PLAIN_FIRST {
            assert_eq!(
                m.choose(10),
                0,
                "plain steps until the baseline is measured"
            );
            m.passed(1, 1.0);
        }
        assert_eq!(m.choose(10), 0, "the first pass only warmed up");
        m.passed(1, 1.0);
        assert_eq!(m.choose(10), 1, "a second row looks free until measured");
        m.passed(2, 5.0);
        assert_eq!(m.choose(10), 1, "a first pass of two rows does not count");
        m.passed(2, 1.0);
        m.compared(1, 1);
        assert_eq!(m.choose(10), 2);
        assert_eq!(m.choose(1), 1, "never more than the room left");
    }

    #[test]
    fn a_spike_is_not_the_cost() {
        let mut m = measured(1, &[1.0, 1.0]);
        m.passed(2, 50.0);
        assert_eq!(m.estimate(2), 1.0);
    }

    #[test]
    fn stops_guessing_when_rows_cost_as_much_as_passes() {
        let mut m = measured(4, &[1.0, 2.0]);
        for _ in 0..20 {
            m.compared(1, 1);
        }
        // Even always taken, 2 tokens for 2 seconds is no better than plain; any drafting cost makes it worse.
        m.guessed(1, 0.1);
        assert_eq!(m.choose(10), 0);
        // Until the probe after PROBE_EVERY plain steps; the next comes after twice as many.
        let first = (2..).find(|_| m.choose(10) == 1);
        assert_eq!(first, Some(PROBE_EVERY));
        let next = (1..).find(|_| m.choose(10) == 1);
        assert_eq!(next, Some(2 * PROBE_EVERY));
    }

    #[test]
    fn the_neighbours_of_a_guessing_k_are_probed_in_turn() {
        let mut m = measured(4, &[1.0, 1.0, 3.0]);
        for _ in 0..50 {
            m.compared(2, 1);
        }
        let picks: Vec<usize> = (0..PROBE_EVERY / 2).map(|_| m.choose(10)).collect();
        assert_eq!(
            picks.iter().filter(|&&k| k == 1).count(),
            PROBE_EVERY / 2 - 2,
            "{picks:?}"
        );
        assert_eq!(picks.iter().filter(|&&k| k == 0).count(), 1);
        assert_eq!(picks.iter().filter(|&&k| k == 2).count(), 1);
    }

    #[test]
    fn cheap_rows_and_good_guesses_pay_for_more_guesses() {
        let mut m = measured(4, &[1.0, 1.1, 1.2]);
        for _ in 0..50 {
            m.compared(2, 2);
        }
        assert_eq!(m.choose(10), 3, "one row beyond the measured is tried");
        // A drafter that is always wrong: back to plain steps.
        for _ in 0..100 {
            m.compared(1, 0);
        }
        assert_eq!(m.choose(10), 0);
    }

    #[test]
    fn unmeasured_rows_lie_on_the_line_through_the_measured() {
        let mut m = measured(6, &[1.0, 0.0, 2.0, 0.0, 0.0, 5.0]);
        for at in [1, 3, 4] {
            m.pass[at].clear();
        }
        assert_eq!(m.estimate(2), 1.5);
        assert_eq!(m.estimate(4), 3.0);
        m.pass[5].clear();
        assert_eq!(m.estimate(5), 3.0, "extended from the two largest measured");
    }
}
