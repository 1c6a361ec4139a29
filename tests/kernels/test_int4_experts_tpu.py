"""The gathered INT4 expert matvec's TPU (Mosaic) form: in Pallas' TPU interpreter it
dequantizes exactly as ``dequantize_int4_groups`` and its products equal XLA's
gather-dequantize-dot; compiled deviceless for v5p at Kimi K2.6's sizes it declares the bytes
its blocks move, reads its weights where XLA:TPU stores them (the layouts it predicts are the
compiler's), and the MoE's gathered dispatch through it reads each pair's expert about once."""

from __future__ import annotations

import functools
import json
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from jax.experimental.pallas import tpu as pltpu

import jaxdd
from jaxdd.models.expert_dispatch import gathered_experts, gathered_pairs, int4_kernel, pair_experts
from jaxdd.models.quant import Int4Experts, dequantize_int4_groups
from jaxdd.planning.aot import find_machine
from jaxdd.runtime.backend import Backend
from pallas_kernels.int4_experts_tpu import (
    PER_WORD,
    block_n,
    declared_bytes,
    gathered_int4_matvec_tpu,
    stored_transposed,
)

INTERPRET = pltpu.InterpretParams()
# (experts, outputs, inputs, group): row-major words and
# scales; swapped scales; swapped words and scales (down)
SHAPES = [(3, 40, 256, 128), (4, 256, 256, 32), (3, 256, 64, 32)]
# Kimi K2.6's expert pieces per device: TP8 gate / up and
# down, EP8 (48 experts) and one device's gate / up and down.
KIMI_PIECES = [
    (384, 256, 7168),
    (384, 7168, 256),
    (48, 2048, 7168),
    (48, 7168, 2048),
    (384, 2048, 7168),
]


