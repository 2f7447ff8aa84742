#!/usr/bin/env python3
"""Independent float64 reference forward pass for `kimi_k3` and `kimi_linear` checkpoints.

    python3 tools/reference/reference.py --model DIR --ids 1,2,3 --out logits.npy [--check-margins]

Writes float64 logits of shape [len(ids), vocab_size]: row t is the next-token distribution after
ids[0..=t] (teacher forcing, causal). `--check-margins` prints to stderr, per MoE layer, the smallest
gap between the k-th and (k+1)-th selection score (sigmoid + correction bias) over all positions.

Spec: docs/k3-model-contract.md ("contract", section and step numbers cited below) and
docs/checkpoint-layout.md ("layout") for kimi_linear, which follows transformers 5.17 KimiLinear.
Only numpy; every activation, state and cache is float64. Formulations are deliberately the plain
ones (expanded MLA keys/values, step-by-step KDA recurrence), not the engine's.

Ambiguities resolved (each also flagged at its use with "AMBIGUITY"):
  A1 K3 KDA q/k normalisation: q / max(||q||, 1e-12) / sqrt(head_dim), k / max(||k||, 1e-12)
     (contract 4 KDA step 3), not the public kernel's sqrt(||x||^2 + 1e-6).
  A2 K3 A_log is per head: entries [0, heads) are used, the padding is never read (contract KDA 5).
  A3 K3 MLA latent norms (q_a_layernorm, kv_a_layernorm) use rms_norm_eps; kimi_linear's
     kv_a_layernorm uses 1e-6 (layout).
  A4 AttnRes Mix: key = v * rsqrt(mean(v^2) + rms_norm_eps), no weight; score vector
     w = *_res_norm.weight * *_res_proj.weight[0], multiplied in float64 (no fold rounding).
  A5 Router ties: lower expert id wins (stable sort on -choice).
  A6 Expert accumulation order: ascending expert id (float64 makes order immaterial in practice).
  A7 MXFP4 scale byte 255 is rejected (ckpt.dequant_mxfp4).
  A8 SiTU betas come from text_config `activation_situ_beta` / `activation_situ_linear_beta`
     (defaults 4.0 / 25.0 when absent).
  A9 Grouped routing (num_expert_group > 1) is refused: K3 and Kimi Linear use 1 / 1 (a no-op), and
     public code disagrees on the mask fill value.
  A10 kimi_linear softplus is the exact log(1 + e^x) (torch's threshold=20 shortcut differs < 3e-9).
  A11 KDA o_norm eps is rms_norm_eps for both families; its gate is sigmoid for both.
  A12 KDA decay gate form is chosen by linear_attn_config.gate_lower_bound: set (K3 default -5.0)
      -> lb * sigmoid(exp(A_log[h]) * raw); absent/null (released kimi_linear) -> softplus form.
"""

import argparse
import json
import os
import sys

# Single-threaded BLAS: these matrices are tiny, threads only add contention, and one thread keeps
# every reduction order fixed from run to run. Must precede the numpy import.
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402

sys.dont_write_bytecode = True  # keep tools/reference/ free of __pycache__
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ckpt import Checkpoint, dequant_mxfp4  # noqa: E402

_REQUIRED = object()


def _get(d, names, default=_REQUIRED):
    """First present, non-null value among config key `names` (a name or a tuple of aliases)."""
    for name in (names,) if isinstance(names, str) else names:
        if d.get(name) is not None:
            return d[name]
    if default is _REQUIRED:
        raise KeyError(f"config.json lacks {names!r}")
    return default


# ----------------------------------------------------------------------------------------------
# Config


