//! deltafin's OpenAI-compatible HTTP API (axum on tokio): `/v1/models`, `/v1/chat/completions`,
//! `/v1/completions`, `/v1/responses` (streaming and not), Anthropic's `/v1/messages` (and its
//! `count_tokens`), `/health`, `/metrics`.
//!
//! Model work never runs on the async runtime: each request becomes a [`Job`] for the engine's [`Scheduler`]
//! (one worker thread, every active request's next piece in one batched pass, bounded queue), and its tokens
//! come back over a channel. A client that goes away drops the channel, which cancels its job before the next
//! forward pass.

mod api;
mod chat;
mod cli;
mod dialect;
mod error;
mod metrics;
mod prompt;
mod respond;
mod sink;

pub use cli::{run, ServeArgs};

use anyhow::{Context, Result};
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use deltafin_engine::{Scheduler, SchedulerConfig};
use deltafin_formats::config::Family;
use deltafin_models::Backend;
use deltafin_store::ExpertStore;
use deltafin_tokenizer::chat::{ChatFormat, ChatTemplate, K3_END_OF_MSG};
use deltafin_tokenizer::Tokenizer;
use dialect::chat::Chat;
use dialect::completions::Completions;
use dialect::messages::{self, Messages};
use dialect::responses::Responses;
use dialect::Dialect;
use error::ApiError;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// The id clients use in `model` (and see in `/v1/models`).
    pub model_name: String,
    /// When set, `/v1/*` requires `Authorization: Bearer <key>`.
    pub api_key: Option<String>,
    /// Largest accepted request body (larger gets 413).
    pub max_body_bytes: usize,
    pub scheduler: SchedulerConfig,
    /// Prompt plus generated tokens may not exceed this.
    pub max_context: usize,
    /// `max_tokens` when a chat request gives none (completions default to 16, as OpenAI's).
    pub default_max_tokens: usize,
    /// Idle time after which a stream gets an SSE comment (e.g. during a long prefill).
    pub keep_alive: Duration,
    /// After a shutdown signal, how long in-flight generations may run before they are ended with an error.
    pub shutdown_grace: Duration,
    /// The checkpoint's Jinja chat template, through which a model chats when deltafin has no built-in
    /// format for it (K3's and harmony's are built in: [`ChatFormat::builtin`]). Without either it serves
    /// only `/v1/completions`.
    pub chat_template: Option<Arc<ChatTemplate>>,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            model_name: "deltafin".into(),
            api_key: None,
            max_body_bytes: 8 << 20,
            scheduler: SchedulerConfig::default(),
            max_context: 65536,
            default_max_tokens: 4096,
            keep_alive: Duration::from_secs(10),
            shutdown_grace: Duration::from_secs(30),
            chat_template: None,
        }
    }
}

pub(crate) struct AppState {
    cfg: ServerConfig,
    sched: Arc<Scheduler>,
    /// Where routed experts are read from (its counters feed `/metrics`).
    store: Arc<ExpertStore>,
    tokenizer: Arc<Tokenizer>,
    /// How chat prompts are written and replies read, or why this model cannot chat.
    chat: Result<chat::Chat, String>,
    vocab: usize,
    /// Tokens that end a generation: the model's EOS, `<|end_of_msg|>` and the chat format's stop tokens.
    stop_ids: Vec<u32>,
    http: metrics::HttpCounters,
    next_id: AtomicU64,
    created: u64,
}

/// Serves `model` (on whichever backend computes it) on `listener` until `shutdown` resolves, then stops
/// accepting, lets in-flight requests finish for up to `shutdown_grace`, ends what is left with an error, and
/// returns once the worker has exited.
pub async fn serve<B: Backend + 'static>(
    listener: tokio::net::TcpListener,
    model: Arc<B>,
    tokenizer: Arc<Tokenizer>,
    cfg: ServerConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<()> {
    let format = ChatFormat::builtin(&tokenizer, model.config().family == Family::KimiK3)
        .or_else(|| cfg.chat_template.clone().map(ChatFormat::Template));
    let mut stop_ids: Vec<u32> = model.config().eos_token_id.into_iter().collect();
    stop_ids.extend(tokenizer.eos_ids());
    stop_ids.extend(tokenizer.special_id(K3_END_OF_MSG));
    if let Some(f) = &format {
        stop_ids.extend(
            f.stop_tokens()
                .iter()
                .filter_map(|n| tokenizer.special_id(n)),
        );
    }
    stop_ids.sort_unstable();
    stop_ids.dedup();
    let sched = Arc::new(
        Scheduler::start(model.clone(), cfg.scheduler.clone())
            .context("starting the generation worker")?,
    );
    let state = Arc::new(AppState {
        chat: match format {
            Some(f) => chat::Chat::new(f, &tokenizer).map_err(|e| format!("{e:#}")),
            None => Err(
                "the checkpoint has no chat template (chat_template.jinja, or \
                 chat_template in tokenizer_config.json)"
                    .into(),
            ),
        },
        vocab: model.config().vocab_size,
        stop_ids,
        tokenizer,
        store: model.store().clone(),
        sched: sched.clone(),
        http: Default::default(),
        next_id: AtomicU64::new(1),
        created: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        cfg,
    });
    let grace = state.cfg.shutdown_grace;
    let on_signal = sched.clone();
    let signal = async move {
        shutdown.await;
        on_signal.close();
        tokio::spawn(async move {
            tokio::time::sleep(grace).await;
            on_signal.abort();
        });
    };
    axum::serve(listener, router(state))
        .with_graceful_shutdown(signal)
        .await
        .context("serving HTTP")?;
    sched.close();
    tokio::task::spawn_blocking(move || sched.join()).await?;
    Ok(())
}

