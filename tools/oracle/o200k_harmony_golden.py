#!/usr/bin/env python3
"""Goldens for gpt-oss's o200k_harmony tokenizer and the harmony chat format, from OpenAI's own implementations.

Writes --out (default tests/fixtures/o200k_harmony):

  o200k_base.tiktoken  the o200k_base ranks (199998 lines "base64(token bytes) rank"), sha256 pinned to the
                       expected_hash in tiktoken's tiktoken_ext/openai_public.py. Nothing is downloaded from
                       OpenAI: --ranks-from-npm rebuilds the file from the npm package js-tiktoken@1.0.21 (which
                       bundles the ranks) and the hash proves it is the same file.
  corpus.json          {"ordinary": [str...], "with_specials": [str...]}: repository docs, the K3 tokenizer corpus,
                       scripts, emoji, whitespace and contraction edge cases; harmony-formatted text with specials
  golden.json          tiktoken's o200k_harmony ids for every string ("ordinary": encode_ordinary; "with_specials":
                       allowed_special="all"), the special-token table, the pattern, versions
  harmony.json         openai-harmony's rendering (ids and text) of several conversations: system/developer/user/
                       assistant, analysis/commentary/final channels, a function tool call with <|constrain|>,
                       a tool result, completion / full / training renders; a parse of a completion; stop tokens
  README.md

tiktoken builds the encoding with its own o200k_harmony constructor (the ranks are handed to it through its cache
directory); openai-harmony (Rust) encodes the same corpus independently and must agree id for id.

Regenerate (needs `pip install tiktoken openai-harmony`; with --ranks-from-npm also npm):

    python3 tools/oracle/o200k_harmony_golden.py --out tests/fixtures/o200k_harmony
"""

import argparse
import glob
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile

REGEN_COMMAND = "python3 tools/oracle/o200k_harmony_golden.py --out tests/fixtures/o200k_harmony"
RANKS_URL = "https://openaipublic.blob.core.windows.net/encodings/o200k_base.tiktoken"  # tiktoken's cache key only
RANKS_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
NPM_PACKAGE = "js-tiktoken@1.0.21"
# openai-harmony 0.0.8 differs from tiktoken's o200k_harmony on exactly these names: it has no <|endofprompt|>
# (plain text to it) and adds <|reserved_201088|> = 201088, one past gpt-oss's vocab_size. The goldens are tiktoken's.
HARMONY_DIVERGENT = ("<|endofprompt|>", "<|reserved_201088|>")
REPO_DOCS = ["README.md", "docs/architecture.md", "docs/checkpoint-layout.md"]


def fail(msg):
    print(f"FATAL: {msg}", file=sys.stderr, flush=True)
    sys.exit(1)


def check(cond, msg):
    if not cond:
        fail(msg)


def sha256(data):
    return hashlib.sha256(data).hexdigest()


def ranks_from_npm():
    """The o200k_base.tiktoken bytes rebuilt from js-tiktoken's bundled ranks ("<prefix> <offset> tok tok ..."
    lines: token i of a line has rank offset + i)."""
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(["npm", "pack", NPM_PACKAGE, "--silent"], cwd=tmp, check=True, stdout=subprocess.DEVNULL)
        (tgz,) = glob.glob(os.path.join(tmp, "*.tgz"))
        with tarfile.open(tgz) as tar:
            src = tar.extractfile("package/dist/ranks/o200k_base.cjs").read().decode()
    obj = json.loads(src.removeprefix("module.exports = ").rstrip().rstrip(";"))
    ranks = []
    for line in obj["bpe_ranks"].split("\n"):
        if line:
            _, offset, *tokens = line.split(" ")
            ranks += [(int(offset) + i, t) for i, t in enumerate(tokens)]
    ranks.sort()
    check([r for r, _ in ranks] == list(range(len(ranks))), "npm ranks are not 0..n-1")
    return "".join(f"{t} {r}\n" for r, t in ranks).encode()


def tiktoken_encoding(ranks_path):
    """tiktoken.get_encoding("o200k_harmony") with the ranks served from a private cache directory."""
    cache = tempfile.mkdtemp(prefix="tiktoken-cache-")
    shutil.copy(ranks_path, os.path.join(cache, hashlib.sha1(RANKS_URL.encode()).hexdigest()))
    os.environ["TIKTOKEN_CACHE_DIR"] = cache
    import tiktoken

    return tiktoken, tiktoken.get_encoding("o200k_harmony")


