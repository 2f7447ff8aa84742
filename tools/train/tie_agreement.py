#!/usr/bin/env python3
"""Tie-aware agreement: deltafin vs the PyTorch float64 forward, with routing near-ties broken the engine's way.

    python3 tools/train/tie_agreement.py --engine /tmp/deltafin-i8 \
        [--model models/shakespeare-k3] [--windows all | 213 | 0:16,213] [--margin 1e-6] [--out FILE.json]

Why: the noaux_tc router keeps the top-k of sigmoid(W x) + bias. Where float64 puts the k-th and (k+1)-th
selection scores closer together than fp32 can resolve, an fp32 engine (deltafin) and a float64 reference
may keep different experts, and every later position of that window then sees different state. That is a
property of the input, not a difference in the math; this script separates the two.

For each 256-token window of the held-out test split (fresh state per window, as analyze.py):
  1. deltafin (`run --prompt-ids --dump-logits --events`): fp32 logits of every row, and the experts it
     routed every row to at every MoE layer (the prefill line of the events trace).
  2. PyTorch float64 on the exported checkpoint with the tie policy below: the reference logits.
     Per row: max|deltafin - torch| / max|torch| (the project's measure), against `--tol` (1e-4).
  3. Only in windows where the policy changed a selection: the plain float64 forward (no policy: the
     numbers analyze.py reports), and the plain float32 forward (the model's own inference precision),
     with the expert each of float64, float32 and deltafin keeps at each such tie.

Tie policy (the only change to the float64 forward): at a (layer, row) where deltafin's selected set
differs from float64's top-k, and every expert in the difference has a float64 selection score within
`margin` of float64's k-th score, the selected set is deltafin's. `margin` 1e-6 is 8 fp32 ulps at
scores in [1, 2), 17 in [0.5, 1): the order of what fp32 rounding of the router input can move. A
difference with any expert outside the margin is not overridden and is reported as a disagreement
(there should be none). Rows where the sets agree are untouched, so windows without such a tie compute
exactly analyze.py's forward.

Writes a JSON summary (--out) and prints one line per window with a tie and a final summary.
"""

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

sys.dont_write_bytecode = True
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import export  # noqa: E402
from train import load_split, windows  # noqa: E402

SEQ = 256


def row_rel(a, b):
    return np.abs(a - b).max(-1) / np.abs(b).max(-1)


def engine_run(engine, model_dir, ids, moe_layers, k):
    """deltafin on one window: (logits [T, vocab] float32, {layer: ids [T, k] ascending})."""
    with tempfile.TemporaryDirectory() as d:
        out, ev = os.path.join(d, "l.npy"), os.path.join(d, "ev.jsonl")
        subprocess.run([engine, "run", "--model", model_dir, "--prompt-ids", ",".join(map(str, ids)),
                        "--max-new", "1", "--ignore-eos", "--dump-logits", out, "--events", ev],
                       check=True, capture_output=True)
        logits = np.load(out)[: len(ids)]
        with open(ev) as f:
            prefill = json.loads(f.readline())  # max-new 1: the only line is the prefill pass
    assert prefill["pass"] == "prefill"
    routes = {L: [] for L in moe_layers}
    for L, row in prefill["routes"]:  # [layer, ids] per row, rows in order within each layer
        routes[L].append(row)
    routes = {L: np.array(r, dtype=np.int64) for L, r in routes.items()}
    assert all(r.shape == (len(ids), k) for r in routes.values()), "one route per row and layer expected"
    return logits, routes


