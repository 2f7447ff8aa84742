#!/usr/bin/env python3
"""Trains a small Kimi-K3-architecture model on the Shakespeare corpus and exports it.

    python3 tools/train/train.py --preset target  --out models/shakespeare-k3
    python3 tools/train/train.py --preset drafter --out models/shakespeare-k3-drafter

Reads tools/train/data/{train,val,test}.u16 (prepare_corpus.py). Every default below is the recipe of
the committed models (docs/trained-model.md); `--steps` overrides the preset's step count. The
committed run asked for 2400 (target) and 1500 (drafter) steps with --max-seconds 220 / 150, which
lowered them at step 20 (before the warm-up ended, so the schedule is that of a run started with the
lowered count) to 747 and 1007: the presets now say so, and the plain commands reproduce that run.

Training: AdamW, linear warm-up then cosine decay to 10%, bf16 autocast (KDA recurrence, router and
loss in fp32), dropout on the attention and MLP branch outputs, quantisation-aware training of the
routed experts (fake MXFP4 with a straight-through estimator, from step 0), and the aux-loss-free
balance rule for the router's correction bias after every step:
    bias += gamma * sign(mean_load - load)          (load = tokens routed to each expert in the batch)
Model selection: the step with the lowest validation loss (evaluated every --eval-every steps).

Determinism: seeded initialisation (CPU generator), seeded batch order (CPU generator), seeded
dropout, torch.use_deterministic_algorithms(True, warn_only=True), CUBLAS_WORKSPACE_CONFIG=:4096:8;
the MoE computes every expert on every token (no scatter/index_add) so no atomics enter the
gradients. Same hardware + same torch -> same weights.

Writes into --out: the checkpoint (export.py) and train_log.json (recipe, losses, timings, perplexities).
"""

import argparse
import copy
import json
import math
import os
import sys
import time

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
sys.dont_write_bytecode = True

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import export  # noqa: E402
from k3model import K3Config, K3Model  # noqa: E402

PRESETS = {
    # ~26 MB checkpoint: 8 layers (MLA at 1-based 4 and 8), 4 AttnRes blocks, 64 experts top-8.
    "target": dict(
        cfg=K3Config(vocab_size=4352, hidden=256, layers=8, full_attn_layers=[4, 8], attn_res_block=2,
                     kda_heads=4, kda_head_dim=64, mla_heads=4, q_lora=128, kv_lora=128, qk_nope=32,
                     qk_rope=32, v_head=64, dense_inter=1024, n_experts=64, top_k=8, moe_inter=128,
                     latent=128, n_shared=2),
        steps=747, batch=32, seq=256, lr=2e-3, warmup=150, weight_decay=0.1, dropout=0.1,
        bias_gamma=5e-3, seed=1234, eval_every=150),
    # ~3 MB: 4 layers (MLA at 1-based 4), 2 AttnRes blocks, 16 experts top-4.
    "drafter": dict(
        cfg=K3Config(vocab_size=4352, hidden=128, layers=4, full_attn_layers=[4], attn_res_block=2,
                     kda_heads=2, kda_head_dim=64, mla_heads=2, q_lora=64, kv_lora=64, qk_nope=32,
                     qk_rope=32, v_head=64, dense_inter=512, n_experts=16, top_k=4, moe_inter=64,
                     latent=64, n_shared=2),
        steps=1007, batch=32, seq=256, lr=3e-3, warmup=100, weight_decay=0.1, dropout=0.1,
        bias_gamma=5e-3, seed=4321, eval_every=150),
}


def load_split(data_dir, split):
    return torch.from_numpy(np.fromfile(os.path.join(data_dir, f"{split}.u16"), dtype="<u2").astype(np.int64))


def windows(tokens, seq):
    """Non-overlapping evaluation windows [n, seq + 1] (inputs + next-token targets)."""
    n = (tokens.numel() - 1) // seq
    idx = torch.arange(n)[:, None] * seq + torch.arange(seq + 1)[None, :]
    return tokens[idx]


