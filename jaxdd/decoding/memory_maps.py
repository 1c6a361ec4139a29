"""Whether a pool's programs fit the memory maps this process may hold.

XLA:CPU loads each compiled program's kernels into the process as memory maps of their own (code,
read-only data and data: about three a kernel, several hundred a program of the demo pair), and
Linux allows a process ``vm.max_map_count`` of them (65,530 by default): past it LLVM cannot
allocate and the process dies mid-compile. A pool compiles every program it will run while warming
up (a prefill per prompt bucket and kind, a sampled and a greedy round per tier), so what it needs
is known before it starts: its prefills times the maps of its longest prefill and its rounds times
those of its full round, each compiled once to count them.
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np

from jaxdd.decoding.prefill import prefill_row
from jaxdd.decoding.requests import RowRequest, pad_requests
from jaxdd.decoding.rounds import decode_round
from jaxdd.decoding.sampling import GREEDY
from jaxdd.errors import InputError

LIMIT_FILE = Path("/proc/sys/vm/max_map_count")
MAPS_FILE = Path("/proc/self/maps")
HEADROOM = 0.9  # of the limit: the server's threads, its HTTP side and the allocator map too
# the pool's own programs besides prefills and rounds (its empty state, a row's insert, a
# round over one row's settings), counted as rounds
OWN_PROGRAMS = 4


def map_limit() -> int | None:
    """The memory maps Linux allows a process (None where there is no such limit to read)."""
    return int(LIMIT_FILE.read_text()) if LIMIT_FILE.exists() else None


def maps_in_use() -> int:
    with MAPS_FILE.open() as maps:
        return sum(1 for _ in maps)


def pool_programs(pool) -> tuple[int, int]:
    """(prefills, rounds and the like): the programs ``pool`` (a ``RowPool``) compiles warming
    up."""
    shape = pool.shape
    return len(shape.warm_up_requests(pool.prefix_cache)), 2 * len(shape.tiers) + OWN_PROGRAMS


def maps_taken(lowered: jax.stages.Lowered) -> int:
    """The memory maps compiling ``lowered`` takes in this process (the executable then freed)."""
    before = maps_in_use()
    compiled = lowered.compile()
    taken = maps_in_use() - before
    del compiled
    return taken


def program_maps(pool) -> tuple[int, int]:
    """(maps of ``pool``'s longest prefill, of its full round), each compiled once."""
    one = pool.host_settings(slice(0, 1))
    tokens, count, seeds = pad_requests([RowRequest([1], 1, [], GREEDY)], 1, pool.max_prompt)
    prefill = prefill_row.lower(
        pool.spec,
        pool.models,
        pool.state,
        np.int32(0),
        tokens,
        count,
        one,
        seeds,
        pool.decoder.mesh,
        False,
    )
    settings = jax.device_put(pool.host_settings())
    return maps_taken(prefill), maps_taken(
        decode_round.lower(pool.spec, pool.models, pool.state, settings)
    )


def check_pool_maps(pool, flags: str) -> None:
    """An ``InputError`` where ``pool``'s programs would take this process past its memory maps
    (XLA:CPU only: elsewhere programs live on the device), naming the limit and ``flags`` (the
    options that shrink the pool's program set, in the caller's words)."""
    limit = map_limit()
    if limit is None or pool.decoder.backend.platform != "cpu":  # where its models live
        return
    (prefills, rounds), (per_prefill, per_round) = pool_programs(pool), program_maps(pool)
    used = maps_in_use()
    needed = used + prefills * per_prefill + rounds * per_round
    if needed > HEADROOM * limit:
        raise InputError(
            f"this pool compiles {prefills} prefills of up to {per_prefill} memory maps each and "
            f"{rounds} rounds of up to {per_round} on XLA:CPU: {needed:,} maps with the {used:,} "
            f"in use, past {HEADROOM:.0%} of this host's vm.max_map_count {limit:,} (the process "
            f"would die mid-compile); {flags}, or raise vm.max_map_count"
        )
