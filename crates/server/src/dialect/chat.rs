//! OpenAI's chat completions (`POST /v1/chat/completions`): a `chat.completion` with one message a choice
//! (reasoning as `reasoning_content`, calls as `tool_calls`), or `chat.completion.chunk`s.

use super::openai::{self, Chunks};
use super::{Dialect, Events, Format, Reply};
use crate::api::{self, ChatRequest};
use crate::error::ApiError;
use crate::prompt::{self, Prepared};
use crate::sink::{Delta, Finish, LogprobItem};
use crate::AppState;
use axum::response::sse::Event;
use deltafin_tokenizer::chat::ToolCall;
use serde_json::{json, Value};

pub struct Chat;

impl Dialect for Chat {
    type Request = ChatRequest;
    type Events = ChatEvents;

    fn parse(body: &[u8]) -> Result<ChatRequest, ApiError> {
        api::chat(body)
    }

    fn prepare(s: &AppState, req: ChatRequest) -> Result<Prepared, ApiError> {
        prompt::chat(s, req, "reasoning_effort")
    }

    fn id(created: u64, n: u64) -> String {
        format!("chatcmpl-{created:x}-{n}")
    }

    fn reply(f: &Format, replies: &[Reply]) -> Value {
        let choices = replies.iter().enumerate().map(|(index, r)| {
            let mut message = json!({"role": "assistant", "content": r.content, "refusal": null});
            if !r.reasoning.is_empty() {
                message["reasoning_content"] = json!(r.reasoning);
            }
            if !r.calls.is_empty() {
                // OpenAI's shape: no text beside the calls is null content.
                if r.content.is_empty() {
                    message["content"] = Value::Null;
                }
                message["tool_calls"] = r.calls.iter().map(|(i, c)| tool_call(*i, c)).collect();
            }
            let lp = f.logprobs.then(|| logprobs(&r.logprobs));
            json!({"index": index, "message": message, "logprobs": lp, "finish_reason": r.finish.reason})
        });
        openai::reply(f, "chat.completion", choices.collect(), replies)
    }

    /// Each choice's role comes first, before the prompt is computed (OpenAI's first chunks).
    fn start(f: Format, choices: usize) -> (ChatEvents, Vec<Event>) {
        let chunks = Chunks::new(f, "chat.completion.chunk", "delta");
        let role = json!({"role": "assistant", "content": ""});
        let first = (0..choices)
            .map(|c| chunks.chunk(c, role.clone(), None, None))
            .collect();
        (ChatEvents(chunks), first)
    }
}

/// The `index`-th tool call of a reply as OpenAI gives it; the id is the model's, or `call_INDEX` when it
/// wrote none.
fn tool_call(index: usize, call: &ToolCall) -> Value {
    let id = if call.id.is_empty() {
        format!("call_{index}")
    } else {
        call.id.clone()
    };
    json!({"id": id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}})
}

/// `{"content": [{token, logprob, bytes, top_logprobs}]}`.
fn logprobs(items: &[LogprobItem]) -> Value {
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
}

pub struct ChatEvents(Chunks);

impl Events for ChatEvents {
    fn delta(&mut self, choice: usize, d: &Delta, out: &mut Vec<Event>) {
        let mut delta = json!({});
        if !d.reasoning.is_empty() {
            delta["reasoning_content"] = json!(d.reasoning);
        }
        if !d.content.is_empty() || !d.logprobs.is_empty() {
            delta["content"] = json!(d.content);
        }
        let lp = self.0.format.logprobs.then(|| logprobs(&d.logprobs));
        out.push(self.0.chunk(choice, delta, None, lp));
    }

    /// A call comes whole, in one chunk; streams number it.
    fn tool_call(&mut self, choice: usize, index: usize, call: &ToolCall, out: &mut Vec<Event>) {
        let mut c = tool_call(index, call);
        c["index"] = json!(index);
        out.push(self.0.chunk(choice, json!({"tool_calls": [c]}), None, None));
    }

    fn done(&mut self, choice: usize, f: &Finish, last: bool, out: &mut Vec<Event>) {
        self.0.done(choice, json!({}), f, last, out);
    }

    fn error(&mut self, message: &str) -> Event {
        Chunks::error(message)
    }
}
