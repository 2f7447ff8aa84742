//! tiktoken-format byte-level BPE with K3's special tokens, chat rendering and reply parsing.
//!
//! `tiktoken.model` holds the ranks (rank = id); `tokenizer_config.json` names the added (special) ids
//! above them. A Hugging Face `tokenizer.json` loads too: a converted tiktoken tokenizer (gpt-oss's
//! o200k_harmony) with the same rank BPE and its own pattern, any other through the `tokenizers` crate.
//!
//! # Encoding
//!
//! - [`Tokenizer::encode`] / [`Tokenizer::encode_bytes`]: ordinary text. Never produces special ids: text
//!   such as "<|open|>" is BPE'd like any other text. Pre-tokenization is a linear-time scanner with
//!   exactly the semantics of tiktoken's regex (Kimi's [`pretok::KIMI_PATTERN`] or o200k's
//!   [`pretok::O200K_PATTERN`]); invalid UTF-8 given to
//!   `encode_bytes` is pre-tokenized as if each invalid subsequence were U+FFFD, and BPE'd as its raw
//!   bytes, so decoding gives the input back byte for byte.
//! - [`Tokenizer::encode_pieces`]: a rendered chat, as [`Piece`]s. Special-token names are recognised
//!   only in [`Piece::Template`] text (owned by the template); [`Piece::Text`] (user, tool or model
//!   text) is always ordinary text. Adjacent text of both kinds is BPE'd as one string, so the ids equal
//!   those of tokenizing the rendered string with specials recognised, whenever the user text holds no
//!   special names.
//!
//! # Decoding
//!
//! [`Tokenizer::decode`] for whole sequences; [`StreamDecoder`] for streams: it returns text as tokens
//! arrive and never emits half a UTF-8 character. A generated id the tokenizer has no text for (a padding
//! row of the embedding table, as many released checkpoints have) renders as no text there, with one
//! warning per process: a model's own output never ends a generation.
//!
//! # Chat (module [`chat`])
//!
//! ```no_run
//! use deltafin_tokenizer::chat::{render_k3, ChatMessage, Effort, ReplyEvent, ReplyParser};
//! use deltafin_tokenizer::{StreamDecoder, Tokenizer};
//! # fn main() -> anyhow::Result<()> {
//! let tokenizer = Tokenizer::from_dir(std::path::Path::new("path/to/checkpoint"))?;
//! # let generated: Vec<u32> = Vec::new();
//! let pieces = render_k3(&[ChatMessage::user("Hi")], Some(Effort::High), true);
//! let prompt_ids = tokenizer.encode_pieces(&pieces);
//! let mut parser = ReplyParser::new(); // the K3 generation prompt leaves the reply inside a think block
//! let mut decoder = StreamDecoder::new(&tokenizer);
//! for id in generated {
//!     for event in parser.push(&decoder.push(id)) {
//!         match event {
//!             ReplyEvent::Reasoning(t) => {} // thinking text
//!             ReplyEvent::Content(t) => {}   // the answer
//!             ReplyEvent::ToolCall(call) => {}
//!         }
//!     }
//! }
//! let rest = parser.finish(&decoder.finish());
//! # Ok(())
//! # }
//! ```
//!
//! gpt-oss speaks harmony: [`chat::harmony::render_harmony`] renders a conversation as openai-harmony
//! does, [`chat::harmony::HarmonyParser`] turns the completion into the same [`chat::ReplyEvent`]s, and
//! generation stops at [`Tokenizer::eos_ids`] (from `generation_config.json`: `<|return|>`, `<|call|>`).
//! Other model families render through their checkpoint's own Jinja chat template:
//! [`chat::ChatTemplate::from_dir`] and [`chat::ChatTemplate::render`], which also return [`Piece`]s.

mod bpe;
pub mod chat;
mod files;
mod hf;
pub mod pretok;
mod stream;
mod train;

use anyhow::{bail, Context, Result};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

pub use files::{
    k3_special_name, write_tiktoken_files, write_tiktoken_files_named, K3_NUM_SPECIALS,
};
pub use hf::byte_level_alphabet;
pub use pretok::{pretokenize, pretokenize_bytes, Pattern};
pub use stream::StreamDecoder;
pub use train::train_bpe;

