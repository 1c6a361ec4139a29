"""A prompt prefilled in parts in a RowPool. The prefix cache: a conversation's next turn (its
history resent and a new message) finds the pages of the last turn's prompt and output cached,
target and drafter alike, prefills only the rest, and decodes to what its full prompt gives
alone, greedy and seeded sampled, with the same acceptance per round as without the hit. Chunks:
a long prompt prefilled a chunk per round while another request decodes between them, both as
alone; ``generate`` with chunks gives the tokens of a whole prefill. Nothing compiles after
warm-up; every page is free or cached again once requests end."""

from __future__ import annotations

import numpy as np
import pytest

import jaxdd
from jaxdd.cli import DEMO
from jaxdd.decoding.engine import SpeculativeDecoder
from jaxdd.decoding.requests import RowRequest
from jaxdd.decoding.rows import RowPool
from jaxdd.runtime.compile_time import compile_clock
from jaxdd.testing.pools import run_alone

# prompts to 160 tokens (a next turn: 64 + 80 answered + 16): the prompt buckets a pool warms up
# (each a prefill, and one after a hit) end at 160
OPTIONS = {"rows": 2, "max_len": 192, "max_prompt": 160}


@pytest.fixture(scope="module")
def decoder():
    return SpeculativeDecoder(*jaxdd.load_pair(DEMO / "target", DEMO / "drafter", "float32"))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("method", "sampling"),
    [("dflash", jaxdd.Sampling()), ("ddtree", jaxdd.Sampling(0.8, 0.95, 0, 7))],
)
def test_the_next_turn_hits_and_decodes_as_alone(decoder, method, sampling):
    rng = np.random.default_rng(5)
    options = {"method": method, **OPTIONS, **({"budget": 12} if method == "ddtree" else {})}
    cached = RowPool.serving(decoder, prefix_cache=True, **options)
    plain = RowPool.serving(decoder, **options)
    with compile_clock() as warm:
        cached.warm_up()
    assert warm.count > 0  # the prefill after a hit is among what warm-up compiles
    assert cached.pages.cached == 0  # warm-up leaves nothing behind
    first = RowRequest(rng.integers(1, 4096, 64).tolist(), 80, [], sampling)
    with compile_clock() as clock:
        said, _, none = run_alone(cached, first)
        history = first.prompt + said + rng.integers(1, 4096, 16).tolist()
        second = RowRequest(history, 24, [], sampling)
        hit, sizes, found = run_alone(cached, second)
        # the first prompt's first page found, and a rest of more than a page after it
        other = RowRequest(first.prompt + rng.integers(1, 4096, 96).tolist(), 2, [], sampling)
        _, _, found_other = run_alone(cached, other)
    assert clock.count == 0 and len(said) == 80 and found_other == 64
    # two pages: the first turn's prompt and its output but the last round's (the drafter's lag)
    assert none == 0 and found == 128
    miss, plain_sizes, _ = run_alone(plain, second)
    alone = decoder.generate(
        history,
        method=method,
        max_new_tokens=24,
        stop_token_ids=[],
        sampling=sampling,
        **({"budget": 12} if method == "ddtree" else {}),
    )
    assert hit == miss == alone.tokens
    assert sizes == plain_sizes  # the drafter's context was restored with the target's
    assert not cached.busy and cached.pages.held == 0
    assert cached.pages.free + cached.pages.cached == cached.pages.usable


@pytest.mark.slow
def test_a_prompt_in_chunks_lets_the_others_decode_between_them(decoder):
    rng = np.random.default_rng(8)
    pool = RowPool.serving(decoder, method="dflash", prefill_chunk=32, **OPTIONS)
    pool.warm_up()
    decoding = RowRequest(rng.integers(1, 4096, 10).tolist(), 60, [], jaxdd.Sampling(0.8, seed=3))
    long = RowRequest(rng.integers(1, 4096, 150).tolist(), 20, [], jaxdd.Sampling())
    outputs, between = {0: [], 1: []}, []
    with compile_clock() as clock:
        owner = {pool.admit([pool.check(decoding)])[0]: 0}
        owner[pool.admit([pool.check(long)])[0]] = 1  # its first chunk
        for _ in range(100):  # bounded: both end within their max_tokens rounds
            if not pool.busy:
                break
            updates = {owner[row]: update for row, update in pool.step().items()}
            if not outputs[1]:  # a chunk per round: the other request's tokens meanwhile
                between.append(len(updates[0].tokens) if 0 in updates else 0)
            for i, update in updates.items():
                outputs[i] += update.tokens
    assert clock.count == 0 and not pool.busy
    assert len(between) == 4 and all(between)  # 5 chunks of 32: the last brings its first token
    for i, request in enumerate([decoding, long]):
        options = {"max_new_tokens": request.max_new_tokens, "sampling": request.sampling}
        alone = decoder.generate(request.prompt, method="dflash", stop_token_ids=[], **options)
        assert outputs[i] == alone.tokens, i


@pytest.mark.parametrize("method", ["ar", "ddtree"])
def test_generate_prefills_in_chunks_to_the_same_tokens(decoder, method):
    rng = np.random.default_rng(9)
    prompts = [rng.integers(1, 4096, n).tolist() for n in (100, 7)]  # one chunked, one whole
    options = {
        "method": method,
        "max_new_tokens": [20, 12],
        "sampling": [jaxdd.Sampling(), jaxdd.Sampling(0.9, 0.9, 0, 11)],
        "stop_token_ids": [],
        **({"budget": 6} if method == "ddtree" else {}),
    }
    chunked = decoder.generate_batch(prompts, prefill_chunk=32, **options)
    whole = decoder.generate_batch(prompts, **options)
    for a, b in zip(chunked, whole, strict=True):
        assert a.tokens == b.tokens and a.acceptance_lengths == b.acceptance_lengths
    assert len(chunked[0].tokens) == 20
    with compile_clock() as clock:  # each call makes a pool of the same shape: its state's jit too
        again = decoder.generate_batch(prompts, prefill_chunk=32, **options)
    assert clock.count == 0 and [a.tokens for a in again] == [a.tokens for a in chunked]
