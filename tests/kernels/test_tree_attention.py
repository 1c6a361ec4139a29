"""The Pallas tree-attention kernel against its jnp reference (interpret mode on
CPU; a GPU twin when present), and inside the model and the DDTree decoder."""

from __future__ import annotations

import functools
import itertools
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.experimental.pallas import tpu as pltpu

from jaxdd.runtime import cpu_kernels
from jaxdd.runtime.backend import Backend
from jaxdd.testing.profiles import examples
from jaxdd.testing.reference import random_tree_parents, rel_err, tree_depths_and_mask
from pallas_kernels.block_traffic import grid_bytes
from pallas_kernels.gpu_launch import Gpu, GpuTiles
from pallas_kernels.online_softmax import NEG
from pallas_kernels.tree_attention import (
    TRITON_DEPRECATION,
    tree_attention,
    tree_attention_reference,
)
from pallas_kernels.tree_attention_tpu import (
    _cache_specs,
    declared_bytes,
    paged_tiles,
    table_groups,
    tpu_tiles,
    tree_attention_tpu,
)
from pallas_kernels.tree_operands import TreeOperands, unfold_pages
from pallas_kernels.tuned_block_sizes import kv_splits

ON_GPU = jax.default_backend() == "gpu"
# (batch, tree tokens, heads, latent, rope, cache slots); GPU lowering wants dims >= 16
SHAPES = [
    (1, 1, 2, 32, 8, 16),
    (2, 9, 4, 32, 8, 64),
    (1, 17, 2, 64, 16, 128),
    (2, 33, 1, 16, 16, 64),
]
GPU_SHAPES = [(2, 9, 4, 64, 16, 64), (1, 65, 8, 512, 64, 256)]
TOLERANCE = {"float32": 2e-5, "bfloat16": 2e-2}
TILES = GpuTiles(block_q=16, block_k=16)


def operands(args, pages: jax.Array | None = None, fold: int = 1) -> TreeOperands:
    """The kernel's operands: ``args`` in ``inputs``' order, read through ``pages``."""
    return TreeOperands(*args, pages, fold=fold)


def inputs(shape, dtype, seed):
    b, t, h, r, dr, s = shape
    rng = np.random.default_rng(seed)

    def normal(*dims):
        return jnp.asarray(rng.standard_normal(dims), dtype)

    mask = np.stack([tree_depths_and_mask(random_tree_parents(rng, t))[1] for _ in range(b)])
    length = jnp.asarray(rng.integers(0, s - t + 1, b), jnp.int32)
    args = (normal(b, t, h, r), normal(b, t, h, dr), normal(b, s, r), normal(b, s, dr), length)
    return (*args, normal(b, t, r), normal(b, t, dr), jnp.asarray(mask))


def check(shape, dtype, seed, interpret):
    args = inputs(shape, dtype, seed)
    scale = shape[3] ** -0.5
    expected = tree_attention_reference(operands(args), scale=scale)
    options = Backend("cpu" if interpret else "gpu").kernel_options()
    actual = tree_attention(operands(args), scale=scale, tiles=TILES, **options)
    np.testing.assert_allclose(
        np.asarray(actual), np.asarray(expected), atol=TOLERANCE[dtype], rtol=0
    )


@pytest.mark.slow
@settings(max_examples=examples(8), deadline=None)
@given(
    shape=st.sampled_from(SHAPES),
    dtype=st.sampled_from(["float32", "bfloat16"]),
    seed=st.integers(0, 10**6),
)
def test_kernel_interpreted_matches_reference(shape, dtype, seed):
    check(shape, dtype, seed, interpret=True)


def test_empty_prefix_and_full_prefix():
    """length 0 (only the tree) and a prefix filling every slot but the tree's."""
    for length in (0, 48):
        args = list(inputs((1, 9, 2, 32, 8, 64), "float32", 0))
        args[4] = jnp.array([length], jnp.int32)
        expected = tree_attention_reference(operands(args), scale=0.3)
        actual = tree_attention(operands(args), scale=0.3, tiles=TILES, interpret=True)
        np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), atol=2e-5)


# TPU form: caches of 3 key blocks of 128 (lengths inside a block, or 0: blocks
# skipped), of fewer slots than a block, and one of 4 blocks of 512; trees up
# to past one 128-lane chunk of the tail; batch rows of other lengths.
TPU_SHAPES = [(2, 9, 4, 64, 16, 384), (1, 17, 2, 32, 8, 64), (2, 130, 2, 64, 16, 2048)]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", TPU_SHAPES, ids=["3-blocks", "under-a-block", "tail-past-128"])
def test_tpu_form_in_the_tpu_interpreter_matches_reference(shape, dtype):
    """The Mosaic form run by Pallas' TPU interpreter (TPU semantics:
    VMEM blocks, the grid's pipeline, scalar prefetch) on random
    trees and cache lengths that are not multiples of its blocks."""
    args = inputs(shape, dtype, seed=sum(shape))
    scale = shape[3] ** -0.5
    expected = tree_attention_reference(operands(args), scale=scale)
    actual = tree_attention_tpu(operands(args), scale=scale, interpret=pltpu.InterpretParams())
    np.testing.assert_allclose(
        np.asarray(actual), np.asarray(expected), atol=TOLERANCE[dtype], rtol=0
    )


