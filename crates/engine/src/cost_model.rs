//! How many guesses a speculative step checks, from measurements: a pass over k+1 rows costs what it costs in
//! this configuration (the union of the rows' experts that are not cached, the spine layers that stream, the
//! compute), and yields 1 + the guesses taken. Each step picks the k with the most expected tokens per second —
//! 0 (a plain step) whenever guessing would not pay. It only decides how many tokens a pass checks, never
//! which tokens come out.

/// Weight of a new measurement in the running averages of pass and drafting times.
const SMOOTHING: f64 = 0.25;
/// How much of the acceptance history each new comparison keeps: costs and drafters' luck drift.
const MEMORY: f64 = 0.95;
/// Steps after which a neighbour of the best k is tried instead, so that its cost and acceptance stay
/// measured as they move (the cache warms, text turns repetitive): one guess after this many plain steps in a
/// row, and every half as many steps one more or one fewer than the best when guessing.
const PROBE_EVERY: usize = 32;

pub struct CostModel {
    /// Running average of the seconds of a decode pass by its rows − 1 (taking its logits included, drafting
    /// not); `None` until measured.
    pass: Vec<Option<f64>>,
    /// Running average of the seconds the drafter spends per guess.
    guess: f64,
    /// Per guess position: (taken, compared), decayed, counting only comparisons whose earlier guesses were
    /// taken — the chance of a guess being taken given its predecessors were.
    accept: Vec<(f64, f64)>,
    /// Steps since the last probe, and whether the next probe of a guessing k tries one more (or one fewer).
    since_probe: usize,
    probe_up: bool,
}

impl CostModel {
    /// For up to `max` guesses per pass.
    pub fn new(max: usize) -> CostModel {
        CostModel {
            pass: vec![None; max + 1],
            guess: 0.0,
            accept: vec![(0.0, 0.0); max],
            since_probe: 0,
            probe_up: true,
        }
    }

    /// Guesses to check in the next pass, at most `room`. A row count not measured yet is estimated by
    /// extending the measured ones in a straight line (at no extra cost beyond the largest measured until a
    /// second is known), and tried only one row beyond the largest measured: growing k costs one probe a row.
    pub fn choose(&mut self, room: usize) -> usize {
        let Some(plain) = self.pass[0] else {
            return 0;
        };
        let measured = self.pass.iter().rposition(Option::is_some).unwrap_or(0);
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
            PROBE_EVERY
        } else {
            PROBE_EVERY / 2
        };
        if self.since_probe < every {
            return best;
        }
        self.since_probe = 0;
        self.probe_up = !self.probe_up;
        if best == 0 || (!self.probe_up && best < most) {
            best + 1
        } else {
            best - 1
        }
    }

    /// A decode pass over `rows` rows took `secs`.
    pub fn passed(&mut self, rows: usize, secs: f64) {
        if let Some(slot) = self.pass.get_mut(rows - 1) {
            *slot = Some(slot.map_or(secs, |avg| avg + SMOOTHING * (secs - avg)));
        }
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
        if let Some(secs) = self.pass[at] {
            return secs;
        }
        let measured = |r: &usize| self.pass[*r].map(|s| (*r as f64, s));
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

    #[test]
    fn measures_a_plain_step_first_then_grows_one_row_at_a_time() {
        let mut m = CostModel::new(4);
        assert_eq!(m.choose(10), 0, "nothing measured: a plain step");
        m.passed(1, 1.0);
        assert_eq!(m.choose(10), 1, "a second row looks free until measured");
        m.passed(2, 1.0);
        m.compared(1, 1);
        assert_eq!(m.choose(10), 2);
        assert_eq!(m.choose(1), 1, "never more than the room left");
    }

    #[test]
    fn stops_guessing_when_rows_cost_as_much_as_passes() {
        let mut m = CostModel::new(4);
        m.passed(1, 1.0);
        m.passed(2, 2.0);
        for _ in 0..20 {
            m.compared(1, 1);
        }
        // Even always taken, 2 tokens for 2 seconds is no better than plain; any drafting cost makes it worse.
        m.guessed(1, 0.1);
        assert_eq!(m.choose(10), 0);
        // Until the probe after PROBE_EVERY plain steps.
        let probes = (0..PROBE_EVERY).filter(|_| m.choose(10) == 1).count();
        assert_eq!(probes, 1);
    }

    #[test]
    fn the_neighbours_of_a_guessing_k_are_probed_in_turn() {
        let mut m = CostModel::new(4);
        m.passed(1, 1.0);
        m.passed(2, 1.0);
        m.passed(3, 3.0);
        for _ in 0..50 {
            m.compared(2, 1);
        }
        let picks: Vec<usize> = (0..PROBE_EVERY).map(|_| m.choose(10)).collect();
        assert_eq!(picks.iter().filter(|&&k| k == 1).count(), PROBE_EVERY - 2);
        assert_eq!(picks.iter().filter(|&&k| k == 0).count(), 1);
        assert_eq!(picks.iter().filter(|&&k| k == 2).count(), 1);
    }

    #[test]
    fn cheap_rows_and_good_guesses_pay_for_more_guesses() {
        let mut m = CostModel::new(4);
        m.passed(1, 1.0);
        m.passed(2, 1.1);
        m.passed(3, 1.2);
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
        let mut m = CostModel::new(6);
        m.passed(1, 1.0);
        m.passed(3, 2.0);
        m.passed(6, 5.0);
        assert_eq!(m.estimate(2), 1.5);
        assert_eq!(m.estimate(4), 3.0);
        m.pass[5] = None;
        assert_eq!(m.estimate(5), 3.0, "extended from the two largest measured");
    }
}
