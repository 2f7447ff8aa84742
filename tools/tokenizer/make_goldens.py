"""Golden token ids for deltafin's tokenizer, from Python's `tiktoken` (an independent implementation).

For each test tokenizer (a directory holding the `tiktoken.model` that `deltafin make-model` writes), this
loads the ranks into `tiktoken.Encoding` with Kimi's pre-tokenizer pattern and K3's special tokens (nothing
is downloaded), encodes every string of a corpus covering several scripts, code, whitespace edge cases,
emoji and long inputs, and writes:

  OUT/corpus.json         the corpus: {"ordinary": [str...], "with_specials": [str...]}
  OUT/golden-NAME.json    {"pattern", "num_ranks", "rank_file_fnv1a64", "ordinary": [[id...]...],
                           "with_specials": [[id...]...]}

"ordinary" strings are encoded with `encode_ordinary` (special names are plain text); "with_specials" are
template-like strings encoded with every special recognised (`allowed_special="all"`).

Usage (see tests/fixtures/tokenizer/README.md):
  python3 tools/tokenizer/make_goldens.py --out tests/fixtures/tokenizer tiny=DIR small=DIR
"""

import argparse
import base64
import json
import os

import tiktoken

# Kimi's pre-tokenizer pattern, as published with the Kimi tokenizers.
KIMI_PATTERN = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)


def fnv1a64(data):
    h = 0xCBF29CE484222325
    for b in data:
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def load_encoding(directory):
    raw = open(os.path.join(directory, "tiktoken.model"), "rb").read()
    ranks = {}
    for line in raw.splitlines():
        if line:
            token, rank = line.split(b" ")
            ranks[base64.b64decode(token)] = int(rank)
    config = json.load(open(os.path.join(directory, "tokenizer_config.json"), encoding="utf-8"))
    specials = {e["content"]: int(i) for i, e in config["added_tokens_decoder"].items()}
    enc = tiktoken.Encoding(
        name=os.path.basename(directory.rstrip("/")),
        pat_str=KIMI_PATTERN,
        mergeable_ranks=ranks,
        special_tokens=specials,
    )
    return enc, len(ranks), fnv1a64(raw)


class XorShift:
    """Deterministic on every Python version (unlike `random`)."""

    def __init__(self, seed):
        self.x = seed

    def below(self, n):
        x = self.x
        x ^= (x << 13) & 0xFFFFFFFFFFFFFFFF
        x ^= x >> 7
        x ^= (x << 17) & 0xFFFFFFFFFFFFFFFF
        self.x = x
        return x % n


PROSE = [
    "The capital of France is Paris.",
    "I'm sure they'LL say it's fine; we've DON'T-style contractions, you'd think, I'M TOLD.",
    "camelCase, snake_case, SCREAMING_CASE, HTTPServer, iPhone, McDonald's, O'Neill's",
    "Hello, world! How are you doing today? Fine... thanks!!! (really) [yes] {no} <maybe>",
    "我爱北京天安门，天安门上太阳升。人工智能正在改变世界。",
    "日本語のテキストです。カタカナとひらがな、漢字が混ざっています。東京タワー",
    "한국어 텍스트입니다. 안녕하세요, 반갑습니다!",
    "Привет, мир! Это тест токенизатора. ЁЖИК и ёжик.",
    "Γειά σου Κόσμε! Αυτό είναι ένα τεστ. ΣΊΣΥΦΟΣ",
    "مرحبا بالعالم! هذا اختبار. ١٢٣٤٥٦",
    "שלום עולם! זהו מבחן.",
    "नमस्ते दुनिया! यह एक परीक्षण है। क्षत्रिय",
    "สวัสดีชาวโลก นี่คือการทดสอบ",
    "Tiếng Việt có dấu: Trường Đại học, nghiêng.",
    "Combining: e\u0301 a\u0308 n\u0303 Cafe\u0301 \u0301\u0301\u0301",
    "Turkish İstanbul ıi; German Straße STRASSE ẞ; Kelvin \u212a; long s \u017f 'ſ",
    "Titlecase ǅungla ǈ ǋ; modifiers ʰʲʷ; ordinals 1ª 2º",
    "Ελληνικά + English + 中文 + русский + العربية in one line",
]

CODE = [
    'fn main() {\n    let x: Vec<u32> = (0..10).map(|i| i * 2).collect();\n    println!("{:?}", x);\n}\n',
    "def f(a, b=2, *args, **kw):\n\treturn {'a': a, \"b\": b}  # comment\n",
    '{"key": [1, 2.5e-3, true, null], "nested": {"k": "v\\n"}}',
    '<!DOCTYPE html>\n<html lang="en"><body class="x">&amp; &lt;tag&gt;</body></html>\r\n',
    "for f in *.txt; do echo \"$f\" | sed -E 's/([a-z]+)/\\1!/g'; done 2>&1 >/dev/null",
    r"^(?:[a-z0-9!#$%&'*+/=?^_`{|}~-]+)@\w+\.\w{2,}$",
    "SELECT id, name FROM users WHERE age >= 18 AND name LIKE '%o''brien%';",
    "x+=1;y-=2;z*=3;w/=4;a<<=1;b>>=2;c&&d||e!f?g:h",
]

