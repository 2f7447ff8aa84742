#!/usr/bin/env python3
"""Golden logits for a tiny gpt-oss model in the released MXFP4 layout, computed by transformers.

Writes --out (default tests/fixtures/gpt_oss_tiny_mxfp4): config.json (the released gpt-oss-120b form, shrunk, with
quantization_config {quant_method mxfp4, modules_to_not_convert [...]}), model.safetensors.index.json, two shards
(experts as U8 *_blocks [E, rows, cols/32, 16] and U8 E8M0 *_scales [E, rows, cols/32], everything else BF16),
golden_logits.npy, golden.json and README.md.

Procedure:
 1. Instantiate transformers' GptOssForCausalLM (eager attention and experts) from the released config: 4 layers
    alternating sliding_attention (window 6) and full_attention, attention sinks, YaRN RoPE as released (factor
    32, beta_fast 32, beta_slow 1, truncate false), GQA, router with bias, clamped SwiGLU (alpha 1.702, limit 7).
    Set every weight to seeded BF16 values, encode the experts as MXFP4 and set them to the exactly decoded values
    (tools/oracle/quant_formats.py), run in float64 (RMSNorm's variance and RoPE's angles stay float32).
 2. Prefill the 12-token prompt with the cache, then 8 cached greedy decode steps (20 tokens: past the sliding
    window); cross-check with one no-cache forward; require decisive routing and greedy choices, or re-seed.
 3. Write the released layout, check transformers' own MXFP4 decoder (convert_moe_packed_tensors) gives the
    golden weights, and reload with GptOssForCausalLM.from_pretrained(dir, quantization_config=
    Mxfp4Config(dequantize=True)) to identical weights and logits.

Regenerate (needs torch, transformers >= 5.24, accelerate, safetensors, numpy; CPU, seconds):

    python3 tools/oracle/gpt_oss_golden.py --out tests/fixtures/gpt_oss_tiny_mxfp4
"""

import argparse
import copy
import math
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import hf_golden as hg  # noqa: E402  (sets the offline/CPU environment before torch is imported)
import quant_formats as qf  # noqa: E402
import torch  # noqa: E402
from transformers import GptOssConfig, GptOssForCausalLM, Mxfp4Config  # noqa: E402
from transformers.integrations.mxfp4 import convert_moe_packed_tensors  # noqa: E402

REGEN_COMMAND = "python3 tools/oracle/gpt_oss_golden.py --out tests/fixtures/gpt_oss_tiny_mxfp4"
VOCAB = 512
PROMPT_LEN = 12
NUM_NEW = 8
SLIDING_WINDOW = 6
ROUTER_MARGIN_MIN = 1e-3
GREEDY_MARGIN_MIN = 1e-3
CACHED_VS_FULL_MAX = 1e-5  # float64 model, but RMSNorm and the RoPE angles run in float32
MAX_ATTEMPTS = 100

QUANT_CONFIG = {
    "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                               "lm_head"],
    "quant_method": "mxfp4",
}

# gpt-oss-120b's released config.json keys (values shrunk; the token ids are placeholders inside the tiny vocab).
RELEASED_CONFIG = {
    "architectures": ["GptOssForCausalLM"],
    "attention_bias": True,
    "attention_dropout": 0.0,
    "eos_token_id": 2,
    "experts_per_token": 4,
    "head_dim": 32,
    "hidden_act": "silu",
    "hidden_size": 64,
    "initial_context_length": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 64,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    "max_position_embeddings": 131072,
    "model_type": "gpt_oss",
    "num_attention_heads": 4,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 4,
    "num_key_value_heads": 2,
    "num_local_experts": 16,
    "output_router_logits": False,
    "pad_token_id": 1,
    "quantization_config": QUANT_CONFIG,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "rope_type": "yarn",
        "truncate": False,
    },
    "rope_theta": 150000,
    "router_aux_loss_coef": 0.9,
    "sliding_window": SLIDING_WINDOW,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": VOCAB,
}

SHARDS = [
    ("model-00001-of-00002.safetensors", lambda n: n.startswith("model.embed_tokens.")
     or re.match(r"model\.layers\.[01]\.", n) is not None),
    ("model-00002-of-00002.safetensors", lambda n: True),
]
EXPERT_PROJS = ("gate_up_proj", "down_proj")


