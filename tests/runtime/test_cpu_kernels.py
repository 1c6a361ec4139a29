"""The XLA:CPU kernels (jaxdd/runtime/cpu_kernels.cc). The gathered INT4 matvec's
dequantization equals ``dequantize_int4_groups`` (itself checked against compressed-tensors in
test_quant.py) bit for bit, in the form this host compiles and in the portable form; its
products equal XLA's gathered form; the dense matvec and the row dot equal XLA's products, and
decode attention through them equals XLA's; the model picks each only where it applies."""

from __future__ import annotations

import ctypes
import functools
import logging
import platform

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from hypothesis import example, given, settings
from hypothesis import strategies as st
from transformers import DeepseekV3Config

from jaxdd.cache import LatentCache, Paging
from jaxdd.config import KimiConfig
from jaxdd.models.expert_dispatch import gathered_experts, int4_kernel, pair_experts
from jaxdd.models.layers import linear
from jaxdd.models.quant import Int4Experts, dequantize_int4_groups
from jaxdd.models.target import KimiTarget
from jaxdd.runtime import cpu_kernels
from jaxdd.runtime.backend import Backend
from jaxdd.testing.profiles import examples
from jaxdd.testing.reference import TINY_K2, tree_depths_and_mask
from pallas_kernels import int4_experts

pytestmark = pytest.mark.skipif(
    not cpu_kernels.available(), reason="no C++ compiler builds the kernels here"
)


def every_bf16_scale() -> np.ndarray:
    """Every finite bf16 (subnormals, zero, both signs, both sides of the
    kernel's 2^100 split limit) whose products with q in [-8, 7] stay finite."""
    values = (np.arange(2**16, dtype=np.uint32) << 16).view(np.float32)
    values = values[np.isfinite(values)]
    return values[np.abs(values) < np.finfo(np.float32).max / 8]


