"""The drafter's context cache: per layer the K/V of the target features it was given.

One buffer per layer, updated in place under donation (as ``jaxdd.cache.latent``). Heads come
before slots, as the drafter's attention matmuls read them: stored [batch, slots, kv_heads,
head_dim], XLA:CPU transposes every layer's whole cache in every round. A decode state's is a
pool of pages [pages, kv_heads, page, head_dim] under the same page tables as the target's
latent pool (a request's page j holds the same positions in both), in the models' dtype or
in 8-bit floats (``DrafterKV``): the drafts read it, the target's verify does not, so greedy
tokens stay the target's and sampled ones its distribution (not the same draws for a seed).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import struct

from jaxdd.cache.layout import CacheView, Pool, bytes_per_token
from jaxdd.cache.paging import Paging
from jaxdd.config import DrafterConfig
from jaxdd.types import DrafterKV

SLOT_AXIS = 2  # of the [batch, kv_heads, slots, head_dim] buffers
KV_DTYPES = {"fp8": jnp.dtype(jnp.float8_e4m3fn)}  # e4m3: the mantissa bits K/V need most


def kv_dtype(choice: DrafterKV, dtype: jnp.dtype) -> jnp.dtype:
    """The dtype the drafter's context K/V is stored in, for models in ``dtype``."""
    if choice == "model":
        return jnp.dtype(dtype)
    if choice not in KV_DTYPES:
        raise ValueError(f"drafter_kv: expected model or one of {list(KV_DTYPES)}, got {choice!r}")
    return KV_DTYPES[choice]


def heads_as_rows(buffer: jax.Array) -> jax.Array:
    """A buffer [batch | pages, kv_heads, ...] with each KV head a row (or page) of its own,
    [batch * kv_heads | pages * kv_heads, ...], at no copy: a pool's page p of head j is then page
    ``p * kv_heads + j``, so a row's table serves its KV heads' rows (a kernel's ``fold``)."""
    return buffer.reshape(-1, *buffer.shape[2:])


@struct.dataclass
class DraftCache:
    # per layer [batch, kv_heads, slots, head_dim] (normed and rotated), or a Pool of pages
    keys: tuple[jax.Array, ...]
    values: tuple[jax.Array, ...]  # per layer, as ``keys``
    length: jax.Array  # [batch] int32: context tokens cached
    pages: jax.Array | None = None  # [batch, row_pages] int32: each row's page table (a pool)

    @classmethod
    def zeros(cls, config: DrafterConfig, batch: int, slots: int, dtype: jnp.dtype) -> DraftCache:
        """A cache of ``slots`` rows of its own per sequence."""
        shape = (batch, config.num_key_value_heads, slots, config.head_dim)
        layers = range(config.num_hidden_layers)
        return cls(
            keys=tuple(jnp.zeros(shape, dtype) for _ in layers),
            values=tuple(jnp.zeros(shape, dtype) for _ in layers),
            length=jnp.zeros((batch,), jnp.int32),
        )

    @classmethod
    def pooled(
        cls,
        config: DrafterConfig,
        batch: int,
        paging: Paging,
        dtype: jnp.dtype,
    ) -> DraftCache:
        """A pool paged as ``paging`` says (the target's pool's, whose page ids it shares) for
        ``batch`` rows, every table null."""
        shape = (paging.pool_pages, config.num_key_value_heads, paging.page, config.head_dim)
        pool = lambda: Pool(jnp.zeros(shape, dtype) for _ in range(config.num_hidden_layers))
        return cls(
            keys=pool(),
            values=pool(),
            length=jnp.zeros((batch,), jnp.int32),
            pages=jnp.asarray(paging.null_table(batch)),
        )

    @property
    def slots(self) -> int:
        """Slots per row: its buffer's, or its table's pages'."""
        if self.pages is None:
            return self.keys[0].shape[SLOT_AXIS]
        return self.pages.shape[1] * self.keys[0].shape[SLOT_AXIS]

    def token_bytes(self, bytes_of: Callable[[jax.Array], float]) -> float:
        """The bytes a token's K/V take in this cache's pool, counted by ``bytes_of``."""
        return bytes_per_token((*self.keys, *self.values), SLOT_AXIS, bytes_of)

    @property
    def view(self) -> CacheView:
        """Where this cache's forwards read and write."""
        return CacheView(self.length, self.pages, SLOT_AXIS)
