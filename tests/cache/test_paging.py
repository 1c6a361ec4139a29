"""The paging spec and the rules that place a page: one answer wherever it is asked."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from jaxdd.cache import Paging
from jaxdd.cache.layout import CacheView, locate
from jaxdd.cache.pages import PageTable
from jaxdd.cache.paging import pages_on, pool_pages, share_of, tokens_on


@dataclasses.dataclass(frozen=True)
class Dealt:
    page: int
    devices: int


@pytest.mark.parametrize("devices", [1, 2, 3, 8])
@pytest.mark.parametrize("page", [1, 4, 64])
def test_a_row_pages_and_tokens_on_each_share_count_what_share_of_deals(devices, page):
    for length in range(0, 40 * page, max(1, page // 4)):
        position_share = share_of(np.arange(length) // page, devices)
        for share in range(devices):
            assert tokens_on(length, share, page, devices) == (position_share == share).sum()
            pages = -(-length // page)
            dealt = share_of(np.arange(pages), devices)
            assert pages_on(pages, share, devices) == (dealt == share).sum()


@pytest.mark.parametrize("devices", [1, 2, 8])
def test_for_rows_sizes_whole_pages_on_every_device_and_a_pool_of_every_row(devices):
    paging = Paging.for_rows(Dealt(16, devices), 3, 48, 100, 9)
    assert paging.slots % (16 * devices) == 0 and paging.slots >= 109
    assert paging.row_pages % devices == 0
    assert paging.pool_pages == pool_pages(3 * paging.slots, 16, devices)
    assert paging.tokens >= 3 * paging.slots
    smaller = paging.holding(200)
    assert smaller.row_pages == paging.row_pages and smaller.tokens >= 200
    assert smaller.tokens_in(smaller.pool_pages) == smaller.tokens


def test_the_null_table_names_each_shares_null_page_and_no_row_is_given_one():
    paging = Paging(row_pages=6, pool_pages=12, page=4, devices=3)
    nulls = paging.null_pages()
    np.testing.assert_array_equal(nulls, [0, 4, 8])
    np.testing.assert_array_equal(paging.null_table(2), [[0, 4, 8, 0, 4, 8]] * 2)
    pages = PageTable(2, paging)
    pages.take(0, 24)  # every page of a row
    held = pages.table[0]
    assert not set(held.tolist()) & set(nulls.tolist())
    np.testing.assert_array_equal(held // paging.share, share_of(np.arange(6), 3))


def test_a_position_outside_the_table_is_past_the_pool_and_a_write_there_lands_nowhere():
    tables = jnp.asarray([[3, 1], [2, 0]], jnp.int32)
    positions = jnp.asarray([[0, 5, 8, 11], [-1, 3, 4, 100]], jnp.int32)
    page, slot = locate(tables, positions, 4, outside=7)
    np.testing.assert_array_equal(page, [[3, 1, 7, 7], [7, 2, 0, 7]])
    np.testing.assert_array_equal(slot, positions % 4)
    pool = jnp.zeros((4, 4, 2), jnp.float32)
    view = CacheView(jnp.asarray([6, 6], jnp.int32), tables)
    written = view.write(pool, jnp.ones((2, 3, 2), jnp.float32))  # slots 6 .. 8: 8 is past
    assert float(written.sum()) == 2 * 2 * 2  # two rows of two slots, each of two values
    np.testing.assert_array_equal(written[1, 2:], 1)  # row 0's slots 6, 7: page 1, slots 2, 3
    np.testing.assert_array_equal(written[0, 2:], 1)  # row 1's: page 0, slots 2, 3


def test_a_table_without_the_prefix_cache_keeps_no_page():
    pages = PageTable(1, Paging(row_pages=2, pool_pages=3, page=4))
    prompt = list(range(8))
    pages.take(0, 8, prompt)
    pages.insert(0, prompt)
    pages.release(0)
    assert not pages.prefix.keeps and pages.cached == 0 and pages.hits([*prompt, 9]) == []
    assert pages.free == pages.usable
