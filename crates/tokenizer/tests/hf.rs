//! `tokenizer.json` (Hugging Face) checkpoints: a small byte-level BPE built here with the `tokenizers`
//! crate, saved into a temporary directory and loaded through `Tokenizer::from_dir`.

use deltafin_tokenizer::{Piece, Tokenizer};
use std::path::Path;
use tokenizers::models::bpe::BPE;
use tokenizers::{AddedToken, DecoderWrapper, PreTokenizerWrapper};

/// GPT-2's byte-to-character map: printable Latin-1 bytes stand for themselves, the rest get 256, 257, …
fn alphabet() -> Vec<char> {
    let mut next = 256;
    (0..=255u32)
        .map(|b| {
            if (0x21..=0x7E).contains(&b)
                || (0xA1..=0xAC).contains(&b)
                || (0xAE..=0xFF).contains(&b)
            {
                char::from_u32(b).unwrap()
            } else {
                next += 1;
                char::from_u32(next - 1).unwrap()
            }
        })
        .collect()
}

const ENDOFTEXT: u32 = 261;
const IM_START: u32 = 262;
const THINK: u32 = 263;

/// Vocabulary: byte b has id b; then he=256, ll=257, hell=258, hello=259, Ġw=260; added tokens
/// <|endoftext|>=261 and <|im_start|>=262 (special), <think>=263 (not special).
fn write_checkpoint(dir: &Path) {
    let a = alphabet();
    assert_eq!(a[b' ' as usize], 'Ġ');
    let mut vocab = serde_json::Map::new();
    for (b, c) in a.iter().enumerate() {
        vocab.insert(c.to_string(), b.into());
    }
    let merges = [
        ("h", "e"),
        ("l", "l"),
        ("he", "ll"),
        ("hell", "o"),
        ("Ġ", "w"),
    ];
    for (i, (x, y)) in merges.iter().enumerate() {
        vocab.insert(format!("{x}{y}"), (256 + i).into());
    }
    let vocab_path = dir.join("vocab.json");
    let merges_path = dir.join("merges.txt");
    std::fs::write(&vocab_path, serde_json::to_string(&vocab).unwrap()).unwrap();
    let merges_txt: String = merges.iter().map(|(x, y)| format!("{x} {y}\n")).collect();
    std::fs::write(&merges_path, format!("#version: 0.2\n{merges_txt}")).unwrap();

    let bpe = BPE::from_file(vocab_path.to_str().unwrap(), merges_path.to_str().unwrap())
        .build()
        .unwrap();
    let mut tok = tokenizers::Tokenizer::new(bpe);
    let byte_level = tokenizers::pre_tokenizers::byte_level::ByteLevel::new(false, true, true);
    tok.with_pre_tokenizer(Some(PreTokenizerWrapper::ByteLevel(byte_level)));
    tok.with_decoder(Some(DecoderWrapper::ByteLevel(byte_level)));
    tok.add_special_tokens(&[
        AddedToken::from("<|endoftext|>", true),
        AddedToken::from("<|im_start|>", true),
    ]);
    tok.add_tokens(&[AddedToken::from("<think>", false)]);
    tok.save(dir.join("tokenizer.json"), true).unwrap();
    std::fs::remove_file(vocab_path).unwrap();
    std::fs::remove_file(merges_path).unwrap();
    std::fs::write(
        dir.join("tokenizer_config.json"),
        r#"{"bos_token": null, "eos_token": {"content": "<|endoftext|>"}, "pad_token": "<|endoftext|>"}"#,
    )
    .unwrap();
}

fn load() -> (tempfile::TempDir, Tokenizer) {
    let dir = tempfile::tempdir().unwrap();
    write_checkpoint(dir.path());
    let tok = Tokenizer::from_dir(dir.path()).unwrap();
    (dir, tok)
}

#[test]
fn exact_ids_for_hand_checked_strings() {
    let (_dir, tok) = load();
    assert_eq!(tok.encode("hello"), [259]);
    // "hello", "Ġworld": Ġw merges; o r l d stay bytes.
    assert_eq!(tok.encode("hello world"), [259, 260, 111, 114, 108, 100]);
    assert_eq!(tok.encode("hell"), [258]);
    assert_eq!(tok.encode("llhe"), [257, 256]);
    // é is C3 A9: two byte tokens.
    assert_eq!(tok.encode("é"), [0xC3, 0xA9]);
    assert_eq!(tok.encode(""), Vec::<u32>::new());
    assert_eq!(tok.vocab_size(), 264);
    assert_eq!(tok.num_ranks(), 261);
    assert_eq!(tok.eos_id(), Some(ENDOFTEXT));
    assert_eq!(tok.pad_id(), Some(ENDOFTEXT));
    assert_eq!(tok.bos_id(), None);
    assert_eq!(tok.unk_id(), None);
    assert_eq!(tok.special_id("<|im_start|>"), Some(IM_START));
    assert_eq!(tok.special_name(ENDOFTEXT), Some("<|endoftext|>"));
    // Added but not special: not a special, though template text still maps it to its id.
    assert_eq!(tok.special_id("<think>"), None);
    assert_eq!(tok.encode_with_specials("<think>"), [THINK]);
}

