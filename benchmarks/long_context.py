"""Does acceptance hold across the context? (issue 69's goal)

    python benchmarks/long_context.py [--target DIR] [--drafter DIR] [--files 3]
                                      [--long 1500] [--short 200] [--max-new-tokens 96]
                                      [--budget 16] [--out JSON]

On held-out stdlib files (the trainer's validation split, ``jaxdd.train.data.split``; the first
--files of them, sorted, with --long + --max-new-tokens tokens), a prompt of the file's first
--long tokens and one of its last --short of those (both end at the same place) are decoded
greedily for --max-new-tokens tokens (no stop token) by AR, DFlash and DDTree (--budget nodes)
through ``SpeculativeDecoder.generate_batch``, each prompt alone, prefilled 256 tokens a call.
Reports per run the mean acceptance (tokens per target forward) and tokens/s (compile time
excluded, ``jaxdd.generate.summary``), whether the tokens equal AR's, and per method the mean
acceptance at each length and their ratio: the goal is long >= 0.8x short for DFlash and
DDTree, and DFlash >= 2.5 at the long length. Defaults to the bundled pair; writes
benchmarks/results/long_context.json (or --out) with the machine and the command.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

import jaxdd
from jaxdd.cli import DEMO
from jaxdd.decoding.engine import SpeculativeDecoder
from jaxdd.generate import summary
from jaxdd.testing.benchmark import write_result
from jaxdd.train.data import encode_corpus, split, stdlib_files
from jaxdd.train.tokenizer import END_OF_TEXT

RESULTS = Path(__file__).parent / "results"
PREFILL_CHUNK = 256  # the prompt's activations, not a 1,500-token prefill's, on the shared host


def held_out_prompts(
    target_dir: Path, files: int, long: int, short: int, new_tokens: int
) -> list[tuple[str, list[int], list[int]]]:
    """(file, long prompt, short prompt) for the first ``files`` validation files with
    ``long + new_tokens`` tokens; both prompts end at token ``long`` of the file."""
    tokenizer = Tokenizer.from_file(str(target_dir / "tokenizer.json"))  # as the trainer reads
    separator = tokenizer.token_to_id(END_OF_TEXT)
    out = []
    for name in split(stdlib_files())[1]:
        ids = encode_corpus(tokenizer, [name], separator)
        if len(ids) >= long + new_tokens:
            prompt = ids[:long].tolist()
            out.append((name, prompt, prompt[-short:]))
        if len(out) == files:
            return out
    raise ValueError(f"--files: only {len(out)} validation files have {long + new_tokens} tokens")


def decode(decoder: SpeculativeDecoder, prompt: list[int], method: str, args) -> dict:
    """One greedy generation's summary, its tokens and its run without compile time (a
    run that compiled is repeated)."""
    options = {"budget": args.budget} if method == "ddtree" else {}

    def run():
        return decoder.generate_batch(
            [prompt],
            method=method,
            max_new_tokens=args.max_new_tokens,
            stop_token_ids=[],
            prefill_chunk=PREFILL_CHUNK,
            **options,
        )[0]

    result = run()
    if result.compile_seconds > 0:
        result = run()
    return {**summary(method, result), "tokens": result.tokens}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", type=Path, default=DEMO / "target")
    parser.add_argument("--drafter", type=Path, default=DEMO / "drafter")
    parser.add_argument("--files", type=int, default=3)
    parser.add_argument("--long", type=int, default=1500)
    parser.add_argument("--short", type=int, default=200)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--budget", type=int, default=16)
    parser.add_argument("--out", type=Path, default=RESULTS / "long_context.json")
    args = parser.parse_args(argv)
    if not 0 < args.short <= args.long:
        parser.error(f"--short must be in [1, --long {args.long}], got {args.short}")
    for flag, path in (("--target", args.target / "tokenizer.json"), ("--drafter", args.drafter)):
        if not path.exists():
            parser.error(f"{flag}: {path} does not exist")
    try:
        prompts = held_out_prompts(
            args.target, args.files, args.long, args.short, args.max_new_tokens
        )
    except ValueError as error:
        parser.error(str(error))
    target, drafter = jaxdd.load_pair(args.target, args.drafter, "float32")
    decoder = SpeculativeDecoder(target, drafter)
    methods = ("ar", "dflash", "ddtree")
    runs = []
    for name, long_prompt, short_prompt in prompts:
        for prompt in (short_prompt, long_prompt):
            results = {method: decode(decoder, prompt, method, args) for method in methods}
            tokens = {method: result.pop("tokens") for method, result in results.items()}
            for method, result in results.items():
                result |= {"file": name, "prompt_tokens": len(prompt)}
                result["tokens_equal_ar"] = tokens[method] == tokens["ar"]
                runs.append(result)
                print(
                    f"{name} {len(prompt)} {method}: acceptance {result['mean_acceptance']:.2f}, "
                    f"{result['tokens_per_second']:.0f} tokens/s",
                    flush=True,
                )
    report = {
        "command": shlex.join(["python", "benchmarks/long_context.py", *sys.argv[1:]]),
        "target": str(args.target),
        "drafter": str(args.drafter),
        "budget": args.budget,
        "max_new_tokens": args.max_new_tokens,
        "by_method": by_method(runs, args.short, args.long),
        "runs": runs,
    }
    write_result(args.out, report)
    return 0


def by_method(runs: list[dict], short: int, long: int) -> dict:
    """Per speculative method: mean acceptance and tokens/s at each prompt length, and the
    long / short acceptance ratio."""
    out = {}
    for method in ("dflash", "ddtree"):
        at = {
            length: [r for r in runs if r["method"] == method and r["prompt_tokens"] == length]
            for length in (short, long)
        }
        mean = {n: float(np.mean([r["mean_acceptance"] for r in rs])) for n, rs in at.items()}
        speed = {n: float(np.mean([r["tokens_per_second"] for r in rs])) for n, rs in at.items()}
        out[method] = {
            f"acceptance_{short}": round(mean[short], 3),
            f"acceptance_{long}": round(mean[long], 3),
            "long_over_short": round(mean[long] / mean[short], 3),
            f"tokens_per_second_{short}": round(speed[short], 1),
            f"tokens_per_second_{long}": round(speed[long], 1),
        }
    return out


if __name__ == "__main__":
    raise SystemExit(main())
