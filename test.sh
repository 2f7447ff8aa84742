#!/usr/bin/env bash
# The project's one test command: installs what the tests need, then runs every test.
set -euo pipefail
cd "$(dirname "$0")"

# The float64 reference and the Python self-test need numpy (nothing else; no torch).
if ! python3 -c "import numpy" 2>/dev/null; then
  python3 -m pip install --quiet numpy
fi
# The server's client test drives it with the official OpenAI Python SDK.
if ! python3 -c "import openai" 2>/dev/null; then
  python3 -m pip install --quiet openai
fi

cargo test --workspace --release --locked "$@"
