//! Text in, text out: `tokenize`, `run --chat`, `--stats`, `doctor`, and scripted `chat` sessions (piped
//! stdin, SIGINT for Ctrl-C).

mod common;
#[path = "../../tokenizer/tests/common/mod.rs"]
mod o200k;
use common::*;
use deltafin_formats::npy;
use deltafin_makemodel::{make_padded_model, Arch, Preset};
use deltafin_tokenizer::chat::harmony::{render_chat, ReasoningEffort};
use deltafin_tokenizer::chat::{parse_reply, ChatMessage};
use deltafin_tokenizer::Tokenizer;
use std::io::{Read, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

fn stdout_of(cmd: &mut Command) -> (String, String) {
    let out = cmd.output().unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout).to_string(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    );
    assert!(out.status.success(), "failed: {stderr}");
    (stdout, stderr)
}

#[test]
fn tokenize_prints_ids_as_json() {
    let t = tiny(Arch::KimiK3, 0);
    let dir = model_dir(&t);
    let tok = Tokenizer::from_dir(&dir).unwrap();
    let text = "Hello <|open|> 世界";
    let (out, _) = stdout_of(
        bin()
            .args(["tokenize", "--text", text, "--model"])
            .arg(&dir),
    );
    let ids: Vec<u32> = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(ids, tok.encode(text));
    let (out, _) = stdout_of(
        bin()
            .args(["tokenize", "--specials", "--text", text, "--model"])
            .arg(&dir),
    );
    let ids: Vec<u32> = serde_json::from_str(out.trim()).unwrap();
    assert!(ids.contains(&tok.special_id("<|open|>").unwrap()));
    // A directory without tokenizer files: a plain error that says what to do.
    let empty = tempfile::tempdir().unwrap();
    let out = bin()
        .args(["tokenize", "--text", "x", "--model"])
        .arg(empty.path())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr.starts_with("error: ") && stderr.contains("Point --model at"),
        "{stderr}"
    );
}

#[test]
fn run_chat_prints_reasoning_and_answer_of_the_reply() {
    let t = tiny(Arch::KimiK3, 0);
    let dir = model_dir(&t);
    let tok = Tokenizer::from_dir(&dir).unwrap();
    let (out, stderr) = stdout_of(
        bin()
            .args(["run", "--chat", "--effort", "high", "--system", "Be brief."])
            .args([
                "--prompt",
                "Hi there",
                "--max-new",
                "40",
                "--print-ids",
                "--model",
            ])
            .arg(&dir),
    );
    assert!(!stderr.contains("[stats]"), "stats are opt-in: {stderr}");
    let (text, ids) = out.trim_end().rsplit_once('\n').unwrap();
    let ids: Vec<u32> = serde_json::from_str(ids).unwrap();
    // What was printed is the parsed reply of exactly the generated ids.
    let reply = parse_reply(&tok.decode(&ids).unwrap());
    let mut want = String::new();
    if !reply.reasoning.is_empty() {
        want += &format!("[thinking] {}", reply.reasoning);
    }
    if !reply.content.is_empty() || !reply.tool_calls.is_empty() {
        want += if want.is_empty() {
            "[answer] "
        } else {
            "\n[answer] "
        };
        want += &reply.content;
    }
    for c in &reply.tool_calls {
        want += &format!("\n[tool call {} id={}] {}", c.name, c.id, c.arguments);
    }
    assert_eq!(text, want);

    let (_, stderr) = stdout_of(
        bin()
            .args([
                "run",
                "--stats",
                "--prompt",
                "Hi",
                "--max-new",
                "3",
                "--model",
            ])
            .arg(&dir),
    );
    assert!(stderr.contains("[stats]"), "{stderr}");
}

#[test]
fn run_chat_needs_a_chat_format() {
    // The tiny Kimi Linear checkpoint has no chat template.
    let t = tiny(Arch::KimiLinear, 0);
    let out = bin()
        .args(["run", "--chat", "--prompt", "hi", "--model"])
        .arg(model_dir(&t))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("has no chat template"), "{stderr}");
}

