"""The bytes a Pallas kernel moves between device memory and its blocks,
from its grid and block index maps: what its ``pl.CostEstimate`` declares
(and ``jaxdd.compiled_traffic`` then counts for the kernel's custom call).

A pipelined kernel fetches an input block when its block index differs from the previous
grid step's (Pallas skips the copy of a block it already holds) and writes an output block
back when its index is about to change or the grid ends; the grid runs in row-major order.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence

import numpy as np

# One operand's blocking: (block shape, None for a
# squeezed dimension of 1; index map; element dtype).
Blocking = tuple[tuple[int | None, ...], Callable[..., tuple], np.dtype]


def block_fetches(
    grid: Sequence[int], index_map: Callable[..., tuple], scalars: Sequence[int] = ()
) -> int:
    """How many times a block moves over the grid: once
    per run of grid steps with the same block index."""
    moves = 0
    previous = None
    for step in itertools.product(*(range(n) for n in grid)):
        index = tuple(int(i) for i in index_map(*step, *scalars))
        moves += index != previous
        previous = index
    return moves


def grid_bytes(
    grid: Sequence[int], blockings: Sequence[Blocking], scalars: Sequence[int] = ()
) -> int:
    """Bytes all ``blockings`` (inputs and outputs alike) move over
    ``grid``; ``scalars``: the values of the scalar-prefetch operands
    the index maps read (the worst case where they vary at run time)."""
    total = 0
    for shape, index_map, dtype in blockings:
        block = math.prod(1 if d is None else d for d in shape) * np.dtype(dtype).itemsize
        total += block * block_fetches(grid, index_map, scalars)
    return total
