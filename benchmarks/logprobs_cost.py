"""What logprobs cost a round, on the demo pair and HumanEval prompts (fp32, batch 1, this machine).

    python benchmarks/logprobs_cost.py [--prompts 12] [--max-new-tokens 64] [--logprobs 20]

A DFlash round (block 8) and a DDTree round (budget 16), greedy, with top-20 logprobs (what
``jaxdd.serve`` computes by default, ``--max-logprobs 20``) against the same round without,
per round after compilation (fixed-length runs, A and B interleaved per prompt), and whether
the tokens are the same (they must be). Prompts: the HumanEval prompts of at least 256 -
max_new_tokens tokens, cut to their last that many (one shape bucket).

Writes benchmarks/results/logprobs_cost.json.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from humaneval import humaneval_prompts, load_pair
from tqdm import tqdm

from jaxdd.cli import DEMO
from jaxdd.decoding.engine import SpeculativeDecoder
from jaxdd.testing.benchmark import write_result

RESULTS = Path(__file__).parent / "results"
SHAPES = {"dflash": {"method": "dflash"}, "ddtree budget 16": {"method": "ddtree", "budget": 16}}


def round_cost(decoder: SpeculativeDecoder, prompts: list[list[int]], max_new: int, k: int) -> dict:
    """Mean milliseconds per round without and with top-``k`` logprobs, and
    whether every run's tokens were the same."""
    common = {"max_new_tokens": max_new, "stop_token_ids": []}  # fixed length: full rounds
    arms = {"off": {}, "on": {"logprobs": k}}
    per_round = {(shape, arm): [] for shape in SHAPES for arm in arms}
    same = {shape: True for shape in SHAPES}
    for prompt in tqdm(prompts, desc="logprobs cost", leave=False):
        for shape, options in SHAPES.items():
            tokens = {}
            for arm, extra in arms.items():
                result = decoder.generate(prompt, **options, **extra, **common)
                if result.compile_seconds:
                    result = decoder.generate(prompt, **options, **extra, **common)
                per_round[shape, arm].append(result.decode_seconds / result.rounds * 1e3)
                tokens[arm] = result.tokens
            same[shape] &= tokens["off"] == tokens["on"]
    report = {}
    for shape in SHAPES:
        off, on = (statistics.mean(per_round[shape, arm]) for arm in arms)
        report[shape] = {"off_ms": off, "on_ms": on, "ratio": on / off, "same_tokens": same[shape]}
        print(
            f"{shape}: off {off:.2f} ms, top-{k} logprobs {on:.2f} ms ({on / off:.3f}x), "
            f"same tokens: {same[shape]}"
        )
    return report


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--logprobs", type=int, default=20)
    parser.add_argument("--out", type=Path, default=RESULTS / "logprobs_cost.json")
    args = parser.parse_args()
    keep = 256 - args.max_new_tokens
    prompts = [p for p in humaneval_prompts(164, keep) if len(p) == keep][: args.prompts]
    decoder = SpeculativeDecoder(*load_pair(DEMO))
    cost = round_cost(decoder, prompts, args.max_new_tokens, args.logprobs)
    report = {
        "benchmark": "logprobs_cost",
        "setup": {
            "pair": "jaxdd/demo/kimi-mini (fp32)",
            "prompts": len(prompts),
            "prompt_tokens": keep,
            "max_new_tokens": args.max_new_tokens,
            "logprobs": args.logprobs,
        },
        "round_cost": cost,
        "goal": "a DDTree round with logprobs on within 1.1x of off; tokens identical on and off",
    }
    write_result(args.out, report)


if __name__ == "__main__":
    main()
