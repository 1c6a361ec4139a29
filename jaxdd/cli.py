"""What the command lines (``jaxdd.generate``, ``jaxdd.plan``, ``jaxdd.crosscheck``,
``convert``) share: one ``jaxdd: ...`` line and exit code 2 for what the user can fix,
exit 130 on Ctrl-C, silence when the output pipe closes, and the checks of the platform
and device count made before JAX starts a backend (afterwards a wrong one is an assertion,
a C++ abort, a stall in libtpu's probe for a TPU, or a host filled with simulated
devices). An unknown flag in ``XLA_FLAGS`` is found the same way, before XLA aborts on it
(the checks themselves: ``jaxdd.runtime.backend_start``).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import jax

from jaxdd.errors import CheckpointError, ConfigError, InputError, Refusal
from jaxdd.runtime.backend_start import (
    DEVICE_FILES,
    check_simulated,
    check_xla_flags,
    device_present,
    simulate_cpu_devices,
    start_backend,
)
from jaxdd.runtime.distributed import join
from jaxdd.runtime.host import PLATFORMS
from jaxdd.runtime.startup import end_now
from jaxdd.types import DRAFTER_KVS, LAYOUTS, METHODS, MOE_MODES

# 130 and 141: the shell's codes for SIGINT and SIGPIPE
USAGE = 2
INTERRUPTED = 130
BROKEN_PIPE = 141
# a directory, or 0 / off: no persistent compilation cache
CACHE_ENVIRONMENT = "JAXDD_COMPILATION_CACHE"
CLEAR_ERRORS = (CheckpointError, ConfigError, InputError)
DEMO = Path(__file__).parent / "demo" / "kimi-mini"  # the bundled pair, the commands' default model


def print_note(message, *_) -> None:
    """A ``jaxdd: note:`` line on stderr (also the ``warnings.showwarning`` of the commands)."""
    print(f"jaxdd: note: {message}", file=sys.stderr, flush=True)


def compute_dtype(requested: str, platform: str) -> str:
    """``--dtype``: ``auto`` is float32 on CPU (exact
    and not slower there), bfloat16 on accelerators."""
    if requested != "auto":
        return requested
    return "float32" if platform == "cpu" else "bfloat16"


def model_stop_ids(config, tokenizer) -> list[int]:
    """The ids a generation always stops at: the config's
    EOS ids and the tokenizer's (end of turn)."""
    return sorted(set(config.eos_token_ids) | set(tokenizer.stop_ids if tokenizer else ()))


def parse_ids(text: str) -> list[int]:
    try:
        ids = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not ids:
        raise argparse.ArgumentTypeError("the prompt is empty")
    return ids


def positive(text: str) -> int:
    return at_least(text, 1)


def budget(text: str) -> int | str:
    """A positive budget, or "auto" (each round chosen among a set)."""
    return text if text == "auto" else positive(text)


def non_negative(text: str) -> int:
    return at_least(text, 0)


def at_least(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be >= {least}, got {value}")
    return value


def read_text(path: Path, flag: str) -> str:
    """The text of the file ``flag`` names; an unreadable
    or non-UTF-8 file is an ``InputError`` naming both."""
    try:
        return path.read_text()
    except OSError as error:
        raise InputError(f"{flag} {path}: {error.strerror}") from None
    except UnicodeDecodeError:
        raise InputError(f"{flag} {path}: not UTF-8 text") from None


def port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be in 1..65535, got {value}")
    return value


class OneLineParser(argparse.ArgumentParser):
    """Bad arguments in one ``jaxdd: ...`` line, exit 2 (argparse's own adds the usage)."""

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE, f"jaxdd: {message} (--help for usage)\n")


def command_parser(prog: str, doc: str) -> argparse.ArgumentParser:
    """A command's parser: its docstring's first paragraph
    as the description, the rest as the epilog."""
    return OneLineParser(
        prog=prog,
        description=doc.split("\n\n")[0].replace("``", ""),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=doc.split("\n\n", 1)[1].replace("``", ""),
    )


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    """The pair and the round: what ``generate`` and ``serve`` both take."""
    parser.add_argument(
        "--checkpoint",
        type=Path,
        help="target: HF or jaxdd checkpoint (default: bundled kimi-mini)",
    )
    parser.add_argument(
        "--drafter",
        type=Path,
        help="DFlash drafter checkpoint (default with kimi-mini: its drafter)",
    )
    parser.add_argument("--method", choices=METHODS, help="default: dflash with a drafter, else ar")
    parser.add_argument(
        "--block-size", type=positive, help="DFlash block size (default: the drafter's)"
    )
    about = (
        "DDTree nodes per round (default: block size - 1); auto: each round the one of the "
        "default budget, half of it and plain decoding (DFlash: its block and plain decoding) "
        "expected to give the most tokens per second"
    )
    parser.add_argument("--budget", type=budget, help=about)


