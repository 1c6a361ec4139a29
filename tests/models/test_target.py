"""Full-model cross-checks against HF transformers DeepseekV3ForCausalLM (fp32, CPU).

All tests share batch 2 and a 16-slot cache so each flavour compiles a handful of executables only.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import jaxdd
from jaxdd.testing.reference import (
    FLAVOURS,
    additive_mask,
    hf_model,
    random_tree_parents,
    rel_err,
    tree_depths_and_mask,
)

TOL = 1e-5  # fp32 logits, relative to the largest logit
BATCH, SLOTS = 2, 16
CASES = [(flavour, seed) for flavour in FLAVOURS for seed in (0, 1)]


@pytest.fixture(scope="module", params=CASES, ids=[f"{f}-seed{s}" for f, s in CASES])
def pair(request, tmp_path_factory):
    flavour, seed = request.param
    model = hf_model(FLAVOURS[flavour], seed)
    directory = tmp_path_factory.mktemp(f"{flavour}{seed}")
    model.save_pretrained(directory)
    return model, jaxdd.load_target(directory, dtype="float32"), seed


def hf_forward(model, ids, **kwargs):
    with torch.no_grad():
        return model(torch.from_numpy(np.asarray(ids)), output_hidden_states=True, **kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("form", ["naive", "absorbed"])
def test_prefill_logits_and_taps_match_hf(pair, form):
    """Logits, and taps = the residual stream after the
    tapped layers (HF hidden_states[i + 1]) in tap order.

    HF replaces its last hidden state by the final-normed one, so the last
    layer is not tapped here (DFlash taps end three layers before the last).
    """
    model, target, seed = pair
    rng = np.random.default_rng([seed, 1])  # this test's own draw, whatever ran before
    ids = rng.integers(0, target.config.vocab_size, (BATCH, 12))
    taps = (target.config.num_hidden_layers - 2, 0)
    out = target.forward(ids, target.new_cache(BATCH, SLOTS), taps=taps, attention=form)
    expected = hf_forward(model, ids)
    assert rel_err(out.logits, expected.logits.numpy()) < TOL
    assert (
        rel_err(out.taps, np.concatenate([expected.hidden_states[i + 1].numpy() for i in taps], -1))
        < TOL
    )


@pytest.mark.slow
@pytest.mark.parametrize("decode_form", ["absorbed", "naive"])
def test_incremental_decode_matches_full_forward(pair, decode_form):
    """Prefill a prefix, then decode one token at a time
    through the cache: every step equals HF's row."""
    model, target, seed = pair
    rng = np.random.default_rng([seed, 2])  # this test's own draw, whatever ran before
    ids = rng.integers(0, target.config.vocab_size, (BATCH, 12))
    out = target.forward(ids[:, :5], target.new_cache(BATCH, SLOTS))
    rows, cache = [np.asarray(out.logits)], out.cache
    for i in range(5, ids.shape[1]):
        out = target.forward(ids[:, i : i + 1], cache, attention=decode_form)
        rows.append(np.asarray(out.logits))
        cache = out.cache
    assert rel_err(np.concatenate(rows, axis=1), hf_forward(model, ids).logits.numpy()) < TOL
    np.testing.assert_array_equal(np.asarray(cache.length), [12, 12])


def test_tree_forward_matches_hf_with_4d_mask(pair):
    """Each row's tree sees the whole prefix and its own ancestors, at positions start + depth."""
    model, target, seed = pair
    rng = np.random.default_rng([seed, 3])  # this test's own draw, whatever ran before
    prefix_len, nodes = 5, 9
    prefix = rng.integers(0, target.config.vocab_size, (BATCH, prefix_len))
    tree = rng.integers(0, target.config.vocab_size, (BATCH, nodes))
    depths, tree_visible = zip(
        *(tree_depths_and_mask(random_tree_parents(rng, nodes)) for _ in range(BATCH)), strict=True
    )
    depths, tree_visible = np.stack(depths), np.stack(tree_visible)

    prefill = target.forward(prefix, target.new_cache(BATCH, SLOTS))
    out = target.forward(
        tree, prefill.cache, positions=prefix_len + depths, visible=tree_visible, commit=False
    )
    np.testing.assert_array_equal(np.asarray(out.cache.length), [prefix_len] * BATCH)

    total = prefix_len + nodes
    visible = np.zeros((BATCH, total, total), bool)
    visible[:, :prefix_len, :prefix_len] = np.tril(np.ones((prefix_len, prefix_len), bool))
    visible[:, prefix_len:, :prefix_len] = True
    visible[:, prefix_len:, prefix_len:] = tree_visible
    positions = np.concatenate(
        [np.broadcast_to(np.arange(prefix_len), (BATCH, prefix_len)), prefix_len + depths], 1
    )
    expected = hf_forward(
        model,
        np.concatenate([prefix, tree], axis=1),
        attention_mask=additive_mask(visible),
        position_ids=torch.from_numpy(positions),
    ).logits.numpy()
    assert rel_err(out.logits, expected[:, prefix_len:]) < TOL


BF16_EPS = 2.0**-8  # bf16's unit roundoff (8 significand bits)


@pytest.mark.slow
def test_bf16_forward_tracks_fp32(pair):
    """bf16 weights and activations stay close to fp32 (a check of the dtype plumbing, not
    of exactness), per position, within bounds from bf16's roundoff and the depth: the
    median position within eps x (layers + 1) (measured at most 2.2 eps over 40 draws on
    every flavour), and 80% of them within 4x that. Not every position: a rounding can flip
    a routing choice (a discrete top-k), which moves that position's logits further."""
    _, target, seed = pair
    # its own draw
    ids = np.random.default_rng([seed, 4]).integers(0, target.config.vocab_size, (BATCH, 12))
    low = target.astype("bfloat16")
    assert low.model.layers[-1].mlp.router.weight.dtype == np.float32  # the router stays fp32
    assert low.model.embed.dtype == np.dtype("bfloat16")
    cache = target.new_cache(BATCH, SLOTS)
    ours = np.asarray(low.forward(ids, low.new_cache(BATCH, SLOTS)).logits, np.float64)
    exact = np.asarray(target.forward(ids, cache).logits, np.float64)
    per_position = np.abs(ours - exact).max(-1) / np.abs(exact).max(-1)
    bound = BF16_EPS * (target.config.num_hidden_layers + 1)
    assert np.median(per_position) <= bound
    assert (per_position <= 4 * bound).mean() >= 0.8
