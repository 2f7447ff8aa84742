//! Anthropic's Messages API (`/v1/messages`) end to end over loopback: the same prompt and tokens as the chat
//! endpoint, Anthropic's reply, stream and error shapes, stop sequences, tools, thinking and x-api-key.

mod common;

use common::*;
use deltafin_server::ServerConfig;
use serde_json::{json, Value};

fn messages_body(extra: Value) -> Value {
    let body = json!({
        "model": MODEL,
        "system": "Be brief.",
        "messages": [{"role": "user", "content": "Name a colour."}],
        "max_tokens": 12,
        "temperature": 0,
        "thinking": {"type": "disabled"},
    });
    merged(body, &extra)
}

/// The text of a reply's text blocks.
fn text_of(reply: &Value) -> String {
    reply["content"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|b| b["type"] == "text")
        .map(|b| b["text"].as_str().unwrap())
        .collect()
}

fn stream_events(addr: std::net::SocketAddr, body: &Value) -> Vec<(String, Value)> {
    let mut st = Stream::open(addr, "/v1/messages", body);
    assert_eq!(st.status, 200);
    st.events()
}

#[test]
fn a_message_is_the_chat_endpoints_reply_in_anthropics_shape() {
    let s = start(config());
    let chat = post(
        s.addr,
        "/v1/chat/completions",
        &json!({"model": MODEL, "max_tokens": 12, "temperature": 0, "reasoning_effort": "none",
                "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]}),
    )
    .json();
    let r = post(s.addr, "/v1/messages", &messages_body(json!({})));
    assert_eq!(r.status, 200, "{}", r.body);
    let m = r.json();
    assert_eq!(m["type"], "message");
    assert_eq!(m["role"], "assistant");
    assert_eq!(m["model"], MODEL);
    assert!(m["id"].as_str().unwrap().starts_with("msg_"), "{m}");
    // The same prompt, greedy: the same tokens and text.
    assert_eq!(
        text_of(&m),
        chat["choices"][0]["message"]["content"].as_str().unwrap()
    );
    let u = &m["usage"];
    assert_eq!(
        u["input_tokens"].as_u64().unwrap() + u["cache_read_input_tokens"].as_u64().unwrap(),
        chat["usage"]["prompt_tokens"].as_u64().unwrap()
    );
    assert_eq!(u["output_tokens"], chat["usage"]["completion_tokens"]);
    let want_stop = match chat["choices"][0]["finish_reason"].as_str().unwrap() {
        "length" => "max_tokens",
        _ => "end_turn",
    };
    assert_eq!(m["stop_reason"], want_stop);
    assert_eq!(m["stop_sequence"], Value::Null);
    // The second request reuses the first one's prompt state, and says so.
    assert!(u["cache_read_input_tokens"].as_u64().unwrap() > 0, "{u}");

    // Streamed: the same text, in Anthropic's event order.
    let events = stream_events(s.addr, &messages_body(json!({"stream": true})));
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names[0], "message_start");
    assert_eq!(names[names.len() - 2..], ["message_delta", "message_stop"]);
    let start = &events[0].1["message"];
    assert_eq!(
        (start["id"].as_str().is_some(), start["content"].clone()),
        (true, json!([]))
    );
    let streamed: String = events
        .iter()
        .filter(|(n, _)| n == "content_block_delta")
        .map(|(_, d)| {
            assert_eq!(d["index"], 0);
            assert_eq!(d["delta"]["type"], "text_delta");
            d["delta"]["text"].as_str().unwrap().to_string()
        })
        .collect();
    assert_eq!(streamed, text_of(&m));
    assert!(!streamed.is_empty(), "the greedy reply has text");
    let delta = &events[events.len() - 2].1;
    assert_eq!(delta["delta"]["stop_reason"], m["stop_reason"]);
    assert_eq!(delta["usage"]["output_tokens"], u["output_tokens"]);
    assert_eq!(names[1], "content_block_start");
    assert_eq!(
        events[1].1["content_block"],
        json!({"type": "text", "text": ""})
    );
    assert_eq!(names[names.len() - 3], "content_block_stop");
}

#[test]
fn max_tokens_0_computes_the_prompt_into_the_prefix_cache() {
    let s = start(config());
    let long = "Experts stream from the drives while the spine stays in memory. ".repeat(4);
    let first = json!({"role": "user", "content": long});
    let warm = messages_body(json!({"max_tokens": 0, "messages": [first]}));
    let warm = post(s.addr, "/v1/messages", &warm).json();
    assert_eq!(warm["content"], json!([]));
    assert_eq!(warm["stop_reason"], "max_tokens");
    assert_eq!(warm["usage"]["output_tokens"], 0);
    let prompt = warm["usage"]["input_tokens"].as_u64().unwrap();
    // The conversation's next request reads the warmed prefix.
    let next = messages_body(json!({"max_tokens": 4, "messages": [
        first, {"role": "assistant", "content": "Noted."}, {"role": "user", "content": "Why?"}]}));
    let next = post(s.addr, "/v1/messages", &next).json();
    let read = next["usage"]["cache_read_input_tokens"].as_u64().unwrap();
    assert_eq!(read, prompt, "{next}");
}

#[test]
fn a_final_assistant_turn_is_the_start_the_reply_continues() {
    let s = start(config());
    let tokenizer = deltafin_tokenizer::Tokenizer::from_dir(&model_dir()).unwrap();
    let start_text = "The colour is";
    let question = json!({"role": "user", "content": "Name a colour."});
    let count = |messages: Value| {
        let body = json!({"model": MODEL, "system": "Be brief.", "messages": messages,
                          "thinking": {"type": "disabled"}});
        post(s.addr, "/v1/messages/count_tokens", &body).json()["input_tokens"]
            .as_u64()
            .unwrap()
    };
    let plain = count(json!([question]));
    let prefilled = count(json!([question, {"role": "assistant", "content": start_text}]));
    // The prompt is the conversation ready for the answer, then the start's tokens.
    assert_eq!(prefilled, plain + tokenizer.encode(start_text).len() as u64);
    // Without a thinking field the prefill answers without thinking; the reply leaves the start out.
    let body = json!({"model": MODEL, "system": "Be brief.", "max_tokens": 12, "temperature": 0,
                      "messages": [question, {"role": "assistant", "content": start_text}]});
    let r = post(s.addr, "/v1/messages", &body);
    assert_eq!(r.status, 200, "{}", r.body);
    let m = r.json();
    let u = &m["usage"];
    assert_eq!(
        u["input_tokens"].as_u64().unwrap() + u["cache_read_input_tokens"].as_u64().unwrap(),
        prefilled
    );
    assert!(
        m["content"]
            .as_array()
            .unwrap()
            .iter()
            .all(|b| b["type"] == "text"),
        "{m}"
    );

    // Prefilled with the greedy reply's first token, the reply is the rest of that greedy reply.
    let chat = post(
        s.addr,
        "/v1/chat/completions",
        &json!({"model": MODEL, "max_tokens": 12, "temperature": 0, "reasoning_effort": "none",
                "logprobs": true, "messages": [{"role": "system", "content": "Be brief."}, question]}),
    )
    .json();
    let whole = chat["choices"][0]["message"]["content"].as_str().unwrap();
    let first = chat["choices"][0]["logprobs"]["content"][0]["token"]
        .as_str()
        .unwrap();
    assert_eq!(
        tokenizer.encode(first).len(),
        1,
        "{first:?} is one token again"
    );
    let body = json!({"model": MODEL, "system": "Be brief.", "max_tokens": 11, "temperature": 0,
                      "messages": [question, {"role": "assistant", "content": first}]});
    let rest = post(s.addr, "/v1/messages", &body).json();
    assert_eq!(format!("{first}{}", text_of(&rest)), whole);
}

#[test]
fn a_stop_sequence_ends_the_reply_and_is_named() {
    let s = start(config());
    let plain = post(
        s.addr,
        "/v1/messages",
        &messages_body(json!({"max_tokens": 24})),
    )
    .json();
    let text = text_of(&plain);
    let chars: Vec<char> = text.chars().collect();
    assert!(chars.len() >= 8, "greedy text too short: {text:?}");
    let stop: String = chars[4..7].iter().collect();
    let body = messages_body(json!({"max_tokens": 24, "stop_sequences": ["never-appears", stop]}));
    let m = post(s.addr, "/v1/messages", &body).json();
    assert_eq!(text_of(&m), &text[..text.find(&stop).unwrap()]);
    assert_eq!(m["stop_reason"], "stop_sequence");
    assert_eq!(m["stop_sequence"], stop.as_str());
    let mut body = body;
    body["stream"] = json!(true);
    let events = stream_events(s.addr, &body);
    let delta = &events[events.len() - 2].1["delta"];
    assert_eq!(
        (delta["stop_reason"].clone(), delta["stop_sequence"].clone()),
        (json!("stop_sequence"), json!(stop))
    );
}

#[test]
fn tools_thinking_and_tool_history_shape_the_prompt() {
    let s = start(config());
    let input_tokens = |extra: Value| {
        let r = post(s.addr, "/v1/messages", &messages_body(extra));
        assert_eq!(r.status, 200, "{}", r.body);
        let u = &r.json()["usage"];
        u["input_tokens"].as_u64().unwrap() + u["cache_read_input_tokens"].as_u64().unwrap()
    };
    let weather = json!([{"name": "get_weather", "description": "The weather in a city.",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]);
    let history = json!([
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_7", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_7", "content": "18 C, sunny"},
            {"type": "text", "text": "Thanks."}]},
    ]);
    let question = input_tokens(json!({"messages": [history[0].clone()]}));
    let plain = input_tokens(json!({"messages": history}));
    let offered = input_tokens(json!({"messages": history, "tools": weather}));
    let declined = input_tokens(
        json!({"messages": history, "tools": weather, "tool_choice": {"type": "none"}}),
    );
    assert!(plain > question + 10, "{plain} vs {question}");
    assert!(offered > plain + 20, "{offered} vs {plain}");
    assert_eq!(declined, plain);
    // count_tokens renders the same prompt without generating.
    let counted = post(
        s.addr,
        "/v1/messages/count_tokens",
        &json!({"model": MODEL, "system": "Be brief.", "messages": history, "tools": weather,
                "thinking": {"type": "disabled"}}),
    );
    assert_eq!(counted.status, 200, "{}", counted.body);
    assert_eq!(counted.json(), json!({"input_tokens": offered}));
    for endpoint in ["/v1/messages", "/v1/messages/count_tokens"] {
        let name =
            format!("deltafin_http_requests_total{{endpoint=\"{endpoint}\",status=\"200\"}}");
        assert!(metric(s.addr, &name) >= 1.0, "{name}");
    }
    let bad = post(
        s.addr,
        "/v1/messages/count_tokens",
        &json!({"model": MODEL, "messages": history, "max_tokens": 5}),
    );
    assert_eq!(bad.status, 400);
    assert!(bad.json()["error"]["message"]
        .as_str()
        .unwrap()
        .starts_with("max_tokens: "));
    // The chat endpoint, given the same conversation in OpenAI's words, sees the same prompt.
    let chat = post(
        s.addr,
        "/v1/chat/completions",
        &json!({"model": MODEL, "max_tokens": 4, "reasoning_effort": "none", "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "Checking.", "tool_calls": [{"id": "toolu_7", "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "toolu_7", "content": "18 C, sunny"},
            {"role": "user", "content": "Thanks."}]}),
    )
    .json();
    assert_eq!(chat["usage"]["prompt_tokens"].as_u64().unwrap(), plain);
    // Thinking on: K3's default prompt (the think block left open) differs from thinking off, and a
    // budget picks an effort, which K3 is told in a system message.
    let default = input_tokens(json!({"thinking": null}));
    let low = input_tokens(
        json!({"thinking": {"type": "enabled", "budget_tokens": 2000}, "max_tokens": 4000}),
    );
    assert_ne!(default, input_tokens(json!({})));
    assert!(low > default, "{low} vs {default}");
}

