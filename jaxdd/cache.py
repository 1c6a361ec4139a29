"""The target's static-shape MLA latent cache.

MLA caches one compressed row per token and layer, shared by all heads: the normed latent ``c_kv``
(kv_lora_rank values) and the rotated rope key ``k_pe`` (qk_rope_head_dim values), 576 values for Kimi instead
of 64 x (192 + 128) for a per-head cache. Shapes never change, so one compiled step serves every round;
``length`` says how many leading slots of each sequence are committed (visible to later tokens).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxdd.config import KimiConfig


@struct.dataclass
class LatentCache:
    latent: jax.Array  # [layers, batch, slots, kv_lora_rank]
    rope: jax.Array  # [layers, batch, slots, qk_rope_head_dim]
    length: jax.Array  # [batch] int32: committed slots per sequence

    @classmethod
    def zeros(cls, config: KimiConfig, batch: int, slots: int, dtype: jnp.dtype) -> LatentCache:
        layers = config.num_hidden_layers
        return cls(
            latent=jnp.zeros((layers, batch, slots, config.kv_lora_rank), dtype),
            rope=jnp.zeros((layers, batch, slots, config.qk_rope_head_dim), dtype),
            length=jnp.zeros((batch,), jnp.int32),
        )

    @property
    def batch(self) -> int:
        return self.latent.shape[1]

    @property
    def slots(self) -> int:
        return self.latent.shape[2]


def compact_rows(cache: LatentCache, start: jax.Array, rows: jax.Array) -> LatentCache:
    """Move each sequence's rows at slots start + rows[:, j] to start + j (all layers): the accepted tree path
    becomes contiguous. rows [B, P] must be increasing along j where it matters (a path's node indices are)."""

    def move(buffer: jax.Array) -> jax.Array:  # [layers, B, S, d]
        picked = jnp.take_along_axis(buffer, (start[:, None] + rows)[None, :, :, None], axis=2)
        return jax.vmap(write_rows, in_axes=(0, 0, None))(buffer, picked, start)

    return cache.replace(latent=move(cache.latent), rope=move(cache.rope))


def write_rows(buffer: jax.Array, rows: jax.Array, start: jax.Array) -> jax.Array:
    """Write rows [batch, T, d] into buffer [batch, slots, d] at slots start[b] .. start[b] + T - 1.

    Like every dynamic update in XLA this clamps out-of-range starts; callers check bounds on the host.
    """
    return jax.vmap(lambda buf, new, s: jax.lax.dynamic_update_slice_in_dim(buf, new, s, axis=0))(
        buffer, rows.astype(buffer.dtype), start
    )
