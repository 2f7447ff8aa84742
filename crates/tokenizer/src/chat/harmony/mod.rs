//! gpt-oss's harmony format: rendering a conversation as openai-harmony does, and parsing a completion.
//!
//! A message is `<|start|>ROLE[ to=RECIPIENT][<|channel|>CHANNEL][ CONTENT_TYPE]<|message|>CONTENT<|end|>`;
//! a tool's message starts with the tool's name instead of its role, an assistant message to a recipient
//! (a tool call) ends with `<|call|>`. The types mirror openai-harmony's and deserialize from its JSON
//! form (`Conversation.to_json()`), so its renders are the tests' goldens (tests/fixtures/o200k_harmony).
//!
//! The format's markup is [`Piece::Template`]; everything from the conversation (contents, names,
//! recipients, channels, instructions, tool descriptions) is [`Piece::Text`], as openai-harmony encodes it
//! with specials disallowed.

mod conversation;
mod parser;
mod schema;

pub use conversation::{conversation, render_chat};
pub use parser::{HarmonyParser, ParsedMessage};
pub use schema::Json;

use super::Pieces;
use crate::Piece;
use anyhow::{bail, ensure, Result};
use serde::Deserialize;
use std::collections::BTreeMap;

pub const START: &str = "<|start|>";
pub const MESSAGE: &str = "<|message|>";
pub const CHANNEL: &str = "<|channel|>";
pub const CONSTRAIN: &str = "<|constrain|>";
/// Ends a message that is not the last of the completion.
pub const END: &str = "<|end|>";
/// Ends an assistant message addressed to a tool: the completion stops for the tool's answer.
pub const CALL: &str = "<|call|>";
/// Ends the assistant's final answer: the completion is done.
pub const RETURN: &str = "<|return|>";
/// The tokens generation stops at, as openai-harmony's `stop_tokens`; `<|end|>` only ends a message
/// in a completion (the model goes on with the next), so a chat stops at [`STOP_FOR_ASSISTANT`].
pub const STOP: [&str; 3] = [RETURN, CALL, END];
/// openai-harmony's `stop_tokens_for_assistant_actions`: where the assistant's turn ends.
pub const STOP_FOR_ASSISTANT: [&str; 2] = [RETURN, CALL];

/// Who wrote a message.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum HarmonyRole {
    System,
    Developer,
    User,
    Assistant,
    Tool,
}

impl HarmonyRole {
    pub fn as_str(self) -> &'static str {
        match self {
            HarmonyRole::System => "system",
            HarmonyRole::Developer => "developer",
            HarmonyRole::User => "user",
            HarmonyRole::Assistant => "assistant",
            HarmonyRole::Tool => "tool",
        }
    }
}

/// One message. A tool's message has the tool's name (`functions.NAME`) as `name`.
#[derive(Clone, Debug, PartialEq, Deserialize)]
pub struct HarmonyMessage {
    pub role: HarmonyRole,
    #[serde(default)]
    pub name: Option<String>,
    pub content: Vec<Content>,
    #[serde(default)]
    pub channel: Option<String>,
    #[serde(default)]
    pub recipient: Option<String>,
    #[serde(default)]
    pub content_type: Option<String>,
}

impl HarmonyMessage {
    /// A message with one text part.
    pub fn text(role: HarmonyRole, text: impl Into<String>) -> Self {
        HarmonyMessage {
            role,
            name: None,
            content: vec![Content::Text { text: text.into() }],
            channel: None,
            recipient: None,
            content_type: None,
        }
    }

    fn is_assistant_on(&self, channel: &str) -> bool {
        self.role == HarmonyRole::Assistant && self.channel.as_deref() == Some(channel)
    }
}

/// A part of a message's content.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Content {
    Text { text: String },
    SystemContent(SystemContent),
    DeveloperContent(DeveloperContent),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
pub enum ReasoningEffort {
    Low,
    Medium,
    High,
}

/// The system message's content: identity, dates, reasoning effort, channels, built-in tools.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
pub struct SystemContent {
    #[serde(default)]
    pub model_identity: Option<String>,
    #[serde(default)]
    pub reasoning_effort: Option<ReasoningEffort>,
    #[serde(default)]
    pub conversation_start_date: Option<String>,
    #[serde(default)]
    pub knowledge_cutoff: Option<String>,
    #[serde(default)]
    pub channel_config: Option<ChannelConfig>,
    #[serde(default)]
    pub tools: Option<BTreeMap<String, ToolNamespace>>,
}

