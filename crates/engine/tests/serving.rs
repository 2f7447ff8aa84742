//! The serving pieces on a real (tiny, random) K3 checkpoint: chunked prefill and prefix reuse are exact,
//! the scheduler batches jobs fairly and exactly, rejects past its queue, drops cancelled jobs, and survives a
//! failed pass.

use deltafin_engine::*;
use deltafin_makemodel::{make_model, Arch, Preset};
use deltafin_models::{Backend, Model, Stats};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

fn model() -> &'static Arc<Model> {
    static MODEL: OnceLock<(tempfile::TempDir, Arc<Model>)> = OnceLock::new();
    &MODEL
        .get_or_init(|| {
            let dir = tempfile::tempdir().unwrap();
            make_model(Arch::KimiK3, Preset::Tiny, 0, dir.path()).unwrap();
            let model = Arc::new(Model::load(dir.path()).unwrap());
            (dir, model)
        })
        .1
}

fn request(prompt: &[u32], max_new: usize, temperature: f32) -> Request {
    Request {
        prompt: prompt.to_vec(),
        max_new,
        stop_ids: vec![],
        sampling: SamplingParams {
            temperature,
            seed: 11,
            ..Default::default()
        },
        prompt_logits: false,
    }
}

/// Runs a generation to the end: its tokens and the bits of every logit vector that chose them.
fn drive(
    model: &Model,
    mut gen: Generation<Model>,
    chunk: usize,
) -> (Vec<u32>, Vec<Vec<u32>>, Generation<Model>) {
    let stats = Stats::default();
    let mut logits = Vec::new();
    while gen
        .step(model, &stats, chunk, |_, l| {
            logits.push(l.iter().map(|x| x.to_bits()).collect());
            Flow::Continue
        })
        .unwrap()
        .is_none()
    {}
    (gen.tokens().to_vec(), logits, gen)
}

const PROMPT: [u32; 11] = [5, 17, 300, 42, 9, 500, 77, 3, 250, 18, 64];

#[test]
fn chunked_prefill_matches_one_pass() {
    let m: &Model = model();
    let req = request(&PROMPT, 6, 0.8);
    let whole = generate(m, &req, &Stats::default(), |_, _| Flow::Continue).unwrap();
    for chunk in [1, 3, 64] {
        let (tokens, _, _) = drive(m, Generation::new(m, &req, None).unwrap(), chunk);
        assert_eq!(tokens, whole.tokens, "prefill chunk {chunk}");
    }
}

#[test]
fn a_prompt_extending_a_stored_prefix_gives_the_same_output_as_recomputing() {
    let m: &Model = model();
    let mut cache = PrefixCache::new(64 << 20);
    // Turn 1: a prompt and its answer; keep the state it ends in.
    let (first, _, gen) = drive(
        m,
        Generation::new(m, &request(&PROMPT[..6], 5, 0.9), None).unwrap(),
        4,
    );
    let (tokens, session, logits) = gen.into_snapshot().unwrap();
    assert_eq!(
        tokens.len(),
        6 + first.len() - 1,
        "the last token is chosen, not yet fed"
    );
    assert!(m.session_bytes(&session) > 0);
    cache.insert(m, tokens.clone(), session, logits);

    // Turn 2 extends everything turn 1 consumed.
    let mut prompt2 = tokens.clone();
    prompt2.extend_from_slice(&[first[first.len() - 1], 88, 99]);
    for temperature in [0.0, 1.0] {
        let req = request(&prompt2, 7, temperature);
        let resume = cache.lookup(m, &prompt2).unwrap().expect("a stored prefix");
        assert_eq!(resume.tokens, tokens.len());
        let reused = drive(m, Generation::new(m, &req, Some(resume)).unwrap(), 256);
        let fresh = drive(m, Generation::new(m, &req, None).unwrap(), 256);
        assert_eq!(reused.2.reused(), tokens.len());
        assert_eq!(reused.0, fresh.0, "tokens at temperature {temperature}");
        assert_eq!(
            reused.1, fresh.1,
            "logits bit for bit at temperature {temperature}"
        );
    }

    // A prompt equal to the stored key needs no pass before its first token.
    let req = request(&tokens, 3, 0.0);
    let resume = cache.lookup(m, &tokens).unwrap().unwrap();
    let reused = drive(m, Generation::new(m, &req, Some(resume)).unwrap(), 256);
    let fresh = drive(m, Generation::new(m, &req, None).unwrap(), 256);
    assert_eq!(reused.1, fresh.1);

    // Unrelated prompts miss; a tiny budget keeps nothing.
    assert!(cache.lookup(m, &[1, 2, 3]).unwrap().is_none());
    assert_eq!((cache.hits(), cache.misses()), (3, 1));
    let mut small = PrefixCache::new(16);
    let (t, s, l) = reused.2.into_snapshot().unwrap();
    small.insert(m, t, s, l);
    assert!(small.is_empty());
}