/// A loaded tokenizer: rank BPE plus named special ids.
pub struct Tokenizer {
    /// Token bytes by rank (tiktoken) or by id (tokenizer.json; empty for ids not in the vocabulary).
    tokens: Vec<Vec<u8>>,
    backend: Backend,
    specials: BTreeMap<u32, String>,
    special_ids: HashMap<String, u32>,
    /// Ids of bos/eos/pad/unk from the config, in `files::ROLE_FIELDS` order.
    roles: [Option<u32>; 4],
    /// `eos_token_id` of `generation_config.json` (one id or a list), if the directory has one.
    generation_eos: Vec<u32>,
    /// Special names, longest first, and which bytes start one (for [`Tokenizer::encode_pieces`]).
    specials_by_len: Vec<(String, u32)>,
    special_first_bytes: [bool; 256],
}

/// How ordinary text becomes ids.
// One per tokenizer, so the inline 1 KiB byte table costs nothing worth a box.
#[allow(clippy::large_enum_variant)]
enum Backend {
    /// Rank BPE after one of the scanner's pre-tokenizers: K3's `tiktoken.model` (Kimi's pattern) or a
    /// converted tiktoken `tokenizer.json` (its own pattern, e.g. gpt-oss's o200k).
    Tiktoken {
        ranks: HashMap<Vec<u8>, u32>,
        byte_rank: [u32; 256],
        pattern: Pattern,
    },
    /// Hugging Face `tokenizer.json` through the `tokenizers` crate.
    Hf(Box<hf::HfBackend>),
}

/// Part of a rendered chat prompt (see [`Tokenizer::encode_pieces`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Piece {
    /// Text the template owns: special-token names in it become special ids.
    Template(String),
    /// Text from the conversation (user, tool, model): always ordinary text, even "<|open|>".
    Text(String),
}

impl Piece {
    /// The piece's text, whichever kind it is.
    pub fn as_str(&self) -> &str {
        match self {
            Piece::Template(t) | Piece::Text(t) => t,
        }
    }
}

impl Tokenizer {
    /// Whether `dir` holds tokenizer files [`Self::from_dir`] can load (`tiktoken.model` or
    /// `tokenizer.json`).
    pub fn present_in(dir: &Path) -> bool {
        dir.join(files::TIKTOKEN_FILE).exists() || dir.join(hf::HF_FILE).exists()
    }

    /// Loads `tiktoken.model` and `tokenizer_config.json` from `dir`. Errors name the file and the line or
    /// field at fault, with what was expected and what was found.
    ///
    /// A directory with `tokenizer.json` and no `tiktoken.model` loads that instead: a converted tiktoken
    /// tokenizer (gpt-oss's) with deltafin's own rank BPE, any other through the `tokenizers` crate. Its
    /// added tokens flagged `special` are the specials; every added token is recognised in template text;
    /// bos/eos/pad/unk come from `tokenizer_config.json` where present.
    ///
    /// Either way `generation_config.json`, where present, adds its `eos_token_id`s to [`Self::eos_ids`].
    pub fn from_dir(dir: &Path) -> Result<Tokenizer> {
        if !dir.join(files::TIKTOKEN_FILE).exists() && dir.join(hf::HF_FILE).exists() {
            return Self::from_hf_dir(dir);
        }
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

        let backend = rank_backend(&tokens, Pattern::Kimi);
        let added = config
            .specials
            .iter()
            .map(|(&id, name)| (name.clone(), id))
            .collect();
        Self::assemble(dir, tokens, backend, config.specials, added, config.roles)
    }

    fn from_hf_dir(dir: &Path) -> Result<Tokenizer> {
        let loaded = hf::load(dir)?;
        let backend = match loaded.engine {
            hf::Engine::Ranks { pattern, num_ranks } => {
                rank_backend(&loaded.tokens[..num_ranks], pattern)
            }
            hf::Engine::Crate(b) => Backend::Hf(b),
        };
        Self::assemble(
            dir,
            loaded.tokens,
            backend,
            loaded.specials,
            loaded.added,
            loaded.roles,
        )
    }