#[test]
fn bad_requests_get_anthropic_errors_naming_the_field() {
    let s = start(ServerConfig {
        api_key: Some("k".into()),
        ..config()
    });
    let call = |body: &Value, headers: &[(&str, &str)]| {
        call_with(s.addr, "POST", "/v1/messages", headers, &body.to_string())
    };
    let key = [("x-api-key", "k"), ("anthropic-version", "2023-06-01")];
    assert_eq!(call(&messages_body(json!({})), &key).status, 200);
    let bearer = call(&messages_body(json!({})), &[("Authorization", "Bearer k")]);
    assert_eq!(bearer.status, 200);
    let denied = call(&messages_body(json!({})), &[("x-api-key", "wrong")]);
    assert_eq!(denied.status, 401);
    assert_eq!(denied.json()["error"]["type"], "authentication_error");
    let cases = [
        (json!({"max_tokens": null}), "max_tokens"),
        (json!({"temperature": 1.5}), "temperature"),
        (json!({"top_k": 5}), "top_k"),
        (json!({"stop": ["x"]}), "stop"),
        (json!({"messages": []}), "messages"),
        (
            json!({"messages": [{"role": "system", "content": "x"}]}),
            "messages[0].role",
        ),
        (
            json!({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}),
            "messages[0].content[0].type",
        ),
        (
            json!({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {}}]}]}),
            "messages[0].content[0].type",
        ),
        (
            json!({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": "x"}]}]}),
            "messages[0].content[0].input",
        ),
        (json!({"tools": [{"name": "f"}]}), "tools[0].input_schema"),
        (
            json!({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}),
            "tools[0].type",
        ),
        (json!({"tool_choice": {"type": "any"}}), "tool_choice"),
        (
            json!({"thinking": {"type": "enabled", "budget_tokens": 100}}),
            "thinking",
        ),
        (
            json!({"thinking": {"type": "enabled", "budget_tokens": 2000, "display": "omitted"}, "max_tokens": 4000}),
            "thinking.display",
        ),
        (
            json!({"output_config": {"format": {"type": "json_schema"}}}),
            "output_config.format",
        ),
        (
            json!({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The"}],
                   "thinking": {"type": "adaptive"}}),
            "thinking",
        ),
        (
            json!({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": [
                {"type": "text", "text": "The"}, {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]}),
            "messages[1]",
        ),
        (json!({"model": "other"}), "model"),
    ];
    for (extra, field) in cases {
        let r = call(&messages_body(extra.clone()), &key);
        let e = r.json();
        assert_eq!(e["type"], "error", "{extra}: {}", r.body);
        let message = e["error"]["message"].as_str().unwrap();
        assert!(
            message.starts_with(&format!("{field}: ")),
            "{extra}: {message}"
        );
        let (status, kind) = if field == "model" {
            (404, "not_found_error")
        } else {
            (400, "invalid_request_error")
        };
        assert_eq!(
            (r.status, e["error"]["type"].as_str().unwrap()),
            (status, kind),
            "{extra}"
        );
    }
}

#[test]
fn malformed_requests_get_4xx_never_5xx() {
    let s = start(config());
    let body = messages_body(json!({"max_tokens": 1, "stop_sequences": ["a"],
        "tools": [{"name": "f", "input_schema": {"type": "object"}}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"},
                     {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "text", "text": "r"}]}]},
                     {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]},
                     {"role": "user", "content": "Go"}]}));
    let cases = mutations(&body, 5);
    assert!(cases.len() > 300, "{}", cases.len());
    for (path, b) in [
        ("/v1/messages", &cases),
        ("/v1/messages/count_tokens", &cases),
    ] {
        for c in b {
            let r = post(s.addr, path, c);
            assert!(r.status < 500, "{path} {c}: {} {}", r.status, r.body);
        }
    }
}