class Config:
    """Model hyper-parameters from config.json (contract section 1; layout for kimi_linear)."""

    def __init__(self, directory):
        with open(os.path.join(directory, "config.json")) as f:
            root = json.load(f)
        self.family = root.get("model_type")
        if self.family not in ("kimi_k3", "kimi_linear"):
            raise ValueError(f"unsupported model_type {self.family!r}")
        tc = root.get("text_config", root) if self.family == "kimi_k3" else root
        quant = root.get("quantization_config") or {}
        if quant and quant.get("format") != "mxfp4-pack-quantized":
            raise ValueError(f"unsupported quantization_config format {quant.get('format')!r}")
        lac = tc.get("linear_attn_config", root.get("linear_attn_config"))
        if lac is None:
            raise KeyError("config.json lacks linear_attn_config")
        self.hidden = _get(tc, "hidden_size")
        self.n_layers = _get(tc, "num_hidden_layers")
        self.vocab = _get(tc, "vocab_size")
        self.eps = float(_get(tc, "rms_norm_eps"))
        self.dense_inter = _get(tc, "intermediate_size")
        self.moe_inter = _get(tc, "moe_intermediate_size")
        self.n_experts = _get(tc, ("num_experts", "n_routed_experts"))
        self.top_k = _get(tc, ("num_experts_per_token", "num_experts_per_tok"))
        self.n_shared = _get(tc, ("num_shared_experts", "n_shared_experts"), 0)
        self.act = _get(tc, "hidden_act", "situ" if self.family == "kimi_k3" else "silu")
        if self.act not in ("situ", "silu"):
            raise ValueError(f"unsupported hidden_act {self.act!r}")
        self.first_dense = _get(tc, "first_k_dense_replace", 0)
        self.routed_scale = float(_get(tc, "routed_scaling_factor", 1.0))
        self.renormalize = bool(_get(tc, ("moe_renormalize", "norm_topk_prob"), True))
        self.n_group = _get(tc, ("num_expert_group", "n_group"), 1)
        self.topk_group = _get(tc, "topk_group", 1)
        if self.n_group != 1:  # AMBIGUITY A9
            raise NotImplementedError("num_expert_group > 1 is not supported by the reference")
        # MLA
        self.mla_heads = _get(tc, "num_attention_heads")
        self.q_lora = _get(tc, "q_lora_rank", None)
        self.kv_lora = _get(tc, "kv_lora_rank")
        self.nope = _get(tc, "qk_nope_head_dim")
        self.rope = _get(tc, "qk_rope_head_dim")
        self.v_dim = _get(tc, "v_head_dim")
        self.mla_gate = bool(_get(tc, "mla_use_output_gate", self.family == "kimi_k3"))
        # AMBIGUITY A3: latent-norm eps (q_a_layernorm, kv_a_layernorm).
        self.latent_eps = self.eps if self.family == "kimi_k3" else 1e-6
        # KDA
        self.kda_heads = _get(lac, "num_heads")
        self.kda_dim = _get(lac, "head_dim")
        self.conv_k = _get(lac, "short_conv_kernel_size")
        # Decay gate form: lower-bound sigmoid gate when a bound is configured (K3: always, default -5),
        # else Kimi Linear's softplus gate. AMBIGUITY A12: kimi_linear follows transformers, which takes
        # the lower-bound form whenever the config sets one; released Kimi Linear configs set none.
        bound = lac.get("gate_lower_bound")
        if self.family == "kimi_k3" and bound is None:
            bound = -5.0
        self.gate_lower_bound = None if bound is None else float(bound)
        full = [i - 1 for i in _get(lac, "full_attn_layers")]
        kda = [i - 1 for i in _get(lac, "kda_layers")]
        if sorted(full + kda) != list(range(self.n_layers)):
            raise ValueError("full_attn_layers and kda_layers (1-based) must partition the layers")
        self.is_mla = [i in set(full) for i in range(self.n_layers)]
        self.situ_beta = float(_get(tc, "activation_situ_beta", 4.0))  # AMBIGUITY A8
        self.situ_linear_beta = float(_get(tc, "activation_situ_linear_beta", 25.0))
        self.tie = bool(root.get("tie_word_embeddings", tc.get("tie_word_embeddings", False)))
        if self.family == "kimi_k3":
            self.latent = _get(tc, "routed_expert_hidden_size")
            self.block = _get(tc, "attn_res_block_size")
            self.latent_norm = bool(_get(tc, "latent_moe_use_norm", True))
            self.prefix = "language_model.model."
            self.lm_head = "language_model.lm_head.weight"
        else:
            self.prefix = "model."
            self.lm_head = "lm_head.weight"

    def is_moe(self, layer):
        return layer >= self.first_dense


