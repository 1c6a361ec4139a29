"""What temperature costs, on the demo pair and HumanEval prompts (fp32, batch 1, this machine).

    python benchmarks/temperature.py [--prompts 40] [--max-new-tokens 64] [--budgets 4,8,16,32,64]

Prompts: the HumanEval prompts of at least 256 - max_new_tokens
tokens, cut to their last that many (39 of 164).

1. Round cost: a DFlash round (block 8) and a DDTree round (budget 16) at
   T=0.7 / top-p 0.95 against a greedy round of the same method, per round
   after compilation (fixed-length runs, methods interleaved per prompt).
2. tau and tokens/s of AR, DFlash and DDTree (each budget) at temperatures 0, 0.3, 0.7
   and 1.0 with top-p 0.95, and z-lab ``dflash_generate`` (PyTorch) at the same settings.
   Sampled tokens differ run to run, so the comparison is of means over the prompts.
   DDTree also builds its tree from the raw draft logits ("raw tree") besides the
   temperature-scaled ones (the default): which gives the higher tau at each temperature.

Writes benchmarks/results/temperature.json and temperature.png.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import jax
import torch
from humaneval import (
    REFERENCE,
    humaneval_prompts,
    jaxdd_runner,
    load_pair,
    reference_runner,
    run_interleaved,
)
from tqdm import tqdm

from jaxdd.cli import DEMO
from jaxdd.decoding.engine import SpeculativeDecoder
from jaxdd.decoding.sampling import GREEDY, Sampling
from jaxdd.testing.benchmark import write_result

RESULTS = Path(__file__).parent / "results"
TEMPERATURES = (0.0, 0.3, 0.7, 1.0)
TOP_P = 0.95
ROUND_COST_SAMPLING = Sampling(temperature=0.7, top_p=TOP_P)


def round_cost(decoder: SpeculativeDecoder, prompts: list[list[int]], max_new: int) -> dict:
    """Mean milliseconds per round, greedy vs T=0.7 /
    top-p 0.95, for DFlash and DDTree budget 16."""
    shapes = {
        "dflash": {"method": "dflash"},
        "ddtree budget 16": {"method": "ddtree", "budget": 16},
    }
    settings = {"greedy": GREEDY, "sampled": ROUND_COST_SAMPLING}
    # fixed length: every run has its full rounds
    common = {"max_new_tokens": max_new, "stop_token_ids": []}
    per_round = {(shape, name): [] for shape in shapes for name in settings}
    for prompt in tqdm(prompts, desc="round cost", leave=False):
        for shape, options in shapes.items():
            for name, sampling in settings.items():
                result = decoder.generate(prompt, sampling=sampling, **options, **common)
                if result.compile_seconds:
                    result = decoder.generate(prompt, sampling=sampling, **options, **common)
                per_round[shape, name].append(result.decode_seconds / result.rounds * 1e3)
    report = {}
    for shape in shapes:
        greedy, sampled = (statistics.mean(per_round[shape, name]) for name in settings)
        report[shape] = {"greedy_ms": greedy, "sampled_ms": sampled, "ratio": sampled / greedy}
        print(
            f"round cost {shape}: greedy {greedy:.2f} ms, T=0.7 {sampled:.2f} ms "
            f"({sampled / greedy:.2f}x)"
        )
    return report


def sweep(
    decoder, prompts, models: Path, max_new: int, budgets: list[int], temperature: float
) -> list[dict]:
    """Every method at one temperature over all prompts,
    interleaved per prompt, with the PyTorch reference."""
    sampling = Sampling(temperature=temperature, top_p=TOP_P if temperature > 0 else 1.0)
    stops = list(decoder.config.eos_token_ids)
    common = {"max_new_tokens": max_new, "stop_token_ids": stops, "sampling": sampling}
    methods = {"ar": {"method": "ar"}, "dflash": {"method": "dflash"}}
    for budget in budgets:
        methods[f"ddtree budget {budget}"] = {"method": "ddtree", "budget": budget}
        if temperature > 0:
            methods[f"ddtree budget {budget} (raw tree)"] = {
                "method": "ddtree",
                "budget": budget,
                "tree_logits": "raw",
            }
    runners = {
        label: jaxdd_runner(decoder, {**options, **common}) for label, options in methods.items()
    }
    block = decoder.drafter.config.block_size
    device = "cuda" if torch.cuda.is_available() else "cpu"
    runners[REFERENCE] = reference_runner(models, max_new, block, stops, device, sampling)
    runs = run_interleaved(prompts, runners)
    for run in runs:
        run.pop("outputs")
        run["temperature"] = temperature
        run["options"] = methods.get(run["label"], {"method": "dflash_generate"})
        print(
            f"T={temperature}: {run['label']:>32}: tau {run['tau']:.2f}, "
            f"{run['tokens_per_s']:.0f} tokens/s"
        )
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompts", type=int, default=40)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--budgets", default="4,8,16,32,64")
    parser.add_argument("--out", type=Path, default=RESULTS / "temperature.json")
    parser.add_argument(
        "--round-cost-only", action="store_true", help="only part 1 (e.g. for a GPU check)"
    )
    args = parser.parse_args()
    budgets = [int(b) for b in args.budgets.split(",")]
    # Prompts of one length (the HumanEval prompts of at least that many
    # tokens, cut to their last ones): one shape bucket. XLA:CPU maps ~1000
    # memory regions per compiled round, and a process may hold 65530.
    keep = 256 - args.max_new_tokens
    prompts = [p for p in humaneval_prompts(164, keep) if len(p) == keep][: args.prompts]
    decoder = SpeculativeDecoder(*load_pair(DEMO))
    cost = round_cost(decoder, prompts[:12], args.max_new_tokens)
    runs = []
    for temperature in () if args.round_cost_only else TEMPERATURES:
        jax.clear_caches()  # the previous temperature's executables (see above)
        runs += sweep(decoder, prompts, DEMO, args.max_new_tokens, budgets, temperature)
    report = {
        "benchmark": "temperature",
        "setup": {
            "pair": "jaxdd/demo/kimi-mini (fp32)",
            "prompts": len(prompts),
            "prompt_tokens": keep,
            "max_new_tokens": args.max_new_tokens,
            "top_p": TOP_P,
            "temperatures": list(TEMPERATURES),
            "budgets": budgets,
        },
        "round_cost": cost,
        "runs": runs,
        "goal": "a T=0.7 / top-p 0.95 round of DFlash and of DDTree (budget 16) costs at most "
        "1.15x a greedy one",
    }
    write_result(args.out, report, torch=torch.__version__)
    if runs:
        plot(json.loads(args.out.read_text()), args.out.with_suffix(".png"))


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    labels = list(dict.fromkeys(run["label"] for run in report["runs"]))
    for label in labels:
        runs = sorted(
            (run for run in report["runs"] if run["label"] == label),
            key=lambda run: run["temperature"],
        )
        style = "--" if "raw tree" in label else ":" if label == REFERENCE else "-"
        for axis, key in ((left, "tau"), (right, "tokens_per_s")):
            axis.plot(
                [run["temperature"] for run in runs],
                [run[key] for run in runs],
                "o" + style,
                label=label,
            )
    left.set(
        xlabel="temperature (top-p 0.95 when > 0)",
        ylabel="tau (tokens per verify round)",
        title="acceptance",
    )
    right.set(
        xlabel="temperature (top-p 0.95 when > 0)", ylabel="tokens/s (end to end)", title="speed"
    )
    right.legend(fontsize=6, ncol=2)
    for axis in (left, right):
        axis.grid(alpha=0.3)
    setup = report["setup"]
    fig.suptitle(
        f"kimi-mini, {setup['prompts']} HumanEval prompts, {setup['max_new_tokens']} new tokens, "
        f"{report['machine']['device']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
