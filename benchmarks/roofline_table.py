"""Where Kimi K2.6 + K2.6 DFlash rounds turn compute-bound: ``jaxdd.plan``'s roofline (FLOPs per
device over the peak dense throughput, beside bytes over bandwidth) of AR / DFlash / DDTree-16 /
DDTree-64 on 8 x RTX PRO 6000 and 8 x H200, TP8 and EP8, at 8k, 32k and 128k tokens of context and
1, 4 and 16 rows, each round's latent cache in the layout with the faster floor on each GPU.

    JAX_PLATFORMS=cpu PYTHONPATH=$PWD python benchmarks/roofline_table.py

Computed from the models' shapes and the hardware table's datasheet peaks
(``jaxdd.planning.hardware``), not measured, under uniform routing: ``jaxdd.plan --traffic``'s
tables (``jaxdd.planning.traffic.traffic_table``) at N rows, ~2 min here. Whether the rows' context
fits is the plan's capacity on each GPU (DDTree's pool, the drafter's K/V in bf16, memory after the
weights). Writes
benchmarks/results/roofline_kimi_k26.json and prints the README's tables.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import jax

from jaxdd.planning.aot import find_machine
from jaxdd.planning.capacity import cache_capacities, shard_bytes, slot_bytes
from jaxdd.planning.hardware import GPUS
from jaxdd.planning.pair import abstract_models, read_configs
from jaxdd.planning.roofline import ModelWork
from jaxdd.planning.traffic import ModelBytes, PairAccount, Spread, traffic_table
from jaxdd.runtime.sharding import make_mesh
from jaxdd.testing.benchmark import write_result
from jaxdd.types import LAYOUTS

RESULT = Path(__file__).parent / "results" / "roofline_kimi_k26.json"
FIXTURES = Path(__file__).parent.parent / "tests" / "fixtures"
COMMAND = "JAX_PLATFORMS=cpu PYTHONPATH=$PWD python benchmarks/roofline_table.py"
TARGETS = ("rtx-pro-6000", "h200")
MODES = ("tp", "ep")
CONTEXTS = (8192, 32768, 131072)
BATCHES = (1, 4, 16)
ROUNDS = {"ar": "AR", "dflash": "DFlash", "ddtree 16": "DDTree-16", "ddtree 64": "DDTree-64"}


def round_rows(tables: dict, moe: str, context: int, batch: int) -> list[dict]:
    """Per GPU and round: the faster layout's floor, its parts and which bound holds."""
    rows = []
    for gpu, name in itertools.product(TARGETS, ROUNDS):
        by_layout = {
            layout: next(row for row in table if row["round"] == name)
            for layout, table in tables.items()
        }
        layout = min(by_layout, key=lambda k: by_layout[k]["targets"][gpu]["round_s"])
        row, times = by_layout[layout], by_layout[layout]["targets"][gpu]
        rows.append(
            {
                "gpu": gpu,
                "moe": moe,
                "context": context,
                "batch": batch,
                "round": name,
                "layout": layout,
                "flops": row["flops"],
                "flops_by_part": row["flops_by_part"],
                "read_bytes": row["read_total"],
                **{key: times[key] for key in ("memory_s", "compute_s", "link_s", "round_s")},
                "bound": times["bound"],
                "tokens_per_s": times["tokens_per_s"],
            }
        )
    return rows


def advice(tables: dict, moe: str, context: int, batch: int) -> list[dict]:
    """Per GPU: the round (of all the table's, each in its faster layout) with the most tokens/s
    and each round's faster layout, by the roofline and by bytes alone (memory + link, the floor
    before the roofline)."""
    names = [row["round"] for row in next(iter(tables.values()))]
    rows = []
    for gpu in TARGETS:
        by_bytes = lambda t: t["memory_s"] + t["link_s"]
        picks = {}
        for rule, seconds in (("roofline", lambda t: t["round_s"]), ("bytes", by_bytes)):
            best = {
                name: min(
                    (seconds(row["targets"][gpu]), layout, row["tau"])
                    for layout, table in tables.items()
                    for row in table
                    if row["round"] == name
                )
                for name in names
            }
            fastest = max(best, key=lambda name: best[name][2] / best[name][0])
            picks[rule] = {"fastest": fastest, "layouts": {n: best[n][1] for n in names}}
        changed = [
            n for n in names if picks["roofline"]["layouts"][n] != picks["bytes"]["layouts"][n]
        ]
        rows.append(
            {
                "gpu": gpu,
                "moe": moe,
                "context": context,
                "batch": batch,
                **picks,
                "layout_changed": changed,
            }
        )
    return rows


