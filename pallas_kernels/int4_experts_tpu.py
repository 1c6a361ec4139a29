"""The gathered INT4 expert matvec's TPU (Mosaic) form: each (token,
slot) pair's row through its own expert, with only the chosen experts'
blocks fetched (by scalar-prefetched expert ids) and dequantized in VMEM.

XLA:TPU gathers the chosen experts' words and scales and relays them out in fp32 before the
matmuls (benchmarks/README.md, "What the compiled rounds move"). Here the grid is (output
blocks, pairs): the pairs are visited in expert order, so consecutive pairs on one expert share
its block index and Pallas fetches the block once; each step unpacks the block's nibbles, scales
them (bf16(q x scale), as ``jaxdd.models.quant.dequantize_int4_groups``) and multiplies in fp32.

XLA:TPU stores an array whose minor dimension pads badly with its last two dimensions
swapped (the scales [E, N, K/group], the down projection's words [E, 7168, 32]); a
Mosaic call takes its operands row-major, so such a piece is handed over swapped back
(``jnp.swapaxes``, which is then a bitcast) and the kernel reads both orientations.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.block_traffic import Blocking, grid_bytes
from pallas_kernels.int4_experts import PER_WORD
from pallas_kernels.tuned_block_sizes import block_sizes

LANES = 128


def _tiled(rows: int, cols: int, dtype: np.dtype) -> int:
    """Elements of a [rows, cols] array in TPU tiles
    ((8, 128) of 32-bit words; 16-bit types two rows a word)."""
    sublanes = 8 * 4 // np.dtype(dtype).itemsize
    return -(-rows // sublanes) * sublanes * -(-cols // LANES) * LANES


def stored_transposed(shape: tuple[int, ...], dtype: Any) -> bool:
    """Whether XLA:TPU stores an array of ``shape`` with its last two dimensions swapped: where
    that pads less into its tiles (ties row-major). Tested against the compiler for shapes with a
    last or second-last dimension that is a multiple of 128 (every Kimi expert piece); for others
    XLA:TPU may move a leading dimension minor, and XLA copies the piece for the kernel."""
    rows, cols = shape[-2:]
    return _tiled(cols, rows, dtype) < _tiled(rows, cols, dtype)


def block_n(n: int, words: int) -> int:
    """Output features per step: all of them if their words fit the tuned ``block_bytes``, else the
    largest multiple of 128 dividing ``n`` that fits (the smallest if none does)."""
    most = block_sizes("int4_experts_tpu")["block_bytes"]
    if n * words * 4 <= most or n % LANES:
        return n
    fitting = [b for b in range(LANES, n + 1, LANES) if n % b == 0 and b * words * 4 <= most]
    return max(fitting, default=LANES)


def _kernel(
    ids_ref,
    x_ref,
    packed_ref,
    scale_ref,
    o_ref,
    *,
    swapped: tuple[bool, bool],  # (packed, scale) handed over [E, width, N]
    group: int,
):
    del ids_ref  # read by the index maps only
    packed_swapped, scale_swapped = swapped
    words = packed_ref[...]  # [words, bn] (swapped) or [bn, words]
    words = words if packed_swapped else words.T
    scale = scale_ref[...]  # [groups, bn] or [bn, groups]
    scale = scale if scale_swapped else scale.astype(jnp.float32).T.astype(scale.dtype)
    n_words = words.shape[0]
    n_groups = scale.shape[0]
    # Each word's scale: a 0/1 [words, groups] matrix times
    # the scales, exact on the MXU (one nonzero term each).
    word_group = jax.lax.div(
        jax.lax.broadcasted_iota(jnp.int32, (n_words, n_groups), 0), group // PER_WORD
    )
    spread = (word_group == jax.lax.broadcasted_iota(jnp.int32, (n_words, n_groups), 1)).astype(
        scale.dtype
    )
    word_scale = jnp.dot(spread, scale, preferred_element_type=jnp.float32)  # [words, bn]
    # [8, words]: row i holds inputs 8w + i, the ones nibble i of each word multiplies
    x = x_ref[...]
    # fp32 products on the MXU (bf16 ones are exact)
    precision = "highest" if x.dtype == jnp.float32 else None
    total = jnp.zeros(o_ref.shape, jnp.float32)
    for i in range(PER_WORD):
        q = ((words >> (4 * i)) & 15) - 8
        # bf16(q x scale)
        weight = (q.astype(jnp.float32) * word_scale).astype(scale.dtype).astype(x.dtype)
        total += jnp.dot(
            x[i : i + 1, :], weight, preferred_element_type=jnp.float32, precision=precision
        )
    o_ref[...] = total


def _blockings(
    packed_shape, scale_shape, swapped: tuple[bool, bool], x_dtype, scale_dtype, bn: int
):
    """The kernel's operands' blockings (x, packed, scale,
    out), index maps over (output block j, pair p, ids)."""
    words = packed_shape[-1]
    groups = scale_shape[-1]

    def piece(width: int, is_swapped: bool) -> tuple[tuple[int | None, ...], Any]:
        if is_swapped:  # handed over [E, width, N]
            return (None, width, bn), lambda j, p, ids: (ids[p], 0, j)
        return (None, bn, width), lambda j, p, ids: (ids[p], j, 0)

    x = ((None, PER_WORD, words), lambda j, p, ids: (p, 0, 0), x_dtype)
    out = ((None, 1, bn), lambda j, p, ids: (p, 0, j), np.float32)
    return [
        x,
        (*piece(words, swapped[0]), np.int32),
        (*piece(groups, swapped[1]), scale_dtype),
        out,
    ]


def declared_bytes(
    pairs: int,
    packed_shape,
    scale_shape,
    x_dtype,
    scale_dtype=jnp.bfloat16,
    swapped: tuple[bool, bool] | None = None,
) -> int:
    """The bytes the kernel declares for ``pairs`` pairs: its blocks' moves over the grid for
    the worst case of the run-time ids, as many distinct experts as can be (the ids are sorted,
    so each expert's pairs are consecutive and its blocks fetched once per output block)."""
    swapped = swapped or (
        stored_transposed(packed_shape, np.int32),
        stored_transposed(scale_shape, scale_dtype),
    )
    n_experts, n, words = packed_shape
    bn = block_n(n, words)
    blockings: list[Blocking] = _blockings(
        packed_shape, scale_shape, swapped, x_dtype, scale_dtype, bn
    )
    worst = np.sort(np.arange(pairs) % n_experts)
    return grid_bytes((n // bn, pairs), blockings, scalars=(worst,))


@functools.partial(jax.jit, static_argnames=("interpret",))
def gathered_int4_matvec_tpu(
    rows: jax.Array, packed: jax.Array, scale: jax.Array, chosen: jax.Array, interpret: Any = False
) -> jax.Array:
    """rows [P, K] through experts ``chosen`` [P] of packed [E, N, K/8] int32
    with scale [E, N, K/group] bf16: [P, N] in rows' dtype, the contract of
    ``jaxdd.runtime.cpu_kernels.gathered_int4_matvec`` (each weight bf16(q x
    scale), the products summed in fp32). ``interpret``: False to compile with
    Mosaic, or ``pltpu.InterpretParams()`` for Pallas' TPU interpreter."""
    pairs, k = rows.shape
    n_experts, n, words = packed.shape
    group = k // scale.shape[-1]
    if k != words * PER_WORD or group % PER_WORD:
        raise ValueError(f"int4 experts: {k} inputs in {words} words with groups of {group}")
    swapped = (
        stored_transposed(packed.shape, packed.dtype),
        stored_transposed(scale.shape, scale.dtype),
    )
    bn = block_n(n, words)
    # pairs in expert order: an expert's block is fetched once per run of its pairs
    order = jnp.argsort(chosen)
    # clamped as XLA's gather clamps
    ids = jnp.clip(chosen[order], 0, n_experts - 1).astype(jnp.int32)
    x = rows[order].reshape(pairs, words, PER_WORD).swapaxes(1, 2)  # [P, 8, words]
    blockings = _blockings(packed.shape, scale.shape, swapped, x.dtype, scale.dtype, bn)
    moved = declared_bytes(pairs, packed.shape, scale.shape, x.dtype, scale.dtype, swapped)
    out = pl.pallas_call(
        functools.partial(_kernel, swapped=swapped, group=group),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(n // bn, pairs),
            in_specs=[pl.BlockSpec(shape, index_map) for shape, index_map, _ in blockings[:3]],
            out_specs=pl.BlockSpec(*blockings[3][:2]),
        ),
        out_shape=jax.ShapeDtypeStruct((pairs, 1, n), jnp.float32),
        # The pairs in one sequence: split across a megacore's cores, each core's first
        # pair would fetch its expert again (past the declared bytes where experts repeat).
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        cost_estimate=pl.CostEstimate(
            flops=2 * pairs * n * k, transcendentals=0, bytes_accessed=moved
        ),
        interpret=interpret,
        name="gathered_int4_matvec_tpu",
    )(
        ids,
        x,
        *(
            # In HBM: left free, XLA:TPU prefetches every expert's scales into VMEM for the call.
            pltpu.with_memory_space_constraint(piece.swapaxes(1, 2) if swap else piece, pltpu.HBM)
            for piece, swap in zip((packed, scale), swapped, strict=True)
        ),
    )
    # back in pair order: a gather, which fuses the cast
    return out[jnp.argsort(order), 0].astype(rows.dtype)
