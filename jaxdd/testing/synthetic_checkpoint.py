"""A random HF-layout target checkpoint of any size, written
shard by shard (for memory tests and benchmarks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file
from transformers import DeepseekV3Config

from jaxdd.config import KimiConfig
from jaxdd.testing.reference import TINY_K2
from jaxdd.weights.hf_mappings import target_mappings


def write_synthetic_target(
    directory: Path, layers: int, experts: int, width: int, dtype: str = "float32", seed: int = 0
) -> tuple[Path, float]:
    """A Kimi-shaped checkpoint (one dense layer, then MoE layers of
    ``experts`` experts of width ``width // 2``), one shard per layer plus
    an index. Returns (directory, size of the largest shard in MiB)."""
    config = DeepseekV3Config(
        **TINY_K2
        | dict(
            hidden_size=width,
            intermediate_size=2 * width,
            moe_intermediate_size=width // 2,
            num_hidden_layers=layers,
            n_routed_experts=experts,
            num_experts_per_tok=4,
        )
    ).to_dict()
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(seed)
    shards: dict[str, dict[str, tuple]] = {}
    for mapping in target_mappings(KimiConfig.from_hf(config)):
        path = mapping.paths[0]
        shard = f"layer-{path[1]:04d}" if path[0] == "layers" else path[0]
        shards.setdefault(shard, {}).update(zip(mapping.names, mapping.shapes, strict=True))
    weight_map = {}
    largest = 0
    for shard, tensors in shards.items():
        file = f"model-{shard}.safetensors"
        arrays = {
            n: (0.02 * rng.standard_normal(s, np.float32)).astype(dtype) for n, s in tensors.items()
        }
        save_file(arrays, directory / file)
        weight_map |= dict.fromkeys(arrays, file)
        largest = max(largest, sum(a.nbytes for a in arrays.values()))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return directory, largest / 2**20


# Runs in a fresh process so its peak RSS (VmHWM) covers only the imports and this one conversion.
_MEASURE = """
import sys, time
import jax.numpy as jnp
from convert.hf_to_jaxdd import convert
from jaxdd.testing.benchmark import process_memory_mb
jnp.zeros(1).block_until_ready()  # the backend is up before the baseline
before = process_memory_mb("VmRSS")
start = time.perf_counter()
convert(sys.argv[1], sys.argv[2], dtype=sys.argv[3], progress=False)
print(time.perf_counter() - start, before, process_memory_mb("VmHWM"))
"""


def measure_conversion(source: Path, output: Path, dtype: str = "bfloat16") -> dict[str, float]:
    """Convert in a subprocess: seconds, RSS before converting and peak RSS (MiB)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    command = [sys.executable, "-c", _MEASURE, str(source), str(output), dtype]
    result = subprocess.run(command, capture_output=True, text=True, env=env, check=True)
    seconds, before, peak = map(float, result.stdout.split()[-3:])
    return {"seconds": seconds, "rss_before_mb": before, "peak_rss_mb": peak}
