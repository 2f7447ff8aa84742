//! `deltafin serve`: flags, starting up, and SIGTERM / Ctrl-C handling.

use crate::{serve, ServerConfig};
use anyhow::{bail, Context, Result};
use clap::Args;
use deltafin_engine::{Draft, DraftArg, Drafter, SchedulerConfig};
use deltafin_formats::config::Family;
use deltafin_models::{Backend, Model};
use deltafin_tokenizer::chat::{ChatFormat, ChatTemplate};
use deltafin_tokenizer::Tokenizer;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

#[derive(Args, Debug)]
pub struct ServeArgs {
    /// Hugging Face checkpoint directory (config.json, safetensors shards, tiktoken.model or tokenizer.json).
    #[arg(long)]
    pub model: PathBuf,
    /// Address to listen on (use 0.0.0.0 to accept other machines; then set --api-key).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Require `Authorization: Bearer KEY` on /v1/* (401 otherwise). /health and /metrics stay open.
    #[arg(long)]
    pub api_key: Option<String>,
    /// The model id clients send and /v1/models lists (default: the directory's name).
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// Generations computed at once: every forward pass is a batch of each one's next token or prompt chunk.
    #[arg(long, default_value_t = 4)]
    pub max_active: usize,
    /// Requests that may wait for a slot; beyond that the server answers 429 with Retry-After.
    #[arg(long, default_value_t = 16)]
    pub queue: usize,
    /// Most prompt tokens per forward pass (other generations advance between chunks).
    #[arg(long, default_value_t = 256)]
    pub prefill_chunk: usize,
    /// Memory for stored conversation states reused by prompts that extend them (0 = off).
    #[arg(long, default_value_t = 1024)]
    pub prefix_cache_mb: usize,
    /// Largest request body; larger gets 413.
    #[arg(long, default_value_t = 8)]
    pub max_body_mb: usize,
    /// Prompt plus generated tokens per request.
    #[arg(long, default_value_t = 65536)]
    pub max_context: usize,
    /// max_tokens for chat requests that give none.
    #[arg(long, default_value_t = 4096)]
    pub default_max_tokens: usize,
    /// Seconds of silence after which a stream gets an SSE keep-alive comment.
    #[arg(long, default_value_t = 10)]
    pub keep_alive_secs: u64,
    /// After SIGTERM, seconds in-flight requests may take before they are ended.
    #[arg(long, default_value_t = 30)]
    pub shutdown_grace_secs: u64,
    /// Speculative decoding: `ngram` (prompt lookup: the tokens that followed the latest earlier occurrence of
    /// the last few, for any model) or a small model's directory (sharing the tokenizer; on the CPU) guesses
    /// the next tokens of every generation and the model checks them in one pass. Replies are exactly those
    /// without it.
    #[arg(long, value_name = "ngram|DIR")]
    pub draft: Option<DraftArg>,
    /// Most tokens guessed per pass of the model; each pass guesses as many as measurements say pay (perhaps
    /// none).
    #[arg(long, default_value_t = 4, requires = "draft")]
    pub draft_tokens: usize,
}

/// `load` opens the checkpoint directory on the backend the caller chose (the CLI's device and store flags).
pub fn run<B: Backend + 'static>(
    a: ServeArgs,
    load: impl FnOnce(&Path) -> Result<B>,
) -> Result<()> {
    if a.max_active == 0 {
        bail!("--max-active must be at least 1");
    }
    let model = Arc::new(load(&a.model)?);
    let tokenizer = Arc::new(Tokenizer::from_dir(&a.model)?);
    let builtin = ChatFormat::builtin(&tokenizer, model.config().family == Family::KimiK3);
    let chat_template = match builtin {
        Some(_) => None,
        None => ChatTemplate::from_dir(&a.model)?.map(Arc::new),
    };
    let drafter = match &a.draft {
        Some(arg) => Some(drafter(arg, &*model, a.draft_tokens)?),
        None => None,
    };
    let name = match a.served_model_name {
        Some(n) => n,
        None => a
            .model
            .canonicalize()
            .ok()
            .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
            .unwrap_or_else(|| "deltafin".into()),
    };
    let cfg = ServerConfig {
        model_name: name,
        api_key: a.api_key,
        max_body_bytes: a.max_body_mb << 20,
        scheduler: SchedulerConfig {
            max_active: a.max_active,
            queue_capacity: a.queue,
            prefill_chunk: a.prefill_chunk,
            prefix_cache_bytes: a.prefix_cache_mb << 20,
            drafter,
        },
        max_context: a.max_context,
        default_max_tokens: a.default_max_tokens,
        keep_alive: Duration::from_secs(a.keep_alive_secs.max(1)),
        shutdown_grace: Duration::from_secs(a.shutdown_grace_secs),
        chat_template,
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let addr = format!("{}:{}", a.host, a.port);
        let listener = tokio::net::TcpListener::bind(&addr)
            .await
            .with_context(|| format!("cannot listen on {addr}"))?;
        eprintln!(
            "deltafin: serving {:?} on http://{}/v1 (Ctrl-C or SIGTERM stops it)",
            cfg.model_name,
            listener.local_addr()?
        );
        serve(listener, model, tokenizer, cfg, shutdown_signal()).await?;
        eprintln!("deltafin: stopped");
        Ok(())
    })
}

/// The `--draft` guesser, refused at start (not per request) when it cannot draft for `model`: the
/// scheduler's own check, [`Draft::new`], is tried once here.
fn drafter(arg: &DraftArg, model: &impl Backend, tokens: usize) -> Result<Drafter> {
    let guesser = arg.load()?;
    Draft::<Model>::new(guesser.clone(), model, tokens)
        .context("the --draft model cannot draft for this one")?;
    Ok(Drafter {
        guesser,
        tokens,
        fixed: false,
    })
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
    eprintln!("deltafin: shutting down (finishing in-flight requests)");
}
