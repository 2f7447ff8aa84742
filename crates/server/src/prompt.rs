//! A parsed request as the model runs it: its prompt's token ids (the model's chat format: K3's, harmony or
//! the checkpoint's template; or a completion's text or ids) and the sink that turns each choice's tokens
//! into messages.

use crate::api::{ChatRequest, Common, CompletionRequest, Prompt};
use crate::chat::{self, ReasoningEffort};
use crate::error::ApiError;
use crate::sink::{ChannelSink, Msg};
use crate::AppState;
use axum::http::StatusCode;
use deltafin_tokenizer::chat::{harmony, k3_tools_message, ChatFormat};
use tokio::sync::mpsc::UnboundedSender;

/// A request ready to queue: its prompt, what it asks of each choice, and the sink of a choice's channel.
pub struct Prepared {
    pub prompt: Vec<u32>,
    pub common: Common,
    /// `max_tokens` when the request gives none.
    pub default_max: usize,
    /// Log-probabilities of the sampled tokens with this many alternatives each; `None`: none.
    pub top_logprobs: Option<usize>,
    pub sink: MakeSink,
}

/// Makes the sink of one choice's channel.
pub type MakeSink = Box<dyn Fn(UnboundedSender<Msg>) -> ChannelSink>;

/// A chat request (any API's): its prompt, and a sink that reads the format's reasoning and tool calls (a
/// template's reply is all content). `effort_field` names the request's thinking setting in errors.
pub fn chat(s: &AppState, req: ChatRequest, effort_field: &str) -> Result<Prepared, ApiError> {
    let prompt = chat_prompt(s, &req, effort_field)?;
    let chat = chat_of(s)?;
    let parser = match &chat.format {
        ChatFormat::K3 => Some(req.effort.reply_parser()),
        ChatFormat::Harmony => Some(chat.format.reply_parser()),
        ChatFormat::Template(_) => None,
    };
    let sink: MakeSink = match parser {
        Some(parser) => {
            let (tok, ids, markup) = (s.tokenizer.clone(), s.stop_ids.clone(), chat.markup.clone());
            let (tools, stop) = (req.tools, req.common.stop.clone());
            Box::new(move |tx| {
                let parser = parser.clone();
                ChannelSink::chat(tok.clone(), &markup, parser, &tools, &stop, ids.clone(), tx)
            })
        }
        None => completion_sink(s, &req.common),
    };
    Ok(Prepared {
        prompt,
        common: req.common,
        default_max: s.cfg.default_max_tokens,
        top_logprobs: req.top_logprobs,
        sink,
    })
}

/// A completion request: its text encoded, or its token ids checked against the vocabulary; 16 tokens
/// unless it asks for more (OpenAI's default).
pub fn completion(s: &AppState, req: CompletionRequest) -> Result<Prepared, ApiError> {
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
    Ok(Prepared {
        prompt,
        sink: completion_sink(s, &req.common),
        common: req.common,
        default_max: 16,
        top_logprobs: req.logprobs,
    })
}

/// A sink whose reply is all content.
fn completion_sink(s: &AppState, c: &Common) -> MakeSink {
    let (tok, ids, stop) = (s.tokenizer.clone(), s.stop_ids.clone(), c.stop.clone());
    Box::new(move |tx| ChannelSink::completion(tok.clone(), &stop, ids.clone(), tx))
}

fn chat_of(s: &AppState) -> Result<&chat::Chat, ApiError> {
    s.chat.as_ref().map_err(|e| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            format!("this model cannot chat: {e}; use /v1/completions"),
        )
    })
}

fn check_model(s: &AppState, c: &Common) -> Result<(), ApiError> {
    if c.model != s.cfg.model_name {
        return Err(ApiError::unknown_model(&c.model, &s.cfg.model_name));
    }
    Ok(())
}

/// A chat request's prompt in the model's format: K3's (with the tools' system message when tools are
/// offered), harmony's, or the checkpoint template's, which refuses what only the built-in formats express
/// rather than ignoring it.
pub fn chat_prompt(
    s: &AppState,
    req: &ChatRequest,
    effort_field: &str,
) -> Result<Vec<u32>, ApiError> {
    check_model(s, &req.common)?;
    let template = match &chat_of(s)?.format {
        ChatFormat::K3 => {
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
        ChatFormat::Harmony => return harmony_prompt(s, req, effort_field),
        ChatFormat::Template(template) => template,
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
            "tools need a built-in chat format (K3's or harmony); this model chats through its own template, \
             whose tool calls deltafin does not read",
        )
        .code("unsupported_parameter"));
    }
    if req.effort != ReasoningEffort::Think(None) {
        return Err(ApiError::invalid(
            effort_field,
            format!("{effort_field} applies to K3's and harmony's reasoning; this model's template has none"),
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

/// A chat request's prompt in harmony: the effort in the system message, the tools in the developer one.
fn harmony_prompt(
    s: &AppState,
    req: &ChatRequest,
    effort_field: &str,
) -> Result<Vec<u32>, ApiError> {
    if req.prefill.is_some() {
        return Err(ApiError::invalid(
            "messages",
            "a final assistant turn (prefill) is not supported in the harmony format; end with a user or tool message",
        )
        .code("unsupported_parameter"));
    }
    let Some(effort) = req.effort.harmony() else {
        return Err(ApiError::invalid(
            effort_field,
            format!(
                "{effort_field} \"none\": harmony models always reason; use low, medium or high"
            ),
        )
        .code("unsupported_parameter"));
    };
    let pieces = harmony::render_chat(&req.messages, req.tools.listed.as_deref(), Some(effort))
        .map_err(|e| ApiError::invalid("messages", format!("{e:#}")))?;
    Ok(s.tokenizer.encode_pieces(&pieces))
}
