//! K3's chat format (XTML, model contract §5), minimally: render messages to token ids and split a reply's
//! tokens into reasoning and content.
//!
//! Placeholder until the tokenizer crate's shared `chat` module (template rendering and reply parsing) lands;
//! then [`Xtml::render`] and [`ReplyParser`] should delegate to it. The server uses only these two seams.

use anyhow::{Context, Result};
use deltafin_tokenizer::Tokenizer;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    System,
    User,
    Assistant,
}

impl Role {
    fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
        }
    }
}

#[derive(Clone, Debug)]
pub struct Message {
    pub role: Role,
    pub content: String,
    pub name: Option<String>,
    /// An earlier assistant turn's reasoning (`reasoning_content`), replayed inside its think block.
    pub reasoning: Option<String>,
}

/// `reasoning_effort`: `None` = no thinking (the think block is closed in the prompt).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Effort {
    None,
    Low,
    Medium,
    High,
}

impl Effort {
    pub fn parse(s: &str) -> Option<Effort> {
        Some(match s {
            "none" => Effort::None,
            "low" => Effort::Low,
            "medium" => Effort::Medium,
            "high" => Effort::High,
            _ => return None,
        })
    }
}

/// The template's special ids.
pub struct Xtml {
    open: u32,
    close: u32,
    sep: u32,
    end_of_msg: u32,
    /// Ids at or above this are special tokens (never text).
    num_ranks: u32,
}

impl Xtml {
    pub fn new(tok: &Tokenizer) -> Result<Xtml> {
        let id = |name: &str| {
            tok.special_id(name).with_context(|| {
                format!("the tokenizer has no {name} special token (needed for chat)")
            })
        };
        Ok(Xtml {
            open: id("<|open|>")?,
            close: id("<|close|>")?,
            sep: id("<|sep|>")?,
            end_of_msg: id("<|end_of_msg|>")?,
            num_ranks: tok.num_ranks() as u32,
        })
    }

    /// `[effort message] messages… generation prompt`. Attribute values escape `&` and `"`; message text is
    /// ordinary BPE (a user's "<|open|>" is not the special token).
    pub fn render(
        &self,
        tok: &Tokenizer,
        messages: &[Message],
        effort: Option<Effort>,
    ) -> Vec<u32> {
        let mut ids = Vec::new();
        let open_message = |ids: &mut Vec<u32>, role: &str, name: Option<&str>| {
            ids.push(self.open);
            let mut head = format!("message role=\"{}\"", escape(role));
            if let Some(n) = name {
                head.push_str(&format!(" name=\"{}\"", escape(n)));
            }
            ids.extend(tok.encode(&head));
            ids.push(self.sep);
        };
        let close_message = |ids: &mut Vec<u32>| {
            ids.push(self.close);
            ids.extend(tok.encode("message"));
            ids.push(self.sep);
            ids.push(self.end_of_msg);
        };
        let block = |ids: &mut Vec<u32>, marker: u32, name: &str| {
            ids.push(marker);
            ids.extend(tok.encode(name));
            ids.push(self.sep);
        };
        if let Some(e) = effort.filter(|&e| e != Effort::None) {
            open_message(&mut ids, "system", Some("thinking_effort"));
            ids.extend(tok.encode(match e {
                Effort::Low => "low",
                Effort::Medium => "medium",
                _ => "high",
            }));
            close_message(&mut ids);
        }
        for m in messages {
            open_message(&mut ids, m.role.as_str(), m.name.as_deref());
            if m.role == Role::Assistant {
                block(&mut ids, self.open, "think");
                ids.extend(tok.encode(m.reasoning.as_deref().unwrap_or("")));
                block(&mut ids, self.close, "think");
            }
            ids.extend(tok.encode(&m.content));
            close_message(&mut ids);
        }
        open_message(&mut ids, "assistant", None);
        block(&mut ids, self.open, "think");
        if effort == Some(Effort::None) {
            block(&mut ids, self.close, "think");
        }
        ids
    }
}

fn escape(v: &str) -> String {
    v.replace('&', "&amp;").replace('"', "&quot;")
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Channel {
    Reasoning,
    Content,
}

/// Splits reply tokens: everything before the think-close marker is reasoning, the rest content; markers
/// (`<|open|>name<|sep|>`, `<|close|>name<|sep|>`) and other special tokens are never text.
pub struct ReplyParser {
    channel: Channel,
    /// Bytes of a marker's name, between `<|open|>`/`<|close|>` and `<|sep|>` (`true` for a close).
    marker: Option<(bool, Vec<u8>)>,
    open: u32,
    close: u32,
    sep: u32,
    num_ranks: u32,
}

/// Longest marker name kept; a longer "name" was text after a stray marker token.
const MAX_MARKER: usize = 64;

impl ReplyParser {
    pub fn new(x: &Xtml, effort: Option<Effort>) -> ReplyParser {
        ReplyParser {
            channel: if effort == Some(Effort::None) {
                Channel::Content
            } else {
                Channel::Reasoning
            },
            marker: None,
            open: x.open,
            close: x.close,
            sep: x.sep,
            num_ranks: x.num_ranks,
        }
    }

    pub fn channel(&self) -> Channel {
        self.channel
    }

    /// One token and its bytes: the text it adds, and to which channel.
    pub fn push(&mut self, token: u32, bytes: &[u8]) -> Option<(Channel, Vec<u8>)> {
        if token == self.open || token == self.close {
            self.marker = Some((token == self.close, Vec::new()));
            return None;
        }
        if token == self.sep {
            if let Some((true, name)) = self.marker.take() {
                if name.trim_ascii() == b"think" {
                    self.channel = Channel::Content;
                }
            }
            return None;
        }
        if token >= self.num_ranks {
            return None;
        }
        match &mut self.marker {
            Some((_, name)) if name.len() + bytes.len() <= MAX_MARKER => {
                name.extend_from_slice(bytes);
                None
            }
            Some((_, name)) => {
                let mut text = std::mem::take(name);
                text.extend_from_slice(bytes);
                self.marker = None;
                Some((self.channel, text))
            }
            None => Some((self.channel, bytes.to_vec())),
        }
    }
}
