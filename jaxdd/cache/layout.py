"""The slot arithmetic of every cache buffer, on the device.

A row's committed tokens sit in slots ``0 .. length - 1`` of its buffers; a forward's new tokens
are written from slot ``length`` on, and only moving ``length`` commits them. Every read mask,
write, compaction and row placement of a decode state is computed here.

A buffer is either a row's own (``[batch, ..., slots, ...]``: a prompt's cache) or a pool of
pages shared by all rows (``[pages, ..., page, ...]``, the page in place of the slots), read and
written through each row's page table: slot ``s`` of row ``b`` is slot ``s % page`` of page
``pages[b, s // page]``. A table's unused entries name a null page, which absorbs the writes
past a row's pages and is never read as committed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

import jax
import jax.numpy as jnp
from flax import struct

# ``write_rows``: one in-place update per sequence up to this batch, a scatter beyond
MAX_UNROLLED_BATCH = 8

Tree = TypeVar("Tree")


class Dealt(Protocol):
    """Pages dealt over devices (``jaxdd.cache.stripes.Stripes``): they move their rows."""

    def write(
        self, pool: jax.Array, pages: jax.Array, rows: jax.Array, start: jax.Array
    ) -> jax.Array: ...

    def read(self, pool: jax.Array, pages: jax.Array, positions: jax.Array) -> jax.Array: ...


class Pool(tuple):
    """A cache's per-layer buffers of pages, shared by all rows: row placement (``front``,
    ``put_rows``) leaves them whole."""


jax.tree_util.register_pytree_node(Pool, lambda pool: (tuple(pool), None), lambda _, c: Pool(c))


@struct.dataclass
class CacheView:
    """Where a forward reads and writes each row's cache: it reads the committed
    slots (below ``length``) and writes its T new rows at ``length .. length + T - 1``.
    With ``pages`` the buffers are pools of pages read through that table (``read``); with
    ``stripes`` too the pools' pages are dealt over the devices, and only the striped attention
    reads them (``stripes.local_length``)."""

    length: jax.Array  # [batch] int32: committed tokens per row
    pages: jax.Array | None = None  # [batch, row_pages] int32: each row's page table
    axis: int = struct.field(pytree_node=False, default=1)  # the slot axis of a row's buffers
    stripes: Dealt | None = struct.field(pytree_node=False, default=None)

    def read(self, buffer: jax.Array) -> jax.Array:
        """Each row's slots [batch, ..., row_pages * page, ...] of ``buffer`` (a pool's pages
        gathered in the order of the rows' tables; a row's own buffer as it is)."""
        if self.pages is None:
            return buffer
        rows = jnp.moveaxis(buffer[self.pages], 1, self.axis)  # [batch, .., pages, page, ..]
        shape = rows.shape
        return rows.reshape(*shape[: self.axis], -1, *shape[self.axis + 2 :])

    def _page_write(self, pool: jax.Array, rows: jax.Array, start: jax.Array) -> jax.Array:
        """``pool`` with ``rows`` [batch, ..., T, ...] at positions ``start[b] ..``."""
        positions = start[:, None] + jnp.arange(rows.shape[self.axis])[None, :]
        page, slot = locate(self.pages, positions, pool.shape[self.axis], pool.shape[0])
        return pool.at[page_index(page, slot, pool.shape[1 : self.axis])].set(
            stored(rows, pool.dtype), mode="drop"
        )

    def committed(self, slots: int, extra: jax.Array | None = None) -> jax.Array:
        """[batch, slots] bool: the committed slots (and ``extra`` [batch] more after them)."""
        end = self.length if extra is None else self.length + extra
        return jnp.arange(slots)[None, :] < end[:, None]

    def mask(self, visible: jax.Array, slots: int) -> jax.Array:
        """[batch, T, slots]: the committed slots for every new token, and new
        token j's slot (``length + j``) where ``visible`` [batch, T, T] allows."""
        slot = jnp.arange(slots)[None, None, :]
        start = self.length[:, None, None]
        new_index = jnp.clip(slot - start, 0, visible.shape[-1] - 1)
        is_new = (slot >= start) & (slot < start + visible.shape[-1])
        new_visible = jnp.take_along_axis(
            visible, jnp.broadcast_to(new_index, (*visible.shape[:2], slots)), axis=-1
        )
        return (slot < start) | (is_new & new_visible)

    def write(self, buffer: jax.Array, rows: jax.Array) -> jax.Array:
        """``buffer`` with the new ``rows`` [batch, ..., T, ...] in their slots."""
        if self.stripes is not None:
            return self.stripes.write(buffer, self.pages, rows, self.length)
        if self.pages is not None:
            return self._page_write(buffer, rows, self.length)
        return write_rows(buffer, rows, self.length, self.axis)

    def gather(self, buffer: jax.Array, path: jax.Array) -> jax.Array:
        """``buffer`` with each row's new rows ``path`` [batch, P] moved to its first P new
        slots (an accepted tree path made contiguous). ``path`` must be increasing where it
        matters (a path's node indices are): row j is read before slot j is written."""
        if self.axis != 1:
            raise ValueError(f"gather: slots on axis 1 only, this view's are on {self.axis}")
        positions = self.length[:, None] + path
        if self.stripes is not None:
            picked = self.stripes.read(buffer, self.pages, positions)
            return self.stripes.write(buffer, self.pages, picked, self.length)
        if self.pages is not None:
            page, slot = locate(self.pages, positions, buffer.shape[1], buffer.shape[0])
            return self._page_write(buffer, buffer.at[page, slot].get(mode="clip"), self.length)
        picked = jnp.take_along_axis(buffer, positions[:, :, None], axis=1)
        return write_rows(buffer, picked, self.length)

    def commit(self, count: jax.Array) -> CacheView:
        """The view after ``count`` [batch] more tokens are committed."""
        return self.replace(length=self.length + count)


