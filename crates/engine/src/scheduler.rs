//! Serving several requests from one model on any backend: a dedicated worker thread (model work blocks and
//! must not run on an async runtime) admits jobs from a bounded queue and advances every active job by one
//! piece — a prefill chunk or one token — in one batched forward pass ([`Backend::forward_batch`]): a routed
//! expert chosen by several jobs is read once for all of them, and each job's rows are computed exactly as
//! alone, so its tokens and logits do not depend on the others. A long prompt or a long answer cannot starve
//! the others. Between passes it polls each job for cancellation and drops a cancelled one at once, freeing its
//! session. Finished prompts and conversations go to the [`PrefixCache`], and a new job whose prompt extends
//! one resumes there. With a [`Drafter`], every job decodes speculatively (its tokens and logits unchanged): its
//! piece is then a chosen token and the drafter's guesses (as many as its cost model expects to pay), checked
//! in the same batched pass; a check that ran past its taken tokens is rolled back to them — or, on a backend
//! that cannot roll back, they are run again in a second pass.

use crate::{
    logprobs, Draft, FinishReason, Flow, Generation, Guesser, Planned, PrefixCache, Request,
    TokenLogprob,
};
use anyhow::Result;
use deltafin_models::{Backend, Model, Pass, Stats};
use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Instant;

#[derive(Clone, Debug)]
pub struct SchedulerConfig {
    /// Jobs computed concurrently, each advanced by one piece in every (batched) pass.
    pub max_active: usize,
    /// Jobs that may wait for a free active slot; a submit beyond that is rejected.
    pub queue_capacity: usize,
    /// Most prompt tokens per pass, so a long prefill lets the other jobs advance between its chunks.
    pub prefill_chunk: usize,
    /// Memory for reusable conversation state (0 turns prefix reuse off).
    pub prefix_cache_bytes: usize,
    /// Speculative decoding for every job.
    pub drafter: Option<Drafter>,
}

/// What guesses for every job: a small model sharing the served model's tokenizer (it runs on the CPU
/// whatever the model runs on; each job has its own session of it), or prompt lookup; up to `tokens` tokens
/// per pass of the model (as many as its cost model expects to pay, or, `fixed`, always `tokens`).
#[derive(Clone)]
pub struct Drafter {
    pub guesser: Guesser<Model>,
    pub tokens: usize,
    pub fixed: bool,
}

impl std::fmt::Debug for Drafter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Drafter {{ tokens: {} }}", self.tokens)
    }
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            max_active: 4,
            queue_capacity: 16,
            prefill_chunk: 256,
            prefix_cache_bytes: 1 << 30,
            drafter: None,
        }
    }
}

/// Where a job's results go. Every method runs on the worker thread, so each must be quick.
pub trait Sink: Send {
    /// The whole prompt is consumed; `cached_tokens` of it came from the prefix cache.
    fn prefilled(&mut self, _prompt_tokens: usize, _cached_tokens: usize) -> Flow {
        Flow::Continue
    }
    /// A generated token, with its log-probabilities when the job asked for them. `Flow::Stop` ends the job
    /// normally (e.g. a stop string matched), with [`FinishReason::Caller`].
    fn token(&mut self, token: u32, logprob: Option<TokenLogprob>) -> Flow;
    /// Called exactly once, unless the job was cancelled.
    fn finished(&mut self, result: Result<Finished, String>);
    /// Polled before every pass: `true` drops the job at once.
    fn cancelled(&self) -> bool;
}

#[derive(Clone, Debug)]
pub struct Finished {
    pub reason: FinishReason,
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    pub completion_tokens: usize,
    pub prefill_secs: f64,
    pub decode_secs: f64,
}

pub struct Job {
    pub request: Request,
    /// `Some(n)`: report each token's log-probability and the `n` most likely alternatives.
    pub top_logprobs: Option<usize>,
    pub sink: Box<dyn Sink>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rejected {
    /// Every active slot and queue place is taken; try again later.
    QueueFull,
    /// The scheduler is closing and accepts no new work.
    ShuttingDown,
}

impl std::fmt::Display for Rejected {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Rejected::QueueFull => "the request queue is full",
            Rejected::ShuttingDown => "the server is shutting down",
        })
    }
}

