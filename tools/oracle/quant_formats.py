"""Encoders and reference decoders of the released quantized weight formats (see docs/checkpoint-layout.md).

Each encoder returns the stored tensors; the matching decoder gives the float64 weight the golden model uses, which
is exact: scales carry few significant bits, so every value x scale product is a BF16 value.

- FP8 block (DeepSeek-V3 / Kimi K2): float8_e4m3fn weight [rows, cols] and F32 weight_scale_inv
  [ceil(rows/128), ceil(cols/128)]; w[i, j] = fp8[i, j] * scale_inv[i // 128, j // 128] (the last block of a
  dimension that is not a multiple of 128 is partial). As DeepSeek's inference/kernel.py weight_dequant.
- INT4 pack-quantized (compressed-tensors, Kimi K2 Thinking experts): symmetric int4 q in [-8, 7], group 32 along
  the input dimension; weight_packed I32 [rows, cols/8]: element j of a row is (q + 8) in bits 4*(j%8).. of word
  j//8 (least significant nibble first); weight_scale BF16 [rows, cols/32]; w = q * scale[row, j // 32].
- MXFP4 (gpt-oss): e2m1 values in U8 *_blocks [..., rows, cols/32, 16] (element 2k in the low nibble of byte k,
  2k+1 in the high nibble) and U8 E8M0 *_scales [..., rows, cols/32]: w = fp4 * 2^(scale - 127).
"""

import math

import torch

FP8_BLOCK = 128
FP8_MAX = 448.0
INT4_GROUP = 32
MXFP4_GROUP = 32
FP4_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def _round_up_bits(x, bits):
    """x (> 0) rounded up to `bits` significant bits, as float64.

    Scales with few significant bits make every decoded weight (a 4-bit FP8 or INT4 magnitude times the scale)
    exactly representable in BF16, so the goldens hold whether an engine decodes in float64, float32 or to BF16
    (as DeepSeek's weight_dequant and compressed-tensors' decompressor do)."""
    m, e = torch.frexp(x.double())
    return torch.ldexp(torch.ceil(m * 2.0**bits) / 2.0**bits, e)


# ---- FP8 e4m3 with 128x128 block scales -------------------------------------------------------------------------


def fp8_block_encode(w):
    rows, cols = w.shape
    gr, gc = math.ceil(rows / FP8_BLOCK), math.ceil(cols / FP8_BLOCK)
    amax = torch.zeros(gr, gc, dtype=torch.float32)
    for bi in range(gr):
        for bj in range(gc):
            blk = w[bi * FP8_BLOCK:(bi + 1) * FP8_BLOCK, bj * FP8_BLOCK:(bj + 1) * FP8_BLOCK]
            amax[bi, bj] = float(blk.abs().max())
    scale_inv = _round_up_bits(amax.double().clamp_min(1e-12) / FP8_MAX, 4).float()
    full = _expand_blocks(scale_inv.double(), rows, cols)
    q = (w.double() / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale_inv


def fp8_block_decode(q, scale_inv):
    rows, cols = q.shape
    return q.double() * _expand_blocks(scale_inv.double(), rows, cols)


def _expand_blocks(s, rows, cols):
    return s.repeat_interleave(FP8_BLOCK, 0)[:rows].repeat_interleave(FP8_BLOCK, 1)[:, :cols]


# ---- INT4 symmetric, group 32, packed into int32 (compressed-tensors pack-quantized) -------------------------------


def int4_pack_encode(w):
    rows, cols = w.shape
    assert cols % INT4_GROUP == 0
    g = w.double().reshape(rows, cols // INT4_GROUP, INT4_GROUP)
    # compressed-tensors' symmetric minmax scale amax / 7.5, stored as BF16
    scale = _round_up_bits((g.abs().amax(-1) / 7.5).clamp_min(1e-12), 5).to(torch.bfloat16)
    q = (g / scale.double()[..., None]).round().clamp(-8, 7).to(torch.int64).reshape(rows, cols)
    u = (q + 8).reshape(rows, cols // 8, 8)
    packed = torch.zeros(rows, cols // 8, dtype=torch.int64)
    for k in range(8):
        packed |= u[..., k] << (4 * k)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    return packed, scale, torch.tensor([rows, cols], dtype=torch.int64)


def int4_pack_decode(packed, scale, shape):
    rows, cols = (int(x) for x in shape)
    p = packed.to(torch.int64) & 0xFFFFFFFF
    q = torch.stack([(p >> (4 * k)) & 0xF for k in range(8)], dim=-1).reshape(rows, cols) - 8
    return q.double() * scale.double().repeat_interleave(INT4_GROUP, 1)


# ---- MXFP4 (OCP microscaling: e2m1 values, one E8M0 scale per 32) ----------------------------------------------------


def mxfp4_encode(w):
    """w [..., rows, cols] -> blocks U8 [..., rows, cols/32, 16], scales U8 [..., rows, cols/32]."""
    *lead, cols = w.shape
    assert cols % MXFP4_GROUP == 0
    g = w.double().reshape(*lead, cols // MXFP4_GROUP, MXFP4_GROUP)
    amax = g.abs().amax(-1).clamp_min(2.0**-120)
    exp = torch.ceil(torch.log2(amax / 6.0)).to(torch.int64)  # |w| / 2^exp <= 6, the largest e2m1 magnitude
    x = g / torch.pow(2.0, exp.double())[..., None]
    lut = torch.tensor(FP4_VALUES, dtype=torch.float64)
    idx = (x[..., None] - lut).abs().argmin(-1)  # nearest e2m1 code (ties: the lower code, +0 before -0)
    idx = idx.reshape(*lead, cols // MXFP4_GROUP, MXFP4_GROUP // 2, 2)
    blocks = (idx[..., 0] | (idx[..., 1] << 4)).to(torch.uint8)
    return blocks, (exp + 127).to(torch.uint8)


def mxfp4_decode(blocks, scales):
    b = blocks.to(torch.int64)
    lut = torch.tensor(FP4_VALUES, dtype=torch.float64)
    vals = torch.stack([lut[b & 0xF], lut[b >> 4]], dim=-1).reshape(*b.shape[:-1], -1)
    vals = vals * torch.pow(2.0, scales.to(torch.float64) - 127)[..., None]
    return vals.reshape(*vals.shape[:-2], -1)
