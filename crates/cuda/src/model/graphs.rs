//! Decode steps as CUDA graphs: capture, launch, and the step run ahead on the device's own choice.

use super::cuda_model::CudaModel;
use super::session::{Ahead, Arena, CudaSession, DecodeGraph, GraphKey};
use crate::devptr::DevPtr;
use crate::gpu::Doing;
use crate::kernels::DecodePick;
use anyhow::{anyhow, bail, Result};
use cudarc::driver::{result as cu, sys};
use deltafin_models::{Backend, LogitRows, Pass, Stats};
use std::time::Instant;

/// The most rows a checking pass runs as a graph: up to 8 guesses. The session keeps a graph per row count,
/// so this bounds how many it holds; longer checks run ungraphed.
pub(super) const MAX_CHECK_ROWS: usize = 9;

impl CudaModel {
    /// Whether one-row steps run as graphs: every expert resident, no streamed layers (their copies are issued
    /// per pass), no `--timeline` (its notes are too), and no capture refused so far.
    pub(super) fn graphed(&self) -> bool {
        self.direct.is_some()
            && self.streamed.is_none()
            && self.gpu.timeline.is_none()
            && self.graphs_off.lock().unwrap().is_none()
    }

    /// A decode step of `session` on `token` through its graph, returning its logits. It takes over the step run
    /// ahead on the device's choice when that choice was `token` and nothing was issued since; otherwise the
    /// header is uploaded and the graph launched (captured first if the session has none that fits). With
    /// `ahead`, the step after it is launched on the device's choice before the logits are waited for, while the
    /// caches and scratch hold it unchanged. A capture the driver refuses turns graphs off for the model.
    pub(super) fn step(
        &self,
        session: &mut CudaSession,
        token: u32,
        ahead: bool,
        stats: &Stats,
    ) -> Result<Vec<f32>> {
        let t0 = Instant::now();
        let pos = session.pos;
        self.begin_keep(session, 1)?;
        let mut arena = self.arena.lock().unwrap();
        // Whether a step ran ahead, and whether it is taken over.
        let ran = session
            .ahead
            .take()
            .map(|g| g.token == token && g.ticket == arena.issued.get());
        let taken = ran == Some(true);
        if !taken {
            self.reserve(session, if ahead { 2 } else { 1 })?;
            self.size_arena(&mut arena, 1, session.mla_cap())?;
            let a = &*arena;
            let hdr = self.stage(a, &[token, pos as u32])?;
            let key = self.graph_key(a, session, 1);
            if session.graph.as_ref().is_none_or(|g| g.key != key) {
                session.graph = None;
                match self.capture(a, session, hdr, stats, key) {
                    Ok(graph) => session.graph = Some(graph),
                    Err(e) => {
                        *self.graphs_off.lock().unwrap() = Some(format!("{e:#}"));
                        drop(arena);
                        self.note_step(ran, 0.0, 0.0);
                        return self.forward(session, &[token], LogitRows::Last, stats);
                    }
                }
            }
            self.launch_step(a, session, pos)?;
        }
        let next = ahead && session.holds(2) && {
            let key = self.graph_key(&arena, session, 1);
            session.graph.as_ref().is_some_and(|g| g.key == key)
        };
        if next {
            self.launch_step(&arena, session, pos + 1)?;
        }
        let issue_secs = t0.elapsed().as_secs_f64();
        // This step's results.
        let par = pos & 1;
        let pk = &self.picks;
        pk.done[par].synchronize().doing("running a decode step")?;
        let ms = pk.span[par][0]
            .elapsed_ms(&pk.span[par][1])
            .doing("timing a decode step")?;
        self.note_step(ran, issue_secs, ms as f64 / 1e3);
        let v = self.cfg.vocab_size;
        // SAFETY: the host buffer holds [2][v + 1] floats, written by a copy that has completed.
        let out = unsafe {
            std::slice::from_raw_parts((pk.host.ptr as *const f32).add(par * (v + 1)), v + 1)
        };
        self.count_step_uses(stats);
        session.pos += 1;
        session.ahead = next.then(|| Ahead {
            token: out[v].to_bits(),
            ticket: arena.issued.get(),
        });
        Ok(out[..v].to_vec())
    }

    /// A graphed step's counters, under one lock: the step run ahead before it (`Some(taken over)`), the host's
    /// time issuing and the GPU's span.
    pub(super) fn note_step(&self, ran: Option<bool>, issue_secs: f64, gpu_secs: f64) {
        let c = &mut self.cache.lock().unwrap().counters;
        match ran {
            Some(true) => c.ahead_taken += 1,
            Some(false) => c.ahead_discarded += 1,
            None => {}
        }
        c.issue_secs += issue_secs;
        c.gpu_secs += gpu_secs;
    }

    /// What a session's graph of a pass of `rows` must have been captured with to replay now.
    pub(super) fn graph_key(&self, a: &Arena, session: &CudaSession, rows: usize) -> GraphKey {
        GraphKey {
            scratch: a.buf.as_ref().expect("sized at pass start").ptr,
            cap: session.mla_cap(),
            rows,
            keep: if rows > 1 { session.keep.grown } else { 0 },
        }
    }

