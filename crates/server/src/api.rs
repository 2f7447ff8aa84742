//! Request bodies, read field by field so that every error names its field: unknown fields and fields
//! deltafin does not support are rejected (never silently ignored), except `user` and `metadata`.

use crate::chat::ReasoningEffort;
use crate::error::ApiError;
use deltafin_engine::SamplingParams;
use deltafin_tokenizer::chat::{ChatMessage, Role, ToolCall};
use serde::de::DeserializeOwned;
use serde_json::{json, Map, Value};

/// Recognised OpenAI fields that deltafin does not implement (accepted only when null), unless an endpoint
/// lists them as its own (chat takes the tool fields).
const UNSUPPORTED: &[&str] = &[
    "tools",
    "tool_choice",
    "functions",
    "function_call",
    "parallel_tool_calls",
    "response_format",
    "audio",
    "modalities",
    "prediction",
    "service_tier",
    "store",
    "web_search_options",
    "suffix",
];

/// Accepted and ignored.
const IGNORED: &[&str] = &["user", "metadata"];

const COMMON: &[&str] = &[
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "n",
    "logprobs",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "stream",
    "stream_options",
];
const CHAT_ONLY: &[&str] = &[
    "messages",
    "max_completion_tokens",
    "top_logprobs",
    "reasoning_effort",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
];
const COMPLETION_ONLY: &[&str] = &["prompt", "echo", "best_of"];

pub struct Fields {
    map: Map<String, Value>,
}

impl Fields {
    /// Parses an OpenAI request: rejects any field outside `known`, the common and the ignored ones, and
    /// OpenAI's fields deltafin does not implement unless null.
    pub fn parse(body: &[u8], known: &[&str]) -> Result<Fields, ApiError> {
        Fields::parse_against(body, &[known, COMMON, IGNORED].concat(), UNSUPPORTED)
    }

    /// Parses a JSON object: rejects any field outside `known` and `unsupported`, and those of
    /// `unsupported` unless null.
    pub fn parse_against(
        body: &[u8],
        known: &[&str],
        unsupported: &[&str],
    ) -> Result<Fields, ApiError> {
        let value: Value = serde_json::from_slice(body).map_err(|e| {
            ApiError::invalid("body", format!("the request body is not valid JSON: {e}"))
        })?;
        let Value::Object(map) = value else {
            return Err(ApiError::invalid(
                "body",
                "the request body must be a JSON object",
            ));
        };
        for (key, v) in &map {
            if known.contains(&key.as_str()) {
                continue;
            }
            if unsupported.contains(&key.as_str()) {
                if !v.is_null() {
                    return Err(ApiError::invalid(
                        key.clone(),
                        format!("'{key}' is not supported by deltafin"),
                    )
                    .code("unsupported_parameter"));
                }
            } else {
                return Err(ApiError::invalid(
                    key.clone(),
                    format!("Unrecognized request argument supplied: {key}"),
                )
                .code("unknown_parameter"));
            }
        }
        Ok(Fields { map })
    }

    /// The field's value; null and absent are `None`.
    pub fn get<T: DeserializeOwned>(&self, name: &str) -> Result<Option<T>, ApiError> {
        match self.map.get(name) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => T::deserialize(v)
                .map(Some)
                .map_err(|e| ApiError::invalid(name, format!("Invalid value for '{name}': {e}"))),
        }
    }

    /// A non-empty list field.
    pub fn list(&self, name: &str) -> Result<&[Value], ApiError> {
        match self.raw(name) {
            Some(Value::Array(items)) if !items.is_empty() => Ok(items),
            _ => Err(ApiError::invalid(
                name,
                format!("'{name}' must be a non-empty list"),
            )),
        }
    }

    pub fn raw(&self, name: &str) -> Option<&Value> {
        self.map.get(name).filter(|v| !v.is_null())
    }
}

/// What both endpoints ask of a generation.
pub struct Common {
    pub model: String,
    pub max_tokens: Option<usize>,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
    /// Choices to generate (OpenAI's `n`): choice i samples with seed + i.
    pub n: usize,
}

/// The most choices one request may ask for.
pub const MAX_CHOICES: u64 = 16;

