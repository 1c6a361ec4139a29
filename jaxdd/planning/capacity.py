"""How many context tokens the devices' memory holds for the caches, in either layout of the
target's latent cache (``jaxdd.planning.cache_layout``), counted in whole pages.

What one token takes on a device comes from the decode state's own shardings
(``jaxdd.decoding.state.state_shardings``): the target's latent rows, replicated, and the
drafter's context K/V, split by KV heads. Striping divides the first by the devices but not the
second: every device keeps its heads' share of the drafter's K/V for every page.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from jaxdd.cache import Paging
from jaxdd.cache.paging import PAGE_TOKENS
from jaxdd.cache.stripes import Stripes
from jaxdd.config import DrafterConfig, KimiConfig
from jaxdd.decoding.checks import MAX_STOP_TOKENS
from jaxdd.decoding.engine import SpeculativeDecoder
from jaxdd.decoding.prefill import prefill_after, prefill_row
from jaxdd.decoding.requests import RowShape
from jaxdd.decoding.rounds import decode_round
from jaxdd.decoding.sampling import GREEDY, Sampling, SamplingArrays
from jaxdd.decoding.state import DecodeState, RowSettings, state_shardings
from jaxdd.runtime.backend import Backend
from jaxdd.runtime.buckets import prompt_bucket
from jaxdd.runtime.sharding import make_mesh
from jaxdd.types import LAYOUTS, CacheLayout, DrafterKV

# of the memory the weights leave on a device, the share a server's pool of pages and its
# executables' temporaries take by default (vLLM's gpu_memory_utilization is 0.9 of it all)
CACHE_MEMORY_FRACTION = 0.9


@dataclasses.dataclass(frozen=True)
class StateSpec:
    """What a decode state holds, whatever its rows: the target's latent cache (striped by
    ``stripes``; None: replicated), the drafter's K/V (none without its config, stored as
    ``drafter_kv`` says) for blocks of ``block`` tokens, caches in ``dtype``."""

    config: KimiConfig
    drafter_config: DrafterConfig | None
    block: int
    dtype: jnp.dtype = jnp.bfloat16
    stripes: Stripes | None = None
    drafter_kv: DrafterKV = "model"


def abstract_state(
    spec: StateSpec, batch: int, paging: Paging, mesh: jax.sharding.Mesh
) -> DecodeState:
    """The decode state before a prefill as sharded ShapeDtypeStructs (nothing allocated):
    ``batch`` rows paged as ``paging`` says, placed on ``mesh``."""
    rng = jax.ShapeDtypeStruct((batch, 2), jnp.uint32)
    models = (spec.config, spec.drafter_config)
    layout = (spec.stripes, spec.drafter_kv)
    empty = lambda rng: DecodeState.empty(
        *models, batch, paging, spec.block, spec.dtype, rng, *layout
    )
    state = jax.eval_shape(empty, rng)
    shardings = state_shardings(state, mesh)
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings
    )


def abstract_settings(rows: int, row_pages: int, sampling: Sampling = GREEDY) -> RowSettings:
    """``rows`` rows' settings for a round or a prefill, all sampled so, as ShapeDtypeStructs."""
    ints = lambda *dims: jax.ShapeDtypeStruct(dims, jnp.int32)
    sampled = jax.eval_shape(lambda: SamplingArrays.of([sampling] * rows))
    paused = jax.ShapeDtypeStruct((rows,), jnp.bool_)
    return RowSettings(
        ints(rows), ints(rows, MAX_STOP_TOKENS), sampled, ints(rows, row_pages), paused
    )


def shard_bytes(x: jax.ShapeDtypeStruct) -> int:
    """Bytes of one device's shard of an abstract array."""
    return math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize


def slot_bytes(
    config: KimiConfig,
    drafter_config: DrafterConfig | None,
    mesh: jax.sharding.Mesh,
    dtype: jnp.dtype = jnp.bfloat16,
    drafter_kv: DrafterKV = "model",
) -> dict[str, float]:
    """Per device, the bytes one more cache slot of a row takes: ``latent`` (the target's
    latent rows, all layers) and ``drafter`` (the drafter's context K/V, all layers, stored as
    ``drafter_kv`` says; 0 without a drafter), caches in ``dtype``: what their pools of one
    page, as the decode state shards them, declare."""
    spec = StateSpec(config, drafter_config, 1, dtype, drafter_kv=drafter_kv)
    state = abstract_state(spec, 1, Paging(1, 1), mesh)
    per_token = lambda cache: 0.0 if cache is None else cache.token_bytes(shard_bytes)
    return {"latent": per_token(state.target_cache), "drafter": per_token(state.draft_cache)}