/// What the worker has done so far (read by metrics endpoints).
#[derive(Default)]
pub struct Counters {
    pub completed: AtomicU64,
    pub failed: AtomicU64,
    pub cancelled: AtomicU64,
    pub prompt_tokens: AtomicU64,
    /// Prompt tokens taken from the prefix cache instead of computed.
    pub cached_tokens: AtomicU64,
    pub completion_tokens: AtomicU64,
    /// Time in passes, split between prompt and generated rows by their share of a pass's rows.
    pub prefill_ns: AtomicU64,
    pub decode_ns: AtomicU64,
    pub queued: AtomicU64,
    pub active: AtomicU64,
    pub prefix_cache_entries: AtomicU64,
    pub prefix_cache_bytes: AtomicU64,
    pub prefix_cache_hits: AtomicU64,
    pub prefix_cache_misses: AtomicU64,
    /// Tokens the drafter guessed, and those the model's own choice matched.
    pub draft_proposed: AtomicU64,
    pub draft_accepted: AtomicU64,
    /// Batched passes run, the jobs in them and their rows, summed over the passes.
    pub batched_passes: AtomicU64,
    pub batched_jobs: AtomicU64,
    pub batched_rows: AtomicU64,
    /// Passes that failed and were run again one job at a time, so that only the jobs that fail again alone
    /// fail.
    pub isolated_passes: AtomicU64,
}

struct Queue {
    jobs: VecDeque<Job>,
    /// Jobs the worker holds (admitted, not yet finished).
    active: usize,
    closing: bool,
}

struct Shared {
    cfg: SchedulerConfig,
    queue: Mutex<Queue>,
    wake: Condvar,
    abort: AtomicBool,
    counters: Counters,
    stats: Stats,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Queue> {
        // The queue holds no invariant a panic could break half-way; keep serving.
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }
}

pub struct Scheduler {
    shared: Arc<Shared>,
    worker: Mutex<Option<JoinHandle<()>>>,
}

impl Scheduler {
    /// Starts the worker thread for `model`.
    pub fn start<B: Backend + 'static>(
        model: Arc<B>,
        cfg: SchedulerConfig,
    ) -> std::io::Result<Scheduler> {
        let shared = Arc::new(Shared {
            cfg: SchedulerConfig {
                max_active: cfg.max_active.max(1),
                prefill_chunk: cfg.prefill_chunk.max(1),
                ..cfg
            },
            queue: Mutex::new(Queue {
                jobs: VecDeque::new(),
                active: 0,
                closing: false,
            }),
            wake: Condvar::new(),
            abort: AtomicBool::new(false),
            counters: Counters::default(),
            stats: Stats::default(),
        });
        let worker_shared = shared.clone();
        let worker = std::thread::Builder::new()
            .name("deltafin-scheduler".into())
            .spawn(move || Worker::new(model, worker_shared).run())?;
        Ok(Scheduler {
            shared,
            worker: Mutex::new(Some(worker)),
        })
    }

    /// Queues `job`, or rejects it at once when the queue is full or closing (the job is dropped).
    pub fn submit(&self, job: Job) -> Result<(), Rejected> {
        let mut q = self.shared.lock();
        if q.closing {
            return Err(Rejected::ShuttingDown);
        }
        if q.jobs.len() + q.active >= self.shared.cfg.max_active + self.shared.cfg.queue_capacity {
            return Err(Rejected::QueueFull);
        }
        q.jobs.push_back(job);
        self.shared
            .counters
            .queued
            .store(q.jobs.len() as u64, Ordering::Relaxed);
        self.shared.wake.notify_one();
        Ok(())
    }

    /// Accept no new jobs; those queued and active still run to completion.
    pub fn close(&self) {
        self.shared.lock().closing = true;
        self.shared.wake.notify_one();
    }

    /// Close, and end every queued and active job now with an error.
    pub fn abort(&self) {
        self.shared.abort.store(true, Ordering::Relaxed);
        self.close();
    }

    /// Waits for the worker to exit (after [`Self::close`] once the work is done, or [`Self::abort`]).
    pub fn join(&self) {
        let handle = self.worker.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(h) = handle {
            // The worker catches panics per job; a panic escaping it has already been reported.
            let _ = h.join();
        }
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.shared.cfg
    }

    pub fn counters(&self) -> &Counters {
        &self.shared.counters
    }

    /// Expert I/O of every pass the worker ran.
    pub fn stats(&self) -> &Stats {
        &self.shared.stats
    }
}

