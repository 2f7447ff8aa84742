#!/usr/bin/env bash
# Runs on a GPU machine: where a resident decode step's time goes, by leaving kernels out. BINARY must be built
# from a scratch copy with tools/cuda/knockout.patch applied (never on main: its output is wrong by design): it
# skips the launches named in DELTAFIN_SKIP (kernel names, or mm:ROWSxCOLS for a spine matrix shape) and with
# DELTAFIN_SHAPES lists the shapes. Each set runs once on the K3 bench preset (48 decode steps); what a set saves
# against the runs without one is its kernels' cost on the critical path, programmatic launch included.
# Usage: tools/cuda/knockout.sh BINARY OUTDIR [SET...]   (default sets: each kernel kind, all matrices, the spine)
set -uo pipefail
BIN=$1; OUT=$2; shift 2
source "$(dirname "$0")/env.sh"
mkdir -p "$OUT"
m=$(checkpoint "$BIN" kimi_k3 bench)
args=(run --model "$m" --device cuda --expert-cache 12G --prompt-ids "$(seq -s, 1 16)" --ignore-eos)
DELTAFIN_SHAPES=1 "$BIN" "${args[@]}" --max-new 2 2>&1 >/dev/null | grep '^mm:' | sort | uniq -c >"$OUT/shapes.txt"
mm=$(awk '{print $2}' "$OUT/shapes.txt" | paste -sd,)
small=attn_res_mix,kda_recurrence,mla_append,mla_attend,moe_combine,mlp_up_act,embed_rows
[ $# -gt 0 ] || set -- attn_res_mix kda_recurrence mla_attend mlp_up_act moe_combine expert_up_mx expert_down_mx \
  expert_up_mx,expert_down_mx $(awk '{print $2}' "$OUT/shapes.txt") "$mm" "$mm,$small"
: >"$OUT/runs.txt"
for s in "" "$@" ""; do
  t=$(DELTAFIN_SKIP="$s" timeout 60 "$BIN" "${args[@]}" --max-new 48 2>&1 >/dev/null | grep -oE 'median step [0-9.]+' | cut -d' ' -f3)
  echo "${t:-failed} [$s]" | tee -a "$OUT/runs.txt"
done
python3 - "$OUT/runs.txt" <<'PY'
import re, statistics, sys
runs = [re.match(r"(\S+) \[(.*)\]$", l).groups() for l in open(sys.argv[1]).read().splitlines()]
base = statistics.median(float(t) for t, s in runs if s == "")
print(f"without knock-outs: {base:.3f} ms")
for t, s in runs:
    if s and t != "failed":
        print(f"{1000 * (base - float(t)):7.1f} us saved by skipping {s}")
PY
