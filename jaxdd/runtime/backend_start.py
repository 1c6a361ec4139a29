"""Starting JAX's backend, with each way it can fail found first or said in one line (a Refusal):
an accelerator asked for whose device files are absent, an ``XLA_FLAGS`` flag XLA does not know
(XLA aborts on it), more simulated CPU devices than the host's memory holds, a runtime that fails
to start."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import select
import signal
import sys

import jax
from jax._src import xla_bridge
from jax._src.lib import xla_client

from jaxdd.errors import Refusal
from jaxdd.runtime.host import available_memory

# The device files an accelerator's driver creates: without them JAX
# can only fail (or, for a TPU, probe the cloud metadata server first).
DEVICE_FILES = {"gpu": ("/dev/nvidiactl", "/dev/kfd"), "tpu": ("/dev/accel0", "/dev/vfio/0")}
# Simulated CPU devices cost the host memory growing with their count squared
# (every device pair's collective buffers and partitioned programs): bytes
# per pair, measured on the bundled pair (benchmarks/README.md, "Faults").
CPU_DEVICE_PAIR_BYTES = 70 * 2**10
FLAG_CHECK_SECONDS = 30  # a trial parse of XLA_FLAGS taking longer is abandoned (the run will tell)


def device_present(platform: str) -> str | None:
    """The device file that shows ``platform``'s accelerator is here, or None."""
    return next((f for f in DEVICE_FILES.get(platform, ()) if os.path.exists(f)), None)


def check_xla_flags() -> None:
    """A Refusal naming the flags of ``XLA_FLAGS`` that XLA does not know. XLA parses the variable
    when the first backend starts and aborts on an unknown flag (a fatal log line, or a C++ trace):
    a forked child makes that parse first. Once a backend runs, the flags were parsed already."""
    flags = os.environ.get("XLA_FLAGS", "").strip()
    if not flags or xla_bridge.backends_are_initialized():
        return
    reader, writer = os.pipe()
    child = os.fork()
    if child == 0:  # only this thread lives on in the child: it parses, and exits
        os.dup2(writer, 2)
        try:
            xla_client.make_cpu_client()
        finally:
            os._exit(0)
    os.close(writer)
    said = b""
    while select.select([reader], [], [], FLAG_CHECK_SECONDS)[0]:
        chunk = os.read(reader, 4096)
        if not chunk:
            break
        said += chunk
    os.close(reader)
    os.kill(child, signal.SIGKILL)  # a no-op unless it hung
    os.waitpid(child, 0)
    unknown = re.search(r"Unknown (flags?) in XLA_FLAGS: (.*)", said.decode(errors="replace"))
    if unknown:
        raise Refusal(f"XLA_FLAGS: unknown {unknown.group(1)} {unknown.group(2).strip()}")


def start_backend() -> list:
    """JAX's devices, starting its backend; a Refusal naming the platform when
    its runtime fails to start (a driver without its CUDA libraries, a TPU held
    by another process). JAX logs a plugin's failure as a traceback: held, and
    said in one line (a note when JAX started another platform instead)."""
    logger = logging.getLogger("jax._src.xla_bridge")
    held = _Held(logging.WARNING)
    logger.addHandler(held)
    propagate = logger.propagate
    logger.propagate = False
    try:
        devices = jax.devices()
    # JAX asserts when no platform it was asked for started
    except (RuntimeError, AssertionError) as error:
        platforms = (
            f"JAX_PLATFORMS={jax.config.jax_platforms}" if jax.config.jax_platforms else "JAX"
        )
        reasons = [*held.reasons(), *_lines(error)]
        raise Refusal(
            f"{platforms}: no backend started ({reasons[0] if reasons else 'no reason given'})"
        ) from None
    finally:
        logger.removeHandler(held)
        logger.propagate = propagate
    for reason in held.reasons():
        print(
            f"jaxdd: note: {reason}; running on {devices[0].platform}", file=sys.stderr, flush=True
        )
    return devices


class _Held(logging.Handler):
    def __init__(self, level: int):
        super().__init__(level)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def reasons(self) -> list[str]:
        """Each record's message in one line, with its
        exception's (the cause of a plugin's failure)."""
        out = []
        for record in self.records:
            message = _lines(record.getMessage())
            cause = _lines(record.exc_info[1]) if record.exc_info and record.exc_info[1] else []
            out.append(": ".join(message[:1] + cause[:1])[:300])
        return [line for line in out if line]


def _lines(value: object) -> list[str]:
    return [line.strip() for line in str(value).strip().splitlines() if line.strip()]


def simulated_device_limit(available: int | None) -> int:
    """The most CPU devices to simulate: those whose cost stays within half of ``available`` bytes
    (the other half for the model and its compiles); 64 where the host's memory is unknown."""
    return 64 if available is None else max(1, math.isqrt(available // 2 // CPU_DEVICE_PAIR_BYTES))


def simulate_cpu_devices(count: int) -> None:
    """Give the CPU backend ``count`` devices, or a Refusal
    when the host's memory cannot hold that many."""
    check_simulated(count, f"--devices {count}")
    # Once JAX's backend runs (main called in-process), the
    # devices it has are what --devices is checked against.
    with contextlib.suppress(RuntimeError):
        jax.config.update("jax_num_cpu_devices", count)


def check_simulated(count: int, asked: str) -> None:
    available = available_memory()
    limit = simulated_device_limit(available)
    if count > limit:
        need = count**2 * CPU_DEVICE_PAIR_BYTES / 1e9
        have = "" if available is None else f" of the {available / 1e9:.1f} GB available"
        raise Refusal(
            f"{asked}: this host has 1 CPU device; simulating {count} would take about "
            f"{need:.0f} GB "
            f"(at most {limit} fit in half{have})"
        )
