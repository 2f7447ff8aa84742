"""A small Kimi K3 in PyTorch, written from docs/k3-model-contract.md section 4.

Same layer types in the same schedule as K3: KDA layers with MLA at the 1-based layers listed in
`full_attn_layers`, Block Attention Residuals, gated NoPE MLA with a low-rank query, KDA with the
lower-bound sigmoid decay gate and per-head A_log, a dense SiTU MLP in layer 0, and from layer 1 on
the latent MoE (sigmoid noaux router with a selection-only correction bias, MXFP4 routed experts,
RMS norm after the weighted sum, two fused shared experts).

Parameter names are the checkpoint's names without the `language_model.model.` prefix, except:
routed experts are stacked (`experts.w1 [E, I, latent]`, `w2 [E, latent, I]`, `w3 [E, I, latent]`),
`A_log` holds one value per head (the checkpoint pads it to head_dim with zeros) and the conv weights
are [C, 1, K] exactly as stored. The exporter (export.py) maps names and packs MXFP4.

Numerics: `forward` works in the dtype of the parameters (fp32 for training, float64 for the
agreement reference). KDA is computed in the chunkwise (WY) form, exact in real arithmetic and
checked against the step-by-step recurrence of the contract in selftest.py.
"""

import json
import math
from dataclasses import asdict, dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class K3Config:
    vocab_size: int = 4352
    hidden: int = 256
    layers: int = 8
    full_attn_layers: list = field(default_factory=lambda: [4, 8])  # 1-based, as in the config
    attn_res_block: int = 2
    kda_heads: int = 4
    kda_head_dim: int = 64
    conv_kernel: int = 4
    mla_heads: int = 4
    q_lora: int = 128
    kv_lora: int = 128
    qk_nope: int = 32
    qk_rope: int = 32
    v_head: int = 64
    dense_inter: int = 1024
    n_experts: int = 64
    top_k: int = 8
    moe_inter: int = 128
    latent: int = 128
    n_shared: int = 2
    eps: float = 1e-5
    gate_lower_bound: float = -5.0
    situ_beta: float = 4.0
    situ_linear_beta: float = 25.0

    def is_mla(self, layer):
        return (layer + 1) in self.full_attn_layers

    def to_json(self):
        return json.dumps(asdict(self))


# ----------------------------------------------------------------------------------------------
# Elementwise pieces


def rms(x, w, eps):
    """Contract notation RMS(x, w) = w * (x * rsqrt(mean(x^2) + eps)) over the last axis."""
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def situ(gate, up, beta=4.0, linear_beta=25.0):
    """SiTU: beta*tanh(gate/beta)*sigmoid(gate) * linear_beta*tanh(up/linear_beta)."""
    return beta * torch.tanh(gate / beta) * torch.sigmoid(gate) * (linear_beta * torch.tanh(up / linear_beta))


def attn_res_mix(values, w, eps):
    """Block AttnRes Mix: keys are the values RMS-normalised without weight, scored against w,
    softmax over the values, weighted sum."""
    v = torch.stack(values)  # [n, ..., D]
    k = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
    alpha = torch.softmax((k * w).sum(-1), dim=0)
    return (alpha.unsqueeze(-1) * v).sum(0)


# ----------------------------------------------------------------------------------------------
# MXFP4 (contract section 3): E2M1 elements, one power-of-two scale per 32 inputs of a row


E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
MXFP4_GROUP = 32
# Scale exponent rule: the smallest power of two with amax / 2^e <= 6, so no element is clipped.
# (OCP's floor(log2(amax)) - 2 rule clips the top of some groups to 6; both are valid MXFP4.)


