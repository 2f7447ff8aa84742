//! `run --timeline`: where a decode step's time goes on the GPU, launch by launch.
//!
//! With the timeline on, the kernels are compiled with `DELTAFIN_TIMELINE`: thread 0 of every block notes the
//! moment (`%globaltimer`, ns) it is past its `pdl_wait`, which is when the kernel before it has finished. Every
//! kernel on the compute stream waits once a block at one row, so a decode pass's notes are its launches' blocks;
//! after the pass's last kernel a one-block `timeline_mark` notes when that one finished. With programmatic launch
//! the kernels overlap, and what a launch costs the step is the time from the kernel before it finishing to it
//! finishing: the knock-out's marginal cost, for every launch of one run at once.

use std::collections::BTreeMap;
use std::sync::Mutex;

/// Each launch's cost on the critical path, from its blocks' notes (`blocks[i]` blocks for launch i, in launch
/// order; `stamps` in any order). Launch i's blocks all pass their wait after launch i−1 has finished and before
/// launch i has, so in time order they are consecutive runs of each launch's block count, and launch i costs the
/// time from its first note to launch i+1's first note. The last launch only marks the end: one cost fewer than
/// launches. None when the notes do not add up to the blocks (some were lost, or a block waited twice).
pub fn critical_path(blocks: &[u32], stamps: &mut [u64]) -> Option<Vec<u64>> {
    if blocks.is_empty() || blocks.iter().map(|&b| b as usize).sum::<usize>() != stamps.len() {
        return None;
    }
    stamps.sort_unstable();
    let mut at = 0;
    let first: Vec<u64> = blocks
        .iter()
        .map(|&b| {
            let t = stamps[at];
            at += b as usize;
            t
        })
        .collect();
    Some(first.windows(2).map(|w| w[1] - w[0]).collect())
}

/// The timeline's device buffer and what the passes so far added up to.
pub struct Timeline {
    /// Device addresses of kernels.cu's `timeline` notes and `timeline_n` count, and how many notes fit.
    pub(crate) notes: u64,
    pub(crate) count: u64,
    pub(crate) cap: usize,
    /// This pass's launches on the compute stream, in order: (label, blocks).
    launches: Mutex<Vec<(String, u32)>>,
    totals: Mutex<Totals>,
}

#[derive(Default)]
struct Totals {
    /// Per label: launches, and nanoseconds on the critical path, over the decode steps.
    by_label: BTreeMap<String, (u64, u64)>,
    steps: u64,
    /// Decode steps whose notes did not add up (left out of the table).
    unsplit: u64,
}

impl Timeline {
    pub(crate) fn new(notes: u64, count: u64, cap: usize) -> Timeline {
        Timeline {
            notes,
            count,
            cap,
            launches: Mutex::new(Vec::new()),
            totals: Mutex::new(Totals::default()),
        }
    }

    /// A launch on the compute stream, as it is issued.
    pub(crate) fn launched(&self, label: String, blocks: u32) {
        self.launches.lock().unwrap().push((label, blocks));
    }

    /// A pass starts: its launches are counted from here.
    pub(crate) fn begin(&self) {
        self.launches.lock().unwrap().clear();
    }

    /// A decode pass has finished (the device is idle): its notes, read back, are split into its launches.
    pub(crate) fn end_step(&self, notes: &mut [u64]) {
        let launches = std::mem::take(&mut *self.launches.lock().unwrap());
        let blocks: Vec<u32> = launches.iter().map(|l| l.1).collect();
        let mut t = self.totals.lock().unwrap();
        t.steps += 1;
        match critical_path(&blocks, notes) {
            Some(costs) => {
                for ((label, _), ns) in launches.iter().zip(costs) {
                    let e = t.by_label.entry(label.clone()).or_default();
                    e.0 += 1;
                    e.1 += ns;
                }
            }
            None => t.unsplit += 1,
        }
    }

    /// The `[timeline]` table: per kernel (matmuls by shape), launches and milliseconds a decode step, most first.
    pub fn report(&self) -> String {
        let t = self.totals.lock().unwrap();
        let steps = (t.steps - t.unsplit).max(1) as f64;
        let total: u64 = t.by_label.values().map(|v| v.1).sum();
        let mut rows: Vec<_> = t.by_label.iter().collect();
        rows.sort_by_key(|(_, v)| std::cmp::Reverse(v.1));
        let mut s = format!(
            "[timeline] {} decode steps ({} not split), {:.0} launches a step, {:.3} ms a step on the critical path:",
            t.steps - t.unsplit,
            t.unsplit,
            rows.iter().map(|(_, v)| v.0).sum::<u64>() as f64 / steps,
            total as f64 / steps / 1e6
        );
        for (label, (n, ns)) in rows {
            s.push_str(&format!(
                "\n  {label:<28} {:>5.1} a step {:>8.1} us {:>5.1}%",
                *n as f64 / steps,
                *ns as f64 / steps / 1e3,
                100.0 * *ns as f64 / total.max(1) as f64
            ));
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_launch_costs_the_time_until_the_next_one_starts() {
        // Three launches of 2, 3 and 1 blocks; the notes arrive out of order.
        let mut stamps = vec![130, 100, 104, 181, 135, 140];
        assert_eq!(critical_path(&[2, 3, 1], &mut stamps), Some(vec![30, 51]));
    }

    #[test]
    fn equal_stamps_across_a_boundary_still_split() {
        let mut stamps = vec![10, 20, 20, 20, 30];
        assert_eq!(critical_path(&[2, 2, 1], &mut stamps), Some(vec![10, 10]));
    }

    #[test]
    fn notes_that_do_not_add_up_are_refused() {
        assert_eq!(critical_path(&[2, 3], &mut [1, 2, 3, 4]), None);
        assert_eq!(critical_path(&[], &mut []), None);
    }

    #[test]
    fn the_report_averages_over_the_steps() {
        let t = Timeline::new(0, 0, 0);
        for _ in 0..2 {
            t.begin();
            t.launched("a".into(), 1);
            t.launched("b".into(), 2);
            t.launched("timeline_mark".into(), 1);
            t.end_step(&mut [0, 3000, 3000, 5000]);
        }
        let r = t.report();
        assert!(
            r.contains("2 decode steps (0 not split), 2 launches a step, 0.005 ms"),
            "{r}"
        );
        // Most first: a (3 us of the 5), then b.
        let rows: Vec<Vec<&str>> = r
            .lines()
            .skip(1)
            .map(|l| l.split_whitespace().collect())
            .collect();
        assert_eq!(
            rows[0],
            ["a", "1.0", "a", "step", "3.0", "us", "60.0%"],
            "{r}"
        );
        assert_eq!(
            rows[1],
            ["b", "1.0", "a", "step", "2.0", "us", "40.0%"],
            "{r}"
        );
    }
}
