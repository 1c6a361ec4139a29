"""Absorbed-MLA tree-verify attention as a Pallas kernel, with its pure-jnp reference.

In absorbed MLA every head attends over the same per-token rows: a latent (kv_lora_rank, 512
for Kimi) that is both key and value, and a rotated rope key (64). A tree-verify step has T
new tokens (the root and the tree nodes) that see every committed prefix row (slots < length)
and, among themselves, only their ancestors. So the kernel flattens (token, head) into query
rows, runs an online softmax over the prefix in blocks (no mask but the length), then over the
tree tail with the ancestor mask, and writes the latent-space output; the caller applies the
value up-projection. The latent and rope operands stay apart (two dots), never concatenated.

With ``pages`` every form reads the committed rows from pools of pages instead: the cache operands
are pools [pages, page, r | dr] shared by all rows and ``pages`` [B, row_pages] int32 is each
row's page table (slot s of row b is slot s % page of page ``pages[b, s // page]``); the kernels
read each key block through the table (a block never spans two pages), so no row is gathered
into a contiguous copy first, and no slot at or past ``length`` is ever read but in the last
live block's page.

With ``with_lse`` every form also returns each query row's log-sum-exp, so that attentions over
disjoint shares of the cache (each device's share a committed prefix of its own) merge exactly;
a row that sees no key (no share and no tree token) then gives out 0 and lse ``NEG``.

The caller passes the backend's choices (``jaxdd.runtime.backend.Backend.kernel_options``):
``interpret=True`` on CPU; Triton compiler parameters on GPU (block sizes are powers of two,
as Triton needs). TPUs get the form in ``tree_attention_tpu.py`` (the same online-softmax
step, the cache streamed through VMEM). Where a batch's row blocks leave a GPU's
multiprocessors idle, split-KV shares each row block's keys among several programs and merges
their partial outputs by log-sum-exp (``launch``, ``merge_splits``).

Pallas' Triton backend is deprecated since jax 0.11 (warned at every lowering; filtered here by
its text, ``TRITON_DEPRECATION``); docs/kernels.md says where this form goes when jax drops it.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.gpu_launch import (
    FALLBACK_GPU,
    TUNED_TILES,
    Gpu,
    GpuTiles,
    Launch,
    launch,
    pow2,
)
from pallas_kernels.online_softmax import NEG, log_sum_exp, merge_splits, online_softmax_step
from pallas_kernels.tree_operands import TreeOperands, gather_pages

# jax >= 0.11 warns at each Triton lowering; the form has no other GPU backend to go to yet
# (Mosaic GPU: no scalar prefetch, sm_120 unchecked; docs/kernels.md)
TRITON_DEPRECATION = "The Pallas Triton backend is deprecated"
warnings.filterwarnings("ignore", message=TRITON_DEPRECATION, category=DeprecationWarning)


def tree_attention_reference(
    ops: TreeOperands, *, scale: float, with_lse: bool = False
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Plain jnp over ``ops`` (with pages: the pools gathered here first). Returns the attention
    output in latent space [B,T,H,r] (fp32); ``with_lse``: ``(out, lse)``, lse [B,T,H] fp32 the
    natural log of the sum of exp(scale * score) over the visible keys. A row that sees no key
    (``with_lse`` only) gives out 0 and lse ``NEG``."""
    f32 = jnp.float32
    ops = ops.unfolded()
    cache_latent, cache_rope = ops.cache_latent, ops.cache_rope
    if ops.pages is not None:
        cache_latent, cache_rope = (gather_pages(c, ops.pages) for c in (cache_latent, cache_rope))
    keys_latent = jnp.concatenate([cache_latent, ops.tail_latent], axis=1).astype(f32)
    keys_rope = jnp.concatenate([cache_rope, ops.tail_rope], axis=1).astype(f32)
    scores = jnp.einsum("bthr,bsr->bhts", ops.q_latent.astype(f32), keys_latent)
    scores += jnp.einsum("bthd,bsd->bhts", ops.q_rope.astype(f32), keys_rope)
    prefix = jnp.arange(cache_latent.shape[1])[None, None, :] < ops.length[:, None, None]
    tail_mask = ops.tail_mask
    mask = jnp.concatenate(
        [jnp.broadcast_to(prefix, tail_mask.shape[:2] + prefix.shape[-1:]), tail_mask], -1
    )
    logits = jnp.where(mask[:, None], scores * scale, -jnp.inf)
    probs = jax.nn.softmax(logits, axis=-1)
    if not with_lse:
        return jnp.einsum("bhts,bsr->bthr", probs, keys_latent)
    seen = mask.any(-1)[:, None]  # [B,1,T]
    probs = jnp.where(seen[..., None], probs, 0.0)  # a row that sees nothing: 0/0 in softmax
    lse = jnp.where(seen, jax.nn.logsumexp(logits, axis=-1), NEG)
    return jnp.einsum("bhts,bsr->bthr", probs, keys_latent), lse.transpose(0, 2, 1)


