//! What the OpenAI API adds to K3's chat format, which lives in [`deltafin_tokenizer::chat`] (rendering and
//! reply parsing): OpenAI's `reasoning_effort` values, and the special ids a reply parser must see. Other
//! families chat through their checkpoint's Jinja template, their reply all content.

use anyhow::{Context, Result};
use deltafin_tokenizer::chat::{
    render_k3, ChatMessage, ChatTemplate, Effort, ReplyParser, K3_CLOSE, K3_END_OF_MSG, K3_OPEN,
    K3_RESPONSE_OPEN, K3_SEP, K3_THINK_CLOSE,
};
use deltafin_tokenizer::{Piece, Tokenizer};
use std::sync::Arc;

/// How a served model's chat prompts are written.
pub enum Format {
    /// K3's XTML (built in), with these markup tokens.
    K3(Markup),
    /// The checkpoint's own template.
    Template(Arc<ChatTemplate>),
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
    pub fn reply_parser(self) -> ReplyParser {
        match self {
            ReasoningEffort::None => ReplyParser::starting_in_content(),
            ReasoningEffort::Think(_) => ReplyParser::new(),
        }
    }
}

/// The special tokens of K3's markup. A chat reply's other special tokens are never text.
#[derive(Clone)]
pub struct Markup {
    ids: [u32; 4],
}

impl Markup {
    /// Fails when the tokenizer lacks one (the model cannot chat).
    pub fn new(tok: &Tokenizer) -> Result<Markup> {
        let id = |name: &str| {
            tok.special_id(name).with_context(|| {
                format!("the tokenizer has no {name} special token (needed for chat)")
            })
        };
        Ok(Markup {
            ids: [id(K3_OPEN)?, id(K3_CLOSE)?, id(K3_SEP)?, id(K3_END_OF_MSG)?],
        })
    }

    pub fn contains(&self, id: u32) -> bool {
        self.ids.contains(&id)
    }
}
