#!/usr/bin/env python3
"""Golden logits, tokens and chat prompts for `deltafin make-model --arch qwen3_moe --preset tiny`, computed by
transformers.

The checkpoint is make-model's own output (config.json, shards + index, tokenizer.json, tokenizer_config.json
with Qwen3's chat template, generation_config.json), so the fixture also proves that transformers reads that
layout as a Qwen3-MoE release: every weight, the tokenizer and the template.

Procedure:
 1. `deltafin make-model --arch qwen3_moe --preset tiny --seed S --out OUT` (S from --seed upwards).
 2. Load it with Qwen3MoeForCausalLM.from_pretrained (float64, eager attention and experts): no missing or
    unexpected keys; every loaded weight equals the BF16 stored one (experts after transformers' own fusing
    into gate_up_proj / down_proj).
 3. The prompt is transformers' chat prompt for one user message; prefill it with the cache, then 8 cached
    greedy decode steps; cross-check with one no-cache forward; require decisive routing (k-th vs (k+1)-th
    router logit) and greedy choices, else try seed S + 1.
 4. Check that the per-head q/k norms, norm_topk_prob and the dense layer all change the logits.
 5. Record transformers' tokenizer ids for a few texts (without special-token names: transformers matches
    them in any text, deltafin only in template text) and its chat-template ids for a few conversations
    (assistant turns with `reasoning_content`: dropped from earlier turns, a <think> block in the last), for
    the engine's tokenizer and template to match.

Regenerate (needs torch, transformers >= 5.24, safetensors, numpy; CPU, seconds) from the repository root:

    cargo build --release -p deltafin && python3 tools/oracle/qwen3_moe_golden.py --out tests/fixtures/qwen3_moe_tiny_bf16
"""

import argparse
import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import hf_golden as hg  # noqa: E402  (sets the offline/CPU environment before torch is imported)
import torch  # noqa: E402
from transformers import AutoTokenizer, Qwen3MoeForCausalLM  # noqa: E402

REGEN_COMMAND = ("cargo build --release -p deltafin && "
                 "python3 tools/oracle/qwen3_moe_golden.py --out tests/fixtures/qwen3_moe_tiny_bf16")
NUM_NEW = 8
ROUTER_MARGIN_MIN = 1e-3
GREEDY_MARGIN_MIN = 1e-3
CACHED_VS_FULL_MAX = 1e-6  # float64 model, but RMSNorm's variance and the RoPE angles run in float32
MAX_ATTEMPTS = 50
PROMPT_MESSAGES = [{"role": "user", "content": "Why is the sky blue?"}]

TOKENIZER_TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.\n\n  It's 2025, isn't it?",
    "def f(x):\n    return x * 42  # answer\n",
    "naïve café — 東京 🙂",
]

CHAT_CASES = [
    {"messages": PROMPT_MESSAGES, "add_generation_prompt": True},
    {"messages": [{"role": "system", "content": "You are terse."},
                  {"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": "Hello.", "reasoning_content": "The user greets."},
                  {"role": "user", "content": "And now?"}],
     "add_generation_prompt": True},
    {"messages": [{"role": "user", "content": "2+2?"},
                  {"role": "assistant", "content": "4", "reasoning_content": "Add."}],
     "add_generation_prompt": False},
]


def make_model(deltafin, seed, out):
    if os.path.isdir(out):
        shutil.rmtree(out)
    subprocess.run([deltafin, "make-model", "--arch", "qwen3_moe", "--preset", "tiny", "--seed", str(seed),
                    "--out", out], check=True, stdout=subprocess.DEVNULL)


def load(out):
    model, info = Qwen3MoeForCausalLM.from_pretrained(out, dtype=torch.float64, attn_implementation="eager",
                                                      experts_implementation="eager", output_loading_info=True)
    for k in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        hg.check(not info.get(k), f"from_pretrained {k}: {info.get(k)}")
    return model.eval()


