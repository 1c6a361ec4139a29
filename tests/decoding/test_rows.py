"""RowPool: requests admitted into a running decode state at any round decode to what they give
alone (DDTree, greedy and seeded sampled, another cache size and batch than alone), with rounds
in flight and rows released and reused between them, and nothing compiles after warm-up."""

from __future__ import annotations

import numpy as np
import pytest

import jaxdd
from jaxdd.cli import DEMO
from jaxdd.decoding.engine import SpeculativeDecoder
from jaxdd.decoding.requests import RowRequest
from jaxdd.decoding.rows import RowPool
from jaxdd.errors import InputError
from jaxdd.runtime.compile_time import compile_clock
from jaxdd.serve.jobs import SERVER_WORDS


@pytest.fixture(scope="module")
def decoder():
    return SpeculativeDecoder(*jaxdd.load_pair(DEMO / "target", DEMO / "drafter", "float32"))


@pytest.mark.slow
def test_interleaved_ddtree_rows_equal_their_runs_alone(decoder):
    rng = np.random.default_rng(4)
    pool = RowPool.serving(decoder, method="ddtree", budget=12, rows=2, max_len=100, max_prompt=16)
    pool.warm_up()
    requests = [
        (
            rng.integers(1, 4096, size=int(rng.integers(3, 16))).tolist(),
            int(rng.integers(12, 30)),
            sampling,
        )
        for sampling in [
            jaxdd.Sampling(),
            jaxdd.Sampling(0.8, 0.95, 0, 5),
            jaxdd.Sampling(1.0, 1.0, 20, 6),
        ]
        * 2
    ]
    outputs, row_of, pending = {}, {}, list(range(len(requests)))
    with compile_clock() as clock:
        for _ in range(1000):  # bounded: every request ends within its max_tokens rounds
            if not pending and not pool.busy:
                break
            if pending and pool.free_rows() and (not pool.busy or rng.random() < 0.4):
                i = pending.pop(0)
                row = pool.admit([pool.check(RowRequest(*requests[i][:2], [0], requests[i][2]))])[0]
                outputs[i] = []
                row_of[row] = i
                continue
            for row, update in pool.step().items():
                outputs[row_of[row]] = outputs[row_of[row]] + update.tokens
    assert clock.count == 0 and not pending and not pool.busy
    for i, (prompt, length, sampling) in enumerate(requests):
        alone = decoder.generate(
            prompt,
            method="ddtree",
            budget=12,
            max_new_tokens=length,
            stop_token_ids=[0],
            sampling=sampling,
        )
        assert outputs[i] == alone.tokens, i


def row_state(state, row: int) -> list[np.ndarray]:
    """Row ``row``'s part of a decode state (but the pools' pages)."""
    parts = [state.target_cache.length, state.bonus, state.done, state.rng]
    if state.draft_cache is not None:
        parts += [state.context, state.context_count, state.draft_cache.length]
    return [np.asarray(part[row]) for part in parts]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ar", "dflash", "ddtree"])
def test_a_row_paused_for_pages_decodes_as_if_the_rounds_had_not_run(decoder, method):
    """A row that waits for pages runs paused: every per-row part of its state (length, bonus,
    random stream, drafter context and its cached length) is what it was, and both sampled rows
    decode to what they give alone."""
    rng = np.random.default_rng(6)
    options = {"method": method, "budget": 8} if method == "ddtree" else {"method": method}
    pool = RowPool.serving(decoder, rows=2, max_len=80, max_prompt=16, **options)
    requests = [
        RowRequest(rng.integers(1, 4096, 9).tolist(), 30, [], jaxdd.Sampling(0.9, seed=i))
        for i in range(2)
    ]
    outputs = {pool.admit([pool.check(r)])[0]: [] for r in requests}
    grow, waiting = pool.pages.grow, []
    pool.pages.grow = lambda wants: (
        grow({r: t for r, t in wants.items() if r not in waiting})
        + [r for r in wants if r in waiting]
    )
    for step in range(100):  # bounded: each request ends within 30 rounds and 3 paused
        if not pool.busy:
            break
        waiting[:] = [1] if step in (2, 3, 4) else []  # as if no page were free for row 1
        before = row_state(pool.state, 1)
        updates = pool.step()
        for row, update in updates.items():
            outputs[row].extend(update.tokens)
        if waiting:
            assert 1 not in updates
            for was, now in zip(before, row_state(pool.state, 1), strict=True):
                np.testing.assert_array_equal(was, now)
    assert pool.paused_rounds == 3 and not pool.busy
    for row, request in enumerate(requests):
        alone = decoder.generate(
            request.prompt,
            max_new_tokens=30,
            stop_token_ids=[],
            sampling=request.sampling,
            **options,
        )
        assert outputs[row] == alone.tokens, row


