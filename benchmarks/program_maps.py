"""The memory maps a pool's longest prefill and full round take on this host's CPU: what
``jaxdd.decoding.memory_maps.PROGRAM_MAPS`` records.

    python benchmarks/program_maps.py

Each configuration runs in a process of its own: a pool (prefix cache, logprobs) of models at
the demo pair's widths with randomly drawn weights and as many target and drafter layers as it
names, its longest prefill (scoring the prompt) and full round each compiled once, the lines
``/proc/self/maps`` gained counted (``memory_maps.program_maps``). Writes
benchmarks/results/program_maps.json.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

# (method, rows, max_len, target layers, drafter layers, DDTree budget)
CONFIGURATIONS = [
    ("dflash", 8, 1024, 4, 2, None),
    ("dflash", 8, 4096, 4, 2, None),
    ("dflash", 17, 2048, 4, 2, None),
    ("ddtree", 17, 2048, 4, 2, 8),
    ("dflash", 8, 1024, 8, 2, None),
    ("dflash", 8, 1024, 16, 2, None),
    ("dflash", 8, 1024, 4, 4, None),
    ("ddtree", 8, 1024, 16, 2, 8),
    ("ar", 8, 1024, 4, 0, None),
    ("ar", 8, 1024, 16, 0, None),
]
RESULT = Path(__file__).parent / "results" / "program_maps.json"


def measure(method: str, rows: int, max_len: int, layers: int, drafter_layers: int, budget):
    """One configuration's (longest prefill, full round) maps, in this process."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxdd.api import Target
    from jaxdd.cli import DEMO
    from jaxdd.config import DrafterConfig, KimiConfig
    from jaxdd.decoding.engine import SpeculativeDecoder
    from jaxdd.decoding.memory_maps import program_maps
    from jaxdd.decoding.rows import RowPool
    from jaxdd.models.drafter import DFlashDrafter
    from jaxdd.models.target import KimiTarget

    config = KimiConfig.from_json_file(DEMO / "target" / "config.json")
    config = dataclasses.replace(config, num_hidden_layers=layers)
    target = Target(KimiTarget(config, jnp.float32, rngs=nnx.Rngs(0)))
    drafter = None
    if method != "ar":
        drafter_config = DrafterConfig.from_json_file(DEMO / "drafter" / "config.json")
        drafter_config = dataclasses.replace(drafter_config, num_hidden_layers=drafter_layers)
        drafter = DFlashDrafter(drafter_config, jnp.float32, rngs=nnx.Rngs(1))
    options = {"rows": rows, "max_len": max_len, "budget": budget, "max_logprobs": 20}
    pool = RowPool.serving(
        SpeculativeDecoder(target, drafter), method=method, prefix_cache=True, **options
    )
    return jax.default_backend(), program_maps(pool)


def main() -> None:
    from jaxdd.testing.benchmark import write_result

    rows = []
    for configuration in CONFIGURATIONS:
        argv = [sys.executable, __file__, json.dumps(configuration)]
        run = subprocess.run(argv, capture_output=True, text=True, check=True)
        platform, (prefill, round_maps) = json.loads(run.stdout.splitlines()[-1])
        rows.append(
            {
                "configuration": configuration,
                "platform": platform,
                "prefill_maps": prefill,
                "round_maps": round_maps,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    write_result(RESULT, {"programs": rows})


if __name__ == "__main__":
    if len(sys.argv) > 1:  # one configuration, in a process of its own
        print(json.dumps(measure(*json.loads(sys.argv[1]))))
    else:
        main()