def build_config():
    released = copy.deepcopy(RELEASED_CONFIG)
    released.pop("quantization_config")
    cfg = GptOssConfig.from_dict(released, attn_implementation="eager", experts_implementation="eager")
    rp = cfg.rope_parameters
    hg.check(rp["rope_type"] == "yarn" and rp["factor"] == 32.0 and rp["truncate"] is False, f"rope {rp}")
    hg.check(cfg.layer_types == RELEASED_CONFIG["layer_types"] and cfg.sliding_window == SLIDING_WINDOW, "layers")
    hg.check(cfg.swiglu_alpha == 1.702 and cfg.swiglu_limit == 7.0, "swiglu constants")
    hg.check(cfg.num_experts_per_tok == 4 and cfg.num_local_experts == 16, "experts")
    return cfg


def init_weights(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in sorted(model.state_dict().items()):
            shape = tuple(t.shape)
            if name.endswith("norm.weight"):
                v = 0.8 + 0.4 * torch.rand(shape, generator=g)
            elif name.endswith("sinks"):  # per-head logit of the sink, comparable to the attention scores
                v = torch.randn(shape, generator=g)
            elif name == "model.embed_tokens.weight":
                v = torch.randn(shape, generator=g)
            elif name.endswith("router.weight"):
                v = torch.randn(shape, generator=g) * (3.0 / math.sqrt(shape[-1]))
            elif name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):  # [E, in, out]
                v = torch.randn(shape, generator=g) * (2.0 / math.sqrt(shape[1]))
            elif t.ndim >= 2:
                v = torch.randn(shape, generator=g) / math.sqrt(shape[-1])
            elif name.endswith("bias"):
                v = torch.randn(shape, generator=g) * 0.1
            else:
                hg.fail(f"no init rule for {name} {shape}")
            t.copy_(hg.bf16_round(v.double()))


def quantize_experts(model):
    """Encode each expert matrix as MXFP4 in the released orientation [E, out, in]; set the exact decoded values."""
    sd = model.state_dict()
    stored = {}
    with torch.no_grad():
        for name, t in sd.items():
            m = re.fullmatch(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)", name)
            if m is None:
                continue
            blocks, scales = qf.mxfp4_encode(t.transpose(1, 2))  # transformers holds [E, in, out]
            stored[f"{name}_blocks"], stored[f"{name}_scales"] = blocks, scales
            t.copy_(qf.mxfp4_decode(blocks, scales).transpose(1, 2))
    return stored


def to_released(model, stored):
    out = dict(stored)
    for name, t in model.state_dict().items():
        if name.endswith(EXPERT_PROJS):
            continue
        out[name] = t.to(torch.bfloat16).contiguous()
    return out


class RouterProbe:
    """Re-derives the router's choice (top-k of x W^T + b, softmax over the chosen logits) in float64, requires
    transformers' choice, records margins (k-th vs (k+1)-th logit) and routing."""

    def __init__(self, model, cfg):
        self.k, self.on = cfg.num_experts_per_tok, False
        self.margins, self.routing = [], {}
        self.handles = [layer.mlp.router.register_forward_hook(self._hook(i))
                        for i, layer in enumerate(model.model.layers)]

    def _hook(self, layer):
        def hook(module, args, output):
            if not self.on:
                return
            logits, scores, indices = output
            top = logits.double().topk(self.k + 1, dim=-1)
            ours = top.indices[:, :self.k]  # both top-k lists are sorted by descending logit
            hg.check(torch.equal(ours, indices), f"layer {layer}: routing re-derivation differs from transformers")
            w = torch.softmax(top.values[:, :self.k], dim=-1)
            hg.check(torch.allclose(w, scores.double(), rtol=1e-12, atol=0), f"layer {layer}: routing weights")
            hg.record_top_k(self.routing, self.margins, layer, top, self.k, w)

        return hook

    def remove(self):
        for h in self.handles:
            h.remove()