# ----------------------------------------------------------------------------------------------
# Elementwise pieces


def sigmoid(x):
    """1 / (1 + e^-x), evaluated without overflow and with full relative precision for x < 0."""
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def silu(x):
    return x * sigmoid(x)


def softplus(x):
    return np.logaddexp(0.0, x)  # AMBIGUITY A10: exact, no threshold shortcut


def rms_norm(x, w, eps):
    """Contract notation: RMS(x, w) = w * (x * rsqrt(mean(x^2) + eps)), over the last axis."""
    return w * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


def situ(gate, up, beta, linear_beta):
    """Contract 4 SiTU: beta*tanh(gate/beta)*sigmoid(gate) * linear_beta*tanh(up/linear_beta)."""
    return beta * np.tanh(gate / beta) * sigmoid(gate) * (linear_beta * np.tanh(up / linear_beta))


def softmax(x, axis=-1):
    m = np.max(x, axis=axis, keepdims=True)
    e = np.exp(x - m)
    return e / np.sum(e, axis=axis, keepdims=True)


def attn_res_mix(values, w, eps):
    """Contract 4 AttnRes Mix(values, w), per row.

    values: list of [T, D]; k_i = v_i * rsqrt(mean(v_i^2) + eps) (no weight, AMBIGUITY A4);
    s_i = k_i . w; alpha = softmax over i; returns sum_i alpha_i v_i.
    """
    v = np.stack(values)  # [n, T, D]
    keys = v / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + eps)
    alpha = softmax(keys @ w, axis=0)  # [n, T]
    return np.einsum("nt,ntd->td", alpha, v)


# ----------------------------------------------------------------------------------------------
# KDA (contract 4 "KDA"; layout kimi_linear KDA)


def short_conv(x, w, window):
    """KDA step 2: causal depthwise conv + SiLU.

    x [T, C]; w [C, K] (w[:, K-1] multiplies x_t); window [K-1, C]: the previous K-1 inputs (zeros at
    the start). Returns (SiLU(conv) [T, C], new window).
    """
    k = w.shape[1]
    full = np.concatenate([window, x], axis=0)  # [K-1+T, C]
    t = x.shape[0]
    out = np.zeros_like(x)
    for j in range(k):
        out += full[j : j + t] * w[:, j]
    return silu(out), full[t:].copy()


def kda_recurrence(q, k, v, g, beta, state):
    """KDA step 6, one position at a time, per head, in the contract's order.

    q, k [T, H, K]; v [T, H, V]; g [T, H, K] log-decay; beta [T, H]; state S [H, K, V].
      S <- S * exp(g)[:, None];  delta = v - S^T k;  S <- S + (beta k) (x) delta;  o = S^T q.
    Returns (o [T, H, V], S).
    """
    s = state.copy()
    out = np.empty(v.shape)
    for t in range(q.shape[0]):
        s *= np.exp(g[t])[:, :, None]
        delta = v[t] - np.einsum("hkv,hk->hv", s, k[t])
        s += (beta[t][:, None] * k[t])[:, :, None] * delta[:, None, :]
        out[t] = np.einsum("hkv,hk->hv", s, q[t])
    return out, s


def kda_state(cfg):
    c = cfg.kda_heads * cfg.kda_dim
    win = np.zeros((cfg.conv_k - 1, c))
    return {"conv": [win, win.copy(), win.copy()], "S": np.zeros((cfg.kda_heads, cfg.kda_dim, cfg.kda_dim))}


