//! OpenAI's completions (`POST /v1/completions`): a `text_completion` with one text a choice, whole or in
//! chunks, and the legacy log-probability lists.

use super::openai::{self, Chunks};
use super::{Dialect, Events, Format, Reply};
use crate::api::{self, CompletionRequest};
use crate::error::ApiError;
use crate::prompt::{self, Prepared};
use crate::sink::{Delta, Finish, LogprobItem};
use crate::AppState;
use axum::response::sse::Event;
use deltafin_tokenizer::chat::ToolCall;
use serde_json::{json, Value};

pub struct Completions;

impl Dialect for Completions {
    type Request = CompletionRequest;
    type Events = CompletionEvents;

    fn parse(body: &[u8]) -> Result<CompletionRequest, ApiError> {
        api::completion(body)
    }

    fn prepare(s: &AppState, req: CompletionRequest) -> Result<Prepared, ApiError> {
        prompt::completion(s, req)
    }

    fn id(created: u64, n: u64) -> String {
        format!("cmpl-{created:x}-{n}")
    }

    fn reply(f: &Format, replies: &[Reply]) -> Value {
        let choices = replies.iter().enumerate().map(|(index, r)| {
            let lp = f.logprobs.then(|| logprobs(&r.logprobs));
            json!({"index": index, "text": r.content, "logprobs": lp, "finish_reason": r.finish.reason})
        });
        openai::reply(f, "text_completion", choices.collect(), replies)
    }

    fn start(f: Format, _: usize) -> (CompletionEvents, Vec<Event>) {
        let chunks = Chunks::new(f, "text_completion", "text");
        (CompletionEvents(chunks), Vec::new())
    }
}

/// The legacy parallel lists: tokens, their log-probabilities, the top alternatives, and text offsets.
fn logprobs(items: &[LogprobItem]) -> Value {
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

pub struct CompletionEvents(Chunks);

impl Events for CompletionEvents {
    fn delta(&mut self, choice: usize, d: &Delta, out: &mut Vec<Event>) {
        if d.content.is_empty() && d.logprobs.is_empty() {
            return;
        }
        let lp = self.0.format.logprobs.then(|| logprobs(&d.logprobs));
        out.push(self.0.chunk(choice, json!(d.content), None, lp));
    }

    /// A completion's sink reads no tool calls.
    fn tool_call(&mut self, _: usize, _: usize, _: &ToolCall, _: &mut Vec<Event>) {}

    fn done(&mut self, choice: usize, f: &Finish, last: bool, out: &mut Vec<Event>) {
        self.0.done(choice, json!(""), f, last, out);
    }

    fn error(&mut self, message: &str) -> Event {
        Chunks::error(message)
    }
}
