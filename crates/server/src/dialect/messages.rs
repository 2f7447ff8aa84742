//! Anthropic's Messages API (`POST /v1/messages`) on the chat machinery the OpenAI endpoints use: a request
//! becomes the same [`ChatRequest`] (system, turns, tool results and earlier tool uses as K3's messages), and
//! the reply's reasoning, text and tool calls come back as `thinking`, `text` and `tool_use` blocks, whole or
//! as Anthropic's SSE events. Errors take Anthropic's shape: `{"type": "error", "error": {"type", "message"}}`.

use super::{Dialect, Events, Format, Reply};
use crate::api::{
    self, only_fields, random_seed, string_field, temperature_top_p, ChatRequest, Common, Fields,
    Object, Tools,
};
use crate::chat::ReasoningEffort;
use crate::error::ApiError;
use crate::prompt::{self, Prepared};
use crate::sink::{Delta, Finish, Usage};
use crate::AppState;
use axum::http::StatusCode;
use axum::response::sse::Event;
use axum::response::{IntoResponse, Response};
use deltafin_engine::SamplingParams;
use deltafin_tokenizer::chat::{ChatMessage, Effort, Role, ToolCall};
use serde_json::{json, Value};

pub struct Messages;

impl Dialect for Messages {
    type Request = ChatRequest;
    type Events = Blocks;

    fn parse(body: &[u8]) -> Result<ChatRequest, ApiError> {
        parse_as(body, false)
    }

    fn prepare(s: &AppState, req: ChatRequest) -> Result<Prepared, ApiError> {
        prompt::chat(s, req, EFFORT_FIELD)
    }

    fn id(created: u64, n: u64) -> String {
        format!("msg_{created:x}{n:06}")
    }

    /// One choice: Messages has no `n`.
    fn reply(f: &Format, replies: &[Reply]) -> Value {
        let r = &replies[0];
        let uses = r.calls.iter().map(|(i, c)| tool_use(&f.id, *i, c));
        let mut content = Vec::new();
        if !r.reasoning.is_empty() {
            content.push(json!({"type": "thinking", "thinking": r.reasoning, "signature": ""}));
        }
        if !r.content.is_empty() {
            content.push(json!({"type": "text", "text": r.content}));
        }
        content.extend(uses);
        json!({
            "id": f.id, "type": "message", "role": "assistant", "model": f.model, "content": content,
            "stop_reason": stop_reason(&r.finish), "stop_sequence": r.finish.stop_sequence,
            "usage": usage(&r.finish.usage),
        })
    }

    fn start(f: Format, _: usize) -> (Blocks, Vec<Event>) {
        let message = json!({
            "id": f.id, "type": "message", "role": "assistant", "model": f.model, "content": [],
            "stop_reason": null, "stop_sequence": null,
            "usage": {"input_tokens": f.prompt_tokens, "output_tokens": 0},
        });
        let start = event(
            "message_start",
            json!({"type": "message_start", "message": message}),
        );
        let blocks = Blocks {
            id: f.id,
            open: None,
            next: 0,
        };
        (blocks, vec![start])
    }

    /// Anthropic's shape; the field a request error is about leads its message.
    fn error(e: ApiError) -> Response {
        let kind = match e.status {
            StatusCode::UNAUTHORIZED => "authentication_error",
            StatusCode::NOT_FOUND => "not_found_error",
            StatusCode::PAYLOAD_TOO_LARGE => "request_too_large",
            StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
            StatusCode::SERVICE_UNAVAILABLE => "overloaded_error",
            s if s.is_server_error() => "api_error",
            _ => "invalid_request_error",
        };
        let message = match &e.param {
            Some(p) => format!("{p}: {}", e.message),
            None => e.message.clone(),
        };
        let body = json!({"type": "error", "error": {"type": kind, "message": message}});
        let mut resp = (e.status, axum::Json(body)).into_response();
        if let Some(secs) = e.retry_after_secs {
            resp.headers_mut()
                .insert(axum::http::header::RETRY_AFTER, secs.into());
        }
        resp
    }
}

/// The request field that sets K3's thinking.
pub const EFFORT_FIELD: &str = "thinking";

