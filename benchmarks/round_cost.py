"""What a speculative round costs in AR steps, for the demo
pair and for bigger kimi-mini shapes, on this machine.

    python benchmarks/round_cost.py [--prompts 12] [--max-new-tokens 64]

A round that emits tau tokens on average beats AR only if it costs less than tau AR
steps, so the break-even tau of a method is (time per round) / (time per AR step):
it depends on the hardware and the model shapes, not on how well the drafter
guesses. Rounds are timed as users run them (``SpeculativeDecoder.generate``, batch
1, fp32, no stop tokens, HumanEval prompts, methods interleaved per prompt so that
a slow spell of a shared machine hits all alike, compiled runs excluded).

Shapes: the bundled kimi-mini pair (trained: its measured tau is reported too, so the speedup is tau
over break-even), and random-initialized kimi-mini variants within the issue's 5-20M parameters,
deeper or wider, each with the drafter ``jaxdd.train.drafter`` would train for it (two layers, or a
thin one-layer one): their tau means nothing (random drafts), their break-even tau is what a trained
drafter would have to beat. Writes benchmarks/results/round_cost.json and round_cost.png.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from humaneval import humaneval_prompts, jaxdd_runner, load_pair

from jaxdd.api import Target
from jaxdd.cli import DEMO
from jaxdd.config import DrafterConfig, KimiConfig
from jaxdd.decoding.engine import SpeculativeDecoder
from jaxdd.models.drafter import DFlashDrafter
from jaxdd.models.target import KimiTarget
from jaxdd.testing.benchmark import write_result
from jaxdd.train.drafter import drafter_hf_config
from jaxdd.train.target import KIMI_MINI

RESULTS = Path(__file__).parent / "results"
METHODS = {
    "dflash block 3": {"method": "dflash", "block_size": 3},
    "dflash block 4": {"method": "dflash", "block_size": 4},
    "dflash block 8": {"method": "dflash", "block_size": 8},
    "ddtree block 4 budget 3": {"method": "ddtree", "block_size": 4, "budget": 3},
    "ddtree block 8 budget 8": {"method": "ddtree", "block_size": 8, "budget": 8},
}
WIDE = {
    "hidden_size": 512,
    "intermediate_size": 1536,
    "moe_intermediate_size": 256,
    "q_lora_rank": 256,
    "kv_lora_rank": 128,
}
# name: (target config changes, drafter config changes); None: the bundled trained pair.
SHAPES = {
    "demo pair (trained)": None,
    "8 layers": ({"num_hidden_layers": 8}, {}),
    "width 512": (WIDE, {}),
    "width 512, 1-layer thin drafter": (WIDE, {"num_hidden_layers": 1, "intermediate_size": 512}),
}


def parameters(module: nnx.Module) -> int:
    return sum(x.size for x in jax.tree.leaves(nnx.state(module, nnx.Param)))


def random_pair(target_changes: dict, drafter_changes: dict) -> tuple[Target, DFlashDrafter]:
    """A random-initialized kimi-mini variant and its drafter, fp32."""
    config = KimiConfig.from_hf({**KIMI_MINI, **target_changes})
    target = KimiTarget(config, jnp.float32, rngs=nnx.Rngs(0))
    drafter_config = DrafterConfig.from_hf({**drafter_hf_config(config), **drafter_changes})
    return Target(target), DFlashDrafter(drafter_config, jnp.float32, rngs=nnx.Rngs(1))


def measure(target: Target, drafter: DFlashDrafter, prompts: list[list[int]], max_new: int) -> dict:
    """Per method: ms per round (AR: per step) and tau
    over all prompts, methods interleaved per prompt."""
    decoder = SpeculativeDecoder(target, drafter)
    methods = {"ar": {"method": "ar"}, **METHODS}
    runners = {
        label: jaxdd_runner(decoder, {**options, "max_new_tokens": max_new, "stop_token_ids": []})
        for label, options in methods.items()
    }
    totals = {label: {"seconds": 0.0, "rounds": 0, "tokens": 0} for label in methods}
    for prompt in prompts:
        for label, run in runners.items():
            timed = run(prompt)
            total = totals[label]
            total["seconds"] += timed.decode_seconds
            total["rounds"] += timed.rounds
            total["tokens"] += len(timed.tokens) - 1  # the prefill's token is not a round's
    ar_ms = 1e3 * totals["ar"]["seconds"] / totals["ar"]["rounds"]
    out = {}
    for label, total in totals.items():
        ms = 1e3 * total["seconds"] / total["rounds"]
        tau = total["tokens"] / total["rounds"]
        out[label] = {
            "options": methods[label],
            "ms_per_round": ms,
            "break_even_tau": ms / ar_ms,
            "tau": tau,
            "decode_speedup": tau * ar_ms / ms,
        }
    return out


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(METHODS)
    shapes = report["shapes"]
    fig, axis = plt.subplots(figsize=(11, 4.8))
    width = 0.8 / len(shapes)
    x = np.arange(len(labels))
    for i, (name, shape) in enumerate(shapes.items()):
        costs = [shape["methods"][label]["break_even_tau"] for label in labels]
        label = f"{name} (target {shape['target_params_m']:.1f}M)"
        axis.bar(x + (i - (len(shapes) - 1) / 2) * width, costs, width, label=label)
    demo = shapes["demo pair (trained)"]["methods"]
    axis.plot(
        x,
        [demo[label]["tau"] for label in labels],
        "k*",
        markersize=12,
        label="tau of the trained demo pair",
    )
    axis.plot(
        x,
        [METHODS[label]["block_size"] for label in labels],
        "k_",
        markersize=30,
        label="block size (most tau)",
    )
    axis.set_xticks(x, labels, fontsize=8)
    axis.set_ylabel("break-even tau = round time / AR step time")
    axis.set_title(
        f"Speculative rounds in AR steps, {report['machine']['device']} (a method wins "
        f"where tau > bar)"
    )
    axis.grid(axis="y", alpha=0.3)
    axis.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=RESULTS / "round_cost.json")
    args = parser.parse_args()
    prompts = humaneval_prompts(args.prompts, 256 - args.max_new_tokens)
    shapes = {}
    for name, changes in SHAPES.items():
        target, drafter = load_pair(DEMO) if changes is None else random_pair(*changes)
        methods = measure(target, drafter, prompts, args.max_new_tokens)
        shapes[name] = {
            "target_params_m": parameters(target.model) / 1e6,
            "drafter_params_m": parameters(drafter) / 1e6,
            "config_changes": None
            if changes is None
            else {"target": changes[0], "drafter": changes[1]},
            "methods": methods,
        }
        print(
            f"{name}: AR step {methods['ar']['ms_per_round']:.2f} ms; "
            + ", ".join(
                f"{label} {m['break_even_tau']:.2f}"
                for label, m in methods.items()
                if label != "ar"
            ),
            flush=True,
        )
    report = {
        "benchmark": "round_cost",
        "setup": {
            "prompts": len(prompts),
            "max_new_tokens": args.max_new_tokens,
            "dtype": "float32",
            "batch": 1,
        },
        "shapes": shapes,
    }
    write_result(args.out, report)
    plot(json.loads(args.out.read_text()), args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
