//! The endpoints: parse, render the prompt, queue a job, then answer as one JSON body or as SSE chunks.

use crate::api::{self, Common, Prompt};
use crate::chat::{self, ReasoningEffort};
use crate::error::ApiError;
use crate::messages::{self, Blocks};
use crate::metrics;
use crate::responses::{self, Items};
use crate::sink::{ChannelSink, LogprobItem, Msg, Usage};
use crate::AppState;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use deltafin_engine::{Job, Rejected, Request, SamplingParams};
use deltafin_tokenizer::chat::{k3_tools_message, ToolCall};
use serde_json::{json, Value};
use std::collections::VecDeque;
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::{Context, Poll};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

type Shared = State<Arc<AppState>>;

pub async fn health(State(s): Shared) -> Response {
    let c = s.sched.counters();
    Json(json!({
        "status": "ok",
        "model": s.cfg.model_name,
        "active": c.active.load(Ordering::Relaxed),
        "queued": c.queued.load(Ordering::Relaxed),
    }))
    .into_response()
}

pub async fn metrics(State(s): Shared) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        metrics::render(&s.http, &s.sched, &s.store),
    )
        .into_response()
}

/// The served model as both APIs describe one: OpenAI's `object`, `created`, `owned_by` and Anthropic's
/// `type`, `display_name`, `created_at` (each client reads its own fields).
fn model_object(s: &AppState) -> Value {
    let created = std::time::UNIX_EPOCH + std::time::Duration::from_secs(s.created);
    json!({
        "id": s.cfg.model_name, "object": "model", "created": s.created, "owned_by": "deltafin",
        "type": "model", "display_name": s.cfg.model_name,
        "created_at": humantime::format_rfc3339_seconds(created).to_string(),
    })
}

/// The model list, with Anthropic's paging fields (one page).
pub async fn models(State(s): Shared) -> Response {
    let id = &s.cfg.model_name;
    Json(json!({"object": "list", "data": [model_object(&s)], "has_more": false, "first_id": id, "last_id": id}))
        .into_response()
}

pub async fn model(State(s): Shared, Path(id): Path<String>) -> Response {
    if id != s.cfg.model_name {
        return unknown_model(&s, &id).into_response();
    }
    Json(model_object(&s)).into_response()
}

pub async fn not_found() -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        "no such endpoint; deltafin serves /v1/models, /v1/chat/completions, /v1/completions, /v1/responses, /v1/messages, /health and /metrics",
    )
}

fn unknown_model(s: &AppState, id: &str) -> ApiError {
    let mut e = ApiError::new(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        format!(
            "the model {id:?} does not exist; this server serves {:?}",
            s.cfg.model_name
        ),
    )
    .code("model_not_found");
    e.param = Some("model".into());
    e
}

fn body(b: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    b.map_err(|r| {
        let status = r.status();
        if status == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::new(
                status,
                "invalid_request_error",
                "the request body is larger than this server accepts (--max-body-mb)",
            )
            .code("request_too_large")
        } else {
            ApiError::new(status, "invalid_request_error", r.body_text())
        }
    })
}

/// What a parsed request turns into: its queued jobs (one a choice) and how to answer.
struct Planned {
    rxs: Vec<UnboundedReceiver<Msg>>,
    keep_alive: std::time::Duration,
    format: Format,
    stream: bool,
}

/// Which API a request came through, which decides how it is answered.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Chat,
    Completion,
    /// Anthropic's Messages.
    Messages,
    /// OpenAI's Responses.
    Responses,
}

/// A stream of typed events (Anthropic's Messages, OpenAI's Responses), built from the job's messages.
pub trait TypedEvents: Send {
    fn delta(&mut self, reasoning: &str, content: &str, out: &mut Vec<Event>);
    fn tool_call(&mut self, index: usize, call: &ToolCall, out: &mut Vec<Event>);
    fn done(
        &mut self,
        finish_reason: &str,
        stop_sequence: Option<String>,
        usage: &Usage,
        out: &mut Vec<Event>,
    );
    /// An error after the stream started.
    fn error(&mut self, message: &str) -> Event;
}

#[derive(Clone)]
struct Format {
    kind: Kind,
    id: String,
    created: u64,
    model: String,
    include_usage: bool,
    logprobs: bool,
    prompt_tokens: usize,
}

pub async fn chat(State(s): Shared, b: Result<Bytes, BytesRejection>) -> Response {
    respond(plan_chat(&s, b), IntoResponse::into_response).await
}

pub async fn completions(State(s): Shared, b: Result<Bytes, BytesRejection>) -> Response {
    respond(plan_completion(&s, b), IntoResponse::into_response).await
}

/// Anthropic's Messages: the chat path, with Anthropic's reply, stream and error shapes.
pub async fn messages(State(s): Shared, b: Result<Bytes, BytesRejection>) -> Response {
    let planned = body(b)
        .and_then(|b| messages::parse(&b))
        .and_then(|req| plan_chat_request(&s, req, Kind::Messages));
    respond(planned, messages::error_response).await
}

