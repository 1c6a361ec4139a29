"""The gathered INT4 expert matvec's Pallas GPU kernel (pallas_kernels/int4_experts.py):
interpreted on CPU its dequantization equals ``dequantize_int4_groups`` bit for bit and its
products equal XLA's gathered form; compiled deviceless for sm_90 (H200) and sm_120 (RTX
PRO 6000) at Kimi K2.6's per-device sizes, it declares the bytes it moves (each pair's
expert once) and ``jaxdd.compiled_traffic`` counts them; the GPU backend picks it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxdd
from jaxdd.models.expert_dispatch import int4_kernel
from jaxdd.models.quant import Int4Experts, dequantize_int4_groups
from jaxdd.planning.aot import GPU_COMPILER_OPTIONS, find_machine
from jaxdd.runtime.backend import Backend
from pallas_kernels.int4_experts import declared_bytes, gathered_int4_matvec_gpu, supports, tiles

ON_GPU = jax.default_backend() == "gpu"
GPU_MACHINES = ["h200", "rtx-pro-6000"]  # sm_90, sm_120
# Kimi K2.6's routed experts, one TP8 device's slice of their FFN
EXPERTS, HIDDEN, FFN = 384, 7168, 256


def random_experts(rng, experts: int, n_out: int, k: int, group: int, scales=None):
    """packed [E, N, K/8] int32 (every bit pattern) and scale [E, N, K/group] bf16."""
    packed = rng.integers(-(2**31), 2**31, (experts, n_out, k // 8), dtype=np.int64).astype(
        np.int32
    )
    if scales is None:
        scales = rng.uniform(0.001, 0.01, experts * n_out * (k // group))
    scale = np.resize(scales, experts * n_out * (k // group)).reshape(experts, n_out, k // group)
    return packed, scale.astype(ml_dtypes.bfloat16)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(("group", "k"), [(32, 96), (128, 256)])
def test_kernel_dequantizes_exactly(group, k, dtype):
    """One-hot rows read the dequantized weights back exactly, for every stored nibble and
    scales over bf16's whole range (subnormals and both signs), groups of 32 and 128."""
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2**16, 4096, dtype=np.uint32) << 16
    scales = bits.view(np.float32)
    scales = scales[np.isfinite(scales) & (np.abs(scales) < np.finfo(np.float32).max / 8)]
    experts, n_out = 2, 16
    packed, scale = random_experts(rng, experts, n_out, k, group, scales)
    # Pair (e, i): expert e, the one-hot row of input i, so out[pair] is expert e's weight column i.
    chosen = np.repeat(np.arange(experts, dtype=np.int32), k)
    one_hot = jnp.asarray(np.tile(np.eye(k, dtype=np.float32), (experts, 1)), dtype)
    out = gathered_int4_matvec_gpu(one_hot, packed, scale, chosen, interpret=True)
    assert out.dtype == dtype
    dense = dequantize_int4_groups(jnp.asarray(packed), jnp.asarray(scale), k, jnp.bfloat16, group)
    expected = np.asarray(dense, np.float32).transpose(0, 2, 1).reshape(experts * k, n_out)
    np.testing.assert_array_equal(np.asarray(out, np.float32), expected)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(
    ("pairs", "n_out", "k", "group", "chosen"),
    [
        (7, 24, 256, 32, "random"),  # 24 outputs: blocks of 8
        (5, 96, 1024, 128, "repeated"),  # one expert for every pair
        (9, 64, 3 * 256, 32, "distinct"),  # K in 3 loop steps
    ],
)
def test_kernel_products_equal_xla_gathered_form(pairs, n_out, k, group, chosen, dtype):
    """Repeated and distinct experts, any number of pairs, outputs in blocks under
    64: the products equal XLA's gather, dequantize and dot to fp32 rounding."""
    rng = np.random.default_rng(pairs)
    experts = 12
    packed, scale = random_experts(rng, experts, n_out, k, group)
    ids = {
        "random": rng.integers(0, experts, pairs),
        "repeated": np.full(pairs, 3),
        "distinct": rng.permutation(experts)[:pairs],
    }[chosen].astype(np.int32)
    rows = jnp.asarray(rng.standard_normal((pairs, k)), dtype)
    out = gathered_int4_matvec_gpu(rows, packed, scale, ids, interpret=True)
    assert out.dtype == dtype and out.shape == (pairs, n_out)
    dense = dequantize_int4_groups(
        jnp.asarray(packed)[ids], jnp.asarray(scale)[ids], k, jnp.bfloat16, group
    )
    expected = np.einsum("pk,pnk->pn", np.asarray(rows, np.float64), np.asarray(dense, np.float64))
    tolerance = 1e-5 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(
        np.asarray(out, np.float64), expected, rtol=tolerance, atol=tolerance
    )