@pytest.mark.slow
def test_admissions_and_releases_while_rounds_are_in_flight(decoder):
    """Driven as the server drives it (two rounds in flight, admissions between
    them, live rows released and taken by the next request at once): a request
    that runs to its end gets what it gets alone, and a released one got a prefix
    of it; a released row's reports in flight never reach its next request."""
    rng = np.random.default_rng(7)
    pool = RowPool.serving(decoder, method="dflash", rows=2, max_len=80, max_prompt=16)
    pool.warm_up()
    samplings = [jaxdd.Sampling(), jaxdd.Sampling(0.7, 0.9, 0, 11), jaxdd.Sampling(1.0, 1.0, 0, 12)]
    requests = [
        (
            rng.integers(1, 4096, size=int(rng.integers(3, 16))).tolist(),
            int(rng.integers(8, 40)),
            sampling,
        )
        for sampling in samplings * 3
    ]
    outputs, row_of, pending, released, finished = {}, {}, list(range(len(requests))), set(), set()
    for _ in range(2000):  # bounded: every request ends within its max_tokens rounds
        if not pending and not pool.busy and not pool.in_flight:
            break
        if pending and pool.free_rows() and rng.random() < 0.5:
            i = pending.pop(0)
            row_of[
                pool.admit([pool.check(RowRequest(*requests[i][:2], [0], requests[i][2]))])[0]
            ] = i
            outputs[i] = []
        if pool.busy and rng.random() < 0.08:
            row = int(rng.choice([row for row, _ in pool.owners()]))
            pool.release(row)
            released.add(row_of.pop(row))
        if pool.busy:
            pool.dispatch()
        if pool.in_flight >= 2 or (pool.in_flight and not pool.busy):
            for row, update in pool.collect().items():
                outputs[row_of[row]] += update.tokens
                if update.finish is not None:
                    finished.add(row_of.pop(row))
    assert not pending and not pool.busy and released and finished
    assert released | finished == set(range(len(requests))) and not released & finished
    for i, (prompt, length, sampling) in enumerate(requests):
        alone = decoder.generate(
            prompt, max_new_tokens=length, stop_token_ids=[0], sampling=sampling
        ).tokens
        assert outputs[i] == alone if i in finished else alone[: len(outputs[i])] == outputs[i], i


def test_requests_past_the_pool_are_refused(decoder):
    pool = RowPool.serving(decoder, method="dflash", rows=1, max_len=40, max_prompt=16)
    with pytest.raises(InputError, match="max-len 40"):
        pool.check(RowRequest([1, 2, 3], 38, [0], jaxdd.Sampling()), SERVER_WORDS)
    with pytest.raises(InputError, match="at most 16"):
        pool.check(RowRequest([1] * 17, 2, [0], jaxdd.Sampling()), SERVER_WORDS)
    with pytest.raises(InputError, match="outside the vocabulary"):
        pool.check(RowRequest([1, 4096], 2, [0], jaxdd.Sampling()), SERVER_WORDS)
    with pytest.raises(InputError, match="logprobs: this pool computes none"):
        pool.check(RowRequest([1, 2], 2, [0], jaxdd.Sampling(), logprobs=0), SERVER_WORDS)
    scoring = RowPool.serving(
        decoder, method="dflash", rows=1, max_len=40, max_prompt=16, max_logprobs=2
    )
    with pytest.raises(InputError, match=r"logprobs: must be an integer in \[0, 2\], got 3"):
        scoring.check(RowRequest([1, 2], 2, [0], jaxdd.Sampling(), logprobs=3), SERVER_WORDS)
    with pytest.raises(InputError, match="max_tokens: must be an integer >= 1, got 0"):
        scoring.check(RowRequest([1, 2], 0, [0], jaxdd.Sampling(), logprobs=2), SERVER_WORDS)
    with pytest.raises(InputError, match="logprobs: scoring the prompt needs logprobs"):
        scoring.check(RowRequest([1, 2], 0, [0], jaxdd.Sampling(), score_prompt=True), SERVER_WORDS)
    scored = RowRequest([1, 2], 0, [0], jaxdd.Sampling(), 1, True)
    assert scoring.check(scored) == scored