const FIELDS: &[&str] = &[
    "model",
    "max_tokens",
    "messages",
    "system",
    "stop_sequences",
    "stream",
    // Sampling: older API versions' fields, which clients may still send (deltafin samples as asked).
    "temperature",
    "top_p",
    "tools",
    "tool_choice",
    "thinking",
    "output_config",
    // Accepted without effect: the prefix cache needs no markers, and one server has one region, speed and
    // tier.
    "metadata",
    "cache_control",
    "inference_geo",
    "speed",
    "service_tier",
    "user_profile_id",
];

/// Not implemented: accepted only when null.
const UNSUPPORTED: &[&str] = &[
    "top_k",
    "container",
    "mcp_servers",
    "context_management",
    "diagnostics",
];

/// More stop strings than any client sends; each costs a scan of the held-back text per token.
const MAX_STOP_SEQUENCES: usize = 64;

/// What `/v1/messages/count_tokens` reads: the prompt's fields.
const COUNT_FIELDS: &[&str] = &[
    "model",
    "messages",
    "system",
    "tools",
    "tool_choice",
    "thinking",
    "output_config",
    "cache_control",
];

/// Parses a `count_tokens` request: the prompt's fields only, no max_tokens.
pub fn parse_count(body: &[u8]) -> Result<ChatRequest, ApiError> {
    parse_as(body, true)
}

fn parse_as(body: &[u8], counting: bool) -> Result<ChatRequest, ApiError> {
    let fields = if counting { COUNT_FIELDS } else { FIELDS };
    let f = Fields::parse_against(body, fields, UNSUPPORTED)?;
    let model: String = f
        .get("model")?
        .ok_or_else(|| ApiError::invalid("model", "'model' is required"))?;
    let max_tokens: u64 = match f.get("max_tokens")? {
        Some(n) => n,
        None if counting => u64::MAX,
        None => return Err(ApiError::invalid("max_tokens", "'max_tokens' is required")),
    };
    let (temperature, top_p) = temperature_top_p(&f, 1.0)?;
    let stop: Vec<String> = f.get("stop_sequences")?.unwrap_or_default();
    if stop.len() > MAX_STOP_SEQUENCES {
        return Err(ApiError::invalid(
            "stop_sequences",
            format!(
                "at most {MAX_STOP_SEQUENCES} stop sequences, got {}",
                stop.len()
            ),
        ));
    }
    let mut messages = system(f.raw("system"))?;
    let turns = f.list("messages")?;
    for (i, m) in turns.iter().enumerate() {
        turn(i, m, &mut messages)?;
    }
    let mut effort = effort(f.raw("thinking"), f.raw("output_config"), max_tokens)?;
    // A final assistant turn is the reply's start (prefill): its text, which the model continues. The
    // reply is the answer then, so K3 does not think first.
    let mut prefill = None;
    if messages.last().is_some_and(|m| m.role == Role::Assistant) {
        let at = format!("messages[{}]", turns.len() - 1);
        let last = messages.pop().expect("checked above");
        if last.reasoning.is_some() || !last.tool_calls.is_empty() {
            return Err(ApiError::invalid(
                at,
                "a final assistant turn (prefill) may hold text only",
            ));
        }
        if f.raw("thinking").is_some() && effort != ReasoningEffort::None {
            return Err(ApiError::invalid(
                "thinking",
                "a final assistant turn (prefill) starts the answer itself: thinking must be disabled",
            ));
        }
        effort = ReasoningEffort::None;
        prefill = Some(last.content);
    }
    Ok(ChatRequest {
        common: Common {
            model,
            max_tokens: Some(max_tokens.min(usize::MAX as u64) as usize),
            sampling: SamplingParams {
                temperature,
                top_p,
                seed: random_seed(),
                ..SamplingParams::default()
            },
            stop,
            stream: f.get("stream")?.unwrap_or(false),
            include_usage: false,
            n: 1,
        },
        messages,
        top_logprobs: None,
        effort,
        tools: tools(f.raw("tools"), f.raw("tool_choice"))?,
        prefill,
    })
}

