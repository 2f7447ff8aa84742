#!/usr/bin/env bash
# The project's one test command: installs what the tests need, then runs every test.
set -euo pipefail
cd "$(dirname "$0")"

# The float64 reference and the Python self-test need numpy (nothing else; no torch).
if ! python3 -c "import numpy" 2>/dev/null; then
  python3 -m pip install --quiet numpy
fi
# The server's client tests drive it with the official OpenAI and Anthropic Python SDKs, at the versions the
# tests were written against (their arguments change between releases).
for sdk in openai==3.57.0 anthropic==2.15.0; do
  if ! python3 -c "import ${sdk%%=*}, sys; sys.exit(${sdk%%=*}.__version__ != '${sdk##*=}')" 2>/dev/null; then
    python3 -m pip install --quiet "$sdk"
  fi
done

# The CUDA kernels are compiled by NVRTC in a test (no GPU needed); the library comes from PyPI.
NVRTC_DIR=target/nvrtc
if [ ! -e "$NVRTC_DIR/nvidia/cu13/lib/libnvrtc.so.13" ]; then
  python3 -m pip install --quiet --target "$NVRTC_DIR" "nvidia-cuda-nvrtc==13.0.*"
fi
export LD_LIBRARY_PATH="$PWD/$NVRTC_DIR/nvidia/cu13/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

# No import cycle between the files of any crate (the checker checks itself first).
python3 tools/imports/cycles.py --self-test
python3 tools/imports/cycles.py

# Which kernel paths this machine runs, so the log says which ones the bit-identity tests compared.
grep -o -w 'avx2\|fma\|avx512f' /proc/cpuinfo 2>/dev/null | sort -u | tr '\n' ' ' | sed 's/^/cpu: /;s/$/\n/' || true
cargo test --workspace --release --locked "$@"
