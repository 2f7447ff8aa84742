//! What OpenAI's chat completions and completions answer alike: the reply object around the choices, its
//! usage, and the stream of chunks (each naming its choice; a usage chunk when asked; `data: [DONE]`).

use super::{Format, Reply};
use crate::error::ApiError;
use crate::sink::{Finish, Usage};
use axum::response::sse::Event;
use serde_json::{json, Value};

/// The whole answer: `object` with the choices, and the usage of all of them.
pub fn reply(f: &Format, object: &str, choices: Vec<Value>, replies: &[Reply]) -> Value {
    json!({
        "id": f.id,
        "object": object,
        "created": f.created,
        "model": f.model,
        "choices": choices,
        "usage": usage_json(&total_usage(replies.iter().map(|r| r.finish.usage))),
    })
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

fn usage_json(u: &Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
    })
}

/// A stream of chunks of `object`, whose choices hold their new text under `text_key`.
pub struct Chunks {
    pub format: Format,
    object: &'static str,
    text_key: &'static str,
    /// The usage of each finished choice.
    usage: Vec<Usage>,
}

impl Chunks {
    pub fn new(format: Format, object: &'static str, text_key: &'static str) -> Chunks {
        Chunks {
            format,
            object,
            text_key,
            usage: Vec::new(),
        }
    }

    pub fn chunk(
        &self,
        choice: usize,
        text: Value,
        finish: Option<&str>,
        lp: Option<Value>,
    ) -> Event {
        let f = &self.format;
        let mut body = json!({
            "id": f.id, "object": self.object, "created": f.created, "model": f.model,
            "choices": [{"index": choice, self.text_key: text, "logprobs": lp, "finish_reason": finish}],
        });
        if f.include_usage {
            body["usage"] = Value::Null;
        }
        Event::default().data(body.to_string())
    }

    /// A choice's last chunk (`empty` text and its finish reason); after the last choice's, the usage chunk
    /// when asked for, and `[DONE]`.
    pub fn done(
        &mut self,
        choice: usize,
        empty: Value,
        f: &Finish,
        last: bool,
        out: &mut Vec<Event>,
    ) {
        out.push(self.chunk(choice, empty, Some(f.reason), None));
        self.usage.push(f.usage);
        if !last {
            return;
        }
        if self.format.include_usage {
            let f = &self.format;
            let usage = usage_json(&total_usage(self.usage.iter().copied()));
            let body = json!({
                "id": f.id, "object": self.object, "created": f.created, "model": f.model,
                "choices": [], "usage": usage,
            });
            out.push(Event::default().data(body.to_string()));
        }
        out.push(Event::default().data("[DONE]"));
    }

    /// An error after the 200 status went out: OpenAI's error object as the last event.
    pub fn error(message: &str) -> Event {
        Event::default().data(ApiError::generation(message).body().to_string())
    }
}
