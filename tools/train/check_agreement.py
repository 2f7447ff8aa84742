#!/usr/bin/env python3
"""CI check: deltafin reproduces the PyTorch logits of the committed trained models (numpy only).

    python3 tools/train/check_agreement.py --engine target/release/deltafin [--tol 1e-4]

For each model in models/golden/*.json (written by tools/train/analyze.py from the PyTorch float64
forward pass of the exported checkpoint): run deltafin on the golden prompt ids with as many greedy
tokens as the golden has, then require
  * the same greedy tokens, and
  * every logits row within `tol` relative: max|engine - golden| / max|golden| per row.
Exit status 0 when every model passes, 1 otherwise. No torch, no pytest.
"""

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def check(engine, golden_json, tol):
    with open(golden_json) as f:
        g = json.load(f)
    want = np.load(golden_json[: -len(".json")] + "-logits.npy").astype(np.float64)
    prompt, gen = g["prompt_ids"], g["generated_ids"]
    model = os.path.join(ROOT, g["model"])
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "logits.npy")
        r = subprocess.run([engine, "run", "--model", model, "--prompt-ids", ",".join(map(str, prompt)),
                            "--max-new", str(len(gen)), "--ignore-eos", "--dump-logits", out, "--print-ids"],
                           capture_output=True, text=True)
        if r.returncode != 0:
            print(f"FAIL {g['model']}: deltafin exited {r.returncode}: {r.stderr.strip()[-500:]}")
            return False
        got = np.load(out).astype(np.float64)
    got_gen = json.loads(r.stdout.strip().splitlines()[-1])
    P = len(prompt)
    # deltafin: rows 0..P-1 for the prompt, then row P+j chose generated[j]; row P repeats row P-1.
    got = np.concatenate([got[:P], got[P + 1 :]])
    if got.shape != want.shape:
        print(f"FAIL {g['model']}: logits shape {got.shape}, golden {want.shape}")
        return False
    rel = np.abs(got - want).max(-1) / np.abs(want).max(-1)
    ok = got_gen == gen and rel.max() <= tol
    print(f"{'ok  ' if ok else 'FAIL'} {g['model']}: {len(rel)} rows, max relative error {rel.max():.2e} "
          f"(tol {tol:g}), greedy tokens {'equal' if got_gen == gen else f'differ: {got_gen} vs {gen}'}")
    return ok


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", default=os.environ.get("DELTAFIN", os.path.join(ROOT, "target", "release", "deltafin")))
    ap.add_argument("--golden", default=os.path.join(ROOT, "models", "golden"))
    ap.add_argument("--tol", type=float, default=1e-4)
    args = ap.parse_args()
    if not os.access(args.engine, os.X_OK):
        print(f"FAIL: no deltafin binary at {args.engine} (build it, or pass --engine / set DELTAFIN)")
        return 1
    files = sorted(glob.glob(os.path.join(args.golden, "*.json")))
    if not files:
        print(f"FAIL: no golden files in {args.golden}")
        return 1
    t0 = time.time()
    results = [check(args.engine, f, args.tol) for f in files]
    passed = sum(results)
    print(f"{passed} passed, {len(results) - passed} failed ({time.time() - t0:.1f}s)")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
