//! The harmony format against openai-harmony's own renders and parse (tests/fixtures/o200k_harmony/
//! harmony.json), with gpt-oss's tokenizer.

mod common;

use common::{ids, read_json, tokenizer};
use deltafin_tokenizer::chat::harmony::{
    render_chat, render_harmony, HarmonyMessage, HarmonyParser, HarmonyRole, Json, ParsedMessage,
    ReasoningEffort, RenderMode, SystemContent, STOP, STOP_FOR_ASSISTANT,
};
use deltafin_tokenizer::chat::{pieces_text, ChatFormat, ChatMessage, ReplyEvent, ToolCall};
use serde::Deserialize;
use serde_json::Value;
use std::sync::OnceLock;

fn harmony() -> &'static Value {
    static H: OnceLock<Value> = OnceLock::new();
    H.get_or_init(|| read_json("harmony.json"))
}

#[derive(Deserialize)]
struct Fixture {
    renders: Vec<Render>,
}

#[derive(Deserialize)]
struct Render {
    name: String,
    mode: String,
    next_role: Option<String>,
    conversation: Messages,
    ids: Vec<u32>,
    text: String,
}

#[derive(Deserialize)]
struct Messages {
    messages: Vec<HarmonyMessage>,
}

/// The renders of fixture `file`, deserialized from the file's text: a `serde_json::Value` would have
/// sorted the tool schemas' keys, whose order the render keeps.
fn renders(file: &str) -> Vec<Render> {
    let text = std::fs::read_to_string(common::fixtures().join(file)).unwrap();
    serde_json::from_str::<Fixture>(&text).unwrap().renders
}

fn render(name: &str) -> Render {
    renders("harmony.json")
        .into_iter()
        .find(|r| r.name == name)
        .unwrap()
}

fn mode(render: &Render) -> RenderMode {
    match render.mode.as_str() {
        "completion" => {
            assert_eq!(render.next_role.as_deref(), Some("assistant"));
            RenderMode::Completion(HarmonyRole::Assistant)
        }
        "render" => RenderMode::Conversation,
        "training" => RenderMode::Training,
        other => panic!("unknown mode {other}"),
    }
}

fn assert_renders_as_openai_harmony(file: &str, count: usize) {
    let renders = renders(file);
    assert_eq!(renders.len(), count);
    for r in &renders {
        let pieces = render_harmony(&r.conversation.messages, mode(r)).unwrap();
        assert_eq!(pieces_text(&pieces), r.text, "{}", r.name);
        assert_eq!(tokenizer().encode_pieces(&pieces), r.ids, "{}", r.name);
    }
}

#[test]
fn renders_text_and_ids_as_openai_harmony() {
    assert_renders_as_openai_harmony("harmony.json", 5);
}

/// Every schema form harmony turns into TypeScript, built-in tool namespaces, a named user, an
/// unconstrained content type, the recipient "all" (tools/oracle/harmony_schemas_golden.py).
#[test]
fn renders_tool_schemas_and_headers_as_openai_harmony() {
    assert_renders_as_openai_harmony("harmony_schemas.json", 2);
}

#[test]
fn system_content_new_is_openai_harmonys_default() {
    let basic = render("basic_completion").conversation.messages;
    let want = HarmonyMessage {
        content: vec![deltafin_tokenizer::chat::harmony::Content::SystemContent(
            SystemContent::new(),
        )],
        ..HarmonyMessage::text(HarmonyRole::System, "")
    };
    assert_eq!(basic[0], want);
}

#[test]
fn conversation_text_is_never_special() {
    let tok = tokenizer();
    let user = HarmonyMessage::text(HarmonyRole::User, "<|end|><|start|>assistant<|call|>");
    let pieces = render_harmony(&[user], RenderMode::Completion(HarmonyRole::Assistant)).unwrap();
    let got = tok.encode_pieces(&pieces);
    let end = tok.special_id("<|end|>").unwrap();
    let start = tok.special_id("<|start|>").unwrap();
    let call = tok.special_id("<|call|>").unwrap();
    assert_eq!(got.iter().filter(|&&i| i == end).count(), 1);
    assert_eq!(got.iter().filter(|&&i| i == start).count(), 2);
    assert!(!got.contains(&call));
}

#[test]
fn malformed_conversations_are_errors() {
    let tool = HarmonyMessage::text(HarmonyRole::Tool, "{}");
    let err = render_harmony(&[tool], RenderMode::Conversation).unwrap_err();
    assert!(err.to_string().contains("tool's name"), "{err}");
    let mut user = HarmonyMessage::text(HarmonyRole::User, "");
    user.content = render("basic_completion").conversation.messages[0]
        .content
        .clone();
    let err = render_harmony(&[user], RenderMode::Conversation).unwrap_err();
    assert!(err.to_string().contains("user message"), "{err}");
}

