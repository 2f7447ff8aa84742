"""Checkpoint I/O for the float64 reference, in numpy only.

Independent of the engine: safetensors is parsed from its definition (8-byte little-endian header
length, a JSON header mapping names to {dtype, shape, data_offsets}, then the data block, offsets
relative to its start), and MXFP4 is decoded from the contract's section 3.

`write_safetensors` exists for the self-test's random fixtures; the reference itself only reads.
"""

import json
import os
import struct

import numpy as np

# safetensors dtype -> (numpy storage dtype, item size). BF16 is stored as raw uint16 bits.
_STORAGE = {
    "BF16": np.dtype("<u2"),
    "F16": np.dtype("<f2"),
    "F32": np.dtype("<f4"),
    "F64": np.dtype("<f8"),
    "U8": np.dtype("u1"),
    "I8": np.dtype("i1"),
    "I32": np.dtype("<i4"),
    "I64": np.dtype("<i8"),
}


def bf16_bits_to_f64(bits):
    """BF16 -> float64 exactly: the 16 bits become the top half of an fp32 (contract notation)."""
    bits = np.asarray(bits, dtype=np.uint16)
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def f64_to_bf16_bits(x):
    """float64 -> BF16 bits, round to nearest even via fp32 (self-test fixtures only)."""
    f = np.asarray(x, dtype=np.float32)
    u = f.view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return u.astype(np.uint16)


def _read_header(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n).decode("utf-8"))
    header.pop("__metadata__", None)
    return header, 8 + n


class Checkpoint:
    """Name -> tensor access over one `model.safetensors` or an index + shards.

    `raw(name)` returns the stored array (BF16 as uint16 bits, U8 as uint8); `f64(name)` widens
    float tensors to float64 (BF16 exactly, F16/F32 exactly).
    """

    def __init__(self, directory):
        self.directory = directory
        index = os.path.join(directory, "model.safetensors.index.json")
        single = os.path.join(directory, "model.safetensors")
        if os.path.exists(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            files = sorted(set(weight_map.values()))
        elif os.path.exists(single):
            weight_map, files = None, ["model.safetensors"]
        else:
            raise FileNotFoundError(f"{directory}: no model.safetensors(.index.json)")
        self.entries = {}  # name -> (path, dtype, shape, absolute start, absolute end)
        for fname in files:
            path = os.path.join(directory, fname)
            header, data_start = _read_header(path)
            size = os.path.getsize(path)
            for name, meta in header.items():
                if weight_map is not None and weight_map.get(name) != fname:
                    continue
                b, e = meta["data_offsets"]
                dt = meta["dtype"]
                if dt not in _STORAGE:
                    raise ValueError(f"{name}: unsupported dtype {dt}")
                n_items = int(np.prod(meta["shape"], dtype=np.int64))
                if e - b != n_items * _STORAGE[dt].itemsize or data_start + e > size:
                    raise ValueError(f"{name}: data_offsets inconsistent with dtype/shape/file")
                self.entries[name] = (path, dt, tuple(meta["shape"]), data_start + b, data_start + e)
        if weight_map is not None:
            missing = set(weight_map) - set(self.entries)
            if missing:
                raise ValueError(f"index names tensors absent from their shard: {sorted(missing)[:5]}")

    def __contains__(self, name):
        return name in self.entries

    def dtype(self, name):
        return self.entries[name][1]

    def shape(self, name):
        return self.entries[name][2]

    def raw(self, name):
        path, dt, shape, start, end = self.entries[name]
        with open(path, "rb") as f:
            f.seek(start)
            buf = f.read(end - start)
        return np.frombuffer(buf, dtype=_STORAGE[dt]).reshape(shape)

    def f64(self, name):
        dt = self.dtype(name)
        a = self.raw(name)
        if dt == "BF16":
            return bf16_bits_to_f64(a)
        if dt in ("F16", "F32", "F64"):
            return a.astype(np.float64)
        raise ValueError(f"{name}: dtype {dt} is not a float tensor")


# E2M1 magnitudes for nibble values 0..7; bit 3 is the sign (nibble 8 is -0).
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
MXFP4_GROUP = 32


def _e2m1(nibble):
    return -E2M1[nibble & 7] if nibble & 8 else E2M1[nibble & 7]


# Byte -> (element 2j from the LOW nibble, element 2j+1 from the HIGH nibble).
_BYTE_PAIRS = np.array([[_e2m1(b & 0x0F), _e2m1(b >> 4)] for b in range(256)])


def dequant_mxfp4(packed, scale):
    """MXFP4 (contract section 3) -> float64 [rows, 2*packed_cols].

    Byte j of a row holds element 2j in its LOW nibble and 2j+1 in its HIGH nibble; one e8m0 scale
    byte s per 32 consecutive inputs of a row, value 2^(s-127).
    Decision: s = 255 (NaN in the OCP spec, never in K3) is rejected with an error, not propagated.
    """
    packed = np.asarray(packed, dtype=np.uint8)
    scale = np.asarray(scale, dtype=np.uint8)
    rows, half = packed.shape
    cols = 2 * half
    if scale.shape != (rows, cols // MXFP4_GROUP) or cols % MXFP4_GROUP:
        raise ValueError(f"mxfp4: packed {packed.shape} vs scale {scale.shape}")
    if np.any(scale == 255):
        raise ValueError("mxfp4: scale byte 255 (NaN) present")
    vals = _BYTE_PAIRS[packed].reshape(rows, cols)
    factor = np.ldexp(1.0, scale.astype(np.int64) - 127)  # 2^(s-127), exact in float64
    return vals * np.repeat(factor, MXFP4_GROUP, axis=1)


def write_safetensors(path, tensors):
    """Write {name: (dtype_str, ndarray of storage values)} in insertion order (self-test only)."""
    header, blobs, off = {}, [], 0
    for name, (dt, arr) in tensors.items():
        data = np.ascontiguousarray(arr, dtype=_STORAGE[dt]).tobytes()
        header[name] = {"dtype": dt, "shape": list(arr.shape), "data_offsets": [off, off + len(data)]}
        blobs.append(data)
        off += len(data)
    hbytes = json.dumps(header).encode("utf-8")
    hbytes += b" " * (-len(hbytes) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hbytes)))
        f.write(hbytes)
        for b in blobs:
            f.write(b)
