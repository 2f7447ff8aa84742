//! How many guesses a speculative step checks, from measurements: a pass over k+1 rows costs what it costs in
//! this configuration and yields 1 + the guesses taken. Each step picks the k with the most expected tokens per
//! second — 0 (a plain step) whenever guessing would not pay. It only decides how many tokens a pass checks,
//! never which tokens come out.
//!
//! A pass's cost is modelled from what it is made of, so that a k never tried is predicted rather than
//! explored blindly: the spine layers that stream (one read serves every row), the routed experts that are not
//! cached (the union of the rows' experts: read time per byte of one row's, times how the union grows with
//! rows) and the rest — compute — which grows with the rows. Each part is measured on the passes run.

use std::collections::VecDeque;

/// Weight of a new measurement in the running average of drafting times.
const SMOOTHING: f64 = 0.25;
/// Recent passes kept per row count. Row counts are compared over the same number of their latest passes, by
/// medians: a pass can take several times as long as the next on a shared machine, and the fastest of many
/// plain passes against one or two of a guessing k would bias the choice against guessing.
const RECENT: usize = 8;
/// Plain passes measured before the first guess: the baseline everything is compared with. A pass of two
/// rows is measured next, whatever it costs: with the plain pass, it shows how much of a pass its rows share.
/// Then the baseline is measured again: the first passes of a run fill caches and touch buffers for the first
/// time, and took 4–6× a later plain pass on the built-in model (BENCHMARKS.md, "Stop 27"), which made the
/// first guesses look 2–3× faster than they were.
const PLAIN_FIRST: usize = 3;
/// How much of the acceptance history each new comparison keeps: costs and drafters' luck drift.
const MEMORY: f64 = 0.95;
/// Steps after which a neighbour of the best k is tried instead, so that its cost and acceptance stay
/// measured as they move (the cache warms, text turns repetitive): one guess after this many plain steps in a
/// row — twice as many after each probe that changed nothing (once two rows are measured `PLAIN_FIRST`
/// times), four times as many — and from the start — where guessing is predicted to lose clearly (below
/// `CLEAR_LOSS` of plain speed), up to `PROBE_EVERY_MOST`, as a probe costs where guessing does not pay (a check, and a drafting model's
/// catch-up: ~8 ms, 2% of a 300-token decode of the built-in model) — and every quarter as many steps one
/// more or one fewer than the best when guessing.
const PROBE_EVERY: usize = 32;
const PROBE_EVERY_MOST: usize = 256;
const CLEAR_LOSS: f64 = 0.8;
/// And never more often than keeps probes within this share of the decode time, by what a probe (a pass of two
/// rows and a guess) costs over a plain step as measured: where a plain step is cheap against the drafter — a
/// GPU step of 0.35 ms against a CPU drafter's 32-token catch-up of ~9 ms — probes are rarer than the back-off
/// alone would make them (up to `PROBE_COST_MOST` plain steps apart).
const PROBE_SHARE: f64 = 1.0 / 32.0;
const PROBE_COST_MOST: usize = 4096;

/// What one decode pass cost, measured around it.
#[derive(Clone, Copy, Debug, Default)]
pub struct PassCost {
    /// Wall seconds (taking its logits and rolling back included, drafting not).
    pub secs: f64,
    /// Of which waiting for streamed spine layers.
    pub spine_wait: f64,
    /// Of which waiting for routed experts to be read.
    pub expert_wait: f64,
    /// Routed-expert bytes the pass read (the union of its rows' experts that were not cached).
    pub expert_bytes: f64,
}

impl PassCost {
    /// What is neither read wait: compute and overheads, with `spine` the spine wait the model assumes.
    fn work(&self, spine: f64) -> f64 {
        self.secs - spine - self.expert_wait
    }
}

pub struct CostModel {
    /// The most recent decode passes by their rows − 1; empty until measured. The first pass of each row
    /// count is not counted: it warms caches and allocates buffers, and can take several times as long.
    pass: Vec<VecDeque<PassCost>>,
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

