"""The tree-verify attention kernel's TPU (Mosaic) form: the GPU
form's algorithm (``tree_attention.py``) with the committed cache
streamed through a grid axis instead of read through pointers.

Mosaic stages every block in VMEM (a scoped 16-32 MiB per kernel by default), so the GPU form's
whole-cache block does not fit long caches. Here the grid is (batch, query-row blocks, key blocks):
the key axis is sequential ("arbitrary") and Pallas double-buffers its cache blocks from HBM, so the
cache is bounded by HBM, not VMEM. The running softmax state lives in VMEM scratch across key steps;
past ``length`` no block is computed, and the index map repeats the last live block so that none is
fetched either. The tree tail (ancestor-masked) runs in the last key step. Blocks are TPU-shaped:
keys in multiples of 128 lanes, the mask's key axis padded to 128, query rows in multiples of 32.

Over pools of pages (``pages``) the page tables are scalar-prefetched into SMEM beside the lengths,
as in ragged paged attention, and the cache operands' index maps read each block's page from
there: a key step takes ``per_step`` pages (each the same pool passed as its own operand, so
Pallas pipelines every page's copy), concatenated into one block of keys; pages larger than the
key block are read in sub-blocks of it. Tables past half of SMEM (256 rows of 128k slots: 2 MiB)
are read by one call per group of rows whose tables fit, each over the same pools.
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.online_softmax import NEG, log_sum_exp, online_softmax_step
from pallas_kernels.tree_attention import (
    out_shapes,
    pad_to,
    query_rows,
    row_mask,
    token_outputs,
)
from pallas_kernels.tree_operands import TreeOperands
from pallas_kernels.tuned_block_sizes import block_sizes

LANES = 128
ROW_ALIGN = 32  # sublane tiles: 8 rows of fp32, 16 of bf16; 32 suits both
MAX_PAGES_PER_STEP = 8  # each page is two more pipelined operands, double-buffered in VMEM
# v5e, v5p and v6e have 1 MiB of SMEM per core; half for the tables leaves the lengths and Mosaic's
# own scalars room
SMEM_TABLE_BYTES = 512 * 1024


class TpuTiles(NamedTuple):
    """The kernel's tiling for one call."""

    block_q: int
    block_k: int
    tail: int  # tree tokens padded to lanes
    row_blocks: int


def tpu_tiles(tokens: int, heads: int, slots: int) -> TpuTiles:
    """The tiles ``tree_attention_tpu`` uses for these
    shapes: nothing depends on the cache but its block."""
    rows = tokens * heads
    tuned = block_sizes("tree_attention_tpu")  # block_k a multiple of 128
    block_q = min(tuned["block_q"], pl.cdiv(rows, ROW_ALIGN) * ROW_ALIGN)
    steps = (tuned["block_k"], 256, LANES)
    block_k = next((k for k in steps if slots % k == 0 and k <= slots), slots)
    return TpuTiles(block_q, block_k, pl.cdiv(tokens, LANES) * LANES, pl.cdiv(rows, block_q))


class PagedTiles(NamedTuple):
    """How the paged form reads a row's pages: key steps of ``per_step`` blocks of ``unit`` slots,
    each inside one page."""

    unit: int
    per_step: int