def main() -> None:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    jax.config.update("jax_num_cpu_devices", 8)  # before any JAX op, as jaxdd.plan's own main
    configs = (FIXTURES / "kimi_k25_config.json", FIXTURES / "kimi_k26_dflash_config.json")
    rows, advised, capacity = [], [], {}
    for moe in MODES:
        config, drafter_config, experts = read_configs(*configs)
        mesh = make_mesh(8, find_machine("rtx-pro-6000", 8).devices)
        models, per_device, _ = abstract_models(config, drafter_config, experts, mesh, moe)
        model_bytes = ModelBytes.of(*models, shard_bytes)
        work = ModelWork.of(*models, shard_bytes)
        slot = slot_bytes(config, drafter_config, mesh)
        for gpu in TARGETS:
            free = GPUS[gpu].memory - sum(per_device.values())
            capacity[(gpu, moe)] = cache_capacities(free, slot, 8)
        for context, batch in itertools.product(CONTEXTS, BATCHES):
            pair = PairAccount(config, model_bytes, work)
            block = drafter_config.block_size
            tables = {
                layout: traffic_table(pair, Spread(8, moe, layout), context, block, batch=batch)
                for layout in LAYOUTS
            }
            rows += round_rows(tables, moe, context, batch)
            advised += advice(tables, moe, context, batch)
    for row in rows:
        held = capacity[(row["gpu"], row["moe"])][row["layout"]]["tokens"]
        row["fits"] = row["batch"] * row["context"] <= held
    write_result(
        RESULT,
        {
            "command": COMMAND,
            "rows": rows,
            "advice": advised,
            "capacity_tokens": {
                f"{gpu} {moe}": {layout: c[layout]["tokens"] for layout in LAYOUTS}
                for (gpu, moe), c in capacity.items()
            },
            "peaks": {
                gpu: {"flops": GPUS[gpu].peak_flops, "source": GPUS[gpu].peak_source}
                for gpu in TARGETS
            },
        },
    )
    print(table(rows))
    for row in advised:
        print(
            f"{row['gpu']} {row['moe']} {row['context'] // 1024}k x{row['batch']}: fastest "
            f"{row['roofline']['fastest']} (bytes alone: {row['bytes']['fastest']}); layout "
            f"changed for {row['layout_changed'] or 'none'}"
        )


def table(rows: list[dict]) -> str:
    """The README's table: per GPU, MoE mode, context and rows, each round's memory and compute
    ms (compute-bound ones in bold), and whether the rows' context fits."""
    lines = [
        "| GPUs | MoE | context | rows | " + " | ".join(ROUNDS.values()) + " | fits |",
        "|---|---|---|---|" + "---|" * len(ROUNDS) + "---|",
    ]
    key = lambda r: (r["gpu"], r["moe"], r["context"], r["batch"])
    for (gpu, moe, context, batch), group in itertools.groupby(sorted(rows, key=key), key):
        group = list(group)
        cells = []
        for row in group:
            cell = f"{row['memory_s'] * 1e3:.1f} / {row['compute_s'] * 1e3:.1f}"
            cell += f" {row['layout'][0]}"
            cells.append(f"**{cell}**" if row["bound"] == "compute" else cell)
        fits = "yes" if all(row["fits"] for row in group) else "no"
        lines.append(
            f"| {GPUS[gpu].name} | {moe} | {context // 1024}k | {batch} | "
            + " | ".join(cells)
            + f" | {fits} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
