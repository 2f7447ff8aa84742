#!/bin/bash
# `deltafin fetch` of a whole checkpoint (every byte verified) against curl downloading the same files, both
# from nginx on loopback. Usage: tools/bench/remote_fetch.sh [path/to/deltafin]
# Needs nginx (apt-get install nginx-light). Serves /tmp/srv/k3s: a `small` K3 with its checksum manifest.
set -euo pipefail
D=${1:-target/release/deltafin}
HERE=$(cd "$(dirname "$0")" && pwd)
if [ ! -d /tmp/srv/k3s ]; then
  mkdir -p /tmp/srv
  "$D" make-model --arch kimi_k3 --preset small --seed 1 --out /tmp/srv/k3s >/dev/null
  "$D" checksums --model /tmp/srv/k3s
fi
[ -f /tmp/nginx.pid ] && kill -0 "$(cat /tmp/nginx.pid)" 2>/dev/null || nginx -c "$HERE/nginx-loopback.conf"
URL=http://127.0.0.1:8088/k3s
echo "bytes: $(du -sb /tmp/srv/k3s | cut -f1)"
echo "deltafin_s curl_s"
for i in 1 2 3 4 5; do
  rm -rf /tmp/mf /tmp/cf; mkdir -p /tmp/cf
  t0=$(date +%s.%N); "$D" fetch --from $URL --out /tmp/mf >/dev/null 2>&1; t1=$(date +%s.%N)
  (cd /tmp/cf && for f in $(ls /tmp/srv/k3s); do curl -s -o "$f" "$URL/$f"; done; sync)
  t2=$(date +%s.%N)
  echo "$(echo "$t1 - $t0" | bc) $(echo "$t2 - $t1" | bc)"
done
