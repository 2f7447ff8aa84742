//! Other families' chat templates: the checkpoint's own Jinja template, rendered with minijinja.

use super::{ChatMessage, Role};
use crate::Piece;
use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use std::path::Path;

/// Marks the conversation text inside the render: `SENTINEL_OPEN index SENTINEL_CLOSE`. Private-use
/// code points, which no template writes itself.
const SENTINEL_OPEN: char = '\u{E000}';
const SENTINEL_CLOSE: char = '\u{E001}';

/// A checkpoint's Jinja chat template (Hugging Face conventions: `messages`, `add_generation_prompt`,
/// `bos_token`, `eos_token`, `tools`, `raise_exception`, Python string methods).
pub struct ChatTemplate {
    source: String,
    bos_token: String,
    eos_token: String,
}

/// Its source is long: the size only.
impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ChatTemplate({} bytes)", self.source.len())
    }
}

impl ChatTemplate {
    /// A template from its source and the special names it may refer to as `bos_token`/`eos_token`.
    pub fn new(source: impl Into<String>, bos_token: &str, eos_token: &str) -> Result<Self> {
        let t = ChatTemplate {
            source: source.into(),
            bos_token: bos_token.to_string(),
            eos_token: eos_token.to_string(),
        };
        t.environment()
            .template_from_str(&t.source)
            .context("the chat template does not parse as Jinja")?;
        Ok(t)
    }

    /// Whether the template renders think blocks (`</think>`, as Qwen3's does for the last reply's
    /// `reasoning_content`): its model's replies then start with one.
    pub fn thinks(&self) -> bool {
        self.source.contains(super::THINK_CLOSE)
    }

    /// The template of checkpoint `dir`: `chat_template.jinja` if present, else `chat_template` in
    /// `tokenizer_config.json` (a string, or a list of `{name, template}` of which "default" is used).
    /// `Ok(None)` when the checkpoint has none.
    pub fn from_dir(dir: &Path) -> Result<Option<Self>> {
        let config_path = dir.join("tokenizer_config.json");
        let config: Value = match std::fs::read_to_string(&config_path) {
            Ok(text) => serde_json::from_str(&text)
                .with_context(|| format!("{} is not valid JSON", config_path.display()))?,
            Err(_) => Value::Null,
        };
        let token = |field: &str| match &config[field] {
            Value::String(s) => s.clone(),
            Value::Object(o) => o
                .get("content")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_string(),
            _ => String::new(),
        };
        let jinja_path = dir.join("chat_template.jinja");
        let source = if jinja_path.exists() {
            std::fs::read_to_string(&jinja_path)
                .with_context(|| format!("cannot read {}", jinja_path.display()))?
        } else {
            match &config["chat_template"] {
                Value::String(s) => s.clone(),
                Value::Array(list) => {
                    let default = list
                        .iter()
                        .find(|t| t["name"] == "default")
                        .and_then(|t| t["template"].as_str());
                    match default {
                        Some(s) => s.to_string(),
                        None => bail!(
                            "{}: chat_template lists named templates but none named \"default\"",
                            config_path.display()
                        ),
                    }
                }
                Value::Null => return Ok(None),
                _ => bail!(
                    "{}: chat_template should be a string or a list of {{name, template}}",
                    config_path.display()
                ),
            }
        };
        Self::new(source, &token("bos_token"), &token("eos_token"))
            .with_context(|| format!("in the chat template of {}", dir.display()))
            .map(Some)
    }

