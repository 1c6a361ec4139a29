"""The target's latent cache striped over the devices (decode context parallelism).

Replicated, every device stores every latent row and reads all of them in every round. Striped,
a row's tokens are cut into pages of ``PAGE_TOKENS`` dealt round-robin over the devices: page j
of a row lives on device ``j % devices``. Each device's share of a buffer is the slot axis' own
block under a ``NamedSharding`` (device d holds slots ``d * S / devices ..``), in which its pages
sit in order, so a device's committed rows are a prefix of its block (``local_length``) and the
attention over them is the one-device attention with a shorter length.

Every function here that moves rows runs per device (``shard_map``): a device writes the rows
whose pages it owns and drops the rest, so no row crosses the link but those a reader asks for.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from jaxdd.cache.layout import CacheView
from jaxdd.runtime.sharding import AXIS

PAGE_TOKENS = 64

SLOTS = PartitionSpec(None, AXIS)  # a [batch, slots, ...] buffer split along its slots
WHOLE = PartitionSpec()


@dataclasses.dataclass(frozen=True)
class Stripes:
    """How a striped cache's rows are dealt over ``mesh``'s devices: pages of ``page`` tokens."""

    mesh: Mesh
    page: int = PAGE_TOKENS

    @property
    def devices(self) -> int:
        return self.mesh.shape[AXIS]

    @property
    def unit(self) -> int:
        """Slots come in multiples of this: one page on every device."""
        return self.page * self.devices

    def local_length(self, length: jax.Array, device: jax.Array) -> jax.Array:
        """How many of ``device``'s slots hold committed rows when ``length`` tokens are:
        its whole pages among the first ``length // page``, and the partial page if its."""
        pages, rest = jnp.divmod(length, self.page)
        whole = jnp.maximum(pages - device + self.devices - 1, 0) // self.devices
        return whole * self.page + jnp.where(pages % self.devices == device, rest, 0)

    def local_view(self, length: jax.Array, device: jax.Array) -> CacheView:
        """What ``device``'s block of a buffer holds: ``local_length`` committed slots."""
        return CacheView(self.local_length(length, device))

    def local_slot(self, positions: jax.Array, device: jax.Array, slots: int) -> jax.Array:
        """Where ``device`` keeps the rows of ``positions``: the index in its ``slots`` slots,
        or ``slots`` (out of bounds, so dropped by a write) for a position not its own."""
        page = positions // self.page
        index = (page // self.devices) * self.page + positions % self.page
        mine = (page % self.devices == device) & (positions >= 0) & (index < slots)
        return jnp.where(mine, index, slots)

    def per_device(self, fn: Callable, in_specs: tuple, out_specs) -> Callable:
        """``fn`` run on every device of the mesh on its share of the operands."""
        return jax.shard_map(
            fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False
        )

    def write(self, buffer: jax.Array, rows: jax.Array, start: jax.Array) -> jax.Array:
        """``buffer`` [batch, slots, ...] with ``rows`` [batch, T, ...] at positions
        ``start[b] ..``: each device writes those of its pages."""

        def local(buffer, rows, start):
            device = jax.lax.axis_index(AXIS)
            positions = start[:, None] + jnp.arange(rows.shape[1])[None, :]
            index = self.local_slot(positions, device, buffer.shape[1])
            batch = jnp.arange(buffer.shape[0])[:, None]
            return buffer.at[batch, index].set(rows.astype(buffer.dtype), mode="drop")

        return self.per_device(local, (SLOTS, WHOLE, WHOLE), SLOTS)(buffer, rows, start)

    def read(self, buffer: jax.Array, positions: jax.Array) -> jax.Array:
        """The rows [batch, P, ...] at ``positions`` [batch, P], on every device (each is read
        where it lives and summed with the others' zeros, so it arrives exact)."""

        def local(buffer, positions):
            index = self.local_slot(positions, jax.lax.axis_index(AXIS), buffer.shape[1])
            mine = (index < buffer.shape[1]).reshape(*index.shape, *(1,) * (buffer.ndim - 2))
            picked = jnp.take_along_axis(
                buffer, jnp.minimum(index, buffer.shape[1] - 1)[..., None], axis=1
            )
            return jax.lax.psum(jnp.where(mine, picked, 0), AXIS)

        return self.per_device(local, (SLOTS, WHOLE), WHOLE)(buffer, positions)

    def merge(self, out: jax.Array, lse: jax.Array, split_heads: bool) -> jax.Array:
        """Per device: the attention of all the devices' keys from each one's ``out`` [B, T, H,
        r] and log-sum-exp ``lse`` [B, T, H] over its own, in float32; with ``split_heads`` each
        device keeps its block of the heads (one reduce-scatter), else all of them."""
        weight = jnp.exp(lse - jax.lax.pmax(lse, AXIS))  # 0 for a device that saw nothing
        weighted = out * weight[..., None]
        if split_heads:
            total = jax.lax.psum_scatter(weight, AXIS, scatter_dimension=2, tiled=True)
            weighted = jax.lax.psum_scatter(weighted, AXIS, scatter_dimension=2, tiled=True)
        else:
            total = jax.lax.psum(weight, AXIS)
            weighted = jax.lax.psum(weighted, AXIS)
        return weighted / total[..., None]