pub fn common(f: &Fields, max_tokens_field: Option<&str>) -> Result<Common, ApiError> {
    let model: String = f
        .get("model")?
        .ok_or_else(|| ApiError::invalid("model", "'model' is required"))?;
    let mut max_tokens: Option<(u64, &str)> = f.get("max_tokens")?.map(|v| (v, "max_tokens"));
    if let Some(alt) = max_tokens_field {
        if let Some(v) = f.get::<u64>(alt)? {
            max_tokens = Some((v, alt));
        }
    }
    if let Some((0, field)) = max_tokens {
        return Err(ApiError::invalid(
            field,
            format!("{field} must be at least 1"),
        ));
    }
    let n: u64 = f.get("n")?.unwrap_or(1);
    if !(1..=MAX_CHOICES).contains(&n) {
        return Err(ApiError::invalid(
            "n",
            format!("'n' (choices to generate) must be between 1 and {MAX_CHOICES}, got {n}"),
        ));
    }
    let (temperature, top_p) = temperature_top_p(f, 2.0)?;
    let penalty = |name: &str| -> Result<f32, ApiError> {
        let v: f32 = f.get(name)?.unwrap_or(0.0);
        if !(-2.0..=2.0).contains(&v) {
            return Err(ApiError::invalid(
                name,
                format!("{name} must be in [-2, 2], got {v}"),
            ));
        }
        Ok(v)
    };
    let presence_penalty = penalty("presence_penalty")?;
    let frequency_penalty = penalty("frequency_penalty")?;
    let logit_bias = logit_bias(f)?;
    let seed = match f.raw("seed") {
        None => random_seed(),
        Some(Value::Number(n)) if n.is_u64() || n.is_i64() => {
            n.as_u64().unwrap_or_else(|| n.as_i64().unwrap_or(0) as u64)
        }
        Some(_) => return Err(ApiError::invalid("seed", "seed must be an integer")),
    };
    let stop = match f.raw("stop") {
        None => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) => {
            let mut out = Vec::new();
            for v in items {
                match v {
                    Value::String(s) => out.push(s.clone()),
                    _ => {
                        return Err(ApiError::invalid(
                            "stop",
                            "stop must be a string or a list of strings",
                        ))
                    }
                }
            }
            out
        }
        Some(_) => {
            return Err(ApiError::invalid(
                "stop",
                "stop must be a string or a list of strings",
            ))
        }
    };
    if stop.len() > 4 {
        return Err(ApiError::invalid(
            "stop",
            format!("at most 4 stop sequences, got {}", stop.len()),
        ));
    }
    let stream: bool = f.get("stream")?.unwrap_or(false);
    let mut include_usage = false;
    if let Some(opts) = f.raw("stream_options") {
        let Value::Object(o) = opts else {
            return Err(ApiError::invalid(
                "stream_options",
                "stream_options must be an object",
            ));
        };
        for (k, v) in o {
            match (k.as_str(), v) {
                ("include_usage", Value::Bool(b)) => include_usage = *b,
                ("include_usage", Value::Null) => {}
                ("include_usage", _) => {
                    return Err(ApiError::invalid(
                        "stream_options.include_usage",
                        "include_usage must be a boolean",
                    ))
                }
                _ => {
                    return Err(ApiError::invalid(
                        format!("stream_options.{k}"),
                        format!("Unrecognized stream option: {k}"),
                    ))
                }
            }
        }
        if !stream {
            return Err(ApiError::invalid(
                "stream_options",
                "stream_options is only allowed when stream is true",
            ));
        }
    }
    Ok(Common {
        model,
        max_tokens: max_tokens.map(|(v, _)| v.min(usize::MAX as u64) as usize),
        sampling: SamplingParams {
            temperature,
            top_p,
            seed,
            presence_penalty,
            frequency_penalty,
            logit_bias,
        },
        stop,
        stream,
        n: n as usize,
        include_usage,
    })
}

/// `temperature` (in [0, `max`], default 1) and `top_p` (in (0, 1], default 1).
pub fn temperature_top_p(f: &Fields, max: f32) -> Result<(f32, f32), ApiError> {
    let temperature: f32 = f.get("temperature")?.unwrap_or(1.0);
    if !(0.0..=max).contains(&temperature) {
        return Err(ApiError::invalid(
            "temperature",
            format!("temperature must be in [0, {max}], got {temperature}"),
        ));
    }
    let top_p: f32 = f.get("top_p")?.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(ApiError::invalid(
            "top_p",
            format!("top_p must be in (0, 1], got {top_p}"),
        ));
    }
    Ok((temperature, top_p))
}

