//! A chat (deltafin's [`ChatMessage`]s, OpenAI's tool objects, a reasoning effort) as the harmony
//! conversation gpt-oss was trained on, ready for the assistant's reply.
//!
//! - The system message is openai-harmony's `SystemContent.new()` (no current date, so a prompt is the
//!   same whenever it is rendered) with the requested reasoning effort.
//! - The chat's leading system messages become the developer message's instructions (as gpt-oss's own
//!   chat template does), the offered tools its `functions` namespace; a later system message is a
//!   developer message where it stands.
//! - An assistant turn is its reasoning on `analysis`, its text on `final` (on `commentary`, as a
//!   preamble, when it calls tools), and each call on `commentary` to `functions.NAME` with
//!   `<|constrain|>json` arguments, as the model writes them.
//! - A tool result comes from `functions.NAME` (the call its `tool_call_id` answers names the tool) to
//!   the assistant on `commentary`.

use super::{
    render_harmony, Content, DeveloperContent, HarmonyMessage, HarmonyRole, Json, ReasoningEffort,
    RenderMode, SystemContent, ToolDescription, ToolNamespace, CONSTRAIN,
};
use crate::chat::{ChatMessage, Role};
use crate::Piece;
use anyhow::{bail, Context, Result};
use serde::Deserialize;
use std::collections::BTreeMap;

/// OpenAI's tool object: `{"type": "function", "function": {...}}`.
#[derive(Deserialize)]
struct Tool {
    #[serde(rename = "type")]
    kind: String,
    function: Function,
}

#[derive(Deserialize)]
struct Function {
    name: String,
    #[serde(default)]
    description: Option<String>,
    #[serde(default)]
    parameters: Option<Json>,
}

/// The prompt for the assistant's reply to `messages`, offering the tools in `tools_json` (OpenAI's tool
/// objects as a JSON list) at `effort` (`None`: harmony's default, medium).
pub fn render_chat(
    messages: &[ChatMessage],
    tools_json: Option<&str>,
    effort: Option<ReasoningEffort>,
) -> Result<Vec<Piece>> {
    let conversation = conversation(messages, tools_json, effort)?;
    render_harmony(
        &conversation,
        RenderMode::Completion(HarmonyRole::Assistant),
    )
}

/// The harmony messages of a chat (see the module docs).
pub fn conversation(
    messages: &[ChatMessage],
    tools_json: Option<&str>,
    effort: Option<ReasoningEffort>,
) -> Result<Vec<HarmonyMessage>> {
    let system = SystemContent {
        reasoning_effort: Some(effort.unwrap_or(ReasoningEffort::Medium)),
        ..SystemContent::new()
    };
    let mut out = vec![HarmonyMessage {
        content: vec![Content::SystemContent(system)],
        ..HarmonyMessage::text(HarmonyRole::System, "")
    }];
    let leading = messages
        .iter()
        .take_while(|m| m.role == Role::System)
        .count();
    let instructions: Vec<&str> = messages[..leading]
        .iter()
        .map(|m| m.content.as_str())
        .collect();
    let developer = DeveloperContent {
        instructions: (!instructions.is_empty()).then(|| instructions.join("\n\n")),
        tools: tools_json.map(functions).transpose()?,
    };
    if developer.instructions.is_some() || developer.tools.is_some() {
        out.push(HarmonyMessage {
            content: vec![Content::DeveloperContent(developer)],
            ..HarmonyMessage::text(HarmonyRole::Developer, "")
        });
    }
    for (i, m) in messages.iter().enumerate().skip(leading) {
        match m.role {
            Role::System => out.push(HarmonyMessage::text(HarmonyRole::Developer, &m.content)),
            Role::User => out.push(HarmonyMessage::text(HarmonyRole::User, &m.content)),
            Role::Assistant => assistant(m, &mut out),
            Role::Tool => out.push(HarmonyMessage {
                name: Some(format!("functions.{}", tool_name(&messages[..i], m)?)),
                channel: Some("commentary".into()),
                recipient: Some("assistant".into()),
                ..HarmonyMessage::text(HarmonyRole::Tool, &m.content)
            }),
        }
    }
    Ok(out)
}

fn assistant(m: &ChatMessage, out: &mut Vec<HarmonyMessage>) {
    let on = |channel: &str, text: &str| HarmonyMessage {
        channel: Some(channel.into()),
        ..HarmonyMessage::text(HarmonyRole::Assistant, text)
    };
    if let Some(reasoning) = m.reasoning.as_deref().filter(|r| !r.is_empty()) {
        out.push(on("analysis", reasoning));
    }
    if m.tool_calls.is_empty() {
        out.push(on("final", &m.content));
        return;
    }
    if !m.content.is_empty() {
        out.push(on("commentary", &m.content));
    }
    for call in &m.tool_calls {
        out.push(HarmonyMessage {
            recipient: Some(format!("functions.{}", call.name)),
            content_type: Some(format!("{CONSTRAIN}json")),
            ..on("commentary", &call.arguments)
        });
    }
}

/// The name of the tool whose call `result` answers: the name of the earlier call with its id, else the
/// result's own name.
fn tool_name(before: &[ChatMessage], result: &ChatMessage) -> Result<String> {
    let id = result.tool_call_id.as_deref().unwrap_or_default();
    let called = before
        .iter()
        .rev()
        .flat_map(|m| &m.tool_calls)
        .find(|c| c.id == id);
    match (called, &result.name) {
        (Some(call), _) => Ok(call.name.clone()),
        (None, Some(name)) => Ok(name.clone()),
        (None, None) => bail!(
            "the tool result for tool_call_id {id:?} answers no earlier tool call; harmony names the tool \
             that answers, so give the assistant's call with that id"
        ),
    }
}

/// The `functions` namespace of OpenAI's tool objects.
fn functions(tools_json: &str) -> Result<BTreeMap<String, ToolNamespace>> {
    let tools: Vec<Tool> = serde_json::from_str(tools_json).context(
        "tools must be a list of {\"type\": \"function\", \"function\": {\"name\", \"description\", \"parameters\"}}",
    )?;
    let mut described = Vec::with_capacity(tools.len());
    for tool in tools {
        if tool.kind != "function" {
            bail!(
                "tool type {:?} is not supported with harmony; use \"function\"",
                tool.kind
            );
        }
        described.push(ToolDescription {
            name: tool.function.name,
            description: tool.function.description.unwrap_or_default(),
            parameters: tool.function.parameters,
        });
    }
    let namespace = ToolNamespace {
        name: "functions".into(),
        description: None,
        tools: described,
    };
    Ok(BTreeMap::from([("functions".to_string(), namespace)]))
}
