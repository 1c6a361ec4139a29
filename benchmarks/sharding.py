"""AR / DFlash / DDTree on 8 simulated CPU devices
(tensor- and expert-parallel) against one device, one run.

    python benchmarks/sharding.py [--max-new-tokens 32] [--repeats 3]

A tiny random Kimi-shaped target (8 heads, 16 experts) and drafter. Simulated
devices share the host's cores, so the 8-device numbers measure the
partitioned program's overhead (collectives, shard_map), not a speedup. Also
reports the bytes each device holds. Writes benchmarks/results/sharding.json.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)

import argparse
import json
import tempfile
from pathlib import Path

import jax
import numpy as np
from flax import nnx

import jaxdd
from jaxdd.decoding.engine import SpeculativeDecoder
from jaxdd.runtime.sharding import make_mesh, shard_module
from jaxdd.testing.benchmark import timed, write_result
from jaxdd.testing.reference import SHARDABLE_DRAFTER, SHARDABLE_K2, save_random_pair

RESULTS = Path(__file__).parent / "results" / "sharding.json"
METHODS = {"ar": {}, "dflash": {}, "ddtree": {"budget": 16}}


def device_bytes(*modules) -> int:
    """Bytes of parameters on the first device."""
    first = jax.devices()[0]
    total = 0
    for module in modules:
        for leaf in jax.tree.leaves(nnx.state(module)):
            total += sum(s.data.nbytes for s in leaf.addressable_shards if s.device == first)
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        pair = (Path(directory), SHARDABLE_K2, SHARDABLE_DRAFTER)
        target_dir, drafter_dir = save_random_pair(*pair, seed=0)
        prompt = np.random.default_rng(0).integers(0, 250, 24).tolist()
        rows, reference = {}, None
        for placement in ("1 device", "8 devices tp", "8 devices ep"):
            target = jaxdd.load_target(target_dir, dtype="float32")
            drafter = jaxdd.load_drafter(drafter_dir, dtype="float32")
            if placement != "1 device":
                mesh = make_mesh(8)
                mode = placement.split()[-1]
                shard_module(target.model, mesh, mode)
                shard_module(drafter, mesh, mode)
                target = jaxdd.Target(target.model)
            decoder = SpeculativeDecoder(target, drafter)
            row = {"bytes_per_device": device_bytes(target.model, drafter)}
            tokens = {}
            for method, kwargs in METHODS.items():

                def run(decoder=decoder, method=method, kwargs=kwargs):
                    return decoder.generate(
                        prompt,
                        method=method,
                        max_new_tokens=args.max_new_tokens,
                        stop_token_ids=[],
                        **kwargs,
                    )

                run()  # compile
                result, seconds = timed(run, args.repeats)
                row[f"{method}_tokens_per_s"] = round(len(result.tokens) / seconds, 1)
                tokens[method] = result.tokens
            reference = reference or tokens
            row["same_tokens_as_one_device"] = tokens == reference
            rows[placement] = row
            print(placement, json.dumps(row))
    write_result(RESULTS, {"runs": rows})


if __name__ == "__main__":
    main()
