"""What the real targets' compiled rounds move: Kimi K2.6 + its DFlash drafter (full
width), each round compiled deviceless for H200, RTX PRO 6000 and TPU v5p
(``jaxdd.plan``), its HLO traffic account (``jaxdd.compiled_traffic``) against the floor
(``jaxdd.planning.traffic``) of the same latent cache layout, and the tokens/s each predicts
with the demo pair's tau.

    JAX_PLATFORMS=cpu python benchmarks/compiled_traffic.py [--layers 3] [--hardware h200 ...]
        [--method ar ...] [--max-len 131072] [--cache-layout striped] [--greedy]
        [--drafter-kv fp8]

TP8 over 8 devices, 8k tokens of context by default, batch 1; AR, DFlash (block 8) and DDTree
(budget 16) rounds, greedy, and the sampled DDTree round. Each round compiles in its
own process, one at a time (a full-width compile takes a minute and several GB).
Merges its rows into benchmarks/results/compiled_traffic_<layers>l_<context>k_<layout>.json
by (hardware, round), so the rows of rounds not compiled this run stay, and prints the table
and its README rows.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

from jaxdd.planning.hardware import named_hardware
from jaxdd.planning.traffic import DEMO_TAU
from jaxdd.testing.benchmark import write_result
from jaxdd.types import DRAFTER_KVS, LAYOUTS, CacheLayout, DrafterKV

RESULTS = Path(__file__).parent / "results"
FIXTURES = Path(__file__).parent.parent / "tests" / "fixtures"
HARDWARE = ("h200", "rtx-pro-6000", "v5p:2x2x2")
ROUNDS = (("ar", False), ("dflash", False), ("ddtree", False), ("ddtree", True))
BUDGET = 16


@dataclasses.dataclass(frozen=True)
class Context:
    """The context the rounds are compiled at, their latent cache's layout and the drafter's
    K/V dtype."""

    max_len: int
    layout: CacheLayout
    drafter_kv: DrafterKV = "model"

    def results(self, layers: int) -> Path:
        kv = "" if self.drafter_kv == "model" else f"_{self.drafter_kv}"
        name = f"compiled_traffic_{layers}l_{self.max_len // 1024}k_{self.layout}{kv}.json"
        return RESULTS / name


def compile_round(
    hardware: str, method: str, sampled: bool, layers: int | None, context: Context
) -> dict:
    """``jaxdd.plan --json`` for one round, in a fresh
    process (its memory goes back when it ends)."""
    command = [
        sys.executable,
        "-m",
        "jaxdd.plan",
        "--config",
        str(FIXTURES / "kimi_k25_config.json"),
    ]
    command += [
        "--drafter-config",
        str(FIXTURES / "kimi_k26_dflash_config.json"),
        "--hardware",
        hardware,
    ]
    command += [
        "--devices",
        "8",
        "--moe",
        "tp",
        "--method",
        method,
        "--budget",
        str(BUDGET),
        "--max-len",
        str(context.max_len),
        "--cache-layout",
        context.layout,
        "--drafter-kv",
        context.drafter_kv,
    ]
    command += (
        ["--json"] + (["--sampled"] if sampled else []) + ([f"--layers={layers}"] if layers else [])
    )
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "TPU_SKIP_MDS_QUERY": "1",
        "TPU_WORKER_HOSTNAMES": "localhost",
    }
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        return {
            "error": done.stderr.strip().splitlines()[-1][:300]
            if done.stderr.strip()
            else f"exit {done.returncode}"
        }
    return json.loads(done.stdout)


def row(result: dict, hardware: str, method: str, sampled: bool) -> dict:
    """One table row: floor and compiled bytes, their ratio, and tokens/s at each
    (memory bytes / bandwidth plus the floor's link time, all-reduces and a striped round's
    merge, with the demo pair's tau)."""
    chip = named_hardware(hardware)
    account = result["compiled_traffic"]
    floor = account["floor"]
    sent = floor["allreduce_bytes"] + floor["merge_bytes"]
    collectives = floor["allreduces"] + floor["merge_collectives"]
    link_s = sent / chip.link + collectives * chip.collective_latency
    tau = DEMO_TAU[method][BUDGET] if method == "ddtree" else DEMO_TAU[method]
    floor_s = (account["floor_bytes"] - 2 * sent) / chip.bandwidth + link_s
    compiled_s = (account["bytes"] - account["collective_bytes"]) / chip.bandwidth + link_s
    return {
        "hardware": hardware,
        "round": f"{method}{' sampled' if sampled else ''}",
        "floor_bytes": account["floor_bytes"],
        "compiled_bytes": account["bytes"],
        "ratio": account["ratio"],
        "tau": tau,
        "tokens_per_s_floor": tau / floor_s,
        "tokens_per_s_compiled": tau / compiled_s,
        "by_stage": account["by_stage"],
        "top_ops": account["top_ops"][:5],
        "custom_calls": account["custom_calls"],
    }


def round_key(entry: dict) -> tuple[str, str]:
    """(hardware, round) of a row, or of a failure (which says ``sampled`` apart)."""
    return entry["hardware"], entry["round"] + (" sampled" if entry.get("sampled") else "")


def merged(previous: list[dict], new: list[dict], attempted: set[tuple[str, str]]) -> list[dict]:
    """``previous`` entries but those of a (hardware, round) ``attempted`` this run,
    and ``new``'s, in the order of ``HARDWARE`` and ``ROUNDS`` (others last)."""
    names = [f"{m}{' sampled' if s else ''}" for m, s in ROUNDS]
    rank = lambda name, known: known.index(name) if name in known else len(known)

    def order(entry: dict) -> tuple:
        hardware, name = round_key(entry)
        return rank(hardware, HARDWARE), hardware, rank(name, names)

    return sorted([e for e in previous if round_key(e) not in attempted] + new, key=order)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--layers", type=int, default=3, help="full width, this many layers (0: all 61)"
    )
    parser.add_argument("--hardware", nargs="+", default=list(HARDWARE))
    parser.add_argument("--method", nargs="+", default=["ar", "dflash", "ddtree"])
    parser.add_argument("--greedy", action="store_true", help="skip the sampled DDTree round")
    parser.add_argument("--max-len", type=int, default=8192, help="tokens of context")
    parser.add_argument("--cache-layout", choices=LAYOUTS, default="replicated")
    parser.add_argument("--drafter-kv", choices=DRAFTER_KVS, default="model")
    args = parser.parse_args()
    context = Context(args.max_len, args.cache_layout, args.drafter_kv)
    rows, failures = [], []
    for hardware in args.hardware:
        for method, sampled in ROUNDS:
            if method not in args.method or (sampled and args.greedy):
                continue
            result = compile_round(hardware, method, sampled, args.layers or None, context)
            if "error" in result or "compiled_traffic" not in result:
                failures.append(
                    {"hardware": hardware, "round": method, "sampled": sampled, **result}
                )
                print(
                    f"{hardware} {method}{' sampled' if sampled else ''}: "
                    f"{result.get('error', 'did not fit')}"
                )
                continue
            rows.append(row(result, hardware, method, sampled))
            r = rows[-1]
            print(
                f"{hardware:<13} {r['round']:<15} floor {r['floor_bytes'] / 1e9:6.3f} GB  compiled "
                f"{r['compiled_bytes'] / 1e9:6.3f} GB  {r['ratio']:5.2f}x  tokens/s "
                f"{r['tokens_per_s_floor']:7.0f} "
                f"at the floor, {r['tokens_per_s_compiled']:7.0f} compiled",
                flush=True,
            )
    for hardware in args.hardware:
        greedy, sampled = (
            next((r for r in rows if r["hardware"] == hardware and r["round"] == name), None)
            for name in ("ddtree", "ddtree sampled")
        )
        if greedy and sampled:
            print(
                f"{hardware}: sampled / greedy DDTree bytes "
                f"{sampled['compiled_bytes'] / greedy['compiled_bytes']:.3f}"
            )
    layers = args.layers or 61
    path = context.results(layers)
    previous = json.loads(path.read_text()) if path.exists() else {}
    # a round compiled now replaces its old row or failure
    attempted = {round_key(e) for e in rows + failures}
    rows = merged(previous.get("rows", []), rows, attempted)
    failures = merged(previous.get("failures", []), failures, attempted)
    report = {
        "layers": layers,
        "devices": 8,
        "moe": "tp",
        "max_len": context.max_len,
        "cache_layout": context.layout,
        "drafter_kv": context.drafter_kv,
        "budget": BUDGET,
        "rows": rows,
    }
    write_result(path, report | {"failures": failures})
    print("\n".join(readme_rows(rows, failures, context)))


def readme_rows(rows: list[dict], failures: list[dict], context: Context) -> list[str]:
    """The README's table rows: per hardware, compiled bytes / floor of each round (or why its
    compile failed) and the sampled / greedy DDTree bytes."""
    lines = []
    for hardware in dict.fromkeys(e["hardware"] for e in rows + failures):
        ratios = {r["round"]: r for r in rows if r["hardware"] == hardware}
        failed = {round_key(f)[1]: f for f in failures if f["hardware"] == hardware}
        cells = []
        for method in ("ar", "dflash", "ddtree"):
            if method in ratios:
                cells.append(f"{ratios[method]['ratio']:.2f}x")
            else:
                cells.append(
                    f"failed: {failed[method].get('error', 'did not fit')}"
                    if method in failed
                    else "-"
                )
        pair = [ratios.get(name) for name in ("ddtree sampled", "ddtree")]
        cells.append(
            "-" if None in pair else f"{pair[0]['compiled_bytes'] / pair[1]['compiled_bytes']:.3f}"
        )
        name = f"{named_hardware(hardware).name}, {context.max_len // 1024}k, {context.layout}"
        lines.append(f"| {name} | {' | '.join(cells)} |")
    return lines


if __name__ == "__main__":
    main()