/// The answer to a planned request, streamed or whole; errors in the API's shape (`error`).
async fn respond(planned: Result<Planned, ApiError>, error: fn(ApiError) -> Response) -> Response {
    match planned {
        Err(e) => error(e),
        Ok(p) if p.stream => stream(p),
        Ok(p) => collect(p).await.unwrap_or_else(error),
    }
}

/// OpenAI's Responses: the chat path, answered with output items.
pub async fn responses(State(s): Shared, b: Result<Bytes, BytesRejection>) -> Response {
    let planned = body(b)
        .and_then(|b| responses::parse(&b))
        .and_then(|req| plan_chat_request(&s, req, Kind::Responses));
    respond(planned, IntoResponse::into_response).await
}

/// Anthropic's token count: the prompt a Messages request would have, `{"input_tokens": N}`.
pub async fn count_tokens(State(s): Shared, b: Result<Bytes, BytesRejection>) -> Response {
    body(b)
        .and_then(|b| messages::parse_count(&b))
        .and_then(|req| chat_prompt(&s, &req, Kind::Messages))
        .map_or_else(messages::error_response, |prompt| {
            Json(json!({"input_tokens": prompt.len()})).into_response()
        })
}

fn plan_chat(s: &AppState, b: Result<Bytes, BytesRejection>) -> Result<Planned, ApiError> {
    plan_chat_request(s, api::chat(&body(b)?)?, Kind::Chat)
}

fn plan_chat_request(s: &AppState, req: api::ChatRequest, kind: Kind) -> Result<Planned, ApiError> {
    let prompt = chat_prompt(s, &req, kind)?;
    let default_max = s.cfg.default_max_tokens;
    let format = format(s, kind, &req.common, req.top_logprobs.is_some(), &prompt);
    let rxs = submit_choices(
        s,
        &prompt,
        &req.common,
        default_max,
        req.top_logprobs,
        |tx| chat_sink(s, &req, tx),
    )?;
    Ok(Planned {
        rxs,
        keep_alive: s.cfg.keep_alive,
        stream: req.common.stream,
        format,
    })
}

fn chat_format(s: &AppState) -> Result<&chat::Format, ApiError> {
    s.chat.as_ref().map_err(|e| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            format!("this model cannot chat: {e}; use /v1/completions"),
        )
    })
}

/// A chat request's prompt: K3's (with the tools' system message when tools are offered), or the
/// checkpoint template's, which refuses what only K3's format expresses rather than ignoring it.
fn chat_prompt(s: &AppState, req: &api::ChatRequest, kind: Kind) -> Result<Vec<u32>, ApiError> {
    check_model(s, &req.common)?;
    let template = match chat_format(s)? {
        chat::Format::K3(_) => {
            let listed = req.tools.listed.as_deref().map(k3_tools_message);
            let messages: Vec<_> = listed
                .into_iter()
                .chain(req.messages.iter().cloned())
                .collect();
            let mut prompt = req.effort.render(&s.tokenizer, &messages);
            if let Some(start) = &req.prefill {
                prompt.extend(s.tokenizer.encode(start));
            }
            return Ok(prompt);
        }
        chat::Format::Template(template) => template,
    };
    if req.prefill.is_some() {
        return Err(ApiError::invalid(
            "messages",
            "a final assistant turn (prefill) needs K3's chat format; this model chats through its own template",
        )
        .code("unsupported_parameter"));
    }
    if req.tools.listed.is_some() {
        return Err(ApiError::invalid(
            "tools",
            "tools need K3's chat format; this model chats through its own template, whose tool calls \
             deltafin does not read",
        )
        .code("unsupported_parameter"));
    }
    if req.effort != ReasoningEffort::Think(None) {
        let field = if kind == Kind::Messages {
            "thinking"
        } else {
            "reasoning_effort"
        };
        return Err(ApiError::invalid(
            field,
            format!("{field} applies to K3's thinking; this model's template has none"),
        )
        .code("unsupported_parameter"));
    }
    let pieces = template.render(&req.messages, true, None).map_err(|e| {
        ApiError::invalid(
            "messages",
            format!("the model's chat template refused them: {e:#}"),
        )
    })?;
    Ok(s.tokenizer.encode_pieces(&pieces))
}

/// The sink of a chat reply: K3's parses reasoning and tool calls; a template's reply is all content.
fn chat_sink(
    s: &AppState,
    req: &api::ChatRequest,
    tx: UnboundedSender<Msg>,
) -> Result<ChannelSink, ApiError> {
    let (tok, stop, ids) = (s.tokenizer.clone(), &req.common.stop, s.stop_ids.clone());
    Ok(match chat_format(s)? {
        chat::Format::K3(markup) => {
            ChannelSink::chat(tok, markup, req.effort, &req.tools, stop, ids, tx)
        }
        chat::Format::Template(_) => ChannelSink::completion(tok, stop, ids, tx),
    })
}

