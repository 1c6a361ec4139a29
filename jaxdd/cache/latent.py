"""The target's static-shape MLA latent cache.

MLA caches one compressed row per token and layer, shared by all heads: the normed
latent ``c_kv`` (kv_lora_rank values) and the rotated rope key ``k_pe``
(qk_rope_head_dim values), 576 values for Kimi instead of 64 x (192 + 128) for a
per-head cache. Shapes never change, so one compiled step serves every round; ``length``
says how many tokens of each row are committed (visible to later tokens).

A decode state's cache is a pool of pages shared by its rows, read and written through each
row's page table (``jaxdd.cache.layout``); a prompt's cache, filled once and copied into the
pool, is the prompt's own rows.

Every layer's rows are a buffer of their own (a tuple, not one stacked array): a jitted round with
the state donated then writes each layer's new rows in place. With one ``[layers, ...]`` array,
writing layer i's rows (``cache.at[i].set(...)``) while attention reads them makes XLA copy the
whole stack once per layer, a cost that grows with the context.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxdd.cache.layout import CacheView, Pool, bytes_per_token
from jaxdd.cache.paging import Paging
from jaxdd.cache.stripes import PAGES, Stripes
from jaxdd.config import KimiConfig


@struct.dataclass
class LatentCache:
    # per layer: a prompt's rows [batch, slots, kv_lora_rank], or a Pool of [pages, page, ..]
    latent: tuple[jax.Array, ...]
    rope: tuple[jax.Array, ...]  # per layer [batch, slots | (pages, page), qk_rope_head_dim]
    length: jax.Array  # [batch] int32: committed tokens per row
    pages: jax.Array | None = None  # [batch, row_pages] int32: each row's page table (a pool)
    # None: every device holds every page; else how the pages are dealt over the devices
    stripes: Stripes | None = struct.field(pytree_node=False, default=None)

    @classmethod
    def zeros(cls, config: KimiConfig, batch: int, slots: int, dtype: jnp.dtype) -> LatentCache:
        """A cache of ``slots`` rows of its own per sequence (a prompt's)."""
        layers = range(config.num_hidden_layers)
        return cls(
            latent=tuple(jnp.zeros((batch, slots, config.kv_lora_rank), dtype) for _ in layers),
            rope=tuple(jnp.zeros((batch, slots, config.qk_rope_head_dim), dtype) for _ in layers),
            length=jnp.zeros((batch,), jnp.int32),
        )

    @classmethod
    def pooled(
        cls,
        config: KimiConfig,
        batch: int,
        paging: Paging,
        dtype: jnp.dtype,
        stripes: Stripes | None = None,
    ) -> LatentCache:
        """A pool paged as ``paging`` says for ``batch`` rows, every table null; ``stripes``:
        the pages dealt over the devices (as ``paging``'s shares)."""
        shape = (paging.pool_pages, paging.page)
        pool = lambda width: Pool(
            jnp.zeros((*shape, width), dtype) for _ in range(config.num_hidden_layers)
        )
        return cls(
            latent=pool(config.kv_lora_rank),
            rope=pool(config.qk_rope_head_dim),
            length=jnp.zeros((batch,), jnp.int32),
            pages=jnp.asarray(paging.null_table(batch)),
            stripes=stripes,
        )

    @property
    def batch(self) -> int:
        return self.length.shape[0]

    @property
    def slots(self) -> int:
        """Slots per row: its buffer's, or its table's pages'."""
        if self.pages is None:
            return self.latent[0].shape[1]
        return self.pages.shape[1] * self.latent[0].shape[1]

    def token_bytes(self, bytes_of: Callable[[jax.Array], float]) -> float:
        """The bytes a token's rows take in this cache's pool, counted by ``bytes_of``."""
        return bytes_per_token((*self.latent, *self.rope), 1, bytes_of)

    def shardings(self, mesh: Mesh) -> LatentCache:
        """Where this cache lives on ``mesh``: every buffer whole on each device, or a pool
        split along its pages when striped; ``length`` and the tables on every device."""
        whole = NamedSharding(mesh, PartitionSpec())
        buffer = NamedSharding(mesh, PAGES) if self.stripes is not None else whole
        kind = type(self.latent)
        return self.replace(
            latent=kind((buffer,) * len(self.latent)),
            rope=kind((buffer,) * len(self.rope)),
            length=whole,
            pages=None if self.pages is None else whole,
        )

    @property
    def view(self) -> CacheView:
        """Where this cache's forwards read and write."""
        return CacheView(self.length, self.pages, stripes=self.stripes)

    def commit(self, count: jax.Array) -> LatentCache:
        """``count`` [batch] more tokens committed (the rows a forward wrote)."""
        return self.replace(length=self.view.commit(count).length)

    def keep_path(self, path: jax.Array) -> LatentCache:
        """The new rows ``path`` [batch, P] of each row moved to its first P new slots,
        all layers: an accepted tree path becomes what the next ``commit`` keeps."""
        move = lambda buffer: self.view.gather(buffer, path)
        kind = type(self.latent)  # a Pool of pages, or a prompt's rows
        return self.replace(latent=kind(map(move, self.latent)), rope=kind(map(move, self.rope)))

    def fill(self, prompt: LatentCache, length: jax.Array) -> LatentCache:
        """This cache's rows (empty, their pages in their tables) holding the rows of
        ``prompt``, a cache of the prompts' own padded length, with ``length`` [batch] of them
        committed (a prefill's result)."""
        start = self.view.replace(length=jnp.zeros_like(length))
        latent, rope = jax.tree.map(
            start.write, (tuple(self.latent), tuple(self.rope)), (prompt.latent, prompt.rope)
        )
        kind = type(self.latent)
        return self.replace(latent=kind(latent), rope=kind(rope), length=length)
