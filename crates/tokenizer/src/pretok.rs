//! Pre-tokenizers (Kimi's and tiktoken's o200k): cut text into the pieces BPE sees, as a hand-written
//! linear-time scanner.
//!
//! The two patterns ([`KIMI_PATTERN`], [`O200K_PATTERN`]) share their structure; o200k has no Han
//! alternative (so its letter classes include Han) and lets `/` follow a punctuation run as newlines
//! do. The pieces are exactly the matches of the [`Pattern`] under backtracking (leftmost-first) regex
//! semantics — the semantics tiktoken gets from fancy-regex — but found without backtracking: every
//! alternative below is matched by forward scans that remember the positions a backtracking engine
//! would fall back to, so each input byte is looked at a bounded number of times. A backtracking
//! engine spends O(n) per match on inputs such as long whitespace runs cut into short pieces, and
//! gives up beyond its backtrack limit; the scanner has neither problem.
//!
//! Character classes come from the same Unicode tables the regex engines use: each class expression of
//! the pattern is parsed by `regex-syntax` once and merged into one range table.
//!
//! Invalid UTF-8 (only reachable through [`pretokenize_bytes`]): each maximal invalid subsequence (the
//! unit `String::from_utf8_lossy` replaces by one U+FFFD) is classified as if it were U+FFFD (a symbol),
//! but its raw bytes stay in the piece, so pieces always concatenate back to the input.

use std::sync::OnceLock;

/// Kimi's pattern, one alternative per line (documentation and the cross-check oracle in the tests; the
/// scanner below implements it). The two letter alternatives exclude Han so that Han runs stay in the
/// first alternative; `\s+(?!\S)` leaves the last space of a run to prefix the next word.
pub const KIMI_PATTERN: &str = concat!(
    r"[\p{Han}]+",
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|\p{N}{1,3}",
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"|\s*[\r\n]+",
    r"|\s+(?!\S)",
    r"|\s+",
);

/// tiktoken's `o200k_base` pattern (also `o200k_harmony`'s, gpt-oss's), as `tiktoken_ext/openai_public.py`
/// joins it.
pub const O200K_PATTERN: &str = concat!(
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|\p{N}{1,3}",
    r"| ?[^\s\p{L}\p{N}]+[\r\n/]*",
    r"|\s*[\r\n]+",
    r"|\s+(?!\S)",
    r"|\s+",
);

/// A pre-tokenizer pattern the scanner implements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pattern {
    /// [`KIMI_PATTERN`] (K3's `tiktoken.model`).
    Kimi,
    /// [`O200K_PATTERN`] (gpt-oss's o200k_harmony).
    O200k,
}

impl Pattern {
    /// The pattern as tiktoken writes it.
    pub fn regex(self) -> &'static str {
        match self {
            Pattern::Kimi => KIMI_PATTERN,
            Pattern::O200k => O200K_PATTERN,
        }
    }

    /// The pattern whose regex is exactly `regex`, if the scanner implements it.
    pub fn from_regex(regex: &str) -> Option<Pattern> {
        [Pattern::Kimi, Pattern::O200k]
            .into_iter()
            .find(|p| p.regex() == regex)
    }

    /// Splits `bytes` into the pieces BPE sees; their concatenation is always exactly `bytes`. Valid
    /// UTF-8 splits exactly as tiktoken splits it with [`Self::regex`]; invalid sequences are treated as
    /// U+FFFD (see the module docs). Time is linear in the input length.
    pub fn pieces(self, bytes: &[u8]) -> Pieces<'_> {
        Pieces {
            scanner: Scanner {
                b: bytes,
                t: table(self),
                slash_after_punct: self == Pattern::O200k,
            },
            pos: 0,
        }
    }

    /// Splits `text` into the pieces BPE sees; their concatenation is always exactly `text`.
    pub fn split(self, text: &str) -> Vec<&str> {
        let mut pos = 0;
        self.pieces(text.as_bytes())
            .map(|piece| {
                // Pieces of valid UTF-8 end on character boundaries, so the slice cannot panic.
                let s = &text[pos..pos + piece.len()];
                pos += piece.len();
                s
            })
            .collect()
    }
}

