//! Routed experts: routing, the VRAM cache's copies and waves, and the expert kernels' launches.

use super::cuda_model::CudaModel;
use super::expert_cache::{CudaCounters, Direct, ExpertCache, ExpertKernels};
use super::forward::Mm;
use super::session::Arena;
use super::spine::Moe;
use crate::devptr::DevPtr;
use crate::gpu::{par_copy, Doing};
use crate::kernels::{
    AddRows, ExpertDown, ExpertRun, ExpertUp, ExpertUpBiased, MoeCombine, MoeGroup, MoeRoute,
    MoeRouteSoftmax, MxRepack,
};
use crate::plan::plan_waves;
use anyhow::{bail, Context, Result};
use cudarc::driver::{result as cu, CudaEvent};
use deltafin_models::describe::Scoring;
use deltafin_models::ops;
use deltafin_models::Stats;
use deltafin_store::RecordRef;
use std::sync::atomic::Ordering;
use std::time::Instant;

impl CudaModel {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn moe<'s>(
        &'s self,
        a: &Arena,
        layer: usize,
        m: &Moe,
        x: DevPtr<f32>,
        n: usize,
        stats: &Stats,
        held: &mut Vec<RecordRef<'s>>,
        h: DevPtr<f32>,
    ) -> Result<()> {
        let mc = &self.cfg.moe;
        let (e_count, top_k) = (mc.num_experts, mc.top_k);
        let lay = &self.layout;
        // K3: the shared expert needs nothing of the routed ones until the last add, so it runs on the side
        // stream meanwhile, and the latent up-projection adds its output: h += routed + shared, the same sum as
        // the CPU's shared + routed (an addition of two values does not depend on their order).
        let shared = match (&m.latent, &m.shared) {
            (Some(_), Some(sh)) => {
                self.gpu.record(&self.fork)?;
                self.gpu
                    .side
                    .wait(&self.fork)
                    .doing("ordering the shared experts' stream")?;
                let s = a.f32s(n * self.cfg.hidden)?;
                let side = Mm {
                    side: true,
                    ..Mm::default()
                };
                self.mlp(a, sh, x, n, s, side)?;
                self.join
                    .record(&self.gpu.side)
                    .doing("recording the shared experts' end")?;
                Some(s)
            }
            _ => None,
        };
        // Router logits and the selection on the device, in both paths (the same weights, bit for bit).
        let (z, logits) = match (&m.latent, &m.xin) {
            (Some((down, _, _)), Some(xin)) => {
                let y = self.mm_parts(a, xin, &[down, &m.router], x, n, None)?;
                (y[0], y[1])
            }
            _ => (x, self.mm(a, &m.router, x, n)?),
        };
        let ids = a.take(4 * n * top_k)?;
        let wts = a.f32s(n * top_k)?;
        // Every expert resident: the selected records come from the layer's device table and nothing goes to the
        // host; one row's (decode) straight from the router, several rows' grouped by expert on the device.
        // Otherwise the host takes the ids, plans the copies and runs each chosen expert once per pass.
        let direct = self.direct.as_ref();
        let table = direct.map_or(DevPtr::NULL, |d| {
            d.table.typed().byte_add((8 * layer * e_count) as u64)
        });
        let (route_table, slots) = match direct {
            Some(_) if n == 1 => (table, a.take(8 * top_k)?),
            _ => (DevPtr::NULL, DevPtr::NULL),
        };
        match m.scoring {
            Scoring::SigmoidCorrected => MoeRoute {
                logits,
                bias: m.bias.ptr(),
                e: e_count,
                topk: top_k,
                renorm: mc.renormalize,
                scale: mc.routed_scaling_factor,
                ids,
                wts,
                table: route_table,
                slots,
                groups: mc.groups,
                topk_group: mc.topk_group,
            }
            .go(&self.gpu, n)?,
            // Qwen3-MoE's router; the family is refused when a CUDA model is opened.
            Scoring::Softmax => {
                bail!("a softmax-over-all-experts router is not yet on CUDA; use --device cpu")
            }
            Scoring::SoftmaxTopK => MoeRouteSoftmax {
                logits,
                bias: m.bias.ptr(),
                e: e_count,
                topk: top_k,
                ids,
                wts,
                table: route_table,
                slots,
            }
            .go(&self.gpu, n)?,
        }
        let (entry, y) = match direct {
            Some(d) if n == 1 => {
                let act = a.f32s(top_k * lay.inter)?;
                let y = a.f32s(top_k * lay.width)?;
                let (seq, row0) = (d.seq.typed(), d.row0.typed());
                self.launch_experts(top_k, 1, slots, seq, row0, z, act, y)?;
                (seq, y)
            }
            Some(_) => {
                // As many groups as there can be distinct experts: the empty ones cost a block start each.
                let (pairs, groups) = (n * top_k, (n * top_k).min(e_count));
                let (slots, row_off) = (a.take(8 * groups)?, a.take(4 * (groups + 1))?);
                let (rows, entry) = (a.take(4 * pairs)?, a.take(4 * pairs)?);
                MoeGroup {
                    ids,
                    n,
                    topk: top_k,
                    e: e_count,
                    groups,
                    table,
                    slots,
                    row_off,
                    rows,
                    entry,
                    count: DevPtr::new(a.groups.get()).byte_add(4 * layer as u64),
                }
                .go(&self.gpu)?;
                let act = a.f32s(pairs * lay.inter)?;
                let y = a.f32s(pairs * lay.width)?;
                let per_pass = lay.rows_per_pass();
                self.launch_experts(groups, per_pass, slots, row_off, rows, z, act, y)?;
                (entry, y)
            }
            None => {
                let (entry, y, uses) = self.routed_via_host(a, layer, ids, z, n, held)?;
                self.count_uses(stats, uses, false);
                (entry, y)
            }
        };
        // acc = Σ w_i y_i per row, experts in ascending id order.
        let acc = a.f32s(n * lay.width)?;
        MoeCombine {
            y,
            entry,
            wts,
            acc,
            n,
            topk: top_k,
            width: lay.width,
        }
        .go(&self.gpu)?;
        match (&m.latent, &m.shared) {
            (Some((_, norm, up)), _) => {
                if shared.is_some() {
                    self.gpu.wait(&self.join)?;
                }
                let out = Mm {
                    norm: Some((norm.ptr(), self.cfg.rms_norm_eps)),
                    add: shared.unwrap_or_default(),
                    accumulate: true,
                    ..Mm::default()
                };
                self.mm_into(up, acc, h, n, out)
            }
            // h += shared + routed, the sum as the CPU forms it (shared output, then the routed part added).
            (None, Some(sh)) => self.mlp(
                a,
                sh,
                x,
                n,
                h,
                Mm {
                    add: acc,
                    accumulate: true,
                    ..Mm::default()
                },
            ),
            // gpt-oss: h += routed.
            (None, None) => AddRows {
                y: h,
                x: acc,
                len: n * lay.width,
            }
            .go(&self.gpu),
        }
    }

    /// The routed experts with the selection `ids` ([n][top_k] on the device) brought to the host: each chosen
    /// expert runs once for all its rows, resident ones at once, misses in waves as their copies arrive.
    /// Returns the combine's entries ([n][top_k] indices into the outputs, on the device), the outputs, and
    /// the number of experts used.
    pub(super) fn routed_via_host<'s>(
        &'s self,
        a: &Arena,
        layer: usize,
        ids: DevPtr<i32>,
        z: DevPtr<f32>,
        n: usize,
        held: &mut Vec<RecordRef<'s>>,
    ) -> Result<(DevPtr<i32>, DevPtr<f32>, usize)> {
        let top_k = self.cfg.moe.top_k;
        a.copies.set(true);
        let ids: Vec<i32> = self.gpu.dtoh(ids.addr(), n * top_k)?;
        // The compute stream is idle here, so it has passed its waits on every earlier copy: their records may
        // move again.
        held.clear();
        let routes: Vec<&[i32]> = ids.chunks(top_k).collect();
        let mut union: Vec<usize> = ids.iter().map(|&e| e as usize).collect();
        union.sort_unstable();
        union.dedup();
        let lay = &self.layout;
        let rows_of: Vec<Vec<usize>> = union
            .iter()
            .map(|&e| {
                (0..n)
                    .filter(|&t| routes[t].contains(&(e as i32)))
                    .collect()
            })
            .collect();
        let mut cache = self.cache.lock().unwrap();
        let waves = plan_waves(&mut cache.plan, layer, &union);
        // Entries (expert, row) numbered in execution order; entry_of[u] = first entry of union index u.
        let mut entry_of = vec![0usize; union.len()];
        let mut next = 0;
        for w in &waves {
            for &(u, _) in w.hits.iter().chain(&w.misses) {
                entry_of[u] = next;
                next += rows_of[u].len();
            }
        }
        let total = next;
        let act = a.f32s(total * lay.inter)?;
        let y = a.f32s(total * lay.width)?;
        for (wi, w) in waves.iter().enumerate() {
            // Resident experts run at once (overlapping the copies below on the other stream).
            self.launch_group(a, &cache.placed(&w.hits), &rows_of, &entry_of, z, act, y)?;
            if w.misses.is_empty() {
                continue;
            }
            let t0 = Instant::now();
            if wi > 0 {
                // The misses may overwrite slots the previous wave's kernels read.
                let done = self.gpu.mark()?;
                self.gpu
                    .copy
                    .wait(&done)
                    .doing("ordering expert copies after the previous wave")?;
            }
            let misses = cache.placed(&w.misses);
            let todo: Vec<(usize, u64)> = misses.iter().map(|&(u, at)| (union[u], at)).collect();
            self.copy_in(&mut cache, layer, &todo, held)?;
            cache.counters.stage_secs += t0.elapsed().as_secs_f64();
            let copied = self.copies_done()?;
            self.gpu.wait(&copied)?;
            self.launch_group(a, &misses, &rows_of, &entry_of, z, act, y)?;
        }
        let hits: u64 = waves.iter().map(|w| w.hits.len() as u64).sum();
        cache.counters.vram_hits += hits;
        cache.counters.vram_misses += union.len() as u64 - hits;
        drop(cache);
        let mut entry = Vec::with_capacity(n * top_k);
        for (t, r) in routes.iter().enumerate() {
            for id in r.iter() {
                let u = union.binary_search(&(*id as usize)).expect("in the union");
                let j = rows_of[u]
                    .iter()
                    .position(|&x| x == t)
                    .expect("row chose it");
                entry.push((entry_of[u] + j) as i32);
            }
        }
        Ok((self.stage(a, &entry)?, y, union.len()))
    }

    /// Copies records `(expert, VRAM destination)` of `layer` from the store on the copy stream, in the order
    /// they arrive. `held`: the store records whose copies may still be running.
    pub(super) fn copy_in<'s>(
        &'s self,
        cache: &mut ExpertCache,
        layer: usize,
        todo: &[(usize, u64)],
        held: &mut Vec<RecordRef<'s>>,
    ) -> Result<()> {
        let len = self.layout.len();
        let ids: Vec<usize> = todo.iter().map(|t| t.0).collect();
        let mut fetch = self.store.fetch(layer, &ids);
        while let Some(rec) = fetch.next() {
            let rec = rec?;
            let dst = todo
                .iter()
                .find(|t| t.0 == rec.expert)
                .expect("asked for")
                .1;
            if self.slab_registered {
                // SAFETY: the slot holds slot_len >= len bytes; the record stays pinned in the store (held)
                // until the copy has completed.
                unsafe { cu::memcpy_htod_async(dst, rec.bytes(), self.gpu.copy.cu_stream()) }
                    .doing("copying an expert to the GPU")?;
                held.push(rec);
                // Held records pin store slots that this fetch may need for records still to load.
                if held.len() >= self.held_cap {
                    self.gpu
                        .copy
                        .synchronize()
                        .doing("waiting for experts' copies to the GPU")?;
                    held.clear();
                }
            } else {
                let k = cache.ring.take();
                let (pinned, ev) = &mut cache.staging[k];
                ev.synchronize()
                    .doing("waiting for a staging buffer's copy to the GPU")?;
                par_copy(pinned.as_mut_slice(), rec.bytes());
                drop(rec);
                // SAFETY: the slot holds slot_len >= len bytes; the pinned buffer is not rewritten before `ev`.
                unsafe {
                    cu::memcpy_htod_async(dst, &pinned.as_slice()[..len], self.gpu.copy.cu_stream())
                }
                .doing("copying an expert to the GPU")?;
                ev.record(&self.gpu.copy)
                    .doing("recording an expert's copy")?;
            }
            if self.layout.mxfp4() {
                cache
                    .copied
                    .record(&self.gpu.copy)
                    .doing("recording the experts' copies")?;
                self.gpu
                    .prep
                    .wait(&cache.copied)
                    .doing("ordering the experts' use after their copies")?;
                self.repack(dst)?;
            }
            cache.counters.h2d_bytes += len as u64;
        }
        Ok(())
    }

    /// Rearranges a just-copied MXFP4 record into the expert kernels' device layout (kernels.cu, `mx_repack`),
    /// on the prep stream, ordered after its copy.
    pub(super) fn repack(&self, dst: u64) -> Result<()> {
        let lay = &self.layout;
        // A block holds one 32-row group of a tensor (its size checked at load).
        MxRepack {
            rec: DevPtr::new(dst),
            parts: lay.repack_parts(),
            width: lay.width,
            inter: lay.inter,
        }
        .go(&self.gpu, lay.repack_smem())
    }

    /// An event after every copy issued so far and, for MXFP4 experts, their rearrangement.
    pub(super) fn copies_done(&self) -> Result<CudaEvent> {
        let s = if self.layout.mxfp4() {
            &self.gpu.prep
        } else {
            &self.gpu.copy
        };
        s.record_event(None).doing("recording an event")
    }

    /// Fills the VRAM cache with every routed expert (when it holds them all): "resident" then means resident
    /// from the first token, with no first-touch copies in the passes.
    pub(super) fn preload(&self) -> Result<()> {
        let mut cache = self.cache.lock().unwrap();
        let ids: Vec<usize> = (0..self.cfg.moe.num_experts).collect();
        for layer in (0..self.cfg.num_layers).filter(|&l| !self.cfg.is_dense(l)) {
            let mut held = Vec::new();
            for w in plan_waves(&mut cache.plan, layer, &ids) {
                let todo: Vec<(usize, u64)> = w
                    .misses
                    .iter()
                    .map(|&(u, s)| (ids[u], cache.slot(s)))
                    .collect();
                self.copy_in(&mut cache, layer, &todo, &mut held)?;
            }
            self.gpu
                .copy
                .synchronize()
                .doing("copying experts to the GPU")?;
        }
        self.gpu
            .prep
            .synchronize()
            .doing("readying experts on the GPU")?;
        cache.counters = CudaCounters::default();
        Ok(())
    }

    /// The resident decode path's device tables (after `preload`: every expert has its slot for good).
    pub(super) fn direct_tables(&self) -> Result<Direct> {
        let (e, k) = (self.cfg.moe.num_experts, self.cfg.moe.top_k);
        let mut cache = self.cache.lock().unwrap();
        let mut table = vec![0u64; self.cfg.num_layers * e];
        for layer in (0..self.cfg.num_layers).filter(|&l| !self.cfg.is_dense(l)) {
            for id in 0..e {
                let s = cache
                    .plan
                    .lookup((layer, id))
                    .context("internal: a preloaded expert has no slot")?;
                table[layer * e + id] = cache.slot(s);
            }
        }
        cache.plan.unpin_all();
        Ok(Direct {
            table: self.gpu.upload(&table)?,
            seq: self.gpu.upload(&(0..=k as i32).collect::<Vec<_>>())?,
            row0: self.gpu.upload(&vec![0i32; k])?,
        })
    }

    /// `uses` chosen experts, each read once from VRAM (`resident`: found there without the host's plan, which
    /// counts its own hits).
    /// A resident decode step's experts: top_k a MoE layer.
    pub(super) fn count_step_uses(&self, stats: &Stats) {
        let moe = (0..self.cfg.num_layers).filter(|&l| !self.cfg.is_dense(l));
        self.count_uses(stats, moe.count() * self.cfg.moe.top_k, true);
    }

    pub(super) fn count_uses(&self, stats: &Stats, uses: usize, resident: bool) {
        if resident {
            self.cache.lock().unwrap().counters.vram_hits += uses as u64;
        }
        stats.expert_uses.fetch_add(uses as u64, Ordering::Relaxed);
        stats
            .expert_bytes
            .fetch_add((uses * self.layout.len()) as u64, Ordering::Relaxed);
    }

    /// Stages one group's tables (record pointers, row offsets, rows) and launches its experts.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn launch_group(
        &self,
        a: &Arena,
        group: &[(usize, u64)],
        rows_of: &[Vec<usize>],
        entry_of: &[usize],
        z: DevPtr<f32>,
        act: DevPtr<f32>,
        y: DevPtr<f32>,
    ) -> Result<()> {
        if group.is_empty() {
            return Ok(());
        }
        let lay = &self.layout;
        let slots: Vec<u64> = group.iter().map(|g| g.1).collect();
        let mut row_off = Vec::with_capacity(group.len() + 1);
        let mut rows: Vec<i32> = Vec::new();
        // Entries of this group are consecutive in execution order.
        let first = entry_of[group[0].0];
        for &(u, _) in group {
            row_off.push((entry_of[u] - first) as i32);
            rows.extend(rows_of[u].iter().map(|&t| t as i32));
        }
        row_off.push(rows.len() as i32);
        let per_pass = if rows.len() > group.len() {
            lay.rows_per_pass()
        } else {
            1
        };
        let slots_dev = self.stage(a, &slots)?;
        let off_dev = self.stage(a, &row_off)?;
        let rows_dev = self.stage(a, &rows)?;
        self.launch_experts(
            group.len(),
            per_pass,
            slots_dev,
            off_dev,
            rows_dev,
            z,
            act.byte_add((4 * first * lay.inter) as u64),
            y.byte_add((4 * first * lay.width) as u64),
        )
    }

    /// `g` experts from device tables: `slots[u]` its record, entries `row_off[u]..row_off[u+1]` its rows of z
    /// (`rows[entry]`); entry e's activations and outputs at row e of `act` and `y`. `per_pass`: the kernels that
    /// take that many of an expert's rows a pass over its weights (1, or `rows_per_pass` when some have several).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn launch_experts(
        &self,
        g: usize,
        per_pass: usize,
        slots: DevPtr<u64>,
        row_off: DevPtr<i32>,
        rows: DevPtr<i32>,
        z: DevPtr<f32>,
        act: DevPtr<f32>,
        y: DevPtr<f32>,
    ) -> Result<()> {
        let lay = &self.layout;
        let variant = lay.variant(per_pass);
        let run = ExpertRun { variant, count: g };
        let up_smem = lay.expert_smem(lay.width, per_pass);
        // Four warps a block, each on 32 rows over half of their blocks: 64 intermediate rows (gate and up, two
        // groups in turn) in expert_up (gpt-oss: 64 interleaved gate_up rows), 64 output rows in expert_down.
        match (variant.act(), self.expert_act) {
            (Some(kind), _) => ExpertUp {
                slots,
                row_off,
                rows,
                z,
                a: act,
                width: lay.width,
                inter: lay.inter,
                act: kind,
                parts: lay.offsets(),
            }
            .go(&self.gpu, run, up_smem)?,
            (None, ops::Act::ClampedSwiglu { limit }) => ExpertUpBiased {
                slots,
                row_off,
                rows,
                z,
                a: act,
                width: lay.width,
                inter: lay.inter,
                limit,
                parts: lay.offsets(),
            }
            .go(&self.gpu, run, up_smem)?,
            (None, other) => bail!("internal: biased MXFP4 experts with {other:?}"),
        }
        ExpertDown {
            slots,
            row_off,
            a: act,
            y,
            width: lay.width,
            inter: lay.inter,
            parts: lay.offsets(),
        }
        .go(&self.gpu, run, lay.expert_smem(lay.inter, per_pass))
    }
}
