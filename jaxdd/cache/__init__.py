"""Where each request's cache lives: the one place that computes it.

A decode state holds ``rows`` rows; each row holds one request's target latent rows and drafter
context K/V in slots 0, 1, ... of its own fixed-size buffers.

- ``table``: the host side. ``RowTable`` gives a request a row when it is admitted and takes it
  back when it ends; ``cache_slots`` / ``row_slots`` size every row's buffers.
- ``layout``: the device side. ``CacheView`` tells a forward where each row's committed tokens
  are (what to read) and where its new ones go (what to write); the functions beside it place a
  request's state in a row of the batch.
- ``latent`` / ``draft``: the target's MLA latent cache and the drafter's context K/V, each read
  and written through its view.

The models never compute a slot: they take a view and call it.
"""

from jaxdd.cache.draft import DraftCache
from jaxdd.cache.latent import LatentCache
from jaxdd.cache.layout import CacheView
from jaxdd.cache.table import RowTable, cache_slots, row_slots

__all__ = ["CacheView", "DraftCache", "LatentCache", "RowTable", "cache_slots", "row_slots"]
