"""The programs a decode state passes through, its formats named (``jaxdd.decoding.programs``).
On TPU they name the pools' row-major layout; here row-major is the default, so naming the
formats anyway runs every program through its wrapping jit and checks that jit's arguments,
static ones and donation against the plain jits' tokens: a batch (one prefill into a new state)
and a serving pool (a prefill per row, the prefill after the first chunk, rounds over the first
rows and over all)."""

from __future__ import annotations

import numpy as np
import pytest
from jax.experimental.layout import Format

import jaxdd
from jaxdd.cli import DEMO
from jaxdd.decoding import programs, requests
from jaxdd.decoding.engine import SpeculativeDecoder
from jaxdd.decoding.requests import RowRequest
from jaxdd.decoding.rows import RowPool
from jaxdd.decoding.sampling import GREEDY

SAMPLED = jaxdd.Sampling(0.8, 0.95, 0, 11)
pytestmark = pytest.mark.slow  # every test compiles the pair's programs twice


@pytest.fixture(scope="module")
def decoder():
    return SpeculativeDecoder(*jaxdd.load_pair(DEMO / "target", DEMO / "drafter", "float32"))


def name_formats(monkeypatch) -> None:
    """Every state's formats named, as on TPU."""
    for module in (programs, requests):
        monkeypatch.setattr(module, "names_formats", lambda mesh: True)


def prompts(seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 4096, n).tolist() for n in (9, 40, 100)]


@pytest.mark.parametrize("method", ["ar", "dflash", "ddtree"])
def test_a_batch_decodes_alike_through_the_named_programs(decoder, monkeypatch, method):
    options = {"method": method, "max_new_tokens": 20, "stop_token_ids": []}
    options["sampling"] = [GREEDY, SAMPLED, GREEDY]
    plain = decoder.generate_batch(prompts(1), **options)
    name_formats(monkeypatch)
    named = decoder.generate_batch(prompts(1), **options)
    assert [r.tokens for r in named] == [r.tokens for r in plain]
    assert all(len(r.tokens) == 20 for r in plain)


def run(pool: RowPool, asked: list[RowRequest]) -> dict[int, list[int]]:
    """``asked`` admitted together, then rounds until every one has ended: tokens by request."""
    owner = {pool.admit([pool.check(request)])[0]: i for i, request in enumerate(asked)}
    said = {i: [] for i in owner.values()}
    for _ in range(200):  # bounded: each round brings a token or a chunk to every busy row
        if not pool.busy:
            break
        for row, update in pool.step().items():
            said[owner[row]] += update.tokens
    assert not pool.busy
    return said


def test_a_serving_pool_decodes_alike_through_the_named_programs(decoder, monkeypatch):
    options = {"method": "dflash", "rows": 4, "max_len": 256, "max_prompt": 192}
    rng = np.random.default_rng(2)
    asked = [
        RowRequest(rng.integers(1, 4096, 150).tolist(), 30, [], SAMPLED),  # chunked
        RowRequest(rng.integers(1, 4096, 12).tolist(), 40, [], GREEDY),
    ]
    plain = run(RowPool.serving(decoder, prefill_chunk=64, **options), asked)
    name_formats(monkeypatch)
    pool = RowPool.serving(decoder, prefill_chunk=64, **options)
    inner = pool.programs.decode_round.__wrapped__  # the plain jit, inside one naming formats
    assert inner is programs.PLAIN.decode_round
    named = run(pool, asked)
    assert named == plain and [len(t) for t in plain.values()] == [30, 40]
    rope = pool.shape.formats(decoder).target_cache.rope
    assert all(isinstance(f, Format) for f in rope)
