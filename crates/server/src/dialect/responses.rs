//! OpenAI's Responses API (`POST /v1/responses`) on the chat machinery: `instructions` and the `input` items
//! (messages, earlier function calls, their outputs, reasoning) become the same [`ChatRequest`] as a chat
//! request, and the reply's reasoning, text and calls come back as `reasoning`, `message` and
//! `function_call` output items, whole or as the Responses stream's events. Responses are not stored:
//! `previous_response_id` is refused, so clients send the whole conversation (as with `store: false`).

use super::{Dialect, Events, Format, Reply};
use crate::api::{
    self, only_fields, random_seed, string_field, temperature_top_p, ChatRequest, Common, Fields,
    Tools,
};
use crate::chat::ReasoningEffort;
use crate::error::ApiError;
use crate::prompt::{self, Prepared};
use crate::sink::{Delta, Finish, Usage};
use crate::AppState;
use axum::response::sse::Event;
use deltafin_engine::SamplingParams;
use deltafin_tokenizer::chat::{ChatMessage, Effort, Role, ToolCall};
use serde_json::{json, Value};

pub struct Responses;

impl Dialect for Responses {
    type Request = ChatRequest;
    type Events = Items;

    fn parse(body: &[u8]) -> Result<ChatRequest, ApiError> {
        parse(body)
    }

    fn prepare(s: &AppState, req: ChatRequest) -> Result<Prepared, ApiError> {
        prompt::chat(s, req, "reasoning_effort")
    }

    fn id(created: u64, n: u64) -> String {
        format!("resp_{created:x}{n:06}")
    }

    /// One choice: Responses has no `n`.
    fn reply(f: &Format, replies: &[Reply]) -> Value {
        let r = &replies[0];
        let output = output(&f.id, &r.reasoning, &r.content, &r.calls);
        let finish = Some(r.finish.reason);
        response(
            &f.id,
            f.created,
            &f.model,
            output,
            finish,
            Some(&r.finish.usage),
        )
    }

    fn start(f: Format, _: usize) -> (Items, Vec<Event>) {
        let mut items = Items {
            id: f.id,
            created: f.created,
            model: f.model,
            seq: 0,
            open: None,
            done: Vec::new(),
        };
        let r = response(
            &items.id,
            items.created,
            &items.model,
            Vec::new(),
            None,
            None,
        );
        let events = vec![
            items.event("response.created", json!({"response": r.clone()})),
            items.event("response.in_progress", json!({"response": r})),
        ];
        (items, events)
    }
}

const FIELDS: &[&str] = &[
    "model",
    "input",
    "instructions",
    "max_output_tokens",
    "temperature",
    "top_p",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "reasoning",
    "text",
    "stream",
    "truncation",
    // Accepted without effect: nothing is stored (so `include`'s encrypted reasoning never exists), the
    // prefix cache needs no key, and one server has one tier.
    "store",
    "include",
    "metadata",
    "safety_identifier",
    "prompt_cache_key",
    "prompt_cache_retention",
    "service_tier",
    "user",
    // Refused with their reason when given: responses are not stored.
    "previous_response_id",
    "conversation",
];

/// Not implemented: accepted only when null.
const UNSUPPORTED: &[&str] = &[
    "background",
    "context_management",
    "max_tool_calls",
    "prompt",
    "top_logprobs",
    "stream_options",
];

