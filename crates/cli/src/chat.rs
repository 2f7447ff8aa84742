//! `deltafin chat`: an interactive conversation, plus the chat prompt and reply printing that `run --chat`
//! shares.

use crate::device::DeviceArgs;
use crate::progress;
use crate::store_args::StoreArgs;
use anyhow::{bail, Context, Result};
use clap::Args;
use deltafin_cuda::Device;
use deltafin_engine::{generate_in, generate_speculative_in, FinishReason, Flow, Request};
use deltafin_formats::config::Family;
use deltafin_models::{Backend, Model, Stats};
use deltafin_tokenizer::chat::{harmony, render_k3, ChatFormat, ChatMessage, Effort, ReplyEvent};
use deltafin_tokenizer::{StreamDecoder, Tokenizer};
use std::io::{BufRead, IsTerminal, Write};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

#[derive(Args)]
pub struct ChatArgs {
    /// Hugging Face checkpoint directory (config.json, safetensors shards, tokenizer files).
    #[arg(long)]
    model: std::path::PathBuf,
    /// A system message that opens the conversation (default: none).
    #[arg(long)]
    system: Option<String>,
    /// Thinking effort: announced to K3 in a system message (low, high or max; default: none, the
    /// model's own default), or harmony's reasoning effort (low or high; default medium).
    #[arg(long)]
    effort: Option<Effort>,
    /// Most tokens per reply.
    #[arg(long, default_value_t = 1024)]
    max_new: usize,
    #[command(flatten)]
    sampling: crate::SamplingArgs,
    /// Do not print the model's reasoning (default: printed before the answer, dimmed on a terminal).
    #[arg(long)]
    hide_reasoning: bool,
    /// Print the [stats] line (time, tokens, expert reads) to stderr after each reply.
    #[arg(long)]
    stats: bool,
    #[command(flatten)]
    draft: crate::DraftArgs,
    #[command(flatten)]
    store: StoreArgs,
    #[command(flatten)]
    device: DeviceArgs,
}

/// The checkpoint's chat format (the tokenizer files decide: [`ChatFormat`]), or why it cannot chat.
pub fn chat_format(dir: &Path, tok: &Tokenizer, family: Family) -> Result<ChatFormat> {
    match ChatFormat::from_dir(dir, tok, family == Family::KimiK3)? {
        Some(format) => Ok(format),
        None => bail!(
            "{} has no chat template (chat_template.jinja or chat_template in tokenizer_config.json). Add one, or use `deltafin run` without --chat for plain completion.",
            dir.display()
        ),
    }
}

/// Prompt ids for `messages` followed by the assistant's turn; `effort` goes to K3's thinking-effort
/// message or harmony's reasoning effort (a template has none).
pub fn chat_prompt(
    format: &ChatFormat,
    tok: &Tokenizer,
    messages: &[ChatMessage],
    effort: Option<Effort>,
) -> Result<Vec<u32>> {
    let pieces = match format {
        ChatFormat::K3 => render_k3(messages, effort, true),
        ChatFormat::Harmony => harmony::render_chat(messages, None, harmony_effort(effort)?)?,
        ChatFormat::Template(t) => t.render(messages, true, None)?,
    };
    Ok(tok.encode_pieces(&pieces))
}

fn harmony_effort(effort: Option<Effort>) -> Result<Option<harmony::ReasoningEffort>> {
    Ok(match effort {
        None => None,
        Some(Effort::Low) => Some(harmony::ReasoningEffort::Low),
        Some(Effort::High) => Some(harmony::ReasoningEffort::High),
        Some(Effort::Max) => bail!(
            "--effort max is K3's; harmony's reasoning efforts are low, medium (the default) and high"
        ),
    })
}

/// Ids that end the assistant's turn: the model's EOS, the checkpoint's and the format's stop tokens.
pub fn stop_ids(format: &ChatFormat, tok: &Tokenizer, model_eos: Option<u32>) -> Vec<u32> {
    let mut ids: Vec<u32> = model_eos.into_iter().chain(tok.eos_ids()).collect();
    ids.extend(
        format
            .stop_tokens()
            .iter()
            .filter_map(|n| tok.special_id(n)),
    );
    ids.sort_unstable();
    ids.dedup();
    ids
}

