"""What this host is, read in one place: the platform
names JAX takes and the memory it can still give."""

from __future__ import annotations

from pathlib import Path

from jaxdd.types import Platform

# JAX_PLATFORMS' names, by the platform jaxdd treats them as.
PLATFORMS: dict[str, Platform] = {
    "cpu": "cpu",
    "cuda": "gpu",
    "gpu": "gpu",
    "rocm": "gpu",
    "tpu": "tpu",
}


def available_memory() -> int | None:
    """Bytes of memory this host can still give (``MemAvailable``), None where unknown."""
    try:
        meminfo = Path("/proc/meminfo").read_text()
        return next(
            int(line.split()[1]) * 1024
            for line in meminfo.splitlines()
            if line.startswith("MemAvailable:")
        )
    except (OSError, StopIteration, ValueError, IndexError):
        return None