/// Parses a Responses request into the chat request it asks for.
fn parse(body: &[u8]) -> Result<ChatRequest, ApiError> {
    let f = Fields::parse_against(body, FIELDS, UNSUPPORTED)?;
    for k in ["previous_response_id", "conversation"] {
        if f.raw(k).is_some() {
            let why = "deltafin stores no responses; send the whole conversation in 'input'";
            return Err(ApiError::invalid(k, format!("'{k}': {why}")).code("unsupported_parameter"));
        }
    }
    let model: String = f
        .get("model")?
        .ok_or_else(|| ApiError::invalid("model", "'model' is required"))?;
    let max_tokens: Option<u64> = f.get("max_output_tokens")?;
    if max_tokens == Some(0) {
        return Err(ApiError::invalid(
            "max_output_tokens",
            "max_output_tokens must be at least 1",
        ));
    }
    let (temperature, top_p) = temperature_top_p(&f, 2.0)?;
    if f.raw("truncation").is_some_and(|t| t != "disabled") {
        return Err(ApiError::invalid(
            "truncation",
            "truncation must be \"disabled\": deltafin never drops input to fit the context",
        )
        .code("unsupported_parameter"));
    }
    text_format(f.raw("text"))?;
    let mut messages = Vec::new();
    if let Some(i) = f.get::<String>("instructions")? {
        messages.push(ChatMessage::system(i));
    }
    match f.raw("input") {
        Some(Value::String(s)) => messages.push(ChatMessage::new(Role::User, s.clone())),
        Some(Value::Array(items)) if !items.is_empty() => {
            for (i, item) in items.iter().enumerate() {
                input_item(i, item, &mut messages)?;
            }
        }
        _ => {
            return Err(ApiError::invalid(
                "input",
                "'input' must be a string or a non-empty list of items",
            ))
        }
    }
    let parallel = f.get::<bool>("parallel_tool_calls")?.unwrap_or(true);
    Ok(ChatRequest {
        common: Common {
            model,
            max_tokens: max_tokens.map(|m| m.min(usize::MAX as u64) as usize),
            sampling: SamplingParams {
                temperature,
                top_p,
                seed: random_seed(),
                ..SamplingParams::default()
            },
            stop: Vec::new(),
            stream: f.get("stream")?.unwrap_or(false),
            include_usage: false,
            n: 1,
        },
        messages,
        top_logprobs: None,
        effort: effort(f.raw("reasoning"))?,
        tools: tools(f.raw("tools"), f.raw("tool_choice"), parallel)?,
        prefill: None,
    })
}

/// `text`: only plain text output (`{"format": {"type": "text"}}`; structured outputs would need
/// constrained sampling) at the default `verbosity`, medium (K3 has no other).
fn text_format(v: Option<&Value>) -> Result<(), ApiError> {
    let Some(v) = v else { return Ok(()) };
    let ok = v.as_object().is_some_and(|o| {
        o.iter().all(|(k, x)| match k.as_str() {
            "format" => x.is_null() || x.get("type") == Some(&json!("text")),
            "verbosity" => x.is_null() || x == "medium",
            _ => false,
        })
    });
    if ok {
        return Ok(());
    }
    Err(ApiError::invalid(
        "text",
        "text may only ask for plain text ({\"format\": {\"type\": \"text\"}}) at verbosity medium: deltafin \
         never constrains sampling, and K3 has no verbosity setting",
    )
    .code("unsupported_parameter"))
}

/// `reasoning.effort`: none or minimal answer without thinking; low and high tell K3 that effort; medium
/// (the default) leaves K3's own. `summary` is accepted: the reasoning item holds the whole thinking.
fn effort(v: Option<&Value>) -> Result<ReasoningEffort, ApiError> {
    let Some(v) = v else {
        return Ok(ReasoningEffort::Think(None));
    };
    let Value::Object(o) = v else {
        return Err(ApiError::invalid(
            "reasoning",
            "reasoning must be an object",
        ));
    };
    only_fields(o, &["effort", "summary", "generate_summary"], "reasoning")?;
    let effort = match o.get("effort") {
        None | Some(Value::Null) => "medium",
        Some(e) => e.as_str().unwrap_or(""),
    };
    Ok(match effort {
        "medium" => ReasoningEffort::Think(None),
        "none" | "minimal" => ReasoningEffort::None,
        "low" => ReasoningEffort::Think(Some(Effort::Low)),
        "high" | "xhigh" => ReasoningEffort::Think(Some(Effort::High)),
        _ => {
            return Err(ApiError::invalid(
                "reasoning.effort",
                "effort must be none, minimal, low, medium, high or xhigh",
            ))
        }
    })
}

