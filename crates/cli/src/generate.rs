//! `run` and `demo`: tokenize (raw or as a chat), generate with the engine on the CPU or a GPU, stream the
//! text, and with `--stats` report where the time went.

use crate::chat::{chat_format, chat_prompt, stop_ids, ReplyPrinter};
use crate::device::{self, DeviceArgs};
use crate::progress;
use crate::GenArgs;
use anyhow::{bail, Context, Result};
use deltafin_cuda::Device;
use deltafin_engine::{generate, generate_speculative, Draft, Flow, Request};
use deltafin_formats::npy;
use deltafin_models::{Backend, LoadOptions, Model, Stats};
use deltafin_tokenizer::chat::ChatFormat;
use deltafin_tokenizer::chat::ChatMessage;
use deltafin_tokenizer::{StreamDecoder, Tokenizer};
use std::io::Write;
use std::path::Path;
use std::time::Instant;

/// Loads the model on `dev` and generates. On a GPU, `probe` first measures its copy bandwidths, and a
/// `[cuda]` line of what the device did follows the output.
pub fn run(
    dir: &Path,
    args: &GenArgs,
    load: &LoadOptions,
    dev: &DeviceArgs,
    probe: bool,
    timeline: bool,
) -> Result<()> {
    let t_load = Instant::now();
    match dev.device {
        Device::Cpu => {
            if timeline {
                bail!("--timeline times the GPU's kernels: add --device cuda");
            }
            let model = progress::while_busy("loading the model", || Model::load_with(dir, load))?;
            let load_secs = t_load.elapsed().as_secs_f64();
            let spine = deltafin_models::streamed_spine_bytes(dir, model.streamed_layers())?;
            generate_on(dir, &model, load_secs, args, Some(spine))
        }
        Device::Cuda(ordinal) => {
            if args.events.is_some() {
                bail!("--events needs the CPU backend: the CUDA passes record no per-layer times or routes");
            }
            let model = dev.load_cuda(ordinal, dir, load, timeline)?;
            let load_secs = t_load.elapsed().as_secs_f64();
            if probe {
                device::probe_bandwidth(&model)?;
            }
            let timed = device::Timed::new(&model);
            generate_on(dir, &timed, load_secs, args, None)?;
            eprintln!("{}", timed.line(load_secs));
            if let Some(r) = model.timeline_report() {
                eprintln!("{r}");
            }
            Ok(())
        }
    }
}

impl crate::DraftArgs {
    /// The drafter these flags ask for, if any. A drafting model is small: it runs on the CPU whatever the
    /// model runs on.
    pub(crate) fn load(&self, model: &impl Backend) -> Result<Option<Draft<Model>>> {
        let Some(arg) = &self.draft else {
            return Ok(None);
        };
        let guesser = progress::while_busy("loading the drafter", || arg.load())?;
        let draft = Draft::new(guesser, model, self.draft_tokens)?;
        Ok(Some(if self.draft_fixed {
            draft.fixed()
        } else {
            draft
        }))
    }
}

