"""K3 checkpoint export and import for the trained models (docs/checkpoint-layout.md, kimi_k3).

`export(model, out_dir, ...)` writes config.json, generation_config.json, the tokenizer files,
sharded safetensors with `model.safetensors.index.json` (or one `model.safetensors`):
  * BF16 (round to nearest even) for every matrix and norm; F32 for the conv weights, A_log (padded
    with zeros from heads to head_dim entries), dt_bias, o_norm and e_score_correction_bias;
  * routed experts in MXFP4, `experts.{E}.{w1,w2,w3}.{weight_packed,weight_scale}` (U8), element 2j in
    the low nibble of byte j, scale byte = exponent + 127, the six tensors of one expert contiguous
    in one shard in the order w1.packed, w1.scale, w2.packed, w2.scale, w3.packed, w3.scale.
The routed expert values are exactly the fake-quantised values the training forward pass used.

`load(dir, dtype)` reads such a directory back into a K3Model (BF16 widened exactly, MXFP4
dequantised), with numpy and this file's own safetensors reader only.
"""

import json
import os
import shutil
import struct

import numpy as np
import torch

from k3model import K3Config, K3Model, mxfp4_quantize

PREFIX = "language_model.model."
HERE = os.path.dirname(os.path.abspath(__file__))
TOKENIZER_DIR = os.path.join(HERE, "tokenizer")
F32_SUFFIXES = ("conv1d.weight", "A_log", "dt_bias", "o_norm.weight", "e_score_correction_bias")
ST_DTYPES = {"BF16": ("<u2", 2), "F32": ("<f4", 4), "U8": ("u1", 1)}


