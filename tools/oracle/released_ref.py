#!/usr/bin/env python3
"""Independent numpy (float64) forward of the DeepSeek-V3 / Kimi K2 and gpt-oss fixtures, from their RELEASED files.

Needs only numpy: shards are parsed by hand; BF16, F8_E4M3, I32/I64 pack-quantized INT4 and U8 MXFP4 are decoded
here as docs/checkpoint-layout.md says. It re-implements the equations of each fixture's README (MLA with q LoRA,
interleaved YaRN RoPE, grouped sigmoid router; gpt-oss attention with sinks, sliding window, rotate-half YaRN,
clamped SwiGLU, softmax router) as one causal pass over sequence_ids, and checks the transformers goldens:
logits (max |diff|), greedy ids and routing. A second opinion on the goldens and a readable spec of the math:

    python3 tools/oracle/released_ref.py tests/fixtures/deepseek_v3_tiny_bf16 tests/fixtures/deepseek_v3_tiny_fp8 \\
        tests/fixtures/kimi_k2_tiny_int4 tests/fixtures/gpt_oss_tiny_mxfp4
"""

import json
import math
import os
import struct
import sys

import numpy as np

LOGITS_TOL = 1e-4  # the goldens are float64 results with float32 norms/softmax, stored as float32
ROUTING_TOL = 1e-5  # routing weights: the same float32 islands move them by ~1e-6


# ---- reading ---------------------------------------------------------------------------------------------------


def fp8_e4m3(raw):
    b = raw.astype(np.int64)
    sign = np.where(b >> 7, -1.0, 1.0)
    exp, mant = (b >> 3) & 15, b & 7
    val = np.where(exp == 0, mant / 8.0 * 2.0**-6, (1 + mant / 8.0) * np.exp2(exp - 7.0))
    assert not ((exp == 15) & (mant == 7)).any(), "FP8 NaN in a weight"
    return sign * val


DTYPES = {
    "BF16": lambda r: (np.frombuffer(r, "<u2").astype(np.uint32) << 16).view(np.float32),
    "F32": lambda r: np.frombuffer(r, "<f4"),
    "F8_E4M3": lambda r: fp8_e4m3(np.frombuffer(r, np.uint8)),
    "U8": lambda r: np.frombuffer(r, np.uint8),
    "I32": lambda r: np.frombuffer(r, "<i4"),
    "I64": lambda r: np.frombuffer(r, "<i8"),
}


def load_dir(d):
    cfg = json.load(open(os.path.join(d, "config.json")))
    index = json.load(open(os.path.join(d, "model.safetensors.index.json")))["weight_map"]
    w = {}
    for shard in sorted(set(index.values())):
        with open(os.path.join(d, shard), "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
            data = f.read()
        for name, info in header.items():
            if name != "__metadata__":
                a, b = info["data_offsets"]
                arr = DTYPES[info["dtype"]](data[a:b]).reshape(info["shape"])
                w[name] = arr if info["dtype"] in ("U8", "I32", "I64") else arr.astype(np.float64)
    assert set(w) == set(index), "index and shards disagree"
    return cfg, w


def linear(w, base):
    """The float64 [out, in] matrix of a linear, whatever its stored format."""
    if f"{base}.weight_scale_inv" in w:  # FP8, 128x128 blocks, partial last blocks keep their own scale
        q, s = w[f"{base}.weight"], w[f"{base}.weight_scale_inv"]
        rows, cols = q.shape
        return q * np.repeat(np.repeat(s, 128, 0)[:rows], 128, 1)[:, :cols]
    if f"{base}.weight_packed" in w:  # compressed-tensors pack-quantized INT4, group 32
        rows, cols = (int(x) for x in w[f"{base}.weight_shape"])
        p = w[f"{base}.weight_packed"].astype(np.int64) & 0xFFFFFFFF
        q = np.stack([(p >> (4 * k)) & 15 for k in range(8)], -1).reshape(rows, cols) - 8
        return q * np.repeat(w[f"{base}.weight_scale"], 32, 1)
    return w[f"{base}.weight"]


FP4 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])


