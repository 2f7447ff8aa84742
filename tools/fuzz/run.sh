#!/usr/bin/env bash
# Fuzzes every parser of untrusted input (crates/fuzz) with libFuzzer for SECONDS each, starting from the
# committed corpus (tools/fuzz/corpus/TARGET). A run is reproducible from its SEED (printed; random unless
# given) on the same corpus; a failing input is kept under target/fuzz/artifacts/TARGET/ and replayed with
# the command printed beside it. Exits non-zero if any target crashed, hung (>10 s on one input) or
# allocated past its limits.
#
# Usage: tools/fuzz/run.sh [SECONDS [SEED [TARGET...]]]
set -euo pipefail
cd "$(dirname "$0")/../.."

secs=${1:-20}
seed=${2:-$((RANDOM * 32768 + RANDOM + 1))}
shift $(($# < 2 ? $# : 2))

# cargo fuzz from crates.io, kept under target/ so later runs skip the install.
tools=target/fuzz-tools
if [ ! -x "$tools/bin/cargo-fuzz" ]; then
  cargo install cargo-fuzz --version 0.13.2 --locked --root "$tools"
fi
# On stable Rust: RUSTC_BOOTSTRAP lets it pass its unstable flags, and there is no sanitizer runtime (the
# targets are safe Rust; libFuzzer still catches panics, hangs and oversized allocations).
RUSTC_BOOTSTRAP=1 "$tools/bin/cargo-fuzz" build --fuzz-dir tools/fuzz -O -a --sanitizer none \
  --target-dir target/fuzz parsers
bin=target/fuzz/x86_64-unknown-linux-gnu/release/parsers

targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  mapfile -t targets < <(ls tools/fuzz/corpus)
fi
echo "fuzzing ${#targets[@]} targets for ${secs}s each, seed $seed"
failed=()
for t in "${targets[@]}"; do
  # New inputs go to a fresh folder, so the run depends only on the seed and the committed corpus.
  work=target/fuzz/work/$t
  artifacts=target/fuzz/artifacts/$t
  log=target/fuzz/$t.log
  rm -rf "$work"
  mkdir -p "$work" "$artifacts"
  if DELTAFIN_FUZZ_TARGET=$t "$bin" "$work" "tools/fuzz/corpus/$t" -seed="$seed" -max_total_time="$secs" \
    -timeout=10 -rss_limit_mb=2048 -malloc_limit_mb=512 -artifact_prefix="$artifacts/" \
    -print_final_stats=1 >"$log" 2>&1; then
    runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")
    cov=$(grep -o 'cov: [0-9]*' "$log" | tail -1)
    echo "$t: ok, $runs inputs, $cov, $(ls "$work" | wc -l) new corpus inputs"
  else
    failed+=("$t")
    tail -n 40 "$log"
    echo "$t: FAILED (seed $seed); replay with: DELTAFIN_FUZZ_TARGET=$t $bin $artifacts/*"
  fi
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "fuzzing failed: ${failed[*]}" >&2
  exit 1
fi
