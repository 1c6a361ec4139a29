"""``python -m jaxdd.generate``: generation, plain (``ar``) or speculative (``dflash``, ``ddtree``), greedy or sampled.

    python -m jaxdd.generate --checkpoint TARGET_DIR [--drafter DRAFTER_DIR] --prompt-ids 1,2,3 [--json]

No demo model is bundled yet; without ``--checkpoint`` this says so and exits.
"""

from __future__ import annotations

import argparse
import json
import sys

import jaxdd
from jaxdd.tokenizer import load_tokenizer


def parse_ids(text: str) -> list[int]:
    try:
        ids = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("the prompt is empty")
    return ids


def positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m jaxdd.generate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", help="target: HF checkpoint directory or jaxdd checkpoint")
    parser.add_argument("--drafter", help="DFlash drafter checkpoint directory (z-lab layout)")
    prompt = parser.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", help="prompt text (needs tokenizer.json in the checkpoint directory)")
    prompt.add_argument("--prompt-ids", type=parse_ids, help="prompt token ids, e.g. 1,2,3")
    parser.add_argument("--method", choices=["ar", "dflash", "ddtree"], help="default: dflash with --drafter, else ar")
    parser.add_argument("--block-size", type=positive, help="DFlash block size (default: the drafter's)")
    parser.add_argument("--budget", type=positive, help="DDTree nodes per round (default: block size - 1)")
    parser.add_argument("--max-new-tokens", type=positive, default=64)
    parser.add_argument("--stop-ids", type=parse_ids, help="stop token ids (default: the target's EOS ids)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0, help="0 = no limit")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--json", action="store_true", help="print one JSON object: ids, acceptance, timings")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.checkpoint is None:
        print("jaxdd: no default model is bundled yet; pass --checkpoint DIR [--drafter DIR] --prompt-ids 1,2,3")
        return 0
    method = args.method or ("dflash" if args.drafter else "ar")
    if method != "ar" and not args.drafter:
        parser.error(f"--method {method} needs --drafter DIR")
    if args.prompt is None and args.prompt_ids is None:
        parser.error("give --prompt TEXT or --prompt-ids 1,2,3")
    try:
        target = jaxdd.load_target(args.checkpoint, dtype=args.dtype)
        tokenizer = load_tokenizer(args.checkpoint)
        if args.prompt is not None:
            if tokenizer is None:
                raise jaxdd.CheckpointError(f"{args.checkpoint}: no tokenizer.json; pass --prompt-ids instead")
            prompt_ids = tokenizer.encode(args.prompt).ids
        else:
            prompt_ids = args.prompt_ids
        drafter = jaxdd.load_drafter(args.drafter, dtype=args.dtype) if method != "ar" else None
        result = target.generate(
            prompt_ids,
            drafter=drafter,
            method=method,
            max_new_tokens=args.max_new_tokens,
            stop_token_ids=args.stop_ids,
            block_size=args.block_size,
            budget=args.budget,
            sampling=jaxdd.Sampling(args.temperature, args.top_p, args.top_k, args.seed),
        )
    except (jaxdd.CheckpointError, jaxdd.ConfigError, jaxdd.InputError) as error:
        print(f"jaxdd: {error}", file=sys.stderr)
        return 2

    tokens_per_second = len(result.tokens) / result.decode_seconds if result.decode_seconds > 0 else None
    if args.json:
        report = {
            "method": method,
            "prompt_ids": list(prompt_ids),
            "output_ids": result.tokens,
            "acceptance_lengths": result.acceptance_lengths,
            "mean_acceptance": result.mean_acceptance,
            "timings": {
                "prefill_seconds": result.prefill_seconds,
                "decode_seconds": result.decode_seconds,
                "tokens_per_second": tokens_per_second,
            },
        }
        print(json.dumps(report))
        return 0
    print(tokenizer.decode(result.tokens) if tokenizer is not None else ",".join(map(str, result.tokens)))
    print(
        f"[{method}] {len(result.tokens)} tokens in {result.rounds + 1} target forwards, "
        f"mean acceptance {result.mean_acceptance:.2f}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
