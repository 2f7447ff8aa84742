#!/usr/bin/env python3
"""Golden logits for tiny DeepSeek-V3 / Kimi K2 models in their released layouts, computed by transformers.

Writes three fixtures under --out (default tests/fixtures), each a Hugging Face folder with config.json,
model.safetensors.index.json, two shards, golden_logits.npy, golden.json and README.md:

  deepseek_v3_tiny_bf16/    model_type deepseek_v3, every matrix BF16 (e_score_correction_bias F32)
  deepseek_v3_tiny_fp8/     the same architecture as DeepSeek-V3 / Kimi K2 release it: float8_e4m3fn weights with
                            F32 weight_scale_inv [ceil(rows/128), ceil(cols/128)] for every quantized linear,
                            quantization_config {quant_method fp8, fmt e4m3, activation_scheme dynamic,
                            weight_block_size [128, 128]}; dimensions 144, 160 and 192 make partial blocks
  kimi_k2_tiny_int4/        Kimi K2 Thinking's layout: model_type kimi_k2 on DeepseekV3ForCausalLM, routed experts
                            compressed-tensors pack-quantized INT4 (symmetric, group 32), the rest BF16

Procedure, per fixture:
 1. Instantiate transformers' DeepseekV3ForCausalLM (eager attention and experts) from the released config, set
    every weight to seeded BF16 values, quantize and dequantize the variant's quantized matrices exactly
    (tools/oracle/quant_formats.py), and run the model in float64 (transformers keeps RMSNorm's variance, the
    router logits and the attention softmax in float32: those are the only float32 steps).
 2. Prefill the 12-token prompt with the cache, then 8 cached single-token greedy decode steps; cross-check with
    one no-cache forward; require decisive routing (group and expert selection margins) and greedy margins, or
    re-seed.
 3. Write the released layout, decode it back with the reference decoders, with compressed-tensors' own
    decompressor (INT4), and reload it with DeepseekV3ForCausalLM.from_pretrained where transformers can on CPU;
    require the weights (and logits) that made the goldens.

Regenerate (needs torch, transformers >= 5.24, accelerate, compressed-tensors, safetensors, numpy; CPU, ~1 min):

    python3 tools/oracle/deepseek_v3_golden.py --out tests/fixtures
"""

import argparse
import copy
import json
import math
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import hf_golden as hg  # noqa: E402  (sets the offline/CPU environment before torch is imported)
import quant_formats as qf  # noqa: E402
import torch  # noqa: E402
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM  # noqa: E402

REGEN_COMMAND = "python3 tools/oracle/deepseek_v3_golden.py --out tests/fixtures"
VOCAB = 512
PROMPT_LEN = 12
NUM_NEW = 8
ROUTER_MARGIN_MIN = 1e-3
GREEDY_MARGIN_MIN = 1e-3
CACHED_VS_FULL_MAX = 1e-5  # float64 model, but norms, router and softmax run in float32
MAX_ATTEMPTS = 100

# DeepSeek-V3's released config.json keys (values shrunk). hidden 64, but q_lora_rank 96, kv_lora_rank 144
# (kv_a_proj_with_mqa 160 rows, kv_b_proj 144 columns) and intermediate_size 192 cross a 128 boundary.
DEEPSEEK_V3_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 192,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "num_nextn_predict_layers": 0,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_shared_experts": 1,
    "n_routed_experts": 16,
    "ep_size": 1,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 144,
    "q_lora_rank": 96,
    "qk_rope_head_dim": 16,
    "v_head_dim": 16,
    "qk_nope_head_dim": 16,
    "topk_method": "noaux_tc",
    "n_group": 4,
    "topk_group": 2,
    "num_experts_per_tok": 4,
    "moe_layer_freq": 1,
    "first_k_dense_replace": 1,
    "norm_topk_prob": True,
    "scoring_func": "sigmoid",
    "hidden_act": "silu",
    "max_position_embeddings": 163840,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
    "use_cache": True,
    "torch_dtype": "bfloat16",
}

FP8_QUANT_CONFIG = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [128, 128],
}

