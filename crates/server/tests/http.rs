//! The HTTP API end to end over loopback, with a raw client: shapes, field validation, auth, limits,
//! streaming, stop strings, seeds, logprobs, prefix reuse, backpressure, cancellation and shutdown.

mod common;

use common::*;
use deltafin_engine::Guesser;
use serde_json::{json, Value};
use std::time::Duration;

fn chat_body(extra: Value) -> Value {
    let base = json!({
        "model": MODEL,
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}],
        "max_tokens": 8,
        "temperature": 0,
        "reasoning_effort": "none",
    });
    merged(base, &extra)
}

fn error_param(r: &Resp) -> String {
    r.json()["error"]["param"]
        .as_str()
        .unwrap_or("")
        .to_string()
}

/// Posts `body` to `path` and expects a 400 whose `param` is `param`; the response, for further checks.
fn assert_rejected(addr: std::net::SocketAddr, path: &str, body: &Value, param: &str) -> Resp {
    let r = post(addr, path, body);
    assert_eq!(
        (r.status, error_param(&r)),
        (400, param.to_string()),
        "{body}: {}",
        r.body
    );
    r
}

#[test]
fn models_health_metrics_and_unknown_routes() {
    let s = start(config());
    let h = get(s.addr, "/health");
    assert_eq!((h.status, h.json()["status"].clone()), (200, json!("ok")));
    let m = get(s.addr, "/v1/models").json();
    assert_eq!(m["data"][0]["id"], MODEL);
    assert_eq!(get(s.addr, &format!("/v1/models/{MODEL}")).status, 200);
    let other = get(s.addr, "/v1/models/gpt-4");
    assert_eq!(
        (other.status, other.json()["error"]["code"].clone()),
        (404, json!("model_not_found"))
    );
    let nf = get(s.addr, "/v2/nothing");
    assert_eq!(nf.status, 404);
    assert!(nf.json()["error"]["message"].is_string());
    let metrics = get(s.addr, "/metrics");
    assert!(metrics
        .header("content-type")
        .unwrap()
        .starts_with("text/plain"));
    for name in [
        "deltafin_queue_depth 0",
        "deltafin_completion_tokens_total 0",
        "deltafin_batched_passes_total 0",
        "deltafin_expert_bytes_read_total",
        "deltafin_http_requests_total{endpoint=\"/v1/models\",status=\"200\"} 2",
    ] {
        assert!(
            metrics.body.contains(name),
            "{name} missing from\n{}",
            metrics.body
        );
    }
}

#[test]
fn chat_answers_in_openai_shape_and_reuses_the_prompt_state() {
    let s = start(config());
    let r = post(s.addr, "/v1/chat/completions", &chat_body(json!({})));
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["model"], MODEL);
    let choice = &v["choices"][0];
    assert_eq!(choice["message"]["role"], "assistant");
    assert!(choice["message"]["content"].is_string());
    assert!(["stop", "length"].contains(&choice["finish_reason"].as_str().unwrap()));
    let usage = &v["usage"];
    let completion = usage["completion_tokens"].as_u64().unwrap();
    assert!((1..=8).contains(&completion));
    assert_eq!(
        usage["total_tokens"].as_u64().unwrap(),
        usage["prompt_tokens"].as_u64().unwrap() + completion
    );
    assert_eq!(usage["prompt_tokens_details"]["cached_tokens"], 0);

    // The same conversation again resumes the stored prompt state and answers identically (greedy).
    let again = post(s.addr, "/v1/chat/completions", &chat_body(json!({}))).json();
    assert_eq!(again["choices"][0]["message"], choice["message"]);
    assert_eq!(
        again["usage"]["prompt_tokens_details"]["cached_tokens"],
        usage["prompt_tokens"]
    );

    // A follow-up turn extends the first prompt; only its new tokens are computed.
    let mut follow = chat_body(json!({}));
    follow["messages"].as_array_mut().unwrap().extend([
        json!({"role": "assistant", "content": choice["message"]["content"]}),
        json!({"role": "user", "content": [{"type": "text", "text": "Another"}, {"type": "text", "text": " one."}]}),
    ]);
    let next = post(s.addr, "/v1/chat/completions", &follow).json();
    let cached = next["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(
        cached > 0 && cached < next["usage"]["prompt_tokens"].as_u64().unwrap(),
        "{next}"
    );
    assert!(metric(s.addr, "deltafin_prefix_cache_hits_total") >= 2.0);
}

