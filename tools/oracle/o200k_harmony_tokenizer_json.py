#!/usr/bin/env python3
"""gpt-oss's Hugging Face tokenizer files for the o200k_harmony fixture, made the way transformers makes them.

Released gpt-oss directories ship `tokenizer.json` (not a .tiktoken file): transformers' TikTokenConverter turns
the o200k_base ranks, o200k's pattern and the harmony specials into a byte-level BPE. The full file is 28 MB
(4.5 MB gzipped), so this script commits its layout instead and the Rust test puts the ranks back:

  tokenizer_layout.json   the converter's tokenizer.json with `model.vocab` = {} and `model.merges` = [] (everything
                          else as written: pre-tokenizer, decoder, post-processor, the 1090 added tokens)
  tokenizer_config.json   bos/eos/pad names, as gpt-oss's
  generation_config.json  `eos_token_id` [200002, 199999, 200012] (<|return|>, <|endoftext|>, <|call|>), as gpt-oss's
  README.md

The script checks that the converter's vocabulary is exactly the ranks written in the GPT-2 byte alphabet with
id = rank (what the test rebuilds), that every added token has tiktoken's id, and reports how the converted
tokenizer, run by the `tokenizers` package, compares with tiktoken's goldens.

Regenerate (needs `pip install transformers tokenizers tiktoken`; reads the committed goldens):

    python3 tools/oracle/o200k_harmony_tokenizer_json.py --fixture tests/fixtures/o200k_harmony
"""

import argparse
import base64
import json
import os
import sys
import tempfile

REGEN_COMMAND = "python3 tools/oracle/o200k_harmony_tokenizer_json.py --fixture tests/fixtures/o200k_harmony"
# gpt-oss's generation_config.json ends generation at <|return|>, <|endoftext|> and <|call|>.
EOS_IDS = [200002, 199999, 200012]
CONFIG = {"bos_token": "<|startoftext|>", "eos_token": "<|return|>", "pad_token": "<|endoftext|>",
          "tokenizer_class": "PreTrainedTokenizerFast"}


def fail(msg):
    print(f"FATAL: {msg}", file=sys.stderr, flush=True)
    sys.exit(1)


def check(cond, msg):
    if not cond:
        fail(msg)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fixture", default="tests/fixtures/o200k_harmony")
    args = ap.parse_args()
    from transformers.convert_slow_tokenizer import TikTokenConverter, bytes_to_unicode
    import tokenizers
    import transformers

    with open(os.path.join(args.fixture, "golden.json")) as f:
        golden = json.load(f)
    with open(os.path.join(args.fixture, "corpus.json"), encoding="utf-8") as f:
        corpus = json.load(f)
    ranks_path = os.path.join(args.fixture, golden["ranks_file"])
    # One name per id, in id order (the converter numbers added tokens from the vocabulary's end). Id 200018
    # has two names in tiktoken; it decodes as <|endofprompt|>, so that is the one kept.
    by_id = {}
    for name, i in golden["special_tokens"].items():
        if i not in by_id or name == golden["decode_200018"]["tiktoken"]:
            by_id[i] = name
    names = [by_id[i] for i in sorted(by_id)]
    check(sorted(by_id) == list(range(golden["num_ranks"], golden["n_vocab"])), "special ids are not dense")
    tok = TikTokenConverter(vocab_file=ranks_path, pattern=golden["pattern"], extra_special_tokens=names).converted()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "tokenizer.json")
        tok.save(path)
        with open(path, encoding="utf-8") as f:
            full = json.load(f)

    encoder = bytes_to_unicode()
    with open(ranks_path) as f:
        want = {}
        for line in f:
            b64, rank = line.split()
            want["".join(encoder[b] for b in base64.b64decode(b64))] = int(rank)
    check(full["model"]["vocab"] == want, "the converter's vocab is not the ranks in the byte alphabet")
    check(all(golden["special_tokens"][t["content"]] == t["id"] and t["special"] for t in full["added_tokens"]),
          "an added token's id differs from tiktoken's")
    agree = sum(tok.encode(s, add_special_tokens=False).ids == ids
                for s, ids in zip(corpus["ordinary"], golden["ordinary"]))
    agree_specials = sum(tok.encode(s, add_special_tokens=False).ids == ids
                         for s, ids in zip(corpus["with_specials"], golden["with_specials"]))

    layout = dict(full)
    layout["model"] = dict(full["model"], vocab={}, merges=[])
    out = args.fixture
    with open(os.path.join(out, "tokenizer_layout.json"), "w", encoding="utf-8") as f:
        json.dump(layout, f, ensure_ascii=False, separators=(",", ":"))
        f.write("\n")
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(CONFIG, f, indent=2)
        f.write("\n")
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 199998, "eos_token_id": EOS_IDS, "pad_token_id": 199999}, f, indent=2)
        f.write("\n")
    with open(os.path.join(out, "TOKENIZER_JSON.md"), "w") as f:
        f.write(f"""# gpt-oss's tokenizer.json for the o200k_harmony goldens

Made by `tools/oracle/o200k_harmony_tokenizer_json.py` with transformers {transformers.__version__} (its
`TikTokenConverter`, which made gpt-oss's released `tokenizer.json`) and tokenizers {tokenizers.__version__};
regenerate with

    {REGEN_COMMAND}

- `tokenizer_layout.json`: the converter's `tokenizer.json` with `model.vocab` and `model.merges` emptied (the full
  file is 28 MB). The converter's vocabulary is exactly `o200k_base.tiktoken` written in the GPT-2 byte alphabet
  with id = rank (checked), so a test puts it back from the ranks. The {len(full['added_tokens'])} added tokens are
  the specials with tiktoken's ids; id 200018 appears once, as `{by_id[200018]}`.
- `tokenizer_config.json` (bos `<|startoftext|>`, eos `<|return|>`, pad `<|endoftext|>`) and
  `generation_config.json` (`eos_token_id` {EOS_IDS}: `<|return|>`, `<|endoftext|>`, `<|call|>`) as gpt-oss
  declares them.
- The full converted tokenizer run by the `tokenizers` package gave tiktoken's ids on {agree} of
  {len(golden['ordinary'])} ordinary strings (its added-token matcher turns special names in plain text into
  specials, which `encode_ordinary` does not) and on {agree_specials} of {len(golden['with_specials'])} strings
  with specials.
""")
    print(f"layout {os.path.getsize(os.path.join(out, 'tokenizer_layout.json'))} bytes; tokenizers agrees on "
          f"{agree}/{len(golden['ordinary'])} ordinary, {agree_specials}/{len(golden['with_specials'])} with specials\nOK")


if __name__ == "__main__":
    main()
