"""The Kimi K2.6 + K2.6 DFlash traffic account on 8 GPUs: bytes per round and device, the floor per round and the
tokens/s the demo pair's tau curve predicts, TP vs EP, 8k and 32k tokens of context (``jaxdd.plan --traffic``).

    python benchmarks/traffic_table.py

Computed from the model's shapes and the GPUs' datasheets (``jaxdd.traffic``), not measured. Writes
benchmarks/results/traffic_kimi_k26.json and prints the README's table (best round per GPU, mode and context).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import jax

from jaxdd.plan import plan
from jaxdd.testing.benchmark import write_result
from jaxdd.traffic import HARDWARE

RESULTS = Path(__file__).parent / "results"
FIXTURES = Path(__file__).parent.parent / "tests" / "fixtures"


def main() -> None:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    jax.config.update("jax_num_cpu_devices", 8)  # before any JAX op, as jaxdd.plan's own main

    config, drafter = FIXTURES / "kimi_k25_config.json", FIXTURES / "kimi_k26_dflash_config.json"
    runs = []
    for moe in ("tp", "ep"):
        for context in (8192, 32768):
            result = plan(config, drafter, 8, moe, max_len=context, compile_round=False)
            runs.append({"moe": moe, "context": context, "rows": result["traffic"]})
    hardware = {key: dataclasses.asdict(gpu) for key, gpu in HARDWARE.items()}
    write_result(RESULTS / "traffic_kimi_k26.json", {"runs": runs, "hardware": hardware})
    print("| GPUs | MoE | context | AR | DFlash | DDTree 4 / 8 / 16 / 32 / 64 | best |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for gpu in ("rtx-pro-6000", "h200", "b200"):
        for run in runs:
            speed = {row["round"]: row["targets"][gpu]["tokens_per_s"] for row in run["rows"]}
            trees = " / ".join(f"{speed[f'ddtree {b}']:.0f}" for b in (4, 8, 16, 32, 64))
            best = max(speed, key=speed.get)
            print(
                f"| {HARDWARE[gpu].name} | {run['moe']} | {run['context'] // 1024}k | {speed['ar']:.0f} | "
                f"{speed['dflash']:.0f} | {trees} | {best} |"
            )


if __name__ == "__main__":
    main()