def harmony_encoding(ranks_path):
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = os.path.dirname(os.path.abspath(ranks_path))
    import openai_harmony as oh

    return oh, oh.load_harmony_encoding(oh.HarmonyEncodingName.HARMONY_GPT_OSS)


# ---- corpus ----------------------------------------------------------------------------------------------------

EDGE_CASES = [
    "",
    " ",
    "  leading and trailing  ",
    "\n\n\n",
    "a\r\nb\rc\n\rd",
    "\t\ttabs\tand  spaces \t\n",
    "I'M HERE, he's THERE, they'LL see, you'Re, WE'VE, she'D, it'S",
    "don't DON'T Don'T can't won't y'all o'clock rock'n'roll",
    "1 12 123 1234 12345 123456 3.14159 -42 1e-5 0x1F 1,000,000",
    "٠١٢٣٤٥٦٧٨٩ ①②③ ⅫⅣ ½ ¾ ²³",
    "Hello, 世界! 你好，世界。日本語のテキストとカタカナ。한국어 텍스트입니다.",
    "Привет, мир! Ελληνικά γράμματα. Українська мова.",
    "مرحبا بالعالم — עברית מימין לשמאל",
    "नमस्ते दुनिया। বাংলা লিপি। தமிழ் எழுத்து। ไทยภาษา",
    "e\u0301 n\u0303 a\u0308 (combining) vs é ñ ä (precomposed); Z\u0351\u0334a\u0338l\u0330g\u0335o",
    "emoji: 👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 🇫🇷 ❤️ 🤖✨ 🧑🏿‍💻",
    "math: ∀x∈ℝ, ∃y: x²+y²≤1 ⇒ ∑ᵢ aᵢ ≥ 0; ∫₀^∞ e^{-x} dx = 1",
    "code: fn main() { let x: Vec<u32> = (0..10).map(|i| i * i).collect(); println!(\"{x:?}\"); }",
    "def f(x):\n    return {'a': [1, 2, 3], \"b\": None}  # comment\n",
    "<html><body class=\"x\">&amp; &lt;tag&gt;</body></html>",
    "https://example.com/path/to/page?query=1&other=two#fragment  user@example.org",
    "////\\\\\\\\ ---- ==== **** ____ ~~~~ ```` '''' \"\"\"\" ....",
    "ZERO\u200bWIDTH\u200cJOINERS\u200d and\u00a0no-break\u2009thin\u3000ideographic spaces",
    "\ufeffBOM at start, replacement \ufffd, private use \ue000, astral \U0001f600 \U00010348",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "<|start|>, <|message|>, <|end|> as plain text are not specials in encode_ordinary",
    "<|reserved_200018|> <|endofprompt|> <|im_start|> <|not_a_token|> <| start |>",
]

SPECIALS_CASES = [
    "<|startoftext|>text<|endoftext|>",
    "<|start|>user<|message|>Hi<|end|><|start|>assistant",
    "<|start|>assistant<|channel|>analysis<|message|>Think.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Done.<|return|>",
    "<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>"
    "{\"city\":\"Paris\"}<|call|>",
    "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>{\"temp\": 20}<|end|>",
    "<|reserved_200000|><|reserved_200001|><|reserved_200004|><|reserved_200009|><|reserved_200010|>"
    "<|reserved_200011|><|reserved_200013|><|reserved_200017|><|reserved_200018|><|endofprompt|>"
    "<|reserved_201087|>",
    "<|end|><|end|>  <|end|>\n<|end|>x<|end|>",
    "text<|start|without close <|start|> <|unknown|> <|reserved_201088|> <|start|>",
    "Ünïcödé<|message|>日本語<|message|>👍🏽<|call|>",
]


def build_corpus(repo_root):
    with open(os.path.join(repo_root, "tests/fixtures/tokenizer/corpus.json"), encoding="utf-8") as f:
        k3 = json.load(f)
    docs = []
    for rel in REPO_DOCS:
        with open(os.path.join(repo_root, rel), encoding="utf-8") as f:
            docs.append(f.read())
    ordinary = EDGE_CASES + k3["ordinary"] + docs
    return {"ordinary": ordinary, "with_specials": SPECIALS_CASES + k3["with_specials"]}


# ---- harmony conversations -------------------------------------------------------------------------------------


