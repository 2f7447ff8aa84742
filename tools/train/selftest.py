#!/usr/bin/env python3
"""Self-test of the training code on the CPU (seconds): run before spending device time.

    python3 tools/train/selftest.py [--engine /path/to/deltafin]

1. KDA chunkwise form == the contract's step-by-step recurrence (float64, several chunk sizes, T not
   a multiple of the chunk).
2. MXFP4: pack -> tools/reference/ckpt.dequant_mxfp4 (an independent decoder) == fake_mxfp4 values.
3. A tiny randomly initialised K3Model -> export -> load: logits equal the model's own (with
   quantised experts and BF16-rounded weights), and tools/reference/reference.py (float64 numpy)
   agrees with the PyTorch model on the exported directory.
4. With --engine: deltafin's logits on the exported directory agree within 1e-4 relative.
"""

import argparse
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch

sys.dont_write_bytecode = True
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tools", "reference"))
import export  # noqa: E402
from k3model import K3Config, K3Model, fake_mxfp4, kda_chunked, kda_recurrent  # noqa: E402

TINY = K3Config(vocab_size=4352, hidden=64, layers=5, full_attn_layers=[4, 5], attn_res_block=2,
                kda_heads=2, kda_head_dim=32, mla_heads=2, q_lora=32, kv_lora=32, qk_nope=16, qk_rope=16,
                v_head=16, dense_inter=128, n_experts=8, top_k=2, moe_inter=32, latent=32)


def rel(a, b):
    """Max over rows of max|a - b| / max|b| (the project's exactness measure)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b).max(-1) / np.abs(b).max(-1)))


def check_kda():
    g = torch.Generator().manual_seed(1)
    B, H, T, K, V = 2, 3, 45, 16, 8
    q = torch.nn.functional.normalize(torch.randn(B, H, T, K, generator=g, dtype=torch.float64), dim=-1) / 4
    k = torch.nn.functional.normalize(torch.randn(B, H, T, K, generator=g, dtype=torch.float64), dim=-1)
    v = torch.randn(B, H, T, V, generator=g, dtype=torch.float64)
    gl = -5 * torch.sigmoid(torch.randn(B, H, T, K, generator=g, dtype=torch.float64) * 2 - 2)
    beta = torch.sigmoid(torch.randn(B, H, T, generator=g, dtype=torch.float64))
    ref, _ = kda_recurrent(q, k, v, gl, beta)
    for c in (1, 4, 16, 32, 64):
        err = (kda_chunked(q, k, v, gl, beta, chunk=c) - ref).abs().max().item()
        assert err < 1e-12, (c, err)
    print(f"kda: chunked == recurrent (max err {err:.1e})")


def check_mxfp4():
    from ckpt import dequant_mxfp4
    g = torch.Generator().manual_seed(2)
    w = torch.randn(48, 96, generator=g) * torch.exp(torch.randn(48, 1, generator=g))
    w[3, :32] = 0.0
    w[5, 7] = 1e-30
    packed, scale = export.pack_mxfp4(w)
    ref = dequant_mxfp4(packed, scale)
    fq = fake_mxfp4(w).double().numpy()
    assert np.array_equal(ref, fq), np.abs(ref - fq).max()
    assert np.array_equal(export.unpack_mxfp4(packed, scale), ref)
    err = np.abs(fq - w.double().numpy()).max(-1) / np.abs(w.double().numpy()).max(-1).clip(1e-30)
    print(f"mxfp4: packer == reference decoder == fake quant; max relative row error {err.max():.3f}")


def perturbed_tiny(seed):
    torch.manual_seed(seed)
    m = K3Model(TINY)
    m.init_weights(seed)
    with torch.no_grad():  # move everything off its initial value so every tensor is exercised
        for n, p in m.named_parameters():
            if p.dim() == 1 or n.endswith("_res_proj"):
                p.add_(torch.randn_like(p) * (0.3 if "res_proj" in n or "A_log" in n else 0.1))
            else:
                p.mul_(3.0)
        for _, moe in m.moe_layers():
            moe.gate.e_score_correction_bias.copy_(torch.randn(TINY.n_experts) * 0.05)
    return m


def check_export(engine):
    model = perturbed_tiny(3)
    ids = [int(x) for x in torch.randint(0, 4096, (40,), generator=torch.Generator().manual_seed(4))]
    with tempfile.TemporaryDirectory() as d:
        info = export.export(model, d, max_shard_bytes=64 << 10)
        assert info["shards"] > 1
        back = export.load(d)
        with torch.no_grad():
            got = back(torch.tensor([ids]))[0].numpy()
            rec = back(torch.tensor([ids]), recurrent=True)[0].numpy()
        assert rel(got, rec) < 1e-12
        dense = back(torch.tensor([ids]))[0].detach().numpy()  # grad enabled: every expert, masked
        assert rel(got, dense) < 1e-12, rel(got, dense)
        import reference
        refm = reference.Model(d)
        ref = refm.forward(ids)
        r = rel(got, ref)
        assert r < 1e-9, r
        print(f"export: {info['shards']} shards, {info['tensors']} tensors; torch(float64) vs "
              f"tools/reference: {r:.1e}")
        # the exported model equals the trained one up to the BF16 rounding of non-expert weights
        with torch.no_grad():
            orig = model.double()(torch.tensor([ids]), quant=True)[0].numpy()
        print(f"export: BF16 rounding of non-expert weights moves logits by {rel(got, orig):.1e} (relative; "
              "large here because these random, scaled-up weights route chaotically; ~1e-4 in ppl on the trained model)")
        if engine:
            out = os.path.join(d, "engine.npy")
            subprocess.run([engine, "run", "--model", d, "--prompt-ids", ",".join(map(str, ids[:-1])),
                            "--max-new", "1", "--ignore-eos", "--dump-logits", out], check=True,
                           stdout=subprocess.DEVNULL)
            eng = np.load(out)[: len(ids) - 1]
            r = rel(eng, got[: len(ids) - 1])
            print(f"engine: deltafin vs torch(float64): {r:.2e}")
            assert r < 1e-4, r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", help="deltafin binary")
    args = ap.parse_args()
    torch.set_num_threads(1)
    check_kda()
    check_mxfp4()
    check_export(args.engine)
    print("selftest: ok")


if __name__ == "__main__":
    main()
