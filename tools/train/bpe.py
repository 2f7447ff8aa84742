"""Byte-level BPE for deltafin's trained models: Kimi's pre-tokenizer, a trainer, a tiktoken-style
encoder, and the K3 tokenizer files.

The rules mirror crates/tokenizer (pretok.rs, train.rs, bpe.rs, files.rs) so that a prompt the engine
encodes gets the same ids the training corpus was encoded with:
  * pieces: Kimi's pre-tokenizer regex (set intersection `&&[^\\p{Han}]` written as `--\\p{Han}` for
    Python's `regex` module, V1 mode); merges never cross pieces;
  * training: ranks 0..255 are the single bytes; each step merges the most frequent adjacent pair
    (overlapping occurrences such as the two in "aaa" both count), ties to the lexicographically
    smallest (left bytes, right bytes); a merge whose bytes already form a token reuses it;
  * encoding: repeatedly merge the adjacent pair whose concatenation has the lowest rank, leftmost
    first, until no adjacent pair is a token (tiktoken's semantics);
  * files: `tiktoken.model` (base64 token, space, rank per line) and `tokenizer_config.json` with
    K3's 256 reserved specials at ids n_ranks + k.
"""

import base64
import heapq
import json
import os

import regex

KIMI_PATTERN = (
    r"[\p{Han}]+"
    r"|[^\r\n\p{L}\p{N}]?[[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]--\p{Han}]*[[\p{Ll}\p{Lm}\p{Lo}\p{M}]--\p{Han}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]--\p{Han}]+[[\p{Ll}\p{Lm}\p{Lo}\p{M}]--\p{Han}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+"
    r"|\s+(?!\S)"
    r"|\s+"
)
_RE = regex.compile(KIMI_PATTERN, regex.V1)

NUM_SPECIALS = 256
BOS, EOS, END_OF_MSG, PAD = 0, 1, 2, 255  # offsets after the ranks


def special_name(k):
    """Name of K3's special token k (id = n_ranks + k), as crates/tokenizer/src/files.rs."""
    fixed = {0: "[BOS]", 1: "[EOS]", 2: "<|end_of_msg|>", 3: "<|open|>", 4: "<|close|>", 5: "<|sep|>",
             6: "<|header_start|>", 7: "<|header_end|>", 9: "[EOT]", 254: "[UNK]", 255: "[PAD]"}
    return fixed.get(k, f"<|reserved_token_{k}|>")


def pretokenize(text):
    """Pieces whose concatenation is exactly `text`."""
    return _RE.findall(text)


def train(text, n_ranks):
    """Learns up to n_ranks tokens (bytes objects, in rank order) on `text`."""
    tokens = [bytes([b]) for b in range(256)]
    ids = {t: i for i, t in enumerate(tokens)}
    freq = {}
    for piece in pretokenize(text):
        freq[piece] = freq.get(piece, 0) + 1
    words = [[list(w.encode("utf-8")), f] for w, f in sorted(freq.items())]
    counts, holders = {}, {}
    for wi, (word, f) in enumerate(words):
        for pair in zip(word, word[1:]):
            counts[pair] = counts.get(pair, 0) + f
            holders.setdefault(pair, set()).add(wi)

    def key(pair, count):
        return (-count, tokens[pair[0]], tokens[pair[1]], pair)

    heap = [key(p, c) for p, c in counts.items()]
    heapq.heapify(heap)
    while len(tokens) < n_ranks and heap:
        neg, _, _, pair = heapq.heappop(heap)
        count = -neg
        if counts.get(pair) != count or count <= 0:
            continue
        merged = tokens[pair[0]] + tokens[pair[1]]
        new_id = ids.get(merged)
        if new_id is None:
            new_id = len(tokens)
            tokens.append(merged)
            ids[merged] = new_id
        delta = {}
        for wi in holders.pop(pair, ()):
            word, f = words[wi]
            if not any(p == pair for p in zip(word, word[1:])):
                continue
            for p in zip(word, word[1:]):
                delta[p] = delta.get(p, 0) - f
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == pair:
                    out.append(new_id)
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            words[wi][0] = out
            for p in zip(out, out[1:]):
                delta[p] = delta.get(p, 0) + f
                holders.setdefault(p, set()).add(wi)
        for p, d in delta.items():
            if d == 0:
                continue
            c = counts.get(p, 0) + d
            counts[p] = c
            if c > 0:
                heapq.heappush(heap, key(p, c))
    return tokens


class Encoder:
    """tiktoken-style rank BPE over the bytes of each piece, with a per-piece cache."""

    def __init__(self, tokens):
        self.tokens = tokens
        self.ranks = {t: i for i, t in enumerate(tokens)}
        self.cache = {}

    def encode_piece(self, piece):
        parts = [bytes([b]) for b in piece]
        while len(parts) > 1:
            best, at = None, -1
            for i in range(len(parts) - 1):
                r = self.ranks.get(parts[i] + parts[i + 1])
                if r is not None and (best is None or r < best):
                    best, at = r, i
            if best is None:
                break
            parts[at : at + 2] = [parts[at] + parts[at + 1]]
        return [self.ranks[p] for p in parts]

    def encode(self, text):
        out = []
        for piece in pretokenize(text):
            ids = self.cache.get(piece)
            if ids is None:
                ids = self.encode_piece(piece.encode("utf-8"))
                self.cache[piece] = ids
            out.extend(ids)
        return out

    def decode(self, ids):
        n = len(self.tokens)
        return b"".join(self.tokens[i] if i < n else special_name(i - n).encode() for i in ids).decode(
            "utf-8", errors="replace")


def read_tiktoken(path):
    tokens = {}
    with open(path, "rb") as f:
        for line in f:
            line = line.strip()
            if line:
                b64, rank = line.split(b" ")
                tokens[int(rank)] = base64.b64decode(b64)
    return [tokens[i] for i in range(len(tokens))]


def write_files(directory, tokens):
    """Writes tiktoken.model and tokenizer_config.json in the format of files.rs."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "tiktoken.model"), "w") as f:
        for rank, t in enumerate(tokens):
            f.write(f"{base64.b64encode(t).decode()} {rank}\n")
    base = len(tokens)
    added = {str(base + k): {"content": special_name(k), "lstrip": False, "normalized": False,
                             "rstrip": False, "single_word": False, "special": True}
             for k in range(NUM_SPECIALS)}
    config = {"added_tokens_decoder": added, "bos_token": "[BOS]", "eos_token": "[EOS]",
              "pad_token": "[PAD]", "unk_token": "[UNK]"}
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        f.write(json.dumps(config, indent=2) + "\n")