def mxfp4_quantize(w):
    """w [..., cols] (cols % 32 == 0) -> (codes int8 in 0..15 [..., cols], exponent int [..., cols/32]).

    Element value = E2M1[code & 7] * (-1 if code & 8) * 2^exponent. Rounding is to the nearest grid
    point, ties to the lower magnitude."""
    shape = w.shape
    g = w.reshape(*shape[:-1], shape[-1] // MXFP4_GROUP, MXFP4_GROUP)
    amax = g.abs().amax(-1, keepdim=True)
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    e = torch.ceil(torch.log2(safe / 6.0))
    # log2 rounding can put amax/2^e a hair above 6; step up once where it does.
    e = torch.where(safe / torch.exp2(e) > 6.0, e + 1, e)
    # Scale bytes stay in 1..254: byte 0 would be the fp32 bit pattern 0 (zero, not 2^-127) in the
    # contract's "s << 23" decoding, and 255 is NaN. Zero groups take the smallest scale.
    e = torch.where(amax > 0, e, torch.full_like(e, -126.0)).clamp(-126, 127)
    x = (g / torch.exp2(e)).abs()
    grid = torch.tensor(E2M1_GRID, dtype=w.dtype, device=w.device)
    mids = (grid[1:] + grid[:-1]) / 2
    mag = torch.bucketize(x, mids, right=False)  # index of nearest grid point; ties go low
    code = mag + 8 * (g < 0).to(mag.dtype)
    code = torch.where(mag == 0, torch.zeros_like(code), code)  # never write -0
    return code.reshape(shape).to(torch.int8), e.squeeze(-1).to(torch.int32)


def mxfp4_dequantize(code, e, dtype):
    grid = torch.tensor(E2M1_GRID, dtype=dtype, device=code.device)
    c = code.long()
    v = grid[c & 7] * torch.where((c & 8) != 0, -1.0, 1.0).to(dtype)
    shape = v.shape
    v = v.reshape(*shape[:-1], shape[-1] // MXFP4_GROUP, MXFP4_GROUP)
    return (v * torch.exp2(e.to(dtype)).unsqueeze(-1)).reshape(shape)


def fake_mxfp4(w):
    """Quantise-dequantise in the forward pass, identity gradient (straight-through estimator)."""
    with torch.no_grad():
        code, e = mxfp4_quantize(w.detach().float())
        q = mxfp4_dequantize(code, e, torch.float32).to(w.dtype)
    return w + (q - w).detach()


# ----------------------------------------------------------------------------------------------
# KDA


def kda_recurrent(q, k, v, g, beta, state=None):
    """The contract's recurrence, one position at a time (reference for the chunk form).

    q, k [B,H,T,K]; v [B,H,T,V]; g [B,H,T,K] log-decay; beta [B,H,T]. Per step and head:
      S <- S * exp(g)[:, None];  delta = v - S^T k;  S <- S + (beta k) (x) delta;  o = S^T q."""
    B, H, T, K = k.shape
    S = torch.zeros(B, H, K, v.shape[-1], dtype=v.dtype, device=v.device) if state is None else state
    out = []
    for t in range(T):
        S = S * torch.exp(g[:, :, t]).unsqueeze(-1)
        delta = v[:, :, t] - torch.einsum("bhkv,bhk->bhv", S, k[:, :, t])
        S = S + (beta[:, :, t, None] * k[:, :, t]).unsqueeze(-1) * delta.unsqueeze(-2)
        out.append(torch.einsum("bhkv,bhk->bhv", S, q[:, :, t]))
    return torch.stack(out, dim=2), S


def kda_chunked(q, k, v, g, beta, chunk=32):
    """Chunkwise (WY) form of kda_recurrent from a zero state; exact in real arithmetic.

    Within a chunk with cumulative log-decay c_t = sum_{s<=t} g_s (per key channel), the pseudo-values
    u_t = beta_t * delta_t solve (I + A) u = beta (v - (k * e^c) S0) with A_tj = beta_t sum_d k_t k_j
    e^{c_t - c_j} (j < t); outputs o_t = (q_t * e^{c_t}) S0 + sum_{j<=t} (q_t . k_j e^{c_t - c_j}) u_j;
    the state carries as S = e^{c_C} S0 + sum_j (k_j e^{c_C - c_j}) u_j^T. Every exponent is <= 0."""
    B, H, T, K = k.shape
    V = v.shape[-1]
    pad = (-T) % chunk
    if pad:  # zero keys, values, betas and log-decays leave the state untouched
        q, k, v, g = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v, g))
        beta = F.pad(beta, (0, pad))
    N = (T + pad) // chunk
    q, k, g = (x.reshape(B, H, N, chunk, K) for x in (q, k, g))
    v = v.reshape(B, H, N, chunk, V)
    beta = beta.reshape(B, H, N, chunk)
    c = torch.cumsum(g, dim=-2)
    diff = c.unsqueeze(-2) - c.unsqueeze(-3)  # [.., t, j, K] = c_t - c_j
    idx = torch.arange(chunk, device=k.device)
    incl = (idx[None, :] <= idx[:, None])  # j <= t
    decay = torch.exp(diff.masked_fill(~incl[..., None], float("-inf")))
    kk = (k.unsqueeze(-2) * k.unsqueeze(-3) * decay).sum(-1)  # [.., t, j]
    qk = (q.unsqueeze(-2) * k.unsqueeze(-3) * decay).sum(-1)
    strict = ~torch.eye(chunk, dtype=torch.bool, device=k.device) & incl
    A = kk.masked_fill(~strict, 0.0) * beta.unsqueeze(-1)
    eye = torch.eye(chunk, dtype=k.dtype, device=k.device)
    IA = eye + A
    ec = torch.exp(c)
    U0 = torch.linalg.solve_triangular(IA, beta.unsqueeze(-1) * v, upper=False, unitriangular=True)
    W = torch.linalg.solve_triangular(IA, beta.unsqueeze(-1) * (k * ec), upper=False, unitriangular=True)
    Qd = q * ec
    Kend = k * torch.exp(c[..., -1:, :] - c)
    dlast = torch.exp(c[..., -1, :])  # [B,H,N,K]
    S = torch.zeros(B, H, K, V, dtype=v.dtype, device=v.device)
    outs = []
    for n in range(N):
        u = U0[:, :, n] - W[:, :, n] @ S
        outs.append(Qd[:, :, n] @ S + qk[:, :, n] @ u)
        S = dlast[:, :, n].unsqueeze(-1) * S + Kend[:, :, n].transpose(-1, -2) @ u
    o = torch.stack(outs, dim=2).reshape(B, H, N * chunk, V)
    return o[:, :, :T]


