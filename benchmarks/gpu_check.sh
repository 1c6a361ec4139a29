#!/usr/bin/env bash
# One short device check for a session that has a GPU (see README): the tree-attention kernel compiled for the
# GPU against its jnp reference, then kernel vs XLA timings at Kimi-like verify shapes. Results go to $OUT
# (or benchmarks/results/) as gpu_check.json. Not run by CI (CI has no GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results}"
python -m pytest -q -m gpu tests/test_tree_attention.py -p no:cacheprovider
python - "$OUT" <<'PY'
import json, sys, time
import jax, jax.numpy as jnp, numpy as np
from pallas_kernels.tree_attention import tree_attention, tree_attention_reference

def median_ms(fn, n=20):
    jax.block_until_ready(fn())
    times = []
    for _ in range(n):
        start = time.perf_counter(); jax.block_until_ready(fn()); times.append(time.perf_counter() - start)
    return float(np.median(times) * 1e3)

rows = []
rng = np.random.default_rng(0)
for tokens, heads, slots in [(65, 64, 4096), (257, 64, 4096), (257, 8, 32768)]:
    r, dr = 512, 64
    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
    mask = jnp.asarray(np.tril(np.ones((tokens, tokens), bool)))[None]
    args = (normal(1, tokens, heads, r), normal(1, tokens, heads, dr), normal(1, slots, r), normal(1, slots, dr),
            jnp.array([slots - tokens], jnp.int32), normal(1, tokens, r), normal(1, tokens, dr), mask)
    reference = jax.jit(tree_attention_reference, static_argnames="scale")
    kernel = lambda: tree_attention(*args, scale=0.1)
    error = float(jnp.abs(kernel() - reference(*args, scale=0.1)).max())
    rows.append({"tokens": tokens, "heads": heads, "slots": slots, "max_abs_error": error,
                 "kernel_ms": median_ms(kernel), "xla_ms": median_ms(lambda: reference(*args, scale=0.1))})
    print(rows[-1])
json.dump({"device": str(jax.devices()[0]), "jax": jax.__version__, "rows": rows},
          open(f"{sys.argv[1]}/gpu_check.json", "w"), indent=2)
PY
