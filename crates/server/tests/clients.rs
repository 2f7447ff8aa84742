//! The official `openai` and `anthropic` Python packages against a running server
//! (tools/clients/{openai,anthropic}_client_test.py). Fails — never skips — when python3 or a package is
//! missing: ./test.sh installs them.

mod common;

use common::*;
use deltafin_makemodel::Arch;
use deltafin_server::ServerConfig;
use deltafin_tokenizer::chat::ChatTemplate;
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
    let s = start_on(
        dir,
        ServerConfig {
            api_key: Some("test-key".into()),
            ..cfg
        },
    );
    let script = format!(
        "{}/../../tools/clients/{script}",
        env!("CARGO_MANIFEST_DIR")
    );
    let out = Command::new("python3")
        .arg(script)
        .args(["--base-url", &format!("http://{}{path}", s.addr)])
        .args(["--model", MODEL, "--api-key", "test-key"])
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

/// Checkpoints of both families whose embedding tables have padding rows past the tokenizer's ranks and
/// specials: the model picks their ids, which have no text; every reply still completes.
#[test]
fn the_official_openai_python_client_works_on_checkpoints_with_padding_rows() {
    // Kimi Linear checkpoints ship no chat template: it chats through a plain one.
    let plain = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}";
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
            Arch::KimiLinear => (
                ServerConfig {
                    chat_template: Some(Arc::new(ChatTemplate::new(plain, "", "").unwrap())),
                    ..cfg
                },
                &["--template-chat"][..],
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