class KDA(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        D, H, K = cfg.hidden, cfg.kda_heads, cfg.kda_head_dim
        C = H * K
        self.cfg = cfg
        self.q_proj, self.k_proj, self.v_proj, self.g_proj = (nn.Linear(D, C, bias=False) for _ in range(4))
        self.q_conv1d, self.k_conv1d, self.v_conv1d = (nn.Parameter(torch.empty(C, 1, cfg.conv_kernel)) for _ in range(3))
        self.f_a_proj = nn.Linear(D, K, bias=False)
        self.f_b_proj = nn.Linear(K, C, bias=False)
        self.b_proj = nn.Linear(D, H, bias=False)
        self.A_log = nn.Parameter(torch.zeros(H))
        self.dt_bias = nn.Parameter(torch.zeros(C))
        self.o_norm = nn.Parameter(torch.ones(K))
        self.o_proj = nn.Linear(C, D, bias=False)

    def conv(self, x, w):
        """Causal depthwise conv over [x_{t-3}, .., x_t] (zeros before the start), then SiLU.
        Written as K shifted products: cheap, and deterministic on every device."""
        K = w.shape[-1]
        T = x.shape[1]
        xp = F.pad(x, (0, 0, K - 1, 0))
        w = w[:, 0, :].to(x.dtype)
        y = sum(xp[:, j : j + T] * w[:, j] for j in range(K))
        return F.silu(y)

    def forward(self, x, recurrent=False):
        cfg = self.cfg
        B, T, _ = x.shape
        H, K = cfg.kda_heads, cfg.kda_head_dim

        def heads(y):
            return y.reshape(B, T, H, K).transpose(1, 2)  # [B,H,T,K]

        dt = self.o_norm.dtype  # the recurrence runs in the parameters' precision, never bf16
        q = heads(self.conv(self.q_proj(x), self.q_conv1d).to(dt))
        k = heads(self.conv(self.k_proj(x), self.k_conv1d).to(dt))
        v = heads(self.conv(self.v_proj(x), self.v_conv1d).to(dt))
        q = q / q.norm(dim=-1, keepdim=True).clamp_min(1e-12) / math.sqrt(K)
        k = k / k.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        beta = torch.sigmoid(self.b_proj(x).to(dt)).transpose(1, 2)  # [B,H,T]
        raw = heads(self.f_b_proj(self.f_a_proj(x)).to(dt) + self.dt_bias)
        g = cfg.gate_lower_bound * torch.sigmoid(torch.exp(self.A_log)[None, :, None, None] * raw)
        with torch.autocast(x.device.type, enabled=False):
            if recurrent:
                o, _ = kda_recurrent(q, k, v, g, beta)
            else:
                o = kda_chunked(q, k, v, g, beta)
        o = rms(o, self.o_norm, cfg.eps).transpose(1, 2)  # [B,T,H,K]
        o = o * torch.sigmoid(self.g_proj(x)).reshape(B, T, H, K)
        return self.o_proj(o.reshape(B, T, H * K))


class MLA(nn.Module):
    """Gated NoPE MLA, expanded form (keys [k_nope | k_pe], k_pe shared by the heads, never rotated)."""

    def __init__(self, cfg):
        super().__init__()
        D, H = cfg.hidden, cfg.mla_heads
        self.cfg = cfg
        self.q_a_proj = nn.Linear(D, cfg.q_lora, bias=False)
        self.q_a_layernorm = nn.Parameter(torch.ones(cfg.q_lora))
        self.q_b_proj = nn.Linear(cfg.q_lora, H * (cfg.qk_nope + cfg.qk_rope), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(D, cfg.kv_lora + cfg.qk_rope, bias=False)
        self.kv_a_layernorm = nn.Parameter(torch.ones(cfg.kv_lora))
        self.kv_b_proj = nn.Linear(cfg.kv_lora, H * (cfg.qk_nope + cfg.v_head), bias=False)
        self.g_proj = nn.Linear(D, H * cfg.v_head, bias=False)
        self.o_proj = nn.Linear(H * cfg.v_head, D, bias=False)

    def forward(self, x):
        cfg = self.cfg
        B, T, _ = x.shape
        H, dn, dr, dv = cfg.mla_heads, cfg.qk_nope, cfg.qk_rope, cfg.v_head
        Q = self.q_b_proj(rms(self.q_a_proj(x), self.q_a_layernorm, cfg.eps)).reshape(B, T, H, dn + dr)
        c = self.kv_a_proj_with_mqa(x)
        lat = rms(c[..., : cfg.kv_lora], self.kv_a_layernorm, cfg.eps)
        k_pe = c[..., cfg.kv_lora :]
        kv = self.kv_b_proj(lat).reshape(B, T, H, dn + dv)
        key = torch.cat([kv[..., :dn], k_pe.unsqueeze(2).expand(B, T, H, dr)], dim=-1)
        val = kv[..., dn:]
        scores = torch.einsum("bthd,bshd->bhts", Q, key) / math.sqrt(dn + dr)
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        p = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
        attn = torch.einsum("bhts,bshv->bthv", p, val).reshape(B, T, H * dv)
        return self.o_proj(attn * torch.sigmoid(self.g_proj(x)))


class DenseMLP(nn.Module):
    """down(SiTU(gate x, up x)); also the fused shared experts."""

    def __init__(self, cfg, width):
        super().__init__()
        self.cfg = cfg
        self.gate_proj = nn.Linear(cfg.hidden, width, bias=False)
        self.up_proj = nn.Linear(cfg.hidden, width, bias=False)
        self.down_proj = nn.Linear(width, cfg.hidden, bias=False)

    def forward(self, x):
        return self.down_proj(situ(self.gate_proj(x), self.up_proj(x), self.cfg.situ_beta, self.cfg.situ_linear_beta))


class Experts(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        E, I, L = cfg.n_experts, cfg.moe_inter, cfg.latent
        self.w1 = nn.Parameter(torch.empty(E, I, L))  # gate
        self.w2 = nn.Parameter(torch.empty(E, L, I))  # down
        self.w3 = nn.Parameter(torch.empty(E, I, L))  # up


class Gate(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.n_experts, cfg.hidden))
        # Selection-only bias, moved by the aux-loss-free balance rule, never by gradients.
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_experts))