/// `system`: a string or a list of text blocks; one system message.
fn system(v: Option<&Value>) -> Result<Vec<ChatMessage>, ApiError> {
    let text = match v {
        None => return Ok(Vec::new()),
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(blocks)) => {
            let mut text = String::new();
            for (j, b) in blocks.iter().enumerate() {
                let at = format!("system[{j}]");
                let o = block(&at, b, &["text"])?;
                text.push_str(&string_field(o, "text", &at)?);
            }
            text
        }
        Some(_) => {
            return Err(ApiError::invalid(
                "system",
                "system must be a string or a list of text blocks",
            ))
        }
    };
    Ok(vec![ChatMessage::system(text)])
}

/// Block `v` at `at`: an object whose `type` is one of `kinds`, with only that type's fields.
fn block<'a>(at: &str, v: &'a Value, kinds: &[&str]) -> Result<&'a Object, ApiError> {
    let Value::Object(o) = v else {
        return Err(ApiError::invalid(
            at,
            "each content block must be an object",
        ));
    };
    let kind = o.get("type").and_then(Value::as_str).unwrap_or("");
    let fields: &[&str] = match kind {
        "text" => &["type", "text", "cache_control", "citations"],
        "tool_use" => &["type", "id", "name", "input", "cache_control"],
        "tool_result" => &[
            "type",
            "tool_use_id",
            "content",
            "is_error",
            "cache_control",
        ],
        "thinking" => &["type", "thinking", "signature"],
        _ => &[],
    };
    if !kinds.contains(&kind) || fields.is_empty() {
        return Err(ApiError::invalid(
            format!("{at}.type"),
            format!(
                "block type {kind:?} is not accepted here; deltafin reads {} blocks",
                kinds.join(", ")
            ),
        ));
    }
    only_fields(o, fields, at)?;
    Ok(o)
}

/// `messages[i]`, appended to `out` as K3's messages: a user turn's tool results become tool messages (in
/// order, before its text), an assistant turn's thinking, text and tool uses one assistant message.
fn turn(i: usize, m: &Value, out: &mut Vec<ChatMessage>) -> Result<(), ApiError> {
    let at = format!("messages[{i}]");
    let Value::Object(o) = m else {
        return Err(ApiError::invalid(at, "each message must be an object"));
    };
    only_fields(o, &["role", "content"], &at)?;
    let role = match o.get("role").and_then(Value::as_str) {
        Some("user") => Role::User,
        Some("assistant") => Role::Assistant,
        _ => return Err(ApiError::invalid(
            format!("{at}.role"),
            "role must be \"user\" or \"assistant\" (the system prompt is the top-level 'system')",
        )),
    };
    let kinds: &[&str] = if role == Role::User {
        &["text", "tool_result"]
    } else {
        &["text", "thinking", "tool_use"]
    };
    let blocks = match o.get("content") {
        Some(Value::String(s)) => vec![json!({"type": "text", "text": s})],
        Some(Value::Array(b)) => b.clone(),
        _ => {
            return Err(ApiError::invalid(
                format!("{at}.content"),
                "content must be a string or a list of content blocks",
            ))
        }
    };
    let mut text = String::new();
    let mut reasoning: Option<String> = None;
    let mut calls = Vec::new();
    for (j, b) in blocks.iter().enumerate() {
        let at = format!("{at}.content[{j}]");
        let o = block(&at, b, kinds)?;
        match o["type"].as_str() {
            Some("text") => text.push_str(&string_field(o, "text", &at)?),
            Some("thinking") => reasoning
                .get_or_insert_with(String::new)
                .push_str(&string_field(o, "thinking", &at)?),
            Some("tool_use") => {
                let input = match o.get("input") {
                    Some(v @ Value::Object(_)) => v.to_string(),
                    _ => {
                        return Err(ApiError::invalid(
                            format!("{at}.input"),
                            "a tool use's input must be an object",
                        ))
                    }
                };
                calls.push(ToolCall {
                    id: string_field(o, "id", &at)?,
                    name: string_field(o, "name", &at)?,
                    arguments: input,
                });
            }
            _ => out.push(tool_result(o, &at)?),
        }
    }
    if role == Role::Assistant {
        out.push(ChatMessage {
            reasoning,
            tool_calls: calls,
            ..ChatMessage::new(Role::Assistant, text)
        });
    } else if !text.is_empty() || !blocks.iter().any(|b| b["type"] == "tool_result") {
        out.push(ChatMessage::new(Role::User, text));
    }
    Ok(())
}

