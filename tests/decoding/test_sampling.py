"""Sampling: settings, the filtered distribution,
lossless sampled AR / DFlash / DDTree, and batching."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from dflash.model import _sampling_probs
from hypothesis import example, given, settings
from hypothesis import strategies as st

import jaxdd
from jaxdd.decoding.engine import SpeculativeDecoder
from jaxdd.decoding.sampling import (
    CANDIDATES,
    Sampling,
    SamplingArrays,
    filtered_probs,
    sample,
    seed_keys,
    split_keys,
)
from jaxdd.planning.aot import find_machine
from jaxdd.runtime.backend import Backend
from jaxdd.testing.profiles import examples
from jaxdd.testing.reference import TINY_K2, drafter_config, hf_drafter, hf_greedy, hf_model

# A vocabulary small enough to enumerate every 3-token continuation (8^3
# = 512), and logits scaled up so the distributions are far from uniform.
# CALLS batches of ROWS: small ones, as a batch's admission costs grow faster than its rows.
VOCAB, NEW, ROWS, CALLS = 8, 3, 128, 64
PROMPT = [1, 4, 2, 6, 3]
SETTINGS = Sampling(temperature=0.8, top_p=0.95, top_k=6)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("temperature", -0.1, "temperature: must be a finite number >= 0"),
        ("temperature", float("nan"), "temperature"),
        ("top_p", 0.0, r"top_p: must be in \(0, 1\]"),
        ("top_p", 1.5, "top_p"),
        ("top_k", -1, "top_k: must be an integer >= 0"),
        ("top_k", 2.5, "top_k"),
        ("seed", -3, r"seed: must be an integer in \[0, 2\*\*32\)"),
    ],
)
def test_bad_settings(field, value, message):
    with pytest.raises(jaxdd.InputError, match=message):
        Sampling(**{field: value})


@pytest.mark.parametrize(
    "setting", [(1.0, 1.0, 0), (0.7, 0.9, 0), (1.3, 1.0, 5), (0.5, 0.6, 12), (2.0, 0.3, 40)]
)
def test_filtered_probs_match_dflash(setting):
    temperature, top_p, top_k = setting
    logits = np.random.default_rng(0).standard_normal((3, 5, 64)).astype(np.float32) * 3
    expected = _sampling_probs(torch.from_numpy(logits), temperature, top_p, top_k).numpy()
    ours = filtered_probs(
        jnp.asarray(logits), SamplingArrays.of([Sampling(temperature, top_p, top_k)] * 3)
    )
    np.testing.assert_allclose(np.asarray(ours), expected, atol=1e-6)


# Sums of float32 probabilities (the sampler's) stray from
# the exact mass by at most this much, for <= 1000 tokens.
MASS_ROUNDING = 1e-5


def sorted_filter(
    logits: np.ndarray, temperature: float, top_p: float, top_k: int
) -> tuple[np.ndarray, np.ndarray]:
    """(kept [..., V] bool, probabilities [..., V] float64 after the top-k cut) by
    sorting: scores >= the k-th largest, then the sorted prefix whose exact (float64) mass
    before each token is below top_p, and every token as likely as the last one kept."""
    scores = logits.astype(np.float32) / np.float32(temperature)
    if 0 < top_k < scores.shape[-1]:
        kth = -np.sort(-scores, axis=-1)[..., top_k - 1 : top_k]
        scores = np.where(scores < kth, -np.inf, scores)
    scores = scores.astype(np.float64)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    if top_p >= 1:
        return probs > 0, probs
    descending = -np.sort(-probs, axis=-1)
    kept = ((np.cumsum(descending, axis=-1) - descending) < top_p).sum(-1, keepdims=True)
    return probs >= np.take_along_axis(descending, kept - 1, axis=-1), probs


def logits_of(seed: int, vocab: int, scale: float, kind: str, dtype: str) -> np.ndarray:
    """[2, 3, vocab] float32 logits: normal, tied (rounded to halves),
    flat (one value a row) or mostly masked (-inf), held in ``dtype``."""
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((2, 3, vocab)).astype(np.float32) * scale
    if kind == "ties":
        logits = np.round(logits * 2) / 2
    elif kind == "flat":
        logits = np.broadcast_to(logits[..., :1], logits.shape).copy()
    elif kind == "masked":
        logits[rng.random(logits.shape) < 0.7] = -np.inf
        logits[..., rng.integers(vocab)] = 0.0  # every row keeps a finite logit
    return np.asarray(jnp.asarray(logits, dtype).astype(jnp.float32))


# compiled once per shape, not per example
jit_filtered_probs = jax.jit(filtered_probs, static_argnums=2)


@pytest.mark.slow
@settings(max_examples=examples(60), deadline=None)
@given(
    seed=st.integers(0, 2**31),
    vocab=st.sampled_from([40, 300, 1000]),
    scale=st.sampled_from([0.05, 1.0, 8.0]),
    top_p=st.sampled_from([1.0, 0.999999, 0.95, 0.6, 0.1]),
    top_k=st.sampled_from(
        ["off", 1, 3, CANDIDATES, CANDIDATES + 6, 250, "vocab - 1", "vocab", "vocab + 5"]
    ),
    kind=st.sampled_from(["normal", "ties", "flat", "masked"]),
    dtype=st.sampled_from(["float32", "bfloat16"]),
)
@example(seed=3101, vocab=300, scale=1.0, top_p=0.95, top_k=250, kind="ties", dtype="float32")
def test_cut_offs_keep_what_sorting_keeps(seed, vocab, scale, top_p, top_k, kind, dtype):
    """The top-k and top-p cut-offs, found among the candidates or by a search beyond
    them (a bisection, a 4- or a 16-way search), keep what sorting keeps, ties
    included: exactly, but for a nucleus edge within float32 rounding of top_p, where
    either side is right. (The @example: the exact mass before the edge is 0.949999,
    and a float32 cumulative sum in the old reference made it 0.9500006.)"""
    top_k = {"off": 0, "vocab - 1": vocab - 1, "vocab": vocab, "vocab + 5": vocab + 5}.get(
        top_k, top_k
    )
    logits = logits_of(seed, vocab, scale, kind, dtype)
    exact, probs = sorted_filter(logits, 0.7, top_p, top_k)
    low, _ = sorted_filter(logits, 0.7, top_p - MASS_ROUNDING, top_k)
    high, _ = sorted_filter(logits, 0.7, min(top_p + MASS_ROUNDING, 1.0), top_k)
    # rows whose nucleus edge is within rounding of top_p
    edge = (low != high).any(-1, keepdims=True)
    # XLA flushes subnormal probabilities to 0
    normal = (probs == 0) | (probs >= np.finfo(np.float32).tiny)
    rows = SamplingArrays.of([Sampling(0.7, top_p, top_k)] * 2)
    for ways in (2, 4, 16):
        ours = np.asarray(jit_filtered_probs(jnp.asarray(logits), rows, ways))
        kept = ours > 0
        mismatch = normal & np.where(edge, (kept & ~high) | (low & ~kept), kept != exact)
        assert not mismatch.any(), (
            f"ways={ways}: rows {np.argwhere(mismatch.any(-1)).tolist()} keep other tokens"
        )
        expected = np.where(kept, probs, 0.0)
        np.testing.assert_allclose(
            ours, expected / expected.sum(-1, keepdims=True), atol=1e-6, err_msg=f"{ways=}"
        )


def _filter_bytes(machine: str, ways: int) -> int:
    """What ``filtered_probs`` of a DDTree verify's 17 positions moves, compiled
    for ``machine``: a device's share of K2's vocabulary under TP8 (20480 of
    163840), every cut-off searched (the compiler counts the larger branch)."""
    where = find_machine(machine, 1)
    device = jax.sharding.SingleDeviceSharding(where.devices[0])
    shapes = [
        ((1, 17, 20480), jnp.float32),
        ((1,), jnp.float32),
        ((1,), jnp.float32),
        ((1,), jnp.int32),
    ]
    args = [jax.ShapeDtypeStruct(shape, dtype, sharding=device) for shape, dtype in shapes]
    f = lambda logits, t, p, k: filtered_probs(logits, SamplingArrays(t, p, k), ways)
    compiled = jax.jit(f).lower(*args).compile(compiler_options=where.compiler_options or None)
    return jaxdd.compiled_traffic(compiled)["bytes"]


@pytest.mark.slow
@pytest.mark.parametrize(("machine", "platform"), [("h200", "gpu"), ("cpu", "cpu")])
def test_cut_off_search_reads_the_values_least_with_its_backends_ways(machine, platform):
    """Each backend's ``cut_off_ways`` is the cheapest there: XLA:GPU fuses 15
    comparisons into one read of the values (16 ways: 37x the logits' bytes, a
    bisection 83x), XLA:CPU writes them out (a bisection is cheapest)."""
    logits = 17 * 20480 * 4
    chosen = Backend(platform).cut_off_ways()
    moved = {ways: _filter_bytes(machine, ways) for ways in {2, 16, chosen}}
    assert moved[chosen] == min(moved.values())
    if platform == "gpu":
        assert moved[chosen] <= 45 * logits < moved[2]


@pytest.mark.slow
@pytest.mark.parametrize("vocab", [7, 100, 4096])
def test_sample_draws_each_token_with_its_probability(vocab):
    """The two-level inverse-CDF draw against the probabilities it is given
    (zeros included): a chi-square test over 40000 draws, which also rejects
    a distribution with a quarter of the likeliest token's mass moved."""
    rng = np.random.default_rng(vocab)
    # at most 70 tokens with mass, spread over the vocabulary (and its blocks)
    probs = np.zeros(vocab, np.float32)
    likely = rng.choice(vocab, min(vocab - 2, 70), replace=False)
    probs[likely] = rng.dirichlet(np.full(len(likely), 2.0))
    draws, calls = 4000, 10
    keys = seed_keys(jnp.arange(draws, dtype=jnp.uint32))
    counts = np.zeros(vocab)
    for _ in range(calls):
        keys, (key,) = split_keys(keys, 1)
        tokens = np.asarray(sample(key, jnp.broadcast_to(jnp.asarray(probs), (draws, vocab))))
        counts += np.bincount(tokens, minlength=vocab)
    assert counts[probs == 0].sum() == 0
    support = probs > 0
    expected = probs[support] * draws * calls
    statistic = ((counts[support] - expected) ** 2 / expected).sum()
    dof = support.sum() - 1
    assert statistic < dof + 5 * math.sqrt(2 * dof)  # ~3.5 sigma over the chi-square mean
    shifted = probs.copy()
    top = int(np.argmax(probs))
    shifted[top] *= 0.75
    shifted /= shifted.sum()
    wrong = shifted[support] * draws * calls
    assert ((counts[support] - wrong) ** 2 / wrong).sum() > dof + 5 * math.sqrt(2 * dof)


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    """(HF target, decoder) over an 8-token vocabulary with peaked distributions."""
    root = tmp_path_factory.mktemp("vocab8")
    target = hf_model(TINY_K2 | dict(vocab_size=VOCAB, bos_token_id=0, eos_token_id=7), seed=11)
    with torch.no_grad():
        target.lm_head.weight.mul_(5.0)
    target.save_pretrained(root / "target")
    drafter_settings = drafter_config(
        block_size=4,
        vocab_size=VOCAB,
        dflash_config={"mask_token_id": 7, "target_layer_ids": [1, 0]},
    )
    hf_drafter(drafter_settings, seed=11).save_pretrained(root / "drafter")
    decoder = SpeculativeDecoder(
        jaxdd.load_target(root / "target", dtype="float32"),
        jaxdd.load_drafter(root / "drafter", dtype="float32"),
    )
    return target, decoder


