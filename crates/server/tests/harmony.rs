//! A checkpoint whose tokenizer is o200k_harmony chats in harmony: the tiny random K3 checkpoint with
//! gpt-oss's tokenizer files (tests/fixtures/o200k_harmony) and an embedding table that covers its ids.
//! The random model writes no harmony, so the prompt is checked by what the model does with it: a chat's
//! greedy reply is token for token the greedy completion of openai-harmony's render of the same chat.

mod common;
#[path = "../../tokenizer/tests/common/mod.rs"]
mod o200k;

use common::{post, start_on, Stream};
use deltafin_makemodel::{make_padded_model, Arch, Preset};
use deltafin_server::ServerConfig;
use deltafin_tokenizer::chat::harmony::{render_chat, ReasoningEffort};
use deltafin_tokenizer::chat::{ChatMessage, ToolCall};
use deltafin_tokenizer::Tokenizer;
use serde_json::{json, Value};
use std::path::PathBuf;
use std::sync::OnceLock;

/// o200k_harmony's ids run to 201087; the padding rows put them all inside the embedding table.
const O200K_IDS: usize = 201_088;

fn harmony_model() -> PathBuf {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        make_padded_model(Arch::KimiK3, Preset::Tiny, 0, O200K_IDS, dir.path()).unwrap();
        for k3_file in ["tiktoken.model", "tokenizer_config.json"] {
            std::fs::remove_file(dir.path().join(k3_file)).unwrap();
        }
        o200k::write_checkpoint(dir.path());
        dir
    })
    .path()
    .to_path_buf()
}

fn config() -> ServerConfig {
    ServerConfig {
        model_name: "harmony-tiny".into(),
        ..ServerConfig::default()
    }
}

/// The chat the tests send: instructions, a question, an earlier tool call with its reasoning, its result.
fn chat_messages() -> Value {
    json!([
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What is the weather in Tokyo?"},
        {"role": "assistant", "content": null, "reasoning_content": "I need the weather tool.",
         "tool_calls": [{"id": "call_0", "type": "function",
                         "function": {"name": "get_weather", "arguments": "{\"location\":\"Tokyo\"}"}}]},
        {"role": "tool", "tool_call_id": "call_0", "content": "{\"temperature\": 20}"}
    ])
}

fn tools() -> Value {
    json!([{"type": "function", "function": {"name": "get_weather", "description": "Gets the weather.",
            "parameters": {"type": "object", "properties": {"location": {"type": "string"}},
                           "required": ["location"]}}}])
}

/// The same chat as deltafin's messages, rendered by `render_chat` (tested against openai-harmony's
/// renders in the tokenizer crate).
fn expected_prompt(tok: &Tokenizer) -> Vec<u32> {
    let mut call = ChatMessage::assistant("");
    call.reasoning = Some("I need the weather tool.".into());
    call.tool_calls = vec![ToolCall {
        id: "call_0".into(),
        name: "get_weather".into(),
        arguments: "{\"location\":\"Tokyo\"}".into(),
    }];
    let messages = [
        ChatMessage::system("Answer briefly."),
        ChatMessage::user("What is the weather in Tokyo?"),
        call,
        ChatMessage::tool("call_0", "{\"temperature\": 20}"),
    ];
    let tools = tools().to_string();
    let pieces = render_chat(&messages, Some(&tools), Some(ReasoningEffort::High)).unwrap();
    tok.encode_pieces(&pieces)
}

#[test]
fn a_chat_prompt_is_the_harmony_render_of_its_messages_and_tools() {
    let dir = harmony_model();
    let tok = Tokenizer::from_dir(&dir).unwrap();
    let s = start_on(&dir, config());
    let prompt = expected_prompt(&tok);
    let chat = post(
        s.addr,
        "/v1/chat/completions",
        &json!({"model": "harmony-tiny", "messages": chat_messages(), "tools": tools(),
                "reasoning_effort": "high", "max_tokens": 8, "temperature": 0, "logprobs": true}),
    );
    assert_eq!(chat.status, 200, "{}", chat.body);
    let chat = chat.json();
    assert_eq!(chat["usage"]["prompt_tokens"], prompt.len());
    let completion = post(
        s.addr,
        "/v1/completions",
        &json!({"model": "harmony-tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0,
                "logprobs": 0}),
    )
    .json();
    let chat_tokens: Vec<&Value> = chat["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| &t["token"])
        .collect();
    let completion_tokens: Vec<&Value> = completion["choices"][0]["logprobs"]["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .collect();
    assert!(!chat_tokens.is_empty());
    assert_eq!(chat_tokens, completion_tokens);
    // Another effort is another prompt, hence (for this random model) another reply.
    let low = post(
        s.addr,
        "/v1/chat/completions",
        &json!({"model": "harmony-tiny", "messages": chat_messages(), "tools": tools(),
                "reasoning_effort": "low", "max_tokens": 8, "temperature": 0, "logprobs": true}),
    )
    .json();
    assert_eq!(low["usage"]["prompt_tokens"], prompt.len());
    assert_ne!(
        low["choices"][0]["logprobs"],
        chat["choices"][0]["logprobs"]
    );
}

#[test]
fn harmony_chats_stream_and_refuse_what_harmony_cannot_express() {
    let s = start_on(&harmony_model(), config());
    let body = |extra: Value| {
        let mut b = json!({"model": "harmony-tiny", "max_tokens": 6, "temperature": 0,
                           "messages": [{"role": "user", "content": "Hi."}]});
        b.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        b
    };
    let whole = post(s.addr, "/v1/chat/completions", &body(json!({}))).json();
    let mut stream = Stream::open(
        s.addr,
        "/v1/chat/completions",
        &body(json!({"stream": true})),
    );
    assert_eq!(stream.status, 200);
    let chunks = stream.rest();
    assert_eq!(chunks.last().map(String::as_str), Some("[DONE]"));
    let mut content = String::new();
    let mut reasoning = String::new();
    for c in &chunks[..chunks.len() - 1] {
        let c: Value = serde_json::from_str(c).unwrap();
        let delta = &c["choices"][0]["delta"];
        content.push_str(delta["content"].as_str().unwrap_or_default());
        reasoning.push_str(delta["reasoning_content"].as_str().unwrap_or_default());
    }
    let message = &whole["choices"][0]["message"];
    assert_eq!(content, message["content"].as_str().unwrap_or_default());
    assert_eq!(
        reasoning,
        message["reasoning_content"].as_str().unwrap_or_default()
    );
    for (extra, field) in [
        (json!({"reasoning_effort": "none"}), "reasoning_effort"),
        (
            json!({"messages": [{"role": "tool", "tool_call_id": "nope", "content": "1"}]}),
            "messages",
        ),
    ] {
        let r = post(s.addr, "/v1/chat/completions", &body(extra));
        assert_eq!(r.status, 400, "{}", r.body);
        assert_eq!(r.json()["error"]["param"], field, "{}", r.body);
    }
    // Anthropic's final assistant turn starts the reply (prefill), which harmony's prompt cannot express.
    let r = post(
        s.addr,
        "/v1/messages",
        &json!({"model": "harmony-tiny", "max_tokens": 4,
                "messages": [{"role": "user", "content": "Hi."},
                             {"role": "assistant", "content": "Hel"}]}),
    );
    assert_eq!(r.status, 400, "{}", r.body);
    let message = r.json()["error"]["message"].as_str().unwrap().to_string();
    assert!(
        message.starts_with("messages") && message.contains("prefill"),
        "{message}"
    );
}
