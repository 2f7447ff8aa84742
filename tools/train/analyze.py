#!/usr/bin/env python3
"""Agreement, perplexity and routing analysis of the exported models (CPU, float64 PyTorch).

    python3 tools/train/analyze.py --engine /tmp/target-train/release/deltafin \
        [--target models/shakespeare-k3] [--drafter models/shakespeare-k3-drafter] [--windows 260]

For the target (and the drafter), on the held-out test split cut into 256-token windows (fresh state
each, as in training):
  * PyTorch float64 forward of the exported checkpoint (export.load) vs deltafin's --dump-logits, per
    row: max |engine - torch| / max |torch| (the project's measure); greedy agreement;
  * held-out perplexity from each;
  * golden files for check_agreement.py: a test-split prompt plus 16 greedy tokens (PyTorch's), the
    PyTorch float64 logits of every row as float32 .npy;
and for the target only, routing on the test windows:
  * expert popularity per MoE layer (share of routed slots per expert; max/mean, min/mean, effective
    number of experts exp(entropy), experts never chosen);
  * consecutive-token overlap |ids_t ∩ ids_{t-1}| / k per layer;
  * lookahead recall per layer: layer L+1's router (weights and correction bias) applied to layer L's
    router input, top-k (and top-2k) vs layer L+1's actual choice;
  * a trace (JSON lines, models/routing-trace-*.jsonl): per token, per MoE layer, the chosen ids and
    the lookahead-predicted ids.
Writes models/analysis.json with every number, and prints a summary.
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
from k3model import rms, route  # noqa: E402
from train import load_split, windows  # noqa: E402

SEQ = 256
TOL = 1e-4


def row_rel(a, b):
    return np.abs(a - b).max(-1) / np.abs(b).max(-1)


def nll(logits, targets):
    lg = logits.astype(np.float64)
    m = lg.max(-1, keepdims=True)
    lse = (m[:, 0] + np.log(np.exp(lg - m).sum(-1)))
    return lse - lg[np.arange(len(targets)), targets]


def engine_logits(engine, model_dir, ids, max_new=1, threads=None):
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "l.npy")
        cmd = [engine] + (["--threads", str(threads)] if threads else []) + [
            "run", "--model", model_dir, "--prompt-ids", ",".join(map(str, ids)), "--max-new", str(max_new),
            "--ignore-eos", "--dump-logits", out, "--print-ids"]
        r = subprocess.run(cmd, check=True, capture_output=True, text=True)
        gen = json.loads(r.stdout.strip().splitlines()[-1])
        return np.load(out), gen


def min_margin(model, x, row=None):
    """(layer, gap) of the smallest float64 gap between the k-th and (k+1)-th selection score
    (sigmoid + correction bias) over the MoE layers, at `row` or over all rows."""
    stats = []
    with torch.no_grad():
        model(x, stats=stats)
        best = (None, float("inf"))
        for L, moe in model.moe_layers():
            g = moe.gate
            s = torch.sigmoid(stats[L]["router_in"][0] @ g.weight.t()) + g.e_score_correction_bias
            srt = torch.sort(s, -1, descending=True).values
            gap = srt[:, model.cfg.top_k - 1] - srt[:, model.cfg.top_k]
            gap = float(gap[row] if row is not None else gap.min())
            if gap < best[1]:
                best = (L, gap)
    return best


def agreement(engine, model_dir, model, wins, label):
    """Teacher-forced logits on every window from both; returns the numbers."""
    rels, greedy_same, n_eng, n_torch, rows, flips = [], 0, 0.0, 0.0, 0, []
    t_eng = t_torch = 0.0
    for w in wins:
        ids, targets = w[:-1].tolist(), w[1:].numpy()
        t0 = time.time()
        eng, _ = engine_logits(engine, model_dir, ids)
        t_eng += time.time() - t0
        eng = eng[: len(ids)]
        t0 = time.time()
        with torch.no_grad():
            ref = model(w[None, :-1])[0].numpy()
        t_torch += time.time() - t0
        r = row_rel(eng, ref)
        rels.append(r)
        if r.max() > TOL:
            first = int(np.argmax(r > TOL))
            layer, margin = min_margin(model, w[None, :-1], first)
            flips.append({"window": len(rels) - 1, "first_row": first, "rows_over_tol": int((r > TOL).sum()),
                          "smallest_topk_margin_at_first_row": margin, "layer": layer})
        greedy_same += int((eng.argmax(-1) == ref.argmax(-1)).sum())
        n_eng += nll(eng, targets).sum()
        n_torch += nll(ref, targets).sum()
        rows += len(ids)
    rels = np.concatenate(rels)
    res = {"windows": len(wins), "tokens_scored": rows, "rel_max": float(rels.max()),
           "rel_median": float(np.median(rels)), "rel_p99": float(np.quantile(rels, 0.99)),
           "rows_over_tol": int((rels > TOL).sum()), "tol": TOL, "windows_over_tol": flips,
           "greedy_argmax_equal": greedy_same / rows,
           "ppl_engine": math.exp(n_eng / rows), "ppl_torch_float64": math.exp(n_torch / rows),
           "engine_seconds": round(t_eng, 1), "torch_seconds": round(t_torch, 1)}
    for f in flips:
        print(f"[{label}] window {f['window']}: {f['rows_over_tol']} rows over {TOL:g} from row {f['first_row']}, "
              f"where layer {f['layer']}'s top-k margin is {f['smallest_topk_margin_at_first_row']:.1e} (float64)")
    print(f"[{label}] {rows} held-out tokens: engine vs torch rel max {res['rel_max']:.2e} "
          f"(median {res['rel_median']:.1e}); argmax equal {res['greedy_argmax_equal']:.4f}; "
          f"ppl engine {res['ppl_engine']:.3f} torch {res['ppl_torch_float64']:.3f}", flush=True)
    return res


def engine_ppl(engine, model_dir, wins, label):
    """deltafin's perplexity over every window (teacher forced, fresh state per window)."""
    total, n, t0 = 0.0, 0, time.time()
    for w in wins:
        eng, _ = engine_logits(engine, model_dir, w[:-1].tolist())
        total += nll(eng[: len(w) - 1], w[1:].numpy()).sum()
        n += len(w) - 1
    print(f"[{label}] deltafin perplexity over {n} test tokens: {math.exp(total / n):.3f}", flush=True)
    return {"tokens": n, "ppl": math.exp(total / n), "nats": total / n, "seconds": round(time.time() - t0, 1)}