def exact_distribution(target, settings: Sampling) -> np.ndarray:
    """P(x1, x2, x3 | PROMPT) [V, V, V] under the filtered target distribution, by enumeration."""

    def step(prefixes: list[list[int]]) -> np.ndarray:
        with torch.no_grad():
            logits = target(torch.tensor([PROMPT + p for p in prefixes])).logits[:, -1]
        return (
            _sampling_probs(logits, settings.temperature, settings.top_p, settings.top_k)
            .double()
            .numpy()
        )

    first = step([[]])[0]
    second = step([[a] for a in range(VOCAB)])  # [V, V]
    third = step([[a, b] for a in range(VOCAB) for b in range(VOCAB)]).reshape(VOCAB, VOCAB, VOCAB)
    return first[:, None, None] * second[:, :, None] * third


def sampled_counts(
    decoder: SpeculativeDecoder, method: str, settings: Sampling, **options
) -> np.ndarray:
    counts = np.zeros((VOCAB,) * NEW, np.int64)
    for call in range(CALLS):
        requests = [
            Sampling(settings.temperature, settings.top_p, settings.top_k, seed=call * ROWS + r)
            for r in range(ROWS)
        ]
        results = decoder.generate_batch(
            [PROMPT] * ROWS,
            sampling=requests,
            method=method,
            max_new_tokens=NEW,
            stop_token_ids=[],
            budget=6,
            **options,
        )
        for result in results:
            counts[tuple(result.tokens)] += 1
    return counts


