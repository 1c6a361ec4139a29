"""The server's default pool of pages (``jaxdd.planning.capacity.device_cache_tokens``): on GPUs
and TPUs, what 90% of the memory the weights leave holds; the pool a decoder then makes takes
no more than that share of a device, and a group of pages more would not fit (counted from the
live state's buffers, not from the formula), replicated on one device and striped over 8; on
CPU, whose allocator reports no limit, no default from memory."""

from __future__ import annotations

import jax
import pytest

import jaxdd
from jaxdd.cli import DEMO
from jaxdd.decoding.engine import SpeculativeDecoder
from jaxdd.decoding.rows import RowPool
from jaxdd.planning.capacity import CACHE_MEMORY_FRACTION, device_cache_tokens
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


def test_cpu_reports_no_memory_limit(decoders):
    assert device_cache_tokens(decoders["replicated"]) is None


@pytest.mark.parametrize("layout", ["replicated", "striped"])
@pytest.mark.parametrize("free", [3_000_000, 40_000_000])
def test_the_pool_takes_its_share_of_what_the_weights_leave(decoders, monkeypatch, layout, free):
    decoder = decoders[layout]
    monkeypatch.setattr(Backend, "free_bytes", staticmethod(lambda devices, host=True: free))
    tokens = device_cache_tokens(decoder)
    pool = RowPool(decoder, method="dflash", rows=4, max_len=256, cache_tokens=tokens)
    assert pool.cache_tokens == tokens
    latent = device_bytes(pool.state.target_cache)
    drafter = device_bytes(pool.state.draft_cache)
    # striped, a group of one page per device: a latent page on each, the drafter's K/V of all
    group = 8 if layout == "striped" else 1
    pages = pool.shape.pool_pages  # the null pages included
    group_bytes = latent / (pages / group) + group * drafter / pages
    assert latent + drafter <= CACHE_MEMORY_FRACTION * free < latent + drafter + group_bytes