def packed_with_every_q(rng, rows: int, in_features: int) -> np.ndarray:
    """[rows, in/8] int32 words in which every 32-value
    run holds each stored nibble 0..15 twice, shuffled."""
    runs = np.tile(np.arange(16), (rows * in_features // 32, 2))
    nibbles = rng.permuted(runs, axis=1).reshape(rows, in_features // 8, 8).astype(np.uint32)
    return (nibbles << (4 * np.arange(8, dtype=np.uint32))).sum(-1).astype(np.uint32).view(np.int32)


@functools.cache
def portable_target() -> str:
    """The INT4 matvec built without AVX-512 (the form AVX2 and ARM hosts run),
    registered under its own name; off x86 the native build is that form."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return cpu_kernels.INT4_TARGET
    library = ctypes.CDLL(str(cpu_kernels.build(cpu_kernels.compiler(), ("-mno-avx512f",))))
    name = "jaxdd_test_portable_int4_matvec"
    jax.ffi.register_ffi_target(
        name, jax.ffi.pycapsule(getattr(library, cpu_kernels.INT4_TARGET)), platform="cpu"
    )
    return name


@pytest.mark.slow
@pytest.mark.parametrize("form", ["native", "portable"])
@pytest.mark.parametrize(("group", "in_features"), [(32, 96), (64, 128), (128, 384)])
def test_kernel_dequantizes_every_scale_exactly(group, in_features, form):
    """One-hot rows read the dequantized weights back exactly: every finite bf16
    scale, every q with each, groups of 32 (two per 8-word block), 64 and 128 (whole
    blocks), and inputs ending in a partial block (96, 384); in the form this host
    compiles (AVX-512: table lookups) and the portable one (arithmetic)."""
    target = cpu_kernels.INT4_TARGET if form == "native" else portable_target()
    rng = np.random.default_rng(0)
    scales = rng.permutation(every_bf16_scale())
    groups = in_features // group
    experts, rows = 2, -(-scales.size // (2 * groups))
    scale = (
        np.resize(scales, experts * rows * groups)
        .reshape(experts, rows, groups)
        .astype(ml_dtypes.bfloat16)
    )
    packed = packed_with_every_q(rng, experts * rows, in_features).reshape(experts, rows, -1)
    # Pair (e, i): expert e, the one-hot row of input i, so out[pair] is expert e's weight column i.
    chosen = np.repeat(np.arange(experts, dtype=np.int32), in_features)
    one_hot = np.tile(np.eye(in_features, dtype=np.float32), (experts, 1))
    out = jax.jit(cpu_kernels.gathered_int4_matvec, static_argnames="target")(
        one_hot, packed, scale, chosen, target
    )
    dense = dequantize_int4_groups(
        jnp.asarray(packed), jnp.asarray(scale), in_features, jnp.bfloat16, group
    )
    expected = np.asarray(dense, np.float32).transpose(0, 2, 1).reshape(experts * in_features, rows)
    np.testing.assert_array_equal(np.asarray(out), expected)


@pytest.mark.slow
@settings(max_examples=examples(8), deadline=None)  # each example's shapes compile anew
@given(
    pairs=st.integers(1, 40),
    n_out=st.integers(1, 70),
    blocks=st.integers(1, 5),
    dtype=st.sampled_from([jnp.float32, jnp.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_kernel_products_equal_xla_gathered_form(pairs, n_out, blocks, dtype, seed):
    """Any number of pairs and output rows (chunks split across XLA's threads,
    ragged last chunks), any chosen experts (repeated ones included): the
    products equal XLA's gather, dequantize and dot to fp32 rounding."""
    rng = np.random.default_rng(seed)
    experts, in_features = 5, 32 * blocks
    packed = rng.integers(
        -(2**31), 2**31, (experts, n_out, in_features // 8), dtype=np.int64
    ).astype(np.int32)
    scale = rng.uniform(0.001, 0.01, (experts, n_out, in_features // 32)).astype(ml_dtypes.bfloat16)
    rows = rng.standard_normal((pairs, in_features)).astype(dtype)
    chosen = rng.integers(0, experts, pairs).astype(np.int32)
    out = jax.jit(cpu_kernels.gathered_int4_matvec)(rows, packed, scale, chosen)
    assert out.dtype == dtype and out.shape == (pairs, n_out)
    dense = dequantize_int4_groups(
        jnp.asarray(packed)[chosen], jnp.asarray(scale)[chosen], in_features
    )
    expected = np.einsum("pk,pnk->pn", np.asarray(rows, np.float64), np.asarray(dense, np.float64))
    tolerance = 1e-5 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(
        np.asarray(out, np.float64), expected, rtol=tolerance, atol=tolerance
    )


def int4_projections(rng, n_experts: int, d: int, f: int, group: int) -> list[Int4Experts]:
    projections = []
    for shape in [(n_experts, d, f), (n_experts, d, f), (n_experts, f, d)]:
        p = Int4Experts(shape, jnp.float32, (None,) * 3, group)
        p.packed[...] = rng.integers(-(2**31), 2**31, p.packed.shape, dtype=np.int64).astype(
            np.int32
        )
        p.scale[...] = jnp.asarray(rng.uniform(0.01, 0.05, p.scale.shape), jnp.bfloat16)
        projections.append(p)
    return projections


def test_gathered_dispatch_through_the_kernel_equals_xla():
    """The MoE's gathered dispatch gives the same outputs
    through the kernel as through XLA's dequantization."""
    rng = np.random.default_rng(1)
    projections = int4_projections(rng, 6, 64, 96, 32)
    pieces = [p.stored() for p in projections]
    x = jnp.asarray(rng.standard_normal((7, 64)), jnp.float32)
    experts = jnp.asarray(rng.integers(0, 6, (7, 3)))
    weights = jnp.asarray(rng.random((7, 3)), jnp.float32)
    outputs = {}
    for kernel in (True, False):
        backend = Backend("cpu", cpu_kernels=kernel)
        through = pair_experts(projections, pieces, backend)
        outputs[kernel] = jax.jit(lambda x, w, e, t=through: gathered_experts(x, w, e, t))(
            x, weights, experts
        )
    np.testing.assert_allclose(outputs[True], outputs[False], rtol=1e-5, atol=1e-6)


def test_the_kernel_is_used_only_where_it_applies():
    """CPU and INT4 groups that are whole half-blocks; not for other groups, GPUs (they have
    their own, tests/kernels/test_int4_experts.py), or when turned off; and with it gathering
    pays up to a few pairs per expert (without it, only below half a pair per expert)."""
    rng = np.random.default_rng(2)
    cpu = Backend("cpu")
    assert (
        int4_kernel(int4_projections(rng, 2, 64, 32, 32), cpu) is cpu_kernels.gathered_int4_matvec
    )
    gpu = int4_kernel(int4_projections(rng, 2, 64, 32, 32), Backend("gpu"))
    assert gpu is not None and gpu.func is int4_experts.gathered_int4_matvec_gpu
    for backend, group in ((cpu, 16), (Backend("cpu", cpu_kernels=False), 32)):
        assert int4_kernel(int4_projections(rng, 2, 64, 32, group), backend) is None
    assert cpu.moe_dispatch(16, 8, 128, 1024, 512, quantized=True, kernel=True) == "gathered"
    assert cpu.moe_dispatch(16, 8, 128, 1024, 512, quantized=True, kernel=False) != "gathered"
    assert cpu.moe_dispatch(80, 8, 128, 1024, 512, quantized=True, kernel=True) != "gathered"


@pytest.mark.slow
def test_build_is_cached_and_a_failing_compiler_falls_back(tmp_path, monkeypatch, caplog):
    """The library is built once into the cache (a rename: no partial
    file), reused after; a compiler that fails leaves nothing in the
    cache and makes ``load`` answer None with one warning."""
    monkeypatch.setenv("JAXDD_CACHE", str(tmp_path))
    compiler = cpu_kernels.compiler()
    library = cpu_kernels.build(compiler)
    assert library.parent == tmp_path / "native" and [p.name for p in library.parent.iterdir()] == [
        library.name
    ]
    built = library.stat().st_mtime_ns
    assert cpu_kernels.build(compiler) == library and library.stat().st_mtime_ns == built
    monkeypatch.setenv("JAXDD_CACHE", str(tmp_path / "failing"))
    with caplog.at_level(logging.WARNING, logger="jaxdd.runtime.cpu_kernels"):
        assert cpu_kernels.load("false") is None
    assert "did not build" in caplog.text
    assert not any((tmp_path / "failing").rglob("*.so"))


@settings(max_examples=examples(8), deadline=None)  # each example's shapes compile anew
@given(
    rows=st.integers(1, 3),
    k=st.integers(1, 700),
    n=st.one_of(st.integers(1, 90), st.integers(500, 600)),
    weight_dtype=st.sampled_from([jnp.float32, jnp.bfloat16]),
    row_dtype=st.sampled_from([jnp.float32, jnp.bfloat16]),
    seed=st.integers(0, 2**16),
)
# wide: 4 rows a pass
@example(rows=2, k=300, n=530, weight_dtype=jnp.float32, row_dtype=jnp.float32, seed=0)
def test_dense_matvec_equals_xla(rows, k, n, weight_dtype, row_dtype, seed):
    """Any rows, inputs (one block of W's rows or several, split across threads)
    and outputs (narrow and wide weights, whole vectors and a ragged tail): the
    dense kernel equals XLA's matmul to fp32 rounding, in the rows' dtype."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((rows, k)), row_dtype)
    weight = jnp.asarray(rng.standard_normal((k, n)), weight_dtype)
    out = jax.jit(cpu_kernels.dense_matvec)(x, weight)
    assert out.dtype == row_dtype and out.shape == (rows, n)
    expected = np.asarray(x, np.float64) @ np.asarray(weight, np.float64)
    tolerance = 1e-5 * np.sqrt(k) if row_dtype == jnp.float32 else 1e-2 * np.sqrt(k)
    np.testing.assert_allclose(
        np.asarray(out, np.float64), expected, rtol=tolerance, atol=tolerance
    )


def test_linear_uses_the_dense_kernel_only_where_it_applies():
    """``linear`` (any weight rank) gives XLA's result through the kernel for a few rows on one
    CPU device; more rows, several devices, other platforms and the switch leave it to XLA."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((1, 1, 48)), jnp.float32)
    weight = jnp.asarray(rng.standard_normal((48, 4, 24)), jnp.float32)
    through_kernel = jax.jit(lambda x, w: linear(x, w, Backend("cpu")))(x, weight)
    np.testing.assert_allclose(
        through_kernel, jnp.einsum("btq,qhd->bthd", x, weight), rtol=1e-5, atol=1e-5
    )
    cpu = Backend("cpu")
    assert cpu.dense_matvec(1) is cpu_kernels.dense_matvec and cpu.dense_matvec(
        Backend.DENSE_KERNEL_ROWS
    )
    off = [
        Backend("cpu", devices=8),
        Backend("gpu"),
        Backend("tpu"),
        Backend("cpu", cpu_kernels=False),
    ]
    assert cpu.dense_matvec(Backend.DENSE_KERNEL_ROWS + 1) is None and all(
        b.dense_matvec(1) is None for b in off
    )
    assert Backend.of_devices(jax.devices()[:1]).devices == 1


@settings(max_examples=examples(8), deadline=None)  # each example's shapes compile anew
@given(
    groups=st.integers(1, 9),
    rows=st.integers(1, 19),
    n=st.integers(1, 150),
    k=st.integers(1, 300),
    weight_dtype=st.sampled_from([jnp.float32, jnp.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_row_dot_equals_xla(groups, rows, n, k, weight_dtype, seed):
    """Any groups, rows of x (8, 4, 2 and 1 at a time), weight rows (split
    across threads, a ragged last task) and lengths (whole vectors and a
    tail): the row-dot kernel equals the einsum to fp32 rounding."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((groups, rows, k)), jnp.float32)
    weight = jnp.asarray(rng.standard_normal((groups, n, k)), weight_dtype)
    out = jax.jit(cpu_kernels.row_dot)(x, weight)
    assert out.dtype == jnp.float32 and out.shape == (groups, rows, n)
    expected = np.einsum("gpk,gnk->gpn", np.asarray(x, np.float64), np.asarray(weight, np.float64))
    np.testing.assert_allclose(
        np.asarray(out, np.float64), expected, rtol=1e-5 * np.sqrt(k), atol=1e-5 * np.sqrt(k)
    )


@pytest.mark.slow
def test_decode_attention_through_the_kernels_equals_xla():
    """A one-token step after a prefill (a batch of two: one cache each) gives XLA's hidden states
    and logits with the dense matvecs and absorbed attention's products through the kernels."""
    batch = 2
    config = KimiConfig.from_hf(DeepseekV3Config(**TINY_K2).to_dict())
    target = KimiTarget(config, jnp.float32, rngs=nnx.Rngs(4))
    rng = np.random.default_rng(4)
    prompt = jnp.asarray(rng.integers(0, config.vocab_size, (batch, 5)), jnp.int32)

    def step(backend: Backend) -> tuple[jax.Array, jax.Array]:
        @jax.jit
        def run(tokens):
            cache = LatentCache.zeros(config, batch, 16, jnp.float32)
            positions = jnp.broadcast_to(jnp.arange(5), (batch, 5))
            causal = jnp.broadcast_to(jnp.tril(jnp.ones((5, 5), bool)), (batch, 5, 5))
            cache = target(tokens, positions, cache, causal, backend=backend).cache.replace(
                length=jnp.full((batch,), 5, jnp.int32)
            )
            one = jnp.ones((batch, 1, 1), bool)
            hidden = target(
                tokens[:, -1:], positions[:, -1:] + 1, cache, one, backend=backend
            ).hidden
            return hidden, target.logits(hidden, backend)

        return run(prompt)

    assert Backend("cpu").decode_kernels(batch) is cpu_kernels
    with_kernels, xla = step(Backend("cpu")), step(Backend("cpu", cpu_kernels=False))
    for ours, theirs in zip(with_kernels, xla, strict=True):
        np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4)


def test_the_attention_kernel_is_chosen_where_it_applies():
    """The absorbed form over pools of pages on one CPU device runs in the C++ tree attention;
    over a row's own buffers (a prompt's), on several devices, with the kernels off, or in the
    naive form, XLA's einsums; the pallas form always in the Pallas kernel."""
    cpu = Backend("cpu")
    assert cpu.attention_kernel("absorbed", paged=True) is cpu_kernels.tree_attention
    for backend, attention, paged in (
        (cpu, "absorbed", False),
        (cpu, "naive", True),
        (Backend("cpu", devices=8), "absorbed", True),
        (Backend("cpu", cpu_kernels=False), "absorbed", True),
        (Backend("gpu"), "absorbed", True),
    ):
        assert backend.attention_kernel(attention, paged) is None
    assert cpu.attention_kernel("pallas", paged=True).func is cpu.tree_attention().func


@pytest.mark.slow
def test_verify_over_pages_through_the_kernel_equals_xla():
    """A tree verify (8 tokens, each seeing its ancestors) after a prefill, both over a pool of
    pages whose tables are shuffled: the target's hidden states and the cache it writes equal
    XLA's gathered form, and only the kernel's program calls it."""
    batch, prompt_len, tree = 2, 70, 8
    config = KimiConfig.from_hf(DeepseekV3Config(**TINY_K2).to_dict())
    target = KimiTarget(config, jnp.float32, rngs=nnx.Rngs(5))
    rng = np.random.default_rng(5)
    tokens = jnp.asarray(rng.integers(0, config.vocab_size, (batch, prompt_len + tree)), jnp.int32)
    depths, visible = tree_depths_and_mask(np.array([-1, 0, 0, 1, 1, 2, 3, 6]))
    visible = jnp.asarray(np.broadcast_to(visible, (batch, tree, tree)))

    def verify(backend: Backend):
        cache = LatentCache.pooled(config, batch, Paging(3, 7), jnp.float32)
        cache = cache.replace(pages=jnp.array([[3, 1, 5], [2, 6, 4]], jnp.int32))
        positions = jnp.broadcast_to(jnp.arange(prompt_len), (batch, prompt_len))
        causal = jnp.broadcast_to(
            jnp.tril(jnp.ones((prompt_len,) * 2, bool)), (batch,) + (prompt_len,) * 2
        )
        prefix = target(tokens[:, :prompt_len], positions, cache, causal, backend=backend).cache
        prefix = prefix.replace(length=jnp.array([prompt_len, prompt_len - 9], jnp.int32))
        out = target(
            tokens[:, prompt_len:],
            prefix.length[:, None] + jnp.asarray(depths),
            prefix,
            visible,
            backend=backend,
        )
        return out.hidden, out.cache

    programs = {}
    results = {}
    for name, backend in (("kernel", Backend("cpu")), ("xla", Backend("cpu", cpu_kernels=False))):
        programs[name] = jax.jit(verify, static_argnums=0).lower(backend).as_text()
        results[name] = jax.jit(verify, static_argnums=0)(backend)
    assert cpu_kernels.ATTENTION_TARGET in programs["kernel"]
    assert cpu_kernels.ATTENTION_TARGET not in programs["xla"]
    leaves = (jax.tree.leaves(results[name]) for name in ("kernel", "xla"))
    for ours, theirs in zip(*leaves, strict=True):
        np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4)
