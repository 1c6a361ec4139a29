"""Timing helpers shared by the benchmark scripts (medians, with results forced to finish)."""

from __future__ import annotations

import statistics
import time

import jax


def median_ms(fn, repeats: int = 30) -> float:
    """Median milliseconds of ``fn()`` after one warm-up call (compilation), waiting for device results."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def timed(fn, repeats: int):
    """(result of the last call, median seconds over ``repeats`` calls)."""
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return result, statistics.median(times)