def test_tpu_form_empty_and_full_prefix():
    for length in (0, 384 - 9):
        args = list(inputs((1, 9, 2, 32, 8, 384), "float32", 1))
        args[4] = jnp.array([length], jnp.int32)
        expected = tree_attention_reference(operands(args), scale=0.3)
        actual = tree_attention_tpu(operands(args), scale=0.3, interpret=pltpu.InterpretParams())
        np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), atol=2e-5)


def without_tree(args, batch_row: int, length: int) -> list:
    """``args`` as a device that does not own the new rows sees them at ``batch_row``:
    no tree token visible, ``length`` committed rows of its own (0: nothing to see)."""
    args = list(args)
    args[4] = args[4].at[batch_row].set(length)
    args[7] = args[7].at[batch_row].set(False)
    return args


def check_lse(actual, expected, dtype) -> None:
    """``actual`` (out, lse) against the reference's ``expected``."""
    out, lse = (np.asarray(x) for x in actual)
    assert np.isfinite(out).all() and np.isfinite(lse).all()
    np.testing.assert_allclose(out, np.asarray(expected[0]), atol=TOLERANCE[dtype], rtol=0)
    # bf16 operands too: their scores are exact products summed in fp32
    tolerance = TOLERANCE["float32"]
    np.testing.assert_allclose(lse, np.asarray(expected[1]), atol=tolerance, rtol=tolerance)


@pytest.mark.slow
@settings(max_examples=examples(8), deadline=None)
@given(
    shape=st.sampled_from(SHAPES),
    dtype=st.sampled_from(["float32", "bfloat16"]),
    seed=st.integers(0, 10**6),
    tree=st.sampled_from(["owned", "elsewhere", "elsewhere-no-cache"]),
)
def test_kernel_lse_interpreted_matches_reference(shape, dtype, seed, tree):
    """with_lse: the output as without it, and each row's log-sum-exp; the first batch row's
    tree tokens on another device (its rows see the cache alone, or nothing)."""
    args = inputs(shape, dtype, seed)
    if tree != "owned":
        args = without_tree(args, 0, 0 if tree == "elsewhere-no-cache" else int(args[4][0]))
    scale = shape[3] ** -0.5
    expected = tree_attention_reference(operands(args), scale=scale, with_lse=True)
    kernel = functools.partial(tree_attention, scale=scale, tiles=TILES, interpret=True)
    actual = kernel(operands(args), with_lse=True)
    check_lse(actual, expected, dtype)
    np.testing.assert_array_equal(np.asarray(actual[0]), np.asarray(kernel(operands(args))))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", TPU_SHAPES[:2], ids=["3-blocks", "under-a-block"])