/// Prints reasoning and content as reply events arrive. On a terminal reasoning is dimmed; otherwise it
/// is marked `[thinking]` and the answer `[answer]`, so piped output stays readable and parseable.
pub struct ReplyPrinter {
    tty: bool,
    show_reasoning: bool,
    section: Option<Section>,
    pub reply: ChatMessage,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Section {
    Reasoning,
    Content,
}

impl ReplyPrinter {
    pub fn new(show_reasoning: bool) -> Self {
        ReplyPrinter {
            tty: std::io::stdout().is_terminal(),
            show_reasoning,
            section: None,
            reply: ChatMessage::assistant(""),
        }
    }

    fn enter(&mut self, out: &mut impl Write, section: Section) -> std::io::Result<()> {
        if self.section == Some(section) {
            return Ok(());
        }
        let previous = self.section.replace(section);
        match (self.tty, section) {
            (true, Section::Reasoning) => write!(out, "\x1b[2m"),
            (true, Section::Content) if previous == Some(Section::Reasoning) => {
                write!(out, "\x1b[0m\n\n")
            }
            (true, Section::Content) => Ok(()),
            (false, Section::Reasoning) => write!(out, "[thinking] "),
            (false, Section::Content) if previous.is_some() => write!(out, "\n[answer] "),
            (false, Section::Content) => write!(out, "[answer] "),
        }
    }

    pub fn print(&mut self, out: &mut impl Write, events: Vec<ReplyEvent>) -> std::io::Result<()> {
        for event in events {
            match event {
                ReplyEvent::Reasoning(t) => {
                    self.reply
                        .reasoning
                        .get_or_insert_with(String::new)
                        .push_str(&t);
                    if self.show_reasoning {
                        self.enter(out, Section::Reasoning)?;
                        out.write_all(t.as_bytes())?;
                    }
                }
                ReplyEvent::Content(t) => {
                    self.reply.content.push_str(&t);
                    self.enter(out, Section::Content)?;
                    out.write_all(t.as_bytes())?;
                }
                ReplyEvent::ToolCall(call) => {
                    self.enter(out, Section::Content)?;
                    write!(
                        out,
                        "\n[tool call {} id={}] {}",
                        call.name, call.id, call.arguments
                    )?;
                    self.reply.tool_calls.push(call);
                }
            }
        }
        out.flush()
    }

