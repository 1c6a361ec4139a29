"""The slot arithmetic of every cache buffer, on the device.

A row's committed tokens sit in slots ``0 .. length - 1`` of its buffers; a forward's new tokens
are written from slot ``length`` on, and only moving ``length`` commits them. Every read mask,
write, compaction and row placement of a decode state is computed here.
"""

from __future__ import annotations

import functools
from typing import Protocol, TypeVar

import jax
import jax.numpy as jnp
from flax import struct

# ``write_rows``: one in-place update per sequence up to this batch, a scatter beyond
MAX_UNROLLED_BATCH = 8

Tree = TypeVar("Tree")


class Dealt(Protocol):
    """Rows dealt over devices (``jaxdd.cache.stripes.Stripes``): they move them."""

    def write(self, buffer: jax.Array, rows: jax.Array, start: jax.Array) -> jax.Array: ...

    def read(self, buffer: jax.Array, positions: jax.Array) -> jax.Array: ...


@struct.dataclass
class CacheView:
    """Where a forward reads and writes each row's cache: it reads the committed
    slots (below ``length``) and writes its T new rows at ``length .. length + T - 1``.
    With ``stripes`` the buffers are striped over the devices: slot ``i`` is not position ``i``,
    and only the striped attention reads them (``stripes.local_length``)."""

    length: jax.Array  # [batch] int32: committed tokens per row
    axis: int = struct.field(pytree_node=False, default=1)  # the slot axis of the buffers
    stripes: Dealt | None = struct.field(pytree_node=False, default=None)

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
            return self.stripes.write(buffer, rows, self.length)
        return write_rows(buffer, rows, self.length, self.axis)

    def gather(self, buffer: jax.Array, path: jax.Array) -> jax.Array:
        """``buffer`` with each row's new rows ``path`` [batch, P] moved to its first P new
        slots (an accepted tree path made contiguous). ``path`` must be increasing where it
        matters (a path's node indices are): row j is read before slot j is written."""
        if self.axis != 1:
            raise ValueError(f"gather: slots on axis 1 only, this view's are on {self.axis}")
        if self.stripes is not None:
            picked = self.stripes.read(buffer, self.length[:, None] + path)
            return self.stripes.write(buffer, picked, self.length)
        picked = jnp.take_along_axis(buffer, (self.length[:, None] + path)[:, :, None], axis=1)
        return write_rows(buffer, picked, self.length)

    def commit(self, count: jax.Array) -> CacheView:
        """The view after ``count`` [batch] more tokens are committed."""
        return self.replace(length=self.length + count)


def write_rows(buffer: jax.Array, rows: jax.Array, start: jax.Array, axis: int = 1) -> jax.Array:
    """Write rows [batch, ..., T, ...] into buffer [batch, ..., slots, ...] at
    slots start[b] .. start[b] + T - 1 of ``axis`` (the slot axis of both).

    Like every dynamic update in XLA this clamps out-of-range starts; callers check bounds
    on the host. Small batches write each sequence with its own in-place update: vmapped,
    the update becomes a scatter, which XLA:CPU runs as a select over the whole buffer.
    """
    rows = rows.astype(buffer.dtype)
    if buffer.shape[0] > MAX_UNROLLED_BATCH:
        update = functools.partial(jax.lax.dynamic_update_slice_in_dim, axis=axis - 1)
        return jax.vmap(update)(buffer, rows, start)
    for b in range(buffer.shape[0]):
        corner = [0] * buffer.ndim
        corner[0] = b
        corner[axis] = start[b]
        buffer = jax.lax.dynamic_update_slice(buffer, rows[b : b + 1], tuple(corner))
    return buffer


def put_row(batch: Tree, one: Tree, row: jax.Array) -> Tree:
    """``batch`` (every leaf [rows, ...]) with row ``row`` replaced by ``one``'s single row."""
    return jax.tree.map(
        lambda rows, new: jax.lax.dynamic_update_slice_in_dim(rows, new, row, axis=0), batch, one
    )


def front(batch: Tree, rows: int) -> Tree:
    """The first ``rows`` rows of every leaf."""
    return jax.tree.map(lambda x: x[:rows], batch)


def put_front(batch: Tree, part: Tree) -> Tree:
    """``batch`` with its first rows replaced by ``part``'s (as ``front`` took them)."""
    update = lambda full, new: jax.lax.dynamic_update_slice_in_dim(full, new, 0, axis=0)
    return jax.tree.map(update, batch, part)
