"""A pool with ``auto``: whatever sequence of its rounds runs (forced, or the chooser's), greedy
tokens are plain greedy decoding's, the drafter's context stays whole across plain rounds, and
warm-up compiles every round of the set (no more than the memory maps' count), nothing after."""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest

import jaxdd
from jaxdd.cli import DEMO
from jaxdd.decoding import memory_maps
from jaxdd.decoding.engine import SpeculativeDecoder
from jaxdd.decoding.requests import RowRequest
from jaxdd.decoding.rows import RowPool
from jaxdd.decoding.speculation import Ticket
from jaxdd.errors import InputError
from jaxdd.runtime.compile_time import compile_clock


@pytest.fixture(scope="module")
def decoder():
    return SpeculativeDecoder(*jaxdd.load_pair(DEMO / "target", DEMO / "drafter", "float32"))


def prompts(seed: int, count: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 4096, size=int(rng.integers(3, 9))).tolist() for _ in range(count)]


def decode(pool: RowPool, requests: list[RowRequest], check=None) -> list[list[int]]:
    """Each request's tokens, all admitted at once and stepped to their ends (``check(pool)``
    after every round)."""
    rows = [pool.admit([pool.check(request)])[0] for request in requests]
    outputs = dict.fromkeys(rows, ())
    while pool.busy:
        for row, update in pool.step().items():
            outputs[row] += tuple(update.tokens)
        if check is not None:
            check(pool)
    return [list(outputs[row]) for row in rows]


def context_whole(pool: RowPool) -> None:
    """Every busy row's drafter holds the context up to its pending rows: the drafter caches
    what the target committed but the last round's tokens, which wait in ``context``."""
    state = pool.state
    drafted = np.asarray(state.draft_cache.length) + np.asarray(state.context_count)
    committed = np.asarray(state.target_cache.length)
    busy = [row for row, _ in pool.owners()]
    assert (drafted[busy] == committed[busy]).all(), (drafted, committed)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("method", "sequence"),
    [
        ("ddtree", ["ar", "ar", "ddtree-7", "ddtree-3", "ar", "ddtree-7", "ddtree-3", "ddtree-3"]),
        ("dflash", ["ar", "dflash-8", "dflash-8", "ar", "ar", "ar", "dflash-8"]),
        # plain rounds past the context's block: their pending taps cached once it is full
        ("ddtree", ["ar"] * 11 + ["ddtree-7", "ddtree-3"]),
    ],
)
def test_any_sequence_of_rounds_decodes_plain_greedy_tokens(decoder, method, sequence):
    pool = RowPool.serving(decoder, method=method, rows=2, max_len=64, max_prompt=8, auto=True)
    assert set(pool.round_set.names) == set(sequence)
    forced = itertools.cycle(sequence)
    pool.chooser.choose = lambda tier: Ticket(next(forced), tier, time.perf_counter())
    requests = [RowRequest(prompt, 40, [0]) for prompt in prompts(7, 2)]
    outputs = decode(pool, requests, context_whole)
    for request, output in zip(requests, outputs, strict=True):
        alone = decoder.generate(request.prompt, method="ar", max_new_tokens=40, stop_token_ids=[0])
        assert output == alone.tokens


@pytest.mark.slow
def test_the_chooser_runs_every_round_of_the_set_without_compiling(decoder):
    pool = RowPool.serving(decoder, method="ddtree", rows=2, max_len=64, max_prompt=8, auto=True)
    with compile_clock() as warming:
        pool.warm_up()
    counted = memory_maps.pool_programs("ddtree", 2, 8, False, False, None, 3)
    assert counted.rounds == 2 * 3 * len(pool.shape.tiers) + memory_maps.OWN_PROGRAMS
    assert warming.count <= counted.prefills + counted.rounds
    pool.chooser.probe_every = 4  # every round of the set runs within the few rounds here
    tiers = pool.shape.tiers
    assert set(pool.chooser.base) == {(n, t) for n in pool.round_set.names for t in tiers}
    assert set(pool.chooser.rounds.values()) == {0} and pool.chooser.tokens == {"ar": 1.0}
    greedy = [RowRequest(prompt, 48, [0]) for prompt in prompts(11, 2)]
    sampled = RowRequest(greedy[0].prompt, 24, [0], jaxdd.Sampling(0.8, 0.95, 0, 3))
    with compile_clock() as clock:
        outputs = decode(pool, greedy)
        decode(pool, [sampled], context_whole)
    assert clock.count == 0
    assert all(pool.chooser.rounds[name] > 0 for name in pool.round_set.names)
    for request, output in zip(greedy, outputs, strict=True):
        alone = decoder.generate(request.prompt, method="ar", max_new_tokens=48, stop_token_ids=[0])
        assert output == alone.tokens


def test_plain_decoding_has_nothing_to_choose(decoder):
    with pytest.raises(InputError, match="budget"):
        RowPool.serving(decoder, method="ar", rows=1, max_len=16, auto=True)


@pytest.mark.slow
def test_a_batch_with_budget_auto_decodes_plain_greedy_tokens(decoder):
    batch = prompts(13, 3)
    options = {"max_new_tokens": 32, "stop_token_ids": [0]}
    results = decoder.generate_batch(batch, method="ddtree", budget="auto", **options)
    for prompt, result in zip(batch, results, strict=True):
        assert result.tokens == decoder.generate(prompt, method="ar", **options).tokens
        assert set(result.spec_rounds) == {"ddtree-7", "ddtree-3", "ar"}
        assert sum(result.spec_rounds.values()) >= result.rounds


def test_a_budget_is_a_number_or_auto_and_auto_needs_a_drafted_method(decoder):
    with pytest.raises(InputError, match="budget: expected an integer or 'auto', got 'fast'"):
        decoder.generate([1, 2], method="ddtree", budget="fast")
    with pytest.raises(InputError, match="budget"):
        decoder.generate([1, 2], method="ar", budget="auto")
