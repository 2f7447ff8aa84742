use base64::engine::general_purpose::STANDARD as BASE64;
use base64::Engine;
use deltafin_tokenizer::{builtin_corpus, pretokenize, train_bpe, write_tiktoken_files, Tokenizer};
use std::path::Path;
use std::sync::OnceLock;

fn byte_ranks() -> Vec<Vec<u8>> {
    (0..=255u8).map(|b| vec![b]).collect()
}

/// tiktoken.model text for `tokens`, rank = position.
fn model_text(tokens: &[Vec<u8>]) -> String {
    tokens
        .iter()
        .enumerate()
        .map(|(r, t)| format!("{} {r}\n", BASE64.encode(t)))
        .collect()
}

fn write(dir: &Path, model: &str, config: &str) {
    std::fs::write(dir.join("tiktoken.model"), model).unwrap();
    std::fs::write(dir.join("tokenizer_config.json"), config).unwrap();
}

/// The hand-written vocabulary: bytes, then these ranks from 256 on.
const HAND: [&str; 7] = ["he", "ll", "hell", "hello", " world", "wo", "or"];
const HAND_CONFIG: &str = r#"{
  "added_tokens_decoder": {
    "263": {"content": "[BOS]", "special": true},
    "300": {"content": "<|open|>", "special": true}
  },
  "bos_token": {"content": "[BOS]", "lstrip": false},
  "eos_token": null
}"#;

fn hand_tokenizer() -> Tokenizer {
    let dir = tempfile::tempdir().unwrap();
    let mut tokens = byte_ranks();
    tokens.extend(HAND.iter().map(|t| t.as_bytes().to_vec()));
    write(dir.path(), &model_text(&tokens), HAND_CONFIG);
    Tokenizer::from_dir(dir.path()).unwrap()
}

fn trained() -> &'static Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        write_tiktoken_files(dir.path(), &train_bpe(builtin_corpus(), 4096)).unwrap();
        Tokenizer::from_dir(dir.path()).unwrap()
    })
}

#[test]
fn hand_vocabulary_exact_ids() {
    let tok = hand_tokenizer();
    let b = |s: &str| s.bytes().map(u32::from).collect::<Vec<_>>();
    let cases: Vec<(&str, Vec<u32>)> = vec![
        ("hello", vec![259]),
        // A whole piece that is a token maps to it even though no merge path reaches it.
        (" world", vec![260]),
        // ...while a longer piece goes through merges: "wo" (261) beats "or" (262), then nothing applies.
        (" worlds", [vec![32, 261], b("rlds")].concat()),
        // he, then ll, then he+ll, then hell+o; the trailing o stays a byte.
        ("helloo", vec![259, 111]),
        ("shell", vec![115, 258]),
        (" hello", vec![32, 259]),
        ("Hello world", vec![72, 101, 257, 111, 260]),
        // Equal ranks merge leftmost first.
        ("llll", vec![257, 257]),
        ("lll", vec![257, 108]),
        ("hello!", vec![259, 33]),
        ("", vec![]),
    ];
    for (text, want) in cases {
        assert_eq!(tok.encode(text), want, "encode({text:?})");
        assert_eq!(tok.decode(&want).unwrap(), text);
    }
}

#[test]
fn hand_vocabulary_specials_and_sizes() {
    let tok = hand_tokenizer();
    assert_eq!(tok.num_ranks(), 263);
    assert_eq!(tok.vocab_size(), 301);
    assert_eq!(tok.special_id("[BOS]"), Some(263));
    assert_eq!(tok.special_id("<|open|>"), Some(300));
    assert_eq!(tok.special_id("hello"), None);
    assert_eq!(
        (tok.bos_id(), tok.eos_id(), tok.pad_id()),
        (Some(263), None, None)
    );
    assert_eq!(tok.decode(&[263, 259, 300]).unwrap(), "[BOS]hello<|open|>");
    let gap = tok.decode_bytes(&[259, 264]).unwrap_err().to_string();
    assert!(
        gap.contains("token id 264 is outside the vocabulary"),
        "{gap}"
    );
    assert!(tok.decode(&[301]).is_err());
    // Special names in text are ordinary text.
    let ids = tok.encode("[BOS]<|open|>");
    assert!(ids.iter().all(|&id| id < 263), "{ids:?}");
    assert_eq!(
        ids,
        "[BOS]<|open|>".bytes().map(u32::from).collect::<Vec<_>>()
    );
}