/// A `tool_result` block as K3's tool message; a failed tool's result (`is_error`) is prefixed "Error: ",
/// since K3's format has no flag for it.
fn tool_result(o: &Object, at: &str) -> Result<ChatMessage, ApiError> {
    let id = string_field(o, "tool_use_id", at)?;
    let mut text = match o.get("content") {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for (k, p) in parts.iter().enumerate() {
                let at = format!("{at}.content[{k}]");
                text.push_str(&string_field(block(&at, p, &["text"])?, "text", &at)?);
            }
            text
        }
        Some(_) => {
            return Err(ApiError::invalid(
                format!("{at}.content"),
                "a tool result's content must be a string or a list of text blocks",
            ))
        }
    };
    match o.get("is_error") {
        None | Some(Value::Null) | Some(Value::Bool(false)) => {}
        Some(Value::Bool(true)) => text.insert_str(0, "Error: "),
        Some(_) => {
            return Err(ApiError::invalid(
                format!("{at}.is_error"),
                "is_error must be a boolean",
            ))
        }
    }
    Ok(ChatMessage {
        tool_call_id: Some(id),
        ..ChatMessage::new(Role::Tool, text)
    })
}

/// K3's thinking from `thinking` and `output_config.effort`. `thinking`: `disabled` answers without
/// thinking; `adaptive`, `between_tools` or absent think as K3 does by default; `enabled` with
/// `budget_tokens` B thinks with an effort picked by B (below 4,096 low, from 16,384 high; K3 has no token
/// budget, so max_tokens stays the only cap). `display` may be `summarized` (the whole thinking is returned).
/// `output_config.effort`, when given, picks the effort instead: low; medium (the default); high, xhigh or
/// max (high).
fn effort(
    thinking: Option<&Value>,
    output: Option<&Value>,
    max_tokens: u64,
) -> Result<ReasoningEffort, ApiError> {
    let mut effort = ReasoningEffort::Think(None);
    if let Some(v) = thinking {
        let bad = |m: &str| Err(ApiError::invalid("thinking", m));
        let Value::Object(o) = v else {
            return bad("thinking must be an object");
        };
        match o.get("display") {
            None | Some(Value::Null) => {}
            Some(d) if d == "summarized" => {}
            Some(_) => {
                return Err(ApiError::invalid(
                    "thinking.display",
                    "display must be \"summarized\" (deltafin returns the whole thinking; it cannot omit it)",
                ))
            }
        }
        let known = |fields: &[&str]| o.keys().all(|k| fields.contains(&k.as_str()));
        effort = match o.get("type").and_then(Value::as_str) {
            Some("disabled") if known(&["type"]) => ReasoningEffort::None,
            Some("adaptive" | "between_tools") if known(&["type", "display"]) => effort,
            Some("enabled") if known(&["type", "budget_tokens", "display"]) => {
                match o.get("budget_tokens").and_then(Value::as_u64) {
                    Some(b) if b >= 1024 && b < max_tokens => ReasoningEffort::Think(match b {
                        ..4096 => Some(Effort::Low),
                        16384.. => Some(Effort::High),
                        _ => None,
                    }),
                    _ => {
                        return bad(&format!(
                        "budget_tokens must be an integer of at least 1024 and below max_tokens \
                             ({max_tokens})"
                    ))
                    }
                }
            }
            _ => {
                return bad(
                    "thinking must be {\"type\": \"disabled\"}, {\"type\": \"adaptive\"} or \
                     {\"type\": \"enabled\", \"budget_tokens\": N}",
                )
            }
        };
    }
    let Some(output) = output else {
        return Ok(effort);
    };
    let Value::Object(o) = output else {
        return Err(ApiError::invalid("output_config", "must be an object"));
    };
    only_fields(o, &["effort", "format"], "output_config")?;
    if o.get("format").is_some_and(|f| !f.is_null()) {
        return Err(ApiError::invalid(
            "output_config.format",
            "structured outputs are not supported: deltafin never constrains sampling",
        )
        .code("unsupported_parameter"));
    }
    let chosen = match o.get("effort") {
        None | Some(Value::Null) => return Ok(effort),
        Some(e) => match e.as_str() {
            Some("low") => Some(Effort::Low),
            Some("medium") => None,
            Some("high" | "xhigh" | "max") => Some(Effort::High),
            _ => {
                return Err(ApiError::invalid(
                    "output_config.effort",
                    "effort must be low, medium, high, xhigh or max",
                ))
            }
        },
    };
    Ok(match effort {
        ReasoningEffort::None => ReasoningEffort::None,
        ReasoningEffort::Think(_) => ReasoningEffort::Think(chosen),
    })
}

