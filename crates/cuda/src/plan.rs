//! Host-side planning, free of any device: which spine layers stay in VRAM, which VRAM slot holds which
//! expert (LRU among unpinned slots), how one layer's experts split into waves when the budget holds fewer
//! slots than the layer needs, the rotation of the pinned staging buffers, and how many x rows a spine
//! matmul stages at once.

use deltafin_models::spine::plan_resident;
use std::collections::HashMap;

/// Which spine layers stay in VRAM under `allowance` bytes: all of them when they fit; otherwise the CPU
/// path's plan (a prefix) in what is left after the two streaming buffers of the largest layer's size.
pub fn plan_spine(layer_bytes: &[u64], allowance: u64) -> Vec<bool> {
    let total: u64 = layer_bytes.iter().sum();
    let largest = layer_bytes.iter().copied().max().unwrap_or(0);
    if total <= allowance {
        return vec![true; layer_bytes.len()];
    }
    plan_resident(layer_bytes, allowance.saturating_sub(2 * largest))
}

/// Shared memory of a `matmul_bf16` block before its x rows: four warps, each a ring of 4 KB pieces (2,048
/// BF16 weights), as many as a row has, at most four (kernels.cu's MM_RING). Short rows then leave room for more
/// blocks an SM.
pub fn matmul_ring_bytes(cols: usize) -> usize {
    4 * cols.div_ceil(2048).clamp(1, 4) * 4096
}

/// How many x rows (at most eight, kernels.cu's MM_TILE) a `matmul_bf16` block stages for a `cols`-column
/// matrix within `smem` bytes of dynamic shared memory; `None` when not even one fits.
pub fn matmul_tile(smem: usize, cols: usize) -> Option<usize> {
    let tile = (smem.saturating_sub(matmul_ring_bytes(cols)) / (4 * cols)).min(8);
    (tile > 0).then_some(tile)
}

/// The most values an AttnRes mix reads on the device (kernels.cu's MIX_VALUES).
pub const MIX_VALUES: usize = 16;

/// How many values a model's widest AttnRes mix reads: every block's anchor, then h (none without AttnRes).
pub fn attn_res_values(num_layers: usize, block: Option<usize>) -> usize {
    block.map_or(0, |b| num_layers.div_ceil(b) + 1)
}

pub type Key = (usize, usize);

/// The VRAM expert cache's bookkeeping: `slots` record-sized slots, least-recently-used eviction among
/// slots not pinned by the wave in flight.
pub struct SlotCache {
    keys: Vec<Option<Key>>,
    last_use: Vec<u64>,
    pinned: Vec<bool>,
    map: HashMap<Key, usize>,
    tick: u64,
}

impl SlotCache {
    pub fn new(slots: usize) -> SlotCache {
        SlotCache {
            keys: vec![None; slots],
            last_use: vec![0; slots],
            pinned: vec![false; slots],
            map: HashMap::new(),
            tick: 0,
        }
    }

    pub fn slots(&self) -> usize {
        self.keys.len()
    }

    /// A resident record: pins and touches its slot.
    pub fn lookup(&mut self, key: Key) -> Option<usize> {
        let s = *self.map.get(&key)?;
        self.use_slot(s);
        Some(s)
    }

    /// A slot for a record about to be copied in: a free one, else the least recently used unpinned one
    /// (its record is forgotten). `None` when every slot is pinned.
    pub fn insert(&mut self, key: Key) -> Option<usize> {
        debug_assert!(!self.map.contains_key(&key));
        let s = match self.keys.iter().position(Option::is_none) {
            Some(s) => s,
            None => (0..self.keys.len())
                .filter(|&s| !self.pinned[s])
                .min_by_key(|&s| self.last_use[s])?,
        };
        if let Some(old) = self.keys[s].take() {
            self.map.remove(&old);
        }
        self.keys[s] = Some(key);
        self.map.insert(key, s);
        self.use_slot(s);
        Some(s)
    }

