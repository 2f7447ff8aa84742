//! The APIs deltafin answers ("dialects"): OpenAI's chat completions, completions and responses, and
//! Anthropic's messages. Each reads its request body into a prompt and answers in its own shapes, as one body
//! or as a stream of events, and shapes its errors; the request pipeline ([`crate::respond`]) is generic over
//! [`Dialect`] and knows none of the shapes.

pub mod chat;
pub mod completions;
pub mod messages;
mod openai;
pub mod responses;

use crate::error::ApiError;
use crate::prompt::Prepared;
use crate::sink::{Delta, Finish, LogprobItem};
use crate::AppState;
use axum::response::sse::Event;
use axum::response::{IntoResponse, Response};
use deltafin_tokenizer::chat::ToolCall;
use serde_json::Value;

/// One API: its request, its reply whole and streamed, and its error shape.
pub trait Dialect: Send + Sync + 'static {
    type Request;
    type Events: Events;

    /// Parses and validates a request body (before anything reaches the tokenizer or the model).
    fn parse(body: &[u8]) -> Result<Self::Request, ApiError>;
    /// The request's prompt, and what it asks of each choice.
    fn prepare(s: &AppState, req: Self::Request) -> Result<Prepared, ApiError>;
    /// A reply's id: unique (`n` counts the server's requests) and in the API's form.
    fn id(created: u64, n: u64) -> String;
    /// The whole answer, from every choice's reply (in choice order).
    fn reply(f: &Format, replies: &[Reply]) -> Value;
    /// A stream of `choices` choices: its state, and the events that open it.
    fn start(f: Format, choices: usize) -> (Self::Events, Vec<Event>);
    /// A refused request, or a failed generation before the answer started.
    fn error(e: ApiError) -> Response {
        e.into_response()
    }
}

/// A stream in the making: each choice's messages become this API's events, appended to `out`.
pub trait Events: Send + Unpin + 'static {
    fn delta(&mut self, choice: usize, d: &Delta, out: &mut Vec<Event>);
    /// The reply's `index`-th tool call, whole.
    fn tool_call(&mut self, choice: usize, index: usize, call: &ToolCall, out: &mut Vec<Event>);
    /// A choice ended; `last`: it was the last one open, and the stream ends after these events.
    fn done(&mut self, choice: usize, f: &Finish, last: bool, out: &mut Vec<Event>);
    /// An error after the stream started: the stream's last event.
    fn error(&mut self, message: &str) -> Event;
}

/// What every part of one request's answer names.
#[derive(Clone)]
pub struct Format {
    pub id: String,
    pub created: u64,
    pub model: String,
    /// A stream's usage chunk (OpenAI's `stream_options.include_usage`).
    pub include_usage: bool,
    /// Whether the answer carries log-probabilities.
    pub logprobs: bool,
    pub prompt_tokens: usize,
}

/// One choice's whole reply.
pub struct Reply {
    pub reasoning: String,
    pub content: String,
    pub logprobs: Vec<LogprobItem>,
    pub calls: Vec<(usize, ToolCall)>,
    pub finish: Finish,
}
