#!/usr/bin/env python3
"""Independent numpy (float64) Kimi Linear forward over a checkpoint in the RELEASED layout.

Needs only numpy (no torch, no transformers, no safetensors package: shards are parsed by hand, BF16 widened
by bit shift). It reads config.json + the safetensors shards of a kimi_linear directory written in the layout of
docs/checkpoint-layout.md, re-implements the equations listed in tests/fixtures/kimi_linear_tiny/README.md
(KDA token by token in its recurrent form, MLA as full causal attention, sigmoid router + bias, MoE) and
compares with the transformers goldens in that directory:

    python3 tools/oracle/kimi_linear_ref.py tests/fixtures/kimi_linear_tiny

It checks golden_logits.npy (max abs diff), golden_hidden.npy, the greedy ids and the per-layer routing in
golden.json, and exits non-zero on a mismatch. It is a second opinion on the goldens and a readable spec of the
math the Rust engine must match.
"""

import json
import os
import struct
import sys

import numpy as np

LOGITS_TOL = 2e-4  # float64 here vs float32 in transformers
HIDDEN_TOL = 2e-4


def read_safetensors(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        raw = data[a:b]
        if info["dtype"] == "BF16":
            arr = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        elif info["dtype"] == "F32":
            arr = np.frombuffer(raw, dtype="<f4")
        else:
            raise ValueError(f"{name}: unsupported dtype {info['dtype']}")
        out[name] = arr.reshape(info["shape"]).astype(np.float64)
    return out


def load_dir(d):
    cfg = json.load(open(os.path.join(d, "config.json")))
    index = json.load(open(os.path.join(d, "model.safetensors.index.json")))
    w = {}
    for shard in sorted(set(index["weight_map"].values())):
        part = read_safetensors(os.path.join(d, shard))
        for k in part:
            assert index["weight_map"][k] == shard, k
        w.update(part)
    assert set(w) == set(index["weight_map"]), "index and shards disagree"
    return cfg, w


def rms(x, weight, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * weight


def silu(x):
    return x / (1.0 + np.exp(-x))


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def softplus20(z):  # transformers: z if z > 20 else log(1 + exp(z))
    return np.where(z > 20.0, z, np.log(1.0 + np.exp(np.minimum(z, 20.0))))


def l2norm(x):  # FLA / transformers: x / sqrt(sum(x^2) + 1e-6)
    return x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)


def causal_conv(x, w):  # x [T, C], w [C, 1, K]: out[t, c] = sum_j w[c, 0, j] * x[t - (K-1) + j, c]
    T, _ = x.shape
    K = w.shape[-1]
    xp = np.concatenate([np.zeros((K - 1, x.shape[1])), x], axis=0)
    out = np.zeros_like(x)
    for j in range(K):
        out += w[:, 0, j][None, :] * xp[j:j + T]
    return out


def kda(x, p, cfg):
    la = cfg["linear_attn_config"]
    nh, hd = la["num_heads"], la["head_dim"]
    T = x.shape[0]
    q = silu(causal_conv(x @ p["q_proj.weight"].T, p["q_conv1d.weight"])).reshape(T, nh, hd)
    k = silu(causal_conv(x @ p["k_proj.weight"].T, p["k_conv1d.weight"])).reshape(T, nh, hd)
    v = silu(causal_conv(x @ p["v_proj.weight"].T, p["v_conv1d.weight"])).reshape(T, nh, hd)
    f = (x @ p["f_a_proj.weight"].T @ p["f_b_proj.weight"].T + p["dt_bias"]).reshape(T, nh, hd)
    g = -np.exp(p["A_log"].reshape(nh))[None, :, None] * softplus20(f)
    beta = sigmoid(x @ p["b_proj.weight"].T)  # [T, nh]
    q = l2norm(q) * hd ** -0.5
    k = l2norm(k)
    S = np.zeros((nh, hd, hd))  # [head, k, v]
    o = np.zeros((T, nh, hd))
    for t in range(T):
        S = S * np.exp(g[t])[:, :, None]
        kv = np.einsum("hkv,hk->hv", S, k[t])
        delta = (v[t] - kv) * beta[t][:, None]
        S = S + np.einsum("hk,hv->hkv", k[t], delta)
        o[t] = np.einsum("hkv,hk->hv", S, q[t])
    gate = (x @ p["g_a_proj.weight"].T @ p["g_b_proj.weight"].T).reshape(T, nh, hd)
    o = rms(o, p["o_norm.weight"], cfg["rms_norm_eps"]) * sigmoid(gate)
    return o.reshape(T, nh * hd) @ p["o_proj.weight"].T


def mla(x, p, cfg):
    T = x.shape[0]
    nh = cfg["num_attention_heads"]
    dn, dr, dv, r = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"], cfg["kv_lora_rank"]
    q = (x @ p["q_proj.weight"].T).reshape(T, nh, dn + dr)
    ckv = x @ p["kv_a_proj_with_mqa.weight"].T
    lat, krot = ckv[:, :r], ckv[:, r:]
    lat = rms(lat, p["kv_a_layernorm.weight"], 1e-6)  # KimiLinearRMSNorm default eps, not rms_norm_eps
    kv = (lat @ p["kv_b_proj.weight"].T).reshape(T, nh, dn + dv)
    k = np.concatenate([kv[..., :dn], np.broadcast_to(krot[:, None, :], (T, nh, dr))], axis=-1)
    v = kv[..., dn:]
    s = np.einsum("thd,shd->hts", q, k) * (dn + dr) ** -0.5
    s = np.where(np.triu(np.ones((T, T), dtype=bool), 1)[None], -np.inf, s)
    s = np.exp(s - s.max(-1, keepdims=True))
    s = s / s.sum(-1, keepdims=True)
    o = np.einsum("hts,shd->thd", s, v)
    return o.reshape(T, nh * dv) @ p["o_proj.weight"].T


def swiglu(x, gate, up, down):
    return (silu(x @ gate.T) * (x @ up.T)) @ down.T


def moe(x, p, cfg, routing_out):
    E, k = cfg["num_experts"], cfg["num_experts_per_token"]
    assert cfg["num_expert_group"] == 1 and cfg["topk_group"] == 1
    scores = sigmoid(x @ p["gate.weight"].T)  # [T, E]
    sel = scores + p["gate.e_score_correction_bias"]
    out = swiglu(x, p["shared_experts.gate_proj.weight"], p["shared_experts.up_proj.weight"],
                 p["shared_experts.down_proj.weight"])
    for t in range(x.shape[0]):
        idx = np.argsort(-sel[t], kind="stable")[:k]
        w = scores[t, idx]
        if cfg["moe_renormalize"]:
            w = w / (w.sum() + 1e-20)
        w = w * cfg["routed_scaling_factor"]
        order = np.argsort(idx)
        routing_out.append(([int(i) for i in idx[order]], [float(a) for a in w[order]]))
        for e, we in zip(idx, w):
            pe = f"experts.{e}."
            out[t] += we * swiglu(x[t:t + 1], p[pe + "w1.weight"], p[pe + "w3.weight"], p[pe + "w2.weight"])[0]
    return out


def forward(cfg, w, ids):
    la = cfg["linear_attn_config"]
    kda_layers = {i - 1 for i in la["kda_layers"]}
    eps = cfg["rms_norm_eps"]
    h = w["model.embed_tokens.weight"][np.asarray(ids)]
    hidden = [h.copy()]
    routing = {}
    for i in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        x = rms(h, w[pre + "input_layernorm.weight"], eps)
        attn_p = {k[len(pre + "self_attn."):]: v for k, v in w.items() if k.startswith(pre + "self_attn.")}
        h = h + (kda(x, attn_p, cfg) if i in kda_layers else mla(x, attn_p, cfg))
        x = rms(h, w[pre + "post_attention_layernorm.weight"], eps)
        if i < cfg["first_k_dense_replace"]:
            h = h + swiglu(x, w[pre + "mlp.gate_proj.weight"], w[pre + "mlp.up_proj.weight"],
                           w[pre + "mlp.down_proj.weight"])
        else:
            mp = {k[len(pre + "block_sparse_moe."):]: v for k, v in w.items() if k.startswith(pre + "block_sparse_moe.")}
            routing[i] = []
            h = h + moe(x, mp, cfg, routing[i])
        hidden.append(h.copy())
    logits = rms(h, w["model.norm.weight"], eps) @ w["lm_head.weight"].T
    return logits, np.stack(hidden), routing


def main():
    d = sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/kimi_linear_tiny"
    cfg, w = load_dir(d)
    golden = json.load(open(os.path.join(d, "golden.json")))
    ref_logits = np.load(os.path.join(d, "golden_logits.npy"))
    ref_hidden = np.load(os.path.join(d, "golden_hidden.npy"))
    seq = golden["sequence_ids"]
    logits, hidden, routing = forward(cfg, w, seq)
    ok = True
    dl = float(np.abs(logits - ref_logits).max())
    dh = float(np.abs(hidden - ref_hidden).max())
    print(f"logits max |numpy f64 - transformers f32| = {dl:.3e} (tol {LOGITS_TOL:g})")
    print(f"hidden max |numpy f64 - transformers f32| = {dh:.3e} (tol {HIDDEN_TOL:g})")
    ok &= dl < LOGITS_TOL and dh < HIDDEN_TOL
    P, gen = len(golden["prompt_ids"]), golden["generated_ids"]
    greedy = [int(logits[P - 1 + i].argmax()) for i in range(len(gen))]
    print(f"greedy ids {greedy} (golden {gen})")
    ok &= greedy == gen
    for layer, rows in routing.items():
        g = golden["routing"][str(layer)]
        same = [r[0] for r in rows] == g["experts"]
        dw = max(abs(a - b) for r, gw in zip(rows, g["weights"]) for a, b in zip(r[1], gw))
        print(f"layer {layer}: routing {'same' if same else 'DIFFERENT'}, max weight diff {dw:.3e}")
        ok &= same and dw < 1e-4
    print("OK" if ok else "MISMATCH")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
