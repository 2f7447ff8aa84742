//! Kimi's pre-tokenizer: the regex that cuts text into pieces before BPE.

use fancy_regex::Regex;
use std::sync::OnceLock;

/// Kimi's pattern, one alternative per line. The two letter alternatives exclude Han so that Han runs
/// stay in the first alternative; `\s+(?!\S)` leaves the last space of a run to prefix the next word.
const KIMI_PATTERN: &str = concat!(
    r"[\p{Han}]+",
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|\p{N}{1,3}",
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"|\s*[\r\n]+",
    r"|\s+(?!\S)",
    r"|\s+",
);

fn kimi_regex() -> &'static Regex {
    static RE: OnceLock<Regex> = OnceLock::new();
    RE.get_or_init(|| Regex::new(KIMI_PATTERN).expect("the built-in Kimi pattern compiles"))
}

/// Splits `text` into the pieces BPE sees; their concatenation is always exactly `text`.
///
/// Every character can start a match of some alternative, so matches tile the text. Should the regex
/// engine give up (fancy-regex's backtrack limit), the unsplit rest becomes one piece rather than being
/// lost: encoding stays lossless, only the merge boundaries differ from tiktoken's in that case.
pub fn pretokenize(text: &str) -> Vec<&str> {
    let mut pieces = Vec::new();
    let mut pos = 0;
    for m in kimi_regex().find_iter(text) {
        let Ok(m) = m else { break };
        if m.start() > pos {
            pieces.push(&text[pos..m.start()]);
        }
        pieces.push(m.as_str());
        pos = m.end();
    }
    if pos < text.len() {
        pieces.push(&text[pos..]);
    }
    pieces
}

#[cfg(test)]
mod tests {
    use super::pretokenize;

    #[test]
    fn splits_hand_written_cases() {
        let cases: &[(&str, &[&str])] = &[
            (
                "Hello world's 12345 !!\n\n  x",
                &["Hello", " world's", " ", "123", "45", " !!\n\n", " ", " x"],
            ),
            ("I'LL go, don't", &["I'LL", " go", ",", " don't"]),
            ("camelCase HTTPServer", &["camel", "Case", " HTTPServer"]),
            ("a  b\n\nc", &["a", " ", " b", "\n\n", "c"]),
            ("x   \n  y", &["x", "   \n", " ", " y"]),
            ("end   ", &["end", "   "]),
            ("我爱北京天安门 ok", &["我爱北京天安门", " ok"]),
            ("日本語のテキスト", &["日本語", "のテキスト"]),
            ("😀😀 hi", &["😀😀", " hi"]),
            ("<|open|>", &["<|", "open", "|>"]),
            ("3.14159", &["3", ".", "141", "59"]),
            ("\t\tfoo()", &["\t", "\tfoo", "()"]),
        ];
        for (text, want) in cases {
            assert_eq!(pretokenize(text), *want, "pieces of {text:?}");
        }
    }

    #[test]
    fn pieces_tile_long_and_odd_input() {
        let texts = [
            " ".repeat(100_000),
            "a".repeat(100_000),
            "\n \r\n\t".repeat(20_000),
            "é\u{301}ß'S'sx1".repeat(5_000),
        ];
        for text in &texts {
            assert_eq!(pretokenize(text).concat(), *text);
        }
    }
}
