//! Streaming decode: text out as tokens arrive, never half a UTF-8 character.

use crate::Tokenizer;
use std::borrow::Borrow;
use std::sync::Once;

/// Turns a stream of token ids into text pieces. A character whose bytes are split across tokens is held
/// back until its last byte arrives; bytes that can never complete a character come out as U+FFFD right
/// away (one per invalid subsequence, as `String::from_utf8_lossy` does), so nothing is held forever.
/// Special ids come out as their names; ids with no text as nothing. Concatenating every returned piece and [`Self::finish`] gives
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

    /// The text completed by token `id` (possibly empty). An id the tokenizer has no text for (a padding
    /// row beyond the ranks and specials) completes nothing: a model may pick one, and its output must not
    /// end the generation. The first such id warns on stderr, once per process.
    pub fn push(&mut self, id: u32) -> String {
        let tokenizer = self.tokenizer.borrow();
        match tokenizer.token_bytes(id) {
            Some(bytes) => release(&mut self.pending, bytes),
            None => {
                static WARNED: Once = Once::new();
                WARNED.call_once(|| {
                    eprintln!(
                        "warning: the model generated a token the tokenizer has no text for: {}. Such ids (padding rows of the embedding table) render as no text, and generation goes on (said once).",
                        tokenizer.unrenderable(id)
                    )
                });
                String::new()
            }
        }
    }

    /// Like [`Self::push`] for raw bytes.
    pub fn push_bytes(&mut self, bytes: &[u8]) -> String {
        release(&mut self.pending, bytes)
    }

    /// Ends the stream: an incomplete trailing character comes out as U+FFFD.
    pub fn finish(&mut self) -> String {
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        out
    }
}

/// Appends `bytes` to the incomplete character in `pending` and takes out every character that is now
/// complete (or can never be).
fn release(pending: &mut Vec<u8>, bytes: &[u8]) -> String {
    pending.extend_from_slice(bytes);
    let mut out = String::new();
    let mut rest: &[u8] = pending;
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
    *pending = rest.to_vec();
    out
}
