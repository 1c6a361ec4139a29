"""How many context tokens the devices' memory holds for the caches, in either layout of the
target's latent cache (``jaxdd.planning.cache_layout``), counted in whole pages.

What one token takes on a device comes from the decode state's own shardings
(``jaxdd.decoding.rounds.state_shardings``): the target's latent rows, replicated, and the
drafter's context K/V, split by KV heads. Striping divides the first by the devices but not the
second: every device keeps its heads' share of the drafter's K/V for every page.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from jaxdd.cache.pages import PAGE_TOKENS, pool_pages
from jaxdd.cache.stripes import Stripes, paging
from jaxdd.config import DrafterConfig, KimiConfig
from jaxdd.decoding.engine import SpeculativeDecoder
from jaxdd.decoding.rounds import DecodeState, state_shardings
from jaxdd.runtime.backend import Backend
from jaxdd.runtime.sharding import make_mesh
from jaxdd.types import CacheLayout

# of the memory the weights leave on a device, the share a server's pool of pages takes by
# default: the rest for a round's temporaries (vLLM's gpu_memory_utilization is 0.9 of it all)
CACHE_MEMORY_FRACTION = 0.9


def abstract_state(
    config: KimiConfig,
    drafter_config: DrafterConfig | None,
    batch: int,
    slots: int,
    block: int,
    mesh: jax.sharding.Mesh,
    stripes: Stripes | None = None,
    dtype: jnp.dtype = jnp.bfloat16,
) -> DecodeState:
    """The decode state before a prefill as sharded ShapeDtypeStructs (nothing allocated): a
    pool of pages holding ``batch`` rows of ``slots`` slots, its latent cache striped by
    ``stripes`` (None: replicated)."""
    rng = jax.ShapeDtypeStruct((batch, 2), jnp.uint32)
    page, devices = paging(stripes)
    pages = (slots // page, pool_pages(batch * slots, page, devices))
    empty = lambda rng: DecodeState.empty(
        config, drafter_config, batch, *pages, block, dtype, rng, stripes
    )
    state = jax.eval_shape(empty, rng)
    shardings = state_shardings(state, mesh)
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings
    )


def shard_bytes(x: jax.ShapeDtypeStruct) -> int:
    """Bytes of one device's shard of an abstract array."""
    return math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize


def slot_bytes(
    config: KimiConfig,
    drafter_config: DrafterConfig | None,
    mesh: jax.sharding.Mesh,
    dtype: jnp.dtype = jnp.bfloat16,
) -> dict[str, float]:
    """Per device, the bytes one more cache slot of a row takes: ``latent`` (the target's
    latent rows, all layers) and ``drafter`` (the drafter's context K/V, all layers; 0 without
    a drafter), caches in ``dtype``."""

    def caches(slots: int) -> dict[str, int]:
        state = abstract_state(config, drafter_config, 1, slots, 1, mesh, dtype=dtype)
        total = lambda cache: sum(
            shard_bytes(x) for x in jax.tree.leaves(cache.replace(pages=None) if cache else [])
        )  # the pools: a row's page table is 4 bytes a page, not a slot's
        return {"latent": total(state.target_cache), "drafter": total(state.draft_cache)}

    # two sizes, so what does not grow with the slots (lengths) cancels
    small, large = caches(PAGE_TOKENS), caches(2 * PAGE_TOKENS)
    return {name: (large[name] - small[name]) / PAGE_TOKENS for name in small}


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


def fitting_cache_tokens(
    config: KimiConfig,
    drafter_config: DrafterConfig | None,
    mesh: jax.sharding.Mesh,
    stripes: Stripes | None,
    dtype: jnp.dtype,
    free: int,
) -> int:
    """The context tokens (whole pages) that ``CACHE_MEMORY_FRACTION`` of ``free`` bytes per
    device hold for the target's latent cache, in ``stripes``' layout (None: replicated), and
    the drafter's context K/V, less the null pages (a page on each device: one group of pages)."""
    slot = slot_bytes(config, drafter_config, mesh, dtype)
    layout = "striped" if stripes is not None else "replicated"
    devices = mesh.devices.size
    held = cache_capacity(free * CACHE_MEMORY_FRACTION, slot, devices, layout)["tokens"]
    return max(0, int(held) - (devices if stripes is not None else 1) * PAGE_TOKENS)


def device_cache_tokens(decoder: SpeculativeDecoder) -> int | None:
    """The context tokens a server's pool of pages holds by default: ``fitting_cache_tokens`` of
    what its devices' allocators still have once the weights are loaded, the least over the
    processes (each runs the same pool); None where the allocators report no limit (CPU, whose
    devices share the host's memory with everything else)."""
    mesh = decoder.mesh or make_mesh(1, jax.local_devices()[:1])
    local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    free = Backend.free_bytes(local, host=False)
    if free is None:
        return None
    dtype = decoder.target.model.dtype
    drafter = decoder.drafter.config if decoder.drafter is not None else None
    tokens = fitting_cache_tokens(decoder.config, drafter, mesh, decoder.stripes, dtype, free)
    if jax.process_count() > 1:
        tokens = int(multihost_utils.process_allgather(np.int64(tokens)).min())
    return tokens
