"""Logprobs: each emitted token's log-probability and top-k under the target's distribution
before temperature and cut-offs, and a scored prompt's, equal a plain forward's log-softmax (HF
transformers over prompt + output, fp32); asking for them changes no token."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import jaxdd
from jaxdd.decoding.report import Logprobs, RoundReport
from jaxdd.decoding.requests import RowRequest
from jaxdd.decoding.rows import RowPool
from jaxdd.decoding.sampling import GREEDY

PROMPT = [5, 17, 3, 250, 9, 1, 77, 200, 4, 4, 91]
MAX_NEW = 20
K = 5
SAMPLED = jaxdd.Sampling(temperature=0.8, top_p=0.9, seed=3)
CASES = [
    ("ar", GREEDY),
    ("dflash", GREEDY),
    ("ddtree", GREEDY),
    ("dflash", SAMPLED),
    ("ddtree", SAMPLED),
]
ATOL = 1e-4  # fp32 forwards of different programs (HF eager vs jaxdd's MLA forms)


def reference_logprobs(ref_target, ids: list[int]) -> np.ndarray:
    """log_softmax of the HF target's logits over ``ids``, one plain forward: [len(ids), V]."""
    with torch.no_grad():
        logits = ref_target(torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.double(), dim=-1).numpy()


def assert_matches(entries, reference: np.ndarray, tokens: list[int], k: int) -> None:
    """Entry i is token i's under reference row i: the token's value and the top k's."""
    assert len(entries) == len(tokens)
    for entry, row, token in zip(entries, reference, tokens, strict=True):
        assert entry.logprob == pytest.approx(row[token], abs=ATOL)
        ids, values = zip(*entry.top, strict=True)
        assert len(ids) == k and list(values) == sorted(values, reverse=True)
        np.testing.assert_allclose(values, np.sort(row)[::-1][:k], atol=ATOL)
        np.testing.assert_allclose(row[list(ids)], values, atol=ATOL)  # ids of those values
        if token == ids[0]:
            assert entry.logprob == values[0]  # the one log-softmax: exactly equal


@pytest.mark.slow
@pytest.mark.parametrize(("method", "sampling"), CASES, ids=lambda c: getattr(c, "greedy", c))
def test_logprobs_change_no_token_and_equal_a_plain_forward(models, method, sampling):
    ref_target, _, decoder = models
    options = {"method": method, "max_new_tokens": MAX_NEW, "stop_token_ids": []}
    options |= {"sampling": sampling, "block_size": 4}
    plain = decoder.generate(PROMPT, **options)
    scored = decoder.generate(PROMPT, **options, logprobs=K, score_prompt=True)
    assert scored.tokens == plain.tokens
    assert scored.acceptance_lengths == plain.acceptance_lengths
    assert plain.logprobs == [] and plain.prompt_logprobs == []
    reference = reference_logprobs(ref_target, PROMPT + scored.tokens)
    assert_matches(scored.prompt_logprobs, reference[: len(PROMPT) - 1], PROMPT[1:], K)
    assert_matches(scored.logprobs, reference[len(PROMPT) - 1 : -1], scored.tokens, K)


@pytest.mark.slow
def test_a_batch_of_mixed_prompts(models):
    """Rows of a batch (prompts of different lengths, one padded row) each get their own."""
    ref_target, _, decoder = models
    prompts = [PROMPT, PROMPT[:4], [7, 8]]
    results = decoder.generate_batch(
        prompts, max_new_tokens=6, stop_token_ids=[], logprobs=2, score_prompt=True
    )
    for prompt, result in zip(prompts, results, strict=True):
        reference = reference_logprobs(ref_target, prompt + result.tokens)
        assert_matches(result.prompt_logprobs, reference[: len(prompt) - 1], prompt[1:], 2)
        assert_matches(result.logprobs, reference[len(prompt) - 1 : -1], result.tokens, 2)


def test_the_report_carries_floats_exactly():
    """Log-probabilities travel bitcast in the report's int32 array: decoded bit for bit."""
    rng = np.random.default_rng(0)
    rows = 3
    width = 4
    k = 2
    prompt = 5
    tokens = rng.integers(0, 100, (rows, width)).astype(np.int32)
    produced = np.array([1, 4, 0], np.int32)
    stopped = np.array([False, True, False])
    emitted = [rng.standard_normal((rows, width)).astype(np.float32)]
    emitted += [rng.integers(0, 100, (rows, width, k)).astype(np.int32)]
    emitted += [rng.standard_normal((rows, width, k)).astype(np.float32)]
    scored = [
        rng.standard_normal((rows, prompt)).astype(np.float32),
        rng.integers(0, 100, (rows, prompt, k)).astype(np.int32),
        np.full((rows, prompt, k), -np.inf, np.float32),
    ]
    encoded = RoundReport.encode(tokens, produced, stopped, None, None, emitted, scored)
    report = RoundReport.decode(encoded, width, 0, k, prompt)
    np.testing.assert_array_equal(report.tokens, tokens)
    np.testing.assert_array_equal(report.produced, produced)
    for decoded, arrays in ((report.logprobs, emitted), (report.prompt_logprobs, scored)):
        assert isinstance(decoded, Logprobs)
        for got, want in zip((decoded.chosen, decoded.top_ids, decoded.top), arrays, strict=True):
            np.testing.assert_array_equal(got, want)
    assert RoundReport.decode(encoded[:, : width + 2], width).logprobs is None


@pytest.mark.slow
def test_only_asking_rows_get_theirs(models):
    """A row that asked for logprobs beside one that did not gets the plain forward's values, the
    other none; a prompt scored alone whose next token would be a stop token ends by its length
    (that token was never produced)."""
    ref_target, _, decoder = models
    pool = RowPool.serving(
        decoder, method="dflash", rows=2, max_len=64, max_prompt=16, max_logprobs=K
    )
    quiet = pool.admit([RowRequest(PROMPT[:5], 12, [])])[0]
    asking = pool.admit([RowRequest(PROMPT, 6, [], logprobs=K)])[0]
    got = {quiet: [], asking: []}
    scores = []
    for _ in range(12):
        for row, update in pool.step().items():
            got[row] += update.tokens
            if row == asking:
                scores += update.logprobs
            else:
                assert update.logprobs is None
        if not pool.busy:
            break
    reference = reference_logprobs(ref_target, PROMPT + got[asking])
    assert_matches(scores, reference[len(PROMPT) - 1 : -1], got[asking], K)
    first = decoder.generate(PROMPT, max_new_tokens=1, stop_token_ids=[]).tokens[0]
    pool.admit([RowRequest(PROMPT, 0, [first], logprobs=K, score_prompt=True)])
    (update,) = pool.step().values()
    assert update.tokens == [] and update.finish == "length" and not update.first
    assert_matches(update.prompt_logprobs, reference[: len(PROMPT) - 1], PROMPT[1:], K)
