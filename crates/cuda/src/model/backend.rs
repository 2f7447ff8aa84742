//! The CPU model's `Backend` contract on the device.

use super::cuda_model::CudaModel;
use super::graphs::MAX_CHECK_ROWS;
use super::session::{header, CudaSession, Keep, State};
use super::spine::Attn;
use crate::gpu::{DevBuf, Doing};
use anyhow::Result;
use deltafin_formats::config::ModelConfig;
use deltafin_models::{split_rows, Backend, LogitRows, Pass, Stats};
use deltafin_store::ExpertStore;
use std::sync::Arc;
use std::time::Instant;

/// The CPU model's contract on the device: the same sessions, passes and logits (within the tolerance of the
/// GPU's math functions; docs/cuda.md).
impl Backend for CudaModel {
    type Session = CudaSession;

    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn store(&self) -> &Arc<ExpertStore> {
        &self.store
    }

    /// The GPU's name and compute capability.
    fn kernels(&self) -> String {
        let off = self.graphs_off.lock().unwrap();
        let graphs = off.as_ref().map_or(String::new(), |why| {
            format!(", decode steps without graphs: {why}")
        });
        format!(
            "{} (sm_{}{}){graphs}",
            self.gpu.name, self.gpu.sm.0, self.gpu.sm.1
        )
    }

    fn reports_layers(&self) -> bool {
        false
    }

    fn new_session(&self) -> Result<CudaSession> {
        let layers = self
            .layers
            .iter()
            .map(|l| match &l.attn {
                Attn::Kda(k) => {
                    let w = k.heads * k.dim;
                    // Two copies of each: see kda_recurrence.
                    Ok(State::Kda {
                        conv: self.zeros(2 * 3 * w * (k.kern - 1))?,
                        s: self.zeros(2 * k.heads * k.dim * k.dim)?,
                    })
                }
                Attn::Mla(m) => {
                    let cap = 64;
                    Ok(State::Mla {
                        lat: self.zeros(cap * m.kvl)?,
                        pe: self.zeros(cap * m.rope)?,
                        cap,
                    })
                }
                Attn::Gqa(g) => {
                    let cap = 64;
                    Ok(State::Gqa {
                        k: self.zeros(cap * g.kv_width())?,
                        v: self.zeros(cap * g.kv_width())?,
                        cap,
                    })
                }
            })
            .collect::<Result<_>>()?;
        Ok(CudaSession {
            layers,
            pos: 0,
            graph: None,
            checks: Vec::new(),
            ahead: None,
            keep: Keep::default(),
        })
    }