/// The last message if it is the assistant's (so that calls and reasoning join the turn they belong to),
/// else a new, empty assistant message.
fn assistant_turn(out: &mut Vec<ChatMessage>) -> &mut ChatMessage {
    if out.last().is_none_or(|m| m.role != Role::Assistant) {
        out.push(ChatMessage::new(Role::Assistant, ""));
    }
    out.last_mut().expect("pushed above")
}

/// `input[i]` appended to `out`: a message (roles user, system, developer, assistant; text parts), an
/// earlier `function_call` (joins the assistant turn before it), its `function_call_output` (a tool
/// message), or a `reasoning` item (the next assistant turn's thinking).
fn input_item(i: usize, item: &Value, out: &mut Vec<ChatMessage>) -> Result<(), ApiError> {
    let at = format!("input[{i}]");
    let Value::Object(o) = item else {
        return Err(ApiError::invalid(at, "each input item must be an object"));
    };
    let kind = o.get("type").and_then(Value::as_str).unwrap_or("message");
    let fields: &[&str] = match kind {
        "message" => &["type", "role", "content", "id", "status"],
        "function_call" => &["type", "call_id", "name", "arguments", "id", "status"],
        "function_call_output" => &["type", "call_id", "output", "id", "status"],
        "reasoning" => &["type", "summary", "content", "id", "encrypted_content", "status"],
        other => {
            return Err(ApiError::invalid(
                format!("{at}.type"),
                format!(
                    "input item type {other:?} is not supported; deltafin reads message, function_call, \
                     function_call_output and reasoning items"
                ),
            ))
        }
    };
    only_fields(o, fields, &at)?;
    match kind {
        "function_call" => {
            let call = ToolCall {
                id: string_field(o, "call_id", &at)?,
                name: string_field(o, "name", &at)?,
                arguments: string_field(o, "arguments", &at)?,
            };
            assistant_turn(out).tool_calls.push(call);
        }
        "function_call_output" => out.push(ChatMessage {
            tool_call_id: Some(string_field(o, "call_id", &at)?),
            ..ChatMessage::new(Role::Tool, string_field(o, "output", &at)?)
        }),
        "reasoning" => {
            let mut text = String::new();
            for key in ["summary", "content"] {
                let Some(Value::Array(parts)) = o.get(key) else {
                    continue;
                };
                for (j, p) in parts.iter().enumerate() {
                    match p.get("text").and_then(Value::as_str) {
                        Some(t) => text.push_str(t),
                        None => {
                            return Err(ApiError::invalid(
                                format!("{at}.{key}[{j}]"),
                                "reasoning parts are {\"type\": \"summary_text\" or \"reasoning_text\", \"text\": ...}",
                            ))
                        }
                    }
                }
            }
            let turn = ChatMessage {
                reasoning: Some(text),
                ..ChatMessage::new(Role::Assistant, "")
            };
            out.push(turn);
        }
        _ => {
            let role = match o.get("role").and_then(Value::as_str) {
                Some("user") => Role::User,
                Some("system" | "developer") => Role::System,
                Some("assistant") => Role::Assistant,
                _ => {
                    return Err(ApiError::invalid(
                        format!("{at}.role"),
                        "role must be user, system, developer or assistant",
                    ))
                }
            };
            let text = api::text_content(
                &format!("{at}.content"),
                o.get("content"),
                &["input_text", "output_text"],
            )?;
            // An assistant message after a reasoning item is that turn's answer.
            match out.last_mut() {
                Some(m)
                    if role == Role::Assistant
                        && m.role == Role::Assistant
                        && m.content.is_empty()
                        && m.tool_calls.is_empty() =>
                {
                    m.content = text
                }
                _ => out.push(ChatMessage::new(role, text)),
            }
        }
    }
    Ok(())
}

