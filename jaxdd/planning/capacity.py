"""How many context tokens the devices' memory holds for the caches, in either layout of the
target's latent cache (``jaxdd.planning.cache_layout``), counted in whole pages.

What one token takes on a device comes from the decode state's own shardings
(``jaxdd.decoding.rounds.state_shardings``): the target's latent rows, replicated, and the
drafter's context K/V, split by KV heads. Striping divides the first by the devices but not the
second: every device keeps its heads' share of the drafter's K/V for every page.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp

from jaxdd.cache.pages import PAGE_TOKENS, pool_pages
from jaxdd.cache.stripes import Stripes, paging
from jaxdd.config import DrafterConfig, KimiConfig
from jaxdd.decoding.rounds import DecodeState, state_shardings
from jaxdd.types import CacheLayout


def abstract_state(
    config: KimiConfig,
    drafter_config: DrafterConfig,
    batch: int,
    slots: int,
    block: int,
    mesh: jax.sharding.Mesh,
    stripes: Stripes | None = None,
) -> DecodeState:
    """The decode state before a prefill as sharded ShapeDtypeStructs (nothing allocated): a
    pool of pages holding ``batch`` rows of ``slots`` slots, its latent cache striped by
    ``stripes`` (None: replicated)."""
    rng = jax.ShapeDtypeStruct((batch, 2), jnp.uint32)
    page, devices = paging(stripes)
    pages = (slots // page, pool_pages(batch * slots, page, devices))
    empty = lambda rng: DecodeState.empty(
        config, drafter_config, batch, *pages, block, jnp.bfloat16, rng, stripes
    )
    state = jax.eval_shape(empty, rng)
    shardings = state_shardings(state, mesh)
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings
    )


def slot_bytes(
    config: KimiConfig,
    drafter_config: DrafterConfig,
    mesh: jax.sharding.Mesh,
    shard_bytes: Callable[[jax.ShapeDtypeStruct], int],
) -> dict[str, float]:
    """Per device, the bytes one more cache slot of a row takes: ``latent`` (the target's
    latent rows, all layers) and ``drafter`` (the drafter's context K/V, all layers);
    ``shard_bytes(array)`` gives one device's bytes of an abstract array."""

    def caches(slots: int) -> dict[str, int]:
        state = abstract_state(config, drafter_config, 1, slots, 1, mesh)
        total = lambda tree: sum(shard_bytes(x) for x in jax.tree.leaves(tree))
        # the pools: a row's page table is 4 bytes a page, not a slot's
        caches = state.target_cache.replace(pages=None), state.draft_cache.replace(pages=None)
        return {"latent": total(caches[0]), "drafter": total(caches[1])}

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
