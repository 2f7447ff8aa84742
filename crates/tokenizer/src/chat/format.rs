//! Which chat format a checkpoint speaks, decided once from its tokenizer files (and family), and the
//! reply parser that goes with it.
//!
//! In order:
//! 1. **Harmony** when the tokenizer defines every harmony markup token ([`HARMONY_MARKUP`] and the stop
//!    tokens `<|return|>`, `<|call|>`) as a special token: that is o200k_harmony, gpt-oss's tokenizer. A
//!    chat template (gpt-oss ships one) is not consulted: deltafin renders harmony itself, as
//!    openai-harmony does, and parses the reply's channels.
//! 2. **K3** (XTML, built in) for a `kimi_k3` checkpoint.
//! 3. **Template**: the checkpoint's Jinja chat template (`chat_template.jinja`, or `chat_template` in
//!    `tokenizer_config.json`); its reply is all content, but for a `<think>` … `</think>` block at its
//!    start where the template handles those (Qwen3's: [`ThinkParser`]).
//!
//! Without any of them the checkpoint cannot chat (plain completion still works).

use super::harmony::{self, HarmonyParser};
use super::{
    ChatTemplate, ReplyEvent, ReplyParser, ThinkParser, K3_CLOSE, K3_END_OF_MSG, K3_OPEN, K3_SEP,
};
use crate::Tokenizer;
use anyhow::Result;
use std::path::Path;
use std::sync::Arc;

/// The special tokens of harmony's markup that its reply parser reads (besides the stop tokens).
pub const HARMONY_MARKUP: [&str; 5] = [
    harmony::START,
    harmony::CHANNEL,
    harmony::MESSAGE,
    harmony::CONSTRAIN,
    harmony::END,
];

/// The special tokens of K3's markup that its reply parser reads.
pub const K3_MARKUP: [&str; 4] = [K3_OPEN, K3_CLOSE, K3_SEP, K3_END_OF_MSG];

/// How a checkpoint's conversations become prompts and its replies reasoning, content and tool calls.
#[derive(Clone)]
pub enum ChatFormat {
    /// gpt-oss's harmony format, rendered and parsed by deltafin ([`harmony`]).
    Harmony,
    /// K3's XTML, rendered and parsed by deltafin.
    K3,
    /// The checkpoint's own Jinja template.
    Template(Arc<ChatTemplate>),
}

impl ChatFormat {
    /// The format deltafin renders itself for this tokenizer (`k3_family`: the checkpoint is `kimi_k3`),
    /// if any (see the module docs).
    pub fn builtin(tok: &Tokenizer, k3_family: bool) -> Option<ChatFormat> {
        let harmony = HARMONY_MARKUP
            .iter()
            .chain(&harmony::STOP_FOR_ASSISTANT)
            .all(|name| tok.special_id(name).is_some());
        if harmony {
            Some(ChatFormat::Harmony)
        } else if k3_family {
            Some(ChatFormat::K3)
        } else {
            None
        }
    }

    /// The checkpoint's format: [`Self::builtin`], else its chat template; `None` when it has none.
    pub fn from_dir(dir: &Path, tok: &Tokenizer, k3_family: bool) -> Result<Option<ChatFormat>> {
        Ok(match Self::builtin(tok, k3_family) {
            Some(format) => Some(format),
            None => ChatTemplate::from_dir(dir)?.map(|t| ChatFormat::Template(Arc::new(t))),
        })
    }

    /// What the format is called (`deltafin doctor` prints it).
    pub fn name(&self) -> &'static str {
        match self {
            ChatFormat::Harmony => "harmony (built in)",
            ChatFormat::K3 => "K3 XTML (built in)",
            ChatFormat::Template(_) => "the checkpoint's Jinja template",
        }
    }

    /// The special tokens the reply parser reads; a reply's other special tokens are not text.
    pub fn markup(&self) -> &'static [&'static str] {
        match self {
            ChatFormat::Harmony => &HARMONY_MARKUP,
            ChatFormat::K3 => &K3_MARKUP,
            ChatFormat::Template(_) => &[],
        }
    }

    /// The special tokens that end the assistant's turn in this format (besides the checkpoint's EOS).
    pub fn stop_tokens(&self) -> &'static [&'static str] {
        match self {
            ChatFormat::Harmony => &harmony::STOP_FOR_ASSISTANT,
            ChatFormat::K3 => &[K3_END_OF_MSG],
            ChatFormat::Template(_) => &[],
        }
    }

    /// A parser for the reply to a prompt that ends ready for the assistant: harmony's from the first
    /// header, K3's inside the think block, a thinking template's think block then content, another
    /// template's all content.
    pub fn reply_parser(&self) -> ChatParser {
        match self {
            ChatFormat::Harmony => ChatParser::Harmony(HarmonyParser::new()),
            ChatFormat::K3 => ChatParser::K3(ReplyParser::new()),
            ChatFormat::Template(t) if t.thinks() => ChatParser::Think(ThinkParser::new()),
            ChatFormat::Template(_) => ChatParser::K3(ReplyParser::starting_in_content()),
        }
    }
}

/// The reply parser of a [`ChatFormat`].
#[derive(Clone)]
pub enum ChatParser {
    K3(ReplyParser),
    Harmony(HarmonyParser),
    Think(ThinkParser),
}

impl ChatParser {
    /// See [`ReplyParser::push`] and [`HarmonyParser::push`].
    pub fn push(&mut self, text: &str) -> Vec<ReplyEvent> {
        match self {
            ChatParser::K3(p) => p.push(text),
            ChatParser::Harmony(p) => p.push(text),
            ChatParser::Think(p) => p.push(text),
        }
    }

    /// See [`ReplyParser::finish`] and [`HarmonyParser::finish`].
    pub fn finish(&mut self, text: &str) -> Vec<ReplyEvent> {
        match self {
            ChatParser::K3(p) => p.finish(text),
            ChatParser::Harmony(p) => p.finish(text),
            ChatParser::Think(p) => p.finish(text),
        }
    }

    /// Whether what is pushed next is reasoning (unless it ends the reasoning).
    pub fn in_reasoning(&self) -> bool {
        match self {
            ChatParser::K3(p) => p.in_reasoning(),
            ChatParser::Harmony(p) => p.in_reasoning(),
            ChatParser::Think(p) => p.in_reasoning(),
        }
    }
}
