"""``python -m jaxdd.generate``: generate text, plain
(``ar``) or speculative (``dflash``, ``ddtree``), streamed.

    python -m jaxdd.generate  # the bundled kimi-mini pair, a default prompt
    python -m jaxdd.generate "def fibonacci(n):" --method ddtree --budget 16
    python -m jaxdd.generate --prompt-file prompt.txt  # or --prompt-file - for stdin
    python -m jaxdd.generate --checkpoint TARGET_DIR [--drafter DRAFTER_DIR] --prompt-ids 1,2,3
                             --json

The text streams to stdout as tokens are accepted; a summary (tokens/s, mean acceptance
length, target forwards, compile time) goes to stderr. ``--json`` prints one JSON
object instead. Checkpoints with a chat template (instruct models, e.g. Kimi's
tokenizer_config.json) get the prompt wrapped as a user turn unless ``--no-chat``; the bundled
pair's target is a base model (its template is for chat clients), so only with ``--chat``.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import warnings
from pathlib import Path

import jax

import jaxdd
from jaxdd import cli
from jaxdd.cli import DEMO, parse_ids, positive, print_note
from jaxdd.decoding.engine import Generation
from jaxdd.planning.default_layout import RunRound, default_layout
from jaxdd.runtime.backend import Backend
from jaxdd.runtime.distributed import disagreeing_processes
from jaxdd.weights.tokenizer import IncrementalDecoder, TextTokenizer, load_tokenizer

DEFAULT_PROMPT = (
    'def read_config(path):\n    """Read a JSON config file and return it as a dict."""\n'
)


def build_parser() -> argparse.ArgumentParser:
    parser = cli.command_parser("python -m jaxdd.generate", __doc__)
    prompt = parser.add_mutually_exclusive_group()
    prompt.add_argument(
        "prompt", nargs="?", help="prompt text (default with the bundled model: a Python stub)"
    )
    prompt.add_argument(
        "--prompt-file", type=Path, help="read the prompt text from a file ('-': stdin)"
    )
    prompt.add_argument("--prompt-ids", type=parse_ids, help="prompt token ids, e.g. 1,2,3")
    cli.add_model_flags(parser)
    parser.add_argument(
        "--max-new-tokens", type=positive, default=64, help="generate at most this many tokens"
    )
    parser.add_argument(
        "--stop-ids", type=parse_ids, help="stop token ids (default: EOS and end of turn)"
    )
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument(
        "--top-p", type=float, default=1.0, help="nucleus sampling: keep this much probability mass"
    )
    parser.add_argument("--top-k", type=int, default=0, help="0 = no limit")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (temperature > 0)")
    parser.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        help="use the chat template (default: if any, but for the bundled base model)",
    )
    parser.add_argument("--system", help="system message for the chat template")
    parser.add_argument(
        "--prefill-chunk",
        type=positive,
        metavar="TOKENS",
        help="prefill a longer prompt this many tokens at a time (the activations of one chunk; "
        "the same tokens; default: whole)",
    )
    parser.add_argument(
        "--dtype",
        choices=["auto", "bfloat16", "float32"],
        default="auto",
        help="auto: float32 on CPU (XLA:CPU has no bf16 matmul and upcasts: 2-3x slower), "
        "bfloat16 elsewhere",
    )
    cli.add_device_flags(parser)
    parser.add_argument(
        "--verify-checksums",
        action="store_true",
        help="check jaxdd checkpoints against the checksums recorded at conversion first (reads "
        "every byte once)",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object: ids, text, acceptance, timings (prefill_seconds and "
        "decode_seconds include "
        "compile_seconds; tokens_per_second leaves it out)",
    )
    return parser


class TextStream:
    """Prints the text of accepted tokens as they come
    (``IncrementalDecoder``; without a tokenizer, the ids)."""

    def __init__(self, tokenizer: TextTokenizer | None, stop_ids: set[int], status: str):
        self.decoder = IncrementalDecoder(tokenizer) if tokenizer is not None else None
        self.stop_ids = stop_ids
        self.out = sys.stdout
        self.printed_ids = False
        # Said on stderr when the first tokens take over a
        # second (compiling), so never before a quick error.
        self.status = threading.Timer(1.0, lambda: print(status, file=sys.stderr, flush=True))
        self.status.daemon = True

    def __call__(self, tokens: list[int], final: bool = False) -> None:
        self.status.cancel()
        kept = [t for t in tokens if t not in self.stop_ids]
        if self.decoder is not None:
            text = self.decoder.push(kept, final)
        else:
            text = ("," if self.printed_ids and kept else "") + ",".join(map(str, kept))
            self.printed_ids = self.printed_ids or bool(kept)
        if text:
            self.out.write(text)
            self.out.flush()

    def close(self) -> None:
        self(tokens=[], final=True)
        self.out.write("\n")
        self.out.flush()


def read_prompt(
    args, tokenizer: TextTokenizer | None, bundled: bool, parser
) -> tuple[list[int], str | None]:
    """(prompt ids, prompt text or None)."""
    if args.prompt_ids is not None:
        return args.prompt_ids, None
    if args.prompt_file is not None:
        text = (
            read_stdin()
            if str(args.prompt_file) == "-"
            else cli.read_text(args.prompt_file, "--prompt-file")
        )
    elif args.prompt is not None:
        text = args.prompt
    elif bundled:
        text = DEFAULT_PROMPT
    else:
        parser.error("give a prompt: TEXT, --prompt-file FILE (- for stdin) or --prompt-ids 1,2,3")
    if not text:
        raise jaxdd.InputError("the prompt is empty")
    if tokenizer is None:
        raise jaxdd.CheckpointError(
            f"{args.checkpoint}: no tokenizer (tokenizer.json or tiktoken.model); pass "
            f"--prompt-ids instead"
        )
    chat = args.chat
    if chat is None:  # the bundled target is a base model: its template serves chat clients only
        chat = tokenizer.chat_template is not None and not bundled
    if chat:
        return tokenizer.chat_prompt(text, system=args.system), text
    return tokenizer.encode(text), text


def read_stdin() -> str:
    if sys.stdin is None:
        raise jaxdd.InputError("--prompt-file -: standard input is closed")
    try:
        return sys.stdin.read()
    except UnicodeDecodeError:
        raise jaxdd.InputError("--prompt-file -: standard input is not UTF-8 text") from None


def method_flags(args, method: str) -> list[tuple[str, object, bool]]:
    """(flag, value, whether the method uses it) for the flags that only some methods read."""
    return [
        ("--block-size", args.block_size, method != "ar"),
        # auto: each round chosen among DDTree's or DFlash's set
        (
            "--budget",
            args.budget,
            method == "ddtree" or (args.budget, method) == ("auto", "dflash"),
        ),
    ]


def fixed_budget(args) -> int | None:
    """``--budget`` as a number (auto: None, the set's largest round's)."""
    return None if args.budget == "auto" else args.budget


def summary(method: str, result: Generation) -> dict:
    tokens = len(result.tokens)
    running = result.prefill_seconds + result.decode_seconds - result.compile_seconds
    return {
        "method": method,
        "options": result.round_shape,
        "new_tokens": tokens,
        "mean_acceptance": result.mean_acceptance,
        "target_forwards": result.rounds + 1,  # the prefill, then one verify per round
        "rounds_by_spec": result.spec_rounds,
        "prefill_seconds": result.prefill_seconds,
        "decode_seconds": result.decode_seconds,
        "compile_seconds": result.compile_seconds,
        "tokens_per_second": tokens / running if running > 0 else None,  # compile time excluded
    }


def summary_line(report: dict) -> str:
    options = "".join(f" {k} {v}" for k, v in report["options"].items())
    if len(report["rounds_by_spec"]) > 1:  # --budget auto
        options += " rounds " + ", ".join(f"{k} {v}" for k, v in report["rounds_by_spec"].items())
    speed = f"{report['tokens_per_second']:.1f}" if report["tokens_per_second"] else "-"
    return (
        f"[{report['method']}{options}] {report['new_tokens']} tokens, {speed} tokens/s, "
        f"mean acceptance {report['mean_acceptance']:.2f}, {report['target_forwards']} "
        f"target forwards, "
        f"compile {report['compile_seconds']:.1f} s"
    )


def main(argv: list[str] | None = None) -> int:
    with warnings.catch_warnings():
        warnings.simplefilter("always", jaxdd.LargeRoundWarning)
        warnings.showwarning = print_note
        return run(argv)


def run(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    bundled, checkpoint, drafter_dir, method = cli.model_choice(args, parser, DEMO)
    unused = [
        flag for flag, value, used in method_flags(args, method) if value is not None and not used
    ]
    if unused:
        print(f"jaxdd: {unused[0]} does not apply to --method {method}", file=sys.stderr)
        return 2
    platform = cli.choose_platform()
    cli.enable_compilation_cache()
    try:
        devices = cli.start_job(args, platform)
    except (cli.Refusal, jaxdd.InputError) as error:
        return cli.fail(error)
    backend = Backend.local()
    quiet = jax.process_index() != 0  # every process runs the program; process 0 speaks for them
    dtype = cli.compute_dtype(args.dtype, backend.platform)
    stream = None
    try:
        tokenizer = load_tokenizer(checkpoint)
        prompt_ids, prompt_text = read_prompt(args, tokenizer, bundled, parser)
        # On several devices each process reads only its devices' parts of the checkpoints.
        drafter_path = drafter_dir if method != "ar" else None
        target, drafter = jaxdd.load_pair(
            checkpoint, drafter_path, dtype, devices, args.moe or "tp", args.verify_checksums
        )
        stop_ids = args.stop_ids
        if stop_ids is None:
            stop_ids = cli.model_stop_ids(target.config, tokenizer)
        status = f"[{method}] compiling the prefill and the round (once per shape)..."
        stream = None if args.json or quiet else TextStream(tokenizer, set(stop_ids), status)
        if stream is not None:
            if prompt_text is not None:
                print(prompt_text, end="", flush=True)
            stream.status.start()
        result = target.generate(
            prompt_ids,
            drafter=drafter,
            method=method,
            max_new_tokens=args.max_new_tokens,
            stop_token_ids=stop_ids,
            block_size=args.block_size,
            budget=args.budget,
            sampling=jaxdd.Sampling(args.temperature, args.top_p, args.top_k, args.seed),
            on_tokens=stream,
            cache_layout=args.cache_layout
            or default_layout(
                target.model,
                drafter,
                RunRound(
                    method,
                    len(prompt_ids) + args.max_new_tokens,
                    block=args.block_size,
                    budget=fixed_budget(args),
                ),
                args.drafter_kv,
            ).layout,
            drafter_kv=args.drafter_kv,
            prefill_chunk=args.prefill_chunk,
        )
    except (jaxdd.CheckpointError, jaxdd.ConfigError, jaxdd.InputError) as error:
        if stream is not None:
            stream.status.cancel()
        print(f"jaxdd: {error}", file=sys.stderr)
        return 2

    differ = disagreeing_processes(result.tokens, args.max_new_tokens)
    if differ:
        print(f"jaxdd: processes {differ} generated other tokens than process 0", file=sys.stderr)
        return 1
    if quiet:
        return 0
    report = summary(method, result)
    if args.json:
        text = tokenizer.decode(result.tokens) if tokenizer is not None else None
        ids = {"prompt_ids": list(prompt_ids), "output_ids": result.tokens, "text": text}
        line = json.dumps({**ids, **report, "acceptance_lengths": result.acceptance_lengths})
        print(line, flush=True)  # whole, before the collectives' own lines (gloo) reach stdout
        return 0
    stream.close()
    print(summary_line(report), file=sys.stderr)
    return 0


if __name__ == "__main__":
    cli.run(main)
