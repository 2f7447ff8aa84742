use super::{class_ranges, decode_at, folds_to, pretokenize, pretokenize_bytes, Pattern};
use fancy_regex::Regex;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

const PATTERNS: [Pattern; 2] = [Pattern::Kimi, Pattern::O200k];

/// The oracle: the pattern run by fancy-regex (tiktoken's engine), whose matches must tile the text.
fn regex_pieces(pattern: Pattern, text: &str) -> Vec<&str> {
    static KIMI: OnceLock<Regex> = OnceLock::new();
    static O200K: OnceLock<Regex> = OnceLock::new();
    let re = match pattern {
        Pattern::Kimi => &KIMI,
        Pattern::O200k => &O200K,
    }
    .get_or_init(|| Regex::new(pattern.regex()).unwrap());
    let mut pieces = Vec::new();
    let mut pos = 0;
    for m in re.find_iter(text) {
        let m = m.expect("fancy-regex stays within its backtrack limit on test inputs");
        assert_eq!(m.start(), pos, "regex matches tile {text:?}");
        pieces.push(m.as_str());
        pos = m.end();
    }
    assert_eq!(pos, text.len());
    pieces
}

/// xorshift64: deterministic pseudo-random numbers without a dependency.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// Characters chosen to sit on every class boundary the pattern draws: cased letters of several
/// scripts, titlecase (ǅ), modifier letters (ʰ, 々 which is also Han), other letters (の, 한), marks
/// (U+0301, U+302A with Han script extension, U+0903 spacing), digits of several kinds (٣, ², Ⅻ, 〇),
/// contraction letters and their folds (ſ, K), apostrophes, every kind of whitespace, symbols, emoji.
const ALPHABET: &[char] = &[
    'a', 'b', 'z', 'A', 'B', 'Z', 's', 'S', 't', 'T', 'r', 'R', 'e', 'E', 'v', 'V', 'm', 'M', 'l',
    'L', 'd', 'D', 'ſ', 'K', '\'', '\'', '\'', 'ǅ', 'ʰ', '々', '中', '日', '〇', 'の', 'ア', '한',
    'Ж', 'ж', 'Ω', 'ω', 'ß', 'ẞ', 'İ', '\u{301}', '\u{302A}', '\u{903}', 'ा', 'ب', '0', '1', '9',
    '٣', '²', 'Ⅻ', ' ', ' ', ' ', '\t', '\n', '\n', '\r', '\u{b}', '\u{c}', '\u{85}', '\u{a0}',
    '\u{2028}', '\u{3000}', '\u{200d}', '\u{feff}', '!', '.', ',', '"', '<', '|', '>', '-', '_',
    '(', '{', '/', '/', '\u{fffd}', '😀', '👍', '🏽', '、', '。', '€',
];

#[test]
fn matches_fancy_regex_on_random_text() {
    for pattern in PATTERNS {
        matches_fancy_regex_on_random_text_with(pattern);
    }
}

fn matches_fancy_regex_on_random_text_with(pattern: Pattern) {
    let mut rng = Rng(0x2545_f491_4f6c_dd1d);
    for case in 0..40_000 {
        let len = rng.below(if case % 100 == 0 { 400 } else { 24 });
        let text: String = (0..len)
            .map(|_| {
                if rng.below(16) == 0 {
                    // Any scalar value, to reach characters the alphabet does not name.
                    loop {
                        if let Some(c) = char::from_u32(rng.below(0x11_0000) as u32) {
                            break c;
                        }
                    }
                } else {
                    ALPHABET[rng.below(ALPHABET.len())]
                }
            })
            .collect();
        assert_eq!(
            pattern.split(&text),
            regex_pieces(pattern, &text),
            "{pattern:?} pieces of {text:?}"
        );
    }
}

#[test]
fn matches_fancy_regex_for_every_code_point() {
    // Each scalar value in contexts that exercise every alternative: doubled, after a space, before a
    // lowercase letter and a contraction, after an uppercase letter, and around newlines.
    let chars: Vec<char> = (0..=0x10_FFFFu32).filter_map(char::from_u32).collect();
    for (pattern, chunk) in PATTERNS
        .into_iter()
        .flat_map(|p| chars.chunks(512).map(move |c| (p, c)))
    {
        let mut text = String::new();
        for &c in chunk {
            text.extend([
                c, c, ' ', c, 'a', '\'', 'S', 'X', c, '\n', c, ' ', ' ', '1', c,
            ]);
        }
        let (ours, theirs) = (pattern.split(&text), regex_pieces(pattern, &text));
        if ours != theirs {
            let at = ours.iter().zip(&theirs).position(|(a, b)| a != b).unwrap();
            panic!(
                "{pattern:?}: first difference at piece {at}: ours {:?}, fancy-regex {:?}",
                &ours[at..(at + 3).min(ours.len())],
                &theirs[at..(at + 3).min(theirs.len())]
            );
        }
    }
}

#[test]
fn contraction_folds_match_regex_case_folding() {
    for letter in *b"strevmld" {
        let ranges = class_ranges(&format!("(?i:{})", letter as char));
        for cp in 0..=0x10_FFFFu32 {
            let in_class = ranges.iter().any(|&(s, e)| (s..=e).contains(&cp));
            assert_eq!(
                folds_to(cp, letter),
                in_class,
                "U+{cp:04X} vs {}",
                letter as char
            );
        }
    }
}

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
        ("", &[]),
    ];
    for (text, want) in cases {
        assert_eq!(pretokenize(text), *want, "pieces of {text:?}");
    }
}

