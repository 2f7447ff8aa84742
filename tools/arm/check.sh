#!/usr/bin/env bash
# The Arm checks, run by .ci/run (issue 24). On this x86-64 Linux machine:
#  1. installs what they need if missing: the Rust targets, Debian's AArch64 cross compiler and libc, qemu-user;
#  2. cross-builds the kernels' tests and the deltafin binary for aarch64-unknown-linux-gnu and runs the tests
#     under qemu-aarch64: every kernel on NEON against scalar, bit for bit;
#  3. runs the tiny and small presets of kimi_k3 and kimi_linear (made here by the x86 binary) on both ISAs with
#     --dump-logits: the logits files and the generated tokens must be byte-identical, and `demo` must print the
#     same text;
#  4. type-checks and lints the workspace, tests included, for aarch64-apple-darwin (macOS on Apple Silicon).
# Cross builds go to target/arm, so later runs reuse them. Times under emulation say nothing about Arm speed.
set -euo pipefail
cd "$(dirname "$0")/../.."

ARM=aarch64-unknown-linux-gnu
MAC=aarch64-apple-darwin
SYSROOT=/usr/aarch64-linux-gnu
started=$SECONDS
step() { echo "== arm: $* ($((SECONDS - started))s)"; }

step "installing what is missing"
packages=()
command -v aarch64-linux-gnu-gcc >/dev/null || packages+=(gcc-aarch64-linux-gnu libc6-dev-arm64-cross)
command -v qemu-aarch64 >/dev/null || packages+=(qemu-user)
if ((${#packages[@]})); then
  sudo=$([ "$(id -u)" = 0 ] || echo sudo)
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${packages[@]}" >/dev/null
fi
installed=$(rustup target list --installed)
for target in $ARM $MAC; do
  grep -qx "$target" <<<"$installed" || rustup target add "$target"
done

# The linker and the qemu runner for $ARM come from .cargo/config.toml.
step "kernel tests under qemu-aarch64"
CARGO_TARGET_DIR=target/arm cargo test --release --locked --target $ARM -p deltafin-kernels

step "building deltafin for x86-64 and for $ARM"
cargo build --release --locked -p deltafin
CARGO_TARGET_DIR=target/arm cargo build --release --locked --target $ARM -p deltafin
x86=target/release/deltafin
arm() { qemu-aarch64 -L $SYSROOT target/arm/$ARM/release/deltafin "$@"; }

work=$(mktemp -d "${TMPDIR:-/tmp}/deltafin-arm.XXXXXX")
trap 'rm -rf "$work"' EXIT
# Both runs must produce these byte for byte; `cmp` names the first differing byte.
same() {
  cmp "$work/x86.$1" "$work/arm.$1" || {
    echo "arm: $2: x86-64 and aarch64 differ ($1)" >&2
    exit 1
  }
}

# The [stats] line names the kernels that ran: SIMD on both sides, or the comparison proves little. (An x86
# machine without AVX2 would stop here; CI machines have it. AVX-512 is compared where the CPU has it.)
kernels() {
  grep -q "| kernels $2\$" "$1" || {
    echo "arm: expected the $2 kernels; the run said:" >&2
    cat "$1" >&2
    exit 1
  }
}

x86_isas=(avx2+fma)
if grep -q -w avx512f /proc/cpuinfo; then
  x86_isas+=(avx512)
fi
echo "arm: x86-64 kernel paths compared: ${x86_isas[*]}"

for arch in kimi_k3 kimi_linear; do
  for preset in tiny small; do
    step "$arch $preset: logits on x86-64 and on aarch64"
    model=$work/$arch-$preset
    $x86 make-model --arch $arch --preset $preset --seed 0 --out "$model" >/dev/null
    # A prompt of several rows (prefill) followed by decode steps; --threads 2 splits the products.
    run=(run --model "$model" --prompt-ids 1,2,3,400,5,6,7,8 --max-new 8 --ignore-eos --print-ids --threads 2 --stats)
    arm "${run[@]}" --dump-logits "$work/arm.npy" >"$work/arm.txt" 2>"$work/arm.err"
    kernels "$work/arm.err" neon
    # Every x86 SIMD path this machine runs, each against the same aarch64 run.
    for isa in "${x86_isas[@]}"; do
      $x86 "${run[@]}" --isa "$isa" --dump-logits "$work/x86.npy" >"$work/x86.txt" 2>"$work/x86.err"
      kernels "$work/x86.err" "$isa"
      same npy "$arch $preset logits ($isa)"
      same txt "$arch $preset output ($isa)"
    done
    rm -rf "$model"
  done
done

step "demo: the trained model's text on x86-64 and on aarch64"
$x86 demo --cache-dir "$work/demo" >"$work/x86.txt"
arm demo --cache-dir "$work/demo" >"$work/arm.txt"
same txt "demo text"
echo "arm: logits and text byte-identical on x86-64 and aarch64 (4 checkpoints, demo)"

# Clippy type-checks like `cargo check` and also lints the code only macOS and AArch64 compile (NEON, fcntl).
step "type-checking and linting for $MAC"
CARGO_TARGET_DIR=target/arm cargo clippy --workspace --all-targets --release --locked --target $MAC -- -D warnings

step "done"