#[test]
fn the_cache_evicts_the_least_recently_used_entry() {
    let m: &Model = model();
    let snap = |prompt: &[u32]| {
        let (_, _, gen) = drive(
            m,
            Generation::new(m, &request(prompt, 0, 0.0), None).unwrap(),
            256,
        );
        gen.into_snapshot().unwrap()
    };
    let (ta, sa, la) = snap(&PROMPT[..3]);
    let entry = m.session_bytes(&sa) + 4 * (3 + la.len());
    let mut cache = PrefixCache::new(2 * entry + entry / 2);
    cache.insert(m, ta.clone(), sa, la);
    let (tb, sb, lb) = snap(&PROMPT[3..6]);
    cache.insert(m, tb.clone(), sb, lb);
    assert!(
        cache.lookup(m, &ta).unwrap().is_some(),
        "touch a: b is now the oldest"
    );
    let (tc, sc, lc) = snap(&PROMPT[6..9]);
    cache.insert(m, tc.clone(), sc, lc);
    assert_eq!(cache.len(), 2);
    assert!(cache.used_bytes() <= cache.budget_bytes());
    assert!(cache.lookup(m, &tb).unwrap().is_none());
    assert!(cache.lookup(m, &ta).unwrap().is_some() && cache.lookup(m, &tc).unwrap().is_some());
}

/// What the engine's copies of a session (prefix reuse, speculative checks, drafting) need of any backend: a
/// fork is the original's state bit for bit — it continues exactly as recomputing would — and each runs on
/// without disturbing the other, also past an MLA cache's first capacity.
fn forks_continue_exactly<B: Backend>(model: &B) {
    let stats = Stats::default();
    let rows = deltafin_models::LogitRows::All;
    let vocab = model.config().vocab_size;
    let long: Vec<u32> = (0..80).map(|i| (i * 37 % vocab) as u32).collect();
    let run = |session: &mut B::Session, tokens: &[u32]| -> Vec<u32> {
        let logits = model.forward(session, tokens, rows, &stats).unwrap();
        logits.iter().map(|x| x.to_bits()).collect()
    };
    let recomputed = |tokens: &[u32]| {
        let mut s = model.new_session().unwrap();
        run(&mut s, &PROMPT);
        run(&mut s, tokens)
    };
    let mut original = model.new_session().unwrap();
    run(&mut original, &PROMPT);
    let mut fork = model.fork(&original).unwrap();
    let mut spare = model.fork(&original).unwrap();
    assert_eq!(model.position(&fork), PROMPT.len());
    assert_eq!(model.session_bytes(&fork), model.session_bytes(&original));
    // The fork runs far ahead first; then the original and another fork continue as if it never had.
    assert_eq!(run(&mut fork, &long), recomputed(&long));
    assert_eq!(run(&mut original, &[7, 8]), recomputed(&[7, 8]));
    assert_eq!(run(&mut spare, &[7, 8]), recomputed(&[7, 8]));
    assert_eq!(model.position(&fork), PROMPT.len() + long.len());
    assert_eq!(model.position(&original), PROMPT.len() + 2);
}

