//! tiktoken-format byte-level BPE with K3's special tokens.
//!
//! `tiktoken.model` holds the ranks (rank = id); `tokenizer_config.json` names the added (special) ids
//! above them. Ordinary encoding never produces special ids: text such as "<|open|>" is BPE'd like any
//! other text, and only template code asks for special ids by name via [`Tokenizer::special_id`].

mod bpe;
mod files;
mod pretok;
mod train;

use anyhow::{bail, Context, Result};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

pub use files::{k3_special_name, write_tiktoken_files, K3_NUM_SPECIALS};
pub use pretok::pretokenize;
pub use train::train_bpe;

/// A loaded tokenizer: rank BPE plus named special ids.
pub struct Tokenizer {
    /// Token bytes by rank.
    tokens: Vec<Vec<u8>>,
    ranks: HashMap<Vec<u8>, u32>,
    byte_rank: [u32; 256],
    specials: BTreeMap<u32, String>,
    special_ids: HashMap<String, u32>,
    /// Ids of bos/eos/pad/unk from the config, in `files::ROLE_FIELDS` order.
    roles: [Option<u32>; 4],
}

impl Tokenizer {
    /// Loads `tiktoken.model` and `tokenizer_config.json` from `dir`. Errors name the file and the line or
    /// field at fault, with what was expected and what was found.
    pub fn from_dir(dir: &Path) -> Result<Tokenizer> {
        let model_path = dir.join(files::TIKTOKEN_FILE);
        let model = std::fs::read(&model_path)
            .with_context(|| format!("reading {}", model_path.display()))?;
        let model = match std::str::from_utf8(&model) {
            Ok(s) => s,
            Err(e) => {
                let line = model[..e.valid_up_to()]
                    .iter()
                    .filter(|&&b| b == b'\n')
                    .count()
                    + 1;
                bail!(
                    "{}:{line}: expected ASCII text, found a non-UTF-8 byte",
                    model_path.display()
                );
            }
        };
        let tokens = files::parse_tiktoken(&model_path, model)?;

        let config_path = dir.join(files::CONFIG_FILE);
        let config = std::fs::read_to_string(&config_path)
            .with_context(|| format!("reading {}", config_path.display()))?;
        let config = files::parse_config(&config_path, &config, tokens.len())?;

        let ranks: HashMap<Vec<u8>, u32> = tokens.iter().cloned().zip(0..).collect();
        let byte_rank = std::array::from_fn(|b| ranks[&[b as u8][..]]);
        let special_ids = config
            .specials
            .iter()
            .map(|(&id, name)| (name.clone(), id))
            .collect();
        Ok(Tokenizer {
            tokens,
            ranks,
            byte_rank,
            specials: config.specials,
            special_ids,
            roles: config.roles,
        })
    }

    /// Encodes ordinary text: Kimi pre-tokenizer, then rank BPE per piece (a piece that is itself a token
    /// maps to it directly, as in tiktoken). Special-token names in `text` are ordinary text.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        let mut out = Vec::with_capacity(text.len() / 3);
        for piece in pretokenize(text) {
            match self.ranks.get(piece.as_bytes()) {
                Some(&id) => out.push(id),
                None => bpe::encode_piece(piece.as_bytes(), &self.ranks, &self.byte_rank, &mut out),
            }
        }
        out
    }

    /// The bytes of `ids` concatenated; special ids render as their names.
    pub fn decode_bytes(&self, ids: &[u32]) -> Result<Vec<u8>> {
        let mut out = Vec::new();
        for &id in ids {
            if let Some(token) = self.tokens.get(id as usize) {
                out.extend_from_slice(token);
            } else if let Some(name) = self.specials.get(&id) {
                out.extend_from_slice(name.as_bytes());
            } else {
                bail!(
                    "token id {id} is outside the vocabulary (ranks 0..{}, {} special ids, vocab size {})",
                    self.tokens.len(),
                    self.specials.len(),
                    self.vocab_size()
                );
            }
        }
        Ok(out)
    }

    /// [`Self::decode_bytes`] as a String; invalid UTF-8 (e.g. half a character) becomes U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        Ok(String::from_utf8_lossy(&self.decode_bytes(ids)?).into_owned())
    }

    /// The id of the special token named `name` (e.g. "<|open|>").
    pub fn special_id(&self, name: &str) -> Option<u32> {
        self.special_ids.get(name).copied()
    }

    /// Ranks plus specials, i.e. the largest id + 1 (ids in gaps between them decode as errors).
    pub fn vocab_size(&self) -> usize {
        let top_special = self
            .specials
            .keys()
            .next_back()
            .map_or(0, |&id| id as usize + 1);
        self.tokens.len().max(top_special)
    }

    /// Number of BPE ranks in `tiktoken.model` (ids 0..num_ranks).
    pub fn num_ranks(&self) -> usize {
        self.tokens.len()
    }

    /// `bos_token` from the config, resolved to its id.
    pub fn bos_id(&self) -> Option<u32> {
        self.roles[0]
    }

    /// `eos_token` from the config, resolved to its id.
    pub fn eos_id(&self) -> Option<u32> {
        self.roles[1]
    }

    /// `pad_token` from the config, resolved to its id.
    pub fn pad_id(&self) -> Option<u32> {
        self.roles[2]
    }

    /// `unk_token` from the config, resolved to its id.
    pub fn unk_id(&self) -> Option<u32> {
        self.roles[3]
    }
}

/// The text the test tokenizers are trained on: prose, code, numbers, punctuation and some non-English
/// text (incl. Han and emoji). `train_bpe` reaches well over 4096 ranks on it.
pub fn builtin_corpus() -> &'static str {
    include_str!("corpus.txt")
}