/// Generates on `model`, loaded in `load_secs`, whose passes each read `spine_per_pass` bytes of the spine
/// from disk (when known).
fn generate_on<B: Backend>(
    dir: &Path,
    model: &B,
    load_secs: f64,
    args: &GenArgs,
    spine_per_pass: Option<u64>,
) -> Result<()> {
    let t_prepare = Instant::now();
    let cfg = model.config();
    let vocab = cfg.vocab_size;
    let tokenizer = if Tokenizer::present_in(dir) {
        Some(Tokenizer::from_dir(dir)?)
    } else {
        None
    };
    let format = match (args.chat, &tokenizer) {
        (false, _) => None,
        (true, Some(tok)) => Some(chat_format(dir, tok, cfg.family)?),
        (true, None) => bail!(
            "--chat needs the tokenizer files (tiktoken.model or tokenizer.json), which {} lacks",
            dir.display()
        ),
    };
    let prompt: Vec<u32> = match (&args.prompt, &args.prompt_ids) {
        (Some(text), _) => {
            let tok = tokenizer.as_ref().with_context(|| {
                format!(
                    "{} has no tiktoken.model or tokenizer.json; pass --prompt-ids instead of --prompt",
                    dir.display()
                )
            })?;
            match &format {
                Some(f) => {
                    let mut messages: Vec<ChatMessage> =
                        args.system.iter().map(ChatMessage::system).collect();
                    messages.push(ChatMessage::user(text));
                    chat_prompt(f, tok, &messages, args.effort)?
                }
                None => tok.encode(text),
            }
        }
        (None, Some(ids)) => ids.clone(),
        (None, None) => bail!("pass --prompt TEXT or --prompt-ids 1,2,3"),
    };
    let load_secs = load_secs + t_prepare.elapsed().as_secs_f64();

    let stop_ids = match (&format, &tokenizer) {
        _ if args.ignore_eos => vec![],
        (Some(f), Some(tok)) => stop_ids(f, tok, cfg.eos_token_id),
        _ => cfg.eos_token_id.into_iter().collect(),
    };
    let req = Request {
        prompt,
        max_new: args.max_new,
        stop_ids,
        sampling: args.sampling.params(),
        prompt_logits: args.dump_logits.is_some(),
    };
    let (prefill, stats) = progress::prefill_bar(
        req.prompt.len(),
        model.reports_layers().then_some(model.config().num_layers),
        if args.events.is_some() {
            Stats::with_routes()
        } else {
            Stats::default()
        },
    );
    let mut events = match &args.events {
        Some(path) => Some(crate::report::Events::create(path, model)?),
        None => None,
    };
    let mut out = std::io::stdout().lock();
    let mut chosen_logits: Vec<f32> = Vec::new();
    let mut decoder = tokenizer.as_ref().map(StreamDecoder::new);
    let mut parser = format.as_ref().map(ChatFormat::reply_parser);
    let mut printer = ReplyPrinter::new(true);
    let mut failure = None;
    // A drafting model is small: it runs on the CPU whatever the model runs on.
    let mut draft = args.draft.load(model)?;
    let on_token = |token: u32, logits: &[f32]| {
        prefill.finish_and_clear();
        if let Some(ev) = &mut events {
            if let Err(e) = ev.token(model, &stats, token) {
                failure = Some(e);
                return Flow::Stop;
            }
        }
        if args.dump_logits.is_some() {
            chosen_logits.extend_from_slice(logits);
        }
        if let Some(decoder) = &mut decoder {
            let text = decoder.push(token);
            let step = match &mut parser {
                Some(p) => printer.print(&mut out, p.push(&text)),
                None => out.write_all(text.as_bytes()).and_then(|_| out.flush()),
            };
            if let Err(e) = step {
                failure = Some(e.into());
                return Flow::Stop;
            }
        }
        Flow::Continue
    };
    let output = match &mut draft {
        Some(d) => generate_speculative(model, d, &req, &stats, on_token)?,
        None => generate(model, &req, &stats, on_token)?,
    };
    prefill.finish_and_clear();
    if let Some(e) = failure {
        return Err(e);
    }
    if let Some(decoder) = &mut decoder {
        let rest = decoder.finish();
        match &mut parser {
            Some(p) => {
                printer.print(&mut out, p.finish(&rest))?;
                printer.end(&mut out)?;
            }
            None => writeln!(out, "{rest}")?,
        }
    }
    if args.print_ids || tokenizer.is_none() {
        writeln!(out, "{}", serde_json::to_string(&output.tokens)?)?;
    }
    if let Some(path) = &args.dump_logits {
        // Prompt rows, then row P+j = the logits that chose generated[j] (row P repeats the last prompt row).
        let mut rows = output.prompt_logits.clone().unwrap_or_default();
        rows.extend_from_slice(&chosen_logits);
        npy::write_f32(path, rows.len() / vocab, vocab, &rows)?;
    }
    if args.stats {
        crate::report::print_stats(
            model,
            &stats,
            req.prompt.len(),
            &output,
            load_secs,
            spine_per_pass,
            draft.as_ref(),
        );
    }
    Ok(())
}