impl SystemContent {
    /// openai-harmony's `SystemContent.new()`: ChatGPT's identity, cutoff 2024-06, medium effort, the three
    /// channels required.
    pub fn new() -> Self {
        SystemContent {
            model_identity: Some(
                "You are ChatGPT, a large language model trained by OpenAI.".into(),
            ),
            reasoning_effort: Some(ReasoningEffort::Medium),
            conversation_start_date: None,
            knowledge_cutoff: Some("2024-06".into()),
            channel_config: Some(ChannelConfig {
                valid_channels: ["analysis", "commentary", "final"].map(String::from).into(),
                channel_required: true,
            }),
            tools: None,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
pub struct ChannelConfig {
    pub valid_channels: Vec<String>,
    pub channel_required: bool,
}

/// The developer message's content: instructions and the function tools.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
pub struct DeveloperContent {
    #[serde(default)]
    pub instructions: Option<String>,
    #[serde(default)]
    pub tools: Option<BTreeMap<String, ToolNamespace>>,
}

/// Tools under one name (`functions` for the caller's functions).
#[derive(Clone, Debug, PartialEq, Deserialize)]
pub struct ToolNamespace {
    pub name: String,
    #[serde(default)]
    pub description: Option<String>,
    #[serde(default)]
    pub tools: Vec<ToolDescription>,
}

#[derive(Clone, Debug, PartialEq, Deserialize)]
pub struct ToolDescription {
    pub name: String,
    pub description: String,
    /// A JSON schema, keys in their given order (the order of the rendered properties). Deserialize it
    /// from the JSON text: a `serde_json::Value` has already sorted the keys.
    #[serde(default)]
    pub parameters: Option<Json>,
}

/// What [`render_harmony`] produces.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RenderMode {
    /// A prompt: the conversation, then `<|start|>` and this role (the model writes the rest).
    Completion(HarmonyRole),
    /// The conversation as it stands.
    Conversation,
    /// As [`RenderMode::Conversation`], but a last assistant `final` message ends with `<|return|>`.
    Training,
}

/// Renders `messages` as openai-harmony's `render_conversation_for_completion` / `render_conversation`
/// / `render_conversation_for_training` do with their default config: when the last assistant message is
/// on the `final` channel, the `analysis` messages before the first `final` one are left out (the
/// reasoning of answered turns is not shown to the model again).
pub fn render_harmony(messages: &[HarmonyMessage], mode: RenderMode) -> Result<Vec<Piece>> {
    let has_function_tools = messages.iter().flat_map(|m| &m.content).any(|c| {
        matches!(c, Content::DeveloperContent(DeveloperContent { tools: Some(t), .. })
            if t.get("functions").is_some_and(|ns| !ns.tools.is_empty()))
    });
    let last_assistant_is_final = messages
        .iter()
        .rev()
        .find(|m| m.role == HarmonyRole::Assistant)
        .is_some_and(|m| m.is_assistant_on("final"));
    let first_final = messages
        .iter()
        .position(|m| m.channel.as_deref() == Some("final"));
    let mut out = Pieces::default();
    for (i, m) in messages.iter().enumerate() {
        let dropped = last_assistant_is_final
            && first_final.is_some_and(|f| i < f)
            && m.channel.as_deref() == Some("analysis");
        if dropped {
            continue;
        }
        let returns =
            mode == RenderMode::Training && i + 1 == messages.len() && m.is_assistant_on("final");
        render_message(&mut out, m, has_function_tools, returns)?;
    }
    if let RenderMode::Completion(role) = mode {
        out.template(START);
        out.template(role.as_str());
    }
    Ok(out.0)
}

fn render_message(
    out: &mut Pieces,
    m: &HarmonyMessage,
    has_function_tools: bool,
    returns: bool,
) -> Result<()> {
    out.template(START);
    if m.role == HarmonyRole::Tool {
        let Some(name) = &m.name else {
            bail!("a harmony tool message needs the tool's name (e.g. \"functions.get_weather\")");
        };
        out.text(name);
    } else {
        out.template(m.role.as_str());
        if let Some(name) = &m.name {
            out.text(&format!(":{name}"));
        }
    }
    if let Some(recipient) = m.recipient.as_deref().filter(|&r| r != "all") {
        out.template(" to=");
        out.text(recipient);
    }
    if let Some(channel) = &m.channel {
        out.template(CHANNEL);
        out.text(channel);
    }
    if let Some(content_type) = &m.content_type {
        match content_type.strip_prefix(CONSTRAIN) {
            Some(rest) => {
                out.template(" ");
                out.template(CONSTRAIN);
                out.text(rest);
            }
            None => out.text(&format!(" {content_type}")),
        }
    }
    out.template(MESSAGE);
    for part in &m.content {
        let text = match part {
            Content::Text { text } => text.clone(),
            Content::SystemContent(sys) => {
                ensure!(
                    m.role == HarmonyRole::System,
                    "system content is only allowed in a system message, found in a {} message",
                    m.role.as_str()
                );
                system_text(sys, has_function_tools)
            }
            Content::DeveloperContent(dev) => {
                ensure!(
                    m.role == HarmonyRole::Developer,
                    "developer content is only allowed in a developer message, found in a {} message",
                    m.role.as_str()
                );
                developer_text(dev)
            }
        };
        out.text(&text);
    }
    out.template(if returns {
        RETURN
    } else if m.role == HarmonyRole::Assistant && m.recipient.is_some() {
        CALL
    } else {
        END
    });
    Ok(())
}

fn system_text(sys: &SystemContent, has_function_tools: bool) -> String {
    let mut sections = Vec::new();
    let top: Vec<String> = [
        sys.model_identity.clone(),
        sys.knowledge_cutoff
            .as_ref()
            .map(|d| format!("Knowledge cutoff: {d}")),
        sys.conversation_start_date
            .as_ref()
            .map(|d| format!("Current date: {d}")),
    ]
    .into_iter()
    .flatten()
    .collect();
    if !top.is_empty() {
        sections.push(top.join("\n"));
    }
    if let Some(effort) = sys.reasoning_effort {
        let effort = match effort {
            ReasoningEffort::Low => "low",
            ReasoningEffort::Medium => "medium",
            ReasoningEffort::High => "high",
        };
        sections.push(format!("Reasoning: {effort}"));
    }
    if let Some(tools) = sys.tools.as_ref().filter(|t| !t.is_empty()) {
        sections.push(tools_text(tools));
    }
    if let Some(cc) = sys
        .channel_config
        .as_ref()
        .filter(|c| !c.valid_channels.is_empty())
    {
        let mut s = format!("# Valid channels: {}.", cc.valid_channels.join(", "));
        if cc.channel_required {
            s.push_str(" Channel must be included for every message.");
        }
        if has_function_tools {
            s.push_str("\nCalls to these tools must go to the commentary channel: 'functions'.");
        }
        sections.push(s);
    }
    sections.join("\n\n")
}

fn developer_text(dev: &DeveloperContent) -> String {
    let mut sections = Vec::new();
    if let Some(instructions) = &dev.instructions {
        sections.push("# Instructions".to_string());
        sections.push(instructions.clone());
    }
    if let Some(tools) = dev.tools.as_ref().filter(|t| !t.is_empty()) {
        sections.push(tools_text(tools));
    }
    sections.join("\n\n")
}

/// `# Tools`, then per namespace its description and a TypeScript-like `namespace NAME { ... }`.
fn tools_text(tools: &BTreeMap<String, ToolNamespace>) -> String {
    let mut sections = vec!["# Tools".to_string()];
    for ns in tools.values() {
        let mut lines = vec![format!("## {}\n", ns.name)];
        let has_tools = !ns.tools.is_empty();
        for line in ns.description.iter().flat_map(|d| d.lines()) {
            lines.push(if has_tools {
                format!("// {line}")
            } else {
                line.to_string()
            });
        }
        if has_tools {
            lines.push(format!("namespace {} {{\n", ns.name));
            for tool in &ns.tools {
                lines.extend(tool.description.lines().map(|l| format!("// {l}")));
                lines.push(match &tool.parameters {
                    Some(p) => format!(
                        "type {} = (_: {}) => any;\n",
                        tool.name,
                        schema::typescript(p, "")
                    ),
                    None => format!("type {} = () => any;\n", tool.name),
                });
            }
            lines.push(format!("}} // namespace {}", ns.name));
        }
        sections.push(lines.join("\n"));
    }
    sections.join("\n\n")
}
