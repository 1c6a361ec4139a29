"""The drafter's context K/V in fp8 (``--drafter-kv fp8``) against the models' dtype: acceptance
and token identity on HumanEval prompts with the bundled pair (fp32, greedy, batch 1, CPU).

    PYTHONPATH=$PWD python benchmarks/drafter_kv.py [--prompts 16] [--max-new-tokens 64]

The K/V in 8 bits halve the bytes every context token takes on every device (the capacity and
floor in ``benchmarks/traffic_table.py``); only the drafts read them, so the tokens must stay
plain greedy decoding's and the question is what the rounding costs in accepted tokens. Writes
benchmarks/results/drafter_kv.json.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from humaneval import humaneval_prompts

import jaxdd
from jaxdd.cli import DEMO
from jaxdd.decoding.engine import SpeculativeDecoder
from jaxdd.testing.benchmark import write_result
from jaxdd.types import DRAFTER_KVS

RESULTS = Path(__file__).parent / "results"
ROUNDS = {"dflash": {}, "ddtree 16": {"budget": 16}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()
    pair = jaxdd.load_pair(DEMO / "target", DEMO / "drafter", "float32")
    prompts = humaneval_prompts(args.prompts, keep=192)
    common = {"max_new_tokens": args.max_new_tokens, "stop_token_ids": []}
    plain = SpeculativeDecoder(*pair)
    greedy = [plain.generate(p, method="ar", **common).tokens for p in prompts]
    rows = {}
    for kv in DRAFTER_KVS:
        decoder = SpeculativeDecoder(*pair, drafter_kv=kv)
        for name, options in ROUNDS.items():
            method = name.split()[0]
            runs = [decoder.generate(p, method=method, **common, **options) for p in prompts]
            accepted = sum(sum(run.acceptance_lengths) for run in runs)
            rounds = sum(len(run.acceptance_lengths) for run in runs)
            rows[f"{name}, K/V {kv}"] = {
                "tau": accepted / rounds,
                "tokens_equal_ar": [run.tokens for run in runs] == greedy,
            }
            print(f"{name}, drafter K/V {kv}: {rows[f'{name}, K/V {kv}']}", flush=True)
    command = "PYTHONPATH=$PWD python benchmarks/drafter_kv.py"
    write_result(RESULTS / "drafter_kv.json", {"command": command, **vars(args), "rounds": rows})


if __name__ == "__main__":
    main()
