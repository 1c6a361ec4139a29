"""The target's static-shape MLA latent cache.

MLA caches one compressed row per token and layer, shared by all heads: the normed
latent ``c_kv`` (kv_lora_rank values) and the rotated rope key ``k_pe``
(qk_rope_head_dim values), 576 values for Kimi instead of 64 x (192 + 128) for a
per-head cache. Shapes never change, so one compiled step serves every round; ``length``
says how many tokens of each row are committed (visible to later tokens).

Every layer's rows are a buffer of their own (a tuple, not one stacked array): a jitted round with
the state donated then writes each layer's new rows in place. With one ``[layers, ...]`` array,
writing layer i's rows (``cache.at[i].set(...)``) while attention reads them makes XLA copy the
whole stack once per layer, a cost that grows with the context.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxdd.cache.layout import CacheView
from jaxdd.cache.stripes import SLOTS, Stripes
from jaxdd.config import KimiConfig


@struct.dataclass
class LatentCache:
    latent: tuple[jax.Array, ...]  # per layer [batch, slots, kv_lora_rank]
    rope: tuple[jax.Array, ...]  # per layer [batch, slots, qk_rope_head_dim]
    length: jax.Array  # [batch] int32: committed tokens per row
    # None: every device holds every row; else how the rows are dealt over the devices
    stripes: Stripes | None = struct.field(pytree_node=False, default=None)

    @classmethod
    def zeros(
        cls,
        config: KimiConfig,
        batch: int,
        slots: int,
        dtype: jnp.dtype,
        stripes: Stripes | None = None,
    ) -> LatentCache:
        if stripes is not None and slots % stripes.unit:
            raise ValueError(f"slots: a striped cache needs a multiple of {stripes.unit}: {slots}")
        layers = range(config.num_hidden_layers)
        return cls(
            latent=tuple(jnp.zeros((batch, slots, config.kv_lora_rank), dtype) for _ in layers),
            rope=tuple(jnp.zeros((batch, slots, config.qk_rope_head_dim), dtype) for _ in layers),
            length=jnp.zeros((batch,), jnp.int32),
            stripes=stripes,
        )

    @property
    def batch(self) -> int:
        return self.latent[0].shape[0]

    @property
    def slots(self) -> int:
        return self.latent[0].shape[1]

    def shardings(self, mesh: Mesh) -> LatentCache:
        """Where this cache lives on ``mesh``: every buffer whole on each device, or split
        along its slots when striped; ``length`` on every device."""
        whole = NamedSharding(mesh, PartitionSpec())
        buffer = NamedSharding(mesh, SLOTS) if self.stripes is not None else whole
        return self.replace(
            latent=(buffer,) * len(self.latent), rope=(buffer,) * len(self.rope), length=whole
        )

    @property
    def view(self) -> CacheView:
        """Where this cache's forwards read and write."""
        return CacheView(self.length, stripes=self.stripes)

    def commit(self, count: jax.Array) -> LatentCache:
        """``count`` [batch] more tokens committed (the rows a forward wrote)."""
        return self.replace(length=self.view.commit(count).length)

    def keep_path(self, path: jax.Array) -> LatentCache:
        """The new rows ``path`` [batch, P] of each row moved to its first P new slots,
        all layers: an accepted tree path becomes what the next ``commit`` keeps."""
        move = lambda buffer: self.view.gather(buffer, path)
        return self.replace(latent=tuple(map(move, self.latent)), rope=tuple(map(move, self.rope)))

    def fill(self, prompt: LatentCache, length: jax.Array) -> LatentCache:
        """This (empty) cache holding the rows of ``prompt``, a cache of the prompts' own
        padded length, with ``length`` [batch] of them committed (a prefill's result)."""
        if self.stripes is None:
            first = lambda full, rows: full.at[:, : prompt.slots].set(rows)  # a prefill starts at 0
        else:
            start = jnp.zeros_like(length)
            first = lambda full, rows: self.stripes.write(full, rows, start)
        latent, rope = jax.tree.map(first, (self.latent, self.rope), (prompt.latent, prompt.rope))
        return self.replace(latent=latent, rope=rope, length=length)