#[test]
fn a_forked_cpu_session_continues_exactly_like_its_original() {
    forks_continue_exactly(&**model());
}

/// A job's id and its result: how it finished and its tokens, or its error.
type Report = (usize, Result<(Finished, Vec<u32>), String>);

/// Records tokens into a shared log and reports the end on a channel.
struct TestSink {
    id: usize,
    log: Arc<Mutex<Vec<usize>>>,
    tokens: Vec<u32>,
    cancel: Arc<AtomicBool>,
    cancel_after: Option<usize>,
    done: mpsc::Sender<Report>,
}

impl Sink for TestSink {
    fn token(&mut self, token: u32, logprob: Option<TokenLogprob>) -> Flow {
        if let Some(lp) = logprob {
            assert_eq!(lp.token, token);
            assert!(lp.logprob <= 0.0 && lp.top.len() == 2);
        }
        self.tokens.push(token);
        self.log.lock().unwrap().push(self.id);
        if Some(self.tokens.len()) == self.cancel_after {
            self.cancel.store(true, Ordering::Relaxed);
        }
        Flow::Continue
    }
    fn finished(&mut self, result: Result<Finished, String>) {
        let tokens = std::mem::take(&mut self.tokens);
        let _ = self.done.send((self.id, result.map(|f| (f, tokens))));
    }
    fn cancelled(&self) -> bool {
        self.cancel.load(Ordering::Relaxed)
    }
}

struct Harness {
    log: Arc<Mutex<Vec<usize>>>,
    tx: mpsc::Sender<Report>,
    rx: mpsc::Receiver<Report>,
}

impl Harness {
    fn new() -> Harness {
        let (tx, rx) = mpsc::channel();
        Harness {
            log: Arc::default(),
            tx,
            rx,
        }
    }
    fn job(&self, id: usize, req: Request, cancel_after: Option<usize>) -> Job {
        Job {
            request: req,
            top_logprobs: Some(2),
            sink: Box::new(TestSink {
                id,
                log: self.log.clone(),
                tokens: vec![],
                cancel: Arc::default(),
                cancel_after,
                done: self.tx.clone(),
            }),
        }
    }
    fn next(&self) -> Report {
        self.rx
            .recv_timeout(Duration::from_secs(60))
            .expect("a job finished within a minute")
    }
}

fn scheduler(max_active: usize, queue_capacity: usize, drafter: Option<Drafter>) -> Scheduler {
    Scheduler::start(
        model().clone(),
        SchedulerConfig {
            max_active,
            queue_capacity,
            prefill_chunk: 4,
            prefix_cache_bytes: 0,
            drafter,
        },
    )
    .unwrap()
}

/// Waits for `reqs`' jobs (submitted to `h` with ids 0..) and checks each got exactly its plain generation's
/// tokens; returns each one's report in id order.
fn expect_plain(h: &Harness, reqs: &[Request]) -> Vec<Finished> {
    let mut done: Vec<Option<Finished>> = vec![None; reqs.len()];
    for _ in reqs {
        let (id, result) = h.next();
        let (fin, tokens) = result.unwrap();
        let plain = generate(&**model(), &reqs[id], &Stats::default(), |_, _| {
            Flow::Continue
        })
        .unwrap();
        assert_eq!(tokens, plain.tokens, "job {id}");
        done[id] = Some(fin);
    }
    done.into_iter()
        .map(|f| f.expect("each job reported once"))
        .collect()
}

