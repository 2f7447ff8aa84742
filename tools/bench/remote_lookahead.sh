#!/bin/bash
# Lookahead from the network: decode time of the built-in trained model run from a fresh spine-only mirror of
# a server that answers every request after 20 ms (tools/bench/slow_server.py), with and without --no-prefetch.
# Usage: tools/bench/remote_lookahead.sh [path/to/deltafin]
set -euo pipefail
D=${1:-target/release/deltafin}
mkdir -p /tmp/srv2 && rm -rf /tmp/srv2/sk && cp -r models/shakespeare-k3 /tmp/srv2/sk
"$D" checksums --model /tmp/srv2/sk >/dev/null
python3 tools/bench/slow_server.py /tmp/srv2 8099 20 & SERVER=$!
trap 'kill $SERVER' EXIT
sleep 1
for mode in "" "--no-prefetch"; do
  for i in 1 2 3 4 5; do
    rm -rf /tmp/ms
    "$D" fetch --from http://127.0.0.1:8099/sk --out /tmp/ms --spine-only >/dev/null 2>&1
    "$D" run --model /tmp/ms --prompt "ROMEO:" --max-new 40 --ignore-eos --stats $mode 2>&1 >/dev/null \
      | grep -o 'decode [0-9]* tok [0-9.]*s\|lookahead brought [0-9]* experts ([0-9]* used)' | tr '\n' ' '
    echo "[${mode:-lookahead on}]"
  done
done