def kda_layer(cfg, p, x, st):
    """KDA attention for rows x [T, hidden] continuing from state st (modified in place)."""
    T = x.shape[0]
    H, D = cfg.kda_heads, cfg.kda_dim
    # Steps 1-2: projections and causal short conv with SiLU.
    qkv = []
    for i, n in enumerate("qkv"):
        y, st["conv"][i] = short_conv(x @ p[f"{n}_proj"].T, p[f"{n}_conv1d"].reshape(H * D, -1), st["conv"][i])
        qkv.append(y.reshape(T, H, D))
    q, k, v = qkv
    # Step 3: per-head L2 normalisation of q and k; q also scaled by 1/sqrt(head_dim).
    qn = np.sqrt(np.sum(q * q, axis=-1, keepdims=True))
    kn = np.sqrt(np.sum(k * k, axis=-1, keepdims=True))
    if cfg.family == "kimi_k3":  # AMBIGUITY A1
        q = q / np.maximum(qn, 1e-12) / np.sqrt(D)
        k = k / np.maximum(kn, 1e-12)
    else:  # fla l2norm: x * rsqrt(sum x^2 + 1e-6)
        q = q / np.sqrt(qn * qn + 1e-6) / np.sqrt(D)
        k = k / np.sqrt(kn * kn + 1e-6)
    # Step 4: beta, one scalar per head.
    beta = sigmoid(x @ p["b_proj"].T)  # [T, H]
    # Step 5: decay gate, raw = W_fb (W_fa x) + dt_bias, per head and key channel.
    raw = ((x @ p["f_a_proj"].T) @ p["f_b_proj"].T + p["dt_bias"]).reshape(T, H, D)
    a_log = p["A_log"].reshape(-1)  # K3: [head_dim], first H real; kimi_linear: [1, 1, H, 1]
    if cfg.family == "kimi_linear" and a_log.shape[0] != H:
        raise ValueError("kimi_linear A_log must hold one value per head")
    a = np.exp(a_log[:H])[None, :, None]  # AMBIGUITY A2: per head; K3 padding is never read
    if cfg.gate_lower_bound is not None:  # K3: g = lb * sigmoid(exp(A_log[h]) * raw)
        g = cfg.gate_lower_bound * sigmoid(a * raw)
    else:  # Kimi Linear: g = -exp(A_log[h]) * softplus(raw)
        g = -a * softplus(raw)
    # Step 6: the delta-rule recurrence.
    o, st["S"] = kda_recurrence(q, k, v, g, beta, st["S"])
    # Step 7: per-head RMS with o_norm (AMBIGUITY A11), sigmoid output gate, o_proj.
    o = rms_norm(o, p["o_norm"], cfg.eps)
    if cfg.family == "kimi_k3":
        gate = x @ p["g_proj"].T
    else:
        gate = (x @ p["g_a_proj"].T) @ p["g_b_proj"].T
    o = o * sigmoid(gate).reshape(T, H, D)
    return o.reshape(T, H * D) @ p["o_proj"].T


# ----------------------------------------------------------------------------------------------
# MLA, NoPE, expanded (contract 4 "Gated MLA, NoPE"; layout kimi_linear MLA)


def mla_state(cfg):
    h = cfg.mla_heads
    return {"K": np.zeros((0, h, cfg.nope + cfg.rope)), "V": np.zeros((0, h, cfg.v_dim))}


