"""Full-model cross-checks against HF transformers DeepseekV3ForCausalLM (fp32, CPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from reference import FLAVOURS, additive_mask, hf_model, random_tree_parents, rel_err, tree_depths_and_mask

import jaxdd

TOL = 1e-5  # fp32 logits, relative to the largest logit
CASES = [(flavour, seed) for flavour in FLAVOURS for seed in (0, 1)]


@pytest.fixture(scope="module", params=CASES, ids=[f"{f}-seed{s}" for f, s in CASES])
def pair(request, tmp_path_factory):
    flavour, seed = request.param
    model = hf_model(FLAVOURS[flavour], seed)
    directory = tmp_path_factory.mktemp(f"{flavour}{seed}")
    model.save_pretrained(directory)
    return model, jaxdd.load_target(directory, dtype="float32"), np.random.default_rng(seed)


def hf_logits(model, ids, **kwargs) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(np.asarray(ids)), **kwargs).logits.float().numpy()


@pytest.mark.parametrize("form", ["naive", "absorbed"])
def test_prefill_logits_match_hf(pair, form):
    model, target, rng = pair
    ids = rng.integers(0, target.config.vocab_size, (2, 13))
    assert rel_err(target.logits(ids, form=form), hf_logits(model, ids)) < TOL


def test_incremental_decode_matches_full_forward(pair):
    """Prefill a prefix, then decode one token at a time through the cache: every step equals HF's row."""
    model, target, rng = pair
    ids = rng.integers(0, target.config.vocab_size, (2, 12))
    expected = hf_logits(model, ids)
    out = target.forward(ids[:, :5], target.new_cache(2, 16))
    rows = [np.asarray(out.logits)]
    cache = out.cache
    for i in range(5, ids.shape[1]):
        out = target.forward(ids[:, i : i + 1], cache)
        cache = out.cache
        rows.append(np.asarray(out.logits))
    assert rel_err(np.concatenate(rows, axis=1), expected) < TOL
    np.testing.assert_array_equal(np.asarray(cache.length), [12, 12])


def test_tree_forward_matches_hf_with_4d_mask(pair):
    """A tree of new tokens sees the whole prefix and its own ancestors, at positions start + depth."""
    model, target, rng = pair
    prefix_len, nodes = 7, 9
    parents = random_tree_parents(rng, nodes)
    depths, tree_visible = tree_depths_and_mask(parents)
    prefix = rng.integers(0, target.config.vocab_size, (1, prefix_len))
    tree = rng.integers(0, target.config.vocab_size, (1, nodes))

    prefill = target.forward(prefix, target.new_cache(1, 32))
    out = target.forward(
        tree, prefill.cache, positions=(prefix_len + depths)[None], visible=tree_visible[None], commit=False
    )

    total = prefix_len + nodes
    visible = np.zeros((1, total, total), bool)
    visible[0, :prefix_len, :prefix_len] = np.tril(np.ones((prefix_len, prefix_len), bool))
    visible[0, prefix_len:, :prefix_len] = True
    visible[0, prefix_len:, prefix_len:] = tree_visible
    positions = np.concatenate([np.arange(prefix_len), prefix_len + depths])[None]
    expected = hf_logits(
        model,
        np.concatenate([prefix, tree], axis=1),
        attention_mask=additive_mask(visible),
        position_ids=torch.from_numpy(positions),
    )
    assert rel_err(out.logits, expected[:, prefix_len:]) < TOL
    np.testing.assert_array_equal(np.asarray(out.cache.length), [prefix_len])  # commit=False


def test_taps_are_hf_hidden_states(pair):
    """taps=(i, j) returns the residual stream after layers i and j: HF hidden_states[i + 1], concatenated.

    (HF replaces its last hidden state by the final-normed one, so the last layer is left out here; DFlash
    taps end three layers before the last.)
    """
    model, target, rng = pair
    ids = rng.integers(0, target.config.vocab_size, (1, 6))
    taps = (target.config.num_hidden_layers - 2, 0)
    out = target.forward(ids, target.new_cache(1, 8), taps=taps)
    with torch.no_grad():
        hidden = model(torch.from_numpy(ids), output_hidden_states=True).hidden_states
    expected = np.concatenate([hidden[i + 1].numpy() for i in taps], axis=-1)
    assert rel_err(out.taps, expected) < TOL


def test_absorbed_and_naive_agree_on_decode(pair):
    _, target, rng = pair
    ids = rng.integers(0, target.config.vocab_size, (2, 9))
    results = {}
    for form in ("naive", "absorbed"):
        prefill = target.forward(ids[:, :8], target.new_cache(2, 12), form=form)
        results[form] = np.asarray(target.forward(ids[:, 8:], prefill.cache, form=form).logits)
    assert rel_err(results["absorbed"], results["naive"]) < TOL


def test_bf16_forward_tracks_fp32(pair):
    """bf16 weights and activations stay close to fp32 (a smoke check of the dtype plumbing, not exactness)."""
    _, target, rng = pair
    ids = rng.integers(0, target.config.vocab_size, (1, 10))
    low = target.astype("bfloat16")
    assert low.model.layers[-1].mlp.router.weight.dtype == np.float32  # the router stays fp32
    assert rel_err(low.logits(ids), target.logits(ids)) < 0.05