/// Three jobs advance together, one piece each in every batched pass: each gets exactly its plain
/// generation's tokens (sampled ones too), and the batch reads fewer expert bytes than the same jobs one at a
/// time (an expert chosen by several jobs is read once a pass).
#[test]
fn the_scheduler_batches_jobs_and_matches_plain_generation() {
    let sched = scheduler(3, 0, None);
    let h = Harness::new();
    let reqs: Vec<Request> = (0..3)
        .map(|i| request(&PROMPT[i..], 12, 0.7 * i as f32))
        .collect();
    for (i, r) in reqs.iter().enumerate() {
        sched.submit(h.job(i, r.clone(), None)).unwrap();
    }
    assert_eq!(
        sched.submit(h.job(9, reqs[0].clone(), None)),
        Err(Rejected::QueueFull)
    );
    for fin in expect_plain(&h, &reqs) {
        assert_eq!(
            (fin.reason, fin.completion_tokens),
            (FinishReason::Length, 12)
        );
    }
    // Fair: one piece per job in every pass, so while all three run, their token counts stay within the few
    // prefill passes by which their starts can differ.
    let log = h.log.lock().unwrap().clone();
    let mut counts = [0usize; 3];
    for &j in &log {
        counts[j] += 1;
        if counts.iter().all(|&c| c < 12) {
            let (lo, hi) = (counts.iter().min().unwrap(), counts.iter().max().unwrap());
            assert!(hi - lo <= 4, "unfair order: {log:?}");
        }
    }
    let c = sched.counters();
    assert_eq!(c.completed.load(Ordering::Relaxed), 3);
    assert_eq!(c.completion_tokens.load(Ordering::Relaxed), 36);
    let (passes, jobs) = (
        c.batched_passes.load(Ordering::Relaxed),
        c.batched_jobs.load(Ordering::Relaxed),
    );
    assert!(
        jobs > 2 * passes,
        "{jobs} job pieces in {passes} passes: not batched"
    );
    let batched = sched.stats().bytes();
    assert!(batched > 0, "expert bytes are counted");
    let one_by_one = scheduler(1, 2, None);
    let h = Harness::new();
    for (i, r) in reqs.iter().enumerate() {
        one_by_one.submit(h.job(i, r.clone(), None)).unwrap();
    }
    expect_plain(&h, &reqs);
    let alone = one_by_one.stats().bytes();
    assert!(
        batched < alone,
        "batched passes read {batched} expert bytes, one job at a time {alone}"
    );
}

#[test]
fn a_cancelled_job_is_dropped_and_the_next_resumes_from_the_cache() {
    let m: &Model = model();
    let sched = Scheduler::start(
        model().clone(),
        SchedulerConfig {
            max_active: 1,
            queue_capacity: 4,
            prefill_chunk: 256,
            prefix_cache_bytes: 64 << 20,
            ..Default::default()
        },
    )
    .unwrap();
    let h = Harness::new();
    // Job 0 is cancelled after 2 of 1000 tokens; job 1 then runs and reports normally.
    sched
        .submit(h.job(0, request(&PROMPT, 1000, 0.0), Some(2)))
        .unwrap();
    let mut longer = PROMPT.to_vec();
    longer.push(7);
    sched
        .submit(h.job(1, request(&longer, 3, 0.0), None))
        .unwrap();
    let (id, result) = h.next();
    assert_eq!(id, 1, "the cancelled job never reports");
    let (fin, tokens) = result.unwrap();
    assert_eq!(h.log.lock().unwrap().iter().filter(|&&j| j == 0).count(), 2);
    assert_eq!(sched.counters().cancelled.load(Ordering::Relaxed), 1);
    // Job 0's prompt state was stored after its prefill; job 1 extends it.
    assert_eq!(fin.cached_tokens, PROMPT.len());
    let plain = generate(m, &request(&longer, 3, 0.0), &Stats::default(), |_, _| {
        Flow::Continue
    })
    .unwrap();
    assert_eq!(tokens, plain.tokens);

    // Bad requests fail through the sink, and the worker keeps serving.
    sched
        .submit(h.job(2, request(&[u32::MAX], 3, 0.0), None))
        .unwrap();
    assert!(h.next().1.unwrap_err().contains("outside the vocabulary"));
    sched.close();
    assert_eq!(
        sched.submit(h.job(3, request(&PROMPT, 1, 0.0), None)),
        Err(Rejected::ShuttingDown)
    );
    sched.join();
}

