"""The tree-verify attention's operands as one value, passed whole to every form of the kernel
(``tree_attention_reference``, the GPU and TPU forms, ``jaxdd.runtime.cpu_kernels``), and the
page-table helpers that read them."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TreeOperands:
    """The queries of a tree-verify step, the committed cache they see and the tree's own rows.

    Without ``pages`` the cache operands are rows [B, S, r | dr]; with them, pools [P, page,
    r | dr] shared by all rows, and ``pages`` [B / fold, row_pages] int32 is each row's page
    table (slot s of row b is slot s % page of page ``pages[b, s // page]``), each shared by
    ``fold`` rows (``unfold_pages``)."""

    q_latent: jax.Array  # [B, T, H, r]
    q_rope: jax.Array  # [B, T, H, dr]
    cache_latent: jax.Array  # [B, S, r] or a pool [P, page, r]
    cache_rope: jax.Array  # [B, S, dr] or a pool [P, page, dr]
    length: jax.Array  # [B]: committed slots per row
    tail_latent: jax.Array  # [B, T, r]: the tree tokens' own rows
    tail_rope: jax.Array  # [B, T, dr]
    tail_mask: jax.Array  # [B, T, T] bool: may tree token i see tree token j
    pages: jax.Array | None = None
    fold: int = dataclasses.field(default=1, metadata={"static": True})

    def replace(self, **changes: object) -> TreeOperands:
        return dataclasses.replace(self, **changes)

    def rows(self, start: int, end: int) -> TreeOperands:
        """Rows ``start * fold .. end * fold`` (tables ``start .. end``) over the same pools."""
        part = lambda x: x[start * self.fold : end * self.fold]
        return self.replace(
            q_latent=part(self.q_latent),
            q_rope=part(self.q_rope),
            length=part(self.length),
            tail_latent=part(self.tail_latent),
            tail_rope=part(self.tail_rope),
            tail_mask=part(self.tail_mask),
            pages=None if self.pages is None else self.pages[start:end],
        )

    def unfolded(self) -> TreeOperands:
        """These operands with a table per row (``fold`` 1)."""
        if self.pages is None:
            return self
        return self.replace(pages=unfold_pages(self.pages, self.fold), fold=1)

    def check_pages(self) -> int:
        """The page size of the pools, read through the tables by every query row; a ValueError
        names a mismatch."""
        latent, rope, pages = self.cache_latent, self.cache_rope, self.pages
        if latent.ndim != 3 or latent.shape[:2] != rope.shape[:2]:
            raise ValueError(
                f"pools of pages [P, page, r] and [P, page, dr] expected, got latent"
                f" {latent.shape} and rope {rope.shape}"
            )
        if pages.ndim != 2 or not jnp.issubdtype(pages.dtype, jnp.integer):
            raise ValueError(
                f"page tables [B, row_pages] int expected, got {pages.dtype}{pages.shape}"
            )
        rows = self.q_latent.shape[0]
        if pages.shape[0] * self.fold != rows:
            raise ValueError(
                f"{pages.shape[0]} page tables, each for {self.fold} rows, for {rows} rows"
            )
        return latent.shape[1]


def gather_pages(pool: jax.Array, pages: jax.Array) -> jax.Array:
    """Each row's slots [B, row_pages * page, d] of a pool [P, page, d] through its table."""
    rows = pool[pages]  # [B, row_pages, page, d]
    return rows.reshape(pages.shape[0], -1, pool.shape[-1])


def unfold_pages(pages: jax.Array, fold: int) -> jax.Array:
    """Tables [B, row_pages] shared by ``fold`` rows each -> [B * fold, row_pages]: row ``b`` reads
    page ``p * fold + b % fold`` where its table row ``b // fold`` names ``p`` (a pool of
    [P, fold, page, d] seen as [P * fold, page, d], as the drafter's KV heads are)."""
    if fold == 1:
        return pages
    folded = pages[:, None] * fold + jnp.arange(fold, dtype=pages.dtype)[None, :, None]
    return folded.reshape(-1, pages.shape[1])
