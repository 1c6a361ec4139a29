"""Per-module cross-checks against the HF transformers DeepseekV3 modules (fp32, CPU, eager)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

import jaxdd
from jaxdd.cache import CacheView
from jaxdd.models.expert_dispatch import (
    gathered_experts,
    gathered_local_pairs,
    pair_experts,
    skipping_experts,
    tiled_experts,
)
from jaxdd.models.layers import apply_rope, rms_norm, rope_cos_sin
from jaxdd.models.moe import _bf16_head
from jaxdd.models.quant import DenseExperts
from jaxdd.models.target import target_rope
from jaxdd.runtime.backend import Backend
from jaxdd.testing.profiles import examples
from jaxdd.testing.reference import FLAVOURS, additive_mask, hf_model, rel_err

TOL = 1e-5


@pytest.fixture(scope="module", params=list(FLAVOURS))
def pair(request, tmp_path_factory):
    model = hf_model(FLAVOURS[request.param], seed=3)
    directory = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(directory)
    return model, jaxdd.load_target(directory, dtype="float32").model


def hidden(rng, *shape) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def torch_of(x) -> torch.Tensor:
    return torch.from_numpy(np.array(x))


@pytest.mark.parametrize("eps", [1e-6, 1e-5])
def test_rms_norm(eps):
    rng = np.random.default_rng(0)
    x, w = hidden(rng, 3, 5, 64), hidden(rng, 64)
    ref = hf.DeepseekV3RMSNorm(64, eps=eps)
    ref.weight.data = torch_of(w)
    with torch.no_grad():
        expected = ref(torch_of(x)).numpy()
    assert rel_err(rms_norm(jnp.asarray(x), jnp.asarray(w), eps), expected) < 1e-6
    # bf16 follows HF's cast order: normalise in fp32, cast, then multiply by the weight in bf16.
    with torch.no_grad():
        expected16 = ref.to(torch.bfloat16)(torch_of(x).to(torch.bfloat16)).float().numpy()
    actual16 = rms_norm(jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16), eps).astype(
        jnp.float32
    )
    assert rel_err(actual16, expected16) < 1e-2


def test_rope_cos_sin(pair):
    model, target = pair
    positions = np.array([[0, 1, 7, 100, 4095, 4096, 20000, 120000]])
    with torch.no_grad():
        cos, sin = model.model.rotary_emb(torch.zeros(1, dtype=torch.float32), torch_of(positions))
    inv_freq, amplitude = target_rope(target.config)
    our_cos, our_sin = rope_cos_sin(jnp.asarray(positions), inv_freq, amplitude, jnp.float32)
    half = cos.shape[-1] // 2  # HF repeats the frequencies: cat(freqs, freqs)
    np.testing.assert_allclose(our_cos, cos[..., :half].numpy(), atol=1e-5)
    np.testing.assert_allclose(our_sin, sin[..., :half].numpy(), atol=1e-5)
    np.testing.assert_array_equal(np.asarray(inv_freq), model.model.rotary_emb.inv_freq.numpy())


@pytest.mark.parametrize("interleaved", [True, False])
def test_apply_rope(interleaved):
    rng = np.random.default_rng(1)
    q, k = hidden(rng, 2, 4, 6, 8), hidden(rng, 2, 1, 6, 8)  # [B, heads, T, d]
    angles = rng.uniform(-3, 3, (2, 6, 4)).astype(np.float32)
    cos_full, sin_full = (torch_of(np.concatenate([f(angles)] * 2, -1)) for f in (np.cos, np.sin))
    rotate = hf.apply_rotary_pos_emb_interleave if interleaved else hf.apply_rotary_pos_emb
    q_ref, k_ref = rotate(torch_of(q), torch_of(k), cos_full, sin_full)
    cos, sin = jnp.cos(angles)[:, None], jnp.sin(angles)[:, None]
    np.testing.assert_allclose(
        apply_rope(jnp.asarray(q), cos, sin, interleaved), q_ref.numpy(), atol=1e-6
    )
    np.testing.assert_allclose(
        apply_rope(jnp.asarray(k), cos, sin, interleaved), k_ref.numpy(), atol=1e-6
    )


@pytest.mark.slow
@pytest.mark.parametrize("form", ["naive", "absorbed", "pallas"])
def test_attention(pair, form):
    model, target = pair
    rng = np.random.default_rng(2)
    b, t = 2, 7
    x = hidden(rng, b, t, target.config.hidden_size)
    positions = np.broadcast_to(np.arange(3, 3 + t), (b, t))
    causal = np.broadcast_to(np.tril(np.ones((t, t), bool)), (b, t, t))
    layer = model.model.layers[1].self_attn
    with torch.no_grad():
        rope = model.model.rotary_emb(torch_of(x), torch_of(positions))
        expected = layer(torch_of(x), rope, attention_mask=additive_mask(causal))[0].numpy()

    inv_freq, amplitude = target_rope(target.config)
    cos_sin = rope_cos_sin(jnp.asarray(positions), inv_freq, amplitude, jnp.float32)
    c = target.config
    view, causal = causal_args(b, t)
    out, (latent, k_pe) = target.layers[1].attn(
        jnp.asarray(x), cos_sin, empty_rows(c, b, t), view, causal, form, Backend.local()
    )
    assert rel_err(out, expected) < TOL
    assert latent.shape == (b, t, c.kv_lora_rank) and k_pe.shape == (b, t, c.qk_rope_head_dim)


def empty_rows(config, b: int, t: int) -> tuple[jnp.ndarray, jnp.ndarray]:
    """An empty cache of exactly t slots for one layer."""
    return jnp.zeros((b, t, config.kv_lora_rank)), jnp.zeros((b, t, config.qk_rope_head_dim))


def causal_args(b: int, t: int) -> tuple[CacheView, jnp.ndarray]:
    """(view, visible) for t new tokens into an empty t-slot cache."""
    return CacheView(jnp.zeros((b,), jnp.int32)), jnp.asarray(
        np.broadcast_to(np.tril(np.ones((t, t), bool)), (b, t, t))
    )


def moe_layer(target) -> int:
    return target.config.num_hidden_layers - 1


def test_router(pair):
    model, target = pair
    x = hidden(np.random.default_rng(4), 33, target.config.hidden_size)
    i = moe_layer(target)
    with torch.no_grad():
        _, ref_weights, ref_experts = model.model.layers[i].mlp.gate(torch_of(x))
    weights, experts = target.layers[i].mlp.router(jnp.asarray(x))
    # Order within a token's top-k is arbitrary
    # (torch.topk(sorted=False)): compare sorted by expert id.
    ref_order, order = np.argsort(ref_experts.numpy(), -1), np.argsort(np.asarray(experts), -1)
    sorted_ref = np.take_along_axis(ref_experts.numpy(), ref_order, -1)
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(experts), order, -1), sorted_ref)
    np.testing.assert_allclose(
        np.take_along_axis(np.asarray(weights), order, -1),
        np.take_along_axis(ref_weights.numpy(), ref_order, -1),
        rtol=1e-6,
    )


def test_bf16_parts_sum_to_x():
    """The router's three bf16 parts of fp32 x sum to x
    exactly, from 2**-103 to fp32's largest, both signs."""
    rng = np.random.default_rng(7)
    signs = rng.choice([-1.0, 1.0], 100000)
    x = (signs * rng.uniform(1, 2, 100000) * 2.0 ** rng.integers(-103, 128, 100000)).astype(
        np.float32
    )
    x = np.concatenate(
        [x, np.float32([np.finfo(np.float32).max, -np.finfo(np.float32).max, 2.0**-103])]
    )
    high = _bf16_head(jnp.asarray(x))
    middle = _bf16_head(jnp.asarray(x) - high)
    low = jnp.asarray(x) - high - middle
    parts = [np.asarray(p.astype(jnp.bfloat16), np.float64) for p in (high, middle, low)]
    np.testing.assert_array_equal(parts[0] + parts[1] + parts[2], x.astype(np.float64))


