//! The endpoints. Every API's request takes the same way ([`respond`], generic over its [`Dialect`]): parse,
//! prepare the prompt, queue a job a choice, then answer as one JSON body or as SSE events.

use crate::dialect::messages::{self, Messages};
use crate::dialect::{Dialect, Events, Format, Reply};
use crate::error::ApiError;
use crate::metrics;
use crate::prompt::{self, Prepared};
use crate::sink::{ChannelSink, Delta, Msg};
use crate::AppState;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use deltafin_engine::{Job, Rejected, Request, SamplingParams};
use serde_json::{json, Value};
use std::collections::VecDeque;
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::{Context, Poll};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

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
        return ApiError::unknown_model(&id, &s.cfg.model_name).into_response();
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

/// Anthropic's token count: the prompt a Messages request would have, `{"input_tokens": N}`.
pub async fn count_tokens(State(s): Shared, b: Result<Bytes, BytesRejection>) -> Response {
    body(b)
        .and_then(|b| messages::parse_count(&b))
        .and_then(|req| prompt::chat_prompt(&s, &req, messages::EFFORT_FIELD))
        .map_or_else(Messages::error, |prompt| {
            Json(json!({"input_tokens": prompt.len()})).into_response()
        })
}

/// A request to `D`'s endpoint.
pub async fn endpoint<D: Dialect>(State(s): Shared, b: Result<Bytes, BytesRejection>) -> Response {
    respond::<D>(plan::<D>(&s, b)).await
}

/// What a parsed request turns into: its queued jobs (one a choice) and how to answer.
struct Planned {
    rxs: Vec<UnboundedReceiver<Msg>>,
    keep_alive: std::time::Duration,
    format: Format,
    stream: bool,
}

fn plan<D: Dialect>(s: &AppState, b: Result<Bytes, BytesRejection>) -> Result<Planned, ApiError> {
    let p = D::prepare(s, D::parse(&body(b)?)?)?;
    let format = Format {
        id: D::id(s.created, s.next_id.fetch_add(1, Ordering::Relaxed)),
        created: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        model: s.cfg.model_name.clone(),
        include_usage: p.common.include_usage,
        logprobs: p.top_logprobs.is_some(),
        prompt_tokens: p.prompt.len(),
    };
    Ok(Planned {
        rxs: submit_choices(s, &p)?,
        keep_alive: s.cfg.keep_alive,
        stream: p.common.stream,
        format,
    })
}

/// The answer to a planned request, streamed or whole; errors in the API's shape.
async fn respond<D: Dialect>(planned: Result<Planned, ApiError>) -> Response {
    match planned {
        Err(e) => D::error(e),
        Ok(p) if p.stream => stream::<D>(p),
        Ok(p) => collect::<D>(p).await.unwrap_or_else(D::error),
    }
}

/// Queues the request's `n` choices, each replying through the sink `p.sink` makes of its channel; their
/// receivers, in choice order. More choices than the server runs and queues at once could never all be taken:
/// a 400, not a 429 to retry.
fn submit_choices(s: &AppState, p: &Prepared) -> Result<Vec<UnboundedReceiver<Msg>>, ApiError> {
    let (cfg, n) = (s.sched.config(), p.common.n);
    let room = cfg.max_active + cfg.queue_capacity;
    if n > room {
        return Err(ApiError::invalid(
            "n",
            format!(
                "'n' is {n} but this server takes at most {room} generations at once (--max-active {} plus \
                 --queue {}); ask for fewer choices",
                cfg.max_active, cfg.queue_capacity
            ),
        ));
    }
    let mut rxs = Vec::with_capacity(n);
    for choice in 0..n {
        let (tx, rx) = unbounded_channel();
        submit(s, p, choice, Box::new((p.sink)(tx)))?;
        rxs.push(rx);
    }
    Ok(rxs)
}

