"""AR vs DFlash vs DDTree (budgets 8..256) on a tiny
random target with partly-right drafts, CPU, one run.

    python benchmarks/ddtree_rounds.py [--max-new-tokens 64] [--repeats 3]

Drafts come from the real (random) drafter with the target's own greedy token lifted to the
top at 85% of positions (jaxdd/testing/oracle.py), so rounds accept several tokens. Reports
tokens/s, rounds/s and mean acceptance per method, and the per-stage split of one round
(draft, tree build, verify, accept, commit: the op time of each named scope of the real
round in a profile). Writes benchmarks/results/ddtree_rounds.json and ddtree_rounds.png.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np

import jaxdd
from jaxdd.decoding.engine import SpeculativeDecoder
from jaxdd.testing.benchmark import timed, write_result
from jaxdd.testing.oracle import OracleDrafter
from jaxdd.testing.reference import TINY_K2, drafter_config, hf_drafter, hf_greedy, hf_model
from jaxdd.testing.rounds import BatchRound
from jaxdd.testing.stages import STAGES, round_stages

RESULTS = Path(__file__).parent / "results"
BUDGETS = [8, 16, 32, 64, 128, 256]
BLOCK = 8


def stage_split(
    decoder: SpeculativeDecoder, prompt: list[int], budget: int, max_length: int
) -> dict:
    """Op ms per stage of the real DDTree round (its named
    scopes in a profile), from the state after the prefill."""
    batch_round = BatchRound.of(
        decoder,
        [prompt],
        method="ddtree",
        max_new_tokens=max_length - len(prompt),
        budget=budget,
        stop_token_ids=[],
    )
    return round_stages(batch_round)


def run(decoder, prompts, method, repeats, **kwargs) -> dict:
    def all_prompts():
        return [decoder.generate(p, method=method, stop_token_ids=[], **kwargs) for p in prompts]

    all_prompts()  # compile
    results, seconds = timed(all_prompts, repeats)
    tokens = sum(len(r.tokens) for r in results)
    rounds = sum(r.rounds for r in results)
    return {
        "tokens_per_s": tokens / seconds,
        "rounds_per_s": rounds / seconds,
        "mean_acceptance": tokens / (rounds + len(prompts)),
        "tokens": [r.tokens for r in results],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    max_new = args.max_new_tokens

    ref_target = hf_model(TINY_K2, seed=0)
    with tempfile.TemporaryDirectory() as directory:
        ref_target.save_pretrained(Path(directory) / "t")
        hf_drafter(drafter_config(block_size=BLOCK), seed=0).save_pretrained(Path(directory) / "d")
        target = jaxdd.load_target(Path(directory) / "t", dtype="float32")
        drafter = jaxdd.load_drafter(Path(directory) / "d", dtype="float32")

    prompt = np.random.default_rng(0).integers(0, 250, 24).tolist()
    greedy = np.array(prompt + hf_greedy(ref_target, prompt, max_new + BLOCK))
    right = np.random.default_rng(1).random(len(greedy)) < 0.85
    oracle = OracleDrafter(drafter, greedy, right)
    decoder = SpeculativeDecoder(target, oracle)
    expected = greedy[len(prompt) : len(prompt) + max_new].tolist()

    results = {"ar": run(decoder, [prompt], "ar", args.repeats, max_new_tokens=max_new)}
    results["dflash"] = run(decoder, [prompt], "dflash", args.repeats, max_new_tokens=max_new)
    for budget in BUDGETS:
        results[f"ddtree_{budget}"] = run(
            decoder, [prompt], "ddtree", args.repeats, max_new_tokens=max_new, budget=budget
        )
        results[f"ddtree_{budget}"]["stages"] = stage_split(
            decoder, prompt, budget, len(prompt) + max_new
        )
    for name, r in results.items():
        r["lossless"] = r.pop("tokens") == [expected]
        stages = r.get("stages")
        share = ""
        if stages:
            overhead = stages["build_ms"] + stages["accept_ms"] + stages["commit_ms"]
            stages["build_accept_commit_share"] = overhead / sum(
                v for k, v in stages.items() if k.endswith("_ms")
            )
            share = f", build+accept+commit {stages['build_accept_commit_share']:.1%} of the round"
        speed = f"{r['tokens_per_s']:.0f} tok/s, acceptance {r['mean_acceptance']:.2f}"
        print(f"{name}: {speed}, lossless={r['lossless']}{share}")

    ar = results["ar"]["tokens_per_s"]
    report = {
        "benchmark": "ddtree_rounds",
        "setup": {
            "target": "jaxdd/testing/reference.py TINY_K2 (fp32)",
            "block_size": BLOCK,
            "max_new_tokens": max_new,
            "drafts": "random drafter + greedy token lifted to the top at 85% of positions",
        },
        "results": results,
        "speedup_over_ar": {name: r["tokens_per_s"] / ar for name, r in results.items()},
        "goal": "build + accept + commit <= 15% of the round at budget 64",
    }
    write_result(RESULTS / "ddtree_rounds.json", report)
    plot(results, RESULTS / "ddtree_rounds.png")


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    budgets = BUDGETS
    tree = [results[f"ddtree_{b}"] for b in budgets]
    left.plot(budgets, [r["tokens_per_s"] for r in tree], "o-", label="DDTree")
    for name, style in (("dflash", "--"), ("ar", ":")):
        left.axhline(results[name]["tokens_per_s"], linestyle=style, color="gray", label=name)
    left.set(
        xscale="log",
        xlabel="tree budget (nodes)",
        ylabel="tokens/s",
        title="throughput (CPU, tiny model)",
    )
    left.legend()
    stages = [f"{stage}_ms" for stage in (*STAGES, "other")]
    bottom = np.zeros(len(budgets))
    for stage in stages:
        values = np.array([r["stages"][stage] for r in tree])
        right.bar([str(b) for b in budgets], values, bottom=bottom, label=stage.removesuffix("_ms"))
        bottom += values
    right.set(
        xlabel="tree budget (nodes)", ylabel="op ms per round", title="one DDTree round, by stage"
    )
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