def add_device_flags(parser: argparse.ArgumentParser) -> None:
    """The devices to shard over and, on several hosts,
    the job: what ``generate`` and ``serve`` both take."""
    parser.add_argument(
        "--devices",
        type=positive,
        help="shard target and drafter over this many devices (default: every GPU or TPU; 1 on "
        "CPU, where "
        "--devices N simulates N; with several processes: the job's, split evenly)",
    )
    parser.add_argument(
        "--moe",
        choices=MOE_MODES,
        help="with several devices, split each routed expert's width (tp, the default: less "
        "traffic per round, "
        "python -m jaxdd.plan --traffic) or place whole experts (ep)",
    )
    parser.add_argument(
        "--cache-layout",
        choices=LAYOUTS,
        help="with several devices, keep the MLA latent cache whole on each (replicated) or "
        "deal its pages over them, each attending over its own (striped: each device reads 1/N "
        "of the context); default: the layout python -m jaxdd.plan finds faster on these "
        "devices (replicated on one device or devices it has no model of)",
    )
    parser.add_argument(
        "--drafter-kv",
        choices=DRAFTER_KVS,
        default="model",
        help="store the drafter's context K/V in the models' dtype (model) or in 8-bit floats "
        "(fp8: half its bytes, so more context per device; the drafts may change, greedy tokens "
        "do not, sampled ones keep the target's distribution but not a seed's draws)",
    )
    hosts = parser.add_argument_group(
        "several hosts (one process each; not needed where JAX finds the job itself)"
    )
    hosts.add_argument(
        "--coordinator", metavar="HOST:PORT", help="process 0's address, the same for every process"
    )
    hosts.add_argument("--num-processes", type=positive, help="processes in the job")
    hosts.add_argument(
        "--process-id",
        type=int,
        help="this process: 0 (speaks for the job: prints, serves) .. num-processes - 1",
    )
    hosts.add_argument(
        "--coordinator-timeout",
        type=positive,
        default=60,
        metavar="SECONDS",
        help="give up when the other processes have not joined within this long, or (serve) "
        "when a process has "
        "waited this long for process 0's next step (default: 60)",
    )