def route(cfg, gate_weight, bias, x, select=None):
    """noaux_tc: s = sigmoid(W x); ids = top-k of s + bias; weights s[ids] / (sum + 1e-20).

    Returns (dense weights [.., E] with zeros off the chosen ids, the 0/1 mask, ids [.., k]).
    Computed in fp32 or wider; ties (never seen) go to the lower id as torch.topk's sorted output.
    `select(choice, ids) -> ids`, if given, may replace the chosen ids (analysis only: tie_agreement.py
    uses it to break near-ties the way another implementation did); training never sets it."""
    dt = torch.promote_types(x.dtype, torch.float32)
    s = torch.sigmoid(x.to(dt) @ gate_weight.to(dt).t())
    choice = s + bias.to(dt)
    ids = torch.topk(choice, cfg.top_k, dim=-1, sorted=True).indices
    if select is not None:
        ids = select(choice, ids)
    mask = torch.zeros_like(s).scatter(-1, ids, 1.0)
    w = s * mask
    w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return w, mask, ids


class MoE(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.gate = Gate(cfg)
        self.routed_expert_down_proj = nn.Linear(cfg.hidden, cfg.latent, bias=False)
        self.routed_expert_norm = nn.Parameter(torch.ones(cfg.latent))
        self.routed_expert_up_proj = nn.Linear(cfg.latent, cfg.hidden, bias=False)
        self.experts = Experts(cfg)
        self.shared_experts = DenseMLP(cfg, cfg.n_shared * cfg.moe_inter)
        self.select = None  # optional routing override for analysis, see route(); not a parameter

    def expert_weights(self, quant):
        e = self.experts
        if quant:
            return fake_mxfp4(e.w1), fake_mxfp4(e.w2), fake_mxfp4(e.w3)
        return e.w1, e.w2, e.w3

    def forward(self, x, quant=True, stats=None):
        cfg = self.cfg
        w, mask, ids = route(cfg, self.gate.weight, self.gate.e_score_correction_bias, x, self.select)
        if stats is not None:
            stats["ids"] = ids
            stats["load"] = mask.reshape(-1, cfg.n_experts).sum(0)
        z = self.routed_expert_down_proj(x)
        w1, w2, w3 = self.expert_weights(quant)
        if not torch.is_grad_enabled():
            # Inference: only the chosen experts, accumulated in ascending expert id.
            zf = z.reshape(-1, z.shape[-1]).to(torch.promote_types(z.dtype, torch.float32))
            wf, idf = w.reshape(-1, cfg.n_experts), ids.reshape(-1, cfg.top_k)
            acc = torch.zeros_like(zf)
            for e in torch.unique(idf).tolist():
                rows = (idf == e).any(-1).nonzero().squeeze(-1)
                hz = situ(zf[rows] @ w1[e].t(), zf[rows] @ w3[e].t(), cfg.situ_beta, cfg.situ_linear_beta)
                acc[rows] += wf[rows, e, None].to(zf.dtype) * (hz @ w2[e].t())
            acc = acc.reshape(z.shape)
            r = self.routed_expert_up_proj(rms(acc, self.routed_expert_norm, cfg.eps))
            return r + self.shared_experts(x)
        # Every expert on every token, weighted by the (mostly zero) routing weights: no gather or
        # scatter, so the computation is deterministic on the GPU; the waste is small at this size.
        h = situ(torch.einsum("...l,eil->...ei", z, w1), torch.einsum("...l,eil->...ei", z, w3),
                 cfg.situ_beta, cfg.situ_linear_beta)
        y = torch.einsum("...ei,eli->...el", h, w2)
        acc = torch.einsum("...e,...el->...l", w.to(y.dtype), y)
        r = self.routed_expert_up_proj(rms(acc, self.routed_expert_norm, cfg.eps))
        return r + self.shared_experts(x)


class Layer(nn.Module):
    def __init__(self, cfg, i):
        super().__init__()
        D = cfg.hidden
        self.input_layernorm = nn.Parameter(torch.ones(D))
        self.post_attention_layernorm = nn.Parameter(torch.ones(D))
        # AttnRes score vectors w = res_norm * res_proj[0]; res_proj starts at zero (uniform mixing).
        self.self_attention_res_norm = nn.Parameter(torch.ones(D))
        self.self_attention_res_proj = nn.Parameter(torch.zeros(1, D))
        self.mlp_res_norm = nn.Parameter(torch.ones(D))
        self.mlp_res_proj = nn.Parameter(torch.zeros(1, D))
        self.self_attn = MLA(cfg) if cfg.is_mla(i) else KDA(cfg)
        if i == 0:
            self.mlp = DenseMLP(cfg, cfg.dense_inter)
        else:
            self.block_sparse_moe = MoE(cfg)


class K3Model(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.layers = nn.ModuleList(Layer(cfg, i) for i in range(cfg.layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden))
        self.output_attn_res_norm = nn.Parameter(torch.ones(cfg.hidden))
        self.output_attn_res_proj = nn.Parameter(torch.zeros(1, cfg.hidden))
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)

    def init_weights(self, seed):
        """Seeded initialisation: N(0, 0.02) for matrices, output projections scaled by 1/sqrt(2L)."""
        gen = torch.Generator().manual_seed(seed)
        cfg = self.cfg
        out_std = 0.02 / math.sqrt(2 * cfg.layers)
        for name, p in self.named_parameters():
            with torch.no_grad():
                if name.endswith("conv1d"):
                    p.copy_(torch.randn(p.shape, generator=gen) * (1 / math.sqrt(cfg.conv_kernel)) * 0.5)
                elif name.endswith("A_log"):
                    p.zero_()
                elif name.endswith("dt_bias"):
                    # decay per step exp(-5 sigmoid(dt)) between about 0.99 and 0.5 at the start
                    lo, hi = math.log(0.002 / 0.998), math.log(0.14 / 0.86)
                    p.copy_(lo + (hi - lo) * torch.rand(p.shape, generator=gen))
                elif p.dim() == 1 or name.endswith("_res_proj"):
                    continue  # norms at 1, AttnRes projections at 0
                elif name.endswith(("o_proj.weight", "down_proj.weight", "up_proj.weight")) and "routed_expert_down" not in name:
                    std = out_std if ("o_proj" in name or "down_proj" in name) else 0.02
                    p.copy_(torch.randn(p.shape, generator=gen) * std)
                elif ".experts.w" in name:
                    fan_in = p.shape[-1]
                    p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(fan_in))
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.02)

    # True once the routed experts hold MXFP4 values already (export.load): no fake quantisation.
    prequantized = False

    def forward(self, ids, quant=None, recurrent=False, stats=None, dropout=0.0):
        """Logits [B, T, vocab] for ids [B, T] (teacher forcing, causal, fresh state).

        stats (a list) receives per layer {'router_in': the MLP's normed input, 'h_in': the partial sum
        entering the layer, 'ids': chosen ids, 'load': per-expert count} (ids/load for MoE layers)."""
        cfg = self.cfg
        eps = cfg.eps
        if quant is None:
            quant = not self.prequantized
        h = self.embed_tokens(ids)
        anchors = []
        for L, layer in enumerate(self.layers):
            h_in = h
            w_attn = layer.self_attention_res_norm * layer.self_attention_res_proj[0]
            w_mlp = layer.mlp_res_norm * layer.mlp_res_proj[0]
            a = attn_res_mix(anchors + [h], w_attn, eps) if anchors else h
            if L % cfg.attn_res_block == 0:
                anchors.append(h)
                prefix = None
            else:
                prefix = h
            x = rms(a, layer.input_layernorm, eps)
            o = layer.self_attn(x) if cfg.is_mla(L) else layer.self_attn(x, recurrent=recurrent)
            if dropout:
                o = F.dropout(o, dropout, self.training)
            q = o if prefix is None else prefix + o
            m = attn_res_mix(anchors + [q], w_mlp, eps)
            xm = rms(m, layer.post_attention_layernorm, eps)
            st = None
            if stats is not None:
                st = {"router_in": xm, "h_in": h_in}
                stats.append(st)
            if L == 0:
                y = layer.mlp(xm)
            else:
                y = layer.block_sparse_moe(xm, quant=quant, stats=st)
            if dropout:
                y = F.dropout(y, dropout, self.training)
            h = q + y
        w_out = self.output_attn_res_norm * self.output_attn_res_proj[0]
        return self.lm_head(rms(attn_res_mix(anchors + [h], w_out, eps), self.norm, eps))

    def moe_layers(self):
        return [(L, layer.block_sparse_moe) for L, layer in enumerate(self.layers) if L > 0]
