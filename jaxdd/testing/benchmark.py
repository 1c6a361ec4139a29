"""Timing helpers and result files shared by the benchmark scripts
(medians, with results forced to finish; where it ran)."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import jax


def median_ms(fn, repeats: int = 30) -> float:
    """Median milliseconds of ``fn()`` after one warm-up
    call (compilation), waiting for device results."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def timed(fn, repeats: int):
    """(result of the last call, median seconds over ``repeats`` calls)."""
    times = []
    result = None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return result, statistics.median(times)


def machine_info() -> dict:
    """Where a benchmark ran. Speedups on a CPU depend on the processor (benchmarks/README.md,
    "HumanEval"), so results name it."""
    on_cpu = jax.default_backend() == "cpu"
    return {
        "platform": platform.platform(),
        "device": f"CPU ({os.cpu_count()} cores)" if on_cpu else jax.devices()[0].device_kind,
        "processor": _processor_name(),
        "jax": jax.__version__,
    }


def _processor_name() -> str:
    """The CPU's model name from /proc/cpuinfo
    (``platform.processor()`` is empty on most Linux hosts)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def write_result(path: Path, report: dict, **versions: str) -> Path:
    """Write a benchmark's JSON result with the machine it ran on
    (``machine_info`` plus ``versions``, e.g. the torch version), atomically:
    a run stopped part-way leaves the previous result in place."""
    report = {**report, "machine": {**machine_info(), **versions, **report.get("machine", {})}}
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(json.dumps(report, indent=2) + "\n")
    os.replace(partial, path)
    print(f"wrote {path}")
    return path


def process_memory_mb(field: str = "VmHWM") -> float:
    """This process's resident memory from /proc/self/status:
    ``VmRSS`` now, ``VmHWM`` its peak (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise OSError(f"/proc/self/status: no {field}")


def plot_by_clients(
    axis: Any, clients: list[int], series: dict[str, tuple[list[float], str]], title: str
) -> None:
    """Generated tokens/s against concurrent clients on a matplotlib ``axis`` (log scale, a tick
    per count): ``series`` by label, each its rates (one per count) and line style."""
    for label, (rates, style) in series.items():
        axis.plot(clients, rates, style, label=label)
    axis.set(xscale="log", xlabel="concurrent clients", ylabel="generated tokens / s", title=title)
    axis.set_xticks(clients, [str(c) for c in clients])
    axis.legend()