class EngineTies:
    """`select` hook of one MoE layer (k3model.route): float64's top-k, except at near-ties that the
    engine broke the other way, where the engine's set is kept (see the module docstring)."""

    def __init__(self, layer, engine_ids, margin, log):
        self.layer, self.engine_ids, self.margin, self.log = layer, engine_ids, margin, log

    def __call__(self, choice, ids):
        c = choice.reshape(-1, choice.shape[-1])
        ids = ids.reshape(-1, ids.shape[-1]).clone()
        k = ids.shape[-1]
        srt = torch.sort(c, -1, descending=True).values
        kth, gap = srt[:, k - 1], srt[:, k - 1] - srt[:, k]
        self.log["positions"] += c.shape[0]
        self.log["min_gap"] = min(self.log["min_gap"], float(gap.min()))
        for t in torch.nonzero(gap < self.margin).flatten().tolist():
            self.log["near_ties"].append({"window": self.log["window"], "layer": self.layer, "row": t,
                                          "gap_k_k1_float64": float(gap[t]),
                                          "engine_same_set": set(ids[t].tolist()) == set(self.engine_ids[t].tolist())})
        for t in range(c.shape[0]):
            mine, eng = set(ids[t].tolist()), set(self.engine_ids[t].tolist())
            if mine == eng:
                continue
            diff = sorted(mine ^ eng)
            entry = {"window": self.log["window"], "layer": self.layer, "row": t, "gap_k_k1_float64": float(gap[t]),
                     "float64_only": sorted(mine - eng), "engine_only": sorted(eng - mine),
                     "scores_float64": {str(e): float(c[t, e]) for e in diff}}
            if all(abs(float(c[t, e] - kth[t])) < self.margin for e in diff):
                # the engine's set, in descending float64 score like topk's output
                eng_ids = torch.tensor(sorted(eng, key=lambda e: -float(c[t, e])), dtype=ids.dtype)
                ids[t] = eng_ids
                self.log["overrides"].append(entry)
            else:
                self.log["disagreements"].append(entry)
        return ids.reshape(choice.shape[:-1] + (k,))


def set_hooks(model, hooks):
    for L, moe in model.moe_layers():
        moe.select = hooks.get(L) if hooks else None


def forward(model, x, stats=None):
    with torch.no_grad():
        return model(x, stats=stats)[0].numpy()


def fp32_choice(model32, stats, layer, row, experts):
    """float32 selection scores (sigmoid + bias) of `experts` at (layer, row) of a float32 forward."""
    g = model32.layers[layer].block_sparse_moe.gate
    with torch.no_grad():
        s = torch.sigmoid(stats[layer]["router_in"][0, row] @ g.weight.t()) + g.e_score_correction_bias
    return {str(e): float(s[e]) for e in experts}


def summary(rels, argmax_same, tol):
    r = np.concatenate(rels)
    return {"rows": int(r.size), "rows_over_tol": int((r > tol).sum()), "rel_max": float(r.max()),
            "rel_median": float(np.median(r)), "rel_p99": float(np.quantile(r, 0.99)),
            "argmax_equal": int(argmax_same)}


