//! Hugging Face `tokenizer.json`, loaded through the `tokenizers` crate — or, when the file is a tiktoken
//! tokenizer converted by transformers' `TikTokenConverter` (gpt-oss's is), by deltafin's own rank BPE.
//!
//! A converted file has no normalizer, splits with tiktoken's pattern then maps bytes with `ByteLevel`
//! (no regex of its own), and is a byte-level BPE whose ids are the tiktoken ranks (dense, every byte a
//! token) with merges listed in the order of the ids they make. Rank BPE over those ids is exactly
//! tiktoken's encoding; the `tokenizers` crate's merge-based BPE and its own regex engine only
//! approximate it, so such a file whose pattern [`Pattern::from_regex`] knows is encoded natively.
//!
//! Plain text is encoded through the tokenizer's normalizer, pre-tokenizer and model only, never its
//! added-token matcher, so text such as "<|endoftext|>" in user text is ordinary text; added tokens are
//! recognised by [`crate::Tokenizer::encode_pieces`] in template text, like the tiktoken backend's
//! specials. Token bytes for decoding are computed once per id: byte-level vocabularies through the
//! inverse of the GPT-2 byte-to-character alphabet, others through byte fallback (`<0x41>`) and `▁` as a
//! space.

use crate::pretok::Pattern;
use anyhow::{bail, Context, Result};
use serde_json::Value;
use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use tokenizers::{Model, Normalizer, OffsetType, PreTokenizedString, PreTokenizer};

pub(crate) const HF_FILE: &str = "tokenizer.json";

pub(crate) struct HfBackend {
    tok: tokenizers::Tokenizer,
    /// Size of the model's own vocabulary (without added tokens).
    pub model_vocab: usize,
}

/// What [`load`] returns: how to encode plus everything the shared [`crate::Tokenizer`] fields need.
pub(crate) struct Loaded {
    pub engine: Engine,
    /// Bytes of each id (empty for ids that are not in the vocabulary).
    pub tokens: Vec<Vec<u8>>,
    /// Added tokens flagged `special`, by id.
    pub specials: BTreeMap<u32, String>,
    /// Every added token (special or not): recognised in template text.
    pub added: Vec<(String, u32)>,
    /// bos/eos/pad/unk from `tokenizer_config.json`, in `files::ROLE_FIELDS` order.
    pub roles: [Option<u32>; 4],
}

pub(crate) enum Engine {
    /// A converted tiktoken tokenizer: ids `0..num_ranks` of the token table are its ranks.
    Ranks {
        pattern: Pattern,
        num_ranks: usize,
    },
    Crate(Box<HfBackend>),
}

/// The GPT-2 byte-level alphabet: the character each byte is written as in a byte-level vocabulary.
pub fn byte_level_alphabet() -> [char; 256] {
    let mut out = ['\0'; 256];
    let mut next = 256u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        let code = if printable {
            b as u32
        } else {
            let c = next;
            next += 1;
            c
        };
        out[b as usize] = char::from_u32(code).unwrap_or('\0');
    }
    out
}

/// True when the decoder (or, failing that, the pre-tokenizer) is byte-level, possibly in a sequence.
fn is_byte_level(root: &Value) -> bool {
    fn has(v: &Value) -> bool {
        match v.get("type").and_then(Value::as_str) {
            Some("ByteLevel") => true,
            Some("Sequence") => ["decoders", "pretokenizers"]
                .iter()
                .filter_map(|k| v.get(*k).and_then(Value::as_array))
                .flatten()
                .any(has),
            _ => false,
        }
    }
    match root.get("decoder") {
        Some(d) if !d.is_null() => has(d),
        _ => root.get("pre_tokenizer").is_some_and(has),
    }
}

/// Raw bytes of vocabulary token `token`.
fn token_bytes(token: &str, byte_level: Option<&std::collections::HashMap<char, u8>>) -> Vec<u8> {
    if let Some(inverse) = byte_level {
        let bytes: Option<Vec<u8>> = token.chars().map(|c| inverse.get(&c).copied()).collect();
        if let Some(bytes) = bytes {
            return bytes;
        }
        return token.as_bytes().to_vec();
    }
    if token.len() == 6 && token.starts_with("<0x") && token.ends_with('>') {
        if let Ok(b) = u8::from_str_radix(&token[3..5], 16) {
            return vec![b];
        }
    }
    token.replace('\u{2581}', " ").into_bytes()
}

