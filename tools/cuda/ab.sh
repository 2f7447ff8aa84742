#!/usr/bin/env bash
# Runs on a GPU machine: an A/B of prebuilt binaries on the K3 bench preset, everything resident. Each binary
# decodes 48 tokens after a 16-token prompt REPS times, the binaries interleaved so that drift hits all alike.
# Prints every run (median step, device->device copy probe), then each binary's median step and the ratio to
# the bound (bytes a token / the probe's median over all runs).
# Usage: tools/cuda/ab.sh OUTDIR REPS BINARY...
set -uo pipefail
OUT=$1; REPS=$2; shift 2
source "$(dirname "$0")/env.sh"
mkdir -p "$OUT"
b=$(checkpoint "$1" kimi_k3 bench)
RUNS=$OUT/ab.txt; : >"$RUNS"
for _ in $(seq "$REPS"); do
  for bin in "$@"; do
    line=$(timeout 60 "$bin" run --model "$b" --device cuda --expert-cache 12G --probe-bandwidth \
      --prompt-ids "$(seq -s, 1 16)" --max-new 48 --ignore-eos 2>&1 >/dev/null |
      grep -oE "device->device [0-9.]+ GB/s|median step [0-9.]+ ms|spine [0-9.]+ MB/token|experts [0-9.]+ MB/token|[Ee]rror.*" | tr '\n' ' ')
    echo "$bin: $line" | tee -a "$RUNS"
  done
done
python3 - "$RUNS" "$@" <<'PY'
import re, statistics, sys
runs = open(sys.argv[1]).read().splitlines()
probe = [float(x) for l in runs for x in re.findall(r"device->device ([0-9.]+)", l)]
mb = [float(a) + float(b) for l in runs for a, b in re.findall(r"spine ([0-9.]+) MB/token experts ([0-9.]+) MB/token", l)]
bound = statistics.median(mb) / statistics.median(probe) if probe and mb else None  # MB / (GB/s) = ms
if bound:
    print(f"bound {statistics.median(mb):.1f} MB a token / {statistics.median(probe):.1f} GB/s "
          f"(device->device probe, median of {len(probe)} runs) = {bound:.4f} ms")
for b in sys.argv[2:]:
    steps = [float(x) for l in runs if l.startswith(b + ":") for x in re.findall(r"median step ([0-9.]+)", l)]
    if not steps:
        print(f"{b}: no run finished")
        continue
    m = statistics.median(steps)
    print(f"{b}: median step {m:.3f} ms over {len(steps)} runs" + (f", {m / bound:.2f} x the bound" if bound else ""))
PY