def parse_windows(spec, n):
    if spec == "all":
        return list(range(n))
    out = []
    for part in spec.split(","):
        a, _, b = part.partition(":")
        out += list(range(int(a), int(b))) if b else [int(a)]
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", required=True)
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "shakespeare-k3"))
    ap.add_argument("--windows", default="all", help='"all", or indices / a:b ranges, comma-separated')
    ap.add_argument("--margin", type=float, default=1e-6)
    ap.add_argument("--tol", type=float, default=1e-4)
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    ap.add_argument("--out", default=None, help="JSON summary (default: print only)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    wins = windows(load_split(os.path.join(HERE, "data"), "test"), SEQ)
    sel = parse_windows(args.windows, wins.shape[0])
    model = export.load(args.model, torch.float64)
    model32 = export.load(args.model, torch.float32)
    cfg = model.cfg
    moe_layers = [L for L, _ in model.moe_layers()]

    log = {"window": None, "positions": 0, "near_ties": [], "min_gap": math.inf, "overrides": [], "disagreements": []}
    rel_plain, rel_tie, rel_no_tie = [], [], []
    same_plain = same_tie = 0
    tie_windows = []
    t_eng = t_torch = 0.0
    for wi in sel:
        x = wins[wi : wi + 1, :-1]
        t0 = time.time()
        eng, routes = engine_run(args.engine, args.model, x[0].tolist(), moe_layers, cfg.top_k)
        t_eng += time.time() - t0
        t0 = time.time()
        n_over, n_dis = len(log["overrides"]), len(log["disagreements"])
        log["window"] = wi
        set_hooks(model, {L: EngineTies(L, routes[L], args.margin, log) for L in moe_layers})
        ref_tie = forward(model, x)
        set_hooks(model, None)
        r_tie = row_rel(eng, ref_tie)
        rel_tie.append(r_tie)
        same_tie += int((eng.argmax(-1) == ref_tie.argmax(-1)).sum())
        ties = log["overrides"][n_over:]
        if not ties:
            # no selection changed: this was exactly the plain float64 forward
            rel_plain.append(r_tie)
            rel_no_tie.append(r_tie)
            same_plain += int((eng.argmax(-1) == ref_tie.argmax(-1)).sum())
        else:
            ref64 = forward(model, x)
            st32 = []
            ref32 = forward(model32, x, stats=st32)
            r64, r32 = row_rel(eng, ref64), row_rel(eng, ref32)
            rel_plain.append(r64)
            same_plain += int((eng.argmax(-1) == ref64.argmax(-1)).sum())
            for tie in ties:
                L, t = tie["layer"], tie["row"]
                ids32 = set(st32[L]["ids"][0, t].tolist())
                diff = tie["float64_only"] + tie["engine_only"]
                tie["float32_keeps"] = sorted(e for e in diff if e in ids32)
                tie["engine_keeps"] = tie["engine_only"]
                tie["float64_keeps"] = tie["float64_only"]
                tie["scores_float32"] = fp32_choice(model32, st32, L, t, diff)
            over64 = np.nonzero(r64 > args.tol)[0]
            entry = {"window": wi, "ties": ties,
                     "plain_float64": {"rows_over_tol": int(over64.size),
                                       "first_row_over_tol": int(over64[0]) if over64.size else None,
                                       "rel_max": float(r64.max()),
                                       "argmax_equal": int((eng.argmax(-1) == ref64.argmax(-1)).sum())},
                     "float32_torch": {"rows_over_tol": int((r32 > args.tol).sum()), "rel_max": float(r32.max()),
                                       "float32_vs_float64_rel_max": float(row_rel(ref32, ref64).max())},
                     "tie_aware_float64": {"rows_over_tol": int((r_tie > args.tol).sum()),
                                           "rel_max": float(r_tie.max()),
                                           "argmax_equal": int((eng.argmax(-1) == ref_tie.argmax(-1)).sum())}}
            tie_windows.append(entry)
            for tie in ties:
                print(f"window {wi}: layer {tie['layer']} row {tie['row']}: float64 gap {tie['gap_k_k1_float64']:.2e}; "
                      f"keeps float64 {tie['float64_keeps']} float32 {tie['float32_keeps']} "
                      f"deltafin {tie['engine_keeps']}")
            print(f"window {wi}: rows over {args.tol:g}: plain float64 {entry['plain_float64']['rows_over_tol']} "
                  f"(max {r64.max():.2e}), float32 torch {entry['float32_torch']['rows_over_tol']} "
                  f"(max {r32.max():.2e}), tie-aware float64 {entry['tie_aware_float64']['rows_over_tol']} "
                  f"(max {r_tie.max():.2e})", flush=True)
        for d in log["disagreements"][n_dis:]:
            print(f"window {wi}: DISAGREEMENT beyond margin at layer {d['layer']} row {d['row']}: {d}", flush=True)
        t_torch += time.time() - t0
        if (len(rel_tie) % 20) == 0:
            print(f"... {len(rel_tie)}/{len(sel)} windows", flush=True)

    res = {"model": os.path.relpath(os.path.abspath(args.model), ROOT), "windows": len(sel),
           "windows_spec": args.windows, "margin": args.margin, "tol": args.tol,
           "measure": "per row max|deltafin - torch| / max|torch|",
           "plain_float64": summary(rel_plain, same_plain, args.tol),
           "tie_aware_float64": summary(rel_tie, same_tie, args.tol),
           "rel_max_in_windows_without_override": float(np.concatenate(rel_no_tie).max()) if rel_no_tie else None,
           "routing": {"positions_x_moe_layers": log["positions"],
                       "float64_gap_below_margin": len(log["near_ties"]),
                       "float64_gap_below_margin_engine_same_set": sum(n["engine_same_set"] for n in log["near_ties"]),
                       "near_ties": log["near_ties"],
                       "smallest_float64_gap": log["min_gap"],
                       "engine_broke_other_way": len(log["overrides"]),
                       "disagreements_beyond_margin": log["disagreements"]},
           "windows_with_ties": tie_windows,
           "engine_seconds": round(t_eng, 1), "torch_seconds": round(t_torch, 1)}
    p, t = res["plain_float64"], res["tie_aware_float64"]
    print(f"{res['model']}: {p['rows']} rows, {len(sel)} windows. plain float64: {p['rows_over_tol']} over {args.tol:g}, "
          f"max {p['rel_max']:.2e}. tie-aware (margin {args.margin:g}): {t['rows_over_tol']} over, max {t['rel_max']:.2e}, "
          f"median {t['rel_median']:.1e}, p99 {t['rel_p99']:.1e}, argmax equal {t['argmax_equal']}/{t['rows']}. "
          f"float64 gaps < margin: {len(log['near_ties'])} of {log['positions']} (smallest {log['min_gap']:.1e}); "
          f"engine broke {len(log['overrides'])} of them the other way; "
          f"disagreements beyond margin: {len(log['disagreements'])}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
