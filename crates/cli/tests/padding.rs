//! Checkpoints whose embedding tables have padding rows past the tokenizer's ranks and specials (as many
//! released ones do): the model picks their ids, which have no text, and no command stops for it.

mod common;

use common::*;
use deltafin_makemodel::{make_padded_model, Arch, Preset};
use deltafin_tokenizer::Tokenizer;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};

const WARNING: &str = "the tokenizer has no text for";

fn padded(arch: Arch, seed: u64) -> (tempfile::TempDir, PathBuf) {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path().join("model");
    make_padded_model(arch, Preset::Tiny, seed, 256, &dir).unwrap();
    (t, dir)
}

fn ok(out: Output) -> (String, String) {
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    );
    assert!(out.status.success(), "{stderr}");
    (stdout, stderr)
}

/// `deltafin run` with `--print-ids`: (printed text, generated ids, stderr).
fn run(model: &Path, args: &[&str]) -> (String, Vec<u32>, String) {
    let (stdout, stderr) = ok(bin()
        .arg("run")
        .arg("--model")
        .arg(model)
        .args(["--max-new", "16", "--ignore-eos", "--print-ids"])
        .args(args)
        .output()
        .unwrap());
    let (text, ids) = stdout
        .trim_end_matches('\n')
        .rsplit_once('\n')
        .unwrap_or(("", stdout.trim_end()));
    (text.to_string(), serde_json::from_str(ids).unwrap(), stderr)
}

#[test]
fn run_goes_on_past_padding_ids_with_and_without_a_tokenizer() {
    for arch in [Arch::KimiK3, Arch::KimiLinear] {
        let (_t, dir) = padded(arch, 0);
        let tok = Tokenizer::from_dir(&dir).unwrap();
        let prompt = ["--prompt-ids", "5,17,42"];
        let (text, ids, stderr) = run(&dir, &[&prompt[..], &["--stats"]].concat());
        assert_eq!(ids.len(), 16, "{arch:?}");
        let padding = ids.iter().filter(|&&id| tok.token_bytes(id).is_none());
        assert!(padding.count() > 1, "{arch:?}: no padding ids in {ids:?}");
        // The text is that of the other ids; the warning comes once however many padding ids there were.
        let rendered: Vec<u32> = ids
            .iter()
            .copied()
            .filter(|&id| tok.token_bytes(id).is_some())
            .collect();
        assert_eq!(text, tok.decode(&rendered).unwrap(), "{arch:?}");
        assert_eq!(stderr.matches(WARNING).count(), 1, "{stderr}");
        // The first token comes from the prefill: the decode passes made the other 15.
        assert!(stderr.contains("| decode 15 tok "), "{stderr}");

        // Without tokenizer files: ids only, the same ones.
        for file in ["tiktoken.model", "tokenizer_config.json"] {
            std::fs::remove_file(dir.join(file)).unwrap();
        }
        let (text, bare, stderr) = run(&dir, &prompt);
        assert_eq!((text.as_str(), &bare), ("", &ids), "{arch:?}: {stderr}");
    }
}

#[test]
fn speculative_decoding_and_chat_formats_go_on_past_padding_ids() {
    let (_t, dir) = padded(Arch::KimiK3, 0);
    let (_d, drafter) = padded(Arch::KimiK3, 1);
    let tok = Tokenizer::from_dir(&dir).unwrap();
    let prompt = ["--prompt", "The experts stream"];
    let (text, ids, _) = run(&dir, &prompt);
    assert!(
        ids.iter().any(|&id| tok.token_bytes(id).is_none()),
        "{ids:?}"
    );
    let draft = ["--draft", drafter.to_str().unwrap(), "--draft-tokens", "2"];
    let (draft_text, draft_ids, _) = run(&dir, &[&prompt[..], &draft].concat());
    assert_eq!((draft_text, draft_ids), (text, ids));

    let (_, ids, stderr) = run(&dir, &["--chat", "--prompt", "Hi there"]);
    assert!(
        ids.iter().any(|&id| tok.token_bytes(id).is_none()),
        "{ids:?}"
    );
    assert_eq!(stderr.matches(WARNING).count(), 1, "{stderr}");
}

#[test]
fn chat_goes_on_past_padding_ids() {
    let (_t, dir) = padded(Arch::KimiK3, 0);
    let mut child = bin()
        .arg("chat")
        .arg("--model")
        .arg(&dir)
        .args(["--max-new", "16"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    writeln!(child.stdin.take().unwrap(), "Hi there\nAnd again").unwrap();
    let (stdout, stderr) = ok(child.wait_with_output().unwrap());
    // Both replies were printed (one line each), and at least one held a padding id.
    assert_eq!(stdout.lines().count(), 2, "{stdout}\n{stderr}");
    assert_eq!(stderr.matches(WARNING).count(), 1, "{stderr}");
}
