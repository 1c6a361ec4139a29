"""Where each request's cache lives: the one place that computes it.

A decode state's target latent cache and drafter context K/V are pools of pages shared by its
rows; a row reads and writes its slots 0, 1, ... through its page table (slot s: page
``table[s // page]``), holding the pages its request can reach from admission to its end.

- ``paging``: the paging spec (``Paging``: pages per row, the pool, its shares and null pages),
  sized by ``cache_slots`` / ``row_slots``, and every rule that places a page.
- ``table`` / ``pages``: the host side. ``RowTable`` gives a request a row when it is admitted
  and takes it back when it ends; ``PageTable`` gives the row its pages (admission waits for
  them) and takes them back, keeping those ``prefix`` indexes (``NoPrefix``: none).
- ``layout``: the device side. ``CacheView`` tells a forward where each row's committed tokens
  are (what to read) and where its new ones go (what to write), through the page tables; the
  functions beside it place a request's state in a row of the batch.
- ``latent`` / ``draft``: the target's MLA latent cache and the drafter's context K/V, each read
  and written through its view; ``stripes``: the latent pages dealt over the devices.

The models never compute a slot: they take a view and call it.
"""

from jaxdd.cache.draft import DraftCache
from jaxdd.cache.latent import LatentCache
from jaxdd.cache.layout import CacheView
from jaxdd.cache.paging import Paging, cache_slots, row_slots
from jaxdd.cache.table import RowTable

__all__ = [
    "CacheView",
    "DraftCache",
    "LatentCache",
    "Paging",
    "RowTable",
    "cache_slots",
    "row_slots",
]