def cache_capacity(
    free: float, slot: Mapping[str, float], devices: int, layout: CacheLayout
) -> dict[str, float]:
    """The context tokens (whole pages) that ``free`` bytes per device hold in ``layout``,
    for one slot's ``slot_bytes``: the pages, and the bytes a token takes per device."""
    # striped, a group of one page per device puts one page of latent rows
    # on each device and the drafter's K/V of all the group's pages on every one
    group = devices if layout == "striped" else 1
    group_bytes = PAGE_TOKENS * (slot["latent"] + group * slot["drafter"])
    pages = int(max(free, 0) // group_bytes) * group
    return {
        "tokens": pages * PAGE_TOKENS,
        "pages": pages,
        "bytes_per_token": group_bytes / (group * PAGE_TOKENS),
    }


def cache_capacities(
    free: float, slot: Mapping[str, float], devices: int
) -> dict[CacheLayout, dict[str, float]]:
    """``cache_capacity`` in each layout."""
    return {layout: cache_capacity(free, slot, devices, layout) for layout in LAYOUTS}


def pool_temporaries(decoder: SpeculativeDecoder, shape: RowShape) -> int:
    """The most temporary bytes a device needs for the biggest of a pool's executables: the
    prefill of its longest part (the largest prompt bucket; with chunks and no scoring, a
    chunk), whole and after cached pages, and its sampled round over every row. Compiled ahead
    of time for a pool of the rows' own size: the temporaries do not grow with the pool (a row's
    pages are read or gathered from it, and it is written in place)."""
    spec, rows, mesh = shape.spec, shape.rows, decoder.mesh
    drafter = None if spec.method == "ar" else decoder.drafter.config
    dtype = decoder.target.model.dtype
    made = StateSpec(decoder.config, drafter, spec.block, dtype, decoder.stripes, spec.drafter_kv)
    paging = shape.paging.holding(rows * shape.slots)
    state = abstract_state(made, rows, paging, mesh or make_mesh(1, jax.local_devices()[:1]))
    scoring = bool(spec.top_logprobs)  # a scored prompt is prefilled whole
    longest = min(shape.max_prompt, (not scoring and shape.prefill_chunk) or shape.max_prompt)
    ints = lambda *dims: jax.ShapeDtypeStruct(dims, jnp.int32)
    settings = lambda n: abstract_settings(n, shape.paging.row_pages)
    models, flag = decoder.models_for(spec), jax.ShapeDtypeStruct((), jnp.bool_)
    seeds = jax.ShapeDtypeStruct((1,), jnp.uint32)
    one = (ints(1, prompt_bucket(longest)), ints(1), settings(1), seeds)
    lowered = [
        prefill_row.lower(spec, models, state, ints(), *one, mesh, scoring),
        prefill_after.lower(spec, models, state, ints(), *one, mesh, ints(), flag),
        decode_round.lower(spec, models, state, settings(rows)),
    ]
    return max(x.compile().memory_analysis().temp_size_in_bytes for x in lowered)


def least_free_bytes(mesh: jax.sharding.Mesh) -> int | None:
    """What one of ``mesh``'s devices can still allocate: this process's devices' allocators, the
    least over the processes (every process calls it: an allgather), None where none reports a
    limit (CPU, whose devices share the host's memory with everything else)."""
    local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    free = Backend.free_bytes(local, host=False) if local else None
    if jax.process_count() > 1:
        every = multihost_utils.process_allgather(np.int64(-1 if free is None else free))
        free = min((f for f in every.tolist() if f >= 0), default=None)
    return free


def device_cache_tokens(
    decoder: SpeculativeDecoder, shape: RowShape, prefix_cache: bool
) -> int | None:
    """The context tokens a server's pool of pages of ``shape`` holds by default: what
    ``CACHE_MEMORY_FRACTION`` of its devices' free memory (the weights loaded; the least over
    the processes, which all run the same pool) holds less the pool's temporaries
    (``pool_temporaries``), in whole groups of pages, less the null pages; without the
    ``prefix_cache`` no more than every row full. None where the allocators report no limit."""
    mesh = decoder.mesh or make_mesh(1, jax.local_devices()[:1])
    free = least_free_bytes(mesh)
    if free is None:
        return None
    cache_bytes = free * CACHE_MEMORY_FRACTION - pool_temporaries(decoder, shape)
    drafter = decoder.drafter.config if shape.spec.method != "ar" else None
    slot = slot_bytes(
        decoder.config, drafter, mesh, decoder.target.model.dtype, shape.spec.drafter_kv
    )
    cache_layout = "striped" if decoder.stripes is not None else "replicated"
    held = cache_capacity(cache_bytes, slot, mesh.devices.size, cache_layout)["pages"]
    tokens = max(0, shape.paging.tokens_in(held))
    if not prefix_cache:
        tokens = min(tokens, shape.rows * shape.slots)  # a row holds no more than its slots
    return tokens
