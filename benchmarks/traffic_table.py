"""The Kimi K2.6 + K2.6 DFlash traffic account on 8 GPUs: bytes per round
and device, the floor per round and the tokens/s the demo pair's tau curve
predicts, TP vs EP, 8k and 32k tokens of context (``jaxdd.plan --traffic``).

    python benchmarks/traffic_table.py

Computed from the model's shapes and the GPUs' datasheets (``jaxdd.planning.traffic``), not
measured, under uniform routing. Beside it, the demo pair's measured routing (its router's
choices on 16 HumanEval prompts, per MoE layer): the distinct experts a round of T tokens reads
under that histogram against uniform routing. Writes benchmarks/results/traffic_kimi_k26.json
and prints the README's table (best round per GPU, mode and context).
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

    def recording(router, x):
        weights, experts = original(router, x)
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


def main() -> None:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    jax.config.update("jax_num_cpu_devices", 8)  # before any JAX op, as jaxdd.plan's own main

    config, drafter = FIXTURES / "kimi_k25_config.json", FIXTURES / "kimi_k26_dflash_config.json"
    runs = []
    for moe in ("tp", "ep"):
        for context in (8192, 32768):
            result = plan(
                config,
                drafter,
                PlanOptions(devices=8, moe=moe, max_len=context, compile_round=False),
            )
            runs.append({"moe": moe, "context": context, "rows": result["traffic"]})
    hardware = {key: dataclasses.asdict(gpu) for key, gpu in GPUS.items()}
    routing = demo_routing()
    write_result(
        RESULTS / "traffic_kimi_k26.json",
        {"runs": runs, "hardware": hardware, "demo_routing": routing},
    )
    for t in ROUND_TOKENS:
        measured = " / ".join(f"{layer['distinct'][t]:.2f}" for layer in routing["layers"])
        print(
            f"demo pair, {t} tokens: distinct experts per MoE layer {measured} (uniform "
            f"{routing['uniform'][t]:.2f})"
        )
    print("| GPUs | MoE | context | AR | DFlash | DDTree 4 / 8 / 16 / 32 / 64 | best |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for gpu in ("rtx-pro-6000", "h200", "b200"):
        for run in runs:
            speed = {row["round"]: row["targets"][gpu]["tokens_per_s"] for row in run["rows"]}
            trees = " / ".join(f"{speed[f'ddtree {b}']:.0f}" for b in (4, 8, 16, 32, 64))
            best = max(speed, key=speed.get)
            print(
                f"| {GPUS[gpu].name} | {run['moe']} | {run['context'] // 1024}k | "
                f"{speed['ar']:.0f} | "
                f"{speed['dflash']:.0f} | {trees} | {best} |"
            )


if __name__ == "__main__":
    main()
