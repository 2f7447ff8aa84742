//! Streaming decode: text out as tokens arrive, never half a UTF-8 character.

use crate::Tokenizer;
use anyhow::Result;
use std::borrow::Borrow;

/// Turns a stream of token ids into text pieces. A character whose bytes are split across tokens is held
/// back until its last byte arrives; bytes that can never complete a character come out as U+FFFD right
/// away (one per invalid subsequence, as `String::from_utf8_lossy` does), so nothing is held forever.
/// Special ids come out as their names. Concatenating every returned piece and [`Self::finish`] gives
/// `String::from_utf8_lossy` of all the tokens' bytes.
///
/// It holds the tokenizer as `T`: a `&Tokenizer` usually, an `Arc<Tokenizer>` where the decoder must own it
/// (a sink handed to another thread).
pub struct StreamDecoder<T: Borrow<Tokenizer>> {
    tokenizer: T,
    /// Bytes of an incomplete character (at most 3).
    pending: Vec<u8>,
}

impl<T: Borrow<Tokenizer>> StreamDecoder<T> {
    pub fn new(tokenizer: T) -> Self {
        StreamDecoder {
            tokenizer,
            pending: Vec::new(),
        }
    }

    /// The text completed by token `id` (possibly empty). Errors only for ids outside the vocabulary.
    pub fn push(&mut self, id: u32) -> Result<String> {
        let bytes = self.tokenizer.borrow().decode_bytes(&[id])?;
        Ok(self.push_bytes(&bytes))
    }

    /// Like [`Self::push`] for raw bytes.
    pub fn push_bytes(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let mut out = String::new();
        let mut rest: &[u8] = &self.pending;
        loop {
            match std::str::from_utf8(rest) {
                Ok(s) => {
                    out.push_str(s);
                    rest = &[];
                    break;
                }
                Err(e) => {
                    let (valid, after) = rest.split_at(e.valid_up_to());
                    // Valid UTF-8 by construction of valid_up_to.
                    out.push_str(std::str::from_utf8(valid).unwrap_or_default());
                    match e.error_len() {
                        // An incomplete character at the end: wait for more bytes.
                        None => {
                            rest = after;
                            break;
                        }
                        Some(len) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            rest = &after[len..];
                        }
                    }
                }
            }
        }
        self.pending = rest.to_vec();
        out
    }

    /// Ends the stream: an incomplete trailing character comes out as U+FFFD.
    pub fn finish(&mut self) -> String {
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        out
    }
}
