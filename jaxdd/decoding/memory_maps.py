"""Whether a configuration's compiled programs fit the memory maps this process may hold.

XLA:CPU loads each compiled program's kernels into the process as memory maps of their own (code,
read-only data and data: about three a kernel, several hundred a program of the demo pair), and
Linux allows a process ``vm.max_map_count`` of them (65,530 by default): past it LLVM cannot
allocate and the process dies mid-compile. What a configuration compiles is known from its flags
before any weight loads (a server's pool: a prefill per prompt bucket and kind, a sampled and a
greedy round per tier, all while warming up), and what each program takes from ``PROGRAM_MAPS``,
measured per platform, so a configuration past the limit is refused in seconds.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import numpy as np

from jaxdd.cache.paging import PAGE_TOKENS
from jaxdd.decoding.prefill import prefill_row
from jaxdd.decoding.requests import RowRequest, pad_requests, warm_up_requests
from jaxdd.decoding.rounds import decode_round
from jaxdd.decoding.sampling import GREEDY
from jaxdd.errors import InputError
from jaxdd.runtime.buckets import round_tiers
from jaxdd.types import Method

LIMIT_FILE = Path("/proc/sys/vm/max_map_count")
MAPS_FILE = Path("/proc/self/maps")
HEADROOM = 0.9  # of the limit: the server's threads, its HTTP side and the allocator map too
# the pool's own programs besides prefills and rounds (its empty state, a row's insert, a
# round over one row's settings), counted as rounds
OWN_PROGRAMS = 4


@dataclasses.dataclass(frozen=True)
class ProgramMaps:
    """The memory maps one compiled program takes: a fixed part and a part per target and per
    drafter layer (the models' layers are unrolled, each compiling kernels of its own)."""

    fixed: int
    per_target_layer: int
    per_drafter_layer: int

    def of(self, target_layers: int, drafter_layers: int) -> int:
        per_layer = self.per_target_layer * target_layers + self.per_drafter_layer * drafter_layers
        return self.fixed + per_layer


# By platform and program: the longest prefill, and the full round of each method. XLA:CPU, JAX
# 0.10.2, float32: the /proc/self/maps lines each compile added (``program_maps``) at the demo
# pair's widths, 4 to 16 target and 2 to 4 drafter layers, 8 and 17 rows, prompts up to 4,096
# tokens (benchmarks/program_maps.py), fitted as fixed + per layer and raised 5% or more over
# the most seen (another CPU's or JAX's codegen). Elsewhere a program's code lives on the
# device: none listed, nothing checked.
PROGRAM_MAPS: dict[str, dict[str, ProgramMaps]] = {
    "cpu": {
        "prefill": ProgramMaps(fixed=500, per_target_layer=23, per_drafter_layer=6),
        "ar": ProgramMaps(fixed=370, per_target_layer=10, per_drafter_layer=0),
        "dflash": ProgramMaps(fixed=800, per_target_layer=23, per_drafter_layer=6),
        "ddtree": ProgramMaps(fixed=830, per_target_layer=28, per_drafter_layer=6),
    },
}


@dataclasses.dataclass(frozen=True)
class Programs:
    """What a configuration compiles: ``prefills``, and ``rounds`` of ``method`` (and the like)."""

    method: Method
    prefills: int
    rounds: int

    def maps(self, sizes: tuple[int, int]) -> int:
        """The maps these programs take at ``sizes`` (``program_sizes``)."""
        return self.prefills * sizes[0] + self.rounds * sizes[1]


def pool_programs(
    method: Method,
    rows: int,
    max_prompt: int,
    scoring: bool,
    prefix_cache: bool,
    prefill_chunk: int | None,
    specs: int = 1,
) -> Programs:
    """The programs a ``RowPool`` of these options compiles warming up (``scoring``: with
    logprobs, its prompts' scoring prefills too; ``specs``: the rounds of its set, each counted
    as ``method``'s, the largest)."""
    prompts = warm_up_requests(max_prompt, PAGE_TOKENS, scoring, prefix_cache, prefill_chunk)
    return Programs(method, len(prompts), 2 * specs * len(round_tiers(rows)) + OWN_PROGRAMS)


def map_limit() -> int | None:
    """The memory maps Linux allows a process (None where there is no such limit to read)."""
    return int(LIMIT_FILE.read_text()) if LIMIT_FILE.exists() else None


def maps_in_use() -> int:
    with MAPS_FILE.open() as maps:
        return sum(1 for _ in maps)


def program_sizes(method: Method, platform: str, layers: tuple[int, int]) -> tuple[int, int] | None:
    """(maps of a prefill, of a round of ``method``) of models of ``layers`` (target, drafter)
    on ``platform`` (None where its programs take no maps worth counting)."""
    table = PROGRAM_MAPS.get(platform)
    if table is None:
        return None
    return table["prefill"].of(*layers), table[method].of(*layers)


def server_maps(
    method: Method, rows: int, max_len: int, layers: tuple[int, int], platform: str
) -> dict[str, int | bool | None] | None:
    """The programs a server of ``rows`` rows at ``max_len`` tokens compiles (with logprobs and
    the prefix cache, its defaults), the maps they take and whether that fits this host's limit
    (None where programs take no maps worth counting)."""
    sizes = program_sizes(method, platform, layers)
    if sizes is None:
        return None
    programs = pool_programs(method, rows, max(max_len - 1, 1), True, True, None)
    needed, limit = programs.maps(sizes), map_limit()
    fits = limit is None or needed <= HEADROOM * limit
    return {
        "programs": programs.prefills + programs.rounds,
        "maps": needed,
        "limit": limit,
        "fits": fits,
    }


def check_maps(programs: Programs, platform: str, layers: tuple[int, int], flags: str) -> None:
    """An ``InputError`` where ``programs`` of models of ``layers`` (target, drafter) would take
    this process past its memory maps on ``platform``, naming the limit and ``flags`` (the
    options that shrink the set of programs, in the caller's words)."""
    limit, sizes = map_limit(), program_sizes(programs.method, platform, layers)
    if limit is None or sizes is None:
        return
    used = maps_in_use()
    needed = used + programs.maps(sizes)
    if needed > HEADROOM * limit:
        raise InputError(
            f"this configuration compiles {programs.prefills} prefills of up to {sizes[0]} "
            f"memory maps each and {programs.rounds} rounds of up to {sizes[1]} on XLA:CPU: "
            f"{needed:,} maps with the {used:,} in use, past {HEADROOM:.0%} of this host's "
            f"vm.max_map_count {limit:,} (the process would die mid-compile); {flags}, or raise "
            "vm.max_map_count"
        )


def maps_taken(lowered: jax.stages.Lowered) -> int:
    """The memory maps compiling ``lowered`` takes in this process (the executable then freed)."""
    before = maps_in_use()
    compiled = lowered.compile()
    taken = maps_in_use() - before
    del compiled
    return taken


def program_maps(pool) -> tuple[int, int]:
    """(maps of ``pool``'s longest prefill, of its full round), each compiled once: what
    ``PROGRAM_MAPS`` records."""
    one = pool.settings.host(slice(0, 1))
    tokens, count, seeds = pad_requests([RowRequest([1], 1, [], GREEDY)], 1, pool.shape.max_prompt)
    prefill = prefill_row.lower(
        pool.shape.spec,
        pool.models,
        pool.state,
        np.int32(0),
        tokens,
        count,
        one,
        seeds,
        pool.decoder.mesh,
        bool(pool.shape.spec.top_logprobs),  # scoring the prompt too, where the pool may
    )
    settings = pool.settings.device()
    return maps_taken(prefill), maps_taken(
        decode_round.lower(pool.shape.spec, pool.models, pool.state, settings)
    )
