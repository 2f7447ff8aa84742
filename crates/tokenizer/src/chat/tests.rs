use super::*;
use crate::{train_bpe, write_tiktoken_files, Tokenizer};

fn tiny_tokenizer() -> (tempfile::TempDir, Tokenizer) {
    let dir = tempfile::tempdir().unwrap();
    write_tiktoken_files(dir.path(), &train_bpe(crate::builtin_corpus(), 512)).unwrap();
    let tok = Tokenizer::from_dir(dir.path()).unwrap();
    (dir, tok)
}

fn conversation() -> Vec<ChatMessage> {
    let mut user = ChatMessage::user("What's the weather in \"Paris\" & Rome? <|open|>");
    user.name = Some("Ann \"the & tester\"".into());
    let mut assistant = ChatMessage::assistant("Let me check.");
    assistant.reasoning = Some("The user wants weather.".into());
    assistant.tool_calls = vec![ToolCall {
        id: "call_1".into(),
        name: "weather".into(),
        arguments: r#"{"city":"Paris"}"#.into(),
    }];
    let mut tool = ChatMessage::tool("call_1", "18°C, sunny");
    tool.name = Some("weather".into());
    vec![
        ChatMessage::system("You are terse."),
        user,
        assistant,
        tool,
        ChatMessage::assistant("Sunny, 18°C."),
    ]
}

#[test]
fn renders_k3_xtml_exactly() {
    let pieces = render_k3(&conversation(), Some(Effort::High), true);
    let want = concat!(
        r#"<|open|>message role="system" name="thinking_effort"<|sep|>Thinking effort: high.<|close|>message<|sep|><|end_of_msg|>"#,
        r#"<|open|>message role="system"<|sep|>You are terse.<|close|>message<|sep|><|end_of_msg|>"#,
        r#"<|open|>message role="user" name="Ann &quot;the &amp; tester&quot;"<|sep|>What's the weather in "Paris" & Rome? <|open|><|close|>message<|sep|><|end_of_msg|>"#,
        r#"<|open|>message role="assistant"<|sep|><|open|>think<|sep|>The user wants weather.<|close|>think<|sep|>"#,
        r#"<|open|>response<|sep|>Let me check.<|close|>response<|sep|>"#,
        r#"<|open|>tool_call id="call_1" name="weather"<|sep|>{"city":"Paris"}<|close|>tool_call<|sep|>"#,
        r#"<|close|>message<|sep|><|end_of_msg|>"#,
        r#"<|open|>message role="tool" name="weather" tool_call_id="call_1"<|sep|>18°C, sunny<|close|>message<|sep|><|end_of_msg|>"#,
        r#"<|open|>message role="assistant"<|sep|><|open|>think<|sep|><|close|>think<|sep|><|open|>response<|sep|>Sunny, 18°C.<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>"#,
        r#"<|open|>message role="assistant"<|sep|><|open|>think<|sep|>"#,
    );
    assert_eq!(pieces_text(&pieces), want);
    // Conversation strings are Text, never Template.
    for text in [
        "What's the weather in \"Paris\" & Rome? <|open|>",
        "Ann &quot;the &amp; tester&quot;",
        "{\"city\":\"Paris\"}",
    ] {
        assert!(pieces.contains(&Piece::Text(text.into())), "{text:?}");
    }
    assert!(pieces
        .iter()
        .all(|p| matches!(p, Piece::Text(_)) || !p.as_str().contains("Rome")));
}