    /// Guesses to check in the next pass, at most `room`: the k whose predicted pass cost (plus drafting)
    /// buys the most expected tokens per second, against a plain pass predicted from as many latest passes.
    pub fn choose(&mut self, room: usize) -> usize {
        if self.pass[0].len() < PLAIN_FIRST || room == 0 || self.accept.is_empty() {
            return 0;
        }
        if self.pass[1].is_empty() {
            // Two points make a line: one guess until a pass of two rows is measured (its first only warms
            // up) tells how much of a pass its rows share.
            return 1;
        }
        let (mut best, mut best_gain) = (0, 0.0);
        for k in 1..=room.min(self.accept.len()) {
            let n = self.samples(k + 2);
            let per_token =
                (self.estimate(k + 1, n) + k as f64 * self.guess) / self.expected_tokens(k);
            let gain = self.estimate(1, n) / per_token;
            if gain > best_gain {
                (best, best_gain) = (k, gain);
            }
        }
        if best_gain <= 1.0 {
            best = 0;
        }
        self.probe(best, best_gain, room.min(self.accept.len()))
    }

    /// The fewest plain steps between probes that keeps them within `PROBE_SHARE` of the time: what a probe (a
    /// pass of two rows and a guess) costs over a plain step, in plain steps, over the share.
    fn probes_apart(&self) -> usize {
        let n = self.samples(2);
        let plain = self.estimate(1, n);
        let extra = (self.estimate(2, n) + self.guess - plain) / plain;
        (extra / PROBE_SHARE)
            .ceil()
            .clamp(0.0, PROBE_COST_MOST as f64) as usize
    }

    /// Latest passes per row count that estimates up to `rows` rows compare: the fewest any measured row count
    /// up to there has, so that a row count measured once is not set against the best of many plain passes.
    fn samples(&self, rows: usize) -> usize {
        self.pass
            .iter()
            .take(rows)
            .map(VecDeque::len)
            .filter(|&len| len > 0)
            .min()
            .unwrap_or(0)
    }

    /// `best`, or — every so often — a neighbour of it up to `most`. `gain`: the best guessing k's predicted
    /// speed relative to plain steps.
    fn probe(&mut self, best: usize, gain: f64, most: usize) -> usize {
        if most == 0 {
            return 0;
        }
        self.since_probe += 1;
        let every = if best == 0 {
            let clear_loss_floor = if gain < CLEAR_LOSS {
                4 * PROBE_EVERY
            } else {
                0
            };
            self.plain_probe_every
                .max(clear_loss_floor)
                .max(self.probes_apart())
        } else {
            self.plain_probe_every = PROBE_EVERY;
            PROBE_EVERY / 4
        };
        if self.since_probe < every {
            return best;
        }
        self.since_probe = 0;
        // Backing off only once a pass of two rows has been measured a few times — one noisy pass must not
        // keep guessing off for hundreds of steps — unless guessing is predicted to lose clearly.
        if best == 0 && gain < CLEAR_LOSS {
            self.plain_probe_every = (4 * every).min(PROBE_EVERY_MOST);
        } else if best == 0 && self.pass[1].len() >= PLAIN_FIRST {
            self.plain_probe_every = (2 * every).min(PROBE_EVERY_MOST);
        }
        self.probe_up = !self.probe_up;
        if best == 0 || (!self.probe_up && best < most) {
            best + 1
        } else {
            best - 1
        }
    }

