#!/bin/bash
# Decode speed of the built-in trained model with and without its drafter (greedy, 200 tokens, 5 runs each;
# median). Usage: tools/bench/speculative.sh [path/to/deltafin]
set -euo pipefail
D=${1:-target/release/deltafin}
M=models/shakespeare-k3; R=models/shakespeare-k3-drafter
for k in 0 1 2 4; do
  extra=(); [ "$k" != 0 ] && extra=(--draft "$R" --draft-tokens "$k")
  for i in 1 2 3 4 5; do
    "$D" run --model "$M" --prompt "ROMEO:" --max-new 200 --ignore-eos --stats "${extra[@]}" 2>&1 >/dev/null \
      | grep -o 'decode [0-9]* tok [0-9.]*s' | awk '{print $4}'
  done | sort -n | sed -n 3p | xargs echo "k=$k median decode seconds:"
  [ "$k" != 0 ] && "$D" run --model "$M" --prompt "ROMEO:" --max-new 200 --ignore-eos --stats "${extra[@]}" 2>&1 >/dev/null | grep speculative
done