def check_weights(model, out):
    """Every loaded weight is the stored BF16 value; experts are stacked by transformers as [E, 2I, H] / [E, H, I]."""
    stored = hg.read_checkpoint(out)
    for name, t in stored.items():
        hg.check(t.dtype == torch.bfloat16, f"{name} is {t.dtype}, not BF16")
    sd = model.state_dict()
    n = 0
    for name, t in sd.items():
        if name.endswith("mlp.experts.gate_up_proj") or name.endswith("mlp.experts.down_proj"):
            p = name.rsplit(".", 1)[0]
            for e in range(t.shape[0]):
                if name.endswith("gate_up_proj"):
                    want = torch.cat([stored[f"{p}.{e}.gate_proj.weight"], stored[f"{p}.{e}.up_proj.weight"]])
                else:
                    want = stored[f"{p}.{e}.down_proj.weight"]
                hg.check(torch.equal(t[e], want.double()), f"{name}[{e}] differs from the stored experts")
                n += 1
        else:
            hg.check(torch.equal(t, stored[name].double()), f"{name} differs from the stored tensor")
            n += 1
    return n


class RouterProbe:
    """Re-derives each router's choice in float64 (softmax over all experts, top k, renormalised), requires
    transformers' choice and weights, records margins (k-th vs (k+1)-th logit) and routing."""

    def __init__(self, model, cfg):
        self.k, self.on = cfg.num_experts_per_tok, False
        self.margins, self.routing = [], {}
        self.handles = []
        for i, layer in enumerate(model.model.layers):
            if hasattr(layer.mlp, "gate"):
                self.handles.append(layer.mlp.gate.register_forward_hook(self._hook(i)))

    def _hook(self, layer):
        def hook(module, args, output):
            if not self.on:
                return
            logits, scores, indices = output
            top = logits.double().topk(self.k + 1, dim=-1)
            ours = top.indices[:, :self.k]
            hg.check(torch.equal(ours, indices), f"layer {layer}: routing re-derivation differs from transformers")
            p = torch.softmax(logits.double(), dim=-1).gather(1, ours)
            w = p / p.sum(-1, keepdim=True)
            # transformers takes this softmax in float32 whatever the model's dtype.
            hg.check(torch.allclose(w, scores.double(), rtol=1e-6, atol=0), f"layer {layer}: routing weights")
            hg.record_top_k(self.routing, self.margins, layer, top, self.k, w)

        return hook

    def remove(self):
        for h in self.handles:
            h.remove()


def search_seed(deltafin, out, first_seed):
    for seed in range(first_seed, first_seed + MAX_ATTEMPTS):
        make_model(deltafin, seed, out)
        tok = AutoTokenizer.from_pretrained(out)
        prompt = torch.tensor(tok.apply_chat_template(PROMPT_MESSAGES, add_generation_prompt=True, tokenize=True,
                                                      return_dict=False), dtype=torch.long)
        model = load(out)
        probe = RouterProbe(model, model.config)
        probe.on = True
        logits, generated, nxt, gm = hg.run_cached(model, prompt, NUM_NEW)
        probe.on = False
        seq = torch.cat([prompt, torch.tensor(generated)])
        full = hg.run_full(model, seq)
        probe.remove()
        mr, mg = min(probe.margins), min(gm)
        ok = mr > ROUTER_MARGIN_MIN and mg > GREEDY_MARGIN_MIN
        print(f"seed {seed}: router margin {mr:.3e}, greedy margin {mg:.3e} -> {'ok' if ok else 'retry'}", flush=True)
        if ok:
            return seed, tok, model, prompt, logits, generated, nxt, gm, seq, full, mr, probe.routing
    hg.fail(f"no seed in {MAX_ATTEMPTS} gave decisive routing and greedy choices")


@torch.no_grad()
def feature_effects(model, seq, full):
    """How much the logits move without each Qwen3 feature: all must matter on this checkpoint."""
    effects = {}
    norms = [p for layer in model.model.layers for p in (layer.self_attn.q_norm.weight, layer.self_attn.k_norm.weight)]
    saved = [p.clone() for p in norms]
    for p in norms:
        p.fill_(1.0)
    effects["max_abs_change_with_unit_qk_norm_weights"] = float((hg.run_full(model, seq) - full).abs().max())
    for p, v in zip(norms, saved):
        p.copy_(v)
    for layer in model.model.layers:
        if hasattr(layer.mlp, "gate"):
            layer.mlp.gate.norm_topk_prob = False
    effects["max_abs_change_without_norm_topk_prob"] = float((hg.run_full(model, seq) - full).abs().max())
    for layer in model.model.layers:
        if hasattr(layer.mlp, "gate"):
            layer.mlp.gate.norm_topk_prob = True
    dense = [layer.mlp for layer in model.model.layers if not hasattr(layer.mlp, "gate")]
    hg.check(len(dense) == 1, f"expected one dense layer, found {len(dense)}")
    saved = dense[0].down_proj.weight.clone()
    dense[0].down_proj.weight.zero_()
    effects["max_abs_change_without_the_dense_mlp"] = float((hg.run_full(model, seq) - full).abs().max())
    dense[0].down_proj.weight.copy_(saved)
    hg.check(torch.equal(hg.run_full(model, seq), full), "restoring the weights did not restore the logits")
    for k, v in effects.items():
        hg.check(v > 0.1, f"{k}: the feature barely matters ({v})")
    return effects