impl Drop for Scheduler {
    fn drop(&mut self) {
        self.abort();
        self.join();
    }
}

struct Active<B: Backend> {
    job: Job,
    gen: Generation<B>,
    draft: Option<Draft<Model>>,
    /// The drafter's guesses proposed and accepted that the counters hold.
    counted: (u64, u64),
}

/// A job in a batched pass: what it was before, and the pass it planned.
struct InPass<B: Backend> {
    a: Active<B>,
    was_prefilled: bool,
    plan: Planned<B::Session>,
}

/// What a job does with each token it chooses: counts it and hands it to the sink, with its log-probabilities
/// when the job asked for them.
fn token_callback<'a>(c: &'a Counters, job: &'a mut Job) -> impl FnMut(u32, &[f32]) -> Flow + 'a {
    let (sink, top) = (&mut job.sink, job.top_logprobs);
    move |token, logits| {
        c.completion_tokens.fetch_add(1, Ordering::Relaxed);
        sink.token(token, top.map(|n| logprobs(logits, token, n)))
    }
}

enum Outcome {
    Running,
    /// Finished normally (its state can go to the prefix cache).
    Done,
    Dropped,
}

struct Worker<B: Backend> {
    model: Arc<B>,
    shared: Arc<Shared>,
    cache: PrefixCache<B>,
    /// When the last pass returned, if it ran the next step ahead: that step ran from then on.
    ran_ahead: Option<Instant>,
}

impl<B: Backend> Worker<B> {
    fn new(model: Arc<B>, shared: Arc<Shared>) -> Worker<B> {
        let cache = PrefixCache::new(shared.cfg.prefix_cache_bytes);
        Worker {
            model,
            shared,
            cache,
            ran_ahead: None,
        }
    }

    fn run(mut self) {
        let mut active: Vec<Active<B>> = Vec::new();
        loop {
            let (admitted, closing) = self.admit(active.len());
            let Some(admitted) = admitted else {
                return;
            };
            if self.shared.abort.load(Ordering::Relaxed) {
                for mut a in active.drain(..) {
                    a.job.sink.finished(Err(Rejected::ShuttingDown.to_string()));
                }
                for mut job in admitted {
                    job.sink.finished(Err(Rejected::ShuttingDown.to_string()));
                }
                self.set_active(0);
                if closing {
                    return;
                }
                continue;
            }
            for job in admitted {
                if let Some(a) = self.start(job) {
                    active.push(a);
                }
            }
            active = self.batched(active);
            self.set_active(active.len());
        }
    }

