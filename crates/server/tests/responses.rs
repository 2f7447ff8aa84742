//! OpenAI's Responses API (`/v1/responses`) end to end over loopback: the same prompt and tokens as the chat
//! endpoint, output items, the typed event stream, function-call history and what is refused.

mod common;

use common::*;
use serde_json::{json, Value};

fn responses_body(extra: Value) -> Value {
    let body = json!({
        "model": MODEL,
        "instructions": "Be brief.",
        "input": "Name a colour.",
        "max_output_tokens": 12,
        "temperature": 0,
        "reasoning": {"effort": "none"},
        "store": false,
    });
    merged(body, &extra)
}

fn chat(addr: std::net::SocketAddr, messages: Value) -> Value {
    let body = json!({"model": MODEL, "max_tokens": 12, "temperature": 0, "reasoning_effort": "none",
                      "messages": messages});
    post(addr, "/v1/chat/completions", &body).json()
}

/// The text of a response's message items.
fn output_text(r: &Value) -> String {
    r["output"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|i| i["type"] == "message")
        .flat_map(|i| i["content"].as_array().unwrap().iter())
        .map(|p| p["text"].as_str().unwrap())
        .collect()
}

#[test]
fn a_response_is_the_chat_endpoints_reply_as_output_items() {
    let s = start(config());
    let c = chat(
        s.addr,
        json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]),
    );
    let r = post(s.addr, "/v1/responses", &responses_body(json!({})));
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["object"], "response");
    assert!(v["id"].as_str().unwrap().starts_with("resp_"), "{v}");
    let text = output_text(&v);
    assert!(!text.is_empty());
    assert_eq!(
        text,
        c["choices"][0]["message"]["content"].as_str().unwrap()
    );
    assert_eq!(v["usage"]["input_tokens"], c["usage"]["prompt_tokens"]);
    assert_eq!(v["usage"]["output_tokens"], c["usage"]["completion_tokens"]);
    let (status, reason) = match c["choices"][0]["finish_reason"].as_str().unwrap() {
        "length" => ("incomplete", json!({"reason": "max_output_tokens"})),
        _ => ("completed", Value::Null),
    };
    assert_eq!(
        (v["status"].as_str().unwrap(), &v["incomplete_details"]),
        (status, &reason)
    );

    // Streamed: typed events, numbered in order, the text in deltas, the whole response at the end.
    let mut st = Stream::open(
        s.addr,
        "/v1/responses",
        &responses_body(json!({"stream": true})),
    );
    assert_eq!(st.status, 200);
    let events: Vec<Value> = st.events().into_iter().map(|(_, d)| d).collect();
    for (i, e) in events.iter().enumerate() {
        assert_eq!(e["sequence_number"], i);
    }
    let kinds: Vec<&str> = events.iter().map(|e| e["type"].as_str().unwrap()).collect();
    assert_eq!(kinds[..2], ["response.created", "response.in_progress"]);
    assert_eq!(
        kinds[2..5],
        [
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.delta"
        ]
    );
    let streamed: String = events
        .iter()
        .filter(|e| e["type"] == "response.output_text.delta")
        .map(|e| e["delta"].as_str().unwrap())
        .collect();
    assert_eq!(streamed, text);
    let last = events.last().unwrap();
    assert_eq!(last["type"], format!("response.{status}"));
    // The same items; their ids are the response's own.
    let without_ids = |r: &Value| {
        let mut out = r["output"].clone();
        for item in out.as_array_mut().unwrap() {
            item["id"] = Value::Null;
        }
        out
    };
    assert_eq!(without_ids(&last["response"]), without_ids(&v));
    assert_eq!(
        last["response"]["usage"]["output_tokens"],
        v["usage"]["output_tokens"]
    );
}

#[test]
fn function_calls_and_their_outputs_are_the_chat_endpoints_tool_history() {
    let s = start(config());
    let tools = json!([{"type": "function", "name": "get_weather", "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]);
    let input = json!([
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "Use the tool."}]},
        {"type": "function_call", "call_id": "call_7", "name": "get_weather", "arguments": "{\"city\":\"Paris\"}"},
        {"type": "function_call_output", "call_id": "call_7", "output": "18 C, sunny"},
    ]);
    // As Codex sends it: nothing stored, encrypted reasoning asked for (there is none), the default verbosity.
    let extra = json!({"input": input, "tools": tools, "include": ["reasoning.encrypted_content"],
                       "text": {"verbosity": "medium"}, "prompt_cache_key": "k", "parallel_tool_calls": false});
    let r = post(s.addr, "/v1/responses", &responses_body(extra));
    assert_eq!(r.status, 200, "{}", r.body);
    let c = post(
        s.addr,
        "/v1/chat/completions",
        &json!({"model": MODEL, "max_tokens": 2, "reasoning_effort": "none", "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": null, "reasoning_content": "Use the tool.", "tool_calls": [
                {"id": "call_7", "type": "function",
                 "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "call_7", "content": "18 C, sunny"}],
            "tools": [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]}),
    )
    .json();
    assert_eq!(
        r.json()["usage"]["input_tokens"],
        c["usage"]["prompt_tokens"]
    );
}

#[test]
fn what_the_responses_api_cannot_do_is_refused_naming_the_field() {
    let s = start(config());
    let cases = [
        (
            json!({"previous_response_id": "resp_1"}),
            "previous_response_id",
        ),
        (
            json!({"tool_choice": "required", "tools": []}),
            "tool_choice",
        ),
        (
            json!({"text": {"format": {"type": "json_schema", "schema": {}}}}),
            "text",
        ),
        (json!({"text": {"verbosity": "low"}}), "text"),
        (json!({"tools": [{"type": "web_search"}]}), "tools[0].type"),
        (
            json!({"tools": [{"type": "function", "name": "f", "strict": true}]}),
            "tools[0].strict",
        ),
        (json!({"truncation": "auto"}), "truncation"),
        (json!({"input": []}), "input"),
        (
            json!({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}),
            "input[0].content[0]",
        ),
        (
            json!({"input": [{"type": "file_search_call", "id": "x"}]}),
            "input[0].type",
        ),
        (
            json!({"reasoning": {"effort": "extreme"}}),
            "reasoning.effort",
        ),
        (json!({"frobnicate": 1}), "frobnicate"),
    ];
    for (extra, param) in cases {
        let r = post(s.addr, "/v1/responses", &responses_body(extra.clone()));
        assert_eq!(r.status, 400, "{extra}: {}", r.body);
        assert_eq!(r.json()["error"]["param"], param, "{extra}: {}", r.body);
    }
}

#[test]
fn malformed_requests_get_4xx_never_5xx() {
    let s = start(config());
    let body = responses_body(json!({"max_output_tokens": 1,
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
                  {"type": "reasoning", "summary": [{"type": "summary_text", "text": "t"}]},
                  {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                  {"type": "function_call_output", "call_id": "c", "output": "r"}],
        "text": {"format": {"type": "text"}}}));
    let cases = mutations(&body, 5);
    assert!(cases.len() > 300, "{}", cases.len());
    for c in &cases {
        let r = post(s.addr, "/v1/responses", c);
        assert!(r.status < 500, "{c}: {} {}", r.status, r.body);
    }
}
