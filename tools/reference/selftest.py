#!/usr/bin/env python3
"""Self-test of the float64 reference (CI: `python3 tools/reference/selftest.py`; exits 1 on failure).

Builds random tiny kimi_k3 and kimi_linear checkpoints (presets.md "tiny" sizes) with numpy in the
documented layout, writes them as safetensors (sharded + index, and single-file), and checks:
  - MXFP4 / BF16 decoding of hand-written bytes against hand-written values (contract section 3);
  - SiTU limits, router tie-breaking (lower id wins), AttnRes Mix identities, short conv windows
    against hand-computed sums;
  - KDA recurrence: one pass == two halves with carried state == the product form
    S_t = (I - beta k k^T) diag(exp g) S_{t-1} + beta k v^T;
  - MLA: the expanded form used by the reference == an absorbed latent form written here;
  - AttnRes: the anchor/restart steps == an explicit block-sum restatement;
  - whole model: causality, teacher forcing == fresh prefix runs, chunked forward with carried state
    == one pass, sharded == single-file, K3 A_log padding is never read, a transposed tensor is
    rejected by the layout shape check;
  - the CLI end to end (shape, dtype, equality with in-process, --check-margins output).
"""

import json
import os
import subprocess
import sys
import tempfile
import time

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # as reference.py: before the numpy import

import numpy as np  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.dont_write_bytecode = True  # keep tools/reference/ free of __pycache__
sys.path.insert(0, HERE)
import reference as ref  # noqa: E402
from ckpt import bf16_bits_to_f64, dequant_mxfp4, f64_to_bf16_bits, write_safetensors  # noqa: E402

FAILURES = []


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what)
    if not ok:
        FAILURES.append(what)


def rel_err(a, b):
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))


# ----------------------------------------------------------------------------------------------
# Hand-written decoding cases


def test_decoding():
    # Row 0: 64 inputs = two scale groups. Bytes: 0x21 -> (0.5, 1.0); 0x9F -> (-6, -0.5);
    # 0x80 -> (0, -0); 0x7A -> (-1.0, 6). Scales 128 (x2) then 126 (x0.5).
    row0 = np.zeros(32, np.uint8)
    row0[0], row0[1], row0[2], row0[3] = 0x21, 0x9F, 0x80, 0x7A
    row0[16], row0[31] = 0x43, 0xE5  # group 2: (1.5, 2.0); last byte (3.0, -4.0)
    # Row 1: every nibble 0xB = -1.5, scale 127 (x1) and 0 (2^-127).
    row1 = np.full(32, 0xBB, np.uint8)
    packed = np.stack([row0, row1])
    scale = np.array([[128, 126], [127, 0]], np.uint8)
    got = dequant_mxfp4(packed, scale)
    want = np.zeros((2, 64))
    want[0, 0:8] = [1.0, 2.0, -12.0, -1.0, 0.0, -0.0, -2.0, 12.0]
    want[0, 32:34] = [0.75, 1.0]
    want[0, 62:64] = [1.5, -2.0]
    want[1, :32] = -1.5
    want[1, 32:] = -1.5 * 2.0**-127
    check(got.shape == (2, 64) and np.array_equal(got, want), "mxfp4 hand-written bytes decode to hand-written values")
    check(np.signbit(got[0, 5]) and not np.signbit(got[0, 4]), "mxfp4 nibble 8 is -0")
    try:
        dequant_mxfp4(packed, np.array([[255, 127], [127, 127]], np.uint8))
        check(False, "mxfp4 scale 255 rejected")
    except ValueError:
        check(True, "mxfp4 scale 255 rejected")
    bits = np.array([0x3F80, 0xC040, 0x3F81, 0x0000, 0x8000, 0x4780], np.uint16)
    want = np.array([1.0, -3.0, 1.0078125, 0.0, -0.0, 65536.0])
    check(np.array_equal(bf16_bits_to_f64(bits), want), "bf16 hand-written bits widen exactly")
    check(np.array_equal(f64_to_bf16_bits(want), bits), "bf16 writer round-trips")