/// Parses and validates a request body as the handler of `route` does before anything reaches the tokenizer
/// or the model: `None` for a route that takes no body, else the client-facing error body if it is refused.
/// The parsers' one entry point from outside (the fuzzer's).
pub fn parse_request(route: &str, body: &[u8]) -> Option<Result<(), serde_json::Value>> {
    let parsed = match route {
        "/v1/chat/completions" => Chat::parse(body).map(drop),
        "/v1/completions" => Completions::parse(body).map(drop),
        "/v1/messages" => Messages::parse(body).map(drop),
        "/v1/messages/count_tokens" => messages::parse_count(body).map(drop),
        "/v1/responses" => Responses::parse(body).map(drop),
        _ => return None,
    };
    Some(parsed.map_err(|e| e.body()))
}

fn router(state: Arc<AppState>) -> Router {
    let v1 = Router::new()
        .route("/v1/models", get(respond::models))
        .route("/v1/models/{id}", get(respond::model))
        .route("/v1/chat/completions", post(respond::endpoint::<Chat>))
        .route("/v1/completions", post(respond::endpoint::<Completions>))
        .route("/v1/messages", post(respond::endpoint::<Messages>))
        .route("/v1/messages/count_tokens", post(respond::count_tokens))
        .route("/v1/responses", post(respond::endpoint::<Responses>))
        .route_layer(middleware::from_fn_with_state(state.clone(), auth));
    Router::new()
        .merge(v1)
        .route("/health", get(respond::health))
        .route("/metrics", get(respond::metrics))
        .fallback(respond::not_found)
        .layer(DefaultBodyLimit::max(state.cfg.max_body_bytes))
        .layer(middleware::from_fn_with_state(state.clone(), count))
        .layer(tower_http::catch_panic::CatchPanicLayer::custom(
            |_: Box<dyn std::any::Any + Send>| {
                ApiError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "server_error",
                    "internal error while handling the request",
                )
                .into_response()
            },
        ))
        .with_state(state)
}

async fn auth(State(state): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    if let Some(key) = &state.cfg.api_key {
        // OpenAI's clients send the key as a bearer token, Anthropic's in x-api-key.
        let headers = req.headers();
        let given = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .or_else(|| headers.get("x-api-key").and_then(|v| v.to_str().ok()));
        if !given.is_some_and(|g| constant_time_eq(g.as_bytes(), key.as_bytes())) {
            let e = ApiError::new(
                StatusCode::UNAUTHORIZED,
                "invalid_request_error",
                "missing or incorrect API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
            )
            .code("invalid_api_key");
            return if req.uri().path().starts_with("/v1/messages") {
                Messages::error(e)
            } else {
                e.into_response()
            };
        }
    }
    next.run(req).await
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn count(State(state): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let path = req.uri().path().to_owned();
    let resp = next.run(req).await;
    state.http.record(&path, resp.status().as_u16());
    resp
}

/// A server on its own thread and runtime (for tests and embedding): bound before this returns.
pub struct Running {
    pub addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<Result<()>>>,
}

impl Running {
    /// Binds `addr` (port 0 picks a free port) and serves there.
    pub fn start<B: Backend + 'static>(
        addr: SocketAddr,
        model: Arc<B>,
        tokenizer: Arc<Tokenizer>,
        cfg: ServerConfig,
    ) -> Result<Running> {
        let listener =
            std::net::TcpListener::bind(addr).with_context(|| format!("binding {addr}"))?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("deltafin-http".into())
            .spawn(move || {
                let rt = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .enable_all()
                    .build()?;
                rt.block_on(async move {
                    let listener = tokio::net::TcpListener::from_std(listener)?;
                    serve(listener, model, tokenizer, cfg, async move {
                        let _ = stopped.await;
                    })
                    .await
                })
            })?;
        Ok(Running {
            addr,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// Graceful shutdown (as on SIGTERM); returns when the server has exited.
    pub fn stop(mut self) -> Result<()> {
        self.shutdown()
    }

    fn shutdown(&mut self) -> Result<()> {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        match self.thread.take() {
            Some(t) => t
                .join()
                .map_err(|_| anyhow::anyhow!("the server thread panicked"))?,
            None => Ok(()),
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.shutdown();
    }
}
