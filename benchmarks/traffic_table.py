"""The Kimi K2.6 + K2.6 DFlash traffic account on 8 GPUs: bytes per round
and device, the floor per round and the tokens/s the demo pair's tau curve
predicts, TP vs EP, 8k, 32k and 128k tokens of context, the latent cache
replicated and striped (``jaxdd.plan --traffic``), and what context the pages
of either layout hold on 8 x RTX PRO 6000.

    JAX_PLATFORMS=cpu PYTHONPATH=$PWD python benchmarks/traffic_table.py

Computed from the model's shapes and the GPUs' datasheets (``jaxdd.planning.traffic``), not
measured, under uniform routing. The capacity comes from the traffic-only plan (memory after the
weights) and from one deviceless compile of the DDTree-16 round at 128k (after its temporaries
too). Beside it, the demo pair's measured routing (its router's choices on 16 HumanEval prompts,
per MoE layer): the distinct experts a round of T tokens reads under that histogram against
uniform routing. Writes benchmarks/results/traffic_kimi_k26.json and prints the README's table
(tokens/s per GPU, mode, context and layout) and the goals of issue 52's account.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import jax
import numpy as np
from humaneval import humaneval_prompts

import jaxdd
from jaxdd.cli import DEMO
from jaxdd.models.moe import Router
from jaxdd.planning.fit import PlanOptions, plan
from jaxdd.planning.hardware import GPUS
from jaxdd.planning.traffic import distinct_experts
from jaxdd.testing.benchmark import write_result

RESULTS = Path(__file__).parent / "results"
ROUND_TOKENS = (1, 8, 9, 17, 65)  # AR, DFlash block 8, DDTree budgets 8, 16, 64
FIXTURES = Path(__file__).parent.parent / "tests" / "fixtures"


def demo_routing(prompts: int = 16) -> dict:
    """Per MoE layer of the demo target: how often its router picks each
    expert (probabilities summing to k), and the distinct experts expected
    for each of ``ROUND_TOKENS`` under that histogram and under uniform."""
    # in call order: every forward runs its MoE layers' routers in turn
    calls: list[np.ndarray] = []
    original = Router.__call__

    def recording(router, *args):
        weights, experts = original(router, *args)
        calls.append(np.asarray(experts))
        return weights, experts

    target = jaxdd.load_target(DEMO / "target", dtype="float32")
    Router.__call__ = recording
    try:
        with jax.disable_jit():  # eager, so the router's choices can be recorded
            for prompt in humaneval_prompts(prompts, 192):
                target.logits([prompt])
    finally:
        Router.__call__ = original
    c = target.config
    moe_layers = c.num_hidden_layers - c.first_k_dense_replace
    layers = []
    for layer in range(moe_layers):
        counts = np.bincount(
            np.concatenate(calls[layer::moe_layers]).ravel(), minlength=c.n_routed_experts
        )
        p = counts / counts.sum() * c.num_experts_per_tok
        layers.append(
            {
                "probabilities": p.round(4).tolist(),
                "distinct": {
                    t: distinct_experts(t, c.num_experts_per_tok, c.n_routed_experts, p)
                    for t in ROUND_TOKENS
                },
            }
        )
    uniform = {
        t: distinct_experts(t, c.num_experts_per_tok, c.n_routed_experts) for t in ROUND_TOKENS
    }
    return {
        "experts": c.n_routed_experts,
        "top_k": c.num_experts_per_tok,
        "uniform": uniform,
        "layers": layers,
    }


CONTEXTS = (8192, 32768, 131072)
CAPACITY_ROUND = {"method": "ddtree", "budget": 16, "max_len": 131072}
FP8 = "the drafter's K/V in fp8, after the compiled round's temporaries"


def main() -> None:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    jax.config.update("jax_num_cpu_devices", 8)  # before any JAX op, as jaxdd.plan's own main

    config, drafter = FIXTURES / "kimi_k25_config.json", FIXTURES / "kimi_k26_dflash_config.json"
    runs, layouts = [], {}
    for moe in ("tp", "ep"):
        for context in CONTEXTS:
            options = PlanOptions("rtx-pro-6000", 8, moe, max_len=context, compile_round=False)
            result = plan(config, drafter, options)
            layouts[(moe, context)] = (result["cache_layout"], result["cache_layout_reason"])
            for layout, rows in result["traffic_by_layout"].items():
                runs.append({"moe": moe, "context": context, "layout": layout, "rows": rows})
    compiled = plan(config, drafter, PlanOptions("rtx-pro-6000", 8, **CAPACITY_ROUND))
    fp8 = plan(config, drafter, PlanOptions("rtx-pro-6000", 8, **CAPACITY_ROUND, drafter_kv="fp8"))
    capacity = {
        "weights only": result["cache_capacity"],
        "after the compiled round's temporaries": compiled["cache_capacity"],
        FP8: fp8["cache_capacity"],
        "compiled_round": CAPACITY_ROUND | {"fits": compiled["fits"], "fits_fp8": fp8["fits"]},
    }
    hardware = {key: dataclasses.asdict(gpu) for key, gpu in GPUS.items()}
    routing = demo_routing()
    write_result(
        RESULTS / "traffic_kimi_k26.json",
        {
            "command": "JAX_PLATFORMS=cpu PYTHONPATH=$PWD python benchmarks/traffic_table.py",
            "runs": runs,
            "default_layout_ddtree_64": {f"{m} {c}": v for (m, c), v in layouts.items()},
            "faster_layout": faster_layouts(runs),
            "capacity_rtx_pro_6000": capacity,
            "hardware": hardware,
            "demo_routing": routing,
        },
    )
    for t in ROUND_TOKENS:
        measured = " / ".join(f"{layer['distinct'][t]:.2f}" for layer in routing["layers"])
        print(
            f"demo pair, {t} tokens: distinct experts per MoE layer {measured} (uniform "
            f"{routing['uniform'][t]:.2f})"
        )
    print_table(runs)
    print_goals(runs, capacity)


def faster_layouts(runs: list[dict]) -> dict[str, dict[str, dict[str, str]]]:
    """Per MoE mode and context, per GPU and round: the layout with the lower floor."""
    floors: dict[str, dict[str, dict[str, dict[str, float]]]] = {}
    for run in runs:
        per_gpu = floors.setdefault(f"{run['moe']} {run['context']}", {})
        for row in run["rows"]:
            for gpu, target in row["targets"].items():
                per_round = per_gpu.setdefault(gpu, {}).setdefault(row["round"], {})
                per_round[run["layout"]] = target["round_s"]
    return {
        key: {
            gpu: {name: min(floor, key=floor.get) for name, floor in rounds.items()}
            for gpu, rounds in per_gpu.items()
        }
        for key, per_gpu in floors.items()
    }


def print_table(runs: list[dict]) -> None:
    """tokens/s at the floor per GPU, MoE mode, context and layout (8k and
    32k replicated only, as before: the layout that is faster there)."""
    print("| GPUs | MoE | context | cache | AR | DFlash | DDTree 4 / 8 / 16 / 32 / 64 | best |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for gpu in ("rtx-pro-6000", "h200", "b200"):
        for run in runs:
            if run["layout"] == "striped" and run["context"] < max(CONTEXTS):
                continue
            speed = {row["round"]: row["targets"][gpu]["tokens_per_s"] for row in run["rows"]}
            trees = " / ".join(f"{speed[f'ddtree {b}']:.0f}" for b in (4, 8, 16, 32, 64))
            best = max(speed, key=speed.get)
            print(
                f"| {GPUS[gpu].name} | {run['moe']} | {run['context'] // 1024}k | "
                f"{run['layout']} | {speed['ar']:.0f} | {speed['dflash']:.0f} | {trees} | {best} |"
            )


def print_goals(runs: list[dict], capacity: dict) -> None:
    """Issue 52's account goals on 8 x RTX PRO 6000, TP, batch 1: GB read per
    device by AR and DDTree-16 per context and layout, and the capacity (against today's
    replicated rows: the drafter's K/V in the models' dtype, after the round's temporaries)."""
    for run in runs:
        if run["moe"] != "tp":
            continue
        read = {row["round"]: row["read_total"] / 1e9 for row in run["rows"]}
        merge = run["rows"][0].get("merges", {})
        collectives = {name: cost["collectives"] for name, cost in merge.items()}
        print(
            f"tp {run['context'] // 1024}k {run['layout']}: AR {read['ar']:.3f} GB, "
            f"DDTree-16 {read['ddtree 16']:.3f} GB per device; merge collectives {collectives}"
        )
    today = capacity["after the compiled round's temporaries"]["replicated"]["tokens"]
    for name in ("weights only", "after the compiled round's temporaries", FP8):
        held = capacity[name]
        ratio = held["striped"]["tokens"] / max(held["replicated"]["tokens"], 1)
        print(
            f"capacity ({name}, {held['free_bytes'] / 1e9:.2f} GB free): replicated "
            f"{held['replicated']['tokens']:,}, striped {held['striped']['tokens']:,} tokens "
            f"({ratio:.2f}x; {held['striped']['tokens'] / max(today, 1):.2f}x today's rows)"
        )


if __name__ == "__main__":
    main()