def conversations(oh):
    R = oh.Role
    msg = oh.Message.from_role_and_content
    system = (oh.SystemContent.new().with_reasoning_effort(oh.ReasoningEffort.HIGH)
              .with_conversation_start_date("2025-06-28"))
    weather = oh.ToolDescription.new(
        "get_current_weather", "Gets the current weather in the provided location.",
        parameters={"type": "object", "properties": {
            "location": {"type": "string", "description": "The city and state, e.g. San Francisco, CA"},
            "format": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"}},
            "required": ["location"]})
    developer = (oh.DeveloperContent.new().with_instructions("Always respond in riddles.")
                 .with_function_tools([weather]))
    basic = [msg(R.SYSTEM, oh.SystemContent.new()), msg(R.USER, "What is 2 + 2?")]
    full = [
        msg(R.SYSTEM, system),
        msg(R.DEVELOPER, developer),
        msg(R.USER, "What is the weather like in SF?"),
        msg(R.ASSISTANT, "Need to use function get_current_weather.").with_channel("analysis"),
        msg(R.ASSISTANT, '{"location": "San Francisco, CA"}').with_channel("commentary")
        .with_recipient("functions.get_current_weather").with_content_type("<|constrain|>json"),
        oh.Message.from_author_and_content(oh.Author.new(R.TOOL, "functions.get_current_weather"),
                                           '{"sunny": true, "temperature": 20}')
        .with_channel("commentary").with_recipient("assistant"),
    ]
    answered = full + [
        msg(R.ASSISTANT, "The weather is sunny.").with_channel("analysis"),
        msg(R.ASSISTANT, "It is sunny and 20 °C in San Francisco — un jour ensoleillé ☀️.").with_channel("final"),
    ]
    multi_turn = [
        msg(R.SYSTEM, oh.SystemContent.new().with_reasoning_effort(oh.ReasoningEffort.LOW)),
        msg(R.USER, "Name a prime."),
        msg(R.ASSISTANT, "2 is prime.").with_channel("analysis"),
        msg(R.ASSISTANT, "2").with_channel("final"),
        msg(R.USER, "Another, in Japanese?"),
    ]
    C = oh.Conversation.from_messages
    return [
        ("basic_completion", "completion", C(basic)),
        ("tool_call_completion", "completion", C(full)),
        ("multi_turn_completion", "completion", C(multi_turn)),
        ("answered_render", "render", C(answered)),
        ("answered_training", "training", C(answered)),
    ]


def render_all(oh, enc, tk):
    out = []
    for name, mode, conv in conversations(oh):
        if mode == "completion":
            ids = enc.render_conversation_for_completion(conv, oh.Role.ASSISTANT)
        elif mode == "render":
            ids = enc.render_conversation(conv)
        else:
            ids = enc.render_conversation_for_training(conv)
        text = enc.decode_utf8(ids)
        # the rendered text, re-encoded with every special allowed, must give the same ids (no merge across)
        check(tk.encode(text, allowed_special="all") == ids, f"{name}: rendered ids are not the text's encoding")
        out.append({"name": name, "mode": mode, "next_role": "assistant" if mode == "completion" else None,
                    "conversation": json.loads(conv.to_json()), "ids": ids, "text": text})
    completion = ("<|channel|>analysis<|message|>User asks for 2+2. Simple.<|end|>"
                  "<|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|return|>")
    ids = tk.encode(completion, allowed_special="all")
    parsed = enc.parse_messages_from_completion_tokens(ids, oh.Role.ASSISTANT)
    return {
        "renders": out,
        "parse": {"role": "assistant", "text": completion, "ids": ids,
                  "messages": [json.loads(m.to_json()) for m in parsed]},
        "stop_tokens": enc.stop_tokens(),
        "stop_tokens_for_assistant_actions": enc.stop_tokens_for_assistant_actions(),
    }


# ---- main ------------------------------------------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="tests/fixtures/o200k_harmony")
    ap.add_argument("--ranks-from-npm", action="store_true", help=f"rebuild o200k_base.tiktoken from {NPM_PACKAGE}")
    args = ap.parse_args()
    repo_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    os.makedirs(args.out, exist_ok=True)
    ranks_path = os.path.join(args.out, "o200k_base.tiktoken")
    if args.ranks_from_npm:
        data = ranks_from_npm()
        check(sha256(data) == RANKS_SHA256, f"ranks from npm hash to {sha256(data)}, expected {RANKS_SHA256}")
        with open(ranks_path, "wb") as f:
            f.write(data)
    check(os.path.exists(ranks_path), f"{ranks_path} missing: run with --ranks-from-npm")
    with open(ranks_path, "rb") as f:
        check(sha256(f.read()) == RANKS_SHA256, f"{ranks_path}: sha256 differs from tiktoken's expected_hash")

    tiktoken, tk = tiktoken_encoding(ranks_path)
    oh, enc = harmony_encoding(ranks_path)
    check(tk.n_vocab == 201088, f"o200k_harmony n_vocab {tk.n_vocab}")
    corpus = build_corpus(repo_root)
    ordinary = [tk.encode_ordinary(s) for s in corpus["ordinary"]]
    with_specials = [tk.encode(s, allowed_special="all") for s in corpus["with_specials"]]
    for s, ids in zip(corpus["ordinary"], ordinary):
        check(tk.decode_bytes(ids) == s.encode(), f"round trip: {s[:40]!r}")
        check(enc.encode(s, disallowed_special=()) == ids, f"openai-harmony disagrees on {s[:40]!r}")
    for s, ids in zip(corpus["with_specials"], with_specials):
        # id 200018 has two names; tiktoken decodes it as <|endofprompt|>
        check(tk.decode_bytes(ids) == s.replace("<|reserved_200018|>", "<|endofprompt|>").encode(),
              f"round trip: {s[:40]!r}")
        if not any(d in s for d in HARMONY_DIVERGENT):
            check(enc.encode(s, allowed_special="all") == ids, f"openai-harmony disagrees on {s[:40]!r}")
    specials = dict(sorted(tk._special_tokens.items(), key=lambda kv: (kv[1], kv[0])))
    for name, i in specials.items():
        check(tk.encode(name, allowed_special="all") == [i], f"special {name}")
        if name not in HARMONY_DIVERGENT:
            check(enc.encode(name, allowed_special="all") == [i], f"openai-harmony special {name}")
    divergences = {d: {"tiktoken": tk.encode(d, allowed_special="all"),
                       "openai_harmony": enc.encode(d, allowed_special="all")} for d in HARMONY_DIVERGENT}
    for d, v in divergences.items():
        check(v["tiktoken"] != v["openai_harmony"], f"{d}: the libraries now agree; update HARMONY_DIVERGENT")
    check(set(tk._special_tokens) ^ enc.special_tokens_set == set(HARMONY_DIVERGENT), "special sets differ more")

    with open(os.path.join(args.out, "corpus.json"), "w", encoding="utf-8") as f:
        json.dump(corpus, f, ensure_ascii=False, indent=0)
        f.write("\n")
    from importlib.metadata import version

    golden = {
        "encoding": "o200k_harmony",
        "generator": "tools/oracle/o200k_harmony_golden.py",
        "command": REGEN_COMMAND,
        "versions": {"tiktoken": tiktoken.__version__, "openai_harmony": version("openai-harmony"),
                     "python": platform.python_version()},
        "ranks_file": "o200k_base.tiktoken",
        "ranks_sha256": RANKS_SHA256,
        "num_ranks": len(tk._mergeable_ranks),
        "n_vocab": tk.n_vocab,
        "pattern": tk._pat_str,
        "special_tokens": specials,
        "openai_harmony_divergences": divergences,
        "decode_200018": {"tiktoken": tk.decode([200018]), "openai_harmony": enc.decode_utf8([200018])},
        "ordinary": ordinary,
        "with_specials": with_specials,
    }
    with open(os.path.join(args.out, "golden.json"), "w") as f:
        json.dump(golden, f, separators=(",", ":"))
        f.write("\n")
    harmony = render_all(oh, enc, tk)
    with open(os.path.join(args.out, "harmony.json"), "w", encoding="utf-8") as f:
        json.dump(harmony, f, ensure_ascii=False, indent=1)
        f.write("\n")
    with open(os.path.join(args.out, "README.md"), "w") as f:
        f.write(readme(golden, harmony, corpus))
    sizes = {n: os.path.getsize(os.path.join(args.out, n)) for n in sorted(os.listdir(args.out))}
    print(json.dumps(sizes), f"\n{len(ordinary)} ordinary, {len(with_specials)} with specials, "
          f"{sum(map(len, ordinary)) + sum(map(len, with_specials))} ids\nOK")


def readme(g, h, corpus):
    named = {k: v for k, v in g["special_tokens"].items() if not k.startswith("<|reserved_")}
    return f"""# o200k_harmony: tokenizer and harmony-format goldens

gpt-oss's tokenizer is tiktoken's `o200k_harmony`: the o200k_base ranks ({g['num_ranks']} byte-level BPE ranks,
ids 0..{g['num_ranks'] - 1}), o200k's pre-tokenizer pattern, and special tokens 199998..201087 (n_vocab
{g['n_vocab']}). Generated by `tools/oracle/o200k_harmony_golden.py` with tiktoken {g['versions']['tiktoken']} and
openai-harmony {g['versions']['openai_harmony']}; regenerate with

    {REGEN_COMMAND}

(`--ranks-from-npm` rebuilds `o200k_base.tiktoken` from the npm package {NPM_PACKAGE}; either way its sha256 must
be tiktoken's pinned `{RANKS_SHA256}`). CI needs no Python package: these files are the goldens.

## Files
- `o200k_base.tiktoken` (3.6 MB, the same text format as K3's `tiktoken.model`: `base64(bytes) rank` per line).
- `corpus.json`: {len(corpus['ordinary'])} "ordinary" strings (edge cases, tests/fixtures/tokenizer's K3 corpus,
  and {', '.join(REPO_DOCS)} as of generation) and {len(corpus['with_specials'])} "with_specials" strings.
- `golden.json`: tiktoken's ids: `ordinary[i]` = `encode_ordinary(corpus.ordinary[i])` (special names are plain
  text), `with_specials[i]` = `encode(corpus.with_specials[i], allowed_special="all")`; plus `special_tokens`
  (all {len(g['special_tokens'])} names with ids), `pattern`, `ranks_sha256`. openai-harmony's own (Rust) encoder
  gave identical ids for every string not containing {' or '.join(HARMONY_DIVERGENT)} (see below), and every id
  list decodes back to the string's bytes.
- `harmony.json`: openai-harmony's renders (`ids` and `text`) of {len(h['renders'])} conversations (its JSON form
  included): completion prompts (`render_conversation_for_completion(conv, assistant)`), a full render and a
  training render (the last assistant final message ends in `<|return|>` instead of `<|end|>`); a parse of an
  assistant completion into messages; `stop_tokens` {h['stop_tokens']} and `stop_tokens_for_assistant_actions`
  {h['stop_tokens_for_assistant_actions']}.

## Special tokens
Named: {json.dumps(named)}; every other id in 200000..201087 is `<|reserved_N|>`. Id 200018 has two names,
`<|endofprompt|>` (inherited from o200k_base) and `<|reserved_200018|>`: both encode to 200018; tiktoken decodes
it as `{g['decode_200018']['tiktoken']}`, openai-harmony as `{g['decode_200018']['openai_harmony']}`.
openai-harmony {g['versions']['openai_harmony']} differs from tiktoken on two names (`openai_harmony_divergences`
in golden.json): it has no `<|endofprompt|>` (encodes it as plain text) and has an extra `<|reserved_201088|>`
= 201088, outside gpt-oss's vocab_size 201088. These goldens follow tiktoken.

## Harmony format (as rendered here)
- A message: `<|start|>{{role}}[ to={{recipient}}]<|channel|>{{channel}}[ {{content_type}}]<|message|>{{content}}<|end|>`
  (channel and recipient parts only when set; a tool's message starts with its name, e.g.
  `<|start|>functions.get_current_weather to=assistant<|channel|>commentary<|message|>...`).
- An assistant message to a tool (`to=functions.NAME`, content type `<|constrain|>json`) ends with `<|call|>`, also
  when rendered from history; a generated final answer ends with `<|return|>` (the training render puts it on the
  last final message; in history it is `<|end|>`). A completion prompt ends with `<|start|>assistant`.
- The system message carries model identity, knowledge cutoff, optional `Current date`, `Reasoning: low|medium|high`
  and the valid channels; the developer message carries `# Instructions` and the `# Tools` TypeScript-like
  namespace (`namespace functions {{ ... }}`); analysis messages that precede a final answer are dropped from
  the render (auto_drop_analysis), tool calls and results are kept.
"""


if __name__ == "__main__":
    main()