/// Queues choice `choice` of a request (its sampler seeded with the request's seed + choice). A later choice
/// refused (a full queue) drops the receivers of those before it, which cancels their jobs.
fn submit(
    s: &AppState,
    p: &Prepared,
    choice: usize,
    sink: Box<ChannelSink>,
) -> Result<(), ApiError> {
    let (prompt, c) = (&p.prompt, &p.common);
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
                c.max_tokens.unwrap_or(p.default_max.min(room))
            ),
        )
        .code("context_length_exceeded"));
    }
    let job = Job {
        request: Request {
            prompt: prompt.to_vec(),
            max_new: c.max_tokens.unwrap_or(p.default_max.min(room)),
            stop_ids: s.stop_ids.clone(),
            sampling: SamplingParams {
                seed: c.sampling.seed.wrapping_add(choice as u64),
                ..c.sampling.clone()
            },
            prompt_logits: false,
        },
        top_logprobs: p.top_logprobs,
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

/// Waits for one choice's whole reply.
async fn gather(rx: &mut UnboundedReceiver<Msg>) -> Result<Reply, ApiError> {
    let mut text = Delta::default();
    let mut calls = Vec::new();
    loop {
        match rx.recv().await {
            Some(Msg::ToolCall { index, call }) => calls.push((index, call)),
            Some(Msg::Delta(d)) => {
                text.reasoning.push_str(&d.reasoning);
                text.content.push_str(&d.content);
                text.logprobs.extend(d.logprobs);
            }
            Some(Msg::Done(finish)) => {
                return Ok(Reply {
                    reasoning: text.reasoning,
                    content: text.content,
                    logprobs: text.logprobs,
                    calls,
                    finish,
                })
            }
            Some(Msg::Error(e)) => return Err(ApiError::generation(e)),
            None => return Err(ApiError::generation(UNFINISHED)),
        }
    }
}

const UNFINISHED: &str = "the generation ended without a result";

/// The non-streaming answer: wait for every choice's whole generation (they run at once). Dropping this future
/// (client gone) drops the receivers, which cancels the jobs.
async fn collect<D: Dialect>(mut p: Planned) -> Result<Response, ApiError> {
    let mut replies = Vec::with_capacity(p.rxs.len());
    for rx in &mut p.rxs {
        replies.push(gather(rx).await?);
    }
    Ok(Json(D::reply(&p.format, &replies)).into_response())
}

fn stream<D: Dialect>(p: Planned) -> Response {
    let keep_alive = KeepAlive::new().interval(p.keep_alive).text("keep-alive");
    let (events, first) = D::start(p.format, p.rxs.len());
    let events = EventStream {
        open: vec![true; p.rxs.len()],
        rxs: p.rxs,
        next: 0,
        pending: first.into(),
        done: false,
        events,
    };
    (
        [("x-accel-buffering", "no")],
        Sse::new(events).keep_alive(keep_alive),
    )
        .into_response()
}

/// Turns the jobs' messages into SSE events as they come; ends after every choice has finished, or after an
/// error event.
struct EventStream<E> {
    rxs: Vec<UnboundedReceiver<Msg>>,
    /// Which choices are still generating.
    open: Vec<bool>,
    /// The choice polled first next time (each in turn, so none waits behind another).
    next: usize,
    pending: VecDeque<Event>,
    done: bool,
    events: E,
}

impl<E: Events> EventStream<E> {
    /// Choice `choice`'s next message.
    fn on(&mut self, choice: usize, msg: Option<Msg>) {
        let mut out = Vec::new();
        match msg {
            Some(Msg::Delta(d)) => self.events.delta(choice, &d, &mut out),
            Some(Msg::ToolCall { index, call }) => {
                self.events.tool_call(choice, index, &call, &mut out)
            }
            Some(Msg::Done(finish)) => {
                self.open[choice] = false;
                self.done = !self.open.contains(&true);
                self.events.done(choice, &finish, self.done, &mut out);
            }
            Some(Msg::Error(message)) => return self.fail(&message),
            None => return self.fail(UNFINISHED),
        }
        self.pending.extend(out);
    }

    /// An error after the 200 status went out: an event with the API's error object, then the end.
    fn fail(&mut self, message: &str) {
        let e = self.events.error(message);
        self.pending.push_back(e);
        self.done = true;
    }
}

impl<E: Events> tokio_stream::Stream for EventStream<E> {
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
    use crate::dialect::chat::Chat;
    use crate::dialect::responses::Responses;
    use crate::sink::{Finish, Usage};
    use deltafin_tokenizer::chat::ToolCall;
    use tokio::sync::mpsc::UnboundedSender;

    fn call(id: &str, name: &str, arguments: &str) -> ToolCall {
        ToolCall {
            id: id.into(),
            name: name.into(),
            arguments: arguments.into(),
        }
    }

    fn delta(reasoning: &str, content: &str) -> Msg {
        Msg::Delta(Delta {
            reasoning: reasoning.into(),
            content: content.into(),
            logprobs: Vec::new(),
        })
    }

    /// An answer planned over a channel the test has written `msgs` to.
    fn planned(stream: bool, msgs: Vec<Msg>) -> (Planned, UnboundedSender<Msg>) {
        let (tx, rx) = unbounded_channel();
        let format = Format {
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
            Msg::Done(Finish {
                reason: "tool_calls",
                stop_sequence: None,
                usage: Usage::default(),
            }),
        ];
        planned(stream, msgs)
    }

    async fn body(r: Response) -> String {
        let bytes = axum::body::to_bytes(r.into_body(), 1 << 20).await.unwrap();
        String::from_utf8(bytes.to_vec()).unwrap()
    }

    #[tokio::test]
    async fn a_plain_answer_lists_the_calls_with_null_content() {
        let (p, _tx) = two_calls(false);
        let v: Value = serde_json::from_str(&body(respond::<Chat>(Ok(p)).await).await).unwrap();
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
        let text = body(respond::<Chat>(Ok(p)).await).await;
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
        // Every chunk is the one choice's, whatever call it carries.
        assert!(chunks.iter().all(|c| c["choices"][0]["index"] == 0));
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

    /// A reply that thinks, writes, then calls two tools (one with arguments that are not JSON).
    fn thinking_text_and_calls(stream: bool) -> (Planned, UnboundedSender<Msg>) {
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
            Msg::Done(Finish {
                reason: "tool_calls",
                stop_sequence: None,
                usage: Usage {
                    prompt_tokens: 30,
                    cached_tokens: 10,
                    completion_tokens: 7,
                    reasoning_tokens: 3,
                },
            }),
        ];
        planned(stream, msgs)
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
        let (p, _tx) = thinking_text_and_calls(false);
        let r = collect::<Messages>(p).await.unwrap();
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
        let (p, tx) = thinking_text_and_calls(true);
        drop(tx);
        let events = events(&body(stream::<Messages>(p)).await);
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
        let (p, _tx) = thinking_text_and_calls(false);
        let whole: Value =
            serde_json::from_str(&body(collect::<Responses>(p).await.unwrap()).await).unwrap();
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
        let (p, tx) = thinking_text_and_calls(true);
        drop(tx);
        let events = events(&body(stream::<Responses>(p)).await);
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
