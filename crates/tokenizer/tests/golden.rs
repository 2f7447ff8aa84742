//! Our ids equal Python tiktoken's on the committed corpus (see tests/fixtures/tokenizer/README.md).

use deltafin_tokenizer::{
    builtin_corpus, pretok::KIMI_PATTERN, train_bpe, write_tiktoken_files, Tokenizer,
};
use serde_json::Value;
use std::path::PathBuf;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tokenizer")
}

fn read_json(name: &str) -> Value {
    let path = fixtures().join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap()
}

fn strings(v: &Value) -> Vec<String> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap().to_string())
        .collect()
}

fn ids(v: &Value) -> Vec<Vec<u32>> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|row| {
            row.as_array()
                .unwrap()
                .iter()
                .map(|i| i.as_u64().unwrap() as u32)
                .collect()
        })
        .collect()
}

fn fnv1a64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    })
}

fn check(preset: &str, n_ranks: usize) {
    let golden = read_json(&format!("golden-{preset}.json"));
    let corpus = read_json("corpus.json");
    assert_eq!(
        golden["pattern"], KIMI_PATTERN,
        "the goldens were made with another pattern"
    );
    // The same ranks `deltafin make-model` writes for this preset.
    let dir = tempfile::tempdir().unwrap();
    write_tiktoken_files(dir.path(), &train_bpe(builtin_corpus(), n_ranks)).unwrap();
    let rank_file = std::fs::read(dir.path().join("tiktoken.model")).unwrap();
    assert_eq!(
        format!("{:016x}", fnv1a64(&rank_file)),
        golden["rank_file_fnv1a64"].as_str().unwrap(),
        "the {preset} rank file changed since the goldens were made; regenerate them (see the README)"
    );
    let tok = Tokenizer::from_dir(dir.path()).unwrap();
    assert_eq!(
        tok.num_ranks(),
        golden["num_ranks"].as_u64().unwrap() as usize
    );

    let texts = strings(&corpus["ordinary"]);
    let want = ids(&golden["ordinary"]);
    assert_eq!(texts.len(), want.len());
    for (text, want) in texts.iter().zip(&want) {
        let got = tok.encode(text);
        assert!(
            got == *want,
            "{preset}: {text:?}\n ours:     {got:?}\n tiktoken: {want:?}"
        );
        assert_eq!(tok.decode(&got).unwrap(), *text);
    }
    let texts = strings(&corpus["with_specials"]);
    let want = ids(&golden["with_specials"]);
    for (text, want) in texts.iter().zip(&want) {
        assert_eq!(tok.encode_with_specials(text), *want, "{preset}: {text:?}");
    }
}

#[test]
fn tiny_tokenizer_matches_tiktoken() {
    check("tiny", 512);
}

#[test]
fn small_tokenizer_matches_tiktoken() {
    check("small", 4096);
}