def tokenizer_cases(tok):
    texts = [{"text": t, "ids": tok.encode(t, add_special_tokens=False)} for t in TOKENIZER_TEXTS]
    for case in texts:
        hg.check(tok.decode(case["ids"]) == case["text"], f"decode(encode({case['text']!r})) differs")
    chats = []
    for case in CHAT_CASES:
        text = tok.apply_chat_template(case["messages"], add_generation_prompt=case["add_generation_prompt"],
                                       tokenize=False)
        ids = tok.apply_chat_template(case["messages"], add_generation_prompt=case["add_generation_prompt"],
                                      tokenize=True, return_dict=False)
        chats.append(dict(case, text=text, ids=list(ids)))
    hg.check("<think>\nThe user greets." not in chats[1]["text"], "old reasoning was not dropped from history")
    hg.check("<think>\nAdd.\n</think>\n\n4" in chats[2]["text"], "the last reply lost its reasoning")
    return texts, chats


NUMERICS = [
    "RMSNorm: w * x * rsqrt(mean(x^2) + eps), eps = rms_norm_eps (1e-6) (transformers: variance in float32), for "
    "input_layernorm, post_attention_layernorm, norm and the per-head q_norm / k_norm over head_dim.",
    "Attention: q/k/v/o projections without bias; head_dim 32 (4 heads * 32 = 128 != hidden 64); GQA, 2 query "
    "heads per KV head; q = q_norm(q_proj x) and k = k_norm(k_proj x) per head, then RoPE; scale head_dim^-0.5; "
    "plain causal softmax (no sinks, no sliding window: use_sliding_window false).",
    "RoPE: rotate-half pairs (x[i], x[i + d/2]), angle pos * theta^(-2i/d), theta 1e6, no scaling; inv_freq and "
    "angles in float32.",
    "Router: logits = x W^T (no bias); p = softmax over all 16 experts; the top 4 p; divided by their sum "
    "(norm_topk_prob true). transformers takes this softmax (and so the weights) in float32 even in a float64 "
    "model.",
    "Experts: down(silu(gate x) * up x); MoE output = sum_i w_i out_i; layer 1 is in mlp_only_layers: a dense "
    "SwiGLU MLP of intermediate_size 96 instead.",
    "Residuals: h += attn(input_layernorm(h)); h += ffn(post_attention_layernorm(h)); logits = lm_head(norm(h)), "
    "untied.",
]


