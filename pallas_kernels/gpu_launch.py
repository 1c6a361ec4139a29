"""The GPU form's launch: query rows per program, key blocks, key splits (split-KV), from the
tuning table and the GPU's multiprocessors."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

from jax.experimental import pallas as pl

from pallas_kernels.tuned_block_sizes import (
    MULTIPROCESSORS,
    block_sizes,
    dtype_class,
    gpu_device,
    kv_splits,
)


def pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class GpuTiles:
    """Tiles a caller chooses for the GPU form: ``block_q`` query rows per program, keys in
    blocks of ``block_k``, each row block's keys shared by ``splits`` programs; None: the tuning
    table's."""

    block_q: int | None = None
    block_k: int | None = None
    splits: int | None = None


TUNED_TILES = GpuTiles()  # every tile from the tuning table


@dataclasses.dataclass(frozen=True)
class Gpu:
    """The GPU a launch is for: ``shared_memory`` bytes per block (which names its row of the
    tuning table) and its ``multiprocessors``; None: the table's fallback device's."""

    shared_memory: int | None = None
    multiprocessors: int | None = None


FALLBACK_GPU = Gpu()


class Launch(NamedTuple):
    """The GPU form's launch: ``block_q`` query rows (of ``padded_rows``) per program, keys in
    blocks of ``block_k``, each row block's keys shared by ``splits`` programs of
    ``split_blocks`` key blocks each."""

    block_q: int
    block_k: int
    padded_rows: int
    splits: int
    split_blocks: int

    def grid(self, batch: int) -> tuple[int, int, int]:
        """Programs by (batch row, row block, key split)."""
        return batch, self.padded_rows // self.block_q, self.splits


def launch(
    batch: int,
    rows: int,
    slots: int,
    page: int | None,
    dtype: Any,
    tiles: GpuTiles = TUNED_TILES,
    gpu: Gpu = FALLBACK_GPU,
) -> Launch:
    """The launch for ``batch`` rows of ``rows`` query rows (token x head) over ``slots`` key
    slots each (in pages of ``page``, or contiguous: None), computing in ``dtype``; the ``tiles``
    not given come from the tuning table for ``gpu`` (``tree_attention``'s arguments)."""
    device = gpu_device(gpu.shared_memory)
    tuned = block_sizes("tree_attention", device, dtype_class(dtype))
    block_q, block_k, splits = tiles.block_q, tiles.block_k, tiles.splits
    if block_q is None:
        enough = batch * rows >= tuned["block_q"] * tuned["programs"]
        block_q = tuned["block_q"] if enough else tuned["few_programs_block_q"]
    block_q = min(block_q, pow2(rows))
    padded_rows = pl.cdiv(rows, block_q) * block_q
    block_k = block_k or tuned["block_k"]
    if page is None:
        block_k = min(block_k, slots)
        if slots % block_k:
            raise ValueError(f"cache slots {slots} must be a multiple of block_k {block_k}")
    else:  # Triton's loads are powers of two, and a block must not span two pages
        block_k = math.gcd(1 << (block_k.bit_length() - 1), page)
    if splits is None:
        sms = gpu.multiprocessors or MULTIPROCESSORS[device]
        splits = kv_splits(sms, batch * padded_rows // block_q, slots, tuned["min_split_keys"])
    # a split of whole pages (paged) or key blocks; splits left with no slot are dropped
    unit = page or block_k
    split_blocks = pl.cdiv(pl.cdiv(slots, unit), splits) * unit // block_k
    return Launch(
        block_q, block_k, padded_rows, pl.cdiv(slots // block_k, split_blocks), split_blocks
    )