    /// Takes queued jobs into free active slots, sleeping while there is nothing to do. `None`: exit.
    fn admit(&self, n_active: usize) -> (Option<Vec<Job>>, bool) {
        let mut q = self.shared.lock();
        loop {
            let aborting = self.shared.abort.load(Ordering::Relaxed);
            let mut admitted = Vec::new();
            while aborting || n_active + admitted.len() < self.shared.cfg.max_active {
                match q.jobs.pop_front() {
                    Some(job) => admitted.push(job),
                    None => break,
                }
            }
            q.active = n_active + admitted.len();
            let c = &self.shared.counters;
            c.queued.store(q.jobs.len() as u64, Ordering::Relaxed);
            if n_active > 0 || !admitted.is_empty() || aborting {
                return (Some(admitted), q.closing);
            }
            if q.closing {
                return (None, true);
            }
            q = self.shared.wake.wait(q).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Frees a finishing job's slot before its sink hears of the end: a client that sends its next request as
    /// soon as it has the reply must find the slot free, not be refused as if the server were full.
    fn release(&self) {
        let mut q = self.shared.lock();
        q.active = q.active.saturating_sub(1);
    }

    fn set_active(&self, n: usize) {
        self.shared.lock().active = n;
        self.shared
            .counters
            .active
            .store(n as u64, Ordering::Relaxed);
    }

    fn start(&mut self, mut job: Job) -> Option<Active<B>> {
        if job.sink.cancelled() {
            self.shared
                .counters
                .cancelled
                .fetch_add(1, Ordering::Relaxed);
            return None;
        }
        let resume = if job.request.prompt_logits || self.cache.budget_bytes() == 0 {
            Ok(None)
        } else {
            self.cache.lookup(&*self.model, &job.request.prompt)
        };
        self.publish_cache();
        let draft = match &self.shared.cfg.drafter {
            Some(d) => Draft::new(d.guesser.clone(), &*self.model, d.tokens)
                .map(|draft| Some(if d.fixed { draft.fixed() } else { draft })),
            None => Ok(None),
        };
        let started = resume
            .and_then(|r| Generation::new(&*self.model, &job.request, r))
            .and_then(|gen| Ok((gen, draft?)));
        match started {
            Ok((gen, draft)) => Some(Active {
                job,
                gen,
                draft,
                counted: (0, 0),
            }),
            Err(e) => {
                self.shared.counters.failed.fetch_add(1, Ordering::Relaxed);
                self.release();
                job.sink.finished(Err(format!("{e:#}")));
                None
            }
        }
    }

    /// Settles a job after its part of a pass: kept running, remembered, dropped, or failed by a panic.
    fn settle(
        &mut self,
        mut a: Active<B>,
        outcome: std::thread::Result<Outcome>,
        still: &mut Vec<Active<B>>,
    ) {
        match outcome {
            Ok(Outcome::Running) => still.push(a),
            Ok(Outcome::Done) => self.remember(a.gen),
            Ok(Outcome::Dropped) => {}
            Err(panic) => {
                let what = panic_message(&panic);
                self.shared.counters.failed.fetch_add(1, Ordering::Relaxed);
                self.release();
                let sink = &mut a.job.sink;
                let _ = catch_unwind(AssertUnwindSafe(|| {
                    sink.finished(Err(format!("internal error: {what}")))
                }));
            }
        }
    }

    /// Every job's next piece in batched passes: each plans it (a chosen token goes to its sink now), the
    /// pass runs, and each takes its logits; the speculative checks that ran past their taken tokens run those
    /// again in a second pass. A failed pass fails the jobs that fail again alone; a panicking one, the jobs in it.
    fn batched(&mut self, active: Vec<Active<B>>) -> Vec<Active<B>> {
        let shared = self.shared.clone();
        let c = &shared.counters;
        let model = self.model.clone();
        let mut still = Vec::with_capacity(active.len());
        let mut planned: Vec<InPass<B>> = Vec::with_capacity(active.len());
        for mut a in active {
            if a.job.sink.cancelled() {
                c.cancelled.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            let was_prefilled = a.gen.prefilled();
            let plan = catch_unwind(AssertUnwindSafe(|| {
                let on_token = token_callback(c, &mut a.job);
                let chunk = shared.cfg.prefill_chunk;
                match &mut a.draft {
                    Some(d) => a.gen.plan_speculative(&*model, d, chunk, on_token),
                    None => Ok(a.gen.plan(chunk, on_token)),
                }
            }));
            self.route(a, was_prefilled, plan, &mut planned, &mut still);
        }
        let reruns = self.pass(planned, &mut still);
        let again = self.pass(reruns, &mut still);
        debug_assert!(again.is_empty(), "a re-run needs no further pass");
        still
    }

    /// One batched pass of `planned`; each job takes its logits, and is settled unless it needs another pass
    /// (returned).
    fn pass(&mut self, mut planned: Vec<InPass<B>>, still: &mut Vec<Active<B>>) -> Vec<InPass<B>> {
        if planned.is_empty() {
            return planned;
        }
        let shared = self.shared.clone();
        let c = &shared.counters;
        let mut t0 = Instant::now();
        let alone = matches!(&planned[..], [p] if p.plan.decode_step() && p.a.draft.is_none());
        let ran_ahead = self.ran_ahead.take();
        let mut ahead = false;
        let result = if alone {
            let p = &mut planned[0];
            // One job decoding alone: a step of its own, which may run the next one ahead while the
            // scheduler hands this token out and looks for new work (that step's time counts from here).
            ahead = p.a.gen.runs_ahead();
            t0 = ran_ahead.unwrap_or(t0);
            let token = p.plan.tokens[0];
            let session = p.a.gen.session_mut();
            let model = &*self.model;
            catch_unwind(AssertUnwindSafe(|| {
                model
                    .decode(session, token, ahead, &shared.stats)
                    .map(|l| vec![l])
            }))
        } else {
            let mut passes: Vec<Pass<'_, B::Session>> = planned
                .iter_mut()
                .map(|p| Pass {
                    session: p.a.gen.session_mut(),
                    tokens: &p.plan.tokens,
                    rows: p.plan.rows,
                })
                .collect();
            let model = &*self.model;
            catch_unwind(AssertUnwindSafe(|| {
                model.forward_batch(&mut passes, &shared.stats)
            }))
        };
        let ns = t0.elapsed().as_nanos() as u64;
        if ahead {
            self.ran_ahead = Some(Instant::now());
        }
        let rows = |prefill: bool| -> u64 {
            planned
                .iter()
                .filter(|p| p.plan.prefill() == prefill)
                .map(|p| p.plan.tokens.len() as u64)
                .sum()
        };
        let (prefill_rows, decode_rows) = (rows(true), rows(false));
        c.batched_passes.fetch_add(1, Ordering::Relaxed);
        c.batched_jobs
            .fetch_add(planned.len() as u64, Ordering::Relaxed);
        c.batched_rows
            .fetch_add(prefill_rows + decode_rows, Ordering::Relaxed);
        let prefill_ns = ns * prefill_rows / (prefill_rows + decode_rows);
        c.prefill_ns.fetch_add(prefill_ns, Ordering::Relaxed);
        c.decode_ns.fetch_add(ns - prefill_ns, Ordering::Relaxed);
        let vocab = self.model.config().vocab_size;
        // Each job's logits, or why it has none.
        let results: Vec<Result<Vec<f32>, String>> = match result {
            Ok(Ok(l)) => l.into_iter().map(Ok).collect(),
            // A failed pass (an expert read that failed, say) fails only the jobs that fail again alone: each
            // runs its piece by itself on a session rebuilt from its tokens (the pass left every session of it
            // part way).
            Ok(Err(_)) => {
                c.isolated_passes.fetch_add(1, Ordering::Relaxed);
                let chunk = shared.cfg.prefill_chunk;
                planned
                    .iter_mut()
                    .map(|p| {
                        catch_unwind(AssertUnwindSafe(|| {
                            p.a.gen
                                .run_alone(&*self.model, &p.plan, chunk, &shared.stats)
                        }))
                        .map_err(|panic| format!("internal error: {}", panic_message(&panic)))
                        .and_then(|r| r.map_err(|e| format!("{e:#}")))
                    })
                    .collect()
            }
            Err(panic) => {
                let e = format!("internal error: {}", panic_message(&panic));
                planned.iter().map(|_| Err(e.clone())).collect()
            }
        };
        let mut again = Vec::new();
        for (
            InPass {
                mut a,
                was_prefilled,
                plan,
            },
            result,
        ) in planned.into_iter().zip(results)
        {
            // The job's logits applied: a further pass it needs (a re-run), or how it stands.
            let applied = match result {
                Ok(l) => catch_unwind(AssertUnwindSafe(|| {
                    let on_token = token_callback(c, &mut a.job);
                    match &mut a.draft {
                        Some(d) => a.gen.apply_speculative(&*self.model, plan, l, d, on_token),
                        None => {
                            a.gen.apply(plan, l, vocab);
                            Ok(None)
                        }
                    }
                })),
                Err(e) => Ok(Err(anyhow::anyhow!("{e}"))),
            };
            self.route(a, was_prefilled, applied, &mut again, still);
        }
        again
    }

    /// Where a job goes once it has planned or applied: into `next` with the pass it needs, or — no pass
    /// needed (finished by its chosen token), or a failure — settled.
    fn route(
        &mut self,
        mut a: Active<B>,
        was_prefilled: bool,
        step: std::thread::Result<Result<Option<Planned<B::Session>>>>,
        next: &mut Vec<InPass<B>>,
        still: &mut Vec<Active<B>>,
    ) {
        let outcome = match step {
            Ok(Ok(Some(plan))) => {
                next.push(InPass {
                    a,
                    was_prefilled,
                    plan,
                });
                return;
            }
            Ok(step) => catch_unwind(AssertUnwindSafe(|| {
                let step = step.map(|_| a.gen.finish_reason());
                self.after(&mut a, was_prefilled, step)
            })),
            Err(panic) => Err(panic),
        };
        self.count_draft(&mut a);
        self.settle(a, outcome, still);
    }

    /// Adds what the job's drafter guessed and had taken since last counted to the counters.
    fn count_draft(&self, a: &mut Active<B>) {
        if let Some(d) = &a.draft {
            let c = &self.shared.counters;
            c.draft_proposed
                .fetch_add(d.proposed - a.counted.0, Ordering::Relaxed);
            c.draft_accepted
                .fetch_add(d.accepted - a.counted.1, Ordering::Relaxed);
            a.counted = (d.proposed, d.accepted);
        }
    }

    /// What follows a job's pass: a failure ends it; a prompt just consumed is reported (and its state goes
    /// to the prefix cache); a finished generation is reported.
    fn after(
        &mut self,
        a: &mut Active<B>,
        was_prefilled: bool,
        step: Result<Option<FinishReason>>,
    ) -> Outcome {
        let c = &self.shared.counters;
        let finish = match step {
            Ok(f) => f,
            Err(e) => {
                c.failed.fetch_add(1, Ordering::Relaxed);
                self.release();
                a.job.sink.finished(Err(format!("{e:#}")));
                return Outcome::Dropped;
            }
        };
        if !was_prefilled && a.gen.prefilled() {
            let (n, cached) = (a.gen.prompt_len(), a.gen.reused());
            c.prompt_tokens.fetch_add(n as u64, Ordering::Relaxed);
            c.cached_tokens.fetch_add(cached as u64, Ordering::Relaxed);
            // The prompt's own state: a regenerated answer or a next turn that keeps this prompt resumes here.
            if cached < n && finish.is_none() && self.cache.budget_bytes() > 0 {
                match a.gen.snapshot(&*self.model) {
                    Ok(Some((tokens, session, logits))) => {
                        self.cache.insert(&*self.model, tokens, session, logits);
                        self.publish_cache();
                    }
                    Ok(None) => {}
                    Err(e) => {
                        c.failed.fetch_add(1, Ordering::Relaxed);
                        self.release();
                        a.job.sink.finished(Err(format!("{e:#}")));
                        return Outcome::Dropped;
                    }
                }
            }
            if a.job.sink.prefilled(n, cached) == Flow::Stop {
                c.cancelled.fetch_add(1, Ordering::Relaxed);
                return Outcome::Dropped;
            }
        }
        let Some(reason) = finish else {
            return Outcome::Running;
        };
        c.completed.fetch_add(1, Ordering::Relaxed);
        self.release();
        a.job.sink.finished(Ok(Finished {
            reason,
            prompt_tokens: a.gen.prompt_len(),
            cached_tokens: a.gen.reused(),
            completion_tokens: a.gen.tokens().len(),
            prefill_secs: a.gen.prefill_secs(),
            decode_secs: a.gen.decode_secs(),
        }));
        Outcome::Done
    }

    /// Keeps a finished conversation's state for a follow-up request.
    fn remember(&mut self, gen: Generation<B>) {
        if self.cache.budget_bytes() == 0 {
            return;
        }
        if let Some((tokens, session, logits)) = gen.into_snapshot() {
            self.cache.insert(&*self.model, tokens, session, logits);
            self.publish_cache();
        }
    }

    fn publish_cache(&self) {
        let c = &self.shared.counters;
        c.prefix_cache_entries
            .store(self.cache.len() as u64, Ordering::Relaxed);
        c.prefix_cache_bytes
            .store(self.cache.used_bytes() as u64, Ordering::Relaxed);
        c.prefix_cache_hits
            .store(self.cache.hits(), Ordering::Relaxed);
        c.prefix_cache_misses
            .store(self.cache.misses(), Ordering::Relaxed);
    }
}

fn panic_message(p: &Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic in the generation worker".into()
    }
}