pub(crate) fn load(dir: &Path) -> Result<Loaded> {
    let path = dir.join(HF_FILE);
    let shown = path.display();
    let text = std::fs::read(&path).with_context(|| format!("reading {shown}"))?;
    let root: Value =
        serde_json::from_slice(&text).with_context(|| format!("{shown}: expected JSON"))?;
    let Some(obj) = root.as_object() else {
        bail!("{shown}: expected a JSON object at the top level");
    };
    match obj.get("model") {
        Some(Value::Object(_)) => {}
        None | Some(Value::Null) => bail!("{shown}: expected a \"model\" object, found none"),
        Some(_) => bail!("{shown}: \"model\": expected an object"),
    }
    let added = added_tokens(&root, &shown)?;
    if let Some((pattern, tokens)) = converted_tiktoken(&root) {
        let vocab = &root["model"]["vocab"];
        let vocab_id = |name: &str| vocab.get(name)?.as_u64()?.try_into().ok();
        let roles = roles(dir, vocab_id, &added)?;
        let engine = Engine::Ranks {
            pattern,
            num_ranks: tokens.len(),
        };
        return assemble(&shown, tokens, added, engine, roles);
    }
    let tok = tokenizers::Tokenizer::from_bytes(&text).map_err(|e| {
        anyhow::anyhow!("{shown}: not a tokenizer the tokenizers crate can load: {e}")
    })?;

    let byte_level = is_byte_level(&root).then(|| {
        byte_level_alphabet()
            .iter()
            .enumerate()
            .map(|(b, &c)| (c, b as u8))
            .collect::<HashMap<char, u8>>()
    });
    let vocab = tok.get_model().get_vocab();
    let top = vocab.values().max().map_or(0, |&id| id as usize + 1);
    check_dense(&shown, top, vocab.len() + added.len())?;
    let mut tokens = vec![Vec::new(); top];
    for (token, &id) in &vocab {
        tokens[id as usize] = token_bytes(token, byte_level.as_ref());
    }
    let roles = roles(dir, |name| tok.token_to_id(name), &added)?;
    let model_vocab = tok.get_model().get_vocab_size();
    let engine = Engine::Crate(Box::new(HfBackend { tok, model_vocab }));
    assemble(&shown, tokens, added, engine, roles)
}

/// Ids are (nearly) dense in any real vocabulary; the token table is sized by the largest, so that must be
/// in proportion to the file.
fn check_dense(shown: &impl std::fmt::Display, top: usize, entries: usize) -> Result<()> {
    if top > 2 * entries + 1024 {
        bail!(
            "{shown}: token id {} is far beyond the file's {entries} tokens (ids this sparse mean a damaged file)",
            top - 1
        );
    }
    Ok(())
}

/// Added tokens with a non-empty content: (content, id, flagged special).
fn added_tokens(root: &Value, shown: &impl std::fmt::Display) -> Result<Vec<(String, u32, bool)>> {
    let Some(list) = root.get("added_tokens").filter(|v| !v.is_null()) else {
        return Ok(Vec::new());
    };
    let Some(list) = list.as_array() else {
        bail!("{shown}: \"added_tokens\": expected a list");
    };
    let mut out = Vec::with_capacity(list.len());
    for (i, t) in list.iter().enumerate() {
        let id = t
            .get("id")
            .and_then(Value::as_u64)
            .and_then(|id| u32::try_from(id).ok());
        let content = t.get("content").and_then(Value::as_str);
        let (Some(id), Some(content)) = (id, content) else {
            bail!("{shown}: added_tokens[{i}]: expected an \"id\" (a token id) and a \"content\" string, found {t}");
        };
        if !content.is_empty() {
            let special = t.get("special").and_then(Value::as_bool).unwrap_or(false);
            out.push((content.to_string(), id, special));
        }
    }
    Ok(out)
}

/// [`Loaded`] from the vocabulary's bytes by id and the added tokens, whose text joins the table.
fn assemble(
    shown: &impl std::fmt::Display,
    mut tokens: Vec<Vec<u8>>,
    added: Vec<(String, u32, bool)>,
    engine: Engine,
    roles: [Option<u32>; 4],
) -> Result<Loaded> {
    let top = added
        .iter()
        .map(|&(_, id, _)| id as usize + 1)
        .fold(tokens.len(), usize::max);
    check_dense(shown, top, tokens.len() + added.len())?;
    tokens.resize(top, Vec::new());
    let mut specials = BTreeMap::new();
    let mut added_list = Vec::new();
    for (content, id, special) in added {
        tokens[id as usize] = content.as_bytes().to_vec();
        if special {
            specials.insert(id, content.clone());
        }
        added_list.push((content, id));
    }
    Ok(Loaded {
        engine,
        tokens,
        specials,
        added: added_list,
        roles,
    })
}