    /// The tokenizer from its parts; `added` (specials and other added tokens) are recognised in template
    /// text, and `generation_config.json`'s `eos_token_id` is read from `dir`.
    fn assemble(
        dir: &Path,
        tokens: Vec<Vec<u8>>,
        backend: Backend,
        specials: BTreeMap<u32, String>,
        mut added: Vec<(String, u32)>,
        roles: [Option<u32>; 4],
    ) -> Result<Tokenizer> {
        let special_ids = specials
            .iter()
            .map(|(&id, name)| (name.clone(), id))
            .collect();
        added.sort_by(|(a, ia), (b, ib)| b.len().cmp(&a.len()).then(ia.cmp(ib)));
        let mut special_first_bytes = [false; 256];
        for (name, _) in &added {
            special_first_bytes[name.as_bytes()[0] as usize] = true;
        }
        let mut tok = Tokenizer {
            tokens,
            backend,
            specials,
            special_ids,
            roles,
            generation_eos: Vec::new(),
            specials_by_len: added,
            special_first_bytes,
        };
        tok.generation_eos =
            files::generation_eos(dir, |id| tok.token_bytes(id).is_some(), tok.vocab_size())?;
        Ok(tok)
    }

    /// Encodes ordinary text: the pre-tokenizer (Kimi's, or the pattern of a converted `tokenizer.json`),
    /// then rank BPE per piece (a piece that is itself a token
    /// maps to it directly, as in tiktoken). Special-token names in `text` are ordinary text.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        self.encode_bytes(text.as_bytes())
    }

    /// [`Self::encode`] for arbitrary bytes. Invalid UTF-8 is kept, not replaced: each invalid
    /// subsequence is pre-tokenized like U+FFFD but BPE'd as its own bytes, so
    /// `decode_bytes(encode_bytes(b)) == b` for every `b`. (A `tokenizer.json` tokenizer encodes text
    /// only: there each invalid subsequence becomes U+FFFD.)
    pub fn encode_bytes(&self, bytes: &[u8]) -> Vec<u32> {
        let mut out = Vec::with_capacity(bytes.len() / 3);
        self.encode_into(bytes, &mut out);
        out
    }

    fn encode_into(&self, bytes: &[u8], out: &mut Vec<u32>) {
        let (ranks, byte_rank, pattern) = match &self.backend {
            Backend::Tiktoken {
                ranks,
                byte_rank,
                pattern,
            } => (ranks, byte_rank, *pattern),
            Backend::Hf(hf) => return hf.encode_into(&String::from_utf8_lossy(bytes), out),
        };
        for piece in pattern.pieces(bytes) {
            match ranks.get(piece) {
                Some(&id) => out.push(id),
                None => bpe::encode_piece(piece, ranks, byte_rank, out),
            }
        }
    }

    /// Encodes a rendered template: special-token names are recognised in [`Piece::Template`] text
    /// only; runs of text between specials (from any mix of pieces) are encoded as one string.
    pub fn encode_pieces(&self, pieces: &[Piece]) -> Vec<u32> {
        let mut out = Vec::new();
        let mut text = String::new();
        for piece in pieces {
            match piece {
                Piece::Text(t) => text.push_str(t),
                Piece::Template(t) => {
                    let mut rest = t.as_str();
                    while let Some((at, name, id)) = self.find_special(rest) {
                        text.push_str(&rest[..at]);
                        self.encode_into(text.as_bytes(), &mut out);
                        text.clear();
                        out.push(id);
                        rest = &rest[at + name.len()..];
                    }
                    text.push_str(rest);
                }
            }
        }
        self.encode_into(text.as_bytes(), &mut out);
        out
    }

    /// Encodes template-owned text with special-token names recognised (e.g. "<|open|>" → its id).
    /// Never pass user text here; use [`Self::encode_pieces`] to mix the two.
    pub fn encode_with_specials(&self, template_text: &str) -> Vec<u32> {
        self.encode_pieces(&[Piece::Template(template_text.to_string())])
    }

    /// The first special-token name in `text` (the longest one where several start at the same byte):
    /// (byte offset, name, id).
    fn find_special<'a>(&'a self, text: &str) -> Option<(usize, &'a str, u32)> {
        let bytes = text.as_bytes();
        (0..bytes.len())
            .filter(|&i| self.special_first_bytes[bytes[i] as usize])
            .find_map(|i| {
                self.specials_by_len
                    .iter()
                    .find(|(name, _)| bytes[i..].starts_with(name.as_bytes()))
                    .map(|(name, id)| (i, name.as_str(), *id))
            })
    }

    /// The bytes of `ids` concatenated; special ids render as their names. An id with no text is an error
    /// here; a model's output goes through [`StreamDecoder`], which renders such ids as nothing.
    pub fn decode_bytes(&self, ids: &[u32]) -> Result<Vec<u8>> {
        let mut out = Vec::new();
        for &id in ids {
            match self.token_bytes(id) {
                Some(bytes) => out.extend_from_slice(bytes),
                None => bail!("{}", self.unrenderable(id)),
            }
        }
        Ok(out)
    }

    /// The bytes of one id (a special id's name), or `None` for an id the tokenizer has no text for: a gap,
    /// or a padding row of the model's embedding table beyond the ranks and specials.
    pub fn token_bytes(&self, id: u32) -> Option<&[u8]> {
        // Tiktoken tokens are never empty; an empty entry is a gap in a tokenizer.json vocabulary.
        match self.tokens.get(id as usize).filter(|t| !t.is_empty()) {
            Some(token) => Some(token),
            None => self.specials.get(&id).map(|name| name.as_bytes()),
        }
    }

    /// Says that `id` has no text, and what the tokenizer does cover.
    pub(crate) fn unrenderable(&self, id: u32) -> String {
        format!(
            "token id {id} is outside the vocabulary (ranks 0..{}, {} special ids, vocab size {})",
            self.tokens.len(),
            self.specials.len(),
            self.vocab_size()
        )
    }

    /// [`Self::decode_bytes`] as a String; invalid UTF-8 (e.g. half a character) becomes U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        Ok(String::from_utf8_lossy(&self.decode_bytes(ids)?).into_owned())
    }

    /// The name of special id `id`, if it is one.
    pub fn special_name(&self, id: u32) -> Option<&str> {
        self.specials.get(&id).map(String::as_str)
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

    /// Number of BPE ranks (ids 0..num_ranks); for a `tokenizer.json` the `tokenizers` crate runs, the
    /// size of the model's own vocabulary (added tokens not counted).
    pub fn num_ranks(&self) -> usize {
        match &self.backend {
            Backend::Tiktoken { ranks, .. } => ranks.len(),
            Backend::Hf(hf) => hf.model_vocab,
        }
    }

    /// The pre-tokenizer pattern, when deltafin runs the BPE itself (not for a `tokenizer.json` the
    /// `tokenizers` crate runs).
    pub fn pattern(&self) -> Option<Pattern> {
        match &self.backend {
            Backend::Tiktoken { pattern, .. } => Some(*pattern),
            Backend::Hf(_) => None,
        }
    }

    /// `bos_token` from the config, resolved to its id.
    pub fn bos_id(&self) -> Option<u32> {
        self.roles[0]
    }

    /// `eos_token` from the config, resolved to its id.
    pub fn eos_id(&self) -> Option<u32> {
        self.roles[1]
    }

    /// Every id that ends generation by the checkpoint's own files: `eos_token_id` of
    /// `generation_config.json` (gpt-oss lists `<|return|>`, `<|endoftext|>` and `<|call|>` there) and the
    /// config's `eos_token`; sorted, without repeats.
    pub fn eos_ids(&self) -> Vec<u32> {
        let mut ids: Vec<u32> = self
            .generation_eos
            .iter()
            .copied()
            .chain(self.eos_id())
            .collect();
        ids.sort_unstable();
        ids.dedup();
        ids
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

/// Rank BPE over `tokens` (rank = position), which hold every single byte.
fn rank_backend(tokens: &[Vec<u8>], pattern: Pattern) -> Backend {
    let ranks: HashMap<Vec<u8>, u32> = tokens.iter().cloned().zip(0..).collect();
    let byte_rank = std::array::from_fn(|b| ranks[&[b as u8][..]]);
    Backend::Tiktoken {
        ranks,
        byte_rank,
        pattern,
    }
}

/// The text the test tokenizers are trained on: prose, code, numbers, punctuation and some non-English
/// text (incl. Han and emoji). `train_bpe` reaches well over 4096 ranks on it.
pub fn builtin_corpus() -> &'static str {
    include_str!("corpus.txt")
}
