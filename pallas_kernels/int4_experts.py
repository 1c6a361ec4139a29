"""The gathered INT4 expert matvec as a Pallas GPU (Triton) kernel: each
(token, slot) pair's row through its own expert, the expert's packed
words and scales read once per pair and dequantized in registers.

XLA:GPU, given the gather-then-dequantize form (``jaxdd.models.expert_dispatch.gathered_pairs``),
may write the gathered experts out and read them again at a speculative round's pair counts. Here
every program loads its pair's expert id and reads only that expert's rows, so the bytes are the
experts' once, plus the rows (benchmarks/README.md, "What the compiled rounds move").

Same contract and values as ``jaxdd.runtime.cpu_kernels.gathered_int4_matvec``: every
weight dequantized as ``jaxdd.models.quant.dequantize_int4_groups`` does (bf16(q x scale),
q = nibble - 8, low nibble first) and the products summed in fp32. The words are viewed [E,
N, groups, words per group] (a free reshape), so a tile's scales broadcast over its words;
the rows are laid out by nibble ([P, 8, groups, words per group]: row value 8w + i at [i,
w]), so nibble i of every word meets its row value without an in-register interleave.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.tuned_block_sizes import block_sizes

PER_WORD = 8  # INT4 values per int32 word


def supports(group: int) -> bool:
    """Whether scale groups of ``group`` inputs fit the
    kernel's tiles: whole words, a power of two of them."""
    words = group // PER_WORD
    return group % PER_WORD == 0 and words > 0 and words & (words - 1) == 0


def _pow2_divisor(n: int, cap: int) -> int:
    """The largest power of two that divides ``n``, at
    most ``cap`` (Triton's tiles are powers of two)."""
    return min(n & -n, cap)


def tiles(n_out: int, groups: int, group: int) -> tuple[int, int]:
    """(output rows per program, scale groups per loop step) for an [N, groups x group] expert: at
    most the tuned sizes, powers of two dividing N and whole groups."""
    tuned = block_sizes("int4_experts")
    per_group = group // PER_WORD
    block_groups = _pow2_divisor(groups, max(tuned["block_words"] // per_group, 1))
    return _pow2_divisor(n_out, tuned["block_n"]), block_groups


def declared_bytes(pairs: int, n_out: int, k: int, groups: int, itemsize: int, block_n: int) -> int:
    """What the kernel reads and writes: per program its pair's id and row
    (the row once per block of outputs) and its block of outputs (rows' dtype,
    ``itemsize`` bytes); per pair its expert's words and bf16 scales, once."""
    programs = pairs * (n_out // block_n)
    per_program = 4 + (k + block_n) * itemsize
    per_pair = n_out * (k // 2 + groups * 2)
    return programs * per_program + pairs * per_pair


def _kernel(
    chosen_ref, rows_ref, packed_ref, scale_ref, out_ref, *, block_n: int, block_groups: int
):
    expert = chosen_ref[0]
    first = pl.program_id(1) * block_n
    groups = packed_ref.shape[2]
    per_group = packed_ref.shape[3]
    outputs = pl.ds(first, block_n)

    def step(g, acc):
        at = pl.ds(g * block_groups, block_groups)
        words = packed_ref[expert, outputs, at, :]  # [bn, bg, per_group] int32
        scale = scale_ref[expert, outputs, at].astype(jnp.float32)[:, :, None]
        for i in range(PER_WORD):
            q = ((words >> (4 * i)) & 15) - 8
            # The fp32 product is exact (|q| <= 8); rounded
            # once to bf16, as dequantize_int4_groups does.
            weight = (q.astype(jnp.float32) * scale).astype(jnp.bfloat16).astype(jnp.float32)
            acc += weight * rows_ref[i, at, :].astype(jnp.float32)[None]
        return acc

    acc = jnp.zeros((block_n, block_groups, per_group), jnp.float32)
    acc = jax.lax.fori_loop(0, groups // block_groups, step, acc)
    out_ref[...] = acc.sum(axis=2).sum(axis=1).astype(out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("interpret", "compiler_params"))
def gathered_int4_matvec_gpu(
    rows: jax.Array,
    packed: jax.Array,
    scale: jax.Array,
    chosen: jax.Array,
    interpret: bool = False,
    compiler_params: Any = None,
) -> jax.Array:
    """rows [P, K] through experts ``chosen`` [P] of packed [E, N, K/8] int32 with scale [E, N,
    K/group] bf16: [P, N] in rows' dtype (``jaxdd.runtime.cpu_kernels.gathered_int4_matvec``'s
    contract). Grid: pairs x blocks of N; K looped inside. Ids are clamped to [0, E) as XLA's
    gather clamps (Triton does not check its loads). ``interpret``: on CPU, through Pallas'
    interpreter; ``compiler_params``: Triton's."""
    pairs, k = rows.shape
    experts, n_out, words = packed.shape
    groups = scale.shape[2]
    per_group = words // groups
    if words * PER_WORD != k or per_group * groups != words:
        raise ValueError(
            f"INT4 matvec: rows [{pairs}, {k}] do not match packed {packed.shape} / scale "
            f"{scale.shape}"
        )
    block_n, block_groups = tiles(n_out, groups, per_group * PER_WORD)
    # Row value 8w + i at [i, w]: nibble i of word w meets
    # it (a transpose of [P, K], small beside the experts).
    by_nibble = rows.reshape(pairs, groups, per_group, PER_WORD).transpose(0, 3, 1, 2)
    pieces = (packed.reshape(experts, n_out, groups, per_group), scale)
    cost = pl.CostEstimate(
        flops=2 * pairs * n_out * k,
        transcendentals=0,
        bytes_accessed=declared_bytes(pairs, n_out, k, groups, rows.dtype.itemsize, block_n),
    )
    return pl.pallas_call(
        functools.partial(_kernel, block_n=block_n, block_groups=block_groups),
        out_shape=jax.ShapeDtypeStruct((pairs, n_out), rows.dtype),
        grid=(pairs, n_out // block_n),
        in_specs=[
            pl.BlockSpec((1,), lambda p, j: (p,)),
            pl.BlockSpec((None, PER_WORD, groups, per_group), lambda p, j: (p, 0, 0, 0)),
            *(pl.BlockSpec(piece.shape, lambda p, j, n=piece.ndim: (0,) * n) for piece in pieces),
        ],
        out_specs=pl.BlockSpec((None, block_n), lambda p, j: (p, j)),
        interpret=interpret,
        compiler_params=compiler_params,
        cost_estimate=cost,
        # Triton's lowering drops the cost estimate but keeps the metadata in the
        # call's backend config, where jaxdd.compiled_traffic reads the declared bytes.
        metadata={"bytes_accessed": str(cost.bytes_accessed)},
        name="gathered_int4_matvec",
    )(jnp.clip(chosen, 0, experts - 1).astype(jnp.int32), by_nibble, *pieces)