/// `tools`: function tools (`{"type": "function", "name", "description", "parameters", "strict"}`),
/// checked and listed to K3 as the chat endpoint's; `tool_choice` auto or none.
fn tools(list: Option<&Value>, choice: Option<&Value>, parallel: bool) -> Result<Tools, ApiError> {
    let offer = api::tool_choice_offers(choice)?;
    let mut functions = Vec::new();
    for (i, t) in api::tools_list(list)?.iter().enumerate() {
        let at = format!("tools[{i}]");
        let Some(o) = t.as_object() else {
            return Err(ApiError::invalid(at, "each tool must be an object"));
        };
        if o.get("type").and_then(Value::as_str) != Some("function") {
            return Err(ApiError::invalid(
                format!("{at}.type"),
                "only function tools are supported (no built-in tools)",
            )
            .code("unsupported_parameter"));
        }
        let mut function = o.clone();
        function.remove("type");
        functions.push((at, function));
    }
    api::offer_tools(functions, offer, parallel)
}

/// The usage object: input tokens (of which cached), output tokens (of which reasoning).
fn usage(u: &Usage) -> Value {
    json!({
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.cached_tokens},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    })
}

/// A response object: `status` in_progress (the stream's first events), completed, or incomplete (the
/// output-token limit) with its reason.
fn response(
    id: &str,
    created: u64,
    model: &str,
    output: Vec<Value>,
    finish: Option<&str>,
    usage: Option<&Usage>,
) -> Value {
    let (status, incomplete) = match finish {
        None => ("in_progress", Value::Null),
        Some("length") => ("incomplete", json!({"reason": "max_output_tokens"})),
        Some(_) => ("completed", Value::Null),
    };
    json!({
        "id": id, "object": "response", "created_at": created, "status": status, "model": model,
        "output": output, "incomplete_details": incomplete, "error": null,
        "usage": usage.map(self::usage),
    })
}

/// An output item's id: its kind's prefix and the response id's unique part.
fn item_id(prefix: &str, response_id: &str) -> String {
    format!("{prefix}_{}", response_id.trim_start_matches("resp_"))
}

fn reasoning_item(id: &str, text: &str) -> Value {
    json!({"type": "reasoning", "id": item_id("rs", id), "summary": [{"type": "summary_text", "text": text}]})
}

fn message_item(id: &str, text: &str, status: &str) -> Value {
    let content = if status == "in_progress" {
        json!([])
    } else {
        json!([{"type": "output_text", "text": text, "annotations": []}])
    };
    json!({"type": "message", "id": item_id("msg", id), "status": status, "role": "assistant", "content": content})
}

/// A call as a function_call item; a call without an id of the model's gets `call_<response>_<index>`.
fn call_item(id: &str, index: usize, call: &ToolCall, status: &str) -> Value {
    let call_id = if call.id.is_empty() {
        format!("{}_{index}", item_id("call", id))
    } else {
        call.id.clone()
    };
    let arguments = if status == "in_progress" {
        ""
    } else {
        call.arguments.as_str()
    };
    json!({"type": "function_call", "id": format!("{}_{index}", item_id("fc", id)), "call_id": call_id,
           "name": call.name, "arguments": arguments, "status": status})
}

/// The output items of a whole reply: reasoning, the message (also when the reply is empty and made no
/// call), then the calls.
fn output(id: &str, reasoning: &str, text: &str, calls: &[(usize, ToolCall)]) -> Vec<Value> {
    let mut out = Vec::new();
    if !reasoning.is_empty() {
        out.push(reasoning_item(id, reasoning));
    }
    if !text.is_empty() || calls.is_empty() {
        out.push(message_item(id, text, "completed"));
    }
    out.extend(calls.iter().map(|(i, c)| call_item(id, *i, c, "completed")));
    out
}

/// The Responses stream: `response.created` and `response.in_progress`, then each output item as it is
/// written (added, its part or summary added, text deltas, done), then `response.completed` (or
/// `response.incomplete`) with the whole response. Every event carries its `sequence_number`.
pub struct Items {
    id: String,
    created: u64,
    model: String,
    seq: u64,
    /// The open item: its output index and its text so far, and whether it is the reasoning.
    open: Option<(usize, String, bool)>,
    /// The finished items, in order.
    done: Vec<Value>,
}

