//! The official `openai` and `anthropic` Python packages against a running server
//! (tools/clients/{openai,anthropic}_client_test.py). Fails — never skips — when python3 or a package is
//! missing: ./test.sh installs them.

mod common;

use common::*;
use deltafin_makemodel::{make_model, Arch, Preset};
use deltafin_server::{Running, ServerConfig};
use deltafin_tokenizer::chat::{harmony, ChatMessage, ChatTemplate};
use deltafin_tokenizer::Tokenizer;
use serde_json::json;
use std::path::Path;
use std::process::Command;
use std::sync::Arc;

/// Runs `script` (under tools/clients) against a fresh server with an API key, after checking that python3
/// imports `package`; `path` is what the client takes as its base URL after the address.
fn client_checks(package: &str, script: &str, path: &str) {
    let cfg = ServerConfig {
        scheduler: limited(1),
        ..config()
    };
    client_checks_on(&model_dir(), cfg, package, script, path, &[]);
}

/// Two generations at once and `queue` waiting: the parallel clients see both queueing and 429s.
fn limited(queue: usize) -> deltafin_engine::SchedulerConfig {
    deltafin_engine::SchedulerConfig {
        max_active: 2,
        queue_capacity: queue,
        ..Default::default()
    }
}

/// [`client_checks`] on the checkpoint in `dir` served with `cfg` (plus an API key), with `extra`
/// arguments for the script.
fn client_checks_on(
    dir: &Path,
    cfg: ServerConfig,
    package: &str,
    script: &str,
    path: &str,
    extra: &[&str],
) {
    let s = start_with_key(dir, cfg);
    run_client(&s, package, script, path, extra);
}

const API_KEY: &str = "test-key";

/// A server of the checkpoint in `dir` that requires [`API_KEY`].
fn start_with_key(dir: &Path, cfg: ServerConfig) -> Running {
    start_on(
        dir,
        ServerConfig {
            api_key: Some(API_KEY.into()),
            ..cfg
        },
    )
}

/// Runs `script` (under tools/clients) against `s`, after checking that python3 imports `package`; `path`
/// is what the client takes as its base URL after the address.
fn run_client(s: &Running, package: &str, script: &str, path: &str, extra: &[&str]) {
    let probe = Command::new("python3")
        .args([
            "-c",
            &format!("import {package}; print({package}.__version__)"),
        ])
        .output()
        .expect(
            "python3 is required for this test (run ./test.sh, which installs the client packages)",
        );
    assert!(
        probe.status.success(),
        "the `{package}` Python package is missing: run ./test.sh or `python3 -m pip install {package}`\n{}",
        String::from_utf8_lossy(&probe.stderr)
    );
    let script = format!(
        "{}/../../tools/clients/{script}",
        env!("CARGO_MANIFEST_DIR")
    );
    let out = Command::new("python3")
        .arg(script)
        .args(["--base-url", &format!("http://{}{path}", s.addr)])
        .args(["--model", MODEL, "--api-key", API_KEY])
        .args(extra)
        .output()
        .unwrap();
    let log = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "the {package} client test failed:\n{log}"
    );
    assert!(log.contains("all checks passed"), "{log}");
    eprintln!("{log}");
}

#[test]
fn the_official_openai_python_client_works_against_the_server() {
    client_checks("openai", "openai_client_test.py", "/v1");
}

#[test]
fn the_official_anthropic_python_client_works_against_the_server() {
    client_checks("anthropic", "anthropic_client_test.py", "");
}

/// A chat template for checkpoints that ship none (Kimi Linear's, make-model's DeepSeek-V3).
fn plain_template() -> Option<Arc<ChatTemplate>> {
    let plain = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}";
    Some(Arc::new(ChatTemplate::new(plain, "", "").unwrap()))
}

/// Checkpoints of both families whose embedding tables have padding rows past the tokenizer's ranks and
/// specials: the model picks their ids, which have no text; every reply still completes.
#[test]
fn the_official_openai_python_client_works_on_checkpoints_with_padding_rows() {
    for arch in [Arch::KimiK3, Arch::KimiLinear] {
        let dir = padded_model_dir(arch);
        let padding = Tokenizer::from_dir(&dir).unwrap().vocab_size();
        // A queue for every parallel client: a reply is sent before its slot is counted free, so a tight
        // queue can refuse the suite's next request.
        let cfg = ServerConfig {
            scheduler: limited(8),
            ..config()
        };
        let (cfg, family_args) = match arch {
            Arch::KimiK3 => (cfg, &[][..]),
            // Kimi Linear checkpoints ship no chat template: it chats through a plain one.
            Arch::KimiLinear => (
                ServerConfig {
                    chat_template: plain_template(),
                    ..cfg
                },
                &["--chat", "template"][..],
            ),
            Arch::GptOss | Arch::DeepseekV3 | Arch::KimiK2 | Arch::Qwen3Moe => {
                unreachable!("{arch:?} takes no padding rows")
            }
        };
        // The suite's greedy completion (streamed, cut by a stop string) holds padding ids among its text.
        let s = start_on(&dir, cfg.clone());
        let r = post(
            s.addr,
            "/v1/completions",
            &json!({"model": MODEL, "prompt": "Experts stream from", "max_tokens": 24, "temperature": 0,
                    "logprobs": 1}),
        );
        assert_eq!(r.status, 200, "{arch:?}: {}", r.body);
        let choice = &r.json()["choices"][0];
        let tokens = choice["logprobs"]["tokens"].as_array().unwrap();
        assert!(
            tokens.iter().any(|t| t == ""),
            "{arch:?}: no padding id among the suite's greedy tokens: {choice}"
        );
        assert!(!choice["text"].as_str().unwrap().is_empty(), "{choice}");
        s.stop().unwrap();
        let padding_id = (padding + PADDING_ROWS / 2).to_string();
        let mut extra = vec!["--padding-id", &padding_id];
        extra.extend(family_args);
        client_checks_on(&dir, cfg, "openai", "openai_client_test.py", "/v1", &extra);
    }
}