/// `logit_bias`: `{"token id": bias}`, each bias in [-100, 100] (ids are checked against the vocabulary
/// when the request is planned).
fn logit_bias(f: &Fields) -> Result<Vec<(u32, f32)>, ApiError> {
    let Some(raw) = f.raw("logit_bias") else {
        return Ok(Vec::new());
    };
    let Value::Object(o) = raw else {
        return Err(ApiError::invalid(
            "logit_bias",
            "logit_bias must be an object of token id to bias",
        ));
    };
    let mut out = Vec::with_capacity(o.len());
    for (k, v) in o {
        let Ok(id) = k.parse::<u32>() else {
            return Err(ApiError::invalid(
                "logit_bias",
                format!("logit_bias keys are token ids; {k:?} is not one"),
            ));
        };
        match v.as_f64() {
            Some(b) if (-100.0..=100.0).contains(&b) => out.push((id, b as f32)),
            _ => {
                return Err(ApiError::invalid(
                    "logit_bias",
                    format!("the bias of token {id} must be a number in [-100, 100], got {v}"),
                ))
            }
        }
    }
    out.sort_unstable_by_key(|&(id, _)| id);
    if let Some(w) = out.windows(2).find(|w| w[0].0 == w[1].0) {
        return Err(ApiError::invalid(
            "logit_bias",
            format!("token {} is given twice", w[0].0),
        ));
    }
    Ok(out)
}

/// Without a seed, each request draws its own (sampling is still reproducible given the seed).
pub fn random_seed() -> u64 {
    use std::collections::hash_map::RandomState;
    use std::hash::BuildHasher;
    RandomState::new().hash_one(std::time::SystemTime::now())
}

pub struct ChatRequest {
    pub common: Common,
    pub messages: Vec<ChatMessage>,
    pub top_logprobs: Option<usize>,
    pub effort: ReasoningEffort,
    pub tools: Tools,
    /// The reply's start, which the model continues and the reply leaves out (Anthropic's prefill).
    pub prefill: Option<String>,
}

/// The tools a chat request offers the model.
#[derive(Clone, Debug)]
pub struct Tools {
    /// Their JSON list, as the prompt shows it; `None` without tools or with `tool_choice: "none"` (then
    /// the model is not told of them, and a call it writes anyway is not passed on).
    pub listed: Option<String>,
    /// `parallel_tool_calls` (default true): false ends the reply after its first call.
    pub parallel: bool,
}

pub fn chat(body: &[u8]) -> Result<ChatRequest, ApiError> {
    let f = Fields::parse(body, CHAT_ONLY)?;
    let common = common(&f, Some("max_completion_tokens"))?;
    let messages = f
        .list("messages")?
        .iter()
        .enumerate()
        .map(|(i, m)| message(i, m))
        .collect::<Result<Vec<_>, _>>()?;
    let logprobs: bool = f.get("logprobs")?.unwrap_or(false);
    let top: Option<u64> = f.get("top_logprobs")?;
    if let Some(t) = top {
        if t > 20 {
            return Err(ApiError::invalid(
                "top_logprobs",
                "top_logprobs must be in [0, 20]",
            ));
        }
        if !logprobs {
            return Err(ApiError::invalid(
                "top_logprobs",
                "top_logprobs requires logprobs to be true",
            ));
        }
    }
    let effort = match f.get::<String>("reasoning_effort")? {
        None => ReasoningEffort::Think(None),
        Some(s) => ReasoningEffort::parse(&s).ok_or_else(|| {
            ApiError::invalid(
                "reasoning_effort",
                format!("reasoning_effort must be one of none, low, medium, high; got {s:?}"),
            )
        })?,
    };
    Ok(ChatRequest {
        common,
        messages,
        top_logprobs: logprobs.then_some(top.unwrap_or(0) as usize),
        effort,
        tools: tools(&f)?,
        prefill: None,
    })
}

