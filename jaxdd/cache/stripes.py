"""The target's latent cache striped over the devices (decode context parallelism).

Replicated, every device stores every latent row and reads all of them in every round. Striped,
the pool of pages is split over the devices, device d holding share d, and a row's page j is one
of device ``share_of(j)``'s (``jaxdd.cache.paging``), so a device's pages of a row, in table
order, hold a prefix of its share of the row's tokens (``local_length``), and the attention over
them is the one-device attention over a shorter table.

Every function here that moves rows runs per device (``shard_map``): a device writes the rows
whose pages it owns and drops the rest, so no row crosses the link but those a reader asks for.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from jaxdd.cache.layout import CacheView, locate, stored
from jaxdd.cache.paging import PAGE_TOKENS, share_holding, tokens_on
from jaxdd.runtime.sharding import AXIS
from pallas_kernels.online_softmax import merge_by_lse

PAGES = PartitionSpec(AXIS)  # a pool [pages, page, ...] split along its pages
WHOLE = PartitionSpec()


@dataclasses.dataclass(frozen=True)
class Stripes:
    """How a striped cache's pages are dealt over ``mesh``'s devices: pages of ``page`` tokens."""

    mesh: Mesh
    page: int = PAGE_TOKENS

    @property
    def devices(self) -> int:
        return self.mesh.shape[AXIS]

    def local_length(self, length: jax.Array, device: jax.Array) -> jax.Array:
        """How many of ``device``'s slots hold committed rows when ``length`` tokens are."""
        return tokens_on(length, device, self.page, self.devices)

    def local_view(self, view: CacheView, device: jax.Array, share: int) -> CacheView:
        """What ``device`` reads of ``view``'s rows: its ``local_length`` committed slots in its
        own pages (pages ``device``, ``device + devices``, ... of each table), numbered in its
        ``share`` pages."""
        batch, row_pages = view.pages.shape
        dealt = view.pages.reshape(batch, row_pages // self.devices, self.devices)
        own = jnp.take(dealt, device, axis=2) - device * share
        return CacheView(self.local_length(view.length, device), own)

    def _local_page(
        self, pages: jax.Array, positions: jax.Array, device: jax.Array, share: int
    ) -> tuple[jax.Array, jax.Array]:
        """(page in ``device``'s ``share`` pages, slot in it) of each row's ``positions``
        [batch, P]; ``share`` (past its pages, as ``locate`` puts a position outside the
        table) for a position not on its pages."""
        page, slot = locate(pages, positions, self.page, share * self.devices)
        mine = share_holding(page, share) == device
        return jnp.where(mine, page - device * share, share), slot

    def per_device(self, fn: Callable, in_specs: tuple, out_specs) -> Callable:
        """``fn`` run on every device of the mesh on its share of the operands."""
        return jax.shard_map(
            fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False
        )

    def write(
        self, pool: jax.Array, pages: jax.Array, rows: jax.Array, start: jax.Array
    ) -> jax.Array:
        """``pool`` [pages, page, ...] with ``rows`` [batch, T, ...] at positions ``start[b] ..``
        of the rows whose tables are ``pages``: each device writes those of its pages."""

        def local(pool, pages, rows, start):
            positions = start[:, None] + jnp.arange(rows.shape[1])[None, :]
            at = self._local_page(pages, positions, jax.lax.axis_index(AXIS), pool.shape[0])
            return pool.at[at].set(stored(rows, pool.dtype), mode="drop")

        return self.per_device(local, (PAGES, WHOLE, WHOLE, WHOLE), PAGES)(pool, pages, rows, start)

    def read(self, pool: jax.Array, pages: jax.Array, positions: jax.Array) -> jax.Array:
        """The rows [batch, P, ...] at ``positions`` [batch, P] of the rows whose tables are
        ``pages``, on every device (each is read where it lives and summed with the others'
        zeros, so it arrives exact)."""

        def local(pool, pages, positions):
            page, slot = self._local_page(pages, positions, jax.lax.axis_index(AXIS), pool.shape[0])
            mine = (page < pool.shape[0]).reshape(*page.shape, *(1,) * (pool.ndim - 2))
            picked = pool[jnp.minimum(page, pool.shape[0] - 1), slot]
            return jax.lax.psum(jnp.where(mine, picked, 0), AXIS)

        return self.per_device(local, (PAGES, WHOLE, WHOLE), WHOLE)(pool, pages, positions)

    def merge(self, out: jax.Array, lse: jax.Array, split_heads: bool) -> jax.Array:
        """Per device: the attention of all the devices' keys from each one's ``out`` [B, T, H,
        r] and log-sum-exp ``lse`` [B, T, H] over its own, in float32; with ``split_heads`` each
        device keeps its block of the heads (one reduce-scatter), else all of them."""
        if split_heads:
            over_devices = lambda x: jax.lax.psum_scatter(x, AXIS, scatter_dimension=2, tiled=True)
        else:
            over_devices = lambda x: jax.lax.psum(x, AXIS)
        return merge_by_lse(out, lse, lambda x: jax.lax.pmax(x, AXIS), over_devices)[0]