/// Like [`drive`], with `draft` guessing.
fn drive_speculative(
    model: &Model,
    draft: &mut Draft<Model>,
    mut gen: Generation<Model>,
) -> (Vec<u32>, Vec<Vec<u32>>, Generation<Model>) {
    let stats = Stats::default();
    let mut logits = Vec::new();
    while gen
        .step_speculative(model, draft, &stats, 256, |_, l| {
            logits.push(l.iter().map(|x| x.to_bits()).collect());
            Flow::Continue
        })
        .unwrap()
        .is_none()
    {}
    (gen.tokens().to_vec(), logits, gen)
}

#[test]
fn speculative_steps_stop_where_plain_steps_stop_and_leave_the_same_state() {
    let m: &Model = model();
    let dir = tempfile::tempdir().unwrap();
    make_model(Arch::KimiK3, Preset::Tiny, 1, dir.path()).unwrap();
    let other = Arc::new(Model::load(dir.path()).unwrap());
    let plain = drive(
        m,
        Generation::new(m, &request(&PROMPT, 20, 0.0), None).unwrap(),
        256,
    );
    for temperature in [0.0, 0.9] {
        let mut req = request(&PROMPT, 20, temperature);
        // End on the 7th token of the greedy run when it comes up.
        req.stop_ids = vec![plain.0[6]];
        let (a_tokens, a_logits, a) = drive(m, Generation::new(m, &req, None).unwrap(), 256);
        // A drafter that is always right (the model itself), one that is mostly wrong, and prompt lookup;
        // guessing k every pass, and as many as the cost model chooses.
        let guessers = [
            Guesser::Model(model().clone()),
            Guesser::Model(other.clone()),
            Guesser::Ngram,
        ];
        for (guesser, fixed) in guessers.iter().flat_map(|g| [(g, true), (g, false)]) {
            for k in [1, 3, 8] {
                let draft = Draft::new(guesser.clone(), m, k).unwrap();
                let mut draft = if fixed { draft.fixed() } else { draft };
                let (b_tokens, b_logits, b) =
                    drive_speculative(m, &mut draft, Generation::new(m, &req, None).unwrap());
                assert_eq!(a_tokens, b_tokens, "t={temperature} k={k} fixed={fixed}");
                assert!(a_logits == b_logits, "t={temperature} k={k} fixed={fixed}");
                assert_eq!(draft.reruns, 0, "the CPU rolls back instead");
                assert_eq!(a.finish_reason(), b.finish_reason());
                // Both sessions consumed the same history: the next pass is bit-identical.
                let (ha, mut sa, la) = a.snapshot(m).unwrap().unwrap();
                let (hb, mut sb, lb) = b.into_snapshot().unwrap();
                assert_eq!(ha, hb);
                assert!(la == lb);
                let stats = Stats::default();
                let rows = deltafin_models::LogitRows::Last;
                let next_a = m.forward(&mut sa, &[7], rows, &stats).unwrap();
                let next_b = m.forward(&mut sb, &[7], rows, &stats).unwrap();
                assert!(next_a == next_b);
                if let (Guesser::Model(d), true) = (guesser, fixed) {
                    if Arc::ptr_eq(d, model()) && temperature == 0.0 {
                        assert_eq!(draft.acceptance(), 1.0, "the model agrees with itself");
                    }
                }
            }
        }
    }
}