/// `tools` (function tools, checked field by field), `tool_choice` and `parallel_tool_calls`.
fn tools(f: &Fields) -> Result<Tools, ApiError> {
    let parallel = f.get::<bool>("parallel_tool_calls")?.unwrap_or(true);
    let offer = tool_choice_offers(f.raw("tool_choice"))?;
    let mut functions = Vec::new();
    for (i, t) in tools_list(f.raw("tools"))?.iter().enumerate() {
        let at = format!("tools[{i}]");
        let (_, func) = function_entry(
            &at,
            t,
            &[],
            &["name", "description", "parameters", "strict"],
        )?;
        functions.push((format!("{at}.function"), func.clone()));
    }
    offer_tools(functions, offer, parallel)
}

/// `tools`, a list (absent: none).
pub fn tools_list(v: Option<&Value>) -> Result<&[Value], ApiError> {
    match v {
        None => Ok(&[]),
        Some(Value::Array(list)) => Ok(list),
        Some(_) => Err(ApiError::invalid("tools", "'tools' must be a list")),
    }
}

/// OpenAI's `tool_choice`: "auto" (the default) or "none" (the tools are not offered); whether to offer them.
pub fn tool_choice_offers(v: Option<&Value>) -> Result<bool, ApiError> {
    match v {
        None => Ok(true),
        Some(Value::String(c)) if c == "auto" || c == "none" => Ok(c == "auto"),
        Some(_) => Err(ApiError::invalid(
            "tool_choice",
            "tool_choice must be \"auto\" or \"none\": deltafin never constrains sampling, so it cannot \
             force a call (\"required\" or a named function)",
        )
        .code("unsupported_parameter")),
    }
}

/// The tools a request offers: each function (its fields at `at`) checked by [`function`], the names unique,
/// listed to the model in the chat endpoint's form unless `offer` is false.
pub fn offer_tools(
    functions: Vec<(String, Object)>,
    offer: bool,
    parallel: bool,
) -> Result<Tools, ApiError> {
    let mut names = Vec::new();
    let mut listed = Vec::with_capacity(functions.len());
    for (at, func) in functions {
        let name = function(&at, &func)?;
        if names.contains(&name) {
            return Err(ApiError::invalid(
                format!("{at}.name"),
                format!("two tools are named {name:?}"),
            ));
        }
        names.push(name);
        listed.push(json!({"type": "function", "function": func}));
    }
    Ok(Tools {
        listed: (offer && !listed.is_empty()).then(|| Value::Array(listed).to_string()),
        parallel,
    })
}

/// Checks a function's fields (at `at`): name, description, parameters, strict; returns its name.
fn function(at: &str, func: &Object) -> Result<String, ApiError> {
    if let Some(k) = func
        .keys()
        .find(|k| !["name", "description", "parameters", "strict"].contains(&k.as_str()))
    {
        return Err(
            ApiError::invalid(format!("{at}.{k}"), format!("Unrecognized field: {k}"))
                .code("unknown_parameter"),
        );
    }
    let at = |k: &str| format!("{at}.{k}");
    let name = match func.get("name") {
        Some(Value::String(n))
            if (1..=64).contains(&n.len())
                && n.chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-') =>
        {
            n.clone()
        }
        _ => {
            return Err(ApiError::invalid(
                at("name"),
                "a function's name must be 1 to 64 letters, digits, '_' or '-'",
            ))
        }
    };
    if !matches!(func.get("description"), None | Some(Value::String(_))) {
        return Err(ApiError::invalid(at("description"), "must be a string"));
    }
    if !matches!(func.get("parameters"), None | Some(Value::Object(_))) {
        return Err(ApiError::invalid(
            at("parameters"),
            "must be a JSON Schema object",
        ));
    }
    match func.get("strict") {
        None | Some(Value::Null) | Some(Value::Bool(false)) => {}
        Some(_) => {
            return Err(ApiError::invalid(
                at("strict"),
                "strict schemas are not supported: deltafin never constrains sampling",
            )
            .code("unsupported_parameter"))
        }
    }
    Ok(name)
}

pub type Object = Map<String, Value>;