#[test]
fn thinking_goes_to_reasoning_content() {
    let s = start(config());
    let mut body = chat_body(json!({"max_tokens": 6}));
    body.as_object_mut().unwrap().remove("reasoning_effort");
    let v = post(s.addr, "/v1/chat/completions", &body).json();
    let usage = &v["usage"];
    assert!(
        usage["completion_tokens_details"]["reasoning_tokens"]
            .as_u64()
            .unwrap()
            > 0,
        "{v}"
    );
    let high = post(
        s.addr,
        "/v1/chat/completions",
        &chat_body(json!({"reasoning_effort": "high"})),
    );
    assert_eq!(high.status, 200);
    let bad = post(
        s.addr,
        "/v1/chat/completions",
        &chat_body(json!({"reasoning_effort": "extreme"})),
    );
    assert_eq!(
        (bad.status, error_param(&bad)),
        (400, "reasoning_effort".into())
    );
}

#[test]
fn bad_requests_get_openai_shaped_400s_naming_the_field() {
    let s = start(config());
    let cases: Vec<(Value, &str)> = vec![
        (json!({"frobnicate": 1}), "frobnicate"),
        (json!({"n": 0}), "n"),
        (json!({"n": 17}), "n"),
        (json!({"temperature": "hot"}), "temperature"),
        (json!({"temperature": 3}), "temperature"),
        (json!({"top_p": 0}), "top_p"),
        (json!({"stop": ["a", "b", "c", "d", "e"]}), "stop"),
        (
            json!({"tools": [{"type": "function"}]}),
            "tools[0].function",
        ),
        (json!({"tools": {"type": "function"}}), "tools"),
        (
            json!({"tools": [{"type": "function", "function": {"name": "a b"}}]}),
            "tools[0].function.name",
        ),
        (
            json!({"tools": [{"type": "function", "function": {"name": "f", "strict": true}}]}),
            "tools[0].function.strict",
        ),
        (
            json!({"tools": [{"type": "function", "function": {"name": "f", "colour": 1}}]}),
            "tools[0].function.colour",
        ),
        (
            json!({"tools": [{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "f"}}]}),
            "tools[1].function.name",
        ),
        (json!({"tool_choice": "required"}), "tool_choice"),
        (json!({"parallel_tool_calls": "yes"}), "parallel_tool_calls"),
        (json!({"functions": [{"name": "f"}]}), "functions"),
        (json!({"top_logprobs": 3}), "top_logprobs"),
        (json!({"presence_penalty": 9}), "presence_penalty"),
        (json!({"max_tokens": 0}), "max_tokens"),
        (
            json!({"stream_options": {"include_usage": true}}),
            "stream_options",
        ),
        (json!({"messages": []}), "messages"),
        (
            json!({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
            "messages[0].content[0]",
        ),
        (
            json!({"messages": [{"role": "user", "content": "x", "colour": 1}]}),
            "messages[0].colour",
        ),
        (
            json!({"messages": [{"role": "critic", "content": "x"}]}),
            "messages[0].role",
        ),
        (
            json!({"messages": [{"role": "tool", "content": "x"}]}),
            "messages[0].tool_call_id",
        ),
        (
            json!({"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]}),
            "messages[0].tool_call_id",
        ),
        (
            json!({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f"}}]}]}),
            "messages[0].tool_calls[0].function.arguments",
        ),
        (
            json!({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}),
            "messages[0].tool_calls",
        ),
        (json!({"max_tokens": 1_000_000}), "messages"),
        (json!({"logit_bias": {"x": 1}}), "logit_bias"),
    ];
    for (extra, param) in cases {
        let r = assert_rejected(s.addr, "/v1/chat/completions", &chat_body(extra), param);
        assert_eq!(r.json()["error"]["type"], "invalid_request_error");
    }
    // Ignored fields are fine.
    let ok = post(
        s.addr,
        "/v1/chat/completions",
        &chat_body(json!({"user": "u1", "metadata": {"k": "v"}, "seed": 3})),
    );
    assert_eq!(ok.status, 200, "{}", ok.body);
    let not_json = call_with(s.addr, "POST", "/v1/chat/completions", &[], "{nope");
    assert_eq!(
        (not_json.status, error_param(&not_json)),
        (400, "body".into())
    );
    let wrong_model = post(
        s.addr,
        "/v1/chat/completions",
        &chat_body(json!({"model": "gpt-4o"})),
    );
    assert_eq!(wrong_model.status, 404);
    for (extra, param) in [
        (json!({"echo": true}), "echo"),
        (
            json!({"tools": [{"type": "function", "function": {"name": "f"}}]}),
            "tools",
        ),
        (json!({"logprobs": 9}), "logprobs"),
        (json!({"prompt": [[1], [2]]}), "prompt"),
    ] {
        let body = merged(json!({"model": MODEL, "prompt": "hi"}), &extra);
        assert_rejected(s.addr, "/v1/completions", &body, param);
    }
}

#[test]
fn tools_are_offered_in_the_prompt_and_tool_history_is_accepted() {
    let s = start(config());
    let weather = json!([{"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }}]);
    let history = json!([
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_7", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_7", "content": "18 C, sunny"},
    ]);
    let prompt_tokens = |extra: Value| {
        let r = post(s.addr, "/v1/chat/completions", &chat_body(extra));
        assert_eq!(r.status, 200, "{}", r.body);
        let v = r.json();
        // This random model writes no calls: the answer is plain content.
        assert!(
            v["choices"][0]["message"].get("tool_calls").is_none(),
            "{v}"
        );
        v["usage"]["prompt_tokens"].as_u64().unwrap()
    };
    let plain = prompt_tokens(json!({"messages": history}));
    let offered =
        prompt_tokens(json!({"messages": history, "tools": weather, "parallel_tool_calls": false}));
    let auto = prompt_tokens(json!({"messages": history, "tools": weather, "tool_choice": "auto"}));
    let declined =
        prompt_tokens(json!({"messages": history, "tools": weather, "tool_choice": "none"}));
    // The tools message holds the schemas' JSON; "none" leaves the model uninformed of them.
    assert!(offered > plain + 20, "{offered} vs {plain}");
    assert_eq!(auto, offered);
    assert_eq!(declined, plain);
    // The history's call and result are in the prompt: it is longer than the question alone.
    let question = prompt_tokens(json!({"messages": [history[0].clone()]}));
    assert!(plain > question + 10, "{plain} vs {question}");
}

#[test]
fn a_drafter_changes_no_reply_and_is_counted() {
    let other = tempfile::tempdir().unwrap();
    deltafin_makemodel::make_model(
        deltafin_makemodel::Arch::KimiK3,
        deltafin_makemodel::Preset::Tiny,
        1,
        other.path(),
    )
    .unwrap();
    let bodies = [
        json!({"model": MODEL, "prompt": "Drives stream weights while", "max_tokens": 20,
               "temperature": 0, "logprobs": 2}),
        json!({"model": MODEL, "prompt": "Drives stream weights while", "max_tokens": 20,
               "temperature": 1.0, "seed": 99, "logprobs": 2}),
        chat_body(json!({"max_tokens": 12, "temperature": 0.7, "seed": 5})),
        // Streamed: every chunk's choices (the text or delta, logprobs, finish reason) in order.
        json!({"model": MODEL, "prompt": "Drives stream weights while", "max_tokens": 16,
               "temperature": 0, "logprobs": 2, "stream": true}),
        chat_body(json!({"max_tokens": 16, "temperature": 0.8, "seed": 7, "stream": true})),
    ];
    let replies = |cfg: deltafin_server::ServerConfig| {
        let s = start(cfg);
        let out: Vec<Value> = bodies
            .iter()
            .map(|b| {
                let path = if b.get("messages").is_some() {
                    "/v1/chat/completions"
                } else {
                    "/v1/completions"
                };
                if b["stream"] != json!(true) {
                    let r = post(s.addr, path, b);
                    assert_eq!(r.status, 200, "{}", r.body);
                    return r.json()["choices"][0].clone();
                }
                let mut st = Stream::open(s.addr, path, b);
                assert_eq!(st.status, 200);
                let payloads = st.rest();
                assert_eq!(payloads.last().map(String::as_str), Some("[DONE]"));
                let chunks = &payloads[..payloads.len() - 1];
                assert!(chunks.len() > 2, "streamed token by token");
                chunks
                    .iter()
                    .map(|p| serde_json::from_str::<Value>(p).unwrap()["choices"].clone())
                    .collect()
            })
            .collect();
        (out, get(s.addr, "/metrics").body)
    };
    let (plain, _) = replies(config());
    // The model as its own drafter (every guess right), another model (mostly wrong), and prompt lookup.
    let model_guesser = |dir: &std::path::Path| {
        Guesser::Model(std::sync::Arc::new(
            deltafin_models::Model::load(dir).unwrap(),
        ))
    };
    for (name, guesser) in [
        ("itself", model_guesser(&model_dir())),
        ("another", model_guesser(other.path())),
        ("ngram", Guesser::Ngram),
    ] {
        let mut cfg = config();
        cfg.scheduler.drafter = Some(deltafin_engine::Drafter {
            guesser,
            tokens: 3,
            fixed: true,
        });
        let (drafted, metrics) = replies(cfg);
        assert_eq!(drafted, plain, "drafter {name}");
        let count = |outcome: &str| -> f64 {
            let line = format!("deltafin_draft_tokens_total{{outcome=\"{outcome}\"}} ");
            let at = metrics.find(&line).expect("the draft counter");
            metrics[at + line.len()..]
                .lines()
                .next()
                .unwrap()
                .parse()
                .unwrap()
        };
        assert!(count("accepted") <= count("proposed"));
        if name != "ngram" {
            assert!(count("proposed") > 0.0, "drafter {name} guessed");
        }
        if name == "itself" {
            assert!(count("accepted") > 0.0, "the model agrees with itself");
        }
    }
}

#[test]
fn a_family_with_a_jinja_template_chats_through_it() {
    use deltafin_tokenizer::chat::{ChatMessage, ChatTemplate};
    let dir = tempfile::tempdir().unwrap();
    deltafin_makemodel::make_model(
        deltafin_makemodel::Arch::KimiLinear,
        deltafin_makemodel::Preset::Tiny,
        0,
        dir.path(),
    )
    .unwrap();
    let serve = |template: Option<ChatTemplate>| {
        let model = std::sync::Arc::new(deltafin_models::Model::load(dir.path()).unwrap());
        let tokenizer =
            std::sync::Arc::new(deltafin_tokenizer::Tokenizer::from_dir(dir.path()).unwrap());
        let cfg = deltafin_server::ServerConfig {
            chat_template: template.map(std::sync::Arc::new),
            ..config()
        };
        deltafin_server::Running::start("127.0.0.1:0".parse().unwrap(), model, tokenizer, cfg)
            .unwrap()
    };
    let body = json!({"model": MODEL, "max_tokens": 6, "temperature": 0,
                      "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]});
    // Without a template this family cannot chat (its checkpoint has none): completions only.
    let s = serve(None);
    let r = post(s.addr, "/v1/chat/completions", &body);
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.body.contains("no chat template"), "{}", r.body);
    assert_eq!(
        post(
            s.addr,
            "/v1/completions",
            &json!({"model": MODEL, "prompt": "Hi", "max_tokens": 2})
        )
        .status,
        200
    );
    drop(s);

    let source = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}";
    let s = serve(Some(ChatTemplate::new(source, "", "").unwrap()));
    let r = post(s.addr, "/v1/chat/completions", &body);
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert!(v["choices"][0]["message"]["content"].is_string(), "{v}");
    assert!(
        v["choices"][0]["message"]
            .get("reasoning_content")
            .is_none(),
        "{v}"
    );
    // The prompt is exactly the template's rendering.
    let tok = deltafin_tokenizer::Tokenizer::from_dir(dir.path()).unwrap();
    let pieces = ChatTemplate::new(source, "", "")
        .unwrap()
        .render(
            &[ChatMessage::system("Be brief."), ChatMessage::user("Hi")],
            true,
            None,
        )
        .unwrap();
    assert_eq!(
        v["usage"]["prompt_tokens"].as_u64().unwrap() as usize,
        tok.encode_pieces(&pieces).len()
    );
    // What only K3's format expresses is refused.
    let tools = json!([{"type": "function", "function": {"name": "f"}}]);
    for (extra, param) in [
        (json!({"tools": tools}), "tools"),
        (json!({"reasoning_effort": "high"}), "reasoning_effort"),
    ] {
        let b = merged(body.clone(), &extra);
        assert_rejected(s.addr, "/v1/chat/completions", &b, param);
    }
}

#[test]
fn logit_bias_bans_and_forces_tokens() {
    let s = start(config());
    let body = |bias: Value| {
        json!({"model": MODEL, "prompt": "Drives stream weights while", "max_tokens": 6,
               "temperature": 0, "logprobs": 1, "logit_bias": bias})
    };
    let tokens = |r: &Resp| -> Vec<String> {
        assert_eq!(r.status, 200, "{}", r.body);
        r.json()["choices"][0]["logprobs"]["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_str().unwrap().to_string())
            .collect()
    };
    let tok = deltafin_tokenizer::Tokenizer::from_dir(&model_dir()).unwrap();
    let plain = tokens(&post(s.addr, "/v1/completions", &body(json!({}))));
    // Banning the greedy first token changes it.
    let first = tok.encode(&plain[0]);
    assert_eq!(first.len(), 1, "{:?}", plain[0]);
    let banned = tokens(&post(
        s.addr,
        "/v1/completions",
        &body(json!({first[0].to_string(): -100})),
    ));
    assert_ne!(banned[0], plain[0]);
    assert!(!banned.contains(&plain[0]), "{banned:?}");
    // A +100 bias makes one token win every step.
    let forced_id = tok.encode(" the")[0];
    let forced = tokens(&post(
        s.addr,
        "/v1/completions",
        &body(json!({forced_id.to_string(): 100})),
    ));
    let text = tok.decode(&[forced_id]).unwrap();
    assert!(forced.iter().all(|t| *t == text), "{forced:?}");
    for bad in [
        json!({"abc": 1}),
        json!({"5": 101}),
        json!({"5": "x"}),
        json!([1]),
        json!({"5": 1, "05": 2}),
        json!({"99999999": 1}),
    ] {
        assert_rejected(s.addr, "/v1/completions", &body(bad), "logit_bias");
    }
}

#[test]
fn api_key_and_body_limit() {
    let s = start(deltafin_server::ServerConfig {
        api_key: Some("sekrit".into()),
        max_body_bytes: 2048,
        ..config()
    });
    let body = chat_body(json!({})).to_string();
    let none = call_with(s.addr, "POST", "/v1/chat/completions", &[], &body);
    assert_eq!(
        (none.status, none.json()["error"]["code"].clone()),
        (401, json!("invalid_api_key"))
    );
    let wrong = call_with(
        s.addr,
        "GET",
        "/v1/models",
        &[("Authorization", "Bearer nope")],
        "",
    );
    assert_eq!(wrong.status, 401);
    let right = call_with(
        s.addr,
        "POST",
        "/v1/chat/completions",
        &[("Authorization", "Bearer sekrit")],
        &body,
    );
    assert_eq!(right.status, 200, "{}", right.body);
    assert_eq!(get(s.addr, "/health").status, 200, "health needs no key");
    let big = chat_body(json!({"messages": [{"role": "user", "content": "x".repeat(10_000)}]}))
        .to_string();
    let r = call_with(
        s.addr,
        "POST",
        "/v1/chat/completions",
        &[("Authorization", "Bearer sekrit")],
        &big,
    );
    assert_eq!(r.status, 413, "{}", r.body);
    assert_eq!(r.json()["error"]["code"], "request_too_large");
}

/// The concatenated `content` deltas of a chat stream, and its payloads.
fn stream_chat(addr: std::net::SocketAddr, body: &Value) -> (String, Vec<Value>) {
    let mut st = Stream::open(addr, "/v1/chat/completions", body);
    assert_eq!(st.status, 200);
    let payloads = st.rest();
    assert_eq!(payloads.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = payloads[..payloads.len() - 1]
        .iter()
        .map(|p| serde_json::from_str(p).unwrap())
        .collect();
    let text = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    (text, chunks)
}

#[test]
fn streaming_matches_the_plain_answer_and_reports_usage() {
    let s = start(config());
    let body = chat_body(json!({"max_tokens": 12, "temperature": 0.9, "seed": 42}));
    let plain = post(s.addr, "/v1/chat/completions", &body).json();
    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    sbody["stream_options"] = json!({"include_usage": true});
    let (text, chunks) = stream_chat(s.addr, &sbody);
    assert_eq!(
        text,
        plain["choices"][0]["message"]["content"].as_str().unwrap(),
        "same seed, same tokens"
    );
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(chunks[0]["object"], "chat.completion.chunk");
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"], json!([]));
    assert_eq!(
        last["usage"]["completion_tokens"],
        plain["usage"]["completion_tokens"]
    );
    let finish = &chunks[chunks.len() - 2]["choices"][0]["finish_reason"];
    assert_eq!(finish, &plain["choices"][0]["finish_reason"]);
    assert!(chunks[..chunks.len() - 1]
        .iter()
        .all(|c| c["usage"].is_null()));

    // Completions stream too, with logprobs per token.
    let cbody = json!({"model": MODEL, "prompt": "The expert store", "max_tokens": 6, "temperature": 0,
                       "logprobs": 2, "stream": true});
    let mut st = Stream::open(s.addr, "/v1/completions", &cbody);
    let payloads = st.rest();
    assert_eq!(payloads.last().unwrap(), "[DONE]");
    let mut n_lp = 0;
    for p in &payloads[..payloads.len() - 1] {
        let c: Value = serde_json::from_str(p).unwrap();
        assert_eq!(c["object"], "text_completion");
        if let Some(lp) = c["choices"][0]["logprobs"].as_object() {
            n_lp += lp["tokens"].as_array().unwrap().len();
            assert!(lp["top_logprobs"][0].as_object().unwrap().len() <= 2);
        }
    }
    assert!((1..=6).contains(&n_lp));
}

/// `n` choices: choice i is the reply the same request gets alone with seed + i, every choice generated at once;
/// the usage counts the prompt once and every completion; a stream names each chunk's choice.
#[test]
fn n_choices_are_the_replies_of_seed_plus_i() {
    let s = start(config());
    let one = json!({"model": MODEL, "prompt": "Drives stream weights while", "max_tokens": 12,
                     "temperature": 1.0, "seed": 11, "logprobs": 2});
    let mut body = one.clone();
    body["n"] = json!(3);
    let r = post(s.addr, "/v1/completions", &body);
    assert_eq!(r.status, 200, "{}", r.body);
    let all = r.json();
    let choices = all["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3);
    let mut completion_tokens = 0;
    for (i, c) in choices.iter().enumerate() {
        let mut alone = one.clone();
        alone["seed"] = json!(11 + i);
        let alone = post(s.addr, "/v1/completions", &alone).json();
        let mut expected = alone["choices"][0].clone();
        expected["index"] = json!(i);
        assert_eq!(c, &expected, "choice {i}");
        completion_tokens += alone["usage"]["completion_tokens"].as_u64().unwrap();
        assert_eq!(
            all["usage"]["prompt_tokens"],
            alone["usage"]["prompt_tokens"]
        );
    }
    assert_eq!(all["usage"]["completion_tokens"], json!(completion_tokens));

    // Streamed: each choice's role chunk, its text and its finish, and one usage chunk for all.
    let mut chat = chat_body(json!({"max_tokens": 10, "temperature": 0.8, "seed": 5, "n": 2}));
    let plain = post(s.addr, "/v1/chat/completions", &chat).json();
    chat["stream"] = json!(true);
    chat["stream_options"] = json!({"include_usage": true});
    let (_, chunks) = stream_chat(s.addr, &chat);
    for i in 0..2 {
        let mine: Vec<&Value> = chunks
            .iter()
            .filter(|c| c["choices"][0]["index"] == json!(i))
            .collect();
        assert_eq!(mine[0]["choices"][0]["delta"]["role"], "assistant");
        let text: String = mine
            .iter()
            .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
            .collect();
        assert_eq!(
            text,
            plain["choices"][i]["message"]["content"].as_str().unwrap()
        );
        let finish = &mine.last().unwrap()["choices"][0]["finish_reason"];
        assert_eq!(finish, &plain["choices"][i]["finish_reason"]);
    }
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"], json!([]));
    // (The stream's prompt was cached by the plain request: only the cached count differs.)
    for field in ["prompt_tokens", "completion_tokens", "total_tokens"] {
        assert_eq!(last["usage"][field], plain["usage"][field], "{field}");
    }

    // More choices than the server takes at once: a 400 naming n (a 429 would invite a retry that cannot work).
    let small = start_limited(2, 1);
    let r = assert_rejected(
        small.addr,
        "/v1/completions",
        &json!({"model": MODEL, "prompt": "a", "n": 4}),
        "n",
    );
    assert!(r.body.contains("at most 3"), "{}", r.body);
}

#[test]
fn seeds_logprobs_and_stop_strings() {
    let s = start(config());
    let base = json!({"model": MODEL, "prompt": "Drives stream weights while", "max_tokens": 24,
                      "temperature": 0, "logprobs": 3});
    let plain = post(s.addr, "/v1/completions", &base).json();
    let text = plain["choices"][0]["text"].as_str().unwrap().to_string();
    let lp = &plain["choices"][0]["logprobs"];
    let n = lp["tokens"].as_array().unwrap().len();
    assert!((1..=24).contains(&n));
    assert_eq!(lp["token_logprobs"].as_array().unwrap().len(), n);
    let first_lp = lp["token_logprobs"][0].as_f64().unwrap();
    let best = lp["top_logprobs"][0]
        .as_object()
        .unwrap()
        .values()
        .map(|v| v.as_f64().unwrap())
        .fold(f64::MIN, f64::max);
    assert!(
        first_lp <= 0.0 && (first_lp - best).abs() < 1e-6,
        "greedy picks the most likely token"
    );

    // Same seed → same tokens.
    let mut seeded = base.clone();
    seeded["temperature"] = json!(1.0);
    seeded["seed"] = json!(1234);
    let a = post(s.addr, "/v1/completions", &seeded).json();
    let b = post(s.addr, "/v1/completions", &seeded).json();
    assert_eq!(a["choices"][0]["text"], b["choices"][0]["text"]);
    assert_eq!(a["choices"][0]["logprobs"], b["choices"][0]["logprobs"]);

    // A stop string taken from the middle of the greedy text ends it there, unsent, even when split across tokens.
    let chars: Vec<char> = text.chars().collect();
    assert!(
        chars.len() >= 8,
        "greedy text too short for the test: {text:?}"
    );
    let stop: String = chars[4..7].iter().collect();
    let expected = &text[..text.find(&stop).unwrap()];
    let mut with_stop = base.clone();
    with_stop["stop"] = json!([stop, "never-appears"]);
    let r = post(s.addr, "/v1/completions", &with_stop).json();
    assert_eq!(
        r["choices"][0]["text"], expected,
        "stop {stop:?} in {text:?}"
    );
    assert_eq!(r["choices"][0]["finish_reason"], "stop");
    with_stop["stream"] = json!(true);
    let mut st = Stream::open(s.addr, "/v1/completions", &with_stop);
    let streamed: String = st
        .rest()
        .iter()
        .filter(|p| *p != "[DONE]")
        .map(|p| {
            serde_json::from_str::<Value>(p).unwrap()["choices"][0]["text"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    assert_eq!(streamed, expected);

    // Token-id prompts work; out-of-vocabulary ids are a 400.
    let ids = post(
        s.addr,
        "/v1/completions",
        &json!({"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 2}),
    );
    assert_eq!(ids.status, 200, "{}", ids.body);
    let oov = post(
        s.addr,
        "/v1/completions",
        &json!({"model": MODEL, "prompt": [5, 99999999], "max_tokens": 2}),
    );
    assert_eq!((oov.status, error_param(&oov)), (400, "prompt".into()));
}

/// A long greedy completion that keeps a generation slot busy.
fn long_stream(addr: std::net::SocketAddr) -> Stream {
    let body = json!({"model": MODEL, "prompt": "Keep going", "max_tokens": 60000, "temperature": 0, "stream": true});
    let mut st = Stream::open(addr, "/v1/completions", &body);
    assert_eq!(st.status, 200);
    st.data().expect("a first chunk");
    st
}

/// A server that runs at most `max_active` requests at once and queues `queue` more.
fn start_limited(max_active: usize, queue: usize) -> deltafin_server::Running {
    start(deltafin_server::ServerConfig {
        scheduler: deltafin_engine::SchedulerConfig {
            max_active,
            queue_capacity: queue,
            ..Default::default()
        },
        ..config()
    })
}

#[test]
fn a_full_queue_answers_429_and_a_disconnect_cancels_promptly() {
    let s = start_limited(1, 0);
    let busy = long_stream(s.addr);
    let r = post(s.addr, "/v1/chat/completions", &chat_body(json!({})));
    assert_eq!(r.status, 429, "{}", r.body);
    assert_eq!(r.header("retry-after").as_deref(), Some("1"));
    assert_eq!(r.json()["error"]["type"], "rate_limit_error");
    assert_eq!(metric(s.addr, "deltafin_active_generations"), 1.0);

    drop(busy); // the client goes away mid-generation
    eventually(10, "the generation to be cancelled", || {
        metric(s.addr, "deltafin_generations_total{outcome=\"cancelled\"}") == 1.0
            && metric(s.addr, "deltafin_active_generations") == 0.0
    });
    let r = post(s.addr, "/v1/chat/completions", &chat_body(json!({})));
    assert_eq!(r.status, 200, "the slot is free again");
}

#[test]
fn keep_alive_comments_flow_while_a_long_prompt_is_computed() {
    let s = start(deltafin_server::ServerConfig {
        keep_alive: Duration::from_millis(1),
        scheduler: deltafin_engine::SchedulerConfig {
            prefill_chunk: 4096,
            ..Default::default()
        },
        ..config()
    });
    let prompt: Vec<u32> = (0..3000).map(|i| (i * 7 % 500) as u32).collect();
    let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0, "stream": true});
    let mut st = Stream::open(s.addr, "/v1/completions", &body);
    let first = st.line().unwrap();
    assert!(
        first.starts_with(':'),
        "a comment precedes the first token: {first}"
    );
    assert_eq!(st.rest().last().unwrap(), "[DONE]");
}

#[test]
fn shutdown_finishes_in_flight_streams() {
    let s = start(config());
    let body = json!({"model": MODEL, "prompt": "Short", "max_tokens": 40, "temperature": 0, "stream": true});
    let mut st = Stream::open(s.addr, "/v1/completions", &body);
    st.data().unwrap();
    let stopper = std::thread::spawn(move || s.stop());
    assert_eq!(st.rest().last().unwrap(), "[DONE]", "the stream completes");
    stopper.join().unwrap().unwrap();
}

#[test]
fn a_generation_ended_mid_stream_gets_an_sse_error_event() {
    let s = start(deltafin_server::ServerConfig {
        shutdown_grace: Duration::ZERO,
        ..config()
    });
    let mut st = long_stream(s.addr);
    let stopper = std::thread::spawn(move || s.stop());
    let rest = st.rest();
    let last: Value = serde_json::from_str(rest.last().unwrap()).unwrap();
    assert_eq!(last["error"]["type"], "server_error", "{last}");
    assert!(last["error"]["message"]
        .as_str()
        .unwrap()
        .contains("shutting down"));
    stopper.join().unwrap().unwrap();
}

#[test]
fn malformed_chat_and_completion_requests_get_4xx_never_5xx() {
    let s = start(config());
    let chat = chat_body(
        json!({"max_tokens": 1, "stop": ["a"], "logprobs": true, "top_logprobs": 1,
        "logit_bias": {"5": 1}, "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]},
                     {"role": "assistant", "content": null, "tool_calls": [{"id": "c", "type": "function",
                      "function": {"name": "f", "arguments": "{}"}}]},
                     {"role": "tool", "tool_call_id": "c", "content": "r"}]}),
    );
    let completion =
        json!({"model": MODEL, "prompt": [1, 2], "max_tokens": 1, "logprobs": 1, "seed": 3});
    for (path, body) in [
        ("/v1/chat/completions", chat),
        ("/v1/completions", completion),
    ] {
        let cases = mutations(&body, 5);
        assert!(cases.len() > 50, "{}", cases.len());
        for c in &cases {
            let r = post(s.addr, path, c);
            assert!(r.status < 500, "{path} {c}: {} {}", r.status, r.body);
        }
    }
}

/// Requests that arrive together share batched passes, and each gets exactly the reply it gets alone: the
/// same text, tokens' log-probabilities and usage, sampled or greedy.
#[test]
fn concurrent_requests_share_passes_and_get_the_replies_they_get_alone() {
    let s = start(config());
    let bodies: Vec<Value> = (0..3)
        .map(|i| {
            json!({"model": MODEL, "prompt": format!("Drives stream weights {i} while"),
                   "max_tokens": 64, "temperature": 0.5 * i as f64, "seed": 7 + i, "logprobs": 2})
        })
        .collect();
    let together: Vec<Value> = std::thread::scope(|scope| {
        let calls: Vec<_> = bodies
            .iter()
            .map(|b| scope.spawn(|| post(s.addr, "/v1/completions", b)))
            .collect();
        calls
            .into_iter()
            .map(|c| {
                let r = c.join().unwrap();
                assert_eq!(r.status, 200, "{}", r.body);
                r.json()
            })
            .collect()
    });
    let metrics = get(s.addr, "/metrics").body;
    let count = |name: &str| -> f64 {
        let line = metrics.lines().find(|l| l.starts_with(&format!("{name} ")));
        line.and_then(|l| l.split(' ').nth(1)?.parse().ok())
            .unwrap_or_else(|| panic!("{name} missing from\n{metrics}"))
    };
    let (passes, pieces) = (
        count("deltafin_batched_passes_total"),
        count("deltafin_batched_generations_total"),
    );
    assert!(
        pieces > passes,
        "{pieces} generation pieces in {passes} passes: no pass was shared"
    );
    for (b, t) in bodies.iter().zip(&together) {
        let alone = post(s.addr, "/v1/completions", b).json();
        assert_eq!(t["choices"], alone["choices"], "{b}");
        assert_eq!(
            t["usage"]["completion_tokens"],
            alone["usage"]["completion_tokens"]
        );
    }
}