/// `tools` (custom tools: name, description, input_schema) in the JSON list K3's tool message shows
/// (OpenAI's function form, as the chat endpoint lists them), and `tool_choice`.
fn tools(list: Option<&Value>, choice: Option<&Value>) -> Result<Tools, ApiError> {
    let mut parallel = true;
    let mut offer = true;
    if let Some(c) = choice {
        let o = c.as_object().ok_or_else(|| {
            ApiError::invalid("tool_choice", "tool_choice must be an object with a 'type'")
        })?;
        match o.get("disable_parallel_tool_use") {
            None | Some(Value::Null) => {}
            Some(Value::Bool(b)) => parallel = !b,
            Some(_) => {
                return Err(ApiError::invalid(
                    "tool_choice.disable_parallel_tool_use",
                    "must be a boolean",
                ))
            }
        }
        match o.get("type").and_then(Value::as_str) {
            Some("auto") => {}
            Some("none") => offer = false,
            Some("any" | "tool") => {
                return Err(ApiError::invalid(
                    "tool_choice",
                    "tool_choice must be auto or none: deltafin never constrains sampling, so it cannot \
                     force a tool use (any, or a named tool)",
                )
                .code("unsupported_parameter"))
            }
            _ => {
                return Err(ApiError::invalid(
                    "tool_choice.type",
                    "the type must be auto, any, tool or none",
                ))
            }
        }
    }
    let mut functions = Vec::new();
    for (i, t) in api::tools_list(list)?.iter().enumerate() {
        let at = format!("tools[{i}]");
        let Value::Object(o) = t else {
            return Err(ApiError::invalid(at, "each tool must be an object"));
        };
        if let Some(kind) = o
            .get("type")
            .and_then(Value::as_str)
            .filter(|&k| k != "custom")
        {
            return Err(ApiError::invalid(
                format!("{at}.type"),
                format!("tool type {kind:?} (one of Anthropic's own) is not supported; give custom tools with an input_schema"),
            )
            .code("unsupported_parameter"));
        }
        let known = [
            "type",
            "name",
            "description",
            "input_schema",
            "cache_control",
        ];
        only_fields(o, &known, &at)?;
        let Some(schema @ Value::Object(_)) = o.get("input_schema") else {
            return Err(ApiError::invalid(
                format!("{at}.input_schema"),
                "a tool needs its input_schema, a JSON Schema object",
            ));
        };
        // As the chat endpoint's function: name, description, and the schema as its parameters.
        let mut function = Object::new();
        for k in ["name", "description"] {
            if let Some(v) = o.get(k) {
                function.insert(k.into(), v.clone());
            }
        }
        function.insert("parameters".into(), schema.clone());
        functions.push((at, function));
    }
    api::offer_tools(functions, offer, parallel)
}

/// A reply's stop reason in Anthropic's words, from the sink's finish reason.
fn stop_reason(f: &Finish) -> &'static str {
    match f.reason {
        "length" => "max_tokens",
        "tool_calls" => "tool_use",
        _ if f.stop_sequence.is_some() => "stop_sequence",
        _ => "end_turn",
    }
}

/// Anthropic's usage: input tokens not read from the prefix cache, those read from it, and output tokens.
fn usage(u: &Usage) -> Value {
    json!({
        "input_tokens": u.prompt_tokens.saturating_sub(u.cached_tokens),
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": u.cached_tokens,
        "output_tokens": u.completion_tokens,
    })
}