fn plan_completion(s: &AppState, b: Result<Bytes, BytesRejection>) -> Result<Planned, ApiError> {
    let req = api::completion(&body(b)?)?;
    check_model(s, &req.common)?;
    let prompt = match req.prompt {
        Prompt::Text(t) => s.tokenizer.encode(&t),
        Prompt::Tokens(ids) => {
            if let Some(bad) = ids.iter().find(|&&t| t as usize >= s.vocab) {
                return Err(ApiError::invalid(
                    "prompt",
                    format!(
                        "token id {bad} is outside the vocabulary (size {})",
                        s.vocab
                    ),
                ));
            }
            ids
        }
    };
    let format = format(
        s,
        Kind::Completion,
        &req.common,
        req.logprobs.is_some(),
        &prompt,
    );
    let rxs = submit_choices(s, &prompt, &req.common, 16, req.logprobs, |tx| {
        let (tok, ids) = (s.tokenizer.clone(), s.stop_ids.clone());
        Ok(ChannelSink::completion(tok, &req.common.stop, ids, tx))
    })?;
    Ok(Planned {
        rxs,
        keep_alive: s.cfg.keep_alive,
        stream: req.common.stream,
        format,
    })
}

/// Queues the request's `n` choices, each replying through the sink `sink` makes of its channel; their
/// receivers, in choice order. More choices than the server runs and queues at once could never all be taken:
/// a 400, not a 429 to retry.
fn submit_choices(
    s: &AppState,
    prompt: &[u32],
    c: &Common,
    default_max: usize,
    top_logprobs: Option<usize>,
    sink: impl Fn(UnboundedSender<Msg>) -> Result<ChannelSink, ApiError>,
) -> Result<Vec<UnboundedReceiver<Msg>>, ApiError> {
    let cfg = s.sched.config();
    let room = cfg.max_active + cfg.queue_capacity;
    if c.n > room {
        return Err(ApiError::invalid(
            "n",
            format!(
                "'n' is {} but this server takes at most {room} generations at once (--max-active {} plus \
                 --queue {}); ask for fewer choices",
                c.n, cfg.max_active, cfg.queue_capacity
            ),
        ));
    }
    let mut rxs = Vec::with_capacity(c.n);
    for choice in 0..c.n {
        let (tx, rx) = unbounded_channel();
        submit(
            s,
            prompt,
            c,
            choice,
            default_max,
            top_logprobs,
            Box::new(sink(tx)?),
        )?;
        rxs.push(rx);
    }
    Ok(rxs)
}

fn check_model(s: &AppState, c: &Common) -> Result<(), ApiError> {
    if c.model != s.cfg.model_name {
        return Err(unknown_model(s, &c.model));
    }
    Ok(())
}

fn format(s: &AppState, kind: Kind, c: &Common, logprobs: bool, prompt: &[u32]) -> Format {
    let n = s.next_id.fetch_add(1, Ordering::Relaxed);
    Format {
        kind,
        id: match kind {
            Kind::Chat => format!("chatcmpl-{:x}-{n}", s.created),
            Kind::Completion => format!("cmpl-{:x}-{n}", s.created),
            Kind::Messages => format!("msg_{:x}{n:06}", s.created),
            Kind::Responses => format!("resp_{:x}{n:06}", s.created),
        },
        created: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        model: s.cfg.model_name.clone(),
        include_usage: c.include_usage,
        logprobs,
        prompt_tokens: prompt.len(),
    }
}

/// Queues choice `choice` of a request (its sampler seeded with the request's seed + choice). A later choice
/// refused (a full queue) drops the receivers of those before it, which cancels their jobs.
fn submit(
    s: &AppState,
    prompt: &[u32],
    c: &Common,
    choice: usize,
    default_max: usize,
    top_logprobs: Option<usize>,
    sink: Box<ChannelSink>,
) -> Result<(), ApiError> {
    if prompt.is_empty() {
        return Err(ApiError::invalid("prompt", "the prompt is empty"));
    }
    if let Some(&(id, _)) = c
        .sampling
        .logit_bias
        .iter()
        .find(|&&(id, _)| id as usize >= s.vocab)
    {
        return Err(ApiError::invalid(
            "logit_bias",
            format!("token id {id} is outside the vocabulary (size {})", s.vocab),
        ));
    }
    let room = s.cfg.max_context.saturating_sub(prompt.len());
    if room == 0 || c.max_tokens.is_some_and(|m| m > room) {
        return Err(ApiError::invalid(
            "messages",
            format!(
                "this server's context is {} tokens; the prompt has {} and {} more were requested",
                s.cfg.max_context,
                prompt.len(),
                c.max_tokens.unwrap_or(default_max.min(room))
            ),
        )
        .code("context_length_exceeded"));
    }
    let job = Job {
        request: Request {
            prompt: prompt.to_vec(),
            max_new: c.max_tokens.unwrap_or(default_max.min(room)),
            stop_ids: s.stop_ids.clone(),
            sampling: SamplingParams {
                seed: c.sampling.seed.wrapping_add(choice as u64),
                ..c.sampling.clone()
            },
            prompt_logits: false,
        },
        top_logprobs,
        sink,
    };
    s.sched.submit(job).map_err(|r| match r {
        Rejected::QueueFull => {
            let mut e = ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_error",
                "every generation slot and queue place is taken; retry after a moment",
            )
            .code("queue_full");
            e.retry_after_secs = Some(1);
            e
        }
        Rejected::ShuttingDown => ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            "the server is shutting down",
        ),
    })
}