@pytest.mark.parametrize("platform", ["cpu", "gpu"])
def test_bf16_router_matches_hf(pair, platform):
    """A router gate stored in bf16 (as K2.x checkpoints store it; HF upcasts it to fp32) picks HF's
    experts with HF's weights, multiplied as fp32 (cpu) or as stored with x in three bf16 parts (the
    GPU / TPU path, run here on XLA:CPU; that XLA:GPU keeps the parts: test_compiled_traffic.py)."""
    model, target = pair
    i = moe_layer(target)
    gate, router = model.model.layers[i].mlp.gate, target.layers[i].mlp.router
    stored = gate.weight.data.clone()
    gate.weight.data = stored.to(torch.bfloat16).float()
    fp32 = router.weight.value
    router.weight.value = jnp.asarray(gate.weight.data.numpy().T).astype(jnp.bfloat16)
    x = hidden(np.random.default_rng([5, len(platform)]), 33, target.config.hidden_size)
    try:
        with torch.no_grad():
            _, ref_weights, ref_experts = gate(torch_of(x))
        weights, experts = router(jnp.asarray(x), Backend(platform))
    finally:
        gate.weight.data, router.weight.value = stored, fp32
    ref_order, order = np.argsort(ref_experts.numpy(), -1), np.argsort(np.asarray(experts), -1)
    np.testing.assert_array_equal(
        np.take_along_axis(np.asarray(experts), order, -1),
        np.take_along_axis(ref_experts.numpy(), ref_order, -1),
    )
    np.testing.assert_allclose(
        np.take_along_axis(np.asarray(weights), order, -1),
        np.take_along_axis(ref_weights.numpy(), ref_order, -1),
        rtol=1e-6,
    )