    /// A checking pass of `session` over `tokens` (several rows, kept for a rollback: `begin_keep` is done
    /// here) through the session's graph for that many rows, captured first if it has none that fits; every
    /// row's logits. A step run ahead is discarded: this pass reads the state from before it.
    pub(super) fn check(
        &self,
        session: &mut CudaSession,
        tokens: &[u32],
        stats: &Stats,
    ) -> Result<Vec<f32>> {
        let t0 = Instant::now();
        let n = tokens.len();
        if session.ahead.take().is_some() {
            self.cache.lock().unwrap().counters.ahead_discarded += 1;
        }
        self.reserve(session, n)?;
        self.begin_keep(session, n)?;
        let mut arena = self.arena.lock().unwrap();
        self.size_arena(&mut arena, n, session.mla_cap())?;
        let a = &*arena;
        let mut header = tokens.to_vec();
        header.push(session.pos as u32);
        let hdr = self.stage(a, &header)?;
        let key = self.graph_key(a, session, n);
        let at = session.checks.iter().position(|g| g.key.rows == n);
        let graph = match at {
            Some(i) if session.checks[i].key == key => session.checks.swap_remove(i),
            _ => {
                if let Some(i) = at {
                    session.checks.swap_remove(i);
                }
                match self.capture(a, session, hdr, stats, key) {
                    Ok(g) => g,
                    Err(e) => {
                        *self.graphs_off.lock().unwrap() = Some(format!("{e:#}"));
                        drop(arena);
                        // The ungraphed pass keeps the rows instead.
                        session.keep.armed = session.keep.pass.take().is_some();
                        return self.forward(session, tokens, LogitRows::All, stats);
                    }
                }
            }
        };
        a.issued.set(a.issued.get() + 1);
        let launched = graph.graph.launch().doing("launching a checking pass");
        let (logits, groups) = (graph.logits, graph.groups);
        session.checks.push(graph);
        launched?;
        let issue_secs = t0.elapsed().as_secs_f64();
        let out = self.gpu.dtoh::<f32>(logits, n * self.cfg.vocab_size)?;
        let counts = self.gpu.dtoh::<i32>(groups, self.cfg.num_layers)?;
        let moe = (0..self.cfg.num_layers).filter(|&l| !self.cfg.is_dense(l));
        self.count_uses(stats, moe.map(|l| counts[l] as usize).sum(), true);
        self.note_step(None, issue_secs, 0.0);
        session.pos += n;
        Ok(out)
    }

    /// Launches the session's graph for its step at `pos` (the header already in place on the device), and
    /// copies its results back on the copy stream.
    pub(super) fn launch_step(&self, a: &Arena, session: &CudaSession, pos: usize) -> Result<()> {
        let g = session.graph.as_ref().expect("captured before its launch");
        let par = pos & 1;
        let pk = &self.picks;
        let v = self.cfg.vocab_size;
        self.gpu.record(&pk.span[par][0])?;
        g.graph.launch().doing("launching a decode step")?;
        self.gpu.record(&pk.span[par][1])?;
        let copy = &self.gpu.copy;
        copy.wait(&pk.span[par][1])
            .doing("ordering the logits copy after a decode step")?;
        let bytes = 4 * (v + 1);
        // SAFETY: both buffers hold [2][v + 1] floats; the host's half `par` is read only after `done[par]`, and
        // written again only by the step two after this one, launched after that read.
        unsafe {
            let dst = std::slice::from_raw_parts_mut(pk.host.ptr.add(par * bytes), bytes);
            cu::memcpy_dtoh_async(dst, pk.out.ptr + (par * bytes) as u64, copy.cu_stream())
        }
        .doing("copying a decode step's logits back")?;
        pk.done[par]
            .record(copy)
            .doing("recording the logits copy")?;
        a.issued.set(a.issued.get() + 1);
        Ok(())
    }

    /// The pass of `key.rows` rows on the header at `hdr` (a one-row pass with its pick, a longer one with every
    /// row's logits), captured as a graph (not run).
    pub(super) fn capture(
        &self,
        a: &Arena,
        session: &mut CudaSession,
        hdr: DevPtr<u32>,
        stats: &Stats,
        key: GraphKey,
    ) -> Result<DecodeGraph> {
        let stream = &self.gpu.stream;
        let staged = a.host_off.get();
        stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .doing("capturing a decode step")?;
        let tokens = vec![0; key.rows];
        let mut pass = [Pass {
            session,
            tokens: &tokens,
            rows: if key.rows == 1 {
                LogitRows::Last
            } else {
                LogitRows::All
            },
        }];
        let issued = self
            .pass(a, &mut pass, stats, &mut Vec::new(), hdr)
            .and_then(|(logits, _)| {
                if key.rows == 1 {
                    DecodePick {
                        logits,
                        vocab: self.cfg.vocab_size,
                        hdr,
                        out: self.picks.out.typed(),
                    }
                    .go(&self.gpu)?;
                }
                Ok(logits)
            });
        // The capture ends whatever the issue did, so the stream is usable again.
        let graph = stream.end_capture(sys::CUgraphInstantiate_flags(0));
        let logits = issued?;
        // The graph holds no upload (the key does not cover the upload area): only the header, staged before it.
        if a.host_off.get() != staged {
            bail!("internal: a decode step uploads more than its header");
        }
        let graph = graph
            .doing("capturing a decode step")?
            .ok_or_else(|| anyhow!("capturing a decode step: the graph is empty"))?;
        Ok(DecodeGraph {
            graph,
            key,
            ctx: self.gpu.ctx.clone(),
            logits: logits.addr(),
            groups: a.groups.get(),
        })
    }
}
