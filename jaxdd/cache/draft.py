"""The drafter's context cache: per layer the K/V of the target features it was given.

One buffer per layer, updated in place under donation (as ``jaxdd.cache.latent``). Heads come
before slots, as the drafter's attention matmuls read them: stored [batch, slots, kv_heads,
head_dim], XLA:CPU transposes every layer's whole cache in every round.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxdd.cache.layout import CacheView
from jaxdd.config import DrafterConfig

SLOT_AXIS = 2  # of the [batch, kv_heads, slots, head_dim] buffers


@struct.dataclass
class DraftCache:
    keys: tuple[jax.Array, ...]  # per layer [batch, kv_heads, slots, head_dim] (normed and rotated)
    values: tuple[jax.Array, ...]  # per layer [batch, kv_heads, slots, head_dim]
    length: jax.Array  # [batch] int32: context tokens cached

    @classmethod
    def zeros(cls, config: DrafterConfig, batch: int, slots: int, dtype: jnp.dtype) -> DraftCache:
        shape = (batch, config.num_key_value_heads, slots, config.head_dim)
        layers = range(config.num_hidden_layers)
        return cls(
            keys=tuple(jnp.zeros(shape, dtype) for _ in layers),
            values=tuple(jnp.zeros(shape, dtype) for _ in layers),
            length=jnp.zeros((batch,), jnp.int32),
        )

    @property
    def slots(self) -> int:
        return self.keys[0].shape[SLOT_AXIS]

    @property
    def view(self) -> CacheView:
        """Where this cache's forwards read and write."""
        return CacheView(self.length, SLOT_AXIS)

    def visible(self, block_len: jax.Array) -> jax.Array:
        """[batch, slots]: what a drafted block sees: the context and its first ``block_len``."""
        return self.view.committed(self.slots, extra=block_len)