// One bit per class expression of the patterns.
const HAN: u8 = 1; // [\p{Han}] (Kimi only)
const UPPER: u8 = 2; // [\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}] (Kimi: && [^\p{Han}])
const LOWER: u8 = 4; // [\p{Ll}\p{Lm}\p{Lo}\p{M}] (Kimi: && [^\p{Han}])
const PREFIX: u8 = 8; // [^\r\n\p{L}\p{N}]
const DIGIT: u8 = 16; // \p{N}
const PUNCT: u8 = 32; // [^\s\p{L}\p{N}]
const SPACE: u8 = 64; // \s

const KIMI_CLASSES: &[(u8, &str)] = &[
    (HAN, r"[\p{Han}]"),
    (UPPER, r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"),
    (LOWER, r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"),
    (PREFIX, r"[^\r\n\p{L}\p{N}]"),
    (DIGIT, r"\p{N}"),
    (PUNCT, r"[^\s\p{L}\p{N}]"),
    (SPACE, r"\s"),
];

/// o200k's classes: no Han alternative, so the letter classes keep Han and the HAN bit is never set.
const O200K_CLASSES: &[(u8, &str)] = &[
    (UPPER, r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"),
    (LOWER, r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"),
    (PREFIX, r"[^\r\n\p{L}\p{N}]"),
    (DIGIT, r"\p{N}"),
    (PUNCT, r"[^\s\p{L}\p{N}]"),
    (SPACE, r"\s"),
];

/// Class bits of every code point: a direct table for ASCII, sorted (first code point, bits) runs above.
struct ClassTable {
    ascii: [u8; 128],
    runs: Vec<(u32, u8)>,
}

fn class_ranges(expr: &str) -> Vec<(u32, u32)> {
    use regex_syntax::hir::{Class, HirKind};
    let hir = regex_syntax::Parser::new()
        .parse(expr)
        .expect("the built-in class expressions parse");
    match hir.kind() {
        HirKind::Class(Class::Unicode(c)) => c
            .ranges()
            .iter()
            .map(|r| (r.start() as u32, r.end() as u32))
            .collect(),
        other => panic!("{expr} is not a Unicode class: {other:?}"),
    }
}

fn table(pattern: Pattern) -> &'static ClassTable {
    static KIMI: OnceLock<ClassTable> = OnceLock::new();
    static O200K: OnceLock<ClassTable> = OnceLock::new();
    match pattern {
        Pattern::Kimi => KIMI.get_or_init(|| build_table(KIMI_CLASSES)),
        Pattern::O200k => O200K.get_or_init(|| build_table(O200K_CLASSES)),
    }
}

fn build_table(class_exprs: &[(u8, &str)]) -> ClassTable {
    let classes: Vec<(u8, Vec<(u32, u32)>)> = class_exprs
        .iter()
        .map(|&(bit, expr)| (bit, class_ranges(expr)))
        .collect();
    let bits_of = |cp: u32| {
        classes.iter().fold(0u8, |acc, (bit, ranges)| {
            let i = ranges.partition_point(|&(_, end)| end < cp);
            if i < ranges.len() && ranges[i].0 <= cp {
                acc | bit
            } else {
                acc
            }
        })
    };
    let mut starts: Vec<u32> = vec![0];
    for (_, ranges) in &classes {
        for &(s, e) in ranges {
            starts.push(s);
            starts.push(e + 1);
        }
    }
    starts.sort_unstable();
    starts.dedup();
    let mut runs: Vec<(u32, u8)> = Vec::new();
    for s in starts {
        let bits = bits_of(s);
        if runs.last().is_none_or(|&(_, b)| b != bits) {
            runs.push((s, bits));
        }
    }
    ClassTable {
        ascii: std::array::from_fn(|c| bits_of(c as u32)),
        runs,
    }
}

impl ClassTable {
    #[inline]
    fn bits(&self, cp: u32) -> u8 {
        if cp < 128 {
            self.ascii[cp as usize]
        } else {
            let i = self.runs.partition_point(|&(s, _)| s <= cp);
            self.runs[i - 1].1
        }
    }
}

/// Decodes the character at `b[i..]` (`i < b.len()`): `(code point, length)`. A maximal invalid
/// subsequence decodes as U+FFFD with its own length (1–3 bytes), as `Utf8Chunks` delimits it.
#[inline]
fn decode_at(b: &[u8], i: usize) -> (u32, usize) {
    let b0 = b[i];
    if b0 < 0x80 {
        return (b0 as u32, 1);
    }
    const INVALID: u32 = 0xFFFD;
    // Expected continuation count and the allowed range of the second byte (Unicode Table 3-7).
    let (extra, lo, hi, init) = match b0 {
        0xC2..=0xDF => (1, 0x80, 0xBF, b0 as u32 & 0x1F),
        0xE0 => (2, 0xA0, 0xBF, 0),
        0xE1..=0xEC | 0xEE..=0xEF => (2, 0x80, 0xBF, b0 as u32 & 0x0F),
        0xED => (2, 0x80, 0x9F, 0x0D),
        0xF0 => (3, 0x90, 0xBF, 0),
        0xF1..=0xF3 => (3, 0x80, 0xBF, b0 as u32 & 0x07),
        0xF4 => (3, 0x80, 0x8F, 4),
        _ => return (INVALID, 1),
    };
    let mut cp = init;
    for k in 1..=extra {
        let (lo, hi) = if k == 1 { (lo, hi) } else { (0x80, 0xBF) };
        match b.get(i + k) {
            Some(&c) if (lo..=hi).contains(&c) => cp = (cp << 6) | (c as u32 & 0x3F),
            _ => return (INVALID, k),
        }
    }
    (cp, extra + 1)
}

/// `c` matches the ASCII letter `lower` case-insensitively under Unicode simple case folding (only `s`
/// has a non-ASCII fold among the contraction letters: U+017F LATIN SMALL LETTER LONG S).
#[inline]
fn folds_to(c: u32, lower: u8) -> bool {
    c == lower as u32 || c == lower.to_ascii_uppercase() as u32 || (lower == b's' && c == 0x17F)
}

struct Scanner<'a> {
    b: &'a [u8],
    t: &'static ClassTable,
    /// o200k's punctuation alternative ends in `[\r\n/]*`, Kimi's in `[\r\n]*`.
    slash_after_punct: bool,
}

impl Scanner<'_> {
    /// (class bits, length, code point) of the character at `i < len`.
    #[inline]
    fn at(&self, i: usize) -> (u8, usize, u32) {
        let (cp, len) = decode_at(self.b, i);
        (self.t.bits(cp), len, cp)
    }

    #[inline]
    fn bits(&self, i: usize) -> u8 {
        if i < self.b.len() {
            self.at(i).0
        } else {
            0
        }
    }

    /// End of the run of characters from `i` that have any bit of `mask`.
    fn run_end(&self, mut i: usize, mask: u8) -> usize {
        while i < self.b.len() {
            let (bits, len, _) = self.at(i);
            if bits & mask == 0 {
                break;
            }
            i += len;
        }
        i
    }

    /// End of the run of `\r`/`\n` from `i`.
    fn newline_run_end(&self, mut i: usize) -> usize {
        while matches!(self.b.get(i), Some(b'\r' | b'\n')) {
            i += 1;
        }
        i
    }

    /// End of the run of `\r`/`\n` (and `/` where the pattern allows it) that may follow punctuation.
    fn punct_tail_end(&self, mut i: usize) -> usize {
        while let Some(&c) = self.b.get(i) {
            if !(c == b'\r' || c == b'\n' || (self.slash_after_punct && c == b'/')) {
                break;
            }
            i += 1;
        }
        i
    }

    /// `(?i:'s|'t|'re|'ve|'m|'ll|'d)?` at `e`: the end after the optional contraction.
    fn contraction_end(&self, e: usize) -> usize {
        if self.b.get(e) != Some(&b'\'') || e + 1 >= self.b.len() {
            return e;
        }
        let (c1, l1) = decode_at(self.b, e + 1);
        let second = |letter: u8| {
            let p = e + 1 + l1;
            if p < self.b.len() {
                let (c2, l2) = decode_at(self.b, p);
                folds_to(c2, letter).then_some(p + l2)
            } else {
                None
            }
        };
        let one = e + 1 + l1;
        let found = if [b's', b't', b'm', b'd'].iter().any(|&l| folds_to(c1, l)) {
            Some(one)
        } else if folds_to(c1, b'r') || folds_to(c1, b'v') {
            second(b'e')
        } else if folds_to(c1, b'l') {
            second(b'l')
        } else {
            None
        };
        found.unwrap_or(e)
    }

    /// End of the piece that starts at `i < len`: the match of the first alternative that matches there,
    /// with the length a backtracking engine would choose.
    fn piece_end(&self, i: usize) -> usize {
        let n = self.b.len();
        let (bits0, len0, cp0) = self.at(i);
        // [\p{Han}]+
        if bits0 & HAN != 0 {
            return self.run_end(i, HAN);
        }
        // The optional `[^\r\n\p{L}\p{N}]?` of the two letter alternatives: taken first, dropped on failure.
        let letter_starts = [(bits0 & PREFIX != 0).then_some(i + len0), Some(i)];
        // P? U* W+ C?: U* runs to k, then backs off to the last position where W+ can start: k itself if
        // it holds a W character, else the last W character inside the U run (then W+ is that one).
        for j in letter_starts.into_iter().flatten() {
            let mut k = j;
            let mut last_lower = None;
            while k < n {
                let (bits, len, _) = self.at(k);
                if bits & UPPER == 0 {
                    break;
                }
                if bits & LOWER != 0 {
                    last_lower = Some(k);
                }
                k += len;
            }
            let lower_start = if self.bits(k) & LOWER != 0 {
                Some(k)
            } else {
                last_lower
            };
            if let Some(s) = lower_start {
                return self.contraction_end(self.run_end(s, LOWER));
            }
        }
        // P? U+ W* C?: the greedy path always succeeds once U+ has one character.
        for j in letter_starts.into_iter().flatten() {
            let k = self.run_end(j, UPPER);
            if k > j {
                return self.contraction_end(self.run_end(k, LOWER));
            }
        }
        // \p{N}{1,3}
        if bits0 & DIGIT != 0 {
            let mut e = i;
            for _ in 0..3 {
                if e >= n {
                    break;
                }
                let (bits, len, _) = self.at(e);
                if bits & DIGIT == 0 {
                    break;
                }
                e += len;
            }
            return e;
        }
        // ` ?[^\s\p{L}\p{N}]+[\r\n]*` (o200k: `[\r\n/]*`)
        for j in [(cp0 == ' ' as u32).then_some(i + 1), Some(i)]
            .into_iter()
            .flatten()
        {
            if self.bits(j) & PUNCT != 0 {
                return self.punct_tail_end(self.run_end(j, PUNCT));
            }
        }
        // One scan of the whitespace run from i serves the last three alternatives.
        let mut k = i;
        let mut last_newline = None;
        let mut last_start = i;
        while k < n {
            let (bits, len, cp) = self.at(k);
            if bits & SPACE == 0 {
                break;
            }
            if cp == '\r' as u32 || cp == '\n' as u32 {
                last_newline = Some(k);
            }
            last_start = k;
            k += len;
        }
        // \s*[\r\n]+: \s* backs off to the last newline of the run, then [\r\n]+ runs greedily.
        let newline = if matches!(self.b.get(k), Some(b'\r' | b'\n')) {
            Some(k)
        } else {
            last_newline
        };
        if let Some(m) = newline {
            return self.newline_run_end(m);
        }
        if k > i {
            // \s+(?!\S): the whole run at the end of the text, else all but its last character (which
            // is followed by whitespace) if that leaves at least one.
            if k == n {
                return n;
            }
            if last_start > i {
                return last_start;
            }
            // \s+
            return k;
        }
        // Unreachable: every character is Han, a letter (UPPER or LOWER), a digit, whitespace, or PUNCT.
        // Taking one character keeps the pieces tiling the input regardless.
        i + len0
    }
}

/// Iterator over the pieces of a byte string (see [`pretokenize_bytes`]).
pub struct Pieces<'a> {
    scanner: Scanner<'a>,
    pos: usize,
}

impl<'a> Iterator for Pieces<'a> {
    type Item = &'a [u8];

    fn next(&mut self) -> Option<&'a [u8]> {
        if self.pos >= self.scanner.b.len() {
            return None;
        }
        let start = self.pos;
        self.pos = self.scanner.piece_end(start);
        Some(&self.scanner.b[start..self.pos])
    }
}

/// [`Pattern::pieces`] with Kimi's pattern.
pub fn pretokenize_bytes(bytes: &[u8]) -> Pieces<'_> {
    Pattern::Kimi.pieces(bytes)
}

/// [`Pattern::split`] with Kimi's pattern.
pub fn pretokenize(text: &str) -> Vec<&str> {
    Pattern::Kimi.split(text)
}

#[cfg(test)]
mod tests;