#[test]
fn splits_o200k_cases() {
    // Where o200k differs from Kimi: Han joins the letter runs, and `/` may follow punctuation.
    let cases: &[(&str, &[&str])] = &[
        ("我爱北京天安门 ok", &["我爱北京天安门", " ok"]),
        ("日本語のテキスト", &["日本語のテキスト"]),
        (
            "https://x.com/a//b",
            &["https", "://", "x", ".com", "/a", "//", "b"],
        ),
        ("a!/\n/x", &["a", "!/\n/", "x"]),
        ("</div>\n\n/*", &["</", "div", ">\n\n/", "*"]),
        ("I'LL go, don't", &["I'LL", " go", ",", " don't"]),
    ];
    for (text, want) in cases {
        assert_eq!(Pattern::O200k.split(text), *want, "pieces of {text:?}");
    }
}

#[test]
fn decodes_invalid_utf8_like_utf8_chunks() {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    for _ in 0..20_000 {
        // Bytes biased towards lead and continuation bytes so that truncated sequences are common.
        let bytes: Vec<u8> = (0..rng.below(12))
            .map(|_| match rng.below(4) {
                0 => b"a \n"[rng.below(3)],
                1 => 0x80 + rng.below(0x40) as u8,
                _ => 0xC0 + rng.below(0x40) as u8,
            })
            .collect();
        let mut want: Vec<(u32, usize)> = Vec::new();
        for chunk in bytes.utf8_chunks() {
            want.extend(chunk.valid().chars().map(|c| (c as u32, c.len_utf8())));
            if !chunk.invalid().is_empty() {
                want.push((0xFFFD, chunk.invalid().len()));
            }
        }
        let mut got = Vec::new();
        let mut i = 0;
        while i < bytes.len() {
            let (cp, len) = decode_at(&bytes, i);
            got.push((cp, len));
            i += len;
        }
        assert_eq!(got, want, "{bytes:02x?}");
    }
}

#[test]
fn invalid_utf8_splits_like_its_lossy_text() {
    let mut rng = Rng(0x1234_5678_9abc_def1);
    for _ in 0..5_000 {
        let bytes: Vec<u8> = (0..rng.below(30))
            .map(|_| match rng.below(5) {
                0 => 0x80 + rng.below(0x80) as u8,
                _ => {
                    let common = b"ab A'1 \n.\xe4\xb8\xad";
                    common[rng.below(common.len())]
                }
            })
            .collect();
        let pieces: Vec<&[u8]> = pretokenize_bytes(&bytes).collect();
        assert_eq!(pieces.concat(), bytes);
        // Replacing each invalid subsequence by U+FFFD piece by piece gives the lossy text's pieces.
        let lossy: Vec<String> = pieces
            .iter()
            .map(|p| String::from_utf8_lossy(p).into_owned())
            .collect();
        let text = String::from_utf8_lossy(&bytes);
        assert_eq!(pretokenize(&text), lossy, "{bytes:02x?}");
    }
}

fn time_pieces(input: &[u8]) -> (Duration, usize) {
    let t = Instant::now();
    let count = pretokenize_bytes(input).count();
    (t.elapsed(), count)
}

/// Inputs on which a backtracking engine does O(n) work per short piece, or exceeds its backtrack limit.
fn adversarial(n: usize) -> Vec<(&'static str, Vec<u8>)> {
    vec![
        (
            "spaces then a word",
            [" ".repeat(n), "x".into()].concat().into_bytes(),
        ),
        ("spaces", " ".repeat(n).into_bytes()),
        ("tabs and spaces", " \t".repeat(n / 2).into_bytes()),
        ("newlines and spaces", " \n ".repeat(n / 3).into_bytes()),
        ("digits", "7".repeat(n).into_bytes()),
        ("one lowercase letter", "a".repeat(n).into_bytes()),
        ("one uppercase letter", "A".repeat(n).into_bytes()),
        (
            "uppercase then a mark",
            ["A".repeat(n), "\u{301}".into()].concat().into_bytes(),
        ),
        ("marks", "\u{301}".repeat(n / 2).into_bytes()),
        ("punctuation", "!".repeat(n).into_bytes()),
        ("apostrophes", "'".repeat(n).into_bytes()),
        ("Han", "中".repeat(n / 3).into_bytes()),
        ("invalid bytes", vec![0xFF; n]),
        ("truncated sequences", [0xE4, 0xB8].repeat(n / 2)),
    ]
}

#[test]
fn linear_time_on_adversarial_input() {
    // Quadratic work on 8 MiB would take hours; linear takes tens of milliseconds. The absolute bound
    // leaves a wide margin for slow, shared machines, and the ratio (linear: 8, quadratic: 64) catches
    // a superlinear term early. Best of three runs smooths out scheduling noise.
    let best = |input: &[u8]| (0..3).map(|_| time_pieces(input).0).min().unwrap();
    for ((name, small), (_, large)) in adversarial(1 << 20).into_iter().zip(adversarial(8 << 20)) {
        let (ts, tl) = (best(&small), best(&large));
        assert!(tl < Duration::from_secs(5), "{name}: {tl:?} for 8 MiB");
        assert!(
            tl.as_secs_f64() < 24.0 * ts.as_secs_f64() + 0.05,
            "{name}: {ts:?} for 1 MiB but {tl:?} for 8 MiB"
        );
    }
}

#[test]
fn pieces_tile_long_and_odd_input() {
    for (_, input) in adversarial(100_000) {
        for pattern in PATTERNS {
            assert_eq!(pattern.pieces(&input).collect::<Vec<_>>().concat(), input);
        }
    }
}