def quantized(rng, experts: int, n: int, k: int, group: int) -> tuple[np.ndarray, np.ndarray]:
    packed = rng.integers(-(2**31), 2**31, (experts, n, k // PER_WORD), dtype=np.int64).astype(
        np.int32
    )
    scale = rng.uniform(0.001, 0.01, (experts, n, k // group)).astype(ml_dtypes.bfloat16)
    return packed, scale


def dense(packed, scale, k: int, group: int) -> np.ndarray:
    """[E, N, K] fp32: the weights as ``dequantize_int4_groups`` makes them (bf16(q x scale))."""
    weights = dequantize_int4_groups(
        jnp.asarray(packed), jnp.asarray(scale), k, jnp.bfloat16, group
    )
    return np.asarray(weights, np.float32)


@pytest.mark.slow
@pytest.mark.parametrize(("experts", "n", "k", "group"), SHAPES)
def test_one_hot_rows_read_the_dequantized_weights_exactly(experts, n, k, group):
    """Pair (e, i) is expert e with the one-hot row of input i, so its
    output is column i of expert e's weight: every one equals
    dequantize_int4_groups' bit for bit, in both stored orientations."""
    rng = np.random.default_rng(0)
    packed, scale = quantized(rng, experts, n, k, group)
    chosen = np.repeat(np.arange(experts, dtype=np.int32), k)
    one_hot = np.tile(np.eye(k, dtype=np.float32), (experts, 1))
    out = gathered_int4_matvec_tpu(one_hot, packed, scale, chosen, interpret=INTERPRET)
    expected = dense(packed, scale, k, group).transpose(0, 2, 1).reshape(experts * k, n)
    np.testing.assert_array_equal(np.asarray(out), expected)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(("experts", "n", "k", "group"), SHAPES)
@pytest.mark.parametrize("repeated", [True, False], ids=["repeated", "distinct"])
def test_products_equal_xla_gathered_form(experts, n, k, group, dtype, repeated):
    """7 pairs (no multiple of a block), on experts chosen by several pairs or each
    by one: the outputs equal XLA's gather, dequantize and dot, to fp32 rounding
    (the sums run in another order) and, in bf16, to the output's rounding."""
    rng = np.random.default_rng(1)
    packed, scale = quantized(rng, max(experts, 7), n, k, group)
    chosen = rng.integers(0, 2, 7) if repeated else rng.permutation(max(experts, 7))[:7]
    rows = jnp.asarray(rng.standard_normal((7, k)), dtype)
    out = gathered_int4_matvec_tpu(
        rows, packed, scale, jnp.asarray(chosen, jnp.int32), interpret=INTERPRET
    )
    assert out.dtype == dtype and out.shape == (7, n)
    expected = np.einsum(
        "pk,pnk->pn", np.asarray(rows, np.float64), dense(packed, scale, k, group)[chosen]
    )
    if dtype == jnp.float32:
        np.testing.assert_allclose(np.asarray(out, np.float64), expected, rtol=1e-5, atol=1e-6)
    else:
        np.testing.assert_allclose(np.asarray(out, np.float64), expected, rtol=2**-7, atol=1e-3)


@pytest.mark.slow
def test_gathered_dispatch_through_the_kernel_equals_xla(monkeypatch):
    """The MoE's gathered dispatch on TPU (its kernel interpreted here) gives XLA's
    gather-then-dequantize outputs: 7 tokens, 3 slots each, over 6 INT4 experts (group 32)."""
    rng = np.random.default_rng(2)
    shapes = [(6, 64, 96), (6, 64, 96), (6, 96, 64)]
    projections = [Int4Experts(shape, jnp.float32, (None,) * 3, 32) for shape in shapes]
    for p in projections:
        p.packed[...], p.scale[...] = quantized(
            rng, p.packed.shape[0], p.packed.shape[1], p.scale.shape[2] * 32, 32
        )
    pieces = [p.stored() for p in projections]
    x = jnp.asarray(rng.standard_normal((7, 64)), jnp.float32)
    experts = jnp.asarray(rng.integers(0, 6, (7, 3)))
    weights = jnp.asarray(rng.random((7, 3)), jnp.float32)
    interpreted = functools.partial(gathered_int4_matvec_tpu, interpret=INTERPRET)
    monkeypatch.setattr(Backend, "int4_matvec", lambda self, group, unplaced=False: interpreted)
    through = pair_experts(projections, pieces, Backend("tpu"))
    ours = gathered_experts(x, weights, experts, through)
    xla = gathered_experts(
        x, weights, experts, lambda r, c: gathered_pairs(r, c, projections, pieces)
    )
    np.testing.assert_allclose(ours, xla, rtol=1e-5, atol=1e-6)


def test_the_kernel_is_used_on_tpu_where_experts_are_placed():
    """On TPU the MoE takes the Mosaic kernel for INT4 experts, except
    where the experts lie on several devices outside shard_map: JAX refuses
    to partition a Mosaic call there, even on replicated operands."""
    make = lambda shape: nnx.eval_shape(lambda: Int4Experts(shape, jnp.bfloat16, (None,) * 3, 32))
    projections = [make((4, 64, 32)), make((4, 64, 32)), make((4, 32, 64))]
    assert int4_kernel(projections, Backend("tpu")) is gathered_int4_matvec_tpu
    assert int4_kernel(projections, Backend("tpu"), unplaced=True) is None
    mesh = jax.sharding.Mesh(np.array(find_machine("v5p:2x2x2").devices), ("x",))
    whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=whole)
    args = [
        spec((8, 64), jnp.bfloat16),
        spec((4, 32, 8), jnp.int32),
        spec((4, 32, 2), jnp.bfloat16),
    ]
    with pytest.raises(
        NotImplementedError, match="Mosaic kernels cannot be automatically partitioned"
    ):
        jax.jit(gathered_int4_matvec_tpu).lower(*args, spec((8,), jnp.int32)).compile()


def _v5p():
    where = find_machine("v5p:2x2x2", 1)
    device = jax.sharding.SingleDeviceSharding(where.devices[0])
    return where, lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=device)


def test_predicted_layouts_are_the_compilers():
    """XLA:TPU stores the scales and the down projection's words with their last
    two dimensions swapped, the gate and up words row-major: ``stored_transposed``
    says which for every Kimi piece, as the compiler's own layouts do."""
    _, spec = _v5p()
    shapes = [(e, n, k // d) for e, n, k in KIMI_PIECES for d in (PER_WORD, 32)]
    dtypes = [jnp.int32 if i % 2 == 0 else jnp.bfloat16 for i in range(len(shapes))]
    compiled = jax.jit(lambda *a: [x[0] for x in a]).lower(*map(spec, shapes, dtypes)).compile()
    layouts = [f.layout.major_to_minor for f in compiled.input_formats[0]]
    predicted = [
        (0, 2, 1) if stored_transposed(s, d) else (0, 1, 2)
        for s, d in zip(shapes, dtypes, strict=True)
    ]
    assert layouts == predicted
    assert predicted.count((0, 2, 1)) == 6  # every scale, and the down projection's words at TP8


def _blocks_moved(pairs: int, experts: int, n: int, k: int, x_bytes: int) -> int:
    """The kernel's blocks over its grid, counted by hand: each (output block, pair)
    step fetches its pair's rows and writes its outputs (fp32); each output block
    fetches the words and scales of as many distinct experts as the pairs can choose."""
    words = k // PER_WORD
    bn = block_n(n, words)
    expert_block = bn * words * 4 + bn * (k // 32) * 2
    return (n // bn) * (
        min(pairs, experts) * expert_block + pairs * (PER_WORD * words * x_bytes + bn * 4)
    )


@pytest.mark.slow
@pytest.mark.parametrize(("experts", "n", "k"), KIMI_PIECES)
def test_compiles_for_v5p_and_declares_its_blocks(experts, n, k):
    """At Kimi's sizes (136 pairs: a DDTree-16 verify; under EP more than a device's 48
    experts) the Mosaic kernel compiles for v5p; its custom call declares what its
    blocks move (recomputed here by hand), XLA copies no weight for it, and the call is
    nearly all the program moves (the rows' sort and the outputs' unsort are small)."""
    where, spec = _v5p()
    pairs = 136
    args = [
        spec((pairs, k), jnp.bfloat16),
        spec((experts, n, k // PER_WORD), jnp.int32),
        spec((experts, n, k // 32), jnp.bfloat16),
        spec((pairs,), jnp.int32),
    ]
    compiled = (
        jax.jit(gathered_int4_matvec_tpu)
        .lower(*args)
        .compile(compiler_options=where.compiler_options)
    )
    account = jaxdd.compiled_traffic(compiled)
    call = account["custom_calls"]["tpu_custom_call"]
    declared = declared_bytes(pairs, args[1].shape, args[2].shape, jnp.bfloat16)
    assert (call["counted"], call["count"]) == ("declared", 1)
    # less what it reads on chip: at most the pairs' expert ids (in whole 128-lane tiles), which
    # XLA computes into VMEM
    assert call["bytes"] + call["on_chip"] == declared and call["on_chip"] <= -(-pairs // 128) * 512
    assert declared == _blocks_moved(pairs, experts, n, k, 2)
    assert account["weight_copies"] == []
    assert account["bytes"] <= 1.2 * declared


@pytest.mark.slow
def test_gathered_int4_experts_are_read_once_on_tpu():
    """The MoE's gathered dispatch on XLA:TPU (v5p): a DDTree-16 verify's 136 (token,
    slot) pairs through K2.6's 384 INT4 experts (TP8 shards, gate / up / down) read
    each pair's expert about once through the kernel; XLA's own gather-then-dequantize
    form moves several times that (it relays the gathered experts out in fp32)."""
    experts, hidden, ffn, tokens, top_k = 384, 7168, 256, 17, 8
    make = lambda shape: nnx.eval_shape(lambda: Int4Experts(shape, jnp.bfloat16, (None,) * 3, 32))
    projections = [
        make((experts, hidden, ffn)),
        make((experts, hidden, ffn)),
        make((experts, ffn, hidden)),
    ]
    where, spec = _v5p()
    backend = where.backend
    assert backend.platform == "tpu"
    pieces_shapes = [
        [(p.packed.shape, jnp.int32), (p.scale.shape, jnp.bfloat16)] for p in projections
    ]
    flat_shapes = [s for p in pieces_shapes for s in p]

    def moved(through_kernel: bool) -> dict:
        def f(x, weights, chosen, *flat):
            pieces = [flat[0:2], flat[2:4], flat[4:6]]
            if through_kernel:
                through = pair_experts(projections, pieces, backend)
            else:
                through = lambda rows, ids: gathered_pairs(
                    rows, ids, projections, pieces, shifts=True
                )
            return gathered_experts(x, weights, chosen, through)

        shapes = [
            ((tokens, hidden), jnp.bfloat16),
            ((tokens, top_k), jnp.float32),
            ((tokens, top_k), jnp.int32),
        ]
        args = [spec(s, d) for s, d in [*shapes, *flat_shapes]]
        return jaxdd.compiled_traffic(
            jax.jit(f).lower(*args).compile(compiler_options=where.compiler_options)
        )

    pairs = tokens * top_k
    per_expert = sum(
        math.prod(shape[1:]) * jnp.dtype(dtype).itemsize for shape, dtype in flat_shapes
    )
    kernel = moved(through_kernel=True)
    assert kernel["weight_copies"] == [] and kernel["custom_calls"]["tpu_custom_call"]["count"] == 3
    assert pairs * per_expert <= kernel["bytes"] <= 1.1 * pairs * per_expert
    # Nothing but the kernel moves two experts' bytes: no gather or relayout of the experts.
    assert [op["op"] for op in kernel["top_ops"] if op["bytes"] > 2 * per_expert] == [
        "custom-call"
    ] * 3
    assert moved(through_kernel=False)["bytes"] >= 2 * pairs * per_expert


@pytest.mark.slow
def test_a_v5p_round_runs_the_kernel_on_each_devices_experts(
    tiny_plan_configs, tmp_path, monkeypatch
):
    """The AR round of a tiny K2.6-style pair (INT4 experts, 64 of them) on 8 v5p chips under
    EP: each MoE layer's gate, up and down go through the kernel on the device's own 8 experts
    (6 Mosaic calls more than XLA's gathered form), and no weight is copied for it."""
    from jaxdd.planning.fit import PlanOptions, plan

    target, drafter = tiny_plan_configs
    config = json.loads(target.read_text())
    config["text_config"]["n_routed_experts"] = 64
    (tmp_path / "target.json").write_text(json.dumps(config))

    def mosaic_calls() -> tuple[str, int]:
        result = plan(
            tmp_path / "target.json", drafter, PlanOptions("v5p:2x2x2", 8, "ep", "ar", 16, 256)
        )
        assert result["compiled_traffic"]["weight_copies"] == []
        return result["dispatch"], result["compiled_traffic"]["custom_calls"]["tpu_custom_call"][
            "count"
        ]

    dispatch, with_kernel = mosaic_calls()
    monkeypatch.setattr(Backend, "int4_matvec", lambda self, group, sharded=False: None)
    # 2 MoE layers
    assert mosaic_calls() == (dispatch, with_kernel - 3 * 2) and dispatch == "gathered"
