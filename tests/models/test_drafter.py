"""The DFlash drafter against z-lab ``DFlashDraftModel`` (fp32, CPU, eager)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.experimental.pallas import tpu as pltpu
from transformers import DynamicCache

from jaxdd.cache import DraftCache, Paging
from jaxdd.config import DrafterConfig, default_target_layer_ids
from jaxdd.errors import ConfigError
from jaxdd.runtime import cpu_kernels
from jaxdd.runtime.backend import Backend
from jaxdd.runtime.sharding import make_mesh
from jaxdd.testing.reference import drafter_config, hf_drafter, rel_err
from jaxdd.weights.hf_loader import load_hf_drafter
from pallas_kernels.tree_attention import tree_attention
from pallas_kernels.tree_attention_tpu import tree_attention_tpu

TOL = 1e-5
ON_GPU = jax.default_backend() == "gpu"
# the tree-attention kernel's forms, interpreted (compiled too on a GPU): the drafter's attention
# in them (the verify's ``pallas`` form) against the reference too
KERNELS = {
    "xla": lambda: None,
    "gpu form": lambda: functools.partial(tree_attention, interpret=True),
    "tpu form": lambda: functools.partial(tree_attention_tpu, interpret=pltpu.InterpretParams()),
    "gpu form compiled": lambda: Backend.local().tree_attention(),
    "cpu kernel": lambda: cpu_kernels.tree_attention,
}
FORMS = [
    *list(KERNELS)[:3],
    pytest.param("gpu form compiled", marks=pytest.mark.skipif(not ON_GPU, reason="needs a GPU")),
    pytest.param(
        "cpu kernel",
        marks=pytest.mark.skipif(not cpu_kernels.available(), reason="no C++ compiler here"),
    ),
]


@pytest.fixture(scope="module", params=["rope", "yarn"])
def pair(request, tmp_path_factory):
    reference = hf_drafter(drafter_config(yarn=request.param == "yarn"), seed=2)
    directory = tmp_path_factory.mktemp(request.param)
    reference.save_pretrained(directory)
    return reference, load_hf_drafter(directory, jnp.float32), directory


def reference_step(reference, cache, features, embeds, start):
    """One reference drafter forward: new context features,
    then the block at positions start..start+B-1."""
    ctx = features.shape[1]
    positions = torch.arange(start - ctx, start + embeds.shape[1])[None]
    with torch.no_grad():
        hidden = reference(
            position_ids=positions,
            noise_embedding=torch.from_numpy(embeds),
            target_hidden=torch.from_numpy(features),
            past_key_values=cache,
            use_cache=True,
        ).numpy()
    cache.crop(-embeds.shape[1])  # the reference keeps the context K/V only
    return hidden


def context_cache(config: DrafterConfig, paged: bool) -> DraftCache:
    """64 slots of one row: its own buffer, or 4 pages of 16 out of order in a pool of 9."""
    if not paged:
        return DraftCache.zeros(config, 1, 64, jnp.float32)
    pool = DraftCache.pooled(config, 1, Paging(4, 9, page=16), jnp.float32)
    return pool.replace(pages=jnp.asarray([[7, 2, 5, 3]], jnp.int32))


@pytest.mark.slow
@pytest.mark.parametrize("paged", [False, True], ids=["rows", "pages"])
@pytest.mark.parametrize("form", FORMS)
def test_rounds_of_context_injection(pair, form, paged):
    """Prompt context, then two rounds of newly committed context: same
    hidden states as the reference, in every attention form, over a row's buffer or pages.
    The cache carried from round to round is the one drafting returned, whose uncommitted
    block rows must not leak."""
    reference, drafter, _ = pair
    rng = np.random.default_rng(0)
    block, width = 8, 2 * 64
    cache_ref = DynamicCache(config=reference.config)
    cache = context_cache(drafter.config, paged)
    start = 0
    for ctx in (7, 3, 5):
        features = rng.standard_normal((1, ctx, width)).astype(np.float32)
        embeds = rng.standard_normal((1, block, 64)).astype(np.float32)
        start += ctx
        expected = reference_step(reference, cache_ref, features, embeds, start)
        positions = jnp.arange(start - ctx, start)[None]
        cache = drafter.inject(cache, jnp.asarray(features), positions, jnp.array([ctx]))
        positions = (start + jnp.arange(block))[None]
        hidden, cache = drafter(
            jnp.asarray(embeds), positions, cache, jnp.array([block]), KERNELS[form]()
        )
        assert rel_err(hidden, expected) < TOL
    assert int(cache.length[0]) == start


@pytest.mark.slow
@pytest.mark.parametrize("form", FORMS)
def test_short_block_hides_the_rest(pair, form):
    """Near max length the reference drafts a shorter
    block; masking the tail of a full block is the same."""
    reference, drafter, _ = pair
    rng = np.random.default_rng(1)
    features = rng.standard_normal((1, 6, 128)).astype(np.float32)
    embeds = rng.standard_normal((1, 8, 64)).astype(np.float32)
    expected = reference_step(
        reference, DynamicCache(config=reference.config), features, embeds[:, :3], 6
    )
    cache = drafter.inject(
        DraftCache.zeros(drafter.config, 1, 32, jnp.float32),
        jnp.asarray(features),
        jnp.arange(6)[None],
        jnp.array([6]),
    )
    positions = (6 + jnp.arange(8))[None]
    hidden, _ = drafter(jnp.asarray(embeds), positions, cache, jnp.array([3]), KERNELS[form]())
    assert rel_err(hidden[:, :3], expected) < TOL


@pytest.mark.slow
@pytest.mark.parametrize("devices", [1, 2, 8])
def test_the_kernel_attends_as_xla_over_rows_of_pages(pair, devices):
    """Two rows of other context lengths and block lengths over shuffled pages: the drafter's
    attention in the kernel gives XLA's hidden states on one device, per device on its KV heads
    (2 devices: one of the 2 each) and whole on every device (8: the 2 heads do not split)."""
    _, _, directory = pair
    mesh = make_mesh(devices)
    drafter = load_hf_drafter(directory, jnp.float32, None if devices == 1 else (mesh, "tp"))
    rng = np.random.default_rng(devices)
    cache = DraftCache.pooled(drafter.config, 2, Paging(4, 9, page=16), jnp.float32)
    cache = cache.replace(pages=jnp.asarray([[7, 2, 5, 3], [1, 4, 6, 8]], jnp.int32))
    features = jnp.asarray(rng.standard_normal((2, 20, 128)), jnp.float32)
    cache = drafter.inject(cache, features, jnp.arange(20)[None].repeat(2, 0), jnp.array([20, 13]))
    embeds = jnp.asarray(rng.standard_normal((2, 8, 64)), jnp.float32)
    positions = cache.length[:, None] + jnp.arange(8)[None]
    block_len = jnp.array([8, 3])
    kernel = functools.partial(tree_attention, interpret=True)
    expected, _ = drafter(embeds, positions, cache, block_len)
    assert rel_err(drafter(embeds, positions, cache, block_len, kernel)[0], expected) < TOL


def test_config_fields():
    cfg = DrafterConfig.from_hf(drafter_config(block_size=16))
    assert (cfg.block_size, cfg.mask_token_id, cfg.target_layer_ids) == (16, 255, (1, 0))
    derived = drafter_config(
        dflash_config={"mask_token_id": 5}, num_target_layers=61, num_hidden_layers=6
    )
    # Kimi K2.x taps
    assert DrafterConfig.from_hf(derived).target_layer_ids == (1, 12, 24, 35, 47, 58)
    assert default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)  # Qwen3-8B taps
    yarn = DrafterConfig.from_hf(drafter_config(yarn=True)).yarn
    assert (yarn.factor, yarn.beta_fast, yarn.mscale, yarn.mscale_all_dim) == (64.0, 32.0, 1.0, 1.0)
    with pytest.raises(ConfigError, match="dflash_config.mask_token_id: missing"):
        DrafterConfig.from_hf(drafter_config(dflash_config={"target_layer_ids": [0]}))
    with pytest.raises(ConfigError, match="layer_types: only non-causal full-attention"):
        DrafterConfig.from_hf(drafter_config(layer_types=["sliding_attention", "full_attention"]))
    with pytest.raises(ConfigError, match="block_size: must be >= 2"):
        DrafterConfig.from_hf(drafter_config(block_size=1))


@pytest.mark.slow
@pytest.mark.parametrize("form", FORMS[1:])
def test_context_k_v_in_fp8_reads_alike_in_every_form(pair, form):
    """The context K/V stored in 8-bit floats (the block's own rounded alike): the kernel's
    forms give the XLA form's hidden states, and those stay near the reference's (fp32 K/V)
    but not at it (the K/V were rounded)."""
    reference, drafter, _ = pair
    rng = np.random.default_rng(3)
    features = rng.standard_normal((1, 20, 128)).astype(np.float32)
    embeds = rng.standard_normal((1, 8, 64)).astype(np.float32)
    expected = reference_step(
        reference, DynamicCache(config=reference.config), features, embeds, 20
    )
    cache = DraftCache.pooled(drafter.config, 1, Paging(4, 9, page=16), jnp.float8_e4m3fn)
    cache = cache.replace(pages=jnp.asarray([[7, 2, 5, 3]], jnp.int32))
    cache = drafter.inject(cache, jnp.asarray(features), jnp.arange(20)[None], jnp.array([20]))
    assert cache.keys[0].dtype == jnp.float8_e4m3fn
    args = (jnp.asarray(embeds), (20 + jnp.arange(8))[None], cache, jnp.array([8]))
    xla, _ = drafter(*args)
    assert rel_err(drafter(*args, KERNELS[form]())[0], xla) < TOL
    assert TOL < rel_err(xla, expected) < 0.01  # rounded, not far