/// One choice's whole reply.
struct Reply {
    reasoning: String,
    content: String,
    logprobs: Vec<LogprobItem>,
    calls: Vec<(usize, ToolCall)>,
    finish_reason: &'static str,
    stop_sequence: Option<String>,
    usage: Usage,
}

/// Waits for one choice's whole reply.
async fn gather(rx: &mut UnboundedReceiver<Msg>) -> Result<Reply, ApiError> {
    let (mut reasoning, mut content, mut logprobs) = (String::new(), String::new(), Vec::new());
    let mut calls = Vec::new();
    loop {
        match rx.recv().await {
            Some(Msg::ToolCall { index, call }) => calls.push((index, call)),
            Some(Msg::Delta {
                reasoning: r,
                content: c,
                logprobs: l,
            }) => {
                reasoning.push_str(&r);
                content.push_str(&c);
                logprobs.extend(l);
            }
            Some(Msg::Done {
                finish_reason,
                stop_sequence,
                usage,
            }) => {
                return Ok(Reply {
                    reasoning,
                    content,
                    logprobs,
                    calls,
                    finish_reason,
                    stop_sequence,
                    usage,
                })
            }
            Some(Msg::Error(e)) => return Err(generation_error(e)),
            None => {
                return Err(generation_error(
                    "the generation ended without a result".into(),
                ))
            }
        }
    }
}

/// The usage of several choices of one prompt: the prompt counted once (the first choice's), the completions
/// added.
fn total_usage(choices: impl IntoIterator<Item = Usage>) -> Usage {
    let mut it = choices.into_iter();
    let mut total = it.next().unwrap_or_default();
    for u in it {
        total.completion_tokens += u.completion_tokens;
        total.reasoning_tokens += u.reasoning_tokens;
    }
    total
}

/// The non-streaming answer: wait for every choice's whole generation (they run at once). Dropping this future
/// (client gone) drops the receivers, which cancels the jobs.
async fn collect(mut p: Planned) -> Result<Response, ApiError> {
    let mut replies = Vec::with_capacity(p.rxs.len());
    for rx in &mut p.rxs {
        replies.push(gather(rx).await?);
    }
    let f = &p.format;
    if matches!(f.kind, Kind::Messages | Kind::Responses) {
        // One choice: these APIs have no `n`.
        let r = &replies[0];
        if f.kind == Kind::Messages {
            let uses: Vec<Value> = r
                .calls
                .iter()
                .map(|(i, c)| messages::tool_use(&f.id, *i, c))
                .collect();
            let stop = messages::stop_reason(r.finish_reason, &r.stop_sequence);
            let blocks = messages::content(&r.reasoning, &r.content, uses);
            let reply = messages::reply(
                &f.id,
                &f.model,
                blocks,
                stop,
                r.stop_sequence.clone(),
                &r.usage,
            );
            return Ok(Json(reply).into_response());
        }
        let output = responses::output(&f.id, &r.reasoning, &r.content, &r.calls);
        let reply = responses::response(
            &f.id,
            f.created,
            &f.model,
            output,
            Some(r.finish_reason),
            Some(&r.usage),
        );
        return Ok(Json(reply).into_response());
    }
    let chat = f.kind == Kind::Chat;
    let choices: Vec<Value> = replies
        .iter()
        .enumerate()
        .map(|(index, r)| {
            let lp = f.logprobs.then(|| logprobs_json(chat, &r.logprobs));
            if !chat {
                return json!({"index": index, "text": r.content, "logprobs": lp, "finish_reason": r.finish_reason});
            }
            let mut message = json!({"role": "assistant", "content": r.content, "refusal": null});
            if !r.reasoning.is_empty() {
                message["reasoning_content"] = json!(r.reasoning);
            }
            if !r.calls.is_empty() {
                // OpenAI's shape: no text beside the calls is null content.
                if r.content.is_empty() {
                    message["content"] = Value::Null;
                }
                message["tool_calls"] = r.calls.iter().map(|(i, c)| tool_call_json(*i, c)).collect();
            }
            json!({"index": index, "message": message, "logprobs": lp, "finish_reason": r.finish_reason})
        })
        .collect();
    Ok(Json(json!({
        "id": f.id,
        "object": if chat { "chat.completion" } else { "text_completion" },
        "created": f.created,
        "model": f.model,
        "choices": choices,
        "usage": usage_json(&total_usage(replies.iter().map(|r| r.usage))),
    }))
    .into_response())
}

