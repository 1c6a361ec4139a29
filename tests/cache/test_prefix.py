"""The prefix cache's pages: free + cached + held = the pool after every step, a cached page is
only ever reused for the tokens it was computed for, a page a row holds is never evicted, a
request gives its pages back once, and admission counts exactly what the takes will find."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxdd.cache.pages import PageTable
from jaxdd.cache.paging import Paging, pool_pages
from jaxdd.errors import InvariantError
from jaxdd.testing.profiles import examples

ROWS = 5
SEQUENCE = 200  # tokens of each conversation a row follows


class Model:
    """A page table driven like a pool of rows, and what each page's slots hold."""

    def __init__(self, devices: int, page: int, extra: int, seed: int):
        self.page = page
        row_pages = -(-SEQUENCE // (page * devices)) * devices
        paging = Paging(row_pages, pool_pages(extra * page, page, devices), page, devices)
        self.pages = PageTable(ROWS, paging, prefix=True)
        rng = np.random.default_rng(seed)
        # few conversations over few tokens: prompts share prefixes often
        self.conversations = [rng.integers(0, 3, SEQUENCE).tolist() for _ in range(3)]
        self.rows: dict[int, tuple[list[int], int]] = {}  # row -> (its conversation, prompt)
        self.holds: dict[int, tuple[int, ...]] = {}  # page -> the tokens up to its last slot

    def take(self, row: int, conversation: int, prompt: int, insert: bool = True) -> None:
        tokens = self.conversations[conversation]
        reach = min(SEQUENCE, prompt + 40)
        fits = self.pages.fits(reach, tokens[:prompt])
        if row in self.rows or not fits:
            with pytest.raises(InvariantError, match="free pages"):
                self.pages.take(row, reach, tokens[:prompt])
            return
        cached = self.pages.take(row, reach, tokens[:prompt])
        assert cached % self.page == 0 and cached < prompt  # the last token is computed
        for j, page in enumerate(self.pages.table[row, : -(-reach // self.page)].tolist()):
            upto = tuple(tokens[: (j + 1) * self.page])
            if j < cached // self.page:  # reused: computed for exactly these tokens
                assert self.holds[page] == upto
            else:  # new to this row alone: whatever it held is gone
                assert self.pages._refs[page] == 1
                self.holds[page] = upto
        self.rows[row] = (tokens, prompt)
        if insert:
            self.pages.insert(row, tokens[:prompt])  # the prompt, once prefilled

    def end(self, row: int, produced: int) -> None:
        if row in self.rows:
            tokens, prompt = self.rows.pop(row)
            self.pages.insert(row, tokens[: min(SEQUENCE, prompt + produced)])
        self.pages.release(row)
        self.pages.release(row)  # a second release gives nothing back twice

    def check(self) -> None:
        pages = self.pages
        nulls = set(pages.paging.null_table(1)[0].tolist())
        free = [p for share in pages._free for p in share]
        cached = [p for share in pages._cached for p in share]
        held = [p for p in range(pages.paging.pool_pages) if pages._refs[p] > 0]
        assert pages.free + pages.cached + pages.held == pages.usable
        assert len(set(free) | set(cached) | set(held) | nulls) == pages.paging.pool_pages
        assert all(p in pages.prefix for p in cached)
        counts = np.zeros((pages.paging.pool_pages,), np.int32)
        for row, n in pages._held.items():
            np.add.at(counts, pages.table[row, :n], 1)
        np.testing.assert_array_equal(counts, pages._refs)
        for j in range(pages.paging.row_pages):
            assert (pages.table[:, j] // pages.share == j % pages.devices).all()


operation = st.one_of(
    st.tuples(st.just("take"), st.integers(0, ROWS - 1), st.integers(0, 2), st.integers(1, 160)),
    st.tuples(st.just("end"), st.integers(0, ROWS - 1), st.integers(0, 60)),
    st.tuples(
        st.just("admit"),
        st.lists(st.tuples(st.integers(0, 2), st.integers(1, 160))),
        st.booleans(),  # prompts prefilled in chunks: keyed only once all are admitted
    ),
    st.tuples(st.just("reset")),
)


@given(
    devices=st.sampled_from([1, 2, 4]),
    page=st.sampled_from([4, 16]),
    extra=st.integers(4, 60),
    seed=st.integers(0, 2**16),
    ops=st.lists(operation, max_size=50),
)
@settings(max_examples=examples(80), deadline=None)
def test_pages_are_free_cached_or_held_and_hits_hold_their_tokens(devices, page, extra, seed, ops):
    model = Model(devices, page, extra, seed)
    for op in ops:
        if op[0] == "take":
            model.take(*op[1:])
        elif op[0] == "end":
            model.end(*op[1:])
        elif op[0] == "admit":  # what admissible counts, the takes find (or more: the
            # prompts admitted first may cache pages the later ones start with)
            free = [row for row in range(ROWS) if row not in model.rows][: len(op[1])]
            waiting = op[1][: len(free)]
            prompts = [model.conversations[c][:n] for c, n in waiting]
            reaches = [min(SEQUENCE, n + 40) for _, n in waiting]
            admitted = model.pages.admissible(reaches, prompts=prompts)
            chunked = op[2]
            for i, (row, (conversation, prompt)) in enumerate(zip(free, waiting, strict=True)):
                if i == admitted:
                    break
                assert model.pages.fits(reaches[i], prompts[i])
                model.take(row, conversation, prompt, insert=not chunked)
            for row, (conversation, prompt) in zip(free[:admitted], waiting, strict=False):
                model.pages.insert(row, model.conversations[conversation][:prompt])
        else:
            model.pages.clear()
            model.rows.clear()
            assert model.pages.cached == model.pages.held == 0
        model.check()


def test_admission_counts_what_released_rows_give_back_to_the_cache():
    pages = PageTable(3, Paging(6, pool_pages(6 * 4, 4), page=4), prefix=True)  # 6 pages of 4
    prompt = list(range(10))
    assert pages.take(0, 16, prompt) == 0  # 4 pages
    pages.insert(0, prompt)  # its first 2 pages cached (held by row 0 still)
    assert pages.free == 2 and pages.cached == 0
    # a second request with the same prompt shares those 2 pages and needs 2 new ones
    assert pages.admissible([16], prompts=[prompt]) == 1
    assert pages.admissible([16, 16], prompts=[prompt, prompt]) == 1
    assert pages.admissible([16, 16], release=(0,), prompts=[prompt, prompt]) == 2
    assert pages.admissible([24], release=(0,)) == 1 and pages.admissible([24]) == 0
    pages.release(0)
    assert pages.free == 4 and pages.cached == 2
    assert pages.take(1, 24, prompt) == 8  # the 2 cached pages, then 4 new
    pages.release(1)
    # a different prompt evicts the least recently used cached page: the prefix's later one
    assert pages.take(2, 20, [7] * 10) == 0 and pages.cached == 1
    assert len(pages.hits(prompt)) == 1


def test_requests_admitted_together_find_their_pages_when_the_first_shares_its_prompt():
    """Admission counts each request's hits as the cache holds them now; the second of two
    requests with one prompt then shares the first's prompt pages: a state at least as safe, so
    its take still succeeds (it failed when shared pages counted as never given back)."""
    pages = PageTable(4, Paging(80, pool_pages(75 * 64), page=64), prefix=True)
    pages.take(0, 5 * 64, limit=75 * 64)
    prompt = list(range(150))
    assert pages.admissible([67 * 64] * 2, prompts=[prompt, prompt], starts=[166, 166]) == 2
    assert pages.take(1, 166, prompt, 67 * 64) == 0
    pages.insert(1, prompt)
    assert pages.take(2, 166, prompt, 67 * 64) == 128  # two pages shared with row 1


def test_a_cached_page_two_requests_hit_costs_each_a_page():
    """A take may evict the cached page a later request hits (the least recently used, when its
    share has no free page), and a chunked prompt keys its own pages only once prefilled: a third
    request hitting the same cached page must not count it as shared."""
    pages = PageTable(8, Paging(8, 8, page=4), prefix=True)  # 7 usable pages
    for prompt in ([1, 2, 3, 4, 5], *([10 + i] * 4 + [0] for i in range(4))):
        pages.take(0, 5, prompt)
        pages.insert(0, prompt)
        pages.release(0)
    pages.take(7, 4 * pages.free)  # every page held or cached, [1, 2, 3, 4] least recent
    requests = [([50] * 3, 4), ([1, 2, 3, 4, 6, 7, 8, 9, 9], 9), ([1, 2, 3, 4, 5], 5)]
    admitted = pages.admissible([t for _, t in requests], prompts=[p for p, _ in requests])
    assert admitted == 2
    for row, (prompt, tokens) in enumerate(requests[:admitted], start=1):
        pages.take(row, tokens, prompt)  # the second prompt not keyed yet: it comes in chunks
