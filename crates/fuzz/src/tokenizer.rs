//! The tokenizer's files, chat templates and the streaming reply parser. Tokenizer files are written to a
//! temporary directory and loaded the way a checkpoint's are.

use base64::engine::general_purpose::STANDARD as BASE64;
use base64::Engine;
use deltafin_tokenizer::chat::{
    harmony::HarmonyParser, parse_reply, ChatMessage, ChatTemplate, ReplyEvent, ReplyParser,
    ToolCall,
};
use deltafin_tokenizer::Tokenizer;
use std::path::Path;

/// A tokenizer config whose one added token lies past any rank a fuzzed `tiktoken.model` can have.
const CONFIG: &str = r#"{"added_tokens_decoder": {"1000000": {"content": "<|im_end|>"}}, "eos_token": "<|im_end|>"}"#;

/// Text that exercises ordinary text, a special name and a multi-byte character.
const TEXT: &str = "hello <|im_end|> wörld 123";

/// A temporary directory holding `files`.
fn dir_with(files: &[(&str, &[u8])]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("a temporary directory");
    for (name, bytes) in files {
        std::fs::write(dir.path().join(name), bytes).expect("writing a temporary file");
    }
    dir
}

fn load(files: &[(&str, &[u8])]) -> Option<Tokenizer> {
    Tokenizer::from_dir(dir_with(files).path()).ok()
}

/// Whatever loads must encode and decode without failing on its own ids.
fn exercise(tok: &Tokenizer) {
    let ids = tok.encode_with_specials(TEXT);
    tok.decode(&ids)
        .expect("decoding ids the tokenizer produced");
    tok.decode(&tok.encode(TEXT))
        .expect("decoding ids the tokenizer produced");
}

/// `tiktoken.model`, rank 0..256 for each single byte, as the tokenizer needs.
fn byte_ranks() -> String {
    use std::fmt::Write;
    let mut out = String::new();
    for b in 0..=255u8 {
        writeln!(out, "{} {b}", BASE64.encode([b])).unwrap();
    }
    out
}

pub fn tiktoken(data: &[u8]) {
    if let Some(tok) = load(&[
        ("tiktoken.model", data),
        ("tokenizer_config.json", CONFIG.as_bytes()),
    ]) {
        exercise(&tok);
    }
}

/// `tokenizer_config.json`, for the tokenizer and for the chat template it may carry.
pub fn config(data: &[u8]) {
    let dir = dir_with(&[
        ("tiktoken.model", byte_ranks().as_bytes()),
        ("tokenizer_config.json", data),
    ]);
    if let Ok(tok) = Tokenizer::from_dir(dir.path()) {
        exercise(&tok);
    }
    render(dir.path());
}

pub fn hf_json(data: &[u8]) {
    if let Some(tok) = load(&[("tokenizer.json", data)]) {
        exercise(&tok);
    }
}

/// A conversation with every role, a tool call and tools offered.
fn conversation() -> (Vec<ChatMessage>, serde_json::Value) {
    let mut assistant = ChatMessage::assistant("Let me look.");
    assistant.reasoning = Some("The user wants the weather.".into());
    assistant.tool_calls.push(ToolCall {
        id: "call_1".into(),
        name: "weather".into(),
        arguments: r#"{"city": "Paris"}"#.into(),
    });
    let messages = vec![
        ChatMessage::system("Be brief."),
        ChatMessage::user("Weather in Paris? <|im_end|>"),
        assistant,
        ChatMessage::tool("call_1", "sunny"),
    ];
    let tools = serde_json::json!([{"type": "function", "function": {"name": "weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]);
    (messages, tools)
}

/// A template's source as `chat_template.jinja`, loaded and rendered.
pub fn chat_template(data: &[u8]) {
    render(dir_with(&[("chat_template.jinja", data)]).path());
}

fn render(dir: &Path) {
    if let Ok(Some(t)) = ChatTemplate::from_dir(dir) {
        let (messages, tools) = conversation();
        let _ = t.render(&messages, true, Some(&tools));
        let _ = t.render(&messages[..2], false, None);
    }
}

/// A reply parser fed in pieces: K3's and harmony's.
trait Parser {
    fn push(&mut self, text: &str) -> Vec<ReplyEvent>;
    fn finish(&mut self, text: &str) -> Vec<ReplyEvent>;
}

impl Parser for ReplyParser {
    fn push(&mut self, text: &str) -> Vec<ReplyEvent> {
        ReplyParser::push(self, text)
    }
    fn finish(&mut self, text: &str) -> Vec<ReplyEvent> {
        ReplyParser::finish(self, text)
    }
}

impl Parser for HarmonyParser {
    fn push(&mut self, text: &str) -> Vec<ReplyEvent> {
        HarmonyParser::push(self, text)
    }
    fn finish(&mut self, text: &str) -> Vec<ReplyEvent> {
        HarmonyParser::finish(self, text)
    }
}

/// Reasoning, content and tool calls of `events`, joined.
fn joined(events: Vec<ReplyEvent>) -> (String, String, Vec<ToolCall>) {
    let mut out = (String::new(), String::new(), Vec::new());
    for e in events {
        match e {
            ReplyEvent::Reasoning(t) => out.0.push_str(&t),
            ReplyEvent::Content(t) => out.1.push_str(&t),
            ReplyEvent::ToolCall(c) => out.2.push(c),
        }
    }
    out
}

/// `parser` fed the text in pieces (cut where the input's bytes say), then finished.
fn streamed(mut parser: impl Parser, data: &[u8], text: &str) -> (String, String, Vec<ToolCall>) {
    let mut rest = text;
    let mut cuts = data.iter().map(|&b| 1 + b as usize % 7);
    let mut events = Vec::new();
    while !rest.is_empty() {
        let mut at = cuts.next().unwrap_or(rest.len()).min(rest.len());
        while !rest.is_char_boundary(at) {
            at += 1;
        }
        events.extend(parser.push(&rest[..at]));
        rest = &rest[at..];
    }
    events.extend(parser.finish(""));
    joined(events)
}

/// The reply parsed whole must equal the reply streamed in pieces, for K3's parser and harmony's.
pub fn reply(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let whole = parse_reply(&text);
    assert_eq!(
        (whole.reasoning, whole.content, whole.tool_calls),
        streamed(ReplyParser::new(), data, &text),
        "streaming {text:?} in pieces parsed differently from the whole"
    );
    let mut harmony = HarmonyParser::new();
    let whole = joined(harmony.finish(&text));
    assert_eq!(
        whole,
        streamed(HarmonyParser::new(), data, &text),
        "harmony: streaming {text:?} in pieces parsed differently from the whole"
    );
}
