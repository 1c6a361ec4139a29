"""The paging spec of a decode state's caches, and every rule that places a page.

A pool of ``pool_pages`` pages is split into ``devices`` equal shares (one when the cache is not
striped); share d is pages ``d * share .. (d + 1) * share - 1`` (it lives on device d, when
striped), and its first page is its null page, which no request holds. A row's table has
``row_pages`` entries, and its page j comes from share ``j % devices`` (``share_of``): so a
device's pages of a row, in table order, hold a prefix of its share of the row's tokens.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol, TypeVar

import numpy as np

from jaxdd.runtime.buckets import bucket

PAGE_TOKENS = 64
CACHE_BUCKETS_PER_OCTAVE = 4
# bucketed lengths past this are multiples of it: a page of the pools
CACHE_ALIGN = 64

Count = TypeVar("Count")  # an int, or an array of them (numpy or JAX)


class Dealing(Protocol):
    """Pages dealt over devices (``jaxdd.cache.stripes.Stripes``)."""

    @property
    def page(self) -> int: ...

    @property
    def devices(self) -> int: ...


def share_of(index: Count, devices: int) -> Count:
    """The share (device) a row's page ``index`` comes from."""
    return index % devices


def share_holding(page: Count, share: int) -> Count:
    """The share (device) holding page id ``page`` of a pool of shares of ``share`` pages."""
    return page // share


def pages_on(pages: Count, share: Count, devices: int) -> Count:
    """How many of a row's first ``pages`` pages come from ``share`` (``share_of``)."""
    return (pages - share + devices - 1) // devices


def tokens_on(length: Count, share: Count, page: int, devices: int) -> Count:
    """How many of a row's first ``length`` tokens lie in ``share``'s pages: those of its whole
    pages, and the partial page's if it is the share's."""
    pages, rest = divmod(length, page)
    return pages_on(pages, share, devices) * page + (share_of(pages, devices) == share) * rest


def pages_for(tokens: int, page: int = PAGE_TOKENS) -> int:
    """The pages that hold ``tokens`` slots."""
    return -(-tokens // page)


def pool_pages(tokens: int, page: int = PAGE_TOKENS, devices: int = 1) -> int:
    """The pages of a pool that holds ``tokens`` tokens of requests, its null pages included:
    as many on every device."""
    return (-(-pages_for(tokens, page) // devices) + 1) * devices


def cache_slots(needed: int) -> int:
    """A length bucket for ``needed`` slots, for callers whose requests' lengths vary (a batch
    of the CLI's): up to ``CACHE_ALIGN``, the next power of two; beyond, the next of four sizes
    per octave rounded up to a multiple of ``CACHE_ALIGN``. Requests of lengths in one bucket
    share a table width, hence the round's programs; powers of two throughout would double a
    8257-slot Kimi row to 16384 slots, and attention reads every slot."""
    if needed <= CACHE_ALIGN:
        return bucket(needed)
    return -(-bucket(needed, per_octave=CACHE_BUCKETS_PER_OCTAVE) // CACHE_ALIGN) * CACHE_ALIGN


def row_slots(padded_prompt: int, max_len: int, round_tokens: int, unit: int = 1) -> int:
    """Slots per row for requests of up to ``max_len`` tokens: a padded prompt's rows, or the
    longest request's plus the rows a round writes past its committed tokens before it keeps
    some (``round_tokens``: a draft block, or the tokens a verify writes), in whole ``unit``s
    (a page, on every device of a striped cache): no more, since the kernels' declared reads
    and the reference's gather cover the whole table."""
    return -(-max(padded_prompt, max_len + round_tokens) // unit) * unit


@dataclasses.dataclass(frozen=True)
class Paging:
    """How a decode state's caches are paged: rows' tables of ``row_pages`` pages of ``page``
    tokens over a pool of ``pool_pages`` pages (null pages included) in ``devices`` shares."""

    row_pages: int
    pool_pages: int
    page: int = PAGE_TOKENS
    devices: int = 1

    @classmethod
    def for_rows(
        cls,
        stripes: Dealing | None,
        rows: int,
        padded_prompt: int,
        max_len: int,
        round_tokens: int,
    ) -> Paging:
        """``rows`` rows sized by ``row_slots`` (whole pages on every device ``stripes`` deals
        them over; None: one share) and a pool that holds every row full."""
        page, devices = (PAGE_TOKENS, 1) if stripes is None else (stripes.page, stripes.devices)
        slots = row_slots(padded_prompt, max_len, round_tokens, page * devices)
        return cls(slots // page, pool_pages(rows * slots, page, devices), page, devices)

    def holding(self, tokens: int) -> Paging:
        """This paging with a pool that holds ``tokens`` tokens of requests."""
        return dataclasses.replace(self, pool_pages=pool_pages(tokens, self.page, self.devices))

    @property
    def slots(self) -> int:
        """Slots per row: its table's pages'."""
        return self.row_pages * self.page

    @property
    def share(self) -> int:
        """Pages per share (per device, striped), its null page included."""
        return self.pool_pages // self.devices

    @property
    def usable(self) -> int:
        """Pages a request can hold: the pool less its null pages."""
        return self.pool_pages - self.devices

    @property
    def tokens(self) -> int:
        """Tokens of requests the pool holds."""
        return self.tokens_in(self.pool_pages)

    def tokens_in(self, pool_pages: int) -> int:
        """Tokens of requests a pool of ``pool_pages`` pages paged so holds (not its null
        pages')."""
        return (pool_pages - self.devices) * self.page

    def null_pages(self) -> np.ndarray:
        """[devices] int32: each share's null page."""
        return (np.arange(self.devices) * self.share).astype(np.int32)

    def null_table(self, rows: int) -> np.ndarray:
        """[rows, row_pages] int32: every entry the null page of its share."""
        shares = share_of(np.arange(self.row_pages), self.devices)
        return np.tile(self.null_pages()[shares], (rows, 1))
