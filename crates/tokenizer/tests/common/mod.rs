//! gpt-oss's tokenizer files, rebuilt from tests/fixtures/o200k_harmony (its TOKENIZER_JSON.md says how
//! they were made): the full `tokenizer.json` is 28 MB, so the committed layout gets its vocabulary back
//! from the committed ranks.

// Each test binary that includes this module uses part of it.
#![allow(dead_code)]

use base64::engine::general_purpose::STANDARD as BASE64;
use base64::Engine;
use deltafin_tokenizer::Tokenizer;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

pub fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/o200k_harmony")
}

pub fn read_json(name: &str) -> Value {
    let path = fixtures().join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap()
}

pub fn golden() -> &'static Value {
    static GOLDEN: OnceLock<Value> = OnceLock::new();
    GOLDEN.get_or_init(|| read_json("golden.json"))
}

pub fn corpus() -> &'static Value {
    static CORPUS: OnceLock<Value> = OnceLock::new();
    CORPUS.get_or_init(|| read_json("corpus.json"))
}

pub fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|i| i.as_u64().unwrap() as u32)
        .collect()
}

/// The character each byte is written as in a byte-level vocabulary (GPT-2's `bytes_to_unicode`).
fn byte_char(b: u8) -> char {
    let printable = |c: u8| matches!(c, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    if printable(b) {
        b as char
    } else {
        let k = (0..b).filter(|&c| !printable(c)).count() as u32;
        char::from_u32(256 + k).unwrap()
    }
}

/// A checkpoint directory as gpt-oss's: `tokenizer.json` (the layout with the ranks as its vocabulary),
/// `tokenizer_config.json`, `generation_config.json`.
pub fn write_checkpoint(dir: &Path) {
    let mut layout = read_json("tokenizer_layout.json");
    let ranks = std::fs::read_to_string(fixtures().join("o200k_base.tiktoken")).unwrap();
    let vocab: serde_json::Map<String, Value> = ranks
        .lines()
        .map(|line| {
            let (b64, rank) = line.split_once(' ').unwrap();
            let bytes = BASE64.decode(b64).unwrap();
            let name: String = bytes.iter().map(|&b| byte_char(b)).collect();
            (name, rank.parse::<u64>().unwrap().into())
        })
        .collect();
    layout["model"]["vocab"] = Value::Object(vocab);
    std::fs::write(dir.join("tokenizer.json"), layout.to_string()).unwrap();
    for name in ["tokenizer_config.json", "generation_config.json"] {
        std::fs::copy(fixtures().join(name), dir.join(name)).unwrap();
    }
}

pub fn tokenizer() -> &'static Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        write_checkpoint(dir.path());
        Tokenizer::from_dir(dir.path()).unwrap()
    })
}
