//! Chat prompts and replies: K3's XTML format, gpt-oss's harmony format ([`harmony`]), other families'
//! Jinja templates, and streaming reply parsers; [`ChatFormat`] says which a checkpoint speaks.
//!
//! Rendering produces [`Piece`]s for [`crate::Tokenizer::encode_pieces`]: the format's own markup is
//! [`Piece::Template`] (special names in it become special ids) and everything from the conversation —
//! contents, names, ids, reasoning, tool arguments — is [`Piece::Text`], so a user who types "<|open|>"
//! gets ordinary text.
//!
//! # K3 (XTML)
//!
//! Each message is `<|open|>message role="user"<|sep|>CONTENT<|close|>message<|sep|><|end_of_msg|>`; a
//! `name` (and for tool results `tool_call_id`) becomes an attribute after `role`, with `&` and `"`
//! escaped as `&amp;` and `&quot;`. The contract fixes that much and the generation prompt
//! ([`K3_GENERATION_PROMPT`]). It leaves open, and this module chooses (each a named constant):
//!
//! - the thinking-effort system message: [`K3_EFFORT_NAME`] as its name, [`k3_effort_text`] as its text;
//! - the think-close marker [`K3_THINK_CLOSE`] (mirrors the open marker that ends the generation prompt);
//! - the response block [`K3_RESPONSE_OPEN`] … [`K3_RESPONSE_CLOSE`] around the answer;
//! - tool calls: `<|open|>tool_call id="ID" name="NAME"<|sep|>ARGUMENTS<|close|>tool_call<|sep|>` after
//!   the response block ([`K3_TOOL_CALL_OPEN`], [`K3_TOOL_CALL_CLOSE`]);
//! - the tools the model may call: a system message named [`K3_TOOLS_NAME`] whose text is their JSON list
//!   (OpenAI's tool objects), before the conversation ([`k3_tools_message`]);
//! - assistant history always carries its think block, empty when the reasoning is unknown, so earlier
//!   turns look like what the model itself produced.
//!
//! A full assistant turn is therefore
//! `<|open|>message role="assistant"<|sep|><|open|>think<|sep|>REASONING<|close|>think<|sep|>`
//! `<|open|>response<|sep|>CONTENT<|close|>response<|sep|>[TOOL CALLS]<|close|>message<|sep|><|end_of_msg|>`.

mod format;
pub mod harmony;
mod reply;
mod scan;
mod template;
#[cfg(test)]
mod tests;
mod think;

pub use format::{ChatFormat, ChatParser, HARMONY_MARKUP, K3_MARKUP};
pub use reply::{parse_reply, Reply, ReplyParser};
pub use scan::ReplyEvent;
pub use template::ChatTemplate;
pub use think::{ThinkParser, THINK_CLOSE, THINK_OPEN};

use crate::Piece;
use serde::{Deserialize, Serialize};

pub const K3_OPEN: &str = "<|open|>";
pub const K3_CLOSE: &str = "<|close|>";
pub const K3_SEP: &str = "<|sep|>";
/// The stop token that ends every message.
pub const K3_END_OF_MSG: &str = "<|end_of_msg|>";
/// Ends every message, after its body.
pub const K3_MESSAGE_CLOSE: &str = "<|close|>message<|sep|><|end_of_msg|>";
pub const K3_THINK_OPEN: &str = "<|open|>think<|sep|>";
/// Our choice (the contract names a think-close marker without spelling it): the think block closes
/// like a message does, with the block's tag.
pub const K3_THINK_CLOSE: &str = "<|close|>think<|sep|>";
/// Our choice: the answer after the think block sits in a `response` block.
pub const K3_RESPONSE_OPEN: &str = "<|open|>response<|sep|>";
pub const K3_RESPONSE_CLOSE: &str = "<|close|>response<|sep|>";
/// Our choice: start of a tool-call block; `id` and `name` attributes and `<|sep|>` follow.
pub const K3_TOOL_CALL_OPEN: &str = "<|open|>tool_call";
pub const K3_TOOL_CALL_CLOSE: &str = "<|close|>tool_call<|sep|>";
/// What the prompt ends with when the model is to answer: an assistant message with an open think block.
pub const K3_GENERATION_PROMPT: &str =
    "<|open|>message role=\"assistant\"<|sep|><|open|>think<|sep|>";
/// Our choice: the `name` attribute of the system message that lists the callable tools.
pub const K3_TOOLS_NAME: &str = "tools";

/// The system message that offers `tools_json` (a JSON list of tool objects) to the model.
pub fn k3_tools_message(tools_json: &str) -> ChatMessage {
    ChatMessage {
        name: Some(K3_TOOLS_NAME.to_string()),
        ..ChatMessage::system(tools_json)
    }
}

/// Our choice: the `name` attribute of the thinking-effort system message.
pub const K3_EFFORT_NAME: &str = "thinking_effort";

/// The text of the thinking-effort system message (our choice; the contract leaves it open).
pub fn k3_effort_text(effort: Effort) -> String {
    format!("Thinking effort: {}.", effort.as_str())
}

/// Who wrote a message.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    System,
    User,
    Assistant,
    Tool,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Tool => "tool",
        }
    }
}