/// make-model's tiny checkpoint of each family besides K3's, one server each, through both official
/// clients: gpt-oss chats in harmony (and, biased towards its markup, writes it in every order), Kimi K2 and
/// Qwen3-MoE through the chat templates their checkpoints ship, DeepSeek-V3 (whose own tokenizer is not
/// modelled) through a plain one.
#[test]
fn the_official_python_clients_work_on_every_family() {
    for arch in [Arch::GptOss, Arch::KimiK2, Arch::Qwen3Moe, Arch::DeepseekV3] {
        let dir = tempfile::tempdir().unwrap();
        make_model(arch, Preset::Tiny, 0, dir.path()).unwrap();
        let tok = Tokenizer::from_dir(dir.path()).unwrap();
        let (chat_template, chat, harmony_ids) = match arch {
            Arch::GptOss => (None, "harmony", Some(harmony_ids(&tok))),
            Arch::KimiK2 | Arch::Qwen3Moe => {
                let template = ChatTemplate::from_dir(dir.path()).unwrap();
                assert!(
                    template.is_some(),
                    "make-model's {arch:?} ships its template"
                );
                (template.map(Arc::new), "template", None)
            }
            Arch::DeepseekV3 => (plain_template(), "template", None),
            Arch::KimiK3 | Arch::KimiLinear => unreachable!("{arch:?} is tested above"),
        };
        let cfg = ServerConfig {
            scheduler: limited(8),
            chat_template: chat_template.clone(),
            ..config()
        };
        let s = start_with_key(dir.path(), cfg);
        if let Some(template) = chat_template {
            assert_prompt_is_the_render(&s, &template, &tok);
        }
        let mut extra = vec!["--chat", chat];
        if let Some(ids) = &harmony_ids {
            // Sampling sorts o200k's 201088 ids each token (tens of ms here): four parallel clients, of
            // which two still queue behind the two active ones.
            extra.extend(["--harmony-ids", ids, "--parallel", "4"]);
        }
        run_client(&s, "openai", "openai_client_test.py", "/v1", &extra);
        run_client(
            &s,
            "anthropic",
            "anthropic_client_test.py",
            "",
            &["--chat", chat],
        );
    }
}

/// The ids the suite biases a harmony model towards: its markup and the header words of its two channels.
fn harmony_ids(tok: &Tokenizer) -> String {
    let markup = [
        harmony::START,
        harmony::CHANNEL,
        harmony::MESSAGE,
        harmony::END,
    ];
    let mut ids: Vec<u32> = markup
        .iter()
        .map(|name| tok.special_id(name).unwrap())
        .collect();
    for word in ["analysis", "final"] {
        let word_ids = tok.encode(word);
        assert_eq!(word_ids.len(), 1, "{word:?} is one token of o200k_harmony");
        ids.extend(word_ids);
    }
    let ids: Vec<String> = ids.iter().map(u32::to_string).collect();
    ids.join(",")
}

/// A chat's prompt is the template's render of its messages: the served prompt's token count.
fn assert_prompt_is_the_render(s: &Running, template: &ChatTemplate, tok: &Tokenizer) {
    let body = json!({"model": MODEL, "max_tokens": 1,
                      "messages": [{"role": "system", "content": "Be brief."},
                                   {"role": "user", "content": "Say hi."}]});
    let auth = format!("Bearer {API_KEY}");
    let r = call_with(
        s.addr,
        "POST",
        "/v1/chat/completions",
        &[("Authorization", &auth)],
        &body.to_string(),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let messages = [
        ChatMessage::system("Be brief."),
        ChatMessage::user("Say hi."),
    ];
    let prompt = tok.encode_pieces(&template.render(&messages, true, None).unwrap());
    assert_eq!(r.json()["usage"]["prompt_tokens"], prompt.len());
}