/// A checkpoint with gpt-oss's tokenizer (o200k_harmony; an embedding table that covers its ids) chats in
/// harmony: `doctor` says so, `run --chat` prompts with the harmony render of the conversation (its logits
/// are those of the rendered ids) and refuses `--effort max`, which is K3's.
#[test]
fn a_harmony_checkpoint_chats_in_harmony() {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path().join("model");
    make_padded_model(Arch::KimiK3, Preset::Tiny, 0, 201_088, &dir).unwrap();
    for k3_file in ["tiktoken.model", "tokenizer_config.json"] {
        std::fs::remove_file(dir.join(k3_file)).unwrap();
    }
    o200k::write_checkpoint(&dir);
    let tok = Tokenizer::from_dir(&dir).unwrap();
    let doctor = bin()
        .args(["doctor", "--model"])
        .arg(&dir)
        .output()
        .unwrap();
    let doctor = String::from_utf8_lossy(&doctor.stdout);
    assert!(doctor.contains("chat: harmony (built in)"), "{doctor}");

    let npy_path = t.path().join("chat.npy");
    stdout_of(
        bin()
            .args(["run", "--chat", "--effort", "high", "--system", "Be brief."])
            .args(["--prompt", "Hi there", "--max-new", "3", "--ignore-eos"])
            .arg("--dump-logits")
            .arg(&npy_path)
            .arg("--model")
            .arg(&dir),
    );
    let messages = [
        ChatMessage::system("Be brief."),
        ChatMessage::user("Hi there"),
    ];
    let prompt = render_chat(&messages, None, Some(ReasoningEffort::High)).unwrap();
    let want = run_dump(&dir, &tok.encode_pieces(&prompt), 3, &[]);
    let got = npy::read(&npy_path).unwrap();
    assert_eq!((got.rows, got.cols), (want.rows, want.cols));
    assert!(
        got.data == want.data,
        "the chat prompt is not the harmony render"
    );

    let out = bin()
        .args([
            "run", "--chat", "--effort", "max", "--prompt", "hi", "--model",
        ])
        .arg(&dir)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("harmony's reasoning efforts"), "{stderr}");
}

#[test]
fn doctor_reports_machine_and_model_health() {
    let t = tiny(Arch::KimiK3, 0);
    let dir = model_dir(&t);
    let (out, _) = stdout_of(
        bin()
            .args(["doctor", "--disk-mib", "8", "--model"])
            .arg(&dir),
    );
    for want in [
        "cpu: ",
        "kernels: ",
        "memory: ",
        "gpu: ",
        "disk: ",
        "GB/s",
        "weights: ",
        "chat: K3",
    ] {
        assert!(out.contains(want), "{want:?} missing from:\n{out}");
    }
    assert!(
        out.contains(&format!("model {}: ok", dir.display())),
        "{out}"
    );
    assert!(
        !dir.join(".deltafin-probe").exists(),
        "the probe file is removed"
    );

    // Two problems, one line each.
    std::fs::remove_file(dir.join("tiktoken.model")).unwrap();
    let shard = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .unwrap();
    std::fs::remove_file(&shard).unwrap();
    let out = bin()
        .args(["doctor", "--disk-mib", "0", "--model"])
        .arg(&dir)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stdout}{stderr}");
    let problems: Vec<&str> = stdout
        .lines()
        .filter(|l| l.starts_with("problem: "))
        .collect();
    assert_eq!(problems.len(), 2, "{stdout}");
    assert!(problems[0].starts_with("problem: weights: "), "{stdout}");
    assert!(problems[1].starts_with("problem: tokenizer: "), "{stdout}");
    assert!(stderr.contains("2 problem(s)"), "{stderr}");
}

#[test]
fn help_documents_every_flag_with_its_default() {
    for (cmd, wants) in [
        (
            "chat",
            &[
                "[default: 1024]",
                "[default: 0]",
                "[default: 1]",
                "default: none",
            ][..],
        ),
        ("tokenize", &["--specials", "default: off"][..]),
        (
            "doctor",
            &["[default: 256]", "default: the --model directory"][..],
        ),
        (
            "run",
            &["--chat", "--stats", "default: off", "[default: 32]"][..],
        ),
    ] {
        let (out, _) = stdout_of(bin().args([cmd, "--help"]));
        for want in wants {
            assert!(out.contains(want), "`{cmd} --help` lacks {want:?}:\n{out}");
        }
    }
}

/// A running `deltafin chat` with its output collected by background threads.
struct Repl {
    child: Child,
    stdin: Option<ChildStdin>,
    stdout: Arc<Mutex<String>>,
    stderr: Arc<Mutex<String>>,
}

impl Repl {
    fn start(args: &[&str], model: &std::path::Path) -> Repl {
        let mut child = bin()
            .arg("chat")
            .args(args)
            .arg("--model")
            .arg(model)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let collect = |mut r: Box<dyn Read + Send>| {
            let buf = Arc::new(Mutex::new(String::new()));
            let sink = buf.clone();
            std::thread::spawn(move || {
                let mut chunk = [0u8; 4096];
                while let Ok(n) = r.read(&mut chunk) {
                    if n == 0 {
                        break;
                    }
                    sink.lock()
                        .unwrap()
                        .push_str(&String::from_utf8_lossy(&chunk[..n]));
                }
            });
            buf
        };
        let stdout = collect(Box::new(child.stdout.take().unwrap()));
        let stderr = collect(Box::new(child.stderr.take().unwrap()));
        let stdin = child.stdin.take();
        Repl {
            child,
            stdin,
            stdout,
            stderr,
        }
    }

    fn send(&mut self, line: &str) {
        let stdin = self.stdin.as_mut().unwrap();
        writeln!(stdin, "{line}").unwrap();
        stdin.flush().unwrap();
    }

