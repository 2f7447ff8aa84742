"""Shared machinery of the transformers golden scripts (deepseek_v3_golden.py, gpt_oss_golden.py).

Everything runs offline on CPU, deterministically, on transformers' eager (pure torch) paths. A golden is the
logits of one cached prefill over the prompt followed by single-token cached decode steps feeding the greedy
tokens, cross-checked against one no-cache forward over the whole sequence.
"""

import json
import os
import platform
import re
import sys

os.environ["CUDA_VISIBLE_DEVICES"] = ""
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ["USE_HUB_KERNELS"] = "0"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import safetensors  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

import transformers  # noqa: E402


def fail(msg):
    print(f"FATAL: {msg}", file=sys.stderr, flush=True)
    sys.exit(1)


def check(cond, msg):
    if not cond:
        fail(msg)


def require_transformers(minimum):
    have = tuple(int(x) for x in re.findall(r"\d+", transformers.__version__)[:2])
    check(have >= minimum, f"need transformers >= {minimum}, have {transformers.__version__}")


def setup_torch():
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.set_float32_matmul_precision("highest")
    torch.set_default_dtype(torch.float32)


def versions():
    out = {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "safetensors": safetensors.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
    }
    try:
        import compressed_tensors

        out["compressed_tensors"] = compressed_tensors.__version__
    except ImportError:
        pass
    return out


def bf16_round(t):
    """The nearest BF16 value of every element, kept in t's dtype."""
    return t.to(torch.bfloat16).to(t.dtype)


def top2_margin(row):
    v = row.topk(2).values
    return float(v[0] - v[1])


@torch.no_grad()
def run_cached(model, prompt_ids, num_new):
    """Prefill the prompt with use_cache=True, then num_new single-token cached forwards feeding the greedy tokens.

    Returns (logits [len(prompt) + num_new, V] in float64, generated ids, the argmax of the last row, the greedy
    margin of each generated id). Row t holds the logits after consuming token t of prompt + generated."""
    out = model(input_ids=prompt_ids[None, :], use_cache=True)
    cache = out.past_key_values
    check(cache is not None, "prefill returned no cache")
    rows = [out.logits[0].double()]
    generated, margins = [], []
    nxt = int(rows[-1][-1].argmax())
    for _ in range(num_new):
        margins.append(top2_margin(rows[-1][-1]))
        generated.append(nxt)
        out = model(input_ids=torch.tensor([[nxt]], dtype=torch.long), cache=cache, use_cache=True)
        cache = out.past_key_values
        check(out.logits.shape[1] == 1, "decode step did not return one row")
        rows.append(out.logits[0].double())
        nxt = int(rows[-1][-1].argmax())
    return torch.cat(rows, dim=0), generated, nxt, margins


@torch.no_grad()
def run_full(model, seq_ids):
    return model(input_ids=seq_ids[None, :], use_cache=False).logits[0].double()


def check_cached_vs_full(logits, full, prompt_len, generated, tol):
    diff = float((logits - full).abs().max())
    check(torch.isfinite(logits).all() and torch.isfinite(full).all(), "non-finite logits")
    check(diff < tol, f"cached vs full max |diff| {diff} >= {tol}")
    for i, tok in enumerate(generated):
        check(int(full[prompt_len - 1 + i].argmax()) == tok, f"no-cache argmax differs at generated[{i}]")
    return diff


def record_top_k(routing, margins, layer, top, k, weights):
    """Records one router call: the k-th vs (k+1)-th score margin of each row (`top`: its k + 1 best, sorted
    descending) in margins, and per row the chosen experts ascending with their weights in routing[layer]."""
    margins += (top.values[:, k - 1] - top.values[:, k]).tolist()
    order = top.indices[:, :k].sort(-1)
    rows = routing.setdefault(str(layer), {"experts": [], "weights": []})
    rows["experts"] += order.values.tolist()
    rows["weights"] += [[float(x) for x in r] for r in weights.gather(1, order.indices)]


def write_checkpoint(tensors, out_dir, shards):
    """Write tensors into the named shards plus model.safetensors.index.json.

    shards: list of (file name, predicate on tensor name), first match wins; every tensor must land in one."""
    for f in os.listdir(out_dir):
        if f.endswith(".safetensors") or f == "model.safetensors.index.json":
            os.remove(os.path.join(out_dir, f))
    parts = {fname: {} for fname, _ in shards}
    for name in sorted(tensors):
        fname = next((f for f, pred in shards if pred(name)), None)
        check(fname is not None, f"{name} fits no shard")
        parts[fname][name] = tensors[name].contiguous()
    weight_map, total = {}, 0
    for fname, part in parts.items():
        check(part, f"shard {fname} would be empty")
        save_file(part, os.path.join(out_dir, fname), metadata={"format": "pt"})
        for name, t in part.items():
            weight_map[name] = fname
            total += t.numel() * t.element_size()
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=1)
        f.write("\n")
    return total


def read_checkpoint(out_dir):
    from safetensors.torch import load_file

    with open(os.path.join(out_dir, "model.safetensors.index.json")) as f:
        index = json.load(f)
    tensors = {}
    for fname in sorted(set(index["weight_map"].values())):
        tensors.update(load_file(os.path.join(out_dir, fname)))
    check(set(tensors) == set(index["weight_map"]), "index and shards disagree")
    return tensors


def write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")


def save_goldens(out_dir, logits, golden, readme):
    """golden_logits.npy (float32), golden.json and README.md; returns the folder's file sizes."""
    np.save(os.path.join(out_dir, "golden_logits.npy"), logits.numpy().astype(np.float32))
    write_json(os.path.join(out_dir, "golden.json"), golden)
    with open(os.path.join(out_dir, "README.md"), "w") as f:
        f.write(readme)
    return {f: os.path.getsize(os.path.join(out_dir, f)) for f in sorted(os.listdir(out_dir))}


def compare_state(expected, got, what):
    """Require two state dicts to hold the same keys and bit-identical values (after widening to float64)."""
    check(set(expected) == set(got), f"{what}: keys differ: {sorted(set(expected) ^ set(got))[:8]}")
    bad = [k for k in expected if not torch.equal(expected[k].double(), got[k].double())]
    check(not bad, f"{what}: differs from the model that made the goldens at {bad[:8]}")
