"""Tokens/s against batch size (1, 2, 4, 8) for AR / DFlash
/ DDTree, and acceptance at T=0 vs T=1; CPU, one run.

    python benchmarks/batching.py [--max-new-tokens 32] [--repeats 3]

A tiny random Kimi-flavoured target with its random DFlash drafter (block 8), so
acceptance is what random weights give, not a trained pair's. Every request in a
batch has its own prompt and seed. Writes benchmarks/results/batching.json.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np

import jaxdd
from jaxdd.decoding.engine import SpeculativeDecoder
from jaxdd.testing.benchmark import timed, write_result
from jaxdd.testing.reference import TINY_K2, drafter_config, save_random_pair

RESULTS = Path(__file__).parent / "results" / "batching.json"
METHODS = {"ar": {}, "dflash": {}, "ddtree": {"budget": 16}}
BATCHES = [1, 2, 4, 8]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        target, drafter = save_random_pair(
            Path(directory), TINY_K2, drafter_config(block_size=8), seed=0
        )
        decoder = SpeculativeDecoder(
            jaxdd.load_target(target, dtype="float32"), jaxdd.load_drafter(drafter, dtype="float32")
        )
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 250, int(n)).tolist() for n in rng.integers(8, 24, max(BATCHES))]
    rows = []
    for temperature in (0.0, 1.0):
        for method, options in METHODS.items():
            for batch in BATCHES:
                settings = [jaxdd.Sampling(temperature=temperature, seed=i) for i in range(batch)]

                def run(batch=batch, settings=settings, method=method, options=options):
                    return decoder.generate_batch(
                        prompts[:batch],
                        sampling=settings,
                        method=method,
                        max_new_tokens=args.max_new_tokens,
                        stop_token_ids=[],
                        **options,
                    )

                run()  # compile
                results, seconds = timed(run, args.repeats)
                tokens = sum(len(r.tokens) for r in results)
                row = {
                    "temperature": temperature,
                    "method": method,
                    "batch": batch,
                    "tokens_per_s": round(tokens / seconds, 1),
                    "mean_acceptance": round(
                        float(np.mean([r.mean_acceptance for r in results])), 3
                    ),
                }
                print(json.dumps(row))
                rows.append(row)
    write_result(RESULTS, {"runs": rows})


if __name__ == "__main__":
    main()
