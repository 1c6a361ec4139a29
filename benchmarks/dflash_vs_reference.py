"""jaxdd DFlash vs z-lab ``dflash_generate`` (PyTorch), or jaxdd DDTree vs the paper's
``ddtree_generate`` loop (``jaxdd.crosscheck.torch_reference.ddtree_reference``), on
the same tiny weights and prompts, CPU, one run.

    python benchmarks/dflash_vs_reference.py [--method dflash|ddtree] [--budget 16] [--prompts 4]
        [--max-new-tokens 64] [--block-size 8]

Two drafters: the real (random) DFlash drafter, which accepts almost nothing, and a
partly-right oracle that runs the same drafter but swaps in the target's own greedy token at
85% of positions (the same rule drives both sides, jaxdd/testing/oracle.py), for realistic
acceptance lengths. Reports tokens/s of both (median of --repeats runs), the ratio, token
and acceptance identity, and jaxdd's per-round time split (the op time of each stage of the
real round in a profile; host = wall time per round minus the jitted round). Writes
benchmarks/results/dflash_vs_reference.json (``ddtree_vs_reference.json`` for DDTree).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np
import torch

import jaxdd
from jaxdd.crosscheck.torch_reference import Generation, ddtree_reference, dflash_reference
from jaxdd.decoding.engine import SpeculativeDecoder
from jaxdd.testing.benchmark import median_ms, timed, write_result
from jaxdd.testing.oracle import OracleDrafter, patched_reference_drafter
from jaxdd.testing.reference import TINY_K2, drafter_config, hf_drafter, hf_greedy, hf_model
from jaxdd.testing.rounds import BatchRound
from jaxdd.testing.stages import round_stages

RESULTS = Path(__file__).parent / "results"


def stage_breakdown(
    decoder: SpeculativeDecoder, prompt: list[int], max_length: int, options: dict
) -> dict:
    """One round from the state right after the prefill: its median wall ms, and the
    op ms of each of its stages (the real round's named scopes in a profile)."""
    new_tokens = max_length - len(prompt)
    batch_round = BatchRound.of(
        decoder, [prompt], max_new_tokens=new_tokens, stop_token_ids=[], **options
    )
    copies = batch_round.copies(60)  # the round donates its state
    full = median_ms(lambda: batch_round(copies.pop()))
    return {"full_round_ms": full, **round_stages(batch_round)}


def run(
    name, reference_drafter, decoder, ref_target, prompts, max_new, options: dict, repeats
) -> dict:
    """``options``: method, block_size and (DDTree) budget, for both sides."""
    block, budget = options["block_size"], options.get("budget")
    tree_generation = Generation(max_new, block, budget=budget)

    def jaxdd_all():
        return [
            decoder.generate(p, max_new_tokens=max_new, stop_token_ids=[], **options)
            for p in prompts
        ]

    def reference_all():
        if options["method"] == "ddtree":
            return [
                ddtree_reference(reference_drafter, ref_target, p, tree_generation) for p in prompts
            ]
        return [
            dflash_reference(reference_drafter, ref_target, p, Generation(max_new, block))
            for p in prompts
        ]

    jaxdd_all()  # compile
    results, jax_seconds = timed(jaxdd_all, repeats)
    references, ref_seconds = timed(reference_all, repeats)
    jax_tokens = [r.tokens for r in results]
    total, rounds = sum(map(len, jax_tokens)), sum(r.rounds for r in results)
    report = {
        "drafter": name,
        "new_tokens": total,
        "rounds": rounds,
        "mean_acceptance": total / (rounds + len(prompts)),
        "jaxdd_tokens_per_s": total / jax_seconds,
        "reference_tokens_per_s": sum(len(t) for t, _ in references) / ref_seconds,
        "speedup_vs_reference": ref_seconds / jax_seconds,
        "tokens_identical": jax_tokens == [t for t, _ in references],
        "acceptance_identical": [r.acceptance_lengths for r in results]
        == [a for _, a in references],
        "jaxdd_ms_per_round": sum(r.decode_seconds for r in results) / rounds * 1e3,
    }
    print(
        f"{name}: jaxdd {report['jaxdd_tokens_per_s']:.0f} tok/s, reference "
        f"{report['reference_tokens_per_s']:.0f} "
        f"tok/s ({report['speedup_vs_reference']:.1f}x), mean acceptance "
        f"{report['mean_acceptance']:.2f}, "
        f"identical={report['tokens_identical'] and report['acceptance_identical']}"
    )
    return report


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=8)
    parser.add_argument("--method", choices=["dflash", "ddtree"], default="dflash")
    parser.add_argument("--budget", type=int, default=16, help="DDTree's tree budget")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(2)
    block, max_new = args.block_size, args.max_new_tokens
    options = {"method": args.method, "block_size": block} | (
        {"budget": args.budget} if args.method == "ddtree" else {}
    )

    rng = np.random.default_rng(0)
    prompts = [
        rng.integers(0, 250, int(rng.integers(16, 30))).tolist() for _ in range(args.prompts)
    ]
    ref_target = hf_model(TINY_K2, seed=0)
    ref_drafter = hf_drafter(drafter_config(block_size=block), seed=0)
    with tempfile.TemporaryDirectory() as directory:
        ref_target.save_pretrained(Path(directory) / "t")
        ref_drafter.save_pretrained(Path(directory) / "d")
        target = jaxdd.load_target(Path(directory) / "t", dtype="float32")
        drafter = jaxdd.load_drafter(Path(directory) / "d", dtype="float32")

    decoder = SpeculativeDecoder(target, drafter)
    reports = [
        run(
            f"{args.method} (random weights)",
            ref_drafter,
            decoder,
            ref_target,
            prompts,
            max_new,
            options,
            args.repeats,
        )
    ]
    for i, prompt in enumerate(prompts):  # the oracle needs the greedy continuation of each prompt
        greedy = np.array(prompt + hf_greedy(ref_target, prompt, max_new + block))
        right = np.random.default_rng(i).random(len(greedy)) < 0.85
        oracle = SpeculativeDecoder(target, OracleDrafter(drafter, greedy, right))
        patched = patched_reference_drafter(ref_drafter, greedy, right)
        reports.append(
            run(
                f"oracle 85% (prompt {i})",
                patched,
                oracle,
                ref_target,
                [prompt],
                max_new,
                options,
                args.repeats,
            )
        )

    stages = stage_breakdown(decoder, prompts[0], len(prompts[0]) + max_new, options)
    round_ms = reports[0]["jaxdd_ms_per_round"]
    # Wall time per round inside generate() minus the
    # same jitted round timed alone (noisy at this size).
    stages["wall_ms_per_round"] = round_ms
    stages["host_and_dispatch_ms"] = round_ms - stages["full_round_ms"]
    print("per-round split (ms):", {k: round(v, 3) for k, v in stages.items()})

    oracle_reports = reports[1:]
    summary = {
        "oracle_speedup_vs_reference": sum(r["speedup_vs_reference"] for r in oracle_reports)
        / len(oracle_reports),
        "random_speedup_vs_reference": reports[0]["speedup_vs_reference"],
        "all_identical": all(r["tokens_identical"] and r["acceptance_identical"] for r in reports),
    }
    report = {
        "benchmark": f"{args.method}_vs_reference",
        "setup": {
            "target": "jaxdd/testing/reference.py TINY_K2 (fp32)",
            "drafter": f"drafter_config(block_size={block})",
            "prompts": len(prompts),
            "max_new_tokens": max_new,
            **options,
        },
        "runs": reports,
        "jaxdd_round_split_ms": stages,
        "summary": summary,
        "goal": "jaxdd >= 3x the PyTorch reference",
    }
    print(json.dumps(summary, indent=2))
    write_result(RESULTS / f"{args.method}_vs_reference.json", report, torch=torch.__version__)


if __name__ == "__main__":
    main()