def search_seed(cfg, prompt, first_seed):
    for seed in range(first_seed, first_seed + MAX_ATTEMPTS):
        torch.manual_seed(seed)
        model = GptOssForCausalLM(cfg).to(torch.float64).eval()
        init_weights(model, seed)
        stored = quantize_experts(model)
        probe = RouterProbe(model, cfg)
        probe.on = True
        logits, generated, nxt, gm = hg.run_cached(model, prompt, NUM_NEW)
        routing = copy.deepcopy(probe.routing)
        seq = torch.cat([prompt, torch.tensor(generated)])
        full = hg.run_full(model, seq)
        probe.remove()
        mr, mg = min(probe.margins), min(gm)
        ok = mr > ROUTER_MARGIN_MIN and mg > GREEDY_MARGIN_MIN
        print(f"seed {seed}: router margin {mr:.3e}, greedy margin {mg:.3e} -> {'ok' if ok else 'retry'}", flush=True)
        if ok:
            return seed, model, stored, logits, generated, nxt, gm, seq, full, mr, routing
    hg.fail(f"no seed in {MAX_ATTEMPTS} gave decisive routing and greedy choices")


def check_written(out_dir, model):
    """transformers' MXFP4 decoder must give the golden expert weights; returns the number of tensors checked."""
    written = hg.read_checkpoint(out_dir)
    sd = model.state_dict()
    n = 0
    for name, t in sd.items():
        if name.endswith(EXPERT_PROJS):
            blocks, scales = written[f"{name}_blocks"], written[f"{name}_scales"]
            hg.check(blocks.dtype == torch.uint8 and scales.dtype == torch.uint8, f"{name}: blocks/scales not U8")
            hf = convert_moe_packed_tensors(blocks, scales, dtype=torch.float64)
            hg.check(torch.equal(hf, t), f"{name}: transformers' MXFP4 decoder gives other weights")
            hg.check(torch.equal(qf.mxfp4_decode(blocks, scales).transpose(1, 2), t), f"{name}: reference decoder")
        else:
            hg.check(written[name].dtype == torch.bfloat16, f"{name} is {written[name].dtype}, expected BF16")
            hg.check(torch.equal(written[name].double(), t), f"{name} not written exactly")
        n += 1
    return n


@torch.no_grad()
def feature_effects(model, seq, full):
    """How much the logits move without the sliding window, and without the sinks: both must matter here."""
    model.config.sliding_window = 10**6
    no_window = hg.run_full(model, seq)
    model.config.sliding_window = SLIDING_WINDOW
    hg.check(torch.equal(hg.run_full(model, seq), full), "restoring the window did not restore the logits")
    sinks = [layer.self_attn.sinks for layer in model.model.layers]
    saved = [s.clone() for s in sinks]
    for s in sinks:
        s.fill_(-math.inf)
    no_sinks = hg.run_full(model, seq)
    for s, v in zip(sinks, saved):
        s.copy_(v)
    effects = {
        "rows_within_window_unchanged_without_window": float((no_window[:SLIDING_WINDOW] - full[:SLIDING_WINDOW])
                                                             .abs().max()),
        "max_abs_change_without_window": float((no_window - full).abs().max()),
        "max_abs_change_without_sinks": float((no_sinks - full).abs().max()),
    }
    hg.check(effects["rows_within_window_unchanged_without_window"] == 0.0, "window changes rows it cannot reach")
    hg.check(effects["max_abs_change_without_window"] > 0.1, f"the sliding window barely matters: {effects}")
    hg.check(effects["max_abs_change_without_sinks"] > 0.1, f"the sinks barely matter: {effects}")
    return effects


def reload_with_transformers(out_dir, model, prompt, logits):
    m2 = GptOssForCausalLM.from_pretrained(out_dir, dtype=torch.float64, attn_implementation="eager",
                                           experts_implementation="eager",
                                           quantization_config=Mxfp4Config(dequantize=True))
    m2.eval()
    hg.compare_state(model.state_dict(), m2.state_dict(), "from_pretrained(Mxfp4Config(dequantize=True))")
    l2, _, _, _ = hg.run_cached(m2, prompt, NUM_NEW)
    diff = float((l2 - logits).abs().max())
    hg.check(diff == 0.0, f"reloaded model gives other logits (max |diff| {diff})")
    return diff


