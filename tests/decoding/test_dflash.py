"""Linear DFlash against z-lab ``dflash.model.dflash_generate``
(greedy, fp32, CPU), and lossless decoding."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import jaxdd
from jaxdd.cache.paging import CACHE_ALIGN, cache_slots
from jaxdd.config import DrafterConfig
from jaxdd.crosscheck.torch_reference import Generation, dflash_reference
from jaxdd.decoding.engine import SpeculativeDecoder
from jaxdd.decoding.sampling import argmax
from jaxdd.models.drafter import DFlashDrafter
from jaxdd.runtime.buckets import PROMPT_BUCKETS_PER_OCTAVE, PROMPT_MIN_STEP, bucket
from jaxdd.runtime.compile_time import compile_clock
from jaxdd.testing.oracle import OracleDrafter, patched_reference_drafter
from jaxdd.testing.profiles import examples
from jaxdd.testing.reference import drafter_config, hf_greedy
from jaxdd.testing.rounds import BatchRound

PROMPTS = [[5, 17, 3, 250, 9, 1, 77], [200, 4, 4, 91, 36, 12, 8, 150, 61, 7, 33]]
MAX_NEW = 24


@pytest.mark.slow
@settings(max_examples=examples(60), deadline=None)
@given(
    hnp.arrays(
        np.float32,
        hnp.array_shapes(min_dims=1, max_dims=3, max_side=40),
        elements=st.integers(-3, 3),
    )
)
def test_argmax_is_the_first_maximum(logits):
    """Greedy decoding's argmax picks the lowest index among tied
    maxima, like numpy's (few distinct values force ties)."""
    np.testing.assert_array_equal(
        np.asarray(argmax(jnp.asarray(logits))), np.argmax(logits, axis=-1)
    )


@pytest.mark.slow
@pytest.mark.parametrize("block_size", [4, 8, 16])
@pytest.mark.parametrize("prompt", PROMPTS, ids=["short", "long"])
def test_matches_dflash_generate(models, block_size, prompt):
    ref_target, ref_drafter, decoder = models
    tokens, lengths = dflash_reference(
        ref_drafter, ref_target, prompt, Generation(MAX_NEW, block_size)
    )
    ours = decoder.generate(
        prompt, max_new_tokens=MAX_NEW, stop_token_ids=[], block_size=block_size
    )
    assert ours.tokens == tokens
    assert ours.acceptance_lengths == lengths


@pytest.mark.slow
def test_lossless_dflash_equals_ar_equals_hf_greedy(models):
    ref_target, _, decoder = models
    prompt = PROMPTS[0]
    expected = hf_greedy(ref_target, prompt, MAX_NEW)
    assert (
        decoder.generate(prompt, method="ar", max_new_tokens=MAX_NEW, stop_token_ids=[]).tokens
        == expected
    )
    for block_size in (4, 16):
        dflash = decoder.generate(
            prompt, max_new_tokens=MAX_NEW, stop_token_ids=[], block_size=block_size
        )
        assert dflash.tokens == expected


@pytest.mark.slow
@pytest.mark.parametrize("block_size", [4, 8, 16])
def test_partly_right_drafts_match_reference(models, block_size):
    """Drafts injected from the target's own greedy continuation: long acceptances,
    shortened last blocks and a stop token inside a round all take the reference's path."""
    ref_target, ref_drafter, decoder = models
    prompt = PROMPTS[1]
    greedy = np.array(prompt + hf_greedy(ref_target, prompt, MAX_NEW + block_size))
    right = np.random.default_rng(block_size).random(len(greedy)) < 0.85
    oracle = SpeculativeDecoder(decoder.target, OracleDrafter(decoder.drafter, greedy, right))
    patched = patched_reference_drafter(ref_drafter, greedy, right)

    continuation = greedy[len(prompt) : len(prompt) + MAX_NEW].tolist()
    # stops mid-generation
    latest_new = max(continuation.index(token) for token in set(continuation))
    for stops in ([], [continuation[latest_new]]):
        tokens, lengths = dflash_reference(
            patched, ref_target, prompt, Generation(MAX_NEW, block_size, stops or None)
        )
        ours = oracle.generate(
            prompt, max_new_tokens=MAX_NEW, stop_token_ids=stops, block_size=block_size
        )
        assert (ours.tokens, ours.acceptance_lengths) == (tokens, lengths)
        assert ours.tokens == continuation[: len(ours.tokens)]  # lossless
        if not stops:
            assert max(lengths) > 2  # long acceptances really happened
            assert len(tokens) == MAX_NEW
        else:
            assert len(tokens) == latest_new + 1


def test_stop_tokens_end_generation(models):
    ref_target, ref_drafter, decoder = models
    prompt = PROMPTS[0]
    full = decoder.generate(prompt, max_new_tokens=MAX_NEW, stop_token_ids=[])
    stop = full.tokens[5]
    tokens, lengths = dflash_reference(
        ref_drafter, ref_target, prompt, Generation(MAX_NEW, 8, [stop])
    )
    ours = decoder.generate(prompt, max_new_tokens=MAX_NEW, stop_token_ids=[stop], block_size=8)
    assert (ours.tokens, ours.acceptance_lengths) == (tokens, lengths)
    assert ours.tokens[-1] == stop and stop not in ours.tokens[:-1]


