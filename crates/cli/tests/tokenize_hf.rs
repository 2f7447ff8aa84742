//! `deltafin tokenize` on a checkpoint that ships a Hugging Face `tokenizer.json` (no tiktoken.model).

use serde_json::{json, Map};
use std::process::Command;

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_deltafin"))
}

/// A byte-level BPE: byte b is id b (GPT-2's byte-to-character map), he=256, ll=257, hell=258,
/// hello=259, Ġw=260, and the special added token <|endoftext|>=261.
fn write_checkpoint(dir: &std::path::Path) {
    let mut next = 256;
    let mut vocab = Map::new();
    for b in 0..=255u32 {
        let c = if (0x21..=0x7E).contains(&b)
            || (0xA1..=0xAC).contains(&b)
            || (0xAE..=0xFF).contains(&b)
        {
            char::from_u32(b).unwrap()
        } else {
            next += 1;
            char::from_u32(next - 1).unwrap()
        };
        vocab.insert(c.to_string(), b.into());
    }
    let merges = ["h e", "l l", "he ll", "hell o", "Ġ w"];
    for (i, m) in merges.iter().enumerate() {
        vocab.insert(m.replace(' ', ""), (256 + i).into());
    }
    let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true});
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [{"id": 261, "content": "<|endoftext|>", "single_word": false, "lstrip": false,
                          "rstrip": false, "normalized": false, "special": true}],
        "normalizer": null,
        "pre_tokenizer": byte_level,
        "post_processor": null,
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                  "vocab": vocab, "merges": merges},
    });
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).unwrap();
    std::fs::write(
        dir.join("tokenizer_config.json"),
        r#"{"eos_token": "<|endoftext|>"}"#,
    )
    .unwrap();
}

fn tokenize(dir: &std::path::Path, args: &[&str]) -> Vec<u32> {
    let out = bin()
        .arg("tokenize")
        .args(args)
        .arg("--model")
        .arg(dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn tokenize_reads_tokenizer_json() {
    let dir = tempfile::tempdir().unwrap();
    write_checkpoint(dir.path());
    assert_eq!(
        tokenize(dir.path(), &["--text", "hello world"]),
        [259, 260, 111, 114, 108, 100]
    );
    let text = "hello<|endoftext|>é";
    let plain = tokenize(dir.path(), &["--text", text]);
    assert!(!plain.contains(&261), "{plain:?}");
    assert_eq!(
        tokenize(dir.path(), &["--specials", "--text", text]),
        [259, 261, 0xC3, 0xA9]
    );

    // A broken tokenizer.json: an error naming the file.
    std::fs::write(dir.path().join("tokenizer.json"), "{not json").unwrap();
    let out = bin()
        .args(["tokenize", "--text", "x", "--model"])
        .arg(dir.path())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr.contains("tokenizer.json: expected JSON"), "{stderr}");
}
