"""How much JAX compiles (tracing, lowering, XLA) while a block of code runs."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax

# jaxpr_trace_duration, jaxpr_to_mlir_module_duration, backend_compile_duration
COMPILE_EVENTS = "/jax/core/compile/"
# one per executable built or read from a disk cache
BACKEND_COMPILE = COMPILE_EVENTS + "backend_compile_duration"


class CompileClock:
    seconds: float = 0.0  # all compile stages
    count: int = 0  # XLA compilations: zero means every shape was already compiled


@contextlib.contextmanager
def compile_clock() -> Iterator[CompileClock]:
    """``with compile_clock() as clock: ...``; then ``clock.seconds`` is
    the compile time spent inside and ``clock.count`` the number of XLA
    compilations (both 0 when every function was already compiled)."""
    clock = CompileClock()

    def listener(event: str, seconds: float, **_) -> None:
        if event.startswith(COMPILE_EVENTS):
            clock.seconds += seconds
            if event == BACKEND_COMPILE:
                clock.count += 1

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield clock
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
