//! Byte-level encoding and streaming decoding on a trained test tokenizer.

use deltafin_tokenizer::{
    builtin_corpus, train_bpe, write_tiktoken_files, StreamDecoder, Tokenizer,
};

fn tokenizer(n_ranks: usize) -> (tempfile::TempDir, Tokenizer) {
    let dir = tempfile::tempdir().unwrap();
    write_tiktoken_files(dir.path(), &train_bpe(builtin_corpus(), n_ranks)).unwrap();
    let tok = Tokenizer::from_dir(dir.path()).unwrap();
    (dir, tok)
}

#[test]
fn stream_decoder_never_splits_a_character() {
    let (_dir, tok) = tokenizer(512);
    let text = "Grüße, 世界! 👨‍👩‍👧 ok <|open|> é\u{301}";
    let ids = tok.encode(text);
    let mut decoder = StreamDecoder::new(&tok);
    let mut out = String::new();
    let mut held = 0;
    for &id in &ids {
        let piece = decoder.push(id);
        assert!(!piece.contains('\u{FFFD}'), "{piece:?}");
        held += piece.is_empty() as usize;
        out.push_str(&piece);
    }
    out.push_str(&decoder.finish());
    assert_eq!(out, text);
    assert!(
        held > 0,
        "the text should include characters split across tokens"
    );
}

#[test]
fn stream_decoder_renders_ids_without_text_as_nothing() {
    let (_dir, tok) = tokenizer(512);
    // Ids past the ranks and specials, as a padded embedding table has them, even inside a character.
    let padding = [
        tok.vocab_size() as u32,
        tok.vocab_size() as u32 + 40,
        u32::MAX,
    ];
    assert!(padding.iter().all(|&id| tok.token_bytes(id).is_none()));
    let text = "Grüße, 世界! 👨‍👩‍👧";
    let mut decoder = StreamDecoder::new(&tok);
    let mut out = String::new();
    for (i, &id) in tok.encode(text).iter().enumerate() {
        assert_eq!(decoder.push(padding[i % padding.len()]), "");
        out.push_str(&decoder.push(id));
    }
    out.push_str(&decoder.finish());
    assert_eq!(out, text);
    // Whole-sequence decoding of ids given by the caller still refuses them.
    assert!(tok.decode(&[padding[0]]).is_err());
}

#[test]
fn stream_decoder_replaces_impossible_bytes_at_once() {
    let (_dir, tok) = tokenizer(512);
    let mut d = StreamDecoder::new(&tok);
    assert_eq!(d.push_bytes(&[0xFF]), "\u{FFFD}");
    assert_eq!(d.push_bytes(&[b'a', 0xE4]), "a");
    assert_eq!(d.push_bytes(&[0xB8]), "");
    assert_eq!(d.push_bytes(&[0xAD]), "中");
    assert_eq!(d.push_bytes(&[0xE4, b'A']), "\u{FFFD}A");
    assert_eq!(d.push_bytes(&[0xF0, 0x9F]), "");
    assert_eq!(d.finish(), "\u{FFFD}");
    assert_eq!(d.finish(), "");
    // Special ids stream as their names.
    let eom = tok.special_id("<|end_of_msg|>").unwrap();
    assert_eq!(d.push(eom), "<|end_of_msg|>");
}

#[test]
fn encode_bytes_round_trips_any_bytes() {
    let (_dir, tok) = tokenizer(4096);
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    for len in 0..400 {
        let bytes: Vec<u8> = (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                match x % 4 {
                    0 => (x >> 8) as u8,
                    _ => b"the cat's 12 \n\xe4\xb8\xad"[(x >> 8) as usize % 16],
                }
            })
            .collect();
        let ids = tok.encode_bytes(&bytes);
        assert_eq!(tok.decode_bytes(&ids).unwrap(), bytes);
        if let Ok(text) = std::str::from_utf8(&bytes) {
            assert_eq!(tok.encode(text), ids);
        }
    }
    // Invalid bytes split like U+FFFD would: here as a symbol between two words.
    let ids = tok.encode_bytes(b"hello\xffworld");
    assert_eq!(tok.decode_bytes(&ids).unwrap(), b"hello\xffworld");
    assert_eq!(ids[..tok.encode("hello").len()], tok.encode("hello")[..]);
}

#[test]
fn special_names_are_text_unless_template() {
    let (_dir, tok) = tokenizer(512);
    let open = tok.special_id("<|open|>").unwrap();
    assert!(!tok.encode("<|open|>").contains(&open));
    assert_eq!(tok.encode_with_specials("<|open|>"), vec![open]);
    assert_eq!(tok.special_name(open), Some("<|open|>"));
    let ids = tok.encode_with_specials("a<|open|><|reserved_token_10|>b");
    let r10 = tok.special_id("<|reserved_token_10|>").unwrap();
    assert_eq!(
        ids,
        [tok.encode("a"), vec![open, r10], tok.encode("b")].concat()
    );
}
