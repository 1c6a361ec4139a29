"""Importing JAX without the CUDA plugin's start-up chatter on hosts without a GPU.

With the CUDA PJRT plugin installed (the ``aot`` extra: compiling for GPUs that are not here),
its CUDA stub prints "Could not find cuda drivers on your machine" from C++, before logging is
configured (``TF_CPP_MIN_LOG_LEVEL`` does not reach it), when ``import jax`` loads the plugin's
extensions and again when JAX registers the plugin. That would break every command's one-line
error. So importing this module (``jaxdd`` and ``convert`` do it first) imports JAX, and has
JAX discover its plugins, with native stderr held: those lines are dropped, everything else
printed is passed on. (Without ``JAX_PLATFORMS=cpu`` such a host also hears JAX itself report
the CUDA plugin's failed start and libtpu's probe for a TPU: real messages, left alone.)

In a command (``python -m jaxdd.generate``, ``serve``, ``plan``, ``crosscheck``, ``convert``)
Ctrl-C or SIGTERM while the imports run ends the process with one line (``end_now``), not a
traceback; ``cli.run`` hands SIGINT back to Python before the command's ``main``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import tempfile
import threading
from collections.abc import Iterator
from types import FrameType

HARMLESS = (
    "cudart_stub.cc",
    "All log messages before absl::InitializeLog() is called are written to STDERR",
)
# The commands: each runs its main through cli.run.
COMMANDS = ("jaxdd.generate", "jaxdd.serve", "jaxdd.plan", "jaxdd.crosscheck", "convert")
STOPPED = {signal.SIGINT: "interrupted", signal.SIGTERM: "terminated"}
_ENDING = threading.Lock()
_stderr = 2  # where end_now writes: fd 2, or the real stderr while fd 2 is held


def end_now(sig: int, frame: FrameType | None = None) -> None:
    """Say ``jaxdd: interrupted`` (or ``terminated``) and exit 128 + ``sig`` at once: unwinding
    while XLA's threads run (compiling, say) can abort the process. Safe from a signal handler and
    from any thread."""
    with _ENDING:  # a second caller waits here while the first exits: one line
        os.write(_stderr, f"jaxdd: {STOPPED.get(sig, signal.Signals(sig).name)}\n".encode())
        os._exit(128 + sig)


def running_command() -> bool:
    """Whether this process is one of ``COMMANDS`` (``python -m NAME``)."""
    argv = getattr(sys, "orig_argv", [])
    return any(argv[i] == "-m" and argv[i + 1] in COMMANDS for i in range(len(argv) - 1))


@contextlib.contextmanager
def _without_cuda_stub_lines() -> Iterator[None]:
    global _stderr
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        _stderr = saved
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            _stderr = 2
            os.close(saved)
            held.seek(0)
            lines = held.read().decode(errors="replace").splitlines(keepends=True)
            sys.stderr.write(
                "".join(line for line in lines if not any(h in line for h in HARMLESS))
            )


def import_jax() -> None:
    """``import jax`` and wrap its plugin discovery, each
    with the CUDA stub's lines dropped (once per process)."""
    if "jax" in sys.modules:
        return
    with _without_cuda_stub_lines():
        import jax  # noqa: F401
    from jax._src import xla_bridge

    # runs once, when the first backend starts
    discover = getattr(xla_bridge, "discover_pjrt_plugins", None)
    if discover is not None:

        def quietly() -> None:
            with _without_cuda_stub_lines():
                discover()

        xla_bridge.discover_pjrt_plugins = quietly


if running_command() and threading.current_thread() is threading.main_thread():
    signal.signal(signal.SIGINT, end_now)
    signal.signal(signal.SIGTERM, end_now)
import_jax()