def golden(engine, model_dir, model, prompt, n_new, out_prefix):
    """PyTorch greedy continuation + float64 logits of every row, saved as the CI golden."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n_new):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
        ref = model(torch.tensor([ids[:-1]]))[0].numpy()
    P = len(prompt)
    gen = ids[P:]
    np.save(out_prefix + "-logits.npy", ref.astype(np.float32))
    with open(out_prefix + ".json", "w") as f:
        json.dump({"model": os.path.relpath(model_dir, ROOT), "prompt_ids": list(prompt), "generated_ids": gen,
                   "rows": "row r < P: after prompt[0..=r]; row P-1+j (j >= 1): after generated[j-1]",
                   "source": "tools/train/analyze.py, PyTorch float64 on the exported checkpoint"}, f)
        f.write("\n")
    layer, margin = min_margin(model, torch.tensor([ids[:-1]]))
    with open(out_prefix + ".json") as f:
        meta = json.load(f)
    meta["smallest_topk_margin"] = {"layer": layer, "gap": margin,
                                    "why": "a gap near fp32 resolution could flip routing between engines"}
    with open(out_prefix + ".json", "w") as f:
        json.dump(meta, f)
        f.write("\n")
    eng, eng_gen = engine_logits(engine, model_dir, prompt, max_new=n_new)
    eng_rows = np.concatenate([eng[:P], eng[P + 1 :]])
    r = row_rel(eng_rows, ref)
    print(f"golden {os.path.basename(out_prefix)}: engine greedy == torch greedy: {eng_gen == gen}; rel max {r.max():.2e}")
    return {"rel_max": float(r.max()), "greedy_equal": eng_gen == gen, "rows": len(ref)}


def routing(model, wins, trace_path, trace_windows):
    cfg = model.cfg
    k, E = cfg.top_k, cfg.n_experts
    moe_layers = [L for L in range(cfg.layers) if L > 0]
    counts = np.zeros((len(moe_layers), E))
    overlap = np.zeros(len(moe_layers))
    overlap_n = 0
    recall = {"router_in": np.zeros(len(moe_layers)), "router_in_top2k": np.zeros(len(moe_layers)),
              "residual": np.zeros(len(moe_layers))}
    n_tok = 0
    f = open(trace_path, "w")
    f.write(json.dumps({"format": "deltafin routing trace v1", "model": "shakespeare-k3", "moe_layers": moe_layers,
                        "top_k": k, "n_experts": E, "windows_of": SEQ,
                        "fields": {"w": "window index in the test split", "t": "position in the window",
                                   "tok": "input token id", "ids": "per MoE layer (in moe_layers order): the "
                                   "chosen expert ids, descending routing score", "pred": "per MoE layer: "
                                   "that layer's router applied to the previous layer's router input (top-k, "
                                   "descending score)"}}) + "\n")
    with torch.no_grad():
        for wi, w in enumerate(wins):
            stats = []
            x = w[None, :-1]
            model(x, stats=stats)
            ids = [stats[L]["ids"][0].numpy() for L in moe_layers]  # [T, k]
            preds, preds2, preds3 = [], [], []
            for i, L in enumerate(moe_layers):
                gate = model.layers[L].block_sparse_moe.gate
                _, _, p = route(cfg, gate.weight, gate.e_score_correction_bias, stats[L - 1]["router_in"][0])
                preds.append(p.numpy())
                s = torch.sigmoid(stats[L - 1]["router_in"][0] @ gate.weight.t()) + gate.e_score_correction_bias
                preds2.append(torch.topk(s, 2 * k, dim=-1).indices.numpy())
                # later, cheaper variant: L's own router on the partial sum entering layer L (known once
                # layer L-1 is done, before L's attention), normed with L's post_attention_layernorm
                hn = rms(stats[L]["h_in"][0], model.layers[L].post_attention_layernorm, cfg.eps)
                preds3.append(route(cfg, gate.weight, gate.e_score_correction_bias, hn)[2].numpy())
            T = x.shape[1]
            for i in range(len(moe_layers)):
                a = ids[i]
                np.add.at(counts[i], a.reshape(-1), 1)
                same = (a[1:, :, None] == a[:-1, None, :]).any(-1).sum(-1)
                overlap[i] += same.sum() / k
                recall["router_in"][i] += (preds[i][:, :, None] == a[:, None, :]).any(-1).sum() / k
                recall["residual"][i] += (preds3[i][:, :, None] == a[:, None, :]).any(-1).sum() / k
                recall["router_in_top2k"][i] += (preds2[i][:, :, None] == a[:, None, :]).any(-2).sum() / k
            overlap_n += T - 1
            n_tok += T
            if wi < trace_windows:
                for t in range(T):
                    f.write(json.dumps({"w": wi, "t": t, "tok": int(x[0, t]),
                                        "ids": [ids[i][t].tolist() for i in range(len(moe_layers))],
                                        "pred": [preds[i][t].tolist() for i in range(len(moe_layers))]},
                                       separators=(",", ":")) + "\n")
    f.close()
    share = counts / counts.sum(-1, keepdims=True)
    ent = -(share * np.log(np.where(share > 0, share, 1))).sum(-1)
    res = {"tokens": n_tok, "moe_layers": moe_layers,
           "popularity_max_over_mean": (share.max(-1) * E).round(3).tolist(),
           "popularity_min_over_mean": (share.min(-1) * E).round(3).tolist(),
           "effective_experts_exp_entropy": np.exp(ent).round(2).tolist(),
           "experts_never_chosen": (counts == 0).sum(-1).tolist(),
           "top5_experts_share": [[[int(e), round(float(s[e]), 4)] for e in np.argsort(-s)[:5]] for s in share],
           "consecutive_overlap": (overlap / overlap_n).round(4).tolist(),
           "consecutive_overlap_random_baseline": round(k / E, 4),
           "lookahead_recall_topk": (recall["router_in"] / n_tok).round(4).tolist(),
           "lookahead_recall_top2k": (recall["router_in_top2k"] / n_tok).round(4).tolist(),
           "lookahead_recall_own_router_on_partial_sum": (recall["residual"] / n_tok).round(4).tolist(),
           "note": "lookahead for layer L uses layer L-1's router input (layer 0's dense-MLP input for L=1)"}
    return res


def speculative_match(target, drafter, wins):
    """Share of positions where the drafter's greedy token equals the target's (teacher forced)."""
    same = n = 0
    with torch.no_grad():
        for w in wins:
            a = target(w[None, :-1])[0].argmax(-1)
            b = drafter(w[None, :-1])[0].argmax(-1)
            same += int((a == b).sum())
            n += a.numel()
    return same / n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", required=True)
    ap.add_argument("--target", default=os.path.join(ROOT, "models", "shakespeare-k3"))
    ap.add_argument("--drafter", default=os.path.join(ROOT, "models", "shakespeare-k3-drafter"))
    ap.add_argument("--windows", type=int, default=260, help="test windows for agreement and perplexity")
    ap.add_argument("--ppl-windows", type=int, default=260, help="test windows for deltafin's perplexity")
    ap.add_argument("--routing-windows", type=int, default=260)
    ap.add_argument("--trace-windows", type=int, default=8)
    ap.add_argument("--out", default=os.path.join(ROOT, "models"))
    args = ap.parse_args()
    torch.set_num_threads(2)
    test = load_split(os.path.join(HERE, "data"), "test")
    wins = windows(test, SEQ)
    res = {"test_windows_total": int(wins.shape[0])}
    gdir = os.path.join(args.out, "golden")
    os.makedirs(gdir, exist_ok=True)
    prompt = wins[0, :48].tolist()
    target = export.load(args.target)
    drafter = export.load(args.drafter) if os.path.exists(args.drafter) else None
    res["golden_target"] = golden(args.engine, args.target, target, prompt, 16, os.path.join(gdir, "shakespeare-k3"))
    if drafter is not None:
        res["golden_drafter"] = golden(args.engine, args.drafter, drafter, prompt, 16,
                                       os.path.join(gdir, "shakespeare-k3-drafter"))
    for name, d in (("target", args.target), ("drafter", args.drafter)):
        if os.path.exists(d):
            res[f"engine_ppl_{name}"] = engine_ppl(args.engine, d, wins[: args.ppl_windows], name)
            with open(os.path.join(d, "train_log.json")) as f:
                res[f"engine_ppl_{name}"]["torch_float64_gpu_same_windows"] = json.load(f)["ppl"]["test_exported_float64"]
    res["agreement_target"] = agreement(args.engine, args.target, target, wins[: args.windows], "target")
    if drafter is not None:
        res["agreement_drafter"] = agreement(args.engine, args.drafter, drafter, wins[: args.windows], "drafter")
        res["drafter_greedy_match_teacher_forced"] = speculative_match(target, drafter, wins[:32])
        print(f"drafter argmax == target argmax on {32 * SEQ} test positions: "
              f"{res['drafter_greedy_match_teacher_forced']:.4f}")
    t0 = time.time()
    res["routing_target"] = routing(target, wins[: args.routing_windows],
                                    os.path.join(args.out, "routing-trace-shakespeare-k3.jsonl"), args.trace_windows)
    res["routing_seconds"] = round(time.time() - t0, 1)
    r = res["routing_target"]
    for i, L in enumerate(r["moe_layers"]):
        print(f"layer {L}: popularity max/mean {r['popularity_max_over_mean'][i]:.2f} eff {r['effective_experts_exp_entropy'][i]:.1f} "
              f"| overlap {r['consecutive_overlap'][i]:.3f} | lookahead recall {r['lookahead_recall_topk'][i]:.3f} "
              f"(top-2k {r['lookahead_recall_top2k'][i]:.3f}; own router on partial sum "
              f"{r['lookahead_recall_own_router_on_partial_sum'][i]:.3f})")
    with open(os.path.join(args.out, "analysis.json"), "w") as f:
        json.dump(res, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
