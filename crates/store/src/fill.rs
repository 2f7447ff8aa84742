//! The background fill: when the cache has a slot for every routed expert, the records nobody asked for yet
//! are read into free slots from idle drive time, so a model that fits in memory ends up decoding from
//! memory without paying for it before the first token.
//!
//! The reads go in file order, in large chunks, at the lowest priority of the read engine (demand, then
//! lookahead, then this), a few records at a time. The fill only takes free slots (it never evicts) and
//! stops when every record is in; a record a pass asks for while its fill read is queued is promoted to
//! demand. Cached bytes never change a result, so neither does the fill.

use crate::{ExpertStore, Key, Phase, Priority};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Duration;

/// Chunk size of fill reads: sequential, so larger than the demand chunk.
pub(crate) const CHUNK_BYTES: usize = 4 << 20;

/// Records being filled at once.
const RECORDS_IN_FLIGHT: usize = 2;

impl ExpertStore {
    /// Starts the fill on its own thread when every record fits in the cache (otherwise there is nothing to
    /// fill without evicting). It begins after the first demand, and ends when the cache is full or the
    /// store is dropped.
    pub fn fill_in_background(self: &Arc<Self>) {
        if !self.holds_every_record() || self.records_cached().0 == 0 {
            return;
        }
        let mut order: Vec<Key> = self
            .layers
            .iter()
            .enumerate()
            .flat_map(|(l, recs)| (0..recs.len()).map(move |e| (l, e)))
            .collect();
        order.sort_by_key(|&(l, e)| {
            let x = &self.layers[l][e].extents[0];
            (x.file, x.offset)
        });
        let (store, notify) = (Arc::downgrade(self), self.notify.clone());
        std::thread::Builder::new()
            .name("deltafin-fill".into())
            .spawn(move || fill(store, order, &notify))
            .expect("spawn the fill thread");
    }
}

fn fill(
    store: Weak<ExpertStore>,
    order: Vec<Key>,
    notify: &(std::sync::Mutex<()>, std::sync::Condvar),
) {
    let mut next = order.into_iter().peekable();
    let mut in_flight = Vec::new();
    loop {
        {
            // Held only between waits, so dropping the model is never held up.
            let Some(s) = store.upgrade() else { return };
            if s.counters.requests.load(Ordering::Relaxed) > 0 {
                in_flight.retain(|d: &Arc<crate::Completion>| !d.is_done());
                while in_flight.len() < RECORDS_IN_FLIGHT {
                    let Some(key) = next.next() else { break };
                    // Asked before the slab lock: the backfill takes its own lock first.
                    if s.backfill
                        .as_ref()
                        .is_some_and(|b| !b.present(key.0, key.1))
                    {
                        continue;
                    }
                    let mut st = s.state.lock().unwrap();
                    if st.map.contains_key(&key) {
                        continue;
                    }
                    let Some(slot) = st.slots.iter().position(|x| x.phase == Phase::Empty) else {
                        return;
                    };
                    s.start_load(&mut st, slot, key, Priority::Background);
                    in_flight.extend(st.slots[slot].done.clone());
                }
                if in_flight.is_empty() && next.peek().is_none() {
                    return;
                }
            }
        }
        let g = notify.0.lock().unwrap();
        let _ = notify.1.wait_timeout(g, Duration::from_millis(20)).unwrap();
    }
}