/// `{"type": "function", "function": {...}}` at `at` (a tool, or an earlier call in a message), with
/// `extra` the keys allowed beside those two and `inner` the function's: the entry and its function.
fn function_entry<'a>(
    at: &str,
    v: &'a Value,
    extra: &[&str],
    inner: &[&str],
) -> Result<(&'a Object, &'a Object), ApiError> {
    let Value::Object(o) = v else {
        return Err(ApiError::invalid(at, "must be an object"));
    };
    only_fields(o, &[&["type", "function"], extra].concat(), at)?;
    if o.get("type").and_then(Value::as_str) != Some("function") {
        return Err(ApiError::invalid(
            format!("{at}.type"),
            "the only type is \"function\"",
        ));
    }
    let Some(Value::Object(func)) = o.get("function") else {
        return Err(ApiError::invalid(
            format!("{at}.function"),
            "a 'function' object is required",
        ));
    };
    only_fields(func, inner, &format!("{at}.function"))?;
    Ok((o, func))
}

/// Rejects keys of `o` outside `known`, naming the first under `at`.
pub fn only_fields(o: &Object, known: &[&str], at: &str) -> Result<(), ApiError> {
    match o.keys().find(|k| !known.contains(&k.as_str())) {
        Some(k) => Err(
            ApiError::invalid(format!("{at}.{k}"), format!("Unrecognized field: {k}"))
                .code("unknown_parameter"),
        ),
        None => Ok(()),
    }
}

/// `o[k]`, a string (the field named `at.k` otherwise).
pub fn string_field(o: &Object, k: &str, at: &str) -> Result<String, ApiError> {
    match o.get(k) {
        Some(Value::String(s)) => Ok(s.clone()),
        _ => Err(ApiError::invalid(
            format!("{at}.{k}"),
            format!("'{k}' must be a string"),
        )),
    }
}

fn message(i: usize, m: &Value) -> Result<ChatMessage, ApiError> {
    let at = |k: &str| format!("messages[{i}].{k}");
    let Value::Object(o) = m else {
        return Err(ApiError::invalid(
            format!("messages[{i}]"),
            "each message must be an object",
        ));
    };
    for (k, v) in o {
        match k.as_str() {
            "role" | "content" | "name" | "reasoning_content" | "tool_calls" | "tool_call_id" => {}
            "function_call" | "audio" | "refusal" if v.is_null() => {}
            "function_call" | "audio" => {
                return Err(
                    ApiError::invalid(at(k), format!("'{k}' is not supported by deltafin"))
                        .code("unsupported_parameter"),
                )
            }
            _ => {
                return Err(
                    ApiError::invalid(at(k), format!("Unrecognized message field: {k}"))
                        .code("unknown_parameter"),
                )
            }
        }
    }
    let role = match o.get("role").and_then(Value::as_str) {
        Some("system" | "developer") => Role::System,
        Some("user") => Role::User,
        Some("assistant") => Role::Assistant,
        Some("tool") => Role::Tool,
        Some(other) => {
            let roles = "system, developer, user, assistant or tool";
            let what = format!("role {other:?} is not supported; use {roles}");
            return Err(ApiError::invalid(at("role"), what));
        }
        None => {
            return Err(ApiError::invalid(
                at("role"),
                "each message needs a string 'role'",
            ))
        }
    };
    let content = match o.get("content") {
        None | Some(Value::Null) if role == Role::Assistant => String::new(),
        c => text_content(&at("content"), c, &["text"])?,
    };
    let string = |k: &str| -> Result<Option<String>, ApiError> {
        match o.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(_) => Err(ApiError::invalid(at(k), format!("'{k}' must be a string"))),
        }
    };
    let tool_call_id = string("tool_call_id")?;
    if (role == Role::Tool) != tool_call_id.is_some() {
        return Err(ApiError::invalid(
            at("tool_call_id"),
            "a tool message needs the 'tool_call_id' it answers, and only tool messages have one",
        ));
    }
    let tool_calls = match o.get("tool_calls") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(calls)) if role == Role::Assistant => calls
            .iter()
            .enumerate()
            .map(|(j, c)| tool_call(&format!("messages[{i}].tool_calls[{j}]"), c))
            .collect::<Result<_, _>>()?,
        Some(_) => {
            return Err(ApiError::invalid(
                at("tool_calls"),
                "'tool_calls' must be a list, on an assistant message",
            ))
        }
    };
    Ok(ChatMessage {
        name: string("name")?,
        reasoning: string("reasoning_content")?,
        tool_calls,
        tool_call_id,
        ..ChatMessage::new(role, content)
    })
}