/// Speculation beside a backend that runs greedy steps ahead: a step that would check guesses while the
/// backend already runs it as a plain step takes that step over and checks one step later, and prompt lookup
/// that finds nothing lets the next step run ahead — so no step run ahead is discarded, and the tokens and
/// logits are plain decoding's.
#[test]
fn speculation_takes_over_steps_run_ahead_instead_of_discarding_them() {
    let m: &Model = model();
    // The prompt twice: prompt lookup finds guesses in the second half and in what the model repeats.
    let prompt: Vec<u32> = PROMPT.iter().chain(&PROMPT).copied().collect();
    let req = request(&prompt, 150, 0.0);
    let (plain_tokens, plain_logits, _) = drive(m, Generation::new(m, &req, None).unwrap(), 256);
    let guessers = [Guesser::Model(model().clone()), Guesser::Ngram];
    for (guesser, fixed) in guessers.iter().flat_map(|g| [(g, true), (g, false)]) {
        let backend = Flaky {
            fail_at: usize::MAX,
            ..Default::default()
        };
        let draft = Draft::new(guesser.clone(), &backend, 3).unwrap();
        let mut draft = if fixed { draft.fixed() } else { draft };
        let mut gen = Generation::new(&backend, &req, None).unwrap();
        let mut logits = Vec::new();
        while gen
            .step_speculative(&backend, &mut draft, &Stats::default(), 256, |_, l| {
                logits.push(l.iter().map(|x| x.to_bits()).collect::<Vec<_>>());
                Flow::Continue
            })
            .unwrap()
            .is_none()
        {}
        let case = format!("fixed={fixed}, ngram={}", matches!(guesser, Guesser::Ngram));
        assert_eq!(gen.tokens(), &plain_tokens[..], "{case}");
        assert!(logits == plain_logits, "{case}");
        assert_eq!(backend.discarded.load(Ordering::Relaxed), 0, "{case}");
        if fixed && matches!(guesser, Guesser::Ngram) {
            // Where lookup finds nothing, steps run ahead even though every step asks for guesses.
            assert!(backend.taken.load(Ordering::Relaxed) > 0, "{case}");
            assert!(draft.passes > 0, "{case}");
        }
    }
}

/// The tiny model, with passes that fail once `fail_at` of them have run (only that one, with `once`); notes
/// whether each decode step asked to run the next one ahead, and plays a backend that does: the step it would
/// run (position and greedy token), and how many such steps were taken over and how many discarded.
#[derive(Default)]
struct Flaky {
    passes: std::sync::atomic::AtomicUsize,
    fail_at: usize,
    once: bool,
    ahead: Mutex<Vec<bool>>,
    running: Mutex<Option<(usize, u32)>>,
    taken: std::sync::atomic::AtomicUsize,
    discarded: std::sync::atomic::AtomicUsize,
}

impl Flaky {
    /// A pass on `session` begins: it takes over the step run ahead when it is that step, else discards it.
    fn pass_begins(&self, session: &deltafin_models::Session, token: Option<u32>) {
        let running = self.running.lock().unwrap().take();
        let at = model().position(session);
        match running {
            Some(r) if token.is_some_and(|t| r == (at, t)) => &self.taken,
            Some(_) => &self.discarded,
            None => return,
        }
        .fetch_add(1, Ordering::Relaxed);
    }
}

