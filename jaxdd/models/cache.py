"""The target's static-shape MLA latent cache.

MLA caches one compressed row per token and layer, shared by all heads: the normed
latent ``c_kv`` (kv_lora_rank values) and the rotated rope key ``k_pe``
(qk_rope_head_dim values), 576 values for Kimi instead of 64 x (192 + 128) for a
per-head cache. Shapes never change, so one compiled step serves every round; ``length``
says how many leading slots of each sequence are committed (visible to later tokens).

Every layer's rows are a buffer of their own (a tuple, not one stacked array): a jitted round with
the state donated then writes each layer's new rows in place. With one ``[layers, ...]`` array,
writing layer i's rows (``cache.at[i].set(...)``) while attention reads them makes XLA copy the
whole stack once per layer, a cost that grows with the context.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct

from jaxdd.config import KimiConfig

# ``write_rows``: one in-place update per sequence up to this batch, a scatter beyond
MAX_UNROLLED_BATCH = 8


@struct.dataclass
class LatentCache:
    latent: tuple[jax.Array, ...]  # per layer [batch, slots, kv_lora_rank]
    rope: tuple[jax.Array, ...]  # per layer [batch, slots, qk_rope_head_dim]
    length: jax.Array  # [batch] int32: committed slots per sequence

    @classmethod
    def zeros(cls, config: KimiConfig, batch: int, slots: int, dtype: jnp.dtype) -> LatentCache:
        layers = range(config.num_hidden_layers)
        return cls(
            latent=tuple(jnp.zeros((batch, slots, config.kv_lora_rank), dtype) for _ in layers),
            rope=tuple(jnp.zeros((batch, slots, config.qk_rope_head_dim), dtype) for _ in layers),
            length=jnp.zeros((batch,), jnp.int32),
        )

    @property
    def batch(self) -> int:
        return self.latent[0].shape[0]

    @property
    def slots(self) -> int:
        return self.latent[0].shape[1]


def compact_rows(cache: LatentCache, start: jax.Array, rows: jax.Array) -> LatentCache:
    """Move each sequence's rows at slots start + rows[:, j] to start + j
    (all layers): the accepted tree path becomes contiguous. rows [B, P] must
    be increasing along j where it matters (a path's node indices are)."""

    def move(buffer: jax.Array) -> jax.Array:  # [B, S, d]
        return write_rows(
            buffer, jnp.take_along_axis(buffer, (start[:, None] + rows)[:, :, None], axis=1), start
        )

    return cache.replace(latent=tuple(map(move, cache.latent)), rope=tuple(map(move, cache.rope)))


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
        corner[0], corner[axis] = b, start[b]
        buffer = jax.lax.dynamic_update_slice(buffer, rows[b : b + 1], tuple(corner))
    return buffer
