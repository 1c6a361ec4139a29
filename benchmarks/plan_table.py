"""Will Kimi K2.6 + K2.6 DFlash fit, per target, from the targets' own compilers
(deviceless, ``jaxdd.plan``): the DDTree round (greedy) for budgets 16 and 64 at
8k and 32k tokens of context, TP and EP, on 8 x H200, 8 x RTX PRO 6000, 8 x B200,
a TPU v5p slice of 8 chips and a TPU v6e slice of 32 chips (16 GB of weights per
chip and the replicated latent cache need more than 16 chips of 32 GB).

    python benchmarks/plan_table.py [--targets h200 v5p:2x2x2 ...]

Each row compiles the full 61-layer program (1-2.5 minutes on this CPU host); rows already
in the result are kept, so an interrupted run resumes (and runs for different targets can
share the file). Writes benchmarks/results/plan_kimi_k26.json and prints the README's table.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from jaxdd.planning.fit import PlanOptions, plan
from jaxdd.testing.benchmark import write_result

RESULT = Path(__file__).parent / "results" / "plan_kimi_k26.json"
FIXTURES = Path(__file__).parent.parent / "tests" / "fixtures"
TARGETS = ("rtx-pro-6000", "h200", "b200", "v5p:2x2x2", "v6e:4x8")
SHAPES = list(itertools.product(("ep", "tp"), (16, 64), (8192, 32768)))  # MoE mode, budget, context
GB = 1e9


def key(row: dict) -> tuple:
    return row["hardware"]["name"], row["moe"], row["budget"], row["max_len"]


def saved_rows() -> list[dict]:
    return json.loads(RESULT.read_text()).get("rows", []) if RESULT.exists() else []


def table(rows: list[dict]) -> str:
    """The README's table: GB per device (weights +
    caches + compiler temporaries) and the verdict."""
    lines = [
        "| target | MoE | budget | context | weights GB | caches GB | temporaries GB | "
        "total GB | of | fits |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in sorted(
        rows,
        key=lambda r: (TARGETS.index(r["hardware"]["name"]), r["moe"], r["budget"], r["max_len"]),
    ):
        d = row["per_device_bytes"]
        weights = (d["target_weights"] + d["drafter_weights"]) / GB
        caches = (d["target_cache"] + d["drafter_cache"]) / GB
        lines.append(
            f"| {row['devices']} x {row['target']['name']} | {row['moe']} | {row['budget']} | "
            f"{row['max_len'] // 1024}k | {weights:.1f} | {caches:.2f} | "
            f"{d['temporaries'] / GB:.2f} | "
            f"{d['total'] / GB:.1f} | {row['target']['memory_bytes'] / GB:.0f} | "
            f"{'yes' if row['fits'] else 'no'} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", nargs="+", default=list(TARGETS), choices=TARGETS)
    args = parser.parse_args()
    rows = saved_rows()
    done = {key(r) for r in rows}
    for target, (moe, budget, context) in itertools.product(args.targets, SHAPES):
        if (target, moe, budget, context) in done:
            continue
        row = plan(
            FIXTURES / "kimi_k25_config.json",
            FIXTURES / "kimi_k26_dflash_config.json",
            PlanOptions(target, moe=moe, budget=budget, max_len=context),
        )
        for name in ("traffic", "traffic_by_layout"):
            row.pop(name)  # benchmarks/traffic_table.py's subject
        print(
            f"{target} {moe} budget {budget} {context // 1024}k: "
            f"{row['per_device_bytes']['total'] / GB:.1f} GB"
        )
        # another run may have added rows meanwhile
        rows = [r for r in saved_rows() if key(r) != key(row)] + [row]
        write_result(RESULT, {"rows": rows, "table": table(rows)})
    print(table(rows))


if __name__ == "__main__":
    main()
