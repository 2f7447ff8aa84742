#!/usr/bin/env bash
# What to report from a real Arm machine (a Mac with Apple Silicon, a Graviton or Ampere server) for
# BENCHMARKS.md: the machine, the kernels' weight bandwidth on one and on all cores (NEON and, for scale,
# scalar), the compute path (`bench --compute`) and the streaming benchmark (`bench`, ~10 GB made once in the
# cache directory). Run from a checkout: tools/arm/report.sh [DIR], DIR the drive to measure (default: .).
# Paste the whole output into the issue or a pull request. (Timings under qemu are not benchmarks.)
set -euo pipefail
cd "$(dirname "$0")/../.."
disk=${1:-.}

cargo build --release --locked -p deltafin
cargo build --release --locked -p deltafin-kernels --example bench
deltafin=target/release/deltafin
bench=target/release/examples/bench
section() { printf '\n### %s\n' "$*"; }

section "machine ($(uname -srm), commit $(git rev-parse --short HEAD))"
"$deltafin" doctor --disk "$disk"
section "kernels: GB/s of weights on one thread and on all cores"
"$bench"
"$bench" --scalar
section "deltafin bench --compute"
"$deltafin" bench --compute
section "deltafin bench"
"$deltafin" bench