def test_router_bias_selects_but_does_not_weight(pair):
    """A large bias on one expert forces it into every
    top-k, yet its weight is its unbiased sigmoid score."""
    _, target = pair
    router = target.layers[moe_layer(target)].mlp.router
    x = jnp.asarray(hidden(np.random.default_rng(5), 9, target.config.hidden_size))
    bias = router.bias[...]
    router.bias[...] = bias.at[3].set(100.0)
    try:
        weights, experts = router(x)
    finally:
        router.bias[...] = bias
    assert (np.asarray(experts) == 3).any(-1).all()
    scores = 1 / (1 + np.exp(-(np.asarray(x) @ np.asarray(router.weight[...]))))
    raw = np.take_along_axis(scores, np.asarray(experts), -1)
    c = target.config
    np.testing.assert_allclose(
        weights, raw / raw.sum(-1, keepdims=True) * c.routed_scaling_factor, rtol=1e-5
    )


@pytest.mark.slow
@pytest.mark.parametrize("dispatch", ["auto", "dense", "gathered", "grouped", "skipping", "tiled"])
def test_moe(pair, dispatch):
    model, target = pair
    # 26 tokens: auto tiles on CPU
    x = hidden(np.random.default_rng(6), 2, 13, target.config.hidden_size)
    i = moe_layer(target)
    with torch.no_grad():
        expected = model.model.layers[i].mlp(torch_of(x)).numpy()
    moe = target.layers[i].mlp
    moe.dispatch = dispatch
    try:
        assert rel_err(moe(jnp.asarray(x), Backend.local()), expected) < TOL
    finally:
        moe.dispatch = "auto"


ROUTINGS = given(
    tokens=st.integers(1, 80),
    top_k=st.integers(1, 3),
    n_experts=st.integers(1, 9),
    favourite=st.floats(0, 1),
    seed=st.integers(0, 2**16),
)


# each example's shapes compile anew (the tiled layout's take longest)
@pytest.mark.slow
@settings(max_examples=examples(6), deadline=None)
@ROUTINGS
def test_tiled_dispatch_any_routing(tokens, top_k, n_experts, favourite, seed):
    """The tiled layout is exact whatever the routing: unused experts, one
    expert taking nearly every pair (its tiles run past the even share), an
    expert chosen twice by one token, group sizes on and off tile edges."""
    check_dispatch(tiled_experts, tokens, top_k, n_experts, favourite, seed)


@pytest.mark.slow
@settings(max_examples=examples(10), deadline=None)  # each example's shapes compile anew
@ROUTINGS
def test_skipping_dispatch_any_routing(tokens, top_k, n_experts, favourite, seed):
    """Skipping the unchosen experts is exact whatever the routing: every
    expert chosen, a few, only one, an expert chosen twice by one token."""
    check_dispatch(skipping_experts, tokens, top_k, n_experts, favourite, seed)


@pytest.mark.slow
@settings(max_examples=examples(10), deadline=None)  # each example's shapes compile anew
@ROUTINGS
def test_gathered_dispatch_any_routing(tokens, top_k, n_experts, favourite, seed):
    """Gathering each pair's expert is exact whatever the routing,
    an expert chosen by many tokens or twice by one included."""
    check_dispatch(gathered, tokens, top_k, n_experts, favourite, seed)