    /// Waits until `done(stdout, stderr)` holds; panics with both after a minute.
    fn wait_for(&self, what: &str, done: impl Fn(&str, &str) -> bool) {
        let t0 = Instant::now();
        loop {
            {
                let (out, err) = (self.stdout.lock().unwrap(), self.stderr.lock().unwrap());
                if done(&out, &err) {
                    return;
                }
                assert!(
                    t0.elapsed() < Duration::from_secs(60),
                    "timed out waiting for {what}\nstdout: {out}\nstderr: {err}"
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn exit_code(mut self) -> Option<i32> {
        let t0 = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status.code();
            }
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "the REPL did not exit"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Repl {
    /// A failed test never leaves the REPL running.
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// How many times the REPL has asked for input.
fn prompts(stderr: &str) -> usize {
    stderr.matches("> ").count()
}

/// The prefill token counts of the `[stats]` lines so far.
fn prefills(stderr: &str) -> Vec<usize> {
    stderr
        .lines()
        .filter_map(|l| l.split("prefill ").nth(1))
        .map(|rest| rest.split(' ').next().unwrap().parse().unwrap())
        .collect()
}

#[test]
fn chat_session_streams_keeps_history_resets_and_exits() {
    let t = tiny(Arch::KimiK3, 0);
    let mut repl = Repl::start(&["--max-new", "12", "--stats"], &model_dir(&t));
    repl.wait_for("the first prompt", |_, err| err.contains("> "));
    let replies = |out: &str| -> Vec<String> { out.lines().map(str::to_string).collect() };

    repl.send("hello");
    // The reply arrives while the session stays open, then the next prompt.
    repl.wait_for("reply 1", |out, err| {
        out.ends_with('\n') && prefills(err).len() == 1
    });
    repl.wait_for("prompt 2", |_, err| prompts(err) == 2);
    repl.send("hello");
    repl.wait_for("reply 2", |_, err| prefills(err).len() == 2);
    repl.send("/reset");
    repl.wait_for("the reset", |_, err| err.contains("(new conversation)"));
    repl.send("hello");
    repl.wait_for("reply 3", |_, err| prefills(err).len() == 3);
    repl.send("/bogus");
    repl.wait_for("the unknown-command note", |_, err| {
        err.contains("unknown command /bogus")
    });
    repl.send("/exit");
    let (out, err) = (
        repl.stdout.lock().unwrap().clone(),
        repl.stderr.lock().unwrap().clone(),
    );
    assert_eq!(repl.exit_code(), Some(0), "{err}");

    let lines = replies(&out);
    assert_eq!(
        lines.len(),
        3,
        "one line per reply (non-terminal output):\n{out}"
    );
    assert!(lines
        .iter()
        .all(|l| l.starts_with("[thinking] ") || l.starts_with("[answer] ")));
    let p = prefills(&err);
    // The second turn's prompt carries the first exchange; after /reset the conversation starts over:
    // the same prompt and (greedy) the same reply as the first turn.
    assert_ne!(p[1], p[0], "{err}");
    assert_eq!(p[2], p[0], "{err}");
    assert_eq!(lines[2], lines[0]);
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn chat_ends_at_end_of_input() {
    let t = tiny(Arch::KimiK3, 0);
    let mut repl = Repl::start(&["--max-new", "4"], &model_dir(&t));
    repl.send("hi");
    // Closing stdin is what Ctrl-D does on a terminal.
    repl.stdin = None;
    let stdout = repl.stdout.clone();
    assert_eq!(repl.exit_code(), Some(0));
    std::thread::sleep(Duration::from_millis(100)); // let the reader thread take the last bytes
    assert_eq!(stdout.lock().unwrap().lines().count(), 1);
}

fn interrupt(repl: &Repl) {
    let ok = Command::new("kill")
        .args(["-INT", &repl.child.id().to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok);
}

#[test]
fn ctrl_c_stops_the_reply_not_the_program() {
    let t = tiny(Arch::KimiK3, 0);
    let mut repl = Repl::start(&["--max-new", "1000000"], &model_dir(&t));
    repl.wait_for("the first prompt", |_, err| err.contains("> "));
    repl.send("Tell me a long story.");
    // Text streams out while the reply is still being generated.
    repl.wait_for("streamed text", |out, _| out.len() > 64);
    interrupt(&repl);
    repl.wait_for("the stop", |_, err| err.contains("[stopped]"));
    repl.wait_for("the next prompt", |_, err| prompts(err) == 2);
    repl.send("/exit");
    assert_eq!(repl.exit_code(), Some(0));

    // At the prompt, Ctrl-C quits (exit status 130, as shells report SIGINT).
    let repl = Repl::start(&[], &model_dir(&t));
    repl.wait_for("the first prompt", |_, err| err.contains("> "));
    interrupt(&repl);
    assert_eq!(repl.exit_code(), Some(130));
}
