#!/usr/bin/env bash
# Runs on a GPU machine: do candidate binaries compute the same bits as a reference? Each binary dumps its CUDA
# logits (12-token prompt, 8 greedy decode steps) on the tiny and small presets of both families, and on the tiny
# ones a 60-token prompt whose 10 decode steps outgrow the MLA caches' first 64 positions; every dump must equal
# the reference's byte for byte. A kernel change that keeps each value's arithmetic keeps them equal.
# Usage: tools/cuda/same.sh OUTDIR REFERENCE BINARY...   (exit 1 when any differs or fails)
set -uo pipefail
OUT=$1; REF=$2; shift 2
source "$(dirname "$0")/env.sh"
mkdir -p "$OUT"
fail=0
short="--prompt-ids 3,17,42,99,7,256,12,5,64,33,1,200 --max-new 8"
long="--prompt-ids $(seq -s, 101 160) --max-new 10"
for arch in kimi_k3 kimi_linear; do for preset in tiny small; do for run in short long; do
  [ $run = long ] && [ $preset != tiny ] && continue
  m=$(checkpoint "$REF" $arch $preset)
  i=0
  for bin in "$REF" "$@"; do
    # shellcheck disable=SC2086
    "$bin" run --model "$m" --device cuda ${!run} --ignore-eos --dump-logits "$OUT/$arch-$preset-$run-$i.npy" \
      >/dev/null 2>"$OUT/err.txt" || { echo "$bin on $arch $preset ($run) failed:"; tail -3 "$OUT/err.txt"; fail=1; }
    if [ $i -gt 0 ]; then
      if cmp -s "$OUT/$arch-$preset-$run-0.npy" "$OUT/$arch-$preset-$run-$i.npy"; then echo "$arch $preset $run: $bin the same"
      else echo "$arch $preset $run: $bin DIFFERS"; fail=1; fi
    fi
    i=$((i + 1))
  done
done; done; done
exit $fail