@pytest.mark.slow
@settings(max_examples=examples(10), deadline=None)  # each example's shapes compile anew
@given(
    tokens=st.integers(1, 12),
    share=st.floats(0, 1),
    capacity=st.integers(1, 8),
    seed=st.integers(0, 2**16),
)
def test_gathered_local_pairs_under_ep(tokens, share, capacity, seed):
    """Under EP a device gathers only the pairs routed to its own experts, compacted
    into ``capacity`` slots: the outputs of gathering every pair with weight 0 for
    the others, whether its pairs fit or overflow (then every pair is gathered)."""
    rng = np.random.default_rng(seed)
    d, f, n_experts, top_k = 16, 8, 6, 2
    shapes = [(n_experts, d, f), (n_experts, d, f), (n_experts, f, d)]
    projections = [
        DenseExperts(nnx.Rngs(i), shape, jnp.float32, (None,) * 3) for i, shape in enumerate(shapes)
    ]
    pieces = [p.stored() for p in projections]
    mine = rng.random((tokens, top_k)) < share  # the pairs routed to this device
    experts = jnp.asarray(np.where(mine, rng.integers(0, n_experts, (tokens, top_k)), 0))
    weights = jnp.asarray(np.where(mine, rng.random((tokens, top_k)), 0), jnp.float32)
    x = jnp.asarray(hidden(rng, tokens, d))
    through = pair_experts(projections, pieces, Backend.local())
    expected = gathered_experts(x, weights, experts, through)
    actual = gathered_local_pairs(x, weights, experts, jnp.asarray(mine), capacity, through)
    np.testing.assert_allclose(actual, expected, rtol=1e-6, atol=1e-6)


def gathered(x, weights, experts, projections, pieces):
    return gathered_experts(x, weights, experts, pair_experts(projections, pieces, Backend.local()))


def check_dispatch(dispatch, tokens, top_k, n_experts, favourite, seed):
    """``dispatch`` against a numpy MoE for random routing
    (``favourite``: the share of pairs sent to expert 0)."""
    rng = np.random.default_rng(seed)
    d, f = 16, 8
    experts = rng.integers(0, n_experts, (tokens, top_k))
    experts[rng.random((tokens, top_k)) < favourite] = 0
    weights = rng.random((tokens, top_k)).astype(np.float32)
    x = hidden(rng, tokens, d)
    projections = [
        DenseExperts(nnx.Rngs(i), shape, jnp.float32, (None,) * 3)
        for i, shape in enumerate([(n_experts, d, f), (n_experts, d, f), (n_experts, f, d)])
    ]
    gate, up, down = (np.asarray(p.weight[...]) for p in projections)
    pieces = [p.stored() for p in projections]
    out = dispatch(jnp.asarray(x), jnp.asarray(weights), jnp.asarray(experts), projections, pieces)
    expected = np.zeros((tokens, d), np.float32)
    for slot in range(top_k):
        e = experts[:, slot]
        gated = np.einsum("nd,ndf->nf", x, gate[e])
        # silu(x gate) * x up
        hidden_ = gated / (1 + np.exp(-gated)) * np.einsum("nd,ndf->nf", x, up[e])
        expected += weights[:, slot, None] * np.einsum("nf,nfd->nd", hidden_, down[e])
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("which", ["dense", "moe"])
def test_decoder_layer(pair, which):
    model, target = pair
    i = 0 if which == "dense" else moe_layer(target)
    assert target.config.is_moe_layer(i) == (which == "moe")
    rng = np.random.default_rng(7)
    b, t = 2, 6
    x = hidden(rng, b, t, target.config.hidden_size)
    positions = np.broadcast_to(np.arange(t), (b, t))
    causal = np.broadcast_to(np.tril(np.ones((t, t), bool)), (b, t, t))
    with torch.no_grad():
        rope = model.model.rotary_emb(torch_of(x), torch_of(positions))
        expected = model.model.layers[i](
            torch_of(x), attention_mask=additive_mask(causal), position_embeddings=rope
        )
    inv_freq, amplitude = target_rope(target.config)
    cos_sin = rope_cos_sin(jnp.asarray(positions), inv_freq, amplitude, jnp.float32)
    c = target.config
    view, causal = causal_args(b, t)
    rows = empty_rows(c, b, t)
    out, _ = target.layers[i](
        jnp.asarray(x), cos_sin, rows, view, causal, "absorbed", Backend.local()
    )
    assert rel_err(out, expected.numpy()) < TOL