def chi_square_z(counts: np.ndarray, expected_probs: np.ndarray) -> float:
    """Wilson-Hilferty z-score of Pearson's chi-square (cells expecting < 5 pooled); > 4 rejects."""
    counts, probs = counts.ravel().astype(float), expected_probs.ravel()
    expected = probs * counts.sum()
    small = expected < 5
    observed = np.append(counts[~small], counts[small].sum())
    expected = np.append(expected[~small], expected[small].sum())
    keep = expected > 0
    statistic = float((((observed - expected) ** 2)[keep] / expected[keep]).sum())
    df = int(keep.sum()) - 1
    return ((statistic / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))


def shifted(probs: np.ndarray, mass: float = 0.02) -> np.ndarray:
    """``probs`` with ``mass`` moved from its most
    likely outcome to its least likely nonzero one."""
    out = probs.copy().ravel()
    nonzero = np.flatnonzero(out > 0)
    out[np.argmax(out)] -= mass
    out[nonzero[np.argmin(out[nonzero])]] += mass
    return out.reshape(probs.shape)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("method", "options"),
    [("ar", {}), ("dflash", {}), ("ddtree", {}), ("ddtree", {"tree_logits": "raw"})],
    ids=["ar", "dflash", "ddtree", "ddtree-raw-tree"],
)
def test_sampled_output_follows_the_target(small_vocab, method, options):
    """8192 sampled 3-token continuations per method against the enumerated target
    distribution: the joint (512 outcomes) and each position's marginal pass a
    chi-square test, and the same samples reject a marginal that is wrong by 2% of
    probability mass (so the test could notice such an error). A DDTree built from
    the raw draft logits (not the temperature-scaled ones) is lossless too."""
    target, decoder = small_vocab
    exact = exact_distribution(target, SETTINGS)
    counts = sampled_counts(decoder, method, SETTINGS, **options)
    assert chi_square_z(counts, exact) < 4
    for axis in range(NEW):
        others = tuple(a for a in range(NEW) if a != axis)
        observed, marginal = counts.sum(axis=others), exact.sum(axis=others)
        assert chi_square_z(observed, marginal) < 4, (axis, observed, marginal * counts.sum())
        assert chi_square_z(observed, shifted(marginal)) > 4


