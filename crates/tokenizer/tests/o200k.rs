//! gpt-oss's tokenizer (o200k_harmony) loaded from a `tokenizer.json` as gpt-oss ships it gives tiktoken's
//! ids on the committed corpus (tests/fixtures/o200k_harmony).

mod common;

use common::{corpus, golden, ids, tokenizer};
use deltafin_tokenizer::pretok::{Pattern, O200K_PATTERN};
use deltafin_tokenizer::Tokenizer;
use serde_json::Value;

/// tiktoken's second name for id 200018; the released tokenizer.json names it `<|endofprompt|>` only.
const ALIAS: &str = "<|reserved_200018|>";
const ENDOFPROMPT: &str = "<|endofprompt|>";

#[test]
fn loads_as_rank_bpe_with_the_o200k_pattern() {
    let tok = tokenizer();
    assert_eq!(golden()["pattern"], O200K_PATTERN);
    assert_eq!(tok.pattern(), Some(Pattern::O200k));
    assert_eq!(
        tok.num_ranks(),
        golden()["num_ranks"].as_u64().unwrap() as usize
    );
    assert_eq!(
        tok.vocab_size(),
        golden()["n_vocab"].as_u64().unwrap() as usize
    );
}

#[test]
fn ordinary_text_encodes_to_tiktoken_ids_and_decodes_back() {
    let tok = tokenizer();
    let texts = corpus()["ordinary"].as_array().unwrap();
    let want = golden()["ordinary"].as_array().unwrap();
    assert_eq!(texts.len(), want.len());
    for (text, want) in texts.iter().zip(want) {
        let text = text.as_str().unwrap();
        let got = tok.encode(text);
        assert_eq!(got, ids(want), "ids of {:?}", &text[..text.len().min(60)]);
        assert_eq!(tok.decode_bytes(&got).unwrap(), text.as_bytes());
    }
}

#[test]
fn text_with_specials_encodes_to_tiktoken_ids_and_decodes_back() {
    let tok = tokenizer();
    let texts = corpus()["with_specials"].as_array().unwrap();
    let want = golden()["with_specials"].as_array().unwrap();
    assert_eq!(texts.len(), want.len());
    for (text, want) in texts.iter().zip(want) {
        // tiktoken encodes both names of 200018 to it; the file has one, so the input uses that one.
        let text = text.as_str().unwrap().replace(ALIAS, ENDOFPROMPT);
        let got = tok.encode_with_specials(&text);
        assert_eq!(got, ids(want), "ids of {:?}", &text[..text.len().min(60)]);
        assert_eq!(tok.decode(&got).unwrap(), text);
    }
}

#[test]
fn specials_by_id_and_name() {
    let tok = tokenizer();
    let specials = golden()["special_tokens"].as_object().unwrap();
    assert_eq!(specials.len(), 1091);
    for (name, id) in specials {
        let id = id.as_u64().unwrap() as u32;
        if name == ALIAS {
            assert_eq!(tok.special_id(name), None, "the file does not name {ALIAS}");
            continue;
        }
        assert_eq!(tok.special_id(name), Some(id), "{name}");
        assert_eq!(tok.special_name(id), Some(name.as_str()), "{id}");
        assert_eq!(tok.encode_with_specials(name), [id], "{name}");
        // In ordinary text a special name is text.
        assert!(tok.encode(name).len() > 1, "{name} as text");
    }
    let harmony = [
        ("<|startoftext|>", 199998),
        ("<|endoftext|>", 199999),
        ("<|return|>", 200002),
        ("<|constrain|>", 200003),
        ("<|channel|>", 200005),
        ("<|start|>", 200006),
        ("<|end|>", 200007),
        ("<|message|>", 200008),
        ("<|call|>", 200012),
        (ENDOFPROMPT, 200018),
    ];
    for (name, id) in harmony {
        assert_eq!(tok.special_id(name), Some(id), "{name}");
    }
}

#[test]
fn generation_ends_at_return_call_and_endoftext() {
    let tok = tokenizer();
    assert_eq!(tok.bos_id(), Some(199998));
    assert_eq!(tok.eos_id(), Some(200002));
    assert_eq!(tok.pad_id(), Some(199999));
    assert_eq!(tok.eos_ids(), [199999, 200002, 200012]);
}

/// A gpt-oss checkpoint directory whose `tokenizer.json` is changed by `edit`.
fn edited(edit: impl FnOnce(&mut Value)) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    common::write_checkpoint(dir.path());
    let path = dir.path().join("tokenizer.json");
    let mut json: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut json);
    std::fs::write(&path, json.to_string()).unwrap();
    dir
}

#[test]
fn only_converted_tiktoken_files_get_the_rank_bpe() {
    // Merges in the order of the ids they make: still tiktoken's ranks.
    let in_order = edited(|j| j["model"]["merges"] = serde_json::json!(["i n", ["Ġ", "t"]]));
    let tok = Tokenizer::from_dir(in_order.path()).unwrap();
    assert_eq!(tok.pattern(), Some(Pattern::O200k));
    // Out of id order ("in" is 258, "Ġt" 260): a BPE whose merge order is not its ids.
    let out_of_order = edited(|j| j["model"]["merges"] = serde_json::json!(["Ġ t", "i n"]));
    let tok = Tokenizer::from_dir(out_of_order.path()).unwrap();
    assert_eq!(tok.pattern(), None);
    // A pattern the scanner does not implement.
    let other = edited(|j| {
        j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = r"\p{L}+|\s+|.".into()
    });
    let tok = Tokenizer::from_dir(other.path()).unwrap();
    assert_eq!(tok.pattern(), None);
    assert_eq!(tok.special_id("<|call|>"), Some(200012));
}

#[test]
fn bad_generation_config_eos_is_an_error_naming_the_field() {
    for (eos, says) in [
        (
            r#""<|return|>""#,
            "expected a token id or a list of token ids",
        ),
        ("[200002, -1]", "found -1"),
        ("[200002, 300000]", "300000 is not a token of the tokenizer"),
    ] {
        let dir = edited(|_| {});
        std::fs::write(
            dir.path().join("generation_config.json"),
            format!(r#"{{"eos_token_id": {eos}}}"#),
        )
        .unwrap();
        let err = Tokenizer::from_dir(dir.path()).err().unwrap();
        let msg = format!("{err:#}");
        assert!(
            msg.contains("generation_config.json: eos_token_id") && msg.contains(says),
            "{msg}"
        );
    }
    let dir = edited(|_| {});
    std::fs::write(
        dir.path().join("generation_config.json"),
        r#"{"eos_token_id": 200012}"#,
    )
    .unwrap();
    let tok = Tokenizer::from_dir(dir.path()).unwrap();
    assert_eq!(tok.eos_ids(), [200002, 200012]);
}
