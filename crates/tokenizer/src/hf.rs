//! Hugging Face `tokenizer.json`, loaded through the `tokenizers` crate.
//!
//! Plain text is encoded through the tokenizer's normalizer, pre-tokenizer and model only, never its
//! added-token matcher, so text such as "<|endoftext|>" in user text is ordinary text; added tokens are
//! recognised by [`crate::Tokenizer::encode_pieces`] in template text, like the tiktoken backend's
//! specials. Token bytes for decoding are computed once per id: byte-level vocabularies through the
//! inverse of the GPT-2 byte-to-character alphabet, others through byte fallback (`<0x41>`) and `▁` as a
//! space.

use anyhow::{bail, Context, Result};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::Path;
use tokenizers::{Model, Normalizer, OffsetType, PreTokenizedString, PreTokenizer};

pub(crate) const HF_FILE: &str = "tokenizer.json";

pub(crate) struct HfBackend {
    tok: tokenizers::Tokenizer,
    /// Size of the model's own vocabulary (without added tokens).
    pub model_vocab: usize,
}

/// What [`load`] returns: the backend plus everything the shared [`crate::Tokenizer`] fields need.
pub(crate) struct Loaded {
    pub backend: HfBackend,
    /// Bytes of each id (empty for ids that are not in the vocabulary).
    pub tokens: Vec<Vec<u8>>,
    /// Added tokens flagged `special`, by id.
    pub specials: BTreeMap<u32, String>,
    /// Every added token (special or not): recognised in template text.
    pub added: Vec<(String, u32)>,
}

/// The GPT-2 byte-level alphabet: the character each byte is written as in a byte-level vocabulary.
fn byte_level_alphabet() -> [char; 256] {
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
    let tok = tokenizers::Tokenizer::from_bytes(&text).map_err(|e| {
        anyhow::anyhow!("{shown}: not a tokenizer the tokenizers crate can load: {e}")
    })?;

    let byte_level = is_byte_level(&root).then(|| {
        byte_level_alphabet()
            .iter()
            .enumerate()
            .map(|(b, &c)| (c, b as u8))
            .collect::<std::collections::HashMap<char, u8>>()
    });
    let vocab = tok.get_model().get_vocab();
    let added = tok.get_added_tokens_decoder();
    let top = vocab
        .values()
        .chain(added.keys())
        .max()
        .map_or(0, |&id| id as usize + 1);
    // Ids are (nearly) dense in any real vocabulary; the table is sized by the largest, so that must be in
    // proportion to the file.
    let entries = vocab.len() + added.len();
    if top > 2 * entries + 1024 {
        bail!(
            "{shown}: token id {} is far beyond the file's {entries} tokens (ids this sparse mean a damaged file)",
            top - 1
        );
    }
    let mut tokens = vec![Vec::new(); top];
    for (token, &id) in &vocab {
        tokens[id as usize] = token_bytes(token, byte_level.as_ref());
    }
    let mut specials = BTreeMap::new();
    let mut added_list = Vec::new();
    for (&id, t) in &added {
        if t.content.is_empty() {
            continue;
        }
        tokens[id as usize] = t.content.as_bytes().to_vec();
        if t.special {
            specials.insert(id, t.content.clone());
        }
        added_list.push((t.content.clone(), id));
    }
    let model_vocab = tok.get_model().get_vocab_size();
    Ok(Loaded {
        backend: HfBackend { tok, model_vocab },
        tokens,
        specials,
        added: added_list,
    })
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

    pub fn token_to_id(&self, name: &str) -> Option<u32> {
        self.tok.token_to_id(name)
    }
}

/// `bos_token`, `eos_token`, `pad_token`, `unk_token` of an optional `tokenizer_config.json`, resolved
/// through `lookup`.
pub(crate) fn roles(dir: &Path, lookup: impl Fn(&str) -> Option<u32>) -> Result<[Option<u32>; 4]> {
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