def test_tpu_form_lse_matches_reference(shape, dtype):
    """The TPU form's log-sum-exp, the last batch row's tree tokens on another device."""
    args = inputs(shape, dtype, seed=sum(shape))
    args = without_tree(args, shape[0] - 1, int(args[4][-1]) // 2)
    scale = shape[3] ** -0.5
    expected = tree_attention_reference(operands(args), scale=scale, with_lse=True)
    kernel = functools.partial(tree_attention_tpu, scale=scale, interpret=pltpu.InterpretParams())
    actual = kernel(operands(args), with_lse=True)
    check_lse(actual, expected, dtype)
    np.testing.assert_array_equal(np.asarray(actual[0]), np.asarray(kernel(operands(args))))


FORMS = {
    "reference": tree_attention_reference,
    "gpu": functools.partial(tree_attention, tiles=TILES, interpret=True),
    "tpu": functools.partial(tree_attention_tpu, interpret=pltpu.InterpretParams()),
    "cpu": cpu_kernels.tree_attention,  # C++, where a compiler builds it (``needs_build``)
}


def needs_build(form: str) -> None:
    """Skip the C++ form where no C++ compiler builds the CPU kernels."""
    if form == "cpu" and not cpu_kernels.available():
        pytest.skip("no C++ compiler builds the CPU kernels here")


@pytest.mark.parametrize("form", FORMS)
def test_rows_that_see_nothing_give_zero_and_neg(form):
    """A device with no cache rows of its own and not the tree's: out 0, lse NEG, no NaN."""
    needs_build(form)
    args = without_tree(inputs((2, 9, 2, 32, 8, 128), "float32", 2), 1, 0)
    out, lse = FORMS[form](operands(args), scale=0.3, with_lse=True)
    assert np.isfinite(np.asarray(out)).all() and np.isfinite(np.asarray(lse)).all()
    assert (np.asarray(out[1]) == 0).all() and (np.asarray(lse[1]) == NEG).all()
    assert (np.asarray(lse[0]) > NEG / 2).all()


def dealt_over_two_devices(args) -> list[list]:
    """The cache dealt row by row over two devices (row i to device i % 2): each one's share is
    a committed prefix of half the slots; the tree tokens are device 0's alone."""
    halves = []
    for device in (0, 1):
        half = list(args)
        half[2], half[3] = args[2][:, device::2], args[3][:, device::2]
        half[4] = (args[4] + 1 - device) // 2
        if device:
            half[7] = jnp.zeros_like(args[7])
        halves.append(half)
    return halves


def merge(parts) -> tuple[jax.Array, jax.Array]:
    """Partial attentions (out [B,T,H,r], lse [B,T,H]) merged exactly by their log-sum-exps."""
    lse = jnp.stack([part_lse for _, part_lse in parts])
    top = lse.max(0)
    weights = jnp.exp(lse - top)
    total = weights.sum(0)
    out = sum(w[..., None] * part_out for w, (part_out, _) in zip(weights, parts, strict=True))
    return out / total[..., None], top + jnp.log(total)


@pytest.mark.slow
@pytest.mark.parametrize("form", FORMS)
def test_halves_of_a_cache_merged_by_lse_give_the_whole(form):
    """Two devices' partial attentions over their shares of one cache, merged by
    lse, equal the attention over the whole cache: lengths 0 and 1 leave device
    1 nothing to see, an odd length gives device 0 one row more."""
    needs_build(form)
    args = list(inputs((3, 9, 2, 32, 8, 512), "float32", 3))
    args[4] = jnp.array([0, 1, 301], jnp.int32)
    whole = FORMS[form](operands(args), scale=0.3, with_lse=True)
    merged = merge(
        [
            FORMS[form](operands(half), scale=0.3, with_lse=True)
            for half in dealt_over_two_devices(args)
        ]
    )
    for got, want in zip(merged, whole, strict=True):
        assert rel_err(np.asarray(got), np.asarray(want)) < 1e-5


def test_tpu_tiles_are_lane_aligned_and_do_not_grow_with_the_cache():
    small, large = tpu_tiles(257, 64, 4096), tpu_tiles(257, 64, 131072)
    assert (
        small == large
        and large.block_k % 128 == 0
        and large.tail == 384
        and large.block_q % 32 == 0
    )
    assert tpu_tiles(9, 4, 64).block_k == 64  # a cache under one block is one block


@pytest.mark.parametrize(
    ("heads", "paging"),
    [(8, None), (8, (16, 6)), (8, (512, 3)), (64, None), (64, (16, 40)), (64, (512, 1))],
    ids=["rows", "pages", "big pages", "row blocks", "row blocks, pages", "row blocks, a page"],
)
def test_tpu_form_declares_what_its_blocks_move_with_every_slot_live(heads, paging):
    """``declared_bytes`` (the kernel's CostEstimate, which the compiled-traffic account counts)
    against the fetches of its own BlockSpecs over its grid (``block_traffic``), every slot live
    and every page distinct (the pool, passed once per part, is not read once per part), its
    cache rows in whole lane tiles."""
    b, t, h, r, dr = 2, 17, heads, 32, 16
    slots = 1024 if paging is None else paging[0] * paging[1]
    tiles = tpu_tiles(t, h, slots)
    if paging is None:
        unit, parts, steps = tiles.block_k, 1, slots // tiles.block_k
        scalars = (np.full(b, slots),)
    else:
        unit, parts = paged_tiles(paging[0])
        steps = -(-slots // unit // parts)
        scalars = (np.full(b, slots), np.arange(b * paging[1]))
    rows = lambda width, dtype: ((None, tiles.block_q, width), lambda i, j, k, *_: (i, j, 0), dtype)
    whole = lambda width: ((None, tiles.tail, width), lambda i, j, k, *_: (i, 0, 0), np.float32)
    # XLA:TPU lays each cache row out in whole tiles of 128 lanes: a block moves them all
    lanes = lambda shape: (*shape[:-1], -(-shape[-1] // 128) * 128)
    caches = [
        (lanes(spec.block_shape), spec.index_map, np.float32)
        for spec in _cache_specs((r, dr), unit, parts, paging and (*paging, 1))
    ]
    blockings = [rows(r, np.float32), rows(dr, np.float32), *caches, whole(r), whole(dr)]
    blockings += [rows(tiles.tail, np.int32), rows(r, np.float32), rows(1, np.float32)]
    moved = grid_bytes((b, tiles.row_blocks, steps), blockings, scalars)
    keys = (slots // unit, unit, parts, steps)
    assert declared_bytes(b, tiles, keys, (r, dr), (4, 4)) == moved
    assert (tiles.row_blocks > 1) == (heads == 64)


def paged_inputs(shape, dtype, seed, tree: str = "owned") -> tuple[list, jax.Array]:
    """Random operands over a pool of pages, and the page tables: each row's live pages (those
    below its length) shuffled over the pool, its other entries the shared null page 0 (random
    rows too). Lengths on a page edge (the whole table among them), mid-page, any, and one row's 0
    (even seeds) or mid-page in the last page (odd); ``tree`` not "owned": the first row's tree
    tokens on another device (nothing of the tree visible)."""
    b, t, h, r, dr, page, row_pages = shape
    rng = np.random.default_rng(seed)
    slots = row_pages * page
    edge = page * rng.integers(1, row_pages + 1, b)
    length = np.choose(
        rng.integers(0, 3, b), [edge, edge - rng.integers(1, page, b), rng.integers(0, slots, b)]
    )
    length[rng.integers(b)] = (0, slots - page // 2)[seed % 2]  # an empty row, or a mid-page end
    args = list(inputs((b, t, h, r, dr, t), dtype, seed))  # its caches replaced below
    if tree != "owned":
        args[7] = args[7].at[0].set(False)
    pool = 1 + b * row_pages
    table = rng.permutation(np.arange(1, pool)).reshape(b, row_pages)
    table[np.arange(row_pages)[None, :] * page >= length[:, None]] = 0
    args[2] = jnp.asarray(rng.standard_normal((pool, page, r)), dtype)
    args[3] = jnp.asarray(rng.standard_normal((pool, page, dr)), dtype)
    args[4] = jnp.asarray(length, jnp.int32)
    return args, jnp.asarray(table, jnp.int32)


def check_paged(kernel, shape, dtype, seed, with_lse: bool, tree: str = "owned") -> None:
    """``kernel`` over pages against the reference over pages, and that against
    the reference over the rows gathered into contiguous caches."""
    args, pages = paged_inputs(shape, dtype, seed, tree)
    scale = shape[3] ** -0.5
    expected = tree_attention_reference(operands(args, pages), scale=scale, with_lse=with_lse)
    rows = [x[pages].reshape(shape[0], -1, x.shape[-1]) for x in args[2:4]]
    contiguous = tree_attention_reference(
        operands([*args[:2], *rows, *args[4:]]), scale=scale, with_lse=with_lse
    )
    for got, want in zip(jax.tree.leaves(expected), jax.tree.leaves(contiguous), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    actual = kernel(operands(args, pages), scale=scale, with_lse=with_lse)
    if with_lse:
        check_lse(actual, expected, dtype)
    else:
        np.testing.assert_allclose(
            np.asarray(actual), np.asarray(expected), atol=TOLERANCE[dtype], rtol=0
        )


# (batch, tree tokens, heads, latent, rope, page, row pages, block_k): key blocks of a page,
# two blocks per page, block_k over the page (one block a page), a one-token tree
PAGED_SHAPES = [
    (2, 9, 4, 32, 8, 16, 5, 16),
    (3, 5, 2, 32, 8, 32, 3, 16),
    (2, 17, 2, 64, 16, 16, 4, 64),
    (1, 1, 2, 32, 8, 64, 2, 32),
]


@pytest.mark.slow
@settings(max_examples=examples(8), deadline=None)
@given(
    shape=st.sampled_from(PAGED_SHAPES),
    dtype=st.sampled_from(["float32", "bfloat16"]),
    seed=st.integers(0, 10**6),
    with_lse=st.booleans(),
    tree=st.sampled_from(["owned", "elsewhere"]),
)
def test_paged_kernel_interpreted_matches_reference(shape, dtype, seed, with_lse, tree):
    """The GPU form over pools of pages (interpreted), each key block's page read from the table."""
    *shape, block_k = shape
    kernel = functools.partial(tree_attention, tiles=GpuTiles(16, block_k), interpret=True)
    check_paged(kernel, tuple(shape), dtype, seed, with_lse, tree)


def kernel_grid(kernel, *args, **kwargs) -> tuple[int, ...]:
    """The launch grid of the one pallas_call ``kernel`` makes."""

    def grids(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                yield eqn.params["grid_mapping"].grid
            for value in eqn.params.values():
                inner = getattr(value, "jaxpr", None)
                if inner is not None:
                    yield from grids(getattr(inner, "jaxpr", inner))

    (grid,) = grids(jax.make_jaxpr(functools.partial(kernel, **kwargs))(*args).jaxpr)
    return grid


@pytest.mark.slow
@settings(max_examples=examples(12), deadline=None)
@given(
    splits=st.sampled_from([1, 2, 7, 16]),
    dtype=st.sampled_from(["float32", "bfloat16"]),
    seed=st.integers(0, 10**6),
    with_lse=st.booleans(),
    paged=st.booleans(),
    tree=st.sampled_from(["owned", "elsewhere"]),
)
def test_split_kv_interpreted_matches_reference(splits, dtype, seed, with_lse, paged, tree):
    """Split-KV: each row block's keys shared by 1, 2, 7 or 16 programs (whole pages each over
    16 pages of 16, or blocks of 16 of 256 slots), merged by log-sum-exp; the first row's length
    of 5 leaves every split but the first without a live key."""
    kernel = functools.partial(tree_attention, tiles=GpuTiles(16, 16, splits), interpret=True)
    if paged:
        check_paged(kernel, (3, 9, 2, 32, 8, 16, 16), dtype, seed, with_lse, tree)
        return
    args = inputs((3, 9, 2, 32, 8, 256), dtype, seed)
    args = without_tree(args, 0, 5) if tree != "owned" else list(args)
    args[4] = args[4].at[0].set(5)
    expected = tree_attention_reference(operands(args), scale=0.2, with_lse=with_lse)
    actual = kernel(operands(args), scale=0.2, with_lse=with_lse)
    if with_lse:
        check_lse(actual, expected, dtype)
    else:
        np.testing.assert_allclose(
            np.asarray(actual), np.asarray(expected), atol=TOLERANCE[dtype], rtol=0
        )


def test_split_kv_grid_follows_the_rule():
    """The splits the kernel launches: FlashMLA's rule on an H200 (132 SMs) and an RTX PRO 6000
    (188), at least ``min_split_keys`` slots each, whole pages each, empty splits dropped."""
    assert kv_splits(132, 9, 131072, 512) == 14  # 17 tokens x 8 heads in 9 programs of 16
    assert kv_splits(132, 33, 131072, 512) == 4  # 65 x 8
    assert kv_splits(188, 9, 131072, 512) == 20
    assert kv_splits(132, 514, 131072, 512) == 1  # 257 x 64: the rows fill the GPU
    assert kv_splits(132, 9, 4096, 512) == 8  # 4k: 512 slots each at least
    args = inputs((1, 17, 8, 32, 8, 4096), "float32", 0)
    kernel = functools.partial(tree_attention, scale=0.1, interpret=True)
    grid = kernel_grid(kernel, operands(args), tiles=TILES)
    assert grid == (1, 9, 8)
    grid = kernel_grid(kernel, operands(args), tiles=TILES, gpu=Gpu(multiprocessors=1))
    assert grid == (1, 9, 1)
    paged, pages = paged_inputs((1, 17, 8, 32, 8, 64, 5), "float32", 0)  # 5 pages: 5 splits
    grid = kernel_grid(kernel, operands(paged, pages), tiles=GpuTiles(16, 16, splits=7))
    assert grid == (1, 9, 5)


# TPU form: 8 pages of 16 per key step over a table of 10 (the last step past the table), one
# row of 3 pages of 64 (a step of 8 pages, 5 past the table), pages of 1024 read in blocks of 512
TPU_PAGED_SHAPES = [
    (2, 9, 4, 64, 16, 16, 10),
    (3, 9, 2, 32, 8, 64, 3),
    (2, 5, 2, 32, 8, 1024, 2),
]


@pytest.mark.slow
@pytest.mark.parametrize("with_lse", [False, True], ids=["out", "lse"])
@pytest.mark.parametrize(
    ("shape", "dtype"),
    list(zip(TPU_PAGED_SHAPES, ["float32", "bfloat16", "float32"], strict=True)),
    ids=["pages-of-16", "pages-of-64", "pages-of-1024"],
)
def test_tpu_paged_form_in_the_tpu_interpreter_matches_reference(shape, dtype, with_lse):
    """The Mosaic form over pools of pages, the tables scalar-prefetched, in Pallas' TPU
    interpreter: steps of several pages, steps past the table, pages split into blocks."""
    assert paged_tiles(16) == (16, 8) and paged_tiles(1024) == (512, 1)
    kernel = functools.partial(tree_attention_tpu, interpret=pltpu.InterpretParams())
    tree = "elsewhere" if with_lse else "owned"
    check_paged(kernel, shape, dtype, sum(shape) + with_lse, with_lse, tree)


@pytest.mark.slow
@pytest.mark.parametrize("fold", [1, 2])
def test_tpu_paged_form_reads_tables_past_smem_in_several_calls(fold):
    """Tables past ``smem_table_bytes`` are read by one call per group of rows (here 5 tables, 2
    per call: groups of 1, 2 and 2), giving the results of one call over them all."""
    args, pages = paged_inputs((5 * fold, 9, 2, 32, 8, 16, 3), "float32", 11)
    pages = pages[::fold]
    pool = [jnp.concatenate([x] * fold) for x in args[2:4]]  # fold x the pages the tables name
    ops = operands([*args[:2], *pool, *args[4:]], pages, fold)
    kernel = functools.partial(
        tree_attention_tpu, scale=0.2, with_lse=True, interpret=pltpu.InterpretParams()
    )
    assert table_groups(pages.shape, 2 * 3 * 4) == [(0, 1), (1, 3), (3, 5)]
    split = kernel(ops, smem_table_bytes=2 * 3 * 4)
    whole = kernel(ops)
    calls = lambda **options: str(jax.make_jaxpr(functools.partial(kernel, **options))(ops)).count(
        "pallas_call["
    )
    assert calls(smem_table_bytes=2 * 3 * 4) == 3 and calls() == 1
    for got, want in zip(split, whole, strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    expected = tree_attention_reference(ops, scale=0.2, with_lse=True)
    check_lse(split, expected, "float32")


@settings(max_examples=examples(50), deadline=None)
@given(tables=st.integers(1, 600), row_pages=st.integers(1, 5000), budget=st.integers(0, 2**21))
def test_table_groups_cover_the_tables_within_the_budget(tables, row_pages, budget):
    """Contiguous groups covering every table, as many per group as the budget holds (one at
    least), sizes within one of each other."""
    groups = table_groups((tables, row_pages), budget)
    assert groups[0][0] == 0 and groups[-1][1] == tables
    assert all(a[1] == b[0] for a, b in itertools.pairwise(groups))
    sizes = [end - start for start, end in groups]
    assert max(sizes) <= max(1, budget // (4 * row_pages)) and max(sizes) - min(sizes) <= 1
    assert min(sizes) >= 1 and len(groups) == -(-tables // max(1, budget // (4 * row_pages)))


# the paged shapes, and widths that are not whole vectors of 16 (latent 40, rope 12)
CPU_PAGED_SHAPES = [shape[:-1] for shape in PAGED_SHAPES] + [(2, 5, 3, 40, 12, 8, 4)]


@settings(max_examples=examples(8), deadline=None)
@given(
    shape=st.sampled_from(CPU_PAGED_SHAPES),
    dtype=st.sampled_from(["float32", "bfloat16"]),
    seed=st.integers(0, 10**6),
    with_lse=st.booleans(),
    tree=st.sampled_from(["owned", "elsewhere"]),
)
def test_cpu_kernel_over_pages_matches_reference(shape, dtype, seed, with_lse, tree):
    """The C++ form over pools of pages (``jaxdd.runtime.cpu_kernels``), jitted: pages of 8-64
    read in blocks of up to 64 keys, rows of every length, trees of 1-17 tokens."""
    needs_build("cpu")
    kernel = jax.jit(cpu_kernels.tree_attention, static_argnames=("scale", "with_lse"))
    check_paged(kernel, shape, dtype, seed, with_lse, tree)


def test_cpu_kernel_reads_no_slot_past_a_rows_length():
    """Every slot at or past each row's length and the null page hold NaN: the C++ form's output
    is finite and equals the reference's over the clean pools (it never reads them)."""
    needs_build("cpu")
    args, pages = paged_inputs((3, 5, 2, 32, 8, 16, 4), "float32", 11)
    expected = tree_attention_reference(operands(args, pages), scale=0.3, with_lse=True)
    slot = np.arange(4 * 16).reshape(4, 16)
    live = np.zeros(args[2].shape[:2], bool)  # [pool pages, page]: the slots below some length
    for row, length in enumerate(np.asarray(args[4])):
        for index, page in enumerate(np.asarray(pages[row])):
            live[page] |= (slot[index] < length) & (page != 0)
    poisoned = [jnp.where(live[..., None], x, jnp.nan) for x in args[2:4]]
    actual = cpu_kernels.tree_attention(
        operands([*args[:2], *poisoned, *args[4:]], pages), scale=0.3, with_lse=True
    )
    assert all(np.isfinite(np.asarray(x)).all() for x in actual)
    check_lse(actual, expected, "float32")


def test_cpu_kernel_reads_every_e4m3_value_exactly():
    """Each row sees one key of an 8-bit pool (its length 1, no tree token): its output is that
    key's latent, so the 256 bit patterns (NaN's two as 0) read as their exact values."""
    needs_build("cpu")
    bits = np.arange(256, dtype=np.uint8).reshape(16, 1, 16)
    bits[np.isin(bits, [0x7F, 0xFF])] = 0
    pool = jnp.asarray(np.concatenate([np.zeros_like(bits[:1]), bits]).view(jnp.float8_e4m3fn))
    args = list(inputs((16, 2, 2, 16, 8, 2), "float32", 0))  # its caches replaced below
    args[2], args[3] = pool, jnp.zeros((17, 1, 8), jnp.float8_e4m3fn)
    args[4] = jnp.ones((16,), jnp.int32)
    args[7] = jnp.zeros_like(args[7])
    pages = jnp.arange(1, 17, dtype=jnp.int32)[:, None]
    out = cpu_kernels.tree_attention(operands(args, pages), scale=0.3)
    expected = np.asarray(pool[1:, 0], np.float32)[:, None, None, :]
    np.testing.assert_array_equal(np.asarray(out), np.broadcast_to(expected, out.shape))


def test_cpu_kernel_refuses_pools_of_other_dtypes():
    needs_build("cpu")
    args = inputs((1, 2, 2, 16, 8, 16), "float32", 0)
    with pytest.raises(ValueError, match="a cache of one dtype"):
        rope = args[3].astype(jnp.bfloat16)
        cpu_kernels.tree_attention(operands([*args[:3], rope, *args[4:]]), scale=0.3)
    with pytest.raises(ValueError, match="a cache of one dtype"):
        half = [x.astype(jnp.float16) for x in args[2:4]]
        cpu_kernels.tree_attention(operands([*args[:2], *half, *args[4:]]), scale=0.3)


@settings(max_examples=examples(8), deadline=None)
@given(
    shape=st.sampled_from(SHAPES),
    dtype=st.sampled_from(["float32", "bfloat16"]),
    seed=st.integers(0, 10**6),
)
def test_cpu_kernel_over_rows_matches_reference(shape, dtype, seed):
    """The C++ form over each row's own buffer (one page of the whole row): out and lse."""
    needs_build("cpu")
    args = inputs(shape, dtype, seed)
    scale = shape[3] ** -0.5
    expected = tree_attention_reference(operands(args), scale=scale, with_lse=True)
    actual = cpu_kernels.tree_attention(operands(args), scale=scale, with_lse=True)
    check_lse(actual, expected, dtype)


KERNELS = {  # the Pallas forms interpreted, and the C++ one
    "gpu": functools.partial(tree_attention, tiles=TILES, interpret=True),
    "tpu": functools.partial(tree_attention_tpu, interpret=pltpu.InterpretParams()),
    "cpu": cpu_kernels.tree_attention,
}


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("form", KERNELS)
def test_a_pool_in_fp8_is_read_as_its_values_widened(form, dtype):
    """Pages stored in 8-bit floats (the drafter's K/V with ``drafter_kv="fp8"``) under fp32 or
    bf16 queries: each form widens every block it reads to the queries' dtype, so it attends
    as over the same values in that dtype (the probabilities too meet the values in it: in
    fp8 they would miss fp32's tolerance). The C++ form widens every block to fp32."""
    needs_build(form)
    kernel = KERNELS[form]
    args, pages = paged_inputs((2, 9, 4, 64, 16, 16, 10), dtype, 5)
    narrow = [x.astype(jnp.float8_e4m3fn) for x in args[2:4]]
    wide = [x.astype(dtype) for x in narrow]
    expected = tree_attention_reference(operands([*args[:2], *wide, *args[4:]], pages), scale=0.125)
    actual = kernel(operands([*args[:2], *narrow, *args[4:]], pages), scale=0.125)
    np.testing.assert_allclose(
        np.asarray(actual), np.asarray(expected), atol=TOLERANCE[dtype], rtol=0
    )


@pytest.mark.parametrize("form", KERNELS)
def test_rows_sharing_a_table_read_their_own_pages(form):
    """``fold`` rows per table (the drafter's KV heads): row b reads page p * fold + b % fold
    where table b // fold names p, as the reference over the unfolded tables."""
    needs_build(form)
    kernel = KERNELS[form]
    args, pages = paged_inputs((4, 9, 2, 32, 8, 16, 3), "float32", 7)
    pages = pages[::2]  # 2 tables of 3 pages of a pool of 13 pages x 2 rows each
    assert np.asarray(unfold_pages(pages, 2))[1, 0] == 2 * int(pages[0, 0]) + 1
    pool = [jnp.concatenate([x, x[::-1]]) for x in args[2:4]]
    pooled = [*args[:2], *pool, *args[4:]]
    expected = tree_attention_reference(operands(pooled, pages, fold=2), scale=0.2)
    actual = kernel(operands(pooled, pages, fold=2), scale=0.2)
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), atol=2e-5, rtol=0)
    with pytest.raises(ValueError, match="2 page tables, each for 3 rows, for 4 rows"):
        kernel(operands(pooled, pages, fold=3), scale=0.2)


def test_pages_must_be_pools_and_tables():
    args, pages = paged_inputs((1, 5, 2, 32, 8, 16, 2), "float32", 0)
    with pytest.raises(ValueError, match="pools of pages"):
        narrow = [*args[:3], args[3][:, :8], *args[4:]]
        tree_attention(operands(narrow, pages), scale=0.3)
    with pytest.raises(ValueError, match="page tables"):
        tree_attention_tpu(operands(args, pages[0]), scale=0.3)
    with pytest.raises(ValueError, match="1 page tables, each for 1 rows, for 2 rows"):
        tree_attention_tpu(operands(rows_twice(args), pages), scale=0.3, smem_table_bytes=0)


def rows_twice(args: list) -> list:
    """``args`` with each row's operands twice (the pools as they are)."""
    return [x if i in (2, 3) else jnp.concatenate([x, x]) for i, x in enumerate(args)]


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU; the interpreted twin above runs everywhere")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_kernel_on_gpu_matches_reference(shape, dtype):
    with jax.default_matmul_precision("highest"):
        check(shape, dtype, 0, interpret=False)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU; the interpreted twin above runs everywhere")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kernel_lse_on_gpu_matches_reference(dtype):
    """with_lse compiled for the GPU, the second batch row's rows seeing nothing."""
    shape = GPU_SHAPES[0]
    args = without_tree(inputs(shape, dtype, 0), 1, 0)
    scale = shape[3] ** -0.5
    options = Backend("gpu").kernel_options()
    with jax.default_matmul_precision("highest"):
        expected = tree_attention_reference(operands(args), scale=scale, with_lse=True)
        actual = tree_attention(operands(args), scale=scale, tiles=TILES, with_lse=True, **options)
    check_lse(actual, expected, dtype)


def test_kernel_lowers_for_gpu_at_kimi_sizes():
    """Lowered for CUDA on any machine (no GPU needed): at Kimi's
    latent sizes the kernel must go through the Triton backend; Mosaic
    GPU would stage the whole cache block in shared memory and fail."""
    b, t, h, r, dr, s = 1, 65, 8, 512, 64, 256
    shapes = [
        (b, t, h, r),
        (b, t, h, dr),
        (b, s, r),
        (b, s, dr),
        (b,),
        (b, t, r),
        (b, t, dr),
        (b, t, t),
    ]
    dtypes = [jnp.bfloat16] * 4 + [jnp.int32, jnp.bfloat16, jnp.bfloat16, jnp.bool_]
    args = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in zip(shapes, dtypes, strict=True)]
    kernel = jax.jit(
        functools.partial(tree_attention, scale=0.1, **Backend("gpu").kernel_options())
    )
    lowered = kernel.trace(operands(args)).lower(lowering_platforms=("cuda",))
    assert "xla.gpu.triton" in lowered.as_text()


def test_this_jax_lowers_the_gpu_form_through_pallas_triton():
    """The GPU form needs Pallas' Triton backend (deprecated since jax 0.11): where a jax lacks
    it, one line names the way out; where it warns, the warning is filtered (and only it)."""
    try:
        from jax.experimental.pallas import triton as pltriton

        pltriton.CompilerParams(num_warps=4)
    except (ImportError, AttributeError) as error:
        pytest.fail(
            f"jax {jax.__version__} has no Pallas Triton backend ({error}): move the GPU form "
            "to jax-triton or Mosaic GPU (docs/kernels.md, 'Past Pallas-Triton')",
            pytrace=False,
        )
    # a process that turns deprecations into errors: the kernel's module filters this one alone
    # (pytest puts its own filters first, so the check runs outside it)
    warn = "warnings.warn({!r}, DeprecationWarning)"
    for message, code in ((TRITON_DEPRECATION + " and will be removed", 0), ("another", 1)):
        script = f"import warnings, pallas_kernels.tree_attention; {warn.format(message)}"
        run = subprocess.run(
            [sys.executable, "-W", "error::DeprecationWarning", "-c", script],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert run.returncode == code, run.stderr[-500:]


@pytest.mark.slow
@pytest.mark.parametrize("models", [0], indirect=True, ids=["seed0"])
def test_ddtree_with_the_kernel_is_lossless(models):
    """The decoder verifying trees through the kernel (interpreted on CPU, compiled
    on GPU) gives the same tokens as verifying with plain XLA, and as AR."""
    from jaxdd.decoding.engine import SpeculativeDecoder

    _, _, decoder = models
    kernel = SpeculativeDecoder(decoder.target, decoder.drafter, attention="pallas")
    xla = SpeculativeDecoder(decoder.target, decoder.drafter, attention="absorbed")
    prompt = [5, 17, 3, 250, 9, 1, 77]
    kwargs = dict(method="ddtree", budget=16, max_new_tokens=12, stop_token_ids=[])
    # GPU: XLA's fp32 dots would otherwise run in TF32
    with jax.default_matmul_precision("highest"):
        tokens = kernel.generate(prompt, **kwargs).tokens
        assert tokens == xla.generate(prompt, **kwargs).tokens
        assert (
            tokens == xla.generate(prompt, method="ar", max_new_tokens=12, stop_token_ids=[]).tokens
        )


@pytest.mark.slow
@pytest.mark.parametrize("models", [0], indirect=True, ids=["seed0"])
def test_ddtree_with_the_tpu_form_is_lossless(models):
    """The decoder verifying trees through the kernel's TPU form, run by Pallas' TPU
    interpreter inside the jitted rounds, gives the tokens of verifying with plain XLA."""
    from jaxdd.decoding.engine import SpeculativeDecoder

    _, _, decoder = models
    tpu_form = Backend("cpu", interpreted_kernel="tpu")
    kernel = SpeculativeDecoder(
        decoder.target, decoder.drafter, attention="pallas", backend=tpu_form
    )
    xla = SpeculativeDecoder(decoder.target, decoder.drafter, attention="absorbed")
    prompt = [5, 17, 3, 250, 9, 1, 77]
    kwargs = dict(method="ddtree", budget=16, max_new_tokens=12, stop_token_ids=[])
    with jax.default_matmul_precision("highest"):
        assert kernel.generate(prompt, **kwargs).tokens == xla.generate(prompt, **kwargs).tokens