#[test]
fn round_trips_varied_text() {
    let tok = trained();
    let texts = [
        "Hello, world! The quick brown fox jumps over the lazy dog.",
        "我爱北京天安门。人工智能正在改变世界！",
        "日本語とEnglishのmixed テキスト, 한국어도 조금.",
        "emoji 😀👨‍👩‍👧‍👦🇯🇵 and ❤️ and flags",
        "   leading, trailing and   inner   spaces   ",
        "tabs\tand\nnewlines\r\n\r\n\n\t mixed \u{a0}\u{3000} whitespace",
        "12345 6789012 3.14159 1e-10 0xDEADBEEF",
        "fn main() { println!(\"{}\", x << 2); } // ok?",
        "<|open|>message role=\"user\"<|sep|>[BOS][EOS]",
        "combining: e\u{301} a\u{308}\u{323} \u{200d}\u{fe0f} zero-width",
        "\u{0}\u{1}\u{7f}\u{80}\u{ffff}\u{10ffff}",
        "",
    ];
    for text in texts {
        let ids = tok.encode(text);
        assert_eq!(tok.decode(&ids).unwrap(), text);
        assert_eq!(tok.encode(text), ids, "deterministic");
        assert!(
            ids.iter().all(|&id| (id as usize) < tok.num_ranks()),
            "no specials from text"
        );
    }
    // Pseudo-random strings over a wide range of code points.
    let mut x: u32 = 12345;
    for len in [1, 7, 50, 400] {
        let s: String = (0..len)
            .filter_map(|_| {
                x = x.wrapping_mul(1_103_515_245).wrapping_add(12_345);
                let pick = (x >> 8) % 4;
                let c = match pick {
                    0 => (x >> 12) % 0x80,
                    1 => 0x80 + (x >> 12) % 0x800,
                    2 => 0x4e00 + (x >> 12) % 0x5200,
                    _ => (x >> 11) % 0x11_0000,
                };
                char::from_u32(c)
            })
            .collect();
        assert_eq!(tok.decode(&tok.encode(&s)).unwrap(), s);
    }
}

#[test]
fn digits_split_in_threes() {
    assert_eq!(pretokenize("12345"), ["123", "45"]);
    let tok = trained();
    let whole = tok.encode("12345");
    assert_eq!(whole, [tok.encode("123"), tok.encode("45")].concat());
    assert_eq!(tok.decode(&whole).unwrap(), "12345");
}

#[test]
fn long_pieces_encode_quickly() {
    let tok = trained();
    for text in [
        "a".repeat(200_000),
        " ".repeat(200_000),
        "ab".repeat(100_000),
        "7".repeat(200_000),
    ] {
        let start = std::time::Instant::now();
        let ids = tok.encode(&text);
        assert_eq!(tok.decode(&ids).unwrap(), text);
        assert!(start.elapsed().as_secs() < 20, "took {:?}", start.elapsed());
    }
}

#[test]
fn written_files_round_trip_with_k3_specials() {
    let dir = tempfile::tempdir().unwrap();
    let ranks = train_bpe(builtin_corpus(), 512);
    assert_eq!(ranks.len(), 512);
    write_tiktoken_files(dir.path(), &ranks).unwrap();
    let tok = Tokenizer::from_dir(dir.path()).unwrap();
    assert_eq!((tok.num_ranks(), tok.vocab_size()), (512, 768));
    for (name, id) in [
        ("[BOS]", 512),
        ("[EOS]", 513),
        ("<|end_of_msg|>", 514),
        ("<|open|>", 515),
        ("<|close|>", 516),
        ("<|sep|>", 517),
        ("<|header_start|>", 518),
        ("<|header_end|>", 519),
        ("<|reserved_token_8|>", 520),
        ("[EOT]", 521),
        ("<|reserved_token_253|>", 765),
        ("[UNK]", 766),
        ("[PAD]", 767),
    ] {
        assert_eq!(tok.special_id(name), Some(id), "{name}");
        assert_eq!(tok.decode(&[id]).unwrap(), name);
    }
    assert_eq!(
        (tok.bos_id(), tok.eos_id(), tok.pad_id(), tok.unk_id()),
        (Some(512), Some(513), Some(767), Some(766))
    );
    for (rank, token) in ranks.iter().enumerate() {
        assert_eq!(tok.decode_bytes(&[rank as u32]).unwrap(), *token);
    }
    // No temporary files left behind.
    let mut names: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    names.sort();
    assert_eq!(names, ["tiktoken.model", "tokenizer_config.json"]);
}

#[test]
fn tiktoken_file_format_is_exact() {
    let dir = tempfile::tempdir().unwrap();
    write_tiktoken_files(
        dir.path(),
        &[b"a".to_vec(), b"bc".to_vec(), vec![0xff, 0x00]],
    )
    .unwrap();
    let text = std::fs::read_to_string(dir.path().join("tiktoken.model")).unwrap();
    assert_eq!(text, "YQ== 0\nYmM= 1\n/wA= 2\n");
    assert!(write_tiktoken_files(dir.path(), &[b"a".to_vec(), b"a".to_vec()]).is_err());
    assert!(write_tiktoken_files(dir.path(), &[vec![]]).is_err());
}

/// Loads a directory whose tiktoken.model is the 256 bytes followed by `extra` lines, with `config`.
fn load_err(extra: &str, config: &str) -> String {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), &(model_text(&byte_ranks()) + extra), config);
    match Tokenizer::from_dir(dir.path()) {
        Ok(_) => panic!("expected an error for extra {extra:?} / config {config:?}"),
        Err(e) => format!("{e:#}"),
    }
}