def mla_layer(cfg, p, x, st):
    """MLA for rows x [T, hidden] after the cached positions in st (expanded K/V, appended in place).

    The plain form: every cached position's full key [k_nope | k_pe] and value per head are kept,
    independent of the engine's absorbed latent cache. No rotation is ever applied to the rope part.
    """
    T = x.shape[0]
    H, dn, dr, dv = cfg.mla_heads, cfg.nope, cfg.rope, cfg.v_dim
    # Step 1: queries.
    if cfg.q_lora:  # K3: low-rank q with its RMS norm
        cq = rms_norm(x @ p["q_a_proj"].T, p["q_a_layernorm"], cfg.latent_eps)
        qall = (cq @ p["q_b_proj"].T).reshape(T, H, dn + dr)
    else:  # kimi_linear: q_proj
        qall = (x @ p["q_proj"].T).reshape(T, H, dn + dr)
    # Step 2: compressed kv: normed latent + shared k_pe.
    c = x @ p["kv_a_proj_with_mqa"].T
    lat = rms_norm(c[:, : cfg.kv_lora], p["kv_a_layernorm"], cfg.latent_eps)
    k_pe = c[:, cfg.kv_lora :]
    # Step 3: expand to per-head k_nope and v; key = [k_nope | k_pe].
    kv = (lat @ p["kv_b_proj"].T).reshape(T, H, dn + dv)
    key = np.concatenate([kv[:, :, :dn], np.broadcast_to(k_pe[:, None, :], (T, H, dr))], axis=-1)
    st["K"] = np.concatenate([st["K"], key], axis=0)
    st["V"] = np.concatenate([st["V"], kv[:, :, dn:]], axis=0)
    # Step 4: causal softmax attention, scale (nope+rope)^-0.5.
    past = st["K"].shape[0] - T
    scores = np.einsum("thd,shd->hts", qall, st["K"]) / np.sqrt(dn + dr)
    allowed = np.arange(st["K"].shape[0])[None, :] <= (past + np.arange(T))[:, None]
    scores = np.where(allowed[None], scores, -np.inf)
    attn = np.einsum("hts,shv->thv", softmax(scores, axis=-1), st["V"])
    # Step 5: sigmoid output gate (K3's mla_use_output_gate; kimi_linear has none), o_proj.
    if cfg.mla_gate:
        attn = attn * sigmoid(x @ p["g_proj"].T).reshape(T, H, dv)
    return attn.reshape(T, H * dv) @ p["o_proj"].T


# ----------------------------------------------------------------------------------------------
# MLPs, router, MoE


def route(cfg, logits, bias):
    """noaux_tc router (contract 4 "Router"), rows independent.

    s = sigmoid(logits); choice = s + bias (selection only); ids = top-k of choice, ties to the lower
    id (AMBIGUITY A5); w = s[ids] / (sum s[ids] + 1e-20) if renormalising; w *= routed_scaling_factor.
    Returns ids [T, k] (in descending choice order), w [T, k], margin [T] = choice_k - choice_{k+1}.
    """
    s = sigmoid(logits)
    choice = s + bias
    order = np.argsort(-choice, axis=-1, kind="stable")  # stable: equal scores keep ascending id
    ids = order[:, : cfg.top_k]
    rows = np.arange(s.shape[0])[:, None]
    w = s[rows, ids]
    if cfg.renormalize:
        w = w / (np.sum(w, axis=-1, keepdims=True) + 1e-20)
    w = w * cfg.routed_scale
    if cfg.top_k < cfg.n_experts:
        margin = choice[rows[:, 0], order[:, cfg.top_k - 1]] - choice[rows[:, 0], order[:, cfg.top_k]]
    else:
        margin = np.full(s.shape[0], np.inf)
    return ids, w, margin


def glu(cfg, gate, up):
    if cfg.act == "situ":
        return situ(gate, up, cfg.situ_beta, cfg.situ_linear_beta)
    return silu(gate) * up


def dense_mlp(cfg, p, x):
    """Contract 4: layer 0 `down(SiTU(gate x, up x))` (SiLU for kimi_linear); also shared experts."""
    return glu(cfg, x @ p["gate_proj"].T, x @ p["up_proj"].T) @ p["down_proj"].T


