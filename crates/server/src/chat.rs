//! What the OpenAI API adds to the chat formats of [`deltafin_tokenizer::chat`] (rendering, reply parsing,
//! [`ChatFormat`]): OpenAI's `reasoning_effort` values, and the special ids a reply parser must see.

use anyhow::{Context, Result};
use deltafin_tokenizer::chat::harmony;
use deltafin_tokenizer::chat::{
    render_k3, ChatFormat, ChatMessage, ChatParser, Effort, ReplyParser, K3_RESPONSE_OPEN,
    K3_THINK_CLOSE,
};
use deltafin_tokenizer::{Piece, Tokenizer};

/// How a served model chats: its format, and the markup its reply parser reads.
pub struct Chat {
    pub format: ChatFormat,
    pub markup: Markup,
}

impl Chat {
    /// Fails when the tokenizer lacks a markup token of the format (the model cannot chat).
    pub fn new(format: ChatFormat, tok: &Tokenizer) -> Result<Chat> {
        let ids = format
            .markup()
            .iter()
            .map(|name| {
                tok.special_id(name).with_context(|| {
                    format!("the tokenizer has no {name} special token (needed for chat)")
                })
            })
            .collect::<Result<_>>()?;
        Ok(Chat {
            format,
            markup: Markup { ids },
        })
    }
}

/// OpenAI's `reasoning_effort`, as K3 understands it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReasoningEffort {
    /// `none`: no thinking. The prompt closes the think block and opens the answer; the reply starts in
    /// content.
    None,
    /// Thinking, with this effort announced in a system message. `Think(None)` (no message: the model's
    /// default) is what an absent `reasoning_effort` and OpenAI's default, `medium`, mean.
    Think(Option<Effort>),
}

impl ReasoningEffort {
    pub fn parse(s: &str) -> Option<ReasoningEffort> {
        Some(match s {
            "none" => ReasoningEffort::None,
            "low" => ReasoningEffort::Think(Some(Effort::Low)),
            "medium" => ReasoningEffort::Think(None),
            "high" => ReasoningEffort::Think(Some(Effort::High)),
            _ => return None,
        })
    }

    /// The prompt's token ids: the conversation in K3's format, ready for the assistant's reply.
    pub fn render(self, tok: &Tokenizer, messages: &[ChatMessage]) -> Vec<u32> {
        let pieces = match self {
            ReasoningEffort::None => {
                let mut p = render_k3(messages, None, true);
                p.push(Piece::Template(format!(
                    "{K3_THINK_CLOSE}{K3_RESPONSE_OPEN}"
                )));
                p
            }
            ReasoningEffort::Think(effort) => render_k3(messages, effort, true),
        };
        tok.encode_pieces(&pieces)
    }

    /// A parser for the reply to [`Self::render`]'s prompt.
    pub fn reply_parser(self) -> ChatParser {
        ChatParser::K3(match self {
            ReasoningEffort::None => ReplyParser::starting_in_content(),
            ReasoningEffort::Think(_) => ReplyParser::new(),
        })
    }

    /// The effort in harmony's system message; `None` for `none`, which harmony has not (its models
    /// always reason).
    pub fn harmony(self) -> Option<harmony::ReasoningEffort> {
        match self {
            ReasoningEffort::None => None,
            ReasoningEffort::Think(Some(Effort::Low)) => Some(harmony::ReasoningEffort::Low),
            ReasoningEffort::Think(None) => Some(harmony::ReasoningEffort::Medium),
            ReasoningEffort::Think(Some(Effort::High | Effort::Max)) => {
                Some(harmony::ReasoningEffort::High)
            }
        }
    }
}

/// The special tokens of a chat format's markup. A chat reply's other special tokens are never text.
#[derive(Clone)]
pub struct Markup {
    ids: Vec<u32>,
}

impl Markup {
    pub fn contains(&self, id: u32) -> bool {
        self.ids.contains(&id)
    }
}
