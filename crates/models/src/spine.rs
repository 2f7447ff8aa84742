//! The spine under a memory budget: layers that fit stay resident; the rest are read from the checkpoint on
//! every pass, one layer ahead on a background thread (double buffering), so a multi-token pass pays for a
//! streamed layer once for all its rows.

use anyhow::{anyhow, Result};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

type LoadFn<L> = Arc<dyn Fn(usize) -> Result<L> + Send + Sync>;

pub struct Spine<L> {
    /// `Some` for resident layers.
    held: Vec<Option<Arc<L>>>,
    load: LoadFn<L>,
    /// Nanoseconds walks have waited for a streamed layer to arrive: what streaming costs a pass beyond its
    /// compute (speculation's cost model reads it).
    waited_ns: AtomicU64,
}

impl<L: Send + Sync + 'static> Spine<L> {
    /// Loads the `resident` layers now; the others on each pass.
    pub fn new(resident: &[bool], load: LoadFn<L>) -> Result<Spine<L>> {
        let held = resident
            .iter()
            .enumerate()
            .map(|(l, &r)| {
                if r {
                    load(l).map(|x| Some(Arc::new(x)))
                } else {
                    Ok(None)
                }
            })
            .collect::<Result<_>>()?;
        Ok(Spine {
            held,
            load,
            waited_ns: AtomicU64::new(0),
        })
    }

    pub fn len(&self) -> usize {
        self.held.len()
    }

    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }

    pub fn streamed(&self) -> usize {
        self.held.iter().filter(|h| h.is_none()).count()
    }

    /// Seconds walks have waited so far for streamed layers to be read.
    pub fn waited_secs(&self) -> f64 {
        self.waited_ns.load(Ordering::Relaxed) as f64 * 1e-9
    }

    /// Visits the layers in order with `(index, layer, next layer if resident)`.
    pub fn walk(&self, mut visit: impl FnMut(usize, &L, Option<&L>) -> Result<()>) -> Result<()> {
        let mut ahead = self.spawn_from(0);
        for l in 0..self.held.len() {
            let layer = match &self.held[l] {
                Some(x) => x.clone(),
                None => {
                    let (i, handle) = ahead
                        .take()
                        .expect("a streamed layer is always loading ahead");
                    debug_assert_eq!(i, l);
                    let t0 = Instant::now();
                    let loaded = handle
                        .join()
                        .map_err(|_| anyhow!("the loader of layer {l} panicked"))??;
                    self.waited_ns
                        .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
                    ahead = self.spawn_from(l + 1);
                    Arc::new(loaded)
                }
            };
            let next = self.held.get(l + 1).and_then(|x| x.as_deref());
            visit(l, &layer, next)?;
        }
        Ok(())
    }

    /// Starts loading the first streamed layer at or after `from`.
    fn spawn_from(&self, from: usize) -> Option<(usize, JoinHandle<Result<L>>)> {
        let l = (from..self.held.len()).find(|&i| self.held[i].is_none())?;
        let load = self.load.clone();
        Some((l, std::thread::spawn(move || load(l))))
    }

    /// Resident layers (all of them when nothing streams), for state set-up.
    pub fn resident(&self, l: usize) -> Option<&L> {
        self.held[l].as_deref()
    }
}

/// Which layers stay resident: in order from layer 0, while their bytes fit in `allowance`.
pub fn plan_resident(layer_bytes: &[u64], allowance: u64) -> Vec<bool> {
    let mut used = 0;
    let mut fits = true;
    layer_bytes
        .iter()
        .map(|&b| {
            fits = fits && used + b <= allowance;
            if fits {
                used += b;
            }
            fits
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn streamed_layers_are_loaded_on_every_walk_in_order() {
        let loads = Arc::new(AtomicUsize::new(0));
        let counter = loads.clone();
        let spine = Spine::new(
            &[true, false, true, false],
            Arc::new(move |l| {
                counter.fetch_add(1, Ordering::SeqCst);
                Ok(l * 10)
            }),
        )
        .unwrap();
        assert_eq!(
            loads.load(Ordering::SeqCst),
            2,
            "resident layers load once, up front"
        );
        for pass in 1..=2 {
            let mut seen = Vec::new();
            spine
                .walk(|l, x, next| {
                    seen.push((l, *x, next.copied()));
                    Ok(())
                })
                .unwrap();
            assert_eq!(
                seen,
                vec![
                    (0, 0, None),
                    (1, 10, Some(20)),
                    (2, 20, None),
                    (3, 30, None)
                ]
            );
            assert_eq!(
                loads.load(Ordering::SeqCst),
                2 + 2 * pass,
                "streamed layers load on each pass"
            );
        }
    }

    #[test]
    fn plan_keeps_a_prefix_that_fits() {
        assert_eq!(
            plan_resident(&[4, 4, 4, 1], 9),
            vec![true, true, false, false]
        );
        assert_eq!(plan_resident(&[4, 4], 100), vec![true, true]);
    }
}
