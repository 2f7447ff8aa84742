#!/usr/bin/env bash
# Runs on a GPU machine with the prebuilt binary: CPU vs CUDA logits on the tiny and small presets of every
# family (MODELS; DeepSeek-V3 and Kimi K2 in each of their stored formats) and the released-format fixtures against
# transformers' goldens, reproducibility, the engine's paths on the GPU (speculative decoding, chat, serve), then decode
# benchmarks (resident and streamed experts) with the copy probes. TESTS, needed unless MODE is bench: the GPU
# tests' binary (crates/cuda/tests/gpu.rs; `cargo test --release -p deltafin-cuda --test gpu --no-run` names it).
# Usage: tools/cuda/verify.sh BINARY OUTDIR [correctness|bench|all] [TESTS]
set -uo pipefail
BIN=$(realpath "$1"); OUT=$2; MODE=${3:-all}; TESTS=${4:-}
MODELS=${MODELS:-kimi_k3 kimi_linear deepseek_v3:fp8 deepseek_v3:bf16 kimi_k2:int4 gpt_oss}
mkdir -p "$OUT"
REPORT=$OUT/report.txt
log() { echo "$@" | tee -a "$REPORT"; }

source "$(dirname "$0")/env.sh"
# The released-format fixtures with their transformers goldens, from the repository root or a folder under it.
FIXTURES=""; for d in . .. ../.. ../../..; do [ -d "$d/tests/fixtures" ] && FIXTURES=$d/tests/fixtures && break; done
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
  for model in $MODELS; do for preset in tiny small; do
    arch=${model%%:*}; quant=${model#$arch}; quant=${quant#:}
    m=$(checkpoint "$BIN" $arch $preset $quant)
    name=$arch${quant:+-$quant}
    "$BIN" run --model "$m" --prompt-ids $PROMPT --max-new $NEW --ignore-eos --print-ids --dump-logits "$W/$name-$preset-cpu.npy" >"$W/cpu.txt" 2>"$W/cpu.err"
    t0=$(date +%s.%N)
    "$BIN" run --model "$m" --device cuda --prompt-ids $PROMPT --max-new $NEW --ignore-eos --print-ids --dump-logits "$W/$name-$preset-gpu.npy" >"$W/gpu.txt" 2>"$W/gpu.err"
    rc=$?
    if [ $rc -ne 0 ]; then log "FAIL $name $preset: cuda run exited $rc"; cat "$W/gpu.err" | tee -a "$REPORT"; fail=1; continue; fi
    "$BIN" run --model "$m" --device cuda --prompt-ids $PROMPT --max-new $NEW --ignore-eos --dump-logits "$W/$name-$preset-gpu2.npy" >/dev/null 2>&1
    log "$name $preset: cpu ids $(tail -1 "$W/cpu.txt") | cuda ids $(tail -1 "$W/gpu.txt")"
    python3 tools/cuda/compare.py "$W/$name-$preset-cpu.npy" "$W/$name-$preset-gpu.npy" 12 "$name-$preset" 2>&1 | tee -a "$REPORT" || fail=1
    if cmp -s "$W/$name-$preset-gpu.npy" "$W/$name-$preset-gpu2.npy"; then log "  reproducible: two CUDA runs bit-identical"; else log "  NOT reproducible across CUDA runs"; fail=1; fi
    # Every expert streamed through a VRAM budget of a few records (waves, copies from the RAM cache): the same bits.
    vram=16K; [ "$preset" = small ] && vram=2M
    "$BIN" run --model "$m" --device cuda --expert-vram $vram --prompt-ids $PROMPT --max-new $NEW --ignore-eos --dump-logits "$W/$name-$preset-gpu3.npy" >/dev/null 2>&1
    if cmp -s "$W/$name-$preset-gpu.npy" "$W/$name-$preset-gpu3.npy"; then log "  streamed (--expert-vram $vram): bit-identical to resident"; else log "  streamed (--expert-vram $vram) DIFFERS from resident"; fail=1; fi
    tail -1 "$W/gpu.err" | tee -a "$REPORT"
  done; done
  # transformers' float64 goldens of the DeepSeek-V3 / Kimi K2 fixtures (crates/cli/tests/golden_deepseek.rs):
  # prompt and generated ids as one CUDA prefill, each golden row within 1e-4 relative, the same argmax.
  for f in deepseek_v3_tiny_bf16 deepseek_v3_tiny_fp8 kimi_k2_tiny_int4; do
    d=$FIXTURES/$f
    ids=$(python3 -c 'import json, sys; g = json.load(open(sys.argv[1])); print(",".join(map(str, g["prompt_ids"] + g["generated_ids"])))' "$d/golden.json")
    if "$BIN" run --model "$d" --device cuda --prompt-ids "$ids" --max-new 1 --ignore-eos --dump-logits "$W/$f-gpu.npy" >/dev/null 2>"$W/gpu.err"; then
      python3 - "$d/golden_logits.npy" "$W/$f-gpu.npy" "$f" <<'PY' 2>&1 | tee -a "$REPORT" || fail=1
import json, sys
import numpy as np
gold, ours = np.load(sys.argv[1]), np.load(sys.argv[2])
rel = [float(np.abs(gold[i] - ours[i]).max() / np.abs(gold[i]).max()) for i in range(len(gold))]
same = all(int(gold[i].argmax()) == int(ours[i].argmax()) for i in range(len(gold)))
ok = len(ours) >= len(gold) and max(rel) <= 1e-4 and same
print(json.dumps({"golden": sys.argv[3], "rows": len(gold), "max_rel": max(rel), "same_argmax_all_rows": same, "pass": ok}))
sys.exit(0 if ok else 1)
PY
    else
      log "FAIL $f golden: cuda run"; cat "$W/gpu.err" | tee -a "$REPORT"; fail=1
    fi
  done
  # A context longer than mla_attend's chunk of positions (512): its chunked softmax and context, prompt and decode.
  m=$(checkpoint "$BIN" kimi_k3 tiny)
  LONG=$(seq -s, 1 700)
  "$BIN" run --model "$m" --prompt-ids "$LONG" --max-new 4 --ignore-eos --dump-logits "$W/long-cpu.npy" >/dev/null 2>&1
  if "$BIN" run --model "$m" --device cuda --prompt-ids "$LONG" --max-new 4 --ignore-eos --dump-logits "$W/long-gpu.npy" >/dev/null 2>"$W/gpu.err"; then
    python3 tools/cuda/compare.py "$W/long-cpu.npy" "$W/long-gpu.npy" 700 "kimi_k3-tiny, 700-token prompt" 2>&1 | tee -a "$REPORT" || fail=1
  else
    log "FAIL kimi_k3 tiny, 700-token prompt: cuda run"; cat "$W/gpu.err" | tee -a "$REPORT"; fail=1
  fi
  # gpt-oss small's sliding layers see 128 positions: a 200-token prompt and its decode steps pass the window
  # (tiny's window of 6 is passed by the 12-token prompt above).
  m=$(checkpoint "$BIN" gpt_oss small)
  LONG=$(seq -s, 1 200)
  "$BIN" run --model "$m" --prompt-ids "$LONG" --max-new 4 --ignore-eos --dump-logits "$W/oss-long-cpu.npy" >/dev/null 2>&1
  if "$BIN" run --model "$m" --device cuda --prompt-ids "$LONG" --max-new 4 --ignore-eos --dump-logits "$W/oss-long-gpu.npy" >/dev/null 2>"$W/gpu.err"; then
    python3 tools/cuda/compare.py "$W/oss-long-cpu.npy" "$W/oss-long-gpu.npy" 200 "gpt_oss-small, 200-token prompt" 2>&1 | tee -a "$REPORT" || fail=1
  else
    log "FAIL gpt_oss small, 200-token prompt: cuda run"; cat "$W/gpu.err" | tee -a "$REPORT"; fail=1
  fi
  # The released MXFP4 fixture on CUDA against transformers' float64 goldens (as golden_gpt_oss.rs checks the CPU):
  # row r < P is golden row r, the row choosing generated token j golden row P − 1 + j.
  fx=$FIXTURES/gpt_oss_tiny_mxfp4
  if [ ! -f "$fx/golden.json" ]; then
    log "FAIL: tests/fixtures/gpt_oss_tiny_mxfp4 not found at or above $PWD"; fail=1
  else
    read -r fp fn < <(python3 -c "import json,sys; g=json.load(open(sys.argv[1])); print(','.join(map(str,g['prompt_ids'])), len(g['generated_ids']))" "$fx/golden.json")
    if "$BIN" run --model "$fx" --device cuda --prompt-ids "$fp" --max-new "$fn" --ignore-eos --dump-logits "$W/fixture-gpu.npy" >/dev/null 2>"$W/gpu.err"; then
      python3 - "$fx" "$W/fixture-gpu.npy" <<'PY' 2>&1 | tee -a "$REPORT" || fail=1
import json, sys
import numpy as np
g = json.load(open(f"{sys.argv[1]}/golden.json"))
gold, ours = np.load(f"{sys.argv[1]}/golden_logits.npy"), np.load(sys.argv[2])
p, gen = len(g["prompt_ids"]), g["generated_ids"]
rel = [float(np.abs(ours[r] - gold[r if r < p else r - 1]).max() / np.abs(gold[r if r < p else r - 1]).max())
       for r in range(len(ours))]
tokens = [int(ours[p + j].argmax()) for j in range(len(gen))]
ok = len(ours) == p + len(gen) and max(rel) <= 1e-4 and tokens == gen
print(json.dumps({"model": "gpt_oss_tiny_mxfp4 fixture on CUDA vs transformers", "rows": len(ours),
                  "max_rel": max(rel), "greedy_tokens_equal": tokens == gen, "pass": ok}))
sys.exit(0 if ok else 1)
PY
    else
      log "FAIL gpt-oss fixture: cuda run"; cat "$W/gpu.err" | tee -a "$REPORT"; fail=1
    fi
  fi
  cp "$W"/kimi_k3-small-*.npy "$OUT/" 2>/dev/null

  log "== a partial remote mirror on the GPU (a local range server, a spine-only fetch)"
  for arch in kimi_k3 kimi_linear; do
    m=$(checkpoint "$BIN" $arch tiny)
    port=18440; [ $arch = kimi_linear ] && port=18441
    python3 tools/bench/slow_server.py "$m" $port 0 >/dev/null 2>&1 &
    hpid=$!
    for _ in $(seq 50); do curl -sf -o /dev/null -r 0-0 "http://127.0.0.1:$port/config.json" && break; sleep 0.1; done
    mm=$W/$arch-mirror; rm -rf "$mm"
    "$BIN" fetch --from "http://127.0.0.1:$port" --out "$mm" --spine-only >/dev/null 2>"$W/fetch.err" || { log "FAIL $arch: spine-only fetch"; cat "$W/fetch.err" | tee -a "$REPORT"; fail=1; }
    # Offline, with no expert local: refused with the CPU's message, nothing computed from the sparse files' holes.
    "$BIN" run --model "$mm" --offline --device cuda --prompt-ids $PROMPT --max-new 2 >/dev/null 2>"$W/off-gpu.err"; rg=$?
    "$BIN" run --model "$mm" --offline --prompt-ids $PROMPT --max-new 2 >/dev/null 2>"$W/off-cpu.err"; rc=$?
    if [ $rg -ne 0 ] && [ $rc -ne 0 ] && grep -q "not in the local cache" "$W/off-gpu.err"; then log "  $arch: --offline with missing experts refused on CUDA as on the CPU"; else log "  $arch: --offline with missing experts NOT refused like the CPU (cuda exit $rg)"; cat "$W/off-gpu.err" | tee -a "$REPORT"; fail=1; fi
    "$BIN" run --model "$mm" --device cuda --prompt-ids $PROMPT --max-new $NEW --ignore-eos --dump-logits "$W/$arch-mirror-gpu.npy" >/dev/null 2>"$W/mirror.err" || { log "FAIL $arch: cuda run on the mirror"; tail -3 "$W/mirror.err" | tee -a "$REPORT"; fail=1; }
    "$BIN" run --model "$m" --device cuda --prompt-ids $PROMPT --max-new $NEW --ignore-eos --dump-logits "$W/$arch-local-gpu.npy" >/dev/null 2>&1
    if cmp -s "$W/$arch-mirror-gpu.npy" "$W/$arch-local-gpu.npy"; then log "  $arch: CUDA on a spine-only mirror bit-identical to the local run"; else log "  $arch: CUDA on a spine-only mirror DIFFERS from the local run"; fail=1; fi
    kill $hpid; wait $hpid 2>/dev/null
  done

  log "== the backend's GPU tests (crates/cuda/tests/gpu.rs)"
  if [ -z "$TESTS" ]; then
    log "FAIL: no GPU test binary given (the 4th argument)"; fail=1
  elif "$TESTS" --ignored --test-threads 1 >"$W/gpu-tests.txt" 2>&1; then
    grep -E "^test |^test result" "$W/gpu-tests.txt" | tee -a "$REPORT"
  else
    log "FAIL: the GPU tests"; tail -30 "$W/gpu-tests.txt" | tee -a "$REPORT"; fail=1
  fi

  log "== the engine on the GPU: speculative decoding, chat, serve (kimi_k3)"
  for preset in tiny small; do
    m=$W/kimi_k3-$preset
    # The model itself as a greedy drafter (on the CPU), sampled and greedy, and prompt lookup on a prompt that
    # repeats: sampled, many guesses are refused, so checking passes (several rows) and rollbacks to each row
    # both run; the bits must not move, and no refusal may re-run the model.
    for d in "sampled $m --temperature 0.8 --seed 3" "greedy $m --temperature 0" "ngram ngram --temperature 0.8 --seed 3"; do
      read -r name draft sampling <<<"$d"
      s="--prompt-ids $PROMPT,$PROMPT,$PROMPT --max-new 24 --ignore-eos $sampling"
      "$BIN" run --model "$m" --device cuda $s --dump-logits "$W/plain.npy" >/dev/null 2>&1
      "$BIN" run --model "$m" --device cuda $s --draft "$draft" --draft-tokens 3 --draft-fixed --stats --dump-logits "$W/spec.npy" >/dev/null 2>"$W/spec.err"
      if cmp -s "$W/plain.npy" "$W/spec.npy"; then log "  $preset $name: speculative bit-identical to plain CUDA decoding"; else log "  $preset $name: speculative DIFFERS from plain CUDA decoding"; fail=1; fi
      grep -q "+ 0 re-runs" "$W/spec.err" || { log "  $preset $name: the model was re-run after a refusal"; fail=1; }
      grep -E "^\[(speculative|cuda)\]" "$W/spec.err" | tee -a "$REPORT"
    done
  done
  m=$W/kimi_k3-tiny
  for dev in cpu cuda; do
    printf 'Hello there\nAnd once more\n' | "$BIN" chat --model "$m" --device $dev --max-new 12 >"$W/chat-$dev.txt" 2>"$W/chat-$dev.err"
    log "  chat --device $dev: exit $?"
  done
  if cmp -s "$W/chat-cpu.txt" "$W/chat-cuda.txt"; then log "  chat: CUDA replies equal the CPU's (greedy)"; else log "  chat: CUDA replies differ from the CPU's (a near tie, or a failure: see $OUT)"; cp "$W"/chat-* "$OUT/"; fi
  # The same completion twice: the second resumes from the prefix cache's fork of the first prompt's session.
  "$BIN" serve --model "$m" --device cuda --port 18431 >"$W/serve.log" 2>&1 &
  spid=$!
  for _ in $(seq 100); do curl -sf http://127.0.0.1:18431/health >/dev/null && break; sleep 0.2; done
  req='{"model": "kimi_k3-tiny", "prompt": [3,17,42,99,7,256,12,5], "max_tokens": 8, "temperature": 0}'
  for i in 1 2; do curl -s http://127.0.0.1:18431/v1/completions -H 'Content-Type: application/json' -d "$req" >"$W/serve-$i.json"; done
  kill $spid; wait $spid
  python3 - "$W/serve-1.json" "$W/serve-2.json" <<'PY' 2>&1 | tee -a "$REPORT" || fail=1
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:])
cached = b["usage"]["prompt_tokens_details"]["cached_tokens"]
ok = a["choices"][0]["text"] == b["choices"][0]["text"] and cached > 0
print(f"  serve --device cuda: second request cached {cached} prompt tokens, same text: {ok}")
sys.exit(0 if ok else 1)
PY
  # Three sampled completions at once (batched passes: one session's rows beside the others'), then one at a
  # time: the same texts and log-probabilities, bit for bit; the metrics show that passes were shared.
  "$BIN" serve --model "$m" --device cuda --port 18432 --prefix-cache-mb 0 >"$W/serve-b.log" 2>&1 &
  spid=$!
  for _ in $(seq 100); do curl -sf http://127.0.0.1:18432/health >/dev/null && break; sleep 0.2; done
  breq() { echo "{\"model\": \"kimi_k3-tiny\", \"prompt\": [3,17,42,$1,7,256], \"max_tokens\": 12, \"temperature\": 0.9, \"seed\": $1, \"logprobs\": 2}"; }
  pids=""
  for i in 1 2 3; do
    curl -s http://127.0.0.1:18432/v1/completions -H 'Content-Type: application/json' -d "$(breq $i)" >"$W/batch-$i.json" &
    pids="$pids $!"
  done
  wait $pids
  for i in 1 2 3; do curl -s http://127.0.0.1:18432/v1/completions -H 'Content-Type: application/json' -d "$(breq $i)" >"$W/alone-$i.json"; done
  curl -s http://127.0.0.1:18432/metrics >"$W/batch-metrics.txt"
  kill $spid; wait $spid
  python3 - "$W" <<'PY' 2>&1 | tee -a "$REPORT" || fail=1