/// The `index`-th tool call of a reply as OpenAI gives it; the id is the model's, or `call_INDEX` when it
/// wrote none.
fn tool_call_json(index: usize, call: &ToolCall) -> Value {
    let id = if call.id.is_empty() {
        format!("call_{index}")
    } else {
        call.id.clone()
    };
    json!({"id": id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}})
}

fn generation_error(message: String) -> ApiError {
    ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
}

fn usage_json(u: &Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
    })
}

/// Chat: `{"content": [{token, logprob, bytes, top_logprobs}]}`; completions: the legacy parallel lists.
fn logprobs_json(chat: bool, items: &[LogprobItem]) -> Value {
    if chat {
        let content: Vec<Value> = items
            .iter()
            .map(|i| {
                json!({
                    "token": i.token, "logprob": i.logprob, "bytes": i.bytes,
                    "top_logprobs": i.top.iter()
                        .map(|(t, b, l)| json!({"token": t, "logprob": l, "bytes": b}))
                        .collect::<Vec<_>>(),
                })
            })
            .collect();
        json!({"content": content, "refusal": null})
    } else {
        let mut offset = 0;
        let mut offsets = Vec::new();
        for i in items {
            offsets.push(offset);
            offset += i.token.len();
        }
        json!({
            "tokens": items.iter().map(|i| i.token.clone()).collect::<Vec<_>>(),
            "token_logprobs": items.iter().map(|i| i.logprob).collect::<Vec<_>>(),
            "top_logprobs": items.iter().map(|i| {
                i.top.iter().map(|(t, _, l)| (t.clone(), json!(l))).collect::<serde_json::Map<_, _>>()
            }).collect::<Vec<_>>(),
            "text_offset": offsets,
        })
    }
}

fn stream(p: Planned) -> Response {
    let keep_alive = KeepAlive::new().interval(p.keep_alive).text("keep-alive");
    let mut events = EventStream {
        open: vec![true; p.rxs.len()],
        rxs: p.rxs,
        next: 0,
        usage: Vec::new(),
        pending: VecDeque::new(),
        done: false,
        typed: None,
        format: p.format,
    };
    let f = &events.format;
    match f.kind {
        // Each choice's role comes first, before the prompt is computed (OpenAI's first chunks).
        Kind::Chat => {
            for index in 0..events.rxs.len() {
                let first = events.chunk(
                    index,
                    json!({"role": "assistant", "content": ""}),
                    None,
                    None,
                );
                events.pending.push_back(first);
            }
        }
        Kind::Messages => {
            let (blocks, start) = Blocks::start(&f.id, &f.model, f.prompt_tokens);
            events.typed = Some(Box::new(blocks));
            events.pending.push_back(start);
        }
        Kind::Responses => {
            let (items, start) = Items::start(&f.id, f.created, &f.model);
            events.typed = Some(Box::new(items));
            events.pending.extend(start);
        }
        Kind::Completion => {}
    }
    (
        [("x-accel-buffering", "no")],
        Sse::new(events).keep_alive(keep_alive),
    )
        .into_response()
}

/// Turns the jobs' messages into SSE events as they come (each chunk names its choice); ends after every
/// choice has finished and `data: [DONE]` (typed streams, one choice: their last event), or an error event.
struct EventStream {
    rxs: Vec<UnboundedReceiver<Msg>>,
    /// Which choices are still generating.
    open: Vec<bool>,
    /// The choice polled first next time (each in turn, so none waits behind another).
    next: usize,
    /// The usage of each finished choice.
    usage: Vec<Usage>,
    pending: VecDeque<Event>,
    done: bool,
    /// Messages' and Responses' events.
    typed: Option<Box<dyn TypedEvents>>,
    format: Format,
}