impl Items {
    fn event(&mut self, kind: &str, mut data: Value) -> Event {
        data["type"] = json!(kind);
        data["sequence_number"] = json!(self.seq);
        self.seq += 1;
        Event::default().event(kind).data(data.to_string())
    }

    fn close(&mut self, out: &mut Vec<Event>) {
        let Some((index, text, thinking)) = self.open.take() else {
            return;
        };
        let k = TextKind::of(thinking);
        let item = if thinking {
            reasoning_item(&self.id, &text)
        } else {
            message_item(&self.id, &text, "completed")
        };
        let id = &item["id"];
        let data = json!({"item_id": id, "output_index": index, k.index_key: 0, "text": text});
        let e = self.event(k.text_done, data);
        out.push(e);
        let part = &item[k.parts][0];
        let data = json!({"item_id": id, "output_index": index, k.index_key: 0, "part": part});
        let e = self.event(k.part_done, data);
        out.push(e);
        self.item_done(index, item, out);
    }

    /// An output item is complete: its event, and it joins the response's output.
    fn item_done(&mut self, index: usize, item: Value, out: &mut Vec<Event>) {
        let e = self.event(
            "response.output_item.done",
            json!({"output_index": index, "item": item}),
        );
        out.push(e);
        self.done.push(item);
    }

    /// Reasoning or text: into the open item of that kind, or a new one.
    fn text(&mut self, thinking: bool, text: &str, out: &mut Vec<Event>) {
        if text.is_empty() {
            return;
        }
        let k = TextKind::of(thinking);
        let item_id = item_id(k.prefix, &self.id);
        if !matches!(&self.open, Some((_, _, t)) if *t == thinking) {
            self.close(out);
            let index = self.done.len();
            let item = if thinking {
                json!({"type": "reasoning", "id": item_id, "summary": []})
            } else {
                message_item(&self.id, "", "in_progress")
            };
            let e = self.event(
                "response.output_item.added",
                json!({"output_index": index, "item": item}),
            );
            out.push(e);
            let part = if thinking {
                json!({"type": "summary_text", "text": ""})
            } else {
                json!({"type": "output_text", "text": "", "annotations": []})
            };
            let data =
                json!({"item_id": item_id, "output_index": index, k.index_key: 0, "part": part});
            let e = self.event(k.part_added, data);
            out.push(e);
            self.open = Some((index, String::new(), thinking));
        }
        let (index, so_far, _) = self.open.as_mut().expect("opened above");
        so_far.push_str(text);
        let data =
            json!({"item_id": item_id, "output_index": *index, k.index_key: 0, "delta": text});
        let e = self.event(k.text_delta, data);
        out.push(e);
    }
}

/// How the stream names a reasoning item's summary text or a message's output text.
struct TextKind {
    prefix: &'static str,
    /// The item's list of parts, and their index field in events.
    parts: &'static str,
    index_key: &'static str,
    part_added: &'static str,
    part_done: &'static str,
    text_delta: &'static str,
    text_done: &'static str,
}

impl TextKind {
    fn of(thinking: bool) -> &'static TextKind {
        const REASONING: TextKind = TextKind {
            prefix: "rs",
            parts: "summary",
            index_key: "summary_index",
            part_added: "response.reasoning_summary_part.added",
            part_done: "response.reasoning_summary_part.done",
            text_delta: "response.reasoning_summary_text.delta",
            text_done: "response.reasoning_summary_text.done",
        };
        const MESSAGE: TextKind = TextKind {
            prefix: "msg",
            parts: "content",
            index_key: "content_index",
            part_added: "response.content_part.added",
            part_done: "response.content_part.done",
            text_delta: "response.output_text.delta",
            text_done: "response.output_text.done",
        };
        if thinking {
            &REASONING
        } else {
            &MESSAGE
        }
    }
}

/// One choice: Responses has no `n`.
impl Events for Items {
    fn delta(&mut self, _: usize, d: &Delta, out: &mut Vec<Event>) {
        self.text(true, &d.reasoning, out);
        self.text(false, &d.content, out);
    }

