"""The paged cache: the host's page tables (every page held once, dealt over the devices'
shares, given back whole; rows that grow a page at a time all end, however many the pool was
promised) and the device's reads and writes through them, which must equal those of a row's own
buffer."""

from __future__ import annotations

import itertools

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxdd.cache.layout import CacheView, write_rows
from jaxdd.cache.pages import Ledger, PageTable
from jaxdd.cache.paging import Paging, pages_for, pool_pages
from jaxdd.errors import InvariantError
from jaxdd.testing.profiles import examples


def check_invariants(pages: PageTable) -> None:
    """Free + held = usable; no page held twice or null; row page j in share j % devices."""
    nulls = pages.paging.null_table(1)[0]
    held = [p for row in range(pages.rows) for p in pages.table[row] if p not in nulls]
    assert len(held) == len(set(held)) == pages.held
    assert pages.free + pages.held == pages.usable
    for j in range(pages.paging.row_pages):
        assert (pages.table[:, j] // pages.share == j % pages.devices).all()


@given(
    devices=st.sampled_from([1, 2, 8]),
    page=st.sampled_from([4, 64]),
    extra=st.integers(1, 40),
    ops=st.lists(st.tuples(st.booleans(), st.integers(0, 5), st.integers(1, 700)), max_size=60),
)
@settings(max_examples=examples(60), deadline=None)
def test_every_page_is_held_once_and_given_back(devices, page, extra, ops):
    rows, row_pages = 6, -(-700 // (page * devices)) * devices
    pool = pool_pages(extra * page, page, devices)
    pages = PageTable(rows, Paging(row_pages, pool, page, devices))
    for take, row, tokens in ops:
        if take and row not in pages._held:
            before = pages.free
            # the admission check is exactly whether the take succeeds
            if pages.admissible([tokens]) == 1:
                pages.take(row, tokens)
                assert before - pages.free == pages_for(tokens, page)
            else:
                with pytest.raises(InvariantError, match="free pages"):
                    pages.take(row, tokens)
        else:
            pages.release(row)
        check_invariants(pages)
    pages.clear()
    assert pages.free == pages.usable and pages.held == 0


def test_admission_counts_the_pages_released_rows_give_back():
    pages = PageTable(4, Paging(4, pool_pages(8 * 64), page=64))  # 8 pages and the null one
    pages.take(0, 256)
    pages.take(1, 192)
    assert pages.free == 1 and not pages.fits(128) and pages.fits(64)
    assert pages.admissible([64, 64]) == 1  # in order: the second waits
    assert pages.admissible([128], release=(1,)) == 1
    assert pages.admissible([128, 256], release=(0,)) == 1
    assert pages.admissible([128, 192], release=(0,)) == 2
    pages.clear()
    assert pages.admissible([4 * 64]) == 1 and pages.admissible([5 * 64]) == 0  # past a row


def ends_in_some_order(available, ledger: Ledger) -> bool:
    """Whether some order of the rows has each one's need available when its turn comes."""
    for order in itertools.permutations(range(len(ledger.needs))):
        left, ended = np.array(available), set()
        for row in order:
            if (ledger.needs[row] > left).any():
                break
            given = [set(np.flatnonzero(h)) <= ended for h in ledger.holders]
            ended.add(row)
            left = left + ledger.returns[row]
            for page, holders in enumerate(ledger.holders):
                if not given[page] and set(np.flatnonzero(holders)) <= ended:
                    left[ledger.shares[page]] += 1
        else:
            return True
    return False


@given(shares=st.integers(1, 3), rows=st.integers(0, 5), data=st.data())
@settings(max_examples=examples(200), deadline=None)
def test_rows_can_all_end_exactly_when_some_order_ends_them(shares, rows, data):
    """Rows with needs and pages of their own, and pages several of them hold (given back when
    the last of those ends)."""
    ints = lambda n, top=4: np.array(
        data.draw(st.lists(st.integers(0, top), min_size=n, max_size=n)), np.int64
    )
    shared = data.draw(st.integers(0, 3))
    held_by = st.lists(st.booleans(), min_size=rows, max_size=rows)  # rows holding a shared page
    holders = np.array(data.draw(st.lists(held_by, min_size=shared, max_size=shared)), bool)
    holders = holders.reshape(shared, rows)
    holders[:, 0:1] |= rows > 0  # each held by a row at least
    needs, returns = ints(rows * shares).reshape(rows, shares), ints(rows * shares)
    ledger = Ledger(needs, returns.reshape(rows, shares), holders, ints(shared, shares - 1))
    available = ints(shares)
    assert ledger.can_all_end(available) == ends_in_some_order(available, ledger)


def test_a_row_waits_for_a_page_that_could_leave_every_row_unable_to_end():
    pages = PageTable(2, Paging(3, pool_pages(4 * 4, 4), page=4))  # 4 pages
    pages.take(0, 4, limit=12)  # a page now, up to 3
    pages.take(1, 4, limit=12)
    # row 0 can still end with the page it takes (it needs 1 more); then neither could with row
    # 1's, nor with a new request's that needs one more
    assert pages.grow({0: 8, 1: 8}) == [1] and pages.free == 1
    assert pages.fits(4) and not pages.fits(4, limit=8)  # one that needs none may take it
    assert pages.grow({1: 100, 0: 100}) == [1] and pages.free == 0  # up to its limit, not past
    pages.release(0)
    assert pages.grow({1: 12}) == [] and pages.free == 1


@given(
    devices=st.sampled_from([1, 2, 8]),
    extra=st.integers(1, 24),
    requests=st.lists(st.tuples(st.integers(1, 40), st.integers(0, 60)), min_size=1, max_size=20),
    steps=st.lists(st.integers(1, 3), min_size=200, max_size=200),
)
@settings(max_examples=examples(60), deadline=None)
def test_rows_growing_a_few_pages_a_step_all_end(devices, extra, requests, steps):
    """Requests (a start and more, in slots) are admitted in order while admission allows, and
    every step each busy row asks for a few pages more until it holds its limit, then ends: in
    every step some row grows or ends, so all of them end, however far the admitted requests'
    limits overrun the pool."""
    rows, page = 6, 4
    row_pages = -(-100 // (page * devices)) * devices
    pool = pool_pages(extra * devices * page, page, devices)
    pages = PageTable(rows, Paging(row_pages, pool, page, devices))
    limits = {}
    most = extra * devices * page  # a request the pool holds alone
    waiting = [(min(start, most), min(start + more, most)) for start, more in requests]
    for step in steps:
        while (
            waiting
            and len(limits) < rows
            and pages.admissible([waiting[0][1]], starts=[waiting[0][0]])
        ):
            start, reach = waiting.pop(0)
            row = min(set(range(rows)) - set(limits))
            pages.take(row, start, limit=reach)
            limits[row] = pages_for(reach, page)
        ended = [row for row, limit in limits.items() if pages._held[row] == limit]
        for row in ended:
            pages.release(row)
            del limits[row]
        held = {row: pages._held[row] for row in limits}
        paused = pages.grow({row: (held[row] + step) * page for row in limits})
        for row, limit in limits.items():
            assert pages._held[row] == (
                held[row] if row in paused else min(held[row] + step, limit)
            )
        check_invariants(pages)
        assert ended or len(paused) < len(limits) or not limits  # some row ends or grows
        if not waiting and not limits:
            break
    assert not waiting and not limits, "200 steps end every request"
    assert pages.free == pages.usable


@pytest.mark.parametrize("axis", [1, 2])
def test_paged_reads_and_writes_equal_a_rows_own_buffer(axis):
    rng = np.random.default_rng(3)
    page, row_pages, pool = 4, 5, 16
    shape = (pool, page, 3) if axis == 1 else (pool, 2, page, 3)
    buffer = jnp.asarray(rng.normal(size=shape), jnp.float32)
    pages = jnp.asarray(rng.permutation(np.arange(1, pool))[: 2 * row_pages].reshape(2, -1))
    view = CacheView(jnp.asarray([3, 9], jnp.int32), pages, axis=axis)
    own = view.read(buffer)  # each row's slots
    assert own.shape[axis] == row_pages * page
    width = 6
    rows_shape = (2, width, 3) if axis == 1 else (2, 2, width, 3)
    rows = jnp.asarray(rng.normal(size=rows_shape), jnp.float32)
    written = view.read(view.write(buffer, rows))
    np.testing.assert_array_equal(written, write_rows(own, rows, view.length, axis))
    if axis == 1:  # an accepted path moved to the first new slots, as in a row's own buffer
        path = jnp.asarray([[0, 2, 5], [1, 3, 4]])
        moved = view.read(view.gather(buffer, path))
        np.testing.assert_array_equal(moved, CacheView(view.length).gather(own, path))