NUMERICS = [
    "RMSNorm: x * rsqrt(mean(x^2) + eps) * w, eps = rms_norm_eps (1e-5) (transformers: variance in float32).",
    "Attention: q/k/v/o projections with bias; head_dim 32 (num_attention_heads * head_dim = 128 != hidden 64); "
    "GQA, 2 query heads per KV head; scale head_dim^-0.5.",
    "Sinks: per query head h a learned logit sinks[h] joins the softmax: p_j = exp(s_j - m) / (sum_k exp(s_k - m) "
    "+ exp(sinks[h] - m)), m the max over the scores and the sink; the sink has no value (its probability is "
    "dropped), so the weights sum to < 1.",
    f"Sliding window (layer_types[i] == sliding_attention, window {SLIDING_WINDOW}): query at position q sees keys "
    f"k with q - {SLIDING_WINDOW} < k <= q, i.e. itself and the {SLIDING_WINDOW - 1} previous tokens "
    "(transformers' sliding_window_overlay: kv_idx > q_idx - sliding_window). Full layers are plain causal.",
    "RoPE: rotate-half (not interleaved): pairs (x[i], x[i + d/2]), angle pos * inv_freq[i]. YaRN (factor 32, "
    "beta_fast 32, beta_slow 1, original 4096, theta 150000, truncate false: the correction range low/high is NOT "
    "floored/ceiled): inv_freq[i] = interp[i] (1 - m[i]) + extrap[i] m[i], extrap = theta^(-2i/d), interp = "
    "extrap / factor, m = 1 - clamp((i - low) / (high - low), 0, 1), low = d ln(orig / (beta_fast 2 pi)) / (2 ln "
    "theta), high = same with beta_slow, clamped to [0, d - 1]; cos and sin are both multiplied by attention_factor "
    "= 0.1 ln(factor) + 1 (= 1.3466) (so q.k carries its square); inv_freq and angles in float32.",
    "Router: logits = x W^T + b; top-k (4) logits; weights = softmax over those k logits only.",
    "Experts (clamped SwiGLU): gate_up = x W_gu + b_gu, gate = gate_up[0::2], up = gate_up[1::2] (interleaved "
    "columns, i.e. rows 2j / 2j+1 of the released [2I, H] matrix); gate = min(gate, 7); up = clamp(up, -7, 7); "
    "out = ((up + 1) * gate * sigmoid(1.702 gate)) W_down + b_down; MoE output = sum_i w_i out_i.",
    "Residuals: h += attn(input_layernorm(h)); h += moe(post_attention_layernorm(h)); logits = lm_head(norm(h)), "
    "untied.",
]