def start_job(args: argparse.Namespace, platform: str) -> int:
    """Join the job the device flags name (or JAX finds), start the backend, and return the
    device count to shard over; a Refusal (or an InputError) for flags this job cannot honour."""
    processes = args.num_processes or 1
    per_host = max(1, (args.devices or 1) // processes)
    join(args.coordinator, args.num_processes, args.process_id, per_host, args.coordinator_timeout)
    if args.devices is not None and processes == 1 and platform == "cpu":
        simulate_cpu_devices(args.devices)
    found = start_backend()
    devices = args.devices or (1 if found[0].platform == "cpu" and processes == 1 else len(found))
    if devices > len(found):
        raise Refusal(
            f"--devices {devices}: {'this host' if processes == 1 else 'the job'} has {len(found)}"
        )
    for flag, value in (("--moe", args.moe), ("--cache-layout", args.cache_layout)):
        if value is not None and devices == 1:
            raise Refusal(f"{flag} applies to several devices (--devices N)")
    return devices


def model_choice(
    args: argparse.Namespace, parser: argparse.ArgumentParser, demo: Path
) -> tuple[bool, Path, Path | None, str]:
    """(bundled, target directory, drafter directory or None, method) from the
    model flags; the bundled pair in ``demo`` when no checkpoint is named."""
    bundled = args.checkpoint is None
    checkpoint = demo / "target" if bundled else args.checkpoint
    drafter_dir = args.drafter or (demo / "drafter" if bundled else None)
    method = args.method or ("dflash" if drafter_dir else "ar")
    if method != "ar" and not drafter_dir:
        parser.error(f"--method {method} needs --drafter DIR")
    return bundled, checkpoint, drafter_dir, method


def fail(message: object) -> int:
    """Print the one ``jaxdd: ...`` line; the exit code for it."""
    if sys.stderr is not None:
        print(f"jaxdd: {message}", file=sys.stderr, flush=True)
    return USAGE


def run(main: Callable[[], int]) -> NoReturn:
    """Run a command's ``main`` as the process: its exit
    code, or the one line for the faults around it."""
    if sys.stdout is None:
        sys.exit(fail("standard output is closed (redirect it to /dev/null to discard the output)"))
    if sys.stderr is not None:
        # a line reaches fd 2 whole: unbuffered (PYTHONUNBUFFERED), print writes text and newline
        # apart, and another thread's line (end_now's, say) could land between them
        sys.stderr.reconfigure(line_buffering=True, write_through=False)
    # From here Ctrl-C is a KeyboardInterrupt again (a command may clean up on it).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        code = main()
        sys.stdout.flush()
    except KeyboardInterrupt:
        # end_now: unwinding would run interpreter shutdown under XLA's threads (a segfault).
        end_now(signal.SIGINT)
    except BrokenPipeError:
        # nothing left to flush into the pipe
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        os._exit(BROKEN_PIPE)
    except (Refusal, *CLEAR_ERRORS) as error:
        code = fail(error)
    except OSError as error:
        if error.filename is None:
            raise
        code = fail(f"{error.filename}: {error.strerror}")
    sys.exit(code)


def choose_platform(cpu_only: bool = False) -> str:
    """Check ``JAX_PLATFORMS`` against this host and settle the platform before a backend
    starts: a value JAX has no backend for, or an accelerator asked for where none is, is
    a Refusal. Unset: the CPU unless a GPU or TPU is here, so a host with libtpu or the
    CUDA plugin installed but no accelerator never starts them. ``cpu_only``: the command
    runs on the host whatever is here (``jaxdd.plan`` compiles deviceless)."""
    asked = os.environ.get("JAX_PLATFORMS", "").strip().lower()
    names = [n.strip() for n in asked.split(",") if n.strip()]
    unknown = [n for n in names if n not in PLATFORMS]
    if unknown:
        raise Refusal(
            f"JAX_PLATFORMS={asked}: {unknown[0]!r} is not a platform (expected cpu, cuda, "
            f"rocm or tpu)"
        )
    missing = [n for n in names if PLATFORMS[n] != "cpu" and device_present(PLATFORMS[n]) is None]
    if missing and not cpu_only:
        kind = PLATFORMS[missing[0]].upper()
        raise Refusal(
            f"JAX_PLATFORMS={asked}: this host has no {kind} "
            f"({' or '.join(DEVICE_FILES[PLATFORMS[missing[0]]])} "
            "missing); unset it to run on the CPU"
        )
    check_xla_flags()
    accelerator = any(device_present(p) for p in DEVICE_FILES)
    chosen = "cpu" if cpu_only or (not names and not accelerator) else asked
    if chosen:
        jax.config.update("jax_platforms", chosen)
    forced = re.search(
        r"--xla_force_host_platform_device_count=(\d+)", os.environ.get("XLA_FLAGS", "")
    )
    if forced:
        check_simulated(int(forced.group(1)), f"XLA_FLAGS={forced.group(0)}")
    if os.environ.get("JAX_NUM_CPU_DEVICES", "").strip().isdigit():
        check_simulated(
            int(os.environ["JAX_NUM_CPU_DEVICES"]),
            f"JAX_NUM_CPU_DEVICES={os.environ['JAX_NUM_CPU_DEVICES']}",
        )
    return chosen


def enable_compilation_cache() -> Path | None:
    """JAX's persistent compilation cache in the user's cache directory, so a second run
    skips the compiles: ``$JAXDD_COMPILATION_CACHE``, else ``$JAX_COMPILATION_CACHE_DIR``
    where set (JAX reads it itself), else ``$XDG_CACHE_HOME/jaxdd`` or ``~/.cache/jaxdd``.
    None: turned off (``JAXDD_COMPILATION_CACHE=0``) or not writable."""
    setting = os.environ.get(CACHE_ENVIRONMENT, "")
    if setting.lower() in ("0", "off", "false", "no"):
        return None
    if not setting and os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return Path(os.environ["JAX_COMPILATION_CACHE_DIR"])
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    directory = Path(setting) if setting else base / "jaxdd" / "compiles"
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    if not os.access(directory, os.W_OK):
        return None
    jax.config.update("jax_compilation_cache_dir", str(directory))
    return directory