/// Message content at `at`: a string, or a list of text parts whose `type` is one of `kinds`, joined.
pub fn text_content(at: &str, content: Option<&Value>, kinds: &[&str]) -> Result<String, ApiError> {
    match content {
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for (j, p) in parts.iter().enumerate() {
                let kind = p.get("type").and_then(Value::as_str).unwrap_or("");
                match p.get("text").and_then(Value::as_str) {
                    Some(t) if kinds.contains(&kind) => text.push_str(t),
                    _ => {
                        return Err(ApiError::invalid(
                            format!("{at}[{j}]"),
                            format!(
                                "only text parts ({{\"type\": {}, \"text\": ...}}) are supported",
                                kinds
                                    .iter()
                                    .map(|k| format!("\"{k}\""))
                                    .collect::<Vec<_>>()
                                    .join(" or ")
                            ),
                        ))
                    }
                }
            }
            Ok(text)
        }
        _ => Err(ApiError::invalid(
            at,
            "content must be a string or a list of text parts",
        )),
    }
}

/// An assistant message's earlier call: `{"id", "type": "function", "function": {"name", "arguments"}}`.
fn tool_call(at: &str, c: &Value) -> Result<ToolCall, ApiError> {
    let field = |k: &str| format!("{at}.{k}");
    let (o, func) = function_entry(at, c, &["id"], &["name", "arguments"])?;
    let text = |v: Option<&Value>, k: &str| match v {
        Some(Value::String(s)) => Ok(s.clone()),
        _ => Err(ApiError::invalid(k, "must be a string")),
    };
    Ok(ToolCall {
        id: text(o.get("id"), &field("id"))?,
        name: text(func.get("name"), &field("function.name"))?,
        arguments: text(func.get("arguments"), &field("function.arguments"))?,
    })
}

pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
}

pub struct CompletionRequest {
    pub common: Common,
    pub prompt: Prompt,
    pub logprobs: Option<usize>,
}

pub fn completion(body: &[u8]) -> Result<CompletionRequest, ApiError> {
    let f = Fields::parse(body, COMPLETION_ONLY)?;
    let common = common(&f, None)?;
    let bad = || {
        ApiError::invalid(
            "prompt",
            "prompt must be a string, a list of token ids, or a list holding one of those (one prompt per request)",
        )
    };
    let prompt = match f.raw("prompt") {
        None => return Err(ApiError::invalid("prompt", "'prompt' is required")),
        Some(Value::String(s)) => Prompt::Text(s.clone()),
        Some(Value::Array(items)) => match items.as_slice() {
            [Value::String(s)] => Prompt::Text(s.clone()),
            [Value::Array(ids)] => Prompt::Tokens(token_ids(ids).ok_or_else(bad)?),
            ids if !ids.is_empty() && ids.iter().all(Value::is_u64) => {
                Prompt::Tokens(token_ids(ids).ok_or_else(bad)?)
            }
            _ => return Err(bad()),
        },
        Some(_) => return Err(bad()),
    };
    let logprobs: Option<u64> = f.get("logprobs")?;
    if logprobs.is_some_and(|n| n > 5) {
        return Err(ApiError::invalid("logprobs", "logprobs must be in [0, 5]"));
    }
    if f.get::<bool>("echo")?.unwrap_or(false) {
        return Err(
            ApiError::invalid("echo", "'echo' is not supported by deltafin")
                .code("unsupported_parameter"),
        );
    }
    if f.get::<u64>("best_of")?.is_some_and(|b| b != 1) {
        return Err(ApiError::invalid("best_of", "best_of must be 1"));
    }
    Ok(CompletionRequest {
        common,
        prompt,
        logprobs: logprobs.map(|n| n as usize),
    })
}

fn token_ids(v: &[Value]) -> Option<Vec<u32>> {
    v.iter()
        .map(|x| x.as_u64().and_then(|n| u32::try_from(n).ok()))
        .collect()
}