    /// Forgets a slot's record (its copy failed).
    pub fn invalidate(&mut self, slot: usize) {
        if let Some(k) = self.keys[slot].take() {
            self.map.remove(&k);
        }
        self.pinned[slot] = false;
    }

    pub fn unpin_all(&mut self) {
        self.pinned.iter_mut().for_each(|p| *p = false);
    }

    fn use_slot(&mut self, s: usize) {
        self.tick += 1;
        self.last_use[s] = self.tick;
        self.pinned[s] = true;
    }
}

/// One wave of a layer's experts: each `(union index, slot)`; hits are resident, misses are copied in first.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Wave {
    pub hits: Vec<(usize, usize)>,
    pub misses: Vec<(usize, usize)>,
}

/// Splits `union` (expert ids of `layer`) into waves that each fit in the cache: a wave ends when every slot
/// is pinned. Slots are unpinned between waves, so a later wave may reuse an earlier wave's slots (the
/// executor orders those copies after the earlier wave's kernels).
pub fn plan_waves(cache: &mut SlotCache, layer: usize, union: &[usize]) -> Vec<Wave> {
    assert!(
        cache.slots() > 0,
        "the VRAM expert cache needs at least one slot"
    );
    let mut waves = vec![Wave::default()];
    for (u, &e) in union.iter().enumerate() {
        loop {
            let wave = waves.last_mut().expect("never empty");
            if let Some(s) = cache.lookup((layer, e)) {
                wave.hits.push((u, s));
                break;
            }
            if let Some(s) = cache.insert((layer, e)) {
                wave.misses.push((u, s));
                break;
            }
            cache.unpin_all();
            waves.push(Wave::default());
        }
    }
    cache.unpin_all();
    waves
}

/// Round-robin over the pinned staging buffers: the next buffer, which the caller waits on (its previous
/// copy must have finished) before overwriting it.
pub struct Ring {
    len: usize,
    next: usize,
}

impl Ring {
    pub fn new(len: usize) -> Ring {
        assert!(len > 0);
        Ring { len, next: 0 }
    }