    /// A decode pass over `rows` rows cost `cost`.
    pub fn passed(&mut self, rows: usize, cost: PassCost) {
        let at = rows - 1;
        if at >= self.pass.len() || !std::mem::replace(&mut self.warmed[at], true) {
            return;
        }
        if at > 0 && self.pass[1..].iter().all(VecDeque::is_empty) {
            self.pass[0].clear();
        }
        let recent = &mut self.pass[at];
        if recent.len() == RECENT {
            recent.pop_front();
        }
        recent.push_back(cost);
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

    /// Predicted seconds of a pass over `rows` rows (a plain pass measured):
    /// spine wait + one row's expert wait × union(rows) + work(rows).
    fn estimate(&self, rows: usize, n: usize) -> f64 {
        let spine = median(self.pass[0].iter().map(|p| p.spine_wait));
        let expert_wait = median(self.pass[0].iter().map(|p| p.expert_wait));
        spine + expert_wait * self.union(rows) + self.work(rows, spine, n)
    }

    /// Expert bytes `rows` rows read relative to one row's: 1 + u·(rows − 1), with u measured on passes of
    /// several rows (0: they share every expert, 1: none) — until then 1, random routing, nothing shared.
    fn union(&self, rows: usize) -> f64 {
        let one = median(self.pass[0].iter().map(|p| p.expert_bytes));
        let growth = self.pass[1..].iter().enumerate().flat_map(|(at, recent)| {
            recent
                .iter()
                .map(move |p| (p.expert_bytes / one - 1.0) / (at + 1) as f64)
        });
        let u = Some(median(growth)).filter(|u| one > 0.0 && !u.is_nan());
        1.0 + u.unwrap_or(1.0).clamp(0.0, 1.0) * (rows - 1) as f64
    }

    /// Work (what is not read wait: compute, overheads) of a pass over `rows` rows, from each measured row
    /// count's median over its `n` latest passes: a measured count's own, between two on the line
    /// joining them, beyond the largest on the line through the two largest (never falling) — with only plain
    /// passes measured, every row costs a plain pass's work (nothing shared until seen).
    fn work(&self, rows: usize, spine: f64, n: usize) -> f64 {
        let measured = |at: usize| {
            let latest = self.pass[at].iter().rev().take(n);
            Some(((at + 1) as f64, median(latest.map(|p| p.work(spine)))))
                .filter(|_| !self.pass[at].is_empty())
        };
        let at = rows - 1;
        if let Some((_, w)) = measured(at) {
            return w;
        }
        let below: Vec<(f64, f64)> = (0..at).rev().filter_map(measured).take(2).collect();
        let above = (at + 1..self.pass.len()).find_map(measured);
        let (lo, hi) = match (below.as_slice(), above) {
            ([lo, ..], Some(hi)) => (*lo, hi),
            ([hi, lo], None) => (*lo, *hi),
            ([only], None) => return only.1 * rows as f64 / only.0,
            _ => unreachable!("a plain pass is measured before any guess"),
        };
        let slope = ((hi.1 - lo.1) / (hi.0 - lo.0)).max(0.0);
        (lo.1 + slope * (rows as f64 - lo.0)).max(0.0)
    }
}

/// The median of `values` (NaN when there are none).
fn median(values: impl Iterator<Item = f64>) -> f64 {
    let mut v: Vec<f64> = values.collect();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pass of `secs`, of which `spine` and `expert` waited on reads of `bytes` expert bytes.
    fn cost(secs: f64, spine: f64, expert: f64, bytes: f64) -> PassCost {
        PassCost {
            secs,
            spine_wait: spine,
            expert_wait: expert,
            expert_bytes: bytes,
        }
    }

    /// Only compute: each row count's passes took `secs[rows − 1]`, enough times to be trusted (0: not run).
    /// Plain passes last, as the first passes of several rows start the baseline again.
    fn measured(max: usize, secs: &[f64]) -> CostModel {
        let mut m = CostModel::new(max);
        let mut order: Vec<(usize, f64)> = secs.iter().copied().enumerate().collect();
        order.rotate_left(1);
        for (at, s) in order.into_iter().filter(|&(_, s)| s > 0.0) {
            for _ in 0..=PLAIN_FIRST {
                m.passed(at + 1, cost(s, 0.0, 0.0, 0.0));
            }
        }
        m
    }

    /// The baseline measured again after the first passes of several rows.
    fn plain_again(m: &mut CostModel, plain: PassCost) {
        for _ in 0..PLAIN_FIRST {
            m.passed(1, plain);
        }
    }

    /// Plain passes of `plain` only, enough to guess.
    fn plain_only(max: usize, plain: PassCost) -> CostModel {
        let mut m = CostModel::new(max);
        for _ in 0..=PLAIN_FIRST {
            m.passed(1, plain);
        }
        m
    }

    fn always_taken(m: &mut CostModel, k: usize) {
        for _ in 0..50 {
            m.compared(k, k);
        }
    }

    #[test]
    fn measures_plain_steps_first() {
        let mut m = CostModel::new(4);
        for _ in 0..PLAIN_FIRST {
            assert_eq!(
                m.choose(10),
                0,
                "plain steps until the baseline is measured"
            );
            m.passed(1, cost(1.0, 0.9, 0.0, 0.0));
        }
        assert_eq!(m.choose(10), 0, "the first pass only warmed up");
        m.passed(1, cost(1.0, 0.9, 0.0, 0.0));
        assert!(
            m.choose(10) > 0,
            "a streamed spine: guessing is predicted to pay"
        );
        assert_eq!(m.choose(0), 0, "never more than the room left");
        assert_eq!(
            measured(0, &[1.0]).choose(10),
            0,
            "nor than the most guesses"
        );
    }

    /// Experts streamed cold with random routing: a pass of r rows reads r rows' experts and computes r rows,
    /// so it costs r plain passes. Even a drafter always right cannot pay for its own time: no guess beyond
    /// the pass of two rows that measures it.
    #[test]
    fn rows_that_cost_a_pass_each_are_not_guessed() {
        let mut m = plain_only(4, cost(1.0, 0.0, 0.6, 100.0));
        always_taken(&mut m, 4);
        m.guessed(1, 0.01);
        let three = m.estimate(3, 1);
        assert!(
            (three - 3.0).abs() < 1e-9,
            "r rows' experts and compute: r passes, not {three}"
        );
        for _ in 0..=PLAIN_FIRST {
            m.passed(2, cost(2.0, 0.0, 1.2, 200.0));
        }
        plain_again(&mut m, cost(1.0, 0.0, 0.6, 100.0));
        assert_eq!(m.choose(10), 0);
        // How the union grows is measured from the bytes: the routing trace, 3 rows reading 0.88 × 3
        // rows' experts.
        for _ in 0..RECENT {
            m.passed(3, cost(0.6 * 2.64 + 1.2, 0.0, 0.6 * 2.64, 264.0));
        }
        assert!((m.union(3) - 2.64).abs() < 1e-9, "{}", m.union(3));
    }

    /// The spine streamed: one read serves every row, and a row's compute is a fraction of the pass.
    fn spine_streamed() -> CostModel {
        let mut m = plain_only(4, cost(1.0, 0.9, 0.0, 0.0));
        for _ in 0..2 {
            m.passed(2, cost(1.1, 0.9, 0.0, 0.0));
        }
        plain_again(&mut m, cost(1.0, 0.9, 0.0, 0.0));
        m
    }

    /// Measured for one and two rows, guessing is predicted to pay for as many guesses as the drafter earns.
    #[test]
    fn rows_that_are_nearly_free_are_guessed_beyond_the_measured() {
        let mut m = spine_streamed();
        assert!(
            (m.estimate(5, 1) - 1.4).abs() < 1e-9,
            "{}",
            m.estimate(5, 1)
        );
        always_taken(&mut m, 4);
        m.guessed(1, 0.01);
        assert_eq!(m.choose(10), 4);
        assert_eq!(m.choose(2), 2);
    }

    #[test]
    fn adapts_when_acceptance_drops_and_recovers() {
        let mut m = spine_streamed();
        always_taken(&mut m, 4);
        assert_eq!(m.choose(10), 4);
        // The text stops repeating: guesses are refused at the first position.
        for _ in 0..100 {
            m.compared(1, 0);
        }
        assert_eq!(m.choose(10), 0);
        // It repeats again: the probes of one guess see it taken, and guessing resumes.
        let resumed = (0..20 * PROBE_EVERY).find(|_| {
            let k = m.choose(10);
            if k > 0 {
                m.compared(k, k);
            }
            k > 1
        });
        assert!(resumed.is_some());
    }

    /// A machine that got busy: plain passes took 0.5 s, now 1.0 s, and the one pass of three rows measured
    /// since took 1.1 s. Set against the same number of latest plain passes, three rows cost about one.
    #[test]
    fn row_counts_are_compared_over_as_many_latest_passes() {
        let mut m = measured(2, &[0.5, 1.0]);
        for _ in 0..RECENT {
            m.passed(1, cost(0.5, 0.0, 0.0, 0.0));
        }
        m.passed(1, cost(1.0, 0.0, 0.0, 0.0));
        m.passed(3, cost(5.0, 0.0, 0.0, 0.0));
        m.passed(3, cost(1.1, 0.0, 0.0, 0.0));
        always_taken(&mut m, 2);
        assert_eq!(m.samples(4), 1);
        assert_eq!(m.estimate(1, 1), 1.0);
        assert_eq!(m.choose(10), 2);
    }

    /// The run's first passes are slow (caches fill, buffers are touched the first time): measured against
    /// them, two rows at twice a later plain pass would look faster than one.
    #[test]
    fn the_baseline_is_measured_again_after_the_first_rows() {
        let mut m = plain_only(1, cost(5.0, 0.0, 0.0, 0.0));
        always_taken(&mut m, 1);
        m.guessed(1, 0.0);
        assert_eq!(m.choose(10), 1, "two rows are measured next");
        m.passed(2, cost(2.0, 0.0, 0.0, 0.0));
        m.passed(2, cost(2.0, 0.0, 0.0, 0.0));
        for _ in 0..PLAIN_FIRST {
            assert_eq!(m.choose(10), 0, "then plain steps again");
            m.passed(1, cost(1.0, 0.0, 0.0, 0.0));
        }
        assert_eq!(m.estimate(1, 1), 1.0);
        assert_eq!(m.choose(10), 0, "two rows cost two plain passes");
    }

    #[test]
    fn a_spike_is_not_the_cost() {
        let mut m = measured(1, &[1.0, 1.0]);
        m.passed(2, cost(50.0, 0.0, 0.0, 0.0));
        assert_eq!(m.estimate(2, m.samples(2)), 1.0);
    }

    #[test]
    fn plain_probes_back_off_while_guessing_does_not_pay() {
        let mut m = measured(4, &[1.0, 2.0]);
        always_taken(&mut m, 1);
        assert_eq!(m.choose(10), 0);
        // Until the probe after PROBE_EVERY plain steps; the next comes after twice as many.
        let first = (2..).find(|_| m.choose(10) == 1);
        assert_eq!(first, Some(PROBE_EVERY));
        let next = (1..).find(|_| m.choose(10) == 1);
        assert_eq!(next, Some(2 * PROBE_EVERY));
        // Not before a pass of two rows is measured a few times.
        let mut m = measured(4, &[1.0]);
        m.passed(2, cost(2.0, 0.0, 0.0, 0.0));
        m.passed(2, cost(2.0, 0.0, 0.0, 0.0));
        plain_again(&mut m, cost(1.0, 0.0, 0.0, 0.0));
        always_taken(&mut m, 1);
        for _ in 0..3 {
            assert_eq!((1..).find(|_| m.choose(10) == 1), Some(PROBE_EVERY));
        }
        // Unless guessing clearly loses (a drafter as slow as a pass): then four times as many from the start.
        let mut m = measured(4, &[1.0, 2.0]);
        always_taken(&mut m, 1);
        for _ in 0..50 {
            m.guessed(1, 1.0);
        }
        assert_eq!((1..).find(|_| m.choose(10) == 1), Some(4 * PROBE_EVERY));
        assert_eq!((1..).find(|_| m.choose(10) == 1), Some(PROBE_EVERY_MOST));
        // A drafter that costs 30 plain steps a guess (a CPU drafter against GPU steps): probes stay within
        // PROBE_SHARE of the time, (2 + 30 - 1) / PROBE_SHARE = 992 plain steps apart.
        let mut m = measured(4, &[1.0, 2.0]);
        always_taken(&mut m, 1);
        for _ in 0..100 {
            m.guessed(1, 30.0);
        }
        assert_eq!((1..).find(|_| m.choose(10) == 1), Some(992));
        assert_eq!((1..).find(|_| m.choose(10) == 1), Some(992));
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
    fn work_of_unmeasured_rows_lies_on_the_line_through_the_measured() {
        let m = measured(6, &[1.0, 0.0, 2.0, 0.0, 0.0, 5.0]);
        let n = m.samples(7);
        assert_eq!(m.estimate(2, n), 1.5);
        assert_eq!(m.estimate(4, n), 3.0);
        let m = measured(6, &[1.0, 0.0, 2.0, 0.0, 0.0, 0.0]);
        assert_eq!(
            m.estimate(5, n),
            3.0,
            "extended from the two largest measured"
        );
        let m = measured(6, &[1.0]);
        assert_eq!(
            m.estimate(5, n),
            5.0,
            "with plain passes only, each row costs one"
        );
    }
}