/// A tool call as a `tool_use` block. Ids are unique per reply (`toolu_<message id>_<index>` where the model
/// wrote none); the arguments become `input`, or `{"_raw_arguments": text}` when the model's arguments are
/// not a JSON object (passed on for the client to judge, never dropped).
fn tool_use(message_id: &str, index: usize, call: &ToolCall) -> Value {
    let id = if call.id.is_empty() {
        format!("toolu_{message_id}_{index}")
    } else {
        call.id.clone()
    };
    let input = match serde_json::from_str::<Value>(&call.arguments) {
        Ok(v @ Value::Object(_)) => v,
        _ => json!({"_raw_arguments": call.arguments}),
    };
    json!({"type": "tool_use", "id": id, "name": call.name, "input": input})
}

/// Anthropic's stream: `message_start`, then each content block as start, deltas and stop (thinking and text
/// blocks as their text arrives, a tool use whole), then `message_delta` with the stop reason and usage and
/// `message_stop`.
pub struct Blocks {
    id: String,
    /// The open block: its index and whether it is thinking (else text).
    open: Option<(usize, bool)>,
    next: usize,
}

fn event(kind: &str, data: Value) -> Event {
    Event::default().event(kind).data(data.to_string())
}

impl Blocks {
    fn close(&mut self, out: &mut Vec<Event>) {
        if let Some((index, _)) = self.open.take() {
            out.push(event(
                "content_block_stop",
                json!({"type": "content_block_stop", "index": index}),
            ));
        }
    }

    fn open(&mut self, block: Value, out: &mut Vec<Event>) -> usize {
        self.close(out);
        let index = self.next;
        self.next += 1;
        out.push(event(
            "content_block_start",
            json!({"type": "content_block_start", "index": index, "content_block": block}),
        ));
        index
    }

    /// Reasoning or text: into the open block of that kind, or a new one.
    fn text(&mut self, thinking: bool, text: &str, out: &mut Vec<Event>) {
        if text.is_empty() {
            return;
        }
        let index = match self.open {
            Some((i, t)) if t == thinking => i,
            _ => {
                let block = if thinking {
                    json!({"type": "thinking", "thinking": "", "signature": ""})
                } else {
                    json!({"type": "text", "text": ""})
                };
                let i = self.open(block, out);
                self.open = Some((i, thinking));
                i
            }
        };
        let delta = if thinking {
            json!({"type": "thinking_delta", "thinking": text})
        } else {
            json!({"type": "text_delta", "text": text})
        };
        out.push(event(
            "content_block_delta",
            json!({"type": "content_block_delta", "index": index, "delta": delta}),
        ));
    }
}

/// One choice: Messages has no `n`.
impl Events for Blocks {
    fn delta(&mut self, _: usize, d: &Delta, out: &mut Vec<Event>) {
        self.text(true, &d.reasoning, out);
        self.text(false, &d.content, out);
    }

    fn tool_call(&mut self, _: usize, index: usize, call: &ToolCall, out: &mut Vec<Event>) {
        let mut block = tool_use(&self.id, index, call);
        let input = std::mem::replace(&mut block["input"], json!({}));
        let i = self.open(block, out);
        out.push(event(
            "content_block_delta",
            json!({"type": "content_block_delta", "index": i,
                   "delta": {"type": "input_json_delta", "partial_json": input.to_string()}}),
        ));
        out.push(event(
            "content_block_stop",
            json!({"type": "content_block_stop", "index": i}),
        ));
    }

    fn done(&mut self, _: usize, f: &Finish, _: bool, out: &mut Vec<Event>) {
        self.close(out);
        out.push(event(
            "message_delta",
            json!({"type": "message_delta",
                   "delta": {"stop_reason": stop_reason(f), "stop_sequence": f.stop_sequence},
                   "usage": usage(&f.usage)}),
        ));
        out.push(event("message_stop", json!({"type": "message_stop"})));
    }

