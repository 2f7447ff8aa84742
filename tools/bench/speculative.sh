#!/bin/bash
# Speculative decoding against plain decoding, interleaved run by run (plain, then each drafter, N rounds), in
# the memory configurations of issue 27. Per configuration and drafter: the median decode tok/s and its ratio
# to plain's median, the median bytes read per generated token (spine streamed from disk, routed experts), and
# the guesses taken, with the passes by guesses checked of the median run.
# Usage: tools/bench/speculative.sh [path/to/deltafin] [rounds] [configs...]
#   configs: a (spine streamed, experts cached), b (experts streamed cold), c (all cached),
#            bench (the 17.5 MB-record bench model, n-gram drafting, experts streamed cold, its own greedy text
#            quoted back)
set -u
D=${1:-target/release/deltafin}
N=${2:-5}
shift 2 || true
CONFIGS=("${@:-a b c bench}")
M=models/shakespeare-k3
R=models/shakespeare-k3-drafter
BENCH=${BENCH_MODEL:-$HOME/.cache/deltafin/kimi_k3-bench-seed0}
# A document, then its first lines again: the model goes on in its own words, which repeat as it goes.
QUOTE=$'ROMEO:\nBut soft! what light through yonder window breaks?\nIt is the east, and Juliet is the sun.\nArise, fair sun, and kill the envious moon,\nWho is already sick and pale with grief,\nThat thou her maid art far more fair than she.\n\nROMEO:\nBut soft! what light through yonder window breaks?\n'

# The bench model's prompt: ids 5,6,7, the first 20 tokens it generates greedily after them, and 5,6,7 again —
# its own text quoted back, so that prompt lookup finds the prompt's end earlier and guesses what followed.
# (Its random weights do not copy: after the second 5,6,7 it says something else, so the guesses are refused.)
BENCH_PROMPT=5,6,7,1248,1536,2757,2545,1896,2547,1958,96,1814,1119,1388,4065,2686,435,1910,2837,3973,2951,1155,2983,5,6,7

# The smallest --memory-budget the model accepts with every expert cached: no spine layer stays resident.
floor() {
  "$D" run --model "$M" --prompt-ids 1 --max-new 1 --expert-cache 16M --memory-budget 1 2>&1 \
    | grep -o 'needs at least [0-9]*' | awk '{print $4}'
}

# One run: "tok/s spine_MB experts_MB taken/proposed chosen" from the [stats] and [speculative] lines.
one() {
  local err
  err=$("$D" run "$@" --ignore-eos --stats 2>&1 >/dev/null)
  local tps spine experts taken chosen
  tps=$(grep -o 'decode [0-9]* tok [0-9.]*s ([0-9.]* tok/s)' <<<"$err" | grep -o '([0-9.]*' | tr -d '(')
  spine=$(grep -o 'spine [0-9.]* MB' <<<"$err" | awk '{print $2}')
  experts=$(grep -o 'experts [0-9.]* MB | lookahead' <<<"$err" | awk '{print $2}')
  taken=$(grep -o '[0-9]* of [0-9]* taken' <<<"$err" | awk '{print $1"/"$3}')
  chosen=$(grep -o 'passes by guesses checked [0-9: ]*' <<<"$err" | cut -d' ' -f5- | tr ' ' ',')
  echo "$tps ${spine:-0} ${experts:-0} ${taken:--} ${chosen:--}"
}

median() { sort -g | awk '{v[NR]=$0} END {print v[int((NR+1)/2)]}'; }

bench_config() {
  local name=$1; shift
  local -a base=("$@")
  local -A out
  local variants=(plain drafter ngram)
  [ "$name" = bench ] && variants=(plain ngram)
  for ((i = 0; i < N; i++)); do
    for v in "${variants[@]}"; do
      case $v in
        plain) extra=() ;;
        drafter) extra=(--draft "$R") ;;
        ngram) extra=(--draft ngram) ;;
      esac
      out[$v]+="$(one "${base[@]}" "${extra[@]}")"$'\n'
    done
  done
  local plain
  plain=$(awk 'NF {print $1}' <<<"${out[plain]}" | median)
  for v in "${variants[@]}"; do
    local rows=${out[$v]}
    local tps mid
    tps=$(awk 'NF {print $1}' <<<"$rows" | median)
    mid=$(awk -v t="$tps" 'NF && $1 == t {print; exit}' <<<"$rows")
    printf '| %s | %s | %.1f | %.2f× | %s | %s | %s | %s |\n' "$name" "$v" "$tps" \
      "$(awk -v a="$tps" -v b="$plain" 'BEGIN {print a / b}')" \
      "$(awk 'NF {print $2}' <<<"$rows" | median)" "$(awk 'NF {print $3}' <<<"$rows" | median)" \
      "$(awk '{print $4}' <<<"$mid")" "$(awk '{print $5}' <<<"$mid")"
  done
  printf '|  | runs (tok/s) | %s |\n' "$(for v in "${variants[@]}"; do echo -n "$v: $(awk 'NF {printf "%s ", $1}' <<<"${out[$v]}")"; done)"
}

echo "| config | drafter | tok/s (median of $N) | vs plain | spine MB/token | experts MB/token | taken | passes by guesses checked (0:plain …) |"
echo "|---|---|---|---|---|---|---|---|"
for c in ${CONFIGS[@]}; do
  case $c in
    a) bench_config "a" --model "$M" --prompt "ROMEO:" --max-new 300 --expert-cache 16M --memory-budget "$(floor)" ;;
    b) bench_config "b" --model "$M" --prompt "ROMEO:" --max-new 300 --expert-cache 0 --no-prefetch ;;
    c) bench_config "c" --model "$M" --prompt "ROMEO:" --max-new 300 ;;
    a-quote) bench_config "a-quote" --model "$M" --prompt "$QUOTE" --max-new 300 --expert-cache 16M --memory-budget "$(floor)" ;;
    bench) bench_config "bench" --model "$BENCH" --prompt-ids "$BENCH_PROMPT" --max-new 12 --expert-cache 0 --no-prefetch ;;
  esac
done