impl EventStream {
    fn chunk(
        &self,
        index: usize,
        delta: Value,
        finish: Option<&str>,
        logprobs: Option<&[LogprobItem]>,
    ) -> Event {
        let f = &self.format;
        let chat = f.kind == Kind::Chat;
        let lp = logprobs.map(|l| logprobs_json(chat, l));
        let mut body = if chat {
            json!({
                "id": f.id, "object": "chat.completion.chunk", "created": f.created, "model": f.model,
                "choices": [{"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}],
            })
        } else {
            json!({
                "id": f.id, "object": "text_completion", "created": f.created, "model": f.model,
                "choices": [{"index": index, "text": delta, "logprobs": lp, "finish_reason": finish}],
            })
        };
        if f.include_usage {
            body["usage"] = Value::Null;
        }
        Event::default().data(body.to_string())
    }

    /// Choice `index`'s next message.
    fn on(&mut self, index: usize, msg: Option<Msg>) {
        if let Some(typed) = &mut self.typed {
            let mut out = Vec::new();
            match msg {
                Some(Msg::Delta {
                    reasoning, content, ..
                }) => typed.delta(&reasoning, &content, &mut out),
                Some(Msg::ToolCall { index, call }) => typed.tool_call(index, &call, &mut out),
                Some(Msg::Done {
                    finish_reason,
                    stop_sequence,
                    usage,
                }) => {
                    typed.done(finish_reason, stop_sequence, &usage, &mut out);
                    self.done = true;
                }
                Some(Msg::Error(message)) => return self.fail(message),
                None => return self.fail("the generation ended without a result".into()),
            }
            self.pending.extend(out);
            return;
        }
        let chat = self.format.kind == Kind::Chat;
        match msg {
            Some(Msg::Delta {
                reasoning,
                content,
                logprobs,
            }) => {
                let lp = self.format.logprobs.then_some(&logprobs[..]);
                if chat {
                    let mut delta = json!({});
                    if !reasoning.is_empty() {
                        delta["reasoning_content"] = json!(reasoning);
                    }
                    if !content.is_empty() || !logprobs.is_empty() {
                        delta["content"] = json!(content);
                    }
                    let e = self.chunk(index, delta, None, lp);
                    self.pending.push_back(e);
                } else if !content.is_empty() || !logprobs.is_empty() {
                    let e = self.chunk(index, json!(content), None, lp);
                    self.pending.push_back(e);
                }
            }
            Some(Msg::ToolCall { index, call }) => {
                // A call comes whole, in one chunk; streams number it.
                let mut c = tool_call_json(index, &call);
                c["index"] = json!(index);
                let delta = json!({"tool_calls": [c]});
                let e = self.chunk(index, delta, None, None);
                self.pending.push_back(e);
            }
            Some(Msg::Done {
                finish_reason,
                usage,
                ..
            }) => {
                let empty = if chat { json!({}) } else { json!("") };
                let e = self.chunk(index, empty, Some(finish_reason), None);
                self.pending.push_back(e);
                self.open[index] = false;
                self.usage.push(usage);
                if self.open.contains(&true) {
                    return;
                }
                let usage = total_usage(self.usage.iter().copied());
                if self.format.include_usage {
                    let f = &self.format;
                    let object = if chat {
                        "chat.completion.chunk"
                    } else {
                        "text_completion"
                    };
                    let body = json!({
                        "id": f.id, "object": object, "created": f.created, "model": f.model,
                        "choices": [], "usage": usage_json(&usage),
                    });
                    self.pending
                        .push_back(Event::default().data(body.to_string()));
                }
                self.pending.push_back(Event::default().data("[DONE]"));
                self.done = true;
            }
            Some(Msg::Error(message)) => self.fail(message),
            None => self.fail("the generation ended without a result".into()),
        }
    }

    /// An error after the 200 status went out: an SSE event with the API's error object, then the end.
    fn fail(&mut self, message: String) {
        let e = if let Some(typed) = &mut self.typed {
            typed.error(&message)
        } else {
            Event::default().data(generation_error(message).body().to_string())
        };
        self.pending.push_back(e);
        self.done = true;
    }
}

impl tokio_stream::Stream for EventStream {
    type Item = Result<Event, Infallible>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        loop {
            if let Some(e) = self.pending.pop_front() {
                return Poll::Ready(Some(Ok(e)));
            }
            if self.done {
                return Poll::Ready(None);
            }
            // The open choices in turn from `next`; every pending one has registered the waker.
            let (n, next) = (self.rxs.len(), self.next);
            let mut ready = None;
            for i in (0..n).map(|k| (next + k) % n) {
                if !self.open[i] {
                    continue;
                }
                if let Poll::Ready(msg) = self.rxs[i].poll_recv(cx) {
                    ready = Some((i, msg));
                    break;
                }
            }
            match ready {
                Some((i, msg)) => {
                    self.next = (i + 1) % n;
                    self.on(i, msg);
                }
                None => return Poll::Pending,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::sync::mpsc::UnboundedSender;

    fn call(id: &str, name: &str, arguments: &str) -> ToolCall {
        ToolCall {
            id: id.into(),
            name: name.into(),
            arguments: arguments.into(),
        }
    }

    fn delta(reasoning: &str, content: &str) -> Msg {
        Msg::Delta {
            reasoning: reasoning.into(),
            content: content.into(),
            logprobs: Vec::new(),
        }
    }

    /// An answer of `kind` planned over a channel the test has written `msgs` to.
    fn planned(kind: Kind, stream: bool, msgs: Vec<Msg>) -> (Planned, UnboundedSender<Msg>) {
        let (tx, rx) = unbounded_channel();
        let format = Format {
            kind,
            id: "t".into(),
            created: 0,
            model: "m".into(),
            include_usage: false,
            logprobs: false,
            prompt_tokens: 1,
        };
        for m in msgs {
            tx.send(m).unwrap();
        }
        let p = Planned {
            rxs: vec![rx],
            keep_alive: std::time::Duration::from_secs(60),
            format,
            stream,
        };
        (p, tx)
    }

    /// A chat reply of no text and two calls.
    fn two_calls(stream: bool) -> (Planned, UnboundedSender<Msg>) {
        let msgs = vec![
            delta("", ""),
            Msg::ToolCall {
                index: 0,
                call: call("c1", "weather", "{}"),
            },
            Msg::ToolCall {
                index: 1,
                call: call("", "time", "{}"),
            },
            Msg::Done {
                finish_reason: "tool_calls",
                stop_sequence: None,
                usage: Usage::default(),
            },
        ];
        planned(Kind::Chat, stream, msgs)
    }

    async fn body(r: Response) -> String {
        let bytes = axum::body::to_bytes(r.into_body(), 1 << 20).await.unwrap();
        String::from_utf8(bytes.to_vec()).unwrap()
    }

    #[tokio::test]
    async fn a_plain_answer_lists_the_calls_with_null_content() {
        let (p, _tx) = two_calls(false);
        let v: Value =
            serde_json::from_str(&body(respond(Ok(p), IntoResponse::into_response).await).await)
                .unwrap();
        let choice = &v["choices"][0];
        assert_eq!(choice["finish_reason"], "tool_calls");
        assert_eq!(choice["message"]["content"], Value::Null);
        assert_eq!(
            choice["message"]["tool_calls"],
            json!([
                {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{}"}},
                {"id": "call_1", "type": "function", "function": {"name": "time", "arguments": "{}"}},
            ])
        );
    }

    #[tokio::test]
    async fn a_stream_sends_each_call_whole_with_its_index() {
        let (p, tx) = two_calls(true);
        drop(tx);
        let text = body(respond(Ok(p), IntoResponse::into_response).await).await;
        let chunks: Vec<Value> = text
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .filter(|d| *d != "[DONE]")
            .map(|d| serde_json::from_str(d).unwrap())
            .collect();
        let calls: Vec<&Value> = chunks
            .iter()
            .filter_map(|c| c["choices"][0]["delta"].get("tool_calls"))
            .collect();
        assert_eq!(
            calls,
            [
                &json!([{"index": 0, "id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}]),
                &json!([{"index": 1, "id": "call_1", "type": "function", "function": {"name": "time", "arguments": "{}"}}]),
            ]
        );
        assert_eq!(
            chunks.last().unwrap()["choices"][0]["finish_reason"],
            "tool_calls"
        );
        assert!(text.trim_end().ends_with("data: [DONE]"));
    }

    /// A reply of `kind` that thinks, writes, then calls two tools (one with arguments that are not JSON).
    fn thinking_text_and_calls(kind: Kind, stream: bool) -> (Planned, UnboundedSender<Msg>) {
        let msgs = vec![
            delta("Let me ", ""),
            delta("see.", "Checking"),
            delta("", "."),
            Msg::ToolCall {
                index: 0,
                call: call("c1", "weather", r#"{"city":"Paris"}"#),
            },
            Msg::ToolCall {
                index: 1,
                call: call("", "time", "not json"),
            },
            Msg::Done {
                finish_reason: "tool_calls",
                stop_sequence: None,
                usage: Usage {
                    prompt_tokens: 30,
                    cached_tokens: 10,
                    completion_tokens: 7,
                    reasoning_tokens: 3,
                },
            },
        ];
        planned(kind, stream, msgs)
    }

    fn messages_blocks() -> Value {
        json!([
            {"type": "thinking", "thinking": "Let me see.", "signature": ""},
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "c1", "name": "weather", "input": {"city": "Paris"}},
            {"type": "tool_use", "id": "toolu_t_1", "name": "time", "input": {"_raw_arguments": "not json"}},
        ])
    }

    #[tokio::test]
    async fn a_message_lists_thinking_text_and_tool_uses() {
        let (p, _tx) = thinking_text_and_calls(Kind::Messages, false);
        let r = collect(p).await.unwrap();
        let v: Value = serde_json::from_str(&body(r).await).unwrap();
        assert_eq!(v["content"], messages_blocks());
        assert_eq!(v["stop_reason"], "tool_use");
        assert_eq!(
            v["usage"],
            json!({"input_tokens": 20, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 10,
                   "output_tokens": 7})
        );
    }

    /// What a client that follows Anthropic's events builds: the content blocks, and the stop reason.
    fn accumulate(events: &[(String, Value)]) -> (Value, Value) {
        let mut blocks: Vec<Value> = Vec::new();
        let mut json_parts: Vec<String> = Vec::new();
        let mut stop = Value::Null;
        for (name, d) in events {
            match name.as_str() {
                "content_block_start" => {
                    assert_eq!(d["index"], blocks.len());
                    blocks.push(d["content_block"].clone());
                    json_parts.push(String::new());
                }
                "content_block_delta" => {
                    let i = d["index"].as_u64().unwrap() as usize;
                    assert_eq!(i + 1, blocks.len(), "deltas go to the open block");
                    let delta = &d["delta"];
                    match delta["type"].as_str().unwrap() {
                        "thinking_delta" => {
                            let t = blocks[i]["thinking"].as_str().unwrap().to_string();
                            blocks[i]["thinking"] = json!(t + delta["thinking"].as_str().unwrap());
                        }
                        "text_delta" => {
                            let t = blocks[i]["text"].as_str().unwrap().to_string();
                            blocks[i]["text"] = json!(t + delta["text"].as_str().unwrap());
                        }
                        "input_json_delta" => {
                            json_parts[i].push_str(delta["partial_json"].as_str().unwrap())
                        }
                        other => panic!("delta type {other}"),
                    }
                }
                "content_block_stop" => {
                    let i = d["index"].as_u64().unwrap() as usize;
                    if blocks[i]["type"] == "tool_use" {
                        blocks[i]["input"] = serde_json::from_str(&json_parts[i]).unwrap();
                    }
                }
                "message_delta" => stop = d["delta"]["stop_reason"].clone(),
                _ => {}
            }
        }
        (Value::Array(blocks), stop)
    }

    #[tokio::test]
    async fn a_message_stream_builds_the_same_blocks() {
        let (p, tx) = thinking_text_and_calls(Kind::Messages, true);
        drop(tx);
        let events = events(&body(stream(p)).await);
        let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names[0], "message_start");
        assert_eq!(names[names.len() - 2..], ["message_delta", "message_stop"]);
        let (blocks, stop) = accumulate(&events);
        assert_eq!(blocks, messages_blocks());
        assert_eq!(stop, "tool_use");
    }

    /// A stream's events as (name, data).
    fn events(text: &str) -> Vec<(String, Value)> {
        let mut events = Vec::new();
        let mut name = None;
        for line in text.lines() {
            if let Some(n) = line.strip_prefix("event: ") {
                name = Some(n.to_string());
            } else if let Some(d) = line.strip_prefix("data: ") {
                events.push((
                    name.take().unwrap(),
                    serde_json::from_str::<Value>(d).unwrap(),
                ));
            }
        }
        events
    }

    #[tokio::test]
    async fn a_response_lists_reasoning_message_and_calls_and_streams_them() {
        let (p, _tx) = thinking_text_and_calls(Kind::Responses, false);
        let whole: Value = serde_json::from_str(&body(collect(p).await.unwrap()).await).unwrap();
        assert_eq!(
            whole["output"],
            json!([
                {"type": "reasoning", "id": "rs_t", "summary": [{"type": "summary_text", "text": "Let me see."}]},
                {"type": "message", "id": "msg_t", "status": "completed", "role": "assistant",
                 "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
                {"type": "function_call", "id": "fc_t_0", "call_id": "c1", "name": "weather",
                 "arguments": "{\"city\":\"Paris\"}", "status": "completed"},
                {"type": "function_call", "id": "fc_t_1", "call_id": "call_t_1", "name": "time",
                 "arguments": "not json", "status": "completed"},
            ])
        );
        assert_eq!(whole["status"], "completed");
        assert_eq!(
            whole["usage"]["output_tokens_details"]["reasoning_tokens"],
            3
        );
        let (p, tx) = thinking_text_and_calls(Kind::Responses, true);
        drop(tx);
        let events = events(&body(stream(p)).await);
        let (last, data) = events.last().unwrap();
        assert_eq!(last, "response.completed");
        assert_eq!(data["response"]["output"], whole["output"]);
        // The deltas and each item's done event rebuild the same items, in output order.
        let done: Vec<&Value> = events
            .iter()
            .filter(|(n, _)| n == "response.output_item.done")
            .map(|(_, d)| &d["item"])
            .collect();
        assert_eq!(
            Value::Array(done.into_iter().cloned().collect()),
            whole["output"]
        );
        let deltas = |kind: &str| -> String {
            events
                .iter()
                .filter(|(n, _)| n == kind)
                .map(|(_, d)| d["delta"].as_str().unwrap())
                .collect()
        };
        assert_eq!(
            deltas("response.reasoning_summary_text.delta"),
            "Let me see."
        );
        assert_eq!(deltas("response.output_text.delta"), "Checking.");
        assert_eq!(
            deltas("response.function_call_arguments.delta"),
            "{\"city\":\"Paris\"}not json"
        );
        for (i, (_, d)) in events.iter().enumerate() {
            assert_eq!(d["sequence_number"], i);
        }
        let find = |kind: &str| &events.iter().find(|(n, _)| n == kind).unwrap().1;
        let text_done = find("response.output_text.done");
        assert_eq!(
            (
                &text_done["text"],
                &text_done["content_index"],
                &text_done["output_index"]
            ),
            (&json!("Checking."), &json!(0), &json!(1))
        );
        let part_done = find("response.reasoning_summary_part.done");
        assert_eq!(
            part_done["part"],
            json!({"type": "summary_text", "text": "Let me see."})
        );
        assert_eq!(part_done["summary_index"], 0);
        assert!(part_done.get("text").is_none());
    }
}