def readme(g):
    return f"""# gpt_oss_tiny_mxfp4: golden logits from Hugging Face transformers

A tiny `GptOssForCausalLM` in gpt-oss-120b's released layout: routed experts MXFP4 (`*_blocks` U8 `[E, rows,
cols/32, 16]`, `*_scales` U8 E8M0 `[E, rows, cols/32]`, biases BF16), everything else BF16; `quantization_config`
`{QUANT_CONFIG}`. 4 layers alternating sliding (window {SLIDING_WINDOW}) and full attention, sinks, YaRN RoPE,
GQA, router with bias, clamped SwiGLU. The {PROMPT_LEN}-token prompt plus {NUM_NEW} decode steps cross the window.

Generated by `tools/oracle/gpt_oss_golden.py` with transformers {g['versions']['transformers']}, torch
{g['versions']['torch']}, in float64 on CPU. Regenerate (needs torch, transformers >= 5.24, accelerate,
safetensors, numpy) with:

    {REGEN_COMMAND}

CI needs no torch: it only reads these files. Layout facts: docs/checkpoint-layout.md.

## Files
- `config.json`: the released config form (`layer_types`, `sliding_window`, `rope_scaling` yarn, `swiglu_limit`,
  `experts_per_token` and `num_experts_per_tok`, `quantization_config`).
- `model.safetensors.index.json`, two shards (embeddings and layers 0-1; layers 2-3, final norm, lm_head).
- `golden_logits.npy`: float32 `{g['logits_shape']}`: row t = logits after token t of `prompt_ids +
  generated_ids`, one cached prefill then {NUM_NEW} cached single-token steps; computed in float64 on the exactly
  decoded weights (every MXFP4 value x 2^e is a BF16 value), rounded to float32.
- `golden.json`: ids, versions, margins, routing per layer and row, the config, the numerics.

## Ids
- prompt_ids ({PROMPT_LEN}, seeded, in [0, {VOCAB})): {g['prompt_ids']}
- generated_ids (greedy, {NUM_NEW}): {g['generated_ids']}

## Checks made when generating
- cached vs one no-cache forward: max |diff| = {g['cached_vs_full_max_abs_diff']:.3e}
- without the sliding window the logits of the first {SLIDING_WINDOW} rows are unchanged and later rows move by up to
  {g['feature_effects']['max_abs_change_without_window']:.3g}; without the sinks by up to
  {g['feature_effects']['max_abs_change_without_sinks']:.3g} (both features are exercised)
- transformers' routing equals top-k + softmax re-derived in float64; smallest k-th vs (k+1)-th router logit
  margin {g['min_router_margin']:.3e}; smallest greedy margin {g['min_greedy_margin']:.3e}
- transformers' own MXFP4 decoder (`convert_moe_packed_tensors`) and tools/oracle/quant_formats.py decode the
  stored blocks/scales to exactly the golden expert weights
- `GptOssForCausalLM.from_pretrained(dir, dtype=torch.float64, quantization_config=Mxfp4Config(dequantize=True))`:
  identical weights, identical logits (max |diff| = {g['reload_max_abs_diff']})
- second opinion, numpy only: `python3 tools/oracle/released_ref.py <this folder>` decodes the released files
  itself and recomputes logits, greedy ids and routing with the equations below (agrees to ~1e-6)

## Numerics transformers uses (the engine must match)
""" + "\n".join(f"- {n}" for n in g["numerics"]) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="tests/fixtures/gpt_oss_tiny_mxfp4")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompt-seed", type=int, default=0)
    args = ap.parse_args()
    hg.require_transformers((5, 24))
    hg.setup_torch()
    os.makedirs(args.out, exist_ok=True)
    cfg = build_config()
    prompt = torch.randint(0, VOCAB, (PROMPT_LEN,), generator=torch.Generator().manual_seed(args.prompt_seed))
    seed, model, stored, logits, generated, nxt, gm, seq, full, min_router, routing = search_seed(
        cfg, prompt, args.seed)
    cvf = hg.check_cached_vs_full(logits, full, PROMPT_LEN, generated, CACHED_VS_FULL_MAX)
    effects = feature_effects(model, seq, full)

    hg.write_json(os.path.join(args.out, "config.json"), RELEASED_CONFIG)
    total = hg.write_checkpoint(to_released(model, stored), args.out, SHARDS)
    checked = check_written(args.out, model)
    reload_diff = reload_with_transformers(args.out, model, prompt, logits)

    golden = {
        "description": "Golden logits for gpt_oss_tiny_mxfp4, computed by transformers' GptOssForCausalLM in float64 "
                       "on CPU (eager attention and experts) on the exactly decoded MXFP4 experts. See README.md.",
        "generator": "tools/oracle/gpt_oss_golden.py",
        "command": REGEN_COMMAND,
        "versions": hg.versions(),
        "weight_seed": seed,
        "prompt_ids": prompt.tolist(),
        "generated_ids": generated,
        "next_id_after_generated": nxt,
        "sequence_ids": seq.tolist(),
        "logits_file": "golden_logits.npy",
        "logits_shape": list(logits.shape),
        "logits_rows": "row t = logits after token t of sequence_ids; one cached prefill over the prompt, then one "
                       f"single-token cached forward per generated id; generated_ids[i] = argmax(row {PROMPT_LEN - 1}"
                       " + i). Computed in float64, stored as float32.",
        "cached_vs_full_max_abs_diff": cvf,
        "min_router_margin": min_router,
        "router_margin_threshold": ROUTER_MARGIN_MIN,
        "min_greedy_margin": min(gm),
        "greedy_margins": gm,
        "row_argmax": [int(x) for x in logits.argmax(-1)],
        "routing": routing,
        "routing_note": "per layer (0-based), per row of sequence_ids (cached passes): chosen experts sorted "
                        "ascending and their softmax weights",
        "feature_effects": effects,
        "tensors_checked": checked,
        "reload_max_abs_diff": reload_diff,
        "checkpoint_total_bytes": total,
        "config": RELEASED_CONFIG,
        "numerics": NUMERICS,
    }
    sizes = hg.save_goldens(args.out, logits, golden, readme(golden))
    print(f"files {sizes} total {sum(sizes.values())}\ngenerated {generated}\nOK", flush=True)


if __name__ == "__main__":
    main()
