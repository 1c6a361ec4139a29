"""``python -m jaxdd.serve``: an OpenAI-compatible server (completions and chat
completions, streamed or not) with continuous batching of speculative rounds.

    python -m jaxdd.serve  # the bundled kimi-mini pair on 127.0.0.1:8000
    python -m jaxdd.serve --method ddtree --budget 16 --max-batch 16 --max-len 1024
    python -m jaxdd.serve --checkpoint TARGET_DIR --drafter DRAFTER_DIR --port 8080
    python -m jaxdd.serve --devices 16 --coordinator HOST0:1234 --num-processes 2
                          --process-id I  # on each host

Start-up: the flags are checked and the port is bound before anything loads (a port in use is one
line, exit 2), and on XLA:CPU a pool whose programs would take the process past vm.max_map_count
is refused there too (``jaxdd.decoding.memory_maps``); then it compiles every shape it will run
(each prompt bucket's prefill up to --max-prompt, and its scoring prefill unless --max-logprobs
0; each tier's rounds), and once GET /health answers 200 it prints "serving ... on ...". Until
then SIGTERM or Ctrl-C ends it at once (one line, exit 143 / 130); afterwards they drain.

Logprobs (``logprobs`` on completions, ``logprobs`` / ``top_logprobs`` on chat, up to
--max-logprobs top ones, default 20) are the target's distribution before temperature and
cut-offs; with --max-logprobs > 0 every round computes them at the emitted positions (the
tokens are the same), and completions' ``echo`` with ``max_tokens`` 0 scores a prompt alone.

GET /metrics has Prometheus metrics under ``jaxdd:``, vLLM's names: tokens, rounds, latencies, and
jaxdd:request_success_total{finished_reason=stop|length|abort|timeout|error} (abort: the client left
or the drain deadline came) and jaxdd:request_refused_total{reason=invalid|too_long|queue_full|
draining|not_ready|unauthorized} (a 400 / 404 / 413 / 415, a 429, a 503, a 401).

With --api-key KEY (or JAXDD_API_KEY) every route but /health and /metrics wants
``Authorization: Bearer KEY`` (else a 401). Each request gets an access-log line on stderr (method,
path, status, prompt+completion tokens, seconds) unless --no-access-log.

Across several processes (hosts) process 0 alone serves HTTP and decides every step (admit, cancel,
timeout, drain), broadcast to the others before each round; they exit 0 when it does. One that
loses process 0 exits at once (1, in one line, or JAX's own abort when its client notices first),
and one that waits --coordinator-timeout seconds for its next step exits 1.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import jax

import jaxdd
from jaxdd import cli
from jaxdd.cli import DEMO, non_negative, positive, print_note
from jaxdd.config import DrafterConfig, KimiConfig
from jaxdd.decoding.checks import PoolOptions, pool_shape
from jaxdd.decoding.engine import SpeculativeDecoder
from jaxdd.decoding.memory_maps import check_maps, pool_programs
from jaxdd.decoding.round_set import AUTO_ROUNDS
from jaxdd.decoding.rows import RowPool
from jaxdd.errors import checkpoint_directory
from jaxdd.planning.capacity import device_cache_tokens
from jaxdd.planning.default_layout import RunRound, default_layout
from jaxdd.runtime.backend import Backend
from jaxdd.serve import faults, lifecycle
from jaxdd.serve.app import Server, create_app
from jaxdd.serve.decisions import Broadcast, Local
from jaxdd.serve.metrics import Metrics
from jaxdd.serve.scheduler import Scheduler
from jaxdd.types import Method
from jaxdd.weights.tokenizer import load_tokenizer


def seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = cli.command_parser("python -m jaxdd.serve", __doc__)
    cli.add_model_flags(parser)
    parser.add_argument(
        "--max-batch", type=positive, default=8, help="decode rows: requests decoded at once"
    )
    parser.add_argument(
        "--max-waiting", type=positive, default=64, help="queued requests past which a 429 answers"
    )
    parser.add_argument(
        "--max-len", type=positive, default=1024, help="prompt + output tokens per request"
    )
    parser.add_argument(
        "--max-prompt", type=positive, help="prompt tokens per request (default: --max-len - 1)"
    )
    parser.add_argument(
        "--cache-tokens",
        type=positive,
        help="context tokens the pool of cache pages holds for all requests; a request takes "
        "pages as it grows, up to those its prompt and max_tokens reach, and waits (to start, "
        "or a round) while taking them could leave a request unable to end (default: "
        "on GPUs and TPUs, what 90%% of the memory the weights leave holds after the pool's "
        "compiled temporaries; on CPU, every row at --max-len)",
    )
    parser.add_argument(
        "--prefix-cache",
        choices=["on", "off"],
        default="on",
        help="keep the cache pages of ended requests for prompts that start with their tokens "
        "(target and drafter; conversations resent in full prefill only what is new)",
    )
    parser.add_argument(
        "--prefill-chunk",
        type=positive,
        metavar="TOKENS",
        help="prefill a longer prompt this many tokens per round, the other requests decoding "
        "between its chunks (default: a prompt whole, between two rounds)",
    )
    parser.add_argument(
        "--max-logprobs",
        type=non_negative,
        default=20,
        help="top logprobs a request may ask for per token (0: no logprobs, no scoring)",
    )
    parser.add_argument(
        "--request-timeout", type=seconds, help="seconds a request may run before it is ended"
    )
    parser.add_argument(
        "--drain-timeout",
        type=seconds,
        default=30.0,
        help="on SIGTERM / SIGINT: seconds to let requests in flight finish before exiting",
    )
    parser.add_argument(
        "--chat-template", type=Path, help="a Jinja chat template (default: the checkpoint's)"
    )
    parser.add_argument(
        "--model-name",
        "--served-model-name",  # vLLM's name for it
        dest="model_name",
        help="the model id clients name (default: the checkpoint directory's name)",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("JAXDD_API_KEY") or None,
        help="the key clients send as Authorization: Bearer KEY (default: $JAXDD_API_KEY; none)",
    )
    parser.add_argument(
        "--no-access-log",
        dest="access_log",
        action="store_false",
        help="no line on stderr per request",
    )
    parser.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto")
    cli.add_device_flags(parser)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=cli.port, default=8000)
    return parser


# what shrinks a pool's set of programs (memory maps on XLA:CPU), in the server's words
MAP_FLAGS = (
    "lower --max-len (or --max-prompt), set --prefill-chunk, --prefix-cache off, --max-logprobs 0 "
    "or a smaller --max-batch"
)


def check_pool_maps(
    args: argparse.Namespace, checkpoint: Path, drafter: Path | None, method: Method, platform: str
) -> None:
    """The programs the pool will compile, counted from the flags and the checkpoints' configs,
    against this process's memory maps: refused before any weight loads."""
    if not (checkpoint / "config.json").is_file():
        return  # not a checkpoint: the loader says what is missing
    config = KimiConfig.from_json_file(checkpoint / "config.json")
    drafted = 0
    if drafter is not None and (drafter / "config.json").is_file():
        drafted = DrafterConfig.from_json_file(drafter / "config.json").num_hidden_layers
    longest = max(min(args.max_len, config.max_position_embeddings) - 1, 1)  # as the pool admits
    max_prompt = min(args.max_prompt or longest, longest)
    scoring, prefix = args.max_logprobs > 0, args.prefix_cache == "on"
    rounds = AUTO_ROUNDS[method] if args.budget == "auto" else 1
    programs = pool_programs(
        method, args.max_batch, max_prompt, scoring, prefix, args.prefill_chunk, rounds
    )
    flags = MAP_FLAGS + (", a number for --budget" if rounds > 1 else "")
    check_maps(programs, platform, (config.num_hidden_layers, drafted), flags)


