"""XLA:CPU allocates each execution's temporaries with malloc, and glibc serves blocks
past its mmap threshold with fresh mappings that it unmaps at free: every decode step
would page-fault its temporaries in again (the kernel zeroing each page), which would
dominate an INT4 MoE layer's time (benchmarks/README.md). ``keep_allocations`` raises
glibc's thresholds once per process so freed blocks are reused instead."""

from __future__ import annotations

import ctypes
import functools

M_TRIM_THRESHOLD = -1  # glibc mallopt parameters (malloc.h)
M_MMAP_MAX = -4
TRIM_THRESHOLD = 2**30  # keep up to 1 GiB of freed heap for the next step instead of returning it


@functools.cache
def keep_allocations() -> bool:
    """Make glibc serve every block from its heap (no per-block mappings; a
    temporary slab is one block of tens of MB, past any mmap threshold mallopt
    accepts) and keep freed heap for reuse; False where malloc is not glibc's."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
