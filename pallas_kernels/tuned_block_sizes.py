"""The kernels' tile choices in one table, keyed by kernel, device and dtype class, with a fallback.

Each kernel reads its block sizes here (``block_sizes``) instead of holding them. A device the table
does not name gets the entry of the kernel's fallback device; a kernel whose tiles depend on neither
device nor dtype has one entry under ``ANY``. What each entry was chosen from (runs, compiles,
limits): benchmarks/README.md, "Kernel tiles".
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import jax.numpy as jnp

ANY = "any"  # an entry for every device (or dtype) the table does not name
# GPUs with less shared memory per block (sm_86/89/120) take the tiles tuned for the RTX PRO 6000
SMALL_SHARED_MEMORY = 128 * 1024


def _tiles(**sizes: int) -> Mapping[str, int]:
    return MappingProxyType(sizes)


# (kernel, device, dtype class) -> tiles. tree_attention: ``block_q`` query rows per program while
# the batch's rows fill ``programs`` programs, else ``few_programs_block_q`` (more programs keep the
# GPU's multiprocessors busy); keys in blocks of ``block_k``, within the shared memory per block;
# split-KV (``kv_splits``) gives each split at least ``min_split_keys`` keys, so the partial
# output a program writes (block_q x (r + 1) fp32) stays under a tenth of the keys it reads.
TUNED: Mapping[tuple[str, str, str], Mapping[str, int]] = MappingProxyType(
    {
        ("tree_attention", "h200", "bf16"): _tiles(
            block_q=32,
            few_programs_block_q=16,
            programs=128,
            block_k=64,
            min_split_keys=512,
        ),
        ("tree_attention", "h200", "fp32"): _tiles(
            block_q=32,
            few_programs_block_q=16,
            programs=128,
            block_k=32,
            min_split_keys=512,
        ),
        ("tree_attention", "rtx-pro-6000", "bf16"): _tiles(
            block_q=16,
            few_programs_block_q=16,
            programs=128,
            block_k=32,
            min_split_keys=512,
        ),
        ("tree_attention", "rtx-pro-6000", "fp32"): _tiles(
            block_q=16,
            few_programs_block_q=16,
            programs=128,
            block_k=16,
            min_split_keys=512,
        ),
        # query rows per program (each reads the whole cache: as many as VMEM holds), cache rows
        # per step
        ("tree_attention_tpu", ANY, ANY): _tiles(block_q=512, block_k=512),
        # output rows per program, words of K per loop step and output row (a tile in registers)
        ("int4_experts", ANY, ANY): _tiles(block_n=64, block_words=32),
        # bytes of words per step: double-buffered and unpacked, well inside the scoped VMEM
        ("int4_experts_tpu", ANY, ANY): _tiles(block_bytes=1 << 20),
        # Triton's compiler parameters, shared by both GPU kernels
        ("triton", ANY, ANY): _tiles(num_warps=4),
    }
)
# whose entry a device missing from the table gets (an unknown GPU: the H200's)
FALLBACK_DEVICE: Mapping[str, str] = MappingProxyType({"tree_attention": "h200"})


# streaming multiprocessors of the table's GPUs, for a backend that does not say how many it has
MULTIPROCESSORS: Mapping[str, int] = MappingProxyType({"h200": 132, "rtx-pro-6000": 188})


def kv_splits(multiprocessors: int, programs: int, keys: int, min_split_keys: int) -> int:
    """How many programs split each row block's keys (split-KV): FlashMLA's rule, as many as
    leave no multiprocessor idle (``multiprocessors // programs``, at least 1), with at least
    ``min_split_keys`` of the row's ``keys`` slots each."""
    return max(1, min(multiprocessors // programs, keys // min_split_keys))


def gpu_device(shared_memory: int | None) -> str:
    """The device in the table for a GPU of ``shared_memory`` bytes per block (None: an H200)."""
    small = shared_memory is not None and shared_memory < SMALL_SHARED_MEMORY
    return "rtx-pro-6000" if small else "h200"


def dtype_class(dtype: Any) -> str:
    """The table's dtype class: ``bf16`` for 16-bit and narrower operands, else ``fp32``."""
    return "bf16" if jnp.dtype(dtype).itemsize <= 2 else "fp32"


def block_sizes(kernel: str, device: str = ANY, dtype: str = ANY) -> Mapping[str, int]:
    """The tiles for ``kernel`` on ``device`` with operands of ``dtype`` class: the device's own
    entry, else its ``ANY`` dtype entry, else the same from the kernel's fallback device."""
    for known in (device, FALLBACK_DEVICE.get(kernel, ANY)):
        for kind in (dtype, ANY):
            tiles = TUNED.get((kernel, known, kind))
            if tiles is not None:
                return tiles
    raise KeyError(f"no tuned block sizes for {kernel!r} (device {device!r}, dtype {dtype!r})")