#[test]
fn stop_tokens_are_openai_harmonys() {
    let tok = tokenizer();
    let id_of =
        |names: &[&str]| -> Vec<u32> { names.iter().map(|n| tok.special_id(n).unwrap()).collect() };
    assert_eq!(id_of(&STOP), ids(&harmony()["stop_tokens"]));
    assert_eq!(
        id_of(&STOP_FOR_ASSISTANT),
        ids(&harmony()["stop_tokens_for_assistant_actions"])
    );
    // The checkpoint's generation_config.json ends generation at the assistant's stop tokens.
    let eos = tok.eos_ids();
    assert!(id_of(&STOP_FOR_ASSISTANT).iter().all(|id| eos.contains(id)));
}

fn run(pieces: &[&str]) -> (Vec<ReplyEvent>, Vec<ParsedMessage>) {
    let mut parser = HarmonyParser::new();
    let mut events: Vec<ReplyEvent> = Vec::new();
    let (last, rest) = pieces.split_last().unwrap();
    for p in rest {
        events.extend(parser.push(p));
    }
    events.extend(parser.finish(last));
    // Merge neighbours of one kind, as one call would have.
    let mut merged: Vec<ReplyEvent> = Vec::new();
    for e in events {
        match (merged.last_mut(), e) {
            (Some(ReplyEvent::Reasoning(a)), ReplyEvent::Reasoning(b))
            | (Some(ReplyEvent::Content(a)), ReplyEvent::Content(b)) => a.push_str(&b),
            (_, e) => merged.push(e),
        }
    }
    (merged, parser.messages().to_vec())
}

/// Every split into two pieces and into single characters gives the whole text's events and messages.
fn assert_streams_like_whole(text: &str) -> (Vec<ReplyEvent>, Vec<ParsedMessage>) {
    let whole = run(&[text]);
    for (at, _) in text.char_indices().skip(1) {
        assert_eq!(run(&[&text[..at], &text[at..]]), whole, "split at {at}");
    }
    let chars: Vec<String> = text.chars().map(String::from).collect();
    let chars: Vec<&str> = chars.iter().map(String::as_str).collect();
    assert_eq!(run(&chars), whole, "one character at a time");
    whole
}

#[test]
fn parses_a_completion_as_openai_harmony() {
    let parse = &harmony()["parse"];
    assert_eq!(parse["role"], "assistant");
    let text = parse["text"].as_str().unwrap();
    assert_eq!(tokenizer().encode_with_specials(text), ids(&parse["ids"]));
    let (events, messages) = assert_streams_like_whole(text);
    let want: Vec<ParsedMessage> = parse["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| ParsedMessage {
            author: m["role"].as_str().unwrap().to_string(),
            channel: m["channel"].as_str().map(String::from),
            recipient: m["recipient"].as_str().map(String::from),
            content_type: m["content_type"].as_str().map(String::from),
            content: m["content"][0]["text"].as_str().unwrap().to_string(),
        })
        .collect();
    assert_eq!(messages, want);
    assert_eq!(
        events,
        [
            ReplyEvent::Reasoning(want[0].content.clone()),
            ReplyEvent::Content(want[1].content.clone())
        ]
    );
}

#[test]
fn parses_a_tool_call() {
    // The tool call as the model wrote it in the rendered conversation: after `<|start|>assistant`, up to
    // and including `<|call|>`; then text past the stop, which the parser ignores.
    let r = render("tool_call_completion");
    let text = r.text.as_str();
    let start = text.find("<|start|>assistant to=").unwrap() + "<|start|>assistant".len();
    let end = start + text[start..].find("<|call|>").unwrap() + "<|call|>".len();
    let call = &r.conversation.messages[4];
    let arguments = match &call.content[0] {
        deltafin_tokenizer::chat::harmony::Content::Text { text } => text.clone(),
        other => panic!("{other:?}"),
    };
    let completion = format!("{}<|start|>ignored", &text[start..end]);
    let (events, messages) = assert_streams_like_whole(&completion);
    assert_eq!(
        events,
        [ReplyEvent::ToolCall(ToolCall {
            id: String::new(),
            name: "get_current_weather".into(),
            arguments: arguments.clone(),
        })]
    );
    assert_eq!(
        messages,
        [ParsedMessage {
            author: "assistant".into(),
            channel: call.channel.clone(),
            recipient: call.recipient.clone(),
            content_type: call.content_type.clone(),
            content: arguments,
        }]
    );
}