    /// One pass over every session's rows: each runs attention on its own state, the rest of the layer on
    /// all rows at once (a routed expert read once for every row that chose it).
    fn forward_batch(
        &self,
        batch: &mut [Pass<'_, CudaSession>],
        stats: &Stats,
    ) -> Result<Vec<Vec<f32>>> {
        if batch.is_empty() {
            return Ok(Vec::new());
        }
        deltafin_models::check_batch(&self.cfg, batch)?;
        // A server runs passes on its own worker thread: the context must be current there.
        self.gpu
            .ctx
            .bind_to_thread()
            .doing("binding the GPU context to this thread")?;
        let n: usize = batch.iter().map(|p| p.tokens.len()).sum();
        if n == 1 && self.graphed() {
            let p = &mut batch[0];
            return Ok(vec![self.step(p.session, p.tokens[0], false, stats)?]);
        }
        if let [p] = batch {
            if n <= MAX_CHECK_ROWS
                && p.rows == LogitRows::All
                && p.session.keep.armed
                && self.graphed()
            {
                return Ok(vec![self.check(p.session, p.tokens, stats)?]);
            }
        }
        let t0 = Instant::now();
        for p in batch.iter_mut() {
            // A step run ahead is discarded: this pass reads the state from before it (see kda_recurrence).
            if p.session.ahead.take().is_some() {
                self.cache.lock().unwrap().counters.ahead_discarded += 1;
            }
            self.reserve(p.session, p.tokens.len())?;
            self.begin_keep(p.session, p.tokens.len())?;
        }
        let cap = batch.iter().map(|p| p.session.mla_cap()).max().unwrap_or(0);
        let mut arena = self.arena.lock().unwrap();
        self.size_arena(&mut arena, n, cap)?;
        arena.issued.set(arena.issued.get() + 1);
        let mut held = Vec::new();
        if let Some(t) = &self.gpu.timeline {
            t.begin();
            self.gpu.htod_sync(t.count, &[0u32])?;
        }
        let issued = self.stage(&arena, &header(batch)).and_then(|hdr| {
            self.gpu.record(&self.span[0])?;
            self.pass(&arena, batch, stats, &mut held, hdr)
        });
        let result = issued.and_then(|(logits, len)| {
            self.gpu.record(&self.span[1])?;
            self.cache.lock().unwrap().counters.issue_secs += t0.elapsed().as_secs_f64();
            let out = self.gpu.dtoh(logits.addr(), len)?;
            let ms = self.span[0]
                .elapsed_ms(&self.span[1])
                .doing("timing a pass")?;
            self.cache.lock().unwrap().counters.gpu_secs += ms as f64 / 1e3;
            Ok(out)
        });
        // Every asynchronous copy from host memory has completed once the logits came back (or on error here).
        // Once they came back, the compute stream is done and with it the side stream's work (joined into it);
        // the copy and prep streams had work only if the pass copied.
        if result.is_err() || arena.copies.get() {
            let _ = self.gpu.stream.synchronize();
            let _ = self.gpu.side.synchronize();
            let _ = self.gpu.copy.synchronize();
            let _ = self.gpu.prep.synchronize();
        }
        drop(held);
        let out = result?;
        // Resident experts are counted here: a decode step's are top_k a layer; a pass of several rows counted
        // its layers' on the device.
        if self.direct.is_some() && n == 1 {
            self.count_step_uses(stats);
        } else if arena.groups.get() != 0 {
            let moe = (0..self.cfg.num_layers).filter(|&l| !self.cfg.is_dense(l));
            let counts = self
                .gpu
                .dtoh::<i32>(arena.groups.get(), self.cfg.num_layers)?;
            self.count_uses(stats, moe.map(|l| counts[l] as usize).sum(), true);
        }
        // A decode step's notes (a longer pass's blocks may wait more than once).
        if let Some(t) = self.gpu.timeline.as_ref().filter(|_| n == 1) {
            let count = self.gpu.dtoh::<u32>(t.count, 1)?[0] as usize;
            t.end_step(&mut self.gpu.dtoh::<u64>(t.notes, count.min(t.cap))?);
        }
        // Each session's logit rows, in batch order; its position moves past its tokens.
        for p in batch.iter_mut() {
            p.session.pos += p.tokens.len();
        }
        Ok(split_rows(out, self.cfg.vocab_size, batch))
    }

    /// A graphed step run ahead when asked (see `step`); otherwise a plain pass.
    fn decode(
        &self,
        session: &mut CudaSession,
        token: u32,
        ahead: bool,
        stats: &Stats,
    ) -> Result<Vec<f32>> {
        if !self.graphed() {
            return self.forward(session, &[token], LogitRows::Last, stats);
        }
        let pass = Pass {
            session,
            tokens: &[token],
            rows: LogitRows::Last,
        };
        deltafin_models::check_batch(&self.cfg, std::slice::from_ref(&pass))?;
        self.gpu
            .ctx
            .bind_to_thread()
            .doing("binding the GPU context to this thread")?;
        self.step(pass.session, token, ahead, stats)
    }

    fn runs_ahead_on(&self, session: &CudaSession, token: u32) -> bool {
        session.ahead.as_ref().is_some_and(|g| {
            g.token == token && g.ticket == self.arena.lock().unwrap().issued.get()
        })
    }

    /// Every state buffer copied whole on the device (the MLA and GQA caches with their spare capacity). The copies have
    /// landed when it returns, so the original may be dropped (freed) or run on at once.
    fn fork(&self, session: &CudaSession) -> Result<CudaSession> {
        let copy = |b: &DevBuf| -> Result<DevBuf> {
            let c = self.gpu.alloc(b.bytes)?;
            self.gpu.dtod(c.ptr, b.ptr, b.bytes)?;
            Ok(c)
        };
        let layers = session
            .layers
            .iter()
            .map(|st| {
                Ok(match st {
                    State::Kda { conv, s } => State::Kda {
                        conv: copy(conv)?,
                        s: copy(s)?,
                    },
                    State::Mla { lat, pe, cap } => State::Mla {
                        lat: copy(lat)?,
                        pe: copy(pe)?,
                        cap: *cap,
                    },
                    State::Gqa { k, v, cap } => State::Gqa {
                        k: copy(k)?,
                        v: copy(v)?,
                        cap: *cap,
                    },
                })
            })
            .collect::<Result<_>>()?;
        self.gpu.stream.synchronize().doing("copying a session")?;
        Ok(CudaSession {
            layers,
            pos: session.pos,
            graph: None,
            checks: Vec::new(),
            ahead: None,
            keep: Keep::default(),
        })
    }

    /// The next pass writes each KDA layer's state after each of its rows but the last into the session's
    /// snapshot buffers (see `Keep`).
    fn keep_rows(&self, session: &mut CudaSession) -> bool {
        session.keep.armed = true;
        true
    }

    /// Copies on the device from the last pass's snapshots (see `roll_back`).
    fn rollback(&self, session: &mut CudaSession, rows: usize) -> Result<()> {
        self.gpu
            .ctx
            .bind_to_thread()
            .doing("binding the GPU context to this thread")?;
        self.roll_back(session, rows)
    }

    fn position(&self, session: &CudaSession) -> usize {
        session.pos
    }

    /// VRAM held: every state buffer, the MLA caches with their spare capacity, the checking passes' snapshots.
    fn session_bytes(&self, session: &CudaSession) -> usize {
        session
            .layers
            .iter()
            .map(|st| match st {
                State::Kda { conv, s } => conv.bytes + s.bytes,
                State::Mla { lat, pe, .. } => lat.bytes + pe.bytes,
                State::Gqa { k, v, .. } => k.bytes + v.bytes,
            })
            .sum::<usize>()
            + session.keep.bytes()
    }
}
