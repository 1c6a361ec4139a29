"""The prefix cache under a running RowPool: random admissions of conversations (each turn resends
the history, the last answer and a new message, so turns hit the pages of earlier ones), rounds,
cancellations and timeouts (a row released mid-request), round faults (``reset``) and failed
batches (``release_all``). After every step: free + cached + held pages = the pool, each page's
references = the rows whose tables hold it (a page a row reads is never free or evictable), a
released row gives its pages back once; and a request decodes to the same tokens whether its
prompt hit the cache or not (greedy: the same prompt, the same tokens)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxdd
from jaxdd.cli import DEMO
from jaxdd.decoding.engine import SpeculativeDecoder
from jaxdd.decoding.requests import RowRequest
from jaxdd.decoding.rows import RowPool
from jaxdd.testing.profiles import examples

ROWS = 3
MAX_PROMPT = 160
CONVERSATIONS = 2


@pytest.fixture(scope="module")
def pool():
    decoder = SpeculativeDecoder(*jaxdd.load_pair(DEMO / "target", DEMO / "drafter", "float32"))
    # a small pool: requests wait for pages, cached pages are evicted for new ones
    options = {"rows": ROWS, "max_len": 224, "max_prompt": MAX_PROMPT, "cache_tokens": 512}
    return RowPool.serving(decoder, method="dflash", prefix_cache=True, prefill_chunk=48, **options)


def check_pages(pool: RowPool) -> None:
    pages = pool.pages
    assert pages.free + pages.cached + pages.held == pages.usable
    counts = np.zeros((pages.paging.pool_pages,), np.int32)
    for row, n in pages._held.items():
        np.add.at(counts, pages.table[row, :n], 1)
    np.testing.assert_array_equal(counts, pages._refs)
    held = {p for p in range(pages.paging.pool_pages) if pages._refs[p] > 0}
    assert held.isdisjoint(p for share in pages._free for p in share)
    assert held.isdisjoint(p for share in pages._cached for p in share)
    assert set(pages._held) == {row for row, _ in pool.owners()}


operation = st.one_of(
    st.tuples(st.just("admit"), st.integers(0, CONVERSATIONS - 1), st.integers(1, 24)),
    st.tuples(st.just("round")),
    st.tuples(st.just("round")),
    st.tuples(st.just("cancel"), st.integers(0, ROWS - 1)),
    st.tuples(st.sampled_from(["fault", "fail_all"])),
)


def drive(pool: RowPool, seed: int, ops: list[tuple]) -> tuple[int, int]:
    """Run ``ops`` on ``pool``, checking the pages after each: the prompt tokens found cached,
    and how often a hit's tokens were compared with a miss's for the same prompt."""
    pool.reset()
    rng = np.random.default_rng(seed)
    histories = [rng.integers(1, 4096, 40).tolist() for _ in range(CONVERSATIONS)]
    said: dict[tuple[int, ...], tuple[list[int], int]] = {}  # a prompt's tokens, its hit
    running: dict[int, tuple[int, list[int], list[int], int]] = {}  # conversation, prompt, ...
    hits = compared = 0  # tokens found cached; a hit's tokens compared with a miss's
    for number, op in enumerate(ops):
        if op[0] == "admit":
            _, conversation, answer = op
            request = pool.check(RowRequest(histories[conversation], answer, [], jaxdd.Sampling()))
            if pool.admissible([request]) == 1:
                pool.admit([request], [number])
                running[number] = (conversation, request.prompt, [], 0)
        elif op[0] == "round" and pool.busy:
            for update in pool.step().values():
                conversation, prompt, tokens, cached = running[update.owner]
                tokens += update.tokens
                if update.first:
                    hits += update.cached_tokens
                    cached = update.cached_tokens
                    running[update.owner] = (conversation, prompt, tokens, cached)
                if update.finish is None:
                    continue
                before, before_cached = said.setdefault(tuple(prompt), (tokens, cached))
                shorter = min(len(before), len(tokens))
                assert before[:shorter] == tokens[:shorter]  # greedy: a hit decodes as a miss
                compared += bool(before_cached) != bool(cached)
                history = [*prompt, *tokens, *rng.integers(1, 4096, 8).tolist()]
                histories[conversation] = history[-MAX_PROMPT:]  # a new turn (or a new chat)
                del running[update.owner]
        elif op[0] == "cancel" and op[1] in dict(pool.owners()):
            held = pool.pages.held
            owner = dict(pool.owners())[op[1]]
            pool.release(op[1])
            pool.release(op[1])  # twice: the pages come back once
            assert pool.pages.held < held
            del running[owner]
        elif op[0] == "fault":  # a round failed: the state may be gone, the cache with it
            pool.reset()
            running.clear()
            assert pool.pages.cached == pool.pages.held == 0
        elif op[0] == "fail_all":
            pool.release_all()
            running.clear()
        check_pages(pool)
    assert hits % pool.pages.page == 0
    return hits, compared


@pytest.mark.slow
@given(seed=st.integers(0, 2**16), ops=st.lists(operation, max_size=40))
@settings(max_examples=examples(12), deadline=None)
def test_pages_add_up_and_hits_decode_as_misses(pool, seed, ops):
    drive(pool, seed, ops)


def test_a_hit_is_compared_with_a_miss(pool):
    """One run the checks above see a hit in: a second turn of 72 tokens (its prompt's first
    page cached once its last chunk is dispatched) admitted twice, a miss and then a hit."""
    turn = [("admit", 0, 24)]
    ops = turn + [("round",)] * 30 + turn + [("round",)] + turn + [("round",)] * 40
    hits, compared = drive(pool, 3, ops)
    assert hits == 64 and compared == 1