/// The pattern and the token bytes by rank when `root` is a converted tiktoken tokenizer (see the module
/// docs); `None` for any other tokenizer, which the `tokenizers` crate then runs.
fn converted_tiktoken(root: &Value) -> Option<(Pattern, Vec<Vec<u8>>)> {
    if !root.get("normalizer").is_none_or(Value::is_null) {
        return None;
    }
    let steps = root["pre_tokenizer"]["pretokenizers"].as_array()?;
    let [split, bytes] = steps.as_slice() else {
        return None;
    };
    let is = |v: &Value, key: &str, want: Value| v.get(key).unwrap_or(&Value::Null) == &want;
    if !(root["pre_tokenizer"]["type"] == "Sequence"
        && split["type"] == "Split"
        && is(split, "behavior", "Isolated".into())
        && is(split, "invert", false.into())
        && bytes["type"] == "ByteLevel"
        && is(bytes, "use_regex", false.into())
        && is(bytes, "add_prefix_space", false.into())
        && root["decoder"]["type"] == "ByteLevel")
    {
        return None;
    }
    let pattern = Pattern::from_regex(split["pattern"]["Regex"].as_str()?)?;
    let model = &root["model"];
    let unset = |key: &str| match model.get(key) {
        None | Some(Value::Null) | Some(Value::Bool(false)) => true,
        Some(Value::String(s)) => s.is_empty(),
        _ => false,
    };
    if model["type"] != "BPE"
        || ![
            "byte_fallback",
            "continuing_subword_prefix",
            "end_of_word_suffix",
            "dropout",
        ]
        .iter()
        .all(|k| unset(k))
    {
        return None;
    }
    let inverse: HashMap<char, u8> = byte_level_alphabet()
        .iter()
        .enumerate()
        .map(|(b, &c)| (c, b as u8))
        .collect();
    let vocab = model["vocab"].as_object()?;
    let mut tokens = vec![Vec::new(); vocab.len()];
    for (name, id) in vocab {
        let slot = tokens.get_mut(usize::try_from(id.as_u64()?).ok()?)?;
        if !slot.is_empty() {
            return None;
        }
        *slot = name
            .chars()
            .map(|c| inverse.get(&c).copied())
            .collect::<Option<Vec<u8>>>()?;
    }
    // Dense ids (n names in n distinct slots), every single byte a token, merges in the order of the ids
    // they make: then id order is rank order.
    let ids: HashMap<&[u8], u32> = tokens.iter().map(Vec::as_slice).zip(0..).collect();
    if ids.len() != tokens.len() || (0..=255u8).any(|b| !ids.contains_key(&[b][..])) {
        return None;
    }
    let mut last = 0;
    for merge in model["merges"].as_array()? {
        let (left, right) = match merge {
            Value::String(s) => s.split_once(' ')?,
            Value::Array(pair) => match pair.as_slice() {
                [l, r] => (l.as_str()?, r.as_str()?),
                _ => return None,
            },
            _ => return None,
        };
        let made = vocab.get(&format!("{left}{right}"))?.as_u64()?;
        if made < last {
            return None;
        }
        last = made;
    }
    Some((pattern, tokens))
}

impl HfBackend {
    /// Normalizer, pre-tokenizer and model, skipping the added-token matcher and post-processor.
    pub fn encode_into(&self, text: &str, out: &mut Vec<u32>) {
        match self.encode_plain(text) {
            Ok(ids) => out.extend(ids),
            // The BPE model fails only on a character it has no token and no unk for.
            Err(_) => out.extend(text.chars().flat_map(|c| {
                self.encode_plain(c.encode_utf8(&mut [0; 4]))
                    .unwrap_or_default()
            })),
        }
    }

    fn encode_plain(&self, text: &str) -> tokenizers::Result<Vec<u32>> {
        if text.is_empty() {
            return Ok(Vec::new());
        }
        let mut pre = PreTokenizedString::from(text);
        if let Some(n) = self.tok.get_normalizer() {
            pre.normalize(|s| n.normalize(s))?;
        }
        if let Some(p) = self.tok.get_pre_tokenizer() {
            p.pre_tokenize(&mut pre)?;
        }
        let model = self.tok.get_model();
        pre.tokenize(|s| model.tokenize(s.get()))?;
        Ok(pre
            .into_encoding(None, 0, OffsetType::None)?
            .get_ids()
            .to_vec())
    }
}

/// `bos_token`, `eos_token`, `pad_token`, `unk_token` of an optional `tokenizer_config.json`, resolved
/// among the added tokens, then through `vocab_id`.
fn roles(
    dir: &Path,
    vocab_id: impl Fn(&str) -> Option<u32>,
    added: &[(String, u32, bool)],
) -> Result<[Option<u32>; 4]> {
    let lookup = |name: &str| {
        added
            .iter()
            .find(|(content, _, _)| content == name)
            .map(|&(_, id, _)| id)
            .or_else(|| vocab_id(name))
    };
    let path = dir.join(crate::files::CONFIG_FILE);
    let mut roles = [None; 4];
    if !path.exists() {
        return Ok(roles);
    }
    let shown = path.display();
    let text = std::fs::read_to_string(&path).with_context(|| format!("reading {shown}"))?;
    let root: Value =
        serde_json::from_str(&text).with_context(|| format!("{shown}: expected JSON"))?;
    for (role, field) in roles.iter_mut().zip(crate::files::ROLE_FIELDS) {
        let Some(name) = crate::files::role_name(root.get(field), field, &shown)? else {
            continue;
        };
        let Some(id) = lookup(name) else {
            bail!("{shown}: {field}: {name:?} is not a token of tokenizer.json");
        };
        *role = Some(id);
    }
    Ok(roles)
}