NUMBERS = [
    "1234567890",
    "3.14159265358979",
    "1,000,000.00 and 1 000 000",
    "٠١٢٣٤٥٦٧٨٩ ۰۱۲ ०१२३",
    "x² + y³ = z¹⁰; ½ ¾; Ⅻ Ⅸ; ①②③",
    "2024-01-31T23:59:59Z 0x1F 0b1010 1e-9",
]

WHITESPACE = [
    "",
    " ",
    "  ",
    "\t",
    "\n",
    "\r\n",
    "\n\n\n",
    " \n ",
    "a  b",
    "a   b",
    "trailing   ",
    "   leading",
    "\u00a0nbsp\u00a0",
    "ideographic\u3000space",
    "line\u2028separator\u2029para",
    "nel\u0085next",
    "\t \n\t \r\n  x",
    "a\n\n  b\n \n\tc",
    "word \n",
    " !!\n\n",
    "\r\r\r\n\n",
    "\u000b\u000cvt ff",
    "zero\u200bwidth\u200djoiner\ufeffbom",
]

EMOJI = [
    "😀😃😄 hi 😁",
    "👨‍👩‍👧‍👦 family",
    "🇫🇷🇯🇵 flags",
    "👍🏽👍🏿 tones",
    "1️⃣ #️⃣ keycaps",
    "✨🚀 launch! 🎉🎉🎉",
    "\ufffd replacement",
]

SPECIAL_LOOKING = [
    "<|open|>message role=\"user\"<|sep|>hi<|close|>message<|sep|><|end_of_msg|>",
    "[BOS] [EOS] [PAD] [UNK] <|reserved_token_17|>",
    "<|im_start|>user",
]

WITH_SPECIALS = [
    '<|open|>message role="user"<|sep|>Hello there!<|close|>message<|sep|><|end_of_msg|>',
    '<|open|>message role="system" name="thinking_effort"<|sep|>Thinking effort: high.<|close|>message<|sep|><|end_of_msg|>'
    '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>',
    '<|open|>message role="user" name="A &quot;b&quot; &amp; c"<|sep|>中文 and emoji 😀<|close|>message<|sep|><|end_of_msg|>',
    "[BOS]text[EOS][PAD]<|reserved_token_200|>tail",
]

ALPHABET = list(
    "aAzZsStTlLdD'ſK ǅʰ々中日〇のア한ЖжΩωßİ\u0301\u302a\u0903ब019٣²Ⅻ   \t\n\n\r\u00a0\u3000\u2028!.,\"<|>-_({😀👍🏽、。€"
)


def build_corpus():
    rng = XorShift(0x2545F4914F6CDD1D)
    random_strings = []
    for _ in range(300):
        n = rng.below(40)
        random_strings.append("".join(ALPHABET[rng.below(len(ALPHABET))] for _ in range(n)))
    long_inputs = [
        " " * 5000 + "x",
        " " * 3000,
        "\n" * 2000 + " " * 2000 + "\n",
        "7" * 3001,
        "a" * 5000,
        "A" * 3000 + "b",
        "ab" * 2500,
        "!" * 2000,
        "中" * 2000,
        "😀" * 1000,
        "\u0301" * 1000,
        " ".join(PROSE) * 8,
        "\n".join(CODE) * 4,
        "".join(random_strings),
    ]
    ordinary = PROSE + CODE + NUMBERS + WHITESPACE + EMOJI + SPECIAL_LOOKING + random_strings + long_inputs
    return {"ordinary": ordinary, "with_specials": WITH_SPECIALS}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="output directory (tests/fixtures/tokenizer)")
    parser.add_argument("tokenizers", nargs="+", metavar="NAME=DIR", help="test tokenizers to encode with")
    args = parser.parse_args()
    corpus = build_corpus()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "corpus.json"), "w", encoding="utf-8") as f:
        json.dump(corpus, f, ensure_ascii=True, indent=0)
        f.write("\n")
    for spec in args.tokenizers:
        name, directory = spec.split("=", 1)
        enc, num_ranks, fnv = load_encoding(directory)
        golden = {
            "pattern": KIMI_PATTERN,
            "num_ranks": num_ranks,
            "rank_file_fnv1a64": format(fnv, "016x"),
            "ordinary": [enc.encode_ordinary(s) for s in corpus["ordinary"]],
            "with_specials": [enc.encode(s, allowed_special="all") for s in corpus["with_specials"]],
        }
        for s, ids in zip(corpus["ordinary"], golden["ordinary"]):
            assert enc.decode_bytes(ids) == s.encode("utf-8"), s[:40]
        path = os.path.join(args.out, f"golden-{name}.json")
        with open(path, "w", encoding="utf-8") as f:
            f.write("{\n")
            for key in ["pattern", "num_ranks", "rank_file_fnv1a64"]:
                f.write(f"{json.dumps(key)}: {json.dumps(golden[key])},\n")
            for key in ["ordinary", "with_specials"]:
                rows = ",\n".join(json.dumps(ids, separators=(",", ":")) for ids in golden[key])
                end = "," if key == "ordinary" else ""
                f.write(f"{json.dumps(key)}: [\n{rows}\n]{end}\n")
            f.write("}\n")
        total = sum(map(len, golden["ordinary"]))
        print(f"{path}: {len(corpus['ordinary'])} ordinary + {len(corpus['with_specials'])} template strings, {total} ids")


if __name__ == "__main__":
    main()