def test_elementwise():
    s = ref.situ(np.array([0.0, 200.0, -200.0, 1.0]), np.array([3.0, 1e6, 1.0, 0.0]), 4.0, 25.0)
    check(s[0] == 0.0 and abs(s[1] - 100.0) < 1e-9 and abs(s[2]) < 1e-80 and s[3] == 0.0, "SiTU limits (4*25 cap, zeros)")
    g, u = 0.7, -2.0
    want = 4 * np.tanh(g / 4) / (1 + np.exp(-g)) * 25 * np.tanh(u / 25)
    check(abs(ref.situ(np.array(g), np.array(u), 4.0, 25.0) - want) < 1e-15, "SiTU value at a point")

    class C:
        top_k, n_experts, renormalize, routed_scale = 3, 6, True, 2.0

    logits = np.zeros((1, 6))
    bias = np.array([0.0, 0.5, 0.0, 0.5, 0.0, 0.0])  # ids 1, 3 lead; then 0, 2, 4, 5 tie
    ids, w, margin = ref.route(C, logits, bias)
    check(ids.tolist() == [[1, 3, 0]], "router tie -> lower id wins")
    check(np.allclose(w, 2.0 / 3.0, rtol=0, atol=1e-15), "router weights from s (no bias), renormalised, scaled")
    check(margin[0] == 0.0, "router margin reports a tie as 0")

    rng = np.random.default_rng(5)
    v = rng.standard_normal((3, 8))
    check(np.allclose(ref.attn_res_mix([v, v], rng.standard_normal(8), 1e-5), v, atol=1e-15), "Mix of equal values is the value")
    v2 = rng.standard_normal((3, 8))
    check(np.allclose(ref.attn_res_mix([v, v2], np.zeros(8), 1e-5), (v + v2) / 2, atol=1e-15), "Mix with w=0 is the mean")


# ----------------------------------------------------------------------------------------------
# KDA and MLA formulations


def test_short_conv():
    w = np.array([[1.0, 2.0, 3.0, 4.0]])  # w[0, 3] multiplies x_t, w[0, 0] multiplies x_{t-3}
    y, win = ref.short_conv(np.array([[1.0], [2.0], [3.0]]), w, np.zeros((3, 1)))
    y2, _ = ref.short_conv(np.array([[5.0]]), w, win)
    pre = np.array([4.0, 3 + 8, 2 + 6 + 12, 1 + 4 + 9 + 20])  # hand-computed windows, zeros before start
    want = pre / (1 + np.exp(-pre))
    check(np.allclose(np.concatenate([y[:, 0], y2[:, 0]]), want, rtol=1e-15, atol=0), "short conv: hand-computed causal windows + SiLU")


def test_kda_recurrence():
    rng = np.random.default_rng(1)
    T, H, K, V = 12, 2, 8, 6
    q, k = rng.standard_normal((T, H, K)), rng.standard_normal((T, H, K))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((T, H, V))
    g = -5.0 * rng.random((T, H, K))
    beta = rng.random((T, H))
    s0 = rng.standard_normal((H, K, V))
    o, s = ref.kda_recurrence(q, k, v, g, beta, s0)
    o1, s1 = ref.kda_recurrence(q[:5], k[:5], v[:5], g[:5], beta[:5], s0)
    o2, s2 = ref.kda_recurrence(q[5:], k[5:], v[5:], g[5:], beta[5:], s1)
    check(rel_err(np.concatenate([o1, o2]), o) < 1e-14 and rel_err(s2, s) < 1e-14, "KDA one pass == two halves with carried state")
    sp = s0.copy()
    op = np.empty_like(o)
    for t in range(T):
        for h in range(H):
            kk = k[t, h][:, None]
            sp[h] = (np.eye(K) - beta[t, h] * kk @ kk.T) @ np.diag(np.exp(g[t, h])) @ sp[h] + beta[t, h] * kk @ v[t, h][None, :]
            op[t, h] = sp[h].T @ q[t, h]
    check(rel_err(op, o) < 1e-12 and rel_err(sp, s) < 1e-12, "KDA recurrence == product form (I - b k k^T) D S + b k v^T")