@given(st.integers(1, 1 << 16))
def test_prompt_buckets_are_quarter_octaves_in_steps_of_16(n):
    """A prompt pads to a multiple of 16, by less than 16 up to 128 tokens and
    by less than a quarter of its length beyond: one of 4 sizes per octave."""
    padded = bucket(n, per_octave=PROMPT_BUCKETS_PER_OCTAVE, min_step=PROMPT_MIN_STEP)
    assert n <= padded and padded % 16 == 0
    assert padded < n + 16 if n <= 128 else padded < 1.25 * n
    octave = 1 << (padded - 1).bit_length()
    assert padded % max(16, octave // 8) == 0  # octave/2 + j * octave/8, j = 1..4
    assert bucket(n) == max(16, octave)  # the default stays powers of two


@given(st.integers(1, 1 << 17))
def test_cache_slots_fit_the_tree_kernel(n):
    """The cache holds n slots with under a quarter (plus
    one kernel block) spare, in whole kernel blocks."""
    slots = cache_slots(n)
    assert n <= slots < max(16, 1.25 * n + CACHE_ALIGN)
    # whole blocks of 16, 32 or 64 slots
    assert slots % min(slots, CACHE_ALIGN) == 0 and slots % 16 == 0
    # Kimi at 8k with a 64-node tree: 16384 slots as a power of two
    assert cache_slots(8192 + 65) == 10240


def test_compiles_once_per_bucket(models):
    """Rounds never recompile, nor do prompts of another length inside the same bucket."""
    _, _, decoder = models
    decoder.generate(PROMPTS[0], max_new_tokens=MAX_NEW, stop_token_ids=[], block_size=8)  # warm
    with compile_clock() as compiles:
        result = decoder.generate(
            PROMPTS[1], max_new_tokens=MAX_NEW - 4, stop_token_ids=[], block_size=8
        )
        decoder.generate([9, 9, 9], max_new_tokens=MAX_NEW, stop_token_ids=[], block_size=8)
    assert result.rounds > 5
    assert compiles.count == 0


def test_bad_input(models, tmp_path):
    _, _, decoder = models
    with pytest.raises(jaxdd.InputError, match="id 256"):
        decoder.generate([1, 256])
    with pytest.raises(jaxdd.InputError, match="max_new_tokens: must be >= 1"):
        decoder.generate([1, 2], max_new_tokens=0)
    with pytest.raises(jaxdd.InputError, match="exceeds the model's max_position_embeddings"):
        decoder.generate([1, 2], max_new_tokens=10**7)
    with pytest.raises(jaxdd.InputError, match="block_size: must be >= 2"):
        decoder.generate([1, 2], block_size=1)
    with pytest.raises(jaxdd.InputError, match="method: expected 'ar', 'dflash' or 'ddtree'"):
        decoder.generate([1, 2], method="beam")
    with pytest.raises(jaxdd.InputError, match="method 'dflash' needs a drafter"):
        SpeculativeDecoder(decoder.target).generate([1, 2])
    with pytest.raises(jaxdd.InputError, match="budget: must be >= 1"):
        decoder.generate([1, 2], method="ddtree", budget=0)
    with pytest.raises(jaxdd.InputError, match="max_children: must be >= 1"):
        decoder.generate([1, 2], method="ddtree", max_children=0)
    with pytest.raises(
        jaxdd.InputError, match="attention: expected 'auto', 'absorbed' or 'pallas'"
    ):
        SpeculativeDecoder(decoder.target, attention="flash")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"hidden_size": 32, "head_dim": 8}, "drafter hidden_size 32 != target hidden_size 64"),
        (
            {"dflash_config": {"mask_token_id": 255, "target_layer_ids": [0, 3]}},
            r"target_layer_ids \[3\] outside",
        ),
        (
            {"dflash_config": {"mask_token_id": 300, "target_layer_ids": [0, 1]}},
            "mask_token_id 300 outside",
        ),
    ],
)
def test_drafter_that_does_not_fit(models, overrides, message):
    _, _, decoder = models
    config = DrafterConfig.from_hf(drafter_config(**overrides))

    with pytest.raises(jaxdd.ConfigError, match=message):
        SpeculativeDecoder(decoder.target, DFlashDrafter(config, jnp.float32, rngs=nnx.Rngs(0)))


def whole_buffer_copies(hlo: str, buffers) -> list[str]:
    """Copies and transposes in a compiled module's entry computation of one of
    ``buffers``, in any layout (the same dimensions, in any order, unit dimensions
    dropped; in-place updates are ``dynamic-update-slice`` fusions)."""

    def dims(shape) -> tuple[int, ...]:
        return tuple(sorted(d for d in shape if d != 1))

    shapes = {dims(b.shape) for b in buffers}
    entry = hlo[hlo.index("\nENTRY") :]
    moves = re.findall(r"^\s*%(\S*(?:copy|transpose)\S*) = \w+\[([\d,]*)\]", entry, re.M)
    return [
        name
        for name, shape in moves
        if "dynamic-update-slice" not in name
        and dims(int(d) for d in shape.split(",") if d) in shapes
    ]


@pytest.mark.slow
@pytest.mark.skipif(jax.default_backend() != "cpu", reason="checks XLA:CPU's compiled rounds")
@pytest.mark.parametrize("method", ["ar", "dflash", "ddtree"])
def test_rounds_update_caches_in_place(models, method):
    """A compiled round writes its rows into the donated caches in place: no
    whole-cache copy or transpose. An AR step used to copy every layer's latent
    cache four times (the written cache read through a bitcast), and every round
    transposed the drafter's keys and values for its attention matmuls."""
    _, _, decoder = models
    batch_round = BatchRound.of(
        decoder, [PROMPTS[1]], method=method, max_new_tokens=MAX_NEW, block_size=4
    )
    lowered, state = batch_round.lower(), batch_round.state
    caches = [*state.target_cache.latent, *state.target_cache.rope]
    if method != "ar":
        caches += [*state.draft_cache.keys, *state.draft_cache.values]
    assert whole_buffer_copies(lowered.compile().as_text(), caches) == []