impl Backend for Flaky {
    type Session = deltafin_models::Session;
    fn config(&self) -> &deltafin_formats::config::ModelConfig {
        model().config()
    }
    fn store(&self) -> &Arc<deltafin_store::ExpertStore> {
        Backend::store(&**model())
    }
    fn kernels(&self) -> String {
        model().kernels()
    }
    fn reports_layers(&self) -> bool {
        false
    }
    fn new_session(&self) -> anyhow::Result<Self::Session> {
        Backend::new_session(&**model())
    }
    fn decode(
        &self,
        session: &mut Self::Session,
        token: u32,
        ahead: bool,
        stats: &Stats,
    ) -> anyhow::Result<Vec<f32>> {
        self.ahead.lock().unwrap().push(ahead);
        self.pass_begins(session, Some(token));
        let logits = model().decode(session, token, ahead, stats)?;
        if ahead {
            let next = deltafin_engine::sampler::argmax(&logits);
            *self.running.lock().unwrap() = Some((model().position(session), next));
        }
        Ok(logits)
    }
    fn runs_ahead_on(&self, session: &Self::Session, token: u32) -> bool {
        *self.running.lock().unwrap() == Some((model().position(session), token))
    }
    fn forward_batch(
        &self,
        batch: &mut [deltafin_models::Pass<'_, Self::Session>],
        stats: &Stats,
    ) -> anyhow::Result<Vec<Vec<f32>>> {
        for pass in batch.iter() {
            self.pass_begins(pass.session, None);
        }
        let n = self.passes.fetch_add(1, Ordering::Relaxed);
        if n == self.fail_at || (n > self.fail_at && !self.once) {
            anyhow::bail!("the expert store could not read a record");
        }
        model().forward_batch(batch, stats)
    }
    fn fork(&self, session: &Self::Session) -> anyhow::Result<Self::Session> {
        model().fork(session)
    }
    fn position(&self, session: &Self::Session) -> usize {
        model().position(session)
    }
    fn session_bytes(&self, session: &Self::Session) -> usize {
        model().session_bytes(session)
    }
}

/// A batched pass that fails, and whose jobs fail again when each runs alone, ends every job in it with the
/// error, and the scheduler keeps running: the counters say so, and a later job is served (here it fails the
/// same way, reported, not hung).
#[test]
fn a_failed_batched_pass_fails_its_jobs_and_the_scheduler_goes_on() {
    let flaky = Arc::new(Flaky {
        fail_at: 3,
        ..Default::default()
    });
    let sched = Scheduler::start(
        flaky,
        SchedulerConfig {
            max_active: 2,
            queue_capacity: 1,
            prefill_chunk: 4,
            prefix_cache_bytes: 0,
            ..Default::default()
        },
    )
    .unwrap();
    let h = Harness::new();
    for i in 0..2 {
        sched
            .submit(h.job(i, request(&PROMPT, 20, 0.0), None))
            .unwrap();
    }
    for _ in 0..2 {
        let (id, result) = h.next();
        let err = result.expect_err("the pass failed");
        assert!(err.contains("could not read a record"), "job {id}: {err}");
    }
    sched
        .submit(h.job(2, request(&PROMPT, 2, 0.0), None))
        .unwrap();
    assert!(h.next().1.is_err());
    let c = sched.counters();
    assert_eq!(c.failed.load(Ordering::Relaxed), 3);
    assert_eq!(c.completed.load(Ordering::Relaxed), 0);
    // The two jobs' pass, then the later job's.
    assert_eq!(c.isolated_passes.load(Ordering::Relaxed), 2);
}

/// A batched pass that fails once (a read that failed, then succeeds): each of its jobs runs its piece again
/// alone, on a session rebuilt from its tokens, and gets exactly its plain generation's tokens.
#[test]
fn jobs_of_a_failed_batched_pass_that_succeed_alone_complete_with_their_usual_tokens() {
    let flaky = Arc::new(Flaky {
        fail_at: 4,
        once: true,
        ..Default::default()
    });
    let sched = Scheduler::start(
        flaky,
        SchedulerConfig {
            max_active: 3,
            queue_capacity: 0,
            prefill_chunk: 4,
            prefix_cache_bytes: 0,
            ..Default::default()
        },
    )
    .unwrap();
    let h = Harness::new();
    let reqs: Vec<Request> = (0..3)
        .map(|i| request(&PROMPT[i..], 10, 0.7 * i as f32))
        .collect();
    for (i, r) in reqs.iter().enumerate() {
        sched.submit(h.job(i, r.clone(), None)).unwrap();
    }
    expect_plain(&h, &reqs);
    let c = sched.counters();
    assert_eq!(c.isolated_passes.load(Ordering::Relaxed), 1);
    assert_eq!(c.failed.load(Ordering::Relaxed), 0);
}

/// A finished job's slot is free by the time its sink hears of the end: a client that sends its next request on
/// the reply is never refused as if the server were full.
#[test]
fn a_finished_jobs_slot_is_free_when_its_reply_arrives() {
    let sched = scheduler(1, 0, None);
    let h = Harness::new();
    for i in 0..20 {
        sched
            .submit(h.job(i, request(&PROMPT, 1, 0.0), None))
            .unwrap_or_else(|e| panic!("job {i} refused: {e:?}"));
        assert!(h.next().1.is_ok());
    }
}

/// A job decoding alone takes its steps through `Backend::decode`, asking to run the next one ahead while it is
/// greedy and has room for a token after the next (so not on its last step); a sampled job never asks. Both get
/// their plain generation's tokens. `generate` asks the same.
#[test]
fn a_lone_greedy_job_lets_the_backend_run_ahead_until_its_last_step() {
    let backend = Arc::new(Flaky {
        fail_at: usize::MAX,
        ..Default::default()
    });
    let sched = Scheduler::start(
        backend.clone(),
        SchedulerConfig {
            max_active: 1,
            queue_capacity: 2,
            prefill_chunk: 4,
            ..Default::default()
        },
    )
    .unwrap();
    let h = Harness::new();
    let reqs = [request(&PROMPT, 6, 0.0), request(&PROMPT, 6, 0.8)];
    for (i, r) in reqs.iter().enumerate() {
        sched.submit(h.job(i, r.clone(), None)).unwrap();
    }
    expect_plain(&h, &reqs);
    let mut want = vec![true; 4];
    want.extend([false; 6]);
    assert_eq!(*backend.ahead.lock().unwrap(), want);
    // A generation stepped on its own (`run`, `chat`) asks the same.
    generate(&*backend, &reqs[0], &Stats::default(), |_, _| {
        Flow::Continue
    })
    .unwrap();
    want.extend([true, true, true, true, false]);
    assert_eq!(*backend.ahead.lock().unwrap(), want);
}

/// With a drafter, concurrent jobs' checks share batched passes (each rolled back to its taken rows): every job still gets exactly its plain generation's tokens, greedy and sampled, with a drafter that
/// is always right and one that is mostly wrong.
#[test]
fn speculative_jobs_share_passes_and_match_plain_generation() {
    let dir = tempfile::tempdir().unwrap();
    make_model(Arch::KimiK3, Preset::Tiny, 1, dir.path()).unwrap();
    let other = Arc::new(Model::load(dir.path()).unwrap());
    let reqs: Vec<Request> = (0..3)
        .map(|i| request(&PROMPT[i..], 14, 0.6 * i as f32))
        .collect();
    for guesser in [Guesser::Model(model().clone()), Guesser::Model(other)] {
        let drafter = Drafter {
            guesser,
            tokens: 3,
            fixed: true,
        };
        let sched = scheduler(3, 0, Some(drafter));
        let h = Harness::new();
        for (i, r) in reqs.iter().enumerate() {
            sched.submit(h.job(i, r.clone(), None)).unwrap();
        }
        expect_plain(&h, &reqs);
        let c = sched.counters();
        let get = |x: &std::sync::atomic::AtomicU64| x.load(Ordering::Relaxed);
        assert!(get(&c.draft_proposed) > 0, "the drafter guessed");
        assert!(get(&c.draft_accepted) <= get(&c.draft_proposed));
        assert!(
            get(&c.batched_jobs) > get(&c.batched_passes),
            "{} job pieces in {} passes: not batched",
            get(&c.batched_jobs),
            get(&c.batched_passes)
        );
    }
}