    fn tool_call(&mut self, _: usize, index: usize, call: &ToolCall, out: &mut Vec<Event>) {
        self.close(out);
        let at = self.done.len();
        let added = call_item(&self.id, index, call, "in_progress");
        let item = call_item(&self.id, index, call, "completed");
        let e = self.event(
            "response.output_item.added",
            json!({"output_index": at, "item": added}),
        );
        out.push(e);
        let e = self.event(
            "response.function_call_arguments.delta",
            json!({"item_id": item["id"], "output_index": at, "delta": call.arguments}),
        );
        out.push(e);
        let e = self.event(
            "response.function_call_arguments.done",
            json!({"item_id": item["id"], "output_index": at, "arguments": call.arguments}),
        );
        out.push(e);
        self.item_done(at, item, out);
    }

    /// Responses have no stop sequences.
    fn done(&mut self, _: usize, f: &Finish, _: bool, out: &mut Vec<Event>) {
        self.close(out);
        if self.done.is_empty() {
            // An empty reply is one empty message, as in the whole response.
            let item = message_item(&self.id, "", "completed");
            let e = self.event(
                "response.output_item.added",
                json!({"output_index": 0, "item": item}),
            );
            out.push(e);
            self.item_done(0, item, out);
        }
        let output = std::mem::take(&mut self.done);
        let r = response(
            &self.id,
            self.created,
            &self.model,
            output,
            Some(f.reason),
            Some(&f.usage),
        );
        let kind = if r["status"] == "incomplete" {
            "response.incomplete"
        } else {
            "response.completed"
        };
        let e = self.event(kind, json!({"response": r}));
        out.push(e);
    }

    fn error(&mut self, message: &str) -> Event {
        self.event(
            "error",
            json!({"code": "server_error", "message": message, "param": null}),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parsed(extra: Value) -> Result<ChatRequest, ApiError> {
        let mut body = json!({"model": "m", "input": "Hi"});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        parse(body.to_string().as_bytes())
    }

    #[test]
    fn reasoning_effort_picks_k3s() {
        let effort = |r: Value| {
            parsed(json!({"reasoning": r}))
                .map(|r| r.effort)
                .map_err(|e| e.param)
        };
        assert_eq!(effort(Value::Null), Ok(ReasoningEffort::Think(None)));
        assert_eq!(
            effort(json!({"summary": "auto"})),
            Ok(ReasoningEffort::Think(None))
        );
        assert_eq!(
            effort(json!({"effort": "minimal"})),
            Ok(ReasoningEffort::None)
        );
        assert_eq!(
            effort(json!({"effort": "low"})),
            Ok(ReasoningEffort::Think(Some(Effort::Low)))
        );
        assert_eq!(
            effort(json!({"effort": "xhigh"})),
            Ok(ReasoningEffort::Think(Some(Effort::High)))
        );
        assert_eq!(
            effort(json!({"effort": 3})),
            Err(Some("reasoning.effort".into()))
        );
    }

    #[test]
    fn input_items_become_k3_turns() {
        let r = parsed(json!({"instructions": "Be brief.", "input": [
            {"role": "user", "content": "Weather?"},
            {"type": "reasoning", "id": "rs", "summary": [{"type": "summary_text", "text": "Use the tool."}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
            {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": "{}"},
            {"type": "function_call", "call_id": "c2", "name": "time", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            {"type": "function_call_output", "call_id": "c2", "output": "noon"},
        ]}))
        .unwrap_or_else(|e| panic!("{}", e.message));
        let m = &r.messages;
        let summary: Vec<(Role, &str, usize)> = m
            .iter()
            .map(|m| (m.role, m.content.as_str(), m.tool_calls.len()))
            .collect();
        assert_eq!(
            summary,
            [
                (Role::System, "Be brief.", 0),
                (Role::User, "Weather?", 0),
                (Role::Assistant, "Checking.", 2),
                (Role::Tool, "sunny", 0),
                (Role::Tool, "noon", 0),
            ]
        );
        assert_eq!(m[2].reasoning.as_deref(), Some("Use the tool."));
        assert_eq!(m[4].tool_call_id.as_deref(), Some("c2"));
    }
}