def mla_absorbed(cfg, p, x):
    """Absorbed MLA (cross-check only): cache lat + k_pe, score q_nope through W_UK^T, expand with W_UV."""
    T, H, dn, dr, dv, r = x.shape[0], cfg.mla_heads, cfg.nope, cfg.rope, cfg.v_dim, cfg.kv_lora
    cq = ref.rms_norm(x @ p["q_a_proj"].T, p["q_a_layernorm"], cfg.eps)
    q = (cq @ p["q_b_proj"].T).reshape(T, H, dn + dr)
    c = x @ p["kv_a_proj_with_mqa"].T
    lat = ref.rms_norm(c[:, :r], p["kv_a_layernorm"], cfg.eps)
    k_pe = c[:, r:]
    wkvb = p["kv_b_proj"].reshape(H, dn + dv, r)
    w_uk, w_uv = wkvb[:, :dn, :], wkvb[:, dn:, :]
    q_lat = np.einsum("thn,hnr->thr", q[:, :, :dn], w_uk)
    scores = (np.einsum("thr,sr->hts", q_lat, lat) + np.einsum("thd,sd->hts", q[:, :, dn:], k_pe)) / np.sqrt(dn + dr)
    scores = np.where(np.tril(np.ones((T, T), bool))[None], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    o_lat = np.einsum("hts,sr->thr", probs, lat)
    attn = np.einsum("thr,hvr->thv", o_lat, w_uv) / (1 + np.exp(-(x @ p["g_proj"].T).reshape(T, H, dv)))
    return attn.reshape(T, H * dv) @ p["o_proj"].T


def test_mla_forms(model):
    cfg = model.cfg
    layer = cfg.is_mla.index(True)
    names = ["kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj", "q_a_proj", "q_a_layernorm", "q_b_proj", "g_proj"]
    p = model.params(layer, "self_attn.", names)
    x = np.random.default_rng(2).standard_normal((9, cfg.hidden))
    expanded = ref.mla_layer(cfg, p, x, ref.mla_state(cfg))
    check(rel_err(expanded, mla_absorbed(cfg, p, x)) < 1e-12, "MLA expanded == absorbed latent form")
    st = ref.mla_state(cfg)
    parts = [ref.mla_layer(cfg, p, x[a:b], st) for a, b in ((0, 4), (4, 5), (5, 9))]
    check(rel_err(np.concatenate(parts), expanded) < 1e-13, "MLA chunked with cache == one pass")


# ----------------------------------------------------------------------------------------------
# Random tiny checkpoints


def bf16(rng, shape, scale):
    return ("BF16", f64_to_bf16_bits(rng.standard_normal(shape) * scale))


def f32(a):
    return ("F32", np.asarray(a, np.float32))


def norm_w(rng, n):
    return ("BF16", f64_to_bf16_bits(1.0 + 0.1 * rng.standard_normal(n)))


def k3_config():
    tc = {
        "model_type": "kimi_linear", "hidden_size": 64, "num_hidden_layers": 7, "intermediate_size": 128,
        "moe_intermediate_size": 32, "routed_expert_hidden_size": 32, "num_experts": 16, "num_experts_per_token": 4,
        "num_shared_experts": 2, "num_attention_heads": 2, "num_key_value_heads": 2, "q_lora_rank": 32,
        "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16, "vocab_size": 768,
        "attn_res_block_size": 2, "first_k_dense_replace": 1, "num_expert_group": 1, "topk_group": 1,
        "routed_scaling_factor": 1.0, "hidden_act": "situ", "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0, "moe_router_activation_func": "sigmoid", "topk_method": "noaux_tc",
        "moe_renormalize": True, "latent_moe_use_norm": True, "mla_use_nope": True, "mla_use_output_gate": True,
        "rms_norm_eps": 1e-5, "num_nextn_predict_layers": 0,
        "linear_attn_config": {"head_dim": 32, "num_heads": 2, "short_conv_kernel_size": 4, "use_full_rank_gate": True,
                               "gate_lower_bound": -5.0, "kda_layers": [1, 2, 3, 5, 6], "full_attn_layers": [4, 7]},
    }
    return {"model_type": "kimi_k3", "dtype": "bfloat16", "tie_word_embeddings": False, "bos_token_id": 512,
            "eos_token_id": 514, "pad_token_id": 767, "text_config": tc}


def linear_config():
    return {
        "model_type": "kimi_linear", "vocab_size": 768, "hidden_size": 64, "intermediate_size": 128,
        "moe_intermediate_size": 32, "num_hidden_layers": 5, "num_attention_heads": 2, "num_key_value_heads": 2,
        "num_experts": 16, "num_experts_per_token": 4, "num_shared_experts": 1, "routed_scaling_factor": 2.446,
        "kv_lora_rank": 32, "q_lora_rank": None, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16,
        "num_expert_group": 1, "topk_group": 1, "moe_renormalize": True, "hidden_act": "silu", "rms_norm_eps": 1e-6,
        "first_k_dense_replace": 1, "tie_word_embeddings": False,
        "linear_attn_config": {"head_dim": 32, "num_heads": 2, "short_conv_kernel_size": 4,
                               "kda_layers": [1, 2, 3], "full_attn_layers": [4, 5]},
    }


def make_tensors(cfg_json, seed):
    """Random weights in the documented layout; returns an ordered list of per-layer groups."""
    rng = np.random.default_rng(seed)
    k3 = cfg_json["model_type"] == "kimi_k3"
    c = cfg_json["text_config"] if k3 else cfg_json
    lac = c["linear_attn_config"]
    D, V, E = c["hidden_size"], c["vocab_size"], c["num_experts"]
    P = "language_model.model." if k3 else "model."
    full = {i - 1 for i in lac["full_attn_layers"]}
    H, hd = lac["num_heads"], lac["head_dim"]
    qkv = H * hd
    mh, dn, dr, dv, r = c["num_attention_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"], c["kv_lora_rank"]
    groups = []

    def lin(out, inp):
        return bf16(rng, (out, inp), 1.0 / np.sqrt(inp))

    g = {P + "embed_tokens.weight": bf16(rng, (V, D), 1.0), P + "norm.weight": norm_w(rng, D),
         ("language_model.lm_head.weight" if k3 else "lm_head.weight"): lin(V, D)}
    if k3:
        g[P + "output_attn_res_norm.weight"] = norm_w(rng, D)
        g[P + "output_attn_res_proj.weight"] = bf16(rng, (1, D), 0.3)
    groups.append(g)
    for L in range(c["num_hidden_layers"]):
        b = f"{P}layers.{L}."
        g = {b + "input_layernorm.weight": norm_w(rng, D), b + "post_attention_layernorm.weight": norm_w(rng, D)}
        if k3:
            for n in ("self_attention_res", "mlp_res"):
                g[b + n + "_norm.weight"] = norm_w(rng, D)
                g[b + n + "_proj.weight"] = bf16(rng, (1, D), 0.3)
        a = b + "self_attn."
        if L in full:
            if k3:
                g[a + "q_a_proj.weight"] = lin(c["q_lora_rank"], D)
                g[a + "q_a_layernorm.weight"] = norm_w(rng, c["q_lora_rank"])
                g[a + "q_b_proj.weight"] = lin(mh * (dn + dr), c["q_lora_rank"])
            else:
                g[a + "q_proj.weight"] = lin(mh * (dn + dr), D)
            g[a + "kv_a_proj_with_mqa.weight"] = lin(r + dr, D)
            g[a + "kv_a_layernorm.weight"] = norm_w(rng, r)
            g[a + "kv_b_proj.weight"] = lin(mh * (dn + dv), r)
            if k3:
                g[a + "g_proj.weight"] = lin(mh * dv, D)
            g[a + "o_proj.weight"] = lin(D, mh * dv)
        else:
            for n in "qkv":
                g[a + f"{n}_proj.weight"] = lin(qkv, D)
            for n in "qkv":
                g[a + f"{n}_conv1d.weight"] = f32(rng.standard_normal((qkv, 1, lac["short_conv_kernel_size"])) * 0.6)
            g[a + "f_a_proj.weight"] = lin(hd, D)
            g[a + "f_b_proj.weight"] = lin(qkv, hd)
            g[a + "b_proj.weight"] = lin(H, D)
            a_log = np.log(rng.uniform(1, 16, H))
            if k3:
                g[a + "A_log"] = f32(np.concatenate([a_log, np.zeros(hd - H)]))
                g[a + "g_proj.weight"] = lin(qkv, D)
            else:
                g[a + "A_log"] = f32(a_log.reshape(1, 1, H, 1))
                g[a + "g_a_proj.weight"] = lin(hd, D)
                g[a + "g_b_proj.weight"] = lin(qkv, hd)
            g[a + "dt_bias"] = f32(rng.standard_normal(qkv) * 0.5)
            g[a + "o_norm.weight"] = f32(1.0 + 0.1 * rng.standard_normal(hd))
            g[a + "o_proj.weight"] = lin(D, qkv)
        if L < c["first_k_dense_replace"]:
            I = c["intermediate_size"]
            g[b + "mlp.gate_proj.weight"], g[b + "mlp.up_proj.weight"] = lin(I, D), lin(I, D)
            g[b + "mlp.down_proj.weight"] = lin(D, I)
        else:
            m = b + "block_sparse_moe."
            I, S = c["moe_intermediate_size"], c["moe_intermediate_size"] * c["num_shared_experts"]
            g[m + "gate.weight"] = lin(E, D)
            g[m + "gate.e_score_correction_bias"] = f32(rng.standard_normal(E) * 0.05)
            if k3:
                lat = c["routed_expert_hidden_size"]
                g[m + "routed_expert_down_proj.weight"] = lin(lat, D)
                g[m + "routed_expert_norm.weight"] = norm_w(rng, lat)
                g[m + "routed_expert_up_proj.weight"] = lin(D, lat)
            g[m + "shared_experts.gate_proj.weight"], g[m + "shared_experts.up_proj.weight"] = lin(S, D), lin(S, D)
            g[m + "shared_experts.down_proj.weight"] = lin(D, S)
            groups.append(g)
            g = {}
            for e in range(E):
                x = f"{m}experts.{e}."
                if k3:
                    for n, (rows, cols) in (("w1", (I, lat)), ("w2", (lat, I)), ("w3", (I, lat))):
                        g[x + n + ".weight_packed"] = ("U8", rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8))
                        g[x + n + ".weight_scale"] = ("U8", rng.integers(122, 125, (rows, cols // 32), dtype=np.uint8))
                else:
                    g[x + "w1.weight"], g[x + "w2.weight"], g[x + "w3.weight"] = lin(I, D), lin(D, I), lin(I, D)
        groups.append(g)
    return groups


def write_checkpoint(directory, cfg_json, groups, shards):
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(cfg_json, f)
    if shards == 1:
        merged = {k: v for g in groups for k, v in g.items()}
        write_safetensors(os.path.join(directory, "model.safetensors"), merged)
        return
    per = -(-len(groups) // shards)
    weight_map = {}
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: v for g in groups[s * per : (s + 1) * per] for k, v in g.items()}
        write_safetensors(os.path.join(directory, fname), part)
        weight_map.update({k: fname for k in part})
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


# ----------------------------------------------------------------------------------------------
# Whole-model invariants


def test_model(name, directory, single_dir):
    model = ref.Model(directory)
    V = model.cfg.vocab
    rng = np.random.default_rng(9)
    ids = rng.integers(0, V, 20)
    logits = model.forward(ids)
    check(logits.shape == (20, V) and np.all(np.isfinite(logits)), f"{name}: logits finite, shape [T, vocab]")
    check(float(np.std(logits[:, :])) > 1e-3 and rel_err(logits[3], logits[4]) > 1e-3, f"{name}: logits are not degenerate")
    ids2 = ids.copy()
    ids2[12:] = rng.integers(0, V, 8)
    l2 = model.forward(ids2)
    check(rel_err(l2[:12], logits[:12]) < 1e-13 and rel_err(l2[12:], logits[12:]) > 1e-6, f"{name}: causal (later ids change only later rows)")
    fresh = np.stack([model.forward(ids[: t + 1])[-1] for t in (0, 6, 13)])
    check(rel_err(fresh, logits[[0, 6, 13]]) < 1e-12, f"{name}: teacher forcing rows == fresh prefix runs")
    st = model.new_state()
    chunks = [model.forward(ids[a:b], st) for a, b in ((0, 7), (7, 8), (8, 20))]
    check(rel_err(np.concatenate(chunks), logits) < 1e-12, f"{name}: chunked forward with carried state == one pass")
    single = ref.Model(single_dir).forward(ids)
    check(np.array_equal(single, logits), f"{name}: single-file checkpoint == sharded + index")
    return model, ids, logits


def k3_blocks_form(model, h, layers):
    """Block AttnRes restated as explicit block sums (cross-check of the contract's anchor/restart steps).

    blocks = [embedding, sum of block 0's sublayer outputs, ...]; `partial` = outputs of the current
    block so far (None at a block start). Every sublayer input mixes completed blocks + partial.
    """
    cfg, eps, P = model.cfg, model.cfg.eps, model.cfg.prefix
    blocks, partial = [h], None
    for L in range(cfg.n_layers):
        b = f"{P}layers.{L}."
        srcs = blocks + ([partial] if partial is not None else [])
        a = ref.attn_res_mix(srcs, model._res_w(b + "self_attention_res_norm.weight", b + "self_attention_res_proj.weight"), eps)
        o = model.attention(L, ref.rms_norm(a, model.w(b + "input_layernorm.weight"), eps), layers[L])
        partial = o if partial is None else partial + o
        m = ref.attn_res_mix(blocks + [partial], model._res_w(b + "mlp_res_norm.weight", b + "mlp_res_proj.weight"), eps)
        partial = partial + model.mlp(L, ref.rms_norm(m, model.w(b + "post_attention_layernorm.weight"), eps), {})
        if L % cfg.block == cfg.block - 1:
            blocks.append(partial)
            partial = None
    srcs = blocks + ([partial] if partial is not None else [])
    w_out = model._res_w(P + "output_attn_res_norm.weight", P + "output_attn_res_proj.weight")
    return ref.rms_norm(ref.attn_res_mix(srcs, w_out, eps), model.w(P + "norm.weight"), eps)


def test_attn_res_blocks(model, ids):
    h = model.w(model.cfg.prefix + "embed_tokens.weight")[ids]
    want = model._k3_layers(h, model.new_state()["layers"], {})
    got = k3_blocks_form(model, h, model.new_state()["layers"])
    check(rel_err(got, want) < 1e-12, "kimi_k3: AttnRes anchors/restarts == explicit block-sum form")


def test_alog_padding(model, ids, logits):
    cfg = model.cfg
    layer = cfg.is_mla.index(False)
    name = f"{cfg.prefix}layers.{layer}.self_attn.A_log"
    padded = model.w(name).copy()
    padded[cfg.kda_heads :] = 3.0
    model.cache[name] = padded
    same = np.array_equal(model.forward(ids), logits)
    padded[: cfg.kda_heads] += 0.5
    changed = rel_err(model.forward(ids), logits) > 1e-6
    del model.cache[name]
    check(same and changed, "kimi_k3: A_log is read per head (padding unread, real entries matter)")


def test_cli(directory, ids, logits, tmp):
    out = os.path.join(tmp, "logits.npy")
    cmd = [sys.executable, os.path.join(HERE, "reference.py"), "--model", directory, "--ids", ",".join(map(str, ids)),
           "--out", out, "--check-margins"]
    p = subprocess.run(cmd, capture_output=True, text=True)
    ok = p.returncode == 0
    if ok:
        got = np.load(out)
        ok = got.dtype == np.float64 and np.array_equal(got, logits)
    check(ok, "CLI writes float64 [T, vocab] logits equal to in-process")
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("layer ")]
    check(len(lines) == 6 and all("margin" in ln for ln in lines), "CLI --check-margins prints one line per MoE layer to stderr")


def test_shape_check(tmp, cfg_json, groups):
    name = "language_model.model.layers.0.self_attn.f_a_proj.weight"
    bad = [dict(g) for g in groups]
    for g in bad:
        if name in g:
            dt, arr = g[name]
            g[name] = (dt, np.ascontiguousarray(arr.T))
    directory = os.path.join(tmp, "k3-transposed")
    write_checkpoint(directory, cfg_json, bad, shards=1)
    try:
        ref.Model(directory).forward([1, 2])
        check(False, "a transposed tensor is rejected by the layout shape check")
    except ValueError as e:
        check("f_a_proj" in str(e), "a transposed tensor is rejected by the layout shape check")


def main():
    t0 = time.time()
    test_decoding()
    test_elementwise()
    test_kda_recurrence()
    test_short_conv()
    with tempfile.TemporaryDirectory() as tmp:
        for name, cfg_json, seed in (("kimi_k3", k3_config(), 11), ("kimi_linear", linear_config(), 12)):
            groups = make_tensors(cfg_json, seed)
            sharded, single = os.path.join(tmp, name), os.path.join(tmp, name + "-single")
            write_checkpoint(sharded, cfg_json, groups, shards=3)
            write_checkpoint(single, cfg_json, groups, shards=1)
            model, ids, logits = test_model(name, sharded, single)
            if name == "kimi_k3":
                test_mla_forms(model)
                test_attn_res_blocks(model, ids)
                test_alog_padding(model, ids, logits)
                test_cli(sharded, ids, logits, tmp)
                test_shape_check(tmp, cfg_json, groups)
    print(f"{len(FAILURES)} failure(s) in {time.time() - t0:.2f} s")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
