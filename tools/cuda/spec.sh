#!/usr/bin/env bash
# Runs on a GPU machine: speculative against plain decoding on the built-in trained model, issue 27's (d). Each
# round runs, 200 greedy tokens each with --stats: on `ROMEO:` plain then the trained drafter; on a document
# quoted back (a passage, then its first two lines again) plain then --draft ngram. Rounds interleave the runs so
# that drift hits all alike. Every speculative run's text must equal its plain run's. Prints each run, then per
# case the median decode tok/s and its ratio to plain, bytes read per generated token, guesses taken, re-runs.
# Usage: tools/cuda/spec.sh OUTDIR BINARY MODEL_DIR DRAFTER_DIR [REPS=5] [FLAGS OF THE SPECULATIVE RUNS...]
set -uo pipefail
OUT=$1; BIN=$2; MODEL=$3; DRAFTER=$4; REPS=${5:-5}; shift $(($# < 5 ? $# : 5))
source "$(dirname "$0")/env.sh"
mkdir -p "$OUT"
RUNS=$OUT/spec.txt; : >"$RUNS"
QUOTE="Two households, both alike in dignity,
In fair Verona, where we lay our scene,
From ancient grudge break to new mutiny,
Where civil blood makes civil hands unclean.
From forth the fatal loins of these two foes
A pair of star-cross'd lovers take their life;
Whose misadventured piteous overthrows
Do with their death bury their parents' strife.

Two households, both alike in dignity,
In fair Verona, where we lay our scene,
"
fail=0
one() {  # CASE NAME PROMPT [FLAGS...]
  local case=$1 name=$2 prompt=$3; shift 3
  timeout 120 "$BIN" run --model "$MODEL" --device cuda --prompt "$prompt" --max-new 200 --ignore-eos --stats \
    "$@" >"$OUT/$case-$name.out" 2>"$OUT/$case-$name.err"
  echo "$case $name: $(grep -E '^\[(stats|speculative)\]' "$OUT/$case-$name.err" | tr '\n' ' ')" >>"$RUNS"
  if [ "$name" != plain ] && ! cmp -s "$OUT/$case-plain.out" "$OUT/$case-$name.out"; then
    echo "$case $name: the text DIFFERS from plain decoding's" | tee -a "$RUNS"; fail=1
  fi
}
for _ in $(seq "$REPS"); do
  one drafter plain "ROMEO:"
  one drafter drafter "ROMEO:" --draft "$DRAFTER" "$@"
  one quote plain "$QUOTE"
  one quote ngram "$QUOTE" --draft ngram "$@"
done
python3 - "$RUNS" <<'PY'
import re, statistics, sys
runs = open(sys.argv[1]).read().splitlines()
def med(case, name, pat):
    v = [float(m) for l in runs if l.startswith(f"{case} {name}:") for m in re.findall(pat, l)]
    return (statistics.median(v), v) if v else (None, v)
for case, spec in [("drafter", "drafter"), ("quote", "ngram")]:
    dec = r"decode [0-9]+ tok [0-9.]+s \(([0-9.]+) tok/s\)"
    base, _ = med(case, "plain", dec)
    for name in ["plain", spec]:
        tps, all_ = med(case, name, dec)
        if tps is None:
            print(f"{case} {name}: no run finished"); continue
        # The spine is resident on the GPU: the line names the experts' bytes only.
        spine, _ = med(case, name, r"spine ([0-9.]+) MB")
        experts, _ = med(case, name, r"experts ([0-9.]+) MB")
        line = f"{case:8} {name:8} median {tps:8.1f} tok/s ({tps / base:.2f}x plain) | read/token spine {spine or 0:.3f} + experts {experts:.3f} MB"
        if name != "plain":
            taken = [re.search(r"([0-9]+) of ([0-9]+) taken", l) for l in runs if l.startswith(f"{case} {name}:")]
            t = sum(int(m[1]) for m in taken if m); p = sum(int(m[2]) for m in taken if m)
            rr = [int(m) for l in runs if l.startswith(f"{case} {name}:") for m in re.findall(r"\+ ([0-9]+) re-runs", l)]
            dr, _ = med(case, name, r"drafting ([0-9.]+) ms")
            line += f" | taken {t}/{p} | re-runs {sum(rr)} | drafting {dr:.1f} ms a run (median)"
        print(line + " | runs " + " ".join(f"{x:.0f}" for x in all_))
PY
exit $fail