    /// Ends the reply's output with a newline (and resets the terminal's colour).
    pub fn end(&mut self, out: &mut impl Write) -> std::io::Result<()> {
        if self.tty && self.section == Some(Section::Reasoning) {
            write!(out, "\x1b[0m")?;
        }
        writeln!(out)?;
        out.flush()
    }
}

/// Set by Ctrl-C while a reply is being generated: the token callback stops at the next token.
static STOP_REPLY: AtomicBool = AtomicBool::new(false);
static GENERATING: AtomicBool = AtomicBool::new(false);

/// Ctrl-C stops the reply being generated; at the prompt it ends the program (exit status 130).
fn install_ctrl_c() -> Result<()> {
    ctrlc::set_handler(|| {
        if GENERATING.load(Ordering::SeqCst) {
            STOP_REPLY.store(true, Ordering::SeqCst);
        } else {
            eprintln!();
            std::process::exit(130);
        }
    })
    .context("cannot install the Ctrl-C handler")
}

const HELP: &str =
    "Type a message and press Enter. /reset starts a new conversation, /exit (or Ctrl-D) quits; Ctrl-C stops a reply.";

pub fn chat(a: ChatArgs) -> Result<()> {
    let t_load = Instant::now();
    let load = a.store.load_options(&a.model)?;
    match a.device.device {
        Device::Cpu => {
            let model =
                progress::while_busy("loading the model", || Model::load_with(&a.model, &load))?;
            let spine = deltafin_models::streamed_spine_bytes(&a.model, model.streamed_layers())?;
            converse(&a, &model, t_load, Some(spine))
        }
        Device::Cuda(ordinal) => {
            let model = a.device.load_cuda(ordinal, &a.model, &load, false)?;
            converse(&a, &model, t_load, None)
        }
    }
}

/// The conversation with `model` (loading began at `t_load`), whose passes each read `spine_per_pass` bytes
/// of the spine from disk (when known).
fn converse<B: Backend>(
    a: &ChatArgs,
    model: &B,
    t_load: Instant,
    spine_per_pass: Option<u64>,
) -> Result<()> {
    let tok = load_tokenizer(&a.model)?;
    let format = chat_format(&a.model, &tok, model.config().family)?;
    let load_secs = t_load.elapsed().as_secs_f64();
    let stop_ids = stop_ids(&format, &tok, model.config().eos_token_id);
    let sampling = a.sampling.params();
    // One drafter for the whole conversation: its cost model keeps what it measured from reply to reply.
    let mut draft = a.draft.load(model)?;
    install_ctrl_c()?;

    let fresh_history =
        || -> Vec<ChatMessage> { a.system.iter().map(ChatMessage::system).collect() };
    let mut history = fresh_history();
    // The session holds exactly `session_tokens`; a new prompt that extends them continues it.
    let mut session = model.new_session()?;
    let mut session_tokens: Vec<u32> = Vec::new();
    eprintln!("deltafin chat with {}. {HELP}", a.model.display());
    let stdin = std::io::stdin();
    let mut line = String::new();
    loop {
        eprint!("> ");
        std::io::stderr().flush()?;
        line.clear();
        if stdin.lock().read_line(&mut line)? == 0 {
            eprintln!();
            break;
        }
        let text = line.trim_end_matches(['\n', '\r']);
        match text.trim() {
            "" => continue,
            "/exit" | "/quit" => break,
            "/reset" => {
                history = fresh_history();
                session = model.new_session()?;
                session_tokens.clear();
                eprintln!("(new conversation)");
                continue;
            }
            "/help" => {
                eprintln!("{HELP}");
                continue;
            }
            cmd if cmd.starts_with('/') => {
                eprintln!("unknown command {cmd}; try /help");
                continue;
            }
            _ => {}
        }
        history.push(ChatMessage::user(text));
        let prompt = chat_prompt(&format, &tok, &history, a.effort)?;
        let new_tokens = match prompt.strip_prefix(&session_tokens[..]) {
            Some(rest) if !rest.is_empty() => rest.to_vec(),
            _ => {
                session = model.new_session()?;
                session_tokens.clear();
                prompt.clone()
            }
        };
        let req = Request {
            prompt: new_tokens,
            max_new: a.max_new,
            stop_ids: stop_ids.clone(),
            sampling: sampling.clone(),
            prompt_logits: false,
        };
        let (prefill, stats) = progress::prefill_bar(
            req.prompt.len(),
            model.reports_layers().then_some(model.config().num_layers),
            Stats::default(),
        );
        let mut printer = ReplyPrinter::new(!a.hide_reasoning);
        let mut parser = format.reply_parser();
        let mut decoder = StreamDecoder::new(&tok);
        let mut out = std::io::stdout().lock();
        let mut failure: Option<anyhow::Error> = None;
        STOP_REPLY.store(false, Ordering::SeqCst);
        GENERATING.store(true, Ordering::SeqCst);
        let on_token = |token, _: &[f32]| {
            prefill.finish_and_clear();
            if STOP_REPLY.load(Ordering::SeqCst) {
                return Flow::Stop;
            }
            match printer.print(&mut out, parser.push(&decoder.push(token))) {
                Ok(()) => Flow::Continue,
                Err(e) => {
                    failure = Some(e.into());
                    Flow::Stop
                }
            }
        };
        let result = match &mut draft {
            Some(d) => generate_speculative_in(model, d, session, &req, &stats, on_token),
            None => generate_in(model, session, &req, &stats, on_token),
        };
        GENERATING.store(false, Ordering::SeqCst);
        prefill.finish_and_clear();
        let output;
        (output, session) = result?;
        if let Some(e) = failure {
            return Err(e);
        }
        printer.print(&mut out, parser.finish(&decoder.finish()))?;
        printer.end(&mut out)?;
        drop(out);
        if output.finish == FinishReason::Caller {
            eprintln!("[stopped]");
        }
        if a.stats {
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
        // The session now holds the prompt and every generated token but the last (never fed back).
        session_tokens.extend_from_slice(&req.prompt);
        session_tokens.extend_from_slice(&output.tokens[..output.tokens.len().saturating_sub(1)]);
        history.push(printer.reply);
    }
    Ok(())
}

pub fn load_tokenizer(dir: &Path) -> Result<Tokenizer> {
    if !Tokenizer::present_in(dir) {
        bail!(
            "{} has no tiktoken.model or tokenizer.json, so text cannot be tokenized. Point --model at a checkpoint directory that includes its tokenizer files.",
            dir.display()
        );
    }
    Tokenizer::from_dir(dir)
}
