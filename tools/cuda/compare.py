"""Compare CPU and CUDA --dump-logits files: max-abs error over max-abs reference, per run and row range."""
import json
import sys

import numpy as np

cpu, gpu, prompt_len = np.load(sys.argv[1]), np.load(sys.argv[2]), int(sys.argv[3])
label = sys.argv[4]
rows = min(len(cpu), len(gpu))
rel = [float(np.abs(cpu[i] - gpu[i]).max() / max(np.abs(cpu[i]).max(), 1e-30)) for i in range(rows)]
same_argmax = [int(cpu[i].argmax()) == int(gpu[i].argmax()) for i in range(rows)]
worst = max(rel)
ok = worst <= 1e-4 and cpu.shape == gpu.shape and all(same_argmax)
print(json.dumps({
    "model": label, "rows": rows, "shape_cpu": list(cpu.shape), "shape_gpu": list(gpu.shape),
    "max_rel_prompt": max(rel[:prompt_len]), "max_rel_decode": max(rel[prompt_len:] or [0.0]),
    "max_rel": worst, "same_argmax_all_rows": all(same_argmax), "pass": ok,
}))
sys.exit(0 if ok else 1)
