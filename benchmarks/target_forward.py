"""One-token decode and a 64-token verify forward: jaxdd
(jitted) vs HF transformers (eager), CPU, one run.

    python benchmarks/target_forward.py [--prefix 256] [--repeats 30]

Writes benchmarks/results/target_forward.json. Both sides run the same
tiny Kimi-flavoured weights in fp32 over a cache that already holds
``--prefix`` tokens; times are medians over ``--repeats`` calls.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
import torch

import jaxdd
from jaxdd.api import ForwardOptions, _forward
from jaxdd.testing.benchmark import write_result
from jaxdd.testing.reference import TINY_K2, hf_model

RESULTS = Path(__file__).parent / "results" / "target_forward.json"


def median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up (compilation on the JAX side)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_hf(model, prefix: np.ndarray, new: np.ndarray, repeats: int) -> float:
    with torch.no_grad():
        out = model(torch.from_numpy(prefix), use_cache=True)
    cache = out.past_key_values
    tokens = torch.from_numpy(new)

    def step():
        with torch.no_grad():
            model(tokens, past_key_values=cache, use_cache=True)
        # drop the new rows again (transformers 5 crops by a negative count)
        cache.crop(-new.shape[1])

    return median_seconds(step, repeats)


def bench_jaxdd(target, prefix: np.ndarray, new: np.ndarray, repeats: int) -> tuple[float, float]:
    """(seconds through the checked host API, seconds of the bare jitted step)."""
    slots = prefix.shape[1] + new.shape[1]
    base = target.forward(prefix, target.new_cache(1, slots)).cache
    # the step donates its cache: start each call from a fresh copy
    snapshot = jax.tree.map(np.asarray, base)

    t = new.shape[1]
    tokens = jax.numpy.asarray(new, jax.numpy.int32)
    positions = jax.numpy.asarray(prefix.shape[1] + np.arange(t)[None], jax.numpy.int32)
    visible = jax.numpy.tril(jax.numpy.ones((1, t, t), bool))
    api_caches = [jax.tree.map(jax.numpy.asarray, snapshot) for _ in range(repeats + 1)]
    raw_caches = [jax.tree.map(jax.numpy.asarray, snapshot) for _ in range(repeats + 1)]

    def api_step():
        jax.block_until_ready(target.forward(new, api_caches.pop(), commit=False).logits)

    def raw_step():
        out = _forward(
            target._spec,
            target._weights,
            tokens,
            positions,
            raw_caches.pop(),
            visible,
            ForwardOptions((), "absorbed", target.backend, False),
        )
        jax.block_until_ready(out.logits)

    # Each call gets its own copy of the cache (made before timing): the step donates it.
    return median_seconds(api_step, repeats), median_seconds(raw_step, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prefix", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()

    torch.set_num_threads(2)
    model = hf_model(TINY_K2, seed=0)
    with tempfile.TemporaryDirectory() as directory:
        model.save_pretrained(directory)
        target = jaxdd.load_target(directory, dtype="float32")
    rng = np.random.default_rng(0)
    prefix = rng.integers(0, TINY_K2["vocab_size"], (1, args.prefix))

    results = {}
    for name, t in (("decode_1", 1), ("verify_64", 64)):
        new = rng.integers(0, TINY_K2["vocab_size"], (1, t))
        hf = bench_hf(model, prefix, new, args.repeats)
        api, raw = bench_jaxdd(target, prefix, new, args.repeats)
        results[name] = {
            "new_tokens": t,
            "hf_eager_ms": hf * 1e3,
            "jaxdd_api_ms": api * 1e3,
            "jaxdd_jit_ms": raw * 1e3,
            "speedup_api": hf / api,
            "speedup_jit": hf / raw,
        }
        print(
            f"{name}: HF {hf * 1e3:.2f} ms, jaxdd API {api * 1e3:.2f} ms ({hf / api:.1f}x), "
            f"jitted step {raw * 1e3:.2f} ms ({hf / raw:.1f}x)"
        )

    report = {
        "benchmark": "target_forward",
        "config": "jaxdd/testing/reference.py TINY_K2 (fp32)",
        "prefix_tokens": args.prefix,
        "repeats": args.repeats,
        "results": results,
        "goal": "jaxdd decode step >= 3x faster than HF eager",
    }
    write_result(RESULTS, report, torch=torch.__version__)


if __name__ == "__main__":
    main()
