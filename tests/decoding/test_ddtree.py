"""DDTree decoding: identical to a PyTorch DDTree loop on the HF models, lossless
against plain greedy decoding, chain trees equal DFlash, compile once per shape."""

from __future__ import annotations

import numpy as np
import pytest

from jaxdd.crosscheck.torch_reference import Generation, ddtree_reference
from jaxdd.decoding.engine import SpeculativeDecoder
from jaxdd.runtime.compile_time import compile_clock
from jaxdd.testing.oracle import OracleDrafter, patched_reference_drafter
from jaxdd.testing.reference import hf_greedy

PROMPTS = [[5, 17, 3, 250, 9, 1, 77], [200, 4, 4, 91, 36, 12, 8, 150, 61, 7, 33]]
MAX_NEW = 24
BLOCK = 8


@pytest.fixture(scope="module")
def greedy(models):
    """HF greedy continuations (the lossless reference)
    of each prompt, long enough for the oracle."""
    ref_target = models[0]
    return [np.array(p + hf_greedy(ref_target, p, MAX_NEW + BLOCK)) for p in PROMPTS]


# Compilation dominates on CPU (one executable per budget
# and model pair), so the second model pair runs a subset.
SEED0 = pytest.mark.parametrize("models", [0], indirect=True, ids=["seed0"])


@pytest.mark.slow
@pytest.mark.parametrize(
    ("models", "budget"),
    [(0, 1), (0, BLOCK - 1), (0, 16), (0, 64), (0, 256), (1, BLOCK - 1), (1, 64)],
    indirect=["models"],
)
def test_lossless_random_drafter(models, greedy, budget):
    _, _, decoder = models
    for prompt, expected in zip(PROMPTS, greedy, strict=True):
        out = decoder.generate(
            prompt, method="ddtree", budget=budget, max_new_tokens=MAX_NEW, stop_token_ids=[]
        )
        assert out.tokens == expected[len(prompt) : len(prompt) + MAX_NEW].tolist()
        assert sum(out.acceptance_lengths) == MAX_NEW - 1


@pytest.mark.slow
@SEED0
@pytest.mark.parametrize("second", [False, True], ids=["top-ranked", "second-ranked"])
@pytest.mark.parametrize("budget", [BLOCK - 1, 64])
def test_lossless_partly_right_drafts(models, greedy, budget, second):
    """Oracle drafts make long paths; with the right
    token ranked second only the tree can accept it."""
    _, _, decoder = models
    prompt, expected = PROMPTS[1], greedy[1]
    right = np.random.default_rng(budget).random(len(expected)) < 0.85
    oracle = SpeculativeDecoder(
        decoder.target, OracleDrafter(decoder.drafter, expected, right, second=second)
    )
    tree = oracle.generate(
        prompt, method="ddtree", budget=budget, max_new_tokens=MAX_NEW, stop_token_ids=[]
    )
    assert tree.tokens == expected[len(prompt) : len(prompt) + MAX_NEW].tolist()
    chain = oracle.generate(
        prompt, method="dflash", max_new_tokens=MAX_NEW, stop_token_ids=[], block_size=BLOCK
    )
    if second:  # every accepted draft came through a second child
        assert max(chain.acceptance_lengths) == 1 and max(tree.acceptance_lengths) >= 2
    elif budget > BLOCK - 1:
        assert tree.rounds <= chain.rounds
    else:
        assert max(tree.acceptance_lengths) > 2


@SEED0
def test_chain_tree_equals_dflash(models, greedy):
    """A top-1 chain of B-1 nodes through the tree path gives DFlash's tokens and per-round
    acceptances, including shortened last blocks and a stop token inside a round."""
    _, _, decoder = models
    prompt, expected = PROMPTS[1], greedy[1]
    right = np.random.default_rng(3).random(len(expected)) < 0.85
    oracle = SpeculativeDecoder(decoder.target, OracleDrafter(decoder.drafter, expected, right))
    continuation = expected[len(prompt) :].tolist()
    for stop_ids in (
        [],
        [continuation[max(continuation.index(t) for t in set(continuation[:MAX_NEW]))]],
    ):
        kwargs = dict(max_new_tokens=MAX_NEW, stop_token_ids=stop_ids, block_size=BLOCK)
        chain = oracle.generate(prompt, method="ddtree", budget=BLOCK - 1, max_children=1, **kwargs)
        dflash = oracle.generate(prompt, method="dflash", **kwargs)
        assert (chain.tokens, chain.acceptance_lengths) == (
            dflash.tokens,
            dflash.acceptance_lengths,
        )
        assert max(chain.acceptance_lengths) > 2


@SEED0
def test_compiles_once_per_budget_and_bucket(models):
    _, _, decoder = models
    decoder.generate(
        PROMPTS[0], method="ddtree", budget=16, max_new_tokens=MAX_NEW, stop_token_ids=[]
    )
    with compile_clock() as compiles:
        out = decoder.generate(
            PROMPTS[1], method="ddtree", budget=16, max_new_tokens=MAX_NEW - 3, stop_token_ids=[]
        )
        decoder.generate(
            [3, 1, 4, 1, 5], method="ddtree", budget=16, max_new_tokens=MAX_NEW, stop_token_ids=[]
        )
    assert out.rounds > 5
    assert compiles.count == 0


@pytest.mark.slow
@SEED0
@pytest.mark.parametrize("second", [False, True], ids=["top-ranked", "second-ranked"])
@pytest.mark.parametrize("budget", [BLOCK - 1, 64])
def test_matches_pytorch_ddtree_loop(models, greedy, budget, second):
    """Token- and acceptance-identical to a PyTorch DDTree loop on the HF models
    (jaxdd/crosscheck/torch_reference.py: the paper's heap, one 4-D-masked HF
    verify, cache compaction), with random drafts, oracle drafts reached through
    first or second children, and a stop token inside a round."""
    ref_target, ref_drafter, decoder = models
    prompt, expected = PROMPTS[1], greedy[1]
    tokens, lengths = ddtree_reference(
        ref_drafter, ref_target, prompt, Generation(MAX_NEW, BLOCK, budget=budget)
    )
    ours = decoder.generate(
        prompt, method="ddtree", budget=budget, max_new_tokens=MAX_NEW, stop_token_ids=[]
    )
    assert (ours.tokens, ours.acceptance_lengths) == (tokens, lengths)

    right = np.random.default_rng(budget).random(len(expected)) < 0.85
    oracle = SpeculativeDecoder(
        decoder.target, OracleDrafter(decoder.drafter, expected, right, second=second)
    )
    patched = patched_reference_drafter(ref_drafter, expected, right, second=second)
    continuation = expected[len(prompt) :].tolist()
    for stops in (
        [],
        [continuation[max(continuation.index(t) for t in set(continuation[:MAX_NEW]))]],
    ):
        tokens, lengths = ddtree_reference(
            patched, ref_target, prompt, Generation(MAX_NEW, BLOCK, stops, budget)
        )
        ours = oracle.generate(
            prompt, method="ddtree", budget=budget, max_new_tokens=MAX_NEW, stop_token_ids=stops
        )
        assert (ours.tokens, ours.acceptance_lengths) == (tokens, lengths)
    assert max(lengths) >= 2