    fn environment(&self) -> minijinja::Environment<'_> {
        let mut env = minijinja::Environment::new();
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> Result<(), minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    msg,
                ))
            },
        );
        env
    }

    /// Renders `messages` (and `tools`, a JSON list of tool schemas, if given) into pieces.
    ///
    /// Every conversation string is replaced by a sentinel before rendering and put back as
    /// [`Piece::Text`] afterwards, so special names typed by a user stay ordinary text. A template that
    /// transforms message text (slicing or splitting it, say) breaks that; then the render is redone with
    /// the real text and returned as one [`Piece::Template`] — specials typed by users are then recognised,
    /// as in Hugging Face's own `apply_chat_template`.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        tools: Option<&Value>,
    ) -> Result<Vec<Piece>> {
        let mut texts = Vec::new();
        let with_sentinels = messages_json(messages, &mut |s| {
            texts.push(s.to_string());
            format!("{SENTINEL_OPEN}{}{SENTINEL_CLOSE}", texts.len() - 1)
        });
        let rendered = self.render_json(&with_sentinels, add_generation_prompt, tools)?;
        if let Some(pieces) = split_sentinels(&rendered, &texts) {
            return Ok(pieces);
        }
        let plain = messages_json(messages, &mut |s| s.to_string());
        Ok(vec![Piece::Template(self.render_json(
            &plain,
            add_generation_prompt,
            tools,
        )?)])
    }

    fn render_json(
        &self,
        messages: &Value,
        add_generation_prompt: bool,
        tools: Option<&Value>,
    ) -> Result<String> {
        let env = self.environment();
        let template = env.template_from_str(&self.source)?;
        let ctx = minijinja::context! {
            messages => minijinja::Value::from_serialize(messages),
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.clone(),
            eos_token => self.eos_token.clone(),
            tools => tools.map(minijinja::Value::from_serialize),
        };
        template
            .render(ctx)
            .map_err(|e| anyhow::anyhow!("rendering the chat template failed: {e:#}"))
    }
}

/// Messages in the OpenAI/Hugging Face shape, every conversation string passed through `text`.
/// Tool-call arguments that parse as a JSON object are given as that object (templates commonly
/// iterate or `tojson` them).
fn messages_json(messages: &[ChatMessage], text: &mut dyn FnMut(&str) -> String) -> Value {
    let list: Vec<Value> = messages
        .iter()
        .map(|m| {
            let mut v = json!({"role": m.role.as_str(), "content": text(&m.content)});
            if let Some(name) = &m.name {
                v["name"] = json!(text(name));
            }
            if let Some(r) = &m.reasoning {
                v["reasoning_content"] = json!(text(r));
            }
            if let Some(id) = &m.tool_call_id {
                v["tool_call_id"] = json!(text(id));
            }
            if m.role == Role::Assistant && !m.tool_calls.is_empty() {
                let calls: Vec<Value> = m
                    .tool_calls
                    .iter()
                    .map(|c| {
                        let arguments = match serde_json::from_str::<Value>(&c.arguments) {
                            Ok(Value::Object(o)) => Value::Object(o),
                            _ => json!(text(&c.arguments)),
                        };
                        json!({
                            "id": text(&c.id),
                            "type": "function",
                            "function": {"name": text(&c.name), "arguments": arguments},
                        })
                    })
                    .collect();
                v["tool_calls"] = Value::Array(calls);
            }
            v
        })
        .collect();
    Value::Array(list)
}

/// Splits a render at its sentinels: template text between them, conversation text for them. `None`
/// if any sentinel is missing, repeated or damaged (the template transformed the text).
fn split_sentinels(rendered: &str, texts: &[String]) -> Option<Vec<Piece>> {
    let mut pieces = Vec::new();
    let mut used = vec![false; texts.len()];
    let mut rest = rendered;
    while let Some(open) = rest.find(SENTINEL_OPEN) {
        let after = &rest[open + SENTINEL_OPEN.len_utf8()..];
        let close = after.find(SENTINEL_CLOSE)?;
        let index: usize = after[..close].parse().ok()?;
        if std::mem::replace(used.get_mut(index)?, true) {
            return None;
        }
        if open > 0 {
            pieces.push(Piece::Template(rest[..open].to_string()));
        }
        if !texts[index].is_empty() {
            pieces.push(Piece::Text(texts[index].clone()));
        }
        rest = &after[close + SENTINEL_CLOSE.len_utf8()..];
    }
    if rest.contains(SENTINEL_CLOSE) {
        return None;
    }
    if !rest.is_empty() {
        pieces.push(Piece::Template(rest.to_string()));
    }
    // Texts a template legitimately skips (e.g. reasoning of earlier turns) are fine; damaged ones are not.
    Some(pieces)
}