def test_kernel_clamps_ids_as_xla_gathers_do():
    """Ids past either end read the first or last expert (as
    XLA's gather clamps), not memory past the arrays."""
    rng = np.random.default_rng(5)
    packed, scale = random_experts(rng, 4, 16, 64, 32)
    rows = jnp.asarray(rng.standard_normal((3, 64)), jnp.float32)
    out = gathered_int4_matvec_gpu(rows, packed, scale, np.int32([-5, 4, 9]), interpret=True)
    clamped = gathered_int4_matvec_gpu(rows, packed, scale, np.int32([0, 3, 3]), interpret=True)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(clamped))


def _compiled_account(machine: str, pairs: int, n_out: int, k: int, dtype=jnp.bfloat16) -> dict:
    where = find_machine(machine, 1)
    device = jax.sharding.SingleDeviceSharding(where.devices[0])
    shapes = [
        ((pairs, k), dtype),
        ((EXPERTS, n_out, k // 8), jnp.int32),
        ((EXPERTS, n_out, k // 32), jnp.bfloat16),
    ]
    args = [
        jax.ShapeDtypeStruct(shape, d, sharding=device)
        for shape, d in [*shapes, ((pairs,), jnp.int32)]
    ]
    kernel = where.backend.int4_matvec(32)
    compiled = jax.jit(kernel).lower(*args).compile(compiler_options=where.compiler_options or None)
    return jaxdd.compiled_traffic(compiled)


@pytest.mark.parametrize("machine", GPU_MACHINES)
@pytest.mark.parametrize(("n_out", "k"), [(FFN, HIDDEN), (HIDDEN, FFN)], ids=["gate_up", "down"])
def test_kernel_compiles_deviceless_and_declares_its_bytes(machine, n_out, k):
    """136 pairs (a DDTree verify of 17 tokens x 8) through K2.6's TP8 gate / up
    ([256, 7168]) and down ([7168, 256]) slices: the kernel compiles for sm_90 and
    sm_120, its call counts the bytes it declares, and those are each pair's expert
    (words and scales) once, plus the pair's bf16 row per program and the outputs."""
    pairs = 136
    account = _compiled_account(machine, pairs, n_out, k)
    ((target, call),) = account["custom_calls"].items()
    assert (target, call["counted"]) == ("__gpu$xla.gpu.triton", "declared")
    block_n = tiles(n_out, k // 32, 32)[0]
    expert = n_out * (k // 8) * 4 + n_out * (k // 32) * 2
    programs = pairs * n_out // block_n
    recomputed = pairs * expert + programs * (4 + 2 * k) + pairs * n_out * 2
    assert call["bytes"] == recomputed == declared_bytes(pairs, n_out, k, k // 32, 2, block_n)
    # rows and their relayout: a few percent
    assert pairs * expert <= account["bytes"] <= 1.1 * pairs * expert


def test_gpu_backend_takes_the_kernel_for_the_groups_it_tiles():
    """Groups of whole words, a power of two of them (Kimi's 32, 128);
    gathering pays on GPU up to one pair per expert (past that ``scan``
    reads fewer bytes), on CPU up to ``KERNEL_GATHERED_PAIRS``."""
    assert supports(32) and supports(128) and not supports(96) and not supports(4)
    gpu = Backend("gpu")
    assert gpu.int4_matvec(32) is not None and gpu.int4_matvec(96) is None
    projections = [Int4Experts((4, 64, 32), jnp.bfloat16, (None,) * 3, 32) for _ in range(3)]
    assert int4_kernel(projections, gpu) is not None
    assert gpu.moe_dispatch(48, 8, 384, HIDDEN, FFN, quantized=True, kernel=True) == "gathered"
    assert gpu.moe_dispatch(49, 8, 384, HIDDEN, FFN, quantized=True, kernel=True) == "scan"
    assert (
        Backend("cpu").moe_dispatch(49, 8, 384, HIDDEN, FFN, quantized=True, kernel=True)
        == "gathered"
    )


@pytest.mark.parametrize("experts", ["replicated", "split"])
def test_the_kernel_compiles_on_several_gpus_outside_shard_map(experts):
    """Unlike a Mosaic call, a Triton call over 8 GPUs outside shard_map
    compiles (XLA runs it on every device, gathering split experts
    first), so the GPU backend keeps it for MoE layers left unplaced."""
    gpu = Backend("gpu")
    assert gpu.int4_matvec(32, unplaced=True) is not None
    mesh = jax.sharding.Mesh(np.array(find_machine("rtx-pro-6000", 8).devices), ("x",))
    split = jax.sharding.PartitionSpec("x" if experts == "split" else None)
    on = lambda shape, dtype, spec: jax.ShapeDtypeStruct(
        shape, dtype, sharding=jax.sharding.NamedSharding(mesh, spec)
    )
    whole = jax.sharding.PartitionSpec()
    args = [
        on((16, 64), jnp.bfloat16, whole),
        on((8, 32, 8), jnp.int32, split),
        on((8, 32, 2), jnp.bfloat16, split),
    ]
    compiled = (
        jax.jit(gpu.int4_matvec(32))
        .lower(*args, on((16,), jnp.int32, whole))
        .compile(GPU_COMPILER_OPTIONS)
    )
    assert ("all-gather" in compiled.as_text()) == (experts == "split")


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU; the interpreted twins above run everywhere")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_on_gpu_equals_the_interpreted_form(dtype):
    """On a GPU: the compiled kernel's dequantization is exact (one-hot rows) and its
    products equal the interpreter's to fp32 rounding, at K2.6's gate / up slice."""
    rng = np.random.default_rng(3)
    packed, scale = random_experts(rng, 16, FFN, HIDDEN, 32)
    chosen = rng.integers(0, 16, 24).astype(np.int32)
    rows = jnp.asarray(rng.standard_normal((24, HIDDEN)), dtype)
    kernel = Backend.local().int4_matvec(32)
    out = np.asarray(kernel(rows, packed, scale, chosen), np.float64)
    # The interpreter on the CPU: XLA:GPU may skip the weights' bf16 rounding
    # (xla_allow_excess_precision), which the kernel does as its contract says.
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        inputs = jax.device_put((rows, packed, scale, chosen), cpu)
        expected = np.asarray(gathered_int4_matvec_gpu(*inputs, interpret=True), np.float64)
    tolerance = 1e-5 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(out, expected, rtol=tolerance, atol=tolerance)
    one_hot = jnp.asarray(np.eye(HIDDEN, dtype=np.float32)[:64], dtype)
    ids = np.zeros(64, np.int32)
    dense = dequantize_int4_groups(jnp.asarray(packed[:1]), jnp.asarray(scale[:1]), HIDDEN)
    expected = np.asarray(dense, np.float32)[0, :, :64].T
    np.testing.assert_array_equal(
        np.asarray(kernel(one_hot, packed, scale, ids), np.float32), expected
    )