@pytest.mark.slow
def test_requests_done_by_their_prefill_need_no_round(decoder):
    """A prompt scored alone and a request for one token end with their prefill's report: the
    pool needs no round for them (the server collects without dispatching one), only for a
    request that wants more."""
    pool = RowPool.serving(
        decoder, method="dflash", rows=2, max_len=40, max_prompt=16, max_logprobs=2
    )
    scored = pool.admit([RowRequest([5, 6, 7], 0, [], logprobs=0, score_prompt=True)])[0]
    one = pool.admit([RowRequest([8, 9], 1, [])])[0]
    assert pool.busy and not pool.needs_round()
    updates = pool.collect()
    assert pool.in_flight == 0 and not pool.busy
    assert updates[scored].tokens == [] and updates[scored].finish == "length"
    assert len(updates[one].tokens) == 1 and updates[one].finish in ("stop", "length")
    assert [e.logprob is not None for e in updates[scored].prompt_logprobs] == [True, True]
    pool.admit([RowRequest([8, 9], 3, [])])
    assert pool.needs_round()


@pytest.mark.slow
def test_a_pool_of_pages_holds_short_requests_beside_a_long_one(decoder):
    """A pool of 18 cache pages for 16 short requests and one of ``max_len``, where rows of fixed
    size would need 17 x ``max_len`` and even their reaches 16 x 2 + 5 pages: all 17 are admitted
    at a page each and grow a page at a time, a row that could leave some row unable to end if it
    took one waiting a round; an 18th waits for admission (a row and a page are free) until
    requests end and give theirs back, and while a row waits, then decodes too. All decode to
    what they give alone."""
    rng = np.random.default_rng(12)
    max_len = 256
    long = RowRequest(rng.integers(1, 4096, 12).tolist(), max_len - 12, [], jaxdd.Sampling())
    short = [
        RowRequest(rng.integers(1, 4096, 10).tolist(), 60, [], jaxdd.Sampling(0.8, seed=i))
        for i in range(17)
    ]
    options = {"method": "dflash", "rows": 18, "max_len": max_len, "max_prompt": 16}
    page = 64
    pool = RowPool.serving(decoder, cache_tokens=18 * page, **options)
    assert pool.cache_tokens == 18 * page < 17 * pool.shape.slots
    assert all(pool.shape.start(r) <= page < pool.shape.reach(r) for r in (long, short[0]))
    pool.warm_up()
    assert pool.admissible([long, *short]) == 17  # the 18th finds a row and a page, and waits
    owner = {pool.admit([pool.check(r)])[0]: i for i, r in enumerate([long, *short[:16]])}
    assert pool.pages.free == 1 and pool.free_rows()
    outputs = {i: [] for i in range(18)}
    waiting = short[16:]
    for _ in range(400):  # bounded: every request ends within its max_tokens rounds
        # none is admitted while a row waits for pages: they go to the waiting rows first
        assert not (pool.settings.paused.any() and pool.admissible(short))
        if waiting and pool.admissible(waiting):
            owner[pool.admit([pool.check(waiting.pop())])[0]] = 17
        if not pool.busy:
            break
        for row, update in pool.step().items():
            outputs[owner[row]].extend(update.tokens)
    assert not pool.busy and not waiting and pool.cache_usage == 0.0
    assert pool.paused_rounds > 0  # rows waited for pages
    for i, request in enumerate([long, *short]):
        if i in (0, 1, 16, 17):  # the long one, the 18th and two short ones
            options = {"max_new_tokens": request.max_new_tokens, "sampling": request.sampling}
            alone = decoder.generate(request.prompt, method="dflash", stop_token_ids=[], **options)
            assert outputs[i] == alone.tokens, i


@pytest.mark.slow
def test_a_row_asks_for_the_rounds_in_flight_it_runs_in(decoder):
    """Before each round a row asks for the pages up to what the rounds in flight it runs in and
    this round can write: a row admitted after two rounds were dispatched asks for its prompt and
    one round, the row that ran in both for two rounds' width more."""
    pool = RowPool.serving(
        decoder, method="dflash", rows=2, max_len=256, max_prompt=16, cache_tokens=512
    )
    pool.warm_up()
    asked = []
    grow = pool.pages.grow
    pool.pages.grow = lambda wants: asked.append(dict(wants)) or grow(wants)
    first = pool.admit([pool.check(RowRequest(list(range(1, 13)), 200, [], jaxdd.Sampling()))])[0]
    pool.dispatch()
    pool.dispatch()
    second = pool.admit([pool.check(RowRequest(list(range(1, 6)), 200, [], jaxdd.Sampling()))])[0]
    pool.dispatch()
    one_round = pool.shape.round_tokens
    assert asked[0] == {first: 12 + one_round}
    assert asked[1] == {first: 12 + pool.shape.spec.width + one_round}
    assert asked[2] == {first: 12 + 2 * pool.shape.spec.width + one_round, second: 5 + one_round}
    pool.release_all()