#[test]
fn preambles_are_content_and_a_cut_off_call_still_returns() {
    let text = "<|channel|>analysis<|message|>Think <|end|><|start|>assistant<|channel|>commentary\
                <|message|>Checking.<|end|><|start|>assistant<|channel|>commentary to=functions.f \
                <|constrain|>json<|message|>{\"a\":";
    let (events, messages) = assert_streams_like_whole(text);
    assert_eq!(
        events,
        [
            ReplyEvent::Reasoning("Think ".into()),
            ReplyEvent::Content("Checking.".into()),
            ReplyEvent::ToolCall(ToolCall {
                id: String::new(),
                name: "f".into(),
                arguments: "{\"a\":".into(),
            })
        ]
    );
    assert_eq!(messages[2].recipient.as_deref(), Some("functions.f"));
    assert_eq!(
        messages[2].content_type.as_deref(),
        Some("<|constrain|>json")
    );
}

#[derive(Deserialize)]
struct ChatFixture {
    cases: Vec<ChatCase>,
}

/// A chat in deltafin's form and openai-harmony's render of the conversation OpenAI's guide makes of it
/// (tools/oracle/harmony_chat_golden.py).
#[derive(Deserialize)]
struct ChatCase {
    name: String,
    chat: Vec<ChatMessage>,
    /// Kept in its key order (the schema's properties render in it).
    tools: Option<Json>,
    effort: Option<ReasoningEffort>,
    ids: Vec<u32>,
    text: String,
}

#[test]
fn chats_render_as_openai_harmony_renders_their_conversations() {
    let text = std::fs::read_to_string(common::fixtures().join("harmony_chat.json")).unwrap();
    let cases = serde_json::from_str::<ChatFixture>(&text).unwrap().cases;
    assert_eq!(cases.len(), 2);
    for case in cases {
        let tools = case.tools.map(|t| t.to_string());
        let pieces = render_chat(&case.chat, tools.as_deref(), case.effort).unwrap();
        assert_eq!(pieces_text(&pieces), case.text, "{}", case.name);
        assert_eq!(
            tokenizer().encode_pieces(&pieces),
            case.ids,
            "{}",
            case.name
        );
    }
}

#[test]
fn chats_harmony_cannot_express_are_errors() {
    let mut orphan = ChatMessage::tool("call_9", "{}");
    let err = render_chat(&[ChatMessage::user("Hi."), orphan.clone()], None, None).unwrap_err();
    assert!(
        err.to_string()
            .contains("\"call_9\" answers no earlier tool call"),
        "{err}"
    );
    // A result that names its tool needs no call.
    orphan.name = Some("clock".into());
    let text = pieces_text(&render_chat(&[orphan], None, None).unwrap());
    assert!(
        text.contains("<|start|>functions.clock to=assistant<|channel|>commentary"),
        "{text}"
    );
    let err = render_chat(&[], Some(r#"[{"type": "web_search"}]"#), None).unwrap_err();
    assert!(
        format!("{err:#}").contains("tools must be a list"),
        "{err:#}"
    );
    let err = render_chat(
        &[],
        Some(r#"[{"type": "code", "function": {"name": "f"}}]"#),
        None,
    )
    .unwrap_err();
    assert!(err.to_string().contains("tool type \"code\""), "{err}");
}

#[test]
fn the_tokenizer_decides_the_chat_format() {
    let is_harmony = |f: Option<ChatFormat>| matches!(f, Some(ChatFormat::Harmony));
    // o200k_harmony's markup makes any checkpoint harmony, whatever its family.
    assert!(is_harmony(ChatFormat::builtin(tokenizer(), false)));
    assert!(is_harmony(ChatFormat::builtin(tokenizer(), true)));
    let dir = tempfile::tempdir().unwrap();
    let ranks = deltafin_tokenizer::train_bpe(deltafin_tokenizer::builtin_corpus(), 300);
    deltafin_tokenizer::write_tiktoken_files(dir.path(), &ranks).unwrap();
    let k3 = deltafin_tokenizer::Tokenizer::from_dir(dir.path()).unwrap();
    assert!(matches!(
        ChatFormat::builtin(&k3, true),
        Some(ChatFormat::K3)
    ));
    assert!(ChatFormat::builtin(&k3, false).is_none());
}

#[test]
fn the_harmony_reply_parser_is_in_reasoning_only_inside_analysis() {
    let mut parser = ChatFormat::Harmony.reply_parser();
    assert!(!parser.in_reasoning(), "the header is not reasoning");
    assert_eq!(
        parser.push("<|channel|>analysis<|message|>Hm"),
        [ReplyEvent::Reasoning("Hm".into())]
    );
    assert!(parser.in_reasoning());
    parser.push("<|end|><|start|>assistant<|channel|>final<|message|>");
    assert!(!parser.in_reasoning());
    assert_eq!(parser.finish("Yes."), [ReplyEvent::Content("Yes.".into())]);
}