@pytest.mark.slow
def test_temperature_to_zero_is_greedy(small_vocab):
    ref_target, decoder = small_vocab
    greedy = hf_greedy(ref_target, PROMPT, 8)
    # the sampling path at a vanishing temperature (0 is the greedy path)
    for method in ("ar", "dflash", "ddtree"):
        settings = Sampling(temperature=1e-4, seed=3)
        out = decoder.generate(
            PROMPT, method=method, sampling=settings, max_new_tokens=8, stop_token_ids=[]
        )
        assert out.tokens == greedy, method


@pytest.mark.slow
def test_batch_rows_equal_their_runs_alone(small_vocab):
    """Greedy and sampled requests of different lengths in one batch: each
    row's output is what it gives alone (the same seed gives the same
    stream wherever the row sits), including a row that stops early."""
    _, decoder = small_vocab
    # Every row ends at 13 tokens, so alone and batched they
    # share one cache size: 3 compiles per method, not 5.
    prompts = [PROMPT, [1, 2, 3, 4, 5, 6, 7, 0, 1, 2], [2, 1, 0, 5, 5, 6, 3], [7, 7, 7, 7, 7]]
    settings = [
        Sampling(),
        Sampling(temperature=1.0, seed=5),
        Sampling(temperature=0.7, top_k=4, seed=6),
        Sampling(),
    ]
    lengths = [8, 3, 6, 8]
    for method in ("ar", "dflash", "ddtree"):
        alone = [
            decoder.generate(p, method=method, sampling=s, max_new_tokens=n, stop_token_ids=[])
            for p, s, n in zip(prompts, settings, lengths, strict=True)
        ]
        batch = decoder.generate_batch(
            prompts, method=method, sampling=settings, max_new_tokens=lengths, stop_token_ids=[]
        )
        assert [r.tokens for r in batch] == [r.tokens for r in alone], method
        assert [len(r.tokens) for r in batch] == lengths
        stop = alone[0].tokens[3]  # a stop token hit by row 0 ends only row 0
        stopped = decoder.generate_batch(
            prompts, method=method, sampling=settings, max_new_tokens=lengths, stop_token_ids=[stop]
        )
        assert stopped[0].tokens == alone[0].tokens[: alone[0].tokens.index(stop) + 1]
