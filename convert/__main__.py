"""``python -m convert``: HF checkpoints <-> jaxdd checkpoints.

    python -m convert hf-to-jaxdd HF_DIR OUT_DIR [--dtype bfloat16|float32] [--dequantize-experts]
    python -m convert jaxdd-to-hf JAXDD_DIR OUT_DIR [--dtype bfloat16|float32]
    python -m convert verify JAXDD_DIR

hf-to-jaxdd reads a Kimi / DeepSeek-V3 target (plain, FP8 blocks, or INT4
pack-quantized experts) or a DFlash drafter; export writes safetensors +
config.json that transformers and dflash load; verify checks a jaxdd checkpoint's
files against the sizes and sha256 checksums recorded when it was written.
"""

from __future__ import annotations

import argparse

from convert.hf_to_jaxdd import convert
from convert.jaxdd_to_hf import export
from convert.verify import verify_checkpoint
from jaxdd import cli
from jaxdd.errors import CheckpointError, ConfigError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m convert", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    to_jaxdd = commands.add_parser(
        "hf-to-jaxdd", help="HF checkpoint directory -> jaxdd checkpoint"
    )
    to_jaxdd.add_argument("source", help="HF checkpoint directory (config.json + *.safetensors)")
    to_jaxdd.add_argument("output", help="new directory for the jaxdd checkpoint")
    to_jaxdd.add_argument(
        "--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="the weights' dtype"
    )
    to_jaxdd.add_argument(
        "--dequantize-experts",
        action="store_true",
        help="store INT4/FP8 routed experts dense (small models)",
    )
    to_hf = commands.add_parser(
        "jaxdd-to-hf", help="jaxdd checkpoint -> HF layout (safetensors + config.json)"
    )
    to_hf.add_argument("source", help="jaxdd checkpoint directory")
    to_hf.add_argument("output", help="new directory for the HF checkpoint")
    to_hf.add_argument("--dtype", choices=["bfloat16", "float32"], help="default: the checkpoint's")
    verify = commands.add_parser(
        "verify", help="check a jaxdd checkpoint's files against their recorded checksums"
    )
    verify.add_argument("source", help="jaxdd checkpoint directory")
    for command in (to_jaxdd, to_hf, verify):
        command.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cli.choose_platform(cpu_only=True)  # conversion runs on the host
    try:
        if args.command == "hf-to-jaxdd":
            print(
                convert(
                    args.source,
                    args.output,
                    args.dtype,
                    args.dequantize_experts,
                    progress=not args.quiet,
                )
            )
        elif args.command == "jaxdd-to-hf":
            export(args.source, args.output, args.dtype, progress=not args.quiet)
        else:
            print(verify_checkpoint(args.source, progress=not args.quiet))
    except (CheckpointError, ConfigError, FileExistsError) as error:
        return cli.fail(error)
    except KeyboardInterrupt:
        cli.fail(
            f"interrupted; {args.output if args.command != 'verify' else 'nothing'} was not written"
        )
        return cli.INTERRUPTED
    return 0


if __name__ == "__main__":
    cli.run(main)
