#!/usr/bin/env bash
# Runs on a GPU machine with the prebuilt binary: CPU vs CUDA logits on the tiny and small presets of both
# families, reproducibility, then decode benchmarks (resident and streamed experts) with the copy probes.
# Usage: tools/cuda/verify.sh BINARY OUTDIR [correctness|bench|all]
set -uo pipefail
BIN=$(realpath "$1"); OUT=$2; MODE=${3:-all}
W=/tmp/deltafin-cuda-verify; mkdir -p "$W" "$OUT"
REPORT=$OUT/report.txt
log() { echo "$@" | tee -a "$REPORT"; }

# The CUDA libraries: the driver's libcuda and NVRTC (toolkit first, then any pip wheel).
for d in /usr/local/cuda/lib64 /usr/local/cuda-13*/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/local/nvidia/lib64; do
  [ -d "$d" ] && LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$d"
done
if ! ls ${LD_LIBRARY_PATH//:/ } 2>/dev/null | grep -q libnvrtc.so; then
  n=$(find / -name 'libnvrtc.so.1[23]' -not -path '/proc/*' 2>/dev/null | head -1)
  [ -n "$n" ] && LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$(dirname "$n")"
fi
export LD_LIBRARY_PATH
log "== environment"; log "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | tee -a "$REPORT"
ldd "$BIN" 2>&1 | tee -a "$REPORT"
"$BIN" --version 2>&1 | tee -a "$REPORT" || { log "FATAL: the binary does not run here"; exit 1; }
nproc | tee -a "$REPORT"

PROMPT=3,17,42,99,7,256,12,5,64,33,1,200
NEW=8
fail=0
if [ "$MODE" != bench ]; then
  log "== correctness: CPU vs CUDA logits (prompt 12 tokens, 8 greedy decode steps)"
  for arch in kimi_k3 kimi_linear; do for preset in tiny small; do
    m=$W/$arch-$preset
    [ -f "$m/config.json" ] || "$BIN" make-model --arch $arch --preset $preset --seed 0 --out "$m" >/dev/null
    "$BIN" run --model "$m" --prompt-ids $PROMPT --max-new $NEW --ignore-eos --print-ids --dump-logits "$W/$arch-$preset-cpu.npy" >"$W/cpu.txt" 2>"$W/cpu.err"
    t0=$(date +%s.%N)
    "$BIN" run --model "$m" --device cuda --prompt-ids $PROMPT --max-new $NEW --ignore-eos --print-ids --dump-logits "$W/$arch-$preset-gpu.npy" >"$W/gpu.txt" 2>"$W/gpu.err"
    rc=$?
    if [ $rc -ne 0 ]; then log "FAIL $arch $preset: cuda run exited $rc"; cat "$W/gpu.err" | tee -a "$REPORT"; fail=1; continue; fi
    "$BIN" run --model "$m" --device cuda --prompt-ids $PROMPT --max-new $NEW --ignore-eos --dump-logits "$W/$arch-$preset-gpu2.npy" >/dev/null 2>&1
    log "$arch $preset: cpu ids $(tail -1 "$W/cpu.txt") | cuda ids $(tail -1 "$W/gpu.txt")"
    python3 tools/cuda/compare.py "$W/$arch-$preset-cpu.npy" "$W/$arch-$preset-gpu.npy" 12 "$arch-$preset" 2>&1 | tee -a "$REPORT" || fail=1
    if cmp -s "$W/$arch-$preset-gpu.npy" "$W/$arch-$preset-gpu2.npy"; then log "  reproducible: two CUDA runs bit-identical"; else log "  NOT reproducible across CUDA runs"; fail=1; fi
    # Every expert streamed through a VRAM budget of a few records (waves, copies from the RAM cache): the same bits.
    vram=16K; [ "$preset" = small ] && vram=2M
    "$BIN" run --model "$m" --device cuda --expert-vram $vram --prompt-ids $PROMPT --max-new $NEW --ignore-eos --dump-logits "$W/$arch-$preset-gpu3.npy" >/dev/null 2>&1
    if cmp -s "$W/$arch-$preset-gpu.npy" "$W/$arch-$preset-gpu3.npy"; then log "  streamed (--expert-vram $vram): bit-identical to resident"; else log "  streamed (--expert-vram $vram) DIFFERS from resident"; fail=1; fi
    tail -1 "$W/gpu.err" | tee -a "$REPORT"
  done; done
  cp "$W"/kimi_k3-small-*.npy "$OUT/" 2>/dev/null
fi

if [ "$MODE" != correctness ]; then
  log "== decode benchmarks"
  IDS=$(seq -s, 1 16)
  bench() { # label model args...
    local label=$1 m=$2; shift 2
    log "-- $label: deltafin run --model $(basename "$m") --prompt-ids 1..16 --max-new 48 --ignore-eos $*"
    timeout 60 "$BIN" run --model "$m" --prompt-ids "$IDS" --max-new 48 --ignore-eos "$@" >/dev/null 2>"$W/b.err"
    grep -E "^\[(cuda|probe|stats)\]" "$W/b.err" | tee -a "$REPORT"
    grep -iE "^error" "$W/b.err" | tee -a "$REPORT"
  }
  m=$W/kimi_k3-small
  [ -f "$m/config.json" ] || "$BIN" make-model --arch kimi_k3 --preset small --seed 0 --out "$m" >/dev/null
  bench "K3 small, CPU" "$m" --expert-cache 1G --stats
  bench "K3 small, CUDA, experts resident" "$m" --device cuda --expert-cache 1G --probe-bandwidth
  bench "K3 small, CUDA, 8 MiB expert VRAM (streaming from RAM)" "$m" --device cuda --expert-cache 1G --expert-vram 8M
  # The 10 GB bench preset only when time is left (device time is scarce): make-model ~1 min, 2 runs.
  if { [ "$MODE" = all ] || [ "$MODE" = bench ]; } && [ "$SECONDS" -lt "${BENCH_DEADLINE:-90}" ]; then
    b=$W/kimi_k3-bench
    if [ ! -f "$b/config.json" ]; then
      t0=$(date +%s); timeout 70 "$BIN" make-model --arch kimi_k3 --preset bench --seed 0 --out "$b" >/dev/null 2>&1; log "make-model bench: rc $? in $(( $(date +%s) - t0 )) s"
    fi
    if [ -f "$b/config.json" ]; then
      bench "K3 bench (17.5 MB records), CUDA, resident" "$b" --device cuda --expert-cache 12G --probe-bandwidth
      bench "K3 bench, CUDA, 1 GiB expert VRAM (streaming from RAM)" "$b" --device cuda --expert-cache 12G --expert-vram 1G --probe-bandwidth
    fi
  fi
fi
log "== done (fail=$fail)"
exit $fail