/// A call the assistant made to a tool. `arguments` is the raw text (JSON by convention).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    pub arguments: String,
}

/// One message of a conversation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: Role,
    #[serde(default)]
    pub content: String,
    /// Optional speaker name (an attribute in K3's format).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Assistant only: the thinking that preceded `content`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning: Option<String>,
    /// Assistant only: tool calls after `content`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    /// Tool only: the id of the call this message answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

impl ChatMessage {
    pub fn new(role: Role, content: impl Into<String>) -> Self {
        ChatMessage {
            role,
            content: content.into(),
            name: None,
            reasoning: None,
            tool_calls: Vec::new(),
            tool_call_id: None,
        }
    }
    pub fn system(content: impl Into<String>) -> Self {
        Self::new(Role::System, content)
    }
    pub fn user(content: impl Into<String>) -> Self {
        Self::new(Role::User, content)
    }
    pub fn assistant(content: impl Into<String>) -> Self {
        Self::new(Role::Assistant, content)
    }
    /// A tool result answering the call with id `tool_call_id`.
    pub fn tool(tool_call_id: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage {
            tool_call_id: Some(tool_call_id.into()),
            ..Self::new(Role::Tool, content)
        }
    }
}

/// How hard the model should think, announced by a system message before the conversation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Effort {
    Low,
    High,
    Max,
}

impl Effort {
    pub fn as_str(self) -> &'static str {
        match self {
            Effort::Low => "low",
            Effort::High => "high",
            Effort::Max => "max",
        }
    }
}

impl std::str::FromStr for Effort {
    type Err = String;
    fn from_str(s: &str) -> Result<Effort, String> {
        match s {
            "low" => Ok(Effort::Low),
            "high" => Ok(Effort::High),
            "max" => Ok(Effort::Max),
            _ => Err(format!(
                "unknown thinking effort {s:?}; use low, high or max"
            )),
        }
    }
}

/// Escapes an XTML attribute value: `&` → `&amp;`, `"` → `&quot;`.
pub fn escape_attribute(value: &str) -> String {
    value.replace('&', "&amp;").replace('"', "&quot;")
}

/// Reverses [`escape_attribute`].
pub fn unescape_attribute(value: &str) -> String {
    value.replace("&quot;", "\"").replace("&amp;", "&")
}

/// Collects pieces, merging neighbours of the same kind.
#[derive(Default)]
struct Pieces(Vec<Piece>);

impl Pieces {
    fn template(&mut self, s: &str) {
        match self.0.last_mut() {
            Some(Piece::Template(t)) => t.push_str(s),
            _ => self.0.push(Piece::Template(s.to_string())),
        }
    }
    fn text(&mut self, s: &str) {
        if s.is_empty() {
            return;
        }
        match self.0.last_mut() {
            Some(Piece::Text(t)) => t.push_str(s),
            _ => self.0.push(Piece::Text(s.to_string())),
        }
    }
    /// ` key="VALUE"` with the value escaped and kept as conversation text.
    fn attribute(&mut self, key: &str, value: &str) {
        self.template(&format!(" {key}=\""));
        self.text(&escape_attribute(value));
        self.template("\"");
    }
}

/// Renders `messages` in K3's XTML (see the module docs): the thinking-effort system message first when
/// `effort` is given, then each message, then [`K3_GENERATION_PROMPT`] if `add_generation_prompt`.
pub fn render_k3(
    messages: &[ChatMessage],
    effort: Option<Effort>,
    add_generation_prompt: bool,
) -> Vec<Piece> {
    let mut out = Pieces::default();
    if let Some(effort) = effort {
        let mut m = ChatMessage::system(k3_effort_text(effort));
        m.name = Some(K3_EFFORT_NAME.to_string());
        render_k3_message(&mut out, &m);
    }
    for m in messages {
        render_k3_message(&mut out, m);
    }
    if add_generation_prompt {
        out.template(K3_GENERATION_PROMPT);
    }
    out.0
}

fn render_k3_message(out: &mut Pieces, m: &ChatMessage) {
    out.template(K3_OPEN);
    out.template("message");
    out.template(&format!(" role=\"{}\"", m.role.as_str()));
    if let Some(name) = &m.name {
        out.attribute("name", name);
    }
    if let Some(id) = &m.tool_call_id {
        out.attribute("tool_call_id", id);
    }
    out.template(K3_SEP);
    if m.role == Role::Assistant {
        out.template(K3_THINK_OPEN);
        out.text(m.reasoning.as_deref().unwrap_or(""));
        out.template(K3_THINK_CLOSE);
        out.template(K3_RESPONSE_OPEN);
        out.text(&m.content);
        out.template(K3_RESPONSE_CLOSE);
        for call in &m.tool_calls {
            out.template(K3_TOOL_CALL_OPEN);
            out.attribute("id", &call.id);
            out.attribute("name", &call.name);
            out.template(K3_SEP);
            out.text(&call.arguments);
            out.template(K3_TOOL_CALL_CLOSE);
        }
    } else {
        out.text(&m.content);
    }
    out.template(K3_MESSAGE_CLOSE);
}

/// The pieces' text concatenated (what a string-rendering template would have produced).
pub fn pieces_text(pieces: &[Piece]) -> String {
    pieces.iter().map(Piece::as_str).collect()
}