class Model:
    """Weights (read lazily, cached as float64) and the forward pass over a chunk of positions."""

    def __init__(self, directory):
        self.cfg = Config(directory)
        self.ckpt = Checkpoint(directory)
        self.cache = {}

    def w(self, name):
        if name not in self.cache:
            a = self.ckpt.f64(name)
            want = self._expected_shape(name)
            if want is not None and (a.shape if isinstance(want, tuple) else a.size) != want:
                raise ValueError(f"{name}: shape {a.shape}, layout says {want}")
            self.cache[name] = a
        return self.cache[name]

    def _expected_shape(self, name):
        """Layout shape of a tensor (a tuple; an int where only the element count is fixed), or None.

        Checked at load so that a transposed or mis-sized tensor fails loudly even where tiny sizes
        coincide (e.g. hidden 64 == KDA projection width 64 in the tiny preset).
        """
        c = self.cfg
        D, V, qkv, hd = c.hidden, c.vocab, c.kda_heads * c.kda_dim, c.kda_dim
        mq, mv = c.mla_heads * (c.nope + c.rope), c.mla_heads * c.v_dim
        rest = name[len(c.prefix) :] if name.startswith(c.prefix) else name
        top = {"embed_tokens.weight": (V, D), "norm.weight": (D,), c.lm_head: (V, D),
               "output_attn_res_norm.weight": (D,), "output_attn_res_proj.weight": (1, D)}
        if not rest.startswith("layers."):
            return top.get(rest)
        _, layer, rest = rest.split(".", 2)
        layer = int(layer)
        common = {"input_layernorm.weight": (D,), "post_attention_layernorm.weight": (D,),
                  "self_attention_res_norm.weight": (D,), "self_attention_res_proj.weight": (1, D),
                  "mlp_res_norm.weight": (D,), "mlp_res_proj.weight": (1, D),
                  "mlp.gate_proj.weight": (c.dense_inter, D), "mlp.up_proj.weight": (c.dense_inter, D),
                  "mlp.down_proj.weight": (D, c.dense_inter)}
        if c.is_mla[layer]:
            attn = {"q_a_proj.weight": (c.q_lora, D), "q_a_layernorm.weight": (c.q_lora,),
                    "q_b_proj.weight": (mq, c.q_lora), "q_proj.weight": (mq, D),
                    "kv_a_proj_with_mqa.weight": (c.kv_lora + c.rope, D), "kv_a_layernorm.weight": (c.kv_lora,),
                    "kv_b_proj.weight": (c.mla_heads * (c.nope + c.v_dim), c.kv_lora),
                    "g_proj.weight": (mv, D), "o_proj.weight": (D, mv)}
        else:
            attn = {f"{n}_proj.weight": (qkv, D) for n in "qkvg"}
            attn.update({f"{n}_conv1d.weight": (qkv, 1, c.conv_k) for n in "qkv"})
            attn.update({"f_a_proj.weight": (hd, D), "f_b_proj.weight": (qkv, hd), "b_proj.weight": (c.kda_heads, D),
                         "A_log": (hd,) if c.family == "kimi_k3" else c.kda_heads, "dt_bias": qkv,
                         "o_norm.weight": (hd,), "o_proj.weight": (D, qkv),
                         "g_a_proj.weight": (hd, D), "g_b_proj.weight": (qkv, hd)})
        common.update({"self_attn." + k: v for k, v in attn.items()})
        E, S = c.n_experts, c.moe_inter * c.n_shared
        lat = getattr(c, "latent", None)
        moe = {"gate.weight": (E, D), "gate.e_score_correction_bias": (E,),
               "routed_expert_down_proj.weight": (lat, D), "routed_expert_norm.weight": (lat,),
               "routed_expert_up_proj.weight": (D, lat), "shared_experts.gate_proj.weight": (S, D),
               "shared_experts.up_proj.weight": (S, D), "shared_experts.down_proj.weight": (D, S)}
        common.update({"block_sparse_moe." + k: v for k, v in moe.items()})
        return common.get(rest)

    def params(self, layer, sub, names):
        base = f"{self.cfg.prefix}layers.{layer}.{sub}"
        out = {}
        for n in names:
            full = f"{base}{n}.weight" if f"{base}{n}.weight" in self.ckpt else f"{base}{n}"
            out[n] = self.w(full)
        return out

    def expert(self, layer, e):
        """Routed expert e of a layer as float64 (w1 gate, w2 down, w3 up)."""
        key = ("expert", layer, e)
        if key not in self.cache:
            base = f"{self.cfg.prefix}layers.{layer}.block_sparse_moe.experts.{e}."
            if base + "w1.weight_packed" in self.ckpt:  # MXFP4 (contract section 3)
                ws = tuple(
                    dequant_mxfp4(self.ckpt.raw(base + f"{n}.weight_packed"), self.ckpt.raw(base + f"{n}.weight_scale"))
                    for n in ("w1", "w2", "w3")
                )
            else:  # BF16 experts (kimi_linear; also accepted for kimi_k3)
                ws = tuple(self.w(base + f"{n}.weight") for n in ("w1", "w2", "w3"))
            width = self.cfg.latent if self.cfg.family == "kimi_k3" else self.cfg.hidden
            im = self.cfg.moe_inter
            if [w.shape for w in ws] != [(im, width), (width, im), (im, width)]:
                raise ValueError(f"{base}: expert shapes {[w.shape for w in ws]}, layout says w1/w3 [{im}, {width}], w2 [{width}, {im}]")
            self.cache[key] = ws
        return self.cache[key]

    # -- state ---------------------------------------------------------------------------------

    def new_state(self):
        """Per-layer caches: KDA conv windows + S, MLA expanded K/V (both grow/advance per chunk)."""
        cfg = self.cfg
        return {"layers": [mla_state(cfg) if cfg.is_mla[i] else kda_state(cfg) for i in range(cfg.n_layers)]}

    # -- blocks --------------------------------------------------------------------------------

    def attention(self, layer, x, st):
        if self.cfg.is_mla[layer]:
            names = ["kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"]
            names += ["q_a_proj", "q_a_layernorm", "q_b_proj"] if self.cfg.q_lora else ["q_proj"]
            names += ["g_proj"] if self.cfg.mla_gate else []
            return mla_layer(self.cfg, self.params(layer, "self_attn.", names), x, st)
        names = ["q_proj", "k_proj", "v_proj", "q_conv1d", "k_conv1d", "v_conv1d", "f_a_proj", "f_b_proj"]
        names += ["b_proj", "A_log", "dt_bias", "o_norm", "o_proj"]
        names += ["g_proj"] if self.cfg.family == "kimi_k3" else ["g_a_proj", "g_b_proj"]
        return kda_layer(self.cfg, self.params(layer, "self_attn.", names), x, st)

    def mlp(self, layer, x, margins):
        cfg = self.cfg
        if not cfg.is_moe(layer):
            return dense_mlp(cfg, self.params(layer, "mlp.", ["gate_proj", "up_proj", "down_proj"]), x)
        p = self.params(layer, "block_sparse_moe.", ["gate", "gate.e_score_correction_bias"])
        ids, wts, margin = route(cfg, x @ p["gate"].T, p["gate.e_score_correction_bias"])
        margins.setdefault(layer, []).append(margin)
        if cfg.family == "kimi_k3":
            lp = self.params(layer, "block_sparse_moe.", ["routed_expert_down_proj", "routed_expert_norm", "routed_expert_up_proj"])
            z = x @ lp["routed_expert_down_proj"].T  # step 1: latent, once per token
        else:
            z = x
        acc = np.zeros_like(z)
        for e in np.unique(ids):  # AMBIGUITY A6: ascending expert id per row
            rows, slot = np.nonzero(ids == e)
            w1, w2, w3 = self.expert(layer, int(e))
            y = glu(cfg, z[rows] @ w1.T, z[rows] @ w3.T) @ w2.T  # step 2
            acc[rows] += wts[rows, slot][:, None] * y  # step 3
        if cfg.family == "kimi_k3":  # step 4: norm after the weighted sum, then up-projection
            if cfg.latent_norm:
                acc = rms_norm(acc, lp["routed_expert_norm"], cfg.eps)
            routed = acc @ lp["routed_expert_up_proj"].T
        else:
            routed = acc
        if cfg.n_shared:  # step 5: fused shared experts
            routed = routed + dense_mlp(cfg, self.params(layer, "block_sparse_moe.shared_experts.", ["gate_proj", "up_proj", "down_proj"]), x)
        return routed

    # -- forward -------------------------------------------------------------------------------

    def forward(self, ids, state=None, margins=None):
        """Logits [len(ids), vocab] for ids following the positions already in `state`."""
        cfg = self.cfg
        state = self.new_state() if state is None else state
        margins = {} if margins is None else margins
        ids = np.asarray(ids, dtype=np.int64)
        if ids.ndim != 1 or np.any(ids < 0) or np.any(ids >= cfg.vocab):
            raise ValueError(f"ids must be in [0, {cfg.vocab})")
        h = self.w(cfg.prefix + "embed_tokens.weight")[ids]  # Embedding
        layers = state["layers"]
        if cfg.family == "kimi_k3":
            h = self._k3_layers(h, layers, margins)
        else:
            for L in range(cfg.n_layers):  # plain residuals (layout kimi_linear)
                h = h + self.attention(L, rms_norm(h, self.params(L, "", ["input_layernorm"])["input_layernorm"], cfg.eps), layers[L])
                h = h + self.mlp(L, rms_norm(h, self.params(L, "", ["post_attention_layernorm"])["post_attention_layernorm"], cfg.eps), margins)
            h = rms_norm(h, self.w(cfg.prefix + "norm.weight"), cfg.eps)
        head = self.w(cfg.prefix + "embed_tokens.weight") if cfg.tie else self.w(cfg.lm_head)
        return h @ head.T

    def _res_w(self, norm, proj):
        """AttnRes score vector w = res_norm.weight * res_proj.weight[0] (AMBIGUITY A4)."""
        return self.w(norm) * self.w(proj).reshape(-1)

    def _k3_layers(self, h, layers, margins):
        """Contract 4 Block AttnRes, steps 1-6 per layer, then the tail; returns normed final rows."""
        cfg = self.cfg
        eps = cfg.eps
        anchors = []
        for L in range(cfg.n_layers):
            base = f"{cfg.prefix}layers.{L}."
            w_attn = self._res_w(base + "self_attention_res_norm.weight", base + "self_attention_res_proj.weight")
            w_mlp = self._res_w(base + "mlp_res_norm.weight", base + "mlp_res_proj.weight")
            a = attn_res_mix(anchors + [h], w_attn, eps) if anchors else h  # step 1
            if L % cfg.block == 0:  # step 2: anchor + restart
                anchors.append(h)
                prefix = None
            else:
                prefix = h
            o = self.attention(L, rms_norm(a, self.w(base + "input_layernorm.weight"), eps), layers[L])  # step 3
            q = o if prefix is None else prefix + o  # step 4
            m = attn_res_mix(anchors + [q], w_mlp, eps)  # step 5
            y = self.mlp(L, rms_norm(m, self.w(base + "post_attention_layernorm.weight"), eps), margins)
            h = q + y  # step 6
        w_out = self._res_w(cfg.prefix + "output_attn_res_norm.weight", cfg.prefix + "output_attn_res_proj.weight")
        return rms_norm(attn_res_mix(anchors + [h], w_out, eps), self.w(cfg.prefix + "norm.weight"), eps)  # Tail


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="checkpoint directory (config.json + safetensors)")
    ap.add_argument("--ids", required=True, help="comma-separated token ids")
    ap.add_argument("--out", required=True, help="output .npy, float64 [len(ids), vocab_size]")
    ap.add_argument("--check-margins", action="store_true", help="print per-MoE-layer min top-k selection gap to stderr")
    args = ap.parse_args(argv)
    ids = [int(s) for s in args.ids.replace(" ", "").split(",") if s != ""]
    if not ids:
        ap.error("--ids is empty")
    model = Model(args.model)
    margins = {}
    logits = model.forward(ids, margins=margins)
    np.save(args.out, np.ascontiguousarray(logits, dtype=np.float64))
    if args.check_margins:
        for layer in sorted(margins):
            m = np.concatenate(margins[layer])
            print(f"layer {layer}: min top-{model.cfg.top_k} margin {m.min():.6e} at position {int(np.argmin(m))}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