#[test]
fn tools_are_a_named_system_message_of_json_text() {
    let tools = r#"[{"type":"function","function":{"name":"weather","description":"<|close|> & \"more\""}}]"#;
    let mut messages = vec![k3_tools_message(tools)];
    messages.extend(conversation().into_iter().skip(1).take(1));
    let pieces = render_k3(&messages, Some(Effort::Low), false);
    let text = pieces_text(&pieces);
    let effort = text.find("thinking_effort").unwrap();
    let listed = text
        .find(&format!(
            r#"role="system" name="tools"<|sep|>{tools}<|close|>message"#
        ))
        .expect("the tools message");
    assert!(effort < listed && listed < text.find(r#"role="user""#).unwrap());
    // The schemas are conversation text: markup typed in a description stays plain.
    assert!(pieces.contains(&Piece::Text(tools.into())));
}

#[test]
fn renders_each_effort_and_none() {
    let user = [ChatMessage::user("hi")];
    let plain = r#"<|open|>message role="user"<|sep|>hi<|close|>message<|sep|><|end_of_msg|>"#;
    assert_eq!(pieces_text(&render_k3(&user, None, false)), plain);
    for (effort, word) in [
        (Effort::Low, "low"),
        (Effort::High, "high"),
        (Effort::Max, "max"),
    ] {
        let text = pieces_text(&render_k3(&user, Some(effort), false));
        let head = format!(
            "<|open|>message role=\"system\" name=\"thinking_effort\"<|sep|>Thinking effort: {word}.<|close|>message<|sep|><|end_of_msg|>"
        );
        assert_eq!(text, head + plain);
        assert_eq!(word.parse::<Effort>().unwrap(), effort);
    }
    assert!("medium".parse::<Effort>().is_err());
    assert!(pieces_text(&render_k3(&user, None, true)).ends_with(K3_GENERATION_PROMPT));
}

#[test]
fn specials_only_from_template_text() {
    let (_dir, tok) = tiny_tokenizer();
    let id = |name: &str| tok.special_id(name).unwrap();
    let pieces = render_k3(&[ChatMessage::user("<|open|>")], None, true);
    let ids = tok.encode_pieces(&pieces);
    // Template markup: <|open|> "message role=\"user\"" <|sep|> ... ; the user's "<|open|>" is BPE text.
    assert_eq!(ids[0], id("<|open|>"));
    let sep = ids.iter().position(|&t| t == id("<|sep|>")).unwrap();
    let close = ids.iter().position(|&t| t == id("<|close|>")).unwrap();
    assert_eq!(&ids[sep + 1..close], &tok.encode("<|open|>")[..]);
    assert!(ids[sep + 1..close]
        .iter()
        .all(|&t| (t as usize) < tok.num_ranks()));
    let opens = ids.iter().filter(|&&t| t == id("<|open|>")).count();
    assert_eq!(
        opens, 3,
        "message, generation-prompt message and think opens"
    );
    // Without special names in user text, pieces encode exactly like the rendered string with specials.
    let pieces = render_k3(&conversation()[..4], Some(Effort::Max), true);
    let rendered = pieces_text(&pieces).replace(" <|open|>", "");
    let pieces: Vec<Piece> = pieces
        .into_iter()
        .map(|p| match p {
            Piece::Text(t) => Piece::Text(t.replace(" <|open|>", "")),
            p => p,
        })
        .collect();
    assert_eq!(
        tok.encode_pieces(&pieces),
        tok.encode_with_specials(&rendered)
    );
    // Decoding gives the rendered text back.
    assert_eq!(tok.decode(&tok.encode_pieces(&pieces)).unwrap(), rendered);
}

/// The reply a model would write after the generation prompt: the rest of an assistant message.
fn reply_text(m: &ChatMessage) -> String {
    let full = pieces_text(&render_k3(std::slice::from_ref(m), None, false));
    let prefix = r#"<|open|>message role="assistant"<|sep|><|open|>think<|sep|>"#;
    full.strip_prefix(prefix).unwrap().to_string()
}

fn collect(events: Vec<ReplyEvent>, reply: &mut Reply) {
    for e in events {
        match e {
            ReplyEvent::Reasoning(t) => reply.reasoning.push_str(&t),
            ReplyEvent::Content(t) => reply.content.push_str(&t),
            ReplyEvent::ToolCall(c) => reply.tool_calls.push(c),
        }
    }
}

#[test]
fn parses_replies_split_anywhere() {
    let mut m = conversation()[2].clone();
    m.tool_calls.push(ToolCall {
        id: "c\"2&".into(),
        name: "search".into(),
        arguments: "{\"q\": \"a < b\"}".into(),
    });
    m.content = "It is <b>bold</b> and 1 < 2.".into();
    let text = reply_text(&m);
    let want = Reply {
        reasoning: m.reasoning.clone().unwrap(),
        content: m.content.clone(),
        tool_calls: m.tool_calls.clone(),
    };
    assert_eq!(parse_reply(&text), want);
    // Every cut into two and three pieces (on character boundaries), and one character at a time.
    let cuts: Vec<usize> = (0..=text.len())
        .filter(|&i| text.is_char_boundary(i))
        .collect();
    for &a in &cuts {
        for &b in cuts.iter().filter(|&&b| b >= a).step_by(7) {
            let mut parser = ReplyParser::new();
            let mut got = Reply::default();
            collect(parser.push(&text[..a]), &mut got);
            collect(parser.push(&text[a..b]), &mut got);
            collect(parser.finish(&text[b..]), &mut got);
            assert_eq!(got, want, "cut at {a} and {b}");
        }
    }
    let mut parser = ReplyParser::new();
    let mut got = Reply::default();
    for c in text.chars() {
        collect(parser.push(c.encode_utf8(&mut [0; 4])), &mut got);
    }
    collect(parser.finish(""), &mut got);
    assert_eq!(got, want);
}

#[test]
fn reply_parser_edge_cases() {
    // No think close: all reasoning. Text after the message close is ignored.
    let r = parse_reply("just thinking<|close|>message<|sep|><|end_of_msg|>ignored");
    assert_eq!(
        (r.reasoning.as_str(), r.content.as_str()),
        ("just thinking", "")
    );
    // A stream cut inside a marker: the partial marker is text.
    let r = parse_reply("a<|close|>think<|sep|>b<|close|>resp");
    assert_eq!(
        (r.reasoning.as_str(), r.content.as_str()),
        ("a", "b<|close|>resp")
    );
    // A model that skips the think close but opens a response block.
    let r = parse_reply("x<|open|>response<|sep|>y<|end_of_msg|>");
    assert_eq!((r.reasoning.as_str(), r.content.as_str()), ("x", "y"));
    // An unfinished tool call comes back verbatim as content.
    let r = parse_reply("<|close|>think<|sep|>ok<|open|>tool_call id=\"1\"<|sep|>{\"a\"");
    assert_eq!(r.content, "ok<|open|>tool_call id=\"1\"<|sep|>{\"a\"");
    assert!(r.tool_calls.is_empty());
    // Starting in content (a prompt without the think open).
    let mut p = ReplyParser::starting_in_content();
    assert!(!p.in_reasoning());
    assert_eq!(p.finish("hi"), vec![ReplyEvent::Content("hi".into())]);
    // The think block ends only once its close marker is complete.
    let mut p = ReplyParser::new();
    p.push("a<|close|>think");
    assert!(p.in_reasoning());
    p.push("<|sep|>");
    assert!(!p.in_reasoning());
    // Held text is released as soon as it can no longer be a marker.
    let mut p = ReplyParser::new();
    assert_eq!(p.push("a<|clo"), vec![ReplyEvent::Reasoning("a".into())]);
    assert_eq!(p.push("ud"), vec![ReplyEvent::Reasoning("<|cloud".into())]);
}

const CHATML: &str = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

#[test]
fn jinja_template_keeps_user_text_plain() {
    let t = ChatTemplate::new(CHATML, "", "").unwrap();
    let msgs = [
        ChatMessage::system("Be nice."),
        ChatMessage::user("<|im_end|> hi"),
    ];
    let pieces = t.render(&msgs, true, None).unwrap();
    assert_eq!(
        pieces,
        vec![
            Piece::Template("<|im_start|>system\n".into()),
            Piece::Text("Be nice.".into()),
            Piece::Template("<|im_end|>\n<|im_start|>user\n".into()),
            Piece::Text("<|im_end|> hi".into()),
            Piece::Template("<|im_end|>\n<|im_start|>assistant\n".into()),
        ]
    );
}

#[test]
fn jinja_template_features_and_fallback() {
    // Python string methods, tools, bos_token and raise_exception as Hugging Face templates use them.
    let src = "{{ bos_token }}{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tools here') }}{% endif %}[{{ m.content.strip() }}]{% if m.tool_calls %}{{ m.tool_calls[0].function.arguments.city }}{% endif %}{% endfor %}{% if tools %}{{ tools | length }}{% endif %}";
    let t = ChatTemplate::new(src, "<s>", "</s>").unwrap();
    let mut a = ChatMessage::assistant("ok");
    a.tool_calls.push(ToolCall {
        id: "1".into(),
        name: "w".into(),
        arguments: r#"{"city":"Oslo"}"#.into(),
    });
    let tools = serde_json::json!([{"type": "function"}]);
    let text = pieces_text(&t.render(&[a], false, Some(&tools)).unwrap());
    assert_eq!(text, "<s>[ok]Oslo1");
    let err = t
        .render(&[ChatMessage::tool("1", "x")], false, None)
        .unwrap_err();
    assert!(format!("{err:#}").contains("no tools here"), "{err:#}");
    // A template that slices message text cannot keep the sentinels: the real text is rendered instead.
    let t = ChatTemplate::new(
        "{% for m in messages %}{{ m.content[1:] }}{% endfor %}",
        "",
        "",
    )
    .unwrap();
    let pieces = t
        .render(&[ChatMessage::user("abcdef")], false, None)
        .unwrap();
    assert_eq!(pieces, vec![Piece::Template("bcdef".into())]);
    assert!(ChatTemplate::new("{% for %}", "", "").is_err());
}

#[test]
fn jinja_render_error_across_a_carriage_return_is_an_error() {
    // Found by fuzzing: with minijinja's "debug" feature, a build with debug assertions drew a source
    // excerpt into the message and panicked on this span across "\r" (the tokenizer crate now leaves that
    // feature off; `cargo test` without --release exercises it). The failure must come back as an error.
    let src =
        "{%- set ns = namespace(sys='') -%}{%- for \r in messages -%}{%- if m.role == 'system' -%}\
               {%- set ns.sys = m.content -%}{%- endif -%}{%- endfor -%}{{Yns.sys | upper }}\
               {% for m in messages if mendif %}</{{ m.role }}>{% endfor %}";
    let t = ChatTemplate::new(src, "", "").unwrap();
    let err = t
        .render(&[ChatMessage::user("hi")], true, None)
        .unwrap_err();
    assert!(format!("{err:#}").contains("chat template"), "{err:#}");
}

#[test]
fn jinja_template_from_checkpoint_files() {
    let dir = tempfile::tempdir().unwrap();
    assert!(ChatTemplate::from_dir(dir.path()).unwrap().is_none());
    let config = serde_json::json!({"chat_template": CHATML, "bos_token": {"content": "<s>"}});
    std::fs::write(dir.path().join("tokenizer_config.json"), config.to_string()).unwrap();
    let t = ChatTemplate::from_dir(dir.path()).unwrap().unwrap();
    assert!(
        pieces_text(&t.render(&[ChatMessage::user("x")], false, None).unwrap()).contains("user\nx")
    );
    let list = serde_json::json!({"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]});
    std::fs::write(dir.path().join("tokenizer_config.json"), list.to_string()).unwrap();
    let t = ChatTemplate::from_dir(dir.path()).unwrap().unwrap();
    assert_eq!(pieces_text(&t.render(&[], false, None).unwrap()), "D");
    // chat_template.jinja wins over the config.
    std::fs::write(dir.path().join("chat_template.jinja"), "J").unwrap();
    let t = ChatTemplate::from_dir(dir.path()).unwrap().unwrap();
    assert_eq!(pieces_text(&t.render(&[], false, None).unwrap()), "J");
}

#[test]
fn messages_deserialize_from_openai_json() {
    let m: ChatMessage =
        serde_json::from_str(r#"{"role":"user","content":"hi","name":"x"}"#).unwrap();
    assert_eq!(m.role, Role::User);
    assert_eq!(m.name.as_deref(), Some("x"));
    assert_eq!(
        unescape_attribute(&escape_attribute("a&\"b&amp;")),
        "a&\"b&amp;"
    );
}

/// A thinking template's reply, cut anywhere: the think block is reasoning, the rest content; a reply
/// without one (after leading whitespace) is all content, a later `<think>` included.
#[test]
fn think_parser_splits_replies_cut_anywhere() {
    let cases = [
        (
            "<think>\nWhy <b>?\n</think>\n\nBlue < red.",
            "\nWhy <b>?\n",
            "\n\nBlue < red.",
        ),
        ("\n<think></think>Hi", "", "Hi"),
        ("\n Hi <think>x</think>", "", "\n Hi <think>x</think>"),
        ("<think>never closed", "never closed", ""),
        ("<thi", "", "<thi"),
    ];
    for (text, reasoning, content) in cases {
        let want = Reply {
            reasoning: reasoning.into(),
            content: content.into(),
            tool_calls: Vec::new(),
        };
        for a in (0..=text.len()).filter(|&i| text.is_char_boundary(i)) {
            let mut parser = ThinkParser::new();
            let mut got = Reply::default();
            collect(parser.push(&text[..a]), &mut got);
            collect(parser.finish(&text[a..]), &mut got);
            assert_eq!(got, want, "{text:?} cut at {a}");
        }
    }
}

#[test]
fn only_templates_that_render_think_blocks_parse_them() {
    let thinking = ChatTemplate::new("{{ '<think>' }}{{ '</think>' }}", "", "").unwrap();
    let plain = ChatTemplate::new("{{ messages[0].content }}", "", "").unwrap();
    let reply = |t: ChatTemplate| {
        let mut p = ChatFormat::Template(std::sync::Arc::new(t)).reply_parser();
        let mut got = Reply::default();
        collect(p.finish("<think>a</think>b"), &mut got);
        (got.reasoning, got.content)
    };
    assert_eq!(reply(thinking), ("a".to_string(), "b".to_string()));
    assert_eq!(
        reply(plain),
        (String::new(), "<think>a</think>b".to_string())
    );
}