# Kimi K2 Thinking's conventions: model_type kimi_k2 with the DeepseekV3 architecture (its remote code maps it
# there), no expert groups (n_group = topk_group = 1), routed_scaling_factor 2.827, YaRN factor 64 (262144 positions) with
# beta_fast = beta_slow = 1 and rope_theta 50000, and compressed-tensors INT4 routed experts. bos/eos are K2's
# 163584/163585 folded into the tiny vocab (placeholders, like every token id here).
KIMI_K2_CONFIG = dict(
    copy.deepcopy(DEEPSEEK_V3_CONFIG),
    model_type="kimi_k2",
    n_group=1,
    topk_group=1,
    routed_scaling_factor=2.827,
    rope_theta=50000.0,
    rope_scaling={
        "beta_fast": 1.0,
        "beta_slow": 1.0,
        "factor": 64.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    max_position_embeddings=262144,
    bos_token_id=163584 % VOCAB,
    eos_token_id=163585 % VOCAB,
)

INT4_QUANT_CONFIG = {
    "config_groups": {
        "group_0": {
            "input_activations": None,
            "output_activations": None,
            "targets": ["Linear"],
            "weights": {
                "actorder": None,
                "block_structure": None,
                "dynamic": False,
                "group_size": 32,
                "num_bits": 4,
                "observer": "minmax",
                "observer_kwargs": {},
                "strategy": "group",
                "symmetric": True,
                "type": "int",
            },
        }
    },
    "format": "pack-quantized",
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"],
    "kv_cache_scheme": None,
    "quant_method": "compressed-tensors",
    "quantization_status": "compressed",
}

VARIANTS = {
    "bf16": ("deepseek_v3_tiny_bf16", DEEPSEEK_V3_CONFIG, None),
    "fp8": ("deepseek_v3_tiny_fp8", DEEPSEEK_V3_CONFIG, FP8_QUANT_CONFIG),
    "int4": ("kimi_k2_tiny_int4", KIMI_K2_CONFIG, INT4_QUANT_CONFIG),
}

SHARDS = [
    ("model-00001-of-00002.safetensors", lambda n: n.startswith("model.embed_tokens.")
     or re.match(r"model\.layers\.[01]\.", n) is not None),
    ("model-00002-of-00002.safetensors", lambda n: True),
]


def build_config(released):
    cfg = DeepseekV3Config.from_dict(copy.deepcopy(released), attn_implementation="eager",
                                     experts_implementation="eager")
    rp = cfg.rope_parameters
    hg.check(rp["rope_type"] == "yarn" and rp["factor"] == released["rope_scaling"]["factor"], f"rope {rp}")
    hg.check(cfg.rope_interleave, "rope_interleave must default to True (DeepSeek's interleaved rope)")
    for k in ("n_group", "topk_group", "num_experts_per_tok", "first_k_dense_replace", "q_lora_rank",
              "kv_lora_rank", "n_routed_experts"):
        hg.check(getattr(cfg, k) == released[k], f"config.{k} = {getattr(cfg, k)}")
    return cfg


# ---- weights ---------------------------------------------------------------------------------------------------


def init_weights(model, seed):
    """Seeded O(1)-activation BF16 values for every parameter and buffer (in the model's float64)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in sorted(model.state_dict().items()):
            shape = tuple(t.shape)
            if name.endswith("e_score_correction_bias"):
                v = torch.randn(shape, generator=g) * 0.1
            elif name.endswith("norm.weight"):
                v = 0.8 + 0.4 * torch.rand(shape, generator=g)
            elif name == "model.embed_tokens.weight":
                v = torch.randn(shape, generator=g)
            elif name.endswith("mlp.gate.weight"):  # router: spread scores so selection is decisive
                v = torch.randn(shape, generator=g) * (3.0 / math.sqrt(shape[-1]))
            elif t.ndim >= 2:
                v = torch.randn(shape, generator=g) / math.sqrt(shape[-1])
            else:
                hg.fail(f"no init rule for {name} {shape}")
            t.copy_(hg.bf16_round(v.double()))


def expert_matrices(cfg, sd, layer):
    """(released name suffix, [rows, cols] tensor) of every routed-expert matrix of one MoE layer."""
    pre = f"model.layers.{layer}.mlp.experts."
    gate_up, down = sd[pre + "gate_up_proj"], sd[pre + "down_proj"]
    inter = cfg.moe_intermediate_size
    for e in range(cfg.n_routed_experts):
        yield f"{e}.gate_proj", gate_up[e, :inter]
        yield f"{e}.up_proj", gate_up[e, inter:]
        yield f"{e}.down_proj", down[e]


def released_linears(cfg, sd):
    """{released weight name without '.weight': (tensor view into sd, kind)}; kind is 'expert', 'router',
    'lm_head', 'embed' or 'linear' (attention, dense MLP, shared experts)."""
    out = {}
    for name, t in sd.items():
        if t.ndim != 2:
            continue
        base = name.removesuffix(".weight")
        if name == "model.embed_tokens.weight":
            out[base] = (t, "embed")
        elif name == "lm_head.weight":
            out[base] = (t, "lm_head")
        elif name.endswith("mlp.gate.weight"):
            out[base] = (t, "router")
        else:
            out[base] = (t, "linear")
    for layer in range(cfg.first_k_dense_replace, cfg.num_hidden_layers):
        for suffix, t in expert_matrices(cfg, sd, layer):
            out[f"model.layers.{layer}.mlp.experts.{suffix}"] = (t, "expert")
    return out


def quantize_in_place(model, cfg, variant):
    """Replace the variant's quantized matrices by their exactly dequantized values; return the stored tensors."""
    sd = model.state_dict()
    stored = {}
    with torch.no_grad():
        for base, (t, kind) in released_linears(cfg, sd).items():
            if variant == "fp8" and kind in ("linear", "expert"):
                q, s = qf.fp8_block_encode(t)
                stored[base] = {"weight": q, "weight_scale_inv": s}
                t.copy_(qf.fp8_block_decode(q, s))
            elif variant == "int4" and kind == "expert":
                packed, scale, shape = qf.int4_pack_encode(t)
                stored[base] = {"weight_packed": packed, "weight_scale": scale, "weight_shape": shape}
                t.copy_(qf.int4_pack_decode(packed, scale, shape))
    return stored


def to_released(model, cfg, stored):
    sd = model.state_dict()
    out = {}
    linears = released_linears(cfg, sd)
    for base, (t, _) in linears.items():
        for suffix, v in stored.get(base, {"weight": t.to(torch.bfloat16)}).items():
            out[f"{base}.{suffix}"] = v.contiguous()
    for name, t in sd.items():
        if t.ndim == 1:
            dtype = torch.float32 if name.endswith("e_score_correction_bias") else torch.bfloat16
            out[name] = t.to(dtype).contiguous()
    return out


# ---- routing probes --------------------------------------------------------------------------------------------


class RouterProbe:
    """Re-derives each router's choice from its float32 logits (sigmoid, + bias, group top-2 sums, top groups,
    top-k) in float64, requires transformers' choice, and records the selection margins and final weights."""

    def __init__(self, model, cfg):
        self.cfg, self.on = cfg, False
        self.margins, self.routing = [], {}
        self.handles = [layer.mlp.gate.register_forward_hook(self._hook(i))
                        for i, layer in enumerate(model.model.layers) if i >= cfg.first_k_dense_replace]

    def _hook(self, layer):
        def hook(module, args, output):
            if not self.on:
                return
            logits, weights, indices = output
            cfg = self.cfg
            scores = logits.double().sigmoid()
            choice = scores + module.e_score_correction_bias.double()
            per = cfg.n_routed_experts // cfg.n_group
            gscore = choice.view(-1, cfg.n_group, per).topk(2, dim=-1).values.sum(-1)
            gtop = gscore.topk(min(cfg.topk_group + 1, cfg.n_group), dim=-1)
            allowed = torch.zeros_like(gscore, dtype=torch.bool)
            allowed.scatter_(1, gtop.indices[:, :cfg.topk_group], True)
            masked = choice.masked_fill(~allowed.repeat_interleave(per, 1), -math.inf)
            etop = masked.topk(cfg.num_experts_per_tok + 1, dim=-1)
            k = cfg.num_experts_per_tok
            ours = etop.indices[:, :k].sort(-1).values
            theirs, order = indices.sort(-1)
            hg.check(torch.equal(ours, theirs), f"layer {layer}: routing re-derivation differs from transformers")
            w = scores.gather(1, ours)
            w = w / (w.sum(-1, keepdim=True) + 1e-20) * cfg.routed_scaling_factor
            hg.check(torch.allclose(w, weights.double().gather(1, order), rtol=1e-6, atol=0), "routing weights")
            for r in range(logits.shape[0]):
                m = float(etop.values[r, k - 1] - etop.values[r, k])
                if cfg.n_group > cfg.topk_group:
                    m = min(m, float(gtop.values[r, cfg.topk_group - 1] - gtop.values[r, cfg.topk_group]))
                self.margins.append(m)
            rows = self.routing.setdefault(str(layer), {"experts": [], "weights": []})
            rows["experts"] += ours.tolist()
            rows["weights"] += [[float(x) for x in row] for row in w]

        return hook

    def remove(self):
        for h in self.handles:
            h.remove()


# ---- one variant -----------------------------------------------------------------------------------------------


def make_model(cfg, seed, variant):
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(cfg).to(torch.float64).eval()
    init_weights(model, seed)
    stored = quantize_in_place(model, cfg, variant)
    return model, stored


def search_seed(cfg, variant, prompt, first_seed):
    for seed in range(first_seed, first_seed + MAX_ATTEMPTS):
        model, stored = make_model(cfg, seed, variant)
        probe = RouterProbe(model, cfg)
        probe.on = True
        logits, generated, nxt, gm = hg.run_cached(model, prompt, NUM_NEW)
        cached_routing = copy.deepcopy(probe.routing)
        seq = torch.cat([prompt, torch.tensor(generated)])
        full = hg.run_full(model, seq)
        probe.remove()
        mr, mg = min(probe.margins), min(gm)
        ok = mr > ROUTER_MARGIN_MIN and mg > GREEDY_MARGIN_MIN
        print(f"  seed {seed}: router margin {mr:.3e}, greedy margin {mg:.3e} -> {'ok' if ok else 'retry'}",
              flush=True)
        if ok:
            return seed, model, stored, logits, generated, nxt, gm, seq, full, mr, cached_routing
    hg.fail(f"{variant}: no seed in {MAX_ATTEMPTS} gave decisive routing and greedy choices")


def check_stored_decodes(written, model, cfg, variant):
    """Decode the written tensors with the reference decoders (and compressed-tensors' own decompressor for INT4)
    and require the weights of the model that made the goldens."""
    sd = model.state_dict()
    linears = released_linears(cfg, sd)
    checked = 0
    for base, (t, kind) in linears.items():
        if f"{base}.weight_scale_inv" in written:
            got = qf.fp8_block_decode(written[f"{base}.weight"], written[f"{base}.weight_scale_inv"])
        elif f"{base}.weight_packed" in written:
            got = qf.int4_pack_decode(written[f"{base}.weight_packed"], written[f"{base}.weight_scale"],
                                      written[f"{base}.weight_shape"])
            got_ct = decompress_with_compressed_tensors(written, base)
            hg.check(torch.equal(got_ct, t), f"{base}: compressed-tensors decompresses to other values")
        else:
            got = written[f"{base}.weight"].double()
        hg.check(torch.equal(got, t), f"{base}: stored {variant} tensors do not decode to the golden weights")
        hg.check(torch.equal(hg.bf16_round(got), got), f"{base}: decoded weight is not BF16-exact")
        checked += 1
    return checked


def decompress_with_compressed_tensors(written, base):
    from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme

    scheme = QuantizationScheme(targets=["Linear"], weights=INT4_QUANT_CONFIG["config_groups"]["group_0"]["weights"])
    state = {k: written[f"{base}.{k}"] for k in ("weight_packed", "weight_scale", "weight_shape")}
    return PackedQuantizationCompressor.decompress(state, scheme)["weight"].double()


def check_ignore_list(written):
    """compressed-tensors' own matcher must put exactly the routed experts under config_groups."""
    from compressed_tensors.utils.match import match_name

    bases = {n.rsplit(".", 1)[0] for n in written if n.endswith((".weight", ".weight_packed"))}
    for base in bases:
        if base.endswith(("norm", "embed_tokens")) or base.endswith("mlp.gate"):
            continue  # not nn.Linear modules in K2's remote code (embedding, norms, MoEGate)
        ignored = any(match_name(base, t) for t in INT4_QUANT_CONFIG["ignore"])
        quantized = f"{base}.weight_packed" in written
        hg.check(ignored != quantized, f"{base}: ignore list says ignored={ignored}, stored quantized={quantized}")


def reload_with_transformers(out_dir, model, cfg, prompt, logits, variant):
    """Reload with DeepseekV3ForCausalLM.from_pretrained; returns a dict of findings for golden.json."""
    try:
        m2 = DeepseekV3ForCausalLM.from_pretrained(out_dir, dtype=torch.float64, attn_implementation="eager",
                                                   experts_implementation="eager")
    except Exception as e:  # recorded: transformers has no CPU loader for this layout
        return {"loaded": False, "error": f"{type(e).__name__}: {str(e)[:300]}"}
    m2.eval()
    sd1, sd2 = model.state_dict(), m2.state_dict()
    hg.check(set(sd1) == set(sd2), f"reloaded keys differ: {sorted(set(sd1) ^ set(sd2))[:8]}")
    differing = sorted(k for k in sd1 if not torch.equal(sd1[k].double(), sd2[k].double()))
    findings = {"loaded": True, "weights_differing": differing}
    if not differing:
        l2, _, _, _ = hg.run_cached(m2, prompt, NUM_NEW)
        findings["logits_max_abs_diff"] = float((l2 - logits).abs().max())
        hg.check(findings["logits_max_abs_diff"] == 0.0, "reloaded model gives other logits")
    return findings


def partial_block_tensors(written):
    out = []
    for name, t in written.items():
        if name.endswith(".weight_scale_inv"):
            w = written[name.replace("_scale_inv", "")]
            if any(d > qf.FP8_BLOCK and d % qf.FP8_BLOCK for d in w.shape):
                out.append(name.removesuffix("_scale_inv"))
    return sorted(out)


def make_variant(variant, out_root, prompt, first_seed):
    dirname, released_cfg, quant = VARIANTS[variant]
    out_dir = os.path.join(out_root, dirname)
    os.makedirs(out_dir, exist_ok=True)
    print(f"{dirname}:", flush=True)
    cfg = build_config(released_cfg)
    seed, model, stored, logits, generated, nxt, gm, seq, full, min_router, routing = search_seed(
        cfg, variant, prompt, first_seed)
    cvf = hg.check_cached_vs_full(logits, full, PROMPT_LEN, generated, CACHED_VS_FULL_MAX)

    config_json = dict(copy.deepcopy(released_cfg))
    if quant is not None:
        config_json["quantization_config"] = quant
    hg.write_json(os.path.join(out_dir, "config.json"), config_json)
    released = to_released(model, cfg, stored)
    total = hg.write_checkpoint(released, out_dir, SHARDS)
    written = hg.read_checkpoint(out_dir)
    hg.check(set(written) == set(released), "written names differ")
    for k in written:
        hg.check(written[k].dtype == released[k].dtype and torch.equal(written[k].view(torch.uint8).flatten()
                 if written[k].dtype == torch.float8_e4m3fn else written[k],
                 released[k].view(torch.uint8).flatten() if released[k].dtype == torch.float8_e4m3fn
                 else released[k]), f"{k} not written back as stored")
    decoded = check_stored_decodes(written, model, cfg, variant)
    if variant == "int4":
        check_ignore_list(written)
    reload = reload_with_transformers(out_dir, model, cfg, prompt, logits, variant)
    print(f"  reload: {json.dumps(reload)[:400]}", flush=True)
    if variant == "bf16":
        hg.check(reload["loaded"] and not reload["weights_differing"], "BF16 reload must be exact")
    partial = partial_block_tensors(written) if variant == "fp8" else []
    if variant == "fp8":
        hg.check(partial, "the FP8 fixture must exercise partial 128-blocks")
        # transformers' Fp8Dequantize takes the block as rows // scale_rows: right for whole blocks, wrong
        # wherever a partial last block makes that quotient differ from 128 (unless the scales happen to agree)
        hg.check(set(reload["weights_differing"]) <= set(partial), "transformers misreads a whole-block tensor")
    if variant == "int4":
        # transformers' compressed-tensors loader does not map per-expert weight_packed onto the fused experts
        hg.check(all(".mlp.experts." in k for k in reload["weights_differing"]), "INT4 reload: non-expert differs")
    golden = {
        "description": f"Golden logits for {dirname}, computed by transformers' DeepseekV3ForCausalLM in float64 on "
                       "CPU (eager attention and experts) on the exactly decoded stored weights. See README.md.",
        "generator": "tools/oracle/deepseek_v3_golden.py",
        "command": REGEN_COMMAND,
        "versions": hg.versions(),
        "variant": variant,
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
        "routing_note": "per MoE layer (0-based), per row of sequence_ids (cached passes): chosen experts sorted "
                        "ascending and their final weights (renormalised sigmoid scores x routed_scaling_factor)",
        "stored_tensors_decoded_and_checked": decoded,
        "transformers_reload": reload,
        "fp8_partial_block_weights": partial,
        "checkpoint_total_bytes": total,
        "config": config_json,
        "numerics": NUMERICS,
    }
    sizes = hg.save_goldens(out_dir, logits, golden, readme(dirname, golden, variant))
    print(f"  files {sizes} total {sum(sizes.values())}\n  generated {generated}", flush=True)


NUMERICS = [
    "RMSNorm: x * rsqrt(mean(x^2) + eps) * w, eps = rms_norm_eps (1e-6) for every norm including q_a_layernorm and "
    "kv_a_layernorm.",
    "MLA with q LoRA: q = q_b(q_a_layernorm(q_a(x))) per head [nope 16 | rope 16]; kv_a_proj_with_mqa(x) = "
    "[latent 144 | k_rope 16]; latent -> kv_a_layernorm -> kv_b_proj -> per head [k_nope 16 | v 16]; key = "
    "[k_nope | rope(k_rope)] with k_rope shared by all heads; softmax scale = (nope + rope)^-0.5 * mscale^2, "
    "mscale = 0.1 * mscale_all_dim * ln(factor) + 1 (YaRN, factor > 1).",
    "RoPE (rope_interleave): the rope part's pairs are adjacent elements (x[2i], x[2i+1]), rotated by angle "
    "pos * inv_freq[i]; YaRN inv_freq[i] = interp[i] * (1 - m[i]) + extrap[i] * m[i] with extrap = base^(-2i/d), "
    "interp = extrap / factor, m = 1 - clamp((i - low) / (high - low), 0, 1), low = floor(d ln(orig / "
    "(beta_fast 2 pi)) / (2 ln base)), high = ceil(same with beta_slow), clamped to [0, d - 1]; cos/sin not "
    "scaled (attention_factor = mscale(factor, mscale) / mscale(factor, mscale_all_dim) = 1). transformers "
    "computes inv_freq and the angles pos * inv_freq in float32.",
    "Router (noaux_tc): logits = x W^T in float32; s = sigmoid(logits); c = s + e_score_correction_bias; group "
    "score = sum of the top-2 c in each of n_group groups of consecutive experts; keep the topk_group best groups; "
    "top-k experts by c among them; weights = s[chosen] / (sum + 1e-20) * routed_scaling_factor.",
    "MoE: sum_i w_i down_i(silu(gate_i x) * up_i x) + shared(x) (shared width moe_intermediate_size * "
    "n_shared_experts); layers < first_k_dense_replace use the dense MLP of intermediate_size.",
    "Residuals: h += attn(input_layernorm(h)); h += mlp(post_attention_layernorm(h)); logits = lm_head(norm(h)).",
]


def readme(dirname, g, variant):
    what = {
        "bf16": "DeepSeek-V3's architecture with every matrix BF16 (`e_score_correction_bias` F32).",
        "fp8": "DeepSeek-V3 / Kimi K2's released FP8 layout: every linear of attention, dense MLP, shared and "
               "routed experts is `float8_e4m3fn` `weight` plus F32 `weight_scale_inv` `[ceil(rows/128), "
               "ceil(cols/128)]`; embeddings, norms, the router (`mlp.gate.weight`) and `lm_head` stay BF16, "
               "`e_score_correction_bias` F32. Scales carry 4 significant bits, so every fp8 x scale is a BF16 "
               f"value (exact whether decoded in float64, float32 or BF16). Partial 128-blocks: {', '.join(g['fp8_partial_block_weights'][:4])}, ...",
        "int4": "Kimi K2 Thinking's layout: `model_type: kimi_k2` on `DeepseekV3ForCausalLM`, routed experts "
                "compressed-tensors `pack-quantized` INT4 (`weight_packed` I32 `[rows, cols/8]`, `weight_scale` "
                "BF16 `[rows, cols/32]`, `weight_shape` I64 `[2]`; symmetric, group 32), everything else BF16 "
                "(`e_score_correction_bias` F32). No expert groups (n_group = topk_group = 1). Scales carry 5 "
                "significant bits, so every q x scale is a BF16 value (exact in any float format).",
    }[variant]
    reload = g["transformers_reload"]
    return f"""# {dirname}: golden logits from Hugging Face transformers

{what}

Generated by `tools/oracle/deepseek_v3_golden.py` with transformers {g['versions']['transformers']}, torch
{g['versions']['torch']}, compressed-tensors {g['versions'].get('compressed_tensors', '-')}, in float64 on CPU.
Regenerate (needs torch, transformers >= 5.24, accelerate, compressed-tensors, safetensors, numpy) with:

    {REGEN_COMMAND}

CI needs no torch: it only reads these files. Layout facts: docs/checkpoint-layout.md.

## Files
- `config.json`: the released config form (`rope_scaling` with `type: yarn`, `n_group`, `topk_group`,
  `first_k_dense_replace`, `q_lora_rank`, ...){' and `quantization_config`' if variant != 'bf16' else ''}.
- `model.safetensors.index.json`, two shards (embeddings and layers 0-1; layer 2, final norm, lm_head).
- `golden_logits.npy`: float32 `{g['logits_shape']}`: row t = logits after token t of `prompt_ids +
  generated_ids`, one cached prefill then {NUM_NEW} cached single-token steps. Computed in float64 on the exactly
  decoded weights (the stored checkpoint is exactly the model), then rounded to float32.
- `golden.json`: ids, versions, margins, routing per MoE layer and row, the config, the numerics.

## Ids
- prompt_ids ({PROMPT_LEN}, seeded, in [0, {VOCAB})): {g['prompt_ids']}
- generated_ids (greedy, {NUM_NEW}): {g['generated_ids']}

## Checks made when generating
- cached vs one no-cache forward: max |diff| = {g['cached_vs_full_max_abs_diff']:.3e}
- the routing transformers chose equals the formula below re-derived in float64 at every MoE layer and row;
  smallest selection margin (k-th vs (k+1)-th expert, and topk_group-th vs next group): {g['min_router_margin']:.3e}
- smallest greedy margin: {g['min_greedy_margin']:.3e}
- every stored tensor decodes (tools/oracle/quant_formats.py{', and compressed-tensors PackedQuantizationCompressor' if variant == 'int4' else ''}) to exactly the
  weights that made the goldens ({g['stored_tensors_decoded_and_checked']} matrices)
- `DeepseekV3ForCausalLM.from_pretrained(dir, dtype=torch.float64)`: {reload_note(reload, variant)}
- second opinion, numpy only: `python3 tools/oracle/released_ref.py <this folder>` decodes the released files
  itself and recomputes logits, greedy ids and routing with the equations below (agrees to ~1e-6)

## Numerics transformers uses (the engine must match)
""" + "\n".join(f"- {n}" for n in g["numerics"]) + "\n"


def reload_note(reload, variant):
    if not reload["weights_differing"]:
        return "identical weights and identical logits"
    if variant == "fp8":
        return (f"loads (on CPU it dequantizes) but misreads {len(reload['weights_differing'])} partial-block "
                "tensors: transformers' Fp8Dequantize takes the block size as rows // scale_rows (160 // 2 = 80, "
                "not 128). Every other tensor is identical; the reference decoder above is the check.")
    return ("loads everything but the routed experts: its compressed-tensors path does not map the per-expert "
            "`weight_packed` tensors onto DeepseekV3's fused experts (reported UNEXPECTED / MISSING); every "
            "other tensor is identical, and compressed-tensors' own decompressor checks the experts.")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="tests/fixtures")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompt-seed", type=int, default=0)
    ap.add_argument("--variant", choices=sorted(VARIANTS), action="append")
    args = ap.parse_args()
    hg.require_transformers((5, 24))
    hg.setup_torch()
    prompt = torch.randint(0, VOCAB, (PROMPT_LEN,), generator=torch.Generator().manual_seed(args.prompt_seed))
    for variant in args.variant or ["bf16", "fp8", "int4"]:
        make_variant(variant, args.out, prompt, args.seed)
    print("OK")


if __name__ == "__main__":
    main()