def readme(g):
    return f"""# qwen3_moe_tiny_bf16: golden logits from Hugging Face transformers

`deltafin make-model --arch qwen3_moe --preset tiny --seed {g['weight_seed']}`, unchanged: a tiny
`Qwen3MoeForCausalLM` in Qwen3-30B-A3B's released layout (all BF16; experts as `mlp.experts.E.{{down,gate,up}}_proj`;
a byte-level BPE `tokenizer.json` with Qwen's pre-tokenizer and added tokens; Qwen3's chat template with its
`<think>` handling; generation_config eos `<|im_end|>`, `<|endoftext|>`). 4 layers, GQA with q/k norms, 16 experts
top-4 with norm_topk_prob, layer 1 dense (`mlp_only_layers`).

Generated by `tools/oracle/qwen3_moe_golden.py` with transformers {g['versions']['transformers']}, torch
{g['versions']['torch']}, in float64 on CPU. Regenerate (needs torch, transformers >= 5.24, safetensors, numpy)
from the repository root with:

    {REGEN_COMMAND}

CI needs no torch: it only reads these files.

## Files
- make-model's checkpoint: `config.json`, `generation_config.json`, `tokenizer.json`, `tokenizer_config.json`,
  three shards and `model.safetensors.index.json`.
- `golden_logits.npy`: float32 `{g['logits_shape']}`: row t = logits after token t of `prompt_ids +
  generated_ids`, one cached prefill then {NUM_NEW} cached single-token steps; computed in float64, stored as float32.
- `golden.json`: ids, versions, margins, routing per MoE layer and row, tokenizer and chat-template cases, numerics.

## Ids
- prompt_ids (transformers' chat prompt for {PROMPT_MESSAGES}): {g['prompt_ids']}
- generated_ids (greedy, {NUM_NEW}): {g['generated_ids']}

## Checks made when generating
- from_pretrained reports no missing, unexpected or mismatched keys; {g['tensors_checked']} loaded tensors (experts
  one by one) equal the stored BF16 values
- cached vs one no-cache forward: max |diff| = {g['cached_vs_full_max_abs_diff']:.3e}
- transformers' routing equals softmax + top-k + renormalisation re-derived in float64; smallest k-th vs (k+1)-th
  router logit margin {g['min_router_margin']:.3e}; smallest greedy margin {g['min_greedy_margin']:.3e}
- the logits move by {g['feature_effects']['max_abs_change_with_unit_qk_norm_weights']:.3g} with unit q/k norm
  weights, {g['feature_effects']['max_abs_change_without_norm_topk_prob']:.3g} without norm_topk_prob and
  {g['feature_effects']['max_abs_change_without_the_dense_mlp']:.3g} without the dense layer's MLP
- transformers' tokenizer decodes each of its encodings back to the text; its chat template drops the reasoning
  of earlier turns and keeps the last reply's

## Numerics transformers uses (the engine must match)
""" + "\n".join(f"- {n}" for n in g["numerics"]) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="tests/fixtures/qwen3_moe_tiny_bf16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--deltafin", default="target/release/deltafin")
    args = ap.parse_args()
    hg.require_transformers((5, 24))
    hg.setup_torch()
    seed, tok, model, prompt, logits, generated, nxt, gm, seq, full, min_router, routing = search_seed(
        args.deltafin, args.out, args.seed)
    cvf = hg.check_cached_vs_full(logits, full, len(prompt), generated, CACHED_VS_FULL_MAX)
    checked = check_weights(model, args.out)
    effects = feature_effects(model, seq, full)
    texts, chats = tokenizer_cases(tok)
    golden = {
        "description": "Golden logits for qwen3_moe_tiny_bf16 (deltafin make-model's tiny qwen3_moe), computed by "
                       "transformers' Qwen3MoeForCausalLM in float64 on CPU (eager attention and experts), and its "
                       "tokenizer's and chat template's ids. See README.md.",
        "generator": "tools/oracle/qwen3_moe_golden.py",
        "command": REGEN_COMMAND,
        "versions": hg.versions(),
        "weight_seed": seed,
        "prompt_messages": PROMPT_MESSAGES,
        "prompt_ids": prompt.tolist(),
        "generated_ids": generated,
        "next_id_after_generated": nxt,
        "sequence_ids": seq.tolist(),
        "logits_file": "golden_logits.npy",
        "logits_shape": list(logits.shape),
        "logits_rows": "row t = logits after token t of sequence_ids; one cached prefill over the prompt, then one "
                       f"single-token cached forward per generated id; generated_ids[i] = argmax(row {len(prompt) - 1}"
                       " + i). Computed in float64, stored as float32.",
        "cached_vs_full_max_abs_diff": cvf,
        "min_router_margin": min_router,
        "router_margin_threshold": ROUTER_MARGIN_MIN,
        "min_greedy_margin": min(gm),
        "greedy_margins": gm,
        "routing": routing,
        "routing_note": "per MoE layer (0-based), per row of sequence_ids (cached passes): chosen experts sorted "
                        "ascending and their renormalised weights",
        "feature_effects": effects,
        "tensors_checked": checked,
        "tokenizer_cases": texts,
        "chat_cases": chats,
        "numerics": NUMERICS,
    }
    sizes = hg.save_goldens(args.out, logits, golden, readme(golden))
    print(f"files {sizes} total {sum(sizes.values())}\ngenerated {generated}\nOK", flush=True)


if __name__ == "__main__":
    main()