@torch.no_grad()
def evaluate(model, wins, device, batch=32, quant=True, autocast=False, max_windows=None):
    """Mean next-token cross-entropy (nats) over every position of every window, fresh state per window."""
    model.eval()
    if max_windows:
        wins = wins[:max_windows]
    total, count = 0.0, 0
    for i in range(0, wins.shape[0], batch):
        w = wins[i : i + batch].to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast and device.type == "cuda"):
            logits = model(w[:, :-1], quant=quant)
        loss = F.cross_entropy(logits.double().reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1), reduction="sum")
        total += loss.item()
        count += w[:, 1:].numel()
    model.train()
    return total / count


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", choices=PRESETS, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--data", default=os.path.join(HERE, "data"))
    ap.add_argument("--steps", type=int)
    ap.add_argument("--max-seconds", type=float, default=1e9,
                    help="after 20 steps, lower the step count (before warm-up ends, logged) so that "
                         "training fits; rerun with --steps <logged> to reproduce")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--batch", type=int, help="override the preset's batch (smoke tests)")
    ap.add_argument("--eval-windows", type=int, help="evaluate on the first N windows only (smoke tests)")
    args = ap.parse_args()
    p = dict(PRESETS[args.preset])
    cfg = p.pop("cfg")
    if args.steps:
        p["steps"] = args.steps
    if args.batch:
        p["batch"] = args.batch
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = torch.device(args.device)
    torch.manual_seed(p["seed"])  # dropout streams
    t_start = time.time()

    train_tok, val_tok, test_tok = (load_split(args.data, s) for s in ("train", "val", "test"))
    val_w, test_w = windows(val_tok, p["seq"])[: args.eval_windows], windows(test_tok, p["seq"])[: args.eval_windows]
    train_dev = train_tok.to(device)

    model = K3Model(cfg)
    model.init_weights(p["seed"])
    model.to(device).train()
    n_params = sum(t.numel() for t in model.parameters())
    n_expert = sum(t.numel() for n, t in model.named_parameters() if ".experts.w" in n)
    decay = [t for n, t in model.named_parameters() if t.dim() >= 2 and not n.endswith("_res_proj")]
    no_decay = [t for n, t in model.named_parameters() if not (t.dim() >= 2 and not n.endswith("_res_proj"))]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": p["weight_decay"]},
                             {"params": no_decay, "weight_decay": 0.0}], lr=p["lr"], betas=(0.9, 0.95),
                            eps=1e-8, foreach=True)
    moes = model.moe_layers()
    batch_gen = torch.Generator().manual_seed(p["seed"] + 1)

    def lr_at(step):
        if step < p["warmup"]:
            return p["lr"] * (step + 1) / p["warmup"]
        t = (step - p["warmup"]) / max(1, p["steps"] - p["warmup"])
        return p["lr"] * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))

    log = {"preset": args.preset, "config": json.loads(cfg.to_json()), "recipe": dict(p),
           "params": n_params, "expert_params": n_expert, "torch": torch.__version__,
           "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
           "command": " ".join(sys.argv), "evals": [], "train_loss": []}
    best = (float("inf"), -1, None)
    step_times = []
    T, B = p["seq"], p["batch"]
    offs = torch.arange(T + 1)
    t_train = time.time()
    step = 0
    while step < p["steps"]:
        t0 = time.time()
        starts = torch.randint(0, train_tok.numel() - T - 1, (B,), generator=batch_gen)
        w = train_dev[(starts[:, None] + offs[None, :]).to(device)]
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        stats = []
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(w[:, :-1], quant=True, stats=stats, dropout=p["dropout"])
        loss = F.cross_entropy(logits.float().reshape(-1, cfg.vocab_size), w[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            for L, moe in moes:
                load = stats[L]["load"]
                moe.gate.e_score_correction_bias.add_(p["bias_gamma"] * torch.sign(load.mean() - load))
        step += 1
        if step % 25 == 0 or step == 1:
            log["train_loss"].append([step, round(loss.item(), 4)])
        if device.type == "cuda" and step <= 21:
            torch.cuda.synchronize()
        step_times.append(time.time() - t0)
        if step == 20:
            per = float(np.median(step_times[5:]))
            fit = int((args.max_seconds - (time.time() - t_train)) / (per * 1.08)) + 20
            if fit < p["steps"]:
                log["steps_lowered"] = {"from": p["steps"], "to": fit, "median_step_s": per}
                p["steps"] = max(fit, p["warmup"] + 1)
                print(f"lowering steps to {p['steps']} to fit --max-seconds", flush=True)
        if step % p["eval_every"] == 0 or step == p["steps"]:
            vl = evaluate(model, val_w, device, autocast=True)
            log["evals"].append({"step": step, "val_loss": round(vl, 4), "train_loss": round(loss.item(), 4),
                                 "elapsed_s": round(time.time() - t_train, 1)})
            print(f"step {step}: train {loss.item():.3f} val {vl:.3f} ({time.time() - t_train:.0f}s)", flush=True)
            if vl < best[0]:
                best = (vl, step, copy.deepcopy(model.state_dict()))
    log["train_seconds"] = round(time.time() - t_train, 1)
    log["median_step_s"] = round(float(np.median(step_times[5:])), 4)
    log["recipe"]["steps"] = p["steps"]
    model.load_state_dict(best[2])
    log["best_step"], log["best_val_loss_bf16"] = best[1], round(best[0], 4)

    # Perplexities of the selected model (fp32 forward, no autocast): quantisation cost of MXFP4.
    res = {}
    res["val_fp32_unquantised"] = evaluate(model, val_w, device, quant=False)
    res["val_fp32_mxfp4"] = evaluate(model, val_w, device, quant=True)
    res["test_fp32_unquantised"] = evaluate(model, test_w, device, quant=False)
    res["test_fp32_mxfp4"] = evaluate(model, test_w, device, quant=True)
    loads = []
    with torch.no_grad():  # expert load on the validation split (fraction of routed slots per expert)
        model.eval()
        for i in range(0, val_w.shape[0], 32):
            stats = []
            model(val_w[i : i + 32, :-1].to(device), stats=stats)
            loads.append(torch.stack([stats[L]["load"] for L, _ in moes]).cpu())
        load = torch.stack(loads).sum(0)
        frac = load / load.sum(-1, keepdim=True)
        log["val_expert_load_max_over_mean"] = [round(float(x), 3) for x in (frac.max(-1).values * cfg.n_experts)]
        log["val_expert_load_min_over_mean"] = [round(float(x), 3) for x in (frac.min(-1).values * cfg.n_experts)]
    info = export.export(model.cpu(), args.out)
    log["export"] = info
    exported = export.load(args.out, torch.float64).to(device)
    res["test_exported_float64"] = evaluate(exported, test_w, device, quant=False)
    res["val_exported_float64"] = evaluate(exported, val_w, device, quant=False)
    log["loss_nats"] = {k: round(v, 5) for k, v in res.items()}
    log["ppl"] = {k: round(math.exp(v), 3) for k, v in res.items()}
    log["test_tokens_scored"] = int(test_w[:, 1:].numel())
    log["total_seconds"] = round(time.time() - t_start, 1)
    with open(os.path.join(args.out, "train_log.json"), "w") as f:
        json.dump(log, f, indent=1)
        f.write("\n")
    print(json.dumps({k: log[k] for k in ("ppl", "best_step", "train_seconds", "median_step_s", "export")}), flush=True)


if __name__ == "__main__":
    main()