def locate(
    pages: jax.Array, positions: jax.Array, page: int, outside: int
) -> tuple[jax.Array, jax.Array]:
    """(page id, slot in it) of each row's ``positions`` [batch, P] through its table ``pages``
    [batch, row_pages] of pages of ``page`` slots; ``outside`` (past the pool's page ids: a
    write drops it) for a position before or past the table."""
    index = positions // page
    inside = (index >= 0) & (index < pages.shape[1])
    found = jnp.take_along_axis(pages, jnp.clip(index, 0, pages.shape[1] - 1), 1)
    return jnp.where(inside, found, outside), positions % page


def bytes_per_token(
    pools: Sequence[jax.Array], axis: int, bytes_of: Callable[[jax.Array], float]
) -> float:
    """The bytes of ``pools`` ([pages, ..., page, ...], the page on ``axis``; abstract or not)
    per token they hold, each counted by ``bytes_of`` (a device's shard of it, say)."""
    return sum(bytes_of(x) / (x.shape[0] * x.shape[axis]) for x in pools)


def page_index(page: jax.Array, slot: jax.Array, between: tuple[int, ...]) -> tuple:
    """The index of a pool [pages, *between, page, ...] whose result is laid out as a row's
    buffer [batch, *between, T, ...], for each row's pages and slots [batch, T]."""
    n = len(between)
    spread = lambda x: x.reshape(x.shape[0], *(1,) * n, x.shape[1])
    dims = [
        jnp.arange(d).reshape(1, *(d if i == j else 1 for j in range(n)), 1)
        for i, d in enumerate(between)
    ]
    return (spread(page), *dims, spread(slot))


def stored(rows: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """``rows`` in a buffer's ``dtype``; into 8-bit floats saturated at their largest value
    (e4m3 has no infinity: a value past it would store NaN)."""
    if jnp.dtype(dtype).itemsize == 1 and jnp.issubdtype(dtype, jnp.floating):
        bound = float(jnp.finfo(dtype).max)
        rows = jnp.clip(rows, -bound, bound)
    return rows.astype(dtype)


def write_rows(buffer: jax.Array, rows: jax.Array, start: jax.Array, axis: int = 1) -> jax.Array:
    """Write rows [batch, ..., T, ...] into buffer [batch, ..., slots, ...] at
    slots start[b] .. start[b] + T - 1 of ``axis`` (the slot axis of both).

    Like every dynamic update in XLA this clamps out-of-range starts; callers check bounds
    on the host. Small batches write each sequence with its own in-place update: vmapped,
    the update becomes a scatter, which XLA:CPU runs as a select over the whole buffer.
    """
    rows = stored(rows, buffer.dtype)
    if buffer.shape[0] > MAX_UNROLLED_BATCH:
        update = functools.partial(jax.lax.dynamic_update_slice_in_dim, axis=axis - 1)
        return jax.vmap(update)(buffer, rows, start)
    for b in range(buffer.shape[0]):
        corner = [0] * buffer.ndim
        corner[0] = b
        corner[axis] = start[b]
        buffer = jax.lax.dynamic_update_slice(buffer, rows[b : b + 1], tuple(corner))
    return buffer


def _per_row(fn: Callable, *trees: Tree) -> Tree:
    """``fn`` over the leaves of ``trees`` that have a row axis; a ``Pool`` is taken from the
    last tree (a part's, after it ran)."""
    pooled = lambda *leaves: leaves[-1] if isinstance(leaves[0], Pool) else fn(*leaves)
    return jax.tree.map(pooled, *trees, is_leaf=lambda x: isinstance(x, Pool))


def take_rows(batch: Tree, rows: jax.Array) -> Tree:
    """The rows ``rows`` [n] of every leaf (the pools whole)."""
    return _per_row(lambda x: x[rows], batch)


def put_rows(batch: Tree, part: Tree, rows: jax.Array) -> Tree:
    """``batch`` with rows ``rows`` [n] replaced by ``part``'s (as ``take_rows`` took them)."""
    return _per_row(lambda full, new: full.at[rows].set(new), batch, part)


def clear_rows(batch: Tree) -> Tree:
    """``batch`` with every row's leaves zero (the pools as they are)."""
    return _per_row(jnp.zeros_like, batch)


def front(batch: Tree, rows: int) -> Tree:
    """The first ``rows`` rows of every leaf (the pools whole)."""
    return _per_row(lambda x: x[:rows], batch)


def put_front(batch: Tree, part: Tree) -> Tree:
    """``batch`` with its first rows replaced by ``part``'s (as ``front`` took them)."""
    update = lambda full, new: jax.lax.dynamic_update_slice_in_dim(full, new, 0, axis=0)
    return _per_row(update, batch, part)