def mxfp4(blocks, scales):
    """[E, rows, G, 16] bytes + [E, rows, G] E8M0 -> [E, rows, G*32] (low nibble = even element)."""
    vals = np.stack([FP4[blocks & 15], FP4[blocks >> 4]], -1).reshape(*blocks.shape[:-1], 32)
    vals = vals * np.exp2(scales.astype(np.float64) - 127)[..., None]
    return vals.reshape(*vals.shape[:-2], -1)


# ---- shared pieces ---------------------------------------------------------------------------------------------


def rms(x, weight, eps):
    x32 = x.astype(np.float32).astype(np.float64)
    return x32 / np.sqrt((x32 * x32).mean(-1, keepdims=True) + eps) * weight


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def yarn_inv_freq(d, theta, rs):
    """transformers' _compute_yarn_parameters (float32 as there) and its cos/sin attention factor."""
    factor, orig = rs["factor"], rs["original_max_position_embeddings"]
    beta_fast, beta_slow = rs.get("beta_fast") or 32, rs.get("beta_slow") or 1

    def corr(rot):
        return d * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(theta))

    low, high = corr(beta_fast), corr(beta_slow)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    pos = np.float32(theta) ** (np.arange(0, d, 2, dtype=np.float32) / np.float32(d))
    extra, inter = np.float32(1) / pos, np.float32(1) / (np.float32(factor) * pos)
    ramp = np.clip((np.arange(d // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    e = np.float32(1) - ramp
    inv = (inter * (1 - e) + extra * e).astype(np.float32)

    def mscale(s, m=1.0):
        return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0

    if rs.get("mscale") and rs.get("mscale_all_dim"):
        att = mscale(factor, rs["mscale"]) / mscale(factor, rs["mscale_all_dim"])
    else:
        att = mscale(factor)
    return inv, att


def angles(inv, t):
    return (np.arange(t, dtype=np.float32)[:, None] * inv[None, :]).astype(np.float64)  # float32 as transformers


# ---- DeepSeek-V3 / Kimi K2 -------------------------------------------------------------------------------------


def deepseek_forward(cfg, w, ids):
    T, eps = len(ids), cfg["rms_norm_eps"]
    nh, nope, rope, vd = (cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"],
                          cfg["v_head_dim"])
    rs = cfg["rope_scaling"]
    inv, att = yarn_inv_freq(rope, cfg["rope_theta"], rs)
    ang = angles(inv, T)
    cos, sin = np.cos(ang) * att, np.sin(ang) * att
    m = 0.1 * rs["mscale_all_dim"] * math.log(rs["factor"]) + 1.0 if rs["factor"] > 1 else 1.0
    scale = (nope + rope) ** -0.5 * m * m
    causal = np.tril(np.ones((T, T), bool))

    def rot(x):  # interleaved pairs (x[2i], x[2i+1])
        a, b = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2], out[..., 1::2] = a * cos - b * sin, b * cos + a * sin
        return out

    h = w["model.embed_tokens.weight"][ids]
    routing = {}
    E, k = cfg["n_routed_experts"], cfg["num_experts_per_tok"]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        x = rms(h, w[p + "input_layernorm.weight"], eps)
        q = linear(w, p + "self_attn.q_b_proj") @ rms(x @ linear(w, p + "self_attn.q_a_proj").T,
                                                      w[p + "self_attn.q_a_layernorm.weight"], eps).T
        q = q.T.reshape(T, nh, nope + rope)
        kv = x @ linear(w, p + "self_attn.kv_a_proj_with_mqa").T
        latent, k_rope = kv[:, :cfg["kv_lora_rank"]], rot(kv[:, cfg["kv_lora_rank"]:])
        kvb = (rms(latent, w[p + "self_attn.kv_a_layernorm.weight"], eps) @ linear(w, p + "self_attn.kv_b_proj").T)
        kvb = kvb.reshape(T, nh, nope + vd)
        out = np.zeros((T, nh, vd))
        for hd in range(nh):
            qh = np.concatenate([q[:, hd, :nope], rot(q[:, hd, nope:])], -1)
            kh = np.concatenate([kvb[:, hd, :nope], k_rope], -1)
            s = np.where(causal, qh @ kh.T * scale, -np.inf)
            out[:, hd] = softmax(s) @ kvb[:, hd, nope:]
        h = h + out.reshape(T, -1) @ linear(w, p + "self_attn.o_proj").T
        x = rms(h, w[p + "post_attention_layernorm.weight"], eps)

        def mlp(pre, x):
            g, u = x @ linear(w, pre + "gate_proj").T, x @ linear(w, pre + "up_proj").T
            return (g * sigmoid(g) * u) @ linear(w, pre + "down_proj").T

        if i < cfg["first_k_dense_replace"]:
            h = h + mlp(p + "mlp.", x)
            continue
        logits = (x.astype(np.float32) @ w[p + "mlp.gate.weight"].astype(np.float32).T).astype(np.float64)
        s = sigmoid(logits)
        c = s + w[p + "mlp.gate.e_score_correction_bias"]
        ng, tg = cfg["n_group"], cfg["topk_group"]
        gs = np.sort(c.reshape(T, ng, E // ng), -1)[..., -2:].sum(-1)
        keep = np.zeros((T, ng), bool)
        np.put_along_axis(keep, np.argsort(-gs, -1, kind="stable")[:, :tg], True, -1)
        c = np.where(np.repeat(keep, E // ng, 1), c, -np.inf)
        chosen = np.sort(np.argsort(-c, -1, kind="stable")[:, :k], -1)
        wt = np.take_along_axis(s, chosen, -1)
        wt = wt / (wt.sum(-1, keepdims=True) + 1e-20) * cfg["routed_scaling_factor"]
        y = mlp(p + "mlp.shared_experts.", x)
        for t in range(T):
            for e, we in zip(chosen[t], wt[t]):
                y[t] += we * mlp(f"{p}mlp.experts.{e}.", x[t:t + 1])[0]
        h = h + y
        routing[str(i)] = {"experts": chosen.tolist(), "weights": wt.tolist()}
    return rms(h, w["model.norm.weight"], eps) @ w["lm_head.weight"].T, routing


# ---- gpt-oss ---------------------------------------------------------------------------------------------------


def gpt_oss_forward(cfg, w, ids):
    T, eps, hd = len(ids), cfg["rms_norm_eps"], cfg["head_dim"]
    nh, nkv, k, window = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["num_experts_per_tok"], \
        cfg["sliding_window"]
    inv, att = yarn_inv_freq(hd, cfg["rope_theta"], cfg["rope_scaling"])
    ang = angles(inv, T)
    cos, sin = np.cos(ang) * att, np.sin(ang) * att
    qi, ki = np.arange(T)[:, None], np.arange(T)[None, :]
    alpha, limit = 1.702, cfg["swiglu_limit"]

    def rot(x):  # rotate-half pairs (x[i], x[i + hd/2])
        a, b = x[..., :hd // 2], x[..., hd // 2:]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], -1)

    h = w["model.embed_tokens.weight"][ids]
    routing = {}
    for i, kind in enumerate(cfg["layer_types"]):
        p = f"model.layers.{i}."
        x = rms(h, w[p + "input_layernorm.weight"], eps)
        proj = {n: x @ w[f"{p}self_attn.{n}_proj.weight"].T + w[f"{p}self_attn.{n}_proj.bias"] for n in "qkv"}
        q, kk, v = (proj[n].reshape(T, -1, hd) for n in "qkv")
        visible = ki <= qi
        if kind == "sliding_attention":
            visible &= ki > qi - window  # itself and window - 1 earlier tokens
        out = np.zeros((T, nh, hd))
        for a in range(nh):
            kv = a // (nh // nkv)
            s = np.where(visible, rot(q[:, a]) @ rot(kk[:, kv]).T * hd**-0.5, -np.inf)
            sink = w[p + "self_attn.sinks"][a]
            mx = np.maximum(s.max(-1, keepdims=True), sink)
            e = np.exp(s - mx)
            out[:, a] = (e / (e.sum(-1, keepdims=True) + np.exp(sink - mx))) @ v[:, kv]
        h = h + out.reshape(T, -1) @ w[p + "self_attn.o_proj.weight"].T + w[p + "self_attn.o_proj.bias"]
        x = rms(h, w[p + "post_attention_layernorm.weight"], eps)
        logits = x @ w[p + "mlp.router.weight"].T + w[p + "mlp.router.bias"]
        top = np.argsort(-logits, -1, kind="stable")[:, :k]
        wt = softmax(np.take_along_axis(logits, top, -1))
        pre = p + "mlp.experts."
        gu_w = mxfp4(w[pre + "gate_up_proj_blocks"], w[pre + "gate_up_proj_scales"])  # [E, 2I, H]
        dn_w = mxfp4(w[pre + "down_proj_blocks"], w[pre + "down_proj_scales"])  # [E, H, I]
        y = np.zeros_like(h)
        for t in range(T):
            for e, we in zip(top[t], wt[t]):
                gu = gu_w[e] @ x[t] + w[pre + "gate_up_proj_bias"][e]
                gate, up = np.minimum(gu[0::2], limit), np.clip(gu[1::2], -limit, limit)
                y[t] += we * (dn_w[e] @ ((up + 1) * gate * sigmoid(alpha * gate)) + w[pre + "down_proj_bias"][e])
        h = h + y
        order = np.argsort(top, -1)
        routing[str(i)] = {"experts": np.take_along_axis(top, order, -1).tolist(),
                           "weights": np.take_along_axis(wt, order, -1).tolist()}
    return rms(h, w["model.norm.weight"], eps) @ w["lm_head.weight"].T, routing


# ---- main ------------------------------------------------------------------------------------------------------


def check_fixture(d):
    cfg, w = load_dir(d)
    golden = json.load(open(os.path.join(d, "golden.json")))
    gold = np.load(os.path.join(d, "golden_logits.npy")).astype(np.float64)
    ids = np.array(golden["sequence_ids"])
    fwd = gpt_oss_forward if cfg["model_type"] == "gpt_oss" else deepseek_forward
    logits, routing = fwd(cfg, w, ids)
    diff = float(np.abs(logits - gold).max())
    p = len(golden["prompt_ids"])
    greedy = [int(x) for x in logits[p - 1:p - 1 + len(golden["generated_ids"])].argmax(-1)]
    ok = diff < LOGITS_TOL and greedy == golden["generated_ids"]
    for layer, r in golden["routing"].items():
        ok &= r["experts"] == routing[layer]["experts"]
        ok &= bool(np.allclose(r["weights"], routing[layer]["weights"], rtol=0, atol=ROUTING_TOL))
    print(f"{d}: max |logits - golden| = {diff:.3e}, greedy {'same' if greedy == golden['generated_ids'] else greedy}"
          f", routing {'same' if ok else 'DIFFERS'} -> {'ok' if ok else 'FAIL'}")
    return ok


def main():
    dirs = sys.argv[1:]
    if not dirs:
        sys.exit(__doc__)
    results = [check_fixture(d) for d in dirs]
    print(f"{sum(results)} passed, {len(results) - sum(results)} failed")
    sys.exit(0 if all(results) else 1)


if __name__ == "__main__":
    main()