import json, re, sys
w = sys.argv[1]
same = all(json.load(open(f"{w}/batch-{i}.json"))["choices"][0] == json.load(open(f"{w}/alone-{i}.json"))["choices"][0]
           for i in (1, 2, 3))
m = open(f"{w}/batch-metrics.txt").read()
get = lambda name: float(re.search(rf"^{name} (\S+)", m, re.M).group(1))
passes, gens = get("deltafin_batched_passes_total"), get("deltafin_batched_generations_total")
print(f"  serve --device cuda, 3 requests at once: the same choices as one at a time: {same}; "
      f"{gens:.0f} generation pieces in {passes:.0f} passes")
sys.exit(0 if same and gens > passes else 1)
PY
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
  m=$(checkpoint "$BIN" kimi_k3 small)
  bench "K3 small, CPU" "$m" --expert-cache 1G --stats
  bench "K3 small, CUDA, experts resident" "$m" --device cuda --expert-cache 1G --probe-bandwidth
  bench "K3 small, CUDA, 8 MiB expert VRAM (streaming from RAM)" "$m" --device cuda --expert-cache 1G --expert-vram 8M
  # The 10 GB bench preset only when time is left (device time is scarce): make-model ~1 min, 2 runs.
  if { [ "$MODE" = all ] || [ "$MODE" = bench ]; } && [ "$SECONDS" -lt "${BENCH_DEADLINE:-90}" ]; then
    t0=$(date +%s); b=$(checkpoint "$BIN" kimi_k3 bench)
    if [ ! -f "$b/config.json" ]; then
      log "make-model bench: not made in $(( $(date +%s) - t0 )) s"
    else
      bench "K3 bench (17.5 MB records), CUDA, resident" "$b" --device cuda --expert-cache 12G --probe-bandwidth
      bench "K3 bench, CUDA, 1 GiB expert VRAM (streaming from RAM)" "$b" --device cuda --expert-cache 12G --expert-vram 1G --probe-bandwidth
    fi
  fi
fi
log "== done (fail=$fail)"
exit $fail