def paged_tiles(page: int) -> PagedTiles:
    """The paged form's key blocks for pages of ``page`` slots: the tuned key block's worth of
    whole pages per step (at most ``MAX_PAGES_PER_STEP``), or sub-blocks of a larger page."""
    block_k = block_sizes("tree_attention_tpu")["block_k"]
    if page >= block_k:
        return PagedTiles(math.gcd(block_k, page), 1)
    return PagedTiles(page, max(1, min(MAX_PAGES_PER_STEP, block_k // page)))


def _kernel(
    *refs,  # scalars, inputs, outputs (with_lse: the log-sum-exp last) and the scratch
    scale,
    parts,
    scalars,
):
    length_ref = refs[0]
    q_lat_ref, q_rope_ref, *refs = refs[scalars:]
    c_refs, cr_refs = refs[:parts], refs[parts : 2 * parts]
    t_ref, tr_ref, mask_ref, o_ref, *lse_ref, acc_ref, m_ref, sum_ref = refs[2 * parts :]
    block_k = parts * c_refs[0].shape[0]
    k = pl.program_id(2)
    length = length_ref[pl.program_id(0)]

    @pl.when(k == 0)
    def _start():
        acc_ref[...] = jnp.zeros_like(acc_ref)
        m_ref[...] = jnp.full_like(m_ref, NEG)
        sum_ref[...] = jnp.zeros_like(sum_ref)

    def step(latent, rope, visible):
        carry = (acc_ref[...], m_ref[...], sum_ref[...])
        acc, m, total = online_softmax_step(
            carry, q_lat_ref[...], q_rope_ref[...], latent, rope, visible, scale
        )
        acc_ref[...] = acc
        m_ref[...] = m
        sum_ref[...] = total

    @pl.when(k * block_k < length)
    def _prefix():
        visible = (k * block_k + jax.lax.broadcasted_iota(jnp.int32, (1, block_k), 1)) < length
        if parts == 1:
            step(c_refs[0][...], cr_refs[0][...], visible)
        else:  # the step's pages in slot order: one block of keys, one lane-dense softmax step
            keys = [jnp.concatenate([ref[...] for ref in refs], 0) for refs in (c_refs, cr_refs)]
            step(*keys, visible)

    @pl.when(k == pl.num_programs(2) - 1)
    def _tail_and_output():
        for j in range(t_ref.shape[0] // LANES):  # static lane-aligned slices of the tree tokens
            keys = pl.ds(j * LANES, LANES)
            step(t_ref[keys, :], tr_ref[keys, :], mask_ref[:, keys] != 0)
        total = sum_ref[...]
        o_ref[...] = (acc_ref[...] / jnp.where(total == 0, 1.0, total)).astype(o_ref.dtype)
        if lse_ref:
            lse_ref[0][...] = log_sum_exp(m_ref[...], total)


def _cache_specs(
    widths: tuple[int, ...], unit: int, parts: int, paging: tuple[int, int, int] | None
) -> list[pl.BlockSpec]:
    """The cache operands' blocks of ``unit`` rows: one operand per width, its k-th block the
    k-th of the row's cache; or with ``paging`` (page, pages per row, rows per table)
    ``parts`` operands per width, part p of step k reading block k * parts + p of the row's
    slots from its page (``unfold_pages``'s, for tables shared by several rows)."""

    # past the committed rows, the last live block again: no new fetch
    def live_block(i, block, length_ref):
        return jnp.minimum(block, jnp.maximum(pl.cdiv(length_ref[i], unit) - 1, 0))

    if paging is None:
        index = lambda i, j, k, length_ref: (i, live_block(i, k, length_ref), 0)
        return [pl.BlockSpec((None, unit, width), index) for width in widths]
    page, row_pages, fold = paging

    def paged(width, part):
        def index(i, j, k, length_ref, pages_ref):
            slot = live_block(i, k * parts + part, length_ref) * unit
            at = jax.lax.div(slot, page)  # lax's truncating forms: slot >= 0
            row = jax.lax.div(i, fold)
            pool_page = pages_ref[row * row_pages + at] * fold + (i - row * fold)
            return pool_page, jax.lax.div(slot - at * page, unit), 0

        return pl.BlockSpec((None, unit, width), index)

    return [paged(width, part) for width in widths for part in range(parts)]


def declared_bytes(
    batch: int,
    tiles: TpuTiles,
    keys: tuple[int, int, int, int],
    widths: tuple[int, int],
    itemsizes: tuple[int, int],
) -> int:
    """What the kernel moves between HBM and VMEM over its grid when all of a row's blocks are
    live (the most: past ``length`` no new block is fetched). ``keys`` (blocks, unit, parts,
    steps): part p of key step k reads a row's block min(k * parts + p, blocks - 1) of ``unit``
    slots, fetched when it differs from the part's previous block, so once per row block, or
    once per row where it never changes. Per row block its query rows, mask and output; per row
    the tree tail. ``widths`` (r, dr); ``itemsizes`` of the queries and tail, and of the cache,
    whose pages' rows XLA:TPU pads to whole tiles of 128 lanes (a 64-wide rope row moves 128)."""
    blocks, unit, parts, steps = keys
    fetched = 0
    for part in range(parts):
        distinct = len({min(k * parts + part, blocks - 1) for k in range(steps)})
        fetched += distinct if distinct == 1 else distinct * tiles.row_blocks
    rows = batch * tiles.row_blocks * tiles.block_q
    inputs, cache = itemsizes
    width = sum(widths)
    queries = rows * (width * inputs + tiles.tail * 4)  # the mask in int32
    outputs = rows * (widths[0] + 1) * 4  # out and lse in fp32 (lse or not: a bound)
    tail = batch * tiles.tail * width * inputs
    lanes = sum(pl.cdiv(w, LANES) * LANES for w in widths)  # a page's rows in whole lane tiles
    return queries + outputs + tail + batch * fetched * unit * lanes * cache


def _cost(
    batch: int, tiles: TpuTiles, keys: tuple[int, int, int, int], widths, queries, cache
) -> pl.CostEstimate:
    """The kernel's CostEstimate: its dots and exponentials over every slot, and
    ``declared_bytes``."""
    rows = batch * tiles.row_blocks * tiles.block_q
    scores = rows * (keys[0] * keys[1] + tiles.tail)
    itemsizes = (queries.dtype.itemsize, cache.dtype.itemsize)
    return pl.CostEstimate(
        flops=2 * scores * (2 * widths[0] + widths[1]),
        transcendentals=scores,
        bytes_accessed=declared_bytes(batch, tiles, keys, widths, itemsizes),
    )


@functools.partial(
    jax.jit,
    static_argnames=("scale", "with_lse", "interpret", "vmem_limit_bytes", "smem_table_bytes"),
)
def tree_attention_tpu(
    ops: TreeOperands,
    *,
    scale: float,
    with_lse: bool = False,
    interpret: Any = False,
    vmem_limit_bytes: int | None = None,
    smem_table_bytes: int = SMEM_TABLE_BYTES,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Same arguments and results as ``tree_attention_reference``; ``interpret``: False to compile
    with Mosaic, or ``pltpu.InterpretParams()`` for Pallas' TPU interpreter (TPU semantics on any
    host). ``vmem_limit_bytes``: Mosaic's scoped VMEM limit (default: the chip's); a compile over it
    fails with the VMEM the kernel needs (``benchmarks/kernel_compiles.py`` reads it from there).
    With pages: pools of pages read through the tables (``paged_tiles``; SMEM holds them, not
    their unfolded copies), at most ``smem_table_bytes`` of them per call (``table_groups``)."""
    options = dict(
        scale=scale, interpret=interpret, vmem_limit_bytes=vmem_limit_bytes, with_lse=with_lse
    )
    if ops.pages is None:
        return _call(ops, **options)
    ops.check_pages()  # all rows, not a group's
    outputs = [
        _call(ops.rows(start, end), **options)
        for start, end in table_groups(ops.pages.shape, smem_table_bytes)
    ]
    return jax.tree.map(lambda *parts: jnp.concatenate(parts), *outputs)


def table_groups(shape: tuple[int, int], smem_table_bytes: int) -> list[tuple[int, int]]:
    """The (start, end) of each call's tables out of ``shape`` [tables, row_pages] int32: as
    many per call as ``smem_table_bytes`` holds (one at least), the groups' sizes within one."""
    tables, row_pages = shape
    calls = -(-tables // max(1, smem_table_bytes // (4 * row_pages)))
    return list(itertools.pairwise(i * tables // calls for i in range(calls + 1)))


def _call(
    ops: TreeOperands,
    *,
    scale: float,
    with_lse: bool,
    interpret: Any,
    vmem_limit_bytes: int | None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """``tree_attention_tpu`` in one kernel call: every table in SMEM."""
    (b, t, h, r), dr = ops.q_latent.shape, ops.q_rope.shape[-1]
    length, pages = ops.length.astype(jnp.int32), ops.pages
    if pages is None:
        row_slots = ops.cache_latent.shape[1]
        tiles = tpu_tiles(t, h, row_slots)
        unit, parts, steps = tiles.block_k, 1, row_slots // tiles.block_k
        scalars = (length,)
    else:
        page = ops.check_pages()
        row_slots = pages.shape[1] * page
        tiles = tpu_tiles(t, h, row_slots)
        unit, parts = paged_tiles(page)
        steps = pl.cdiv(row_slots // unit, parts)
        # keys past the table: none, as in the reference's gather; the table flat in SMEM
        scalars = (jnp.minimum(length, row_slots), pages.astype(jnp.int32).reshape(-1))
    bq = tiles.block_q
    padded_rows = tiles.row_blocks * bq

    mask = row_mask(
        ops.tail_mask, h, padded_rows, tiles.tail, jnp.int32
    )  # int32: TPU tiles of 8 rows

    def by_rows(width):
        return pl.BlockSpec((None, bq, width), lambda i, j, k, *_: (i, j, 0))

    def whole(rows_, width):
        return pl.BlockSpec((None, rows_, width), lambda i, j, k, *_: (i, 0, 0))

    paging = None if pages is None else (page, pages.shape[1], ops.fold)
    caches = _cache_specs((r, dr), unit, parts, paging)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(scalars),
        grid=(b, tiles.row_blocks, steps),
        in_specs=[
            by_rows(r),
            by_rows(dr),
            *caches,
            whole(tiles.tail, r),
            whole(tiles.tail, dr),
            by_rows(tiles.tail),
        ],
        out_specs=(by_rows(r), by_rows(1)) if with_lse else by_rows(r),
        # the running softmax: accumulator, max, sum
        scratch_shapes=[pltpu.VMEM(shape, jnp.float32) for shape in ((bq, r), (bq, 1), (bq, 1))],
    )
    result = pl.pallas_call(
        functools.partial(_kernel, scale=scale, parts=parts, scalars=len(scalars)),
        grid_spec=grid_spec,
        out_shape=out_shapes(b, padded_rows, r, with_lse),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary"),
            vmem_limit_bytes=vmem_limit_bytes,
        ),
        # what it moves, not its operands: a pool passed once per part is read once
        cost_estimate=_cost(
            b,
            tiles,
            (row_slots // unit, unit, parts, steps),
            (r, dr),
            ops.q_latent,
            ops.cache_latent,
        ),
        interpret=interpret,
        name="mla_tree_attention_tpu" if pages is None else "mla_tree_attention_tpu_paged",
    )(
        *scalars,
        query_rows(ops.q_latent, padded_rows),
        query_rows(ops.q_rope, padded_rows),
        *[ops.cache_latent] * parts,
        *[ops.cache_rope] * parts,
        pad_to(ops.tail_latent, 1, tiles.tail),
        pad_to(ops.tail_rope, 1, tiles.tail),
        mask,
    )
    return token_outputs(result, t, h, with_lse)