#[test]
fn bad_files_give_located_errors() {
    let cfg = r#"{"added_tokens_decoder": {}}"#;
    let he = BASE64.encode("he");
    let cases: Vec<(String, &str, &[&str])> = vec![
        (
            format!("{he} 256\n!!notbase64 257\n"),
            cfg,
            &["tiktoken.model:258:", "base64", "!!notbase64"],
        ),
        (
            format!("{he} 256\n{} 256\n", BASE64.encode("ll")),
            cfg,
            &["tiktoken.model:258:", "duplicate rank 256", "line 257"],
        ),
        (
            format!("{he} 256\n{} 258\n", BASE64.encode("ll")),
            cfg,
            &["tiktoken.model:258:", "rank 258 is out of range", "no gaps"],
        ),
        (
            format!("{he} 256\n{he} 257\n"),
            cfg,
            &["tiktoken.model:258:", "duplicate token bytes", "line 257"],
        ),
        (
            format!("{he}  256\n"),
            cfg,
            &["tiktoken.model:257:", "expected `<base64 token> <rank>`"],
        ),
        (
            format!("{he} 25x\n"),
            cfg,
            &["tiktoken.model:257:", "decimal rank", "25x"],
        ),
        (
            format!("{he}\n"),
            cfg,
            &["tiktoken.model:257:", "expected `<base64 token> <rank>`"],
        ),
        (
            format!("{he} 256\n"),
            r#"{"added_tokens_decoder": {"5": {"content": "[BOS]"}}}"#,
            &[
                "tokenizer_config.json",
                "added_tokens_decoder[\"5\"]",
                "collides with rank 5",
            ],
        ),
        (
            String::new(),
            r#"{"added_tokens_decoder": {"x1": {"content": "[BOS]"}}}"#,
            &["tokenizer_config.json", "decimal token id", "x1"],
        ),
        (
            String::new(),
            r#"{"added_tokens_decoder": {"300": {"special": true}}}"#,
            &[
                "tokenizer_config.json",
                "added_tokens_decoder[\"300\"]",
                "content",
            ],
        ),
        (
            String::new(),
            r#"{"added_tokens_decoder": {"300": {"content": "[A]"}, "301": {"content": "[A]"}}}"#,
            &[
                "tokenizer_config.json",
                "\"[A]\" is already the name of id 300",
            ],
        ),
        (
            String::new(),
            r#"{"added_tokens_decoder": [1, 2]}"#,
            &[
                "tokenizer_config.json",
                "added_tokens_decoder: expected an object, found an array",
            ],
        ),
        (
            String::new(),
            r#"{"added_tokens_decoder": {}, "bos_token": "[BOS]"}"#,
            &["tokenizer_config.json", "bos_token", "found \"[BOS]\""],
        ),
        (
            String::new(),
            r#"{"added_tokens_decoder": {}"#,
            &["tokenizer_config.json", "expected JSON"],
        ),
        (
            String::new(),
            "[]",
            &[
                "tokenizer_config.json",
                "expected a JSON object at the top level, found an array",
            ],
        ),
    ];
    for (extra, config, wants) in cases {
        let err = load_err(&extra, config);
        for want in wants {
            assert!(
                err.contains(want),
                "error for {extra:?} / {config}: {err:?} lacks {want:?}"
            );
        }
    }
}

#[test]
fn missing_bytes_and_missing_files() {
    let dir = tempfile::tempdir().unwrap();
    let mut tokens = byte_ranks();
    tokens.remove(0x41);
    write(dir.path(), &model_text(&tokens), "{}");
    let err = format!("{:#}", Tokenizer::from_dir(dir.path()).err().unwrap());
    assert!(
        err.contains("tiktoken.model") && err.contains("byte 0x41"),
        "{err}"
    );

    std::fs::write(dir.path().join("tiktoken.model"), b"YQ== 0\n\xff\n").unwrap();
    let err = format!("{:#}", Tokenizer::from_dir(dir.path()).err().unwrap());
    assert!(
        err.contains("tiktoken.model:2:") && err.contains("non-UTF-8"),
        "{err}"
    );

    std::fs::remove_file(dir.path().join("tokenizer_config.json")).unwrap();
    write(dir.path(), &model_text(&byte_ranks()), "{}");
    std::fs::remove_file(dir.path().join("tokenizer_config.json")).unwrap();
    let err = format!("{:#}", Tokenizer::from_dir(dir.path()).err().unwrap());
    assert!(
        err.contains("reading") && err.contains("tokenizer_config.json"),
        "{err}"
    );

    let empty = tempfile::tempdir().unwrap();
    let err = format!("{:#}", Tokenizer::from_dir(empty.path()).err().unwrap());
    assert!(err.contains("tiktoken.model"), "{err}");
}
