"""``python -m jaxdd.crosscheck``: dump PyTorch reference traces, or compare jaxdd against them."""

from __future__ import annotations

import argparse
import json

from jaxdd import cli
from jaxdd.cli import parse_ids, positive
from jaxdd.crosscheck import __doc__ as usage
from jaxdd.errors import CheckpointError, ConfigError, InputError
from jaxdd.types import METHODS, MOE_MODES

DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def build_parser() -> argparse.ArgumentParser:
    # bad arguments in one line, the subcommands' too (they take the parser's class)
    parser = cli.OneLineParser(
        prog="python -m jaxdd.crosscheck", description=usage.split("\n\n")[0]
    )
    commands = parser.add_subparsers(dest="command", required=True)
    dump = commands.add_parser("dump", help="run the PyTorch references and store their traces")
    dump.add_argument("--target", required=True, help="HF target checkpoint directory")
    dump.add_argument("--drafter", help="z-lab DFlash drafter directory (dflash, ddtree)")
    dump.add_argument(
        "--prompts", required=True, help="JSON list of prompts (token-id lists or strings)"
    )
    dump.add_argument("--method", choices=METHODS, required=True)
    dump.add_argument("--out", required=True, help="reference file to write (.npz)")
    dump.add_argument(
        "--max-new-tokens", type=positive, default=32, help="tokens to generate per prompt"
    )
    dump.add_argument("--block-size", type=positive, help="default: the drafter's")
    dump.add_argument(
        "--budget", type=positive, help="DDTree nodes per round (default: block size - 1)"
    )
    dump.add_argument("--stop-ids", type=parse_ids, help="default: the target's EOS ids")
    dump.add_argument("--topk", type=positive, default=8, help="draft and logit top-k to store")
    compare = commands.add_parser(
        "compare", help="run jaxdd on this backend and compare with a reference"
    )
    compare.add_argument("reference", help="file written by dump")
    compare.add_argument(
        "--dtype", choices=sorted(DTYPES), default="fp32", help="what jaxdd computes in"
    )
    compare.add_argument(
        "--target", help="the target checkpoint (default: the directory the reference names)"
    )
    compare.add_argument(
        "--drafter", help="the drafter checkpoint (default: the directory the reference names)"
    )
    compare.add_argument(
        "--devices", type=positive, default=1, help="shard the models over this many devices"
    )
    compare.add_argument(
        "--moe", choices=MOE_MODES, default="tp", help="with several devices: tp or ep experts"
    )
    compare.add_argument("--json", action="store_true", help="print the report as JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cli.choose_platform()
    cli.enable_compilation_cache()
    try:
        if args.command == "dump":
            from jaxdd.crosscheck.dump import ReferenceRun, dump, read_prompts

            prompts = read_prompts(args.prompts, args.target)
            run = ReferenceRun(
                args.method,
                args.max_new_tokens,
                args.block_size,
                args.budget,
                None if args.stop_ids is None else tuple(args.stop_ids),
                args.topk,
            )
            path = dump(args.target, prompts, args.out, run, drafter_dir=args.drafter)
            print(f"wrote {path}: {len(prompts)} prompt(s), method {args.method}")
            return 0
        from jaxdd.crosscheck.compare import compare

        report = compare(
            args.reference, DTYPES[args.dtype], args.target, args.drafter, args.devices, args.moe
        )
    except (
        CheckpointError,
        ConfigError,
        InputError,
        FileNotFoundError,
        ValueError,
        cli.Refusal,
    ) as error:
        return cli.fail(error)
    print(json.dumps(report.to_json(), indent=2, allow_nan=False) if args.json else report)
    return 0 if report.ok else 1


if __name__ == "__main__":
    cli.run(main)
