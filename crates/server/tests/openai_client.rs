//! The official `openai` Python package against a running server (tools/clients/openai_client_test.py).
//! Fails — never skips — when python3 or the package is missing: ./test.sh installs it.

mod common;

use common::*;
use std::process::Command;

#[test]
fn the_official_openai_python_client_works_against_the_server() {
    let probe = Command::new("python3")
        .args(["-c", "import openai; print(openai.__version__)"])
        .output()
        .expect(
            "python3 is required for this test (run ./test.sh, which installs the openai package)",
        );
    assert!(
        probe.status.success(),
        "the `openai` Python package is missing: run ./test.sh or `python3 -m pip install openai`\n{}",
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
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tools/clients/openai_client_test.py"
    );
    let out = Command::new("python3")
        .arg(script)
        .args(["--base-url", &format!("http://{}/v1", s.addr)])
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
        "the openai client test failed:\n{log}"
    );
    assert!(log.contains("all checks passed"), "{log}");
    eprintln!("{log}");
}