    fn error(&mut self, message: &str) -> Event {
        event(
            "error",
            json!({"type": "error", "error": {"type": "api_error", "message": message}}),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parsed(extra: Value) -> ChatRequest {
        let mut body = json!({"model": "m", "max_tokens": 100, "messages": [{"role": "user", "content": "Hi"}]});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        Messages::parse(body.to_string().as_bytes()).unwrap_or_else(|e| panic!("{}", e.message))
    }

    #[test]
    fn turns_become_k3_messages() {
        let r = parsed(json!({
            "system": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
            "messages": [
                {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "Use the tool.", "signature": "s"},
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Paris"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "down"}],
                     "is_error": true},
                    {"type": "text", "text": "Try again."}]},
                {"role": "assistant", "content": [
                    {"type": "tool_use", "id": "toolu_2", "name": "weather", "input": {}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_2", "content": "18 C"}]},
            ],
        }));
        let m = &r.messages;
        let summary: Vec<(Role, &str)> = m.iter().map(|m| (m.role, m.content.as_str())).collect();
        assert_eq!(
            summary,
            [
                (Role::System, "Be brief."),
                (Role::User, "Weather?"),
                (Role::Assistant, "Checking."),
                (Role::Tool, "Error: down"),
                (Role::User, "Try again."),
                (Role::Assistant, ""),
                (Role::Tool, "18 C"),
            ]
        );
        assert_eq!(m[2].reasoning.as_deref(), Some("Use the tool."));
        assert_eq!(
            m[2].tool_calls,
            [ToolCall {
                id: "toolu_1".into(),
                name: "weather".into(),
                arguments: r#"{"city":"Paris"}"#.into()
            }]
        );
        assert_eq!(m[3].tool_call_id.as_deref(), Some("toolu_1"));
        assert_eq!(m[5].reasoning, None);
        assert_eq!(m[6].tool_call_id.as_deref(), Some("toolu_2"));
    }

    #[test]
    fn thinking_picks_k3s_effort() {
        let effort = |t: Value| parsed(json!({"thinking": t, "max_tokens": 30000})).effort;
        assert_eq!(effort(Value::Null), ReasoningEffort::Think(None));
        assert_eq!(effort(json!({"type": "disabled"})), ReasoningEffort::None);
        let budget = |b: u64| effort(json!({"type": "enabled", "budget_tokens": b}));
        assert_eq!(budget(1024), ReasoningEffort::Think(Some(Effort::Low)));
        assert_eq!(budget(4096), ReasoningEffort::Think(None));
        assert_eq!(budget(16384), ReasoningEffort::Think(Some(Effort::High)));
        assert_eq!(
            effort(json!({"type": "adaptive"})),
            ReasoningEffort::Think(None)
        );
        let with_output = |t: Value, e: &str| {
            parsed(json!({"thinking": t, "output_config": {"effort": e}})).effort
        };
        assert_eq!(
            with_output(json!({"type": "adaptive"}), "max"),
            ReasoningEffort::Think(Some(Effort::High))
        );
        assert_eq!(
            with_output(Value::Null, "low"),
            ReasoningEffort::Think(Some(Effort::Low))
        );
        assert_eq!(
            with_output(json!({"type": "disabled"}), "high"),
            ReasoningEffort::None
        );
        let over = json!({"model": "m", "max_tokens": 2000, "messages": [{"role": "user", "content": "Hi"}],
                          "thinking": {"type": "enabled", "budget_tokens": 2000}});
        assert!(Messages::parse(over.to_string().as_bytes()).is_err());
    }

    #[test]
    fn tools_are_listed_in_openais_function_form() {
        let tool =
            json!({"name": "weather", "description": "d", "input_schema": {"type": "object"}});
        let r = parsed(
            json!({"tools": [tool], "tool_choice": {"type": "auto", "disable_parallel_tool_use": true}}),
        );
        let listed: Value = serde_json::from_str(r.tools.listed.as_deref().unwrap()).unwrap();
        assert_eq!(
            listed,
            json!([{"type": "function", "function": {"name": "weather", "description": "d",
                                                      "parameters": {"type": "object"}}}])
        );
        assert!(!r.tools.parallel);
        let none = parsed(json!({"tools": [tool], "tool_choice": {"type": "none"}}));
        assert_eq!((none.tools.listed, none.tools.parallel), (None, true));
    }
}