def make_pool(args: argparse.Namespace, decoder: SpeculativeDecoder, method: Method) -> RowPool:
    """The server's pool of rows; without --cache-tokens, on GPUs and TPUs, its pages what the
    devices' memory the weights and the pool's temporaries leave holds."""
    prefix, auto = args.prefix_cache == "on", args.budget == "auto"
    asked = {
        "method": method,
        "rows": args.max_batch,
        "max_len": args.max_len,
        "max_prompt": args.max_prompt,
        "block_size": args.block_size,
        "budget": None if auto else args.budget,  # auto: the default is the set's largest
        "max_logprobs": args.max_logprobs,
        "prefill_chunk": args.prefill_chunk,
    }
    fitted = None
    if args.cache_tokens is None:
        fitted = device_cache_tokens(decoder, pool_shape(decoder, PoolOptions(**asked)), prefix)
    try:
        cache_tokens = args.cache_tokens or fitted
        return RowPool.serving(
            decoder, prefix_cache=prefix, auto=auto, cache_tokens=cache_tokens, **asked
        )
    except jaxdd.InputError as error:
        if fitted is None:
            raise
        note = "the default: what the devices' memory holds; set --cache-tokens or lower --max-len"
        raise jaxdd.InputError(f"{error} ({note})") from None


def main(argv: list[str] | None = None) -> int:
    start_up = lifecycle.StartUp()  # first: until the scheduler is ready a signal ends the process
    parser = build_parser()
    args = parser.parse_args(argv)
    bundled, checkpoint, drafter_dir, method = cli.model_choice(args, parser, DEMO)
    drafter_path = drafter_dir if method != "ar" else None
    template = check_paths(args, checkpoint, drafter_path)
    # before JAX starts a backend: no libtpu stall, a clear line for a missing GPU
    platform = cli.choose_platform()
    # Bound before anything loads: a port in use is said in seconds, not after minutes of loading.
    listener = lifecycle.listen(args.host, args.port) if args.process_id in (None, 0) else None
    cli.enable_compilation_cache()
    devices = cli.start_job(args, platform)
    backend = Backend.local()
    dtype = cli.compute_dtype(args.dtype, backend.platform)
    try:
        check_pool_maps(args, checkpoint, drafter_path, method, backend.platform)
        tokenizer = load_tokenizer(checkpoint)
        if template is not None:
            if tokenizer is None:
                raise jaxdd.InputError(
                    "--chat-template: the checkpoint has no tokenizer to encode its text"
                )
            tokenizer.chat_template = template  # its turns end too
        chat_template = tokenizer.chat_template if tokenizer is not None else None
        target, drafter = jaxdd.load_pair(
            checkpoint, drafter_path, dtype, devices, args.moe or "tp"
        )
        budget = None if args.budget == "auto" else args.budget  # auto: its largest round's
        run = RunRound(method, args.max_len, args.max_batch, args.block_size, budget)
        layout = (
            args.cache_layout or default_layout(target.model, drafter, run, args.drafter_kv).layout
        )
        decoder = SpeculativeDecoder(
            target, drafter, cache_layout=layout, drafter_kv=args.drafter_kv
        )
        pool = make_pool(args, decoder, method)
    except (jaxdd.CheckpointError, jaxdd.ConfigError, jaxdd.InputError) as error:
        print(f"jaxdd: {error}", file=sys.stderr)
        return 2
    stop_ids = cli.model_stop_ids(target.config, tokenizer)
    channel = Local()
    if jax.process_count() > 1:
        channel = Broadcast(
            pool.shape.rows,
            pool.shape.max_prompt,
            args.coordinator_timeout,
            leads=jax.process_index() == 0,
        )
    scheduler = Scheduler(pool, Metrics(pool.shape.spec.block), args.max_waiting, channel)
    start_up.ready = scheduler.ready.is_set
    if not channel.leads:
        if listener is not None:  # JAX found the job itself, and this process is not process 0
            listener.close()
        return follow(scheduler)
    name = args.model_name or ("kimi-mini" if bundled else Path(checkpoint).resolve().name)
    server = Server(
        scheduler,
        tokenizer,
        name,
        stop_ids,
        chat_template,
        args.request_timeout,
        args.api_key,
        args.access_log,
    )
    scheduler.start()  # compiles in its thread while the HTTP side already answers /health with 503
    drafted = pool.state.draft_cache  # None for AR
    shape = (
        f"{method}, {args.max_batch} rows, a cache of {pool.cache_tokens} tokens in pages of "
        f"{pool.pages.page}, {layout}, "
        + (f"the drafter's K/V in {drafted.keys[0].dtype}, " if drafted is not None else "")
        + f"prefix cache {args.prefix_cache}, prompt buckets {pool.shape.buckets()}"
        + (
            f", rounds chosen among {'/'.join(pool.round_set.names)}"
            if args.budget == "auto"
            else ""
        )
    )
    try:
        app = create_app(server)
        faults.install_from_env(app, pool)
        serving = f"serving {name} ({shape}) on http://{args.host}:{args.port}/v1"
        lifecycle.serve(app, scheduler, listener, args.drain_timeout, serving)
    finally:
        scheduler.stop()
    return 0


def check_paths(args: argparse.Namespace, checkpoint: Path, drafter: Path | None) -> str | None:
    """What the flags name, checked before anything loads: the checkpoints are directories; the
    chat template's text (None without ``--chat-template``)."""
    checkpoint_directory(checkpoint)
    if drafter is not None:
        checkpoint_directory(drafter)
    if args.chat_template is None:
        return None
    return cli.read_text(args.chat_template, "--chat-template")


def follow(scheduler: Scheduler) -> int:
    """A follower: no HTTP; carry out process 0's decisions
    until it stops (0), or this process's engine fails."""
    print_note(f"process {jax.process_index()}: following process 0's decisions")
    lifecycle.defer_to_process_0()
    scheduler.start()
    scheduler.join()
    return 0 if scheduler.failure is None else 1


if __name__ == "__main__":
    cli.run(main)