    pub fn take(&mut self) -> usize {
        let i = self.next;
        self.next = (self.next + 1) % self.len;
        i
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attn_res_mixes_count_every_anchor_and_h() {
        // K3: 93 layers in blocks of 12 (the final mix reads 8 anchors and h).
        assert_eq!(attn_res_values(93, Some(12)), 9);
        assert!(attn_res_values(93, Some(12)) <= MIX_VALUES);
        assert_eq!(attn_res_values(16, Some(1)), 17);
        assert_eq!(attn_res_values(48, None), 0);
    }

    #[test]
    fn matmul_tiles_shrink_to_what_shared_memory_holds() {
        // An H200 block may opt in to 227 KB.
        let h200 = 232_448;
        assert_eq!(matmul_tile(h200, 512), Some(8));
        assert_eq!(matmul_tile(h200, 7168), Some(5));
        assert_eq!(matmul_tile(h200, 18_432), Some(2));
        // K3's dense down-projection (33,792 columns): one row at a time.
        assert_eq!(matmul_tile(h200, 33_792), Some(1));
        assert_eq!(matmul_tile(h200, 60_000), None);
        // A 48 KB GPU: short rows fit, 7,168 columns (a full 64 KB ring) do not.
        assert_eq!(matmul_tile(48 * 1024, 512), Some(8));
        assert_eq!(matmul_tile(48 * 1024, 7168), None);
    }

    #[test]
    fn matmul_rings_hold_a_row_up_to_four_pieces() {
        assert_eq!(matmul_ring_bytes(512), 4 * 4096);
        assert_eq!(matmul_ring_bytes(2048), 4 * 4096);
        assert_eq!(matmul_ring_bytes(2049), 4 * 2 * 4096);
        assert_eq!(matmul_ring_bytes(7168), 4 * 4 * 4096);
        assert_eq!(matmul_ring_bytes(33_792), 4 * 4 * 4096);
    }

    #[test]
    fn the_spine_streams_the_layers_beyond_its_allowance() {
        // Everything fits: no streaming buffers are needed.
        assert_eq!(plan_spine(&[4, 4, 4], 12), vec![true; 3]);
        // One byte short: two 4-byte buffers come first, leaving room for one layer.
        assert_eq!(
            plan_spine(&[4, 4, 4, 4], 15),
            vec![true, false, false, false]
        );
        // The buffers are sized by the largest layer, wherever it is.
        assert_eq!(
            plan_spine(&[3, 3, 5, 3, 3], 16),
            vec![true, true, false, false, false]
        );
        // Less than the buffers: every layer streams.
        assert_eq!(plan_spine(&[4, 4, 4], 7), vec![false; 3]);
        assert_eq!(plan_spine(&[4, 4, 4], 0), vec![false; 3]);
    }

    #[test]
    fn hits_stay_and_lru_unpinned_slots_are_evicted() {
        let mut c = SlotCache::new(2);
        assert_eq!(c.insert((1, 5)), Some(0));
        assert_eq!(c.insert((1, 6)), Some(1));
        // Both pinned: no room until the wave ends.
        assert_eq!(c.insert((1, 7)), None);
        c.unpin_all();
        assert_eq!(c.lookup((1, 5)), Some(0));
        // 6 is the least recently used unpinned slot.
        assert_eq!(c.insert((1, 7)), Some(1));
        assert_eq!(c.lookup((1, 6)), None);
        assert_eq!(c.lookup((1, 7)), Some(1));
    }

    #[test]
    fn a_layer_larger_than_the_cache_runs_in_waves() {
        let mut c = SlotCache::new(3);
        let waves = plan_waves(&mut c, 2, &[1, 4, 9, 11, 12]);
        assert_eq!(waves.len(), 2);
        assert_eq!(waves[0].misses, vec![(0, 0), (1, 1), (2, 2)]);
        assert!(waves[0].hits.is_empty());
        // The second wave reuses the least recently used slots.
        assert_eq!(waves[1].misses, vec![(3, 0), (4, 1)]);
        // Next pass of the same layer: 9 (slot 2), 11, 12 hit; 1 and 4 were evicted.
        let waves = plan_waves(&mut c, 2, &[9, 11, 12]);
        assert_eq!(
            waves,
            vec![Wave {
                hits: vec![(0, 2), (1, 0), (2, 1)],
                misses: vec![]
            }]
        );
    }

    #[test]
    fn every_union_entry_is_planned_exactly_once() {
        let mut c = SlotCache::new(4);
        for pass in 0..20usize {
            let union: Vec<usize> = (0..7)
                .map(|i| (i * 5 + pass * 3) % 16)
                .collect::<std::collections::BTreeSet<_>>()
                .into_iter()
                .collect();
            let waves = plan_waves(&mut c, pass % 3, &union);
            let mut seen: Vec<usize> = waves
                .iter()
                .flat_map(|w| w.hits.iter().chain(&w.misses).map(|x| x.0))
                .collect();
            seen.sort_unstable();
            assert_eq!(seen, (0..union.len()).collect::<Vec<_>>());
            for w in &waves {
                let mut slots: Vec<usize> = w.hits.iter().chain(&w.misses).map(|x| x.1).collect();
                slots.sort_unstable();
                slots.dedup();
                assert_eq!(
                    slots.len(),
                    w.hits.len() + w.misses.len(),
                    "a slot used twice in one wave"
                );
            }
        }
    }

    #[test]
    fn staging_buffers_rotate() {
        let mut r = Ring::new(3);
        let order: Vec<usize> = (0..7).map(|_| r.take()).collect();
        assert_eq!(order, vec![0, 1, 2, 0, 1, 2, 0]);
    }
}