def _kernel(
    length_ref,
    *refs,  # paged: the row's page table first; with_lse: the log-sum-exp's output last
    scale: float,
    chosen: Launch,
    tail_k: int,
    paged: bool,
):
    if paged:
        pages_ref, *refs = refs
    q_lat_ref, q_rope_ref, c_ref, cr_ref, t_ref, tr_ref, mask_ref, o_ref, *lse_ref = refs
    q_lat = q_lat_ref[...]  # [bq, r]
    q_rope = q_rope_ref[...]  # [bq, dr]
    rows = q_lat.shape[0]
    update = functools.partial(online_softmax_step, q_lat=q_lat, q_rope=q_rope, scale=scale)
    block_k, splits, split_blocks = chosen.block_k, chosen.splits, chosen.split_blocks
    length = length_ref[0]
    blocks = pl.cdiv(length, block_k)

    def cache_block(i):
        """Key block i's (latent, rope): a slice of the row, or of a page through the table."""
        if not paged:
            block = pl.ds(i * block_k, block_k)
            return c_ref[block, :], cr_ref[block, :]
        page = c_ref.shape[1]
        slot = i * block_k
        # lax's truncating div and rem: jnp's floor forms do not lower to Triton (slot >= 0)
        at = (pages_ref[jax.lax.div(slot, page)], pl.ds(jax.lax.rem(slot, page), block_k))
        where = (*at, slice(None))
        return c_ref[where], cr_ref[where]

    if paged:  # a length past the table must not walk past it
        blocks = jnp.minimum(blocks, pages_ref.shape[0] * c_ref.shape[1] // block_k)

    def prefix_block(i, carry):
        visible = (i * block_k + jax.lax.broadcasted_iota(jnp.int32, (1, block_k), 1)) < length
        latent, rope = cache_block(i)
        return update(carry, latent=latent, rope=rope, visible=visible)

    init = (
        jnp.zeros((rows, q_lat.shape[1]), jnp.float32),
        jnp.full((rows, 1), NEG, jnp.float32),
        jnp.zeros((rows, 1), jnp.float32),
    )

    # the tree tokens, in blocks too: a whole 256-token tail would not fit on chip
    def tail_block(j, carry):
        block = pl.ds(j * tail_k, tail_k)
        return update(
            carry, latent=t_ref[block, :], rope=tr_ref[block, :], visible=mask_ref[:, block] != 0
        )

    # split-KV: program (.., .., s) takes key blocks [s, s + 1) x split_blocks, the last split
    # the tree tail too; a split past the row's length sees the tail or nothing
    split = pl.program_id(2)
    first = split * split_blocks
    live = jnp.maximum(jnp.minimum(split_blocks, blocks - first), 0)
    # counted from 0: Triton's loop wants its bounds of one type, and a constant start is one
    carry = jax.lax.fori_loop(0, live, lambda i, c: prefix_block(first + i, c), init)
    tail_blocks = (split == splits - 1).astype(jnp.int32) * (t_ref.shape[0] // tail_k)
    acc, m, total = jax.lax.fori_loop(0, tail_blocks, tail_block, carry)
    o_ref[...] = (acc / jnp.where(total == 0, 1.0, total)).astype(o_ref.dtype)
    if lse_ref:
        lse_ref[0][...] = log_sum_exp(m, total)


def pad_to(x: jax.Array, axis: int, size: int) -> jax.Array:
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad)


def query_rows(x: jax.Array, padded_rows: int) -> jax.Array:
    """[B, T, H, d] -> [B, padded_rows, d]: one query
    row per (token, head), token-major, zero-padded."""
    b, t, h, d = x.shape
    return pad_to(x.reshape(b, t * h, d), 1, padded_rows)


def token_rows(x: jax.Array, tokens: int, heads: int) -> jax.Array:
    """``query_rows`` undone: [B, padded_rows, d] -> [B, T, H, d]."""
    return x[:, : tokens * heads].reshape(x.shape[0], tokens, heads, x.shape[-1])


def row_mask(tail_mask: jax.Array, heads: int, padded_rows: int, tail: int, dtype) -> jax.Array:
    """[B, T, T] bool -> [B, padded_rows, tail]: row
    t*H + h sees what token t sees; padding sees nothing."""
    mask = jnp.repeat(tail_mask, heads, axis=1).astype(dtype)
    return pad_to(pad_to(mask, 1, padded_rows), 2, tail)


def out_shapes(b: int, padded_rows: int, r: int, with_lse: bool) -> Any:
    """The kernel's outputs by query row: out [B, rows, r] (and lse [B, rows, 1]), float32."""
    out = jax.ShapeDtypeStruct((b, padded_rows, r), jnp.float32)
    return (out, jax.ShapeDtypeStruct((b, padded_rows, 1), jnp.float32)) if with_lse else out


def merged_splits(result: Any, splits: int, with_lse: bool) -> Any:
    """The GPU form's outputs by split (out [B, splits, rows, r], lse [B, splits, rows, 1])
    as ``out_shapes``: one split's as they are, more merged by their log-sum-exps."""
    if splits == 1:
        return tuple(x[:, 0] for x in result) if with_lse else result[:, 0]
    out, lse = merge_splits(result[0], result[1][..., 0], axis=1)
    return (out, lse[..., None]) if with_lse else out


def token_outputs(result: Any, t: int, h: int, with_lse: bool) -> Any:
    """``out_shapes``' rows back by token and head: out [B, T, H, r] (and lse [B, T, H])."""
    if not with_lse:
        return token_rows(result, t, h)
    out, lse = result
    return token_rows(out, t, h), token_rows(lse, t, h)[..., 0]


def _full(shape: tuple[int, ...]) -> pl.BlockSpec:
    """A row's whole operand in every program."""
    return pl.BlockSpec((None, *shape), lambda i, j, s: (i, *(0,) * len(shape)))


def _by_rows(block_q: int, width: int) -> pl.BlockSpec:
    """A program's block of query rows of an operand [B, rows, width]."""
    return pl.BlockSpec((None, block_q, width), lambda i, j, s: (i, j, 0))


def _split_outputs(b: int, chosen: Launch, r: int, with_lse: bool) -> tuple[Any, Any]:
    """(out_shape, out_specs): ``out_shapes`` by split, [B, splits, rows, r | 1]."""
    shapes = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((b, chosen.splits, *x.shape[1:]), x.dtype),
        out_shapes(b, chosen.padded_rows, r, with_lse),
    )
    spec = lambda width: pl.BlockSpec(
        (None, None, chosen.block_q, width), lambda i, j, s: (i, s, j, 0)
    )
    return shapes, (spec(r), spec(1)) if with_lse else spec(r)