def bf16_bits(x):
    """fp32 -> BF16 bits, round to nearest even (no NaNs occur in trained weights)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_to_f64(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def pack_mxfp4(w):
    """w [rows, cols] torch -> (packed u8 [rows, cols/2], scale u8 [rows, cols/32])."""
    code, e = mxfp4_quantize(w.detach().float().cpu())
    code = code.numpy().astype(np.uint8)
    packed = (code[:, 0::2] | (code[:, 1::2] << 4)).astype(np.uint8)
    scale = (e.numpy() + 127).astype(np.uint8)
    assert scale.min() >= 1 and scale.max() <= 254
    return packed, scale


E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def unpack_mxfp4(packed, scale):
    rows = packed.shape[0]
    codes = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(rows, -1)
    vals = E2M1[codes]
    return vals * np.repeat(np.ldexp(1.0, scale.astype(np.int64) - 127), 32, axis=1)


def config_json(cfg, n_ranks):
    kda = [i for i in range(1, cfg.layers + 1) if i not in cfg.full_attn_layers]
    text = {
        "model_type": "kimi_linear", "hidden_size": cfg.hidden, "num_hidden_layers": cfg.layers,
        "intermediate_size": cfg.dense_inter, "moe_intermediate_size": cfg.moe_inter,
        "routed_expert_hidden_size": cfg.latent, "num_experts": cfg.n_experts,
        "num_experts_per_token": cfg.top_k, "num_shared_experts": cfg.n_shared,
        "num_attention_heads": cfg.mla_heads, "num_key_value_heads": cfg.mla_heads,
        "q_lora_rank": cfg.q_lora, "kv_lora_rank": cfg.kv_lora, "qk_nope_head_dim": cfg.qk_nope,
        "qk_rope_head_dim": cfg.qk_rope, "v_head_dim": cfg.v_head, "vocab_size": cfg.vocab_size,
        "max_position_embeddings": 1048576, "attn_res_block_size": cfg.attn_res_block,
        "first_k_dense_replace": 1, "num_expert_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0,
        "hidden_act": "situ", "activation_situ_beta": cfg.situ_beta,
        "activation_situ_linear_beta": cfg.situ_linear_beta, "moe_router_activation_func": "sigmoid",
        "topk_method": "noaux_tc", "moe_renormalize": True, "latent_moe_use_norm": True,
        "mla_use_nope": True, "mla_use_output_gate": True, "rms_norm_eps": cfg.eps,
        "num_nextn_predict_layers": 0,
        "linear_attn_config": {"head_dim": cfg.kda_head_dim, "num_heads": cfg.kda_heads,
                               "short_conv_kernel_size": cfg.conv_kernel, "kda_layers": kda,
                               "full_attn_layers": list(cfg.full_attn_layers), "use_full_rank_gate": True,
                               "gate_lower_bound": cfg.gate_lower_bound},
    }
    ignore = ["re:.*lm_head$", "re:.*self_attn\\..*", "re:.*mlp\\..*", "re:.*shared_experts\\..*",
              "re:.*block_sparse_moe\\.gate$", "re:.*routed_expert_(down|up)_proj$"]
    return {
        "model_type": "kimi_k3", "dtype": "bfloat16", "tie_word_embeddings": False, "text_config": text,
        "quantization_config": {
            "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
            "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "float", "group_size": 32,
                                                      "symmetric": True, "scale_dtype": "uint8"},
                                          "targets": ["Linear"]}},
            "ignore": ignore},
        "bos_token_id": n_ranks + 0, "eos_token_id": n_ranks + 2, "pad_token_id": n_ranks + 255,
    }


def ckpt_name(key):
    """state_dict key -> checkpoint tensor name (routed experts excepted)."""
    if key == "lm_head.weight":
        return "language_model.lm_head.weight"
    if not key.endswith((".weight", "A_log", "dt_bias", "e_score_correction_bias")):
        key += ".weight"  # bare nn.Parameter norms, AttnRes projections, conv weights
    return PREFIX + key


def tensor_units(model):
    """Yields lists of (name, dtype, ndarray): each list is kept together in one shard."""
    cfg = model.cfg
    sd = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}

    def conv(key):
        t = sd[key]
        if key.endswith("A_log"):
            t = torch.cat([t, torch.zeros(cfg.kda_head_dim - t.numel())])
        name = ckpt_name(key)
        if name.endswith(F32_SUFFIXES):
            return name, "F32", t.numpy().astype(np.float32)
        return name, "BF16", bf16_bits(t.numpy())

    yield [conv("embed_tokens.weight")]
    for L in range(cfg.layers):
        lp = f"layers.{L}."
        yield [conv(k) for k in sd if k.startswith(lp) and ".experts.w" not in k]
        if L > 0:
            ep = f"{lp}block_sparse_moe.experts."
            w = [sd[ep + n] for n in ("w1", "w2", "w3")]
            for e in range(cfg.n_experts):
                unit = []
                for n, m in zip(("w1", "w2", "w3"), w):
                    packed, scale = pack_mxfp4(m[e])
                    base = f"{PREFIX}{ep}{e}.{n}."
                    unit += [(base + "weight_packed", "U8", packed), (base + "weight_scale", "U8", scale)]
                yield unit
    yield [conv(k) for k in ("norm", "output_attn_res_norm", "output_attn_res_proj")]
    yield [conv("lm_head.weight")]


def write_safetensors(path, tensors):
    header, off = {}, 0
    for name, dt, arr in tensors:
        n = arr.nbytes
        header[name] = {"dtype": dt, "shape": list(arr.shape), "data_offsets": [off, off + n]}
        off += n
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for _, dt, arr in tensors:
            f.write(np.ascontiguousarray(arr, dtype=ST_DTYPES[dt][0]).tobytes())
    return off


def export(model, out_dir, max_shard_bytes=15_000_000, tokenizer_dir=TOKENIZER_DIR):
    """Writes the checkpoint directory; returns {'payload_bytes', 'shards', 'tensors'}."""
    os.makedirs(out_dir, exist_ok=True)
    n_ranks = model.cfg.vocab_size - 256
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        f.write(json.dumps(config_json(model.cfg, n_ranks), indent=2) + "\n")
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        f.write(json.dumps({"do_sample": False, "bos_token_id": n_ranks, "eos_token_id": n_ranks + 2,
                            "pad_token_id": n_ranks + 255}, indent=2) + "\n")
    for n in ("tiktoken.model", "tokenizer_config.json"):
        shutil.copyfile(os.path.join(tokenizer_dir, n), os.path.join(out_dir, n))
    shards, cur, cur_bytes = [], [], 0
    for unit in tensor_units(model):
        b = sum(a.nbytes for _, _, a in unit)
        if cur and cur_bytes + b > max_shard_bytes:
            shards.append(cur)
            cur, cur_bytes = [], 0
        cur += unit
        cur_bytes += b
    shards.append(cur)
    total, weight_map = 0, {}
    if len(shards) == 1:
        total = write_safetensors(os.path.join(out_dir, "model.safetensors"), shards[0])
    else:
        for i, sh in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            total += write_safetensors(os.path.join(out_dir, fname), sh)
            weight_map.update({name: fname for name, _, _ in sh})
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            f.write(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    return {"payload_bytes": total, "shards": len(shards), "tensors": sum(len(s) for s in shards)}


# ----------------------------------------------------------------------------------------------
# Import


def read_safetensors(path):
    out = {}
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        data = f.read()
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        b, e = meta["data_offsets"]
        out[name] = (meta["dtype"], np.frombuffer(data[b:e], dtype=ST_DTYPES[meta["dtype"]][0]).reshape(meta["shape"]))
    return out


def config_from_json(root):
    t = root["text_config"]
    lac = t["linear_attn_config"]
    return K3Config(
        vocab_size=t["vocab_size"], hidden=t["hidden_size"], layers=t["num_hidden_layers"],
        full_attn_layers=list(lac["full_attn_layers"]), attn_res_block=t["attn_res_block_size"],
        kda_heads=lac["num_heads"], kda_head_dim=lac["head_dim"], conv_kernel=lac["short_conv_kernel_size"],
        mla_heads=t["num_attention_heads"], q_lora=t["q_lora_rank"], kv_lora=t["kv_lora_rank"],
        qk_nope=t["qk_nope_head_dim"], qk_rope=t["qk_rope_head_dim"], v_head=t["v_head_dim"],
        dense_inter=t["intermediate_size"], n_experts=t["num_experts"], top_k=t["num_experts_per_token"],
        moe_inter=t["moe_intermediate_size"], latent=t["routed_expert_hidden_size"],
        n_shared=t["num_shared_experts"], eps=t["rms_norm_eps"], gate_lower_bound=lac["gate_lower_bound"])


def load(directory, dtype=torch.float64):
    """The checkpoint in `directory` as a K3Model of `dtype` (eval mode)."""
    with open(os.path.join(directory, "config.json")) as f:
        cfg = config_from_json(json.load(f))
    raw = {}
    index = os.path.join(directory, "model.safetensors.index.json")
    files = (sorted(set(json.load(open(index))["weight_map"].values())) if os.path.exists(index)
             else ["model.safetensors"])
    for fn in files:
        raw.update(read_safetensors(os.path.join(directory, fn)))

    def f64(name):
        dt, a = raw.pop(name)
        return bf16_to_f64(a) if dt == "BF16" else a.astype(np.float64)

    model = K3Model(cfg)
    sd = {}
    for key, t in model.state_dict().items():
        if ".experts.w" in key:
            L, n = key.split(".")[1], key.split(".")[-1]
            mats = []
            for e in range(cfg.n_experts):
                base = f"{PREFIX}layers.{L}.block_sparse_moe.experts.{e}.{n}."
                mats.append(unpack_mxfp4(raw.pop(base + "weight_packed")[1], raw.pop(base + "weight_scale")[1]))
            arr = np.stack(mats)
        else:
            arr = f64(ckpt_name(key))
            if key.endswith("A_log"):
                assert not arr[t.numel():].any(), "A_log padding must be zero"
                arr = arr[: t.numel()]
        sd[key] = torch.from_numpy(np.ascontiguousarray(arr).reshape(t.shape))
    assert not raw, f"tensors not consumed: {sorted(raw)[:5]}"
    model.load_state_dict(sd)
    model.prequantized = True
    return model.to(dtype).eval()
