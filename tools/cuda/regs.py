#!/usr/bin/env python3
"""Registers, spills and static shared memory of every kernel, as NVRTC's ptxas reports them for a GPU
architecture, on any machine with libnvrtc (no GPU needed; test.sh installs it under target/nvrtc).

The routed-expert kernels are bound by how many of their blocks an SM holds: on the H200 expert_up_mx's 768
blocks (16 K3 experts x 48) and expert_down_mx's 896 run in one wave at 80 and 72 registers (6 and 7 blocks of
128 threads an SM); every variant measured with more registers was slower (BENCHMARKS.md, CUDA). Check a kernel
change here before taking it to the GPU.

Usage: LD_LIBRARY_PATH=target/nvrtc/nvidia/cu13/lib tools/cuda/regs.py [--arch sm_90] [-DNAME=VALUE ...]
"""
import argparse
import ctypes
import pathlib
import re
import sys

SOURCE = pathlib.Path(__file__).resolve().parents[2] / "crates/cuda/src/kernels.cu"
# The options of crates/cuda/src/gpu.rs::compile_options, which decide the code ptxas sees.
OPTIONS = ["--fmad=false", "--ftz=false", "--prec-div=true", "--prec-sqrt=true", "--ptxas-options=-v"]


def load_nvrtc():
    for name in ("libnvrtc.so.13", "libnvrtc.so.12"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            pass
    sys.exit("libnvrtc.so.13 (or .12) not found: run test.sh once (it installs it) and add "
             "target/nvrtc/nvidia/cu13/lib to LD_LIBRARY_PATH")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="sm_90", help="a real architecture (sm_80, sm_90, ...)")
    args, defines = ap.parse_known_args()
    bad = [d for d in defines if not d.startswith("-D")]
    if bad:
        sys.exit(f"unknown arguments {bad}: pass defines as -DNAME=VALUE")
    nvrtc = load_nvrtc()
    prog = ctypes.c_void_p()
    src = SOURCE.read_bytes()
    if nvrtc.nvrtcCreateProgram(ctypes.byref(prog), src, b"deltafin_kernels.cu", 0, None, None) != 0:
        sys.exit("nvrtcCreateProgram failed")
    opts = [f"--gpu-architecture={args.arch}", *OPTIONS, *defines]
    arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    rc = nvrtc.nvrtcCompileProgram(prog, len(opts), arr)
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetProgramLog(prog, log)
    text = log.value.decode(errors="replace")
    if rc != 0:
        sys.exit(f"NVRTC rejected the kernels ({args.arch}):\n{text}")
    kernel, rows = None, {}
    for line in text.splitlines():
        if m := re.search(r"Compiling entry function '(\w+)'", line):
            kernel = m.group(1)
        elif kernel and (m := re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)):
            rows.setdefault(kernel, {})["spill"] = f"{m.group(1)}/{m.group(2)}"
        elif kernel and (m := re.search(r"Used (\d+) registers", line)):
            smem = re.search(r"(\d+) bytes smem", line)
            rows.setdefault(kernel, {}).update(regs=int(m.group(1)), smem=int(smem.group(1)) if smem else 0)
    print(f"{'kernel':20} {'registers':>9} {'spill st/ld B':>13} {'static smem B':>13}")
    for k in sorted(rows):
        r = rows[k]
        print(f"{k:20} {r.get('regs', '?'):>9} {r.get('spill', '0/0'):>13} {r.get('smem', 0):>13}")


if __name__ == "__main__":
    main()