#[test]
fn same_ids_and_text_as_the_tokenizers_crate() {
    let dir = tempfile::tempdir().unwrap();
    write_checkpoint(dir.path());
    let tok = Tokenizer::from_dir(dir.path()).unwrap();
    let hf = tokenizers::Tokenizer::from_file(dir.path().join("tokenizer.json")).unwrap();
    for s in [
        "hello world",
        "  héllo\n\twörld  ",
        "日本語のテキスト",
        "a😀b 👩‍👩‍👧 x",
        "123 4567",
    ] {
        let ids = tok.encode(s);
        assert_eq!(ids, hf.encode(s, false).unwrap().get_ids(), "{s:?}");
        assert_eq!(
            tok.decode(&ids).unwrap(),
            hf.decode(&ids, false).unwrap(),
            "{s:?}"
        );
    }
    // The crate's own encode matches added tokens in any text; ours must not (see specials test).
    let text = "hi<|endoftext|>";
    assert!(hf
        .encode(text, false)
        .unwrap()
        .get_ids()
        .contains(&ENDOFTEXT));
    assert!(!tok.encode(text).contains(&ENDOFTEXT));
}

#[test]
fn round_trips_unicode() {
    let (_dir, tok) = load();
    for s in [
        "hello world",
        "Grüße, 世界! ¿Qué tal? Ελληνικά — русский",
        "emoji 😀🎉 and a family 👩‍👩‍👧 and flags 🇯🇵",
        "tabs\tand\nnewlines\r\n  spaces   ",
        "\u{0} control \u{7f} chars \u{ad}",
        "ÿþ Latin-1 edge ¬®",
    ] {
        let ids = tok.encode(s);
        assert_eq!(tok.decode(&ids).unwrap(), s);
        assert_eq!(tok.decode_bytes(&ids).unwrap(), s.as_bytes());
        // Streaming gives the same text, never half a character.
        let mut dec = deltafin_tokenizer::StreamDecoder::new(&tok);
        let mut out = String::new();
        for &id in &ids {
            out.push_str(&dec.push(id));
        }
        out.push_str(&dec.finish());
        assert_eq!(out, s);
    }
    assert!(tok.decode(&[264]).is_err());
}

#[test]
fn specials_only_in_template_text() {
    let (_dir, tok) = load();
    let text = "hi<|endoftext|>there<|im_start|><think>";
    let plain = tok.encode(text);
    assert!(
        plain.iter().all(|&id| id < ENDOFTEXT),
        "plain encode produced an added-token id: {plain:?}"
    );
    assert_eq!(tok.decode(&plain).unwrap(), text);
    let with = tok.encode_with_specials(text);
    assert_eq!(with[..2], [104, 105]);
    assert!(with.contains(&ENDOFTEXT) && with.contains(&IM_START) && with.contains(&THINK));
    assert_eq!(*with.last().unwrap(), THINK);
    assert_eq!(tok.decode(&with).unwrap(), text);
    // User text stays text even next to template text.
    let pieces = [
        Piece::Template("<|im_start|>".into()),
        Piece::Text("<|endoftext|>".into()),
    ];
    let ids = tok.encode_pieces(&pieces);
    assert_eq!(ids[0], IM_START);
    assert!(!ids[1..].contains(&ENDOFTEXT), "{ids:?}");
}

#[test]
fn tiktoken_model_wins_over_tokenizer_json() {
    let dir = tempfile::tempdir().unwrap();
    write_checkpoint(dir.path());
    let ranks: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
    deltafin_tokenizer::write_tiktoken_files(dir.path(), &ranks).unwrap();
    let tok = Tokenizer::from_dir(dir.path()).unwrap();
    assert_eq!(tok.num_ranks(), 256);
    assert_eq!(tok.encode("hello"), [104, 101, 108, 108, 111]);
}

#[test]
fn broken_tokenizer_json_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tokenizer.json");
    let err = |text: &str| {
        std::fs::write(&path, text).unwrap();
        match Tokenizer::from_dir(dir.path()) {
            Ok(_) => panic!("{text:?} loaded"),
            Err(e) => format!("{e:#}"),
        }
    };
    let e = err("{\"model\": ");
    assert!(e.contains("tokenizer.json: expected JSON"), "{e}");
    let e = err("{\"version\": \"1.0\"}");
    assert!(
        e.contains("tokenizer.json: expected a \"model\" object"),
        "{e}"
    );
    let e = err("[1, 2]");
    assert!(e.contains("tokenizer.json: expected a JSON object"), "{e}");
    let e = err("{\"model\": {\"type\": \"NoSuchModel\"}}");
    assert!(e.contains("tokenizer.json: not a tokenizer"), "{e}");

    // A config naming a token that does not exist.
    write_checkpoint(dir.path());
    std::fs::write(
        dir.path().join("tokenizer_config.json"),
        r#"{"eos_token": "<|nope|>"}"#,
    )
    .unwrap();
    let e = format!("{:#}", Tokenizer::from_dir(dir.path()).err().unwrap());
    assert!(e.contains("tokenizer_config.json: eos_token"), "{e}");
}

/// A token id far beyond the vocabulary used to size the id table unchecked: 4e9 ids aborted on allocation.
#[test]
fn a_sparse_huge_token_id_is_refused_before_allocation() {
    let dir = tempfile::tempdir().unwrap();
    write_checkpoint(dir.path());
    let path = dir.path().join("tokenizer.json");
    let mut json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    json["model"]["vocab"]["hello"] = 4_000_000_000u32.into();
    std::fs::write(&path, json.to_string()).unwrap();
    let Err(e) = Tokenizer::from_dir(dir.path()) else {
        panic!("a token id of 4e9 in a vocabulary of 261 loaded");
    };
    let e = format!("{e:#}");
    assert!(e.contains("token id 4000000000 is far beyond"), "{e}");
}
