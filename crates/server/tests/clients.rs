//! The official `openai` and `anthropic` Python packages against a running server
//! (tools/clients/{openai,anthropic}_client_test.py). Fails — never skips — when python3 or a package is
//! missing: ./test.sh installs them.

mod common;

use common::*;
use std::process::Command;

/// Runs `script` (under tools/clients) against a fresh server with an API key, after checking that python3
/// imports `package`; `path` is what the client takes as its base URL after the address.
fn client_checks(package: &str, script: &str, path: &str) {
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
    let s = start(deltafin_server::ServerConfig {
        api_key: Some("test-key".into()),
        scheduler: deltafin_engine::SchedulerConfig {
            max_active: 2,
            queue_capacity: 1,
            ..Default::default()
        },
        ..config()
    });
    let script = format!(
        "{}/../../tools/clients/{script}",
        env!("CARGO_MANIFEST_DIR")
    );
    let out = Command::new("python3")
        .arg(script)
        .args(["--base-url", &format!("http://{}{path}", s.addr)])
        .args(["--model", MODEL, "--api-key", "test-key"])
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