def _cache_spec(cache_latent: jax.Array, paged: bool) -> Callable[[int], pl.BlockSpec]:
    """The cache operands' BlockSpec by width: a row's whole cache, or the whole pools."""
    if not paged:
        return lambda width: _full((cache_latent.shape[1], width))
    pool, page = cache_latent.shape[:2]
    return lambda width: pl.BlockSpec((pool, page, width), lambda i, j, s: (0, 0, 0))


@functools.partial(
    jax.jit, static_argnames=("scale", "with_lse", "tiles", "gpu", "interpret", "compiler_params")
)
def tree_attention(
    ops: TreeOperands,
    *,
    scale: float,
    with_lse: bool = False,
    tiles: GpuTiles = TUNED_TILES,
    gpu: Gpu = FALLBACK_GPU,
    interpret: bool = False,
    compiler_params: Any = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """The Pallas kernel; same arguments and results as ``tree_attention_reference``; ``interpret``
    and ``compiler_params`` as the backend chooses (``Backend.kernel_options``). Query rows (token
    x head) and keys in the ``tiles`` given, each row block's keys shared by ``tiles.splits``
    programs (split-KV, merged by log-sum-exp); what is None comes from ``launch`` for ``gpu``.
    With pages each key block's page is read from the row's table."""
    b, t, h, r = ops.q_latent.shape
    if ops.pages is not None:
        ops.check_pages()
    ops = ops.unfolded()
    cache_latent, pages = ops.cache_latent, ops.pages
    dr = ops.q_rope.shape[-1]
    paged = pages is not None
    page = cache_latent.shape[1] if paged else None
    slots = pages.shape[1] * page if paged else cache_latent.shape[1]
    computed = max(ops.q_latent.dtype, cache_latent.dtype, key=lambda d: d.itemsize)
    chosen = launch(b, t * h, slots, page, computed, tiles, gpu)
    cache_spec = _cache_spec(cache_latent, paged)
    tail = pow2(t)  # pad the tail to a power of two; padded keys are masked out
    mask = row_mask(ops.tail_mask, h, chosen.padded_rows, tail, jnp.int8)

    by_rows = functools.partial(_by_rows, chosen.block_q)
    out_shape, out_specs = _split_outputs(b, chosen, r, with_lse or chosen.splits > 1)
    table = [_full((pages.shape[1],))] if paged else []
    tail_k = min(chosen.block_k, tail)
    kernel = functools.partial(_kernel, scale=scale, chosen=chosen, tail_k=tail_k, paged=paged)
    result = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=chosen.grid(b),
        in_specs=[
            _full((1,)),
            *table,
            by_rows(r),
            by_rows(dr),
            cache_spec(r),
            cache_spec(dr),
            _full((tail, r)),
            _full((tail, dr)),
            by_rows(tail),
        ],
        out_specs=out_specs,
        interpret=interpret,
        compiler_params=compiler_params,
        name="mla_tree_attention_paged" if paged else "mla_tree_attention",
    )(
        ops.length.astype(jnp.int32)[:, None],
        *([pages.astype(jnp.int32)] if paged else []),
        query_rows(ops.q_latent, chosen.padded_rows),
        query_rows(ops.q_rope, chosen.padded_rows),
        cache_latent,
        ops.cache_rope,
        pad_to(ops.tail_latent, 1, tail),
        pad_to(ops.tail_rope, 1, tail),
        mask,
    )
    return token_outputs(merged_splits(result, chosen.splits, with_lse), t, h, with_lse)
