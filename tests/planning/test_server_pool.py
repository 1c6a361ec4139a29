"""The server's default pool of pages (``jaxdd.planning.capacity.device_cache_tokens``): on GPUs
and TPUs, what 90% of the memory the weights leave holds less the pool's compiled temporaries;
the pool a decoder then makes takes no more than that share of a device, and a group of pages
more would not fit (counted from the live state's buffers, not from the formula), replicated on
one device and striped over 8; without the prefix cache, no more than every row full; on CPU,
whose allocator reports no limit, no default from memory."""

from __future__ import annotations

import jax
import pytest

import jaxdd
from jaxdd.cli import DEMO
from jaxdd.decoding.checks import PoolOptions, pool_shape
from jaxdd.decoding.engine import SpeculativeDecoder
from jaxdd.decoding.requests import RowShape
from jaxdd.decoding.rows import RowPool
from jaxdd.planning.capacity import CACHE_MEMORY_FRACTION, device_cache_tokens, pool_temporaries
from jaxdd.runtime.backend import Backend
from jaxdd.testing.reference import SHARDABLE_DRAFTER, SHARDABLE_K2, save_random_pair


@pytest.fixture(scope="module")
def decoders(tmp_path_factory) -> dict[str, SpeculativeDecoder]:
    root = tmp_path_factory.mktemp("server_pool")
    save_random_pair(root, SHARDABLE_K2, SHARDABLE_DRAFTER, seed=3)
    striped = jaxdd.load_pair(root / "target", root / "drafter", "float32", 8)
    return {
        "replicated": SpeculativeDecoder(
            *jaxdd.load_pair(DEMO / "target", DEMO / "drafter", "float32")
        ),
        "striped": SpeculativeDecoder(*striped, cache_layout="striped"),
    }


def device_bytes(cache) -> int:
    """One device's bytes of a cache's pools (its page tables left out)."""
    leaves = jax.tree.leaves(cache.replace(pages=None))
    return sum(x.addressable_shards[0].data.nbytes for x in leaves)


def shape_of(decoder: SpeculativeDecoder) -> RowShape:
    return pool_shape(decoder, PoolOptions("dflash", rows=4, max_len=256))


def test_cpu_reports_no_memory_limit(decoders):
    decoder = decoders["replicated"]
    assert device_cache_tokens(decoder, shape_of(decoder), True) is None


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["replicated", "striped"])
@pytest.mark.parametrize("free", [20_000_000, 80_000_000])
def test_the_pool_takes_its_share_of_what_the_weights_leave(decoders, monkeypatch, layout, free):
    decoder = decoders[layout]
    monkeypatch.setattr(Backend, "free_bytes", staticmethod(lambda devices, host=True: free))
    shape = shape_of(decoder)
    tokens = device_cache_tokens(decoder, shape, True)
    temporaries = pool_temporaries(decoder, shape)
    assert temporaries > 0
    pool = RowPool.serving(decoder, method="dflash", rows=4, max_len=256, cache_tokens=tokens)
    assert pool.cache_tokens == tokens
    latent = device_bytes(pool.state.target_cache)
    drafter = device_bytes(pool.state.draft_cache)
    # striped, a group of one page per device: a latent page on each, the drafter's K/V of all
    group = 8 if layout == "striped" else 1
    pages = pool.shape.paging.pool_pages  # the null pages included
    group_bytes = latent / (pages / group) + group * drafter / pages
    held = latent + drafter + temporaries
    assert held <= CACHE_MEMORY_FRACTION * free < held + group_bytes


def test_without_the_prefix_cache_no_more_than_every_row(decoders, monkeypatch):
    decoder = decoders["replicated"]
    monkeypatch.setattr(Backend, "free_bytes", staticmethod(lambda devices, host=True: 10**9))
    shape = shape_of(decoder)
    assert device_cache_tokens(decoder, shape, False) == shape.rows * shape.slots
    assert device_cache_tokens(decoder, shape, True) > 100 * shape.rows * shape.slots
